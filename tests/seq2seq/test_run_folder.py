"""Run folders and the options of a second run: a new run never overwrites another one silently,
``--resume`` applies the options that may change mid-run and refuses the others by name, and
``--init-from`` takes the model shape from its checkpoint."""

from __future__ import annotations

import pytest
import yaml

from seq2seq_fast.seq2seq.checkpoint import load_checkpoint
from seq2seq_fast.seq2seq.cli import main
from seq2seq_fast.seq2seq.config import CHANGE, FIXED, TrainConfig, TrainError, option_of
from seq2seq_fast.seq2seq.metrics import read_metrics

TINY = [
    "--vocab-size", "6", "--min-len", "2", "--max-len", "5", "--heldout-size", "20",
    "--embed-size", "16", "--hidden-size", "24", "--batch-size", "16", "--lr", "1e-2",
    "--warmup-steps", "5", "--backend", "reference", "--no-progress", "--no-heatmap",
    "--threads", "1", "--steps-per-epoch", "6",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished reversal run of 2 epochs (12 steps)."""
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *TINY, "--epochs", "2", "--out", str(out)]) == 0
    return out


def _copy_run(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "copy")


def test_a_new_run_into_a_run_folder_is_refused_and_nothing_is_touched(run, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    metrics = read_metrics(run)
    assert main(["train", *TINY, "--epochs", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "model.pt" in err and "metrics.jsonl" in err
    assert "--overwrite" in err and f"--resume {run / 'model.pt'}" in err
    assert "Traceback" not in err
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    assert read_metrics(run) == metrics


def test_overwrite_replaces_the_earlier_run(run, tmp_path, capsys):
    out = _copy_run(run, tmp_path)
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out), "--overwrite"]) == 0
    assert "removed the earlier run's" in capsys.readouterr().out
    assert load_checkpoint(out / "model.pt")["step"] == 6
    assert max(r["step"] for r in read_metrics(out)) == 6  # a fresh log, not appended
    assert main(["train", "--resume", str(out / "model.pt"), "--overwrite"]) == 2
    assert "give one" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [
        ["--task", "translate", "--data", "no-such-corpus.tsv"],
        ["--hidden-size", "24", "--embed-size", "24", "--tie-embeddings"],
    ],
    ids=["missing corpus", "impossible model"],
)
def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_start(run, tmp_path, capsys, bad):
    out = _copy_run(run, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code = main(["train", *TINY, "--epochs", "1", *bad, "--out", str(out), "--overwrite"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "removed the earlier run" not in captured.out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_folder_without_a_run_is_used_as_it_is(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["train", *TINY, "--epochs", "1", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "model.pt").exists()


def test_resume_extends_epochs_and_switches_backend(run, tmp_path, capsys):
    out = _copy_run(run, tmp_path)
    code = main(["train", "--resume", str(out / "model.pt"), "--epochs", "3", "--patience", "5"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "resume: epochs 2 -> 3" in printed and "resume: patience 0 -> 5" in printed
    payload = load_checkpoint(out / "model.pt")
    assert payload["step"] == 18 and payload["train_config"]["epochs"] == 3
    assert payload["train_config"]["patience"] == 5
    steps = [r["step"] for r in read_metrics(out) if r["kind"] == "train"]
    assert steps == sorted(steps) and max(steps) <= 18  # appended, in order
    # after the canary stopped a run, it goes on with plain PyTorch
    dumped = _dump(capsys, "--resume", str(out / "model.pt"), "--backend", "auto")
    assert dumped["backend"] == "auto" and dumped["epochs"] == 3


def _dump(capsys, *argv):
    assert main(["train", *argv, "--dump-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_resume_refuses_options_that_cannot_change_by_name(run, capsys):
    before = load_checkpoint(run / "model.pt")["step"]
    argv = ["train", "--resume", str(run / "model.pt"), "--hidden-size", "48", "--lr", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--hidden-size 48 (checkpoint: 24)" in err and "--lr 0.5 (checkpoint: 0.01)" in err
    assert "Traceback" not in err
    assert load_checkpoint(run / "model.pt")["step"] == before
    # the same value as the checkpoint's is no change: accepted
    dumped = _dump(capsys, "--resume", str(run / "model.pt"), "--hidden-size", "24")
    assert dumped["hidden_size"] == 24


def test_every_option_has_a_resume_rule_and_the_run_options_may_change():
    from dataclasses import fields

    rules = {f.name: option_of(f).resume for f in fields(TrainConfig)}
    may_change = {
        "epochs", "time_budget_min", "threads", "backend", "compile", "eval_every", "eval_size",
        "eval_beam", "patience", "progress", "heatmap", "tensorboard", "save_every",
        "keep_checkpoints", "out",
    }  # fmt: skip
    assert all(rules[name] == CHANGE for name in may_change)
    for name in ("hidden_size", "decoder", "cell", "data", "src", "lr", "seed", "task"):
        assert rules[name] == FIXED


def test_resume_in_python_takes_changes(run, tmp_path):
    from seq2seq_fast.seq2seq.train import train

    out = _copy_run(run, tmp_path)
    result = train(resume=out / "model.pt", changes={"epochs": 3, "progress": False})
    assert result.step == 18
    with pytest.raises(TrainError, match="--decoder gnmt"):
        train(resume=out / "model.pt", changes={"decoder": "gnmt"})


def test_init_from_takes_the_shape_from_the_checkpoint(run, tmp_path, capsys):
    out = tmp_path / "tuned"
    argv = ["train", "--init-from", str(run / "model.pt"), "--out", str(out), "--epochs", "1"]
    # no shape flag given: the checkpoint's (hidden 24, embed 16), not the task's defaults
    assert main([*argv, "--no-progress", "--no-heatmap", "--threads", "1"]) == 0
    config = load_checkpoint(out / "model.pt")["train_config"]
    assert config["hidden_size"] == 24 and config["embed_size"] == 16
    assert main([*argv, "--cell", "lstm", "--embed-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "--cell lstm (checkpoint: gru)" in err and "--embed-size" not in err


def test_a_run_that_cannot_start_leaves_no_run_behind(tmp_path, capsys):
    src = tmp_path / "src.txt"
    src.write_text("a b\nc d\n")
    out = tmp_path / "run"
    argv = ["train", *TINY, "--out", str(out), "--src", str(src), "--tgt", str(tmp_path / "no")]
    assert main(argv) == 2
    assert "not found" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out)]) == 0  # not refused


def test_a_second_training_into_a_folder_in_use_is_refused(tmp_path, capsys):
    """Two trainings into one --out mixed their files (model.pt of one, config.yaml of the
    other, both in metrics.jsonl) and the second crashed on a size mismatch. While one holds
    the folder, another is refused by name and touches nothing."""
    from seq2seq_fast.seq2seq.distributed import setup_distributed
    from seq2seq_fast.seq2seq.train import run_folder_lock

    out = tmp_path / "run"
    with run_folder_lock(out, setup_distributed()):  # the first training, running
        assert main(["train", *TINY, "--epochs", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another training" in err and "Traceback" not in err
        assert list(out.iterdir()) == []  # (the lock is on the folder: no file of its own)
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out)]) == 0  # then it may
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_an_out_that_is_a_file_is_named(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("not a folder")
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out)]) == 2
    assert f"--out {out} is a file, not a folder" in capsys.readouterr().err
