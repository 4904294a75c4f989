"""Coqui TTS's ``OriginalAttention`` (TTS/tts/layers/tacotron/attentions.py), softmax or sigmoid
normalisation.

Original parameters: ``query_layer`` (Dq -> A, no bias), ``inputs_layer`` (E -> A, no bias), ``v``
(A -> 1, with bias), each a Coqui ``Linear`` wrapper (``.linear_layer``); with
``location_attention`` a ``location_layer`` (``location_conv1d``: Conv1d 2 -> F, odd width, same
padding, no bias; ``location_dense``: wrapped Linear F -> A, no bias); with ``trans_agent`` a
``ta`` Linear (used only by forward attention). Flags: ``norm``, ``windowing``, ``forward_attn``,
``trans_agent``, ``forward_attn_mask``, ``location_attention``; ``_mask_value`` (-inf). State
(``init_states(inputs)`` sets it): ``attention_weights`` [B, T] and, with location attention,
``attention_weights_cum`` [B, T] (updated in place each step). The decoder computes
``processed_inputs = preprocess_inputs(inputs)`` (= inputs_layer(inputs)) once per utterance.
Original math and call (batch-first)::

    forward(query [B, Dq], inputs [B, T, E], processed_inputs [B, T, A], mask [B, T] (True =
            valid) or None) -> context [B, E]
    keys = processed_inputs [+ location_layer([attention_weights; attention_weights_cum])]
    e = v(tanh(query_layer(query) + keys)); e[~mask] = -inf
    alignment = softmax(e), or with norm="sigmoid" (the default of Coqui's Tacotron configs)
                sigmoid(e) / sigmoid(e).sum(1, keepdim=True)
    attention_weights_cum += alignment; attention_weights = alignment
    context = alignment @ inputs

Converted with ``norm`` "softmax" or "sigmoid", no forward attention and no windowing; the others
are skipped with the reason (:func:`_unsupported`). ``v``'s bias cancels in the softmax; under the
sigmoid it is the op's ``score_bias`` (sigmoid(e + b) / sum sigmoid(e + b)), with its gradient.
The attention runs as a typed plan on the general path's runtime (``_planned.py``): a row with
no valid frame gives NaN, as the original; training steps on the CPU kernel form the location
term inside the kernels (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`: keys by one addmm,
the projected memory's and the values' gradients gathered once per sequence); a content-only
attention gathers the steps' gradients for its fixed keys and values once per sequence
(:class:`~seq2seq_fast.ops.stepwise.StepwiseMemory`).
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


class FusedCoquiOriginalAttention(FusedStandIn):
    """Fused stand-in for Coqui's OriginalAttention (softmax or sigmoid, optionally location-sensitive): same
    parts (the very objects, same state_dict keys), state and methods the decoder calls
    (``init_states``, ``preprocess_inputs``, ``init_win_idx``), same ``forward``."""

    layout = "coqui_original"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)

    def init_win_idx(self) -> None:
        self.win_idx = -1
        self.win_back = 2
        self.win_front = 6

    def init_states(self, inputs: Tensor) -> None:
        batch, length = inputs.shape[:2]
        self.attention_weights = torch.zeros([batch, length], device=inputs.device)
        if self.location_attention:
            self.attention_weights_cum = torch.zeros([batch, length], device=inputs.device)
        if self.windowing:
            self.init_win_idx()

    def preprocess_inputs(self, inputs: Tensor) -> Tensor:
        return self.inputs_layer(inputs)

    def update_location_attention(self, alignments: Tensor) -> None:
        self.attention_weights_cum += alignments

    def forward(
        self, query: Tensor, inputs: Tensor, processed_inputs: Tensor, mask: Tensor | None
    ) -> Tensor:
        reason = _unsupported(self, runtime=True)
        if reason is not None:
            raise RuntimeError(
                f"seq2seq_fast: this converted OriginalAttention cannot run: {reason}"
            )
        score = linear_of(self.v)
        # the score layer's bias: a shift of every score, which a softmax cancels and a sigmoid
        # keeps (sigmoid(e + b))
        shifts = () if score.bias is None else (score.bias,)
        masks = () if mask is None else (mask,)  # True = valid
        location = None
        if self.location_attention:  # keys = processed_inputs + location_layer(previous)
            previous = torch.cat(
                (self.attention_weights.unsqueeze(1), self.attention_weights_cum.unsqueeze(1)),
                dim=1,
            )
            layer = self.location_layer
            location = (
                previous,
                conv1d_of(layer.location_conv1d).weight,
                linear_of(layer.location_dense).weight,
            )
        attention = planned(
            self,
            shifted=bool(shifts),
            masks=("keep",) * len(masks),
            normalisation="sigmoid" if self.norm == "sigmoid" else "softmax",
            one_query=True,
            located=location is not None,
        )
        alignment, context = attention(
            self.query_layer(query),
            processed_inputs,
            score.weight,
            inputs,
            masks=masks,
            fills=(self._mask_value,) * len(masks),
            shifts=shifts,
            location=location,
        )
        if self.location_attention:
            self.update_location_attention(alignment)
        self.attention_weights = alignment
        return context


def _unsupported(module: nn.Module, runtime: bool = False) -> str | None:
    if module.norm not in ("softmax", "sigmoid"):
        return f"norm={module.norm!r}: the original knows softmax and sigmoid only (it raises)"
    if module.forward_attn:
        return (
            "forward attention: the softmax weights are re-weighted by a recursion over the "
            "previous step's weights (clipped at inference) before the context is formed, so "
            "the fused kernel's context would be thrown away"
        )
    if module.windowing and (not runtime or not module.training):
        return (
            "windowing: at inference the window follows the argmax of the raw scores (and the "
            "first step rewrites a score), which the fused kernel does not return"
        )
    return None


def _match(module: nn.Module) -> bool:
    flags = ("norm", "windowing", "forward_attn", "trans_agent", "location_attention")
    if not all(hasattr(module, name) for name in flags) or own_parameter_names(module):
        return False
    if getattr(module, "_mask_value", None) != float("-inf"):
        return False
    expected = {"query_layer", "inputs_layer", "v"}
    expected |= {"ta"} if module.trans_agent else set()
    expected |= {"location_layer"} if module.location_attention else set()
    if child_names(module) != expected:
        return False
    query, inputs = linear_of(module.query_layer), linear_of(module.inputs_layer)
    if query is None or inputs is None or query.bias is not None or inputs.bias is not None:
        return False
    width = query.out_features
    if inputs.out_features != width or not is_score_layer(module.v, width):
        return False
    if not module.location_attention:
        return True
    location = module.location_layer
    if child_names(location) != {"location_conv1d", "location_dense"}:
        return False
    return is_location_layer(location.location_conv1d, location.location_dense, width)


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, frames = 3, 6
    inputs = torch.randn(batch, frames, linear_of(module.inputs_layer).in_features, dtype=dtype)
    processed = module.inputs_layer(inputs).detach()
    query = torch.randn(batch, linear_of(module.query_layer).in_features, dtype=dtype)
    mask = torch.arange(frames) < torch.tensor([6, 4, 2]).unsqueeze(1)
    return (query, inputs, processed, mask), {}


def _prepare(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Fresh states in the inputs' dtype (init_states makes them in the default dtype), with
    some previous weights so the location term is not all zeros."""
    inputs = args[1]
    module.init_states(inputs)
    gen = torch.Generator().manual_seed(7)
    previous = torch.softmax(torch.randn(inputs.shape[:2], generator=gen, dtype=inputs.dtype), 1)
    module.attention_weights = previous
    if module.location_attention:
        module.attention_weights_cum = previous * 2


register(
    Layout(
        "coqui_original",
        _match,
        lambda module, backend: FusedCoquiOriginalAttention(module, backend),
        _example_call,
        prepare=_prepare,
        unsupported=_unsupported,
    )
)
