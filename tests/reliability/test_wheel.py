"""The package as users install it: the sdist, the wheel built from it, repaired by auditwheel, in a
fresh virtual environment, run from outside the checkout.

CI (.ci/run) builds the sdist and the wheel once and names them in ``SEQ2SEQ_FAST_SDIST`` and
``SEQ2SEQ_FAST_WHEEL``; elsewhere these tests build their own (about a minute: one compile).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMOKE = Path(__file__).with_name("wheel_smoke.py")
# What _C may link: the C and C++ runtimes, and torch's own libraries (which torch has loaded
# before _C: the soname is found in the process, not on a search path).
SYSTEM_LIBS = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6", "ld-linux-x86-64.so.2"}
TORCH_LIBS = {"libc10.so", "libtorch_cpu.so", "libtorch.so"}


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{cmd} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def _pip(python, *args: str) -> None:
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    given = os.environ.get("SEQ2SEQ_FAST_SDIST")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("sdist")
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    name = _run([sys.executable, "-c", code], cwd=ROOT).stdout.split()[-1]
    return out / name


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory) -> Path:
    given = os.environ.get("SEQ2SEQ_FAST_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
          "-w", str(out), str(sdist)])  # fmt: skip
    (built,) = out.glob("*.whl")
    return built


def _package_files() -> set[str]:
    """The checkout's package as installed paths: seq2seq_fast/**.py, triton_kernels as _triton."""
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "seq2seq_fast").rglob("*.py")}
    files |= {f"seq2seq_fast/_triton/{p.name}" for p in (ROOT / "triton_kernels").glob("*.py")}
    return {f for f in files if "__pycache__" not in f}


def test_sdist_holds_every_source(sdist):
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    sources |= {str(p.relative_to(ROOT)) for p in (ROOT / "triton_kernels").glob("*.py")}
    sources |= {str(p.relative_to(ROOT)) for p in (ROOT / "seq2seq_fast").rglob("*.py")}
    sources |= {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md"}
    missing = sorted(s for s in sources if "__pycache__" not in s and s not in names)
    assert not missing, f"the sdist lacks {missing}"
    assert not any(n.startswith(("tests/", "bench/")) for n in names)


def test_wheel_holds_the_whole_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = sorted(_package_files() - names)
    assert not missing, f"the wheel lacks {missing}"
    assert any(n.startswith("seq2seq_fast/_C.") and n.endswith(".so") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "triton_kernels/")) for n in names)


def test_wheel_is_tagged_manylinux(wheel):
    # auditwheel repair (--exclude torch's libraries and OpenMP: they come with torch) retags it
    if not os.environ.get("SEQ2SEQ_FAST_WHEEL"):
        pytest.skip("only CI's wheel goes through auditwheel repair (.ci/run)")
    assert "-manylinux_" in wheel.name, wheel.name


def _needed(path: Path) -> list[str]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as handle:
        elf = ELFFile(handle)
        sections = [s for s in elf.iter_sections() if isinstance(s, DynamicSection)]
        return [t.needed for s in sections for t in s.iter_tags() if t.entry.d_tag == "DT_NEEDED"]


def test_extension_links_only_what_torch_provides(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.startswith("seq2seq_fast/_C.")]
        zf.extract(name, tmp_path)
        grafted = [n for n in zf.namelist() if ".libs/" in n]
    assert not grafted, f"auditwheel grafted libraries into the wheel: {grafted}"
    needed = set(_needed(tmp_path / name))
    torch_lib = Path(torch.__file__).parent / "lib"
    torch_openmp = {n for n in _needed(torch_lib / "libtorch_cpu.so") if "omp" in n}
    assert len(torch_openmp) == 1, torch_openmp
    ours_openmp = {n for n in needed if "omp" in n}
    # one OpenMP runtime in the process: _C names the very soname libtorch_cpu loads
    assert ours_openmp == torch_openmp, (ours_openmp, torch_openmp)
    extra = needed - SYSTEM_LIBS - TORCH_LIBS - torch_openmp
    assert not extra, f"_C links libraries a torch CPU install does not provide: {sorted(extra)}"


def test_installed_wheel_works_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # the torch this suite runs on (a bare requirement could pull a multi-GB CUDA build)
    _pip(python, f"torch=={torch.__version__.split('+')[0]}")
    _pip(python, str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON"))}
    env.update(SEQ2SEQ_FAST_CACHE_DIR=str(tmp_path / "cache"), XDG_CACHE_HOME=str(tmp_path))
    done = _run([str(python), "-I", str(SMOKE), str(work)], cwd=work, env=env)
    lines = done.stdout.strip().splitlines()
    passed = [line for line in lines if line.startswith("ok: ")]
    assert len(passed) >= 6 and lines[-1] == f"{len(passed)} passed, 0 failed", done.stdout
