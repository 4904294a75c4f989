"""Additive attention found in a traced graph by what it computes, and replaced by the fused op.

A torch.fx graph (TorchDynamo's, torch-level: ``linear``, ``tanh``, ``add``, ``softmax`` and tensor
methods, with example values carrying shapes) is searched for::

    X = t_1 + t_2 + ... (+ linear(cat([a, b]), W, c), split into a W_a + b W_b + c)
        (repeats and expands of a term that only broadcast it are seen through)
    e = project(tanh(X)) onto a vector v: linear(., w[1, H]), matmul(., v), (. * v).sum(-1),
        einsum("...h,h->..."), bmm(v repeated over the batch, tanh^T), or bmm(v, tanh) with the
        hidden axis in the middle ([B, H, T]: a Conv1d over the memory)
    e -> shape-only ops (squeeze, unsqueeze, transpose, permute, view, reshape, contiguous), dtype
         round trips, scale (e * c, e / c), shifts (e + c, e - c: a number or a one-element
         tensor, and the projection's own bias), masks (masked_fill / masked_fill_ /
         .data.masked_fill_ with a very negative value, where(mask, e, very negative), + a float
         mask), in any order (a shift under the sigmoid: before any mask)
    w = softmax(e, dim=memory axis), or sigmoid(e) / sigmoid(e).sum(dim, keepdim=True)

The terms are sorted by their shapes: those that vary along the softmax's axis are the keys, those
that do not (but vary along some axis) the query, those that vary along none the bias inside the
tanh. Axes along which the keys vary are batch axes, the others query axes. A term varying along
a query axis and the memory axis, or a mask varying along a query axis, is not the op's form:
no match. Only the subgraph from the sum to the softmax is replaced (by :class:`TracedWeights`,
whose weights go back through the same shape ops); the rest of the graph (the context, residuals,
output layers) is kept as it is. The names of modules and parameters play no part.

At run time a key term that is a pure function of the graph's inputs (a projection of the
memory, its layout) is computed once while those inputs stay the same objects (a decoder's steps;
:class:`~seq2seq_fast.nn.keycache.ProjectionCache`), its gradient gathered once per sequence
(:class:`~seq2seq_fast.nn.stepwise.StepwiseMemory`); a bias-free conv + dense location term goes
to the location-aware steps (keys formed inside the kernel, ``_location.py``). Where the op cannot
give the original's result (a row with no valid frame, a float mask that is not a mask, a scale
that is not positive) the replacement computes the original's math in plain ops.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from seq2seq_fast.nn.convert._location import attend_location
from seq2seq_fast.nn.keycache import ProjectionCache
from seq2seq_fast.nn.stepwise import StepwiseMemory
from seq2seq_fast.ops._checks import masking
from seq2seq_fast.ops._torch_private import nn_linear
from seq2seq_fast.ops.additive_attention import additive_attention

# a masked_fill value at or below this takes the position out of the softmax exactly (exp underflows
# to zero in float32 and float64 below about -104 and -745)
MASK_FILL_MAX = -1e4
# the miss of scores cast down and back: exact in the lower dtype only (see _traced._probe)
ROUNDED_SCORES = "the scores are rounded to a lower precision and cast back"

_ADDS = {operator.add, operator.iadd, torch.add, "add", "add_", "__add__", "__radd__"}
_SUBS = {operator.sub, torch.sub, "sub", "__sub__"}
_TANH = {torch.tanh, F.tanh, "tanh"}
_SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax, "softmax"}
_LINEAR = {nn_linear(), F.linear}
_MATMUL = {torch.matmul, operator.matmul, "matmul", "__matmul__"}
_MUL = {operator.mul, torch.mul, "mul", "__mul__", "__rmul__"}
_DIV = {operator.truediv, torch.div, torch.true_divide, "div", "__truediv__"}
_SUM = {torch.sum, "sum"}
_SIGMOID = {torch.sigmoid, F.sigmoid, torch.special.expit, "sigmoid"}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_SHAPE_OPS = {
    "squeeze",
    "unsqueeze",
    "transpose",
    "permute",
    "view",
    "reshape",
    "contiguous",
    torch.squeeze,
    torch.unsqueeze,
    torch.transpose,
    torch.permute,
    torch.reshape,
}
_MASKED_FILL = {"masked_fill", torch.masked_fill}
_REPEATS = {"repeat", "expand", "expand_as"}
_WHERE = {torch.where}
_NEW_FULL = {"new_full"}
_CASTS = {"float", "double", "half", "bfloat16", "to", "type_as"}
_SIZES = {"size", "dim"}


class NoMatch(Exception):
    """The graph around a tanh is not the op's form; the message says where it differs."""


def _is(node: object, targets: set) -> bool:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    try:
        return node.target in targets
    except TypeError:  # an unhashable target
        return False


def _value(node: object):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def _static(size):
    """A size as an int where it is known (TorchDynamo's sizes are SymInts, some of them fixed)."""
    if isinstance(size, torch.SymInt):
        known = size.node.maybe_as_int()
        return size if known is None else known
    return size


def _shape(node: object) -> tuple | None:
    value = _value(node)
    return tuple(map(_static, value.shape)) if isinstance(value, Tensor) else None


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _same(a, b) -> bool:
    return str(a) == str(b)


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _single_user(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise NoMatch(f"{what} is used {len(users)} times (the fused op gives only the weights)")
    return users[0]


# --- the sum inside the tanh ----------------------------------------------------------------------


def _terms(node: fx.Node) -> list[fx.Node]:
    """Leaves of the add tree at ``node`` (an add used elsewhere is a leaf)."""
    if _is(node, _ADDS) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):
            parts = []
            for part in (a, b):
                parts += _terms(part) if len(part.users) == 1 else [part]
            return parts
    return [node]


def _peel_repeat(node: fx.Node, kept_from_end: int = 0) -> fx.Node:
    """The tensor a repeat/expand along other axes than one was made from, where broadcasting it
    gives the same (a linear map commutes with it; a sum broadcasts it). The kept axis is
    ``kept_from_end`` axes before the last (the hidden axis: the last one, or the middle one of a
    [B, H, T] layout)."""
    while _is(node, _REPEATS) and isinstance(node.args[0], fx.Node):
        source, out = _shape(node.args[0]), _shape(node)
        if source is None or out is None or not source or len(source) > len(out):
            break
        padded = (1,) * (len(out) - len(source)) + source
        kept = len(out) - 1 - kept_from_end
        if kept < 0 or not _same(padded[kept], out[kept]):
            break
        if not all(_is_one(a) or _same(a, b) for a, b in zip(padded, out, strict=True)):
            break
        node = node.args[0]
    return node


def _size_hint(size) -> int | None:
    """A size as an int: itself, or the value TorchDynamo traced a symbolic size at."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None and node.has_hint() else None
    return int(hint) if hint is not None else None


def _split_linear_bias(graph: fx.Graph, node: fx.Node) -> list[fx.Node] | None:
    """linear(x, W, c) -> [linear(x, W), c] as a new node and c; linear(x, W) -> [itself]."""
    if not _is(node, _LINEAR) or node.kwargs:
        return None
    source, weight, bias = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    if bias is None:
        return [node]
    with graph.inserting_before(node):
        term = graph.call_function(nn_linear(), (source, weight))
        term.meta["example_value"] = F.linear(_value(source), _value(weight))
    return [term, bias]


def _split_concat_linear(graph: fx.Graph, node: fx.Node) -> list[fx.Node] | None:
    """linear(cat([a, b, ...], -1), W, c) -> [linear(a', W_a), linear(b', W_b), ..., c] as new
    nodes (a' the tensor a repeat/expand was made from), or None. A width TorchDynamo traced as a
    symbol (sizes above 1 of a dynamic trace) is read at run time: W's columns are cut where the
    call's own parts end, never at the traced example's widths."""
    if not _is(node, _LINEAR):
        return None
    source, weight = _arg(node, 0, "input"), _arg(node, 1, "weight")
    bias = _arg(node, 2, "bias")
    if not _is(source, _CAT) or len(source.users) != 1:
        return None
    parts, dim = _arg(source, 0, "tensors"), _arg(source, 1, "dim", 0)
    shape = _shape(source)
    if shape is None or not isinstance(parts, (list, tuple)) or dim not in (-1, len(shape) - 1):
        return None
    widths = [(_shape(part) or (None,))[-1] for part in parts]
    hints = [_size_hint(width) for width in widths if width is not None]
    if len(hints) != len(parts) or any(h is None or h <= 0 for h in hints):
        return None
    terms, start, hint_start = [], 0, 0
    with graph.inserting_before(node):
        for part, width, hint in zip(parts, widths, hints, strict=True):
            if not isinstance(width, int):  # the part's width at run time
                width = graph.call_method("size", (part, -1))
                width.meta["example_value"] = hint
            end = start + hint if isinstance(start, int) and isinstance(width, int) else None
            if end is None:
                end = graph.call_function(operator.add, (start, width))
                end.meta["example_value"] = hint_start + hint
            columns = graph.call_function(
                operator.getitem, (weight, (slice(None), slice(start, end)))
            )
            columns.meta["example_value"] = _value(weight)[:, hint_start : hint_start + hint]
            peeled = _peel_repeat(part)
            term = graph.call_function(nn_linear(), (peeled, columns))
            term.meta["example_value"] = F.linear(_value(peeled), _value(columns))
            terms.append(term)
            start, hint_start = end, hint_start + hint
    if bias is not None:
        terms.append(bias)
    return terms


# --- from the tanh to the softmax -----------------------------------------------------------------


def _vector_source(node: object, width) -> fx.Node | None:
    """The [H] (or [1, ..., 1, H]) tensor that ``node`` repeats or reshapes over leading axes."""
    while isinstance(node, fx.Node):
        shape = _shape(node)
        if shape is not None and _same(shape[-1], width) and all(map(_is_one, shape[:-1])):
            return node
        if not (_is(node, _REPEATS) or _is(node, {"unsqueeze", "view", "reshape"})):
            return None
        node = node.args[0]
    return None


def _einsum_projection(user: fx.Node, tanh: fx.Node, width):
    equation = user.args[0] if user.args and isinstance(user.args[0], str) else None
    operands = list(user.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if equation is None or len(operands) != 2 or tanh not in operands or "..." in equation:
        return None
    inputs, _, output = equation.replace(" ", "").partition("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2:
        return None
    mine = subscripts[operands.index(tanh)]
    other = subscripts[1 - operands.index(tanh)]
    vector = operands[1 - operands.index(tanh)]
    if other != mine[-1] or output != mine[:-1] or _shape(vector) is None:
        return None
    if not _same(_shape(vector), (width,)):
        return None
    return vector


def _projection(tanh: fx.Node, shape: tuple, rank: int):
    """(scores node, vector node, origin of the scores' axes, hidden axis) of tanh's projection
    onto a vector: origin[i] is the axis of the pre-activation without its hidden axis that the
    scores' axis i is, None for an added 1."""
    leading = tuple(range(rank - 1))
    width = shape[-1]
    user = _single_user(tanh, "the tanh")
    if _is(user, {torch.bmm, *_MATMUL}) and len(user.args) == 2 and user.args[1] is tanh:
        # bmm(v repeated over the batch [B, 1, H], tanh [B, H, S]) -> [B, 1, S] (a pointer
        # network's Conv1d over [B, H, S] memory)
        vector = _vector_source(user.args[0], shape[1]) if rank == 3 else None
        weights = _shape(user.args[0])
        if vector is None or weights is None or len(weights) != 3 or not _is_one(weights[1]):
            raise NoMatch("the tanh is multiplied from the left by something not a vector")
        return user, vector, (0, None, 1), 1
    if _is(user, _LINEAR) and _arg(user, 0, "input") is tanh:
        weight = _arg(user, 1, "weight")
        shape = _shape(weight)
        if shape is None or len(shape) != 2 or not _is_one(shape[0]) or not _same(shape[1], width):
            raise NoMatch(f"the tanh goes into a linear map of weight {shape}, not onto a vector")
        return user, weight, leading + (None,), rank - 1
    if _is(user, _MATMUL) and user.args[0] is tanh:
        vector = user.args[1]
        shape = _shape(vector)
        if shape is not None and _same(shape, (width,)):
            return user, vector, leading, rank - 1
        if shape is not None and len(shape) == 2 and _same(shape[0], width) and _is_one(shape[1]):
            return user, vector, leading + (None,), rank - 1
        raise NoMatch(f"the tanh is multiplied by a matrix of shape {shape}, not a vector")
    if _is(user, {torch.einsum}):
        vector = _einsum_projection(user, tanh, width)
        if vector is None:
            raise NoMatch(f"the tanh goes into einsum {user.args[0]!r}, not onto a vector")
        return user, vector, leading, rank - 1
    if _is(user, {"permute", "transpose"}) and rank == 3:
        # bmm(v repeated over the batch [B, 1, H], tanh^T [B, H, S]) -> [B, 1, S]
        dims = [d % 3 for d in user.args[1:]] if user.target == "transpose" else None
        if user.target == "permute":
            dims = list(user.args[1:])
            dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        swapped = dims in ([1, 2], [2, 1]) if user.target == "transpose" else dims == [0, 2, 1]
        product = _single_user(user, "the transposed tanh")
        if swapped and _is(product, {torch.bmm, *_MATMUL}) and product.args[1] is user:
            vector = _vector_source(product.args[0], width)
            shape = _shape(product.args[0])
            if vector is not None and shape is not None and len(shape) == 3:
                if _is_one(shape[1]) and _same(shape[2], width):
                    return product, vector, (0, None, 1), rank - 1
        raise NoMatch("the transposed tanh is not multiplied by a vector repeated over the batch")
    if _is(user, _MUL) and len(user.args) == 2 and tanh in user.args:
        vector = user.args[1] if user.args[0] is tanh else user.args[0]
        shape = _shape(vector)
        if shape is None or not _same(shape[-1], width) or len(shape) > rank:
            raise NoMatch(f"the tanh is multiplied by a tensor of shape {shape}, not a vector")
        if not all(map(_is_one, shape[:-1])) and not isinstance(vector, fx.Node):
            raise NoMatch(f"the tanh is multiplied by a tensor of shape {shape}, not a vector")
        # (a vector per head, [heads, H]: its axes must be batch axes, checked by the caller)
        total = _single_user(user, "the product with the vector")
        dim = _arg(total, 1, "dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if not _is(total, _SUM) or dim not in (-1, rank - 1):
            raise NoMatch("the product with the vector is not summed over the last axis")
        if _arg(total, 3, "dtype") is not None:
            raise NoMatch("the sum over the hidden axis changes the dtype")
        keepdim = bool(_arg(total, 2, "keepdim", False))
        return total, vector, leading + ((None,) if keepdim else ()), rank - 1
    raise NoMatch(f"the tanh goes into {user.target!r}, not a projection onto a vector")


def _permuted(origin: tuple, dims: list[int]) -> tuple:
    return tuple(origin[d] for d in dims)


def _shape_op_origin(node: fx.Node, origin: tuple) -> tuple:
    """Which axis of the pre-activation's leading axes each axis of ``node``'s output is (None: an
    inserted 1), given the same for its input."""
    before, after = _shape(node.args[0]), _shape(node)
    rank = len(before)
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name in ("transpose",):
        a, b = (d % rank for d in node.args[1:3])
        dims = list(range(rank))
        dims[a], dims[b] = dims[b], dims[a]
        return _permuted(origin, dims)
    if name == "permute":
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = node.kwargs.get("dims", dims)
        return _permuted(origin, [d % rank for d in dims])
    if name == "contiguous":
        return origin
    # squeeze, unsqueeze, view, reshape: they may remove or insert 1-axes, and merge neighbouring
    # axes into one (a tuple of their origins: [B, Tq, S] -> [B * Tq, S] before a softmax)
    kept = [(s, o) for s, o in zip(before, origin, strict=True) if not _is_one(s)]
    new, k = [], 0
    for size in after:
        if _is_one(size):
            new.append(None)
            continue
        group, product = [], None
        while k < len(kept) and (product is None or not _same(product, size)):
            product = kept[k][0] if product is None else product * kept[k][0]
            group += list(kept[k][1]) if isinstance(kept[k][1], tuple) else [kept[k][1]]
            k += 1
        if product is None or not _same(product, size):
            raise NoMatch(f"{name} {list(before)} -> {list(after)} mixes axes")
        new.append(group[0] if len(group) == 1 else tuple(group))
    if k != len(kept):
        raise NoMatch(f"{name} {list(before)} -> {list(after)} mixes axes")
    return tuple(new)


def _hint(value):
    """A number as the trace saw it (TorchDynamo passes a module's float attribute as a node)."""
    if isinstance(value, fx.Node):
        value = _value(value)
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value.node.hint
    if isinstance(value, Tensor) and value.numel() == 1 and not value.requires_grad:
        try:
            return value.item()
        except Exception:  # noqa: BLE001 - a fake tensor
            return None
    return value


def _is_mask_setitem(user: fx.Node, node: fx.Node) -> bool:
    """``scores[mask] = value`` with a bool mask of the scores' shape: an in-place masked_fill_
    (d2l's ``masked_softmax`` writes ``X[~mask] = -1e6``)."""
    if not (user.op == "call_function" and user.target is operator.setitem):
        return False
    if len(user.args) != 3 or user.args[0] is not node or not isinstance(user.args[1], fx.Node):
        return False
    index, scores = _value(user.args[1]), _value(node)
    # (a bool index of the scores' rank must have their shape, or the write would fail)
    return (
        isinstance(index, Tensor)
        and isinstance(scores, Tensor)
        and index.dtype == torch.bool
        and index.dim() == scores.dim()
    )


def _ancestors(node: fx.Node):
    """``node`` and every node it depends on, each once (depth first)."""
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        todo.extend(current.all_input_nodes)


def _from_call_inputs(node: fx.Node) -> bool:
    """Whether ``node`` depends on a graph input that is not a parameter or buffer (TorchDynamo
    names each input by its source: ``L['self']._modules['q']._parameters['weight']``)."""
    for current in _ancestors(node):
        if current.op != "placeholder" or not isinstance(_value(current), Tensor):
            continue
        source = getattr(current.meta.get("grapharg"), "source", None)
        name = source.name if source is not None else ""
        if not ("._parameters[" in name or "._buffers[" in name):
            return True
    return False


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


@dataclass
class Match:
    """One additive attention found in a graph (see the module docstring)."""

    tanh: fx.Node
    softmax: fx.Node
    query_terms: list[fx.Node]
    key_terms: list[fx.Node]
    bias_terms: list[fx.Node]
    vector: fx.Node
    rank: int  # of the pre-activation, hidden axis included
    batch_axes: tuple[int, ...]
    query_axes: tuple[int, ...]
    memory_axis: int
    scores_origin: tuple  # the pre-activation's axis each axis of the projection's output is
    hidden_axis: int
    # ("scale", op, node|number), ("shift", sign, node|number), ("fill", ...), ("keep", ...),
    # ("add", ...) in the chain's order
    steps: list[tuple] = field(default_factory=list)
    shape_ops: list[fx.Node] = field(default_factory=list)
    split_nodes: list[fx.Node] = field(default_factory=list)
    helpers: list[fx.Node] = field(default_factory=list)  # new_full(scores, ...): dtype only
    sizes: list[tuple[fx.Node, int]] = field(default_factory=list)  # (size, after k shape ops)
    normalize: str = "softmax"  # or "sigmoid": `softmax` is then the division
    normalize_nodes: list[fx.Node] = field(default_factory=list)  # the sum, then the sigmoids
    # batch axes along which the score vector varies (one vector per head), first in batch_axes
    vector_axes: tuple[int, ...] = ()

    def describe(self) -> str:
        kinds = [s[0] + (f"({s[1]})" if s[0] in ("scale", "shift") else "") for s in self.steps]
        return (
            f"{len(self.query_terms)} query and {len(self.key_terms)} key term(s)"
            + (", a bias" if self.bias_terms else "")
            + (f", then {', '.join(kinds)}" if kinds else "")
            + (", sigmoid-normalised" if self.normalize == "sigmoid" else "")
            + (", a score vector per head" if self.vector_axes else "")
        )


def _sigmoid_normalisation(node: fx.Node, users: list[fx.Node]):
    """(division, dim, [sum, sigmoids]) where ``users`` of the scores ``node`` are one or two
    sigmoid(node) whose only uses are sigmoid(node) / sigmoid(node).sum(dim, keepdim=True) (the
    "smoothing" normalisation); None otherwise."""
    if not users or len(users) > 2:
        return None
    if not all(_is(u, _SIGMOID) and u.args and u.args[0] is node for u in users):
        return None
    if any(len(u.args) > 1 or u.kwargs for u in users):
        return None
    uses = {use for u in users for use in u.users}
    sums = [n for n in uses if _is(n, _SUM)]
    if len(sums) != 1 or len(sums[0].users) != 1:
        return None
    total = sums[0]
    division = next(iter(total.users))
    if not (_is(division, _DIV) and len(division.args) == 2 and not division.kwargs):
        return None
    if division.args[1] is not total or division.args[0] not in users:
        return None
    if total.args[0] not in users or uses != {total, division}:
        return None
    if any(set(u.users) - {total, division} for u in users):
        return None
    dim = _arg(total, 1, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or _arg(total, 2, "keepdim") is not True:
        return None
    if _arg(total, 3, "dtype") is not None or len(total.args) > 3:
        return None
    return division, dim, [total, *users]


def _match_at(graph: fx.Graph, tanh: fx.Node) -> Match:
    inner = tanh.args[0] if tanh.args else tanh.kwargs.get("input")
    shape = _shape(tanh)
    if not isinstance(inner, fx.Node) or shape is None or len(shape) < 2:
        raise NoMatch("the tanh's input is not a tensor of rank 2 or more")
    rank = len(shape)
    scores, vector, origin, hidden = _projection(tanh, shape, rank)
    terms, split_nodes = [_peel_repeat(t, rank - 1 - hidden) for t in _terms(inner)], []
    pooled = None  # attention pooling: one Linear inside the tanh, a learned vector, no query
    width = shape[hidden]
    if len(terms) == 1:
        split = _split_concat_linear(graph, terms[0]) if hidden == rank - 1 else None
        if split is None and hidden == rank - 1:
            # attention pooling, tanh(W h + b) against a learned vector: one key term (and its
            # bias), no query; the op runs it with a zero query
            split = pooled = _split_linear_bias(graph, terms[0])
        if split is None:
            raise NoMatch("the tanh's input is not a sum of two or more terms, nor one Linear")
        split_nodes = [n for n in split if n.op == "call_function" and n.target is not None]
        terms = split
    scores_origin = origin
    steps, shape_ops = [], []
    if _is(scores, _LINEAR) and _arg(scores, 2, "bias") is not None:
        # the score layer's bias: a shift of every score (a softmax cancels it, a sigmoid not)
        steps.append(("shift", "+", _arg(scores, 2, "bias")))
    node = scores
    helpers: list[fx.Node] = []  # scores.new_full(...) for a where: the scores' dtype only
    sizes: list[tuple[fx.Node, int]] = []  # .size() of the chain, after this many shape ops
    while True:
        users = [u for u in node.users if u not in helpers or u.args[0] is node]
        fills_in_place = [
            u
            for u in users
            if (_is(u, {"masked_fill_"}) and u.args[0] is node) or _is_mask_setitem(u, node)
        ]
        for data in [u for u in users if getattr(u.target, "__name__", "") == "_get_data_attr"]:
            # scores.data.masked_fill_(...): the forward sees the fill, autograd does not, and a
            # softmax's backward gives those positions zero gradient all the same
            inner = list(data.users)
            if not inner or not all(_is(u, {"masked_fill_"}) and u.args[0] is data for u in inner):
                raise NoMatch("the scores' .data is used other than by masked_fill_")
            fills_in_place += inner
            helpers.append(data)
            users.remove(data)
        for fill in fills_in_place:
            if fill.users:
                raise NoMatch("the result of an in-place masked_fill_ of the scores is used")
            value = _arg(fill, 2, "value")
            known = _number(_hint(value))
            if known is None or not known <= MASK_FILL_MAX:
                raise NoMatch(f"masked_fill_ with {_hint(value)!r}, not a very negative value")
            mask = _peel_repeat(_arg(fill, 1, "mask"))
            steps.append(("fill", mask, value, origin, _shape(node)))
            helpers.insert(0, fill)  # erased before the .data it fills
            if fill in users:
                users.remove(fill)
        extra = [
            u
            for u in users
            if (_is(u, _NEW_FULL) and u.args[0] is node)
            or (_is(u, {"type_as"}) and len(u.args) == 2 and u.args[1] is node)
        ]  # they take only the scores' dtype (and device)
        # `shape = scores.shape` (d2l's masked_softmax, to reshape back): asked of the weights
        # after the same shape ops
        for u in users:
            if _is(u, _SIZES) and u.args[0] is node:
                extra.append(u)
                sizes.append((u, len(shape_ops)))
        helpers += extra
        normalised = _sigmoid_normalisation(node, [u for u in users if u not in extra])
        if normalised is not None:
            break
        if len(users) - len(extra) != 1:
            raise NoMatch(
                f"the scores are used {len(users)} times (the fused op gives only the weights)"
            )
        user = next(u for u in users if u not in extra)
        if _is(user, _SOFTMAX):
            break
        if _is(user, _CASTS) and user.args[0] is node:
            # a dtype round trip (checked at the softmax): the op computes in the dtype; a cast
            # down (float64 scores through .float()) rounds, which the op does not
            before, after = _value(node), _value(user)
            if (
                isinstance(before, Tensor)
                and isinstance(after, Tensor)
                and after.is_floating_point()
                and torch.finfo(after.dtype).eps > torch.finfo(before.dtype).eps
            ):
                raise NoMatch(f"{ROUNDED_SCORES} ({before.dtype} to {after.dtype})")
        elif _is(user, _SHAPE_OPS):
            if user.args[0] is not node:
                raise NoMatch("a shape op takes the scores as other than its input")
            origin = _shape_op_origin(user, origin)
            shape_ops.append(user)
        elif _is(user, _MASKED_FILL):
            if user.args[0] is not node:
                raise NoMatch("masked_fill takes the scores as its mask")
            value = _arg(user, 2, "value")
            known = _number(_hint(value))
            if known is None or not known <= MASK_FILL_MAX:
                raise NoMatch(f"masked_fill with {_hint(value)!r}, not a very negative value")
            steps.append(("fill", _peel_repeat(_arg(user, 1, "mask")), value, origin, _shape(node)))
        elif _is(user, _WHERE) and len(user.args) == 3 and user.args[1] is node:
            value = user.args[2]
            if isinstance(value, fx.Node) and _is(value, _NEW_FULL) and value.args[0] is node:
                helpers.append(value)
                value = _arg(value, 2, "fill_value")
            known = _number(_hint(value))
            if known is None or not known <= MASK_FILL_MAX:
                raise NoMatch(f"where(mask, scores, {_hint(value)!r}): not a very negative value")
            condition = user.args[0]
            steps.append(("keep", _peel_repeat(condition), value, origin, _shape(node)))
        elif (_is(user, _ADDS) or (_is(user, _SUBS) and user.args[0] is node)) and len(
            user.args
        ) == 2:
            other = user.args[1] if user.args[0] is node else user.args[0]
            sign = "-" if _is(user, _SUBS) else "+"
            if isinstance(other, fx.Node) and isinstance(_value(other), Tensor):
                other_shape, at = _shape(other), _shape(node)
                if other_shape is None or at is None:
                    raise NoMatch("something of unknown shape is added to the scores")
                if all(map(_is_one, other_shape)) and len(other_shape) <= len(at):
                    steps.append(("shift", sign, other))  # one element: every score moves
                elif sign == "-":
                    raise NoMatch("a tensor is subtracted from the scores")
                else:
                    steps.append(("add", _peel_repeat(other), None, origin, at))
            else:
                number = _number(other)
                if number is None and isinstance(_value(other), (torch.SymFloat, torch.SymInt)):
                    number = _number(_hint(other))  # a float attribute made an input
                if number is None or not math.isfinite(number):
                    raise NoMatch(f"the scores are shifted by {_hint(other)!r}, not a number")
                steps.append(("shift", sign, other))
        elif (_is(user, _DIV) or _is(user, _MUL)) and len(user.args) == 2 and not user.kwargs:
            if user.args[0] is not node and _is(user, _DIV):
                raise NoMatch("the scores divide something")
            other = user.args[1] if user.args[0] is node else user.args[0]
            number = _number(other)
            if number is None and isinstance(_value(other), (torch.SymFloat, torch.SymInt)):
                # a module's float attribute that TorchDynamo made an input (another instance
                # had another value): its value comes in at run time, checked there too
                number = _number(_hint(other))
                if number is None:
                    raise NoMatch("the scores are scaled by a number the trace cannot see")
            if number is not None and not number > 0:
                raise NoMatch(f"the scores are scaled by {number}")
            if number is None:
                if not isinstance(other, fx.Node) or _shape(other) is None:
                    raise NoMatch("the scores are scaled by something that is not a number")
                if math.prod(_value(other).shape) != 1:
                    raise NoMatch(f"the scores are scaled by a tensor of shape {_shape(other)}")
            steps.append(("scale", "div" if _is(user, _DIV) else "mul", other))
        else:
            raise NoMatch(f"the scores go into {user.target!r} before any softmax")
        node = user
    normalize, normalize_nodes = "softmax", []
    if normalised is not None:  # sigmoid(e) / sum sigmoid(e): the division stands for the softmax
        softmax, dim, normalize_nodes = normalised
        normalize = "sigmoid"
        kinds = [step[0] for step in steps]
        if "shift" in kinds and any(k in ("fill", "keep", "add") for k in kinds):
            first_mask = min(kinds.index(k) for k in ("fill", "keep", "add") if k in kinds)
            if "shift" in kinds[first_mask:]:
                # a sigmoid of (masked + b): the masked positions need not stay 0
                raise NoMatch("sigmoid-normalised scores shifted after they are masked")
    else:
        softmax = user
        if softmax.args[0] is not node:
            raise NoMatch("the softmax takes the scores as other than its input")
        dim = _arg(softmax, 1, "dim")
        if dim is None and _shape(node) is not None:
            # softmax(x) without a dim (deprecated, still common: nn.Softmax()) takes PyTorch's
            # implicit one: 0 for 0, 1 or 3 dimensions, else 1
            dim = 0 if len(_shape(node)) in (0, 1, 3) else 1
        if (
            not isinstance(dim, int)
            or _arg(softmax, 3 if softmax.op == "call_function" else 2, "dtype") is not None
        ):
            raise NoMatch("softmax without an int dim, or with a dtype")
    if _value(node).dtype != _value(scores).dtype:
        raise NoMatch("the scores reach the softmax in another dtype")
    memory_axis = origin[dim % len(origin)]
    if memory_axis is None:
        raise NoMatch("the softmax runs over an axis of size 1")
    if isinstance(memory_axis, tuple):
        raise NoMatch("the softmax runs over axes merged into one")
    padded = {}
    for term in terms:
        term_shape = _shape(term)
        if term_shape is None or len(term_shape) > rank:
            raise NoMatch(f"a term of shape {term_shape} in a sum of shape {list(shape)}")
        full_rank = (1,) * (rank - len(term_shape)) + term_shape
        if not _same(full_rank[hidden], width):
            raise NoMatch(f"a term of shape {term_shape} in a sum of shape {list(shape)}")
        # the hidden axis moved last (the replacement moves it so)
        padded[term] = full_rank[:hidden] + full_rank[hidden + 1 :] + (full_rank[hidden],)
    varies = {t: {a for a in range(rank - 1) if not _is_one(s[a])} for t, s in padded.items()}
    keys = [t for t in terms if memory_axis in varies[t]]
    queries = [t for t in terms if memory_axis not in varies[t] and varies[t]]
    biases = [t for t in terms if not varies[t]]
    if keys and not queries:
        # a batch of one (TorchDynamo fixes sizes of 1): the query term varies along no axis. A
        # term computed from the call's inputs, not from parameters alone, is the query.
        queries = [t for t in biases if _from_call_inputs(t)]
        biases = [t for t in biases if t not in queries]
    if not keys or not (queries or pooled):
        raise NoMatch("no term of the sum varies along the softmax's axis, or none along another")
    batch_axes = sorted(set().union(*(varies[t] for t in keys)) - {memory_axis})
    query_axes = [a for a in range(rank - 1) if a != memory_axis and a not in batch_axes]
    vector_shape = _shape(vector)
    vector_axes = []
    per_head = _is(scores, _SUM) and not all(map(_is_one, vector_shape[:-1]))  # (. * v).sum(-1)
    if per_head:  # one vector per head: along batch axes only
        padded_vector = (1,) * (rank - len(vector_shape)) + tuple(vector_shape)
        vector_axes = [a for a in range(rank - 1) if not _is_one(padded_vector[a])]
        if hidden != rank - 1 or any(
            a not in batch_axes or not _same(padded_vector[a], shape[a]) for a in vector_axes
        ):
            raise NoMatch(
                f"the score vector of shape {list(vector_shape)} varies along other axes than "
                "the batch's"
            )
        batch_axes = vector_axes + [a for a in batch_axes if a not in vector_axes]
    for step in steps:
        if step[0] in ("fill", "add", "keep"):
            _check_mask(step, query_axes)
    return Match(
        tanh,
        softmax,
        queries,
        keys,
        biases,
        vector,
        rank,
        tuple(batch_axes),
        tuple(query_axes),
        memory_axis,
        scores_origin,
        hidden,
        steps,
        shape_ops,
        split_nodes,
        helpers,
        sizes,
        normalize,
        normalize_nodes,
        tuple(vector_axes),
    )


def _check_mask(step: tuple, query_axes: list[int]) -> None:
    _, mask, _, origin, at_shape = step
    mask_shape = _shape(mask)
    if mask_shape is None or len(mask_shape) > len(origin):
        raise NoMatch(f"a mask of shape {mask_shape} on scores of shape {list(at_shape)}")
    mask_shape = (1,) * (len(origin) - len(mask_shape)) + mask_shape
    if any(isinstance(axis, tuple) for axis in origin):
        raise NoMatch("a mask on scores whose axes were merged")
    for size, axis in zip(mask_shape, origin, strict=True):
        if axis in query_axes and not _is_one(size):
            raise NoMatch("the mask varies along a query axis")


# --- in-place arithmetic ---------------------------------------------------------------------------

# x.add_(y) and the like: the traced graph keeps using the node of x, which no longer holds what
# it held when it was made. Out of place, with x's later readers reading the new node, the graph
# says what it computes (nmtpytorch's inner_sum.add_(bias) was read without its bias before).
_INPLACE_ARITHMETIC = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}
_VIEWS = (
    _SHAPE_OPS
    | _REPEATS
    | {
        operator.getitem,
        "__getitem__",
        "select",
        "narrow",
        "t",
        "expand",
        "as_strided",
        "unfold",
        "split",
        "chunk",
        "unbind",
        "detach",
        "view_as",
        "flatten",
        "unflatten",
        torch.flatten,
        torch.split,
        torch.chunk,
        torch.unbind,
        torch.narrow,
        torch.select,
    }
)


def _writes_in_place(node: fx.Node) -> bool:
    """A call that writes its first argument: ``x.add_(...)``, ``torch.relu_(x)``..."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (
        node.op in ("call_method", "call_function")
        and isinstance(name, str)
        and name.endswith("_")
        and not name.startswith("_")
        and bool(node.args)
    )


def _aliased(base: fx.Node) -> bool:
    """Whether another node may share ``base``'s memory: an input, a view, a view of it."""
    if base.op in ("placeholder", "get_attr") or _is(base, _VIEWS) or base.op == "call_module":
        return True
    return any(_is(user, _VIEWS) or user.op == "call_module" for user in base.users)


def _functionalize_arithmetic(graph: fx.Graph) -> None:
    """Rewrite ``x.add_(y)`` (sub_, mul_, div_) of a graph-made, unaliased x out of place; x's
    readers after the write read its result. Others stay as they are (see _check_not_written)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _INPLACE_ARITHMETIC:
            continue
        base = node.args[0]
        if not isinstance(base, fx.Node) or _aliased(base):
            continue
        later = [u for u in base.users if u is not node and order[u] > order[node]]
        node.target = _INPLACE_ARITHMETIC[node.target]
        for user in later:
            user.replace_input_with(base, node)


def _check_not_written(tanh: fx.Node) -> None:
    """NoMatch where a tensor the tanh's sum is made from was written in place before the tanh:
    the rewrite forms the sum from its terms, and would miss what the write added."""
    order = {node: i for i, node in enumerate(tanh.graph.nodes)}
    for node in _ancestors(tanh):
        aliases, todo = set(), [node]  # node and its views, which share its memory
        while todo:
            current = todo.pop()
            aliases.add(current)
            todo += [u for u in current.users if _is(u, _VIEWS) and u not in aliases]
        for alias in aliases:
            for user in alias.users:
                if user is tanh or not _writes_in_place(user) or user.args[0] is not alias:
                    continue
                if order[user] < order[tanh]:
                    raise NoMatch(
                        f"{node.name} is written in place ({user.target}) before the tanh reads it"
                    )


# --- rows flattened into one axis ------------------------------------------------------------------

# A summariser's coverage attention works on [B*T, A] rows: the decoder's term is made by
# dec.unsqueeze(1).expand(B, T, A).contiguous().view(-1, A), the scores are viewed back to [B, T]
# before the softmax. Batch and frames are one axis there, so the terms cannot be told apart; the
# pass below splits that axis where the scores are split, so the matcher sees [B, T, A] terms.
_FLAT_VIEWS = {"view", "reshape", torch.reshape}


def _unflattened_term(graph: fx.Graph, term: fx.Node, frames, sizes: tuple) -> fx.Node:
    """``term`` [B*T, A] as [B, T, A] (``sizes``, as traced): the tensor an expand over T was made
    from, where it is x.unsqueeze(1).expand(B, T, A) (or repeat) viewed flat; else
    term.unflatten(0, (-1, T))."""
    node = term
    if _is(node, _FLAT_VIEWS) and isinstance(node.args[0], fx.Node):
        inner = node.args[0]
        if _is(inner, {"contiguous"}) and len(inner.users) == 1:
            inner = inner.args[0]
        shape = _shape(inner)
        if _is(inner, _REPEATS) and shape is not None and len(shape) == 3:
            source = inner.args[0] if isinstance(inner.args[0], fx.Node) else None
            source_shape = _shape(source) if source is not None else None
            if (
                source_shape is not None
                and len(source_shape) == 3
                and _is_one(source_shape[1])
                and _same(source_shape[0], shape[0])
                and _same(source_shape[2], shape[2])
                # (the traced sizes: the split's are expressions in the flat size's symbols)
                and _size_hint(shape[1]) == _size_hint(sizes[1])
            ):
                return source
    new = graph.call_method("unflatten", (term, 0, (-1, frames)))
    new.meta["example_value"] = _value(term).unflatten(0, sizes[:2])
    return new


def _unflatten_rows(graph: fx.Graph) -> None:
    """tanh(sum of [N, A] terms) projected to scores [N, 1] or [N] that are then viewed to
    [B, T] (N = B*T): the sum, tanh and projection formed again on [B, T, A] terms (see above),
    the view's readers reading the new scores. Anything else is left as it is."""
    for tanh in [n for n in graph.nodes if _is(n, _TANH)]:
        shape = _shape(tanh)
        inner = tanh.args[0] if tanh.args else None
        if shape is None or len(shape) != 2 or not isinstance(inner, fx.Node):
            continue
        if len(tanh.users) != 1:
            continue
        projection = next(iter(tanh.users))
        if not (_is(projection, _LINEAR) and _arg(projection, 0, "input") is tanh):
            continue
        if len(projection.users) != 1:
            continue
        split = next(iter(projection.users))
        out = _shape(split)
        if not _is(split, _FLAT_VIEWS) or split.args[0] is not projection or out is None:
            continue
        if len(out) != 2 or _is_one(out[1]) or split.kwargs:
            continue
        frames = split.args[-1] if len(split.args) == 3 else None
        if isinstance(frames, (list, tuple)):
            frames = frames[-1] if len(frames) == 2 else None
        if frames is None:
            continue
        sizes = (out[0], out[1], shape[1])
        with graph.inserting_before(split):
            terms = [_unflattened_term(graph, t, frames, sizes) for t in _terms(inner)]
            total = terms[0]
            for t in terms[1:]:
                total = graph.call_function(operator.add, (total, t))
                total.meta["example_value"] = _value(total.args[0]) + _value(t)
            new_tanh = graph.call_function(torch.tanh, (total,))
            new_tanh.meta["example_value"] = torch.tanh(_value(total))
            args = (new_tanh, *projection.args[1:])
            new_scores = graph.call_function(projection.target, args, dict(projection.kwargs))
            new_scores.meta["example_value"] = projection.target(
                *[_value(a) if isinstance(a, fx.Node) else a for a in args]
            )
            new_split = graph.call_method("squeeze", (new_scores, -1))  # [B, T, 1] -> [B, T]
            new_split.meta["example_value"] = _value(new_scores).squeeze(-1)
        split.replace_all_uses_with(new_split)
        graph.erase_node(split)
        for node in (projection, tanh):  # the flat forms, dead now
            if not node.users:
                graph.erase_node(node)


def find_matches(graph: fx.Graph) -> tuple[list[Match], list[str]]:
    """(matches, why each other tanh over a sum is not one)."""
    _functionalize_arithmetic(graph)
    _unflatten_rows(graph)
    matches, misses = [], []
    for node in list(graph.nodes):
        if not _is(node, _TANH):
            continue
        try:
            match = _match_at(graph, node)
            _check_not_written(node)
            matches.append(match)
        except NoMatch as exc:
            misses.append(str(exc))
    return matches, misses


# --- the replacement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What :func:`traced_weights` needs to know of a match besides its tensors."""

    rank: int
    batch_axes: tuple[int, ...]
    query_axes: tuple[int, ...]
    memory_axis: int
    scores_origin: tuple
    hidden_axis: int
    # ("scale", "mul"|"div") | ("shift", "+"|"-") | ("fill"|"keep"|"add", None, origin)
    steps: tuple
    backend: str
    normalize: str = "softmax"  # or "sigmoid" (sigmoid(e) / sum sigmoid(e))
    vector_axes: tuple[int, ...] = ()  # one score vector per index of these (leading) batch axes


def _pad(t: Tensor, rank: int) -> Tensor:
    return t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t


def _mask_to_rows(mask: Tensor, origin: tuple, plan: Plan, full: tuple) -> Tensor:
    """A mask on the scores (in their layout at that step) -> [B', S] over the op's rows."""
    mask = _pad(mask, len(origin))
    index = tuple(0 if axis is None else slice(None) for axis in origin)
    mask = mask[index]  # the inserted 1-axes dropped
    axes = [axis for axis in origin if axis is not None]
    leading = plan.rank - 1
    order = [axes.index(a) if a in axes else None for a in range(leading)]
    shape = [mask.shape[o] if o is not None else 1 for o in order]
    mask = mask.permute([o for o in order if o is not None]).reshape(shape)
    target = [1 if a in plan.query_axes else full[a] for a in range(leading)]
    rows = plan.batch_axes + plan.query_axes + (plan.memory_axis,)
    mask = mask.expand(target).permute(rows)
    return mask.reshape(-1, full[plan.memory_axis])


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
        logs.remove(log)


class TracedWeights:
    """The callable that replaces a match's sum ... softmax in the graph (see :func:`rewrite`):
    the weights in the projection's output layout (``Plan.scores_origin``)."""

    __name__ = "traced_weights"
    # how many times any converted module ran a replacement: a statistic for tests, never read
    # to decide anything (recorded_runs does that, per thread)
    calls = 0
    description = ""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.layout_cache = ProjectionCache()
        self.fixed_cache = ProjectionCache()
        self.mask_cache = ProjectionCache()

    def __call__(self, queries, keys, biases, vector, scales, masks, fills, shifts=()):
        TracedWeights.calls += 1
        for log in getattr(_RUNS, "logs", ()):
            log.append(self)
        plan = self.plan
        rank = plan.rank
        hidden = plan.hidden_axis
        queries = [_pad(t, rank).movedim(hidden, -1) for t in queries]
        location = next((t for t in keys if isinstance(t, _LocationTerm)), None)
        if location is not None and not (
            rank == 3 and hidden == 2 and plan.memory_axis == 1 and plan.batch_axes == (0,)
        ):
            keys = [t if t is not location else _Plain(t.value()) for t in keys]
            location = None
        keys = [t for t in keys if t is not location]
        values_of_terms = [term.value() for term in keys]  # the same objects while cached
        raw = [_pad(t, rank).movedim(hidden, -1) for t in values_of_terms]
        shapes = [t.shape for t in queries + raw]
        if location is not None:
            shapes.append(location.shape())
        full = torch.broadcast_shapes(*shapes)
        width = full[-1]
        rows = plan.batch_axes + plan.query_axes + (plan.memory_axis, rank - 1)
        batch = math.prod(full[a] for a in plan.batch_axes)
        steps_q = math.prod(full[a] for a in plan.query_axes)
        frames = full[plan.memory_axis]
        key_shape = [1 if a in plan.query_axes else full[a] for a in range(rank)]

        def canonical(t):
            return t.expand(key_shape).permute(rows).reshape(batch, frames, width)

        memory = values = None
        if location is not None:  # the fixed part of the keys, kept while the memory is
            key, values = self._fixed(values_of_terms[0], raw[0], canonical, full)
        elif len(raw) == 1 and not plan.vector_axes:
            # one key term: its layout and memory kept with it (a decoder's steps)
            key, values, memory = self._memory(values_of_terms[0], raw[0], canonical, full)
        else:
            key = canonical(raw[0])
            for t in raw[1:]:
                key = key + canonical(t)
        if values is None:
            values = key.new_zeros(batch, frames, 1)  # the graph forms the context: a placeholder
        if queries:
            query = queries[0]
            for t in queries[1:]:
                query = query + t
            query_shape = [1 if a == plan.memory_axis else full[a] for a in range(rank)]
            query = query.expand(query_shape).permute(rows).reshape(batch, steps_q, width)
        else:  # attention pooling: a learned vector scores the keys alone
            query = key.new_zeros(batch, steps_q, width)
        bias = None
        for t in biases:
            t = t.reshape(width)
            bias = t if bias is None else bias + t
        groups = math.prod(full[a] for a in plan.vector_axes)
        v = vector.reshape(groups, width) if plan.vector_axes else vector.reshape(width)
        plain = False
        v_eff, score_bias = v, None  # e' = v_eff . tanh(...) + score_bias: the scaled, shifted e
        scale_iter, shift_iter = iter(scales), iter(shifts)
        for step in plan.steps:
            if step[0] == "scale":
                factor = next(scale_iter)
                if isinstance(factor, Tensor):
                    factor = factor.reshape(())
                plain |= not bool(factor > 0)
                if step[1] == "mul":
                    v_eff = v_eff * factor
                    score_bias = None if score_bias is None else score_bias * factor
                else:
                    v_eff = v_eff / factor
                    score_bias = None if score_bias is None else score_bias / factor
            elif step[0] == "shift":
                shift = next(shift_iter)
                shift = shift.reshape(()) if isinstance(shift, Tensor) else float(shift)
                shift = -shift if step[1] == "-" else shift
                score_bias = shift if score_bias is None else score_bias + shift
        if plan.normalize == "softmax":
            score_bias = None  # a softmax cancels it
        invalid = options = None
        graded = [m for m in masks if isinstance(m, Tensor) and m.requires_grad]
        if masks:
            fill_values = tuple(_fill_value(f) for f in fills)
            invalid, not_exact, options, graded = self._masks(masks, fill_values, full, graded)
            plain |= not_exact
        plain |= bool(graded) and plan.normalize != "softmax"  # (the Jacobian below: softmax's)
        if location is not None and (plain or graded or steps_q != 1):
            key = key + location.value()  # [B, T, A] already: the op's layout
            location = None
        if plain:
            weights = self._plain(query, key, bias, v, scales, masks, fills, full, shifts)
        elif location is not None:
            valid = None if invalid is None else ~invalid
            step_query = query[:, 0] if bias is None else query[:, 0] + bias
            parts = (location.features, location.conv_weight, location.dense_weight)
            _, weights = attend_location(
                self,
                plan.backend,
                step_query,
                key,
                parts,
                values,
                v_eff,
                valid,
                plan.normalize,
                score_bias,
            )
            weights = weights.unsqueeze(1)
        elif plan.vector_axes:  # a score vector per head: the op once per head, over its rows
            options = {} if options is None else options
            rows_per = batch // groups
            parts = []
            for g in range(groups):
                part = slice(g * rows_per, (g + 1) * rows_per)
                _, w = additive_attention(
                    query[part],
                    key[part],
                    values[part],
                    v_eff[g],
                    bias,
                    **{name: t if t is None else t[part] for name, t in options.items()},
                    normalize=plan.normalize,
                    backend=plan.backend,
                    score_bias=score_bias,
                )
                parts.append(w)
            weights = torch.cat(parts)
        else:
            options = {} if options is None else options
            _, weights = additive_attention(
                query,
                key,
                values,
                v_eff,
                bias,
                **options,
                stepwise=memory,
                normalize=plan.normalize,
                backend=plan.backend,
                score_bias=score_bias,
            )
        if graded and not plain:  # a float mask's gradient: the softmax's Jacobian, by a term
            shift = sum(m - m.detach() for m in graded).unsqueeze(1)  # worth zero
            fixed = weights.detach()
            moved = fixed * shift
            weights = weights + moved - fixed * moved.sum(-1, keepdim=True)
        weights = weights.reshape(
            [full[a] for a in plan.batch_axes + plan.query_axes] + [frames]
        ).permute([rows.index(a) for a in range(rank - 1)])
        weights = weights.permute([a for a in plan.scores_origin if a is not None])
        for axis, source in enumerate(plan.scores_origin):  # the projection's added 1-axes
            if source is None:
                weights = weights.unsqueeze(axis)
        return weights

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
                [step for step in plan.steps if step[0] in ("fill", "keep", "add")],
                masks,
                strict=True,
            ):
                rows = _mask_to_rows(mask, step[2], plan, full)
                if step[0] == "add":
                    pure = (rows == 0) | (rows <= MASK_FILL_MAX)
                    not_exact |= not bool(pure.all())
                    if rows.requires_grad:
                        graded_rows.append(rows)
                    rows = rows != 0
                else:
                    rows = rows.to(torch.bool)
                    rows = rows if step[0] == "fill" else ~rows
                    not_exact |= not next(fills) <= MASK_FILL_MAX
                invalid = rows if invalid is None else invalid | rows
            not_exact |= bool(invalid.all(dim=1).any())  # a row without a valid frame
            return invalid, not_exact, (None if not_exact else masking(~invalid)), graded_rows

        if graded or len(masks) != 1 or not isinstance(masks[0], Tensor):
            return compute()
        return self.mask_cache.get(
            masks[0], (tuple(full), *fill_values), compute, watch=lambda e: ()
        )

    def _fixed(self, term: Tensor, raw: Tensor, canonical, full):
        """(the keys' fixed part [B, T, A], a values placeholder [B, T, 1]) for location-aware
        steps: the same objects while the term is (the step's location memory follows them)."""

        def compute():
            key = canonical(raw).contiguous()
            return key, key.new_zeros(key.shape[0], key.shape[1], 1)

        return self.fixed_cache.get(term, (tuple(full),), compute)

    def _memory(self, term: Tensor, raw: Tensor, canonical, full):
        """(keys [B', S, H], values placeholder, StepwiseMemory or None) for one key term, kept
        while the term is the same tensor (the steps of a decoder over one memory)."""

        def compute():
            key = canonical(raw).contiguous()
            values = key.new_zeros(key.shape[0], key.shape[1], 1)
            memory = StepwiseMemory.for_training(key, values, self.plan.backend)
            if memory is None:
                return key, values, None, key
            return memory.keys, memory.values, memory, key

        entry = self.layout_cache.get(term, (tuple(full),), compute, watch=lambda e: e[3:])
        return entry[:3]

    def _plain(self, query, key, bias, v, scales, masks, fills, full, shifts=()):
        """The original's math in the op's layout, step by step (a row without a valid frame, a
        float mask that is not a mask, a scale that is not positive)."""
        plan = self.plan
        scores = _plain_scores(query, key, bias, v)  # [B', T', S]
        scale_index, mask_index, fill_index, shift_index = 0, 0, 0, 0
        for step in plan.steps:
            if step[0] == "scale":
                factor = scales[scale_index]
                scale_index += 1
                scores = scores * factor if step[1] == "mul" else scores / factor
            elif step[0] == "shift":
                shift = shifts[shift_index]
                shift_index += 1
                shift = shift.reshape(()) if isinstance(shift, Tensor) else shift
                scores = scores + shift if step[1] == "+" else scores - shift
            else:
                mask = _mask_to_rows(masks[mask_index], step[2], plan, full).unsqueeze(1)
                mask_index += 1
                if step[0] == "add":
                    scores = scores + mask
                else:
                    mask = mask.to(torch.bool)
                    mask = mask if step[0] == "fill" else ~mask
                    scores = scores.masked_fill(mask, _fill_value(fills[fill_index]))
                    fill_index += 1
        if plan.normalize == "sigmoid":
            return torch.sigmoid(scores) / torch.sigmoid(scores).sum(-1, keepdim=True)
        return torch.softmax(scores, dim=-1)


_PURE_METHODS = {
    "view",
    "unflatten",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "repeat",
    "size",
    "flatten",
    "__getitem__",
    "add",
    "mul",
    "float",
    "to",
}
_PURE_FUNCTIONS = {
    nn_linear(),
    F.linear,
    torch.matmul,
    torch.bmm,
    operator.getitem,
    operator.add,
    operator.mul,
    operator.sub,
    operator.floordiv,
    operator.neg,
    torch.add,
    torch.mul,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.unsqueeze,
    torch.squeeze,
    F.conv1d,
    torch.conv1d,
    torch.cat,
    torch.stack,
}


def _key_function(graph: fx.Graph, term: fx.Node):
    """(a GraphModule computing ``term`` from the graph's inputs it depends on, those inputs), or
    None when the term is not a pure function of inputs (dropout, a get_attr, anything else)."""
    nodes, inputs = set(), []
    for node in _ancestors(term):
        nodes.add(node)
        if node.op == "placeholder":
            inputs.append(node)
        elif not (
            (node.op == "call_method" and node.target in _PURE_METHODS)
            or (node.op == "call_function" and node.target in _PURE_FUNCTIONS)
        ):
            return None
    order = {node: i for i, node in enumerate(graph.nodes)}
    inputs.sort(key=order.__getitem__)
    sub = fx.Graph()
    env = {node: sub.placeholder(node.name) for node in inputs}
    for node in sorted(nodes - set(inputs), key=order.__getitem__):
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(env[term])
    return fx.GraphModule(torch.nn.Module(), sub), inputs


class KeyTerm:
    """A key term the replacement computes itself: once per set of inputs (the memory, the
    weights, the sizes) while they stay the same objects at the same versions, e.g. over the
    steps of a decoder."""

    def __init__(self, function: fx.GraphModule) -> None:
        self.function = function
        self.cache = ProjectionCache()

    def value(self, args: tuple) -> Tensor:
        tensors = [a for a in args if isinstance(a, Tensor)]
        anchor = next((t for t in tensors if not isinstance(t, torch.nn.Parameter)), None)
        if anchor is None:
            return self.function(*args)
        rest = [a if a is not anchor else None for a in args]
        return self.cache.get(anchor, rest, lambda: self.function(*args))


class _BoundTerm:
    __slots__ = ("term", "args")

    def __init__(self, term: KeyTerm, args: tuple) -> None:
        self.term, self.args = term, args

    def value(self) -> Tensor:
        return self.term.value(self.args)


class _Bound:
    """The call_function target that hands a key term its runtime inputs."""

    __name__ = "bind_key_term"

    def __init__(self, term: KeyTerm) -> None:
        self.term = term

    def __call__(self, *args) -> _BoundTerm:
        return _BoundTerm(self.term, args)


class _Plain:
    """A key term computed by the graph (not a pure function of the inputs)."""

    def __init__(self, value: Tensor) -> None:
        self._value = value

    def value(self) -> Tensor:
        return self._value


def _wrap_plain(value: Tensor) -> _Plain:
    return _Plain(value)


_wrap_plain.__name__ = "plain_key_term"


def _single(value) -> int | None:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None


def _location_source(term: fx.Node):
    """(features [B, Cin, T], conv weight [C, Cin, K], dense weight [A, C]) when ``term`` is
    linear(conv1d(features, conv weight, same padding, odd K, no bias)^T, dense weight, no bias),
    a location term the kernels can form themselves; else None."""
    if not _is(term, _LINEAR) or _arg(term, 2, "bias") is not None:
        return None
    swap, dense = _arg(term, 0, "input"), _arg(term, 1, "weight")
    if _is(swap, {"transpose"}) and len(swap.args) == 3:
        if sorted(d % 3 for d in swap.args[1:3]) != [1, 2]:
            return None
    elif _is(swap, {"permute"}):
        dims = list(swap.args[1:])
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        if dims != [0, 2, 1]:
            return None
    else:
        return None
    conv = swap.args[0]
    if not _is(conv, {torch.conv1d, F.conv1d}) or len(swap.users) != 1 or len(conv.users) != 1:
        return None
    weight = _arg(conv, 1, "weight")
    shape = _shape(weight)
    if _arg(conv, 2, "bias") is not None or shape is None or len(shape) != 3:
        return None
    width = shape[2]
    padding = _arg(conv, 4, "padding", 0)
    if not isinstance(width, int) or width % 2 == 0:
        return None
    if padding != "same" and _single(padding) != width // 2:
        return None
    if _single(_arg(conv, 3, "stride", 1)) != 1 or _single(_arg(conv, 5, "dilation", 1)) != 1:
        return None
    if _arg(conv, 6, "groups", 1) != 1:
        return None
    return _arg(conv, 0, "input"), weight, dense


class _LocationTerm:
    """A location term (see :func:`_location_source`), formed inside the kernels where a
    decoder's training steps allow, else by the same ops as the original."""

    __slots__ = ("features", "conv_weight", "dense_weight")

    def __init__(self, features: Tensor, conv_weight: Tensor, dense_weight: Tensor) -> None:
        self.features, self.conv_weight, self.dense_weight = features, conv_weight, dense_weight

    def shape(self) -> tuple:
        return (self.features.shape[0], self.features.shape[2], self.dense_weight.shape[0])

    def value(self) -> Tensor:
        width = self.conv_weight.shape[-1]
        conv = F.conv1d(self.features, self.conv_weight, padding=width // 2)
        return F.linear(conv.transpose(1, 2), self.dense_weight)


def _location_term(features, conv_weight, dense_weight) -> _LocationTerm:
    return _LocationTerm(features, conv_weight, dense_weight)


_location_term.__name__ = "location_key_term"


def _key_terms(graph: fx.Graph, match: Match, before: fx.Node) -> list[fx.Node]:
    terms = []
    with graph.inserting_before(before):
        for term in match.key_terms:
            location = _location_source(term) if len(match.key_terms) == 2 else None
            if location is not None:
                terms.append(graph.call_function(_location_term, location))
                continue
            found = _key_function(graph, term)
            if found is None:
                terms.append(graph.call_function(_wrap_plain, (term,)))
            else:
                function, inputs = found
                terms.append(graph.call_function(_Bound(KeyTerm(function)), tuple(inputs)))
    return terms


def rewrite(graph: fx.Graph, match: Match, backend: str) -> None:
    """Replace ``match``'s sum ... softmax by one :class:`TracedWeights` call (the shape ops between
    the scores and the softmax applied again to its weights)."""
    plan_steps, scales, masks, fills, shifts = [], [], [], [], []
    for step in match.steps:
        if step[0] == "scale":
            plan_steps.append(("scale", step[1]))
            scales.append(step[2])
        elif step[0] == "shift":
            plan_steps.append(("shift", step[1]))
            shifts.append(step[2])
        elif step[0] in ("fill", "keep"):
            plan_steps.append((step[0], None, step[3]))
            masks.append(step[1])
            fills.append(step[2])
        else:
            plan_steps.append(("add", None, step[3]))
            masks.append(step[1])
    key_terms = _key_terms(graph, match, match.softmax)
    plan = Plan(
        match.rank,
        match.batch_axes,
        match.query_axes,
        match.memory_axis,
        match.scores_origin,
        match.hidden_axis,
        tuple(plan_steps),
        backend,
        match.normalize,
        match.vector_axes,
    )
    with graph.inserting_before(match.softmax):
        replacement = TracedWeights(plan)
        replacement.description = match.describe()
        node = graph.call_function(
            replacement,
            (
                match.query_terms,
                key_terms,
                match.bias_terms,
                match.vector,
                scales,
                masks,
                fills,
                shifts,
            ),
        )
        sizes = {}  # the chain's .size() / .dim(): asked of the weights at the same point

        def ask_sizes(applied: int, of: fx.Node) -> None:
            for helper, at in match.sizes:
                if at == applied:
                    sizes[helper] = graph.call_method(helper.target, (of, *helper.args[1:]))
                    sizes[helper].meta.update(helper.meta)

        ask_sizes(0, node)
        for k, op in enumerate(match.shape_ops):
            node = graph.node_copy(
                op, lambda n, prev=node, src=op: prev if n is src.args[0] else sizes.get(n, n)
            )
            ask_sizes(k + 1, node)
    match.softmax.replace_all_uses_with(node)
    graph.erase_node(match.softmax)
    for op in match.normalize_nodes:  # the sigmoid normalisation's sum, then its sigmoids
        graph.erase_node(op)
    for helper in match.helpers:
        if _is(helper, _NEW_FULL):  # new_full(scores, ...): dtype and device from the vector
            helper.replace_input_with(helper.args[0], match.vector)
        elif _is(helper, {"type_as"}):  # x.type_as(scores) (dead if x is the scores' chain)
            helper.replace_input_with(helper.args[1], match.vector)
        elif helper not in sizes:  # an in-place fill of the scores or of their .data: in the
            graph.erase_node(helper)  # op's mask now
    # the original shape ops (dead now, but a graph whose scores are written in place may keep
    # them), then the sizes asked of them
    for op in reversed(match.shape_ops):
        if not op.users:
            graph.erase_node(op)
    for helper, size in sizes.items():  # its other users come after the weights too
        helper.replace_all_uses_with(size)
        graph.erase_node(helper)
