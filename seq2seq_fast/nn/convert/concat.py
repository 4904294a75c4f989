"""The "concat" layout: one Linear over [decoder state; encoder output] and a score vector.

Written from bentrevett/pytorch-seq2seq (notebooks 3 and 4, ``Attention``), the PyTorch chatbot
tutorial (``Attn("concat", H)``) and their many copies. Parameters: ``attn`` (or ``attention``),
a Linear (Dq + Dk -> H, with bias), and ``v``: a Linear (H -> 1, no bias) or a Parameter [H].

Original math: energy = tanh(attn([hidden repeated over S; encoder_outputs])), scores = v . energy,
masked (``mask == 0``) scores set to -1e10, weights = softmax over the source. The module returns
the weights only; the caller forms the context. Splitting attn's weight at the query width,
W = [W_q | W_k], gives scores = v . tanh(W_q hidden + W_k enc + b): the fused op's form.

Call conventions, one registered layout each (the probe keeps the one the module follows):

- ``concat``: bentrevett: ``forward(hidden [B, Dq], encoder_outputs [S, B, Dk], mask [B, S]
  = None) -> weights [B, S]`` (time-major memory);
- ``concat_batch_first``: the copies with ``encoder_outputs [B, S, Dk]`` (``hidden`` may be
  [1, B, Dq] there, squeezed);
- ``chatbot_concat``: the chatbot tutorial's ``Attn``: ``forward(hidden [1, B, H],
  encoder_outputs [S, B, H]) -> weights [B, 1, S]``, score vector ``v`` a Parameter, attribute
  ``method == "concat"``.

A row whose keys are all masked gets uniform weights in the original (all its scores equal).

Thin matchers (``traced=True``): no stand-in of their own. A matched module is converted in place
at ``fuse_attention`` time by the traced runtime, with the layout's example call as its first call
(the runtime's key cache projects the encoder part once per encoder_outputs tensor). The three
layouts differ only in that example call and the name the report gives.
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


def _score_ok(module: nn.Module, hidden: int) -> bool:
    v = getattr(module, "v", None)
    if isinstance(v, nn.Parameter):
        return v.shape == (hidden,)
    return is_linear(v, bias=False, in_features=hidden, out_features=1)


def _match_common(module: nn.Module) -> bool:
    names = child_names(module) - {"v"}
    if names not in ({"attn"}, {"attention"}):
        return False
    linear = getattr(module, next(iter(names)))
    if not is_linear(linear, bias=True) or linear.in_features <= linear.out_features:
        return False
    own = own_parameter_names(module)
    return own in (set(), {"v"}) and _score_ok(module, linear.out_features)


def _match_bentrevett(module: nn.Module) -> bool:
    return _match_common(module) and not hasattr(module, "method")


def _match_chatbot(module: nn.Module) -> bool:
    return (
        _match_common(module)
        and getattr(module, "method", None) == "concat"
        and isinstance(getattr(module, "v", None), nn.Parameter)
    )


def _widths(module: nn.Module) -> tuple[int, int]:
    """(query width, key width): bentrevett's decoder state is attn's output width."""
    linear = module.attn if "attn" in child_names(module) else module.attention
    query_width = linear.out_features
    return query_width, linear.in_features - query_width


def _example(module: nn.Module, dtype: torch.dtype, *, time_major: bool, chatbot: bool):
    batch, num_keys = 3, 5
    query_width, key_width = _widths(module)
    hidden = torch.randn(batch, query_width, dtype=dtype)
    keys = torch.randn(batch, num_keys, key_width, dtype=dtype)
    if time_major:
        keys = keys.transpose(0, 1).contiguous()
    if chatbot:
        return (hidden.unsqueeze(0), keys), {}
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    return (hidden, keys, mask), {}


CONCAT = register(
    Layout(
        "concat",
        _match_bentrevett,
        None,
        lambda m, dtype: _example(m, dtype, time_major=True, chatbot=False),
        traced=True,
    )
)
CONCAT_BATCH_FIRST = register(
    Layout(
        "concat_batch_first",
        _match_bentrevett,
        None,
        lambda m, dtype: _example(m, dtype, time_major=False, chatbot=False),
        traced=True,
    )
)
CHATBOT = register(
    Layout(
        "chatbot_concat",
        _match_chatbot,
        None,
        lambda m, dtype: _example(m, dtype, time_major=True, chatbot=True),
        traced=True,
    )
)
