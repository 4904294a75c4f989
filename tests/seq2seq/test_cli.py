"""The ``seq2seq-fast`` command end to end on a tiny checkpoint; bad inputs give clean errors."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from seq2seq_fast.seq2seq.cli import main

TRAIN_ARGS = [
    "train",
    "--epochs",
    "1",
    "--steps-per-epoch",
    "120",
    "--batch-size",
    "32",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "10",
    "--hidden-size",
    "32",
    "--embed-size",
    "16",
    "--vocab-size",
    "6",
    "--min-len",
    "2",
    "--max-len",
    "5",
    "--heldout-size",
    "50",
    "--backend",
    "reference",
    "--no-progress",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_run")
    assert main([*TRAIN_ARGS, "--out", str(out)]) == 0
    return out / "model.pt"


def test_train_prints_accuracy_and_paths(checkpoint, capsys):
    # The fixture's run already printed; check its files and rerun nothing.
    assert checkpoint.exists()
    assert (checkpoint.parent / "attention.png").stat().st_size > 1000


def test_train_output_lines(tmp_path, capsys):
    args = [*TRAIN_ARGS, "--out", str(tmp_path), "--steps-per-epoch", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out sequence accuracy" in out
    assert f"checkpoint: {tmp_path / 'model.pt'}" in out
    assert f"attention heatmap: {tmp_path / 'attention.png'}" in out


def test_translate_sentence_greedy_and_beam(checkpoint, capsys):
    assert main(["translate", "--checkpoint", str(checkpoint), "a b c d"]) == 0
    greedy = capsys.readouterr().out.strip()
    assert main(["translate", "--checkpoint", str(checkpoint), "--beam", "3", "a b c d"]) == 0
    beam = capsys.readouterr().out.strip()
    assert greedy == "d c b a" and beam == "d c b a"


def test_translate_reads_stdin(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a b\n\nc d e\n"))
    assert main(["translate", "--checkpoint", str(checkpoint)]) == 0
    out, err = capsys.readouterr()
    # One output line per input line: the empty line stays (empty), with a warning.
    assert out.splitlines() == ["b a", "", "e d c"]
    assert "warning: line 2: empty" in err


def test_plot_attention_writes_png(checkpoint, tmp_path, capsys):
    target = tmp_path / "plots" / "heat.png"
    assert main(["plot-attention", "--checkpoint", str(checkpoint), "abcd", "-o", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(target) in capsys.readouterr().out


def test_plot_attention_without_an_ending_writes_and_names_png(checkpoint, tmp_path, capsys):
    target = tmp_path / "heat"
    assert main(["plot-attention", "--checkpoint", str(checkpoint), "abcd", "-o", str(target)]) == 0
    written = tmp_path / "heat.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"attention heatmap: {written}" in capsys.readouterr().out


def test_plot_attention_with_an_unknown_ending_is_named(checkpoint, tmp_path, capsys):
    target = tmp_path / "heat.pgn"
    assert main(["plot-attention", "--checkpoint", str(checkpoint), "abcd", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"-o {target}: no image format has the ending '.pgn'" in err and ".png" in err
    assert not target.exists()


def test_dash_means_the_standard_streams(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a b c\n"))
    assert main(["translate", "--checkpoint", str(checkpoint), "-i", "-", "-o", "-"]) == 0
    assert capsys.readouterr().out.splitlines() == ["c b a"]


def test_version_names_the_package_and_torch(capsys):
    from seq2seq_fast import __version__

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert (
        capsys.readouterr().out.strip() == f"seq2seq-fast {__version__} (torch {torch.__version__})"
    )


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated", "foreign"])
def test_bad_checkpoints_give_one_error_line(checkpoint, tmp_path, capsys, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "garbage":
        path.write_bytes(b"\x00" * 100)
    elif kind == "truncated":
        path.write_bytes(checkpoint.read_bytes()[:5000])
    elif kind == "foreign":
        torch.save({"weights": torch.ones(3)}, path)
    assert main(["translate", "--checkpoint", str(path), "a b"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(path) in err and "Traceback" not in err


def test_bad_corpus_gives_one_error_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--task", "translate", "--data", str(empty), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no usable sentence pairs" in err and "Traceback" not in err
    assert main(["train", "--task", "translate", "--out", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().err


def test_console_script_errors_cleanly(tmp_path):
    """The real process: nonzero exit, one message, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "seq2seq_fast",
            "translate",
            "--checkpoint",
            str(tmp_path / "nope.pt"),
            "a",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "checkpoint not found" in proc.stderr and "Traceback" not in proc.stderr


def test_console_script_translates_and_exits_cleanly(checkpoint, tmp_path):
    """The real process through ``console_main`` (which freezes the garbage collector before the
    interpreter exits): status 0, every line written to stdout and to --output, nothing lost."""
    source = tmp_path / "in.txt"
    source.write_text("a b\n\nc d e\n")
    target = tmp_path / "out.txt"
    base = [sys.executable, "-m", "seq2seq_fast", "translate", "--checkpoint", str(checkpoint)]
    proc = subprocess.run(
        [*base, "--input", str(source)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["b a", "", "e d c"]
    proc = subprocess.run(
        [*base, "--input", str(source), "--output", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert target.read_text().splitlines() == ["b a", "", "e d c"]


def test_console_script_trains_without_exit_noise(tmp_path):
    """Training imports Triton, whose nanobind bindings report objects still alive at exit as
    leaks: freezing the collector must not keep Triton's objects from being collected."""
    args = [*TRAIN_ARGS, "--steps-per-epoch", "3", "--no-heatmap", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "seq2seq_fast", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "held-out sequence accuracy" in proc.stdout
    assert "leaked" not in proc.stderr and "nanobind" not in proc.stderr, proc.stderr[-2000:]
