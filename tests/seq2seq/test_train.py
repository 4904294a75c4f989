"""Training jobs: learning, exact resume, fixed seeds, checkpoints, and 2-process DDP (gloo)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from seq2seq_fast.seq2seq.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.train import train

TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=100,
    embed_size=16,
    hidden_size=32,
    batch_size=32,
    lr=1e-2,
    warmup_steps=10,
    backend="reference",
    progress=False,
    heatmap=False,
    threads=1,
)


# "The same" for losses: equal up to float32 rounding. BLAS kernels may round the last bit
# differently for differently aligned buffers (a new process, a reloaded model), so bit-equality
# across runs is not guaranteed by PyTorch on CPU; a resume that lost any state would be off by far
# more than this.
SAME = 1e-6


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(**(TINY | {"out": str(tmp_path)} | overrides))


def test_tiny_model_learns_short_reversal(tmp_path):
    """Stated bar: >= 90% exact sequences (lengths 2-5, 6 symbols) within 300 steps."""
    result = train(tiny_config(tmp_path, epochs=2, steps_per_epoch=150))
    assert result.metrics["seq_acc"] >= 0.90, result.metrics
    assert result.losses[-1] < result.losses[0] / 5


def test_fixed_seed_gives_the_same_run(tmp_path):
    a = train(tiny_config(tmp_path / "a", epochs=1, steps_per_epoch=15))
    b = train(tiny_config(tmp_path / "b", epochs=1, steps_per_epoch=15))
    c = train(tiny_config(tmp_path / "c", epochs=1, steps_per_epoch=15, seed=1))
    assert a.losses == pytest.approx(b.losses, rel=SAME, abs=0)
    assert a.losses != pytest.approx(c.losses, rel=1e-3)


@pytest.mark.parametrize("decoder", ["gnmt", "bahdanau"])
def test_resume_equals_uninterrupted(tmp_path, decoder):
    """Killed mid-epoch (after step 7 of 2x6) and resumed: the same losses and weights at the end."""
    config = tiny_config(
        tmp_path / "full", epochs=2, steps_per_epoch=6, decoder=decoder, dropout=0.1
    )
    full = train(config)
    partial_config = replace(config, out=str(tmp_path / "part"), stop_after_steps=7)
    partial = train(partial_config)
    assert partial.step == 7 and partial.losses == pytest.approx(full.losses[:7], rel=SAME, abs=0)
    resumed = train(
        TrainConfig(out=str(tmp_path / "part"), progress=False), resume=tmp_path / "part/model.pt"
    )
    assert resumed.step == 12
    assert partial.losses + resumed.losses == pytest.approx(full.losses, rel=SAME, abs=0)
    a = load_checkpoint(tmp_path / "full/model.pt")
    b = load_checkpoint(tmp_path / "part/model.pt")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 12


def test_checkpoint_contents_and_model_reload(tmp_path):
    result = train(tiny_config(tmp_path, epochs=1, steps_per_epoch=5))
    payload = load_checkpoint(result.checkpoint)
    for key in (
        "model_config",
        "train_config",
        "src_vocab",
        "tgt_vocab",
        "model",
        "optimizer",
        "scheduler",
        "rng",
        "epoch",
        "step",
        "metrics",
    ):
        assert key in payload
    assert payload["step"] == 5 and payload["epoch"] == 1
    model, src_vocab, _, _ = load_model(result.checkpoint)
    assert len(src_vocab) == 10 and not model.training
    assert not list(tmp_path.glob(".model.pt.tmp*"))  # the atomic write left nothing behind


def test_corrupt_truncated_and_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        load_checkpoint(garbage)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(CheckpointError, match="not a seq2seq-fast checkpoint"):
        load_checkpoint(foreign)
    result = train(tiny_config(tmp_path / "run", epochs=1, steps_per_epoch=2))
    data = result.checkpoint.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        load_checkpoint(truncated)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint({"a": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint({"a": Unpicklable()}, path)
    assert torch.load(path) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_fused_backend_without_kernel_is_a_clear_error(tmp_path, monkeypatch):
    from seq2seq_fast.ops import _library as ops
    from seq2seq_fast.seq2seq.config import TrainError

    monkeypatch.setattr(ops, "CPU_KERNEL_ERROR", "ImportError: not built (test)")
    with pytest.raises(TrainError, match="--backend fused is not available"):
        train(tiny_config(tmp_path, backend="fused", epochs=1, steps_per_epoch=1))


def test_ddp_two_processes_gloo(tmp_path):
    """torchrun --nproc_per_node=2 on CPU (gloo): a few steps, one checkpoint, replicas agree."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "seq2seq_fast",
        "train",
        "--out",
        str(out),
        "--epochs",
        "1",
        "--steps-per-epoch",
        "4",
        "--batch-size",
        "16",
        "--hidden-size",
        "16",
        "--embed-size",
        "8",
        "--vocab-size",
        "6",
        "--min-len",
        "2",
        "--max-len",
        "4",
        "--heldout-size",
        "20",
        "--backend",
        "reference",
        "--no-progress",
        "--no-heatmap",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 process(es)" in proc.stdout
    payload = load_checkpoint(out / "model.pt")
    assert payload["world_size"] == 2 and payload["step"] == 4
    assert isinstance(payload["rng"], list) and len(payload["rng"]) == 2
    # The two ranks drew different batches.
    assert not torch.equal(payload["rng"][0]["data"], payload["rng"][1]["data"])


def _toy_corpus(path):
    words = ["red", "blue", "green", "cat", "dog", "big"]
    french = ["rouge", "bleu", "vert", "chat", "chien", "grand"]
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(200):
        idx = torch.randint(0, 6, (2,), generator=g).tolist()
        lines.append(" ".join(words[i] for i in idx) + "\t" + " ".join(french[i] for i in idx))
    lines.insert(5, "a line without a tab")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_translate_resume_equals_uninterrupted(tmp_path):
    corpus = _toy_corpus(tmp_path / "toy.tsv")
    config = tiny_config(
        tmp_path / "full",
        task="translate",
        data=str(corpus),
        epochs=2,
        spm_vocab_size=40,
        valid_fraction=0.1,
        test_fraction=0.1,
        eval_size=20,
        dropout=0.1,
    )
    full = train(config)
    part = train(replace(config, out=str(tmp_path / "part"), stop_after_steps=full.step // 2 + 1))
    resumed = train(TrainConfig(progress=False), resume=tmp_path / "part/model.pt")
    assert part.losses + resumed.losses == pytest.approx(full.losses, rel=SAME, abs=0)
    assert resumed.metrics["test_bleu"] == full.metrics["test_bleu"]


def test_translate_task_end_to_end(tmp_path):
    corpus = _toy_corpus(tmp_path / "toy.tsv")
    config = tiny_config(
        tmp_path / "run",
        task="translate",
        data=str(corpus),
        epochs=1,
        spm_vocab_size=40,
        valid_fraction=0.1,
        test_fraction=0.1,
        heatmap=True,
    )
    result = train(config)
    assert 0.0 <= result.metrics["test_bleu"] <= 100.0 and "valid_bleu" in result.metrics
    assert result.heatmap is not None and result.heatmap.stat().st_size > 1000
    assert load_checkpoint(result.checkpoint)["metrics"]["test_bleu"] == result.metrics["test_bleu"]


def test_translate_official_splits_used_as_given(tmp_path, capsys):
    lines = _toy_corpus(tmp_path / "toy.tsv").read_text().splitlines()
    files = {name: tmp_path / f"{name}.tsv" for name in ("train", "valid", "test")}
    files["train"].write_text("\n".join(lines[:150]) + "\n")  # one malformed line among them
    files["valid"].write_text("\n".join(lines[150:175]) + "\n")
    # A word of the test split only: the vocabularies are trained on the training split.
    files["test"].write_text("\n".join(lines[175:]) + "\nzebra zebra\tzebre zebre\n")
    config = tiny_config(
        tmp_path / "run",
        task="translate",
        data=str(files["train"]),
        valid_data=str(files["valid"]),
        test_data=str(files["test"]),
        epochs=1,
        spm_vocab_size=40,
        eval_size=1000,
    )
    result = train(config)
    out = capsys.readouterr().out
    assert "official splits: 149 train / 25 valid / 27 test pairs" in out
    assert "BLEU: sacreBLEU nrefs:1|" in out and "tok:13a" in out
    assert 0.0 <= result.metrics["test_bleu"] <= 100.0 and "valid_bleu" in result.metrics
    src_vocab = load_model(result.checkpoint)[1]
    assert not any("z" in piece for piece in src_vocab.pieces(range(len(src_vocab))))
    with pytest.raises(TrainError, match="--valid-data"):
        TrainConfig(task="translate", data=str(files["train"]), test_data=str(files["test"]))


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "seq2seq_fast", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "train" in proc.stdout and "plot-attention" in proc.stdout


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path, monkeypatch):
    """A Ctrl-C mid-epoch saved nothing (everything since the epoch's start was lost) and said
    only "interrupted". The step it falls in now finishes, model.pt is written at that step, the
    error says how to resume, and the resumed run ends as an uninterrupted one."""
    import signal

    import seq2seq_fast.seq2seq.train as training
    from seq2seq_fast.seq2seq.train import TrainInterrupted

    config = tiny_config(tmp_path / "full", epochs=2, steps_per_epoch=6)
    full = train(config)
    real_step, calls = training.train_step, []

    def step_with_ctrl_c(job, batch):
        calls.append(job.step)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)  # (Python runs the handler before returning)
        return real_step(job, batch)

    monkeypatch.setattr(training, "train_step", step_with_ctrl_c)
    with pytest.raises(TrainInterrupted, match=r"interrupted at step 4 .*--resume .*model\.pt"):
        train(replace(config, out=str(tmp_path / "part")))
    monkeypatch.setattr(training, "train_step", real_step)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert load_checkpoint(tmp_path / "part/model.pt")["step"] == 4
    resumed = train(
        TrainConfig(out=str(tmp_path / "part"), progress=False), resume=tmp_path / "part/model.pt"
    )
    assert resumed.step == 12
    assert resumed.losses == pytest.approx(full.losses[4:], rel=SAME, abs=0)
