"""Named layouts on the general path's runtime: a typed plan built from a layout's structure.

A named layout whose stand-in keeps its project's call convention (JoeyNMT's
``compute_proj_keys`` then one call per step, OpenNMT-py's ``memory_bank`` and lengths) has no
graph to trace: it knows its plan from the module's structure. :class:`PlannedAttention` builds
that plan (the :class:`~seq2seq_fast.nn.convert.traced.plan.Plan` the traced matcher returns,
without graph nodes) and runs it on the same runtime
(:class:`~seq2seq_fast.nn.convert.traced.rewrite.TracedWeights`): the same key layout and step
memory kept over a decoder's steps, the same mask cache, the same plain path where the op cannot
give the original's result (a row with no valid key under a fill of -inf: NaN, as the original).
The stand-in's own code is its call convention only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from seq2seq_fast.nn.convert._base import with_cancelled
from seq2seq_fast.nn.convert.traced.key_terms import _Plain
from seq2seq_fast.nn.convert.traced.plan import (
    Heads,
    KeyTerm,
    Layout,
    Mask,
    Normalisation,
    Plan,
    Shift,
    Terms,
)
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights
from seq2seq_fast.ops.additive_attention import additive_attention

# The pre-activation [Tq, B, S, H]: a query term [Tq, B, 1, H] (the call's [B, Tq, H], a view),
# a key term [B, S, H] (as given: the same tensor over a decoder's steps keeps its layout and step
# memory); scores, weights and masks come [B, Tq, S] (axis 0 of theirs is the pre-activation's 1).
_ORIGIN = (1, 0, 2)
_LAYOUT = Layout(
    rank=4,
    batch_axes=(1,),
    query_axes=(0,),
    memory_axis=2,
    hidden_axis=3,
    scores_origin=_ORIGIN,
)


class PlannedAttention:
    """``(weights [B, Tq, S], context [B, Tq, Dv])`` of a query term [B, Tq, H] against a key
    term [B, S, H] and values [B, S, Dv], with a score vector ([H], or a [1, H] Linear weight),
    with ``shifted``, a shift of every score (a score layer's bias: a softmax cancels it, its
    gradient is zero), then one mask [B, 1, S] per entry of ``masks`` ("keep": True attends,
    "fill": True leaves) and its fill value, and a softmax or sigmoid normalisation (see the
    module docstring)."""

    def __init__(
        self,
        backend: str,
        *,
        shifted: bool = False,
        masks: tuple[Literal["keep", "fill"], ...] = (),
        normalisation: Literal["softmax", "sigmoid"] = "softmax",
        description: str = "",
    ) -> None:
        plan = Plan(
            terms=Terms(queries=(), keys=(KeyTerm(node=None),), biases=()),
            vector=None,
            layout=_LAYOUT,
            steps=(Shift(sign="+", amount=None),) * shifted
            + tuple(
                Mask(kind=kind, mask=None, fill=None, origin=_ORIGIN, at_shape=None)
                for kind in masks
            ),
            normalisation=Normalisation(kind=normalisation),
            heads=Heads(),
            site=None,
        )
        self.runtime = TracedWeights(plan, backend)
        self.runtime.with_context = True
        self.runtime.description = description

    def __call__(
        self,
        query: Tensor,
        keys: Tensor,
        vector: Tensor,
        values: Tensor,
        masks: tuple[Tensor, ...] = (),
        fills: tuple[float, ...] = (),
        shifts: tuple[Tensor, ...] = (),
    ) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return self._compiled(query, keys, vector, values, masks, shifts)
        weights, context = self.runtime(
            [query.transpose(0, 1).unsqueeze(2)],
            [_Plain(keys)],
            [],
            vector,
            [],
            list(masks),
            list(fills),
            list(shifts),
            values=values,
        )
        if context is None:  # the plain path ran (a row with no valid key): the weights only
            context = weights @ values
        return weights, context

    def _compiled(self, query, keys, vector, values, masks, shifts) -> tuple[Tensor, Tensor]:
        """Inside the user's torch.compile: the runtime's caches (by identity, weakly held) and
        its checks of each mask's content would break the graph at every call, so the plan goes
        to the op directly (which torch.compile traces whole). A row with no valid key gives
        zeros there, not NaN."""
        plan = self.runtime.plan
        vector, score_bias = vector.reshape(-1), None
        if plan.normalisation.kind == "softmax":  # (it cancels the shifts)
            vector = with_cancelled(vector, *shifts)
        elif shifts:
            score_bias = sum(shift.reshape(()) for shift in shifts)
        valid = None
        for step, mask in zip([s for s in plan.steps if isinstance(s, Mask)], masks, strict=True):
            mask = mask.squeeze(1).to(torch.bool)
            mask = mask if step.kind == "keep" else ~mask
            valid = mask if valid is None else valid & mask
        context, weights = additive_attention(
            query,
            keys,
            values,
            vector,
            mask=valid,
            normalize=plan.normalisation.kind,
            backend=self.runtime.backend,
            score_bias=score_bias,
        )
        return weights, context
