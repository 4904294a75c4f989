"""Graph passes run before matching: in-place arithmetic made out of place, and rows
flattened into one axis split back (see each section)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from seq2seq_fast.nn.convert.traced.nodes import (
    _ADDS,
    _LINEAR,
    _REPEATS,
    _SHAPE_OPS,
    _SOFTMAX,
    _SUBS,
    _TANH,
    NoMatch,
    _ancestors,
    _arg,
    _is,
    _is_one,
    _same,
    _shape,
    _size_hint,
    _terms,
    _value,
    op_name,
)

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


# tensors made from shapes only: written in place before the tanh (a state started as
# x.data.new(1, B, H).zero_(), DA-RNN's), they are what the graph's ops read after the write in
# the rewritten graph as in the original
_FRESH = {
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
}


def _fresh(node: fx.Node) -> bool:
    """``node`` makes a tensor from sizes only (x.new(1, B, H) with sizes, not x.new(data))."""
    if _is(node, _FRESH):
        return True
    if not _is(node, {"new"}):
        return False
    return not any(isinstance(_value(a), torch.Tensor) for a in node.args[1:])


def _check_not_written(tanh: fx.Node) -> None:
    """NoMatch where a tensor the tanh's sum is made from was written in place before the tanh:
    the rewrite forms the sum from its terms, and would miss what the write added."""
    order = {node: i for i, node in enumerate(tanh.graph.nodes)}
    for node in _ancestors(tanh):
        if _fresh(node):  # made from no values (a zero state, new(...).zero_()): never
            continue  # recomputed by the rewrite, and its writes come before the tanh reads it
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
                        f"{node.name} is written in place ({op_name(user)}) before the tanh reads it"
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
    rows = _linear_of_rows(graph, term, sizes)
    if rows is not None:
        return rows
    if _is(node, _FLAT_VIEWS) and isinstance(node.args[0], fx.Node):
        inner = node.args[0]
        if _is(inner, {"contiguous"}) and len(inner.users) == 1:
            inner = inner.args[0]
        shape = _shape(inner)
        if _is(inner, _REPEATS) and shape is not None and len(shape) == 3:
            source = inner.args[0] if isinstance(inner.args[0], fx.Node) else None
            source_shape = _shape(source) if source is not None else None
            # expanded along T (batch first: [B, 1, A]) or, time first, along the leading
            # axis ([1, B, A], MORAN's h2h(h).view(1, B, H).expand(T, B, H)); the traced sizes
            # compared by value (the split's are expressions in the flat size's symbols)
            if (
                source_shape is not None
                and len(source_shape) == 3
                and _same(source_shape[2], shape[2])
                and all(
                    _size_hint(a) == _size_hint(b)
                    for a, b in zip(shape[:2], sizes[:2], strict=True)
                )
                and any(
                    _is_one(source_shape[axis]) and _same(source_shape[1 - axis], shape[1 - axis])
                    for axis in (0, 1)
                )
            ):
                return source
    new = graph.call_method("unflatten", (term, 0, (-1, frames)))
    new.meta["example_value"] = _value(term).unflatten(0, sizes[:2])
    return new


def _linear_of_rows(graph: fx.Graph, term: fx.Node, sizes: tuple) -> fx.Node | None:
    """``linear(x.view(-1, D), W, c)`` with x [B, T, D] (``sizes``' B and T, as traced): the
    same linear map on x itself, [B, T, A] (DA-RNN's ``attn_layer(x.view(-1, D))`` over a cat of
    the repeated state and the encoded inputs); else None."""
    if not _is(term, _LINEAR) or term.kwargs or len(term.args) < 2:
        return None
    flat = term.args[0]
    if not (isinstance(flat, fx.Node) and _is(flat, _FLAT_VIEWS) and len(flat.users) == 1):
        return None
    source = flat.args[0] if flat.args else None
    shape = _shape(source) if isinstance(source, fx.Node) else None
    if shape is None or len(shape) != 3 or flat.kwargs:
        return None
    if not all(_size_hint(a) == _size_hint(b) for a, b in zip(shape[:2], sizes[:2], strict=True)):
        return None
    new = graph.call_function(term.target, (source, *term.args[1:]))
    new.meta["example_value"] = term.target(
        *[_value(a) if isinstance(a, fx.Node) else a for a in new.args]
    )
    return new


def _drop_views_of_the_tanh_to_its_shape(graph: fx.Graph) -> None:
    """A view or reshape of a tanh to the tanh's own shape (MORAN's ``tanh(...).view(-1, H)`` of
    [N, H] rows) is the tanh itself: its readers read the tanh."""
    for tanh in [n for n in graph.nodes if _is(n, _TANH)]:
        shape = _shape(tanh)
        for view in list(tanh.users):
            if not _is(view, _FLAT_VIEWS) or view.args[0] is not tanh or view.kwargs:
                continue
            out = _shape(view)
            if shape is None or out is None or len(out) != len(shape):
                continue
            if all(_same(a, b) for a, b in zip(out, shape, strict=True)):
                view.replace_all_uses_with(tanh)
                graph.erase_node(view)


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
        # (to [B, T], or to [B, T, 1]: ExplorerFreda's self-attentive encoder's
        # ``ws2(tanh(ws1(x.view(-1, D)))).view(B, T, -1)``)
        kept = len(out) == 3 and _is_one(out[2])
        if len(out) != 2 and not kept or _is_one(out[1]) or split.kwargs:
            continue
        asked = split.args[1:]
        if len(asked) == 1 and isinstance(asked[0], (list, tuple)):
            asked = asked[0]
        frames = asked[1] if len(asked) == len(out) else None
        if frames is None or frames == -1:
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
            new_split = new_scores  # [B, T, 1]
            if not kept:  # -> [B, T]
                new_split = graph.call_method("squeeze", (new_scores, -1))
                new_split.meta["example_value"] = _value(new_scores).squeeze(-1)
        split.replace_all_uses_with(new_split)
        graph.erase_node(split)
        for node in (projection, tanh):  # the flat forms, dead now
            if not node.users:
                graph.erase_node(node)
        _erase_unread(graph, inner)  # (the flat sum and its terms: a cat read once splits)


def _erase_unread(graph: fx.Graph, node: object) -> None:
    """``node`` and then its inputs, as long as nothing reads them (pure nodes only: the sums,
    views and linear maps a pass above formed again)."""
    if not isinstance(node, fx.Node) or node.users:
        return
    if node.op not in ("call_function", "call_method") or str(node.target).endswith("_"):
        return  # (not an in-place add_)
    if not (_is(node, _ADDS) or _is(node, _FLAT_VIEWS) or _is(node, _LINEAR)):
        return
    inputs = list(node.all_input_nodes)
    graph.erase_node(node)
    for a in inputs:
        _erase_unread(graph, a)


def _tanh_before_flattening(graph: fx.Graph) -> None:
    """tanh of a [N, A] view of a [..., A] tensor of rank 3 or more (the sum flattened into rows,
    then the tanh: eladhoffer/seq2seq.pytorch's ``tanh(sum_qk.view(b * t_k * t_q, n))``): the
    tanh taken before the view, which is the same elementwise, so that the flat projection's
    pass below and the match see the tanh of the sum itself."""
    for tanh in [n for n in graph.nodes if _is(n, _TANH)]:
        flat = tanh.args[0] if len(tanh.args) == 1 and not tanh.kwargs else None
        if not isinstance(flat, fx.Node) or not _is(flat, _FLAT_VIEWS) or len(flat.users) != 1:
            continue
        source = flat.args[0] if flat.args else None
        shape, flat_shape = _shape(source), _shape(flat)
        if not isinstance(source, fx.Node) or shape is None or flat_shape is None:
            continue
        if len(shape) < 3 or len(flat_shape) != 2 or not _same(flat_shape[1], shape[-1]):
            continue
        with graph.inserting_before(tanh):
            inner = graph.call_function(torch.tanh, (source,))
            inner.meta["example_value"] = torch.tanh(_value(source))
            args = (inner, *flat.args[1:])
            if flat.op == "call_method":
                view = graph.call_method(flat.target, args, dict(flat.kwargs))
            else:
                view = graph.call_function(flat.target, args, dict(flat.kwargs))
            view.meta["example_value"] = _value(tanh)
        tanh.replace_all_uses_with(view)
        graph.erase_node(tanh)
        graph.erase_node(flat)


def _unflatten_projection(graph: fx.Graph) -> None:
    """tanh [B, T, A] viewed flat to [B*T, A], projected onto one vector, and viewed back to
    [B, T] or [B, T, 1] (self-critical.pytorch's ``Attention`` and its many copies:
    ``alpha_net(dot.view(-1, A)).view(-1, T)``): the projection made on the tanh itself and
    squeezed, the back view's readers reading that. Row-major views, so the same rows; anything
    else (another grouping, a projection to several outputs) is left as it is."""
    for tanh in [n for n in graph.nodes if _is(n, _TANH)]:
        shape = _shape(tanh)
        if shape is None or len(shape) < 3 or len(tanh.users) != 1:
            continue
        flat = next(iter(tanh.users))
        flat_shape = _shape(flat)
        if not _is(flat, _FLAT_VIEWS) or flat.args[0] is not tanh or flat.kwargs:
            continue
        if flat_shape is None or len(flat_shape) != 2 or not _same(flat_shape[1], shape[-1]):
            continue
        if len(flat.users) != 1:
            continue
        projection = next(iter(flat.users))
        weight = _arg(projection, 1, "weight")
        weight_shape = _shape(weight)
        if not (_is(projection, _LINEAR) and _arg(projection, 0, "input") is flat):
            continue
        if weight_shape is None or len(weight_shape) != 2 or not _is_one(weight_shape[0]):
            continue
        if len(projection.users) != 1:
            continue
        back = next(iter(projection.users))
        out = _shape(back)
        if not _is(back, _FLAT_VIEWS) or back.args[0] is not projection or back.kwargs:
            continue
        if out is None:
            continue
        # (back to [B, T], or to [B, T, 1]: the projection's own shape, soobinseo/Tacotron's
        # ``v(tanh(...).view(-1, H)).view(-1, T, 1)``; or to the leading axes with 1-axes put
        # elsewhere, Attention_ocr's time-major ``.view(-1, 1, B)`` of [T, B] rows: the view
        # stays, reading the projection's [T, B, 1])
        kept = len(out) == len(shape) and _is_one(out[-1])
        plain = len(out) == len(shape) - 1 or kept
        if plain and not all(
            _same(a, b) for a, b in zip(out[: len(shape) - 1], shape[:-1], strict=True)
        ):
            continue
        if not plain and not _same_but_ones(out, shape[:-1]):
            continue
        with graph.inserting_before(back):
            args = (tanh, *projection.args[1:])
            scores = graph.call_function(projection.target, args, dict(projection.kwargs))
            scores.meta["example_value"] = projection.target(
                *[_value(a) if isinstance(a, fx.Node) else a for a in args]
            )
            if kept:
                squeezed = scores
            elif plain:
                squeezed = graph.call_method("squeeze", (scores, -1))
                squeezed.meta["example_value"] = _value(scores).squeeze(-1)
        if plain:
            back.replace_all_uses_with(squeezed)
            graph.erase_node(back)
        else:
            back.replace_input_with(projection, scores)
        graph.erase_node(projection)
        graph.erase_node(flat)


def _same_but_ones(a: tuple, b: tuple) -> bool:
    """Whether two shapes are the same once their 1-axes are left out (a view between them
    moves no element)."""
    return _same_shape(tuple(d for d in a if not _is_one(d)), tuple(d for d in b if not _is_one(d)))


def _broadcasts_as_expands(graph: fx.Graph) -> None:
    """``torch.broadcast_tensors(x, q)`` read item by item, where one input already has the
    broadcast shape (JHzzzzzZ's LAS: ``cat(broadcast_tensors(x, h.view(B, 1, -1)), -1)``): that
    input itself, and each other one ``expand_as`` it, the form the key terms see through (a
    query expanded over the keys)."""
    for node in [n for n in graph.nodes if n.op == "call_function"]:
        if node.target is not torch.broadcast_tensors or node.kwargs:
            continue
        inputs = list(node.args)
        shapes = [_shape(a) if isinstance(a, fx.Node) else None for a in inputs]
        items = list(node.users)
        if any(s is None for s in shapes) or not all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
            for u in items
        ):
            continue
        out = _shape(items[0]) if items else None
        full = next(
            (
                a
                for a, s in zip(inputs, shapes, strict=True)
                if out is not None and _same_shape(s, out)
            ),
            None,
        )
        if full is None:
            continue
        for item in items:
            source = inputs[item.args[1]]
            if source is full:
                item.replace_all_uses_with(full)
            else:
                with graph.inserting_before(item):
                    expanded = graph.call_method("expand_as", (source, full))
                    expanded.meta["example_value"] = _value(item)
                item.replace_all_uses_with(expanded)
            graph.erase_node(item)
        graph.erase_node(node)


def _same_shape(a: tuple, b: tuple) -> bool:
    """Whether two shapes (of ints or TorchDynamo's sizes) are the same."""
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _drop_max_shifts(graph: fx.Graph) -> None:
    """``softmax(e - e.max(d, keepdim=True)[0], d)`` (or ``amax``, the max detached): the shift a
    softmax over d cancels (the stability idiom of hand-written masked softmaxes, kenchan's
    keyphrase-generation-rl): the softmax reads e itself, as its own max shift is built in."""
    for softmax in [n for n in graph.nodes if _is(n, _SOFTMAX)]:
        shifted = _arg(softmax, 0, "input")
        if not (_is(shifted, _SUBS) and len(shifted.args) == 2 and len(shifted.users) == 1):
            continue
        scores, top = shifted.args
        while isinstance(top, fx.Node) and _is(top, {"detach"}):
            top = top.args[0]
        dim = _max_dim_of(top, scores)
        shape = _shape(softmax)
        if dim is None or shape is None:
            continue
        asked = _arg(softmax, 1, "dim")
        if not isinstance(asked, int) or asked % len(shape) != dim % len(shape):
            continue
        softmax.replace_input_with(shifted, scores)
        chain = [shifted]  # the subtraction, then the max and what it passed, as none reads them
        node = shifted.args[1]
        while isinstance(node, fx.Node) and node is not scores:
            chain.append(node)
            node = node.args[0] if node.args else None
        for dead in chain:
            if not dead.users:
                graph.erase_node(dead)


def _max_dim_of(node: object, scores: fx.Node) -> int | None:
    """d where ``node`` is ``scores.max(d, keepdim=True)[0]`` or ``scores.amax(d, keepdim=True)``;
    else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]
        if not _is(node, {torch.max, "max"}):
            return None
    elif not _is(node, {torch.amax, "amax"}):
        return None
    if _arg(node, 0, "input") is not scores or not _arg(node, 2, "keepdim", False):
        return None
    dim = _arg(node, 1, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return dim if isinstance(dim, int) else None
