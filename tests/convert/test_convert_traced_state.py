"""The general path's state: owned by the call that watches and by each converted module, never
shared between threads, between two converted models, or with a copy."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from seq2seq_fast.nn.convert import FusedStandIn, fuse_attention_report
from seq2seq_fast.nn.convert import traced as traced_package
from seq2seq_fast.nn.convert.traced.rewrite import recorded_runs
from seq2seq_fast.ops import fused_available
from tests.convert.layouts_traced import CASES

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)


def _case():
    return next(c for c in CASES if c.converts_at(torch.float64) is not None)


def test_no_mutable_module_globals_in_the_general_path():
    """Module-level names of the package are constants, functions, classes, or the thread's own
    slot (threading.local) and the memo of traced classes."""
    import types

    from seq2seq_fast.nn.convert.traced import runtime, watching

    # a memo of derived classes and the lock around TorchDynamo (see runtime.py): not state
    allowed_mutable = {"_CLASSES", "_DYNAMO_LOCK"}
    for module in (watching, runtime, traced_package):
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(
                value, (types.ModuleType, types.FunctionType, type, str, int, float, frozenset)
            ):
                continue
            if isinstance(value, threading.local) or name in allowed_mutable:
                continue
            if isinstance(value, (set, dict, list)) and name.isupper():
                continue  # name tables (_CARRIES, ...), never written
            if isinstance(value, (set, dict, list)) and name.startswith("_") and name[1:].isupper():
                continue
            assert not isinstance(value, (set, dict, list)), (module.__name__, name)


def test_two_models_convert_in_two_threads_each_with_its_own_report():
    case = _case()
    torch.manual_seed(0)
    models = [case.make().double() for _ in range(2)]
    reports = [fuse_attention_report(m) for m in models]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def first_call(model, seed):
        try:
            torch.manual_seed(seed)
            args = case.inputs(3, 5, torch.float64)
            barrier.wait()
            model(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(m, i)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert torch.get_default_dtype() == torch.float32  # the probes restored it
    path = case.converts_at(torch.float64)
    for model, report in zip(models, reports, strict=True):
        assert [r.path for r in report.replaced] == [path], str(report)
        assert isinstance(model.get_submodule(path), FusedStandIn)


def test_the_probe_changes_no_other_threads_default_dtype():
    """The probe leaves torch's default dtype alone. It set it to float64, process-wide: a
    thread that built its model during another thread's probe got float64 weights, and its
    float32 call failed ("mat1 and mat2 must have the same dtype")."""
    case = _case()
    errors: list[BaseException] = []
    made: list[torch.dtype] = []
    barrier = threading.Barrier(4)

    def build_and_call(seed):
        try:
            barrier.wait()
            for attempt in range(3):
                torch.manual_seed(seed * 10 + attempt)
                model = case.make()  # float32: parameters in the default dtype
                made.extend(p.dtype for p in model.parameters())
                fuse_attention_report(model)
                model(*case.inputs(3, 5, torch.float32))  # the watched first call, then the probe
                made.extend(
                    t.dtype for t in case.inputs(2, 4, torch.float32) if t.is_floating_point()
                )
                made.append(torch.zeros(2).dtype)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build_and_call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert set(made) == {torch.float32}


def test_a_watched_call_adds_no_process_wide_module_hooks():
    """The watch follows the module calls of a first call through hooks on the watched module's
    own tree. Process-wide hooks, there while the call ran, were seen by another thread's
    TorchDynamo trace, which guarded on them and failed when they were gone
    (InternalTorchDynamoError: KeyError), so a model converting in one thread broke the first
    call of another model in another."""
    from torch.nn.modules import module as module_globals

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(
                (
                    len(module_globals._global_forward_pre_hooks),
                    len(module_globals._global_forward_hooks),
                )
            )
            return x

    case = _case()
    torch.manual_seed(0)
    model = case.make().double()
    fuse_attention_report(model)
    model.probe = Probe()
    model.register_forward_pre_hook(lambda module, args: [module.probe(args[0])] and None)
    model(*case.inputs(3, 5, torch.float64))  # the watched first call
    assert seen and all(counts == (0, 0) for counts in seen), seen


def test_an_error_in_a_watched_first_call_reaches_the_user_as_it_is():
    """A first call that raises (a wrong input) gives the user's error, not one of the watch's,
    in the watched module and in one inside it; the next good call converts."""
    case = _case()
    torch.manual_seed(0)
    model = case.make().double()
    report = fuse_attention_report(model)
    args = case.inputs(3, 5, torch.float64)
    wrong = tuple(a[..., :-1] if a.is_floating_point() else a for a in args)
    with pytest.raises(RuntimeError) as caught:
        model(*wrong)
    assert "mutated during iteration" not in str(caught.value), caught.value
    model(*args)
    assert [r.path for r in report.replaced] == [case.converts_at(torch.float64)], str(report)


def test_a_thread_sees_only_its_own_fused_runs():
    case = _case()
    torch.manual_seed(0)
    model = case.make().double()
    fuse_attention_report(model)
    args = case.inputs(3, 5, torch.float64)
    model(*args)  # converts
    seen: dict[str, int] = {}

    def other_thread():
        with recorded_runs() as runs:
            model(*case.inputs(3, 5, torch.float64))
        seen["other"] = len(runs)

    with recorded_runs() as mine:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=600)
    assert seen["other"] >= 1 and mine == []  # the other thread's fused run is not ours


def test_a_copy_of_a_converted_module_traces_on_its_own():
    case = _case()
    torch.manual_seed(0)
    model = case.make().double()
    fuse_attention_report(model)
    model(*case.inputs(3, 5, torch.float64))
    path = case.converts_at(torch.float64)
    converted = model.get_submodule(path)
    state = converted.__dict__["_fuse_attention_traced"]
    twin = copy.deepcopy(model)
    assert twin.get_submodule(path).__dict__.get("_fuse_attention_traced") is None
    with recorded_runs() as runs:
        twin(*case.inputs(3, 5, torch.float64))
    assert runs and twin.get_submodule(path).__dict__["_fuse_attention_traced"] is not state
