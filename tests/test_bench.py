"""The benchmarks cannot rot: the pytest-benchmark files and the report run on tiny shapes.

Nothing here asserts a time; only that every provider runs, and that the report is well formed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import harness as sb

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(sb.PROVIDERS_ENV, None)
    env.update({sb.SIZE_ENV: "tiny", sb.DEVICE_ENV: "cpu", sb.THREADS_ENV: "1"}, **extra)
    return env


@pytest.mark.slow
def test_benchmark_files_run_on_tiny_shapes():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "bench/",
            "--benchmark-disable",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        # torch.compile's provider is left to the report test below: compiling is most of the time
        env=_env(**{sb.PROVIDERS_ENV: "fused,eager"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout
    assert " failed" not in proc.stdout and " error" not in proc.stdout


@pytest.mark.slow
def test_report_quick_writes_tables_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--quick", "--size", "tiny", "--device", "cpu",
         "--threads", "1", "--rounds", "2", "--min-sample-ms", "1", "--json", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    assert text.startswith("## additive attention benchmark")
    for header in ("- CPU: ", "torch threads: 1", "commit: ", "#### summary"):
        assert header in text
    table_headers = [line for line in text.splitlines() if line.startswith("| provider |")]
    num_groups = len(sb.TINY_SHAPES) * len(sb.MODES) + 1  # + the decoding loop
    assert len(table_headers) == num_groups

    report = json.loads(out.read_text())
    assert set(report) == {"machine", "config", "groups"}
    for key in ("cpu", "cpu_cores", "torch_threads", "torch", "triton", "commit", "date_utc"):
        assert key in report["machine"]
    assert report["machine"]["torch_threads"] == 1
    groups = report["groups"]
    assert len(groups) == num_groups
    assert {(g["shape"]["name"], g["mode"]) for g in groups if g["kind"] == "op"} == {
        (s.name, m) for s in sb.TINY_SHAPES for m in sb.MODES
    }
    fused_runs = sb.provider_unavailable_reason("fused", "cpu", torch.float32) is None
    for group in groups:
        names = [p["provider"] for p in group["providers"]]
        expected = sb.PROVIDERS if group["kind"] == "op" else sb.DECODE_PROVIDERS
        assert sorted(names) == sorted(expected)
        assert group["tanh_count"] > 0 and group["tanh_work"] >= group["tanh_count"]
        for p in group["providers"]:
            if p["skipped"] is not None:
                assert p["provider"] == "fused" and not fused_runs
                continue
            assert len(p["times_s"]) == 2
            assert p["summary"]["median"] > 0 and p["gtanh_per_s"] > 0
            assert p["peak_extra_bytes"] >= 0
        if fused_runs:
            assert "fused/eager" in group["speedups"]


def test_cpu_peak_extra_bytes_counts_temporaries_not_outputs():
    scratch_elems = 1 << 18  # a 1 MiB float32 temporary, freed before the call returns

    def call():
        scratch = torch.ones(scratch_elems)
        out = scratch[:16].clone()
        del scratch
        return (out,)

    call()
    extra = sb.peak_extra_bytes(call, "cpu")
    assert scratch_elems * 4 <= extra < scratch_elems * 4 + 4096


def test_make_call_outputs_and_gradients_on_tiny_shape():
    shape = sb.TINY_SHAPES[0]
    case = sb.make_case(shape)
    context, weights = sb.make_call("eager", "forward", case)()
    assert context.shape == (shape.batch, shape.q_len, shape.value_dim)
    assert weights.shape == (shape.batch, shape.q_len, shape.k_len)
    outputs = sb.make_call("eager", "forward+backward", case)()
    grads = outputs[2:]
    assert [g.shape for g in grads] == [t.shape for t in case.tensors]
    assert torch.equal(context, outputs[0].detach())


def test_summary_quartiles():
    s = sb.Summary.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.min, s.q1, s.median, s.q3, s.max, s.n) == (1.0, 2.0, 3.0, 4.0, 5.0, 5)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_fresh_process_rss_counts_temporaries_not_outputs():
    code = (
        "import torch\n"
        "from bench import harness as sb\n"
        "def call():\n"
        "    scratch = torch.ones(2 << 20)\n"  # 8 MiB float32, freed before returning
        "    out = scratch[:16].clone()\n"
        "    del scratch\n"
        "    return (out,)\n"
        "call()\n"
        "print(sb.rss_peak_extra_bytes(call))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(**sb.RSS_PROBE_ENV),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    extra = int(proc.stdout.split()[-1])
    assert 7.5 * 2**20 <= extra < 9 * 2**20  # page-granular, and other pages come and go
