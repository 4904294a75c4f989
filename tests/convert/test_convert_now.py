"""``fuse_attention(model, example_inputs=...)`` converts now and counts what it converted; without
example inputs the count says only what was replaced before the first call, and the report lists
the modules still watched."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from seq2seq_fast import fuse_attention
from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn
from tests.convert.layouts_traced import CASES, K, Pointer, _Holder, _pointer_call


class _Normed(nn.Module):
    """A batch norm before the attention: its running statistics are buffers a call updates."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(K)
        self.att = Pointer()

    def forward(self, memory, query, pad):
        return self.att(self.norm(memory.transpose(1, 2)).transpose(1, 2), query, pad)


def test_without_example_inputs_the_count_misses_watched_modules():
    torch.manual_seed(0)
    model = _Holder(Pointer())
    report = fuse_attention_report(model)
    assert report.count == 0 and "att" in report.watching
    assert "watching" in str(report) and "att" in str(report)
    model(*_pointer_call(4, 6, torch.float32))
    assert report.count == 1 and "att" not in report.watching
    assert isinstance(model.att, FusedStandIn)


@pytest.mark.parametrize("form", ["tuple", "kwargs_pair"])
def test_example_inputs_convert_now_and_count(form):
    torch.manual_seed(0)
    model = _Holder(Pointer())
    args = _pointer_call(4, 6, torch.float32)
    want = model(*args)
    example = args if form == "tuple" else (args, {})
    assert fuse_attention(model, example_inputs=example) == 1
    assert isinstance(model.att, FusedStandIn)
    torch.testing.assert_close(model(*args), want, rtol=1e-5, atol=1e-6)


def test_example_inputs_leave_buffers_as_they_were():
    torch.manual_seed(0)
    model = _Normed()
    memory, query, pad = _pointer_call(4, 6, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    report = fuse_attention_report(model, example_inputs=(memory, query, pad))
    after = {k: v for k, v in model.state_dict().items() if "running" in k}
    assert report.count == 1, str(report)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


class _Stateful(nn.Module):
    """A model whose forward keeps state on itself in every way a forward can: a counter, a
    list of past weights, a tensor updated in place, a tensor cached by the batch's size (as
    fastNLP's self-attention keeps its identity matrix), a buffer reassigned, an attribute
    first set by a call; and a dropout that draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.att = Pointer()
        self.drop = nn.Dropout(0.3)
        self.register_buffer("steps", torch.zeros(()))
        self.calls, self.history, self.total = 0, [], torch.zeros(())
        self.eye = torch.eye(1)

    def forward(self, memory, query, pad):
        if self.eye.size(0) != memory.size(0):
            self.eye = torch.eye(memory.size(0))
        probs, pointed = self.att(self.drop(memory), query, pad)
        self.calls += 1
        self.history.append(probs)
        self.total.add_(probs.sum())
        self.steps = self.steps + 1
        self.last_batch = memory.size(0)
        return probs, pointed * self.eye.sum() / self.calls


def _stateful_state(model: _Stateful) -> dict:
    return {
        "calls": model.calls,
        "history": len(model.history),
        "total": float(model.total.detach()),
        "eye": tuple(model.eye.shape),
        "steps": float(model.steps),
        "last_batch": getattr(model, "last_batch", None),
    }


def test_the_example_call_leaves_no_trace_on_the_model():
    """The example call puts back what the model's forward kept on it (plain attributes and
    buffers, their objects and content; an attribute it added is gone) and the random state:
    the converted model's next calls are the unconverted one's."""
    torch.manual_seed(0)
    original = _Stateful()
    model = copy.deepcopy(original)
    before = _stateful_state(model)
    example = _pointer_call(3, 6, torch.float32)
    rng = torch.get_rng_state()
    assert fuse_attention(model, example_inputs=example) == 1
    assert _stateful_state(model) == before
    assert torch.equal(torch.get_rng_state(), rng)
    for batch in (4, 2):
        args = _pointer_call(batch, 5, torch.float32)
        torch.manual_seed(batch)
        got = model(*args)
        torch.manual_seed(batch)
        want = original(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert _stateful_state(model) == _stateful_state(original)


class _NumpyJitter(nn.Module):
    """An attention whose forward draws from numpy's global random state after the softmax
    (MORAN's fractional pickup jitters its weights so in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.att = Pointer()

    def forward(self, memory, query, pad):
        probs, _ = self.att(memory, query, pad)
        jitter = float(np.random.uniform(0.5, 1.5))
        return (probs.unsqueeze(-1) * jitter * memory).sum(1)


def test_a_forward_drawing_from_numpy_converts_and_leaves_the_draws():
    """The probe ran the original and the candidate on different numpy draws: refused ("differs
    from the fused op", 1e-3) or not by the luck of the draw; and the conversion moved the
    caller's numpy and Python random states."""
    import random

    for seed in range(3):
        torch.manual_seed(0)
        original = _NumpyJitter()
        model = copy.deepcopy(original)
        example = _pointer_call(3, 6, torch.float32)
        np.random.seed(seed)
        random.seed(seed)
        states = (np.random.get_state()[1].copy(), random.getstate())
        assert fuse_attention(model, example_inputs=example) == 1, seed
        assert np.array_equal(np.random.get_state()[1], states[0]), seed
        assert random.getstate() == states[1], seed
        args = _pointer_call(4, 5, torch.float32)
        np.random.seed(10)
        got = model(*args)
        np.random.seed(10)
        torch.testing.assert_close(got, original(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if c.converts], ids=lambda c: c.name)
def test_every_traced_layout_counts_at_once(case):
    torch.manual_seed(0)
    model = case.make()
    assert fuse_attention(model, example_inputs=case.inputs(4, 6, torch.float32)) >= 1


def test_a_failing_example_call_names_example_inputs():
    model = _Holder(Pointer())
    with pytest.raises(ValueError, match="example_inputs: calling _Holder with them failed"):
        fuse_attention(model, example_inputs=(torch.randn(2, 3),))


class _KeepsItsLastOutput(nn.Module):
    """A model that keeps its last attention output on itself, as ESPnet's decoders keep their
    attention weights between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.att = Pointer()
        self.last = None

    def forward(self, memory, query, pad):
        self.last = self.att(memory, query, pad)
        return self.last


def test_example_inputs_leave_no_autograd_graph_on_the_model():
    """The example call ran with gradients: what the model kept of it held that call's graph,
    which kept its memory alive and made copy.deepcopy(model) fail ("graph leaves")."""
    torch.manual_seed(0)
    model = _KeepsItsLastOutput()
    args = _pointer_call(4, 6, torch.float32)
    assert fuse_attention(model, example_inputs=args) == 1
    kept = model.last if isinstance(model.last, (tuple, list)) else (model.last,)
    assert all(t.grad_fn is None for t in kept if isinstance(t, torch.Tensor))
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(*args), model(*args))


class _MatchingConcat(nn.Module):
    """DialogueRNN's ``MatchingAttention`` with ``att_type='concat'``: the history M [S, B, Dm]
    (one more step at each call, one at the first) concatenated with the candidate expanded along
    it, one Linear, tanh, the score layer, a softmax over the history."""

    def __init__(self) -> None:
        super().__init__()
        self.transform = nn.Linear(6 + 5, 3, bias=False)
        self.vector_prod = nn.Linear(3, 1, bias=False)

    def forward(self, memory, x):  # memory [S, B, 5], x [B, 6]
        m = memory.transpose(0, 1)
        joined = torch.cat([m, x.unsqueeze(1).expand(-1, memory.size(0), -1)], 2)
        alpha = torch.softmax(self.vector_prod(torch.tanh(self.transform(joined))), 1)
        return torch.bmm(alpha.transpose(1, 2), m)[:, 0, :], alpha


def test_a_concat_attention_whose_first_history_has_one_step_waits():
    """Its first call (one step of history) was left for good: "no term of the sum varies along
    the softmax's axis" (both look constant along an axis of size 1)."""
    torch.manual_seed(0)
    model = _Holder(_MatchingConcat())
    want = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    report = fuse_attention_report(model, example_inputs=(torch.randn(1, 4, 5), torch.randn(4, 6)))
    assert report.count == 0 and "att" in report.watching and not report.skipped, str(report)
    for steps in (2, 3):
        args = (torch.randn(steps, 4, 5, generator=gen), torch.randn(4, 6, generator=gen))
        torch.testing.assert_close(model(*args), want(*args), rtol=1e-5, atol=1e-6)
    assert report.count == 1, str(report)


def test_a_first_call_with_one_key_waits_for_the_next():
    """A memory of one key cannot show which axis is the memory's: such a first call decided
    "not the fused op's form" for good. The module is watched again instead, and converts at its
    next call with more keys; after three calls of one key each it is left, saying why."""
    torch.manual_seed(0)
    model = _Holder(Pointer())
    report = fuse_attention_report(model)
    want = copy.deepcopy(model)
    for frames in (1, 6):
        args = _pointer_call(4, frames, torch.float32)
        torch.testing.assert_close(model(*args), want(*args))
        if frames == 1:
            assert report.count == 0 and "att" in report.watching and not report.skipped
    assert report.count == 1 and isinstance(model.att, FusedStandIn), str(report)
    stubborn = _Holder(Pointer())
    report = fuse_attention_report(stubborn)
    for _ in range(3):
        stubborn(*_pointer_call(4, 1, torch.float32))
    assert report.count == 0 and report.watching == [], str(report)
    assert "in each of its first 3 calls: one key" in report.skipped[0].reason


def test_conversions_made_under_autocast():
    """The safety check and the probe compare in float64; a caller's autocast region made their
    outputs bfloat16, and every conversion there a refusal ("differs ... torch.float64 vs
    torch.bfloat16"): fuse_attention inside autocast, or a watched module first called in a
    bfloat16 training loop, converted nothing."""
    from tests.layouts import TutorialDecoder

    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fuse_attention_report(TutorialDecoder(8, 13))
    assert report.count == 1 and not report.skipped, str(report)
    model = _Holder(Pointer())
    report = fuse_attention_report(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(*_pointer_call(2, 5, torch.float32))
    assert report.count == 1 and not report.skipped, str(report)
    assert isinstance(model.att, FusedStandIn)


def test_a_first_call_under_checkpointing_waits_for_a_call_outside():
    """Converted at the end of its first call inside torch.utils.checkpoint(use_reentrant=False),
    a watched module's recomputation in the backward ran the fused code where its forward had run
    its own: "A different number of tensors was saved during the original forward and
    recomputation". It now waits (with a warning) for a call outside the saved-tensor hooks."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = _Holder(Pointer())
    original = copy.deepcopy(model)
    report = fuse_attention_report(model)
    args = _pointer_call(2, 5, torch.float32)

    def loss_and_grads(net):
        net.zero_grad()
        probs, pointed = checkpoint(net, *args, use_reentrant=False)
        (probs.sum() + pointed.pow(2).sum()).backward()
        return [p.grad.clone() for p in net.parameters()]

    with pytest.warns(UserWarning, match="saved-tensor hooks"):
        got = loss_and_grads(model)
    assert report.count == 0 and "att" in report.watching
    for g, w in zip(got, loss_and_grads(original), strict=True):
        torch.testing.assert_close(g, w)
    model(*args)  # outside: converts
    assert report.count == 1 and isinstance(model.att, FusedStandIn), str(report)
    for g, w in zip(loss_and_grads(model), loss_and_grads(original), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
