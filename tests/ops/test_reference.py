"""The reference against a slow oracle written with Python loops and math.tanh, on tiny sizes."""

from __future__ import annotations

import math

import pytest
import torch

from seq2seq_fast.reference import additive_attention_ref


def oracle(query, keys, values, v, bias, valid):
    """Loops over b, t, s, h in float64 Python floats; valid[b][s] says whether key s may be attended."""
    batch, num_queries, hidden = len(query), len(query[0]), len(v)
    num_keys, value_dim = len(keys[0]), len(values[0][0])
    contexts, weights = [], []
    for b in range(batch):
        ctx_rows, w_rows = [], []
        for t in range(num_queries):
            scores = []
            for s in range(num_keys):
                total = 0.0
                for h in range(hidden):
                    total += v[h] * math.tanh(query[b][t][h] + keys[b][s][h] + bias[h])
                scores.append(total)
            valid_scores = [scores[s] for s in range(num_keys) if valid[b][s]]
            if valid_scores:
                top = max(valid_scores)
                exps = [math.exp(scores[s] - top) if valid[b][s] else 0.0 for s in range(num_keys)]
                norm = sum(exps)
                row = [e / norm for e in exps]
            else:
                row = [0.0] * num_keys
            w_rows.append(row)
            ctx_rows.append(
                [sum(row[s] * values[b][s][d] for s in range(num_keys)) for d in range(value_dim)]
            )
        contexts.append(ctx_rows)
        weights.append(w_rows)
    return torch.tensor(contexts, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)


CASES = [  # B, Tq, Tk, H, Dv, kind
    (2, 3, 4, 5, 2, "none"),
    (3, 2, 5, 3, 4, "lengths"),
    (3, 1, 4, 1, 1, "mask"),
    (1, 1, 1, 2, 3, "none"),
    (2, 4, 3, 6, 2, "lengths"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_reference_matches_oracle(case, dtype):
    batch, num_queries, num_keys, hidden, value_dim, kind = case
    gen = torch.Generator().manual_seed(sum(case[:5]))
    query = torch.randn(batch, num_queries, hidden, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, num_keys, hidden, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, num_keys, value_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(hidden, generator=gen, dtype=torch.float64)
    bias = torch.randn(hidden, generator=gen, dtype=torch.float64)
    lengths = mask = None
    valid = [[True] * num_keys for _ in range(batch)]
    if kind == "lengths":
        lengths = torch.randint(0, num_keys + 1, (batch,), generator=gen)
        lengths[0] = 0  # an empty row
        valid = [[s < int(lengths[b]) for s in range(num_keys)] for b in range(batch)]
    elif kind == "mask":
        mask = torch.rand(batch, num_keys, generator=gen) < 0.5
        mask[0] = False  # an empty row
        mask[1] = True  # a full row
        valid = mask.tolist()
    want_ctx, want_w = oracle(
        query.tolist(), keys.tolist(), values.tolist(), v.tolist(), bias.tolist(), valid
    )
    got_ctx, got_w = additive_attention_ref(
        *(t.to(dtype) for t in (query, keys, values, v, bias)), lengths=lengths, mask=mask
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got_ctx.double(), want_ctx, atol=tol, rtol=tol)
    torch.testing.assert_close(got_w.double(), want_w, atol=tol, rtol=tol)
    assert not torch.isnan(got_ctx).any() and not torch.isnan(got_w).any()


def test_reference_single_step_query_and_no_bias():
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    keys = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 3, 2, generator=gen, dtype=torch.float64)
    v = torch.randn(4, generator=gen, dtype=torch.float64)
    want_ctx, want_w = oracle(
        query[:, None].tolist(),
        keys.tolist(),
        values.tolist(),
        v.tolist(),
        [0.0] * 4,
        [[True] * 3, [True] * 3],
    )
    got_ctx, got_w = additive_attention_ref(query, keys, values, v)
    assert got_ctx.shape == (2, 2) and got_w.shape == (2, 3)
    torch.testing.assert_close(got_ctx, want_ctx[:, 0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_w, want_w[:, 0], atol=1e-12, rtol=1e-12)


def test_reference_empty_row_has_zero_gradients():
    gen = torch.Generator().manual_seed(8)
    leaves = [
        torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
        for shape in [(2, 3, 4), (2, 5, 4), (2, 5, 3), (4,), (4,)]
    ]
    lengths = torch.tensor([0, 5])
    context, weights = additive_attention_ref(*leaves, lengths=lengths)
    (context.sum() + weights.sum()).backward()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert torch.equal(leaves[0].grad[0], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.equal(leaves[1].grad[0], torch.zeros(5, 4, dtype=torch.float64))
