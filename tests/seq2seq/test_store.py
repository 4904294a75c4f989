"""The on-disk token store, the user's tokenizers and vocabulary files (seq2seq/data/store.py, vocab.py).

Every corpus is a small file written by the test; stores are built into the test's own folder.
"""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import sentencepiece as spm

from seq2seq_fast.seq2seq.data import batching, normalize, store, stream, tokenizers
from seq2seq_fast.seq2seq.data import corpus as corpus_module
from seq2seq_fast.seq2seq.data import vocab as vocab_module
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.files import CorpusFiles
from seq2seq_fast.seq2seq.data.normalize import normalize_text
from seq2seq_fast.seq2seq.data.store import load_store_corpus
from seq2seq_fast.seq2seq.data.stream import Options
from seq2seq_fast.seq2seq.data.tokenizers import TokenizerSpec
from seq2seq_fast.seq2seq.data.vocab import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    SentencePieceVocab,
    WordVocab,
    check_vocab_fits,
    read_spm_model,
    read_vocab_file,
)

WORDS = ["red", "blue", "green", "cat", "dog", "big", "small", "house", "tree", "sun"]


def write_corpus(folder, lines=400, seed=0, name=""):
    """Two files, line i of tgt translating line i of src (upper-cased and reversed words)."""
    rng = random.Random(seed)
    src, tgt = folder / f"{name}src.txt", folder / f"{name}tgt.txt"
    src_lines, tgt_lines = [], []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 8))]
        src_lines.append(" ".join(words))
        tgt_lines.append(" ".join(w.upper() for w in reversed(words)))
    src.write_text("\n".join(src_lines) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(tgt_lines) + "\n", encoding="utf-8")
    return src, tgt


def load(src, tgt, cache, spec=None, options=None, **kwargs):
    logs = []
    corpus = load_store_corpus(
        CorpusFiles(str(src), str(tgt)),
        spec or TokenizerSpec(vocab_size=60),
        options or Options(valid_fraction=0.05, test_fraction=0.05),
        cache,
        progress=False,
        log=logs.append,
        **kwargs,
    )
    return corpus, logs


def forbid(monkeypatch, *names):
    """Make these functions fail the test when called (what a reused store must not do)."""
    for target, name in names:

        def fail(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} was called")

        monkeypatch.setattr(target, name, fail)


# --- a fresh store, then reused --------------------------------------------------------------------


def test_fresh_store_holds_every_training_pair_encoded(tmp_path):
    src, tgt = write_corpus(tmp_path)
    corpus, logs = load(src, tgt, tmp_path / "cache")
    assert any("encoding" in line for line in logs)
    train, valid, test = corpus.train, corpus.valid, corpus.test
    assert isinstance(train, store.TokenStore)
    assert len(train) + len(valid) + len(test) == 400 and valid and test
    # The held-out sources never appear in training (the split is by source sentence).
    held = {s for s, _ in valid + test}
    src_lines = src.read_text().splitlines()
    tgt_lines = tgt.read_text().splitlines()
    train_pairs = [(s, t) for s, t in zip(src_lines, tgt_lines, strict=True) if s not in held]
    assert len(train_pairs) == len(train)
    for i, (s, t) in enumerate(train_pairs):  # file order, encoded as the vocabularies encode
        assert train[i] == (corpus.src_vocab.encode(s), corpus.tgt_vocab.encode(t))
    assert train.lengths.dtype == np.int32 and train.lengths.shape == (len(train), 2)
    assert train.src_ids.dtype == np.uint16  # a 60-piece vocabulary fits 16 bits
    folder = train.folder
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["pairs"] == len(train) and manifest["key"] in folder.name
    assert not list(folder.parent.glob(".tmp-*"))  # nothing of the build left beside it


def test_reused_store_is_not_encoded_or_trained_again(tmp_path, monkeypatch):
    src, tgt = write_corpus(tmp_path)
    first, _ = load(src, tgt, tmp_path / "cache")
    forbid(
        monkeypatch,
        (store, "build_store"),
        (SentencePieceVocab, "train"),
        (SentencePieceVocab, "encode_batch"),
        (tokenizers, "sample_sentences"),
    )
    second, logs = load(src, tgt, tmp_path / "cache")
    assert any("reused" in line for line in logs)
    assert second.train.folder == first.train.folder
    assert [second.train[i] for i in range(len(second.train))] == [
        first.train[i] for i in range(len(first.train))
    ]
    assert second.valid == first.valid and second.test == first.test
    assert second.src_vocab.model_proto == first.src_vocab.model_proto


def test_changed_corpus_gets_a_new_store(tmp_path):
    src, tgt = write_corpus(tmp_path)
    first, _ = load(src, tgt, tmp_path / "cache")
    with src.open("a") as f, tgt.open("a") as g:
        f.write("sun tree\n")
        g.write("TREE SUN\n")
    second, logs = load(src, tgt, tmp_path / "cache")
    assert second.train.folder != first.train.folder
    assert any("encoding" in line for line in logs)
    assert second.report.lines == 401


@pytest.mark.parametrize(
    "damage", ["no manifest", "truncated ids", "foreign manifest", "overwritten index"]
)
def test_incomplete_or_corrupt_store_is_rebuilt(tmp_path, damage):
    src, tgt = write_corpus(tmp_path)
    first, _ = load(src, tgt, tmp_path / "cache")
    folder = first.train.folder
    expected = [first.train[i] for i in range(len(first.train))]
    del first
    if damage == "no manifest":
        (folder / "manifest.json").unlink()
    elif damage == "truncated ids":
        data_bytes = (folder / "src.bin").read_bytes()
        (folder / "src.bin").write_bytes(data_bytes[: len(data_bytes) // 2])
    elif damage == "overwritten index":  # same size, other content
        index = bytearray((folder / "lengths.npy").read_bytes())
        index[-8:] = bytes(8)
        (folder / "lengths.npy").write_bytes(bytes(index))
    else:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["key"] = "0" * 20
        (folder / "manifest.json").write_text(json.dumps(manifest))
    second, logs = load(src, tgt, tmp_path / "cache")
    assert any("rebuilding" in line for line in logs), logs
    assert second.train.folder == folder
    assert [second.train[i] for i in range(len(second.train))] == expected


def test_interrupted_build_leaves_no_store_that_looks_complete(tmp_path, monkeypatch):
    src, tgt = write_corpus(tmp_path, lines=3000)
    monkeypatch.setattr(stream, "CHUNK_PAIRS", 256)
    calls = []
    real = SentencePieceVocab.encode_batch

    def interrupted(self, texts):
        calls.append(len(texts))
        if len(calls) == 5:  # some chunks already written
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(SentencePieceVocab, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load(src, tgt, tmp_path / "cache")
    cache = tmp_path / "cache"
    assert not list(cache.glob("store-*")) and not list(cache.glob(".tmp-*"))
    monkeypatch.setattr(SentencePieceVocab, "encode_batch", real)
    corpus, logs = load(src, tgt, cache)  # the tokenizers come from the cache, the store is new
    assert any("from the cache" in line for line in logs)
    assert len(corpus.train) + len(corpus.valid) + len(corpus.test) == 3000


# --- errors naming files and lines -----------------------------------------------------------------


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=50)
    tgt.write_text("\n".join(tgt.read_text().splitlines()[:47]) + "\n")
    with pytest.raises(CorpusError) as info:
        load(src, tgt, tmp_path / "cache")
    message = str(info.value)
    assert str(src) in message and str(tgt) in message
    assert "50 lines" in message and "has 47" in message


def test_missing_corpus_file_is_named(tmp_path):
    src, _ = write_corpus(tmp_path, lines=20)
    with pytest.raises(CorpusError, match=r"target corpus file not found: .*nowhere\.txt"):
        load(src, tmp_path / "nowhere.txt", tmp_path / "cache")
    with pytest.raises(CorpusError, match=r"sentencepiece model not found: .*absent\.model"):
        load(
            src, src, tmp_path / "cache", spec=TokenizerSpec(src_spm=str(tmp_path / "absent.model"))
        )


def test_malformed_lines_are_counted_with_their_numbers(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=60)
    src_lines = src.read_text().splitlines()
    src_lines[9] = "   "  # line 10: empty source
    src.write_bytes(
        ("\n".join(src_lines[:20]) + "\n").encode()
        + b"bad \xff byte\n"
        + ("\n".join(src_lines[21:]) + "\n").encode()
    )  # line 21: not UTF-8
    corpus, _ = load(src, tgt, tmp_path / "cache")
    numbers = dict(corpus.report.malformed)
    assert set(numbers) == {10, 21}
    assert "empty" in numbers[10] and "UTF-8" in numbers[21]
    assert "2 malformed" in corpus.report.summary()


# --- held-out sets capped --------------------------------------------------------------------------


def test_held_out_sets_carved_from_one_file_are_capped(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=3000, seed=3)
    options = Options(valid_fraction=0.3, test_fraction=0.3, max_held_out=40)
    corpus, _ = load(src, tgt, tmp_path / "cache", options=options)
    assert 0 < len(corpus.valid) <= 40 and 0 < len(corpus.test) <= 40
    held = {s for s, _ in corpus.valid + corpus.test}
    train_sources = {corpus.src_vocab.decode(corpus.train[i][0]) for i in range(len(corpus.train))}
    assert not held & train_sources


def test_in_memory_split_is_capped_too():
    pairs = [(f"s{i}", f"t{i}") for i in range(10_000)]
    train, valid, test = corpus_module.split_by_source(pairs, 0.1, 0.1, seed=0, max_held_out=300)
    assert len(valid) == 300 and len(test) == 300 and len(train) == 9_400
    train, valid, test = corpus_module.split_by_source(pairs, 0.01, 0.02, seed=0)  # under the cap
    assert (len(valid), len(test)) == (100, 200)


def test_sentencepiece_is_trained_on_a_sample(tmp_path, monkeypatch):
    src, tgt = write_corpus(tmp_path, lines=2000)
    seen = []
    real = SentencePieceVocab.train.__func__

    def counting(cls, sentences, vocab_size, **kwargs):
        sentences = list(sentences)
        seen.append(len(sentences))
        return real(cls, sentences, vocab_size, **kwargs)

    monkeypatch.setattr(SentencePieceVocab, "train", classmethod(counting))
    load(src, tgt, tmp_path / "cache", spec=TokenizerSpec(vocab_size=60, sample_size=300))
    assert len(seen) == 2 and all(250 <= n <= 300 for n in seen)  # held-out ones left out


# --- the batches drawn from the store's index ------------------------------------------------------


def test_store_batches_cover_every_pair_within_the_token_limit(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=1500)
    corpus, _ = load(src, tgt, tmp_path / "cache")
    train = corpus.train
    pairs = [train[i] for i in range(len(train))]
    counts = set()
    for epoch in range(3):
        batches = batching.token_batches(train, 60, seed=1, epoch=epoch)
        counts.add(len(batches))
        index = np.concatenate(batches)
        assert sorted(index.tolist()) == list(range(len(train)))
        for batch in batches:
            width = max(batching.padded_width(pairs[i]) for i in batch)
            assert width * len(batch) <= 60 or len(batch) == 1
    assert len(counts) == 1  # the same number of batches every epoch (the schedule counts it)
    assert batching.padding_fractions(train, batches) == pytest.approx(
        batching.padding_fractions(pairs, [b.tolist() for b in batches])
    )
    # batch_size batches: the very batches of the in-memory path
    in_memory = batching.epoch_batches(pairs, 16, seed=2, epoch=1)
    indexed = batching.epoch_batches(train, 16, seed=2, epoch=1)
    assert [list(b) for b in in_memory] == [b.tolist() for b in indexed]
    assert batching.max_lengths(train) == batching.max_lengths(pairs)


def test_each_rank_reads_its_own_share(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=1000)
    corpus, _ = load(src, tgt, tmp_path / "cache")
    shares = [
        batching.token_batches(corpus.train, 50, seed=0, epoch=0, rank=r, world_size=3)
        for r in range(3)
    ]
    assert len({len(s) for s in shares}) == 1
    seen = [set(np.concatenate(s).tolist()) for s in shares]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


# --- the user's tokenizers -------------------------------------------------------------------------


def _train_spm(path, sentences, **ids):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
        **ids,
    )
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def test_existing_spm_model_with_other_ids_is_used_as_is(tmp_path, monkeypatch):
    src, tgt = write_corpus(tmp_path, lines=300)
    # sentencepiece's own defaults: unk 0, bos 1, eos 2, no pad
    sp = _train_spm(
        tmp_path / "own.model", src.read_text().splitlines() + tgt.read_text().splitlines()
    )
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    forbid(monkeypatch, (SentencePieceVocab, "train"), (tokenizers, "sample_sentences"))
    corpus, _ = load(
        src,
        tgt,
        tmp_path / "cache",
        spec=TokenizerSpec(
            src_spm=str(tmp_path / "own.model"), tgt_spm=str(tmp_path / "own.model"), share=True
        ),
    )
    vocab = corpus.src_vocab
    assert vocab is corpus.tgt_vocab and vocab.model_proto == (tmp_path / "own.model").read_bytes()
    assert len(vocab) == sp.get_piece_size() + 1  # its 3 specials are ours, plus <pad>
    assert vocab.pieces([PAD_ID, UNK_ID, BOS_ID, EOS_ID]) == list(SPECIALS)
    for text in ["red cat", "big small house tree", "sun zebra"]:
        ids = vocab.encode(text)
        assert all(len(SPECIALS) <= i < len(vocab) or i == UNK_ID for i in ids)
        assert vocab.pieces(ids) == [sp.id_to_piece(i) for i in sp.encode(text)]
        assert vocab.decode(ids) == sp.decode(sp.encode(text))
        assert vocab.decode([BOS_ID, *ids, EOS_ID, PAD_ID]) == sp.decode(sp.encode(text))
    first = normalize_text(src.read_text().splitlines()[0])
    held = {s for s, _ in corpus.valid + corpus.test}
    if first not in held:
        assert corpus.train[0][0] == vocab.encode(first)


def test_spm_model_with_our_ids_keeps_them(tmp_path):
    sp = _train_spm(
        tmp_path / "ours.model",
        ["red cat", "blue dog"] * 50,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
    )
    vocab = read_spm_model(tmp_path / "ours.model")
    assert len(vocab) == sp.get_piece_size()
    assert vocab.encode("red dog") == sp.encode("red dog")
    with pytest.raises(CorpusError, match=r"not a sentencepiece model"):
        (tmp_path / "junk.model").write_bytes(b"not a model")
        read_spm_model(tmp_path / "junk.model")


def test_vocabulary_files(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("<unk>\n<s>\n</s>\nred\t120\ncat\t7\nthe 3\n", encoding="utf-8")
    vocab = read_vocab_file(path)
    assert vocab.tokens == ["red", "cat", "the"] and len(vocab) == 7
    assert vocab.lines == [4, 5, 6]
    assert vocab.encode("the red zebra") == [6, 4, UNK_ID]
    assert vocab.decode([BOS_ID, 6, 4, EOS_ID, PAD_ID]) == "the red"
    restored = vocab_module.vocab_from_state(vocab.to_state())
    assert isinstance(restored, WordVocab) and restored.itos == vocab.itos
    bad = {
        "red\nred\n": r"line 2: token 'red' is already on line 1",
        "red\n\ncat\n": r"line 2: empty line",
        "red\tmany\n": r"line 1: the count 'many' is not a number",
        "red 1 2\n": r"line 1: expected 'token' or 'token<TAB>count'",
    }
    for text, message in bad.items():
        path.write_text(text, encoding="utf-8")
        with pytest.raises(CorpusError, match=rf"{path}.*{message}"):
            read_vocab_file(path)
    with pytest.raises(CorpusError, match=r"vocabulary file not found: .*none\.txt"):
        read_vocab_file(tmp_path / "none.txt")


def test_vocabulary_that_does_not_fit_a_checkpoint_names_file_and_line(tmp_path):
    saved = WordVocab(["red", "cat", "dog"]).to_state()
    path = tmp_path / "other.txt"
    path.write_text("red\ncow\ndog\n")
    with pytest.raises(
        CorpusError,
        match=rf"{path} does not fit ck\.pt: entry 5 \(line 2\) is "
        r"'cow', the checkpoint's is 'cat'",
    ):
        check_vocab_fits(
            read_vocab_file(path), saved, side="source", source=str(path), checkpoint="ck.pt"
        )
    path.write_text("red\ncat\n")
    with pytest.raises(CorpusError, match=r"6 entries, the checkpoint's has 7"):
        check_vocab_fits(
            read_vocab_file(path), saved, side="source", source=str(path), checkpoint="ck.pt"
        )
    path.write_text("red\ncat\ndog\n")
    check_vocab_fits(
        read_vocab_file(path), saved, side="source", source=str(path), checkpoint="ck.pt"
    )


def test_pretokenised_corpus_with_vocabulary_files(tmp_path, monkeypatch):
    src, tgt = write_corpus(tmp_path, lines=200)
    (tmp_path / "src.vocab").write_text("\n".join(f"{w}\t1" for w in WORDS[:-1]) + "\n")
    (tmp_path / "tgt.vocab").write_text("\n".join(w.upper() for w in WORDS) + "\n")
    forbid(monkeypatch, (SentencePieceVocab, "train"))
    spec = TokenizerSpec(
        src_vocab=str(tmp_path / "src.vocab"), tgt_vocab=str(tmp_path / "tgt.vocab")
    )
    corpus, _ = load(src, tgt, tmp_path / "cache", spec=spec)
    assert isinstance(corpus.src_vocab, WordVocab) and len(corpus.src_vocab) == 4 + 9
    unknown = 0
    for i in range(len(corpus.train)):
        s, t = corpus.train[i]
        words = corpus.src_vocab.decode(s).split()
        assert all(w in WORDS[:-1] or w == "<unk>" for w in words)  # "sun" is not in the file
        unknown += words.count("<unk>")
        assert corpus.tgt_vocab.decode(t).split() == [
            "SUN" if w == "<unk>" else w.upper() for w in reversed(words)
        ]
    assert unknown > 0
    with pytest.raises(CorpusError, match="--share-vocab needs one vocabulary"):
        load(
            src,
            tgt,
            tmp_path / "cache",
            spec=TokenizerSpec(
                src_vocab=str(tmp_path / "src.vocab"),
                tgt_vocab=str(tmp_path / "tgt.vocab"),
                share=True,
            ),
        )


def test_block_normalisation_equals_normalize_text():
    rng = random.Random(0)
    alphabet = list("ab Z\t\r\x0b\x0c\x1c\x1f\x85\u00a0\u202f\u2028\u3000\ufb01é") + ["e\u0301"]
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(3000)]
    raw = [(line + "\n").encode() for line in lines]
    texts, bad = normalize.normalize_block(raw, "NFKC")
    assert not bad and texts == [normalize_text(line) for line in lines]
    raw[7] = b"bad \xff\n"
    texts, bad = normalize.normalize_block(raw + [None], "NFC")
    assert set(bad) == {7} and texts[7] is None and texts[-1] is None
    assert texts[8] == normalize_text(lines[8], "NFC")


def test_bench_corpus_generator_writes_aligned_files(tmp_path):
    from bench.bench_data_scale import generate

    src, tgt = generate(tmp_path, 250, seed=3, tsv=True)
    src_lines, tgt_lines = src.read_text().splitlines(), tgt.read_text().splitlines()
    assert len(src_lines) == len(tgt_lines) == 250
    pairs = list(zip(src_lines, tgt_lines, strict=True))
    assert all(3 <= len(s.split()) == len(t.split()) <= 20 for s, t in pairs)
    rows = (tmp_path / "corpus.tsv").read_text().splitlines()
    assert rows == [f"{s}\t{t}" for s, t in zip(src_lines, tgt_lines, strict=True)]
