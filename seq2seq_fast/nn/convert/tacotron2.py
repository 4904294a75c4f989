"""Tacotron 2's location-sensitive ``Attention`` with its ``LocationLayer``: NVIDIA/tacotron2
(model.py), DeepLearningExamples' PyTorch Tacotron2 (same code) and torchaudio's ``_Attention``.

Original parameters: ``query_layer`` (rnn_dim -> A), ``memory_layer`` (E -> A), ``v`` (A -> 1),
all without bias; ``location_layer.location_conv`` (Conv1d 2 -> F, odd width, same padding, no
bias) and ``location_layer.location_dense`` (F -> A, no bias); ``score_mask_value`` (-inf).
Naming difference: NVIDIA and DeepLearningExamples wrap each Linear in ``LinearNorm``
(``.linear_layer``) and the Conv1d in ``ConvNorm`` (``.conv``), so their state_dict keys read
``query_layer.linear_layer.weight``; torchaudio uses plain layers (``query_layer.weight``). Both
are recognised; the stand-in keeps whichever it is given. No state in the module: the decoder
computes ``processed_memory = memory_layer(memory)`` once per utterance and passes it every step.
Original math and call (batch-first)::

    forward(attention_hidden_state [B, rnn_dim], memory [B, T, E], processed_memory [B, T, A],
            attention_weights_cat [B, 2, T] (previous and cumulative weights), mask [B, T]
            (True = padding) or None (NVIDIA's inference)) -> (context [B, E], weights [B, T])
    keys = processed_memory + location_layer(attention_weights_cat)
    e = v(tanh(query_layer(attention_hidden_state) + keys)); e[mask] = score_mask_value
    weights = softmax(e); context = weights @ memory

The attention runs as a typed plan on the general path's runtime (``_planned.py``): a row with
no valid frame gives NaN, as the original; training steps on the CPU kernel form the location
term inside the kernels (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`: keys by one addmm,
the projected memory's and the values' gradients gathered once per sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    own_parameter_names,
    register,
)
from seq2seq_fast.nn.convert._planned import planned
from seq2seq_fast.nn.convert._speech import (
    adopt,
    conv1d_of,
    is_location_layer,
    is_score_layer,
    linear_of,
)


class FusedTacotron2Attention(FusedStandIn):
    """Fused stand-in for Tacotron 2's attention (NVIDIA, DeepLearningExamples, torchaudio): same
    parts (the very objects, same state_dict keys) and ``forward``; the step's keys are the
    processed memory plus the location term."""

    layout = "tacotron2"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)

    def forward(
        self,
        attention_hidden_state: Tensor,
        memory: Tensor,
        processed_memory: Tensor,
        attention_weights_cat: Tensor,
        mask: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        query = self.query_layer(attention_hidden_state)  # [B, A]
        layer = self.location_layer  # keys = processed_memory + location_layer(weights_cat)
        location = (
            attention_weights_cat,
            conv1d_of(layer.location_conv).weight,
            linear_of(layer.location_dense).weight,
        )
        masks = () if mask is None else (mask,)  # True = padding
        attention = planned(self, masks=("fill",) * len(masks), one_query=True, located=True)
        weights, context = attention(
            query,
            processed_memory,
            linear_of(self.v).weight,
            memory,
            masks=masks,
            fills=(self.score_mask_value,) * len(masks),
            location=location,
        )
        return context, weights


def _match(module: nn.Module) -> bool:
    if child_names(module) != {"query_layer", "memory_layer", "v", "location_layer"}:
        return False
    if own_parameter_names(module) or getattr(module, "score_mask_value", None) != float("-inf"):
        return False
    query, memory = linear_of(module.query_layer), linear_of(module.memory_layer)
    location = module.location_layer
    if query is None or memory is None or query.bias is not None or memory.bias is not None:
        return False
    width = query.out_features
    if memory.out_features != width or not is_score_layer(module.v, width):
        return False
    if linear_of(module.v).bias is not None:
        return False
    if child_names(location) != {"location_conv", "location_dense"} or own_parameter_names(
        location
    ):
        return False
    return is_location_layer(location.location_conv, location.location_dense, width)


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, frames = 3, 6
    query = linear_of(module.query_layer)
    memory = torch.randn(batch, frames, linear_of(module.memory_layer).in_features, dtype=dtype)
    processed = module.memory_layer(memory).detach()
    previous = torch.softmax(torch.randn(batch, frames, dtype=dtype), dim=1)
    cat = torch.stack((previous, previous + torch.rand(batch, frames, dtype=dtype)), dim=1)
    mask = torch.arange(frames) >= torch.tensor([6, 4, 2]).unsqueeze(1)
    hidden = torch.randn(batch, query.in_features, dtype=dtype)
    return (hidden, memory, processed, cat, mask), {}


register(
    Layout(
        "tacotron2",
        _match,
        lambda module, backend: FusedTacotron2Attention(module, backend),
        _example_call,
    )
)
