"""JoeyNMT's ``BahdanauAttention`` (joeynmt/attention.py).

Original parameters: ``key_layer`` (Dk -> H), ``query_layer`` (Dq -> H), ``energy_layer``
(H -> 1), all without bias; state ``proj_keys`` and ``proj_query``.

Original math and call: the decoder calls ``compute_proj_keys(keys=encoder_output)`` (once per
decoder forward: once per sequence in training, once per step in greedy and beam search), then
per step::

    forward(query [B, 1, Dq], mask [B, 1, S] (0 = padding), values [B, S, Dv])
    proj_query = query_layer(query)            (kept in self.proj_query)
    scores = energy_layer(tanh(proj_query + proj_keys)) -> [B, 1, S]; scores[mask <= 0] = -inf
    alphas = softmax(scores); context = alphas @ values
    returns (context [B, 1, Dv], alphas [B, 1, S])

The stand-in keeps both methods and both attributes (its call convention); the attention itself
is a typed plan run by the general path's runtime (``_planned.py``). ``compute_proj_keys`` reuses
the projection while the keys tensor and key_layer are unchanged (search calls it every step with
the same encoder output), and training gathers the steps' gradients once per sequence. A row with
no valid key gives NaN, as there (a softmax of -inf only).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    forward_defined_in,
    is_linear,
    own_parameter_names,
    register,
)
from seq2seq_fast.nn.convert._planned import PlannedAttention
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedJoeyBahdanauAttention(FusedStandIn):
    """Fused stand-in for JoeyNMT's BahdanauAttention (see the module docstring)."""

    layout = "joeynmt"

    def __init__(self, original: nn.Module, backend: str) -> None:
        super().__init__(backend)
        self.key_layer = original.key_layer
        self.query_layer = original.query_layer
        self.energy_layer = original.energy_layer
        self.proj_keys = getattr(original, "proj_keys", None)
        self.proj_query = getattr(original, "proj_query", None)
        self.key_cache = ProjectionCache()  # key_layer(keys), per keys tensor
        # scores where mask (True = attend) else -inf, a softmax: the general path's runtime
        self.attention = PlannedAttention(backend, masks=("keep",), description="joeynmt")

    def compute_proj_keys(self, keys: Tensor) -> None:
        """proj_keys = key_layer(keys) [B, S, H], reused while keys and key_layer are unchanged."""
        layer = self.key_layer
        self.proj_keys = self.key_cache.get(keys, (layer.weight,), lambda: layer(keys))

    def compute_proj_query(self, query: Tensor) -> None:
        self.proj_query = self.query_layer(query)

    def forward(self, query: Tensor, mask: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if mask is None:
            raise ValueError("mask is required (JoeyNMT's convention: [B, 1, S], 0 = padding)")
        if self.proj_keys is None:
            raise ValueError("call compute_proj_keys(keys) before forward (JoeyNMT's convention)")
        if query.dim() != 3 or query.shape[1] != 1 or mask.dim() != 3 or mask.shape[1] != 1:
            raise ValueError(
                f"query must be [B, 1, Dq] and mask [B, 1, S], got {list(query.shape)} and "
                f"{list(mask.shape)}"
            )
        self.compute_proj_query(query)
        alphas, context = self.attention(
            self.proj_query,
            self.proj_keys,
            self.energy_layer.weight,
            values,
            masks=(mask if mask.dtype == torch.bool else mask > 0,),
            fills=(float("-inf"),),
        )
        return context, alphas


def _match(module: nn.Module) -> bool:
    if type(module).__name__ != "BahdanauAttention" or not forward_defined_in(
        module, "BahdanauAttention"
    ):
        return False
    if child_names(module) != {"key_layer", "query_layer", "energy_layer"}:
        return False
    if own_parameter_names(module) or not hasattr(module, "compute_proj_keys"):
        return False
    hidden = module.key_layer.out_features
    return (
        is_linear(module.key_layer, bias=False)
        and is_linear(module.query_layer, bias=False, out_features=hidden)
        and is_linear(module.energy_layer, bias=False, in_features=hidden, out_features=1)
    )


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, num_keys = 3, 5
    query = torch.randn(batch, 1, module.query_layer.in_features, dtype=dtype)
    values = torch.randn(batch, num_keys, module.key_layer.in_features, dtype=dtype)
    mask = torch.tensor([[[1, 1, 1, 1, 1]], [[1, 1, 1, 0, 0]], [[1, 0, 0, 0, 0]]]).bool()
    return (query, mask, values), {}


def _prepare(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module.compute_proj_keys(args[2])


def _build(module: nn.Module, backend: str) -> nn.Module:
    return FusedJoeyBahdanauAttention(module, backend)


LAYOUT = register(Layout("joeynmt", _match, _build, _example_call, prepare=_prepare))
