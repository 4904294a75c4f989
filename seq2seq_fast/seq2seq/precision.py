"""The dtype plan of a ``--precision bf16`` training step, and its measurement.

``--precision bf16`` runs the forward under ``torch.autocast(dtype=torch.bfloat16)`` with float32
master weights and a float32 optimiser. What runs in which dtype (docs/ARCHITECTURE.md, "bf16
training: the dtype plan"):

============================================  ========  ===========================================
part                                          dtype     how
============================================  ========  ===========================================
input projections over all steps              bf16      autocast (one product per layer)
key projection (once per batch)               bf16      autocast
output layer + loss, and their backward       bf16      autocast inside linear_cross_entropy;
                                                        log-sum-exp and loss in float32
attention op (scores, softmax, context)       bf16 io   fused kernel reads/writes bf16, float32
                                                        arithmetic and softmax statistics
GRU recurrence (encoder, GNMT decoder)        bf16 io   fused op: bf16 gx in, bf16 h out; state,
                                                        gates, per-step product h W_hh^T and
                                                        dW_hh / db_hh sums in float32, W_hh used
                                                        as the float32 master (never cast)
Bahdanau decoder per-step products            bf16      weights cast once per forward
                                                        (:func:`cast_once`), not once per step
cells (GRU/LSTM gate passes)                  bf16 io   fused ops, float32 inside
parameters, gradients, optimiser              float32   autocast's casts are differentiable
============================================  ========  ===========================================

Weights are cast once per step (autocast caches the casts of parameters; weights formed from
parameters, such as the decoder's stacked [W_hh; W_q], go through :func:`cast_once`), and
neighbouring ops hand each other bf16 activations: nothing is cast back and forth between them.
:func:`conversion_profile` measures what is left: the share of a step's CPU time spent in
dtype-changing copies and the bytes they move (``python -m bench.bench_bf16`` prints it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Bytes per element of the dtypes that torch.profiler names in ``input_dtypes``.
_PROFILER_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
}


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype while autocast is on for ``device_type`` ("cpu" or "cuda"), else None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def cast_once(t: Tensor | None) -> Tensor | None:
    """``t`` in the autocast dtype when autocast is on for its device, else ``t`` itself.

    For a weight formed from parameters once per forward (a slice, a concatenation): autocast
    caches the casts of parameters only, so such a tensor would be cast again at every use (every
    decoder step, and its gradient cast back at every step of the backward). A differentiable
    cast, done once: the gradient reaches the float32 parameters once."""
    if t is None or not t.is_floating_point():
        return t
    dtype = autocast_dtype(t.device.type)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def conversion_profile(step: Callable[[], Any]) -> dict[str, float]:
    """Runs ``step`` once under torch.profiler (CPU) and returns what its dtype casts cost:

    - ``cast_share``: the self CPU time of the ``aten::copy_`` calls whose source and destination
      dtypes differ, over the self CPU time of every op of the step;
    - ``casts``: how many such calls; ``cast_bytes``: the bytes they read and write;
    - ``copy_share``: the same share for every ``aten::copy_`` (casts or not);
    - ``step_ms``: the step's self CPU time in milliseconds.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    total_us = cast_us = copy_us = 0.0
    casts = cast_bytes = 0
    for event in prof.events():
        total_us += event.self_cpu_time_total
        if event.name != "aten::copy_":
            continue
        copy_us += event.self_cpu_time_total
        dtypes = list(getattr(event, "input_dtypes", None) or [])
        if len(dtypes) < 2 or dtypes[0] == dtypes[1] or not event.input_shapes:
            continue
        numel = 1
        for n in event.input_shapes[0]:
            numel *= n
        casts += 1
        cast_us += event.self_cpu_time_total
        cast_bytes += numel * sum(_PROFILER_DTYPE_BYTES.get(d, 4) for d in dtypes[:2])
    total_us = max(total_us, 1e-9)
    return {
        "cast_share": cast_us / total_us,
        "casts": casts,
        "cast_bytes": cast_bytes,
        "copy_share": copy_us / total_us,
        "step_ms": total_us / 1e3,
    }
