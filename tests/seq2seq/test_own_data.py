"""Training on the user's own data end to end: two-file corpora, tokenizer and vocabulary files,
a shared vocabulary with tied embeddings, through the token store (tiny jobs of a few steps)."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.seq2seq.checkpoint import load_checkpoint, load_model
from seq2seq_fast.seq2seq.cli import main
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.train import train
from tests.seq2seq.test_store import WORDS, write_corpus

TINY = [
    "--task",
    "translate",
    "--epochs",
    "1",
    "--embed-size",
    "16",
    "--hidden-size",
    "32",
    "--batch-size",
    "16",
    "--warmup-steps",
    "2",
    "--backend",
    "reference",
    "--no-progress",
    "--no-heatmap",
    "--threads",
    "1",
    "--eval-size",
    "10",
    "--spm-vocab-size",
    "60",
    "--valid-fraction",
    "0.05",
    "--test-fraction",
    "0.05",
]

TINY_CONFIG = dict(
    task="translate",
    epochs=1,
    embed_size=16,
    hidden_size=32,
    batch_size=16,
    warmup_steps=2,
    backend="reference",
    progress=False,
    heatmap=False,
    threads=1,
    eval_size=10,
    spm_vocab_size=60,
    valid_fraction=0.05,
    test_fraction=0.05,
    decoder="gnmt",
    output_layer="attentional",
)


def test_cli_trains_on_two_files_and_translates(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("SEQ2SEQ_FAST_CACHE_DIR", str(cache))
    src, tgt = write_corpus(tmp_path, lines=300)
    out = tmp_path / "run"
    args = [
        *TINY,
        "--src",
        str(src),
        "--tgt",
        str(tgt),
        "--out",
        str(out),
        "--stop-after-steps",
        "4",
    ]
    assert main(["train", *args]) == 0
    log = capsys.readouterr().out
    assert "token store: encoding" in log and "split:" in log
    assert f"corpus cache: {cache} (the per-user default" in log
    payload = load_checkpoint(out / "model.pt")
    assert payload["step"] == 4
    assert payload["src_vocab"]["kind"] == "sentencepiece"  # the tokenizer travels in it
    assert payload["task"]["src"] == str(src) and cache.is_dir()
    assert not (out / "data-cache").exists()
    assert main(["translate", "--checkpoint", str(out / "model.pt"), "red cat"]) == 0
    assert capsys.readouterr().out.strip() != ""
    # The second run, with another --out, opens the store (and the trained tokenizers) as they
    # are from the per-user cache.
    assert main(["train", *args, "--out", str(tmp_path / "run2")]) == 0
    log = capsys.readouterr().out
    assert "pairs, reused)" in log and "from the cache" in log
    assert "encoding" not in log


def test_shared_vocabulary_file_and_tied_embeddings(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=200)
    vocab = tmp_path / "joint.vocab"
    vocab.write_text("\n".join(WORDS + [w.upper() for w in WORDS]) + "\n")
    config = TrainConfig(
        **TINY_CONFIG,
        src=str(src),
        tgt=str(tgt),
        out=str(tmp_path / "run"),
        src_vocab_file=str(vocab),
        tgt_vocab_file=str(vocab),
        share_vocab=True,
        tie_embeddings=True,
        stop_after_steps=3,
    )
    result = train(config)
    model, src_vocab, tgt_vocab, payload = load_model(result.checkpoint)
    assert src_vocab.kind == "words" and len(src_vocab) == 4 + 20
    assert payload["model_config"]["share_embeddings"] and payload["model_config"]["tie_embeddings"]
    table = model.encoder.embedding.weight
    assert model.decoder.embedding.weight is table and model.decoder.output.weight is table
    # One parameter, three uses: counted once, and the saved copies agree.
    names = {n for n, _ in model.named_parameters()}
    assert "encoder.embedding.weight" in names and "decoder.output.weight" not in names
    state = payload["model"]
    assert torch.equal(state["decoder.output.weight"], state["encoder.embedding.weight"])
    # translate needs nothing but the checkpoint: its words come from the vocabulary file
    from seq2seq_fast.seq2seq.translate import Translator

    (translation,) = Translator.load(result.checkpoint).translate(["red  cat"])
    assert set(translation.text.split()) <= set(src_vocab.itos)
    assert translation.source_ids == [src_vocab.stoi["red"], src_vocab.stoi["cat"]]
    # It trained: the shared table moved away from its initial values.
    init = TrainConfig(
        **TINY_CONFIG,
        src=str(src),
        tgt=str(tgt),
        out=str(tmp_path / "zero"),
        src_vocab_file=str(vocab),
        tgt_vocab_file=str(vocab),
        share_vocab=True,
        tie_embeddings=True,
        stop_after_steps=0,
    )
    start = load_checkpoint(train(init).checkpoint)["model"]["encoder.embedding.weight"]
    assert not torch.equal(start, state["encoder.embedding.weight"])


def test_untied_models_keep_their_parameters(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=200)
    config = TrainConfig(
        **TINY_CONFIG,
        src=str(src),
        tgt=str(tgt),
        out=str(tmp_path / "run"),
        share_vocab=True,
        stop_after_steps=2,
    )
    model = load_model(train(config).checkpoint)[0]
    assert model.decoder.output.weight is not model.decoder.embedding.weight
    assert model.decoder.embedding.weight is not model.encoder.embedding.weight
    assert len(model.encoder.embedding.weight) == len(model.decoder.embedding.weight)  # shared


def test_tied_embeddings_need_a_matching_projection_width(tmp_path, capsys):
    src, tgt = write_corpus(tmp_path, lines=100)
    args = [
        *TINY,
        "--src",
        str(src),
        "--tgt",
        str(tgt),
        "--out",
        str(tmp_path / "run"),
        "--tie-embeddings",
        "--output-layer",
        "concat",
    ]
    assert main(["train", *args]) == 2
    assert "--tie-embeddings needs the output projection's input" in capsys.readouterr().err


def test_resume_from_the_store_equals_uninterrupted(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=300)
    config = TrainConfig(
        **TINY_CONFIG,
        src=str(src),
        tgt=str(tgt),
        out=str(tmp_path / "full"),
        batch_tokens=120,
        cache_dir=str(tmp_path / "cache"),
    )
    full = train(config)
    part_config = TrainConfig(
        **{**config.__dict__, "out": str(tmp_path / "part"), "stop_after_steps": full.step // 2}
    )
    part = train(part_config)
    resumed = train(TrainConfig(progress=False), resume=tmp_path / "part/model.pt")
    assert part.losses + resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=0)


def test_cli_errors_name_files_and_counts(tmp_path, capsys):
    src, tgt = write_corpus(tmp_path, lines=30)
    tgt.write_text("\n".join(tgt.read_text().splitlines()[:29]) + "\n")
    base = ["train", *TINY, "--out", str(tmp_path / "run")]
    assert main([*base, "--src", str(src), "--tgt", str(tgt)]) == 2
    err = capsys.readouterr().err
    assert f"{src} has 30 lines, {tgt} has 29" in err and err.count("\n") == 1
    assert main([*base, "--src", str(src)]) == 2
    assert "--src needs --tgt" in capsys.readouterr().err
    assert main([*base, "--src", str(src), "--tgt", str(tmp_path / "missing.txt")]) == 2
    assert f"target corpus file not found: {tmp_path / 'missing.txt'}" in capsys.readouterr().err
    with pytest.raises(TrainError, match="--spm.*for --task translate"):
        TrainConfig(spm="x.model")


def test_resume_with_a_vocabulary_that_does_not_fit(tmp_path, capsys):
    src, tgt = write_corpus(tmp_path, lines=100)
    vocab = tmp_path / "src.vocab"
    vocab.write_text("\n".join(WORDS) + "\n")
    out = tmp_path / "run"
    args = [
        *TINY,
        "--src",
        str(src),
        "--tgt",
        str(tgt),
        "--out",
        str(out),
        "--src-vocab",
        str(vocab),
        "--stop-after-steps",
        "2",
    ]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    other = tmp_path / "other.vocab"
    other.write_text("\n".join(WORDS[:3] + ["zebra"] + WORDS[4:]) + "\n")
    resume = ["train", "--resume", str(out / "model.pt"), "--no-progress"]
    assert main([*resume, "--src-vocab", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"the source vocabulary {other} does not fit {out / 'model.pt'}" in err
    assert "(line 4) is 'zebra', the checkpoint's is 'cat'" in err


def test_tsv_through_the_store_both_directions(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQ2SEQ_FAST_CACHE_DIR", str(tmp_path / "cache"))
    src, tgt = write_corpus(tmp_path, lines=200)
    tsv = tmp_path / "corpus.tsv"
    tsv.write_text(
        "".join(
            f"{s}\t{t}\n"
            for s, t in zip(src.read_text().splitlines(), tgt.read_text().splitlines(), strict=True)
        )
    )
    for direction in ("1-2", "2-1"):
        config = TrainConfig(
            **TINY_CONFIG,
            data=str(tsv),
            token_store=True,
            direction=direction,
            out=str(tmp_path / direction),
            stop_after_steps=1,
        )
        result = train(config)
        _, src_vocab, _, payload = load_model(result.checkpoint)
        pieces = "".join(src_vocab.pieces(range(4, len(src_vocab))))
        assert pieces.islower() if direction == "1-2" else pieces.isupper()
    assert len(list((tmp_path / "cache").glob("store-*"))) == 2  # one a direction


def test_ddp_ranks_share_one_store(tmp_path):
    """torchrun --nproc_per_node=2 (gloo): rank 0 builds the store and trains the tokenizers,
    rank 1 waits and opens them; both train from it."""
    import os
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    src, tgt = write_corpus(tmp_path, lines=300)
    out = tmp_path / "ddp"
    cache = tmp_path / "cache"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SEQ2SEQ_FAST_CACHE_DIR=str(cache)
    )
    command = [
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "seq2seq_fast",
        "train",
        *TINY,
        "--src",
        str(src),
        "--tgt",
        str(tgt),
        "--out",
        str(out),
        "--stop-after-steps",
        "3",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 process(es)" in proc.stdout and proc.stdout.count("token store: encoding") == 1
    payload = load_checkpoint(out / "model.pt")
    assert payload["world_size"] == 2 and payload["step"] == 3
    assert len(list(cache.glob("store-*"))) == 1


def test_big_data_file_goes_through_the_store(tmp_path, monkeypatch):
    from seq2seq_fast.seq2seq.data import options

    src, tgt = write_corpus(tmp_path, lines=50)
    tsv = tmp_path / "corpus.tsv"
    tsv.write_text(
        "".join(
            f"{s}\t{t}\n"
            for s, t in zip(src.read_text().splitlines(), tgt.read_text().splitlines(), strict=True)
        )
    )
    config = TrainConfig(**TINY_CONFIG, data=str(tsv))
    assert not config.uses_token_store
    monkeypatch.setattr(options, "BIG_CORPUS_BYTES", tsv.stat().st_size - 1)
    assert config.uses_token_store
    assert not TrainConfig(**TINY_CONFIG, data=str(tsv), token_store=False).uses_token_store
    assert TrainConfig(**TINY_CONFIG, src=str(src), tgt=str(tgt)).uses_token_store
