"""Thin matchers (``Layout(traced=True)``): a named layout without a stand-in of its own, whose
modules the traced runtime converts at ``fuse_attention`` time (gnmt and the concat layouts).
Each converts at once and is counted, the report names the layout and the traced runtime, the
module (the same object, its class swapped) gives the original's outputs and gradients exactly,
and a look-alike is refused with the probe's reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seq2seq_fast import fuse_attention
from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn, Layout, registered_layouts
from seq2seq_fast.nn.convert._base import check_equivalent
from seq2seq_fast.nn.convert.traced.rewrite import recorded_runs
from seq2seq_fast.ops import fused_available
from seq2seq_fast.ops._torch_private import pytree
from tests import layouts

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

THIN = {"gnmt", "concat", "concat_batch_first", "chatbot_concat"}
B, S = 3, 6


def _gnmt_call(module, query_rank=3, masked=True):
    q, k = module.linear_q.in_features, module.linear_k.in_features
    keys = torch.randn(B, S, k) if module.batch_first else torch.randn(S, B, k)
    if query_rank == 2:
        query = torch.randn(B, q)
    else:
        query = torch.randn(B, 2, q) if module.batch_first else torch.randn(2, B, q)
    if masked:
        module.set_mask(torch.tensor([6, 4, 0]), keys.double())  # a row with no valid key
    return (query, keys)


def _concat_call(module, batch_first=False, masked=True):
    keys = torch.randn(B, S, 8) if batch_first else torch.randn(S, B, 8)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0] * 6])
    return (torch.randn(B, 5), keys, mask) if masked else (torch.randn(B, 5), keys)


# (name, make, the layout it converts as, a call of the module: (module) -> args, prepares state)
CASES = [
    *[
        (
            f"gnmt-normalize={n}-batch_first={bf}-query{rank}d-masked={m}",
            lambda n=n, bf=bf: layouts.GNMTAttention(5, 4, 7, normalize=n, batch_first=bf),
            "gnmt",
            lambda mod, rank=rank, m=m: _gnmt_call(mod, rank, m),
        )
        for n in (False, True)
        for bf in (False, True)
        for rank, m in ((3, True), (2, True), (3, False))
    ],
    ("concat", lambda: layouts.ConcatAttention(4, 5), "concat", _concat_call),
    (
        "concat-vector-nomask",
        lambda: layouts.ConcatAttention(4, 5, vector_score=True),
        "concat",
        lambda mod: _concat_call(mod, masked=False),
    ),
    (
        "concat_batch_first",
        lambda: layouts.ConcatAttention(4, 5, batch_first=True),
        "concat_batch_first",
        lambda mod: _concat_call(mod, batch_first=True),
    ),
    (
        "chatbot_concat",
        lambda: layouts.ChatbotAttn("concat", 5),
        "chatbot_concat",
        lambda mod: (torch.randn(1, B, 5), torch.randn(S, B, 5)),
    ),
]


def _outputs_and_gradients(module: nn.Module, args):
    args = [a.double().requires_grad_() if a.is_floating_point() else a for a in args]
    out = module(*args)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    gen = torch.Generator().manual_seed(3)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in leaves)
    named = sorted(module.named_parameters())
    inputs = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named] + inputs, allow_unused=True)
    return leaves, [torch.zeros(()) if g is None else g for g in grads]


def test_the_thin_matchers_are_registered_without_a_stand_in():
    thin = {layout.name for layout in registered_layouts() if layout.traced}
    assert thin == THIN
    assert all(layout.build is None for layout in registered_layouts() if layout.traced)
    assert all(layout.build is not None for layout in registered_layouts() if not layout.traced)


@pytest.mark.parametrize(("name", "make", "layout", "call"), CASES, ids=[c[0] for c in CASES])
def test_converted_at_fuse_attention_time_exactly(name, make, layout, call):
    torch.manual_seed(0)
    original = nn.ModuleDict({"attn": make()}).double()
    model = copy.deepcopy(original)
    attention = model["attn"]
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    mask_before = getattr(attention, "mask", None)
    report = fuse_attention_report(model)
    # counted at once, under the layout's name, through the traced runtime
    assert report.count == 1 and not report.skipped, str(report)
    assert [(r.path, r.layout) for r in report.replaced] == [("attn", layout)]
    assert report.replaced[0].traced and "key term" in report.replaced[0].traced
    assert f"as '{layout}' through the traced runtime" in str(report)
    # in place: the same object and Parameters, its class a subclass of the original's
    assert model["attn"] is attention and isinstance(attention, FusedStandIn)
    assert type(attention).__mro__[1] is type(original["attn"])
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert getattr(attention, "mask", None) is mask_before  # prepare ran on a copy only
    # exact against the float64 original, outputs and every gradient, the fused op running
    for batch_seed in (1, 2):
        torch.manual_seed(batch_seed)
        args = call(original["attn"])
        torch.manual_seed(batch_seed)
        call(attention)  # the same state (GNMT's mask) on the converted module
        want = _outputs_and_gradients(original["attn"], args)
        with recorded_runs() as ran:
            got = _outputs_and_gradients(attention, args)
        assert ran, "the fused op did not compute the weights"
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fuse_attention_counts_thin_matchers_at_once():
    model = nn.ModuleDict(
        {
            "gnmt": layouts.GNMTAttention(4, 4, 6, normalize=True),
            "concat": layouts.ConcatAttention(3, 4),
            "tutorial": layouts.TutorialAttention(4),
        }
    )
    assert fuse_attention(model) == 3


def test_a_copy_of_a_converted_module_traces_anew_and_matches():
    torch.manual_seed(0)
    original = nn.ModuleDict({"attn": layouts.ConcatAttention(4, 5)}).double()
    model = copy.deepcopy(original)
    fuse_attention(model)
    clone = copy.deepcopy(model)
    assert isinstance(clone["attn"], FusedStandIn)
    args = _concat_call(clone["attn"])
    got, want = (
        _outputs_and_gradients(clone["attn"], args),
        _outputs_and_gradients(original["attn"], args),
    )
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --- look-alikes: matched by structure, other math ------------------------------------------------


class ReluGNMT(layouts.GNMTAttention):
    """GNMT's children and parameters; relu where GNMT has tanh."""

    def calc_score(self, att_query, att_keys):
        return F.relu(att_query.unsqueeze(2) + att_keys.unsqueeze(1)).matmul(self.linear_att)


class NoSoftmaxConcat(layouts.ConcatAttention):
    """The concat layout's children; scores normalised by their sum, not a softmax."""

    def forward(self, hidden, encoder_outputs, mask=None):
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        hidden = hidden.unsqueeze(1).repeat(1, encoder_outputs.shape[1], 1)
        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        scores = self.v(energy).squeeze(2).exp()
        return scores / scores.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    "make",
    [lambda: ReluGNMT(5, 4, 7), lambda: NoSoftmaxConcat(4, 5)],
    ids=["gnmt-relu", "concat-no-softmax"],
)
def test_a_look_alike_is_refused_with_the_probes_reason(make, check):
    torch.manual_seed(0)
    module = make()
    model = nn.ModuleDict({"attn": module})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the probe always runs for a thin matcher: check=False trusts no structure here
    report = fuse_attention_report(model, check=check, traced=False)
    assert report.count == 0 and type(module) is type(make()), str(report)
    assert model["attn"] is module and not isinstance(module, FusedStandIn)
    [skipped] = report.skipped
    assert skipped.path == "attn" and set(skipped.layouts) <= THIN
    assert "through the traced runtime" in skipped.reason
    assert "not the fused op's form" in skipped.reason, skipped.reason
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_layout_says_traced_or_builds_and_has_no_check():
    gnmt = next(layout for layout in registered_layouts() if layout.name == "gnmt")
    with pytest.raises(ValueError, match="traced=True"):
        Layout("x", gnmt.match, None, gnmt.example_call)
    with pytest.raises(ValueError, match="traced=True"):
        Layout("x", gnmt.match, lambda m, b: m, gnmt.example_call, traced=True)
    with pytest.raises(ValueError, match="thin matcher"):
        check_equivalent(layouts.GNMTAttention(4, 4, 6), gnmt, "auto")
