"""bench/compile_check.py: the kernels compiled for sm_90 as the GPU would compile them.

The launchers run on meta tensors through a stand-in Triton driver (compile, no launch); the
check reads registers, occupancy, the tanh loop and the instruction kinds from the SASS. CI runs
the default cases under its own Triton, split over two processes.
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
compile_check = pytest.importorskip("bench.compile_check")
pytest.importorskip("triton")


def _entry(**changes):
    entry = {
        "shape": "gnmt-train",
        "dtype": "bf16",
        "tanh": "approx",
        "kernel": "_fwd_kernel",
        "registers": 160,
        "spill_bytes": 0,
        "blocks_per_sm": 3,
        "loop_local_memory": 0,
        "mufu_kinds": ["MUFU.EX2", "MUFU.TANH"],
        "mma": ["HMMA"],
    }
    return {**entry, **changes}


def test_problems_are_found():
    assert compile_check.problems(_entry()) == []
    assert "256 registers" in compile_check.problems(_entry(registers=256))[0]
    assert "local-memory" in compile_check.problems(_entry(loop_local_memory=2))[0]
    assert "2 blocks/SM" in compile_check.problems(_entry(blocks_per_sm=2))[0]
    assert "MUFU.TANH" in compile_check.problems(_entry(mufu_kinds=["MUFU.EX2"]))[0]
    assert "packed" in compile_check.problems(_entry(tanh="packed"))[0]
    product = _entry(dtype="fp32", tanh="product", mma=[], mufu_kinds=["MUFU.EX2", "MUFU.TANH"])
    assert "product path" in compile_check.problems(product)[0]
    assert "MMA" in compile_check.problems(_entry(mma=[]))[0]
    assert compile_check.blocks_per_sm(168, 4, 40960) == 3  # 65536 / (168 * 128)
    assert compile_check.blocks_per_sm(170, 4, 0) == 2  # rounded up to 176 per thread
    assert compile_check.blocks_per_sm(64, 4, 100 * 1024) == 2  # shared memory bound


SIDE_ENV = "SEQ2SEQ_FAST_TRITON_SIDE"  # a --target install of the GPU's Triton (3.6)


def _run_default_cases(tmp_path, env: dict) -> tuple[list[dict], str]:
    """The default cases, split over two processes (CI has two cores); entries and versions."""
    count = len(compile_check.QUICK)
    halves = [",".join(str(i) for i in range(count) if i % 2 == part) for part in (0, 1)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.compile_check",
                "--cases",
                cases,
                "--json",
                str(tmp_path / f"part{part}.json"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for part, cases in enumerate(halves)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    entries, versions = [], set()
    for part, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, output[-4000:]
        report = json.loads((tmp_path / f"part{part}.json").read_text())
        entries += report["entries"]
        versions.add(report["triton"])
    assert len(entries) == 2 * count  # the forward and the grad kernel of every case
    for entry in entries:
        assert entry["problems"] == [], entry
        assert entry["registers"] <= 255 and entry["loop_local_memory"] == 0
        if entry["kernel"] == "_fwd_kernel":
            assert entry["blocks_per_sm"] >= 3, entry
        if entry["tanh"] == "approx":
            assert "MUFU.TANH" in entry["mufu_kinds"], entry
    kinds = {(e["dtype"], e["tanh"]) for e in entries}
    assert kinds == {("bf16", "approx"), ("fp32", "product"), ("bf16", "packed")}
    (version,) = versions
    return entries, version


@pytest.mark.slow
def test_kernels_compile_for_sm90_as_the_gpu_would(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run_default_cases(tmp_path, env)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get(SIDE_ENV),
    reason=f"{SIDE_ENV} unset: no side Triton "
    "(bench/triton_side_install.sh installs the GPU machine's)",
)
def test_kernels_compile_under_the_gpu_machines_triton(tmp_path):
    import triton

    side = os.environ[SIDE_ENV]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (side, env.get("PYTHONPATH")) if p)
    _, version = _run_default_cases(tmp_path, env)
    assert version != triton.__version__, f"the side install did not take effect ({version})"
