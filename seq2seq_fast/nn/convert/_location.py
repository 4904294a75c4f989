"""Training steps of location-aware attention (ESPnet AttLoc, SpeechBrain's location-aware
attention, fairseq's LocationAttention, Tacotron 2, Coqui): keys_t = P + conv_t @ W^T over fixed
values, where P [B, T, A] is the projected memory, conv_t [B*T, C] the location convolution of
step t's previous weights and W [A, C] the location dense layer's weight.

Through plain ops (and the original), a step writes the location term [B, T, A], then the keys,
and its backward a keys gradient [B, T, A] and a values gradient [B, T, Dv] that autograd adds
into P's and the values'. On the fused CPU kernel, :class:`LocationMemory` runs a step as two
extension ops (csrc/additive_attention.cpp, "location-aware steps"): the forward forms each batch
row's keys P + conv_t W^T in per-thread scratch and scores them there (no [B, T, A] tensor is
written or saved), and the backward forms them again, adds the keys gradient into the sequence's
P gradient and multiplies it out to conv_t's and W's gradients in the same pass (no values'
gradient). The location convolution is the extension's too (csrc/location_conv.cpp). The values'
and P's gradients of all the steps are returned once, when the backward reaches them. Results
equal the plain computation's up to float rounding (sums taken in another order).

Not a layout itself (the leading underscore keeps the package from importing it as one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq_fast.nn.convert._speech import _nothing, attend_gathered, prefix_lengths
from seq2seq_fast.nn.stepwise import _MemoryNode
from seq2seq_fast.ops.additive_attention import (
    CPU_KERNEL_ERROR,
    check_inputs,
    guard_double_backward,
    traced_or_transformed,
)

# Without the extension's kernel (not built; bfloat16 features; an even kernel width), window
# products pay off for narrow windows (1-2 channels x 15-31 taps: 1.2-1.7x faster than conv1d
# forward and backward at B=32, T=100, 1 thread); wide ones (ESPnet's default 201 taps) stay with
# conv1d. The kernel (csrc/location_conv.cpp) is 1.4-3.6x faster than either at those sizes.
MAX_WINDOW = 64


def _windows(features: Tensor, width: int) -> Tensor:
    """[B*T, Cin*K]: each frame's zero-padded window of features [B, Cin, T] (im2col)."""
    batch, channels, frames = features.shape
    padded = F.pad(features, (width // 2, width // 2))
    return padded.unfold(2, width, 1).transpose(1, 2).reshape(batch * frames, channels * width)


class _WindowConv(torch.autograd.Function):
    """conv1d(features [B, Cin, T], weight [C, Cin, K], padding K // 2) as [B*T, C], by one
    product of the frames' windows with the weight; the backward forms the windows again and
    folds the windows' gradient back onto the frames (col2im)."""

    @staticmethod
    def forward(ctx, features: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(features, weight)
        rows = weight.reshape(weight.shape[0], -1)
        return _windows(features, weight.shape[-1]).mm(rows.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        features, weight = ctx.saved_tensors
        batch, channels, frames = features.shape
        width = weight.shape[-1]
        rows = weight.reshape(weight.shape[0], -1)
        grad_features = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(_windows(features, width)).view_as(weight)
        if ctx.needs_input_grad[0]:
            cols = grad.mm(rows).view(batch, frames, channels * width).transpose(1, 2)
            padded = F.fold(cols, output_size=(1, frames + width - 1), kernel_size=(1, width))
            grad_features = padded.view(batch, channels, -1)[:, :, width // 2 : width // 2 + frames]
        return grad_features, grad_weight


class _KernelConv(torch.autograd.Function):
    """conv1d(features [B, Cin, T], weight [C, Cin, K], padding K // 2, K odd) as [B*T, C], by the
    extension's location convolution (csrc/location_conv.cpp): one pass per batch row forward and
    one backward, no im2col or col2im tensors."""

    @staticmethod
    def forward(ctx, features: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(features, weight)
        return torch.ops.seq2seq_fast._location_conv_fwd(features, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        features, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_features, grad_weight = torch.ops.seq2seq_fast._location_conv_bwd(
            grad, features, weight, needs[0], needs[1]
        )  # a gradient not asked for comes back empty
        return guard_double_backward(
            (grad_features if needs[0] else None, grad_weight if needs[1] else None)
        )


def location_columns(features: Tensor, conv_weight: Tensor) -> Tensor:
    """[B*T, C]: the location convolution of features [B, Cin, T] (conv_weight [C, Cin, K], or a
    Conv2d's [C, 1, 1, K]: bias-free, stride 1, zero padding K // 2), frames as rows."""
    weight = conv_weight.reshape(conv_weight.shape[0], -1, conv_weight.shape[-1])
    plain = traced_or_transformed() or torch.is_autocast_enabled("cpu")
    on_cpu = features.device.type == "cpu" and not plain
    kernel_dtype = (
        features.dtype in (torch.float32, torch.float64) and features.dtype == weight.dtype
    )
    if on_cpu and kernel_dtype and weight.shape[-1] % 2 == 1 and CPU_KERNEL_ERROR is None:
        return _KernelConv.apply(features, weight)
    if on_cpu and weight.shape[1] * weight.shape[2] <= MAX_WINDOW:
        return _WindowConv.apply(features, weight)
    conv = F.conv1d(features, weight, padding=weight.shape[-1] // 2)  # [B, C, T]
    return conv.transpose(1, 2).reshape(-1, weight.shape[0])


def location_keys(
    projected: Tensor, features: Tensor, conv_weight: Tensor, dense_weight: Tensor
) -> Tensor:
    """A location-aware step's keys: ``projected + dense(conv(features))``.

    projected [B, T, A] (the projected memory, plus the dense layer's bias where it has one);
    features [B, Cin, T] (previous / cumulative weights); conv_weight as :func:`location_columns`
    takes it; dense_weight [A, C] (a bias-free Linear's). Returns [B, T, A]. The same sums as the
    original's conv, transpose, Linear and add; the dense layer's product is added into the
    projected memory by one ``addmm``.
    """
    batch, frames, width = projected.shape
    conv = location_columns(features, conv_weight)
    keys = torch.addmm(projected.reshape(batch * frames, width), conv, dense_weight.t())
    return keys.view(batch, frames, width)


class _LocationStep(torch.autograd.Function):
    """One step: (context [B, 1, Dv], weights [B, 1, T]) of query [B, 1, A] against keys
    projected + conv @ weight^T, formed inside the kernels (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, projected, conv, weight, values, v, bias, lengths, mask, memory):
        context, weights = torch.ops.seq2seq_fast._location_attention_fwd(
            query, projected, conv, weight, values, v, bias, lengths, mask
        )
        saved = (query, projected, conv, weight, values, v, bias, lengths, mask, weights)
        ctx.save_for_backward(*saved)
        ctx.memory = memory
        ctx.set_materialize_grads(False)
        return context, weights

    @staticmethod
    def backward(ctx, grad_context, grad_weights):
        query, projected, conv, weight, values, v, bias, lengths, mask, weights = ctx.saved_tensors
        memory: LocationMemory = ctx.memory
        if grad_context is None:
            grad_context = query.new_zeros((*query.shape[:2], values.shape[2]))
        else:
            grad_context = grad_context.contiguous()
        grads = torch.ops.seq2seq_fast._location_attention_bwd(
            grad_context, None if grad_weights is None else grad_weights.contiguous(),
            query, projected, conv, weight, values, v, bias, lengths, mask, weights,
            memory._accumulator(),
        )  # fmt: skip
        grad_query, grad_conv, grad_weight, grad_v, grad_bias = grads
        needs = ctx.needs_input_grad
        memory._record(weights[:, 0] if needs[4] else None, grad_context[:, 0])
        return guard_double_backward(
            (
                grad_query,
                None,
                grad_conv if needs[2] else None,
                grad_weight if needs[3] else None,
                None,
                grad_v,
                grad_bias,
                None,
                None,
                None,
            )
        )


class LocationMemory:
    """The projected memory P [B, T, A] and values [B, T, Dv] of one sequence's location-aware
    steps, for training on the fused CPU kernel (see the module docstring). Build it with
    :meth:`for_training` (None where it does not apply), then call :meth:`attend` per step. A
    backward that reaches P and the values spends it (:attr:`spent`); each backward's gathering
    is kept apart by its graph task."""

    def __init__(self, projected: Tensor, values: Tensor) -> None:
        self.sources = (projected, values)
        self.projected, self.values = _MemoryNode.apply(projected, values, self)
        self.spent = False
        self._reset(None)

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the module starts without one (its graph is this forward's)

    def __reduce__(self):
        return (_nothing, ())  # likewise when the module is pickled

    @classmethod
    def for_training(cls, projected: Tensor, values: Tensor, backend: str) -> LocationMemory | None:
        if backend == "reference" or CPU_KERNEL_ERROR is not None or not torch.is_grad_enabled():
            return None
        if traced_or_transformed() or torch.is_autocast_enabled("cpu"):
            return None
        if projected.dim() != 3 or values.dim() != 3 or min(values.shape) == 0:
            return None
        if min(projected.shape) == 0 or not projected.is_contiguous():
            return None
        tensors = (projected, values)
        if any(
            t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) for t in tensors
        ):
            return None
        return cls(projected, values)

    def serves(self, projected: Tensor, values: Tensor) -> bool:
        return not self.spent and self.sources[0] is projected and self.sources[1] is values

    def attend(
        self, query: Tensor, conv: Tensor, weight: Tensor, v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """query [B, A], conv [B*T, C], weight [A, C], v [A], mask bool [B, T] (True = valid) or
        None -> (context [B, Dv], weights [B, T])."""
        query3, _, _, v, _, _, mask, _ = check_inputs(
            query, self.projected, self.values, v, mask=mask
        )
        batch, frames, width = self.projected.shape
        if conv.shape != (batch * frames, weight.shape[1]) or weight.shape[0] != width:
            raise ValueError(
                f"location term: conv {list(conv.shape)} and weight {list(weight.shape)} do not "
                f"match keys [{batch}, {frames}, {width}]"
            )
        lengths = prefix_lengths(mask)
        mask = None if lengths is not None else mask
        bias = query3.new_zeros(width)
        context, weights = _LocationStep.apply(
            query3, self.projected, conv, weight, self.values, v, bias, lengths, mask, self
        )
        return context.squeeze(1), weights.squeeze(1)

    def _reset(self, task: int | None) -> None:
        self._task = task
        self._grad_projected: Tensor | None = None
        self._weights: list[Tensor] = []
        self._grad_contexts: list[Tensor] = []

    def _accumulator(self) -> Tensor:
        """P's gradient in this backward pass, which each step's kernel adds its keys gradient
        into (zeros before the pass's first step)."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # a new backward pass: nothing of an earlier one counts
            self._reset(task)
        if self._grad_projected is None:
            self._grad_projected = torch.zeros_like(self.sources[0])
        return self._grad_projected

    def _record(self, weights: Tensor | None, grad_context: Tensor) -> None:
        """A step's weights and context gradient, for the values' gradient (after
        :meth:`_accumulator` in the same step's backward)."""
        if weights is not None:
            self._weights.append(weights)
            self._grad_contexts.append(grad_context)

    def _collect(self) -> tuple[Tensor | None, Tensor | None]:
        """(dP, dvalues) gathered in this backward pass (None: no step contributed). The memory
        is spent: it lets go of its tensors (the module keeps it until its next sequence)."""
        self.spent = True
        self.sources = (None, None)
        self.projected = self.values = None
        if self._task != torch._C._current_graph_task_id():
            self._reset(None)
            return None, None
        grad_values = None
        if self._weights:
            weights = torch.stack(self._weights, dim=1)  # [B, S, T]
            grads = torch.stack(self._grad_contexts, dim=1)  # [B, S, Dv]
            grad_values = torch.bmm(weights.transpose(1, 2), grads)
        grad_projected = self._grad_projected
        self._reset(None)
        return grad_projected, grad_values


def attend_location(
    owner: nn.Module,
    backend: str,
    query: Tensor,
    projected: Tensor,
    location: tuple[Tensor, Tensor, Tensor],
    values: Tensor,
    v: Tensor,
    mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """A location-aware step: ``attend(backend, query [B, A], projected + dense(conv(features)),
    values [B, T, Dv], v, mask)`` with ``location = (features [B, Cin, T], conv_weight,
    dense_weight [A, C])`` (see :func:`location_keys`); mask bool [B, T] (True = valid) or None.
    When training on the fused CPU kernel, through ``owner``'s :class:`LocationMemory` for these
    projected memory and values (kept in ``owner._location``); else through
    :func:`~seq2seq_fast.nn.convert._speech.attend_gathered`. Returns (context [B, Dv],
    weights [B, T])."""
    features, conv_weight, dense_weight = location
    memory = getattr(owner, "_location", None)
    if not (isinstance(memory, LocationMemory) and memory.serves(projected, values)):
        memory = LocationMemory.for_training(projected, values, backend)
        owner._location = memory
    if memory is None or query.dim() != 2:
        keys = location_keys(projected, features, conv_weight, dense_weight)
        return attend_gathered(owner, backend, query, keys, values, v, mask)
    return memory.attend(query, location_columns(features, conv_weight), dense_weight, v, mask)
