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

import math
from typing import Literal

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert.traced.key_terms import _LocationTerm, _Plain
from seq2seq_fast.nn.convert.traced.plan import (
    Heads,
    KeyTerm,
    Layout,
    LocationSource,
    Mask,
    Normalisation,
    Plan,
    Round,
    Scale,
    Shift,
    Terms,
)
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights, fold_steps
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
# One query per call (a speech decoder's step): the pre-activation [B, S, H], a query term
# [B, 1, H] (the call's [B, H], a view), key terms [B, S, H]; scores, weights and masks [B, S].
# The runtime forms a location term inside the kernels in this layout only.
_ONE_ORIGIN = (0, 1)
_ONE_QUERY = Layout(
    rank=3,
    batch_axes=(0,),
    query_axes=(),
    memory_axis=1,
    hidden_axis=2,
    scores_origin=_ONE_ORIGIN,
)


class PlannedAttention:
    """``(weights, context)`` of a query term against a key term and values, with a score vector
    ([H], or a [1, H] Linear weight), then the steps in this order: ``shifted``, a shift of every
    score (a score layer's bias: a softmax cancels it, its gradient is zero); ``rounded``, the
    scores rounded to float32 and back (a float64 call takes the plain path); one mask per entry
    of ``masks`` ("keep": True attends, "fill": True leaves, each with its fill value; "product":
    AllenNLP's masked softmax, see :class:`~seq2seq_fast.nn.convert.traced.plan.Mask`);
    ``scaled``, a factor on every score (a temperature, folded into the score vector); and a
    softmax or sigmoid normalisation (see the module docstring). With ``values`` None the
    context is the caller's to form: the call returns ``(weights, None)``.

    Shapes: by default a query term [B, Tq, H] against a key term [B, S, H] and values
    [B, S, Dv], masks [B, 1, S], giving weights [B, Tq, S] and context [B, Tq, Dv]. With
    ``one_query`` a query term [B, H], masks [B, S], weights [B, S], context [B, Dv]; there
    ``biased`` adds a bias term [H] inside the tanh, and ``located`` a location term
    ``linear(conv1d(features, conv_weight, same padding)^T, dense_weight)`` to the keys (see
    :class:`~seq2seq_fast.nn.convert.traced.key_terms._LocationTerm`), which the runtime forms
    inside the kernels when training on the CPU kernel."""

    def __init__(
        self,
        backend: str,
        *,
        shifted: bool = False,
        masks: tuple[Literal["keep", "fill", "product"], ...] = (),
        rounded: bool = False,
        scaled: bool = False,
        normalisation: Literal["softmax", "sigmoid"] = "softmax",
        one_query: bool = False,
        biased: bool = False,
        located: bool = False,
        description: str = "",
    ) -> None:
        if (biased or located) and not one_query:
            raise ValueError("PlannedAttention: biased and located take one_query=True")
        origin = _ONE_ORIGIN if one_query else _ORIGIN
        keys = (KeyTerm(node=None),)
        if located:
            keys += (KeyTerm(node=None, location=LocationSource(None, None, None)),)
        plan = Plan(
            terms=Terms(queries=(), keys=keys, biases=(None,) * biased),
            vector=None,
            layout=_ONE_QUERY if one_query else _LAYOUT,
            steps=(Shift(sign="+", amount=None),) * shifted
            + (Round(dtype=torch.float32),) * rounded
            + tuple(
                Mask(kind=kind, mask=None, fill=None, origin=origin, at_shape=None)
                for kind in masks
            )
            + (Scale(op="mul", factor=None),) * scaled,
            normalisation=Normalisation(kind=normalisation),
            heads=Heads(),
            site=None,
        )
        self.plan = plan
        self.backend = backend
        self.one_query = one_query
        self.description = description
        self._runtime: TracedWeights | None = None

    @property
    def runtime(self) -> TracedWeights:
        """The plan's runtime, made at the first call outside torch.compile (its caches hold
        locks, which TorchDynamo cannot make)."""
        if self._runtime is None:
            self._runtime = TracedWeights(self.plan, self.backend)
            self._runtime.with_context = True
            self._runtime.flat_context = self.one_query
            self._runtime.description = self.description
        return self._runtime

    def __call__(
        self,
        query: Tensor,
        keys: Tensor,
        vector: Tensor,
        values: Tensor | None,
        masks: tuple[Tensor, ...] = (),
        fills: tuple[float, ...] = (),
        shifts: tuple[Tensor, ...] = (),
        scales: tuple[object, ...] = (),
        biases: tuple[Tensor, ...] = (),
        location: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return self._compiled(
                query, keys, vector, values, masks, fills, shifts, scales, biases, location
            )
        terms = [_Plain(keys)]
        if location is not None:
            terms.append(_LocationTerm(*location))
        weights, context = self.runtime(
            [query.unsqueeze(1) if self.one_query else query.transpose(0, 1).unsqueeze(2)],
            terms,
            list(biases),
            vector,
            list(scales),
            list(masks),
            list(fills),
            list(shifts),
            values=values,
        )
        if values is None:  # (the caller forms the context)
            return weights, None
        if context is None:  # the plain path ran (a row with no valid key): the weights only
            if self.one_query:
                return weights, (weights.unsqueeze(1) @ values).squeeze(1)
            return weights, weights @ values
        if self.one_query and context.dim() == 3:  # (the location-aware step gives [B, Dv])
            context = context.squeeze(1)
        return weights, context

    def _compiled(
        self, query, keys, vector, values, masks, fills, shifts, scales, biases, location
    ) -> tuple[Tensor, Tensor]:
        """Inside the user's torch.compile: the runtime's caches (by identity, weakly held) and
        its checks of each mask's content would break the graph at every call, so the plan goes
        to the op directly (which torch.compile traces whole). A row with no valid key gives
        uniform weights under a finite fill, as the original (d2l's -1e6), and zeros under -inf
        (the original's NaN); a float product mask is taken as 0/1, and a round step is left
        out (float64 results float32-close)."""
        plan = self.plan
        vector, score_bias, _ = fold_steps(plan, vector.reshape(-1), scales, shifts)
        if location is not None:
            keys = keys + _LocationTerm(*location).value()
        for bias in biases:
            query = query + bias
        valid = None
        for step, mask in zip([s for s in plan.steps if isinstance(s, Mask)], masks, strict=True):
            mask = mask.to(torch.bool) if step.kind != "product" else mask != 0
            mask = mask.squeeze(1) if mask.dim() == 3 else mask
            mask = ~mask if step.kind == "fill" else mask
            valid = mask if valid is None else valid & mask
        context, weights = additive_attention(
            query,
            keys,
            keys.new_zeros(*keys.shape[:2], 1) if values is None else values,
            vector,
            mask=valid,
            normalize=plan.normalisation.kind,
            backend=self.backend,
            score_bias=score_bias,
        )
        if valid is not None and any(math.isfinite(fill) for fill in fills):
            # a row whose keys are all filled with one finite value: uniform, as the original
            empty = ~valid.any(-1)
            empty = empty.reshape(*empty.shape, *(1,) * (weights.dim() - empty.dim()))
            weights = torch.where(empty, 1.0 / keys.shape[1], weights)
            if values is not None:
                mean = values.mean(dim=1)
                mean = mean if context.dim() == 2 else mean.unsqueeze(1)
                context = torch.where(empty, mean, context)
        return weights, (None if values is None else context)


def planned(owner: nn.Module, **config) -> PlannedAttention:
    """``owner``'s :class:`PlannedAttention` of this configuration (keyword arguments as
    PlannedAttention takes them), made at its first use and kept on the owner: a stand-in whose
    calls differ in kind (with a mask or without) has one plan, and one runtime, per kind."""
    plans = owner.__dict__.setdefault("_plans", {})
    key = tuple(config.items())  # (a call site passes its keywords in one order)
    attention = plans.get(key)
    if attention is None:
        attention = PlannedAttention(owner.backend, description=owner.layout, **config)
        if not torch.compiler.is_compiling():  # (inside, one made per trace: it runs no runtime)
            plans[key] = attention
    return attention
