"""The key side of a match, as the replacement computes it at run time.

At run time a key term that is a pure function of the graph's inputs (a projection of the
memory, its layout) is computed once while those inputs stay the same objects (a decoder's steps;
:class:`~seq2seq_fast.nn.keycache.ProjectionCache`), its gradient gathered once per sequence
(:class:`~seq2seq_fast.nn.stepwise.StepwiseMemory`); a bias-free conv + dense location term goes
to the location-aware steps (keys formed inside the kernel, ``_location.py``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from seq2seq_fast.nn.convert.traced.nodes import _ancestors
from seq2seq_fast.nn.convert.traced.plan import Plan
from seq2seq_fast.nn.keycache import ProjectionCache
from seq2seq_fast.ops._torch_private import nn_linear

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
    F.conv2d,
    torch.conv2d,
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


class _LocationTerm:
    """A location term (see :class:`~seq2seq_fast.nn.convert.traced.plan.LocationSource`), formed inside the kernels where a
    decoder's training steps allow, else by the same ops as the original."""

    __slots__ = ("features", "conv_weight", "dense_weight")

    def __init__(self, features: Tensor, conv_weight: Tensor, dense_weight: Tensor) -> None:
        if features.dim() == 4:  # a Conv2d's [B, Cin, 1, T] (its weight [C, Cin, 1, K] as it is)
            features = features.squeeze(2)
        self.features, self.conv_weight, self.dense_weight = features, conv_weight, dense_weight

    def shape(self) -> tuple:
        return (self.features.shape[0], self.features.shape[2], self.dense_weight.shape[0])

    def value(self) -> Tensor:
        weight = self.conv_weight
        weight = weight.reshape(weight.shape[0], -1, weight.shape[-1])  # a Conv2d's: [C, Cin, K]
        conv = F.conv1d(self.features, weight, padding=weight.shape[-1] // 2)
        return F.linear(conv.transpose(1, 2), self.dense_weight)


def _location_term(features, conv_weight, dense_weight) -> _LocationTerm:
    return _LocationTerm(features, conv_weight, dense_weight)


_location_term.__name__ = "location_key_term"


def _key_terms(graph: fx.Graph, plan: Plan, before: fx.Node) -> list[fx.Node]:
    """One node per key term, inserted before ``before``: a location term the kernels form, a
    term computed from the graph's inputs by the replacement (and cached), or the graph's own
    value."""
    terms, on_the_path = [], None
    with graph.inserting_before(before):
        for key in plan.terms.keys:
            if key.location is not None:
                location = key.location
                parts = (location.features, location.conv_weight, location.dense_weight)
                terms.append(graph.call_function(_location_term, parts))
                continue
            # a term the graph keeps (stores on the module, returns, uses elsewhere) is computed
            # by the graph anyway: computing it again here would make a second projection (and a
            # second backward through it) where later steps read the graph's
            if on_the_path is None:
                on_the_path = set(_ancestors(plan.site.tanh))
            escapes = any(user not in on_the_path for user in key.node.users)
            found = None if escapes else _key_function(graph, key.node)
            if found is None:
                terms.append(graph.call_function(_wrap_plain, (key.node,)))
            else:
                function, inputs = found
                terms.append(graph.call_function(_Bound(KeyTerm(function)), tuple(inputs)))
    return terms
