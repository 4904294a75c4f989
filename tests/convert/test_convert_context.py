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


def _converted_steps_match(form: str, dtype, steps: int, monkeypatch) -> list:
    """Convert the form's attention, run ``steps`` calls on one memory against the original's
    (outputs and gradients must match); whether each traced_context call took the op's context."""
    took = _spy(monkeypatch)
    torch.manual_seed(0)
    original = _Additive(form).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model, example_inputs=_args(2, 4, dtype))
    assert report.count == 1, str(report)
    took.clear()
    args = _args(3, 6, dtype)
    got, want = _steps(model, args, steps), _steps(original, args, steps)
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")
    return took


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["bmm", "matmul", "sum", "index"])
def test_the_op_forms_the_context(form, dtype, monkeypatch):
    took = _converted_steps_match(form, dtype, 3, monkeypatch)
    assert took and all(took), f"{form}: the op's context taken {sum(took)} of {len(took)} times"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", ["shared", "transposed"])
def test_other_contexts_stay_the_graphs(form, dtype, monkeypatch):
    """Values that are not [B', S, Dv] over the op's rows (one [S, Dv] for every row: seen at
    run time), or a product the op does not form (the weights on the right): the graph's own
    product, exact."""
    took = _converted_steps_match(form, dtype, 2, monkeypatch)
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
