"""StepwiseMemory: a decoder's steps attend to one memory, gradients gathered once (CPU kernel)."""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from seq2seq_fast import additive_attention
from seq2seq_fast.nn.stepwise import StepwiseMemory
from tests.ops.test_ops import key_masks, make_inputs

pytestmark = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)

ACCUMULATE = torch.ops.seq2seq_fast._additive_attention_bwd_accumulate


def _leaves(batch, num_keys, hidden, value_dim, dtype, seed=0):
    query, keys, values, v, bias = make_inputs(
        batch, 1, num_keys, hidden, value_dim, dtype, seed=seed
    )
    mix = (
        torch.randn(
            value_dim, hidden, generator=torch.Generator().manual_seed(seed + 5), dtype=dtype
        )
        / value_dim**0.5
    )
    return [t.requires_grad_(True) for t in (query[:, 0], keys, values, v, bias, mix)]


def _decode(leaves, lengths, mask, steps, *, stepwise, queries_per_call=1, weights_loss=True):
    """A recurrence like a decoder's: each step's query depends on the previous context; the loss
    uses contexts and (optionally) weights, so grad_context and grad_weights both reach the op."""
    query0, keys, values, v, bias, mix = leaves
    memory = StepwiseMemory(keys, values) if stepwise else None
    k, val = (memory.keys, memory.values) if stepwise else (keys, values)
    query, loss = query0, 0
    gen = torch.Generator().manual_seed(3)
    for t in range(steps):
        q = query.unsqueeze(1).expand(-1, queries_per_call, -1) * (1 + 0.1 * t)
        context, weights = additive_attention(
            q, k, val, v, bias, lengths=lengths, mask=mask, stepwise=memory, backend="fused"
        )
        if stepwise:
            assert type(context.grad_fn).__name__ == "StepAttentionBackward"
        target = torch.randn(context.shape, generator=gen, dtype=context.dtype)
        loss = loss + (context * target).sum()
        if weights_loss:
            loss = loss + (weights * torch.arange(weights.shape[-1], dtype=weights.dtype)).sum()
        query = torch.tanh(query + context[:, 0] @ mix)
    return loss


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("queries_per_call", [1, 3])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize(
    "shape", [(3, 6, 17, 4), (5, 9, 32, 8), (1, 7, 16, 5)], ids=["H17", "H32", "B1"]
)
def test_gradients_equal_the_plain_op(shape, kind, queries_per_call):
    batch, num_keys, hidden, value_dim = shape
    leaves = _leaves(batch, num_keys, hidden, value_dim, torch.float64)
    lengths, mask = key_masks(kind, batch, num_keys)
    steps = 5
    plain = _grads(
        _decode(leaves, lengths, mask, steps, stepwise=False, queries_per_call=queries_per_call),
        leaves,
    )
    gathered = _grads(
        _decode(leaves, lengths, mask, steps, stepwise=True, queries_per_call=queries_per_call),
        leaves,
    )
    names = ("query", "keys", "values", "v", "bias", "mix")
    for name, a, b in zip(names, gathered, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    assert any(g.abs().max() > 0 for g in plain[1:3])  # keys/values gradients are not trivially 0


def test_float32_and_many_queries_split_over_items():
    # B=1 with many queries splits a batch row over several items (per-item dkeys partials).
    query, keys, values, v, bias = make_inputs(1, 64, 11, 24, 6, torch.float32)
    grad_context = torch.randn(1, 64, 6)
    lengths = torch.tensor([8])
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, lengths, None, True
    )
    dq, dk, dval, dv, db = torch.ops.seq2seq_fast.additive_attention_bwd(
        grad_context, None, query, keys, values, v, bias, lengths, None, context, lse, weights
    )
    start = torch.randn_like(keys)
    grad_keys = start.clone()
    dq2, dv2, db2 = ACCUMULATE(
        grad_context, None, query, keys, values, v, bias, lengths, None, weights, grad_keys
    )
    torch.testing.assert_close(grad_keys, start + dk, rtol=1e-5, atol=1e-5)
    assert torch.equal(grad_keys[:, 8:], start[:, 8:])  # rows past the length are left alone
    for a, b in ((dq2, dq), (dv2, dv), (db2, db)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulating_op_rejects_a_misshapen_grad_keys():
    query, keys, values, v, bias = make_inputs(2, 1, 5, 16, 3, torch.float32)
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, None, None, True
    )
    args = (torch.ones_like(context), None, query, keys, values, v, bias, None, None, weights)
    for bad in (
        torch.zeros(2, 4, 16),
        torch.zeros(2, 5, 16, dtype=torch.float64),
        torch.zeros(2, 16, 5).transpose(1, 2),
    ):
        with pytest.raises(RuntimeError, match="grad_keys must be a contiguous CPU tensor"):
            ACCUMULATE(*args, bad)


def test_retain_graph_backward_twice_counts_each_pass_once():
    leaves = _leaves(3, 6, 16, 4, torch.float64)
    loss = _decode(leaves, torch.tensor([6, 2, 4]), None, 4, stepwise=True)
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in leaves]
    loss.backward()
    for a, b in zip(leaves, once, strict=True):
        torch.testing.assert_close(a.grad, 2 * b, rtol=1e-12, atol=1e-12)


def test_a_backward_that_stops_short_of_the_memory_leaves_nothing_behind():
    leaves = _leaves(3, 6, 16, 4, torch.float64)
    query0, keys, values = leaves[:3]
    expected = _grads(_decode(leaves, None, None, 4, stepwise=False), leaves)
    loss = _decode(leaves, None, None, 4, stepwise=True)
    # Only the query's gradient: the steps run their backward, the memory's node does not.
    torch.autograd.grad(loss, [query0], retain_graph=True)
    got = _grads(loss, leaves)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_aliases_used_elsewhere_too_add_their_gradient():
    leaves = _leaves(2, 5, 16, 4, torch.float64)
    keys, values = leaves[1], leaves[2]

    def run(stepwise):
        loss = _decode(leaves, None, None, 3, stepwise=stepwise, weights_loss=False)
        return loss + (keys**2).sum() + values.sum() * 3

    for a, b in zip(_grads(run(True), leaves), _grads(run(False), leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_for_training_applies_only_where_it_pays():
    keys = torch.randn(2, 5, 8, requires_grad=True)
    values = torch.randn(2, 5, 4, requires_grad=True)
    assert isinstance(StepwiseMemory.for_training(keys, values, "auto"), StepwiseMemory)
    assert isinstance(StepwiseMemory.for_training(keys, values, "fused"), StepwiseMemory)
    assert StepwiseMemory.for_training(keys, values, "reference") is None
    assert StepwiseMemory.for_training(keys.detach(), values.detach(), "auto") is None
    with torch.no_grad():
        assert StepwiseMemory.for_training(keys, values, "auto") is None
    grabbed = []
    torch.func.grad(
        lambda k: grabbed.append(StepwiseMemory.for_training(k, values, "auto")) or k.sum()
    )(keys.detach())
    assert grabbed == [None]  # torch.func transforms take the plain op
    empty = torch.zeros(2, 0, 8, requires_grad=True)
    assert StepwiseMemory.for_training(empty, torch.zeros(2, 0, 4), "auto") is None


def test_second_order_gradient_is_a_clear_error():
    leaves = _leaves(2, 5, 16, 4, torch.float64)
    loss = _decode(leaves, None, None, 2, stepwise=True)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)  # first order: fine
    expected = _grads(_decode(leaves, None, None, 2, stepwise=False), leaves)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for grad in grads[1:3]:  # keys and values: through the memory node
        with pytest.raises(RuntimeError, match="not differentiable .a second-order gradient"):
            grad.pow(2).sum().backward()


def test_plain_calls_on_the_original_tensors_are_unaffected():
    # The memory only serves calls that pass its own aliases; others take the usual path.
    leaves = _leaves(2, 5, 16, 4, torch.float64)
    query0, keys, values, v, bias, _ = leaves
    memory = StepwiseMemory(keys, values)
    context, _ = additive_attention(query0, keys, values, v, bias, stepwise=memory, backend="fused")
    assert type(context.grad_fn).__name__ != "StepAttentionBackward"
    expected, _ = additive_attention(query0, keys, values, v, bias)
    torch.testing.assert_close(context, expected)


def _graph_node_names(tensor):
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_bahdanau_decoder_trains_through_the_memory_with_the_fused_backend():
    from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, sequence_loss

    src = torch.randint(4, 12, (3, 5))
    tgt = torch.randint(4, 12, (3, 4))
    for backend in ("fused", "reference"):
        torch.manual_seed(0)
        config = Seq2SeqConfig(
            src_vocab_size=12,
            tgt_vocab_size=12,
            embed_size=8,
            hidden_size=16,
            decoder="bahdanau",
            backend=backend,
        )
        model = Seq2Seq(config)
        loss = sequence_loss(model(src, torch.tensor([5, 2, 4]), tgt)[0], tgt)
        names = _graph_node_names(loss)
        fused = backend == "fused"
        assert ("StepAttentionBackward" in names) == fused
        assert ("_GatheredNodeBackward" in names) == fused
        # the plain op's Functions (eager, and the setup_context style) are not in the graph
        assert not names & {"_EagerAttentionFunctionBackward", "AdditiveAttentionFunctionBackward"}
