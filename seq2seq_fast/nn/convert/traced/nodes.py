"""The graph's vocabulary: which calls are which op, a node's example value and shape, and
small helpers shared by the pattern, the graph passes and the key terms."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from seq2seq_fast.ops._torch_private import nn_linear

# a masked_fill value at or below this takes the position out of the softmax exactly (exp underflows
# to zero in float32 and float64 below about -104 and -745)
MASK_FILL_MAX = -1e4
# the miss of scores cast down and back: exact in the lower dtype only (see runtime._probe)
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
    "t",
    "flatten",
    torch.flatten,
    torch.squeeze,
    torch.unsqueeze,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.t,
}
_MASKED_FILL = {"masked_fill", torch.masked_fill}
_REPEATS = {"repeat", "expand", "expand_as"}
_WHERE = {torch.where}
_NEW_FULL = {"new_full"}
# made from the scores' shape, dtype and device only (a fill of the scores' shape for a where)
_LIKE = {torch.ones_like, torch.full_like, torch.zeros_like}
_CASTS = {"float", "double", "half", "bfloat16", "to", "type_as"}
_SIZES = {"size", "dim"}


class NoMatch(Exception):
    """The graph around a tanh is not the op's form; the message says where it differs."""


# the miss of a graph that ends between the scores and the normaliser (TorchDynamo stopped there:
# a graph break, e.g. at ``int(lengths.max())``); the runtime traces such a module again with
# scalars captured (see runtime.py)
SCORES_LEAVE_THE_GRAPH = (
    "the traced graph ends between the scores and the softmax (TorchDynamo stopped there: a graph "
    "break in the forward, such as a Python loop or an if over a tensor's values, or a .item())"
)


def _is(node: object, targets: set) -> bool:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    try:
        return node.target in targets
    except TypeError:  # an unhashable target
        return False


def op_name(node: fx.Node) -> str:
    """A node's call as a reader knows it ('tanh', 'torch.nn.functional.relu', 'mul'), not the
    repr of a builtin ('<built-in method tanh of type object at 0x...>')."""
    target = node.target
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None)
    if name is None:
        return repr(target)
    owner = getattr(target, "__module__", None) or ""
    return f"{owner}.{name}" if owner.startswith("torch.") else name


def _described(value: object) -> str:
    """A multiplier or operand for a message: a tensor's shape, else the number or object."""
    shape = _shape(value)
    if shape is not None:
        return f"a tensor of shape {shape}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return f"{type(value).__name__} {value}"


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
        raise NoMatch(f"{what} is used {len(users)} times (the fused op gives no inner value)")
    return users[0]


def _inert_dropout(node: fx.Node) -> bool:
    """``F.dropout(x, p, training, inplace)`` that returns its input: p a constant 0 (TorchDynamo
    specialises ``nn.Dropout(0.0)`` so; a p > 0 arrives as a tensor and is not inert) or training
    a constant False (the module in eval mode). An active dropout keeps the graph's product."""
    if not _is(node, {torch.nn.functional.dropout}):
        return False
    names = ("input", "p", "training", "inplace")
    given = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    p, training = given.get("p", 0.5), given.get("training", True)
    return (isinstance(p, (int, float)) and p == 0) or training is False


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


def _size_hint(size) -> int | None:
    """A size as an int: itself, or the value TorchDynamo traced a symbolic size at."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None and node.has_hint() else None
    return int(hint) if hint is not None else None


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


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _single(value) -> int | None:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None
