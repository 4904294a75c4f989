"""The converter's general path (``seq2seq_fast/nn/convert/_traced.py``) on attentions no named
layout knows (tests/convert/layouts_traced.py): each additive one is converted at its first call
and then matches the original exactly (float64 and float32, outputs and the gradients of every
parameter and input, on calls of other sizes than the first), with its state_dict keys
unchanged and no tanh left in its calls; each look-alike is left as it is."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn
from seq2seq_fast.nn.convert._traced_graph import TracedWeights
from seq2seq_fast.ops.additive_attention import fused_available
from tests.convert.layouts_traced import CASES

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
        if w is None or g is None:
            assert (g is None or not g.any()) and (w is None or w.abs().max() < atol), (what, i)
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
    if case.converts is None:
        assert converted == [], str(report)
        assert not any(isinstance(m, FusedStandIn) for m in model.modules())
    else:
        assert converted == [case.converts], str(report)
        assert isinstance(_submodule(model, case.converts), FusedStandIn)
        assert type(_submodule(model, case.converts)).__mro__[1] is type(
            _submodule(original, case.converts)
        )
    # later calls, other sizes: the same outputs and gradients
    for batch, frames in ((3, 5), (4, 9)):
        torch.manual_seed(batch * frames)
        args = case.inputs(batch, frames, dtype)
        calls = TracedWeights.calls
        got = _run(model, args)
        want = _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
        if case.converts is not None:
            assert TracedWeights.calls > calls  # the fused op computed the weights
