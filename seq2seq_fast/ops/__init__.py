"""The op layer: the op contract (schemas, fake kernels, autograd Function, functional, input checks,
library loading), the reference that defines the truth, and the recurrent-cell ops.

    additive_attention   the fused op: ``seq2seq_fast.ops.additive_attention.additive_attention``
                         (also ``seq2seq_fast.additive_attention``)
    reference            ``additive_attention_ref``, plain PyTorch, the spec
    recurrent            GRU layer / GRU cell / LSTM cell ops and the one place that decides
                         whether they serve a tensor

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

from seq2seq_fast.ops import additive_attention, recurrent, reference
from seq2seq_fast.ops.additive_attention import (
    AdditiveAttentionFunction,
    cpu_bf16_hardware,
    fused_available,
    fused_unavailable_reason,
)
from seq2seq_fast.ops.reference import additive_attention_ref

__all__ = [
    "AdditiveAttentionFunction",
    "additive_attention",
    "additive_attention_ref",
    "cpu_bf16_hardware",
    "fused_available",
    "fused_unavailable_reason",
    "recurrent",
    "reference",
]
