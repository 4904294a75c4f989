"""Additive attention found in a traced graph by what it computes, and replaced by the fused op.

A torch.fx graph (TorchDynamo's, torch-level: ``linear``, ``tanh``, ``add``, ``softmax`` and tensor
methods, with example values carrying shapes) is searched for::

    X = t_1 + t_2 + ... (+ linear(cat([a, b]), W, c), split into a W_a + b W_b + c)
        (repeats and expands of a term that only broadcast it are seen through)
    e = project(tanh(X)) onto a vector v: linear(., w[1, H]), matmul(., v), (. * v).sum(-1),
        einsum("...h,h->..."), bmm(v repeated over the batch, tanh^T), or bmm(v, tanh) with the
        hidden axis in the middle ([B, H, T]: a Conv1d over the memory); a dropout that does
        nothing (p = 0, or eval mode) between the tanh and the projection is seen through
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
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from seq2seq_fast.nn.convert.traced.nodes import (
    _ADDS,
    _CASTS,
    _CAT,
    _DIV,
    _LIKE,
    _LINEAR,
    _MASKED_FILL,
    _MATMUL,
    _MUL,
    _NEW_FULL,
    _REPEATS,
    _SHAPE_OPS,
    _SIGMOID,
    _SIZES,
    _SOFTMAX,
    _SUBS,
    _SUM,
    _TANH,
    _WHERE,
    MASK_FILL_MAX,
    ROUNDED_SCORES,
    SCORES_LEAVE_THE_GRAPH,
    NoMatch,
    _ancestors,
    _arg,
    _described,
    _hint,
    _inert_dropout,
    _is,
    _is_one,
    _number,
    _same,
    _shape,
    _single_user,
    _size_hint,
    _terms,
    _value,
    op_name,
)
from seq2seq_fast.nn.convert.traced.passes import (
    _broadcasts_as_expands,
    _check_not_written,
    _drop_max_shifts,
    _drop_views_of_the_tanh_to_its_shape,
    _functionalize_arithmetic,
    _tanh_before_flattening,
    _unflatten_projection,
    _unflatten_rows,
)
from seq2seq_fast.nn.convert.traced.plan import (
    Heads,
    KeyTerm,
    Layout,
    LocationSource,
    Mask,
    Normalisation,
    Plan,
    Scale,
    Shift,
    Site,
    Terms,
)
from seq2seq_fast.ops._torch_private import nn_linear

# --- the sum inside the tanh ----------------------------------------------------------------------


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


def _peel_swapped_repeat(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """:func:`_peel_repeat`, also through a transpose of leading axes after the repeat
    (``hidden.repeat(T, 1, 1).transpose(0, 1)``, keon's seq2seq and its copies; DA-RNN's
    ``.permute(1, 0, 2)``): the source,
    given the repeat's rank with sizes 1 where it repeats, transposed alike (new nodes inserted
    at the graph's insertion point). The node itself where neither applies."""
    dims = _leading_swap(node)
    if dims is None:
        return _peel_repeat(node)
    inner = node.args[0]
    rank = len(_shape(inner))
    source = _peel_repeat(inner)
    source_shape = _shape(source)
    if source is inner or source_shape is None:
        return node
    for _ in range(rank - len(source_shape)):  # (no sizes in the graph: they may be symbols)
        source = graph.call_method("unsqueeze", (source, 0))
        source.meta["example_value"] = _value(source.args[0]).unsqueeze(0)
    swapped = graph.call_method("permute", (source, dims))
    swapped.meta["example_value"] = _value(source).permute(dims)
    return swapped


def _leading_swap(node: fx.Node) -> tuple | None:
    """The permutation of a transpose or permute of a tensor's leading axes that keeps its last
    axis last (``transpose(0, 1)``, DA-RNN's ``permute(1, 0, 2)``); else None."""
    if not (isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node)):
        return None
    shape = _shape(node.args[0])
    if shape is None or node.kwargs:
        return None
    rank = len(shape)
    if _is(node, {"transpose", torch.transpose}) and len(node.args) == 3:
        first, second = node.args[1:]
        if not all(isinstance(d, int) for d in (first, second)):
            return None
        dims = list(range(rank))
        dims[first % rank], dims[second % rank] = dims[second % rank], dims[first % rank]
    elif _is(node, {"permute", torch.permute}) and len(node.args) >= 2:
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        if len(dims) != rank or not all(isinstance(d, int) for d in dims):
            return None
        dims = [d % rank for d in dims]
    else:
        return None
    return tuple(dims) if dims[-1] == rank - 1 else None  # the width axis stays last


def _given_keys(node: fx.Node) -> bool:
    """Whether ``node`` is a tensor as the forward got it or an RNN gave it (a graph input, an
    item of an output tuple, through shape ops): keys whose projection is the identity, not a
    product, a relu or a scaled sum (each a look-alike inside a tanh)."""
    while isinstance(node, fx.Node) and _is(node, _SHAPE_OPS):
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return False
    return node.op == "placeholder" or (
        node.op == "call_function" and node.target is operator.getitem
    )


def _split_linear_bias(graph: fx.Graph, node: fx.Node) -> list[fx.Node] | None:
    """linear(x, W, c) -> [linear(x, W), c] as a new node and c; linear(x, W) or x @ W (W a
    matrix) -> [itself]."""
    if _is(node, {*_MATMUL, torch.mm}) and len(node.args) == 2 and not node.kwargs:
        weight = _shape(node.args[1])
        return [node] if weight is not None and len(weight) == 2 else None
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
            peeled = _peel_swapped_repeat(graph, part)
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


# why scores onto several vectors at once are not the op's (multi-branch or multi-hop pooling)
_SHARED = (
    "several score vectors over one tanh (attentions sharing their hidden layer, as in "
    "multi-branch or multi-hop pooling); the fused op projects each tanh onto one vector, so "
    "fusing would compute the shared tanh once per vector"
)


def _projection(tanh: fx.Node, shape: tuple, rank: int):
    """(scores node, vector node, origin of the scores' axes, hidden axis) of tanh's projection
    onto a vector: origin[i] is the axis of the pre-activation without its hidden axis that the
    scores' axis i is, None for an added 1."""
    leading = tuple(range(rank - 1))
    width = shape[-1]
    user = _single_user(tanh, "the tanh")
    while _inert_dropout(user):  # a dropout that does nothing (p = 0, or eval mode)
        tanh, user = user, _single_user(user, "the tanh after a dropout")
    if _is(user, {F.dropout}):
        raise NoMatch(
            "an active dropout lies between the tanh and the projection onto a vector (the fused "
            "op has none; in eval mode, or at p = 0, it is seen through)"
        )
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
        if shape is not None and len(shape) == 2 and _same(shape[1], width):
            if not _is_one(shape[0]):
                raise NoMatch(f"the tanh goes into a linear map of weight {shape}: {_SHARED}")
        else:
            raise NoMatch(f"the tanh goes into a linear map of weight {shape}, not onto a vector")
        return user, weight, leading + (None,), rank - 1
    if _is(user, _MATMUL) and user.args[0] is tanh:
        vector = user.args[1]
        shape = _shape(vector)
        if shape is not None and _same(shape, (width,)):
            return user, vector, leading, rank - 1
        if shape is not None and len(shape) == 2 and _same(shape[0], width) and _is_one(shape[1]):
            return user, vector, leading + (None,), rank - 1
        if shape is not None and len(shape) == 2 and _same(shape[0], width):
            raise NoMatch(f"the tanh is multiplied by a matrix of shape {shape}: {_SHARED}")
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
        return _product_projection(tanh, user, width, rank, leading)
    if user.op == "output":  # the graph ends after the tanh: a graph break, or its return
        raise NoMatch(
            "the tanh's value leaves the traced graph before any projection onto a vector (the "
            "forward returns it, or TorchDynamo broke the graph after it)"
        )
    if op_name(user) in ("conv1d", "conv2d"):
        raise NoMatch(
            f"the tanh goes into {op_name(user)!r} (its channels projected by a convolution: "
            "the general path takes a projection over the last axis, a Linear or a product)"
        )
    raise NoMatch(f"the tanh goes into {op_name(user)!r}, not a projection onto a vector")


def _product_projection(tanh: fx.Node, user: fx.Node, width, rank: int, leading: tuple):
    """``(tanh * v).sum(-1)``: (the sum, v, origin, hidden axis) as :func:`_projection` gives."""
    vector = user.args[1] if user.args[0] is tanh else user.args[0]
    shape = _shape(vector)
    if (
        shape is None
        or not _same(shape[-1], width)
        or len(shape) > rank
        or (not all(map(_is_one, shape[:-1])) and not isinstance(vector, fx.Node))
    ):
        raise NoMatch(f"the tanh is multiplied by {_described(vector)}, not a vector")
    # (a vector per head, [heads, H]: its axes must be batch axes, checked by the caller)
    total = _single_user(user, "the product with the vector")
    dim = _arg(total, 1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if not _is(total, _SUM):
        maker = vector
        while isinstance(maker, fx.Node) and _inert_dropout(maker):  # (name the gate itself)
            maker = maker.args[0]
        made = f" (made by {op_name(maker)!r})" if isinstance(maker, fx.Node) else ""
        raise NoMatch(
            f"the tanh is multiplied by {_described(vector)}{made}, and the product goes "
            f"into {op_name(total)!r}, not a sum over the last axis"
        )
    if dim not in (-1, rank - 1):
        raise NoMatch("the product with the vector is not summed over the last axis")
    if _arg(total, 3, "dtype") is not None:
        raise NoMatch("the sum over the hidden axis changes the dtype")
    keepdim = bool(_arg(total, 2, "keepdim", False))
    return total, vector, leading + ((None,) if keepdim else ()), rank - 1


def _permuted(origin: tuple, dims: list[int]) -> tuple:
    return tuple(origin[d] for d in dims)


def _shape_op_origin(node: fx.Node, origin: tuple) -> tuple:
    """Which axis of the pre-activation's leading axes each axis of ``node``'s output is (None: an
    inserted 1), given the same for its input."""
    before, after = _shape(node.args[0]), _shape(node)
    rank = len(before)
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name == "t":  # the chatbot tutorial's energies.t(): a 2-D transpose (1-D: none)
        return _permuted(origin, [1, 0]) if rank == 2 else origin
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


def _sigmoid_normalisation(node: fx.Node, users: list[fx.Node]):
    """(division, dim, [the sum's nodes, sigmoids]) where ``users`` of the scores ``node`` are one
    or two sigmoid(node) whose only uses are sigmoid(node) / sigmoid(node).sum(dim, keepdim=True)
    (the "smoothing" normalisation; the sum's dim also restored by ``.unsqueeze(dim)`` or
    ``[:, None]``, as kospeech and ClovaCall write it); None otherwise."""
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
    dim = _arg(total, 1, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or _arg(total, 3, "dtype") is not None or len(total.args) > 3:
        return None
    summed = total if _arg(total, 2, "keepdim") is True else _dim_restored(total, dim, users[0])
    if summed is None or len(summed.users) != 1:
        return None
    division = next(iter(summed.users))
    if not (_is(division, _DIV) and len(division.args) == 2 and not division.kwargs):
        return None
    if division.args[1] is not summed or division.args[0] not in users:
        return None
    if total.args[0] not in users or uses != {total, division}:
        return None
    if any(set(u.users) - {total, division} for u in users):
        return None
    return division, dim, [*([summed] if summed is not total else []), total, *users]


def _dim_restored(total: fx.Node, dim: int, summed_over: fx.Node) -> fx.Node | None:
    """The one user of ``total`` (a sum over ``dim`` without keepdim) that puts the summed axis
    back as size 1: ``.unsqueeze(dim)`` or an index of full slices with None at ``dim``."""
    if _arg(total, 2, "keepdim") not in (None, False) or len(total.users) != 1:
        return None
    shape = _shape(summed_over)
    if shape is None:
        return None
    rank = len(shape)
    axis = dim % rank
    user = next(iter(total.users))
    if _is(user, {"unsqueeze", torch.unsqueeze}) and user.args and user.args[0] is total:
        at = _arg(user, 1, "dim")
        restores = isinstance(at, int) and at % rank == axis
        return user if restores and set(user.kwargs) <= {"dim"} else None
    if user.target is operator.getitem and len(user.args) == 2 and user.args[0] is total:
        index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
        full = slice(None, None, None)
        if (
            len(index) <= rank
            and index[axis : axis + 1] == (None,)
            and all(i == full for k, i in enumerate(index) if k != axis)
        ):
            return user
    return None


def _match_at(graph: fx.Graph, tanh: fx.Node) -> Plan:
    """The plan of the additive attention whose tanh is ``tanh``, or NoMatch saying why not."""
    inner = tanh.args[0] if tanh.args else tanh.kwargs.get("input")
    shape = _shape(tanh)
    if not isinstance(inner, fx.Node) or shape is None or len(shape) < 2:
        raise NoMatch("the tanh's input is not a tensor of rank 2 or more")
    rank = len(shape)
    scores, vector, origin, hidden = _projection(tanh, shape, rank)
    terms, split_nodes, pooled = _sum_terms(graph, inner, rank, hidden)
    chain = _Chain(scores, origin)
    output, dim, normalisation = _walk_to_normaliser(chain)
    if _value(chain.node).dtype != _value(scores).dtype:
        raise NoMatch("the scores reach the softmax in another dtype")
    memory_axis = chain.origin[dim % len(chain.origin)]
    if memory_axis is None:
        raise NoMatch("the softmax runs over an axis of size 1")
    if isinstance(memory_axis, tuple):
        raise NoMatch("the softmax runs over axes merged into one")
    queries, keys, biases, varies = _sorted_terms(terms, shape, hidden, memory_axis)
    key_terms, biases = _key_terms_of(graph, keys, biases, split_nodes)
    where = f"axis {memory_axis} of the tanh's input {list(shape)}"
    if not keys and _is_one(shape[memory_axis]):  # (one key: the runtime waits for a call
        raise NoMatch("the softmax runs over an axis of size 1")  # with more, see ONE_KEY)
    if not keys:
        raise NoMatch(f"no term of the sum varies along the softmax's axis ({where})")
    # attention pooling spelled as a sum: tanh(h @ W + b), one key term and biases only (the one
    # Linear's form, split by hand; two key terms and no query stay refused: see below)
    pooled = pooled or (not queries and len(keys) == 1 and bool(biases))
    if not (queries or pooled):
        raise NoMatch(
            f"every term of the sum varies along the softmax's axis ({where}): none is a "
            "query, the same along it (as where the softmax runs over the batch's axis)"
        )
    batch_axes = sorted(set().union(*(varies[t] for t in keys)) - {memory_axis})
    query_axes = [a for a in range(rank - 1) if a != memory_axis and a not in batch_axes]
    heads = _heads(scores, vector, shape, hidden, batch_axes)
    batch_axes = list(heads.vector_axes) + [a for a in batch_axes if a not in heads.vector_axes]
    for step in chain.steps:
        if isinstance(step, Mask):
            _check_mask(step, query_axes)
    _check_sizes_read_after(graph, chain, output)
    return Plan(
        terms=Terms(
            queries=tuple(queries),
            keys=key_terms,
            biases=tuple(biases),
            learned_query=not queries,
        ),
        vector=vector,
        layout=Layout(
            rank=rank,
            batch_axes=tuple(batch_axes),
            query_axes=tuple(query_axes),
            memory_axis=memory_axis,
            hidden_axis=hidden,
            scores_origin=origin,
        ),
        steps=tuple(chain.steps),
        normalisation=normalisation,
        heads=heads,
        site=Site(
            tanh=tanh,
            output=output,
            shape_ops=tuple(chain.shape_ops),
            split_nodes=tuple(split_nodes),
            helpers=tuple(chain.helpers),
            sizes=tuple(chain.sizes),
        ),
    )


def _check_sizes_read_after(graph: fx.Graph, chain: _Chain, output: fx.Node) -> None:
    """The scores' .size() / .dim() (with dynamic sizes, nodes of the graph) are asked again of
    the replacement's weights, which come just before the normaliser's output: a reader placed
    before that point (pemami4911's pointer: ``torch.zeros(logits.size())`` for a mask made
    before the softmax) would read a size not made yet. Such a graph is left as it is."""
    if not chain.sizes:
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    again = set(chain.shape_ops)  # (made again after the weights, with the sizes asked of them)
    for helper, _ in chain.sizes:
        for user in helper.users:
            if user not in again and order[user] < order[output]:
                raise NoMatch(
                    f"the scores' size is read by {op_name(user)!r} before the normaliser, "
                    "where the fused op's weights are not made yet"
                )


def _sum_terms(graph: fx.Graph, inner: fx.Node, rank: int, hidden: int):
    """(the terms of the tanh's input, the new nodes a split made, whether it is attention
    pooling: one Linear inside the tanh, a learned vector, no query)."""
    terms = [_peel_repeat(t, rank - 1 - hidden) for t in _terms(inner)]
    if len(terms) > 1:
        return terms, [], False
    split = _split_concat_linear(graph, terms[0]) if hidden == rank - 1 else None
    pooled = False
    if split is None and hidden == rank - 1:
        # attention pooling, tanh(W h + b) against a learned vector: one key term (and its
        # bias), no query; the op runs it with a zero query. Or the tensor itself in the tanh
        # (Att-BLSTM's ``w . tanh(H)``: the keys' projection is the identity)
        split = _split_linear_bias(graph, terms[0])
        if split is None and _given_keys(terms[0]):
            split = [terms[0]]
        pooled = split is not None
    if split is None:
        raise NoMatch(
            "the tanh's input is not a sum of two or more terms, nor one Linear, nor the keys "
            "as given (an input, or an RNN's output)"
        )
    split_nodes = [n for n in split if n.op == "call_function" and n.target is not None]
    return split, split_nodes, pooled


class _Chain:
    """The walk from the projection's output towards the normaliser: where it is (``node``, and
    which axis of the pre-activation each of its axes is: ``origin``) and what it passed."""

    def __init__(self, scores: fx.Node, origin: tuple) -> None:
        self.node, self.origin = scores, origin
        self.steps: list = []  # Scale, Shift and Mask in the chain's order
        self.shape_ops: list[fx.Node] = []
        # new_full / type_as of the scores (dtype only), .size() / .dim(), in-place fills
        self.helpers: list[fx.Node] = []
        self.sizes: list[tuple[fx.Node, int]] = []  # .size() of the chain, after k shape ops
        if _is(scores, _LINEAR) and _arg(scores, 2, "bias") is not None:
            # the score layer's bias: a shift of every score (a softmax cancels it, a sigmoid not)
            self.steps.append(Shift(sign="+", amount=_arg(scores, 2, "bias")))

    def mask(self, kind: str, mask: fx.Node, fill) -> None:
        at = _shape(self.node)
        self.steps.append(Mask(kind=kind, mask=mask, fill=fill, origin=self.origin, at_shape=at))


def _walk_to_normaliser(chain: _Chain) -> tuple[fx.Node, int, Normalisation]:
    """Walk ``chain`` to its normaliser: (the node the weights replace, its dim, the
    normalisation)."""
    while True:
        node = chain.node
        users = [u for u in node.users if u not in chain.helpers or u.args[0] is node]
        _take_in_place_fills(chain, users)
        extra = _take_dtype_and_size_users(chain, users)
        normalised = _sigmoid_normalisation(node, [u for u in users if u not in extra])
        if normalised is not None:
            return _sigmoid(chain, normalised)
        if len(users) - len(extra) != 1:
            raise NoMatch(
                f"the scores are used {len(users)} times (the fused op gives the weights, not the scores)"
            )
        user = next(u for u in users if u not in extra)
        if _is(user, _SOFTMAX):
            return _softmax(chain, user)
        _chain_step(chain, user)
        chain.node = user


def _take_in_place_fills(chain: _Chain, users: list[fx.Node]) -> None:
    """The in-place fills of the scores (masked_fill_, ``scores[mask] = value``, and through
    ``.data``) as "fill" masks; taken out of ``users``."""
    node = chain.node
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
        chain.helpers.append(data)
        users.remove(data)
    if len(fills_in_place) == 1 == len(users) and fills_in_place[0].target == "masked_fill_":
        # ``e = e.masked_fill_(mask, -inf)`` (neural_sp), read through its result only: as
        # ``e.masked_fill(...)``, a step of the chain (nothing reads the scores before the fill)
        if fills_in_place[0].users:
            return
    for fill in fills_in_place:
        if fill.users:
            raise NoMatch("the result of an in-place masked_fill_ of the scores is used")
        _fill_step(chain, fill, "masked_fill_")
        chain.helpers.insert(0, fill)  # erased before the .data it fills
        if fill in users:
            users.remove(fill)


def _fill_step(chain: _Chain, fill: fx.Node, what: str) -> None:
    """A masked_fill (or masked_fill_) of the scores with a very negative value: a mask step."""
    value = _arg(fill, 2, "value")
    known = _number(_hint(value))
    if known is None or not known <= MASK_FILL_MAX:
        raise NoMatch(f"{what} with {_hint(value)!r}, not a very negative value")
    chain.mask("fill", _peel_repeat(_arg(fill, 1, "mask")), value)


def _take_dtype_and_size_users(chain: _Chain, users: list[fx.Node]) -> list[fx.Node]:
    """The users of the scores that take only their dtype (and device), or their sizes; they
    become helpers."""
    node = chain.node
    extra = [
        u
        for u in users
        if (_is(u, _NEW_FULL) and u.args[0] is node)
        or (_is(u, {"type_as"}) and len(u.args) == 2 and u.args[1] is node)
    ]
    # ones_like(scores) * c for a where's fill (DeepCTR, TensorFlow ports): reads no score;
    # not a helper (the where's fill, dead once the op takes the mask)
    extra += [u for u in users if _is(u, _LIKE) and u.args[0] is node and _fill_of_like(u, node)]
    # `shape = scores.shape` (d2l's masked_softmax, to reshape back): asked of the weights
    # after the same shape ops
    for u in users:
        if _is(u, _SIZES) and u.args[0] is node:
            extra.append(u)
            chain.sizes.append((u, len(chain.shape_ops)))
    chain.helpers += [u for u in extra if not _is(u, _LIKE)]
    return extra


def _fill_of_like(like: fx.Node, node: fx.Node) -> object | None:
    """The number a ``where(mask, scores, fill)`` fills with, where ``fill`` is made from
    ``like`` (ones_like(scores) * c, c * ones_like(scores), full_like(scores, c)), and that
    where is its only use; else None."""
    if _is(like, {torch.full_like}):
        value, fill = _arg(like, 1, "fill_value"), like
    elif _is(like, {torch.ones_like}) and len(like.users) == 1:
        fill = next(iter(like.users))
        if not (_is(fill, _MUL) and len(fill.args) == 2):
            return None
        value = fill.args[1] if fill.args[0] is like else fill.args[0]
    else:
        return None
    if len(fill.users) != 1 or len(like.users) != 1:
        return None
    where = next(iter(fill.users))
    if not (_is(where, _WHERE) and len(where.args) == 3 and where.args[1] is node):
        return None
    return value if where.args[2] is fill and _number(_hint(value)) is not None else None


def _chain_step(chain: _Chain, user: fx.Node) -> None:
    """One op between the scores and the normaliser: a cast, a shape op, a mask, a shift or a
    scale, noted in ``chain``; NoMatch for anything else."""
    node = chain.node
    if _is(user, _CASTS) and user.args[0] is node:
        _check_cast(node, user)
    elif _is(user, _SHAPE_OPS):
        if user.args[0] is not node:
            raise NoMatch("a shape op takes the scores as other than its input")
        chain.origin = _shape_op_origin(user, chain.origin)
        chain.shape_ops.append(user)
    elif _is(user, {*_MASKED_FILL, "masked_fill_"}):
        if user.args[0] is not node:
            raise NoMatch("masked_fill takes the scores as its mask")
        _fill_step(chain, user, "masked_fill")
    elif _is(user, _WHERE) and len(user.args) == 3 and user.args[1] is node:
        _where_step(chain, user)
    elif (_is(user, _ADDS) or (_is(user, _SUBS) and user.args[0] is node)) and len(user.args) == 2:
        _add_step(chain, user)
    elif (_is(user, _DIV) or _is(user, _MUL)) and len(user.args) == 2 and not user.kwargs:
        _scale_step(chain, user)
    elif user.op == "output":
        raise NoMatch(SCORES_LEAVE_THE_GRAPH)
    else:
        raise NoMatch(f"the scores go into {op_name(user)!r} before any softmax")


def _check_cast(node: fx.Node, user: fx.Node) -> None:
    """A dtype round trip (checked at the softmax): the op computes in the dtype; a cast down
    (float64 scores through .float()) rounds, which the op does not."""
    before, after = _value(node), _value(user)
    if (
        isinstance(before, Tensor)
        and isinstance(after, Tensor)
        and after.is_floating_point()
        and torch.finfo(after.dtype).eps > torch.finfo(before.dtype).eps
    ):
        raise NoMatch(f"{ROUNDED_SCORES} ({before.dtype} to {after.dtype})")


def _where_step(chain: _Chain, user: fx.Node) -> None:
    """where(mask, scores, very negative): a "keep" mask."""
    value = user.args[2]
    if isinstance(value, fx.Node) and _is(value, _NEW_FULL) and value.args[0] is chain.node:
        chain.helpers.append(value)
        value = _arg(value, 2, "fill_value")
    elif isinstance(value, fx.Node):  # full_like(scores, c), ones_like(scores) * c
        made = [value] if _is(value, {torch.full_like}) else list(value.args)
        like = next((a for a in made if _is(a, _LIKE) and a.args[0] is chain.node), None)
        filled = _fill_of_like(like, chain.node) if like is not None else None
        value = value if filled is None else filled
    known = _number(_hint(value))
    if known is None or not known <= MASK_FILL_MAX:
        raise NoMatch(f"where(mask, scores, {_hint(value)!r}): not a very negative value")
    chain.mask("keep", _peel_repeat(user.args[0]), value)


def _add_step(chain: _Chain, user: fx.Node) -> None:
    """scores + / - a number or one-element tensor (a Shift), or + a float mask (an "add"
    Mask)."""
    node = chain.node
    other = user.args[1] if user.args[0] is node else user.args[0]
    sign = "-" if _is(user, _SUBS) else "+"
    if isinstance(other, fx.Node) and isinstance(_value(other), Tensor):
        other_shape, at = _shape(other), _shape(node)
        if other_shape is None or at is None:
            raise NoMatch("something of unknown shape is added to the scores")
        if all(map(_is_one, other_shape)) and len(other_shape) <= len(at):
            chain.steps.append(Shift(sign=sign, amount=other))  # one element: every score moves
        elif sign == "-":
            raise NoMatch("a tensor is subtracted from the scores")
        else:
            chain.mask("add", _peel_repeat(other), None)
        return
    number = _number(other)
    if number is None and isinstance(_value(other), (torch.SymFloat, torch.SymInt)):
        number = _number(_hint(other))  # a float attribute made an input
    if number is None or not math.isfinite(number):
        raise NoMatch(f"the scores are shifted by {_hint(other)!r}, not a number")
    chain.steps.append(Shift(sign=sign, amount=other))


def _scale_step(chain: _Chain, user: fx.Node) -> None:
    """scores * c, c * scores or scores / c: a Scale by a positive number or a one-element
    tensor."""
    if user.args[0] is not chain.node and _is(user, _DIV):
        raise NoMatch("the scores divide something")
    other = user.args[1] if user.args[0] is chain.node else user.args[0]
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
    chain.steps.append(Scale(op="div" if _is(user, _DIV) else "mul", factor=other))


def _sigmoid(chain: _Chain, normalised: tuple) -> tuple[fx.Node, int, Normalisation]:
    """sigmoid(e) / sum sigmoid(e): the division stands for the softmax."""
    division, dim, nodes = normalised
    kinds = [type(step) for step in chain.steps]
    if Shift in kinds and Mask in kinds and Shift in kinds[kinds.index(Mask) :]:
        # a sigmoid of (masked + b): the masked positions need not stay 0
        raise NoMatch("sigmoid-normalised scores shifted after they are masked")
    return division, dim, Normalisation(kind="sigmoid", nodes=tuple(nodes))


def _softmax(chain: _Chain, softmax: fx.Node) -> tuple[fx.Node, int, Normalisation]:
    if softmax.args[0] is not chain.node:
        raise NoMatch("the softmax takes the scores as other than its input")
    dim = _arg(softmax, 1, "dim")
    if dim is None and _shape(chain.node) is not None:
        # softmax(x) without a dim (deprecated, still common: nn.Softmax()) takes PyTorch's
        # implicit one: 0 for 0, 1 or 3 dimensions, else 1
        dim = 0 if len(_shape(chain.node)) in (0, 1, 3) else 1
    if (
        not isinstance(dim, int)
        or _arg(softmax, 3 if softmax.op == "call_function" else 2, "dtype") is not None
    ):
        raise NoMatch("softmax without an int dim, or with a dtype")
    return softmax, dim, Normalisation(kind="softmax")


def _sorted_terms(terms: list[fx.Node], shape: tuple, hidden: int, memory_axis: int):
    """(queries, keys, biases, {term: the leading axes it varies along}): the terms sorted by
    the axes they vary along."""
    rank, width = len(shape), shape[hidden]
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
    return queries, keys, biases, varies


def _heads(scores: fx.Node, vector: fx.Node, shape: tuple, hidden: int, batch_axes) -> Heads:
    """One score vector per head ((. * v).sum(-1) with v [heads, H]): along batch axes only."""
    rank = len(shape)
    vector_shape = _shape(vector)
    if not (_is(scores, _SUM) and not all(map(_is_one, vector_shape[:-1]))):
        return Heads()
    padded_vector = (1,) * (rank - len(vector_shape)) + tuple(vector_shape)
    vector_axes = [a for a in range(rank - 1) if not _is_one(padded_vector[a])]
    if hidden != rank - 1 or any(
        a not in batch_axes or not _same(padded_vector[a], shape[a]) for a in vector_axes
    ):
        raise NoMatch(
            f"the score vector of shape {list(vector_shape)} varies along other axes than "
            "the batch's"
        )
    return Heads(vector_axes=tuple(vector_axes))


def _key_terms_of(graph: fx.Graph, keys: list[fx.Node], biases: list, split_nodes: list):
    """(the key terms, each with its location source where the kernels can form it (only beside
    one other key term: a memory projection plus a location term), the bias terms). A location
    term whose dense layer has a bias (SpeechBrain's ``mlp_loc``) is split: the bias joins the
    sum's biases (the split's new node goes to ``split_nodes``)."""
    if len(keys) != 2:
        return tuple(KeyTerm(node=key) for key in keys), biases
    terms = []
    for key in keys:
        source = _location_source(key, with_bias=True)
        if source is not None and _arg(key, 2, "bias") is not None:
            split = _split_linear_bias(graph, key)
            if split is None:
                source = None
            else:
                key, bias = split
                split_nodes.append(key)
                biases = [*biases, bias]
        terms.append(KeyTerm(node=key, location=source))
    return tuple(terms), biases


def _check_mask(step: Mask, query_axes: list[int]) -> None:
    mask, origin, at_shape = step.mask, step.origin, step.at_shape
    mask_shape = _shape(mask)
    if mask_shape is None or len(mask_shape) > len(origin):
        raise NoMatch(f"a mask of shape {mask_shape} on scores of shape {list(at_shape)}")
    mask_shape = (1,) * (len(origin) - len(mask_shape)) + mask_shape
    if any(isinstance(axis, tuple) for axis in origin):
        raise NoMatch("a mask on scores whose axes were merged")
    for size, axis in zip(mask_shape, origin, strict=True):
        if axis in query_axes and not _is_one(size):
            raise NoMatch("the mask varies along a query axis")


def _location_source(term: fx.Node, with_bias: bool = False):
    """The location source of ``term`` (see :class:`LocationSource`) where it is one; else None.
    ``with_bias``: the dense layer may have a bias (the caller splits it off)."""
    if not _is(term, _LINEAR):
        return None
    if _arg(term, 2, "bias") is not None and not with_bias:
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
    if len(swap.users) != 1:
        return None
    if _is(conv, {"squeeze"}) and len(conv.users) == 1:  # a Conv2d over [B, Cin, 1, T]
        return _conv2d_location(conv, dense)
    if not _is(conv, {torch.conv1d, F.conv1d}) or len(conv.users) != 1:
        return None
    weight = _arg(conv, 1, "weight")
    shape = _shape(weight)
    if shape is None or len(shape) != 3 or not _same_padding(conv, shape[2], 0):
        return None
    return LocationSource(features=_arg(conv, 0, "input"), conv_weight=weight, dense_weight=dense)


def _conv2d_location(squeeze: fx.Node, dense: fx.Node):
    """ESPnet's form: linear(conv2d(features [B, Cin, 1, T], weight [C, Cin, 1, K], padding
    (0, K // 2)).squeeze(2).transpose(1, 2)); the kernels take the Conv2d's weight as it is and
    the features as [B, Cin, T] (:class:`~.key_terms._LocationTerm`)."""
    if len(squeeze.args) != 2 or squeeze.args[1] not in (2, -2):
        return None
    conv = squeeze.args[0]
    if not _is(conv, {torch.conv2d, F.conv2d}) or len(conv.users) != 1:
        return None
    weight, features = _arg(conv, 1, "weight"), _arg(conv, 0, "input")
    shape, in_shape = _shape(weight), _shape(features)
    if shape is None or len(shape) != 4 or shape[2] != 1:
        return None
    if in_shape is None or len(in_shape) != 4 or not _is_one(in_shape[2]):
        return None
    if not _same_padding(conv, shape[3], 1):
        return None
    return LocationSource(features=features, conv_weight=weight, dense_weight=dense)


def _same_padding(conv: fx.Node, width, rows: int) -> bool:
    """A bias-free conv of odd ``width`` with stride 1, dilation 1, one group and the output as
    long as the input (a Conv2d: ``rows`` = 1, one row of height 1, no padding along it)."""
    if _arg(conv, 2, "bias") is not None or not isinstance(width, int) or width % 2 == 0:
        return False
    if _arg(conv, 6, "groups", 1) != 1:
        return False
    axes = rows + 1
    padding = _arg(conv, 4, "padding", 0)
    if padding != "same" and _per_axis(padding, axes) != [0] * rows + [width // 2]:
        return False
    ones = [1] * axes
    return (
        _per_axis(_arg(conv, 3, "stride", 1), axes) == ones
        and _per_axis(_arg(conv, 5, "dilation", 1), axes) == ones
    )


def _per_axis(value, axes: int) -> list | None:
    """A conv argument (one int, or one per axis) as a list of ``axes`` values; None if neither."""
    if isinstance(value, int):
        return [value] * axes
    value = list(value) if isinstance(value, (list, tuple)) else []
    return value if len(value) == axes else None


def find_matches(graph: fx.Graph) -> tuple[list[Plan], list[str]]:
    """(the plan of each additive attention in ``graph``, why each other tanh is not one); the
    graph passes (passes.py) run first."""
    _functionalize_arithmetic(graph)
    _broadcasts_as_expands(graph)
    _drop_max_shifts(graph)
    _drop_views_of_the_tanh_to_its_shape(graph)
    _tanh_before_flattening(graph)  # (first: a flattened sum is not rows, for the next)
    _unflatten_rows(graph)
    _unflatten_projection(graph)
    plans, misses = [], []
    for node in list(graph.nodes):
        if not _is(node, _TANH):
            continue
        try:
            plan = _match_at(graph, node)
            _check_not_written(node)
            plans.append(plan)
        except NoMatch as exc:
            misses.append(str(exc))
    return plans, misses
