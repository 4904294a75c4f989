"""NVIDIA GNMT's ``BahdanauAttention`` (PyTorch GNMT; also in DeepLearningExamples).

Original parameters: ``linear_q`` (Dq -> N, no bias), ``linear_k`` (Dk -> N, no bias),
``linear_att`` [N], and with ``normalize=True`` ``normalize_scalar`` [1] and ``normalize_bias``
[N]; state: ``mask`` (True = padding) set by ``set_mask(context_len, context)``; ``batch_first``.

Original math and call::

    forward(query [B, Tq, Dq] or [B, Dq], keys [B, Tk, Dk])   (time-major [Tq, B, .], [Tk, B, .]
    when batch_first=False; a [B, Dq] query stays batch-major)
    scores = tanh(linear_q(query) + linear_k(keys) [+ normalize_bias]) @ att,
        att = linear_att, or normalize_scalar * linear_att / ||linear_att|| when normalize
    scores[mask] = -65504; weights = softmax(scores); context = weights @ keys

A row whose keys are all masked gets uniform weights there (all its scores are -65504).

A thin matcher (``traced=True``): no stand-in of its own. The module is converted in place at
``fuse_attention`` time by the traced runtime, with the example call below (a mask set by
``set_mask`` with padding and one row with no valid key) as its first call. Every variant the
former stand-in took converts that way (``normalize=True``'s weight-normalised score vector and
bias, ``set_mask`` masks, batch-first and time-major, a [B, Dq] or [B, Tq, Dq] query); the key
projection is computed once per keys tensor over a decoder's steps by the runtime's key cache.
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
    if child_names(module) != {"linear_q", "linear_k"}:
        return False
    linear_q, linear_k = module.linear_q, module.linear_k
    att = getattr(module, "linear_att", None)
    if not (
        is_linear(linear_q, bias=False)
        and is_linear(linear_k, bias=False, out_features=linear_q.out_features)
        and isinstance(att, nn.Parameter)
        and att.shape == (linear_q.out_features,)
        and hasattr(module, "normalize_scalar")
        and hasattr(module, "normalize_bias")
    ):
        return False
    scalar, norm_bias = module.normalize_scalar, module.normalize_bias
    own = own_parameter_names(module)
    if scalar is None and norm_bias is None:
        return own == {"linear_att"}
    return (
        isinstance(scalar, nn.Parameter)
        and scalar.numel() == 1
        and isinstance(norm_bias, nn.Parameter)
        and norm_bias.shape == att.shape
        and own == {"linear_att", "normalize_scalar", "normalize_bias"}
    )


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, num_queries, num_keys = 3, 2, 5
    query = torch.randn(batch, num_queries, module.linear_q.in_features, dtype=dtype)
    keys = torch.randn(batch, num_keys, module.linear_k.in_features, dtype=dtype)
    if not getattr(module, "batch_first", False):
        query, keys = query.transpose(0, 1), keys.transpose(0, 1)
    return (query, keys), {}


def _prepare(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A mask with padding and one row with no valid key."""
    keys = args[1]
    module.set_mask(torch.tensor([5, 3, 0]), keys)


LAYOUT = register(Layout("gnmt", _match, None, _example_call, prepare=_prepare, traced=True))
