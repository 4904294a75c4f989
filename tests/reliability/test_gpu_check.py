"""bench/gpu_check.py: the GPU check must come back with a table whatever fails.

The CPU dry run (tiny shapes, Triton interpreter) with a forced failure proves the guards and
that the summary still prints; the target verdicts are checked on synthetic reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

gpu_check = pytest.importorskip("bench.gpu_check")
gpu_targets = pytest.importorskip("bench.gpu_targets")


def _row(shape, dims, dtype, mode, fused=None, compile_=None, kernel=None, ok=True, peak=None):
    row = {"shape": shape, "dims": list(dims), "dtype": dtype, "mode": mode}
    if ok is not None:
        row["correct"] = {"ok": ok, "worst": "context 1e-1 (allowed 1e-3)", "errors": {}}
    if fused is not None:
        row["fused"] = {"ms": fused, "kernel_ms": kernel, "peak_mib": peak}
    if compile_ is not None:
        row["compile"] = {"ms": compile_}
    return row


def test_stage_failure_is_recorded_and_written(tmp_path):
    args = gpu_check.parse_args(["--dry-run", "--out-dir", str(tmp_path)])
    check = gpu_check.Check(args)
    with check.stage("probes") as record:
        record["before"] = 1
        raise ValueError("boom")
    with check.stage("benchmark") as record:  # the next stage still runs
        record["ran"] = True
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"]["probes"]["status"].startswith("FAILED: ValueError: boom")
    assert report["stages"]["benchmark"]["ran"] is True
    assert report["stages"]["benchmark"]["status"] == "done"
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert "probes FAILED: ValueError: boom" in summary and "targets" in summary


def test_targets_verdicts():
    train, decode = (128, 50, 50, 1024, 1024), (1280, 1, 66, 1024, 1024)
    rows = [
        _row("gnmt-train", train, "bf16", "forward", fused=1.0, compile_=2.5, kernel=0.02),
        _row("gnmt-train", train, "fp32", "forward", fused=1.0, compile_=1.2),
        _row("gnmt-train", train, "bf16", "forward+backward", fused=1.0, compile_=9.0, ok=False),
        # 2 bytes x 1280 x 66 x 2048 = 346 MB of keys + values in 0.1 ms: 3.46 TB/s, 80% of 4.3
        _row("decode-step", decode, "bf16", "forward", fused=0.2, compile_=0.3, kernel=0.1),
    ]
    report = {"rows": rows, "stages": {"bandwidth": {"copy_bytes_per_s": 4.3e12}}}
    lines = "\n".join(gpu_targets.target_lines(report))
    assert "T1 gnmt-train bf16 fwd >= 2x compile: 2.50x: met" in lines
    # 327.68e6 tanh in 0.02 ms = 1.6e16/s: far past the ceiling, so met
    assert "T2 gnmt-train bf16 fwd >= 50% tanh ceiling:" in lines and "%: met" in lines
    assert "T3 gnmt-train fp32 fwd >= 1.5x compile: 1.20x: MISSED" in lines
    assert "T4 gnmt-train bf16 fwd+bwd >= 2x compile: MISSED (incorrect" in lines
    assert "T4 gnmt-train fp32 fwd+bwd >= 2x compile: unmeasured" in lines
    assert "T5 decode-step bf16 fwd keys+values >= 70% of copy bandwidth: 80%: met" in lines
    assert "T5 decode-step fp32 fwd keys+values >= 70% of copy bandwidth: unmeasured" in lines
    assert gpu_targets.any_failure(report)  # the incorrect row fails the check
    assert not gpu_targets.any_failure({"rows": rows[:2]})


def test_memory_target():
    dims = (4, 10, 20, 64, 32)
    pairs_bytes = 16 * 4 * 10 * 20
    row = _row("x", dims, "fp32", "forward", fused=1.0, peak=pairs_bytes / 2**20)
    assert "T6" in gpu_targets._memory_lines([row])[0]
    assert gpu_targets._memory_lines([row])[0].endswith("met")
    row["fused"]["peak_mib"] = 64 * 4 * 10 * 20 * 64 / 2**20  # the [B,Tq,Tk,H] tensor, fp32
    assert gpu_targets._memory_lines([row])[0].endswith("MISSED")


@pytest.mark.triton
def test_dry_run_with_a_failing_probe_still_prints_the_summary(tmp_path):
    """bench/gpu_check.sh --dry-run (CPU, interpreter) with the probe stage forced to fail."""
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself in a dry run
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "gpu_check.sh"),
            "--dry-run",
            "--inject-failure",
            "probes",
            "--shapes",
            "tiny-decode-step",
            "--max-rows",
            "1",
            "--no-sweep",
            "--skip-tests",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    tail = output.strip().splitlines()
    assert any(line.startswith("SUMMARY") for line in tail[-30:]), output[-3000:]
    assert tail[-1].lstrip().startswith("T6"), tail[-1]  # the summary is printed last
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"]["probes"]["status"].startswith("FAILED: RuntimeError: injected")
    assert report["stages"]["benchmark"]["status"] == "done"
    (row,) = report["rows"]
    assert row["shape"] == "tiny-decode-step" and row["correct"]["ok"] is True
    assert row["fused"]["ms"] > 0 and row["compile"]["ms"] > 0
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert "probes FAILED" in summary and "tiny-decode-step" in summary
    assert (tmp_path / "gpu_check.log").exists()
