"""The PyTorch seq2seq translation tutorial's ``BahdanauAttention`` (Wa, Ua, Va) and its copies.

Original math and call (``AttnDecoderRNN`` calls it once per decoder step, with the same encoder
outputs every step)::

    forward(query [B, 1, Dq], keys [B, S, Dk]) -> (context [B, 1, Dk], weights [B, 1, S])
    scores = Va(tanh(Wa(query) + Ua(keys)))          # [B, S, 1] -> [B, 1, S]
    weights = softmax(scores, -1); context = weights @ keys

Va's bias shifts every score of a row equally, so it cancels in the softmax and is left out of
the kernel; it still gets its gradient, zero (``_base.with_cancelled``). No mask.
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
from seq2seq_fast.nn.convert._planned import PlannedAttention
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedTutorialAttention(FusedStandIn):
    """Fused stand-in for the tutorial's attention: the same ``Wa``, ``Ua``, ``Va`` Linears (the
    very Parameter objects, same state_dict keys) and the same call.

    ``Ua(keys)`` is computed once per keys tensor and reused by the following steps
    (:class:`~seq2seq_fast.nn.keycache.ProjectionCache`). The attention is a typed plan on the
    general path's runtime (``_planned.py``): it keeps the keys' layout (one contiguous copy of
    a view such as nn.GRU(batch_first=True)'s output for all the steps), and when training on the
    CPU kernel gathers the steps' gradients for the keys and the projected keys once per
    sequence. A query that is not [B, 1, Dq] (the tutorial's only shape) runs the original's math
    in plain PyTorch.
    """

    layout = "tutorial"

    def __init__(self, Wa: nn.Linear, Ua: nn.Linear, Va: nn.Linear, backend: str = "auto") -> None:  # noqa: N803
        super().__init__(backend)
        self.Wa, self.Ua, self.Va = Wa, Ua, Va
        self.key_cache = ProjectionCache()  # Ua(keys), per keys tensor
        # Va's bias, a shift of every score (cancelled by the softmax): the general path's runtime
        self.attention = PlannedAttention(
            backend, shifted=Va.bias is not None, description="tutorial"
        )

    @property
    def _shifts(self) -> tuple[Tensor, ...]:
        return () if self.Va.bias is None else (self.Va.bias,)

    def _plain(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, keys), weights

    def forward(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        if query.dim() != 3 or keys.dim() != 3 or query.shape[1] != 1:
            return self._plain(query, keys)
        ua = self.Ua
        projected = self.key_cache.get(keys, (ua.weight, ua.bias), lambda: ua(keys))
        weights, context = self.attention(
            self.Wa(query), projected, self.Va.weight, keys, shifts=self._shifts
        )
        return context, weights


def _match(module: nn.Module) -> bool:
    if child_names(module) != {"Wa", "Ua", "Va"} or own_parameter_names(module):
        return False
    wa, ua, va = module.Wa, module.Ua, module.Va
    return (
        is_linear(wa)
        and is_linear(ua, out_features=wa.out_features)
        and is_linear(va, out_features=1, in_features=wa.out_features)
    )


def _build(module: nn.Module, backend: str) -> nn.Module:
    return FusedTutorialAttention(module.Wa, module.Ua, module.Va, backend)


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, num_keys = 3, 5
    query = torch.randn(batch, 1, module.Wa.in_features, dtype=dtype)
    keys = torch.randn(batch, num_keys, module.Ua.in_features, dtype=dtype)
    return (query, keys), {}


LAYOUT = register(Layout("tutorial", _match, _build, _example_call))
