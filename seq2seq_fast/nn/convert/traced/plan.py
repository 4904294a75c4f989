"""The typed plan of one additive attention found in a graph: what the matcher
(:func:`~seq2seq_fast.nn.convert.traced.pattern.find_matches`) returns and what the rewrite
(:func:`~seq2seq_fast.nn.convert.traced.rewrite.rewrite`) turns into one
:class:`~seq2seq_fast.nn.convert.traced.rewrite.TracedWeights` call.

Every part is a small frozen dataclass, filled by keyword. The graph's nodes in it are the
rewrite's: they say which values the replacement receives, in which order; at run time the
replacement reads only the plan's structure (axes, step kinds, normalisation, heads) and gets the
values themselves as its call's arguments.

The op computes, over rows B' (the batch axes) and T' (the query axes) of a memory of S frames::

    e[b, t, s] = v . tanh(query[b, t] + key[b, s] + bias)        (the terms of the sum)
    e' = the steps applied to e, in order                        (scales, shifts, masks)
    weights = softmax(e') or sigmoid(e') / sum sigmoid(e')       (the normalisation)

The context (weights times values) is not part of the plan: the rewrite looks for it after the
normaliser (``rewrite._form_the_context``) and, where the graph forms it in a way the op computes,
hands the values to the same call; otherwise the op gets a zero placeholder for its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import fx


@dataclass(frozen=True)
class Layout:
    """Where the op's axes are among the axes of the pre-activation (the sum inside the tanh,
    hidden axis included)."""

    rank: int  # of the pre-activation, hidden axis included
    batch_axes: tuple[int, ...]  # the keys vary along them (the op's rows B', with query_axes)
    query_axes: tuple[int, ...]  # the other leading axes but the memory's (the op's T')
    memory_axis: int  # the normaliser's axis (the op's S)
    hidden_axis: int  # the tanh's width (last, or the middle one of a [B, H, T] layout)
    # the pre-activation's axis (hidden axis left out) each axis of the projection's output is,
    # None for a 1 the projection added; the weights go back to this layout
    scores_origin: tuple


@dataclass(frozen=True)
class LocationSource:
    """A key term the kernels can form themselves: linear(conv1d(features, conv_weight, same
    padding, odd width, no bias)^T, dense_weight, no bias); the rewrite hands the three to
    :class:`~seq2seq_fast.nn.convert.traced.key_terms._LocationTerm`."""

    features: fx.Node  # [B, Cin, T]
    conv_weight: fx.Node  # [C, Cin, K]
    dense_weight: fx.Node  # [A, C]


@dataclass(frozen=True)
class KeyTerm:
    """One term of the sum that varies along the memory axis (a projection of the memory, a
    location or coverage term fed back each step)."""

    node: fx.Node
    # set where the term is a location term the kernels form (see LocationSource): only where
    # the keys are one memory projection plus that term
    location: LocationSource | None = None


@dataclass(frozen=True)
class Terms:
    """The terms of the sum inside the tanh, sorted by the axes they vary along."""

    queries: tuple[fx.Node, ...]  # vary along some leading axis, not the memory's
    keys: tuple[KeyTerm, ...]  # vary along the memory axis
    biases: tuple[fx.Node, ...]  # vary along no axis (an [H] bias inside the tanh)
    # attention pooling: no query term, a learned vector scores the keys (the op gets a zero
    # query)
    learned_query: bool = False


@dataclass(frozen=True)
class Scale:
    """scores * factor ("mul") or scores / factor ("div"): a scale or a temperature. The factor
    is a number, or a node of one element (a buffer, a parameter, a float attribute TorchDynamo
    made an input); the rewrite passes it in the replacement's ``scales``, in step order. The
    replacement folds it into the score vector (and any score bias before it); a factor that is
    not positive at run time takes the plain path."""

    op: Literal["mul", "div"]
    factor: object


@dataclass(frozen=True)
class Shift:
    """scores + amount ("+") or scores - amount ("-"): a number or a one-element tensor, or the
    score layer's own bias. The rewrite passes it in ``shifts``; a softmax cancels it, a sigmoid
    does not: the op's ``score_bias`` (scaled by the scales after it)."""

    sign: Literal["+", "-"]
    amount: object


@dataclass(frozen=True)
class Mask:
    """A mask on the scores at one point of the chain. "fill": masked_fill(mask, fill) (True
    leaves the softmax); "keep": where(mask, scores, fill) (True stays); "add": + a float mask
    (0 or very negative); "product": AllenNLP's masked softmax, scores * a 0/1 mask, the
    normalisation, then * the mask again and renormalised (sum + 1e-13): the weights over the
    kept frames, and zeros in a row with none (only named layouts make it). The rewrite passes
    ``mask`` in ``masks`` and ``fill`` in ``fills`` ("fill", "keep"); the replacement turns them
    into the op's mask over its rows."""

    kind: Literal["fill", "keep", "add", "product"]
    mask: fx.Node
    fill: object  # a very negative number or one-element node; None for "add" and "product"
    origin: tuple  # the pre-activation's axis each axis of the scores is at this point
    at_shape: tuple  # the scores' shape at this point (for messages)


@dataclass(frozen=True)
class Round:
    """The scores rounded to ``dtype`` and back (fairseq's float16 guard fills its mask in
    float32): nothing where the scores are that narrow already; wider scores (float64) take the
    replacement's plain path, which rounds them as the original does. Only named layouts make
    it."""

    dtype: object  # a torch.dtype


Step = Scale | Shift | Mask | Round


@dataclass(frozen=True)
class Normalisation:
    """softmax(e) over the memory axis, or sigmoid(e) / sigmoid(e).sum(keepdim=True) ("sigmoid":
    a score bias does not cancel there, see Shift)."""

    kind: Literal["softmax", "sigmoid"] = "softmax"
    # "sigmoid": the sum, then the sigmoids (erased with the division the weights replace)
    nodes: tuple[fx.Node, ...] = ()


@dataclass(frozen=True)
class Heads:
    """Multi-head additive attention: one score vector per index of ``vector_axes`` (leading
    batch axes); the op runs once per head over its rows. Empty: one vector."""

    vector_axes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Site:
    """Where the match sits in the graph: what the rewrite replaces, re-applies and erases."""

    tanh: fx.Node
    # the node the weights replace: the softmax, or the sigmoid normalisation's division
    output: fx.Node
    shape_ops: tuple[fx.Node, ...] = ()  # between the scores and the normaliser, re-applied
    split_nodes: tuple[fx.Node, ...] = ()  # new nodes of a split concat / linear
    # new_full(scores, ...) / type_as(scores) (dtype only), .size() / .dim() of the chain,
    # in-place fills of the scores and their .data
    helpers: tuple[fx.Node, ...] = ()
    sizes: tuple[tuple[fx.Node, int], ...] = ()  # (size or dim node, after k shape ops)


@dataclass(frozen=True)
class Plan:
    """One additive attention found in a graph (see the module docstring)."""

    terms: Terms
    # the score vector v as the graph has it: [H], a [1, H] Linear weight, an [H, 1] column, a
    # [1, ..., 1, H] view, or one per head [heads, H] (see heads); the replacement reshapes it
    vector: fx.Node
    layout: Layout
    steps: tuple[Step, ...]  # between the projection and the normaliser, in the chain's order
    normalisation: Normalisation
    heads: Heads
    site: Site

    def describe(self) -> str:
        kinds = [_step_name(step) for step in self.steps]
        return (
            f"{len(self.terms.queries)} query and {len(self.terms.keys)} key term(s)"
            + (", a bias" if self.terms.biases else "")
            + (f", then {', '.join(kinds)}" if kinds else "")
            + (", sigmoid-normalised" if self.normalisation.kind == "sigmoid" else "")
            + (", a score vector per head or row" if self.heads.vector_axes else "")
        )


def _step_name(step: Step) -> str:
    if isinstance(step, Scale):
        return f"scale({step.op})"
    if isinstance(step, Shift):
        return f"shift({step.sign})"
    if isinstance(step, Round):
        return f"round({step.dtype})"
    return step.kind
