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

``scaling`` is folded into the score vector.
The attention runs as a typed plan on the general path's runtime (``_planned.py``): a row with
no valid frame gives NaN, as the original; training steps on the CPU kernel form the location
term inside the kernels (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`: keys by one addmm,
the projected memory's and the values' gradients gathered once per sequence); the content-based one
gathers the steps' gradients for its fixed keys and values once per sequence
(:class:`~seq2seq_fast.ops.stepwise.StepwiseMemory`).
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
)
from seq2seq_fast.nn.convert._planned import planned
from seq2seq_fast.nn.convert._speech import (
    adopt,
    is_finite_number,
    same_padding_conv,
)


def _length_mask(enc_len: Tensor, max_len: int) -> Tensor:
    """[B, max_len]: 1 where position < enc_len, in enc_len's dtype (SpeechBrain's
    length_to_mask)."""
    positions = torch.arange(max_len, device=enc_len.device, dtype=enc_len.dtype)
    return (positions.unsqueeze(0) < enc_len.unsqueeze(1)).to(enc_len.dtype)


class FusedContentBasedAttention(FusedStandIn):
    """Fused stand-in for SpeechBrain's ContentBasedAttention: same parameters (the very
    objects, same state_dict keys), same state, ``reset()`` and ``forward``."""

    layout = "speechbrain_content"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)

    def reset(self) -> None:
        self.enc_len = None
        self.precomputed_enc_h = None
        self.mask = None

    def _first_step(self, enc_states: Tensor, enc_len: Tensor) -> bool:
        if self.precomputed_enc_h is not None:
            return False
        self.precomputed_enc_h = self.mlp_enc(enc_states)
        self.mask = _length_mask(enc_len, enc_states.size(1))
        return True

    def _finish(
        self, dec_states: Tensor, enc_states: Tensor, location: tuple | None = None
    ) -> tuple[Tensor, Tensor]:
        """(mlp_out(context), weights) of e = mlp_attn(tanh(mlp_dec(dec_states) +
        precomputed_enc_h [+ mlp_loc(conv_loc(prev_attn))])), e[mask == 0] = -inf,
        softmax(scaling * e)."""
        biases = () if location is None else (self.mlp_loc.bias,)
        attention = planned(
            self,
            masks=("keep",),
            scaled=True,
            one_query=True,
            biased=bool(biases),
            located=location is not None,
        )
        weights, context = attention(
            self.mlp_dec(dec_states),
            self.precomputed_enc_h,
            self.mlp_attn.weight,
            enc_states,
            masks=(self.mask,),
            fills=(float("-inf"),),
            scales=(self.scaling,),
            biases=biases,
            location=location,
        )
        return self.mlp_out(context), weights

    def forward(
        self, enc_states: Tensor, enc_len: Tensor, dec_states: Tensor
    ) -> tuple[Tensor, Tensor]:
        self._first_step(enc_states, enc_len)
        return self._finish(dec_states, enc_states)


class FusedLocationAwareAttention(FusedContentBasedAttention):
    """Fused stand-in for SpeechBrain's LocationAwareAttention: a step's keys are the cached
    projected memory plus mlp_loc(conv_loc(prev_attn)) (mlp_loc's bias, the same for every
    frame, joins the query)."""

    layout = "speechbrain_location"

    def reset(self) -> None:
        super().reset()
        self.prev_attn = None

    def forward(
        self, enc_states: Tensor, enc_len: Tensor, dec_states: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self._first_step(enc_states, enc_len):
            self.prev_attn = self.mask * (1 / enc_len.float()).unsqueeze(1)
        # keys = precomputed_enc_h + mlp_loc(conv_loc(prev_attn))
        location = (self.prev_attn.unsqueeze(1), self.conv_loc.weight, self.mlp_loc.weight)
        output, weights = self._finish(dec_states, enc_states, location)
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
