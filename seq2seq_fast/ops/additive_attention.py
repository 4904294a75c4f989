"""The fused additive-attention op: schemas, fake kernels, backend registration, autograd, functional.

Layers (one name throughout):
    seq2seq_fast::additive_attention_fwd / _bwd   op schemas, defined once here with torch.library
    csrc/additive_attention.cpp -> seq2seq_fast._C  registers the CPU kernels for those schemas
    triton_kernels/additive_attention.py -> seq2seq_fast._triton  the CUDA kernels, registered below
    AdditiveAttentionFunction                      torch.autograd.Function calling the two ops
    additive_attention()                           the public functional (checks its inputs)

The schemas live in Python so that the package imports and serves CUDA tensors through Triton on a
machine where ``_C`` was not built for the running torch; the dispatcher picks the kernel by device.

Op-level contract (inputs already checked and normalised by ``additive_attention``):
    fwd(query [B,Tq,H], keys [B,Tk,H], values [B,Tk,Dv], v [H], bias [H], lengths int64 [B]?,
        mask bool [B,Tk]?, return_weights) -> (context [B,Tq,Dv], weights [B,Tq,Tk] or [0], lse f32 [B,Tq])
    lse = max + log(sum exp) of the valid scores of a row; +inf for a row with no valid key.
    bwd(grad_context [B,Tq,Dv], grad_weights [B,Tq,Tk]?, query, keys, values, v, bias, lengths?, mask?,
        context, lse, weights [B,Tq,Tk]?) -> (grad_query, grad_keys, grad_values, grad_v, grad_bias),
        input dtype. weights: the forward's softmax weights, when the caller kept them; the CPU
        kernel then needs one pass over the (query, key) pairs instead of two (Triton recomputes
        them from lse either way).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

LIBRARY = "seq2seq_fast"
FWD_NAME = f"{LIBRARY}::additive_attention_fwd"
BWD_NAME = f"{LIBRARY}::additive_attention_bwd"

torch.library.define(
    FWD_NAME,
    "(Tensor query, Tensor keys, Tensor values, Tensor v, Tensor bias, Tensor? lengths, "
    "Tensor? mask, bool return_weights) -> (Tensor, Tensor, Tensor)",
)
torch.library.define(
    BWD_NAME,
    "(Tensor grad_context, Tensor? grad_weights, Tensor query, Tensor keys, Tensor values, "
    "Tensor v, Tensor bias, Tensor? lengths, Tensor? mask, Tensor context, Tensor lse, "
    "Tensor? weights=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.register_fake(FWD_NAME)
def _fwd_fake(query, keys, values, v, bias, lengths, mask, return_weights):
    batch, num_queries, _ = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    context = query.new_empty((batch, num_queries, value_dim))
    weights = query.new_empty((batch, num_queries, num_keys) if return_weights else (0,))
    lse = query.new_empty((batch, num_queries), dtype=torch.float32)
    return context, weights, lse


@torch.library.register_fake(BWD_NAME)
def _bwd_fake(
    grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, context, lse,
    weights=None,
):  # fmt: skip
    return (
        torch.empty_like(query),
        torch.empty_like(keys),
        torch.empty_like(values),
        torch.empty_like(v),
        torch.empty_like(bias),
    )


# --- backends --------------------------------------------------------------------------------------

# bfloat16 on CPU: read and written as bfloat16 by the kernel itself, float32 arithmetic in registers
# (csrc/additive_attention.cpp; no whole-tensor float32 copy).
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

try:  # the C++ extension registers the CPU kernels for the schemas above when it loads
    from seq2seq_fast import _C  # noqa: F401

    CPU_KERNEL_ERROR: str | None = None
except ImportError as exc:  # not built, or built against another torch
    CPU_KERNEL_ERROR = f"{type(exc).__name__}: {exc}"

if CPU_KERNEL_ERROR is None:  # fake kernels of the ops that the extension defines itself

    @torch.library.register_fake("seq2seq_fast::_additive_attention_bwd_accumulate")
    def _bwd_accumulate_fake(
        grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, weights, grad_keys
    ):  # fmt: skip
        # grad_keys is updated in place; (grad_query, grad_v, grad_bias) are new
        return torch.empty_like(query), torch.empty_like(v), torch.empty_like(bias)

    @torch.library.register_fake("seq2seq_fast::_fast_tanh")
    def _fast_tanh_fake(x, y, path):
        return torch.empty_like(x)

    # location-aware attention's steps and convolution (seq2seq_fast/nn/convert/_location.py)
    @torch.library.register_fake("seq2seq_fast::_location_attention_fwd")
    def _location_attention_fwd_fake(query, projected, conv, weight, values, v, bias, lengths, mask):
        batch, frames = projected.shape[:2]
        return query.new_empty(batch, 1, values.shape[2]), query.new_empty(batch, 1, frames)

    @torch.library.register_fake("seq2seq_fast::_location_attention_bwd")
    def _location_attention_bwd_fake(
        grad_context, grad_weights, query, projected, conv, weight, values, v, bias, lengths, mask,
        weights, grad_projected,
    ):  # fmt: skip
        # grad_projected is updated in place; (dquery, dconv, dweight, dv, dbias) are new
        return (
            torch.empty_like(query),
            torch.empty_like(conv),
            torch.empty_like(weight),
            torch.empty_like(v),
            torch.empty_like(bias),
        )

    @torch.library.register_fake("seq2seq_fast::_location_conv_fwd")
    def _location_conv_fwd_fake(features, weight):
        return features.new_empty(features.shape[0] * features.shape[2], weight.shape[0])

    @torch.library.register_fake("seq2seq_fast::_location_conv_bwd")
    def _location_conv_bwd_fake(grad, features, weight, need_features, need_weight):
        return (
            torch.empty_like(features) if need_features else features.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
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
    torch.library.register_kernel(FWD_NAME, "cuda", triton_attention.additive_attention_fwd)
    torch.library.register_kernel(BWD_NAME, "cuda", triton_attention.additive_attention_bwd)
    CUDA_KERNEL_ERROR = None
    return None


_cuda_kernels_loaded = False
CUDA_KERNEL_ERROR: str | None = "CUDA is not available to torch (the Triton kernels are not loaded)"
if torch.cuda.is_available():
    load_cuda_kernels()


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


def cpu_bf16_hardware() -> str | None:
    """The CPU's bfloat16 matrix hardware ("amx" or "avx512_bf16"), or None without it.

    The fused CPU ops take bfloat16 on any CPU (float32 inside). What bfloat16 speeds up is the
    model's products under torch.autocast (oneDNN): on a CPU without this hardware they run
    emulated, slower than float32, so a bf16 training mode should fall back to float32 there.
    """
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    return None


# --- autograd --------------------------------------------------------------------------------------


def traced_or_transformed() -> bool:
    """Inside torch.compile's tracing or a torch.func transform: where only the setup_context-style
    Function works and Python-side autograd state (StepwiseMemory) must stay out."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def guard_double_backward(grads: tuple) -> tuple:
    """A backward's results, made to raise when differentiated again (a backward run with
    create_graph=True, then differentiated): the kernels' backward has no derivative of its own,
    and autograd would otherwise treat it as a constant, silently. First-order results (also under
    create_graph=True, and torch.func.grad) are unchanged."""
    if not torch.is_grad_enabled() or traced_or_transformed():
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    if not tensors:
        return grads
    error = torch._C._functions.DelayedError(
        b"seq2seq_fast: the fused attention's backward is not differentiable (a second-order "
        b"gradient through it); use backend='reference' for higher-order gradients",
        len(tensors),
    )
    wrapped = error(*[t.detach().requires_grad_(True) for t in tensors])
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return tuple(next(wrapped) if isinstance(g, Tensor) else g for g in grads)


def attention_function(
    fwd, bwd, name: str = "AdditiveAttentionFunction", save_weights=lambda query: False
) -> type:
    """A torch.autograd.Function over a (fwd, bwd) kernel pair that follows the op-level contract.

    ``apply(query3d, keys, values, v, bias, lengths, mask, return_weights)`` returns
    (context, weights, lse). It saves the inputs, the context and the O(B*Tq) row statistics,
    and the O(B*Tq*Tk) weights when the forward returned them: when the caller asked for them, or
    when ``save_weights(query)`` is true (the forward then computes them even if not asked, and
    the backward needs no recomputation of the softmax). The public op uses the registered torch
    ops; tests and the GPU check's CPU dry run wrap the Triton launchers directly with it (on CPU
    tensors the dispatcher would pick the C++ kernel).
    """

    def forward_impl(query, keys, values, v, bias, lengths, mask, return_weights):
        keep = return_weights or save_weights(query)
        return fwd(query, keys, values, v, bias, lengths, mask, keep)

    def setup_impl(ctx, inputs, output):
        query, keys, values, v, bias, lengths, mask, _ = inputs
        context, weights, lse = output
        saved_weights = weights if weights.numel() > 0 else None
        ctx.save_for_backward(
            query, keys, values, v, bias, lengths, mask, context, lse, saved_weights
        )
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    def backward_impl(ctx, grad_context, grad_weights, _grad_lse):
        query, keys, values, v, bias, lengths, mask, context, lse, weights = ctx.saved_tensors
        if grad_context is None:
            grad_context = torch.zeros_like(context)
        if grad_weights is not None and grad_weights.numel() == 0:
            grad_weights = None
        grads = bwd(
            grad_context.contiguous(),
            None if grad_weights is None else grad_weights.contiguous(),
            query, keys, values, v, bias, lengths, mask, context, lse, weights,
        )  # fmt: skip
        return guard_double_backward((*grads, None, None, None))

    class _AttentionFunction(torch.autograd.Function):
        forward = staticmethod(forward_impl)
        setup_context = staticmethod(setup_impl)
        backward = staticmethod(backward_impl)

    class _EagerAttentionFunction(torch.autograd.Function):
        """The same Function in the older style (forward takes ctx): its apply skips the
        signature binding that the setup_context style pays on every call (~50 us, measured),
        but torch.func transforms need the other one. ``eager_apply`` picks."""

        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            setup_impl(ctx, inputs, output)
            return output

        backward = staticmethod(backward_impl)

    def eager_apply(*inputs):
        if traced_or_transformed():
            return _AttentionFunction.apply(*inputs)
        return _EagerAttentionFunction.apply(*inputs)

    _AttentionFunction.eager_apply = staticmethod(eager_apply)
    for cls in (_AttentionFunction, _EagerAttentionFunction):
        cls.__name__ = cls.__qualname__ = name
    return _AttentionFunction


AdditiveAttentionFunction = attention_function(
    torch.ops.seq2seq_fast.additive_attention_fwd,
    torch.ops.seq2seq_fast.additive_attention_bwd,
    # The CPU kernel writes the weights in the forward anyway (O(B*Tq*Tk), no extra work), and its
    # backward is one pass instead of two with them. Triton recomputes them from lse instead.
    save_weights=lambda query: query.device.type == "cpu",
)


# --- input checks ----------------------------------------------------------------------------------


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _require_float_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def _as_lengths(lengths: object, batch: int, num_keys: int, device: torch.device) -> Tensor:
    if isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        items = list(lengths)
        try:  # no dtype forced: [1.5, 2] must fail the integer check below, not be truncated
            lengths = (
                torch.tensor(items, device=device)
                if items
                else torch.zeros(0, dtype=torch.int64, device=device)
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"lengths must be an integer tensor or a sequence of ints, got {items!r:.80} ({exc})"
            ) from None
    if not isinstance(lengths, Tensor):
        raise TypeError(
            f"lengths must be an integer tensor of shape [{batch}], got {type(lengths).__name__}"
        )
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [B]=[{batch}], got {_shape(lengths)}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but query is on {device}")
    # Values cannot be read while compiling or on the meta device (shapes only).
    if not torch.compiler.is_compiling() and lengths.numel() > 0 and lengths.device.type != "meta":
        _check_lengths_range(lengths, num_keys)
    return lengths.to(torch.int64).contiguous()


# Lengths tensors whose range was checked: id -> (weak reference, version, Tk). A decoder passes the
# same lengths at every step; reading their range each time costs two reductions and, on CUDA, two
# host synchronisations per call. An in-place change bumps the version and checks again.
_checked_lengths: dict[int, tuple] = {}


def _check_lengths_range(lengths: Tensor, num_keys: int) -> None:
    key = id(lengths)
    entry = _checked_lengths.get(key)
    if entry is not None and entry[0]() is lengths and entry[1:] == (lengths._version, num_keys):
        return
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0 or high > num_keys:
        raise ValueError(f"lengths must lie in [0, Tk={num_keys}], got values from {low} to {high}")
    try:
        ref = weakref.ref(lengths, lambda _, key=key: _checked_lengths.pop(key, None))
    except TypeError:  # not weak-referenceable: check every time
        return
    _checked_lengths[key] = (ref, lengths._version, num_keys)


def _as_mask(mask: object, batch: int, num_keys: int, device: torch.device) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be a bool tensor of shape [{batch}, {num_keys}], got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
    if mask.shape != (batch, num_keys):
        raise ValueError(f"mask must have shape [B, Tk]=[{batch}, {num_keys}], got {_shape(mask)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but query is on {device}")
    return mask.contiguous()


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype while autocast is on for this device (CPU or CUDA), else None."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def check_inputs(query, keys, values, v, bias=None, lengths=None, mask=None):
    """Validate the public contract; return (query3d, keys, values, v, bias, lengths, mask, single_step).

    Under torch.autocast on the query's device the floating inputs are first cast to the autocast
    dtype (differentiable casts, as autocast casts a product's inputs: float32 parameters keep
    float32 gradients). Raises TypeError for non-tensors / wrong dtypes and ValueError for shapes,
    devices, ranges.
    """
    tensors = {"query": query, "keys": keys, "values": values, "v": v}
    if bias is not None:
        tensors["bias"] = bias
    for name, value in tensors.items():
        _require_float_tensor(name, value)
    autocast = _autocast_dtype(query.device)
    if autocast is not None:
        tensors = {name: value.to(autocast) for name, value in tensors.items()}
        query, keys, values, v = (tensors[n] for n in ("query", "keys", "values", "v"))
        bias = tensors.get("bias")
    if query.dim() not in (2, 3):
        raise ValueError(f"query must be [B, Tq, H] or [B, H], got shape {_shape(query)}")
    if keys.dim() != 3:
        raise ValueError(f"keys must be [B, Tk, H], got shape {_shape(keys)}")
    if values.dim() != 3:
        raise ValueError(f"values must be [B, Tk, Dv], got shape {_shape(values)}")
    batch, num_keys, hidden = keys.shape
    if query.shape[0] != batch or query.shape[-1] != hidden:
        raise ValueError(
            f"query {_shape(query)} does not match keys {_shape(keys)}: "
            f"need query [B={batch}, Tq, H={hidden}] or [B={batch}, H={hidden}]"
        )
    if values.shape[0] != batch or values.shape[1] != num_keys:
        raise ValueError(
            f"values {_shape(values)} does not match keys {_shape(keys)}: need [B={batch}, Tk={num_keys}, Dv]"
        )
    if v.shape != (hidden,):
        raise ValueError(f"v must have shape [H]=[{hidden}], got {_shape(v)}")
    if bias is not None and bias.shape != (hidden,):
        raise ValueError(f"bias must have shape [H]=[{hidden}] or be None, got {_shape(bias)}")
    for name, value in tensors.items():
        if value.device != query.device:
            raise ValueError(f"{name} is on {value.device} but query is on {query.device}")
        if value.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but query has dtype {query.dtype}")
    if lengths is not None and mask is not None:
        raise ValueError("pass either lengths or mask, not both")
    if lengths is not None:
        lengths = _as_lengths(lengths, batch, num_keys, query.device)
    if mask is not None:
        mask = _as_mask(mask, batch, num_keys, query.device)
    single_step = query.dim() == 2
    return (
        (query.unsqueeze(1) if single_step else query),
        keys,
        values,
        v,
        bias,
        lengths,
        mask,
        single_step,
    )


def additive_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    mask: Tensor | None = None,
    return_weights: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Fused additive attention: scores, mask, softmax and context in one pass, no [B,Tq,Tk,H] tensor.

        e[b,t,s] = sum_h v[h] * tanh(query[b,t,h] + keys[b,s,h] + bias[h])
        weights = softmax of e over the valid s (masked positions get exactly 0)
        context[b,t] = sum_s weights[b,t,s] * values[b,s]

    Args:
        query: [B, Tq, H], or [B, H] for one decoding step.
        keys: [B, Tk, H] projected encoder states.
        values: [B, Tk, Dv].
        v: [H] score vector.
        bias: [H] or None, added inside the tanh.
        lengths: integer [B] with 0 <= length <= Tk: keys at positions >= length are masked.
        mask: bool [B, Tk], True = may attend. Not together with ``lengths``.
        return_weights: also return the attention weights (else None, and they are not computed).

    Returns:
        context [B, Tq, Dv] ([B, Dv] for a [B, H] query) and weights [B, Tq, Tk] ([B, Tk]) or None,
        in the input dtype. Rows with no valid key give zero context and weights, never NaN.

    Gradients flow to query, keys, values, v and bias. Served on CPU (float32, float64, bfloat16:
    float32 inside) by the C++ kernel and on CUDA (float32, float16, bfloat16) by Triton; other
    inputs raise TypeError. Under torch.autocast the inputs are cast to the autocast dtype.
    """
    checked = check_inputs(query, keys, values, v, bias, lengths, mask)
    return run_checked(checked, return_weights, use_reference=False)


def run_checked(checked: tuple, return_weights: bool, use_reference: bool):
    """Run inputs that ``check_inputs`` returned through the fused op or the reference."""
    query3, keys, values, v, bias, lengths, mask, single_step = checked
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    degenerate = min(query3.shape) == 0 or min(keys.shape) == 0 or values.shape[2] == 0
    if use_reference or degenerate:
        # Degenerate sizes (B, Tq, Tk, H or Dv = 0) leave a kernel nothing to do; the reference is exact.
        from seq2seq_fast.ops.reference import additive_attention_ref

        query = query3.squeeze(1) if single_step else query3
        return additive_attention_ref(
            query, keys, values, v, bias, lengths=lengths, mask=mask, return_weights=return_weights
        )
    reason = fused_unavailable_reason(query3.device, query3.dtype)
    if reason is not None:
        raise TypeError(f"additive_attention: {reason}; use the reference (backend='reference')")
    if bias is None:
        bias = query3.new_zeros(query3.shape[-1])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query3, keys, values, v, bias))
    if grad:
        context, weights, _ = AdditiveAttentionFunction.eager_apply(
            query3, keys, values, v, bias, lengths, mask, return_weights
        )
    else:  # no autograd needed: skip Function.apply's per-call signature binding (~40 us)
        context, weights, _ = torch.ops.seq2seq_fast.additive_attention_fwd(
            query3, keys, values, v, bias, lengths, mask, return_weights
        )
    if single_step:
        context = context.squeeze(1)
        weights = weights.squeeze(1) if return_weights else weights
    return context, (weights if return_weights else None)


_warned: set[tuple[str, torch.dtype]] = set()


def warn_fallback_once(device: torch.device, dtype: torch.dtype, reason: str) -> None:
    key = (torch.device(device).type, dtype)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"seq2seq_fast: falling back to the reference attention: {reason}", stacklevel=3
        )
