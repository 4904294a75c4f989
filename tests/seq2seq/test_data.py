"""Corpus loading, normalisation, splitting, vocabularies and batching, on files the tests write."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from seq2seq_fast.seq2seq.data.batching import epoch_batches, make_batch
from seq2seq_fast.seq2seq.data.corpus import TranslationData, read_parallel_corpus
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.normalize import normalize_text
from seq2seq_fast.seq2seq.data.split import split_by_source
from seq2seq_fast.seq2seq.data.tasks import ReverseTask, Task, TranslationTask
from seq2seq_fast.seq2seq.data.vocab import SentencePieceVocab, SymbolVocab, vocab_from_state
from seq2seq_fast.seq2seq.models import BOS_ID, EOS_ID, PAD_ID, UNK_ID

GOOD = "Go.\tVa !\nHi.\tSalut !\tCC-BY 2.0 (France) Attribution: tatoeba.org\n"


def _write(tmp_path, name: str, data: bytes | str):
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_good_lines_and_extra_columns(tmp_path):
    pairs, report = read_parallel_corpus(_write(tmp_path, "c.txt", GOOD))
    assert pairs == [("Go.", "Va !"), ("Hi.", "Salut !")]
    assert report.lines == 2 and report.pairs == 2 and not report.malformed


def test_malformed_lines_are_counted_with_line_numbers(tmp_path):
    text = "a\tb\nno tab here\n\n   \tx\nc\td\n"
    pairs, report = read_parallel_corpus(_write(tmp_path, "c.tsv", text))
    assert pairs == [("a", "b"), ("c", "d")]
    assert [n for n, _ in report.malformed] == [2, 3, 4]
    assert "line 2" in report.summary() and "3 malformed" in report.summary()


def test_bad_encoding_is_a_malformed_line(tmp_path):
    data = b"good\tbon\n\xff\xfe broken\tcasse\nyes\toui\n"
    pairs, report = read_parallel_corpus(_write(tmp_path, "c.txt", data))
    assert pairs == [("good", "bon"), ("yes", "oui")]
    assert report.malformed[0][0] == 2 and "UTF-8" in report.malformed[0][1]


def test_latin1_file_is_reported_not_crashing(tmp_path):
    path = _write(tmp_path, "c.txt", "café\tcoffee\n".encode("latin-1"))
    with pytest.raises(CorpusError, match="no usable sentence pairs.*UTF-8"):
        read_parallel_corpus(path)


@pytest.mark.parametrize("content", ["", "\n\n", "only one column\n"])
def test_no_pairs_is_a_clear_error(tmp_path, content):
    with pytest.raises(CorpusError, match="no usable sentence pairs"):
        read_parallel_corpus(_write(tmp_path, "c.txt", content))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        read_parallel_corpus(tmp_path / "absent.txt")
    with pytest.raises(CorpusError, match="directory"):
        read_parallel_corpus(tmp_path)


def test_zip_picks_the_corpus_member(tmp_path):
    path = tmp_path / "corpus.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("_about.txt", "about this corpus, no tabs at all, quite long " * 20)
        archive.writestr("fra.txt", GOOD)
    pairs, report = read_parallel_corpus(path)
    assert pairs == [("Go.", "Va !"), ("Hi.", "Salut !")]
    assert report.path.endswith("corpus.zip:fra.txt")


def test_zip_without_text_member_and_broken_zip(tmp_path):
    path = tmp_path / "empty.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data.bin", b"\x00\x01")
    with pytest.raises(CorpusError, match="no .txt or .tsv"):
        read_parallel_corpus(path)
    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as archive:
        archive.writestr("fra.txt", GOOD * 50)
    truncated = _write(tmp_path, "bad.zip", good.read_bytes()[:-30])
    with pytest.raises(CorpusError):
        read_parallel_corpus(truncated)


def test_normalisation_of_narrow_no_break_spaces():
    assert normalize_text("Va\u202f!  Et\u00a0toi\u202f?") == "Va ! Et toi ?"
    assert normalize_text("ﬁn", "NFKC") == "fin"
    assert normalize_text("e\u0301", "NFC") == "é"


def test_direction_and_length_filter(tmp_path):
    text = "one two three\tun deux trois\nshort\tcourt\n"
    pairs, report = read_parallel_corpus(_write(tmp_path, "c.txt", text), swap=True, max_words=2)
    assert pairs == [("court", "short")]
    assert report.too_long == 1


def test_split_is_fixed_and_keeps_sources_apart():
    pairs = [(f"s{i % 40}", f"t{i}") for i in range(200)]
    first = split_by_source(pairs, 0.1, 0.1, seed=3)
    assert first == split_by_source(pairs, 0.1, 0.1, seed=3)
    assert first != split_by_source(pairs, 0.1, 0.1, seed=4)
    train, valid, test = first
    assert len(train) + len(valid) + len(test) == 200
    sources = [{s for s, _ in part} for part in first]
    assert not (sources[0] & sources[1]) and not (sources[0] & sources[2])
    assert not (sources[1] & sources[2])


def test_translation_data_with_sentencepiece(tmp_path):
    words = ["red", "blue", "green", "cat", "dog", "big", "small", "house", "tree", "car"]
    fr = ["rouge", "bleu", "vert", "chat", "chien", "grand", "petit", "maison", "arbre", "voiture"]
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(300):
        idx = torch.randint(0, 10, (3,), generator=g).tolist()
        lines.append(" ".join(words[i] for i in idx) + "\t" + " ".join(fr[i] for i in idx))
    path = _write(tmp_path, "toy.txt", "\n".join(lines) + "\n")
    data = TranslationData.load(path, vocab_size=60, valid_fraction=0.1, test_fraction=0.1)
    assert data.train and data.valid and data.test
    assert data.src_vocab.decode(data.src_vocab.encode("red cat")) == "red cat"
    vocab = vocab_from_state(data.tgt_vocab.to_state())
    assert isinstance(vocab, SentencePieceVocab)
    assert vocab.encode("petit chat") == data.tgt_vocab.encode("petit chat")
    assert [vocab.sp.pad_id(), vocab.sp.unk_id(), vocab.sp.bos_id(), vocab.sp.eos_id()] == [
        PAD_ID,
        UNK_ID,
        BOS_ID,
        EOS_ID,
    ]


def test_symbol_vocab_round_trip():
    vocab = SymbolVocab(list("abcde"))
    assert len(vocab) == 9
    assert vocab.encode("a b z") == [4, 5, UNK_ID]
    assert vocab.encode("abc") == vocab.encode("a b c")
    assert vocab.decode(vocab.encode("e d")) == "e d"
    assert vocab_from_state(vocab.to_state()).itos == vocab.itos


def test_reverse_task_is_seeded_and_reversed():
    task = ReverseTask(vocab_size=10, min_len=3, max_len=6, seed=1, heldout_size=20)
    heldout = task.heldout()
    assert heldout == task.heldout()
    for src, tgt in heldout:
        assert 3 <= len(src) <= 6 and tgt == src[::-1]
        assert all(4 <= t < 14 for t in src)
    a = task.sample(torch.Generator().manual_seed(5), 8)
    b = task.sample(torch.Generator().manual_seed(5), 8)
    assert a == b


def test_both_tasks_give_the_loop_the_same_interface():
    """ReverseTask and TranslationTask are both Tasks: epoch_plan, step_pairs (accum_steps
    batches of id pairs) and example, with the vocabularies, widths and checkpoint info."""
    from types import SimpleNamespace

    config = SimpleNamespace(seed=0, batch_size=4, batch_tokens=None, accum_steps=2)
    ctx = SimpleNamespace(rank=0, world_size=1)
    reverse = ReverseTask(vocab_size=10, min_len=3, max_len=6, seed=1, heldout_size=5)
    src = [f"w{i % 7} w{i % 5} w{i % 3}" for i in range(40)]
    corpus = TranslationData(
        *(SymbolVocab([f"w{i}" for i in range(7)]),) * 2,
        [(list(range(4, 4 + 1 + i % 3)), [4 + i % 7]) for i in range(40)],
        list(zip(src, src, strict=True))[:3],
        [],
        None,
    )
    translate = TranslationTask(corpus, {"kind": "translate"})
    for task, planned in ((reverse, False), (translate, True)):
        assert isinstance(task, Task) and task.info["kind"] == task.kind
        plan = task.epoch_plan(config, 0, ctx)
        assert (plan is not None) == planned
        steps = task.step_pairs(config, plan, 0)
        assert len(steps) == 2 and all(len(pairs) == 4 for pairs in steps)
        for pairs in steps:
            batch = make_batch(pairs, src_pad_to=task.pad_src, tgt_pad_to=task.pad_tgt)
            assert batch.src.shape[1] == task.pad_src and batch.tgt_in.shape[1] == task.pad_tgt
        assert task.example() and task.src_vocab is not None and task.tgt_vocab is not None
    assert translate.example() == src[0] and reverse.generator is not None
    assert translate.generator is None


def test_make_batch_layout():
    batch = make_batch([([5, 6, 7], [7, 6, 5]), ([8], [8])], src_pad_to=4, tgt_pad_to=5)
    assert batch.src.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch.src_lengths.tolist() == [3, 1]
    assert batch.tgt_in.tolist() == [[BOS_ID, 7, 6, 5, 0], [BOS_ID, 8, 0, 0, 0]]
    assert batch.tgt_out.tolist() == [[7, 6, 5, EOS_ID, 0], [8, EOS_ID, 0, 0, 0]]
    assert batch.num_target_tokens == 6


def test_epoch_batches_shard_evenly_and_reproducibly():
    pairs = [([1] * (i % 7 + 1), [1]) for i in range(103)]
    full = epoch_batches(pairs, 8, seed=0, epoch=0)
    assert sorted(i for b in full for i in b) == list(range(103))
    assert full == epoch_batches(pairs, 8, seed=0, epoch=0)
    assert full != epoch_batches(pairs, 8, seed=0, epoch=1)
    r0 = epoch_batches(pairs, 8, seed=0, epoch=0, rank=0, world_size=2)
    r1 = epoch_batches(pairs, 8, seed=0, epoch=0, rank=1, world_size=2)
    assert len(r0) == len(r1) == len(full) // 2
    assert not {i for b in r0 for i in b} & {i for b in r1 for i in b}


FRA_ENG = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "fra-eng.zip"


@pytest.mark.skipif(not FRA_ENG.exists(), reason=f"optional corpus {FRA_ENG} is absent")
def test_fra_eng_corpus_reads_cleanly():
    pairs, report = read_parallel_corpus(FRA_ENG, max_words=10)
    assert report.lines == 142_787 and not report.malformed
    assert report.pairs + report.too_long == report.lines
    assert all("\u202f" not in tgt for _, tgt in pairs)
    assert pairs[0] == ("Go.", "Va !")


def test_a_sentencepiece_vocabulary_too_small_names_the_flag():
    """sentencepiece's own error (fewer pieces than the corpus's characters) came as its
    traceback; it names --spm-vocab-size now, as a ValueError the command line reports."""
    from seq2seq_fast.seq2seq.data.vocab import SentencePieceVocab

    sentences = ["the quick brown fox jumps over the lazy dog"] * 20
    with pytest.raises(ValueError, match=r"--spm-vocab-size 9: sentencepiece could not train"):
        SentencePieceVocab.train(sentences, vocab_size=9)
