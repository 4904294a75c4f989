"""Batched translation: batched greedy/beam search equal one sentence at a time, the Translator
keeps input order and line alignment, the ``translate`` and ``export`` commands end to end."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest
import torch

from seq2seq_fast.ops import fused_available
from seq2seq_fast.seq2seq.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    load_checkpoint,
    save_checkpoint,
)
from seq2seq_fast.seq2seq.cli import main
from seq2seq_fast.seq2seq.data.batching import make_batch
from seq2seq_fast.seq2seq.data.tasks import reverse_symbols
from seq2seq_fast.seq2seq.data.vocab import BOS_ID, EOS_ID, SymbolVocab
from seq2seq_fast.seq2seq.decoding import DecodeOptions, beam_search, greedy_search
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig
from seq2seq_fast.seq2seq.translate import Translator, split_lines

FUSED = "fused" if fused_available("cpu", torch.float32) else "reference"
# (backend, model options): both decoders, both cells, the fused op where it is built
CASES = [
    pytest.param(FUSED, dict(decoder="gnmt", cell="gru"), id=f"gnmt-gru-{FUSED}"),
    pytest.param(
        "reference",
        dict(decoder="bahdanau", cell="lstm", decoder_layers=2),
        id="bahdanau-lstm-2-reference",
    ),
]


def _model(
    backend: str = "reference", seed: int = 0, eos_bias: float = 0.05, **overrides
) -> tuple[Seq2Seq, SymbolVocab]:
    vocab = SymbolVocab(reverse_symbols(10))
    torch.manual_seed(seed)
    config = Seq2SeqConfig(
        src_vocab_size=len(vocab),
        tgt_vocab_size=len(vocab),
        embed_size=16,
        hidden_size=24,
        backend=backend,
        **overrides,
    )
    model = Seq2Seq(config).eval()
    with torch.no_grad():  # untrained: make </s> likely enough that rows finish at different steps
        model.decoder.output.bias[EOS_ID] += eos_bias
    return model, vocab


def _sources(count: int = 12, seed: int = 1) -> list[list[int]]:
    """Id sequences of mixed lengths (1 to 11)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=g).tolist()
    lengths[3] = 1
    return [torch.randint(4, 14, (n,), generator=g).tolist() for n in lengths]


def _alone_and_batched(search, sources):
    """Each source decoded alone and all in one padded batch."""
    alone = []
    for ids in sources:
        src = torch.tensor([ids])
        alone.append(search(src, torch.tensor([len(ids)])))
    batch = make_batch([(s, [0]) for s in sources])
    return [a[0] for a in alone], search(batch.src, batch.src_lengths)


def _assert_same(a, b, what):
    assert a.tokens == b.tokens, what
    assert abs(a.score - b.score) <= 1e-6, (what, a.score, b.score)
    assert a.attention.shape == b.attention.shape, what
    torch.testing.assert_close(a.attention, b.attention, atol=1e-6, rtol=0, msg=what)


@pytest.mark.parametrize("backend,overrides", CASES)
def test_batched_greedy_equals_one_sentence_at_a_time(backend, overrides):
    model, _ = _model(backend, **overrides)
    sources = _sources()
    alone, batched = _alone_and_batched(lambda s, n: greedy_search(model, s, n), sources)
    lengths = {len(h.tokens) for h in batched}
    assert len(lengths) > 1, "the rows should finish at different steps (the batch shrinks)"
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        _assert_same(a, b, f"sentence {i}")


@pytest.mark.parametrize("backend,overrides", CASES)
def test_batched_beam_search_equals_per_sentence(backend, overrides):
    model, _ = _model(backend, seed=2, **overrides)
    sources = _sources(seed=3)

    def search(src, lengths):
        return beam_search(model, src, lengths, DecodeOptions(beam=4, n_best=3, beta=0.2))

    alone, batched = _alone_and_batched(search, sources)
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert len(a) == len(b) == 3, f"sentence {i}: n-best sizes {len(a)}, {len(b)}"
        assert [h.score for h in b] == sorted((h.score for h in b), reverse=True)
        for rank, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"sentence {i}, hypothesis {rank}")


def _plain_beam_search(model, ids, beam, n_best, alpha=0.6, max_len_factor=2.0):
    """One sentence, written out: every row's every token scored, sorted in Python; the top K
    of the 2K best that end in </s> finish (score / ((5 + len) / 6) ** alpha), the best K that do
    not go on; done with K finished or at the length limit."""
    import math

    from seq2seq_fast.seq2seq.decoding import _step_log_probs, max_output_lengths
    from seq2seq_fast.seq2seq.models import map_state

    lengths = torch.tensor([len(ids)])
    limit = int(max_output_lengths(lengths, max_len_factor, None)[0])
    memory, state = model.encode(torch.tensor([ids]), lengths)
    rows = torch.zeros(beam, dtype=torch.long)
    memory, state = memory.index_select(rows), map_state(lambda s: s.index_select(0, rows), state)
    hyps = [(0.0, [])] + [(-math.inf, [])] * (beam - 1)
    y, finished = torch.full((beam,), BOS_ID), []
    for t in range(limit):
        at_limit = torch.full((beam,), limit <= t + 1)
        logp, _, state = _step_log_probs(model, y, state, memory, at_limit)
        scored = [
            (hyps[r][0] + float(logp[r, v]), r, v)
            for r in range(beam)
            for v in range(logp.shape[1])
        ]
        best = sorted(scored, key=lambda c: -c[0])[: 2 * beam]
        for score, r, v in best[:beam]:
            if v == EOS_ID and math.isfinite(score):
                finished.append((score / ((5.0 + t + 1) / 6.0) ** alpha, hyps[r][1]))
        if len(finished) >= beam or limit <= t + 1:
            break
        keep = [c for c in best if c[2] != EOS_ID][:beam]
        order = torch.tensor([r for _, r, _ in keep])
        state = map_state(lambda s, order=order: s.index_select(0, order), state)
        hyps = [(score, hyps[r][1] + [v]) for score, r, v in keep]
        y = torch.tensor([v for _, _, v in keep])
    return sorted(finished, key=lambda h: -h[0])[:n_best]


@pytest.mark.parametrize("beam", [2, 4])
@pytest.mark.parametrize("eos_bias", [0.3, 1.5])
def test_beam_search_equals_a_plain_search(beam, eos_bias):
    """The batched search's candidate selection (each row's 2K best tokens, then the sentence's
    2K best) against every candidate scored and sorted. A large </s> bias puts </s> among a
    row's best tokens, so that the K continuations kept can reach past a row's K best."""
    model, _ = _model("reference", seed=4, eos_bias=eos_bias)
    sources = _sources(count=6, seed=5)
    batch = make_batch([(s, [0]) for s in sources])
    with torch.no_grad():
        options = DecodeOptions(beam=beam, n_best=beam)
        batched = beam_search(model, batch.src, batch.src_lengths, options)
        for i, ids in enumerate(sources):
            plain = _plain_beam_search(model, ids, beam, n_best=beam)
            assert [h.tokens for h in batched[i]] == [tokens for _, tokens in plain], i
            for h, (score, _) in zip(batched[i], plain, strict=True):
                assert abs(h.score - score) <= 1e-6, (i, h.score, score)


def test_padded_rows_encode_and_attend_exactly():
    """The masks: a short sentence padded in a batch of long ones gets the encoder states and the
    attention weights it gets alone, and zero weight on the padding."""
    model, _ = _model("reference", decoder="bahdanau")
    sources = [[5, 6], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    batch = make_batch([(s, [0]) for s in sources])
    memory, state = model.encode(batch.src, batch.src_lengths)
    alone_memory, alone_state = model.encode(torch.tensor([sources[0]]), torch.tensor([2]))
    torch.testing.assert_close(memory.values[0, :2], alone_memory.values[0], atol=1e-6, rtol=0)
    assert memory.values[0, 2:].abs().max() == 0
    torch.testing.assert_close(state[0][0], alone_state[0][0], atol=1e-6, rtol=0)
    y = torch.full((2,), 2)
    _, weights, _ = model.decoder.step(y, state, memory)
    _, alone_weights, _ = model.decoder.step(y[:1], alone_state, alone_memory)
    assert weights[0, 2:].abs().max() == 0
    torch.testing.assert_close(weights[0, :2], alone_weights[0], atol=1e-6, rtol=0)


def test_beam_n_best_must_fit_the_beam():
    with pytest.raises(ValueError, match="n_best"):
        DecodeOptions(beam=2, n_best=3)


@pytest.mark.parametrize("beam", [1, 3])
def test_translator_keeps_order_and_flags_empty_and_long_lines(beam):
    model, vocab = _model("reference")
    texts = ["a b c", "", "d e f g h i j", "   ", "b", "a " * 30, "c d", "e f g h"]
    options = DecodeOptions(beam=beam, n_best=min(beam, 2))
    translator = Translator(
        model, vocab, vocab, options=options, batch_size=3, max_tokens=12, max_source_tokens=20
    )
    counts = []
    results = translator.translate(texts, progress=counts.append)
    assert sum(counts) == len(texts)
    assert len(results) == len(texts)
    warnings = {i: r.warning for i, r in enumerate(results) if r.warning}
    assert sorted(warnings) == [1, 3, 5]
    assert "line 2: empty" in warnings[1] and "line 4: empty" in warnings[3]
    assert "line 6: 30 source tokens" in warnings[5] and "20" in warnings[5]
    alone = Translator(model, vocab, vocab, options=options, batch_size=1)
    for i, (text, result) in enumerate(zip(texts, results, strict=True)):
        if i in warnings:
            assert result.text == "" and result.hypotheses == []
            continue
        (single,) = alone.translate([text])
        assert result.texts == single.texts, text
        assert len(result.hypotheses) == options.n_best
        for x, y in zip(result.hypotheses, single.hypotheses, strict=True):
            assert x.tokens == y.tokens and abs(x.score - y.score) <= 1e-6


@pytest.mark.parametrize(("beam", "sentences"), [(1, 320), (5, 64), (400, 1)])
def test_default_batches_hold_about_320_decoder_rows(beam, sentences):
    model, vocab = _model()
    translator = Translator(model, vocab, vocab, options=DecodeOptions(beam=beam))
    results = translator.encode(["a b"] * 700)
    assert max(len(batch) for batch in translator.batches(results)) == sentences


def test_translator_batches_respect_both_limits():
    model, vocab = _model()
    translator = Translator(model, vocab, vocab, batch_size=4, max_tokens=10)
    results = translator.encode(["a", "a b c", "a b", "a b c d e", "a", "a b c d", "a b"])
    batches = translator.batches(results)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for batch in batches:
        widths = [len(results[i].source_ids) for i in batch]
        assert widths == sorted(widths)
        assert len(batch) <= 4 and len(batch) * max(widths) <= 10


@pytest.mark.parametrize("beam", [1, 3])
def test_workers_translate_the_same_and_keep_the_model_mode(beam):
    model, vocab = _model("reference", decoder="bahdanau", eos_bias=0.3)
    texts = [" ".join("abcdefghij"[(i * 7 + j) % 10] for j in range(1 + i % 9)) for i in range(40)]
    texts[5] = ""
    options = DecodeOptions(beam=beam, n_best=min(beam, 2))
    one = Translator(model, vocab, vocab, options=options).translate(texts)
    model.train()  # the workers' searches must not toggle it under each other
    threaded = Translator(model, vocab, vocab, options=options, workers=3)
    assert len(threaded.batches(threaded.encode(texts))) >= 6  # two batches per worker at least
    counts = []
    many = threaded.translate(texts, progress=counts.append)
    assert model.training and sum(counts) == len(texts)
    assert [r.warning for r in many] == [r.warning for r in one]
    for a, b in zip(one, many, strict=True):
        assert a.texts == b.texts and len(a.hypotheses) == len(b.hypotheses)
        for x, y in zip(a.hypotheses, b.hypotheses, strict=True):
            assert x.tokens == y.tokens and abs(x.score - y.score) <= 1e-6
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        Translator(model, vocab, vocab, workers=0)


def test_a_failing_worker_batch_stops_the_rest(monkeypatch):
    import time

    model, vocab = _model("reference")
    translator = Translator(model, vocab, vocab, batch_size=1, workers=2)
    calls = []

    def decode(sources):
        calls.append(len(calls))
        time.sleep(0.2)
        if len(calls) == 2:
            raise RuntimeError("batch failed")
        return [[] for _ in sources]

    monkeypatch.setattr(translator, "_decode", decode)
    with pytest.raises(RuntimeError, match="batch failed"):
        translator.translate(["a b"] * 20)
    assert len(calls) < 12  # the rest were cancelled, not decoded after the error


def test_split_lines_counts_like_wc():
    assert split_lines(b"\xef\xbb\xbfa\r\n\nb") == ["a", "", "b"]
    assert split_lines(b"a\n\n") == ["a", ""]
    assert split_lines(b"") == []
    assert split_lines("x\ny\n") == ["x", "y"]


# --- the command -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained model in a training checkpoint (decodes deterministically, if not well)."""
    model, vocab = _model("auto", decoder="gnmt", eos_bias=0.0)
    path = tmp_path_factory.mktemp("translate") / "model.pt"
    save_checkpoint(
        {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "model_config": model.config.to_dict(),
            "src_vocab": vocab.to_state(),
            "tgt_vocab": vocab.to_state(),
            "model": model.state_dict(),
            "optimizer": {"state": {}, "param_groups": []},
            "train_config": {"task": "reverse"},
        },
        path,
    )
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


LINES = ["a b c", "", "d e f g", "b", "a b c d e f g h i j", "  ", "c d e"]


def test_translate_file_keeps_one_line_per_input(checkpoint, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n")
    target = tmp_path / "out.txt"
    code, out, err = _run(
        capsys,
        "translate",
        "--checkpoint",
        checkpoint,
        "--input",
        source,
        "--output",
        target,
        "--batch-size",
        "2",
        "--max-source-tokens",
        "8",
    )
    assert code == 0, err
    lines = target.read_text().split("\n")
    assert lines[-1] == "" and len(lines) - 1 == len(LINES)
    for i in (1, 4, 5):
        assert lines[i] == ""
        assert f"warning: line {i + 1}:" in err
    assert all(lines[i] for i in (0, 2, 3, 6))
    assert f"{len(LINES)} sentences, " in err and "tokens/s" in err
    # Per-sentence (batch of 1) and stdin give the same lines.
    code, out, err = _run(
        capsys,
        "translate",
        "--checkpoint",
        checkpoint,
        "--input",
        source,
        "--batch-size",
        "1",
        "--max-source-tokens",
        "8",
    )
    assert code == 0 and out.split("\n") == lines


def test_translate_command_leaves_torch_threads_as_they_were(checkpoint, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n")
    before = torch.get_num_threads()
    for threads in ("1", "2", "3"):
        code, out, _ = _run(
            capsys, "translate", "--checkpoint", checkpoint, "--input", source, "--threads", threads
        )
        assert code == 0 and len(out.splitlines()) == len(LINES)
        assert torch.get_num_threads() == before


@pytest.mark.parametrize(("threads", "workers", "each"), [("1", 1, 1), ("3", 3, 1), ("8", 4, 2)])
def test_translate_threads_become_workers(
    checkpoint, tmp_path, capsys, monkeypatch, threads, workers, each
):
    seen = {}
    load = Translator.load.__func__

    def spy(cls, *args, **kwargs):
        seen.update(workers=kwargs["workers"], each=torch.get_num_threads())
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(Translator, "load", classmethod(spy))
    code, out, _ = _run(
        capsys, "translate", "--checkpoint", checkpoint, "a b c", "--threads", threads
    )
    assert code == 0 and out.strip() and seen == {"workers": workers, "each": each}


def test_translate_stdin_and_beam_n_best(checkpoint, capsys, monkeypatch):
    data = ("\n".join(LINES) + "\n").encode()
    monkeypatch.setattr(
        sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data), isatty=lambda: False)
    )
    code, out, err = _run(
        capsys,
        "translate",
        "--checkpoint",
        checkpoint,
        "--beam",
        "3",
        "--n-best",
        "2",
        "--max-source-tokens",
        "8",
    )
    assert code == 0, err
    lines = out.split("\n")[:-1]
    assert len(lines) == 2 * len(LINES)
    for i in range(len(LINES)):
        pair = lines[2 * i : 2 * i + 2]
        if i in (1, 4, 5):
            assert pair == ["", ""]
            continue
        scores = [float(line.split("\t")[1]) for line in pair]
        assert scores[0] >= scores[1]
    # The best of the n-best is the plain beam output.
    monkeypatch.setattr(
        sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data), isatty=lambda: False)
    )
    code, out, _ = _run(
        capsys, "translate", "--checkpoint", checkpoint, "--beam", "3", "--max-source-tokens", "8"
    )
    assert out.split("\n")[:-1] == [line.split("\t")[0] for line in lines[::2]]


def test_translate_non_utf8_input_names_the_line(checkpoint, tmp_path, capsys):
    source = tmp_path / "latin1.txt"
    source.write_bytes("a b\nc d\ncaf\u00e9 e\n".encode("latin-1"))
    code, out, err = _run(capsys, "translate", "--checkpoint", checkpoint, "--input", source)
    # Streamed output cannot be taken back: the line is read with U+FFFD and named, not fatal.
    assert code == 0 and len(out.splitlines()) == 3
    assert "warning: line 3: not valid UTF-8" in err and "Traceback" not in err


def test_translate_option_errors(checkpoint, capsys):
    code, _, err = _run(capsys, "translate", "--checkpoint", checkpoint, "--n-best", "3", "a b")
    assert code == 2 and "--n-best 3 needs --beam >= 3" in err
    if not torch.cuda.is_available():
        code, _, err = _run(
            capsys, "translate", "--checkpoint", checkpoint, "--device", "cuda", "a b"
        )
        assert code == 2 and "CUDA is not available" in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_translates_the_same_and_cannot_be_resumed(checkpoint, tmp_path, capsys, dtype):
    exported = tmp_path / "model.infer.pt"
    code, out, err = _run(
        capsys, "export", "--checkpoint", checkpoint, "-o", exported, "--dtype", dtype
    )
    assert code == 0, err
    assert f"wrote {exported}" in out and "MB" in out
    payload = load_checkpoint(exported)
    assert "optimizer" not in payload and payload["kind"] == "inference"
    floats = [t for t in payload["model"].values() if t.is_floating_point()]
    assert {t.dtype for t in floats} == {getattr(torch, dtype)}
    if dtype != "float32":
        assert exported.stat().st_size < 0.6 * checkpoint.stat().st_size
    outputs = []
    for path in (checkpoint, exported):
        code, out, err = _run(capsys, "translate", "--checkpoint", path, "--beam", "2", "a b c d")
        assert code == 0, err
        outputs.append(out)
    if dtype == "float32":
        assert outputs[0] == outputs[1]
    code, out, err = _run(
        capsys, "plot-attention", "--checkpoint", exported, "a b c", "-o", tmp_path / "a.png"
    )
    assert code == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    code, _, err = _run(capsys, "train", "--resume", exported, "--no-progress")
    assert code == 2 and "cannot be resumed" in err and "Traceback" not in err


def _checkpoint_of(model, vocab, path, **extra):
    save_checkpoint(
        {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "model_config": model.config.to_dict(),
            "src_vocab": vocab.to_state(),
            "tgt_vocab": vocab.to_state(),
            "model": model.state_dict(),
            "train_config": {"task": "reverse"},
            **extra,
        },
        path,
    )
    return path


def test_export_averages_several_checkpoints(tmp_path, capsys):
    paths, models = [], []
    for seed in range(3):
        model, vocab = _model("auto", seed=seed, decoder="gnmt")
        models.append(model)
        paths.append(_checkpoint_of(model, vocab, tmp_path / f"model.epoch{seed + 1}.pt"))
    averaged = tmp_path / "averaged.pt"
    code, out, err = _run(capsys, "export", "--checkpoint", *paths, "-o", averaged)
    assert code == 0, err
    assert "the average of 3 checkpoints" in out
    payload = load_checkpoint(averaged)
    assert payload["averaged_from"] == [str(p) for p in paths] and payload["metrics"] == {}
    for name, tensor in payload["model"].items():
        expected = sum(m.state_dict()[name].double() for m in models) / 3
        torch.testing.assert_close(tensor, expected.float(), atol=0, rtol=0, msg=name)
    code, out, err = _run(capsys, "translate", "--checkpoint", averaged, "a b c")
    assert code == 0 and len(out.splitlines()) == 1, err


def test_export_averages_checkpoints_given_each_after_its_own_flag(tmp_path, capsys):
    paths = []
    for seed in range(2):
        model, vocab = _model("auto", seed=seed, decoder="gnmt")
        paths.append(_checkpoint_of(model, vocab, tmp_path / f"model.epoch{seed + 1}.pt"))
    together, apart = tmp_path / "together.pt", tmp_path / "apart.pt"
    assert _run(capsys, "export", "--checkpoint", *paths, "-o", together)[0] == 0
    argv = ["export", "--checkpoint", paths[0], "--checkpoint", paths[1], "-o", apart]
    code, out, err = _run(capsys, *argv)
    assert code == 0 and "the average of 2 checkpoints" in out, err
    first, second = load_checkpoint(together)["model"], load_checkpoint(apart)["model"]
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_translate_output_options_are_checked_before_decoding(checkpoint, tmp_path, capsys):
    """-o: the single sentence goes to the file; the input file itself, a folder, a missing
    folder, or a checkpoint given as the sentence: an error naming what was given, and the
    input left as it was."""
    target = tmp_path / "one.txt"
    code, out, err = _run(capsys, "translate", "--checkpoint", checkpoint, "a b c", "-o", target)
    assert code == 0 and out == "", err
    assert len(target.read_text().splitlines()) == 1
    source = tmp_path / "in.txt"
    source.write_text("a b c\nd e\n")
    cases = {
        "is the input file": ["-i", source, "-o", source],
        "is a folder": ["-i", source, "-o", tmp_path],
        "does not exist": ["-i", source, "-o", tmp_path / "nowhere" / "out.txt"],
        "is a checkpoint file": [checkpoint],
    }
    for message, extra in cases.items():
        code, out, err = _run(capsys, "translate", "--checkpoint", checkpoint, *extra)
        assert code == 2 and message in err and "Traceback" not in err, (message, err)
        assert out == ""
    assert source.read_text() == "a b c\nd e\n"


@pytest.mark.parametrize(
    ("flag", "value"), [("--alpha", "nan"), ("--alpha", "inf"), ("--beta", "inf"), ("--beta", "-1")]
)
def test_translate_refuses_penalties_that_are_not_finite_weights(checkpoint, capsys, flag, value):
    with pytest.raises(SystemExit) as stop:  # argparse's own error
        main(["translate", "--checkpoint", str(checkpoint), flag, value, "a b"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and flag in err and "finite number >= 0" in err
    with pytest.raises(ValueError, match=flag.lstrip("-")):
        DecodeOptions(beam=2, **{flag.lstrip("-"): float(value)})


def test_export_refuses_to_average_different_models(tmp_path, capsys):
    model, vocab = _model("auto", decoder="gnmt")
    first = _checkpoint_of(model, vocab, tmp_path / "a.pt")
    wider, _ = _model("auto", decoder="bahdanau")
    other = _checkpoint_of(wider, vocab, tmp_path / "b.pt")
    code, _, err = _run(capsys, "export", "--checkpoint", first, other, "-o", tmp_path / "x.pt")
    assert code == 2 and f"cannot average {other} with {first}" in err and "model config" in err
    small = SymbolVocab(reverse_symbols(6))
    other = _checkpoint_of(model, small, tmp_path / "c.pt")
    code, _, err = _run(capsys, "export", "--checkpoint", first, other, "-o", tmp_path / "x.pt")
    assert code == 2 and "vocabular" in err and "Traceback" not in err
    code, _, err = _run(capsys, "export", "--checkpoint", first, other, "-o", first)
    assert code == 2 and "would overwrite" in err
    assert not (tmp_path / "x.pt").exists()
