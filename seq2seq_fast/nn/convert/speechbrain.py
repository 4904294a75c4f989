"""SpeechBrain's ``ContentBasedAttention`` and ``LocationAwareAttention``
(speechbrain/nnet/attention.py).

Original parameters: ``mlp_enc`` (enc_dim -> attn_dim), ``mlp_dec`` (dec_dim -> attn_dim), both
with bias; ``mlp_attn`` (attn_dim -> 1, no bias); ``mlp_out`` (enc_dim -> output_dim); a
parameterless ``softmax`` child. The location-aware one adds ``conv_loc`` (Conv1d 1 -> C, width
2K+1, padding K, no bias) and ``mlp_loc`` (C -> attn_dim, with bias). ``scaling`` (a number).
State, cleared by ``reset()``: ``precomputed_enc_h``, ``mask`` (1 = valid, in enc_len's dtype)
and ``enc_len``; the location-aware one also ``prev_attn`` (the previous weights, detached; a
beam searcher reorders it in place of the module). Original math and call (batch-first)::

    forward(enc_states [B, T, E], enc_len [B] (frames, any numeric dtype), dec_states [B, D])
        -> (mlp_out(context) [B, output_dim], weights [B, T])
    first call: precomputed_enc_h = mlp_enc(enc_states), mask = arange(T) < enc_len,
        prev_attn = mask / enc_len                    (location-aware)
    keys = precomputed_enc_h [+ mlp_loc(conv_loc(prev_attn))]
    e = mlp_attn(tanh(keys + mlp_dec(dec_states))); e[mask == 0] = -inf
    weights = softmax(scaling * e); prev_attn = weights.detach()
    context = weights @ enc_states

``scaling`` is folded into the score vector. One difference: a row with no valid frame gives NaN
there and zeros here. The content-based training steps go through a StepwiseMemory built with
the cached projection; the location-aware ones through a
:class:`~seq2seq_fast.nn.convert._location.LocationMemory` (keys by one
addmm, no location term written; the projected memory's and the values' gradients gathered once
per sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    is_linear,
    own_parameter_names,
    register,
    score_row,
)
from seq2seq_fast.nn.convert._location import attend_location
from seq2seq_fast.nn.convert._speech import (
    adopt,
    derived,
    is_finite_number,
    same_padding_conv,
    scaled,
)
from seq2seq_fast.nn.stepwise import StepwiseMemory
from seq2seq_fast.ops._checks import masking
from seq2seq_fast.ops.additive_attention import additive_attention


def _length_mask(enc_len: Tensor, max_len: int) -> Tensor:
    """[B, max_len]: 1 where position < enc_len, in enc_len's dtype (SpeechBrain's
    length_to_mask)."""
    positions = torch.arange(max_len, device=enc_len.device, dtype=enc_len.dtype)
    return (positions.unsqueeze(0) < enc_len.unsqueeze(1)).to(enc_len.dtype)


class FusedContentBasedAttention(FusedStandIn):
    """Fused stand-in for SpeechBrain's ContentBasedAttention: same parameters (the very
    objects, same state_dict keys), same state, ``reset()`` and ``forward``."""

    layout = "speechbrain_content"
    gather_steps = True  # StepwiseMemory applies (the location-aware keys change every step)

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)
        self._stepwise: tuple[StepwiseMemory, Tensor] | None = None

    def reset(self) -> None:
        self.enc_len = None
        self.precomputed_enc_h = None
        self.mask = None
        self._stepwise = None
        self._gathered = None
        self._location = None

    def _first_step(self, enc_states: Tensor, enc_len: Tensor) -> bool:
        if self.precomputed_enc_h is not None:
            return False
        self.precomputed_enc_h = self.mlp_enc(enc_states)
        self.mask = _length_mask(enc_len, enc_states.size(1))
        self._stepwise = None
        if self.gather_steps:  # keys and values fixed over the utterance
            memory = StepwiseMemory.for_training(self.precomputed_enc_h, enc_states, self.backend)
            if memory is not None:  # the same values, through a node that gathers gradients
                self.precomputed_enc_h = memory.keys
                self._stepwise = (memory, enc_states)
        return True

    def _finish(
        self, dec_states: Tensor, keys: Tensor, enc_states: Tensor, location: tuple | None = None
    ) -> tuple[Tensor, Tensor]:
        v_eff = scaled(score_row(self.mlp_attn), self.scaling)
        query = self.mlp_dec(dec_states)
        if location is not None:  # location-aware: keys = keys + the location term
            context, weights = attend_location(
                self, self.backend, query, keys, location, enc_states, v_eff, self.mask != 0
            )
            return self.mlp_out(context), weights
        memory = None
        if self._stepwise is not None and self._stepwise[1] is enc_states:
            memory = self._stepwise[0]  # the step attends to the memory's aliases
            enc_states = memory.values
        context, weights = additive_attention(
            query,
            keys,
            enc_states,
            v_eff,
            stepwise=memory,
            **masking(self.mask != 0),
            backend=self.backend,
        )
        return self.mlp_out(context), weights

    def forward(
        self, enc_states: Tensor, enc_len: Tensor, dec_states: Tensor
    ) -> tuple[Tensor, Tensor]:
        self._first_step(enc_states, enc_len)
        return self._finish(dec_states, self.precomputed_enc_h, enc_states)


class FusedLocationAwareAttention(FusedContentBasedAttention):
    """Fused stand-in for SpeechBrain's LocationAwareAttention: a step's keys are the cached
    projected memory plus mlp_loc(conv_loc(prev_attn))."""

    layout = "speechbrain_location"
    gather_steps = False

    def reset(self) -> None:
        super().reset()
        self.prev_attn = None
        self._keys_base = None

    def _base(self) -> Tensor:
        """precomputed_enc_h + mlp_loc.bias, made once per utterance (the location term's
        bias added to the fixed part of the keys, not to every step's)."""
        memory, bias = self.precomputed_enc_h, self.mlp_loc.bias
        return derived(self, "_keys_base", (memory, bias), lambda: memory + bias)

    def forward(
        self, enc_states: Tensor, enc_len: Tensor, dec_states: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self._first_step(enc_states, enc_len):
            self.prev_attn = self.mask * (1 / enc_len.float()).unsqueeze(1)
        # keys = precomputed_enc_h + mlp_loc(conv_loc(prev_attn))
        location = (self.prev_attn.unsqueeze(1), self.conv_loc.weight, self.mlp_loc.weight)
        output, weights = self._finish(dec_states, self._base(), enc_states, location)
        self.prev_attn = weights.detach()
        return output, weights


# --- matchers -------------------------------------------------------------------------------------

_PARTS = {"mlp_enc", "mlp_dec", "mlp_attn", "mlp_out", "softmax"}


def _common(module: nn.Module, extra: set[str]) -> bool:
    if child_names(module) != _PARTS | extra or own_parameter_names(module):
        return False
    softmax = module.softmax
    if type(softmax) is not nn.Softmax or softmax.dim not in (-1, 1):
        return False
    if not is_finite_number(getattr(module, "scaling", None)):
        return False
    if not all(hasattr(module, n) for n in ("precomputed_enc_h", "mask", "enc_len")):
        return False
    enc = module.mlp_enc
    attn_dim = enc.out_features if isinstance(enc, nn.Linear) else -1
    return (
        is_linear(enc, bias=True)
        and is_linear(module.mlp_dec, bias=True, out_features=attn_dim)
        and is_linear(module.mlp_attn, bias=False, in_features=attn_dim, out_features=1)
        and is_linear(module.mlp_out, in_features=enc.in_features)
    )


def _match_content(module: nn.Module) -> bool:
    return _common(module, set())


def _match_location(module: nn.Module) -> bool:
    if not _common(module, {"conv_loc", "mlp_loc"}) or not hasattr(module, "prev_attn"):
        return False
    conv = module.conv_loc
    return (
        type(conv) is nn.Conv1d
        and conv.bias is None
        and same_padding_conv(conv, in_channels=1)
        and is_linear(
            module.mlp_loc,
            bias=True,
            in_features=conv.out_channels,
            out_features=module.mlp_enc.out_features,
        )
    )


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, frames = 3, 6
    enc = torch.randn(batch, frames, module.mlp_enc.in_features, dtype=dtype)
    enc_len = torch.tensor([6.0, 4.0, 2.0], dtype=dtype)
    dec = torch.randn(batch, module.mlp_dec.in_features, dtype=dtype)
    return (enc, enc_len, dec), {}


def _prepare(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module.reset()


register(
    Layout(
        "speechbrain_content",
        _match_content,
        lambda module, backend: FusedContentBasedAttention(module, backend),
        _example_call,
        prepare=_prepare,
    )
)
register(
    Layout(
        "speechbrain_location",
        _match_location,
        lambda module, backend: FusedLocationAwareAttention(module, backend),
        _example_call,
        prepare=_prepare,
    )
)
