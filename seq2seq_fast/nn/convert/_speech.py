"""Helpers shared by the layouts of speech and NLP toolkits (ESPnet, SpeechBrain, fairseq,
Tacotron 2, Coqui TTS, AllenNLP, d2l): taking over an original module's parts and state, telling
plain layers from the thin wrappers some projects put around them, and masks.

Not a layout itself (the leading underscore keeps the package from importing it as one).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import MODULE_INTERNALS, child_names, own_parameter_names
from seq2seq_fast.ops._checks import masking
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.ops.stepwise import GatheredValues


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
        if key not in MODULE_INTERNALS:
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


# --- values read by many steps, their gradient gathered once (ops/stepwise.py) ---------------


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
    """``additive_attention(query [B, A], keys [B, T, A], values [B, T, Dv], v, mask=mask,
    backend=backend, normalize=normalize, score_bias=score_bias)`` for a
    decoder step whose keys change every step but whose values do not: when training, through
    ``owner``'s :class:`GatheredValues` for these values (made on the first step that sees them,
    kept in ``owner._gathered``). Returns (context [B, Dv], weights [B, T])."""
    gathered = getattr(owner, "_gathered", None)
    if gathered is None or not gathered.owns(values):
        gathered = GatheredValues.for_training(values)
        owner._gathered = gathered
    if gathered is None or query.dim() != 2:
        return additive_attention(
            query,
            keys,
            values,
            v,
            backend=backend,
            **masking(mask),
            normalize=normalize,
            score_bias=score_bias,
        )
    return gathered.attend(backend, query, keys, v, mask, normalize, score_bias)
