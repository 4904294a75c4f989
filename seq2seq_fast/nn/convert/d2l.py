"""d2l's ``AdditiveAttention`` (Dive into Deep Learning, PyTorch edition; chapter "Attention
Scoring Functions") in both its forms: ``AdditiveAttention(num_hiddens, dropout)`` with
LazyLinear layers, and the older ``AdditiveAttention(key_size, query_size, num_hiddens, dropout)``.

Original parameters: ``W_k`` (Dk -> H), ``W_q`` (Dq -> H), ``w_v`` (H -> 1), all without bias;
``dropout`` (nn.Dropout on the weights). State: ``attention_weights`` (the last weights, kept for
plotting). Original math and call (batch-first)::

    forward(queries [B, Tq, Dq], keys [B, Tk, Dk], values [B, Tk, Dv], valid_lens [B] or [B, Tq]
            or None) -> context [B, Tq, Dv]
    scores = w_v(tanh(W_q(queries)[:, :, None] + W_k(keys)[:, None])).squeeze(-1)
    attention_weights = softmax of scores with positions >= valid_lens set to -1e6
    context = dropout(attention_weights) @ values

Exactness: the -1e6 fill gives exactly zero weight (|scores| <= ||w_v||_1, far from 1e6); a row
with valid length 0 has all its scores -1e6 there, hence uniform weights over all Tk keys: the
runtime's plain path gives it the same. With dropout active (training and p > 0) the stand-in takes the
fused weights and applies the same ``self.dropout`` to them before its own product with the
values: one draw of the same shape, so under the same RNG state the same positions are dropped,
and the result is exact in every mode. Per-query lengths ([B, Tq]) that differ between queries
run the original's math in plain PyTorch. A decoder that passes the same keys every step (d2l's
Seq2SeqAttentionDecoder) gets their projection once per sequence
(:class:`~seq2seq_fast.nn.keycache.ProjectionCache`). Lazy layers not initialised yet (no forward
has run) are skipped: their sizes are unknown.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
from seq2seq_fast.nn.convert._speech import adopt
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedD2LAdditiveAttention(FusedStandIn):
    """Fused stand-in for d2l's AdditiveAttention: same parts (the very objects, same state_dict
    keys), ``attention_weights`` and ``forward``. Its attention is a typed plan on the general
    path's runtime (``_planned.py``)."""

    layout = "d2l_additive"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)
        self.key_cache = ProjectionCache()  # W_k(keys), per keys tensor
        self.mask_cache = ProjectionCache()  # the mask, per valid_lens tensor

    def _plain(self, queries, keys, values, valid_lens) -> Tensor:
        """The original's math (per-query lengths that differ between the queries)."""
        features = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        keep = torch.arange(scores.shape[-1], device=scores.device) < valid_lens.unsqueeze(-1)
        self.attention_weights = F.softmax(scores.masked_fill(~keep, -1e6), dim=-1)
        return torch.bmm(self.dropout(self.attention_weights), values)

    def _mask(self, valid_lens: Tensor, frames: int) -> Tensor:
        """[B, 1, S], True where a position is below its row's length, as d2l's sequence_mask
        (any numeric dtype; per-query lengths here are the same for every query). One tensor per
        valid_lens tensor: the runtime's mask cache goes by identity."""

        def compute() -> Tensor:
            lengths = valid_lens[:, 0] if valid_lens.dim() == 2 else valid_lens
            positions = torch.arange(frames, device=lengths.device)
            return (positions < lengths[:, None]).unsqueeze(1)

        return self.mask_cache.get(valid_lens, (frames,), compute)

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> Tensor:
        if valid_lens is not None and valid_lens.dim() == 2:
            if valid_lens.shape[1] > 1 and not bool((valid_lens == valid_lens[:, :1]).all()):
                return self._plain(queries, keys, values, valid_lens)
        w_k = self.W_k
        projected = self.key_cache.get(keys, (w_k.weight, w_k.bias), lambda: w_k(keys))
        masks = () if valid_lens is None else (self._mask(valid_lens, keys.shape[1]),)
        # dropout between the weights and the context: the context is then formed here, with
        # the same self.dropout (one draw of the weights' shape, as the original's)
        dropping = self.training and self.dropout.p > 0
        attention = planned(self, masks=("keep",) * len(masks))
        weights, context = attention(
            self.W_q(queries),
            projected,
            self.w_v.weight,
            None if dropping else values,
            masks=masks,
            fills=(-1e6,) * len(masks),
        )
        self.attention_weights = weights
        if dropping:
            context = torch.bmm(self.dropout(weights), values)
        return context


def _is_lazy(module: object) -> bool:
    return isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params()


def _match(module: nn.Module) -> bool:
    if child_names(module) != {"W_k", "W_q", "w_v", "dropout"} or own_parameter_names(module):
        return False
    if type(module.dropout) is not nn.Dropout:
        return False
    parts = (module.W_k, module.W_q, module.w_v)
    if any(_is_lazy(p) for p in parts):
        return all(isinstance(p, nn.LazyLinear) and p.bias is None for p in parts)
    width = module.W_k.out_features if isinstance(module.W_k, nn.Linear) else -1
    return (
        is_linear(module.W_k, bias=False)
        and is_linear(module.W_q, bias=False, out_features=width)
        and is_linear(module.w_v, bias=False, in_features=width, out_features=1)
    )


def _unsupported(module: nn.Module) -> str | None:
    if any(_is_lazy(p) for p in (module.W_k, module.W_q, module.w_v)):
        return "its lazy layers are not initialised yet: convert after a first forward"
    return None


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, num_queries, num_keys, value_dim = 3, 2, 6, 4
    queries = torch.randn(batch, num_queries, module.W_q.in_features, dtype=dtype)
    keys = torch.randn(batch, num_keys, module.W_k.in_features, dtype=dtype)
    values = torch.randn(batch, num_keys, value_dim, dtype=dtype)
    return (queries, keys, values, torch.tensor([6, 3, 0])), {}


register(
    Layout(
        "d2l_additive",
        _match,
        lambda module, backend: FusedD2LAdditiveAttention(module, backend),
        _example_call,
        unsupported=_unsupported,
    )
)
