"""Many attention steps over the same memory (a decoder's), their memory gradients gathered once.

A step-by-step decoder attends to the same values [B, Tk, Dv] at every target step (and, for
Bahdanau's recurrence, to the same projected keys [B, Tk, H]). Through the plain op, each step's
backward returns a fresh gradient of the memory and autograd adds them up: per step, tensors of
the memory's size written, read and summed, although a step's own work is only O(B * Tk * H).
The memories here route the steps' gradients differently (fused CPU kernel only):

- the memory tensors enter the graph once, through one node whose backward runs after every
  step's backward (autograd's dependency order) and returns the gathered gradients
  (:class:`~seq2seq_fast.ops._autograd.StepGradients`);
- each step's backward (:class:`StepAttention`: ``_additive_attention_bwd_accumulate``) forms no
  values' gradient and keeps its weights and grad_context (O(B * Tk) and O(B * Dv)); with the keys
  gathered too it adds its keys' gradient into one buffer in place;
- the values' gradient is then one batched product, cat(p)^T cat(dctx).

    StepwiseMemory   fixed keys and values (Bahdanau, GNMT, the NLP layouts)
    GatheredValues   fixed values, keys that change every step (location-aware layouts)
    LocationMemory   fixed projected memory P and values, keys P + conv_t @ W^T formed inside the
                     location-aware step op (ops/location_attention.py)

Results equal the plain op's up to float rounding (the sums are taken in another order). As with
the plain op, a second-order gradient through them raises. A backward that reaches the steps but
not the memory (``torch.autograd.grad`` with an intermediate as input) leaves nothing behind for
the next one: each backward's gathering is keyed by its graph task. Sums of bfloat16 gradients are
kept in float32 (:func:`~seq2seq_fast.ops._autograd.gradient_sum_dtype`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import (
    StepGradients,
    gradient_sum_dtype,
    guard_double_backward,
    traced_or_transformed,
)
from seq2seq_fast.ops._checks import check_inputs, prefix_lengths
from seq2seq_fast.ops._library import kernel_serves
from seq2seq_fast.ops.additive_attention import (
    additive_attention,
    check_normalize,
    check_score_bias,
)
from seq2seq_fast.ops.location_attention import _LocationStep


class StepAttention(torch.autograd.Function):
    """One decoder step through the fused CPU op: query [B, Tq, H] against keys [B, Tk, H] and
    the gatherer's values [B, Tk, Dv] -> (context [B, Tq, Dv], weights [B, Tq, Tk]).

    The backward (the accumulating kernel) returns the query's, v's and bias's gradients, forms no
    values' gradient (it records (weights, grad_context) with ``gatherer``) and adds the keys'
    gradient into a sum: with ``keys_gathered`` the gatherer's buffer (the keys are the memory's,
    returned once by the gatherer); else a zeroed sum of this step's own, returned here."""

    @staticmethod
    def forward(ctx, query, keys, values, v, bias, lengths, mask, gatherer, keys_gathered: bool):
        context, weights, _ = torch.ops.seq2seq_fast.additive_attention_fwd(
            query, keys, values, v, bias, lengths, mask, True
        )
        ctx.save_for_backward(query, keys, values, v, bias, lengths, mask, weights)
        ctx.set_materialize_grads(False)
        ctx.gatherer, ctx.keys_gathered = gatherer, keys_gathered
        return context, weights

    @staticmethod
    def backward(ctx, grad_context, grad_weights):
        query, keys, values, v, bias, lengths, mask, weights = ctx.saved_tensors
        gatherer = ctx.gatherer
        if grad_context is None:
            grad_context = query.new_zeros((*query.shape[:2], values.shape[2]))
        else:
            grad_context = grad_context.contiguous()
            gatherer.record(weights, grad_context)
        if ctx.keys_gathered:
            key_sum = gatherer.buffer(keys)
        else:
            key_sum = torch.zeros(
                keys.shape, dtype=gradient_sum_dtype(keys.dtype), device=keys.device
            )
        grad_query, grad_v, grad_bias = torch.ops.seq2seq_fast._additive_attention_bwd_accumulate(
            grad_context,
            None if grad_weights is None else grad_weights.contiguous(),
            query,
            keys,
            values,
            v,
            bias,
            lengths,
            mask,
            weights,
            key_sum,
        )
        grad_keys = None
        if not ctx.keys_gathered and ctx.needs_input_grad[1]:
            grad_keys = key_sum.to(keys.dtype)
        return guard_double_backward(
            (grad_query, grad_keys, None, grad_v, grad_bias, None, None, None, None)
        )


class StepwiseMemory(StepGradients):
    """Keys [B, Tk, H] and values [B, Tk, Dv] that many attention calls read, for training.

    Use ``memory.keys`` and ``memory.values`` (aliases that carry the gathered gradients) in place
    of the originals, and pass ``memory`` as ``stepwise=`` to
    :func:`~seq2seq_fast.ops.additive_attention.additive_attention` (or
    ``BahdanauAttention.attend_projected(..., stepwise=memory)``) at each call. Build one per
    forward pass with :meth:`for_training`, which returns None where the fused CPU kernel does not
    apply (then call as usual).
    """

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        # Made contiguous once here, not by the op at every step: e.g. nn.GRU(batch_first=True)
        # returns a transposed view, which cost two copies of the memory per step.
        super().__init__()
        self.keys, self.values = self.attach(keys.contiguous(), values.contiguous())

    @classmethod
    def for_training(cls, keys: Tensor, values: Tensor, backend: str) -> StepwiseMemory | None:
        """A StepwiseMemory when it pays and applies: gradients wanted for keys or values, the
        fused CPU kernel serving them under ``backend``, not inside torch.compile (whose graph the
        memory's Python-side state would break) or a torch.func transform. Otherwise None."""
        if backend == "reference" or not torch.is_grad_enabled():
            return None
        if not (keys.requires_grad or values.requires_grad):
            return None
        if not kernel_serves("attention_step", keys, values):
            return None
        if keys.dim() != 3 or values.dim() != 3 or min(keys.shape) == 0 or values.shape[2] == 0:
            return None  # the op's checks (and the reference for empty sizes) handle these
        return cls(keys, values)

    def owns(self, keys: Tensor, values: Tensor) -> bool:
        """Whether ``keys`` and ``values`` are this memory's (its aliases)."""
        return keys is self.keys and values is self.values

    def attend(self, query3, v, bias, lengths, mask) -> tuple[Tensor, Tensor]:
        """(context [B, Tq, Dv], weights [B, Tq, Tk]) of query3 [B, Tq, H] against this memory;
        inputs as ``check_inputs`` returns them, bias not None (the dispatch calls this)."""
        return StepAttention.apply(
            query3, self.keys, self.values, v, bias, lengths, mask, self, True
        )


class _GatheredContext(torch.autograd.Function):
    """context [B, Dv] = weights [B, T] @ values [B, T, Dv]; the values' gradient of this step is
    left to the gatherer (one product for all the steps), the weights' is returned."""

    @staticmethod
    def forward(ctx, weights: Tensor, values: Tensor, gatherer: GatheredValues) -> Tensor:
        ctx.save_for_backward(weights, values)
        ctx.gatherer = gatherer
        device = values.device.type  # under autocast the product runs in its dtype: so must its
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return torch.bmm(weights.unsqueeze(1), values).squeeze(1)

    @staticmethod
    def backward(ctx, grad_context: Tensor):
        weights, values = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            grad_weights = torch.bmm(values, grad_context.unsqueeze(2)).squeeze(2)
        ctx.gatherer.record(weights.unsqueeze(1), grad_context.to(weights.dtype).unsqueeze(1))
        return grad_weights.to(weights.dtype), None, None


class GatheredValues(StepGradients):
    """Values [B, T, Dv] that every decoder step reads, for training: each step's backward forms
    no values' gradient and keeps (weights, grad_context), O(B * (T + Dv)); the values' gradient
    of all the steps is one batched product when the backward reaches the values, instead of a
    [B, T, Dv] tensor written and summed per step. For layouts whose keys change every step
    (location-aware attention), so that :class:`StepwiseMemory` (fixed keys and values) does not
    apply.

    Use :meth:`for_training` (None where it does not apply), then :meth:`attend` per step. On the
    fused CPU kernel a step is one op forward and one accumulating backward (:class:`StepAttention`
    with the keys not gathered); elsewhere the op forms only the weights (over a one-column
    placeholder) and :meth:`context` the context. A backward that reaches the values spends it
    (:attr:`spent`): make a new one for the next forward pass.
    """

    def __init__(self, values: Tensor) -> None:
        super().__init__()
        self.source = values
        (self.values,) = self.attach(values)
        self._placeholder: Tensor | None = None
        self.spent = False

    @classmethod
    def for_training(cls, values: Tensor) -> GatheredValues | None:
        if not (torch.is_grad_enabled() and values.requires_grad) or traced_or_transformed():
            return None
        if values.dim() != 3 or min(values.shape) == 0:
            return None
        return cls(values)

    def owns(self, values: Tensor) -> bool:
        """Whether ``values`` are the ones this (unspent) gatherer was made for."""
        return not self.spent and self.source is values

    @property
    def placeholder(self) -> Tensor:
        """The op's values argument where it forms only the weights: one column nobody reads."""
        if self._placeholder is None:
            source = self.source.detach()
            self._placeholder = source.new_zeros(source.shape[0], source.shape[1], 1)
        return self._placeholder

    def attend(
        self,
        backend: str,
        query: Tensor,
        keys: Tensor,
        v: Tensor,
        mask: Tensor | None,
        normalize: str = "softmax",
        score_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One step: query [B, A], keys [B, T, A], v [A], mask bool [B, T] (True = valid) or None
        -> (context [B, Dv], weights [B, T]) over these values. ``normalize`` and ``score_bias``
        as ``additive_attention`` takes them (other than a plain softmax: the op forms the
        weights, :meth:`context` the context)."""
        step_kernel = query.dim() == 2 and kernel_serves("attention_step", query, keys, self.values)
        plain_softmax = normalize == "softmax" and score_bias is None
        if backend != "reference" and step_kernel and plain_softmax:
            checked = check_inputs(query, keys, self.values, v, None, None, mask)
            lengths = prefix_lengths(checked.mask)
            mask = None if lengths is not None else checked.mask
            query3 = checked.query
            bias = query3.new_zeros(query3.shape[-1])
            context, weights = StepAttention.apply(
                query3, checked.keys, checked.values, checked.v, bias, lengths, mask, self, False
            )
            return context.squeeze(1), weights.squeeze(1)
        _, weights = additive_attention(
            query,
            keys,
            self.placeholder,
            v,
            mask=mask,
            backend=backend,
            normalize=normalize,
            score_bias=score_bias,
        )
        return self.context(weights), weights

    def context(self, weights: Tensor) -> Tensor:
        """[B, T] weights -> [B, Dv] context over these values."""
        return _GatheredContext.apply(weights, self.values, self)

    def gathered(self) -> tuple[Tensor | None]:
        """The values' gradient of this backward pass's steps; the gatherer is spent."""
        self.spent = True
        _, grad_values = self.collect()
        return (None if grad_values is None else grad_values.to(self.source.dtype),)


class LocationMemory(StepGradients):
    """The projected memory P [B, T, A] and values [B, T, Dv] of one sequence's location-aware
    steps (keys_t = P + conv_t @ W^T), for training on the fused CPU kernel: a step is the
    location-aware step op (:mod:`seq2seq_fast.ops.location_attention`), which forms the keys
    inside the kernels and adds the keys' gradient into the sequence's P gradient. Build it with
    :meth:`for_training` (None where it does not apply), then call :meth:`attend` per step. A
    backward that reaches P and the values spends it (:attr:`spent`)."""

    def __init__(self, projected: Tensor, values: Tensor) -> None:
        super().__init__()
        self.sources = (projected, values)
        self.projected, self.values = self.attach(projected, values)
        self.spent = False

    @classmethod
    def for_training(cls, projected: Tensor, values: Tensor, backend: str) -> LocationMemory | None:
        if backend == "reference" or not torch.is_grad_enabled():
            return None
        if not kernel_serves("location", projected, values):
            return None
        if projected.dim() != 3 or values.dim() != 3 or min(values.shape) == 0:
            return None
        if min(projected.shape) == 0 or not projected.is_contiguous():
            return None
        return cls(projected, values)

    def owns(self, projected: Tensor, values: Tensor) -> bool:
        """Whether these are the (unspent) memory's projected memory and values."""
        return not self.spent and self.sources[0] is projected and self.sources[1] is values

    def attend(
        self,
        query: Tensor,
        conv: Tensor,
        weight: Tensor,
        v: Tensor,
        mask: Tensor | None,
        normalize: str = "softmax",
        score_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """query [B, A], conv [B*T, C], weight [A, C], v [A], mask bool [B, T] (True = valid) or
        None -> (context [B, Dv], weights [B, T]); ``normalize`` and ``score_bias`` as
        ``additive_attention`` takes them."""
        checked = check_inputs(query, self.projected, self.values, v, mask=mask)
        query3, v, mask = checked.query, checked.v, checked.mask
        batch, frames, width = self.projected.shape
        if conv.shape != (batch * frames, weight.shape[1]) or weight.shape[0] != width:
            raise ValueError(
                f"location term: conv {list(conv.shape)} and weight {list(weight.shape)} do not "
                f"match keys [{batch}, {frames}, {width}]"
            )
        lengths = prefix_lengths(mask)
        mask = None if lengths is not None else mask
        # (under autocast: the casts check_inputs made of query and v, differentiable)
        conv, weight = conv.to(query3.dtype), weight.to(query3.dtype)
        bias = query3.new_zeros(width)
        score_bias = check_score_bias(score_bias, query3)
        context, weights = _LocationStep.apply(
            query3,
            self.projected,
            conv,
            weight,
            self.values,
            v,
            bias,
            lengths,
            mask,
            self,
            check_normalize(normalize),
            score_bias,
        )
        return context.squeeze(1), weights.squeeze(1)

    def gathered(self) -> tuple[Tensor | None, Tensor | None]:
        """(dP, dvalues) gathered in this backward pass (None: no step contributed). The memory
        is spent: it lets go of its tensors (the module keeps it until its next sequence)."""
        self.spent = True
        self.sources = (None, None)
        self.projected = self.values = None
        return self.collect()
