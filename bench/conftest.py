"""pytest-benchmark files of seq2seq_fast: ``pytest bench/ --benchmark-only``.

Files here are named ``bench_<thing>.py`` and collected by the hook below. Their shapes come from
``bench/shapes.py`` and their inputs from ``bench/harness.py``, as the report's do. Knobs, shared
with ``python -m bench.harness``:

    SEQ2SEQ_FAST_BENCH_SIZE=tiny|quick|full   shape set (default full; tiny is what CI runs)
    SEQ2SEQ_FAST_BENCH_DEVICE=cpu|cuda        default: cuda when available
    SEQ2SEQ_FAST_BENCH_THREADS=N              torch.set_num_threads(N)
    SEQ2SEQ_FAST_BENCH_PROVIDERS=fused,eager  subset of fused,eager,compile
"""

from __future__ import annotations

import os

import pytest
import torch

from bench import shapes


def pytest_configure(config: pytest.Config) -> None:
    threads = os.environ.get(shapes.THREADS_ENV)
    if threads:
        torch.set_num_threads(int(threads))


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself; collect the rest here.
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def bench_device() -> str:
    return shapes.default_device()


@pytest.fixture(scope="session")
def bench_dtype() -> torch.dtype:
    return torch.float32
