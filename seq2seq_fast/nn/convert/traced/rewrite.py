"""The replacement: a match's sum ... softmax in the graph becomes one :class:`TracedWeights`
call, which runs the fused op (or the original's math in plain ops where the op cannot give the
original's result: a row with no valid frame, a float mask that is not a mask, a scale that is
not positive). Where the graph then multiplies the weights by values in a form the op computes,
the same call forms the context too (:func:`_form_the_context`, :func:`traced_context`)."""

from __future__ import annotations

import contextlib
import math
import operator
import threading

import torch
from torch import Tensor, fx, nn

from seq2seq_fast.nn.convert._base import with_cancelled
from seq2seq_fast.nn.convert._location import attend_location
from seq2seq_fast.nn.convert.traced.key_terms import _BoundTerm, _key_terms, _LocationTerm, _Plain
from seq2seq_fast.nn.convert.traced.nodes import (
    _MATMUL,
    _MUL,
    _NEW_FULL,
    _SUM,
    MASK_FILL_MAX,
    _inert_dropout,
    _is,
)
from seq2seq_fast.nn.convert.traced.plan import Layout, Mask, Plan, Round, Scale, Shift, Site
from seq2seq_fast.nn.keycache import MAX_THREADS, ProjectionCache, Weak, cache_bypassed
from seq2seq_fast.nn.stepwise import StepwiseMemory
from seq2seq_fast.ops._checks import masking
from seq2seq_fast.ops.additive_attention import additive_attention

# --- the replacement ------------------------------------------------------------------------------


# a memo's stand-in for the call's own values, which it must not hold (see _Step, _memory)
_OWN = object()


def _pad(t: Tensor, rank: int) -> Tensor:
    return t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t


def _mask_to_rows(mask: Tensor, origin: tuple, layout: Layout, full: tuple) -> Tensor:
    """A mask on the scores (in their layout at that step) -> [B', S] over the op's rows."""
    mask = _pad(mask, len(origin))
    index = tuple(0 if axis is None else slice(None) for axis in origin)
    mask = mask[index]  # the inserted 1-axes dropped
    axes = [axis for axis in origin if axis is not None]
    leading = layout.rank - 1
    order = [axes.index(a) if a in axes else None for a in range(leading)]
    shape = [mask.shape[o] if o is not None else 1 for o in order]
    mask = mask.permute([o for o in order if o is not None]).reshape(shape)
    target = [1 if a in layout.query_axes else full[a] for a in range(leading)]
    rows = layout.batch_axes + layout.query_axes + (layout.memory_axis,)
    mask = mask.expand(target).permute(rows)
    return mask.reshape(-1, full[layout.memory_axis])


def _fill_value(value) -> float:
    return float(value.reshape(-1)[0]) if isinstance(value, Tensor) else float(value)


def _plain_scores(query, keys, bias, v):
    """[B', T', S] scores; v [H], or [G, H]: one per group of B' / G consecutive rows."""
    pre = query.unsqueeze(2) + keys.unsqueeze(1)
    if bias is not None:
        pre = pre + bias
    if v.dim() == 2:
        groups = v.shape[0]
        tanh = torch.tanh(pre).reshape(groups, -1, *pre.shape[1:])
        return (tanh * v[:, None, None, None, :]).sum(-1).reshape(pre.shape[:-1])
    return torch.tanh(pre) @ v


# The replacements each thread's calls ran, for whoever asks (recorded_runs): the converted
# module's forward (did this call run fused?) and the probe (what did it run?). Per thread: two
# threads calling converted modules never see each other's runs.
_RUNS = threading.local()


@contextlib.contextmanager
def recorded_runs():
    """A list that collects the :class:`TracedWeights` this thread runs inside the block (nested
    blocks each collect theirs)."""
    logs = _RUNS.__dict__.setdefault("logs", [])
    log: list = []
    logs.append(log)
    try:
        yield log
    finally:
        # by identity: list.remove compares by ==, and nested logs of equal contents (two empty
        # ones, or one run seen by both) would remove the outer block's log in the inner's place
        del logs[next(i for i, other in enumerate(logs) if other is log)]


class _Rows:
    """One call's geometry: the broadcast shape ``full`` of the terms (hidden axis last) and the
    op's rows in it: B' (batch axes) x T' (query axes) queries over S (memory axis) frames."""

    __slots__ = (
        "layout",
        "full",
        "width",
        "order",
        "batch",
        "steps_q",
        "frames",
        "key_shape",
        "query_shape",
        "in_order",
        "back_shape",
        "query_size",
        "back_size",
        "key_size",
    )

    def __init__(self, layout: Layout, full) -> None:
        rank = layout.rank
        self.layout, self.full, self.width = layout, full, full[-1]
        self.order = layout.batch_axes + layout.query_axes + (layout.memory_axis, rank - 1)
        self.batch = math.prod(full[a] for a in layout.batch_axes)
        self.steps_q = math.prod(full[a] for a in layout.query_axes)
        self.frames = full[layout.memory_axis]
        self.key_shape = [1 if a in layout.query_axes else full[a] for a in range(rank)]
        self.query_shape = [1 if a == layout.memory_axis else full[a] for a in range(rank)]
        # the terms' axes in the op's order already: a query is a reshape of its sum
        self.in_order = self.order == tuple(range(rank))
        # where the projection's axes come in the op's order, its weights are a reshape of the
        # op's [B', T', S] (its added 1-axes included): that shape, else None
        self.back_shape = None
        origin = [a for a in layout.scores_origin if a is not None]
        if sorted(origin, key=str) == list(range(rank - 1)):  # each leading axis once
            moved = [self.order.index(a) for a in origin]
            if moved == sorted(moved):
                self.back_shape = [1 if a is None else full[a] for a in layout.scores_origin]
        # a single query term already [B', T', H] (one query per call in the op's order), and
        # weights already in the projection's layout, pass as they are (a view costs ~4 us)
        self.query_size = (
            torch.Size((self.batch, self.steps_q, self.width)) if self.in_order else None
        )
        self.back_size = None if self.back_shape is None else torch.Size(self.back_shape)
        self.key_size = torch.Size((self.batch, self.frames, self.width))

    def canonical(self, t: Tensor) -> Tensor:
        """A key term -> [B', S, H] (a term already so, in the op's order, as it is)."""
        if self.in_order and t.shape == self.key_size:
            return t
        return (
            t.expand(self.key_shape)
            .permute(self.order)
            .reshape(self.batch, self.frames, self.width)
        )

    def query(self, queries: list, key: Tensor) -> Tensor:
        """The query terms' sum -> [B', T', H]; zeros for attention pooling (a learned vector
        scores the keys alone)."""
        if not queries:
            return key.new_zeros(self.batch, self.steps_q, self.width)
        query = queries[0]
        if len(queries) == 1 and query.shape == self.query_size:
            return query
        for t in queries[1:]:
            query = query + t
        if self.in_order and list(query.shape) == self.query_shape:
            return query.reshape(self.batch, self.steps_q, self.width)  # in the op's order
        query = query.expand(self.query_shape).permute(self.order)
        return query.reshape(self.batch, self.steps_q, self.width)

    def back(self, weights: Tensor) -> Tensor:
        """Weights [B', T', S] (or [B', S] where T' = 1) -> the projection's output layout
        (``Layout.scores_origin``)."""
        if weights.shape == self.back_size:
            return weights
        if self.back_shape is not None:
            return weights.reshape(self.back_shape)
        layout = self.layout
        weights = weights.reshape(
            [self.full[a] for a in layout.batch_axes + layout.query_axes] + [self.frames]
        ).permute([self.order.index(a) for a in range(layout.rank - 1)])
        weights = weights.permute([a for a in layout.scores_origin if a is not None])
        for axis, source in enumerate(layout.scores_origin):  # the projection's added 1-axes
            if source is None:
                weights = weights.unsqueeze(axis)
        return weights


def _broadcast(shapes: list) -> tuple:
    """``torch.broadcast_shapes(*shapes)`` for shapes of one rank, in plain Python (torch's takes
    ~80 us a call, a decoder step's attention calls it every step); torch's otherwise, and for
    its error message."""
    rank = len(shapes[0])
    if any(len(shape) != rank for shape in shapes):
        return tuple(torch.broadcast_shapes(*shapes))
    full = []
    for sizes in zip(*shapes, strict=True):
        big = max(sizes)
        if any(size not in (1, big) for size in sizes):
            return tuple(torch.broadcast_shapes(*shapes))
        full.append(big)
    return tuple(full)


def _placeholder(key: Tensor) -> Tensor:
    """The op's values [B', S, 1] where the graph forms the context: one column nobody reads."""
    return key.new_zeros(key.shape[0], key.shape[1], 1)


def _same_content(a: Tensor, b: Tensor) -> bool:
    """Two masks with the same elements (shape, dtype and device too); neither wants gradients."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and not (a.requires_grad or b.requires_grad)
        and torch.equal(a, b)
    )


def _versions(*tensors: Tensor) -> tuple | None:
    """The tensors' version counters (None where one has none: made under inference_mode)."""
    versions = []
    for t in tensors:  # (a loop: this runs at every call)
        if t.is_inference():
            return None
        versions.append(t._version)
    return tuple(versions)


def _values_fit(values, rows: _Rows, key: Tensor, memory_first: bool) -> bool:
    """Whether the graph's context values are [B', S, Dv] over the op's rows ([S, B', Dv] where
    the graph's memory axis comes first; else the graph forms the context itself)."""
    leading = (rows.frames, rows.batch) if memory_first else (rows.batch, rows.frames)
    return (
        isinstance(values, Tensor)
        and values.dim() == 3
        and values.shape[:2] == leading
        and values.shape[2] > 0
        and values.dtype == key.dtype
        and values.device == key.device
    )


class _Step:
    """What one call derives from its arguments but the queries (see
    :meth:`TracedWeights._step_memo`)."""

    __slots__ = (
        "rows",
        "values_given",
        "key",
        "values",
        "memory",
        "bias",
        "v",
        "v_eff",
        "score_bias",
        "plain",
        "graded",
        "options",
        "located",
        "valid",
        "watch",
    )

    def __init__(self, rows: _Rows, values_given: bool) -> None:
        self.rows, self.values_given = rows, values_given
        self.key = self.values = self.memory = self.bias = self.v = self.v_eff = None
        self.score_bias = self.valid = None
        self.plain = self.located = False
        self.graded, self.options, self.watch = [], {}, []

    @staticmethod
    def watched(step: _Step) -> list:
        """The tensors a backward runs through when it reaches the step's graph (handed to the
        memo once, then not held: the call's own values are among them)."""
        watch, step.watch = step.watch, []
        return watch


def fold_steps(plan: Plan, v: Tensor, scales, shifts) -> tuple:
    """(v_eff, score_bias, whether the op cannot give the original's result): the scales and
    shifts folded into e' = v_eff . tanh(...) + score_bias (a softmax cancels the bias)."""
    plain = False
    v_eff, score_bias = v, None
    scale_iter, shift_iter = iter(scales), iter(shifts)
    for step in plan.steps:
        if isinstance(step, Scale):
            factor = next(scale_iter)
            if isinstance(factor, Tensor):
                factor = factor.reshape(())
            plain |= not bool(factor > 0)
            if step.op == "mul":
                v_eff = v_eff * factor
                score_bias = None if score_bias is None else score_bias * factor
            else:
                v_eff = v_eff / factor
                score_bias = None if score_bias is None else score_bias / factor
        elif isinstance(step, Shift):
            shift = next(shift_iter)
            shift = shift.reshape(()) if isinstance(shift, Tensor) else float(shift)
            shift = -shift if step.sign == "-" else shift
            score_bias = shift if score_bias is None else score_bias + shift
    if plan.normalisation.kind == "softmax":  # a softmax cancels the shifts
        v_eff = with_cancelled(v_eff, *(s for s in shifts if isinstance(s, Tensor)))
        score_bias = None
    return v_eff, score_bias, plain


class TracedWeights:
    """The callable that replaces a match's sum ... softmax in the graph (see :func:`rewrite`):
    the weights in the projection's output layout (``Layout.scores_origin``). It reads the plan's
    structure only; the plan's values come in as its call's arguments (see :func:`rewrite`).
    It is the owner :func:`~seq2seq_fast.nn.convert._location.attend_location` keeps its
    location memory on (``self._location``)."""

    __name__ = "traced_weights"
    # how many times any converted module ran a replacement: a statistic for tests, never read
    # to decide anything (recorded_runs does that, per thread)
    calls = 0
    description = ""
    # the call also takes ``values`` and returns (weights, context or None): see traced_context
    with_context = False
    # the values come memory axis first, [S, B', Dv] (a time-major graph's): see _op_values
    values_memory_first = False
    # the location-aware steps' context as the step op gives it, [B, Dv] (a caller of one query
    # per call, _planned.py); else [B, 1, Dv], the op's [B', T', Dv]
    flat_context = False

    def __init__(self, plan: Plan, backend: str) -> None:
        self.plan = plan
        self.backend = backend
        self.layout_cache = ProjectionCache()
        self.fixed_cache = ProjectionCache()
        self.mask_cache = ProjectionCache()
        self.step_cache = ProjectionCache()  # see _step_memo
        self.located_plan = any(key.location is not None for key in plan.terms.keys)
        # per thread: the last mask, and the last tensor found equal to it, with its version
        self.last_mask: dict[int, tuple] = {}  # (see _last_mask)
        self.rows: dict[torch.Size, _Rows] = {}  # each call's geometry, by its broadcast shape

    def __call__(self, queries, keys, biases, vector, scales, masks, fills, shifts=(), values=None):
        TracedWeights.calls += 1
        for log in getattr(_RUNS, "logs", ()):
            log.append(self)
        plan, layout = self.plan, self.plan.layout
        if layout.hidden_axis != layout.rank - 1:
            queries = [_pad(t, layout.rank).movedim(layout.hidden_axis, -1) for t in queries]
        else:
            queries = [_pad(t, layout.rank) for t in queries]
        keys, location = self._split_location(keys)
        masks = self._last_mask(masks)
        given = (biases, vector, scales, masks, fills, shifts, values)
        step = self._step_memo(queries, keys, location, given)
        rows, key, plain, graded = step.rows, step.key, step.plain, step.graded
        values = step.values if step.values is not _OWN else self._op_values(values)
        query = rows.query(queries, key)
        if location is not None and not step.located:
            key = key + location.value()  # [B, T, A] already: the op's layout
        context = None
        if plain:
            weights = self._plain(query, key, step, scales, masks, fills, shifts)
        elif step.located:
            context, weights = self._located(query, key, values, step, location)
        elif plan.heads.vector_axes:  # a score vector per head: the op once per head, over its rows
            weights = self._per_head(query, key, values, step)
        else:
            context, weights = additive_attention(
                query,
                key,
                values,
                step.v_eff,
                step.bias,
                **step.options,
                stepwise=step.memory,
                normalize=plan.normalisation.kind,
                backend=self.backend,
                score_bias=step.score_bias,
            )
        if graded and not plain:  # a float mask's gradient: the softmax's Jacobian, by a term
            shift = sum(m - m.detach() for m in graded).unsqueeze(1)  # worth zero
            fixed = weights.detach()
            moved = fixed * shift
            weights = weights + moved - fixed * moved.sum(-1, keepdim=True)
            context = None  # the graph's own, from these weights
        if not self.with_context:
            return rows.back(weights)
        return rows.back(weights), (context if step.values_given else None)

    def _step_memo(self, queries: list, keys: list, location, given: tuple) -> _Step:
        """What a call derives from its arguments but the queries and the location features (the
        geometry, the keys in the op's layout, the folded scales and shifts, the mask's rows):
        kept while the same tensors come in at the same versions and the same shapes (a decoder's
        steps over one memory), as the named stand-ins keep theirs in their attributes. Dropped
        when a backward runs through it (see ProjectionCache); not kept for a float mask that
        wants gradients."""
        # (plain loops: this runs at every call, and a generator costs a call per item)
        inputs = []
        for term in keys:
            inputs.extend(term.args if isinstance(term, _BoundTerm) else (term.value(),))
        anchor = None
        for t in inputs:
            if isinstance(t, Tensor) and not isinstance(t, nn.Parameter):
                anchor = t
                break
        masks = given[3]
        if anchor is None:
            return self._step(queries, keys, location, given)
        for m in masks:
            if isinstance(m, Tensor) and m.requires_grad:
                return self._step(queries, keys, location, given)
        shapes = tuple([t.shape for t in queries])
        if location is not None:
            parts = (location.conv_weight, location.dense_weight, location.features.shape)
        else:
            parts = ()
        flat = (*inputs, *parts, shapes, *given[0], given[1], *given[2], *masks, *given[4])
        # (the anchor is watched by a weak reference: a strong one in the state would keep it)
        flat = tuple([None if p is anchor else p for p in (*flat, *given[5])])
        values = given[6]
        flat += (Weak(values) if isinstance(values, Tensor) else values,)
        return self.step_cache.get(
            anchor, flat, lambda: self._step(queries, keys, location, given), watch=_Step.watched
        )

    def _step(self, queries: list, keys: list, location, given: tuple) -> _Step:
        """The :class:`_Step` of one call (see :meth:`_step_memo`)."""
        biases, vector, scales, masks, fills, shifts, values = given
        plan, layout = self.plan, self.plan.layout
        values_of_terms = [term.value() for term in keys]  # the same objects while cached
        raw = [_pad(t, layout.rank) for t in values_of_terms]
        if layout.hidden_axis != layout.rank - 1:  # (a view costs ~4 us: none where not needed)
            raw = [t.movedim(layout.hidden_axis, -1) for t in raw]
        shapes = [t.shape for t in queries + raw]
        if location is not None:
            shapes.append(location.shape())
        full = _broadcast(shapes)
        rows = self.rows.get(full)
        if rows is None:  # (a few shapes in a run; kept bounded all the same)
            if len(self.rows) >= 64:
                self.rows.clear()
            rows = self.rows[full] = _Rows(layout, full)
        if values is not None and not _values_fit(values, rows, raw[0], self.values_memory_first):
            values = None  # the graph's own context (see traced_context)
        step = _Step(rows, values is not None)
        step.key, step.values, step.memory = self._keys(
            values_of_terms, raw, rows, location is not None, values
        )
        for t in biases:
            t = t.reshape(rows.width)
            step.bias = t if step.bias is None else step.bias + t
        if plan.heads.vector_axes:
            groups = math.prod(rows.full[a] for a in plan.heads.vector_axes)
            step.v = vector.reshape(groups, rows.width)
        else:
            step.v = vector.reshape(rows.width)
        step.v_eff, step.score_bias, step.plain = fold_steps(plan, step.v, scales, shifts)
        step.graded = [m for m in masks if isinstance(m, Tensor) and m.requires_grad]
        invalid = None
        if masks:
            fill_values = tuple(_fill_value(f) for f in fills)
            invalid, not_exact, options, step.graded = self._masks(
                masks, fill_values, rows.full, step.graded
            )
            step.plain |= not_exact
            step.options = {} if options is None else options
        # (the Jacobian of a graded mask below is the softmax's)
        step.plain |= bool(step.graded) and plan.normalisation.kind != "softmax"
        bits = torch.finfo(step.key.dtype).bits
        step.plain |= any(
            isinstance(s, Round) and torch.finfo(s.dtype).bits < bits for s in plan.steps
        )
        if location is not None and not (step.plain or step.graded or rows.steps_q != 1):
            step.located = True
            step.valid = None if invalid is None else ~invalid
        derived = (step.key, step.values, step.bias, step.v, step.v_eff, step.score_bias)
        step.watch = [t for t in (*raw, *derived) if isinstance(t, Tensor)]
        if values is not None and step.values is self._op_values(values):
            step.values = _OWN  # the call's own: passed again at every call, not held
        return step

    def _split_location(self, keys: list) -> tuple[list, _LocationTerm | None]:
        """(the key terms but the location term, the location term the kernels form, if any: only
        for keys [B, T, A] in that layout; else it is computed like any other term)."""
        layout = self.plan.layout
        if not self.located_plan:
            return keys, None
        location = None
        for t in keys:
            if isinstance(t, _LocationTerm):
                location = t
                break
        if location is not None and not (
            layout.rank == 3
            and layout.hidden_axis == 2
            and layout.memory_axis == 1
            and layout.batch_axes == (0,)
        ):
            keys = [t if t is not location else _Plain(t.value()) for t in keys]
            location = None
        return [t for t in keys if t is not location], location

    def _keys(self, values_of_terms: list, raw: list, rows: _Rows, located: bool, given) -> tuple:
        """(keys [B', S, H], values: ``given`` [B', S, Dv] where the op forms the context, else a
        placeholder [B', S, 1]; StepwiseMemory or None)."""
        memory = values = None
        canonical = rows.canonical
        if located:  # the fixed part of the keys, kept while the memory is
            key, values = self._fixed(values_of_terms[0], raw[0], canonical, rows.full, given)
        elif len(raw) == 1 and not self.plan.heads.vector_axes:
            # one key term: its layout and memory kept with it (a decoder's steps)
            key, values, memory = self._memory(
                values_of_terms[0], raw[0], canonical, rows.full, given, rows.steps_q == 1
            )
        else:
            key = canonical(raw[0])
            for t in raw[1:]:
                key = key + canonical(t)
            values = self._op_values(given)
        if values is None:  # the graph forms the context: a placeholder
            values = _placeholder(key)
        return key, values, memory

    def _op_values(self, given: Tensor | None) -> Tensor | None:
        """The graph's context values as the op takes them, [B', S, Dv]."""
        if given is None or not self.values_memory_first:
            return given
        return given.transpose(0, 1)

    def _located(self, query, key, values, step: _Step, location: _LocationTerm) -> tuple:
        """The location-aware steps: the location term formed inside the kernels. (context
        [B, Dv] with ``flat_context``, else [B, 1, Dv]; weights [B, T])."""
        step_query = query[:, 0] if step.bias is None else query[:, 0] + step.bias
        parts = (location.features, location.conv_weight, location.dense_weight)
        context, weights = attend_location(
            self,
            self.backend,
            step_query,
            key,
            parts,
            values,
            step.v_eff,
            step.valid,
            self.plan.normalisation.kind,
            step.score_bias,
        )
        return (context if self.flat_context else context.unsqueeze(1)), weights

    def _per_head(self, query, key, values, step: _Step) -> Tensor:
        """A score vector per head: the op once per head, over its rows."""
        groups = step.v_eff.shape[0]
        rows_per = query.shape[0] // groups
        parts = []
        for g in range(groups):
            part = slice(g * rows_per, (g + 1) * rows_per)
            _, w = additive_attention(
                query[part],
                key[part],
                values[part],
                step.v_eff[g],
                step.bias,
                **{name: t if t is None else t[part] for name, t in step.options.items()},
                normalize=self.plan.normalisation.kind,
                backend=self.backend,
                score_bias=step.score_bias,
            )
            parts.append(w)
        return torch.cat(parts)

    def _masks(self, masks: list, fill_values: tuple, full, graded: list) -> tuple:
        """(invalid bool [B', S], whether the op cannot give the original's result (a row with
        no valid frame, a float mask that is not 0 / very negative, a fill that is not very
        negative), ``additive_attention``'s mask keyword, the float masks [B', S] that want gradients). Found
        once per mask tensor while it stays the same (a decoder passes one for every step)."""
        plan = self.plan

        def compute():
            invalid, not_exact, graded_rows = None, False, []
            fills = iter(fill_values)
            for step, mask in zip(
                [step for step in plan.steps if isinstance(step, Mask)],
                masks,
                strict=True,
            ):
                rows = _mask_to_rows(mask, step.origin, plan.layout, full)
                if step.kind == "product":  # (a 0/1 mask; a row with none kept: zeros, the op's)
                    if rows.dtype != torch.bool:  # (one that wants gradients: the plain path's)
                        not_exact |= rows.requires_grad
                        not_exact |= not bool(((rows == 0) | (rows == 1)).all())
                    rows = rows == 0
                elif step.kind == "add":
                    pure = (rows == 0) | (rows <= MASK_FILL_MAX)
                    not_exact |= not bool(pure.all())
                    if rows.requires_grad:
                        graded_rows.append(rows)
                    rows = rows != 0
                else:
                    rows = rows.to(torch.bool)
                    rows = rows if step.kind == "fill" else ~rows
                    not_exact |= not next(fills) <= MASK_FILL_MAX
                invalid = rows if invalid is None else invalid | rows
            if any(step.kind != "product" for step in plan.steps if isinstance(step, Mask)):
                not_exact |= bool(invalid.all(dim=1).any())  # a row without a valid frame
            return invalid, not_exact, (None if not_exact else masking(~invalid)), graded_rows

        if graded or len(masks) != 1 or not isinstance(masks[0], Tensor):
            return compute()
        mask, params = masks[0], (tuple(full), *fill_values)
        return self.mask_cache.get(mask, params, compute, watch=lambda e: ())

    def _last_mask(self, masks: list) -> list:
        """``masks``, where a single mask equal to the last one this thread passed (shape, dtype,
        device and elements) is that last one: a mask the graph makes at each call
        (``self.mask == 0``) is a new tensor every step, and the caches go by identity."""
        if len(masks) != 1 or not isinstance(masks[0], Tensor):
            return masks
        mask, thread = masks[0], threading.get_ident()
        last, alias = self.last_mask.get(thread, (None, None))
        if last is mask:  # (the same tensor as the last call's: nothing to find)
            return masks
        if mask.requires_grad or cache_bypassed():
            # (a mask that wants gradients has its own graph: another tensor's would lose it)
            return masks
        if last is not None:
            # (a mask found equal is remembered with both versions: the next step passes the
            # same tensor again, which then needs no comparison)
            versions = _versions(mask, last)
            if (alias is not None and alias[0] is mask and alias[1] == versions) or (
                _same_content(last, mask)
            ):
                self.last_mask[thread] = (last, None if versions is None else (mask, versions))
                return [last]
        if len(self.last_mask) >= MAX_THREADS and thread not in self.last_mask:
            self.last_mask.clear()
        self.last_mask[thread] = (mask, None)
        return masks

    def _fixed(self, term: Tensor, raw: Tensor, canonical, full, given):
        """(the keys' fixed part [B, T, A], the values ``given`` or a placeholder [B, T, 1]) for
        location-aware steps: the same objects while the term and values are (the step's
        location memory follows them)."""

        def compute():
            key = canonical(raw).contiguous()
            return key, (_placeholder(key) if given is None else self._op_values(given))

        return self.fixed_cache.get(term, (tuple(full), given), compute)

    def _memory(self, term: Tensor, raw: Tensor, canonical, full, given, one_query: bool):
        """(keys [B', S, H], values (``given`` or a placeholder), StepwiseMemory or None) for one
        key term, kept while the term and values are the same tensors (the steps of a decoder
        over one memory). A StepwiseMemory (the steps' gradients gathered once) for calls of one
        query each only: a call of all the target steps at once is the only one over its memory,
        and the op's own backward is faster there (bench/RESULTS.md)."""

        def compute():
            key = canonical(raw).contiguous()
            values = _placeholder(key) if given is None else self._op_values(given).contiguous()
            memory = StepwiseMemory.for_training(key, values, self.backend) if one_query else None
            if memory is None:
                # (the call's own values are passed again at every call: not held)
                return key, (_OWN if values is given else values), None, key
            return memory.keys, memory.values, memory, key

        held = Weak(given) if given is not None else None
        entry = self.layout_cache.get(
            term, (tuple(full), held, one_query), compute, watch=lambda e: e[3:]
        )
        key, values, memory = entry[:3]
        return key, (given if values is _OWN else values), memory

    def _plain(self, query, key, step: _Step, scales, masks, fills, shifts=()):
        """The original's math in the op's layout, step by step (a row without a valid frame, a
        float mask that is not a mask, a scale that is not positive)."""
        plan, full = self.plan, step.rows.full
        scores = _plain_scores(query, key, step.bias, step.v)  # [B', T', S]
        scale_index, mask_index, fill_index, shift_index = 0, 0, 0, 0
        products = []  # (AllenNLP's masked softmax: the mask again after the normalisation)
        for op in plan.steps:
            if isinstance(op, Round):
                scores = scores.to(op.dtype).to(scores.dtype)
            elif isinstance(op, Scale):
                factor = scales[scale_index]
                scale_index += 1
                scores = scores * factor if op.op == "mul" else scores / factor
            elif isinstance(op, Shift):
                shift = shifts[shift_index]
                shift_index += 1
                shift = shift.reshape(()) if isinstance(shift, Tensor) else shift
                scores = scores + shift if op.sign == "+" else scores - shift
            else:
                mask = _mask_to_rows(masks[mask_index], op.origin, plan.layout, full).unsqueeze(1)
                mask_index += 1
                if op.kind == "product":
                    mask = mask.to(scores.dtype)
                    scores = scores * mask
                    products.append(mask)
                elif op.kind == "add":
                    scores = scores + mask
                else:
                    mask = mask.to(torch.bool)
                    mask = mask if op.kind == "fill" else ~mask
                    scores = scores.masked_fill(mask, _fill_value(fills[fill_index]))
                    fill_index += 1
        if plan.normalisation.kind == "sigmoid":
            weights = torch.sigmoid(scores) / torch.sigmoid(scores).sum(-1, keepdim=True)
        else:
            weights = torch.softmax(scores, dim=-1)
        for mask in products:
            weights = weights * mask
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-13)
        return weights


def rewrite(graph: fx.Graph, plan: Plan, backend: str) -> None:
    """Replace ``plan``'s sum ... normaliser by one :class:`TracedWeights` call (the shape ops
    between the scores and the normaliser applied again to its weights). Its arguments: the query
    terms, the key terms (see key_terms.py), the bias terms, the score vector, then the steps'
    values in step order: each Scale's factor, each Mask's mask, each "fill"/"keep" Mask's fill,
    each Shift's amount."""
    scales = [step.factor for step in plan.steps if isinstance(step, Scale)]
    shifts = [step.amount for step in plan.steps if isinstance(step, Shift)]
    masks = [step.mask for step in plan.steps if isinstance(step, Mask)]
    fills = [
        step.fill for step in plan.steps if isinstance(step, Mask) and step.kind in ("fill", "keep")
    ]
    site = plan.site
    key_terms = _key_terms(graph, plan, site.output)
    with graph.inserting_before(site.output):
        replacement = TracedWeights(plan, backend)
        replacement.description = plan.describe()
        arguments = (plan.terms.queries, key_terms, plan.terms.biases, plan.vector)
        call = graph.call_function(replacement, (*arguments, scales, masks, fills, shifts))
        node, sizes = _shape_ops_again(graph, site, call)
    site.output.replace_all_uses_with(node)
    graph.erase_node(site.output)
    _erase_the_original(graph, plan, sizes)
    _form_the_context(graph, plan, call, node)


def _shape_ops_again(graph: fx.Graph, site: Site, node: fx.Node) -> tuple[fx.Node, dict]:
    """(the weights through the site's shape ops again, {the chain's .size() / .dim(): the same
    asked of the weights at the same point})."""
    sizes = {}

    def ask_sizes(applied: int, of: fx.Node) -> None:
        for helper, at in site.sizes:
            if at == applied:
                sizes[helper] = graph.call_method(helper.target, (of, *helper.args[1:]))
                sizes[helper].meta.update(helper.meta)

    ask_sizes(0, node)
    for k, op in enumerate(site.shape_ops):
        node = graph.node_copy(
            op, lambda n, prev=node, src=op: prev if n is src.args[0] else sizes.get(n, n)
        )
        ask_sizes(k + 1, node)
    return node, sizes


def _erase_the_original(graph: fx.Graph, plan: Plan, sizes: dict) -> None:
    """The normaliser's other nodes, the helpers and the original shape ops, once the weights
    replace the normaliser's output."""
    for op in plan.normalisation.nodes:  # the sigmoid normalisation's sum, then its sigmoids
        graph.erase_node(op)
    for helper in plan.site.helpers:
        if _is(helper, _NEW_FULL):  # new_full(scores, ...): dtype and device from the vector
            helper.replace_input_with(helper.args[0], plan.vector)
        elif _is(helper, {"type_as"}):  # x.type_as(scores) (dead if x is the scores' chain)
            helper.replace_input_with(helper.args[1], plan.vector)
        elif helper not in sizes:  # an in-place fill of the scores or of their .data: in the
            graph.erase_node(helper)  # op's mask now
    # the original shape ops (dead now, but a graph whose scores are written in place may keep
    # them), then the sizes asked of them
    for op in reversed(plan.site.shape_ops):
        if not op.users:
            graph.erase_node(op)
    for helper, size in sizes.items():  # its other users come after the weights too
        helper.replace_all_uses_with(size)
        graph.erase_node(helper)


# --- the context ----------------------------------------------------------------------------------

# view-like ops that keep the elements' row-major order (what _row_major needs of the chain)
_ORDER_KEEPING = {
    "squeeze",
    "unsqueeze",
    "view",
    "reshape",
    "contiguous",
    torch.squeeze,
    torch.unsqueeze,
    torch.reshape,
}
_BMM = {torch.bmm, "bmm", *_MATMUL}


def _row_major(plan: Plan) -> bool:
    """Whether the weights the graph receives hold the op's [B', T', S] weights in row-major
    order (its rows' axes in order, the projection's axes in order, then only reshapes): then a
    [B', T', S] (or [B', S, 1] for T' = 1) view of them is the op's weights, element for element."""
    layout = plan.layout
    if plan.heads.vector_axes:
        return False
    if layout.batch_axes + layout.query_axes + (layout.memory_axis,) != tuple(
        range(layout.rank - 1)
    ):
        return False
    origin = [a for a in layout.scores_origin if a is not None]
    if not all(isinstance(a, int) for a in origin) or origin != sorted(origin):
        return False
    return all(_is(op, _ORDER_KEEPING) for op in plan.site.shape_ops)


def _memory_first(plan: Plan) -> bool:
    """Whether the weights the graph receives are [S, B] in row-major order (a time-major
    graph's: pre-activation [S, B, H], one query per row, the projection's axes in order, then
    only reshapes): then their context is ``(values * X).sum(0)`` with X [S, B, 1]."""
    layout = plan.layout
    if plan.heads.vector_axes or layout.query_axes or layout.rank != 3:
        return False
    if (layout.memory_axis, layout.batch_axes, layout.hidden_axis) != (0, (1,), 2):
        return False
    if [a for a in layout.scores_origin if a is not None] != [0, 1]:
        return False
    return all(_is(op, _ORDER_KEEPING) for op in plan.site.shape_ops)


def _order_keeping_view(node: fx.Node, of: fx.Node) -> bool:
    """``node`` is a view of ``of`` in the same row-major order (an unsqueeze, a view or reshape,
    an index of full slices, ``None`` and ``...``, a dropout that does nothing)."""
    if not isinstance(node, fx.Node) or not node.args or node.args[0] is not of:
        return False
    if _is(node, _ORDER_KEEPING) or _inert_dropout(node):
        return True
    if _is(node, {operator.getitem}) and isinstance(node.args[1], tuple):
        return all(i is None or i is Ellipsis or i == slice(None, None, None) for i in node.args[1])
    return False


def _context_site(weights: fx.Node, memory_first: bool) -> tuple | None:
    """(form, the weights' view X, the values node, the context node) of the context the graph
    forms from the weights: ``bmm(X, values)`` / ``X @ values`` ("bmm", X [B', T', S]) or
    ``(X * values).sum(1)`` ("sum", X [B', S, 1]); where the graph's memory axis comes first,
    ``(X * values).sum(0)`` ("sum0", X [S, B', 1]). X is the weights or one order-keeping view
    of them (the shapes are checked at run time by :func:`traced_context`); None if none."""
    views = [weights] + [u for u in weights.users if _order_keeping_view(u, weights)]
    axes = (0,) if memory_first else (1, -2)
    for view in views:
        for user in view.users:
            if _is(user, _BMM) and len(user.args) == 2 and not user.kwargs and not memory_first:
                if user.args[0] is view and isinstance(user.args[1], fx.Node):
                    return "bmm", view, user.args[1], user
            if _is(user, _MUL) and len(user.args) == 2 and not user.kwargs:
                other = user.args[1] if user.args[0] is view else user.args[0]
                if view not in user.args or not isinstance(other, fx.Node) or other is view:
                    continue
                total = next(iter(user.users)) if len(user.users) == 1 else None
                if total is not None and _is(total, _SUM) and _sums_along(total, user, axes):
                    return ("sum0" if memory_first else "sum"), view, other, total
    return None


def _sums_along(total: fx.Node, product: fx.Node, axes: tuple) -> bool:
    """``total`` is ``product.sum(d)`` for d in ``axes`` (of a rank-3 product), nothing else."""
    if total.args[:1] != (product,) or len(total.args) > 2:
        return False
    if set(total.kwargs) - {"dim", "keepdim"} or total.kwargs.get("keepdim", False):
        return False
    return _sum_dim(total) in axes


def _product_name(product: fx.Node) -> str:
    """The method that computes the graph's product (a callable cannot be a graph argument)."""
    return "bmm" if _is(product, {torch.bmm, "bmm"}) else "matmul"


def _sum_dim(total: fx.Node):
    dim = total.args[1] if len(total.args) == 2 else total.kwargs.get("dim")
    return dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim


def _form_the_context(graph: fx.Graph, plan: Plan, call: fx.Node, weights: fx.Node) -> None:
    """Where the graph forms the context from the weights in a form the op computes (see
    :func:`_context_site`), the op forms it in the same call: the call takes the values and
    returns (weights, context or None), and the context node becomes a :func:`traced_context`
    (the op's context where the shapes are the op's, else the graph's own product)."""
    memory_first = not _row_major(plan)
    if memory_first and not _memory_first(plan):
        return
    found = _context_site(weights, memory_first)
    if found is None:
        return
    form, view, values, context = found
    order = {node: i for i, node in enumerate(graph.nodes)}
    if values.op != "placeholder" and order[values] > order[call]:
        return  # the values come later in the graph than the weights' call
    call.target.with_context = True
    call.target.values_memory_first = memory_first
    call.kwargs = {**call.kwargs, "values": values}
    with graph.inserting_after(call):
        ours = graph.call_function(operator.getitem, (call, 1))
    with graph.inserting_after(call):
        weights_only = graph.call_function(operator.getitem, (call, 0))
    call.replace_all_uses_with(
        weights_only, delete_user_cb=lambda user: user not in (weights_only, ours)
    )
    view = weights_only if view is call else view  # no shape ops: the call was the weights
    with graph.inserting_before(context):
        how = _product_name(context) if form == "bmm" else _sum_dim(context)
        formed = graph.call_function(traced_context, (form, ours, view, values, how))
    formed.meta.update(context.meta)
    context.replace_all_uses_with(formed)
    graph.erase_node(context)


def traced_context(form: str, ours, view: Tensor, values: Tensor, how) -> Tensor:
    """The context in the graph's layout: the op's (``ours``, [B', T', Dv]) where the graph's
    weights view and values are the op's shapes (``bmm``: X [B', T', S]; ``sum``: X [B', S, 1],
    T' = 1; ``sum0``: X [S, B', 1], values [S, B', Dv], T' = 1), else the graph's own product
    (``how``: the product's target as the graph had it, or the sum's axis)."""
    if ours is not None and values.dim() == 3:
        batch, steps = ours.shape[0], ours.shape[1]
        rows, frames = values.shape[:2] if form != "sum0" else reversed(values.shape[:2])
        if rows == batch and form == "bmm" and view.shape == (batch, steps, frames):
            return ours
        if rows == batch and steps == 1 and form != "bmm":
            if view.shape == ((batch, frames, 1) if form == "sum" else (frames, batch, 1)):
                return ours[:, 0]
    if form == "bmm":
        return getattr(view, how)(values)
    return (view * values).sum(how)
