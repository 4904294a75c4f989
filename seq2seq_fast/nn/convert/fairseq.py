"""fairseq's ``LocationAttention`` (fairseq/modules/location_attention.py, used by its Tacotron 2)
and ``MLPAttention`` (fairseq/models/speech_to_text/berard.py).

LocationAttention. Parameters: ``proj_enc`` (E -> A, with bias), ``proj_dec`` (Dd -> A, no bias),
``proj_attn`` (C -> A, no bias), ``conv`` (Conv1d K -> C, width 2W+1, padding W, no bias),
``proj_out`` = Sequential(Tanh, Linear(A, 1)); ``scaling`` (2.0), ``attn_dim``, ``decoder_dim``.
State: ``proj_enc_out`` (the projected memory, computed at the first call, dropped by
``clear_cache()``). Math and call (batch-first)::

    forward(encoder_out [B, T, E], encoder_padding_mask [B, T] (True = padding),
            decoder_h [B, Dd] or None (zeros), attn_state [B, K, T])
        -> (context [B, E], weights [B, T])
    keys = proj_enc_out + proj_attn(conv(attn_state))
    e = proj_out(keys + proj_dec(decoder_h)); e[mask] = -inf; w = softmax(scaling * e)
    context = sum_t w_t encoder_out_t

MLPAttention. Parameters: ``encoder_proj`` (C -> A, with bias), ``decoder_proj`` (Dd -> A, no
bias), ``to_scores`` (A -> 1, no bias); ``context_dim``, ``attention_dim``. No state: the LSTM
decoder calls it at every target step with the same source states, which it projects again each
time. Math and call (time-major source)::

    forward(decoder_state [B, Dd], source_hids [S, B, C], encoder_padding_mask [S, B] (True =
            padding) or None) -> (context [B, C], weights [S, B])
    e = to_scores(tanh(decoder_proj(decoder_state) + encoder_proj(source_hids)))
    e[mask] = -inf (in float32, then back); weights = softmax(e over S); context = sum_s w_s h_s

The MLPAttention stand-in projects a given source once and reuses the projection while the same
tensor comes back unchanged (see :mod:`seq2seq_fast.nn.keycache`). ``proj_out``'s bias cancels
in the softmax; ``scaling`` is folded into the score vector.

LocationAttention runs as a typed plan on the general path's runtime (``_planned.py``): a row with
no valid position gives NaN, as the original; its training steps on the CPU kernel form the
location term inside the kernels (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`).
MLPAttention is a plan on the same runtime; where it masks, its original rounds the scores to
float32 and back (a float16 guard), so a float64 call with a mask takes the runtime's plain path,
which does the same.
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
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedFairseqLocationAttention(FusedStandIn):
    """Fused stand-in for fairseq's LocationAttention: same parts (the very objects, same
    state_dict keys), ``proj_enc_out`` cache and ``clear_cache()``, same ``forward``; the step's
    keys are the cached projected memory plus the location term."""

    layout = "fairseq_location"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)

    def clear_cache(self) -> None:
        self.proj_enc_out = None

    def forward(
        self,
        encoder_out: Tensor,
        encoder_padding_mask: Tensor | None,
        decoder_h: Tensor | None,
        attn_state: Tensor,
    ) -> tuple[Tensor, Tensor]:
        bsz = encoder_out.size(0)
        if self.proj_enc_out is None:
            self.proj_enc_out = self.proj_enc(encoder_out)
        if decoder_h is None:
            decoder_h = encoder_out.new_zeros(bsz, self.decoder_dim)
        score = self.proj_out[1]
        shifts = () if score.bias is None else (score.bias,)  # (cancelled by the softmax)
        masks = () if encoder_padding_mask is None else (encoder_padding_mask,)  # True = padding
        location = (attn_state, self.conv.weight, self.proj_attn.weight)  # keys: + proj_attn(conv)
        attention = planned(
            self,
            shifted=bool(shifts),
            masks=("fill",) * len(masks),
            scaled=True,
            one_query=True,
            located=True,
        )
        weights, context = attention(
            self.proj_dec(decoder_h),
            self.proj_enc_out,
            score.weight,
            encoder_out,
            masks=masks,
            fills=(float("-inf"),) * len(masks),
            shifts=shifts,
            scales=(self.scaling,),
            location=location,
        )
        return context, weights


def _match_location(module: nn.Module) -> bool:
    parts = {"proj_enc", "proj_dec", "proj_attn", "conv", "proj_out"}
    if child_names(module) != parts or own_parameter_names(module):
        return False
    if not all(hasattr(module, n) for n in ("proj_enc_out", "attn_dim", "decoder_dim")):
        return False
    if not is_finite_number(getattr(module, "scaling", None)):
        return False
    out = module.proj_out
    if type(out) is not nn.Sequential or len(out) != 2 or type(out[0]) is not nn.Tanh:
        return False
    width, conv = module.attn_dim, module.conv
    return (
        is_linear(out[1], in_features=width, out_features=1)
        and is_linear(module.proj_enc, bias=True, out_features=width)
        and is_linear(
            module.proj_dec, bias=False, out_features=width, in_features=module.decoder_dim
        )
        and type(conv) is nn.Conv1d
        and conv.bias is None
        and same_padding_conv(conv, in_channels=conv.in_channels)
        and is_linear(
            module.proj_attn, bias=False, in_features=conv.out_channels, out_features=width
        )
    )


def _example_location(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, frames = 3, 6
    encoder_out = torch.randn(batch, frames, module.proj_enc.in_features, dtype=dtype)
    padding = torch.arange(frames) >= torch.tensor([6, 4, 2]).unsqueeze(1)
    decoder_h = torch.randn(batch, module.decoder_dim, dtype=dtype)
    state = torch.rand(batch, module.conv.in_channels, frames, dtype=dtype)
    return (encoder_out, padding, decoder_h, state), {}


def _prepare_location(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module.clear_cache()


register(
    Layout(
        "fairseq_location",
        _match_location,
        lambda module, backend: FusedFairseqLocationAttention(module, backend),
        _example_location,
        prepare=_prepare_location,
    )
)


class FusedFairseqMLPAttention(FusedStandIn):
    """Fused stand-in for fairseq's MLPAttention (s2t_berard): same parts (the very objects, same
    state_dict keys) and ``forward`` (time-major source, weights [S, B]). The source's projection
    and its batch-major copies are made once per source tensor and reused by the later steps
    (:class:`~seq2seq_fast.nn.keycache.ProjectionCache`); the attention is a typed plan on the
    general path's runtime (``_planned.py``), the float32 round trip of the masked scores a
    "round" step."""

    layout = "fairseq_mlp"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)
        self.key_cache = ProjectionCache()  # the source's projection and copies, batch-major
        self.mask_cache = ProjectionCache()  # the padding mask, batch-major

    def _memory(self, source_hids: Tensor) -> tuple[Tensor, Tensor]:
        """The steps' keys [B, S, A] and values [B, S, C], batch-major."""
        keys = self.encoder_proj(source_hids).transpose(0, 1).contiguous()
        return keys, source_hids.transpose(0, 1).contiguous()

    def forward(
        self, decoder_state: Tensor, source_hids: Tensor, encoder_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        proj = self.encoder_proj
        keys, values = self.key_cache.get(
            source_hids, (proj.weight, proj.bias), lambda: self._memory(source_hids)
        )
        masks = ()
        if encoder_padding_mask is not None:  # True = padding; the scores rounded, as there
            padding = encoder_padding_mask
            masks = (self.mask_cache.get(padding, (), lambda: padding.t()),)
        attention = planned(self, rounded=bool(masks), masks=("fill",) * len(masks), one_query=True)
        weights, context = attention(
            self.decoder_proj(decoder_state),
            keys,
            self.to_scores.weight,
            values,
            masks=masks,
            fills=(float("-inf"),) * len(masks),
        )
        return context, weights.t()


def _match_mlp(module: nn.Module) -> bool:
    if child_names(module) != {"encoder_proj", "decoder_proj", "to_scores"}:
        return False
    if own_parameter_names(module) or not hasattr(module, "context_dim"):
        return False
    width = getattr(module, "attention_dim", None)
    return (
        is_linear(
            module.encoder_proj, bias=True, out_features=width, in_features=module.context_dim
        )
        and is_linear(module.decoder_proj, bias=False, out_features=width)
        and is_linear(module.to_scores, bias=False, in_features=width, out_features=1)
    )


def _example_mlp(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, src_len = 3, 6
    state = torch.randn(batch, module.decoder_proj.in_features, dtype=dtype)
    source = torch.randn(src_len, batch, module.context_dim, dtype=dtype)
    padding = (torch.arange(src_len) >= torch.tensor([6, 4, 2]).unsqueeze(1)).t()
    return (state, source, padding), {}


register(
    Layout(
        "fairseq_mlp",
        _match_mlp,
        lambda module, backend: FusedFairseqMLPAttention(module, backend),
        _example_mlp,
    )
)
