"""The converter's general path (``seq2seq_fast/nn/convert/traced/``) on attentions no named
layout knows (tests/convert/layouts_traced.py): each additive one is converted at its first call
and then matches the original exactly (float64 and float32, outputs and the gradients of every
parameter and input, on calls of other sizes than the first), with its state_dict keys
unchanged and no tanh left in its calls; each look-alike is left as it is."""

from __future__ import annotations

import copy
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights
from seq2seq_fast.nn.convert.traced.runtime import TRACE_LIMIT
from seq2seq_fast.ops import fused_available
from tests.convert.layouts_traced import CASES, _Holder

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5)}
IDS = [case.name for case in CASES]


def _run(model, args):
    """Outputs and gradients (parameters by name, then inputs) of a random projection."""
    args = pytree.tree_map(
        lambda t: (
            t.clone().requires_grad_()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
        ),
        args,
    )
    out = model(*args)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    gen = torch.Generator().manual_seed(3)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in leaves)
    named = sorted(model.named_parameters())
    inputs = [
        t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    grads = torch.autograd.grad(loss, [p for _, p in named] + inputs, allow_unused=True)
    return pytree.tree_leaves(out), grads


def _assert_close(got, want, dtype, what):
    rtol, atol = TOLERANCES[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # a parameter the original trains (a score bias a softmax cancels: a gradient of 0 up
        # to rounding) must get a gradient after conversion too, not none (DDP, AdamW)
        assert not (g is None and w is not None), (what, i, "no gradient after conversion")
        if w is None or g is None:
            assert g is None or not g.any(), (what, i)
            continue
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=f"{what}[{i}]")


def _submodule(model, path):
    return model.get_submodule(path)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_converted_or_left_alone(case, dtype):
    torch.manual_seed(0)
    original = case.make().to(dtype)
    model = copy.deepcopy(original)
    keys = list(model.state_dict())
    report = fuse_attention_report(model)
    assert report.count == 0 and report.watching  # nothing until the first call
    torch.manual_seed(1)
    first = case.inputs(4, 7, dtype)
    _assert_close(_run(model, first)[0], _run(original, first)[0], dtype, "first call")
    assert list(model.state_dict()) == keys
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[name])
    converted = [r.path for r in report.replaced]
    # a rewrite the matcher makes is right: the probe never finds a difference (a refusal by the
    # probe is a wrong rewrite caught late, a bug)
    assert not any("differs from the fused op" in s.reason for s in report.skipped), str(report)
    converts = case.converts_at(dtype)
    if converts is None:
        assert converted == [], str(report)
        assert not any(isinstance(m, FusedStandIn) for m in model.modules())
    else:
        assert converted == [converts], str(report)
        assert isinstance(_submodule(model, converts), FusedStandIn)
        assert type(_submodule(model, converts)).__mro__[1] is type(_submodule(original, converts))
    # later calls, other sizes: the same outputs and gradients
    for batch, frames in ((3, 5), (4, 9)):
        torch.manual_seed(batch * frames)
        args = case.inputs(batch, frames, dtype)
        calls = TracedWeights.calls
        got = _run(model, args)
        want = _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
        if converts is not None:
            assert TracedWeights.calls > calls  # the fused op computed the weights


def _steps(model, args, count):
    """``count`` calls on the same tensors (a decoder's steps over one memory): outputs and the
    gradients of the summed projections, as :func:`_run` gives them."""
    args = pytree.tree_map(
        lambda t: (
            t.clone().requires_grad_()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
        ),
        args,
    )
    gen = torch.Generator().manual_seed(5)
    outs, loss = [], 0
    for _ in range(count):
        out = [t for t in pytree.tree_leaves(model(*args)) if isinstance(t, torch.Tensor)]
        outs += out
        loss = loss + sum(
            (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in out
        )
    named = sorted(model.named_parameters())
    inputs = [
        t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    grads = torch.autograd.grad(loss, [p for _, p in named] + inputs, allow_unused=True)
    return outs, grads


CONVERTED = [case for case in CASES if case.converts_at(torch.float64) is not None]


@pytest.mark.parametrize("case", CONVERTED, ids=[case.name for case in CONVERTED])
def test_steps_over_one_memory_and_weight_updates(case):
    """Several calls on one memory (the key projection cached, its gradient gathered once per
    sequence), then an in-place update of every parameter (the cache must see it)."""
    dtype = torch.float64
    torch.manual_seed(0)
    original = case.make().to(dtype)
    model = copy.deepcopy(original)
    fuse_attention_report(model)
    torch.manual_seed(1)
    model(*case.inputs(2, 4, dtype))  # the first call converts
    args = case.inputs(3, 6, dtype)
    for _ in range(2):
        got, want = _steps(model, args, 3), _steps(original, args, 3)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
        with torch.no_grad():
            for a, b in zip(model.parameters(), original.parameters(), strict=True):
                a.add_(0.05)
                b.add_(0.05)


def test_rows_without_a_valid_frame_follow_the_original():
    """A row with every frame masked: -inf fills give NaN weights in the original, finite ones
    uniform weights; the converted module gives the same (through the plain path)."""
    from tests.convert.layouts_traced import Pointer, Tempered, _Call, _Holder

    dtype = torch.float64
    for make, call in (
        (
            lambda: _Holder(Pointer()),
            lambda b, t, pad: (
                torch.randn(b, t, 6, dtype=dtype),
                torch.randn(b, 5, dtype=dtype),
                pad,
            ),
        ),
        (
            lambda: _Call(Tempered()),
            lambda b, t, pad: (
                torch.randn(b, 5, dtype=dtype),
                torch.randn(b, t, 6, dtype=dtype),
                ~pad,
            ),
        ),
    ):
        torch.manual_seed(0)
        original = make().to(dtype)
        model = copy.deepcopy(original)
        report = fuse_attention_report(model)
        pad = torch.zeros(3, 5, dtype=torch.bool)
        model(*call(3, 5, pad))
        assert report.count == 1, str(report)
        pad[1] = True
        args = call(3, 5, pad)
        got, want = _run(model, args), _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")


def test_report_names_the_energy_module_and_converts_its_caller():
    from tests.convert.layouts_traced import AttentiveCell, _Holder

    model = _Holder(AttentiveCell()).double()
    report = fuse_attention_report(model)
    assert set(report.watching) == {"(model)", "att", "att.energy"}
    b, t = 2, 4
    model(
        torch.randn(b, 5, dtype=torch.float64),
        torch.randn(b, 5, dtype=torch.float64),
        torch.randn(b, t, 6, dtype=torch.float64),
        torch.ones(b, t, dtype=torch.bool),
    )
    assert [r.path for r in report.replaced] == ["att"]
    assert [s.path for s in report.skipped] == ["att.energy"]
    assert "caller" in report.skipped[0].reason
    assert report.watching == []
    assert "traced" in str(report)


def test_traced_false_watches_nothing():
    from tests.convert.layouts_traced import Pointer, _Holder

    model = _Holder(Pointer())
    report = fuse_attention_report(model, traced=False)
    assert report.watching == []
    model(torch.randn(2, 3, 6), torch.randn(2, 5), torch.zeros(2, 3, dtype=torch.bool))
    assert report.count == 0 and not report.skipped
    assert not model._forward_pre_hooks and not model.att._forward_pre_hooks


def test_a_converted_module_deep_copies_and_pickles_converted(tmp_path):
    from tests.convert.layouts_traced import Pointer, _Holder

    dtype = torch.float64
    torch.manual_seed(0)
    original = _Holder(Pointer()).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    args = (
        torch.randn(2, 4, 6, dtype=dtype),
        torch.randn(2, 5, dtype=dtype),
        torch.tensor([[False] * 4, [False, False, True, True]]),
    )
    model(*args)
    assert report.count == 1
    torch.save(model, tmp_path / "model.pt")
    for other in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert isinstance(other.att, FusedStandIn) and isinstance(other.att, Pointer)
        calls = TracedWeights.calls
        _assert_close(_run(other, args)[0], _run(original, args)[0], dtype, "outputs")
        assert TracedWeights.calls > calls


def test_location_terms_are_formed_inside_the_kernels(monkeypatch):
    """A conv + dense location term goes to the location-aware steps (keys formed in the
    kernel), and the steps of one memory still match the original."""
    from seq2seq_fast.nn.convert.traced import rewrite as traced_rewrite
    from tests.convert.layouts_traced import LocationHolder, _location_call

    calls = []
    real = traced_rewrite.attend_location
    monkeypatch.setattr(
        traced_rewrite, "attend_location", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    dtype = torch.float64
    torch.manual_seed(0)
    original = LocationHolder().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    model(*_location_call(2, 4, dtype))
    assert [r.path for r in report.replaced] == ["attention"]
    args = _location_call(3, 6, dtype)
    got, want = _steps(model, args, 3), _steps(original, args, 3)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")
    assert len(calls) >= 3


class _NoGradInputs(torch.nn.Module):
    """Additive attention that refuses inputs that need gradients (the probe's always do)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(5, 4), torch.nn.Linear(6, 4)
        self.v = torch.nn.Linear(4, 1)

    def forward(self, query, memory):
        if memory.requires_grad:
            raise TypeError("no gradients through the memory")
        e = self.v(torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))).squeeze(2)
        return torch.softmax(e, -1)


def test_a_probe_that_cannot_run_leaves_the_module_and_the_call_alone():
    from tests.convert.layouts_traced import _Holder

    model = _Holder(_NoGradInputs())
    report = fuse_attention_report(model)
    args = (torch.randn(2, 5), torch.randn(2, 3, 6))
    want = model.att.__class__.forward(model.att, *args)
    torch.testing.assert_close(model(*args), want)  # the first call: the original's result
    assert report.count == 0 and "could not run" in report.skipped[0].reason
    assert type(model.att) is _NoGradInputs


class _CastsToFloat32(torch.nn.Module):
    """forward(memory [B, T, K], lengths [B] ints, query [B, Q]) -> (context, weights): a coverage
    term from a uniform first-step distribution made with ``.float()`` (a speech toolkit's form),
    so it runs in float32 only. ``squash`` replaces the tanh in the look-alike."""

    def __init__(self, squash=torch.tanh):
        super().__init__()
        self.q, self.k = torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(6, 4)
        self.cov = torch.nn.Linear(1, 4, bias=False)
        self.v = torch.nn.Linear(4, 1, bias=False)
        self.squash = squash

    def forward(self, memory, lengths, query):
        pad = torch.arange(memory.size(1))[None, :] >= lengths[:, None]
        first = (~pad).float() / lengths.float()[:, None]
        x = self.q(query).unsqueeze(1) + self.k(memory) + self.cov(first.unsqueeze(2))
        e = self.v(self.squash(x)).squeeze(2).masked_fill(pad, -float("inf"))
        w = torch.softmax(e, -1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


@pytest.mark.parametrize("squash", [torch.tanh, torch.relu], ids=["tanh", "relu"])
def test_a_module_that_runs_in_float32_only_is_probed_in_float32(squash):
    """The float64 probe cannot run it (its float32 mask meets float64 scores); its own calls run
    in float32, so the probe runs there, with float32's tolerances. The look-alike stays."""
    from tests.convert.layouts_traced import _Holder

    torch.manual_seed(0)
    original = _Holder(_CastsToFloat32(squash))
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    lengths = torch.tensor([7, 3])
    model(torch.randn(2, 7, 6), lengths, torch.randn(2, 5))
    if squash is torch.relu:
        assert report.count == 0 and type(model.att) is _CastsToFloat32, str(report)
        return
    assert report.count == 1 and "probed in float32" in report.replaced[0].layout, str(report)
    args = (torch.randn(3, 5, 6), torch.tensor([5, 1, 4]), torch.randn(3, 5))
    got, want = _run(model, args), _run(original, args)
    _assert_close(got[0], want[0], torch.float32, "outputs")
    _assert_close(got[1], want[1], torch.float32, "gradients")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_first_call_without_gradients_still_converts(mode):
    from tests.convert.layouts_traced import Pointer, _Holder, _pointer_call

    dtype = torch.float64
    torch.manual_seed(0)
    original = _Holder(Pointer()).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    with getattr(torch, mode)():
        model(*_pointer_call(2, 4, dtype))
    assert report.count == 1, str(report)
    args = _pointer_call(3, 5, dtype)
    got, want = _run(model, args), _run(original, args)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")


class _GrowingCoverage(torch.nn.Module):
    """forward(query [B, Q], memory [B, T, K], past [list of [B, T]]) -> weights [B, T]: coverage
    over a list of every past step's weights, which grows by one each step (an ASR toolkit's
    form). Each call has a new structure for TorchDynamo: it traces anew every call."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(5, 4, bias=False)
        self.k = torch.nn.Linear(6, 4)
        self.cov = torch.nn.Linear(1, 4, bias=False)
        self.v = torch.nn.Linear(4, 1, bias=False)

    def forward(self, query, memory, past):
        coverage = torch.stack(past).sum(0).unsqueeze(2)
        x = self.q(query).unsqueeze(1) + self.k(memory) + self.cov(coverage)
        return torch.softmax(self.v(torch.tanh(x)).squeeze(2), -1)


def test_a_module_that_traces_anew_every_call_is_put_back_and_says_why():
    from tests.convert.layouts_traced import _Holder

    dtype = torch.float64
    torch.manual_seed(0)
    original = _Holder(_GrowingCoverage()).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    memory, query = torch.randn(2, 3, 6, dtype=dtype), torch.randn(2, 5, dtype=dtype)
    past = [torch.full((2, 3), 1 / 3, dtype=dtype)]
    model(query, memory, past)  # the first call converts
    assert report.count == 1 and isinstance(model.att, FusedStandIn), str(report)
    limit = max(torch._dynamo.config.recompile_limit, TRACE_LIMIT)
    with pytest.warns(UserWarning, match="put back"):
        for _ in range(limit + 2):  # each call traces anew until the limit
            got = model(query, memory, past)
            torch.testing.assert_close(got, original(query, memory, past), rtol=1e-10, atol=1e-10)
            past = [*past, got.detach()]
            if type(model.att) is _GrowingCoverage:
                break
    assert type(model.att) is _GrowingCoverage
    assert report.count == 0, str(report)
    assert "recompile limit" in report.skipped[-1].reason and report.skipped[-1].path == "att"
    torch.testing.assert_close(model(query, memory, past), original(query, memory, past))


def test_a_converted_module_stays_converted_over_new_sizes_and_grad_modes():
    from tests.convert.layouts_traced import Pointer, _Holder, _pointer_call

    model = _Holder(Pointer())
    report = fuse_attention_report(model)
    model(*_pointer_call(2, 4, torch.float32))
    assert report.count == 1, str(report)
    for step in range(12):  # sizes change, and eval calls without gradients come in between
        # (short decodes of new shapes trace anew; none of that may put the module back)
        if step % 4 == 3:
            with torch.no_grad():
                model(*_pointer_call(3, 7, torch.float32))
        model(*_pointer_call(2 + step % 3, 4 + step, torch.float32))
    assert isinstance(model.att, FusedStandIn) and report.count == 1, str(report)


class _ListCache(torch.nn.Module):
    """forward(memory [B, T, K], query [B, Q]) -> (context, weights); the projected memory kept
    from the first step in a list (one entry per head in a multi-head toolkit's form)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(6, 4, bias=False)
        self.q = torch.nn.Linear(5, 4)
        self.v = torch.nn.Linear(4, 1)
        self.cache = None

    def forward(self, memory, query):
        if self.cache is None:
            self.cache = [self.k(memory)]
        w = torch.softmax(self.v(torch.tanh(self.cache[0] + self.q(query).unsqueeze(1))), 1)
        return torch.bmm(w.squeeze(2).unsqueeze(1), memory).squeeze(1), w.squeeze(2)


def test_state_kept_in_a_list_of_graph_tensors_converts():
    dtype = torch.float64
    torch.manual_seed(0)

    def steps(model, memory):
        model.cache = None
        state, outs = torch.zeros(memory.size(0), 5, dtype=dtype), []
        for _ in range(3):
            context, _ = model(memory, state)
            state = torch.tanh(state + context.sum(1, keepdim=True))
            outs.append(state)
        return torch.stack(outs, 1)

    original = _ListCache().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    memory = torch.randn(2, 7, 6, dtype=dtype)
    steps(model, memory).sum().backward()  # converts during the first sequence's steps
    assert report.count == 1 and isinstance(model, FusedStandIn), str(report)
    memory = torch.randn(3, 5, 6, dtype=dtype, requires_grad=True)
    got = steps(model, memory)
    (g_got,) = torch.autograd.grad(got.sum(), memory)
    want = steps(original, memory)
    (g_want,) = torch.autograd.grad(want.sum(), memory)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


class _Sharpened(torch.nn.Module):
    """forward(memory [B, T, K], query [B, Q]) -> weights; the scores times a float attribute."""

    def __init__(self, sharpen: float) -> None:
        super().__init__()
        self.k = torch.nn.Linear(6, 4)
        self.q = torch.nn.Linear(5, 4, bias=False)
        self.v = torch.nn.Linear(4, 1, bias=False)
        self.sharpen = sharpen

    def forward(self, memory, query):
        e = self.v(torch.tanh(self.k(memory) + self.q(query).unsqueeze(1))).squeeze(2)
        return torch.softmax(self.sharpen * e, dim=1)


def test_instances_whose_float_scales_differ_all_convert():
    """A second value of a float attribute makes TorchDynamo pass it as a graph input (a
    symbolic float): the scale then comes in at each call."""
    dtype = torch.float64
    for i, sharpen in enumerate((1.0, 2.0, 0.5, 3.0)):
        torch.manual_seed(i)
        original = _Sharpened(sharpen).to(dtype)
        model = copy.deepcopy(original)
        report = fuse_attention_report(model)
        args = (torch.randn(2, 7, 6, dtype=dtype), torch.randn(2, 5, dtype=dtype))
        model(*args)
        assert report.count == 1, (sharpen, str(report))
        args = (torch.randn(3, 4, 6, dtype=dtype), torch.randn(3, 5, dtype=dtype))
        got, want = _run(model, args), _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_first_call_with_a_batch_of_one_decides_the_same(case):
    """TorchDynamo fixes sizes of 1, so at a batch of one the query term varies along no axis: it
    is told from a bias by coming from the call's inputs. Look-alikes stay look-alikes."""
    dtype = torch.float64
    torch.manual_seed(0)
    original = case.make().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    torch.manual_seed(1)
    first = case.inputs(1, 7, dtype)
    _assert_close(_run(model, first)[0], _run(original, first)[0], dtype, "first call")
    converted = [r.path for r in report.replaced]
    converts = case.converts_at(dtype)
    assert converted == ([] if converts is None else [converts]), str(report)
    for batch in (1, 3):
        torch.manual_seed(batch)
        args = case.inputs(batch, 5, dtype)
        got, want = _run(model, args), _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")


class _Widths(torch.nn.Module):
    """forward(memory [B, T, 6], query [B, 5], pad [B, T]) -> weights; width and scaling vary by
    instance, so instances need traces of their own."""

    def __init__(self, width: int, halve: bool) -> None:
        super().__init__()
        self.k = torch.nn.Linear(6, width)
        self.q = torch.nn.Linear(5, width, bias=False)
        self.v = torch.nn.Linear(width, 1, bias=False)
        self.halve = halve

    def forward(self, memory, query, pad):
        e = self.v(torch.tanh(self.k(memory) + self.q(query).unsqueeze(1))).squeeze(2)
        if self.halve:
            e = e / 2.0
        return torch.softmax(e.masked_fill(pad, -float("inf")), 1)


def test_many_instances_of_one_class_each_convert_and_run_fused():
    """TorchDynamo's recompile limit (8) is counted per compiled function: with one per class, the
    traces of a few instances (widths, dtypes, grad modes) used it up, and later instances were
    refused or ran unfused. Each converted module has a cache of its own."""
    limit = torch._dynamo.config.recompile_limit
    for i in range(limit + 2):
        dtype = torch.float64 if i % 2 else torch.float32
        torch.manual_seed(i)
        original = torch.nn.Sequential()
        original.att = _Widths(4 + i, i % 3 == 0)
        original = original.to(dtype)
        model = copy.deepcopy(original)
        report = fuse_attention_report(model)

        def args(b, t, dtype=dtype):
            pad = torch.zeros(b, t, dtype=torch.bool)
            pad[0, -1] = True
            return (torch.randn(b, t, 6, dtype=dtype), torch.randn(b, 5, dtype=dtype), pad)

        model.att(*args(2, 4 + i % 5))  # converts
        assert report.count == 1, (i, str(report))
        calls = TracedWeights.calls
        with torch.no_grad():
            model.att(*args(3, 6))
        call = args(2, 7)
        got, want = _run(model.att, call), _run(original.att, call)
        assert TracedWeights.calls >= calls + 2, i  # both calls ran the fused op
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")


class _OptionalLocation(torch.nn.Module):
    """A location-aware attention whose first decoder step gets no previous weights (None: a
    row of zeros), as kospeech's LocationAwareAttention takes ``last_alignment_energy=None``."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(6, 6, bias=False)
        self.k = torch.nn.Linear(6, 6)
        self.conv = torch.nn.Conv1d(1, 3, 3, padding=1)
        self.loc = torch.nn.Linear(3, 6, bias=False)
        self.v = torch.nn.Linear(6, 1)

    def forward(self, query, memory, last):
        if last is None:
            last = memory.new_zeros(memory.shape[0], memory.shape[1])
        location = self.loc(self.conv(last.unsqueeze(1)).transpose(1, 2))
        x = self.q(query).unsqueeze(1) + self.k(memory) + location
        w = torch.softmax(self.v(torch.tanh(x)).squeeze(-1), -1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


def test_a_decoders_training_and_validation_calls_stay_converted():
    """A first step without state (None, then a tensor), batch and memory sizes that change,
    training's and validation's grad modes and a batch of 1 each take traces of their own: 8 in
    all put kospeech's LocationAwareAttention back (TorchDynamo's default limit) in its first
    epoch. The module stays converted and matches over two such epochs."""
    from tests.convert.layouts_traced import _Holder

    dtype = torch.float64
    torch.manual_seed(0)
    original = _Holder(_OptionalLocation()).to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(1)

    def steps(net, batch, frames, memory=None, queries=None):
        memory = (
            torch.randn(batch, frames, 6, generator=gen, dtype=dtype) if memory is None else memory
        )
        queries = (
            [torch.randn(batch, 6, generator=gen, dtype=dtype) for _ in range(3)]
            if queries is None
            else queries
        )
        last, out = None, []
        for query in queries:
            context, last = net(query, memory, last)
            out.append(context)
        return torch.stack(out), memory, queries

    report = fuse_attention_report(
        model,
        example_inputs=(torch.randn(2, 6, dtype=dtype), torch.randn(2, 5, 6, dtype=dtype), None),
    )
    assert report.count == 1, str(report)
    for _ in range(2):
        for batch, frames in ((8, 20), (8, 23), (6, 17), (8, 31)):
            got, memory, queries = steps(model, batch, frames)
            want, _, _ = steps(original, batch, frames, memory, queries)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
            got.sum().backward()
        with torch.no_grad():
            for batch, frames in ((1, 13), (4, 15)):
                calls = TracedWeights.calls
                got, memory, queries = steps(model, batch, frames)
                want, _, _ = steps(original, batch, frames, memory, queries)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
                assert TracedWeights.calls == calls + 3, "a call ran unfused"
    assert isinstance(model.att, FusedStandIn) and report.count == 1, str(report)


def _pool_after_recurrence(proj, query, features):
    """Learned-query pooling over time-major features [T, B, F], in a function of its own."""
    weights = torch.softmax(torch.matmul(torch.tanh(proj(features)), query).squeeze(-1), dim=0)
    return (features * weights.unsqueeze(-1)).sum(0)


class _RecurrentPooling(torch.nn.Module):
    """A GRU, then pooling in a helper function: TorchDynamo breaks the forward's graph at the
    GRU and traces the helper as a frame of its own, which every instance of the class shares."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(6, 5, bidirectional=True)
        self.proj = torch.nn.Linear(10, 10)
        self.query = torch.nn.Parameter(torch.randn(10, 1) * 0.3)

    def forward(self, x):
        features, _ = self.gru(x)
        return _pool_after_recurrence(self.proj, self.query, features)


def test_many_instances_whose_shared_helper_traces_each_convert():
    """Each conversion traces the shared helper frame again (the probe's float64 copy, other
    dtypes): from the 9th instance in a process TorchDynamo's default limit of 8 refused it with
    "no tanh in the graphs"."""
    from tests.convert.layouts_traced import _Holder

    for i in range(10):
        dtype = torch.float64 if i % 2 else torch.float32
        torch.manual_seed(i)
        original = _Holder(_RecurrentPooling()).to(dtype)
        model = copy.deepcopy(original)
        x = torch.randn(4, 3, 6, dtype=dtype)
        report = fuse_attention_report(model, example_inputs=(x,))
        assert report.count == 1, (i, str(report))
        calls = TracedWeights.calls
        _assert_close(model(x), original(x), dtype, "outputs")
        assert TracedWeights.calls > calls, i


class _MaskFromScoresSize(torch.nn.Module):
    """A pointer's step: a mask made from the scores' size (``torch.zeros(logits.size())``, as
    pemami4911's neural-combinatorial-rl does) marks the positions already pointed at, before
    the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(6, 4)
        self.k = torch.nn.Linear(5, 4, bias=False)
        self.v = torch.nn.Parameter(torch.randn(4))

    def forward(self, query, memory, pointed):
        e = (torch.tanh(self.q(query).unsqueeze(1) + self.k(memory)) * self.v).sum(-1)
        mask = torch.zeros(e.size(), dtype=torch.bool)
        mask[torch.arange(e.size(0)), pointed] = True
        w = torch.softmax(e.masked_fill(mask, float("-inf")), -1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


def test_a_size_of_the_scores_read_before_the_softmax():
    """With dynamic sizes (from the second batch size on) the scores' .size() is a node of the
    graph; the rewrite asked it of the fused weights, made after its reader: "UnboundLocalError:
    cannot access local variable 'size_3'" at every call with a new batch size."""
    from tests.convert.layouts_traced import _Holder

    dtype = torch.float64
    torch.manual_seed(0)
    original = _Holder(_MaskFromScoresSize()).to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(3)

    def call(batch):
        return (
            torch.randn(batch, 6, generator=gen, dtype=dtype),
            torch.randn(batch, 7, 5, generator=gen, dtype=dtype),
            torch.randint(0, 7, (batch,), generator=gen),
        )

    report = fuse_attention_report(model, example_inputs=call(3))
    assert report.count == 1, str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the dynamic trace runs its own code, and says so)
        for batch in (3, 4, 5, 2):
            args = call(batch)
            got, want = _run(model.att, args), _run(original.att, args)
            _assert_close(got[0], want[0], dtype, "outputs")
            _assert_close(got[1], want[1], dtype, "gradients")


class _WordPooling(torch.nn.Module):
    """HAN's word level: attention pooling of each sentence's words."""

    def __init__(self) -> None:
        super().__init__()
        self.W = torch.nn.Linear(6, 4)
        self.u = torch.nn.Linear(4, 1, bias=False)

    def forward(self, h):  # [N, W, D] -> [N, D]
        w = torch.softmax(self.u(torch.tanh(self.W(h))).squeeze(-1), dim=1)
        return (w.unsqueeze(-1) * h).sum(1)


class _SentencePooling(torch.nn.Module):
    """HAN's sentence level, which runs the word level inside its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.words = _WordPooling()
        self.W = torch.nn.Linear(6, 5)
        self.u = torch.nn.Linear(5, 1, bias=False)

    def forward(self, x):  # [B, S, W, D] -> [B, D]
        b, n, w, d = x.shape
        h = self.words(x.reshape(b * n, w, d)).view(b, n, d)
        e = self.u(torch.tanh(self.W(h))).squeeze(-1)
        return (torch.softmax(e, 1).unsqueeze(-1) * h).sum(1)


def test_a_converted_module_inside_another_says_nothing_of_torch_compile():
    """The outer module's own trace reached the inner one, which warned that it was "called
    inside a compiled model" (and advised torch.compiler.disable) though nobody compiled
    anything. Inside the user's torch.compile both still say so."""
    torch.manual_seed(0)
    original = _Holder(_SentencePooling()).double()
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(5)
    example = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64)
    report = fuse_attention_report(model, example_inputs=((example,), {}))
    assert report.count == 2, str(report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in ((2, 3, 4, 6), (3, 2, 5, 6), (1, 4, 2, 6)):
            x = torch.randn(*shape, generator=gen, dtype=torch.float64)
            calls = TracedWeights.calls
            got = model(x)
            assert TracedWeights.calls - calls == 2  # both levels ran fused
            torch.testing.assert_close(got, original(x), atol=1e-12, rtol=1e-12)
    said = [str(w.message) for w in caught if "fuse_attention" in str(w.message)]
    assert not said, said
    with pytest.warns(UserWarning, match=r"att\.words .*inside a compiled model"):
        torch.compile(model, backend="eager")(example)


class _MaskFromItems(torch.nn.Module):
    """A mask built in a Python loop from ``lengths[b].item()`` (AuCson's batch attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(8, 4)
        self.v = torch.nn.Parameter(torch.randn(4) * 0.5)

    def forward(self, query, keys, lengths):  # [B, 4], [B, T, 4], [B]
        t = keys.shape[1]
        energy = torch.tanh(self.attn(torch.cat([query.unsqueeze(1).expand_as(keys), keys], 2)))
        e = energy @ self.v
        rows = [[False] * int(n.item()) + [True] * (t - int(n.item())) for n in lengths]
        return torch.softmax(e.masked_fill(torch.tensor(rows), -1e9), dim=1)


def test_the_converters_own_trace_prints_no_torch_compile_advice():
    """TorchDynamo printed a dozen lines advising ``capture_scalar_outputs`` at the graph break
    of ``.item()`` when the converter traced the module, to a user who compiled nothing. (In a
    fresh process: torch's log handler writes to the stderr it found at import.)"""
    script = (
        "import torch\n"
        "from seq2seq_fast.nn import fuse_attention_report\n"
        "from tests.convert.layouts_traced import _Holder\n"
        "from tests.convert.test_convert_traced import _MaskFromItems\n"
        "model = _Holder(_MaskFromItems()).double()\n"
        "args = (torch.randn(3, 4).double(), torch.randn(3, 5, 4).double(), torch.tensor([5, 3, 2]))\n"
        "report = fuse_attention_report(model, example_inputs=(args, {}))\n"
        "model(*args)\n"
        "print(report)\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graph break" in done.stdout, done.stdout  # (the converter's own one line)
    assert "item()" not in done.stderr, done.stderr[-3000:]
