"""The general path and the user's own torch.compile: a converted module inside a compiled model
runs its own code and says so; a compiled model converts through the module it wraps; a watched
module first called inside a compiled model waits for an eager call and says so; left out of
the compiled region, the converted module runs the fused replacement."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seq2seq_fast.nn.convert import fuse_attention_report
from seq2seq_fast.nn.convert.traced.rewrite import recorded_runs
from seq2seq_fast.ops import fused_available
from tests.layouts import TutorialAttention

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.attn = TutorialAttention(8)

    def forward(self, query, keys):
        context, weights = self.attn(self.lin(query), keys)
        return context.sin(), weights


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 1, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)


def _pair():
    torch.manual_seed(0)
    plain = Model()
    return plain, copy.deepcopy(plain)


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_converted_module_inside_a_compiled_model_runs_its_own_code_and_says_so():
    plain, model = _pair()
    report = fuse_attention_report(model, named=False, example_inputs=_inputs())
    assert report.count == 1, report
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(UserWarning, match="runs outside torch.compile"), recorded_runs() as ran:
        got = compiled(*_inputs())
    assert not ran
    _same(got, plain(*_inputs()))


def test_left_out_of_the_compiled_region_it_runs_fused():
    plain, model = _pair()
    fuse_attention_report(model, named=False, example_inputs=_inputs())
    model.attn.forward = torch.compiler.disable(model.attn.forward)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with recorded_runs() as ran:
        got = compiled(*_inputs())
    assert len(ran) == 1
    _same(got, plain(*_inputs()))


def test_a_compiled_model_converts_through_the_module_it_wraps():
    plain, model = _pair()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    report = fuse_attention_report(compiled, named=False, example_inputs=_inputs())
    assert report.count == 1 and report.replaced[0].path == "_orig_mod.attn", report
    with recorded_runs() as ran:
        got = model(*_inputs())  # the wrapped model, eagerly: fused
    assert len(ran) == 1
    _same(got, plain(*_inputs()))


def test_a_watched_module_first_called_inside_torch_compile_waits_and_says_so():
    plain, model = _pair()
    report = fuse_attention_report(model, named=False)
    assert "attn" in report.watching, report
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(UserWarning, match="is watched by the general path"):
        got = compiled(*_inputs())
    _same(got, plain(*_inputs()))
    assert report.count == 0 and "attn" in report.watching, report
    with recorded_runs():
        model(*_inputs())  # an eager call decides
    assert report.count == 1, report
