"""Build the package and its C++ CPU kernels (``seq2seq_fast._C``) against the installed torch.

    pip install --no-build-isolation .        # or -e . for a checkout you edit; or pip wheel .

``--no-build-isolation`` compiles against the torch that will import ``_C`` (an isolated build
downloads a torch of its own). The metadata (name, version, dependencies) is in pyproject.toml.

Environment knobs:
    SEQ2SEQ_FAST_SKIP_BUILD=1   install the Python package only (the CPU op then falls back / raises)
    SEQ2SEQ_FAST_DEBUG=1        build the C++ extension with -O0 -g
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Packages are found, not listed: every folder with an __init__.py under seq2seq_fast/ ships.
# triton_kernels/ ships under our namespace as seq2seq_fast._triton (the top-level name
# triton_kernels belongs to Triton's own repository and to an unrelated PyPI package).
PACKAGES = sorted(
    set(find_packages(ROOT, include=["seq2seq_fast", "seq2seq_fast.*"])) | {"seq2seq_fast._triton"}
)
PACKAGE_DIR = {"seq2seq_fast": "seq2seq_fast", "seq2seq_fast._triton": "triton_kernels"}


def torch_openmp_library():
    """The OpenMP runtime file torch ships and loads (torch/lib or torch.libs), or None.

    ``_C`` links that very file, so its NEEDED entry is the soname torch's libtorch_cpu already
    loaded: one OpenMP runtime in the process, whatever torch bundles (libgomp.so.1, a renamed
    libgomp-<hash>.so.1, libiomp5.so). Linking the toolchain's own libgomp instead would load a
    second runtime wherever torch's carries another soname."""
    import torch

    base = os.path.dirname(torch.__file__)
    for folder in (os.path.join(base, "lib"), os.path.join(os.path.dirname(base), "torch.libs")):
        for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*"):
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[0]
    return None


def extension_modules():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    debug = os.environ.get("SEQ2SEQ_FAST_DEBUG", "0") == "1"
    # No -march=native: the binary must run on any x86-64. Wide SIMD paths are compiled per function
    # with target attributes and chosen at run time (see csrc/). -g0: Python's own CFLAGS carry -g,
    # which made _C 24 MB of debug information around 1.3 MB of code.
    cxx_flags = ["-O0", "-g"] if debug else ["-O3", "-g0", "-fno-math-errno"]
    # -fopenmp at compile time: at::parallel_for is inline code that opens OpenMP regions where torch
    # was built with OpenMP. The kernels' threading is at::parallel_for only (no omp pragmas).
    cxx_flags += ["-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    openmp = torch_openmp_library()
    link_flags = [openmp] if openmp else ["-fopenmp"]
    # the ops and their runtime (csrc/*.cpp), the kernel tables per instruction set (csrc/kernels/)
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "kernels", "*.cpp")))
    extension = CppExtension(
        "seq2seq_fast._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )
    return [extension], {"build_ext": BuildExtension}


if __name__ == "__main__":
    ext_modules, cmdclass = [], {}
    if os.environ.get("SEQ2SEQ_FAST_SKIP_BUILD", "0") != "1":
        ext_modules, cmdclass = extension_modules()
    setup(packages=PACKAGES, package_dir=PACKAGE_DIR, ext_modules=ext_modules, cmdclass=cmdclass)
