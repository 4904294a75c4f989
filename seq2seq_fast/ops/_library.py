"""The op library ``seq2seq_fast``: loading its kernels, and whether a fused kernel serves a tensor.

    _C (csrc/ -> seq2seq_fast._C)         loaded here at import; registers the CPU kernels of
                                          every op (and defines the ops only it implements)
    _triton (triton_kernels/)             loaded by :func:`load_cuda_kernels` where torch sees a
                                          CUDA device; registers the attention's CUDA kernels
    CPU_KERNEL_ERROR, CUDA_KERNEL_ERROR   None when loaded, else why not

The op schemas of the public attention are defined in Python (ops/additive_attention.py), so the
package imports and serves CUDA tensors through Triton where ``_C`` was not built for the running
torch. The dispatcher accepts ``_C``'s CPU kernels before those schemas are defined.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import traced_or_transformed
from seq2seq_fast.ops._checks import check_lengths_range

LIBRARY = "seq2seq_fast"

# bfloat16 on CPU: stored as such, computed in float32 inside the kernel (csrc/additive_attention.cpp).
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def new_output_like(t: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``t``'s shape, dtype and device: the fake kernels'
    outputs, like the kernels', are contiguous whatever the inputs' strides (``empty_like``
    would keep a transposed input's strides, and torch.compile's inductor checks them)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _load_error(exc: ImportError, module: str = "seq2seq_fast._C") -> str:
    """Why ``module`` (the extension) did not load, in words a user can act on: not found at all,
    a checkout where it was never built (Python's own message then speaks of a "partially
    initialized module" and a "circular import", which misleads), else the import's own error
    (built against another torch). Asks Python's import system where the module would be, so an
    editable install's own finder is heard too."""
    if importlib.util.find_spec(module) is None:
        return (
            f"it is not built: Python finds no {module} beside {Path(__file__).parents[1]} (from "
            "a source checkout, build it with `pip install --no-build-isolation -e .`)"
        )
    return f"{type(exc).__name__}: {exc}"


try:  # the C++ extension registers the CPU kernels for the ops' schemas when it loads
    from seq2seq_fast import _C  # noqa: F401

    CPU_KERNEL_ERROR: str | None = None
except ImportError as exc:  # not built, or built against another torch
    CPU_KERNEL_ERROR = _load_error(exc)

if CPU_KERNEL_ERROR is None:  # the extension's own library-wide op (csrc/extension.cpp)

    @torch.library.register_fake("seq2seq_fast::_fast_tanh")
    def _fast_tanh_fake(x, y, path):
        return new_output_like(x)

    if hasattr(torch.ops.seq2seq_fast, "_topk_rows"):  # the searches' top-k (csrc/topk.cpp)

        @torch.library.register_fake("seq2seq_fast::_topk_rows")
        def _topk_rows_fake(x, k):
            return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)

        @torch.library.register_fake("seq2seq_fast::_log_softmax_topk")
        def _log_softmax_topk_fake(logits, k, exclude):
            return (
                logits.new_empty(logits.shape[0], k),
                logits.new_empty(logits.shape[0], k, dtype=torch.long),
            )


def load_cuda_kernels() -> str | None:
    """Import the Triton kernels and register them as the ops' CUDA kernels (once).

    Returns None when they are registered, else why not. Called at import only where torch sees a
    CUDA device: on a CPU-only machine importing Triton would add ~0.5 s to every command's start-up
    for kernels no tensor can reach.
    """
    global CUDA_KERNEL_ERROR, _cuda_kernels_loaded
    if _cuda_kernels_loaded:
        return CUDA_KERNEL_ERROR
    _cuda_kernels_loaded = True
    try:
        from seq2seq_fast._triton import additive_attention as triton_attention
    except ImportError as exc:  # Triton missing
        CUDA_KERNEL_ERROR = f"{type(exc).__name__}: {exc}"
        return CUDA_KERNEL_ERROR
    for name, kernel in (
        ("additive_attention_fwd", _lengths_checked(triton_attention.additive_attention_fwd)),
        ("additive_attention_bwd", triton_attention.additive_attention_bwd),
        ("additive_attention_bwd.score_bias", triton_attention.additive_attention_bwd),  # (six)
    ):
        torch.library.register_kernel(f"{LIBRARY}::{name}", "cuda", kernel)
    CUDA_KERNEL_ERROR = None
    return None


def _lengths_checked(forward):
    """The Triton forward, checking that ``lengths`` lie in [0, Tk] first (a ValueError, once per
    lengths tensor and version, as ``additive_attention`` checks them). Under torch.compile that
    check cannot run while tracing, and the kernels themselves read a length past Tk as Tk and a
    negative one as an empty row: the C++ kernels raise, and so does this."""

    def checked(query, keys, values, v, bias, lengths, mask, *args, **kwargs):
        if lengths is not None and lengths.numel() > 0:
            check_lengths_range(lengths, keys.shape[1])
        return forward(query, keys, values, v, bias, lengths, mask, *args, **kwargs)

    return checked


_cuda_kernels_loaded = False
CUDA_KERNEL_ERROR: str | None = "CUDA is not available to torch (the Triton kernels are not loaded)"


def fused_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when a fused kernel serves tensors of this device and dtype, else why not."""
    device_type = torch.device(device).type
    if device_type == "cpu":
        supported, error = _CPU_DTYPES, CPU_KERNEL_ERROR
        what = "the C++ extension seq2seq_fast._C"
    elif device_type == "cuda":
        supported, error = _CUDA_DTYPES, CUDA_KERNEL_ERROR
        what = "the Triton kernels (seq2seq_fast._triton)"
    else:
        return f"no fused kernel for device type {device_type!r} (cpu and cuda are served)"
    if dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        return f"no fused kernel for dtype {dtype} on {device_type} (supported: {names})"
    if error is not None:
        return f"{what} did not load ({error})"
    return None


def fused_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return fused_unavailable_reason(device, dtype) is None


# The kernels a caller may ask about, beyond the attention op itself: the CPU kernels whose
# autograd keeps Python-side state (gathered step gradients), so they stay out of torch.compile's
# tracing and torch.func transforms. Device type -> dtypes served; and what they do under autocast:
# "same" serves only tensors already in the autocast dtype (the op would cast the others, and the
# caller's state would miss them), "bf16" serves bfloat16 autocast (the op casts its inputs).
_CPU_KERNELS = {
    "attention_step": (_CPU_DTYPES, "same"),  # StepwiseMemory, GatheredValues: accumulating bwd
    "location": (_CPU_DTYPES, "same"),  # location-aware step
    "location_conv": ((torch.float32, torch.float64), "same"),  # location convolution
    "recurrent": (_CPU_DTYPES, "bf16"),  # GRU layer, GRU and LSTM cells
}
KERNELS = ("attention", *_CPU_KERNELS)


def kernel_unavailable_reason(kernel: str, *tensors: Tensor) -> str | None:
    """The one decision whether a fused kernel serves a call with these tensors: None when it
    does, else why not. Everything above ``ops`` asks here instead of testing devices or dtypes.

    kernel: "attention" (the op through AdditiveAttentionFunction: CPU or CUDA, any mode, by the
    first tensor's device and dtype, as :func:`fused_unavailable_reason`), "attention_step" (a
    decoder step whose key/value gradients are gathered: StepwiseMemory, GatheredValues),
    "location" (the location-aware step), "location_conv" (the location convolution) or
    "recurrent" (GRU/LSTM ops). The last four: CPU tensors only, in the kernel's dtypes, the extension loaded, not inside
    torch.compile's tracing or a torch.func transform, and autocast as the table above says.
    """
    if _forced and kernel in _forced:
        return f"the {kernel} kernel is switched off by force_reference()"
    if kernel == "attention":
        return fused_unavailable_reason(tensors[0].device, tensors[0].dtype)
    if kernel not in _CPU_KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    dtypes, under_autocast = _CPU_KERNELS[kernel]
    if CPU_KERNEL_ERROR is not None:
        return f"the C++ extension seq2seq_fast._C did not load ({CPU_KERNEL_ERROR})"
    for t in tensors:
        if t.device.type != "cpu":
            return f"the {kernel} kernel serves CPU tensors only, got one on {t.device}"
        if t.dtype not in dtypes:
            return f"the {kernel} kernel does not serve dtype {t.dtype}"
    if traced_or_transformed():
        return (
            f"the {kernel} kernel keeps Python-side autograd state: not under tracing or torch.func"
        )
    if torch.is_autocast_enabled("cpu"):
        autocast = torch.get_autocast_dtype("cpu")
        if under_autocast == "bf16" and autocast != torch.bfloat16:
            return f"the {kernel} kernel does not run under {autocast} autocast"
        if under_autocast == "same" and any(t.dtype != autocast for t in tensors):
            return (
                f"the {kernel} kernel serves only tensors already in the autocast dtype {autocast}"
            )
    return None


# --- switching the fused kernels off for a while ----------------------------------------------------

# The kernels switched off by force_reference (process-wide: read at every call, a plain module
# global so that torch.compile guards on it instead of breaking the graph), and the recorder of
# the kernels that served a call meanwhile.
_forced: frozenset[str] = frozenset()
_served: set[str] | None = None


@contextlib.contextmanager
def force_reference(kernels: Iterable[str] = KERNELS) -> Iterator[set[str]]:
    """Inside the block, the fused ``kernels`` (default: every one of :data:`KERNELS`) serve
    nothing: :func:`kernel_unavailable_reason` says so, the attention dispatch runs the reference
    (with any backend, silently), and the recurrent entry points return None (the models then run
    PyTorch's own ops). Yields the set of op names of the fused kernels that still served a call
    inside the block. Restored on exit, whatever happens; blocks nest. Process-wide: meant for a
    check of one step (the training canary), not for other threads' calls meanwhile."""
    global _forced, _served
    kernels = frozenset([kernels] if isinstance(kernels, str) else kernels)
    if not kernels <= set(KERNELS):
        raise ValueError(f"kernels must be among {KERNELS}, got {sorted(kernels - set(KERNELS))}")
    saved = (_forced, _served)
    served: set[str] = set()
    _forced = saved[0] | kernels
    _served = served
    try:
        yield served
    finally:
        _forced, _served = saved
        if _served is not None:
            _served |= served


def forced_reference(kernel: str) -> bool:
    """Whether :func:`force_reference` switched ``kernel`` off (the dispatch then runs the
    reference without a warning)."""
    return bool(_forced) and kernel in _forced


def note_served(op: str) -> None:
    """A fused kernel served a call: recorded for :func:`force_reference`'s caller, if any."""
    if _served is not None:
        _served.add(op)


def kernel_serves(kernel: str, *tensors: Tensor) -> bool:
    """:func:`kernel_unavailable_reason` is None."""
    return kernel_unavailable_reason(kernel, *tensors) is None


_warned: set[tuple[str, torch.dtype]] = set()


def warn_fallback_once(
    device: torch.device, dtype: torch.dtype, reason: str, stacklevel: int = 3
) -> None:
    key = (torch.device(device).type, dtype)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"seq2seq_fast: falling back to the reference attention: {reason}",
            stacklevel=stacklevel,
        )
