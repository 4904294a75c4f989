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
from seq2seq_fast.nn.stepwise import forward_saving_inputs
from seq2seq_fast.ops._autograd import StepGradients, guard_double_backward, traced_or_transformed
from seq2seq_fast.ops._checks import check_inputs
from seq2seq_fast.ops._library import kernel_serves

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


def _nothing() -> None:
    return None


class _Derived:
    """A value made from some tensors, with what it was made from (see :func:`derived`). Not
    carried by deep copies and pickles of its module (its graph is one forward pass's)."""

    __slots__ = ("key", "value")

    def __init__(self, key: tuple, value: object) -> None:
        self.key, self.value = key, value

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return (_nothing, ())


def derived(owner: nn.Module, name: str, tensors: tuple, compute):
    """``compute()``, kept in ``owner.<name>`` and reused while the same ``tensors`` (the same
    objects at the same versions) come in the same grad mode: a value an utterance's steps share
    (e.g. the fixed part of location-aware keys)."""
    key = (torch.is_grad_enabled(), *((t, t._version) for t in tensors))
    cached = getattr(owner, name, None)
    if (
        isinstance(cached, _Derived)
        and len(cached.key) == len(key)
        and cached.key[0] == key[0]
        and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(cached.key[1:], key[1:], strict=True))
    ):
        return cached.value
    value = compute()
    setattr(owner, name, _Derived(key, value))
    return value


# --- masks ----------------------------------------------------------------------------------------


def prefix_lengths(valid: Tensor | None) -> Tensor | None:
    """int64 [B]: each row's number of valid frames when they are a prefix of the row (a padding
    mask, True = valid), else None. The fused op then scores only those frames."""
    if valid is None or valid.dim() != 2 or valid.dtype != torch.bool:
        return None
    lengths = valid.sum(1)
    prefix = torch.arange(valid.shape[1], device=valid.device) < lengths.unsqueeze(1)
    return lengths if torch.equal(prefix, valid) else None


def masking(valid: Tensor | None) -> dict[str, Tensor | None]:
    """``attend``'s keyword for a bool [B, T] mask (True = valid) on the CPU: ``lengths`` for a
    padding mask (the fused op then skips the padded frames instead of scoring and dropping
    them; the one difference: a non-finite value in the padding does not reach the context),
    else ``mask``."""
    if valid is not None and valid.device.type == "cpu" and not traced_or_transformed():
        lengths = prefix_lengths(valid)  # (reads the mask: not while tracing)
        if lengths is not None:
            return {"lengths": lengths}
    return {"mask": valid}


# --- values read by many steps, their gradient gathered once --------------------------------------


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


class _GatheredStep(torch.autograd.Function):
    """One step through the fused CPU op: query [B, 1, A] against its own keys [B, T, A] and the
    gatherer's values [B, T, Dv]. The backward (the accumulating kernel, into a zeroed buffer)
    returns the query's, keys', v's and bias's gradients and forms no dvalues: it leaves
    (weights, grad_context) to the gatherer."""

    @staticmethod
    def forward(ctx, query, keys, values, v, bias, lengths, mask, gatherer: GatheredValues):
        ctx.gatherer = gatherer
        return forward_saving_inputs(ctx, query, keys, values, v, bias, lengths, mask)

    @staticmethod
    def backward(ctx, grad_context, grad_weights):
        query, keys, values, v, bias, lengths, mask, weights = ctx.saved_tensors
        if grad_context is None:
            grad_context = query.new_zeros((*query.shape[:2], values.shape[2]))
        else:
            grad_context = grad_context.contiguous()
            ctx.gatherer.record(weights, grad_context)
        # bfloat16 keys: their gradient summed in float32 (the op accepts it), rounded once
        acc = torch.float32 if keys.dtype == torch.bfloat16 else keys.dtype
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
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
            grad_keys,
        )
        grad_keys = grad_keys.to(keys.dtype) if ctx.needs_input_grad[1] else None
        return guard_double_backward(
            (grad_query, grad_keys, None, grad_v, grad_bias, None, None, None)
        )


class GatheredValues(StepGradients):
    """Values [B, T, Dv] that every decoder step reads, for training: each step's backward forms
    no values' gradient and keeps (weights, grad_context), O(B * (T + Dv)); the values' gradient
    of all the steps is one batched product when the backward reaches the values, instead of a
    [B, T, Dv] tensor written and summed per step. For layouts whose keys change every step
    (location-aware attention), so that :class:`~seq2seq_fast.nn.stepwise.StepwiseMemory` (fixed
    keys and values) does not apply.

    Use :meth:`for_training` (None where it does not apply), then ``attend(...)`` per step. On the
    fused CPU kernel a step is one op forward and one accumulating backward (no dvalues); elsewhere
    the op forms only the weights (over a one-column placeholder) and ``context(weights)`` the
    context. A backward that reaches the values spends it (:attr:`spent`): make a new one for the
    next forward pass. Each backward's records are kept apart by its graph task.
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
        weights, ``context`` the context)."""
        step_kernel = query.dim() == 2 and kernel_serves("attention_step", query, keys, self.values)
        plain_softmax = normalize == "softmax" and score_bias is None
        if backend != "reference" and step_kernel and plain_softmax:
            checked = check_inputs(query, keys, self.values, v, None, None, mask)
            lengths = prefix_lengths(checked.mask)
            mask = None if lengths is not None else checked.mask
            query3 = checked.query
            bias = query3.new_zeros(query3.shape[-1])
            context, weights = _GatheredStep.apply(
                query3, checked.keys, checked.values, checked.v, bias, lengths, mask, self
            )
            return context.squeeze(1), weights.squeeze(1)
        _, weights = attend(
            backend,
            query,
            keys,
            self.placeholder,
            v,
            mask=mask,
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


def attend_gathered(
    owner: nn.Module,
    backend: str,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    v: Tensor,
    mask: Tensor | None,
    normalize: str = "softmax",
    score_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``attend(backend, query [B, A], keys [B, T, A], values [B, T, Dv], v, mask=mask,
    normalize=normalize, score_bias=score_bias)`` for a decoder step whose keys change every step
    but whose values do not: when training, through ``owner``'s :class:`GatheredValues` for these
    values (made on the first step that sees them, kept in ``owner._gathered``). Returns
    (context [B, Dv], weights [B, T])."""
    gathered = getattr(owner, "_gathered", None)
    if gathered is None or gathered.source is not values or gathered.spent:
        gathered = GatheredValues.for_training(values)
        owner._gathered = gathered
    if gathered is None or query.dim() != 2:
        return attend(
            backend,
            query,
            keys,
            values,
            v,
            **masking(mask),
            normalize=normalize,
            score_bias=score_bias,
        )
    return gathered.attend(backend, query, keys, v, mask, normalize, score_bias)
