"""The op layer: every op whole in its own file, the library that loads their kernels, and the
reference that defines the truth.

    additive_attention     the fused attention: schemas, fake kernels, AdditiveAttentionFunction,
                           the functional ``additive_attention`` (also ``seq2seq_fast.additive_attention``)
    location_attention     the location-aware attention step and the location convolution
    recurrent              GRU layer / GRU cell / LSTM cell ops
    linear_cross_entropy   the output layer and its loss, by row chunks
    stepwise               the decoder step memories (StepwiseMemory, GatheredValues,
                           LocationMemory): a step's memory gradients gathered once per sequence
    reference              ``additive_attention_ref``, plain PyTorch, the spec
    _library               loading ``_C`` and ``_triton``; whether a fused kernel serves a call
                           (``kernel_unavailable_reason``, the one decision) and
                           ``force_reference()``, which switches the fused kernels off for a block
    _autograd              helpers the Functions share (tracing test, double-backward guard,
                           the gradient-sum dtype, StepGradients)
    _checks                the attention's input checks, the autocast dtype, masks as lengths
    _private               every private torch API the package uses, each with why

Environment variables (all of them; none is needed in normal use):

    SEQ2SEQ_FAST_ISA=portable|avx2|avx512   CPU kernels: force that instruction set's kernel
                                            table (default: the widest this CPU runs; a set the
                                            CPU lacks falls back to the best it has). Read at
                                            every call (csrc/runtime.cpp).
    SEQ2SEQ_FAST_SKIP_BUILD=1               install: the Python package only, no C++ extension
                                            (default 0; the CPU op then raises or falls back).
    SEQ2SEQ_FAST_DEBUG=1                    install: build the extension with -O0 -g (default 0).

The benchmarks' own knobs (SEQ2SEQ_FAST_BENCH_*) are listed in bench/.

The submodule ``additive_attention`` keeps its name here (the functional is not re-exported under
the same name). Imports nothing of ``seq2seq_fast`` above it (``nn``, ``seq2seq``); a test enforces it.
"""

import torch

from seq2seq_fast.ops import (
    _library,
    additive_attention,
    linear_cross_entropy,
    location_attention,
    recurrent,
    reference,
    stepwise,
)
from seq2seq_fast.ops._library import force_reference, fused_available, fused_unavailable_reason
from seq2seq_fast.ops.additive_attention import AdditiveAttentionFunction
from seq2seq_fast.ops.reference import additive_attention_ref

if torch.cuda.is_available():  # after the op modules: the Triton kernels need their schemas
    _library.load_cuda_kernels()

__all__ = [
    "AdditiveAttentionFunction",
    "additive_attention",
    "additive_attention_ref",
    "force_reference",
    "fused_available",
    "fused_unavailable_reason",
    "linear_cross_entropy",
    "location_attention",
    "recurrent",
    "reference",
    "stepwise",
]
