"""The converter's family interface: one :class:`Layout` record per attention layout, a registry.

Adding a layout touches one file: a module ``seq2seq_fast/nn/convert/<family>.py`` (its name not
starting with ``_``) that defines the stand-in (none for a thin matcher, below) and calls
:func:`register` at import time. The package imports every such module when it loads, so nothing
else needs editing (except the tests).

A :class:`Layout` has

- ``name``: short and unique, e.g. ``"tutorial"``; it names the layout in reports and logs.
- ``match(module) -> bool``: cheap structural test (child names, types, shapes, class name). It
  must not run the module. A class-name match should also require that ``forward`` is the
  original class's own (:func:`forward_defined_in`), so that a subclass changing it is not taken.
- ``build(module, backend) -> nn.Module``: the stand-in. It holds the *same* Parameter objects
  under the same attribute names (so ``state_dict`` keys and optimisers stay valid), copies any
  extra state the original carries (masks, cached projections, flags), keeps the call signature,
  shapes and return values, and subclasses :class:`FusedStandIn` (so it is never converted again).
- ``example_call(module, dtype) -> (args, kwargs)``: a small random, valid call of ``module`` with
  floating tensors of ``dtype`` on the CPU (two or three batch rows, a few keys, some padding
  when the layout takes a mask or lengths). The safety check runs the original and the stand-in
  on it; use the global RNG (the check seeds it inside :func:`forked_random`).
- optional ``prepare(module, args, kwargs)``: state to set on each module before the example call
  (e.g. GNMT's ``set_mask``); called on the original and on the stand-in alike.
- optional ``unsupported(module) -> str | None``: why a module that matches cannot be converted
  exactly (e.g. sigmoid normalisation, dropout on the weights in training); it is then skipped
  with that reason.
- ``traced``: a *thin matcher*, no stand-in of its own (``build=None``). A module it matches is
  handed at once to the general path's runtime (:mod:`~seq2seq_fast.nn.convert.traced.runtime`:
  the same trace, pattern, typed plan, rewrite, float64 probe and in-place class swap a watched
  module gets at its first call), with ``example_call`` (after ``prepare``, on a copy) as that
  first call. It is reported as replaced "as '<name>' through the traced runtime", or skipped
  with the runtime's reason. The module object stays (its class becomes a traced subclass of
  its own), so hooks keep running and the probe runs whatever ``check`` says. A layout is thin
  where the traced path is as fast as a stand-in would be (bench/RESULTS.md, "Which named
  layouts stay, and why"); only the match and the example call are its own.

A stand-in whose project's call convention the traced path would run slower (JoeyNMT's
``compute_proj_keys``, OpenNMT-py's lengths, the tutorial's steps: no TorchDynamo guards per
call) still hands its attention to that runtime: it builds the typed plan from the module's
structure (:class:`~seq2seq_fast.nn.convert._planned.PlannedAttention`), and its own code is the
call convention only.

The safety check of a named layout (:func:`check_equivalent`) runs a float64 CPU deep copy of the original and the
stand-in built from a second such copy on ``example_call``'s input (same RNG state for both, so
dropout draws agree when the stand-in draws the same way), and compares every output and the
gradients of a random projection of the outputs with respect to every parameter and tensor input.
Any difference refuses the conversion: a look-alike (same children, other math) is left alone.

Stand-ins whose client re-projects a fixed memory at every step use
:class:`seq2seq_fast.nn.keycache.ProjectionCache` (see its docstring).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.attention import check_backend
from seq2seq_fast.ops._library import fused_available
from seq2seq_fast.ops._torch_private import global_module_hooks, pytree


class FusedStandIn(nn.Module):
    """Base class of the converter's stand-ins (the converter never converts one again).
    ``layout`` names the :class:`Layout` that built it; ``backend`` ("auto", "fused" or
    "reference", checked here) is what its attention calls run through.

    A stand-in reads some of its parts' weights directly (a score layer's, a location conv's)
    instead of calling them. So that a change made to the parts after the conversion is never
    lost (a hook, ``torch.nn.utils.prune``'s, a parametrization such as spectral_norm, a child
    replaced by a LoRA wrapper or given an adapter), each call first checks that every part is
    as it was converted (:meth:`keep_parts`); where one is not, the call runs the original
    class's own ``forward`` on the stand-in's state, unfused, and says so once."""

    layout: str = ""

    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        self.backend = check_backend(backend)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # forward, and the other methods of the project's call convention a stand-in defines
        # (JoeyNMT's compute_proj_keys, ESPnet's reset, Coqui's init_states, ...)
        for name, method in list(cls.__dict__.items()):
            if isinstance(method, types.FunctionType) and not name.startswith("_"):
                setattr(cls, name, _guarded(name, method))

    def keep_parts(self, original_class: type) -> None:
        """Record the parts as they are now, and the class whose ``forward`` runs where they
        change (the converter calls this after building the stand-in)."""
        self.__dict__["_original_class"] = original_class
        self.__dict__["_parts"] = _parts_now(self)

    def _parts_changed(self) -> bool:
        parts = self.__dict__.get("_parts")
        if parts is None or torch.compiler.is_compiling():
            return False
        hooks, children, entries = parts
        if hooks != global_module_hooks() or self._modules != children:
            return True
        for module, cls, children, forward_hooks, pre_hooks in entries:
            if (
                module.__class__ is not cls
                or module._modules != children
                or module._forward_hooks != forward_hooks
                or module._forward_pre_hooks != pre_hooks
            ):
                return True
        return False

    def _original_method(self, name: str, *args, **kwargs):
        """The original class's method ``name`` on this stand-in's state (the very
        ``__dict__``: parameters, buffers, children and plain attributes, so what it writes the
        stand-in keeps)."""
        original = self.__dict__["_original_class"]
        if not self.__dict__.get("_said_parts_changed"):
            self.__dict__["_said_parts_changed"] = True
            warnings.warn(
                f"fuse_attention: a part of a converted {original.__qualname__} changed after "
                "the conversion (a hook, pruning, a parametrization, a child replaced or added): "
                "it runs the original's own code from now on, unfused. Make such changes before "
                "fuse_attention to have it fused",
                stacklevel=3,
            )
        view = object.__new__(original)
        object.__setattr__(view, "__dict__", self.__dict__)
        return getattr(original, name)(view, *args, **kwargs)


# The class of each (stand-in class, original class): a stand-in that is an instance of the
# project's class too (a memo, not state; one class per pair keeps pickling stable).
_AS_ORIGINAL: dict[tuple[type, type], type] = {}


def as_original(stand_in: FusedStandIn, original: type) -> None:
    """Make ``stand_in`` an instance of ``original`` as well: its class becomes a subclass of both
    (the stand-in's methods first, then the original's), so that code dispatching on the
    project's class (ESPnet2's ``calculate_all_attentions``: ``isinstance(m, AttLoc)``) still
    finds it, and the original's other methods are there. Left as it is where Python cannot
    make such a class (a layout conflict, another metaclass)."""
    cls = type(stand_in)
    if issubclass(cls, original):
        return
    key = (cls, original)
    if key not in _AS_ORIGINAL:
        try:
            new = type(
                cls.__name__,
                (cls, original),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
            )
        except TypeError:
            return
        # (set after the class is made: __init_subclass__ guards public methods it defines)
        new.__reduce_ex__ = _reduce_as_original
        new._fuse_attention_pair = (cls, original)
        new.extra_repr = cls.extra_repr  # (the stand-in's, not the original's: other state)
        _AS_ORIGINAL[key] = new
    stand_in.__class__ = _AS_ORIGINAL[key]


def _reduce_as_original(self, protocol):
    """Pickles and deep copies name the two importable classes and rebuild the pair's class."""
    state = object.__reduce_ex__(self, protocol)[2]
    return (_rebuild_as_original, type(self)._fuse_attention_pair, state)


def _rebuild_as_original(cls: type, original: type) -> nn.Module:
    """An empty stand-in of the pair's class (pickle then sets its state)."""
    module = object.__new__(cls)
    as_original(module, original)
    return module


# Attributes every nn.Module has (_parameters, _buffers, _modules, hooks); everything else in a
# module's __dict__ is its own state.
MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _guarded(name: str, method: Callable) -> Callable:
    """``method`` of a stand-in, or the original class's ``name`` where the stand-in's parts
    changed since the conversion (see :class:`FusedStandIn`)."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        original = self.__dict__.get("_original_class")
        if original is not None and hasattr(original, name) and self._parts_changed():
            return self._original_method(name, *args, **kwargs)
        return method(self, *args, **kwargs)

    return guarded


def _parts_now(stand_in: nn.Module) -> tuple:
    """The module-wide hooks, the stand-in's children, and each part's class, children and
    hooks (the stand-in's own hooks run in its own call)."""
    entries = []
    for module in stand_in.modules():
        if module is not stand_in:
            entries.append(
                (
                    module,
                    module.__class__,
                    dict(module._modules),
                    dict(module._forward_hooks),
                    dict(module._forward_pre_hooks),
                )
            )
    return global_module_hooks(), dict(stand_in._modules), entries


@contextlib.contextmanager
def forked_random(devices=(), seed: int | None = None):
    """torch's random state (the CPU's and ``devices``' CUDA ones), Python's ``random`` and
    numpy's global state as they were, afterwards; seeded with ``seed`` inside, if given. A
    forward may draw from any of them (MORAN's fractional pickup draws from numpy's): the
    converter's checks run the original and the candidate on the same draws, and its own calls
    leave the user's draws where they were."""
    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=list(devices)):
            if seed is not None:
                torch.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@dataclass(frozen=True)
class Layout:
    """One attention layout the converter recognises (see the module docstring)."""

    name: str
    match: Callable[[nn.Module], bool]
    build: Callable[[nn.Module, str], nn.Module] | None
    example_call: Callable[[nn.Module, torch.dtype], tuple[tuple, dict]]
    prepare: Callable[[nn.Module, tuple, dict], None] | None = None
    unsupported: Callable[[nn.Module], str | None] | None = None
    traced: bool = False  # a thin matcher: no stand-in, the traced runtime converts it at once

    def __post_init__(self) -> None:
        if self.traced != (self.build is None):
            raise ValueError(
                f"layout {self.name!r}: a traced layout (traced=True) has build=None and a "
                f"named one has a build; got traced={self.traced}, build={self.build!r}"
            )


_REGISTRY: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    """Add ``layout`` to the registry (its name must be new); returns it."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
    if layout.name in _REGISTRY and _REGISTRY[layout.name] is not layout:
        raise ValueError(f"a layout named {layout.name!r} is already registered")
    _REGISTRY[layout.name] = layout
    return layout


def registered_layouts() -> list[Layout]:
    """The registered layouts, in registration order."""
    return list(_REGISTRY.values())


# --- report ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replaced:
    path: str  # dotted name in the model, as named_modules() gives it
    layout: str
    original: str  # the original module's class, module.qualname
    # a thin matcher's conversion: what the traced runtime found ("" for a stand-in, and for the
    # general path's own conversions, whose layout already says "traced (...)")
    traced: str = ""


@dataclass(frozen=True)
class Skipped:
    path: str
    layouts: tuple[str, ...]  # the layouts that matched it
    original: str
    reason: str


@dataclass
class ConversionReport:
    """What :func:`fuse_attention_report` replaced, and what matched a layout but was left alone."""

    replaced: list[Replaced] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    # modules the general path (``traced/``) watches until their first call; it adds them to
    # ``replaced`` or ``skipped`` then
    watching: list[str] = field(default_factory=list)
    # modules that were fused before this call (an earlier fuse_attention, or seq2seq_fast's own
    # attention modules): not counted, listed so that a second call does not look like a miss
    fused_before: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.replaced)

    def __str__(self) -> str:
        lines = [f"fuse_attention: {len(self.replaced)} replaced, {len(self.skipped)} skipped"]
        lines += [
            f"  replaced {r.path} ({r.original}) as {r.layout!r}"
            + (f" through the traced runtime ({r.traced})" if r.traced else "")
            for r in self.replaced
        ]
        lines += [
            f"  skipped {s.path} ({s.original}; matched {', '.join(s.layouts)}): {s.reason}"
            for s in self.skipped
        ]
        if self.fused_before:
            lines.append(f"  already fused before this call: {', '.join(self.fused_before)}")
        if self.watching:
            lines.append(
                f"  watching {len(self.watching)} module(s) until their first call "
                f"(converted or left alone then): {', '.join(self.watching)}"
            )
        return "\n".join(lines)


# --- helpers for layouts ---------------------------------------------------------------------------


def class_name(module: object) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def forward_defined_in(module: nn.Module, *class_names: str) -> bool:
    """True when ``type(module).forward`` is defined by a class named one of ``class_names``
    (the original project's class, not a subclass that overrides forward)."""
    forward = getattr(type(module), "forward", None)
    qualname = getattr(forward, "__qualname__", "")
    return qualname.rsplit(".", 1)[0].split(".")[-1] in class_names


def with_cancelled(v: Tensor, *cancelled: Tensor | None) -> Tensor:
    """The score vector ``v`` as the op takes it, with the parameters a softmax cancels (a score
    layer's bias, a shift of every score) joined in with a zero factor where they want gradients.
    They then get a zero gradient, as in the original (where it is zero up to rounding), not
    none: DistributedDataParallel takes a parameter without a gradient for an unused one (an
    error at its next step), and AdamW skips it (no weight decay). One op per call, in training
    only; the value is ``v``'s (NaN where a cancelled parameter is not finite, as the original's
    scores are then)."""
    if not torch.is_grad_enabled():
        return v
    for extra in cancelled:
        if isinstance(extra, Tensor) and extra.requires_grad:
            v = torch.add(v, extra.reshape(()) if extra.numel() == 1 else extra.sum(), alpha=0)
    return v


def is_linear(
    module: object,
    *,
    bias: bool | None = None,
    out_features: int | None = None,
    in_features: int | None = None,
) -> bool:
    """An nn.Linear (exactly; a subclass may change forward) with the given properties."""
    if type(module) is not nn.Linear:
        return False
    if bias is not None and (module.bias is not None) != bias:
        return False
    if in_features is not None and module.in_features != in_features:
        return False
    return out_features is None or module.out_features == out_features


def own_parameter_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters(recurse=False)}


def child_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


# --- safety check ----------------------------------------------------------------------------------

CHECK_RTOL, CHECK_ATOL = 1e-7, 1e-9


def _cpu_copy(module: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    # A module that ran with gradients may hold graph tensors as state (d2l's attention_weights,
    # ESPnet's cached projection), which deepcopy refuses: the copy gets them detached.
    # (also inside lists, tuples and dicts: ESPnet's multi-head attentions keep a list per head)
    memo = {
        id(value): value.detach().clone()
        for sub in module.modules()
        for key, state in vars(sub).items()
        if key not in ("_parameters", "_buffers", "_modules")
        for value in pytree.tree_leaves(state)
        if isinstance(value, Tensor) and not value.is_leaf
    }
    return copy.deepcopy(module, memo).to(device="cpu", dtype=dtype)


def _run(module: nn.Module, layout: Layout, args: tuple, kwargs: dict, seed: int):
    """Outputs and a scalar loss-ready list of (leaf inputs) for one example call."""
    args, kwargs = pytree.tree_map(
        lambda t: (
            t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t
        ),
        (args, kwargs),
    )
    if layout.prepare is not None:
        layout.prepare(module, args, kwargs)
    # the leaves before the call: a call may append to a list it was given (ESPnet's coverage
    # attentions append their weights to att_prev_list)
    inputs = [
        t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.requires_grad
    ]
    with forked_random(seed=seed):
        out = module(*args, **kwargs)
    return out, inputs


def _gradients(module: nn.Module, out, inputs: list[Tensor], seed: int) -> dict[str, Tensor]:
    """Gradients of a random projection of the outputs, by parameter name and input position
    (None, an unused parameter, counts as zeros)."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    named = sorted((n, p) for n, p in module.named_parameters() if p.requires_grad)
    named += [(f"input {i}", t) for i, t in enumerate(inputs)]
    if not leaves or not named:
        return {}
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in leaves)
    grads = torch.autograd.grad(loss, [w for _, w in named], allow_unused=True)
    return {
        name: torch.zeros_like(w) if g is None else g
        for (name, w), g in zip(named, grads, strict=True)
    }


def _first_difference(
    a, b, what: str, rtol: float = CHECK_RTOL, atol: float = CHECK_ATOL
) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{what}: {sorted(a)} vs {sorted(b)}"
        leaves_a, leaves_b, names = list(a.values()), list(b.values()), list(a)
    else:
        leaves_a, spec_a = pytree.tree_flatten(a)
        leaves_b, spec_b = pytree.tree_flatten(b)
        if spec_a != spec_b:
            return f"{what}: structure differs ({spec_a} vs {spec_b})"
        names = list(range(len(leaves_a)))
    for i, x, y in zip(names, leaves_a, leaves_b, strict=True):
        if isinstance(x, Tensor) != isinstance(y, Tensor):
            return f"{what}[{i}]: a tensor on one side only"
        if not isinstance(x, Tensor):
            if x != y:
                return f"{what}[{i}]: {x!r} != {y!r}"
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{what}[{i}]: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            err = (x - y).abs().max().item()
            return f"{what}[{i}]: values differ (max abs difference {err:.3g})"
    return None


def check_equivalent(module: nn.Module, layout: Layout, backend: str, seed: int = 0) -> str | None:
    """None when ``layout``'s stand-in for ``module`` gives the same outputs and gradients as
    ``module`` on ``layout.example_call`` (float64 CPU copies; ``module`` is not touched); else
    why not. (A thin matcher has no stand-in: the traced runtime's probe checks its modules.)"""
    if layout.traced:
        raise ValueError(
            f"layout {layout.name!r} is a thin matcher (traced=True): it has no stand-in to check; "
            "the traced runtime's probe checks the modules it matches"
        )
    original = _cpu_copy(module)
    if backend != "reference" and not fused_available("cpu", torch.float64):
        backend = "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidate = layout.build(_cpu_copy(module), backend)
        candidate.train(module.training)
        with forked_random(seed=seed):
            args, kwargs = layout.example_call(original, torch.float64)
        results = []
        for mod in (original, candidate):
            out, inputs = _run(mod, layout, args, kwargs, seed + 1)
            results.append((out, _gradients(mod, out, inputs, seed + 2)))
    return _first_difference(results[0][0], results[1][0], "output") or _first_difference(
        results[0][1], results[1][1], "gradient"
    )
