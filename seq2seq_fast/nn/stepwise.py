"""Many attention calls over the same keys and values (a decoder's steps), gradients gathered once.

A step-by-step decoder (Bahdanau's recurrence) attends to the same projected keys [B, Tk, H] and
values [B, Tk, Dv] at every target step. Through the plain op, each step's backward returns a
fresh dkeys and dvalues, and autograd adds them up: per step, two tensors of the memory's size
written, read and summed, although a step's own work is only O(B * Tk * H). ``StepwiseMemory``
routes the steps' gradients differently (CPU kernel only):

- the keys and values enter the graph once, through one node whose backward runs after every
  step's backward (autograd's dependency order) and returns the gathered gradients;
- each step's backward (``_additive_attention_bwd_accumulate``) adds its dkeys into one buffer in
  place and forms no dvalues; it keeps its weights and grad_context (O(B * Tk) and O(B * Dv));
- dvalues = sum over steps of p_t^T dctx_t is then one batched product, cat(p)^T cat(dctx).

Results equal the plain op's up to float rounding (the sums are taken in another order). As with
the plain op, a second-order gradient through it raises. A backward that reaches the steps but not
the memory (``torch.autograd.grad`` with an intermediate as input) leaves nothing behind for the
next one: each backward's gathering is keyed by its graph task.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import StepGradients, guard_double_backward
from seq2seq_fast.ops._checks import AttentionInputs
from seq2seq_fast.ops._library import kernel_serves


def forward_saving_inputs(
    ctx, query, keys, values, v, bias, lengths, mask
) -> tuple[Tensor, Tensor]:
    """The forward of a one-step autograd Function over the fused op: -> (context, weights),
    with the inputs and the weights saved for its backward, which may get None gradients."""
    context, weights, _ = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, lengths, mask, True
    )
    ctx.save_for_backward(query, keys, values, v, bias, lengths, mask, weights)
    ctx.set_materialize_grads(False)
    return context, weights


class _StepAttention(torch.autograd.Function):
    """One step's attention through the fused op; keys/values gradients go to the memory."""

    @staticmethod
    def forward(ctx, query, keys, values, v, bias, lengths, mask, memory: StepwiseMemory):
        ctx.memory = memory
        return forward_saving_inputs(ctx, query, keys, values, v, bias, lengths, mask)

    @staticmethod
    def backward(ctx, grad_context, grad_weights):
        query, keys, values, v, bias, lengths, mask, weights = ctx.saved_tensors
        if grad_context is None:
            grad_context = torch.zeros(
                (*query.shape[:2], values.shape[2]), dtype=query.dtype, device=query.device
            )
        grad_query, grad_v, grad_bias = ctx.memory._accumulate(
            grad_context.contiguous(),
            None if grad_weights is None else grad_weights.contiguous(),
            query,
            keys,
            values,
            v,
            bias,
            lengths,
            mask,
            weights,
        )
        return guard_double_backward((grad_query, None, None, grad_v, grad_bias, None, None, None))


class StepwiseMemory(StepGradients):
    """Keys [B, Tk, H] and values [B, Tk, Dv] that many attention calls read, for training.

    Use ``memory.keys`` and ``memory.values`` (aliases that carry the gathered gradients) in place
    of the originals, and pass ``memory`` to :func:`seq2seq_fast.nn.attention.attend` (or
    ``BahdanauAttention.attend_projected(..., stepwise=memory)``) at each call. Build one per
    forward pass with :meth:`for_training`, which returns None where the fused CPU kernel does not
    apply (then call as usual).
    """

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        # Made contiguous once here, not by the op at every step: e.g. nn.GRU(batch_first=True)
        # returns a transposed view, which cost two copies of the memory per step (3% of a
        # tutorial decoder's training step).
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
        return keys is self.keys and values is self.values

    def attend_checked(self, checked: AttentionInputs, return_weights: bool):
        """Inputs as ``check_inputs`` returns them, through this memory -> (context, weights or
        None) as ``additive_attention`` returns them; None where the memory does not apply (it
        does not own the keys and values, no gradient is wanted, a size is zero)."""
        query3, keys, values, bias = checked.query, checked.keys, checked.values, checked.bias
        if not self.owns(keys, values) or not isinstance(return_weights, bool):
            return None
        if min(query3.shape) == 0 or min(keys.shape) == 0 or values.shape[2] == 0:
            return None
        if bias is None:
            bias = query3.new_zeros(query3.shape[-1])
        tensors = (query3, keys, values, checked.v, bias)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return None
        if not kernel_serves("attention", query3):
            return None
        context, weights = self.attend(query3, checked.v, bias, checked.lengths, checked.mask)
        if checked.single_step:
            context, weights = context.squeeze(1), weights.squeeze(1)
        return context, (weights if return_weights else None)

    def attend(self, query3, v, bias, lengths, mask) -> tuple[Tensor, Tensor]:
        """(context [B, Tq, Dv], weights [B, Tq, Tk]) of query3 [B, Tq, H] against this memory."""
        return _StepAttention.apply(query3, self.keys, self.values, v, bias, lengths, mask, self)

    def _accumulate(
        self, grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, weights
    ):
        # bfloat16 keys: dkeys summed over the steps in float32 (the op accepts it)
        acc = torch.float32 if keys.dtype == torch.bfloat16 else keys.dtype
        grads = torch.ops.seq2seq_fast._additive_attention_bwd_accumulate(
            grad_context,
            grad_weights,
            query,
            keys,
            values,
            v,
            bias,
            lengths,
            mask,
            weights,
            self.buffer(keys, acc),
        )
        self.record(weights, grad_context)
        return grads


class StepMemory(NamedTuple):
    """What a stand-in's decoder steps attend to, as :func:`step_memory` makes it."""

    keys: Tensor  # [B, S, H]: the projected keys, or the StepwiseMemory's alias of them
    values: Tensor | None  # [B, S, Dv], or None: the call's own values (see step_memory)
    stepwise: StepwiseMemory | None  # pass to attend(..., stepwise=); None where it does not apply
    projection: Tensor  # the projected keys themselves (what a ProjectionCache should watch)


def step_memory(
    keys: Tensor,
    values: Tensor,
    backend: str,
    *,
    stepwise: bool = True,
    own_values: bool = False,
) -> StepMemory:
    """The memory of a decoder's steps: projected keys [B, S, H] and values [B, S, Dv], through a
    :class:`StepwiseMemory` where it applies (``stepwise`` steps, training on the CPU kernel;
    :meth:`StepwiseMemory.for_training`), else as given. ``own_values``: the values are the
    call's own tensor, which a ProjectionCache holds only weakly; without a StepwiseMemory the
    result then holds None instead (the caller passes its own values again)."""
    memory = StepwiseMemory.for_training(keys, values, backend) if stepwise else None
    if memory is None:
        return StepMemory(keys, None if own_values else values, None, keys)
    return StepMemory(memory.keys, memory.values, memory, keys)
