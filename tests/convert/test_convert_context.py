"""The general path forms the context in the op (issue 35): where the graph multiplies the
weights by values in a form the op computes (``bmm(w, values)``, ``w @ values``,
``(w.unsqueeze(-1) * values).sum(1)``), the replacement hands the values to the op and the
context node takes the op's context; where the shapes at run time are not the op's, the graph's
own product runs. Either way the result is the original's, outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert.traced import rewrite as traced_rewrite
from seq2seq_fast.ops import fused_available
from tests.convert.test_convert_traced import _assert_close, _steps

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)


class _Additive(nn.Module):
    """query [B, Dq] against memory [B, S, Dk], a padding mask [B, S] (True = padding); the
    context in one of the forms below."""

    def __init__(self, form: str, dq: int = 5, dk: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.form = form
        self.q, self.k = nn.Linear(dq, hidden, bias=False), nn.Linear(dk, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, query, memory, padding):
        first = memory[0]  # (before the weights: values the graph has by then)
        e = self.v(torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))).squeeze(-1)
        w = torch.softmax(e.masked_fill(padding, -1e9), dim=-1)  # [B, S]
        if self.form == "bmm":  # SpeechBrain, Tacotron 2, Coqui
            context = torch.bmm(w.unsqueeze(1), memory).squeeze(1)
        elif self.form == "matmul":  # JoeyNMT
            context = (w.unsqueeze(1) @ memory).squeeze(1)
        elif self.form == "sum":  # ESPnet
            context = (memory * w.unsqueeze(2)).sum(dim=1)
        elif self.form == "index":
            context = torch.sum(w[:, :, None] * memory, 1)
        elif self.form == "shared":  # one memory's frames for every row: not [B', S, Dv]
            context = w @ first
        else:  # "transposed": the weights permuted first: the graph's own product
            context = torch.bmm(memory.transpose(1, 2), w.unsqueeze(2)).squeeze(2)
        return context, w


class _TimeMajor(nn.Module):
    """fairseq's Berard MLP attention's layout: query [B, Dq] against memory [S, B, Dk] (time
    major), padding [S, B]; weights [S, B] over axis 0, context summed over axis 0."""

    def __init__(self, form: str, dq: int = 5, dk: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.form = form
        self.q, self.k = nn.Linear(dq, hidden, bias=False), nn.Linear(dk, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, query, memory, padding):
        e = self.v(torch.tanh(self.q(query).unsqueeze(0) + self.k(memory))).squeeze(-1)
        w = torch.softmax(e.masked_fill(padding, -1e9), dim=0)  # [S, B]
        if self.form == "time_major":
            context = (memory * w.unsqueeze(2)).sum(dim=0)
        else:  # "time_major_index"
            context = torch.sum(w[:, :, None] * memory, 0)
        return context, w


class _Dropped(nn.Module):
    """d2l's form: the weights [B, 1, S] through an ``nn.Dropout`` before ``bmm`` with the
    values."""

    def __init__(self, p: float, dq: int = 5, dk: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(dq, hidden, bias=False), nn.Linear(dk, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)
        self.dropout = nn.Dropout(p)

    def forward(self, query, memory, padding):
        e = self.v(torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))).squeeze(-1)
        w = torch.softmax(e.masked_fill(padding, -1e9).unsqueeze(1), dim=-1)  # [B, 1, S]
        return torch.bmm(self.dropout(w), memory).squeeze(1), w


def _time_major_args(batch, frames, dtype):
    query, memory, padding = _args(batch, frames, dtype)
    return query, memory.transpose(0, 1).contiguous(), padding.t().contiguous()


def _args(batch, frames, dtype):
    gen = torch.Generator().manual_seed(batch * 10 + frames)
    query = torch.randn(batch, 5, generator=gen, dtype=dtype)
    memory = torch.randn(batch, frames, 6, generator=gen, dtype=dtype)
    lengths = torch.arange(frames, frames - batch, -1).clamp(min=1)
    padding = torch.arange(frames).unsqueeze(0) >= lengths.unsqueeze(1)
    return query, memory, padding


def _spy(monkeypatch) -> list:
    """Whether each traced_context call took the op's context."""
    took = []
    real = traced_rewrite.traced_context

    def spy(form, ours, *args):
        took.append(ours is not None)
        return real(form, ours, *args)

    monkeypatch.setattr(traced_rewrite, "traced_context", spy)
    return took


def _converted_steps_match(make, dtype, steps: int, monkeypatch, args_of=None) -> list:
    """Convert the attention ``make()`` builds (on ``args_of(2, 4, dtype)``), run ``steps``
    calls on one memory against the original's under the same random state (outputs and
    gradients must match); whether each traced_context call took the op's context."""
    args_of = args_of or _args
    took = _spy(monkeypatch)
    torch.manual_seed(0)
    original = make().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model, example_inputs=args_of(2, 4, dtype))
    assert report.count == 1, str(report)
    took.clear()
    args = args_of(3, 6, dtype)
    torch.manual_seed(3)
    got = _steps(model, args, steps)
    torch.manual_seed(3)
    want = _steps(original, args, steps)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")
    return took


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["bmm", "matmul", "sum", "index"])
def test_the_op_forms_the_context(form, dtype, monkeypatch):
    took = _converted_steps_match(lambda: _Additive(form), dtype, 3, monkeypatch)
    assert took and all(took), f"{form}: the op's context taken {sum(took)} of {len(took)} times"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["shared", "transposed"])
def test_other_contexts_stay_the_graphs(form, dtype, monkeypatch):
    """Values that are not [B', S, Dv] over the op's rows (one [S, Dv] for every row: seen at
    run time), or a product the op does not form (the weights on the right): the graph's own
    product, exact."""
    took = _converted_steps_match(lambda: _Additive(form), dtype, 2, monkeypatch)
    assert not any(took)
    assert len(took) == (2 if form == "shared" else 0)  # asked at each of the 2 calls, or never


@pytest.mark.parametrize(
    "shapes",
    [
        [(3, 1, 5), (3, 4, 5)],
        [(1, 1, 7), (2, 6, 7), (2, 1, 7)],
        [(4,), (1, 4)],  # ranks differ: torch's
        [(0, 3), (1, 3)],
    ],
)
def test_the_runtimes_broadcast_is_torchs(shapes):
    assert traced_rewrite._broadcast(shapes) == tuple(torch.broadcast_shapes(*shapes))


def test_the_runtimes_broadcast_raises_torchs_error():
    with pytest.raises(RuntimeError, match="broadcast"):
        traced_rewrite._broadcast([(3, 4), (2, 4)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["time_major", "time_major_index"])
def test_the_op_forms_a_time_major_context(form, dtype, monkeypatch):
    """Weights [S, B] over axis 0 and ``(values * w[..., None]).sum(0)`` with values [S, B, Dv]
    (fairseq's Berard decoder): the op's context, from the values' transpose."""
    took = _converted_steps_match(
        lambda: _TimeMajor(form), dtype, 3, monkeypatch, args_of=_time_major_args
    )
    assert len(took) == 3 and all(took), took


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "p, training, ours",
    [(0.0, True, True), (0.4, False, True), (0.4, True, False)],
    ids=["p0-train", "eval", "active"],
)
def test_dropout_on_the_weights(p, training, ours, dtype, monkeypatch):
    """A dropout between the weights and the product that does nothing (p = 0, or eval mode):
    the op's context; an active one: the graph's own product of the dropped weights, exact under
    the same random state."""
    took = _converted_steps_match(lambda: _Dropped(p).train(training), dtype, 2, monkeypatch)
    if ours:
        assert len(took) == 2 and all(took), took
    else:
        assert not any(took), took


class _DroppedTanh(_Dropped):
    """The same layers, the dropout on the tanh's output, before the score layer (as in
    attention pooling layers that regularise the hidden layer)."""

    def forward(self, query, memory, padding):
        hidden = torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))
        e = self.v(self.dropout(hidden)).squeeze(-1)
        w = torch.softmax(e.masked_fill(padding, -1e9), dim=-1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("p, training", [(0.0, True), (0.4, False)], ids=["p0-train", "eval"])
def test_a_dropout_that_does_nothing_between_the_tanh_and_the_scores(p, training, dtype):
    """Seen through: converted, and the same as the original (outputs and gradients)."""
    torch.manual_seed(0)
    original = _DroppedTanh(p).to(dtype).train(training)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model, example_inputs=_args(2, 4, dtype))
    assert report.count == 1, str(report)
    got, want = _steps(model, _args(3, 6, dtype), 3), _steps(original, _args(3, 6, dtype), 3)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")


def test_an_active_dropout_between_the_tanh_and_the_scores():
    """Refused, saying so; converted in eval mode and then trained, the training calls run the
    module's own code (the same dropout draws as the original's) and say why, once."""
    dtype = torch.float64
    model = _DroppedTanh(0.4).to(dtype)
    report = fuse_attention_report(copy.deepcopy(model), example_inputs=_args(2, 4, dtype))
    assert report.count == 0 and "active dropout" in str(report), str(report)
    original = model.eval()
    model = copy.deepcopy(original)
    assert fuse_attention_report(model, example_inputs=_args(2, 4, dtype)).count == 1
    model.train(), original.train()
    args = _args(3, 6, dtype)
    with pytest.warns(UserWarning, match="active dropout"):
        torch.manual_seed(3)
        got = _steps(model, args, 2)
    torch.manual_seed(3)
    want = _steps(original, args, 2)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")


class _KeptMask(nn.Module):
    """SpeechBrain's form: a 0/1 mask kept on the module, compared with 0 at every call (a new
    bool tensor each step)."""

    def __init__(self, dq: int = 5, dk: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(dq, hidden, bias=False), nn.Linear(dk, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)
        self.mask = None

    def forward(self, query, memory):
        e = self.v(torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))).squeeze(-1)
        w = torch.softmax(e.masked_fill(self.mask == 0, float("-inf")), dim=-1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_mask_made_at_each_call_is_found_once(dtype, monkeypatch):
    """The mask's rows are found once while its content stays (not at every step), and found
    again when the content changes; the results are the original's throughout."""
    found = []
    real = traced_rewrite._mask_to_rows
    monkeypatch.setattr(traced_rewrite, "_mask_to_rows", lambda *a: found.append(1) or real(*a))
    torch.manual_seed(0)
    original = _KeptMask().to(dtype)
    model = copy.deepcopy(original)
    query, memory, padding = _args(2, 4, dtype)
    model.mask = (~padding).to(dtype)
    report = fuse_attention_report(model, example_inputs=(query, memory))
    assert report.count == 1, str(report)
    query, memory, padding = _args(3, 6, dtype)
    for lengths in ([6, 5, 4], [6, 2, 3]):
        keep = (torch.arange(6) < torch.tensor(lengths).unsqueeze(1)).to(dtype)
        model.mask, original.mask = keep.clone(), keep.clone()
        found.clear()
        got, want = _steps(model, (query, memory), 4), _steps(original, (query, memory), 4)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
        assert len(found) == 1, f"the mask's rows found {len(found)} times over 4 steps"
