"""Watching: which modules compute additive attention, noted during their first call.

Every module with parameters that no named layout took (built-in ``torch.nn`` layers aside) gets a
pair of hooks (:func:`watch_model`). Its first call runs as it is, under a
:class:`~torch.overrides.TorchFunctionMode` (:class:`_Watcher`) that notes every ``tanh`` of a sum
(or of a linear map of a concatenation) and every softmax that depends on one. A module whose
call computes such a tanh is reported; the innermost module whose call also holds the softmax
over it is the one converted (so an energy computed in one module and normalised in its caller is
converted at the caller). When the outermost watched call has returned, the modules chosen are
handed to :func:`~seq2seq_fast.nn.convert.traced.runtime.convert` (trace, rewrite, probe, swap).

State: what one outermost watched call notes (the mode, the open recordings, the event ids, the
events taken) lives in a :class:`_CallWatch` of the calling thread, made when that call starts
and dropped when it ends; what a module needs lives in its own ``__dict__`` (a :class:`_Watch`,
which copies and pickles drop). Nothing is shared between threads or between converted models.
"""

from __future__ import annotations

import itertools
import threading
import warnings

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from seq2seq_fast.nn.convert._base import ConversionReport, FusedStandIn, Skipped, class_name
from seq2seq_fast.ops._torch_private import pytree, saved_tensors_hooks_active

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
    "t",
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
# A module whose first call computed no tanh is watched at its next calls too, up to this many
# calls in all (a decoder's intra-attention attends to nothing at the first step)
NO_TANH_CALLS = 3
# The calling thread's _CallWatch while one of its watched first calls runs (else none).
_THREAD = threading.local()


class _CallWatch:
    """What one outermost watched call notes, on its thread: the mode that watches the call, the
    open recordings (nested watched modules), the modules being called (hooks on its tree,
    only while the call runs), the tanh events (numbered per call), those taken by a module, those
    over one Linear's output, and the conversions to make once the call has returned."""

    def __init__(self) -> None:
        self.stack: list[Recording] = []
        self.pending: list[tuple[Recording, _Watch]] = []
        self.calls: list[nn.Module] = []
        self.events = itertools.count()
        self.claimed: set[int] = set()
        # tanh events over one Linear's output, or a Linear of a concatenation (attention
        # pooling's or the concat form's energies, if a softmax follows; a plain tanh layer's,
        # such as a Luong decoder's output layer, if none does: those go unreported)
        self.affine: set[int] = set()
        # tanh events whose values went into a Linear to several outputs (see _Watcher), and
        # how many outputs
        self.not_scores: set[int] = set()
        self.several: dict[int, int] = {}
        # tanh events a module has been reported for already (its caller does not repeat it)
        self.reported: set[int] = set()
        # the first op each tanh event's values went into that the watch does not follow
        self.ended: dict[int, str] = {}
        self.mode = _Watcher(self)
        self.hooks: list = []  # forward hooks on the watched module's tree, while the call runs

    def start(self) -> None:
        self.mode.__enter__()
        self.calls = [r.module for r in self.stack]
        # hooks on the watched module's own tree, for this call only: not process-wide ones,
        # which another thread's TorchDynamo trace would see come and go (and fail on, guarding
        # on the global hooks' table as it was). Not on the watched module itself (on the calls
        # already): removed at its end, they would change the hooks torch is going through
        # when its forward raises ("OrderedDict mutated during iteration" for the user's error).
        # For the same reason the leaving hooks go first: a watched module's own post hook,
        # after them, removes itself (torch goes through a module's forward hooks as they are,
        # not a copy, when its forward raises)
        root = self.stack[0].module if self.stack else None
        tree = _tree_but_stand_ins(root) if root is not None else []
        self.hooks = [m.register_forward_pre_hook(self._enter_call) for m in tree] + [
            m.register_forward_hook(self._leave_call, always_call=True, prepend=True) for m in tree
        ]

    def stop(self) -> None:
        self.mode.__exit__(None, None, None)
        for handle in self.hooks:
            handle.remove()
        self.hooks, self.calls = [], []

    def _enter_call(self, module, args) -> None:
        if _current() is self:  # (a module shared with another thread: its calls are not ours)
            self.calls.append(module)

    def _leave_call(self, module, args, output) -> None:
        if _current() is self and self.calls and self.calls[-1] is module:
            self.calls.pop()

    def inside_decided_module(self) -> bool:
        """Is a module that has taken its attention already among the calls open now? (A module
        converted already counts: its calls here run its own code, see :func:`watching_now`.)"""
        return any(
            isinstance(module, FusedStandIn) or _watch_of(module, "decided")
            for module in self.calls
        )

    def inside_reported_module(self) -> bool:
        """Is a module reported already (a tanh over a sum, no softmax followed) among the calls
        open now? Its later calls' energies are its own: the caller says nothing more of them."""
        return any(_watch_of(module, "reported") for module in self.calls)


def _current() -> _CallWatch | None:
    return getattr(_THREAD, "watch", None)


def watching_now() -> bool:
    """Is a watched first call running on this thread (its TorchFunctionMode active)? A module
    converted already (at ``fuse_attention`` time by a thin matcher, or earlier) that is called
    inside it runs its own code for that call: TorchDynamo would otherwise trace the watcher's
    mode into its graph."""
    return _current() is not None


def _watch_of(module: nn.Module, flag: str | None = None):
    watch = module.__dict__.get("_fuse_attention_watch")
    return watch if flag is None else bool(watch is not None and getattr(watch, flag))


class Recording:
    """A module's first call (its arguments copied), what the runtime traces and probes on; and
    the tanh events and softmaxes noted during it."""

    def __init__(self, module: nn.Module, path: str, args, kwargs) -> None:
        self.module, self.path, self.args, self.kwargs = module, path, args, kwargs
        self.events: set[int] = set()
        self.softmaxed: set[int] = set()


class _Watcher(TorchFunctionMode):
    """Notes tanh-of-a-sum events and the softmaxes over them for the open recordings."""

    def __init__(self, call: _CallWatch) -> None:
        super().__init__()
        self.call = call
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
        call = self.call
        # a tanh of a plain tensor (no sum, no projection: Att-BLSTM's ``w . tanh(H)``) counts
        # too, as a tanh layer's does: nothing to report unless a softmax follows
        plain = first_kind is None and not events and inputs and inputs[0].dim() >= 2
        if name in ("tanh", "tanh_") and (
            first_kind in ("sum", "affine", "joined_linear") or plain
        ):
            event = next(call.events)
            events = frozenset({event})  # an energy of its own (not of what made its inputs)
            if first_kind in ("affine", "joined_linear") or plain:
                call.affine.add(event)
            if call.inside_decided_module():
                call.claimed.add(event)  # inside a module that has taken its attention already
            elif call.inside_reported_module():
                call.reported.add(event)
            for recording in call.stack:
                recording.events.add(event)
            kind = "tanh"  # (its output as such: a gate multiplies it, see _gated)
        elif name in _SOFTMAX_NAMES and events:
            over = None if name == "sigmoid" else _normalised_size(args, kwargs)
            scores = {e for e in events if e not in call.several or call.several[e] != over}
            if over is None:  # (a sigmoid after a Linear to several outputs: a gate)
                scores -= call.several.keys()
            for recording in call.stack:
                recording.softmaxed |= scores
            events = frozenset()
        else:
            energies_first = first is not None and first[0] is inputs[0] and bool(first[1])
            outputs = _outputs(name, args, kwargs, inputs, energies_first)
            if outputs is not None:
                # a Linear to several outputs, or x @ W: not scores (an attention's are a
                # projection onto one vector), and nothing to report if no softmax follows. A
                # softmax over the outputs (a decoder's output layer: tanh, Linear to the
                # vocabulary, log_softmax) makes no attention either; one over another axis (K
                # attentions sharing one tanh: multi-branch pooling) is reported, not fused.
                call.not_scores |= events
                call.several.update(dict.fromkeys(events, outputs))
            elif _gated(name, inputs, out, self.marks):
                # the tanh's output times a tensor of its shape: a gate (an LSTM cell's
                # o * tanh(c), a GLU), not a projection onto a vector; nothing to report if no
                # softmax follows (a gated attention's softmax is reported, with why). Scores
                # times a 0/1 mask are not a gate: a hand-written softmax may follow
                call.not_scores |= events
            elif name not in _CARRIES and not _pointwise_conv(name, args, kwargs):
                if isinstance(out, Tensor):  # (not .size(), .dim(): they read no values)
                    for event in events:
                        call.ended.setdefault(event, name)
                events = frozenset()  # e.g. an RNN over a tanh's output: no longer its energies
            kind = _kind_of(name, first_kind, args, kwargs, inputs, out)
        if isinstance(out, Tensor) and (events or kind):
            self.marks[id(out)] = (out, events, kind)
        return out


# x @ W spelled as a product: torch.matmul, the @ operator, torch.mm
_MATMUL_NAMES = frozenset({"matmul", "__matmul__", "mm"})


def _kind_of(name: str, first_kind: str | None, args, kwargs, inputs: list, out) -> str | None:
    """What ``out`` is on the way to a tanh: a sum of terms, a join (torch.cat) of them, a
    projection of a join (the concat form's sum) or an affine map; None for anything else."""
    if name in _ADD_NAMES and len(inputs) >= 2:
        return "sum"
    elif name in _CAT_NAMES and len(inputs) >= 2:
        return "joined"
    elif name == "linear":
        # (the concat form's sum; as a plain tanh layer's, unreported without a softmax:
        # a Luong decoder's tanh(W [h; context]) output layer)
        return "joined_linear" if first_kind == "joined" else "affine"
    elif name in _MATMUL_NAMES and len(inputs) == 2 and inputs[1].dim() == 2:
        return "affine"  # x @ W: a projection written out (W a [D, H] weight)
    elif _pointwise_conv(name, args, kwargs):
        return "affine"  # a kernel-size-1 convolution over [B, C, T]: a projection of channels
    elif (
        first_kind in ("sum", "joined_linear")
        and isinstance(out, Tensor)
        and out.shape == inputs[0].shape
    ):
        return first_kind  # e.g. a sum scaled or dropped out before the tanh
    elif (
        first_kind == "sum"
        and name in ("view", "reshape", "flatten")
        and isinstance(out, Tensor)
        and out.dim() >= 2
        and out.shape[-1] == inputs[0].shape[-1]
    ):
        return "sum"  # a sum flattened into rows before the tanh
    return None


def _pointwise_conv(name: str, args, kwargs) -> bool:
    """``F.conv1d`` / ``F.conv2d`` with a kernel of size 1 (wespeaker's and ECAPA's attentive
    pooling over [B, C, T], mmocr SAR's score layer): a Linear over the channel axis."""
    if name not in ("conv1d", "conv2d") or len(args) < 2 or kwargs.get("groups", 1) != 1:
        return False
    weight = args[1]
    return (
        isinstance(weight, Tensor) and weight.dim() >= 3 and all(k == 1 for k in weight.shape[2:])
    )


def _outputs(name: str, args, kwargs, inputs: list, energies_first: bool) -> int | None:
    """How many outputs an F.linear or an ``energies @ W`` (W a matrix) maps each row onto, where
    that is more than one (a projection onto a vector is one); None otherwise."""
    if name == "linear":
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] != 1:
            return weight.shape[0]
    elif _pointwise_conv(name, args, kwargs):
        if args[1].shape[0] != 1:
            return args[1].shape[0]
    elif name in _MATMUL_NAMES and energies_first and len(inputs) == 2:
        if inputs[1].dim() == 2 and inputs[1].shape[1] != 1:
            return inputs[1].shape[1]
    return None


def _gated(name: str, inputs: list, out, marks: dict) -> bool:
    """Is this a product of two tensors of the output's own shape (nothing broadcast), one of
    them a tanh's output as it came (``o * tanh(c)``, ``tanh(c) * o``)?"""
    if name not in ("mul", "__mul__", "__rmul__") or len(inputs) != 2:
        return False
    if not (isinstance(out, Tensor) and all(t.shape == out.shape for t in inputs)):
        return False
    for t in inputs:
        mark = marks.get(id(t))
        if mark is not None and mark[0] is t and mark[2] == "tanh":
            return True
    return False


def _normalised_size(args, kwargs) -> int | None:
    """The size of the axis a softmax or log_softmax normalises (torch's implicit choice where no
    dim is given)."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, Tensor) or x.dim() == 0:
        return None
    if not isinstance(dim, int):
        dim = 0 if x.dim() in (1, 3) else 1
    return x.shape[dim] if -x.dim() <= dim < x.dim() else None


def _floating_copy(value):
    if isinstance(value, Tensor):
        with torch.inference_mode(False):
            return value.detach().clone()
    return value


def _tree_but_stand_ins(root: nn.Module) -> list[nn.Module]:
    """``root``'s submodules (not itself), a stand-in's parts left out: they are converted, and
    a stand-in checks at each call that its parts carry no hooks it was not converted with."""
    tree, seen, pending = [], {id(root)}, list(root.children())
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        tree.append(module)
        if not isinstance(module, FusedStandIn):
            pending.extend(module.children())
    return tree


def _pre_hook(module: nn.Module, args, kwargs):
    watch = _watch_of(module)
    if watch is None or watch.done:
        return None
    if torch.jit.is_tracing():  # torch.jit.trace: the watch waits for an eager call, quietly
        return None
    if torch.compiler.is_compiling():  # a trace of the user's: the watch waits for an eager call
        if not watch.quiet_calls:  # (one whose first call had no tanh: said nothing of it)
            warnings.warn(FIRST_CALL_COMPILED.format(watch.path, class_name(module)), stacklevel=2)
        return None
    if saved_tensors_hooks_active():  # checkpointing: the watch waits for a call outside it
        if not watch.warned_hooks and not watch.quiet_calls:  # (as above)
            watch.warned_hooks = True
            warnings.warn(FIRST_CALL_HOOKED.format(watch.path, class_name(module)), stacklevel=2)
        return None
    watch.done = True
    module._forward_pre_hooks.pop(watch.hook_ids[0], None)
    call = _current()
    if call is None:  # the outermost watched call of this thread
        call = _THREAD.watch = _CallWatch()
        fresh = True
    else:
        fresh = False
    args, kwargs = pytree.tree_map(_floating_copy, (args, kwargs))
    watch.recording = Recording(module, watch.path, args, kwargs)
    call.stack.append(watch.recording)
    if fresh:
        call.start()
    return None


FIRST_CALL_COMPILED = (
    "fuse_attention: {} ({}) is watched by the general path, which runs outside torch.compile: "
    "called inside a compiled model it runs its own code, unfused, and is not converted. Leave it "
    "out of the compiled region (torch.compiler.disable on its forward) to have it converted and "
    "fused; the named layouts' stand-ins run fused inside torch.compile"
)


FIRST_CALL_HOOKED = (
    "fuse_attention: {} ({}) is watched by the general path and called under saved-tensor hooks "
    "(torch.utils.checkpoint without reentrant, or save_on_cpu): converted at the end of such a "
    "call, its recomputation in the backward would run other code than its forward did, which "
    "non-reentrant checkpointing refuses. It runs its own code, unfused, until a call outside "
    "them; pass example_inputs to fuse_attention to convert it before the training loop"
)


def _post_hook(module: nn.Module, args, kwargs, output):
    watch = _watch_of(module)
    recording = getattr(watch, "recording", None)
    call = _current()
    if recording is None or call is None:
        return None
    watch.recording = None
    _unhook(module)
    if recording in call.stack:
        call.stack.remove(recording)
    if recording.path in watch.report.watching:
        watch.report.watching.remove(recording.path)
    _decide(call, recording, watch)
    if not call.stack:
        call.stop()
        _THREAD.watch = None
        for recording, watch in call.pending:
            watch.convert(recording, watch)
    return None


def _decide(call: _CallWatch, recording: Recording, watch: _Watch) -> None:
    """After a watched module's first call: report it or queue its conversion."""
    if not recording.events:
        # no tanh at all: nothing to decide, unless a later call computes its attention (a
        # decoder's intra-attention has nothing to attend to at the first step): its next calls
        # are watched too, quietly (it is not listed as watching), up to NO_TANH_CALLS in all
        watch.quiet_calls += 1
        if watch.quiet_calls < NO_TANH_CALLS:
            rearm(recording.module, listed=False)
        return
    mine = recording.events - call.claimed
    if not mine:
        return
    if not recording.softmaxed & mine:
        if mine <= call.affine | call.not_scores | call.reported:
            return  # a tanh layer, no attention, or reported for a module it calls already
        ended = sorted({call.ended[e] for e in mine if e in call.ended})
        went = (
            f" (its values went into {', '.join(map(repr, ended))}; the fused op normalises by "
            "a softmax, or a sigmoid over its sum)"
            if ended
            else ""
        )
        watch.report.skipped.append(
            Skipped(
                recording.path,
                (LAYOUT,),
                class_name(recording.module),
                f"computes a tanh over a sum, but no softmax over it was followed in its own "
                f"call{went}: the caller holds the softmax (then it converts with its caller), "
                "or the scores reach it through ops the watch does not follow (torch.mm, "
                "torch.cat of per-step scores in a Python loop)",
            )
        )
        call.reported |= mine
        watch.reported = True
        return
    call.claimed.update(mine)
    watch.decided = True
    call.pending.append((recording, watch))


class _Watch:
    """What a watched module needs at its first call (kept in the module's __dict__)."""

    def __init__(self, path: str, report: ConversionReport, backend: str, ids, convert) -> None:
        self.path, self.report, self.backend = path, report, backend
        self.convert = convert  # (recording, watch) -> None: trace, probe, swap (runtime.py)
        self.hook_ids = ids
        self.done = False  # its first call has begun
        self.decided = False  # it took its attention: tanh events in its later calls are its
        self.recording: Recording | None = None
        self.undecided_calls = 0  # first calls that could not decide (one key), watched again
        self.warned_hooks = False  # said once: calls under saved-tensor hooks wait
        self.quiet_calls = 0  # first calls without any tanh, watched again (see _decide)
        self.reported = False  # skipped at its first call (its caller does not repeat it)

    def __deepcopy__(self, memo):
        return None  # a copy of the module is not watched

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def _unhook(module: nn.Module) -> None:
    watch = _watch_of(module)
    if watch is None:
        return
    pre, post = watch.hook_ids
    module._forward_pre_hooks.pop(pre, None)
    module._forward_hooks.pop(post, None)
    module._forward_hooks_with_kwargs.pop(post, None)
    module._forward_hooks_always_called.pop(post, None)


def rearm(module: nn.Module, listed: bool = True) -> None:
    """Watch ``module``'s next call as if it were its first (the last one could not decide);
    ``listed``: in the report's ``watching`` until then."""
    watch = _watch_of(module)
    if watch is None:
        return
    pre = module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    post = module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
    watch.hook_ids = (pre.id, post.id)
    watch.done = watch.decided = False
    if listed:
        watch.report.watching.append(watch.path)


def unwatch_inside(module: nn.Module) -> None:
    """Stop watching the modules inside ``module``, converted now: their calls are part of its
    traced forward (a watch hook there would break TorchDynamo's graph of it)."""
    for sub in module.modules():
        watch = _watch_of(sub)
        if sub is module or watch is None:
            continue
        _unhook(sub)
        watch.done = True
        if watch.path in watch.report.watching:
            watch.report.watching.remove(watch.path)


def strip_watches(module: nn.Module) -> None:
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


def watch_model(model: nn.Module, report: ConversionReport, backend: str, convert) -> None:
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
                path or "(model)", report, backend, (pre.id, post.id), convert
            )
            report.watching.append(path or "(model)")
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
