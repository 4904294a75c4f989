"""The PyTorch seq2seq translation tutorial's ``BahdanauAttention`` (Wa, Ua, Va) and its copies.

Original math and call (``AttnDecoderRNN`` calls it once per decoder step, with the same encoder
outputs every step)::

    forward(query [B, 1, Dq], keys [B, S, Dk]) -> (context [B, 1, Dk], weights [B, 1, S])
    scores = Va(tanh(Wa(query) + Ua(keys)))          # [B, S, 1] -> [B, 1, S]
    weights = softmax(scores, -1); context = weights @ keys

Va's bias shifts every score of a row equally, so it cancels in the softmax (its gradient is zero
either way). No mask.

A thin matcher (``traced=True``): no stand-in of its own. The module is converted in place at
``fuse_attention`` time by the traced runtime, with the example call below as its first call: the
op forms the weights and the context (``weights @ keys``), ``Ua(keys)`` is computed once per keys
tensor over a decoder's steps by the runtime's key cache, and the steps' gradients for the keys
and the projected keys are gathered once per sequence. Other query shapes trace once more.
"""

from __future__ import annotations

import torch
from torch import nn

from seq2seq_fast.nn.convert._base import (
    Layout,
    child_names,
    is_linear,
    own_parameter_names,
    register,
)


def _match(module: nn.Module) -> bool:
    if child_names(module) != {"Wa", "Ua", "Va"} or own_parameter_names(module):
        return False
    wa, ua, va = module.Wa, module.Ua, module.Va
    return (
        is_linear(wa)
        and is_linear(ua, out_features=wa.out_features)
        and is_linear(va, out_features=1, in_features=wa.out_features)
    )


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, num_keys = 3, 5
    query = torch.randn(batch, 1, module.Wa.in_features, dtype=dtype)
    keys = torch.randn(batch, num_keys, module.Ua.in_features, dtype=dtype)
    return (query, keys), {}


LAYOUT = register(Layout("tutorial", _match, None, _example_call, traced=True))
