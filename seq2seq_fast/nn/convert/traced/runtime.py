"""The runtime: a chosen module traced, rewritten, probed, and converted in place.

2. When the outermost watched call has returned, the chosen module's ``forward`` is traced by
   TorchDynamo (``torch.compile`` with a backend of ours, :class:`_Rewriter`, dynamic shapes):
   real code with keyword arguments, branches on ``None`` and on shapes, helper methods and child
   modules all trace. In the graph, :mod:`~seq2seq_fast.nn.convert.traced.pattern` finds the sum,
   tanh, projection, scale, masks and softmax and replaces that subgraph by the fused op; the rest
   of the graph stays.
3. The probe decides: float64 CPU copies of the module, the original and the traced one, run on
   the first call's arguments; every output and the gradients of every parameter and input must
   agree. (A module that cannot run in float64 because it casts to float32 itself, while its own
   call ran in float32, is probed in float32 with float32's tolerances; the report says so.)
   Only then is the module converted, in place: its class becomes a subclass of its own whose
   ``forward`` is the traced one (same object, same parameters, same state_dict keys). In place,
   because the user's code may hold the module under several names (a parent attribute, a list,
   a closure): swapping the object in one parent would leave the others on the original.

The work is done once per module (a trace, a float64 probe); later calls run the compiled graph
(TorchDynamo's guards, then eager autograd through the graph; a new shape or grad mode may trace
once more). Each converted module keeps its own :class:`_TracedState` in its ``__dict__`` (its
trace cache, the report it belongs to), which copies and pickles drop: a copy traces anew.
"""

from __future__ import annotations

import logging
import threading
import types
import uuid
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, fx, nn

from seq2seq_fast.nn.convert._base import (
    MODULE_INTERNALS,
    ConversionReport,
    FusedStandIn,
    Replaced,
    Skipped,
    _cpu_copy,
    _first_difference,
    _gradients,
    class_name,
    forked_random,
)
from seq2seq_fast.nn.convert.traced.nodes import ROUNDED_SCORES, SCORES_LEAVE_THE_GRAPH
from seq2seq_fast.nn.convert.traced.pattern import find_matches
from seq2seq_fast.nn.convert.traced.rewrite import recorded_runs, rewrite
from seq2seq_fast.nn.convert.traced.watching import (
    LAYOUT,
    Recording,
    rearm,
    strip_watches,
    unwatch_inside,
    watching_now,
)
from seq2seq_fast.ops import fused_available
from seq2seq_fast.ops._checks import without_autocast
from seq2seq_fast.ops._torch_private import (
    compile_frame,
    dynamo_capture_scalars,
    dynamo_config,
    dynamo_graph_breaks,
    dynamo_tracing,
    pytree,
    quiet_trace_errors,
)

logger = logging.getLogger(__name__)

# How many traces a converted module's own forward may take before it is put back (TorchDynamo's
# default limit is 8 per frame, for every compiled function of the process). One model's ordinary
# calls multiply their traces: a first decoder step without its state (None, then a tensor), batch
# and memory sizes that turn dynamic only after a trace of their own, training and validation's
# grad modes, a batch of 1 traced apart. kospeech's LocationAwareAttention reached 8 in its first
# training epoch and validation. The raised limit applies only inside a module's first call and
# the calls of a module that has already traced RAISE_FROM times (6 us a call).
TRACE_LIMIT = 32
RAISE_FROM = 3


class _Rewriter:
    """TorchDynamo backend: the graph with every additive attention replaced (or unchanged).
    ``found`` records, per compiled graph, the matches' descriptions and the other tanh's misses."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.found: list[tuple[list[str], list[str]]] = []
        # how many times each frame of this module's own was compiled (TorchDynamo gives up on
        # a frame at its recompile limit; a forward with graph breaks compiles several frames
        # per call). Its own: first compiled for it. A function it shares with other modules
        # (a helper of their common class) counts their compiles too, and giving up there
        # leaves this module's own frames fused.
        self.frame_compiles: dict[int, int] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        frame = compile_frame()
        if frame is not None:
            frame_id, before = frame
            if frame_id in self.frame_compiles or before == 0:
                self.frame_compiles[frame_id] = max(
                    self.frame_compiles.get(frame_id, 0), before + 1
                )
        try:
            # without gradients: the passes compute their new nodes' example values on the
            # trace's tensors, and under a non-reentrant checkpoint each one recorded for backward
            # was a saved tensor more in the forward than in its recomputation (CheckpointError)
            with torch.no_grad():
                plans, misses = find_matches(gm.graph)
                described = []
                for plan in plans:
                    described.append(plan.describe())
                    rewrite(gm.graph, plan, self.backend)
            gm.graph.eliminate_dead_code(is_impure_node=_impure)
            gm.graph.lint()
            gm.recompile()
            self.found.append((described, misses))
        except Exception as exc:  # noqa: BLE001 - an unexpected graph: leave it as it is
            self.found.append(([], [f"the graph could not be rewritten ({_one_line(exc)})"]))
        return gm.forward


def _impure(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep ``node``: FX's own test, and also a call of an
    in-place method or function (``scores.data.masked_fill_(...)``, ``torch.relu_``), whose
    result nobody reads. FX counts every call_method as pure, and removing such a write changed
    mozilla/TTS's windowing attention's masked scores (its result was wrong, not unfused)."""
    if node.is_impure():
        return True
    target = str(node.target if node.op == "call_method" else getattr(node.target, "__name__", ""))
    in_place = target.endswith("_") and not target.endswith("__")  # (not __getitem__)
    return node.op in ("call_method", "call_function") and in_place


@dataclass
class _TracedState:
    """What one converted module needs at its calls (kept in its ``__dict__``): its own trace
    cache (TorchDynamo keeps one per code object, so the forward gets a code object of its own:
    one instance's traces never use up another's recompile limit), the report and path it was
    converted under, and whether a warning was given."""

    rewriter: _Rewriter
    compiled: object
    report: ConversionReport | None = None
    path: str = "?"
    layout: str = LAYOUT  # what the report names it as: "traced", or a thin matcher's name
    warned: bool = False
    # traced with TorchDynamo's scalars captured (see _retrace_capturing_scalars)
    capture_scalars: bool = False
    # the module runs an nn.GRU/nn.LSTM/nn.RNN: traced into its graph (see dynamo_tracing)
    rnn: bool = False
    # set while a converted module around this one runs its own trace (HAN's sentence level
    # around its word level): this forward is traced then by the converter, not by the user's
    # torch.compile, and says nothing of it. (TorchDynamo guards on the value it read: the outer
    # graph was traced with True and runs with True.)
    inside_converted: bool = False
    # the states of the converted modules inside this one (see _converted_inside): found at the
    # first call and again whenever the trace limit is raised, not at every call
    inner: list | None = None

    def compiles(self) -> int:
        """The most traces any of this module's own frames has taken (see _Rewriter)."""
        return max(self.rewriter.frame_compiles.values(), default=len(self.rewriter.found))

    def call(self, module: nn.Module, args, kwargs):
        """The compiled forward, with scalars captured where set, RNNs traced into the graph
        for a module that runs one, and the raised trace limit at its first call (its frames
        may be functions that other modules' traces share: a helper called after a graph break)
        and for a module that keeps tracing."""
        raise_limit = not self.rewriter.found or self.compiles() >= RAISE_FROM
        if raise_limit or self.inner is None:
            self.inner = _converted_inside(module)
        inner = self.inner
        for state in inner:
            state.inside_converted = True
        try:
            if raise_limit:  # (and the trace's log quiet: the converter says what it found)
                with dynamo_tracing(TRACE_LIMIT, allow_rnn=self.rnn), quiet_trace_errors():
                    return self._call(module, args, kwargs)
            if self.rnn:
                with dynamo_tracing(None, allow_rnn=True):
                    return self._call(module, args, kwargs)
            return self._call(module, args, kwargs)
        finally:
            for state in inner:
                state.inside_converted = False

    def _call(self, module: nn.Module, args, kwargs):
        if self.capture_scalars:
            with dynamo_capture_scalars():
                return self.compiled(module, *args, **kwargs)
        return self.compiled(module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return None  # a copy traces anew

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def _converted_inside(module: nn.Module) -> list[_TracedState]:
    """The states of the converted modules inside ``module`` (not itself)."""
    found = []
    for inner in module.modules():
        state = inner.__dict__.get("_fuse_attention_traced")
        if state is not None and inner is not module:
            found.append(state)
    return found


INSIDE_COMPILE = (
    "fuse_attention: {} ({}) was converted by the general path, which runs outside "
    "torch.compile: called inside a compiled model it runs its own code, unfused (your backend "
    "compiles it). Leave it out of the compiled region (torch.compiler.disable on its forward) "
    "to run the fused replacement; the named layouts' stand-ins run fused inside torch.compile"
)


def _traced_state(module: nn.Module, cls: type, backend: str) -> _TracedState:
    state = module.__dict__.get("_fuse_attention_traced")
    if state is None:
        fn = cls.forward
        # a name of its own: TorchDynamo keeps what it learnt of a function's sizes (which turned
        # out to vary: compiled with dynamic sizes from then on) by file, line and name, so a
        # copy under the same name would share it with every other instance of the class and with
        # the probe's copy, whose call (a layout's example call) is of other sizes than the
        # model's: the model's first call would compile with dynamic sizes. Two converted models
        # share nothing this way either, nor does a module made later at a freed one's address
        # (a random name, not the module's id).
        rewriter = _Rewriter(backend)
        state = _TracedState(rewriter, _compiled(fn, f"_fused_{uuid.uuid4().hex}", rewriter))
        # (an RNN run before the attention would break the graph there, and the attention
        # after the break would never be traced: a text classifier's BiLSTM and pooling)
        state.rnn = any(isinstance(m, nn.RNNBase) for m in module.modules())
        module.__dict__["_fuse_attention_traced"] = state
    return state


def _compiled(fn, suffix: str, rewriter: _Rewriter):
    """``fn`` under a code object of its own (named with ``suffix``), compiled with ``rewriter``."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}{suffix}")
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return torch.compile(own, backend=rewriter)


def _retrace_capturing_scalars(module: nn.Module, state: _TracedState, cls: type) -> None:
    """The module's forward under a new code object (nothing of the old traces kept), traced from
    its next call on with TorchDynamo's scalars captured: a forward whose graph ended between the
    scores and the softmax (a pad mask built from ``int(lengths.max())`` there, as ESPnet's
    attentions do on an utterance's first step) then traces whole."""
    suffix = f"_fused_{uuid.uuid4().hex}_scalars"
    state.compiled = _compiled(cls.forward, suffix, state.rewriter)
    state.capture_scalars = True


def _put_back(module: nn.Module, original: type, traces: int) -> None:
    """A converted module whose calls keep tracing anew (an argument whose structure changes with
    every call: a list of past weights that grows by one each decoder step) pays a trace per call
    until the trace limit (TRACE_LIMIT), and then TorchDynamo runs its own code behind the guards:
    unfused. Such a module goes back to its own class, with a warning and a line in the report."""
    state = module.__dict__.pop("_fuse_attention_traced", None)
    module.__class__ = original
    name = class_name(module)
    reason = (
        f"converted, then put back: TorchDynamo stopped tracing its forward after {traces} "
        "traces of one frame (its recompile limit) and ran it unfused; its calls keep needing "
        "new traces (a list argument that grows each step, say: TORCH_LOGS=recompiles says "
        "what changed)"
    )
    report, path = (state.report, state.path) if state is not None else (None, "?")
    layout = state.layout if state is not None else LAYOUT
    warnings.warn(f"fuse_attention: {path} ({name}) {reason}; it runs its own code", stacklevel=3)
    if report is not None:
        report.replaced[:] = [r for r in report.replaced if r.path != path]
        report.skipped.append(Skipped(path, (layout,), name, reason))


def _warn_unmatched(module: nn.Module, state: _TracedState, found: list) -> None:
    """A new trace of a converted module's forward (other sizes, another grad mode) without the
    pattern: those calls run its own code. Said once per module; not said for a trace without
    any tanh (a branch of the forward that attends to nothing, such as an intra-decoder
    attention's first step) or with one key (its weights are all 1: nothing to fuse)."""
    misses = "; ".join(
        dict.fromkeys(m for _, missed in found for m in missed if not m.startswith(ONE_KEY))
    )
    if state.warned or not misses:
        return
    state.warned = True
    warnings.warn(
        f"fuse_attention: {state.path} ({class_name(module)}): a new trace of its forward did not "
        f"match ({misses}); calls that take that trace run its own code, unfused",
        stacklevel=3,
    )


# The traced subclass of each (class, backend): a memo, not state. One class per original class
# keeps isinstance and pickling stable (a pickle names the original class and _rebuild finds
# the same subclass again); what differs between instances lives in each one's _TracedState.
_CLASSES: dict[tuple[type, str], type] = {}


def _inside_compile(module: nn.Module, state: _TracedState, args, kwargs):
    """A converted module's call inside the user's torch.compile (or another tracer): TorchDynamo
    inlines its forward into the user's graph: the module's own code (the user's backend
    compiles it), unfused. Said at each trace that reaches it (the warning is replayed at its
    graph's calls; Python's filter says it once)."""
    if not state.inside_converted:  # (not the trace of a converted module around)
        warnings.warn(INSIDE_COMPILE.format(state.path, class_name(module)), stacklevel=3)
    return state.compiled(module, *args, **kwargs)


def _after_an_unfused_call(module: nn.Module, cls: type, state: _TracedState, before: int) -> None:
    """After a call that ran the module's own code: give up on a module that keeps tracing,
    trace again capturing scalars where the scores left the graph, or say what was missed."""
    traces = len(state.rewriter.found)
    compiles = state.compiles()
    found = state.rewriter.found[before:]
    if compiles >= max(dynamo_config().recompile_limit, TRACE_LIMIT):
        _put_back(module, cls, compiles)
    elif not state.capture_scalars and any(SCORES_LEAVE_THE_GRAPH in missed for _, missed in found):
        _retrace_capturing_scalars(module, state, cls)
    elif traces > before:
        _warn_unmatched(module, state, found)


def traced_class(cls: type, backend: str) -> type:
    """The subclass of ``cls`` whose forward is ``cls.forward`` traced and rewritten."""
    key = (cls, backend)
    if key not in _CLASSES:

        def forward(self, *args, **kwargs):
            if torch.jit.is_tracing():
                # torch.jit.trace records the module's own ops: it cannot trace a TorchDynamo
                # function, and its TorchScript then runs as the original's, without this package
                return cls.forward(self, *args, **kwargs)
            state = _traced_state(self, cls, backend)
            if torch.compiler.is_dynamo_compiling():  # inside the user's own torch.compile
                return _inside_compile(self, state, args, kwargs)
            with _DYNAMO_LOCK:  # (one thread in TorchDynamo at a time: see _DYNAMO_LOCK)
                # torch.compiler.is_compiling() is a process-wide flag: read under the lock, so
                # that another thread's probe (which holds it) is not taken for a compile here
                if torch.compiler.is_compiling():  # another tracer on this thread (torch.export)
                    return _inside_compile(self, state, args, kwargs)
                if watching_now():  # inside a caller's watched first call: this call runs unfused
                    return cls.forward(self, *args, **kwargs)
                before = len(state.rewriter.found)
                with recorded_runs() as ran:
                    out = state.call(self, args, kwargs)
                if not ran:  # this call ran unfused
                    _after_an_unfused_call(self, cls, state, before)
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
    """The call's arguments as CPU copies in ``dtype``, and the leaves their gradients reach. A
    floating argument is passed as a copy made from its leaf (not the leaf itself), as a model's
    own call passes an encoder's output: a forward that writes its argument in place
    (OpenNMT-py's ``memory_bank += linear_cover(coverage)``) runs as in the model."""
    inputs: list[Tensor] = []

    def copy(t):
        if not isinstance(t, Tensor):
            return t
        if not t.is_floating_point():
            return t.cpu()
        inputs.append(t.detach().to("cpu", dtype).requires_grad_())
        return inputs[-1].clone()

    args, kwargs = pytree.tree_map(copy, (args, kwargs))
    return args, kwargs, inputs


# The probe's tolerances in float32, for a module that cannot run in float64 (one that casts to
# float32 itself): rounding of the fused op against plain ops is ~1e-6 relative there, and a
# look-alike (relu, no tanh, a temperature inside it, other padding) differs by far more.
FLOAT32_PROBE_RTOL, FLOAT32_PROBE_ATOL = 1e-4, 1e-5


class _OriginalFailed(Exception):
    """The original module itself could not run on the probe's float64 copies."""


# TorchDynamo is not thread-safe (pytorch/pytorch#118260: its caches and configuration are
# process-wide). Every call into the converted modules' compiled forwards, and every probe (which
# traces and compiles too), holds this lock: one at a time in the process. Uncontended it costs
# well under a microsecond a call; threads that run converted modules at once wait for each
# other there (the rest of their models runs in parallel).
_DYNAMO_LOCK = threading.RLock()


def _probe(module: nn.Module, recording, backend: str) -> tuple[str | None, str]:
    """(None or why not, what was found) for the traced version of ``module``."""
    with _DYNAMO_LOCK, without_autocast(), quiet_trace_errors():
        return _probe_unlocked(module, recording, backend)


def _one_line(exc: BaseException) -> str:
    """An error as a reason: its type and first line (TorchDynamo's run to many lines)."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first[:300]}"


def _probe_unlocked(module: nn.Module, recording, backend: str) -> tuple[str | None, str]:
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


def _probe_copies(module: nn.Module, recording, backend: str, dtype: torch.dtype):
    def cast_state(value):
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.detach().to("cpu", dtype)
        return value

    original = _cpu_copy(module, dtype)
    candidate = _cpu_copy(module, dtype)
    for copy_ in (original, candidate):
        strip_watches(copy_)
        copy_.train(module.training)
        for sub in copy_.modules():  # state kept from earlier calls (a cached projection)
            for key, value in list(vars(sub).items()):
                if isinstance(value, Tensor) or (
                    isinstance(value, (list, tuple, dict)) and key not in MODULE_INTERNALS
                ):
                    setattr(sub, key, pytree.tree_map(cast_state, value))
    probe_backend = backend
    if backend != "reference" and not fused_available("cpu", dtype):
        probe_backend = "reference"
    cls = traced_class(type(module), probe_backend)
    candidate.__class__ = cls
    results = []
    ran: list = []
    breaks: list[str] = []
    # Tensors the forward makes itself (zeros for a state, a mask) stay in torch's default
    # dtype, the same in both runs. (The probe set the default dtype to its own once; that is
    # process-wide, and another thread building a model meanwhile got float64 weights.) Where a
    # float32 tensor made so meets the float64 copies in an op that wants one dtype, the
    # original fails in float64 and the probe runs in float32 (_probe_unlocked).
    with torch.enable_grad(), torch.inference_mode(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod in (original, candidate):
            args, kwargs, inputs = _leaves_for_grad(recording.args, recording.kwargs, dtype)
            try:
                counted = dynamo_graph_breaks()
                with forked_random(seed=1), recorded_runs() as runs:
                    out = mod(*args, **kwargs)
                if mod is candidate:
                    ran, breaks = runs, _new_breaks(counted, dynamo_graph_breaks())
                results.append((out, _gradients(mod, out, inputs, 2)))
            except Exception as exc:
                if mod is original and dtype == torch.float64:
                    raise _OriginalFailed from exc
                raise
    # what the candidate's call ran, and what its traces found
    matched = list(dict.fromkeys(replacement.description for replacement in ran))
    state = candidate.__dict__.get("_fuse_attention_traced")
    found = state.rewriter.found if state is not None else []
    misses = [m for _, missed in found for m in missed]
    if not matched:
        why = "; ".join(dict.fromkeys(misses)) or (
            "no tanh in the graphs TorchDynamo captured of its forward (where the forward has "
            "one, a graph break comes before it or the frame was not traced)"
            if found
            else "TorchDynamo captured no graph of its forward: it runs a whole frame as "
            "Python when a graph break falls inside a loop (a Python loop over a tensor's "
            "values, or an .item() in a loop), which leaves nothing to convert"
        )
        if breaks and (SCORES_LEAVE_THE_GRAPH in why or not found or "no tanh" in why):
            why += f" (TorchDynamo's graph break: {'; '.join(breaks)})"
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


def _new_breaks(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The graph breaks counted between ``before`` and ``after``, each as its reason's first line
    and explanation (TorchDynamo's message runs to a page)."""
    out = []
    for reason, count in after.items():
        if count > before.get(reason, 0):
            lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
            said = lines[0] if lines else reason
            explained = next((x for x in lines[1:] if x.startswith("Explanation:")), None)
            if explained is not None:
                said += f" ({explained.removeprefix('Explanation:').strip()})"
            out.append(said[:300])
    return list(dict.fromkeys(out))


# A first call whose memory has one key: its trace cannot tell the memory's axis (size 1) from
# others, so the module is watched again at its next calls, up to this many in all.
ONE_KEY = "the softmax runs over an axis of size 1"
UNDECIDED_CALLS = 3


def convert(recording, watch) -> None:
    """Probe the traced version of ``recording.module`` on its first call's input; convert it in
    place when it agrees, and say either in ``watch.report``. A first call with one key decides
    nothing: the module's next call is watched instead (up to UNDECIDED_CALLS calls)."""
    reason = _probe_and_swap(recording, watch.report, watch.backend, LAYOUT, recording.module)
    if reason is not None and ONE_KEY in reason:
        watch.undecided_calls += 1
        if watch.undecided_calls < UNDECIDED_CALLS:
            rearm(recording.module)
            return
        reason += f" (in each of its first {UNDECIDED_CALLS} calls: one key)"
    if reason is not None:
        name = class_name(recording.module)
        watch.report.skipped.append(Skipped(recording.path, (LAYOUT,), name, reason))
        logger.debug("fuse_attention: left %s (%s): %s", recording.path, name, reason)


def convert_now(module: nn.Module, path: str, layout, report: ConversionReport, backend: str):
    """A thin matcher's conversion (a ``Layout`` with ``traced=True``, see ``_base.py``): the
    module traced, rewritten, probed and converted in place as a watched module is after its first
    call (:func:`convert`), with ``layout.example_call`` (float64) as that call and
    ``layout.prepare`` applied to a copy (``module``'s own state is left as it is). None when it
    was converted (``report`` lists it as replaced under ``layout.name``), else why not (the
    caller reports it: several layouts may match one module)."""
    with forked_random(seed=0):
        args, kwargs = layout.example_call(module, torch.float64)
    probed = module
    if layout.prepare is not None:
        probed = _cpu_copy(module)
        strip_watches(probed)
        layout.prepare(probed, args, kwargs)
    recording = Recording(module, path, args, kwargs)
    return _probe_and_swap(recording, report, backend, layout.name, probed)


def _probe_and_swap(recording, report, backend: str, layout: str, probed: nn.Module) -> str | None:
    """Probe the traced version of ``probed`` (``recording.module`` or a prepared copy of it) on
    the recorded call; when it agrees, convert ``recording.module`` in place and list it in
    ``report`` under ``layout``, and return None; else return why not."""
    module = recording.module
    try:
        reason, found = _probe(probed, recording, backend)
    except Exception as exc:  # noqa: BLE001 - any failure refuses the conversion
        reason, found = f"the trace or the probe could not run ({_one_line(exc)})", ""
    if reason is not None:
        return reason
    name = class_name(module)
    original = type(module)
    module.__class__ = traced_class(original, backend)
    unwatch_inside(module)
    state = _traced_state(module, original, backend)
    state.report, state.path, state.layout = report, recording.path, layout
    # (a named layout that refused this module, whose calls the general path now serves)
    report.skipped[:] = [s for s in report.skipped if s.path != recording.path]
    if layout == LAYOUT:
        report.replaced.append(Replaced(recording.path, f"{LAYOUT} ({found})", name))
    else:
        report.replaced.append(Replaced(recording.path, layout, name, traced=found))
    logger.debug("fuse_attention: traced %s (%s) as %r: %s", recording.path, name, layout, found)
    return None
