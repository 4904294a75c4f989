"""The fused additive-attention op: schemas, fake kernels, autograd Function, functional.

Layers (one name throughout):
    seq2seq_fast::additive_attention_fwd / _bwd   op schemas, defined once here with torch.library
    csrc/additive_attention.cpp -> seq2seq_fast._C  registers the CPU kernels for those schemas
    triton_kernels/additive_attention.py -> seq2seq_fast._triton  the CUDA kernels (ops/_library.py)
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
    normalize (trailing, both ops, default "softmax"): "softmax" or "sigmoid" (sigmoid(e) / sum of
        sigmoid(e) over the valid keys, "smoothing"); lse then holds log sum sigmoid(e) (+inf for
        a row with no valid key). Computed as the softmax of log sigmoid(e), which is the same
        and never overflows or divides 0 by 0. The CPU backward recomputes the scores for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import guard_double_backward, traced_or_transformed
from seq2seq_fast.ops._checks import AttentionInputs, check_inputs
from seq2seq_fast.ops._library import (
    CPU_KERNEL_ERROR,
    LIBRARY,
    forced_reference,
    kernel_unavailable_reason,
    warn_fallback_once,
)

if TYPE_CHECKING:
    from seq2seq_fast.ops.stepwise import StepwiseMemory

FWD_NAME = f"{LIBRARY}::additive_attention_fwd"
SOFTMAX = "softmax"
NORMALIZATIONS = ("softmax", "sigmoid")
BACKENDS = ("auto", "fused", "reference")
BWD_NAME = f"{LIBRARY}::additive_attention_bwd"

torch.library.define(
    FWD_NAME,
    "(Tensor query, Tensor keys, Tensor values, Tensor v, Tensor bias, Tensor? lengths, "
    'Tensor? mask, bool return_weights, str normalize="softmax") -> (Tensor, Tensor, Tensor)',
)
torch.library.define(
    BWD_NAME,
    "(Tensor grad_context, Tensor? grad_weights, Tensor query, Tensor keys, Tensor values, "
    "Tensor v, Tensor bias, Tensor? lengths, Tensor? mask, Tensor context, Tensor lse, "
    'Tensor? weights=None, str normalize="softmax") '
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.register_fake(FWD_NAME)
def _fwd_fake(query, keys, values, v, bias, lengths, mask, return_weights, normalize="softmax"):
    batch, num_queries, _ = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    context = query.new_empty((batch, num_queries, value_dim))
    weights = query.new_empty((batch, num_queries, num_keys) if return_weights else (0,))
    lse = query.new_empty((batch, num_queries), dtype=torch.float32)
    return context, weights, lse


@torch.library.register_fake(BWD_NAME)
def _bwd_fake(
    grad_context,
    grad_weights,
    query,
    keys,
    values,
    v,
    bias,
    lengths,
    mask,
    context,
    lse,
    weights=None,
    normalize="softmax",
):
    return (
        torch.empty_like(query),
        torch.empty_like(keys),
        torch.empty_like(values),
        torch.empty_like(v),
        torch.empty_like(bias),
    )


# --- fake kernels of the ops the extension defines -------------------------------------------------

if CPU_KERNEL_ERROR is None:  # fake kernels of the ops that the extension defines itself

    @torch.library.register_fake("seq2seq_fast::_additive_attention_bwd_accumulate")
    def _bwd_accumulate_fake(
        grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, weights, grad_keys
    ):
        # grad_keys is updated in place; (grad_query, grad_v, grad_bias) are new
        return torch.empty_like(query), torch.empty_like(v), torch.empty_like(bias)


# --- autograd --------------------------------------------------------------------------------------


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    """Save the inputs, the context, the O(B*Tq) row statistics and, when the forward returned
    them, the O(B*Tq*Tk) weights (the backward then needs no recomputation of the softmax)."""
    query, keys, values, v, bias, lengths, mask = inputs[:7]
    context, weights, lse = output
    ctx.normalize = inputs[8] if len(inputs) > 8 else SOFTMAX
    saved_weights = weights if weights.numel() > 0 else None
    ctx.save_for_backward(query, keys, values, v, bias, lengths, mask, context, lse, saved_weights)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(bwd, ctx, grad_context: Tensor | None, grad_weights: Tensor | None) -> tuple:
    """The five input gradients from the backward kernel ``bwd`` (Nones for the rest)."""
    query, keys, values, v, bias, lengths, mask, context, lse, weights = ctx.saved_tensors
    if grad_context is None:
        grad_context = torch.zeros_like(context)
    if grad_weights is not None and grad_weights.numel() == 0:
        grad_weights = None
    grads = bwd(
        grad_context.contiguous(),
        None if grad_weights is None else grad_weights.contiguous(),
        query,
        keys,
        values,
        v,
        bias,
        lengths,
        mask,
        context,
        lse,
        weights,
        ctx.normalize,
    )
    return guard_double_backward((*grads, None, None, None, None))


class AdditiveAttentionFunction(torch.autograd.Function):
    """The autograd Function over the two ops (op-level contract, module docstring).

    ``apply(query3d, keys, values, v, bias, lengths, mask, return_weights, normalize)`` returns
    (context, weights, lse); the inputs are those :func:`check_inputs` returns (bias not None).
    ``eager_apply`` is the same call, faster outside tracing and transforms.
    """

    @staticmethod
    def forward(query, keys, values, v, bias, lengths, mask, return_weights, normalize=SOFTMAX):
        # The CPU kernel writes the weights in the forward anyway (O(B*Tq*Tk), no extra work),
        # and its backward is one pass instead of two with them. Triton recomputes them from lse.
        keep = return_weights or query.device.type == "cpu"
        return torch.ops.seq2seq_fast.additive_attention_fwd(
            query, keys, values, v, bias, lengths, mask, keep, normalize
        )

    setup_context = staticmethod(_save_for_backward)

    @staticmethod
    def backward(ctx, grad_context, grad_weights, _grad_lse):
        return _backward(
            torch.ops.seq2seq_fast.additive_attention_bwd, ctx, grad_context, grad_weights
        )

    @staticmethod
    def eager_apply(*inputs):
        """``apply``, through :class:`_EagerAttentionFunction` outside torch.compile's tracing and
        torch.func transforms (which need this class's setup_context style)."""
        if traced_or_transformed():
            return AdditiveAttentionFunction.apply(*inputs)
        return _EagerAttentionFunction.apply(*inputs)


class _EagerAttentionFunction(torch.autograd.Function):
    """:class:`AdditiveAttentionFunction` in the older style (forward takes ctx): its apply skips
    the signature binding that the setup_context style pays on every call (bench/RESULTS.md)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = AdditiveAttentionFunction.forward(*inputs)
        _save_for_backward(ctx, inputs, output)
        return output

    backward = staticmethod(AdditiveAttentionFunction.backward)


def attention_function(fwd, bwd) -> type[AdditiveAttentionFunction]:
    """:class:`AdditiveAttentionFunction` over another (fwd, bwd) kernel pair with the same
    contract: tests and the GPU check's CPU dry run wrap the Triton launchers directly with it (on
    CPU tensors the dispatcher would pick the C++ kernel). Weights are saved when asked for."""

    class KernelPairFunction(AdditiveAttentionFunction):
        @staticmethod
        def forward(query, keys, values, v, bias, lengths, mask, return_weights, normalize=SOFTMAX):
            return fwd(query, keys, values, v, bias, lengths, mask, return_weights, normalize)

        @staticmethod
        def backward(ctx, grad_context, grad_weights, _grad_lse):
            return _backward(bwd, ctx, grad_context, grad_weights)

    return KernelPairFunction


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
    normalize: str = "softmax",
    backend: str = "fused",
    stepwise: StepwiseMemory | None = None,
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
        normalize: "softmax" (default), or "sigmoid": weights = sigmoid(e) / sum of sigmoid(e)
            over the valid keys (the "smoothing" of Tacotron-style and LAS-style location-aware
            attention), masked positions exactly 0, a row with no valid key all 0.
        backend: "fused" (default: a fused kernel, else :class:`FusedKernelUnavailable`),
            "auto" (the fused kernel where one serves the inputs' device and dtype, else the
            reference, with one warning per device and dtype) or "reference" (plain PyTorch,
            :func:`~seq2seq_fast.ops.reference.additive_attention_ref`).
        stepwise: a :class:`~seq2seq_fast.ops.stepwise.StepwiseMemory` whose ``keys`` and
            ``values`` are the ones passed (a decoder's steps, training): used where the fused
            CPU kernel runs the softmax with gradients wanted, ignored elsewhere.

    Returns:
        context [B, Tq, Dv] ([B, Dv] for a [B, H] query) and weights [B, Tq, Tk] ([B, Tk]) or None,
        in the input dtype. Rows with no valid key give zero context and weights, never NaN.

    Gradients flow to query, keys, values, v and bias. Served on CPU (float32, float64, bfloat16:
    float32 inside) by the C++ kernel and on CUDA (float32, float16, bfloat16) by Triton. Under
    torch.autocast the inputs are cast to the autocast dtype. This is the one dispatch: every
    module and converter stand-in calls it; the inputs are checked once and the kernel library
    asked once per call.
    """
    checked = check_inputs(query, keys, values, v, bias, lengths, mask)
    check_normalize(normalize)
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    query3, keys, values = checked.query, checked.keys, checked.values
    degenerate = min(query3.shape) == 0 or min(keys.shape) == 0 or values.shape[2] == 0
    if degenerate or _use_reference(backend, query3):
        # Degenerate sizes (B, Tq, Tk, H or Dv = 0) leave a kernel nothing to do; the reference is exact.
        return _reference(checked, return_weights, normalize)
    v, lengths, mask = checked.v, checked.lengths, checked.mask
    bias = query3.new_zeros(query3.shape[-1]) if checked.bias is None else checked.bias
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query3, keys, values, v, bias))
    if grad and stepwise is not None and normalize == SOFTMAX and stepwise.owns(keys, values):
        context, weights = stepwise.attend(query3, v, bias, lengths, mask)
    elif grad:
        context, weights, _ = AdditiveAttentionFunction.eager_apply(
            query3, keys, values, v, bias, lengths, mask, return_weights, normalize
        )
    else:  # no autograd needed: skip Function.apply's per-call signature binding
        context, weights, _ = torch.ops.seq2seq_fast.additive_attention_fwd(
            query3, keys, values, v, bias, lengths, mask, return_weights, normalize
        )
    if checked.single_step:
        context = context.squeeze(1)
        weights = weights.squeeze(1) if return_weights else weights
    return context, (weights if return_weights else None)


def check_normalize(normalize: object) -> str:
    """``normalize`` itself, or a ValueError naming it and what it got."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    return normalize


def check_backend(backend: object) -> str:
    """``backend`` itself if it is one of :data:`BACKENDS`, else ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


class FusedKernelUnavailable(RuntimeError, TypeError):
    """backend="fused" where no fused kernel serves the inputs (a RuntimeError, and a TypeError
    as the functional raised before it took a backend)."""


def _use_reference(backend: str, query: Tensor) -> bool:
    """Whether this call runs the reference: asked once per call (the warning of "auto" once
    per device and dtype; :func:`~seq2seq_fast.ops._library.force_reference` silently)."""
    if backend == "reference" or (check_backend(backend) and forced_reference("attention")):
        return True
    reason = kernel_unavailable_reason("attention", query)
    if reason is None:
        return False
    if backend == "fused":
        raise FusedKernelUnavailable(
            f"additive_attention: backend='fused' but {reason}; use backend='reference' or 'auto'"
        )
    warn_fallback_once(query.device, query.dtype, reason, stacklevel=4)
    return True


def _reference(checked: AttentionInputs, return_weights: bool, normalize: str):
    from seq2seq_fast.ops.reference import additive_attention_ref

    query = checked.query.squeeze(1) if checked.single_step else checked.query
    return additive_attention_ref(
        query,
        checked.keys,
        checked.values,
        checked.v,
        checked.bias,
        lengths=checked.lengths,
        mask=checked.mask,
        return_weights=return_weights,
        normalize=normalize,
    )
