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

from bench import harness, shapes, timing

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(shapes.PROVIDERS_ENV, None)
    env.update(
        {shapes.SIZE_ENV: "tiny", shapes.DEVICE_ENV: "cpu", shapes.THREADS_ENV: "1"}, **extra
    )
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
        env=_env(**{shapes.PROVIDERS_ENV: "fused,eager"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout
    assert " failed" not in proc.stdout and " error" not in proc.stdout


def _table(text: str, section: str) -> list[list[str]]:
    """The body rows of the markdown table under the heading that starts with ``section``."""
    lines = text.split(f"## {section}", 1)[1].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    rows = [line for line in lines[:end] if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


@pytest.mark.slow
def test_bench_bf16_runs_on_tiny_shapes():
    """python -m bench.bench_bf16 in CI: every table present and filled with numbers."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_bf16",
            "--size",
            "tiny",
            "--op-size",
            "tiny",
            "--rounds",
            "1",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    hardware = dict(_table(text, "hardware"))
    assert hardware["native bf16 products (oneDNN)"] in ("True", "False", "None")
    assert hardware["kernel instruction set (_C)"] in ("portable", "avx2", "avx512")
    training = _table(text, "training")
    assert [row[0] for row in training] == [
        "whole step",
        "encoder",
        "decoder",
        "output+loss",
        "optimizer",
    ]
    for _, fp32_ms, bf16_ms, ratio in training:
        assert float(fp32_ms) > 0 and float(bf16_ms) > 0 and float(ratio) > 0
    conversion = dict(_table(text, "conversion"))
    share = float(conversion["dtype-changing aten::copy_ share of step CPU time"].rstrip("%"))
    assert 0 <= share <= 100 and float(conversion["step CPU self time ms"]) > 0
    op = _table(text, "op")
    assert {(row[0], row[1]) for row in op} == {
        (s.name, m) for s in shapes.TINY_SHAPES for m in shapes.MODES
    }
    for row in op:
        assert float(row[2]) > 0 and float(row[3]) > 0 and float(row[4]) > 0
        assert row[5].endswith("B") and row[6].endswith("B")


@pytest.mark.slow
def test_report_quick_writes_tables_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.harness",
            "--quick",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--rounds",
            "2",
            "--min-sample-ms",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    assert text.startswith("## additive attention benchmark")
    for header in ("- CPU: ", "torch threads: 1", "commit: ", "#### summary"):
        assert header in text
    table_headers = [line for line in text.splitlines() if line.startswith("| provider |")]
    num_groups = len(shapes.TINY_SHAPES) * len(shapes.MODES) + 1  # + the decoding loop
    assert len(table_headers) == num_groups

    report = json.loads(out.read_text())
    assert set(report) == {"machine", "config", "groups"}
    for key in ("cpu", "cpu_cores", "torch_threads", "torch", "triton", "commit", "date_utc"):
        assert key in report["machine"]
    assert report["machine"]["torch_threads"] == 1
    groups = report["groups"]
    assert len(groups) == num_groups
    assert {(g["shape"]["name"], g["mode"]) for g in groups if g["kind"] == "op"} == {
        (s.name, m) for s in shapes.TINY_SHAPES for m in shapes.MODES
    }
    fused_runs = harness.provider_unavailable_reason("fused", "cpu", torch.float32) is None
    for group in groups:
        names = [p["provider"] for p in group["providers"]]
        expected = shapes.PROVIDERS if group["kind"] == "op" else harness.DECODE_PROVIDERS
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
    extra = harness.peak_extra_bytes(call, "cpu")
    assert scratch_elems * 4 <= extra < scratch_elems * 4 + 4096


def test_make_call_outputs_and_gradients_on_tiny_shape():
    shape = shapes.TINY_SHAPES[0]
    case = harness.make_case(shape)
    context, weights = harness.make_call("eager", "forward", case)()
    assert context.shape == (shape.batch, shape.q_len, shape.value_dim)
    assert weights.shape == (shape.batch, shape.q_len, shape.k_len)
    outputs = harness.make_call("eager", "forward+backward", case)()
    grads = outputs[2:]
    assert [g.shape for g in grads] == [t.shape for t in case.tensors]
    assert torch.equal(context, outputs[0].detach())


def test_summary_quartiles():
    s = timing.Summary.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.min, s.q1, s.median, s.q3, s.max, s.n) == (1.0, 2.0, 3.0, 4.0, 5.0, 5)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_fresh_process_rss_counts_temporaries_not_outputs():
    code = (
        "import torch\n"
        "from bench import harness\n"
        "def call():\n"
        "    scratch = torch.ones(2 << 20)\n"  # 8 MiB float32, freed before returning
        "    out = scratch[:16].clone()\n"
        "    del scratch\n"
        "    return (out,)\n"
        "call()\n"
        "print(harness.rss_peak_extra_bytes(call))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(**harness.RSS_PROBE_ENV),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    extra = int(proc.stdout.split()[-1])
    assert 7.5 * 2**20 <= extra < 9 * 2**20  # page-granular, and other pages come and go


def test_time_interleaved_rotates_order_and_counts_rounds():
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    samples = timing.time_interleaved(calls, "cpu", rounds=3, min_sample_s=0.0, warmup=2)
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up: each twice, in turn
    assert order[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # rotated every round
    for s in samples.values():
        assert len(s.wall_s) == len(s.cpu_s) == 3 and s.repeats == 1
        assert s.first_s >= 0 and min(s.wall_s) >= 0


def test_time_interleaved_repeats_short_calls_to_fill_a_sample():
    count = 0

    def call():
        nonlocal count
        count += 1

    samples = timing.time_interleaved({"x": call}, "cpu", rounds=2, min_sample_s=0.002, warmup=1)
    assert samples["x"].repeats > 1
    assert count == 1 + 2 * samples["x"].repeats


def test_ratio_summary_is_the_median_of_per_round_ratios():
    s = timing.ratio_summary([2.0, 9.0, 3.0], [1.0, 3.0, 3.0])  # ratios 2, 3, 1
    assert (s.median, s.min, s.max) == (2.0, 1.0, 3.0)
    with pytest.raises(ValueError):
        timing.ratio_summary([1.0], [1.0, 2.0])


def test_cpu_shapes_cut_only_the_batch_and_sizes_nest():
    for full, cpu in zip(shapes.FULL_SHAPES, shapes.CPU_SHAPES, strict=True):
        assert (full.q_len, full.k_len, full.hidden, full.value_dim) == (
            cpu.q_len,
            cpu.k_len,
            cpu.hidden,
            cpu.value_dim,
        )
        assert cpu.batch <= full.batch
    for device in ("cpu", "cuda"):
        full = shapes.shapes_for("full", device)
        assert set(shapes.shapes_for("quick", device)) < set(full)
        assert shapes.shapes_for("tiny", device) == shapes.TINY_SHAPES
    assert shapes.shapes_for("full", "cuda:1") == shapes.FULL_SHAPES
    assert shapes.train_sizes_for("quick") == (shapes.TRAIN_SIZES["small"],)
    with pytest.raises(ValueError, match="size must be one of"):
        shapes.shapes_for("huge", "cpu")


def test_shapes_are_defined_only_in_bench_shapes():
    # The report, the pytest-benchmark files, the training benchmarks and the GPU check take their
    # shapes and sizes from bench/shapes.py: no other file under bench/ defines or constructs one.
    import ast

    from bench import shapes as shapes_module

    constructors = {
        name
        for name, obj in vars(shapes_module).items()
        if isinstance(obj, type) and obj.__module__ == shapes_module.__name__
    }
    assert {"Shape", "DecodeShape", "TrainSize"} <= constructors
    offenders = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name == "shapes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in constructors:
                    offenders.append(f"{path.name}:{node.lineno} constructs {name}")
            elif isinstance(node, ast.ClassDef) and node.name.endswith(("Shape", "Size")):
                offenders.append(f"{path.name}:{node.lineno} defines {node.name}")
    assert not offenders, offenders


def test_time_interleaved_cpu_clock_excludes_waiting():
    # The cpu clock counts this process's CPU time: a call that sleeps costs wall time, not CPU.
    import time

    samples = timing.time_interleaved({"sleep": lambda: time.sleep(0.01)}, "cpu", rounds=2)
    s = samples["sleep"]
    assert min(s.wall_s) >= 0.009
    assert max(s.cpu_s) < 0.5 * min(s.wall_s)


def test_opennmt_side_by_side_parsing_and_ratio_direction():
    """translate_throughput --opennmt: OpenNMT-py's log and pieces read back, and the ratio is
    ours/OpenNMT-py in sentences/s (> 1 when ours takes less time)."""
    from bench import peer_opennmt, translate_throughput

    log = "[INFO] Total translation time (s): 1.2\n[INFO] Average translation time (ms): 2.5\n"
    assert peer_opennmt.translating_seconds(log, 400) == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="Average translation time"):
        peer_opennmt.translating_seconds("no report here", 400)
    assert peer_opennmt.detokenize("\u2581I t \u2581is \u2581here .") == "It is here."
    args = translate_throughput.parse_args(
        ["--checkpoint", "m.pt", "--corpus", "c.zip", "--opennmt", "o.pt", "--precisions", "fp32"]
    )
    args.beams, args.threads = [5], [1]
    ours = translate_throughput.key(
        {"precision": "fp32", "beam": 5, "threads": 1, "backend": "fused"}
    )
    onmt = translate_throughput.key(
        {"precision": translate_throughput.ONMT, "beam": 5, "threads": 1}
    )
    assert set(translate_throughput.key(c) for c in translate_throughput.configurations(args)) == {
        ours,
        onmt,
    }
    runs = {
        ours: [{"seconds": 2.0, "translate_seconds": 1.0}] * 3,
        onmt: [{"seconds": 6.0, "translate_seconds": 4.0}] * 3,
    }
    (ratio,) = translate_throughput.opennmt_ratios(runs, args).values()
    assert ratio == "3.00x wall, 4.00x past start-up"
