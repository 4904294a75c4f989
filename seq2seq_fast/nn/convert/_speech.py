"""Helpers shared by the layouts of speech and NLP toolkits (ESPnet, SpeechBrain, fairseq,
Tacotron 2, Coqui TTS, AllenNLP, d2l): taking over an original module's parts and state, telling
plain layers from the thin wrappers some projects put around them, and masks.

Not a layout itself (the leading underscore keeps the package from importing it as one).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.attention import attend
from seq2seq_fast.nn.convert._base import child_names, own_parameter_names
from seq2seq_fast.ops.additive_attention import traced_or_transformed

# Attributes every nn.Module has; everything else in an original's __dict__ is its own state.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def adopt(stand_in: nn.Module, original: nn.Module) -> None:
    """Give ``stand_in`` the original's own parameters, buffers and children (the same objects,
    registered in the same order, so state_dict keys and their order are unchanged) and a
    shallow copy of its plain attributes (cached projections, masks, flags, previous weights)."""
    for name, param in original._parameters.items():
        stand_in.register_parameter(name, param)
    for name, buffer in original._buffers.items():
        persistent = name not in original._non_persistent_buffers_set
        stand_in.register_buffer(name, buffer, persistent=persistent)
    for name, child in original._modules.items():
        stand_in.add_module(name, child)
    for key, value in vars(original).items():
        if key not in _MODULE_INTERNALS:
            setattr(stand_in, key, value)


def linear_of(module: object) -> nn.Linear | None:
    """The nn.Linear itself, or the one inside a pass-through wrapper whose only part is
    ``linear_layer`` (NVIDIA's LinearNorm, Coqui's Linear); else None. Whether the wrapper really
    passes through is the safety check's to find out."""
    if type(module) is nn.Linear:
        return module
    if isinstance(module, nn.Module) and not own_parameter_names(module):
        if child_names(module) == {"linear_layer"} and type(module.linear_layer) is nn.Linear:
            return module.linear_layer
    return None


def conv1d_of(module: object) -> nn.Conv1d | None:
    """The nn.Conv1d itself, or the one inside a wrapper whose only part is ``conv`` (NVIDIA's
    ConvNorm); else None."""
    if type(module) is nn.Conv1d:
        return module
    if isinstance(module, nn.Module) and not own_parameter_names(module):
        if child_names(module) == {"conv"} and type(module.conv) is nn.Conv1d:
            return module.conv
    return None


def is_score_layer(module: object, in_features: int) -> bool:
    """A Linear (or wrapped one) from the attention width to one score."""
    linear = linear_of(module)
    return linear is not None and linear.in_features == in_features and linear.out_features == 1


def same_padding_conv(conv: object, in_channels: int) -> bool:
    """A stride-1, undilated, ungrouped, odd-width, zero-padded conv that keeps the length."""
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d)):
        return False
    width = conv.kernel_size[-1]
    return (
        conv.in_channels == in_channels
        and all(s == 1 for s in conv.stride)
        and all(d == 1 for d in conv.dilation)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and width % 2 == 1
        and conv.padding[-1] == width // 2
        and all(k == 1 for k in conv.kernel_size[:-1])
        and all(p == 0 for p in conv.padding[:-1])
    )


def is_location_layer(conv_module: object, dense_module: object, width: int) -> bool:
    """Tacotron 2's location layer: a bias-free same-length conv over the 2 attention channels (this
    step's and the cumulative weights), then a bias-free Linear to the attention width."""
    conv, dense = conv1d_of(conv_module), linear_of(dense_module)
    return (
        conv is not None
        and conv.bias is None
        and same_padding_conv(conv, in_channels=2)
        and dense is not None
        and dense.bias is None
        and dense.in_features == conv.out_channels
        and dense.out_features == width
    )


def is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scaled(weight_row: Tensor, scaling: object) -> Tensor:
    """The score vector with a softmax temperature folded in: softmax(s * (w . h)) is the
    softmax of (s * w) . h. ``scaling`` may be a Python number or a tensor."""
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling == 1:
        return weight_row
    return weight_row * scaling


def valid_from_padding(padding: Tensor | None) -> Tensor | None:
    """bool [B, T] True = may attend, from a padding mask (True / nonzero = padding)."""
    if padding is None:
        return None
    return padding == 0 if padding.dtype != torch.bool else ~padding


# --- values read by many steps, their gradient gathered once --------------------------------------


class _ValuesNode(torch.autograd.Function):
    """values -> an alias; the backward returns what the steps gathered (after all of them)."""

    @staticmethod
    def forward(ctx, values: Tensor, gatherer: GatheredValues) -> Tensor:
        ctx.gatherer = gatherer
        ctx.set_materialize_grads(False)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad_values: Tensor | None):
        gathered = ctx.gatherer._collect()
        if gathered is None:
            return grad_values, None
        return (gathered if grad_values is None else gathered + grad_values), None


class _GatheredContext(torch.autograd.Function):
    """context [B, Dv] = weights [B, T] @ values [B, T, Dv]; the values' gradient of this step is
    left to the gatherer (one product for all the steps), the weights' is returned."""

    @staticmethod
    def forward(ctx, weights: Tensor, values: Tensor, gatherer: GatheredValues) -> Tensor:
        ctx.save_for_backward(weights, values)
        ctx.gatherer = gatherer
        return torch.bmm(weights.unsqueeze(1), values).squeeze(1)

    @staticmethod
    def backward(ctx, grad_context: Tensor):
        weights, values = ctx.saved_tensors
        ctx.gatherer._record(weights, grad_context)
        grad_weights = torch.bmm(values, grad_context.unsqueeze(2)).squeeze(2)
        return grad_weights, None, None


def _nothing() -> None:
    return None


class GatheredValues:
    """Values [B, T, Dv] that every decoder step reads through weights @ values, for training:
    each step's backward returns only the weights' gradient and keeps (weights, grad_context),
    O(B * (T + Dv)); the values' gradient of all the steps is one batched product when the
    backward reaches the values, instead of a [B, T, Dv] outer product written and summed per
    step. For layouts whose keys change every step (location-aware attention), so that
    :class:`~seq2seq_fast.nn.stepwise.StepwiseMemory` (fixed keys and values) does not apply.

    Use :meth:`for_training` (None where it does not apply), then ``context(weights)`` per step.
    A backward that reaches the values spends it (:attr:`spent`): make a new one for the next
    forward pass. Each backward's records are kept apart by its graph task.
    """

    def __init__(self, values: Tensor) -> None:
        self.source = values
        self.values = _ValuesNode.apply(values, self)
        # the fused op's values argument: one column nobody reads, no gradient
        self.placeholder = values.detach().new_zeros(values.shape[0], values.shape[1], 1)
        self.spent = False
        self._task: int | None = None
        self._weights: list[Tensor] = []
        self._grads: list[Tensor] = []

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the module starts without one (its graph is this forward's)

    def __reduce__(self):
        return (_nothing, ())  # likewise when the module is pickled (torch.save(model))

    @classmethod
    def for_training(cls, values: Tensor) -> GatheredValues | None:
        if not (torch.is_grad_enabled() and values.requires_grad) or traced_or_transformed():
            return None
        if values.dim() != 3 or min(values.shape) == 0:
            return None
        return cls(values)

    def context(self, weights: Tensor) -> Tensor:
        """[B, T] weights -> [B, Dv] context over these values."""
        return _GatheredContext.apply(weights, self.values, self)

    def _record(self, weights: Tensor, grad_context: Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:  # a new backward pass: nothing of an earlier one counts
            self._task, self._weights, self._grads = task, [], []
        self._weights.append(weights)
        self._grads.append(grad_context)

    def _collect(self) -> Tensor | None:
        self.spent = True
        if self._task != torch._C._current_graph_task_id() or not self._weights:
            self._task, self._weights, self._grads = None, [], []
            return None
        weights = torch.stack(self._weights, dim=1)  # [B, S, T]
        grads = torch.stack(self._grads, dim=1)  # [B, S, Dv]
        self._task, self._weights, self._grads = None, [], []
        return torch.bmm(weights.transpose(1, 2), grads)


def attend_gathered(
    owner: nn.Module,
    backend: str,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    v: Tensor,
    mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``attend(backend, query [B, A], keys [B, T, A], values [B, T, Dv], v, mask=mask)`` for a
    decoder step whose keys change every step but whose values do not: when training, the
    context is formed over ``owner``'s :class:`GatheredValues` for these values (made on the first
    step that sees them, kept in ``owner._gathered``) and the fused op forms only the weights.
    Returns (context [B, Dv], weights [B, T])."""
    gathered = getattr(owner, "_gathered", None)
    if gathered is None or gathered.source is not values or gathered.spent:
        gathered = GatheredValues.for_training(values)
        owner._gathered = gathered
    if gathered is None or query.dim() != 2:
        return attend(backend, query, keys, values, v, mask=mask)
    _, weights = attend(backend, query, keys, gathered.placeholder, v, mask=mask)
    return gathered.context(weights), weights
