"""Converter layouts of NLP projects (the PyTorch tutorial, GNMT, concat, OpenNMT mlp
GlobalAttention, JoeyNMT Bahdanau): each against its plain-PyTorch re-creation (tests/layouts.py)
in a few decoder steps, with padding where the layout takes it."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn, registered_layouts
from seq2seq_fast.nn.convert.traced.key_terms import KeyTerm
from seq2seq_fast.ops import fused_available
from tests import layouts

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

B, S, STEPS = 3, 6, 4
LENGTHS = torch.tensor([6, 4, 1])


def _valid(lengths=LENGTHS, num_keys=S):
    return torch.arange(num_keys).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S], True = valid


@dataclass
class Family:
    make: Callable[[], nn.Module]  # the original, float64 parameters are set by the test
    layout: str
    inputs: Callable[[torch.dtype], dict]  # leaf tensors (requires_grad) and constants
    step: Callable[[nn.Module, dict, object], tuple]  # (outputs, new state)
    start: Callable[[nn.Module, dict], object]  # first state
    reorder: Callable[[dict, object, torch.Tensor], tuple]  # beam reordering of rows


def _mix(dtype, rows, cols, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=dtype) / rows**0.5


# --- the PyTorch tutorial and GNMT (one query per call here) -------------------------------------


def _tutorial_inputs(dtype, hidden=5):
    return {
        "memory": torch.randn(B, S, hidden, dtype=dtype).requires_grad_(),
        "hidden": torch.randn(B, hidden, dtype=dtype).requires_grad_(),
        "mix": _mix(dtype, hidden, hidden),
    }


def _tutorial_step(module, x, hidden):
    context, weights = module(hidden.unsqueeze(1), x["memory"])
    return (context, weights), torch.tanh(hidden + context.squeeze(1) @ x["mix"])


def _gnmt_inputs(dtype, hidden=5, key=4):
    return {
        "memory": torch.randn(S, B, key, dtype=dtype).requires_grad_(),  # time-major
        "hidden": torch.randn(B, hidden, dtype=dtype).requires_grad_(),
        "lengths": LENGTHS.clone(),
        "mix": _mix(dtype, key, hidden),
    }


def _gnmt_step(module, x, hidden):
    module.set_mask(x["lengths"], x["memory"])
    context, weights = module(hidden, x["memory"])  # a [B, Dq] query stays batch-major
    return (context, weights), torch.tanh(hidden + context @ x["mix"])


def _gnmt_reorder(x, state, index):
    x, state = _reorder_rows(x, state, index, 1)
    x["lengths"] = x["lengths"].index_select(0, index)
    return x, state


# --- concat (bentrevett time-major / batch-first, chatbot) ----------------------------------------


def _concat_inputs(dtype, enc=4, dec=5, time_major=True, masked=True):
    memory = torch.randn(B, S, 2 * enc, dtype=dtype)
    if time_major:
        memory = memory.transpose(0, 1).contiguous()
    return {
        "memory": memory.requires_grad_(),
        "hidden": torch.randn(B, dec, dtype=dtype).requires_grad_(),
        "mask": _valid() if masked else None,
        "mix": _mix(dtype, 2 * enc, dec),
        "time_major": time_major,
    }


def _concat_step(module, x, hidden):
    weights = (
        module(hidden, x["memory"], x["mask"])
        if x["mask"] is not None
        else module(hidden, x["memory"])
    )
    memory = x["memory"].transpose(0, 1) if x["time_major"] else x["memory"]
    context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
    return (weights, context), torch.tanh(hidden + context @ x["mix"])


def _chatbot_step(module, x, hidden):
    weights = module(hidden.unsqueeze(0), x["memory"])  # [B, 1, S]
    context = torch.bmm(weights, x["memory"].transpose(0, 1)).squeeze(1)
    return (weights, context), torch.tanh(hidden + context @ x["mix"])


def _reorder_rows(x, state, index, memory_dim):
    x = dict(x)
    x["memory"] = x["memory"].index_select(memory_dim, index)
    if x.get("mask") is not None:
        x["mask"] = x["mask"].index_select(0, index)
    return x, state.index_select(0, index)


def _concat_reorder(x, state, index):
    return _reorder_rows(x, state, index, 1 if x["time_major"] else 0)


# --- OpenNMT GlobalAttention mlp (input feeding, one step at a time) ------------------------------


def _onmt_inputs(dtype, dim=6):
    return {
        "memory": torch.randn(B, S, dim, dtype=dtype).requires_grad_(),
        "source": torch.randn(B, dim, dtype=dtype).requires_grad_(),
        "lengths": LENGTHS.clone(),
    }


def _onmt_step(module, x, source):
    attn_h, align = module(source, x["memory"], x["lengths"])
    return (attn_h, align), torch.tanh(attn_h + source)


def _onmt_reorder(x, state, index):
    x = dict(x)
    x["memory"] = x["memory"].index_select(0, index)
    x["lengths"] = x["lengths"].index_select(0, index)
    return x, state.index_select(0, index)


# --- JoeyNMT Bahdanau ------------------------------------------------------------------------------


def _joey_inputs(dtype, key=4, query=5):
    return {
        "memory": torch.randn(B, S, key, dtype=dtype).requires_grad_(),
        "query": torch.randn(B, 1, query, dtype=dtype).requires_grad_(),
        "mask": _valid().unsqueeze(1),
        "mix": _mix(dtype, key, query),
    }


def _joey_start(module, x):
    module.compute_proj_keys(x["memory"])
    return x["query"]


def _joey_step(module, x, query):
    module.compute_proj_keys(x["memory"])  # as JoeyNMT's search does, every step
    context, alphas = module(query, x["mask"], x["memory"])
    return (context, alphas), torch.tanh(query + context @ x["mix"])


def _joey_reorder(x, state, index):
    x = dict(x)
    x["memory"] = x["memory"].index_select(0, index)
    x["mask"] = x["mask"].index_select(0, index)
    return x, state.index_select(0, index)


FAMILIES = {
    "tutorial": Family(
        lambda: layouts.TutorialAttention(5),
        "tutorial",
        _tutorial_inputs,
        _tutorial_step,
        lambda m, x: x["hidden"],
        lambda x, st, i: _reorder_rows(x, st, i, 0),
    ),
    "gnmt": Family(
        lambda: layouts.GNMTAttention(5, 4, 7, normalize=True),
        "gnmt",
        _gnmt_inputs,
        _gnmt_step,
        lambda m, x: x["hidden"],
        _gnmt_reorder,
    ),
    "concat": Family(
        lambda: layouts.ConcatAttention(4, 5),
        "concat",
        _concat_inputs,
        _concat_step,
        lambda m, x: x["hidden"],
        _concat_reorder,
    ),
    "concat-vector-nomask": Family(
        lambda: layouts.ConcatAttention(4, 5, vector_score=True),
        "concat",
        lambda dtype: _concat_inputs(dtype, masked=False),
        _concat_step,
        lambda m, x: x["hidden"],
        _concat_reorder,
    ),
    "concat_batch_first": Family(
        lambda: layouts.ConcatAttention(4, 5, batch_first=True),
        "concat_batch_first",
        lambda dtype: _concat_inputs(dtype, time_major=False),
        _concat_step,
        lambda m, x: x["hidden"],
        _concat_reorder,
    ),
    "chatbot_concat": Family(
        lambda: layouts.ChatbotAttn("concat", 5),
        "chatbot_concat",
        lambda dtype: (
            _concat_inputs(dtype, enc=5, dec=5, masked=False)
            | {
                "memory": torch.randn(S, B, 5, dtype=dtype).requires_grad_(),
                "mix": _mix(dtype, 5, 5),
            }
        ),
        _chatbot_step,
        lambda m, x: x["hidden"],
        _concat_reorder,
    ),
    "opennmt_mlp": Family(
        lambda: layouts.GlobalAttention(6, attn_type="mlp"),
        "opennmt_mlp",
        _onmt_inputs,
        _onmt_step,
        lambda m, x: x["source"],
        _onmt_reorder,
    ),
    "opennmt_mlp_time_major": Family(
        lambda: layouts.GlobalAttention(6, attn_type="mlp", old_release=True),
        "opennmt_mlp_time_major",
        _onmt_inputs,
        _onmt_step,
        lambda m, x: x["source"],
        _onmt_reorder,
    ),
    "joeynmt": Family(
        lambda: layouts.BahdanauAttention(7, 4, 5),
        "joeynmt",
        _joey_inputs,
        _joey_step,
        _joey_start,
        _joey_reorder,
    ),
}


def _decode(family: Family, module: nn.Module, x: dict, reorder_at: int | None = None):
    outputs, state = [], family.start(module, x)
    for t in range(STEPS):
        if t == reorder_at:
            x, state = family.reorder(x, state, torch.tensor([2, 0, 0]))
        out, state = family.step(module, x, state)
        outputs += list(out)
    return outputs


def _loss(outputs):
    gen = torch.Generator().manual_seed(11)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)


def _pair(name: str, dtype: torch.dtype):
    family = FAMILIES[name]
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": family.make()}).to(dtype)
    fused = copy.deepcopy(plain)
    report = fuse_attention_report(fused)
    assert [(r.path, r.layout) for r in report.replaced] == [("attn", family.layout)], report
    return family, plain, fused


def _leaves(x: dict) -> list[torch.Tensor]:
    return [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def _compare(family, plain, fused, dtype, reorder_at=None):
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    torch.manual_seed(1)
    x = family.inputs(dtype)
    results, missing = [], []
    for model in (plain, fused):
        outputs = _decode(family, model["attn"], x, reorder_at)
        _loss(outputs).backward()
        # a parameter the original trains gets a gradient after conversion too, if only the zero
        # of a score bias that a softmax cancels (None: DDP stops, AdamW skips it)
        missing.append({n for n, p in model.named_parameters() if p.grad is None})
        grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for n, p in model.named_parameters()
        }
        grads |= {f"input {i}": t.grad.clone() for i, t in enumerate(_leaves(x))}
        for t in _leaves(x):
            t.grad = None
        results.append((outputs, grads))
    assert missing[1] <= missing[0], f"no gradient after conversion: {missing[1] - missing[0]}"
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert results[0][1].keys() == results[1][1].keys()
    for key, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][key], grad, **tol, msg=key)


def _thin(layout_name: str) -> bool:
    """Is the layout a thin matcher (converted through the traced runtime, no stand-in)?"""
    return next(lay for lay in registered_layouts() if lay.name == layout_name).traced


def _key_term_caches(monkeypatch) -> list:
    """The projection caches of the traced runtime's key terms made from now on."""
    caches = []
    init = KeyTerm.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self.cache)

    monkeypatch.setattr(KeyTerm, "__init__", spy)
    return caches


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_steps_outputs_and_gradients_match(name, dtype, monkeypatch):
    family, plain, fused = _pair(name, dtype)
    assert list(fused.state_dict()) == list(plain.state_dict())
    caches = _key_term_caches(monkeypatch)
    _compare(family, plain, fused, dtype)
    # the memory was projected once for the steps (JoeyNMT: compute_proj_keys every step); a thin
    # matcher's module by the runtime's key term (its first call inside no watched caller here)
    # (the runtime's later steps reuse the first step's keys whole: its key term is asked once)
    if _thin(family.layout):
        assert len(caches) == 1
        assert caches[0].misses == 1, f"projected {caches[0].misses} times over {STEPS} steps"
        return
    cache = fused["attn"].key_cache
    assert (cache.misses, cache.hits) == ((1, STEPS) if name == "joeynmt" else (1, STEPS - 1))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_state_dict_optimiser_and_beam_reordering(name):
    family, plain, fused = _pair(name, torch.float64)
    params_before = list(fused["attn"].parameters())
    stand_in = fused["attn"]
    assert isinstance(stand_in, FusedStandIn)
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    # the original's module object was replaced, its Parameters were kept
    assert [id(p) for p in stand_in.parameters()] == [id(p) for p in params_before]
    fused.load_state_dict(state)  # loads back under the same keys
    optimisers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (plain, fused)]
    _compare(family, plain, fused, torch.float64)
    for opt in optimisers:
        opt.step()
        opt.zero_grad()
    for key, value in plain.state_dict().items():
        # atol: Adam turns the tutorial's Va.bias rounding-noise gradient (1e-17) into ~1e-11
        torch.testing.assert_close(fused.state_dict()[key], value, atol=1e-9, rtol=1e-7)
    _compare(family, plain, fused, torch.float64, reorder_at=2)  # after the step, reordered


@pytest.mark.parametrize("name", ["concat", "opennmt_mlp", "joeynmt"])
def test_no_grad_decoding_matches(name):
    family, plain, fused = _pair(name, torch.float32)
    torch.manual_seed(2)
    x = family.inputs(torch.float32)
    with torch.no_grad():
        expected = _decode(family, plain["attn"], x, reorder_at=1)
        got = _decode(family, fused["attn"], x, reorder_at=1)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)


def test_rows_without_a_valid_key_and_long_lengths_give_what_the_originals_give():
    # A row with no valid key: NaN in JoeyNMT and OpenNMT-py (a softmax of -inf only), and in
    # their stand-ins, whose plans run on the general path's runtime (its plain path for such a
    # row); a length past S: every key, as OpenNMT-py's sequence_mask gives.
    torch.manual_seed(5)
    _, plain, fused = _pair("opennmt_mlp", torch.float64)
    source, memory = torch.randn(B, 2, 6, dtype=torch.float64), torch.randn(B, S, 6).double()
    aligns = []
    for lengths in (torch.tensor([6, 0, 3]), torch.tensor([9, 4, 1])):
        expected = plain["attn"](source, memory, lengths)
        got = fused["attn"](source, memory, lengths)
        for a, b in zip(expected, got, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, equal_nan=True)
        aligns.append(got[1])
    assert aligns[0][1].isnan().all() and aligns[0][[0, 2]].isfinite().all()
    assert aligns[1].isfinite().all()
    _, plain, fused = _pair("joeynmt", torch.float64)
    memory, query = torch.randn(B, S, 4).double(), torch.randn(B, 1, 5).double()
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [0] * 6, [1] * 6], dtype=torch.bool).unsqueeze(1)
    for module in (plain["attn"], fused["attn"]):
        module.compute_proj_keys(memory)
    expected = plain["attn"](query, mask, memory)
    got = fused["attn"](query, mask, memory)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, equal_nan=True)
    assert got[1][1].isnan().all() and got[1][0].isfinite().all()


def test_opennmt_whole_sequence_and_coverage():
    family, plain, fused = _pair("opennmt_mlp", torch.float64)
    torch.manual_seed(3)
    source, memory = torch.randn(B, 5, 6, dtype=torch.float64), torch.randn(B, S, 6).double()
    for a, b in zip(
        plain["attn"](source, memory, LENGTHS), fused["attn"](source, memory, LENGTHS), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    with pytest.raises(NotImplementedError, match="coverage"):
        fused["attn"](source, memory, LENGTHS, torch.zeros(B, S, dtype=torch.float64))


def test_opennmt_coverage_and_other_types_not_converted():
    model = nn.ModuleDict(
        {
            "coverage": layouts.GlobalAttention(6, coverage=True, attn_type="mlp"),
            "general": layouts.GlobalAttention(6, attn_type="general"),
        }
    )
    report = fuse_attention_report(model)
    assert report.count == 0
    assert [(s.path, "coverage" in s.reason) for s in report.skipped] == [("coverage", True)]


def test_chatbot_other_methods_not_converted():
    model = nn.ModuleDict({m: layouts.ChatbotAttn(m, 4) for m in ("dot", "general")})
    report = fuse_attention_report(model)
    assert report.count == 0 and not report.skipped


# --- look-alikes -----------------------------------------------------------------------------------


class ConcatNoTanh(layouts.ConcatAttention):
    def forward(self, hidden, encoder_outputs, mask=None):
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        hidden = hidden.unsqueeze(1).repeat(1, encoder_outputs.shape[1], 1)
        energy = F.relu(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        return F.softmax(self.v(energy).squeeze(2), dim=1)


class GlobalAttention(layouts.GlobalAttention):  # same class name, a temperature in its forward
    def score(self, h_t, h_s):
        return super().score(h_t, h_s) / 2.0


class BahdanauAttention(layouts.BahdanauAttention):  # same class name, scores scaled
    def forward(self, query, mask, values):
        self.proj_keys = self.proj_keys * 1.5
        return super().forward(query, mask, values)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ConcatNoTanh(4, 5),
        lambda: GlobalAttention(6, attn_type="mlp"),
        lambda: BahdanauAttention(7, 4, 5),
    ],
    ids=["concat-relu", "opennmt-temperature", "joeynmt-scaled"],
)
def test_look_alikes_refused(make):
    model = nn.ModuleDict({"attn": make()})
    report = fuse_attention_report(model)
    assert report.count == 0 and not isinstance(model["attn"], FusedStandIn)
    # a stand-in's safety check finds a difference; a thin matcher's probe finds no fused form
    # (relu, not tanh) in the trace of the layout's example call
    reason = report.skipped[0].reason if report.skipped else ""
    assert "differs" in reason or (
        "through the traced runtime" in reason and "not the fused op's form" in reason
    ), reason


@pytest.mark.parametrize("name", ["concat", "opennmt_mlp", "joeynmt"])
def test_compiled_converted_decoder_matches(name):
    # (opennmt and joeynmt: their stand-ins hand the plan to the op directly inside torch.compile)
    family, plain, fused = _pair(name, torch.float32)
    torch.manual_seed(4)
    x = family.inputs(torch.float32)

    def run(module, x):
        outputs = _decode(family, module, x)
        return _loss(outputs)

    compiled = torch.compile(run, backend="aot_eager")
    expected = run(plain["attn"], x)
    got = compiled(fused["attn"], x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    got.backward()
    grad = x["memory"].grad.clone()
    x["memory"].grad = None
    expected.backward()
    torch.testing.assert_close(grad, x["memory"].grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change", ["spectral_norm_keys", "hook_on_scores"])
def test_joeynmt_with_a_part_changed_after_the_conversion(change):
    """JoeyNMT's ``compute_proj_keys`` is part of its call convention: with spectral_norm put on
    the key layer after the conversion, the stand-in's own ``compute_proj_keys`` read
    ``key_layer.weight`` for its cache (a power iteration at each read) and the results drifted
    from the original's (0.013). Every method of the convention now runs the original's once a
    part changed."""
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": layouts.BahdanauAttention(8, 10, 6)}).double()
    fused = copy.deepcopy(plain)
    assert fuse_attention_report(fused).count == 1
    for model in (plain, fused):
        attention = model["attn"]
        if change == "spectral_norm_keys":
            torch.manual_seed(11)  # (its power iteration starts from random vectors)
            torch.nn.utils.parametrizations.spectral_norm(attention.key_layer)
        else:
            attention.energy_layer.register_forward_hook(lambda module, args, out: 2 * out)
    results = []
    with pytest.warns(UserWarning, match="changed after the conversion"):
        for model in (plain, fused):
            gen = torch.Generator().manual_seed(3)
            outs = []
            for batch, frames in ((3, 7), (2, 5)):
                values = torch.randn(batch, frames, 10, generator=gen, dtype=torch.float64)
                mask = torch.arange(frames) < torch.tensor([frames, 2, 1][:batch])[:, None]
                model["attn"].compute_proj_keys(values)
                sequence = []
                for _ in range(3):
                    query = torch.randn(batch, 1, 6, generator=gen, dtype=torch.float64)
                    sequence += list(model["attn"](query, mask.unsqueeze(1), values))
                sum(o.sum() for o in sequence).backward()
                outs += sequence
            results.append(outs + [p.grad for p in model.parameters()])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


class _WatchedParent(nn.Module):
    """A parent the general path watches until its first call, around a named stand-in."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attn = layouts.TutorialAttention(8)

    def forward(self, query, keys):
        return self.attn(self.proj(query), keys)


def test_a_stand_in_inside_a_watched_first_call_runs_fused():
    """During a watched parent's first call the watcher hooked every module of its tree, the
    stand-in's parts included: the stand-in took them for a change after the conversion, ran
    the original's code and warned that a part had changed."""
    from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights

    model = _WatchedParent().double()
    report = fuse_attention_report(model)
    assert [r.layout for r in report.replaced] == ["tutorial"], str(report)
    assert report.watching == ["(model)"], str(report)
    query, keys = torch.randn(3, 1, 8).double(), torch.randn(3, 5, 8).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        calls = TracedWeights.calls
        model(query, keys)  # the watched first call
        assert TracedWeights.calls > calls  # the stand-in ran fused
