"""Test-session setup: run the Triton kernels through Triton's interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when ``seq2seq_fast`` first imports
its Triton module, so the variable must be set here, before any test module imports the package.
It is only set when CUDA is unavailable, so a GPU machine runs the real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
