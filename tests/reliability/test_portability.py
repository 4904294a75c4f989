"""The CPU kernels away from this machine's build: aarch64, and each table against plain loops.

- Every file in csrc/ (the ops and their runtime) and csrc/kernels/ (the kernel tables) compiles for aarch64-linux-gnu with Zig's bundled clang against the
  installed torch headers, warnings as errors for our own sources (the build of the extension).
- tests/kernel_harness.cpp checks every function of the kernel tables (csrc/kernels/kernels.h: packing,
  exp, scores and the backward's pass on both tanh paths, the value-side products) against plain
  double-precision loops, without torch: built here with the host compiler for every table this CPU
  runs (portable, AVX2, AVX-512), and cross-built for aarch64 (musl, static) and run under
  qemu-aarch64, where the portable tables are what the extension uses.

The full extension (the torch-facing ops, csrc/*.cpp) is tested on aarch64 only
as far as compiling: running it there needs an aarch64 Python and torch. Its portable path runs
here under SEQ2SEQ_FAST_ISA=portable (tests/ops/test_ops.py).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES_KERNELS = sorted((ROOT / "csrc" / "kernels").glob("*.cpp"))
SOURCES = sorted((ROOT / "csrc").glob("*.cpp")) + SOURCES_KERNELS

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
        sys.executable,
        "-m",
        "ziglang",
        "c++",
        "-target",
        "aarch64-linux-gnu",
        "-std=c++17",
        "-O2",
        "-fopenmp",
        "-c",
        str(source),
        "-o",
        str(tmp_path / "out.o"),
        "-DTORCH_EXTENSION_NAME=_C",
        "-I",
        sysconfig.get_paths()["include"],
        "-isystem",
        str(omp),
        # our sources: every warning is an error; torch's and Python's headers are -isystem
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unused-parameter",
    ]
    for path in include_paths():
        cmd += ["-isystem", path]
    # pyconfig.h redefines _POSIX_C_SOURCE after the target's libc headers: not ours to fix
    cmd += ["-Wno-macro-redefined"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    header = (tmp_path / "out.o").read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert int.from_bytes(header[18:20], "little") == 183  # e_machine = EM_AARCH64


HARNESS = ROOT / "tests" / "kernel_harness.cpp"


def _run_harness(cmd_prefix: list[str], binary: pathlib.Path) -> str:
    result = subprocess.run([*cmd_prefix, str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "all " in result.stdout and " checks passed" in result.stdout, result.stdout
    return result.stdout


def test_kernel_tables_match_plain_loops_here(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    binary = tmp_path / "harness"
    cmd = [
        compiler,
        "-std=c++17",
        "-O2",
        "-fno-math-errno",
        "-I",
        str(ROOT / "csrc"),
        str(HARNESS),
        *map(str, SOURCES_KERNELS),
        "-o",
        str(binary),
        "-lm",
    ]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    out = _run_harness([], binary)
    assert "ok portable float" in out and "ok portable double" in out


def test_portable_kernels_run_on_aarch64(tmp_path):
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("no qemu-aarch64 (Debian: qemu-user-static) to run an aarch64 binary")
    zig = [sys.executable, "-m", "ziglang"]
    target = ["-target", "aarch64-linux-musl"]
    objects = []
    # Compiled as objects with Zig's clang, linked as C: the harness and the kernels use no C++
    # library code, so only musl is built for the target (not libc++ too).
    for source in (HARNESS, ROOT / "csrc" / "kernels" / "portable.cpp"):
        obj = tmp_path / (source.stem + ".o")
        cmd = [
            *zig,
            "c++",
            *target,
            "-std=c++17",
            "-O2",
            "-fno-math-errno",
            "-fno-exceptions",
            "-fno-threadsafe-statics",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
            str(ROOT / "csrc"),
            "-c",
            str(source),
            "-o",
            str(obj),
        ]
        build = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert build.returncode == 0, build.stderr[-4000:]
        objects.append(str(obj))
    binary = tmp_path / "harness-aarch64"
    link = subprocess.run(
        [*zig, "cc", *target, "-static", *objects, "-o", str(binary)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert link.returncode == 0, link.stderr[-4000:]
    assert int.from_bytes(binary.read_bytes()[18:20], "little") == 183  # EM_AARCH64
    out = _run_harness([qemu], binary)
    assert "ok portable float" in out and "ok portable double" in out
    assert "avx" not in out  # no x86 table in an aarch64 build
