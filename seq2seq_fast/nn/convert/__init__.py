"""``fuse_attention(model)``: swap the additive-attention submodules of an existing model for fused
ones, in place, each checked against the original before it is swapped.

One converter, two ways in. A named layout matches a module by its structure; the general path
(``traced/``) finds the rest by what their first call computes. Every layout lives in one module
of this package and registers a :class:`~seq2seq_fast.nn.convert._base.Layout` (see ``_base.py``):

- a *thin matcher* (``traced=True``: ``gnmt``, ``concat``, ``concat_batch_first``,
  ``chatbot_concat``) has no stand-in: the module it matches is converted at once by the general
  path's runtime (``traced/runtime.py``: trace, typed plan, rewrite, float64 probe, in-place
  class swap), with the layout's example call as its first call;
- the others keep a hand-written stand-in (checked by :func:`check_equivalent`), where it is
  measurably faster than the traced runtime or the graph cannot express the module
  (bench/RESULTS.md, "Which named layouts stay, and why").

The package imports every layout module below, so adding a layout touches one file.
``registered_layouts()`` lists them; each module's docstring gives the original's math, call and
what is not converted (``tutorial``, ``gnmt``, ``concat``, ``opennmt``, ``joeynmt``; the speech
and other toolkits in ``espnet``, ``speechbrain``, ``fairseq``, ``tacotron2``, ``coqui``,
``allennlp``, ``d2l``).

Stand-ins whose client attends one step at a time over a fixed memory project it once per memory
tensor (:mod:`seq2seq_fast.nn.keycache`) and, in training on the CPU kernel, gather the steps'
memory gradients once per sequence (:mod:`seq2seq_fast.nn.stepwise`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import pkgutil
from collections import deque

import torch
from torch import nn

from seq2seq_fast.nn.attention import BahdanauAttention, check_backend
from seq2seq_fast.nn.convert._base import (
    MODULE_INTERNALS,
    ConversionReport,
    FusedStandIn,
    Layout,
    Replaced,
    Skipped,
    as_original,
    check_equivalent,
    class_name,
    forked_random,
    register,
    registered_layouts,
)
from seq2seq_fast.nn.convert.traced import watch_model
from seq2seq_fast.nn.convert.traced.runtime import convert_now
from seq2seq_fast.ops._checks import without_autocast
from seq2seq_fast.ops._torch_private import uncompiled

__all__ = [
    "ConversionReport",
    "FusedStandIn",
    "Layout",
    "Replaced",
    "Skipped",
    "fuse_attention",
    "fuse_attention_report",
    "register",
    "registered_layouts",
]

logger = logging.getLogger(__name__)

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")


def _has_hooks(module: nn.Module) -> bool:
    return any(
        getattr(module, name, None)
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        )
    )


def _convert_one(module: nn.Module, path: str, backend: str, check: bool, report: ConversionReport):
    """What takes ``module``'s place (recording it in ``report``): a named layout's stand-in, or
    ``module`` itself converted in place by a thin matcher (``Layout.traced``); or None."""
    if isinstance(module, (FusedStandIn, BahdanauAttention)):
        return None
    matched = [
        layout
        for layout in registered_layouts()
        if _matches(layout, module) and _takes_example_call(layout, module)
    ]
    if not matched:
        return None
    reasons = []
    for layout in matched:
        reason = layout.unsupported(module) if layout.unsupported is not None else None
        if reason is None and layout.traced:
            # the same runtime a watched module's first call goes through, on the example call
            reason = convert_now(module, path, layout, report, backend)
            if reason is None:
                return module
            reason = f"through the traced runtime, on this layout's example call: {reason}"
        elif reason is None:
            fused, reason = _built(layout, module, backend)
            if fused is not None and not _takes_every_call(fused, module):
                continue  # another call than the layout's (the general path sees its own)
            if reason is None:
                reason = _stand_in_refused(module, layout, backend, check)
            if reason is None:
                fused.train(module.training)
                fused.keep_parts(type(module))
                as_original(fused, type(module))
                report.replaced.append(Replaced(path, layout.name, class_name(module)))
                return fused
        reasons.append(reason if len(matched) == 1 else f"{layout.name}: {reason}")
    if not reasons:
        return None
    names = tuple(layout.name for layout in matched)
    report.skipped.append(Skipped(path, names, class_name(module), "; ".join(reasons)))
    return None


def _built(layout: Layout, module: nn.Module, backend: str) -> tuple[nn.Module | None, str | None]:
    """``(the layout's stand-in for module, None)``, or ``(None, why it could not be built)``."""
    try:
        return layout.build(module, backend), None
    except Exception as exc:  # noqa: BLE001 - a layout that cannot build it: a skip
        return None, f"its stand-in could not be built ({type(exc).__name__}: {exc})"


def _takes_every_call(stand_in: nn.Module, module: nn.Module) -> bool:
    """Whether ``stand_in.forward`` takes every call ``module.forward`` takes: as many
    positional arguments, every parameter's name, ``*args`` and ``**kwargs`` where the original
    has them. Mellotron's ``Attention`` is NVIDIA Tacotron 2's with a sixth parameter
    (``attention_weights=None``, passed at every step): the 'tacotron2' stand-in, which takes
    five, failed at the first call."""
    try:
        theirs = inspect.signature(module.forward).parameters.values()
        ours = inspect.signature(stand_in.forward).parameters.values()
    except (TypeError, ValueError):  # (no signature to read: the example call decided)
        return True
    kinds = inspect.Parameter
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    our_kinds = {p.kind for p in ours}
    our_names = {p.name for p in ours if p.kind != kinds.POSITIONAL_ONLY}
    for kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
        if any(p.kind == kind for p in theirs) and kind not in our_kinds:
            return False
    if kinds.VAR_POSITIONAL not in our_kinds and sum(p.kind in positional for p in theirs) > sum(
        p.kind in positional for p in ours
    ):
        return False
    named = [p.name for p in theirs if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    return kinds.VAR_KEYWORD in our_kinds or all(name in our_names for name in named)


def _stand_in_refused(module: nn.Module, layout: Layout, backend: str, check: bool) -> str | None:
    """Why a named layout's stand-in may not replace ``module`` (hooks, the safety check), or
    None."""
    if _has_hooks(module):
        return "the module has hooks registered on it, which a stand-in would not run"
    if not check:
        return None
    try:
        with without_autocast():
            reason = check_equivalent(module, layout, backend)
    except Exception as exc:  # noqa: BLE001 - any failure refuses the conversion
        # (the module is not called as the layout calls it: not a difference found)
        return (
            "the safety check could not call it as this layout calls it "
            f"({type(exc).__name__}: {exc})"
        )
    return None if reason is None else f"differs from the stand-in on a random input: {reason}"


def _matches(layout: Layout, module: nn.Module) -> bool:
    try:
        return bool(layout.match(module))
    except Exception:  # noqa: BLE001 - a matcher that trips over a foreign module: no match
        return False


def _takes_example_call(layout: Layout, module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts the call ``layout`` makes (its arguments' number and
    names). A module that has a layout's children but another call is not that layout (keon's
    seq2seq has the concat form's ``attn`` and ``v``, and a call of its own): it is left to the
    general path, which sees its real first call, rather than skipped for a TypeError."""
    try:
        with forked_random():
            args, kwargs = layout.example_call(module, torch.float64)
        inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return False
    except Exception:  # noqa: BLE001 - not a question of the call: the layout's check decides
        return True
    return True


def fuse_attention_report(
    model: nn.Module,
    *,
    backend: str = "auto",
    check: bool = True,
    traced: bool = True,
    named: bool = True,
    example_inputs=None,
) -> ConversionReport:
    """Replace, in place, every recognised additive-attention submodule of ``model`` by a fused
    one, and say what was replaced and what matched a layout but was left alone, and why.

    Args:
        model: any module; its submodules are searched (``model`` itself is not replaced).
        backend: "auto", "fused" or "reference", given to every stand-in.
        check: before each swap, run the original and the stand-in on a small random input
            (float64 copies on the CPU; ``model`` is not touched) and refuse on any difference in
            outputs or gradients. ``check=False`` trusts the structural match alone. (A thin
            matcher's module is always probed: it goes through the traced runtime.)
        traced: also watch the other modules with parameters until their first call, and convert
            those that compute additive attention whatever their names (``traced/``: a trace
            of the call, the pattern found in its graph, a float64 probe of outputs and
            gradients on that call's input decides, whatever ``check`` says). They are added to
            the report as they are called; ``report.watching`` lists those not called yet.
        named: try the named layouts first (``registered_layouts()``; a thin matcher's module
            converts now, counted in the return value); ``named=False`` leaves everything to
            the general path at first calls (to compare the two).
        example_inputs: a call's arguments (a tuple, a dict of keyword arguments, or a
            ``(args, kwargs)`` pair of a tuple and a dict; a single tensor is one argument):
            ``model`` is called with them once, under ``torch.no_grad()``, before this returns
            (what a model keeps of its calls then holds no autograd graph), so the general path
            decides now and the report (and ``fuse_attention``'s count) is complete for every module
            that call reaches through its ``__call__`` and whose attention that call runs. A
            module the call reaches otherwise (``child.forward(x)``, a method such as
            ``infer``: its attention is converted with the module whose ``__call__`` ran it, if
            any) stays in ``report.watching``. A module whose call computes no tanh at all
            (a first decoder step without a previous state, an early return for one-step
            inputs) is not listed, as no module without a tanh is: its next calls are watched
            (up to three in all), and it converts at the first that computes its attention,
            added to the report then. The call's outputs are dropped, and what the model kept of
            the call is put back as it was: buffers (batch-norm statistics), plain attributes
            (a counter, a cached tensor, a list of past weights; attributes the call added are
            removed) and the random state. What the forward writes outside the model (a
            logger, a file) stays written. A call that fails raises ValueError naming
            example_inputs; the named stand-ins swapped in before it stay (each checked), and
            the watched modules convert at their first call. Without it, watched modules
            convert at their first call and are listed in ``report.watching`` until then.

    The stand-ins keep the original Parameter objects (optimisers keep working, ``state_dict``
    keys are unchanged), the call signature and the return values; a module the traced runtime
    converts stays the same object, its class swapped for a traced subclass, and a named stand-in
    is an instance of the original's class too (code that dispatches on it still finds it).
    A module reached by two paths is converted once. Modules fused before the call (an earlier
    call's, seq2seq_fast's own) are listed in ``report.fused_before``, not counted. The report is
    also logged at debug level.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_backend(backend)
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    for flag, value in (("traced", traced), ("named", named)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    if (
        named
        and any(
            _matches(layout, model) and _takes_example_call(layout, model)
            for layout in registered_layouts()
        )
        and not isinstance(model, FusedStandIn)
    ):
        raise ValueError(
            f"model itself is a recognised attention module ({type(model).__name__}); fuse_attention "
            "replaces submodules in place: wrap it in a parent module (e.g. nn.Sequential) first"
        )
    report = ConversionReport(fused_before=_fused_before(model))
    # id(original) -> (original, its stand-in or None); the original is held so its id stays its own
    done: dict[int, tuple[nn.Module, nn.Module | None]] = {}
    queue = deque([(model, "")] if named else [])
    while queue:
        parent, prefix = queue.popleft()
        for name, child in list(parent.named_children()):
            path = f"{prefix}{name}"
            if id(child) not in done:
                fused = _convert_one(child, path, backend, check, report)
                done[id(child)] = (child, fused)
                if fused is None:
                    queue.append((child, f"{path}."))
            fused = done[id(child)][1]
            if fused is not None:
                setattr(parent, name, fused)
    if traced:
        watch_model(model, report, backend)
        if example_inputs is not None:  # (eagerly: the general path runs outside torch.compile)
            _call_once(uncompiled(model), example_inputs)
    logger.debug("%s", report)
    return report


def _fused_before(model: nn.Module) -> list[str]:
    """The paths of ``model``'s submodules that are fused already (stand-ins, traced classes,
    seq2seq_fast's own attention), outermost only."""
    paths: list[str] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(f"{p}.") for p in paths):
            continue
        if isinstance(module, (FusedStandIn, BahdanauAttention)):
            paths.append(path)
    return paths


def _call_once(model: nn.Module, example_inputs) -> None:
    """``model(*args, **kwargs)`` for ``example_inputs`` (see fuse_attention_report), without
    gradients, the model's state put back afterwards (:func:`_state_put_back`); a failing call
    raises ValueError naming example_inputs."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    elif (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        args, kwargs = tuple(example_inputs[0]), example_inputs[1]
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    with _state_put_back(model):
        try:
            # without gradients: what the model keeps of the call on itself (the last weights, a
            # decoder's state) then holds no autograd graph, which would keep the call's memory
            # alive and make copy.deepcopy(model) fail ("graph leaves")
            with torch.no_grad():
                model(*args, **kwargs)
        except Exception as exc:
            raise ValueError(
                f"example_inputs: calling {type(model).__name__} with them failed "
                f"({type(exc).__name__}: {exc})"
            ) from exc


@contextlib.contextmanager
def _state_put_back(model: nn.Module):
    """Every module's state as it was before the example call, afterwards: buffers (their
    content and which tensor each name holds), plain attributes a forward keeps (a cached
    tensor, a step counter, a list of past weights: the objects, and a tensor's or a list's or
    dict's content), attributes the call added removed; and the random state. The converter's own
    attributes (``_fuse_attention_*``) and the conversions themselves stay. What a forward writes
    outside the model (a logger, a file) is not undone."""
    saved = []
    for module in model.modules():
        buffers = {name: (b, _copied(b)) for name, b in module._buffers.items()}
        plain = {k: (v, _copied(v)) for k, v in vars(module).items() if _forward_state(k)}
        saved.append((module, buffers, plain))
    # the CUDA devices whose random state the call may draw from (get_device: -1 on the CPU)
    indices = {t.get_device() for t in (*model.parameters(), *model.buffers())} - {-1}
    devices = sorted(indices) if torch.cuda.is_available() else []
    try:
        with forked_random(devices):
            yield
    finally:
        with torch.no_grad():
            for module, buffers, plain in saved:
                for name, (buffer, content) in buffers.items():
                    module._buffers[name] = _put_back(buffer, content)
                for key in [k for k in vars(module) if _forward_state(k) and k not in plain]:
                    del module.__dict__[key]
                for key, (value, content) in plain.items():
                    module.__dict__[key] = _put_back(value, content)


def _forward_state(key: str) -> bool:
    return key not in MODULE_INTERNALS and not key.startswith("_fuse_attention")


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, dict, set)):
        return value.copy()
    return None


def _put_back(value, content):
    """``value`` (the object an attribute held) with ``content`` (a copy taken before) again."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        if value.shape == content.shape and not torch.equal(value, content):
            with torch.inference_mode(value.is_inference()):  # (one made under inference_mode)
                value.copy_(content)
    elif isinstance(value, list):
        value[:] = content
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(content)
    return value


def fuse_attention(
    model: nn.Module,
    *,
    backend: str = "auto",
    check: bool = True,
    traced: bool = True,
    named: bool = True,
    example_inputs=None,
) -> int:
    """:func:`fuse_attention_report`, returning how many submodules were replaced by the time it
    returns: every named layout's, thin matchers included. With ``example_inputs`` that is every
    conversion the call reaches. Without it, the general path's other conversions come later,
    at each watched module's first call, and are not in the count
    (``fuse_attention_report(...).watching`` lists the modules still watched). Modules fused
    by an earlier call are not counted again."""
    report = fuse_attention_report(
        model,
        backend=backend,
        check=check,
        traced=traced,
        named=named,
        example_inputs=example_inputs,
    )
    return report.count
