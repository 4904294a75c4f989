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

A row whose keys are all masked gets uniform weights there (all its scores are -65504); the stand-in
gives the same.
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
from seq2seq_fast.nn.keycache import ProjectionCache
from seq2seq_fast.nn.stepwise import StepMemory, step_memory
from seq2seq_fast.ops.additive_attention import additive_attention


class FusedGNMTAttention(FusedStandIn):
    """Fused stand-in for NVIDIA GNMT's attention: same parameters and state_dict keys, same
    ``set_mask(context_len, context)``, ``mask`` attribute and ``forward(query, keys)``.
    ``linear_k(keys)`` is computed once per keys tensor (decoding step by step calls it with the
    same context every step), and a step-by-step training client gets the steps' gradients
    gathered once per sequence."""

    layout = "gnmt"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        self.linear_q, self.linear_k = original.linear_q, original.linear_k
        self.linear_att = original.linear_att
        self.normalize = original.normalize_scalar is not None
        self.batch_first = bool(getattr(original, "batch_first", False))
        self.num_units = self.linear_att.shape[0]
        self.normalize_scalar = original.normalize_scalar
        self.normalize_bias = original.normalize_bias
        self.mask = getattr(original, "mask", None)
        self.key_cache = ProjectionCache()

    @property
    def mask(self) -> Tensor | None:
        """bool [B, Tk], True = padding (GNMT's convention), or None."""
        return self._padding

    @mask.setter
    def mask(self, value: Tensor | None) -> None:
        self._padding = value
        self._valid = None if value is None else ~value
        # rows with no valid key: GNMT gives them uniform weights; found once here, not per call
        self._empty_rows = None
        if value is not None and value.numel() > 0:
            empty = value.all(dim=1)
            self._empty_rows = empty if bool(empty.any()) else None

    def set_mask(self, context_len: Tensor, context: Tensor) -> None:
        max_len = context.size(1) if self.batch_first else context.size(0)
        indices = torch.arange(max_len, dtype=torch.int64, device=context.device)
        self.mask = indices >= context_len.unsqueeze(1)

    def _memory(self, keys: Tensor, stepwise: bool) -> StepMemory:
        """The steps' memory for batch-first keys (values: the call's own keys, which the cache
        holds weakly). ``stepwise``: the client attends one query at a time (GNMT's training
        attends all target steps in one call: no memory to gather then)."""
        projected = self.linear_k(keys)
        return step_memory(projected, keys, self.backend, stepwise=stepwise, own_values=True)

    def forward(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        given = keys
        if not self.batch_first:
            keys = keys.transpose(0, 1)
            if query.dim() == 3:
                query = query.transpose(0, 1)
        batch_keys = keys
        stepwise = query.dim() == 2 or query.shape[1] == 1
        memory = self.key_cache.get(
            given,
            (self.linear_k.weight, self.batch_first, stepwise),
            lambda: self._memory(batch_keys, stepwise),
            watch=lambda m: (m.projection,),
        )
        if self.normalize:
            v_eff = self.linear_att / self.linear_att.norm() * self.normalize_scalar
            bias = self.normalize_bias
        else:
            v_eff, bias = self.linear_att, None
        values = keys if memory.values is None else memory.values
        context, weights = additive_attention(
            self.linear_q(query),
            memory.keys,
            values,
            v_eff,
            bias,
            mask=self._valid,
            stepwise=memory.stepwise,
            backend=self.backend,
        )
        if self._empty_rows is not None:
            context, weights = _uniform_rows(self._empty_rows, context, weights, keys)
        if query.dim() == 3 and not self.batch_first:
            context, weights = context.transpose(0, 1), weights.transpose(0, 1)
        return context, weights


def _uniform_rows(empty: Tensor, context: Tensor, weights: Tensor, keys: Tensor):
    """Rows flagged in ``empty`` [B] get uniform weights over all keys and the keys' mean."""
    shape = (-1,) + (1,) * (context.dim() - 1)
    uniform_context = keys.mean(dim=1)
    if context.dim() == 3:
        uniform_context = uniform_context.unsqueeze(1)
    context = torch.where(empty.view(shape), uniform_context, context)
    weights = torch.where(empty.view(shape), 1.0 / keys.shape[1], weights)
    return context, weights


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


def _build(module: nn.Module, backend: str) -> nn.Module:
    return FusedGNMTAttention(module, backend)


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


LAYOUT = register(Layout("gnmt", _match, _build, _example_call, prepare=_prepare))
