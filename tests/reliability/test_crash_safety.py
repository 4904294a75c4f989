"""Crash-safe training: a run that dies while writing a checkpoint loses nothing already saved.

- A failure raised inside torch.save halfway through a checkpoint write (disk full) leaves the
  previous checkpoint intact and loadable, with no temporary file behind.
- A process SIGKILLed in the middle of writing (deterministically, from inside the write), and a
  run that checkpoints every step read concurrently and SIGKILLed at an arbitrary moment: every
  read of model.pt and the file left behind are complete checkpoints.
- Resuming from the surviving checkpoint, through the Python API and through
  ``seq2seq-fast train --resume``, continues with the same losses and ends with the same weights
  as a run that was never interrupted.
- A truncated checkpoint is refused on resume with a clear message, before anything is written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

train_module = pytest.importorskip("seq2seq_fast.seq2seq.train")
from seq2seq_fast.seq2seq.checkpoint import (  # noqa: E402
    CheckpointError,
    load_checkpoint,
    load_model,
)
from seq2seq_fast.seq2seq.train import TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=20,
    embed_size=12,
    hidden_size=16,
    batch_size=8,
    lr=1e-2,
    warmup_steps=2,
    progress=False,
    heatmap=False,
    threads=1,
    epochs=2,
    steps_per_epoch=4,
    dropout=0.1,
    save_every=2,
)


def tiny(out: Path, **overrides) -> TrainConfig:
    return TrainConfig(**(TINY | {"out": str(out)} | overrides))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run: 2 epochs x 4 steps, never interrupted."""
    return train(tiny(tmp_path_factory.mktemp("full")))


def assert_same_weights(path_a: Path, path_b: Path) -> None:
    a, b = load_checkpoint(path_a), load_checkpoint(path_b)
    assert a["step"] == b["step"] and a["epoch"] == b["epoch"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def leftovers(folder: Path) -> list[str]:
    # best.pt: the best evaluation so far, a checkpoint of its own (not a leftover); the run's
    # configuration and metrics log are the run's files too
    files = ("model.pt", "best.pt", "config.yaml", "metrics.jsonl")
    return sorted(p.name for p in folder.iterdir() if p.name not in files)


class DiskFull(OSError):
    pass


def test_failure_inside_the_save_keeps_the_last_checkpoint(tmp_path, monkeypatch, uninterrupted):
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *args, **kwargs):
        if ".model.pt.tmp" not in str(getattr(f, "name", "")):  # best.pt: not counted
            return real_save(obj, f, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] < 4:
            return real_save(obj, f, *args, **kwargs)
        # Saves: steps 2 and 4, end of epoch 1 (step 4), then step 6: half written, disk full.
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise DiskFull(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    out = tmp_path / "run"
    with pytest.raises(DiskFull):
        train(tiny(out))
    monkeypatch.setattr(torch, "save", real_save)

    # model.pt is the end-of-epoch-1 checkpoint, written after step 4.
    payload = load_checkpoint(out / "model.pt")
    assert payload["step"] == 4 and payload["epoch"] == 1 and payload["batch_in_epoch"] == 0
    load_model(out / "model.pt")
    assert leftovers(out) == [], "the half-written temporary file was left behind"

    resumed = train(TrainConfig(out=str(out), progress=False), resume=out / "model.pt")
    assert resumed.losses == uninterrupted.losses[4:]
    assert_same_weights(out / "model.pt", uninterrupted.checkpoint)


# The child trains with a checkpoint at every step; at save number KILL_AT it writes half of the
# checkpoint to the temporary file and SIGKILLs itself (no finally, no cleanup runs).
_KILL_SCRIPT = """
import os, signal, sys, io, torch
sys.path.insert(0, {root!r})
from seq2seq_fast.seq2seq.train import TrainConfig, train
real_save, calls = torch.save, [0]
def save(obj, f, *args, **kwargs):
    calls[0] += ".model.pt.tmp" in str(getattr(f, "name", ""))  # model.pt saves only
    if calls[0] == {kill_at} and ".model.pt.tmp" in str(getattr(f, "name", "")):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
train(TrainConfig(**{config!r}))
"""


def test_sigkill_mid_write_keeps_the_last_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "run"
    config = TINY | {"out": str(out), "save_every": 1}
    # Saves: after steps 1-4, at the end of epoch 1, after step 5, then (7th) after step 6: killed.
    script = _KILL_SCRIPT.format(root=str(ROOT), kill_at=7, config=config)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    payload = load_checkpoint(out / "model.pt")  # the 6th save: after step 5
    assert payload["step"] == 5
    load_model(out / "model.pt")
    # What the kill leaves: one partial temporary file, never mistaken for the checkpoint.
    assert all(name.startswith(".model.pt.tmp") for name in leftovers(out)), leftovers(out)

    resumed = train(TrainConfig(out=str(out), progress=False), resume=out / "model.pt")
    assert resumed.losses == uninterrupted.losses[5:]
    assert_same_weights(out / "model.pt", uninterrupted.checkpoint)
    assert leftovers(out) == [], "the next save removes the killed process's temporary file"


def test_readers_and_a_random_sigkill_always_see_a_whole_checkpoint(tmp_path):
    """While a run checkpoints every step, every read of model.pt gets a complete checkpoint,
    and so does the reader after the run is SIGKILLed at an arbitrary moment."""
    out = tmp_path / "run"
    config = TINY | {"out": str(out), "save_every": 1, "epochs": 50, "steps_per_epoch": 20}
    script = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + (
        f"from seq2seq_fast.seq2seq.train import TrainConfig, train\ntrain(TrainConfig(**{config!r}))\n"
    )
    snapshots: list[bytes] = []
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "model.pt").exists() and time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"training died: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.01)
        reading_until = time.monotonic() + 1.5
        while time.monotonic() < reading_until:
            snapshots.append((out / "model.pt").read_bytes())
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
    steps = set()
    for number, data in enumerate(snapshots):
        snapshot = tmp_path / f"snapshot-{number}.pt"
        snapshot.write_bytes(data)
        steps.add(load_checkpoint(snapshot)["step"])
    assert len(snapshots) >= 10 and len(steps) >= 2, (len(snapshots), steps)
    assert load_checkpoint(out / "model.pt")["step"] >= max(steps)
    load_model(out / "model.pt")


def test_cli_resume_continues_like_an_uninterrupted_run(tmp_path, uninterrupted, capsys):
    from seq2seq_fast.seq2seq.cli import main

    part = tmp_path / "part"
    first = train(replace(tiny(part), stop_after_steps=3))
    assert first.losses == uninterrupted.losses[:3]
    assert main(["train", "--resume", str(part / "model.pt"), "--no-progress"]) == 0
    capsys.readouterr()
    assert_same_weights(part / "model.pt", uninterrupted.checkpoint)


def test_truncated_checkpoint_is_refused_on_resume_before_anything_is_written(tmp_path):
    source = train(tiny(tmp_path / "src", epochs=1, steps_per_epoch=2)).checkpoint
    data = source.read_bytes()
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = bad_dir / "model.pt"
    bad.write_bytes(data[: len(data) * 2 // 3])
    before = bad.read_bytes()
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        train(TrainConfig(out=str(bad_dir), progress=False), resume=bad)
    assert bad.read_bytes() == before and sorted(os.listdir(bad_dir)) == ["model.pt"]
