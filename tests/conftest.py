"""Test-session setup: run the Triton kernels through Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when ``seq2seq_fast`` first imports
its Triton module, so the variable must be set here, before any test module imports the package.
It is only set when CUDA is unavailable, so a GPU machine runs the real kernels.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each one takes its share of threads (and passes it on to
# the processes it starts). With torch's default, every worker runs an OpenMP team as wide as the
# machine, and the teams' spin-waits steal each other's cores: a small training loop ran 24x
# slower beside another worker than alone. Tests about thread counts set their own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _THREADS = max(1, (_CORES or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

# Token stores and trained tokenizers of runs without --cache-dir go to a per-user cache
# (~/.cache/seq2seq-fast): the tests' go to a temporary folder instead, never the real one.
if "SEQ2SEQ_FAST_CACHE_DIR" not in os.environ:
    os.environ["SEQ2SEQ_FAST_CACHE_DIR"] = tempfile.mkdtemp(prefix="seq2seq-fast-cache-")
    atexit.register(shutil.rmtree, os.environ["SEQ2SEQ_FAST_CACHE_DIR"], ignore_errors=True)

# Hypothesis profiles for the fuzz tests (tests/ops/test_fuzz.py). "ci" (the default) keeps the whole
# suite fast; ``pytest --hypothesis-profile=long`` runs many more examples per test. Test files
# scale their own example counts from the active profile's max_examples.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; the fuzz tests skip without it
    pass
else:
    _slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile(
        "ci", max_examples=60, deadline=None, suppress_health_check=_slow_ok, print_blob=True
    )
    settings.register_profile(
        "long", max_examples=2000, deadline=None, suppress_health_check=_slow_ok, print_blob=True
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The instruction sets the range sweeps covered in pytest-xdist's workers (the main process
# runs no test there), sent back through ``workeroutput`` (pytest_testnodedown).
_WORKER_ISAS: set[str] = set()


def _covered_isas() -> set[str]:
    import sys

    covered: set[str] = set()
    for name in ("tests.ops.test_range_sweep", "tests.ops.test_range_sweep_ops"):
        module = sys.modules.get(name)
        covered |= getattr(module, "COVERED_ISAS", set())
    return covered


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker
        workeroutput["covered_isas"] = sorted(_covered_isas())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_ISAS.update(getattr(node, "workeroutput", {}).get("covered_isas", ()))


# Test files that take minutes (a wheel built and installed, cross-compiles, training runs,
# whole-range sweeps): run first, so that pytest-xdist's workers do not end on them one by one
# while the other waits.
_LONG_FILES = (
    "tests/reliability/test_wheel.py",
    "tests/reliability/test_portability.py",
    "tests/seq2seq/test_convergence.py",
    "tests/reliability/test_bench.py",
    "tests/ops/test_range_sweep.py",
    "tests/ops/test_range_sweep_ops.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return _LONG_FILES.index(path) if path in _LONG_FILES else len(_LONG_FILES)

    items.sort(key=rank)  # (stable: each file's own order stays)


def pytest_terminal_summary(terminalreporter):
    """Say which CPU instruction sets the range sweeps ran on (tests/ops/test_range_sweep*.py)."""
    covered = _covered_isas() | _WORKER_ISAS
    if covered:
        order = [isa for isa in ("portable", "avx2", "avx512") if isa in covered]
        missing = [isa for isa in ("portable", "avx2", "avx512") if isa not in covered]
        line = "range sweep ran the CPU kernels on: " + ", ".join(order)
        if missing:
            line += (
                " (not on " + ", ".join(missing) + ": this CPU lacks them, or they were skipped)"
            )
        terminalreporter.write_line(line)
