"""The general path of ``fuse_attention``: additive attention recognised by what it computes.

After the named layouts have taken what they recognise, every other module that has parameters
(built-in ``torch.nn`` layers aside) is watched until its first call:

1. The call runs as it is, under a :class:`~torch.overrides.TorchFunctionMode` that notes every
   ``tanh`` of a sum (or of a linear map of a concatenation) and every softmax that depends on
   one. A module whose call computes such a tanh is reported; the innermost module whose call
   also holds the softmax over it is the one converted (so an energy computed in one module and
   normalised in its caller is converted at the caller).
2. When the outermost watched call has returned, the module's ``forward`` is traced by
   TorchDynamo (``torch.compile`` with a backend of ours, dynamic shapes): real code with
   keyword arguments, branches on ``None`` and on shapes, helper methods and child modules all
   trace. In the graph, :mod:`~seq2seq_fast.nn.convert._traced_graph` finds the sum, tanh,
   projection, scale, masks and softmax and replaces that subgraph by the fused op; the rest of
   the graph stays.
3. The probe decides: float64 CPU copies of the module, the original and the traced one, run on
   the first call's arguments; every output and the gradients of every parameter and input must
   agree. (A module that cannot run in float64 because it casts to float32 itself, while its own
   call ran in float32, is probed in float32 with float32's tolerances; the report says so.)
   Only then is the module converted, in place: its class becomes a subclass of its own
   whose ``forward`` is the traced one (same object, same parameters, same state_dict keys).

The work is done once per module (a trace, a float64 probe); later calls run the compiled graph
(TorchDynamo's guards, then eager autograd through the graph; a new shape or grad mode may trace
once more). What was found for each watched module goes into the :class:`ConversionReport` that
``fuse_attention_report`` returned, as the calls happen (:attr:`ConversionReport.watching` lists the
modules not called yet).
"""

from __future__ import annotations

import itertools
import logging
import threading
import types
import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from seq2seq_fast.nn.convert._base import (
    ConversionReport,
    FusedStandIn,
    Replaced,
    Skipped,
    _cpu_copy,
    _first_difference,
    _gradients,
    class_name,
)
from seq2seq_fast.nn.convert._traced_graph import (
    ROUNDED_SCORES,
    TracedWeights,
    find_matches,
    rewrite,
)
from seq2seq_fast.ops import fused_available
from seq2seq_fast.ops._torch_private import dynamo_config, pytree

logger = logging.getLogger(__name__)

LAYOUT = "traced"
_ADD_NAMES = {"add", "__add__", "__radd__", "add_", "__iadd__"}
_CAT_NAMES = {"cat", "concat", "concatenate"}
# (sigmoid: the "smoothing" sigmoid(e) / sum sigmoid(e); the graph match checks the division)
_SOFTMAX_NAMES = {"softmax", "_softmax", "log_softmax", "sigmoid"}
# ops through which energies stay energies on their way to a softmax (a projection, shape ops,
# scale, masks, a dtype change); anything else ends them
_CARRIES = {
    "linear",
    "matmul",
    "__matmul__",
    "bmm",
    "einsum",
    "mul",
    "__mul__",
    "__rmul__",
    "sum",
    "squeeze",
    "unsqueeze",
    "view",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "flatten",
    "masked_fill",
    "masked_fill_",
    "where",
    "add",
    "__add__",
    "__radd__",
    "add_",
    "sub",
    "__sub__",
    "div",
    "__truediv__",
    "div_",
    "float",
    "double",
    "to",
    "type_as",
    "__getitem__",
    "tanh",
    "dropout",
    "new_full",
}
_state = threading.local()
_events = itertools.count()
_claimed: set[int] = set()  # tanh events a module has taken (tried to convert)
# tanh events over one Linear's output (attention pooling's energies, if a softmax follows;
# a plain tanh layer's, if none does: those go unreported)
_affine: set[int] = set()


_decided: weakref.WeakSet = weakref.WeakSet()  # modules that took their events: and later ones


def _stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack, _state.pending, _state.mode = [], [], None
        _state.calls, _state.global_hooks = [], None
    return _state.stack


def _enter_call(module, args) -> None:
    _state.calls.append(module)


def _leave_call(module, args, output) -> None:
    if _state.calls and _state.calls[-1] is module:
        _state.calls.pop()


class _Recording:
    def __init__(self, module: nn.Module, path: str, args, kwargs) -> None:
        self.module, self.path, self.args, self.kwargs = module, path, args, kwargs
        self.events: set[int] = set()
        self.softmaxed: set[int] = set()


class _Watcher(TorchFunctionMode):
    """Notes tanh-of-a-sum events and the softmaxes over them for the open recordings."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: dict[int, tuple[Tensor, frozenset, str | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        events: frozenset = frozenset()
        for t in inputs:
            mark = self.marks.get(id(t))
            if mark is not None and mark[0] is t:
                events |= mark[1]
        kind = None
        first = self.marks.get(id(inputs[0])) if inputs else None
        first_kind = first[2] if first is not None and first[0] is inputs[0] else None
        if name in ("tanh", "tanh_") and first_kind in ("sum", "affine"):
            event = next(_events)
            events = frozenset({event})  # an energy of its own (not of what made its inputs)
            if first_kind == "affine":
                _affine.add(event)
            if any(call in _decided for call in _state.calls):
                _claimed.add(event)  # inside a module that has taken its attention already
            for recording in _stack():
                recording.events.add(event)
        elif name in _SOFTMAX_NAMES and events:
            for recording in _stack():
                recording.softmaxed |= events
            events = frozenset()
        else:
            if name not in _CARRIES:
                events = frozenset()  # e.g. an RNN over a tanh's output: no longer its energies
            if name in _ADD_NAMES and len(inputs) >= 2:
                kind = "sum"
            elif name in _CAT_NAMES and len(inputs) >= 2:
                kind = "joined"
            elif name == "linear":
                kind = "sum" if first_kind == "joined" else "affine"
            elif first_kind == "sum" and isinstance(out, Tensor) and out.shape == inputs[0].shape:
                kind = "sum"  # e.g. a sum scaled or dropped out before the tanh: still reported
        if isinstance(out, Tensor) and (events or kind):
            self.marks[id(out)] = (out, events, kind)
        return out


def _floating_copy(value):
    if isinstance(value, Tensor):
        with torch.inference_mode(False):
            return value.detach().clone()
    return value


def _pre_hook(module: nn.Module, args, kwargs):
    watch = module.__dict__.get("_fuse_attention_watch")
    if watch is None or watch.done:
        return None
    watch.done = True
    module._forward_pre_hooks.pop(watch.hook_ids[0], None)
    stack = _stack()
    args, kwargs = pytree.tree_map(_floating_copy, (args, kwargs))
    stack.append(_Recording(module, watch.path, args, kwargs))
    watch.recording = stack[-1]
    if _state.mode is None:
        _state.mode = _Watcher()
        _state.mode.__enter__()
        # which module each event happens in (only while a first call is watched)
        _state.calls = [r.module for r in stack]
        _state.global_hooks = (
            torch.nn.modules.module.register_module_forward_pre_hook(_enter_call),
            torch.nn.modules.module.register_module_forward_hook(_leave_call, always_call=True),
        )
    return None


def _post_hook(module: nn.Module, args, kwargs, output):
    watch = module.__dict__.get("_fuse_attention_watch")
    recording = getattr(watch, "recording", None)
    if recording is None:
        return None
    watch.recording = None
    _unhook(module)
    stack = _stack()
    if recording in stack:
        stack.remove(recording)
    if recording.path in watch.report.watching:
        watch.report.watching.remove(recording.path)
    _decide(recording, watch)
    if not stack and _state.mode is not None:
        mode, _state.mode = _state.mode, None
        mode.__exit__(None, None, None)
        for handle in _state.global_hooks:
            handle.remove()
        _state.global_hooks, _state.calls = None, []
        pending, _state.pending = _state.pending, []
        for recording, watch in pending:
            _convert(recording, watch)
    return None


def _decide(recording: _Recording, watch: _Watch) -> None:
    """After a watched module's first call: report it or queue its conversion."""
    if not recording.events:
        return
    mine = recording.events - _claimed
    if not mine:
        return
    if not recording.softmaxed & mine:
        if mine <= _affine:  # a tanh layer, no attention: nothing to report
            return
        watch.report.skipped.append(
            Skipped(
                recording.path,
                (LAYOUT,),
                class_name(recording.module),
                "computes a tanh over a sum but no softmax over it in its own call "
                "(converted with its caller if the caller holds the softmax)",
            )
        )
        return
    _claimed.update(mine)
    _decided.add(recording.module)
    _state.pending.append((recording, watch))


class _Watch:
    """What a watched module needs at its first call (kept in the module's __dict__)."""

    def __init__(self, path: str, report: ConversionReport, backend: str, ids) -> None:
        self.path, self.report, self.backend = path, report, backend
        self.hook_ids = ids
        self.done = False
        self.recording = None

    def __deepcopy__(self, memo):
        return None  # a copy of the module is not watched

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def _unhook(module: nn.Module) -> None:
    watch = module.__dict__.get("_fuse_attention_watch")
    if watch is None:
        return
    pre, post = watch.hook_ids
    module._forward_pre_hooks.pop(pre, None)
    module._forward_hooks.pop(post, None)
    module._forward_hooks_with_kwargs.pop(post, None)
    module._forward_hooks_always_called.pop(post, None)


def _strip_watches(module: nn.Module) -> None:
    """Remove the watch hooks from a copy (whose watch attribute deepcopy dropped)."""
    for sub in module.modules():
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            for key, hook in list(hooks.items()):
                if hook in (_pre_hook, _post_hook):
                    del hooks[key]


def _watchable(module: nn.Module) -> bool:
    if isinstance(module, FusedStandIn) or type(module).__module__.startswith("torch."):
        return False
    if "_fuse_attention_watch" in module.__dict__:
        return False
    return next(module.parameters(), None) is not None


def watch_model(model: nn.Module, report: ConversionReport, backend: str) -> None:
    """Watch every module of ``model`` that the general path may convert (see the module
    docstring); skips the subtrees of stand-ins. The probe always runs (no ``check=False`` here:
    a trace is no structure to trust alone)."""
    seen = set()

    def visit(module: nn.Module, path: str) -> None:
        if id(module) in seen or isinstance(module, FusedStandIn):
            return
        seen.add(id(module))
        if _watchable(module):
            pre = module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            post = module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
            module.__dict__["_fuse_attention_watch"] = _Watch(
                path or "(model)", report, backend, (pre.id, post.id)
            )
            report.watching.append(path or "(model)")
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")


# --- tracing, the probe, the swap -----------------------------------------------------------------


class _Rewriter:
    """TorchDynamo backend: the graph with every additive attention replaced (or unchanged).
    ``found`` records, per compiled graph, the matches' descriptions and the other tanh's misses."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.found: list[tuple[list[str], list[str]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        try:
            matches, misses = find_matches(gm.graph)
            described = []
            for match in matches:
                described.append(match.describe())
                rewrite(gm.graph, match, self.backend)
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
            self.found.append((described, misses))
        except Exception as exc:  # noqa: BLE001 - an unexpected graph: leave it as it is
            self.found.append(([], [f"the graph could not be rewritten ({exc})"]))
        return gm.forward


_CLASSES: dict[tuple[type, str], type] = {}

# A converted module whose calls keep tracing anew (an argument whose structure changes with every
# call: a list of past weights that grows by one each decoder step) pays a trace per call until
# TorchDynamo's recompile limit, and then runs its own code behind the guards: unfused. A call that
# ran no fused replacement once the module's traces reach that limit puts it back in its own class,
# with a warning and a line in the report that say why.
_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (report, path)


def _put_back(module: nn.Module, original: type, traces: int) -> None:
    module.__class__ = original
    name = class_name(module)
    reason = (
        f"converted, then put back: TorchDynamo stopped tracing its forward after {traces} traces "
        "(its recompile limit) and ran it unfused; an argument changes structure from call to "
        "call (a list that grows each step, say)"
    )
    report, path = _CONVERTED.pop(module, (None, "?"))
    warnings.warn(f"fuse_attention: {path} ({name}) {reason}; it runs its own code", stacklevel=3)
    if report is not None:
        report.replaced[:] = [r for r in report.replaced if r.path != path]
        report.skipped.append(Skipped(path, (LAYOUT,), name, reason))


_WARNED: weakref.WeakSet = weakref.WeakSet()


def _warn_unmatched(module: nn.Module, found: list) -> None:
    """A new trace of a converted module's forward (other sizes, another grad mode) without the
    pattern: those calls run its own code. Said once per module."""
    if module in _WARNED:
        return
    _WARNED.add(module)
    misses = "; ".join(dict.fromkeys(m for _, missed in found for m in missed)) or "no tanh"
    _, path = _CONVERTED.get(module, (None, "?"))
    warnings.warn(
        f"fuse_attention: {path} ({class_name(module)}): a new trace of its forward did not "
        f"match ({misses}); calls that take that trace run its own code, unfused",
        stacklevel=3,
    )


# Each converted module has its own trace cache: one instance's traces (other sizes, dtypes, an
# argument that grows) never use up another's TorchDynamo recompile limit, which is counted per
# compiled function (many instances of one class: a sweep, several models, a test session).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (rewriter, fn)


def _compiled_for(module: nn.Module, cls: type, backend: str):
    entry = _COMPILED.get(module)
    if entry is None:
        # TorchDynamo keeps its cache on the code object: a copy of the function with a code
        # object of its own gets a cache of its own (on every torch version)
        fn = cls.forward
        own = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        own.__kwdefaults__ = fn.__kwdefaults__
        rewriter = _Rewriter(backend)
        entry = _COMPILED[module] = (rewriter, torch.compile(own, backend=rewriter))
    return entry


def traced_class(cls: type, backend: str) -> type:
    """The subclass of ``cls`` whose forward is ``cls.forward`` traced and rewritten."""
    key = (cls, backend)
    if key not in _CLASSES:

        def forward(self, *args, **kwargs):
            rewriter, compiled = _compiled_for(self, cls, backend)
            if torch.compiler.is_compiling():  # inside the user's own torch.compile
                return compiled(self, *args, **kwargs)
            ran, before = TracedWeights.calls, len(rewriter.found)
            out = compiled(self, *args, **kwargs)
            if TracedWeights.calls == ran:  # this call ran unfused
                traces = len(rewriter.found)
                if traces >= dynamo_config().recompile_limit:
                    _put_back(self, cls, traces)
                elif traces > before:
                    _warn_unmatched(self, rewriter.found[before:])
            return out

        def __reduce_ex__(self, protocol):
            # pickles and deep copies name the original class (importable) and rebuild this one
            state = super(new, self).__reduce_ex__(protocol)[2]
            return (_rebuild, (cls, backend), state)

        namespace = {
            "forward": forward,
            "layout": LAYOUT,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        namespace["__reduce_ex__"] = __reduce_ex__
        new = type(cls.__name__, (cls, FusedStandIn), namespace)
        _CLASSES[key] = new
    return _CLASSES[key]


def _rebuild(cls: type, backend: str) -> nn.Module:
    """An empty instance of the traced subclass of ``cls`` (pickle then sets its state)."""
    return object.__new__(traced_class(cls, backend))


def _leaves_for_grad(args, kwargs, dtype: torch.dtype = torch.float64):
    args, kwargs = pytree.tree_map(
        lambda t: (
            t.detach().to("cpu", dtype).requires_grad_()
            if isinstance(t, Tensor) and t.is_floating_point()
            else (t.cpu() if isinstance(t, Tensor) else t)
        ),
        (args, kwargs),
    )
    inputs = [
        t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.requires_grad
    ]
    return args, kwargs, inputs


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, hooks


# The probe's tolerances in float32, for a module that cannot run in float64 (one that casts to
# float32 itself): rounding of the fused op against plain ops is ~1e-6 relative there, and a
# look-alike (relu, no tanh, a temperature inside it, other padding) differs by far more.
FLOAT32_PROBE_RTOL, FLOAT32_PROBE_ATOL = 1e-4, 1e-5


class _OriginalFailed(Exception):
    """The original module itself could not run on the probe's float64 copies."""


def _probe(module: nn.Module, recording: _Recording, backend: str) -> tuple[str | None, str]:
    """(None or why not, what was found) for the traced version of ``module``."""
    # the first call may have run under inference_mode or no_grad: the probe's copies and calls
    # must be ordinary tensors with gradients
    dtypes = {
        t.dtype
        for t in pytree.tree_leaves((recording.args, recording.kwargs))
        if isinstance(t, Tensor) and t.is_floating_point()
    }
    with torch.inference_mode(False), torch.enable_grad():
        try:
            reason, found = _probe_copies(module, recording, backend, torch.float64)
        except _OriginalFailed as failed:
            # a module that casts to float32 itself (ESPnet's `.float()` masks) cannot run in
            # float64: where its own call ran in float32, the probe runs in float32
            cause = failed.__cause__
            if dtypes != {torch.float32}:
                raise cause from None
            reason, found = _probe_copies(module, recording, backend, torch.float32)
            why = f"{type(cause).__name__}: {str(cause).splitlines()[0][:120]}"
            return reason, f"{found}; probed in float32, as it does not run in float64 ({why})"
        if reason is not None and ROUNDED_SCORES in reason and dtypes == {torch.float32}:
            # scores cast to float32 and back: a rounding in float64, nothing in float32, the
            # dtype the module's own call ran in
            reason, found = _probe_copies(module, recording, backend, torch.float32)
            return reason, f"{found}; probed in float32, as its scores go through float32"
        return reason, found


def _probe_copies(module: nn.Module, recording: _Recording, backend: str, dtype: torch.dtype):
    def cast_state(value):
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.detach().to("cpu", dtype)
        return value

    original = _cpu_copy(module, dtype)
    candidate = _cpu_copy(module, dtype)
    for copy_ in (original, candidate):
        _strip_watches(copy_)
        copy_.train(module.training)
        for sub in copy_.modules():  # state kept from earlier calls (a cached projection)
            for key, value in list(vars(sub).items()):
                if isinstance(value, Tensor) or (
                    isinstance(value, (list, tuple, dict)) and key not in _MODULE_INTERNALS
                ):
                    setattr(sub, key, pytree.tree_map(cast_state, value))
    probe_backend = backend
    if backend != "reference" and not fused_available("cpu", dtype):
        probe_backend = "reference"
    cls = traced_class(type(module), probe_backend)
    candidate.__class__ = cls
    results = []
    default_dtype = torch.get_default_dtype()
    with torch.enable_grad(), torch.inference_mode(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # tensors the forward makes itself (zeros for a state, a mask) in the probe's dtype too
        torch.set_default_dtype(dtype)
        ran: list = []
        try:
            for mod in (original, candidate):
                args, kwargs, inputs = _leaves_for_grad(recording.args, recording.kwargs, dtype)
                TracedWeights.log = ran if mod is candidate else None
                try:
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(1)
                        out = mod(*args, **kwargs)
                    results.append((out, _gradients(mod, out, inputs, 2)))
                except Exception as exc:
                    if mod is original and dtype == torch.float64:
                        raise _OriginalFailed from exc
                    raise
        finally:
            TracedWeights.log = None
            torch.set_default_dtype(default_dtype)
    # what the candidate's call ran, and what its traces found
    matched = list(dict.fromkeys(replacement.description for replacement in ran))
    found = _COMPILED[candidate][0].found if candidate in _COMPILED else []
    misses = [m for _, missed in found for m in missed]
    if not matched:
        why = "; ".join(dict.fromkeys(misses)) or (
            "no tanh in the graphs TorchDynamo captured (its forward breaks the graph before it, "
            "or the frame was not traced)"
        )
        return f"not the fused op's form: {why}", ""
    tolerances = {}
    if dtype == torch.float32:
        tolerances = {"rtol": FLOAT32_PROBE_RTOL, "atol": FLOAT32_PROBE_ATOL}
    difference = _first_difference(
        results[0][0], results[1][0], "output", **tolerances
    ) or _first_difference(results[0][1], results[1][1], "gradient", **tolerances)
    if difference is not None:
        return f"differs from the fused op on its first call's input: {difference}", ""
    return None, "; ".join(matched)


def _convert(recording: _Recording, watch: _Watch) -> None:
    module, report = recording.module, watch.report
    try:
        reason, found = _probe(module, recording, watch.backend)
    except Exception as exc:  # noqa: BLE001 - any failure refuses the conversion
        reason, found = f"the trace or the probe could not run ({type(exc).__name__}: {exc})", ""
    name = class_name(module)
    if reason is None:
        module.__class__ = traced_class(type(module), watch.backend)
        _CONVERTED[module] = (report, recording.path)
        report.replaced.append(Replaced(recording.path, f"{LAYOUT} ({found})", name))
        logger.debug("fuse_attention: traced %s (%s): %s", recording.path, name, found)
    else:
        report.skipped.append(Skipped(recording.path, (LAYOUT,), name, reason))
        logger.debug("fuse_attention: left %s (%s): %s", recording.path, name, reason)
