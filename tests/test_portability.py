"""The C++ extension's sources compile for aarch64 (the portable kernels, no x86 SIMD).

No aarch64 machine or emulator is at hand here, so this checks the build, not the results: every
file in csrc/ is compiled (not linked) for aarch64-linux-gnu with Zig's bundled clang against the
installed torch headers, with warnings as errors for our own sources. The results of the portable
kernels are tested on this machine (SEQ2SEQ_FAST_ISA=portable, tests/test_ops.py), where they run
the same C++ code.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "csrc").glob("*.cpp"))

ziglang = pytest.importorskip("ziglang", reason="ziglang (the cross compiler) is not installed")


def _omp_header_dir(tmp_path: pathlib.Path) -> pathlib.Path | None:
    """Zig's clang ships no omp.h; the host compiler's one is target-independent C."""
    try:
        out = subprocess.run(
            ["c++", "-print-file-name=include"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return None
    header = pathlib.Path(out) / "omp.h"
    if not header.is_file():
        return None
    target = tmp_path / "omp"
    target.mkdir()
    shutil.copy(header, target / "omp.h")
    return target


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_for_aarch64(source, tmp_path):
    from torch.utils.cpp_extension import include_paths

    omp = _omp_header_dir(tmp_path)
    if omp is None:
        pytest.skip("no omp.h from the host compiler")
    cmd = [
        sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu", "-std=c++17",
        "-O2", "-fopenmp", "-c", str(source), "-o", str(tmp_path / "out.o"),
        "-DTORCH_EXTENSION_NAME=_C", "-I", sysconfig.get_paths()["include"],
        "-isystem", str(omp),
        # our sources: every warning is an error; torch's and Python's headers are -isystem
        "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
    ]  # fmt: skip
    for path in include_paths():
        cmd += ["-isystem", path]
    # pyconfig.h redefines _POSIX_C_SOURCE after the target's libc headers: not ours to fix
    cmd += ["-Wno-macro-redefined"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    header = (tmp_path / "out.o").read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert int.from_bytes(header[18:20], "little") == 183  # e_machine = EM_AARCH64
