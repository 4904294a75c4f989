"""Build: ``pip install --no-build-isolation -e .`` (after ``pip install torch==2.13.0``).

Environment knobs:
    SEQ2SEQ_FAST_SKIP_BUILD=1   install the Python package only (the CPU op then falls back / raises)
    SEQ2SEQ_FAST_DEBUG=1        build the C++ extension with -O0 -g
"""

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
ext_modules = []
cmdclass = {}

if os.environ.get("SEQ2SEQ_FAST_SKIP_BUILD", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    debug = os.environ.get("SEQ2SEQ_FAST_DEBUG", "0") == "1"
    # No -march=native: the binary must run on any x86-64. Wide SIMD paths are compiled per function
    # with target attributes and chosen at run time (see csrc/).
    cxx_flags = ["-O0", "-g"] if debug else ["-O3", "-fno-math-errno"]
    cxx_flags += ["-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    # the ops and their runtime (csrc/*.cpp), the kernel tables per instruction set (csrc/kernels/)
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "kernels", "*.cpp")))
    ext_modules.append(
        CppExtension(
            "seq2seq_fast._C",
            sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    )
    cmdclass["build_ext"] = BuildExtension

setup(
    packages=[
        "seq2seq_fast",
        "seq2seq_fast.ops",
        "seq2seq_fast.nn",
        "seq2seq_fast.seq2seq",
        "seq2seq_fast._triton",
    ],
    package_dir={"seq2seq_fast": "seq2seq_fast", "seq2seq_fast._triton": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
