"""The sigmoid normalisation ("smoothing": sigmoid(e) / sum of sigmoid(e) over the valid keys) of the
additive-attention op: the reference against a slow loop oracle, the CPU kernel and the Triton
kernels (through the interpreter here) against the reference, forward and backward, with lengths,
masks and rows without a valid key, over scores up to |e| = 1e4.
"""

from __future__ import annotations

import math

import pytest
import torch

import seq2seq_fast
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.reference import additive_attention_ref

CPU_KERNEL = seq2seq_fast.fused_available("cpu", torch.float32)
requires_cpu_kernel = pytest.mark.skipif(not CPU_KERNEL, reason="seq2seq_fast._C is not built")
OPS = torch.ops.seq2seq_fast
MASKS = ("none", "lengths", "mask")


def make_inputs(batch, num_queries, num_keys, hidden, value_dim, dtype, *, scale=1.0, seed=0):
    """(query [B, Tq, H] or [B, H] when num_queries is None, keys, values, v, bias); the scores
    reach about +-scale * sum|v| / 2 (v is scaled so that sum |v| = 2 * scale)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, hidden) if num_queries is None else (batch, num_queries, hidden)
    query = torch.randn(shape, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, num_keys, hidden, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, num_keys, value_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(hidden, generator=gen, dtype=torch.float64)
    v = v * (2.0 * scale / v.abs().sum())
    bias = 0.5 * torch.randn(hidden, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (query, keys, values, v, bias))


def key_masks(kind, batch, num_keys):
    """(lengths, mask) with a row without a valid key among the rows (batch >= 3)."""
    if kind == "lengths":
        lengths = torch.tensor([num_keys, 0, max(1, num_keys // 2)] + [num_keys - 1] * (batch - 3))
        return lengths[:batch], None
    if kind == "mask":
        gen = torch.Generator().manual_seed(1)
        mask = torch.rand(batch, num_keys, generator=gen) > 0.4
        mask[0, 0] = True
        mask[1] = False  # a row with no valid key
        return None, mask
    return None, None


def loop_oracle(
    query, keys, values, v, bias, lengths, mask, *, score_bias=0.0, normalize="sigmoid"
):
    """The weights and context key by key in Python floats (float64 loops): sigmoid(e + b) / sum
    sigmoid(e + b), or the softmax of e + b; b = ``score_bias``."""
    q = query.unsqueeze(1) if query.dim() == 2 else query
    batch, num_queries, hidden = q.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    context = torch.zeros(batch, num_queries, value_dim, dtype=torch.float64)
    weights = torch.zeros(batch, num_queries, num_keys, dtype=torch.float64)
    for b in range(batch):
        valid = [
            (lengths is None or s < int(lengths[b])) and (mask is None or bool(mask[b, s]))
            for s in range(num_keys)
        ]
        for t in range(num_queries):
            f = [0.0] * num_keys
            for s in range(num_keys):
                if valid[s]:
                    e = float(score_bias) + sum(
                        float(v[h]) * math.tanh(float(q[b, t, h] + keys[b, s, h] + bias[h]))
                        for h in range(hidden)
                    )
                    f[s] = 1.0 / (1.0 + math.exp(-e)) if normalize == "sigmoid" else math.exp(e)
            total = sum(f)
            for s in range(num_keys):
                if total > 0:
                    weights[b, t, s] = f[s] / total
                    context[b, t] += weights[b, t, s] * values[b, s].double()
    if query.dim() == 2:
        return context.squeeze(1), weights.squeeze(1)
    return context, weights


def oracle(query, keys, values, v, bias, lengths, mask):
    """sigmoid(e) / sum sigmoid(e), key by key in Python floats."""
    return loop_oracle(query, keys, values, v, bias, lengths, mask)


def run(fn, inputs, lengths, mask, grad_seed=5):
    """Outputs of ``fn`` and the gradients of a random linear loss of context and weights."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    context, weights = fn(*leaves, lengths=lengths, mask=mask, normalize="sigmoid")
    gen = torch.Generator().manual_seed(grad_seed)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(context.dtype)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights.dtype)
    loss = (context * gc).sum() + (weights * gw).sum()
    grads = torch.autograd.grad(loss, leaves)
    return context.detach(), weights.detach(), grads


def assert_close_all(got, want, **tol):
    for name, g, w in zip(("context", "weights"), got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for name, g, w in zip(("query", "keys", "values", "v", "bias"), got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


# --- the reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 3])
def test_reference_matches_loop_oracle(kind, num_queries):
    inputs = make_inputs(3, num_queries, 5, 4, 3, torch.float64, scale=3.0)
    lengths, mask = key_masks(kind, 3, 5)
    context, weights = additive_attention_ref(
        *inputs, lengths=lengths, mask=mask, normalize="sigmoid"
    )
    want_context, want_weights = oracle(*inputs, lengths, mask)
    torch.testing.assert_close(weights, want_weights, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(context, want_context, rtol=1e-12, atol=1e-14)


def test_reference_differs_from_softmax_and_rows_sum_to_one():
    inputs = make_inputs(2, 3, 6, 4, 3, torch.float64, scale=2.0)
    _, smooth = additive_attention_ref(*inputs, normalize="sigmoid")
    _, soft = additive_attention_ref(*inputs)
    assert (smooth - soft).abs().max() > 1e-3
    torch.testing.assert_close(smooth.sum(-1), torch.ones(2, 3, dtype=torch.float64))


def test_bad_normalize_is_refused():
    inputs = make_inputs(2, 3, 4, 4, 3, torch.float64)
    with pytest.raises(ValueError, match="normalize"):
        additive_attention_ref(*inputs, normalize="sparsemax")
    with pytest.raises(ValueError, match="normalize.*'relu'"):
        additive_attention(*inputs, normalize="relu")


# --- the CPU kernel --------------------------------------------------------------------------------


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 1, 7])
def test_cpu_kernel_matches_reference_float64(kind, num_queries):
    inputs = make_inputs(4, num_queries, 9, 20, 5, torch.float64, scale=4.0)
    lengths, mask = key_masks(kind, 4, 9)
    got = run(additive_attention, inputs, lengths, mask)
    want = run(additive_attention_ref, inputs, lengths, mask)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 6, 40])
def test_cpu_kernel_matches_reference_float32(kind, num_queries):
    # 40 queries: several query blocks per batch row (the product tanh path, split key rows)
    inputs = make_inputs(3, num_queries, 11, 24, 6, torch.float32, scale=4.0)
    lengths, mask = key_masks(kind, 3, 11)
    got = run(additive_attention, inputs, lengths, mask)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), lengths, mask)
    want = (want[0].float(), want[1].float(), tuple(g.float() for g in want[2]))
    assert_close_all(got, want, rtol=2e-4, atol=2e-5)


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 3])
def test_cpu_kernel_gradcheck(kind, num_queries):
    inputs = make_inputs(3, num_queries, 5, 6, 3, torch.float64, scale=3.0)
    lengths, mask = key_masks(kind, 3, 5)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]

    def f(*xs):
        return additive_attention(*xs, lengths=lengths, mask=mask, normalize="sigmoid")

    assert torch.autograd.gradcheck(f, leaves)


@requires_cpu_kernel
@pytest.mark.parametrize("kind", ("lengths", "mask"))
def test_rows_without_a_valid_key_are_zero(kind):
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float32, scale=50.0)
    lengths, mask = key_masks(kind, 3, 6)
    context, weights, grads = run(additive_attention, inputs, lengths, mask)
    assert torch.equal(weights[1], torch.zeros_like(weights[1]))
    assert torch.equal(context[1], torch.zeros_like(context[1]))
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))  # dquery of the empty row
    valid = (
        torch.arange(6) < lengths[:, None] if lengths is not None else mask
    )  # masked keys: exactly 0
    assert torch.equal(
        weights.masked_select(~valid[:, None, :]),
        torch.zeros(0).new_zeros(int((~valid[:, None, :]).expand_as(weights).sum())),
    )


@requires_cpu_kernel
def test_lse_slot_holds_log_sum_sigmoid():
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float64, scale=6.0)
    lengths, _ = key_masks("lengths", 3, 6)
    _, weights, lse = OPS.additive_attention_fwd(*inputs, lengths, None, True, "sigmoid")
    q, k, _, v, bias = inputs
    e = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1) + bias) @ v
    valid = (torch.arange(6) < lengths[:, None])[:, None, :]
    want = torch.log((torch.sigmoid(e) * valid).sum(-1)).float()
    torch.testing.assert_close(lse[[0, 2]], want[[0, 2]])
    assert torch.isinf(lse[1]).all() and (lse[1] > 0).all()


@requires_cpu_kernel
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_range_sweep_large_scores(scale, dtype):
    """Scores through |e| ~ scale: no overflow, no 0/0 where every sigmoid(e) underflows."""
    inputs = make_inputs(3, 5, 7, 16, 4, dtype, scale=scale, seed=int(scale))
    lengths, _ = key_masks("lengths", 3, 7)
    got = run(additive_attention, inputs, lengths, None)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), lengths, None)
    for t in (*got[:2], *got[2]):
        assert torch.isfinite(t).all()
    want = (want[0].to(dtype), want[1].to(dtype), tuple(g.to(dtype) for g in want[2]))
    if dtype == torch.float64:
        tol = {"rtol": 1e-9, "atol": 1e-9 * scale}
    else:  # float32 scores carry |e| * 1e-7 of rounding, which exp turns into relative error
        tol = {"rtol": 1e-3, "atol": 2e-4 * max(1.0, scale / 30)}
    assert_close_all(got, want, **tol)


@requires_cpu_kernel
def test_all_scores_very_negative_is_not_nan():
    # every sigmoid(e) underflows to 0 in float64 (e ~ -1e4): the weights are those of the limit,
    # softmax(e), not 0/0
    query, keys, values, v, bias = make_inputs(2, 3, 5, 4, 3, torch.float64)
    v = torch.full_like(v, -2.5e3)
    bias = torch.full_like(bias, 50.0)  # tanh(...) = 1: e = -1e4 for every pair
    context, weights = additive_attention(query, keys, values, v, bias, normalize="sigmoid")
    torch.testing.assert_close(weights, torch.full_like(weights, 0.2))
    torch.testing.assert_close(context, values.mean(1, keepdim=True).expand_as(context))


@requires_cpu_kernel
def test_bfloat16_close_to_reference():
    inputs = make_inputs(3, 5, 9, 16, 4, torch.bfloat16, scale=3.0)
    lengths, _ = key_masks("lengths", 3, 9)
    got = run(additive_attention, inputs, lengths, None)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), lengths, None)
    for g, w in zip((*got[:2], *got[2]), (*want[:2], *want[2]), strict=True):
        torch.testing.assert_close(g.double(), w, rtol=3e-2, atol=3e-2)


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
def test_opcheck(kind):
    inputs = make_inputs(3, 5, 6, 17, 4, torch.float32, scale=3.0)
    lengths, mask = key_masks(kind, 3, 6)
    fwd_args = (*inputs, lengths, mask, True, "sigmoid")
    torch.library.opcheck(OPS.additive_attention_fwd.default, fwd_args)
    context, weights, lse = OPS.additive_attention_fwd(*fwd_args)
    grad_context = torch.randn_like(context)
    bwd_args = (grad_context, torch.randn_like(weights), *inputs, lengths, mask, context, lse)
    torch.library.opcheck(OPS.additive_attention_bwd.default, (*bwd_args, weights, "sigmoid"))
    torch.library.opcheck(OPS.additive_attention_bwd.default, (*bwd_args, None, "sigmoid"))


@requires_cpu_kernel
def test_op_refuses_an_unknown_normalize():
    inputs = make_inputs(2, 3, 4, 4, 3, torch.float32)
    with pytest.raises(RuntimeError, match="normalize must be 'softmax' or 'sigmoid'.*'tanh'"):
        OPS.additive_attention_fwd(*inputs, None, None, True, "tanh")


# --- the Triton kernels (interpreter on CPU) ------------------------------------------------------


def _triton():
    tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
    if not torch.cuda.is_available() and not tk.is_interpreted():
        pytest.skip("no CUDA and Triton was imported without TRITON_INTERPRET=1")
    return tk


def _triton_run(tk, inputs, lengths, mask):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, x, v, bias = (t.to(device) for t in inputs)
    lengths = None if lengths is None else lengths.to(device)
    mask = None if mask is None else mask.to(device)
    context, weights, lse = tk.additive_attention_fwd(
        q, k, x, v, bias, lengths, mask, True, "sigmoid"
    )
    gen = torch.Generator().manual_seed(5)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    grads = tk.additive_attention_bwd(
        gc.to(context),
        gw.to(weights),
        q,
        k,
        x,
        v,
        bias,
        lengths,
        mask,
        context,
        lse,
        None,
        "sigmoid",
    )
    return context.cpu(), weights.cpu(), tuple(g.cpu() for g in grads)


@pytest.mark.triton
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [1, 5])
def test_triton_matches_reference(kind, num_queries):
    tk = _triton()
    inputs = make_inputs(3, num_queries, 7, 12, 5, torch.float32, scale=4.0)
    lengths, mask = key_masks(kind, 3, 7)
    got = _triton_run(tk, inputs, lengths, mask)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), lengths, mask)
    want = (want[0].float(), want[1].float(), tuple(g.float() for g in want[2]))
    assert_close_all(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_triton_large_scores(scale):
    tk = _triton()
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float32, scale=scale, seed=3)
    lengths, _ = key_masks("lengths", 3, 6)
    got = _triton_run(tk, inputs, lengths, None)
    for t in (*got[:2], *got[2]):
        assert torch.isfinite(t).all()
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), lengths, None)
    want = (want[0].float(), want[1].float(), tuple(g.float() for g in want[2]))
    assert_close_all(got, want, rtol=1e-3, atol=2e-4 * max(1.0, scale / 30))


@requires_cpu_kernel
def test_under_torch_compile():
    """The Function's setup_context path (tracing) carries normalize to the backward."""
    inputs = make_inputs(2, 3, 5, 4, 3, torch.float64, scale=3.0)
    lengths, _ = key_masks("none", 2, 5)

    def f(*xs):
        context, weights = additive_attention(*xs, normalize="sigmoid")
        return context, weights

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = run(lambda *xs, **kw: compiled(*xs), inputs, lengths, None)
    want = run(additive_attention_ref, inputs, lengths, None)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)
