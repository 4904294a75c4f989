"""The matcher's typed plan: what ``find_matches`` reads off a TorchDynamo graph, field by field,
and that the rewrite built from it gives the original's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seq2seq_fast.nn.convert.traced.pattern import find_matches
from seq2seq_fast.nn.convert.traced.plan import Mask, Plan, Scale, Shift
from seq2seq_fast.nn.convert.traced.rewrite import rewrite
from seq2seq_fast.ops import fused_available

Q, K, A, B, T = 5, 6, 4, 3, 7


class Tempered(nn.Module):
    """Scores by a biased score layer, divided by a temperature, masked, then normalised."""

    def __init__(self, normalize: str) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(Q, A), nn.Linear(K, A, bias=False)
        self.score = nn.Linear(A, 1)
        self.normalize = normalize

    def forward(self, query, memory, pad):
        hidden = torch.tanh(self.query(query).unsqueeze(1) + self.key(memory))
        scores = self.score(hidden).squeeze(-1) / 0.5
        scores = scores.masked_fill(pad, -1e9)
        if self.normalize == "softmax":
            return torch.softmax(scores, dim=-1)
        return torch.sigmoid(scores) / torch.sigmoid(scores).sum(-1, keepdim=True)


class Pooling(nn.Module):
    """Attention pooling: tanh(W h + b) scored by a learned vector, no query."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K, A)
        self.v = nn.Parameter(torch.randn(A))

    def forward(self, memory):
        return torch.softmax(torch.tanh(self.proj(memory)) @ self.v, dim=1)


def _plans(module: nn.Module, *args) -> tuple[list[Plan], list[str], torch.Tensor]:
    """(the plans of the first graph TorchDynamo gives, the misses, the weights of that graph
    once rewritten from them)."""
    found = []

    def backend(gm, example_inputs):
        plans, misses = find_matches(gm.graph)
        found.append((plans, misses))
        for plan in plans:
            rewrite(gm.graph, plan, "auto")
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm.forward

    torch.compiler.reset()
    try:
        weights = torch.compile(module, backend=backend, dynamic=False)(*args)
    finally:
        torch.compiler.reset()
    return (*found[0], weights)


def _inputs():
    torch.manual_seed(0)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 5:] = True
    return torch.randn(B, Q, dtype=torch.float64), torch.randn(B, T, K, dtype=torch.float64), pad


@pytest.mark.skipif(not fused_available("cpu", torch.float64), reason="no C++ extension")
@pytest.mark.parametrize("normalize", ["softmax", "sigmoid"])
def test_plan_of_a_tempered_masked_attention(normalize):
    module = Tempered(normalize).double()
    args = _inputs()
    plans, misses, weights = _plans(module, *args)
    assert misses == [] and len(plans) == 1
    plan = plans[0]
    assert len(plan.terms.queries) == 1 and len(plan.terms.keys) == 1
    assert plan.terms.keys[0].location is None and not plan.terms.learned_query
    # the query Linear's bias is part of its term; no bias term of its own
    assert plan.terms.biases == ()
    assert [type(s) for s in plan.steps] == [Shift, Scale, Mask]
    shift, scale, mask = plan.steps
    assert shift.sign == "+" and shift.amount.op == "placeholder"  # the score layer's bias
    assert scale.op == "div" and scale.factor == 0.5
    assert mask.kind == "fill" and mask.fill == -1e9 and mask.at_shape == (B, T)
    assert plan.normalisation.kind == normalize
    assert len(plan.normalisation.nodes) == (0 if normalize == "softmax" else 3)
    assert plan.layout.rank == 3 and plan.layout.hidden_axis == 2
    assert plan.layout.memory_axis == 1 and plan.layout.batch_axes == (0,)
    assert plan.layout.query_axes == ()
    assert plan.heads.vector_axes == ()
    assert plan.site.output.target in (torch.softmax, "softmax") or normalize == "sigmoid"
    text = plan.describe()
    assert "scale(div)" in text and "fill" in text
    assert ("sigmoid-normalised" in text) == (normalize == "sigmoid")
    torch.testing.assert_close(weights, module(*args))


def test_plan_fields_are_frozen():
    module = Pooling().double()
    plans, _, _ = _plans(module, torch.randn(B, T, K, dtype=torch.float64))
    with pytest.raises(AttributeError):
        plans[0].terms = None  # type: ignore[misc]


@pytest.mark.skipif(not fused_available("cpu", torch.float64), reason="no C++ extension")
def test_plan_of_attention_pooling_has_a_learned_query():
    module = Pooling().double()
    memory = torch.randn(B, T, K, dtype=torch.float64)
    plans, misses, weights = _plans(module, memory)
    assert misses == [] and len(plans) == 1
    plan = plans[0]
    assert plan.terms.learned_query and plan.terms.queries == ()
    assert len(plan.terms.keys) == 1 and len(plan.terms.biases) == 1
    assert plan.steps == () and plan.normalisation.kind == "softmax"
    torch.testing.assert_close(weights, module(memory))
