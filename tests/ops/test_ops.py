"""The CPU (C++) fused op against the reference: numerics, registration, ISA paths, bad inputs.

Tolerances. float64: 1e-10 (the kernels use exact division and std::tanh / std::exp there).
float32: the kernels evaluate tanh(a + b) with an absolute error below TANH_BOUND (checked in
test_tanh_error_bound); a score is sum_h v_h tanh(.), so its error is at most sum_h |v_h| TANH_BOUND,
and softmax weights and everything downstream move by about that much relative. The float32
comparisons allow 1e-5 plus a few times that bound (it only matters for large H).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import seq2seq_fast
from seq2seq_fast import additive_attention
from seq2seq_fast.reference import additive_attention_ref

pytestmark = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)

TANH_BOUND = 1e-6  # max |fast tanh - tanh| over float32, every path (measured ~5e-7)
# The bfloat16 rows' product path (one query per item, kernels.h): a degree-3 2^f and a 14-bit
# reciprocal, below the 2^-9 relative rounding of its bfloat16 inputs (measured 8.6e-5 AVX-512,
# 3.8e-5 AVX2 and portable).
BF16_TANH_BOUND = 1.5e-4
ISAS = ("portable", "avx2", "avx512")
GRAD_NAMES = ("query", "keys", "values", "v", "bias")


# --- helpers ---------------------------------------------------------------------------------


def make_inputs(batch, num_queries, num_keys, hidden, value_dim, dtype, *, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    query = randn(batch, num_queries, hidden) * scale
    keys = randn(batch, num_keys, hidden) * scale
    values = randn(batch, num_keys, value_dim)
    v = randn(hidden) / math.sqrt(hidden) * 2
    bias = randn(hidden) * 0.3
    return query, keys, values, v, bias


def key_masks(kind, batch, num_keys, *, seed=0):
    """(lengths, mask) for kind in none / lengths / mask, with an empty and a full row if B >= 2."""
    gen = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None, None
    if kind == "lengths":
        lengths = torch.randint(0, num_keys + 1, (batch,), generator=gen)
        if batch >= 2:
            lengths[0], lengths[1] = 0, num_keys
        else:
            lengths[0] = max(1, num_keys // 2)
        return lengths, None
    mask = torch.rand(batch, num_keys, generator=gen) < 0.6
    if batch >= 2:
        mask[0] = False
        mask[1] = True
    else:
        mask[0, 0] = True
    return None, mask


def tolerance(dtype, v):
    if dtype == torch.float64:
        return {"atol": 1e-10, "rtol": 1e-10}
    score_error = float(v.abs().sum()) * TANH_BOUND
    tol = 1e-5 + 4 * score_error
    return {"atol": tol, "rtol": tol}


def forward_backward(fn, inputs, lengths, mask, grad_context, grad_weights, **kwargs):
    """Outputs and the five gradients of sum(context * gc) + sum(weights * gw)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    context, weights = fn(*leaves, lengths=lengths, mask=mask, **kwargs)
    loss = (context * grad_context).sum()
    if weights is not None:
        loss = loss + (weights * grad_weights).sum()
    grads = torch.autograd.grad(loss, leaves)
    return context.detach(), (None if weights is None else weights.detach()), grads


def assert_matches_reference(inputs, lengths=None, mask=None, *, return_weights=True, seed=0):
    query, keys, values, v, bias = inputs
    dtype = query.dtype
    gen = torch.Generator().manual_seed(seed + 2)
    ctx_shape = (*query.shape[:-1], values.shape[-1])
    w_shape = (*query.shape[:-1], keys.shape[1])
    gc = torch.randn(ctx_shape, generator=gen, dtype=torch.float64).to(dtype)
    gw = torch.randn(w_shape, generator=gen, dtype=torch.float64).to(dtype)
    fused = forward_backward(
        additive_attention, inputs, lengths, mask, gc, gw, return_weights=return_weights
    )
    ref = forward_backward(
        additive_attention_ref, inputs, lengths, mask, gc, gw, return_weights=return_weights
    )
    tol = tolerance(dtype, v)
    torch.testing.assert_close(fused[0], ref[0], **tol, msg=lambda m: f"context: {m}")
    if return_weights:
        torch.testing.assert_close(fused[1], ref[1], **tol, msg=lambda m: f"weights: {m}")
    else:
        assert fused[1] is None and ref[1] is None
    for name, got, want in zip(GRAD_NAMES, fused[2], ref[2], strict=True):
        assert torch.isfinite(got).all(), f"grad {name} has non-finite values"
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"grad {n}: {m}")
    return fused


# --- numerics against the reference ----------------------------------------------------------

SHAPES = [  # B, Tq, Tk, H, Dv
    (2, 1, 5, 8, 8),  # one query
    (3, 4, 1, 16, 4),  # one key
    (3, 3, 5, 1, 2),  # H = 1
    (2, 5, 7, 3, 4),  # H = 3
    (3, 6, 9, 17, 5),  # H not a multiple of 16
    (2, 7, 11, 250, 13),  # large H, Dv != H
    (2, 3, 300, 16, 8),  # long Tk
    (1, 33, 6, 20, 20),  # one batch row, many queries (split over threads)
    (9, 9, 8, 32, 7),  # more batch rows than work items per thread
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, kind, dtype):
    batch, _, num_keys, _, _ = shape
    inputs = make_inputs(*shape, dtype)
    lengths, mask = key_masks(kind, batch, num_keys)
    assert_matches_reference(inputs, lengths, mask)


@pytest.mark.parametrize("form", [list, tuple])
def test_the_reference_takes_lengths_as_the_op_does(form):
    """The op takes lengths as a sequence of ints; its reference took tensors only."""
    inputs = make_inputs(3, 2, 5, 8, 4, torch.float64)
    lengths = form([5, 0, 2])
    want = additive_attention_ref(*inputs, lengths=torch.tensor([5, 0, 2]))
    for got in (
        additive_attention_ref(*inputs, lengths=lengths),
        additive_attention(*inputs, lengths=lengths),
    ):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_single_step_query(dtype):
    query, keys, values, v, bias = make_inputs(4, 1, 9, 24, 6, dtype)
    query = query[:, 0]  # [B, H]
    lengths = torch.tensor([9, 0, 3, 1])
    context, weights = additive_attention(query, keys, values, v, bias, lengths=lengths)
    assert context.shape == (4, 6) and weights.shape == (4, 9)
    assert_matches_reference((query, keys, values, v, bias), lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_non_contiguous_inputs(dtype):
    batch, num_queries, num_keys, hidden, value_dim = 3, 5, 7, 19, 6
    gen = torch.Generator().manual_seed(3)
    wide_q = torch.randn(batch, num_queries, 2 * hidden, generator=gen, dtype=dtype)
    query = wide_q[..., ::2]  # strided last dimension
    keys = torch.randn(batch, hidden, num_keys, generator=gen, dtype=dtype).transpose(1, 2)
    values = torch.randn(num_keys, batch, value_dim + 3, generator=gen, dtype=dtype)
    values = values.transpose(0, 1)[..., 1 : value_dim + 1]
    v = (torch.randn(2 * hidden, generator=gen, dtype=dtype) / math.sqrt(hidden))[1::2]
    bias = torch.randn(hidden, 2, generator=gen, dtype=dtype)[:, 0]
    lengths = torch.tensor([7, 0, 4, 9, 2])[::2]
    for t in (query, keys, values, v, bias, lengths):
        assert not t.is_contiguous()
    assert_matches_reference((query, keys, values, v, bias), lengths)
    mask = torch.rand(num_keys, batch, generator=gen).t() < 0.5
    assert not mask.is_contiguous()
    assert_matches_reference((query, keys, values, v, bias), mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_without_weights(dtype):
    inputs = make_inputs(3, 6, 8, 20, 5, dtype)
    lengths, _ = key_masks("lengths", 3, 8)
    context, weights = additive_attention(*inputs, lengths=lengths, return_weights=False)
    assert weights is None and context.shape == (3, 6, 5)
    assert_matches_reference(inputs, lengths, return_weights=False)


@pytest.mark.parametrize("kind", ["lengths", "mask"])
def test_empty_rows_are_zero(kind):
    inputs = make_inputs(3, 4, 6, 16, 5, torch.float32)
    lengths, mask = key_masks(kind, 3, 6)  # batch row 0 has no valid key
    context, weights, grads = forward_backward(
        additive_attention,
        inputs,
        lengths,
        mask,
        torch.ones(3, 4, 5),
        torch.ones(3, 4, 6),
    )
    assert torch.equal(context[0], torch.zeros_like(context[0]))
    assert torch.equal(weights[0], torch.zeros_like(weights[0]))
    for name, grad in zip(GRAD_NAMES, grads, strict=True):
        assert torch.isfinite(grad).all(), name
    assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))  # query of the empty row
    assert torch.equal(grads[1][0], torch.zeros_like(grads[1][0]))  # its keys
    assert torch.equal(grads[2][0], torch.zeros_like(grads[2][0]))  # its values
    # masked positions weigh exactly 0 everywhere
    valid = torch.arange(6) < lengths[:, None] if lengths is not None else mask  # [B, Tk]
    assert torch.equal(weights * ~valid[:, None, :], torch.zeros_like(weights))


def test_float32_error_no_worse_than_plain_pytorch():
    """Against the float64 reference, the fused float32 op errs about as much as float32 PyTorch."""
    query, keys, values, v, bias = make_inputs(4, 12, 20, 256, 64, torch.float64)
    lengths = torch.tensor([20, 7, 13, 1])
    gen = torch.Generator().manual_seed(9)
    gc = torch.randn(4, 12, 64, generator=gen, dtype=torch.float64)
    gw = torch.randn(4, 12, 20, generator=gen, dtype=torch.float64)

    def run(fn, dtype):
        inputs = [t.to(dtype) for t in (query, keys, values, v, bias)]
        context, weights, grads = forward_backward(
            fn, inputs, lengths, None, gc.to(dtype), gw.to(dtype)
        )
        return [context, weights, *grads]

    exact = run(additive_attention_ref, torch.float64)
    fused = run(additive_attention, torch.float32)
    plain = run(additive_attention_ref, torch.float32)
    names = ("context", "weights", *GRAD_NAMES)
    for name, want, got, base in zip(names, exact, fused, plain, strict=True):
        scale = want.abs().max().item()
        fused_err = (got.double() - want).abs().max().item() / scale
        plain_err = (base.double() - want).abs().max().item() / scale
        assert fused_err <= 3 * plain_err + 1e-6, f"{name}: {fused_err:.3g} vs {plain_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_loss_on_weights_only(dtype):
    """Only grad_weights reaches the backward (grad_context is None there)."""
    inputs = make_inputs(3, 5, 7, 12, 4, dtype)
    lengths = torch.tensor([7, 0, 3])
    target = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(4), dtype=dtype)
    grads = []
    for fn in (additive_attention, additive_attention_ref):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        _, weights = fn(*leaves, lengths=lengths)
        grads.append(torch.autograd.grad((weights * target).sum(), leaves, allow_unused=True))
    tol = tolerance(dtype, inputs[3])
    for name, got, want in zip(GRAD_NAMES, *grads, strict=True):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


def test_large_inputs_use_the_rational_path():
    """|q + bias| or |k| above the product path's limit (40): those items take the rational tanh."""
    query, keys, values, v, bias = make_inputs(3, 8, 6, 16, 4, torch.float32)
    query[1] *= 40  # saturates tanh; only batch row 1 leaves the product path
    keys[2, 0, 0] = -60.0
    lengths, _ = key_masks("lengths", 3, 6)
    assert_matches_reference((query, keys, values, v, bias), lengths)


# --- gradcheck, opcheck, compile ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
def test_gradcheck(kind):
    query, keys, values, v, bias = make_inputs(2, 5, 4, 6, 3, torch.float64)
    lengths, mask = key_masks(kind, 2, 4)
    if kind == "lengths":
        lengths = torch.tensor([2, 4])  # no empty row: its gradient is exactly 0 anyway
    elif kind == "mask":
        mask = torch.tensor([[True, False, True, True], [False, True, False, False]])
    leaves = tuple(t.requires_grad_(True) for t in (query, keys, values, v, bias))

    def fn(*args):
        context, weights = additive_attention(*args, lengths=lengths, mask=mask)
        return context, weights

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


def _op_args(kind, return_weights):
    query, keys, values, v, bias = make_inputs(3, 5, 6, 17, 4, torch.float32)
    lengths, mask = key_masks(kind, 3, 6)
    return (query, keys, values, v, bias, lengths, mask, return_weights)


@pytest.mark.parametrize("return_weights", [True, False])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
def test_opcheck_fwd(kind, return_weights):
    torch.library.opcheck(
        torch.ops.seq2seq_fast.additive_attention_fwd.default, _op_args(kind, return_weights)
    )


@pytest.mark.parametrize("with_grad_weights", [True, False])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
def test_opcheck_bwd(kind, with_grad_weights):
    query, keys, values, v, bias, lengths, mask, _ = _op_args(kind, True)
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, lengths, mask, True
    )
    grad_context = torch.randn_like(context)
    grad_weights = torch.randn_like(weights) if with_grad_weights else None
    args = (grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, context, lse)
    torch.library.opcheck(torch.ops.seq2seq_fast.additive_attention_bwd.default, args)
    torch.library.opcheck(torch.ops.seq2seq_fast.additive_attention_bwd.default, (*args, weights))


# Both backward paths of the CPU kernel: one pass from the forward's weights (what autograd uses)
# and the recomputing one (no weights). Shapes cover one query (direct dkeys), several query tiles,
# H not a multiple of 16 (padded rows), H a multiple of 16 with one query (keys read in place),
# a batch row split over work items, and the product and rational tanh paths (scale).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize(
    "shape",
    [(3, 1, 9, 32, 16), (2, 3, 7, 17, 5), (3, 13, 9, 48, 6), (1, 40, 9, 20, 5), (4, 6, 5, 16, 3)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("scale", [1.0, 60.0], ids=["product", "rational"])
def test_backward_with_saved_weights_matches_recompute(shape, kind, dtype, scale):
    query, keys, values, v, bias = make_inputs(*shape, dtype, scale=scale)
    lengths, mask = key_masks(kind, shape[0], shape[2])
    fwd = torch.ops.seq2seq_fast.additive_attention_fwd
    bwd = torch.ops.seq2seq_fast.additive_attention_bwd
    context, weights, lse = fwd(query, keys, values, v, bias, lengths, mask, True)
    gen = torch.Generator().manual_seed(3)
    grad_context = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(dtype)
    grad_weights = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(dtype)
    for gw in (None, grad_weights):
        args = (grad_context, gw, query, keys, values, v, bias, lengths, mask, context, lse)
        recomputed = bwd(*args)
        kept = weights.clone()
        one_pass = bwd(*args, weights)
        torch.testing.assert_close(weights, kept, rtol=0, atol=0)  # not written to
        for got, want in zip(one_pass, recomputed, strict=True):
            torch.testing.assert_close(got, want, **tolerance(dtype, v))
        # and both equal the reference's gradients
        leaves = [t.clone().requires_grad_(True) for t in (query, keys, values, v, bias)]
        ref_context, ref_weights = additive_attention_ref(*leaves, lengths=lengths, mask=mask)
        loss = (ref_context * grad_context).sum()
        if gw is not None:
            loss = loss + (ref_weights * gw).sum()
        ref_grads = torch.autograd.grad(loss, leaves)
        for got, want in zip(one_pass, ref_grads, strict=True):
            torch.testing.assert_close(got, want, **tolerance(dtype, v))


def test_backward_rejects_misshapen_weights():
    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 5, torch.float32)
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, None, None, True
    )
    args = (torch.ones_like(context), None, query, keys, values, v, bias, None, None, context, lse)
    with pytest.raises(RuntimeError, match="weights must be"):
        torch.ops.seq2seq_fast.additive_attention_bwd(*args, weights[:, :2])
    with pytest.raises(RuntimeError, match="weights must have"):
        torch.ops.seq2seq_fast.additive_attention_bwd(*args, weights.double())


def test_lse_contract():
    query, keys, values, v, bias = make_inputs(3, 4, 6, 8, 2, torch.float64)
    lengths = torch.tensor([0, 6, 2])
    _, _, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, lengths, None, False
    )
    assert lse.dtype == torch.float32 and lse.shape == (3, 4)
    pre = query.unsqueeze(2) + keys.unsqueeze(1) + bias
    scores = torch.tanh(pre) @ v
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all()
    torch.testing.assert_close(lse[1], torch.logsumexp(scores[1], -1).float())
    torch.testing.assert_close(lse[2], torch.logsumexp(scores[2, :, :2], -1).float())


@pytest.mark.parametrize("time_major", [False, True], ids=["batch-major", "time-major"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_with_backward(backend, time_major, tmp_path, monkeypatch):
    """Also with keys and values that are views of time-major tensors: inductor checks the
    backward's outputs against the fake kernel's strides (contiguous, as the kernels')."""
    # a cache of its own: inductor's graph cache does not know the fake kernels' code, and a
    # graph compiled with another version of them would be reused
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    inputs = make_inputs(2, 5, 7, 16, 4, torch.float32)
    if time_major:
        query, keys, values, v, bias = inputs
        keys, values = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (keys, values))
        inputs = (query, keys, values, v, bias)
    lengths = torch.tensor([7, 3])

    def loss_fn(query, keys, values, v, bias):
        context, weights = additive_attention(query, keys, values, v, bias, lengths=lengths)
        return (context**2).sum() + (weights * torch.arange(7.0)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    eager_leaves = [_copy(t).requires_grad_(True) for t in inputs]
    compiled_leaves = [_copy(t).requires_grad_(True) for t in inputs]
    eager_loss = loss_fn(*eager_leaves)
    compiled_loss = compiled(*compiled_leaves)
    torch.testing.assert_close(compiled_loss, eager_loss)
    eager_loss.backward()
    compiled_loss.backward()
    for name, a, b in zip(GRAD_NAMES, compiled_leaves, eager_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=name: f"grad {n}: {m}")


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with ``t``'s strides (``clone`` keeps them only for dense layouts, as here)."""
    copy = t.clone()
    assert copy.stride() == t.stride()
    return copy


# --- determinism, NaN ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 40, 9, 20, 5), (6, 7, 9, 33, 5)], ids=["split", "rows"])
def test_bitwise_deterministic(shape):
    inputs = make_inputs(*shape, torch.float32)
    lengths = torch.randint(
        1, shape[2] + 1, (shape[0],), generator=torch.Generator().manual_seed(5)
    )
    gc = torch.randn(shape[0], shape[1], shape[4])
    gw = torch.randn(shape[0], shape[1], shape[2])
    first = forward_backward(additive_attention, inputs, lengths, None, gc, gw)
    for _ in range(3):
        again = forward_backward(additive_attention, inputs, lengths, None, gc, gw)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        for a, b in zip(again[2], first[2], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("num_queries", [1, 6], ids=["rational", "product"])
def test_nan_stays_in_its_row(num_queries):
    query, keys, values, v, bias = make_inputs(3, num_queries, 5, 16, 4, torch.float32)
    query[1, num_queries - 1, 3] = float("nan")
    context, weights = additive_attention(query, keys, values, v, bias)
    assert torch.isnan(context[1, num_queries - 1]).all()
    assert torch.isnan(weights[1, num_queries - 1]).all()
    finite = torch.ones(3, num_queries, dtype=torch.bool)
    finite[1, num_queries - 1] = False
    assert torch.isfinite(context[finite]).all() and torch.isfinite(weights[finite]).all()
    # A NaN key poisons the rows that attend to it, and only those.
    query[1, num_queries - 1, 3] = 0.0
    keys[2, 1, 0] = float("nan")
    context, weights = additive_attention(query, keys, values, v, bias)
    assert torch.isnan(context[2]).all()
    assert torch.isfinite(context[:2]).all() and torch.isfinite(weights[:2]).all()


# --- instruction-set paths and the tanh approximation ------------------------------------------


def _isa_available(isa, monkeypatch):
    monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    return torch.ops.seq2seq_fast._cpu_isa() == isa


@pytest.mark.parametrize("isa", ISAS)
def test_each_isa_matches_reference(isa, monkeypatch):
    if not _isa_available(isa, monkeypatch):
        pytest.skip(f"this CPU has no {isa}")
    # One query with 21 keys and random lengths: the 8-key tiles of a decoding step (AVX-512),
    # then 4-key tiles and single keys.
    cases = [
        ((3, 6, 9, 17, 5), "lengths"),
        ((2, 1, 7, 40, 3), "mask"),
        ((4, 1, 21, 32, 4), "lengths"),
    ]
    for shape, kind in cases:
        inputs = make_inputs(*shape, torch.float32)
        lengths, mask = key_masks(kind, shape[0], shape[2])
        assert_matches_reference(inputs, lengths, mask)


def _float32_grid():
    """Dense float32 grid: every 2^-12 up to 16, then log-spaced magnitudes, both signs, specials."""
    fine = torch.arange(0, 16 * 4096 + 1, dtype=torch.float64) / 4096
    coarse = torch.logspace(-30, 38, 20001, dtype=torch.float64)
    tiny = torch.logspace(-45, -30, 101, dtype=torch.float64)
    mags = torch.cat([fine, coarse, tiny]).float()
    mags = mags[torch.isfinite(mags)]
    big = torch.tensor([torch.finfo(torch.float32).max, float("inf")])
    return torch.cat([mags, -mags, big, -big])


@pytest.mark.parametrize("isa", ISAS)
def test_tanh_error_bound(isa, monkeypatch):
    if not _isa_available(isa, monkeypatch):
        pytest.skip(f"this CPU has no {isa}")
    fast_tanh = torch.ops.seq2seq_fast._fast_tanh
    # Rational path: every float32 magnitude, plus inf; NaN stays NaN.
    x = _float32_grid()
    got = fast_tanh(x, torch.zeros_like(x), 1)
    err = (got.double() - torch.tanh(x.double())).abs().max().item()
    assert err < TANH_BOUND, f"rational tanh error {err:.3g}"
    nan = fast_tanh(torch.tensor([float("nan")] * 16), torch.zeros(16), 1)
    assert torch.isnan(nan).all()
    # Product path tanh(a + b) from exp(2a) exp(2b): the whole range |a|, |b| <= 40, and sums
    # that cancel (a ~ -b), where the error is measured against tanh of the exact sum.
    gen = torch.Generator().manual_seed(0)
    a = torch.cat([torch.linspace(-40, 40, 400001), (torch.rand(200000, generator=gen) - 0.5) * 80])
    b = torch.cat([torch.zeros(400001), -a[400001:] + torch.randn(200000, generator=gen)])
    b = b.clamp(-40, 40)
    got = fast_tanh(a, b, 0)
    err = (got.double() - torch.tanh(a.double() + b.double())).abs().max().item()
    assert err < TANH_BOUND, f"product tanh error {err:.3g}"
    # The bfloat16 rows' product path: every float32 magnitude and +-inf (-> +-1), NaN stays NaN.
    got = fast_tanh(x, torch.zeros_like(x), 3)
    err = (got.double() - torch.tanh(x.double())).abs().max().item()
    assert err < BF16_TANH_BOUND, f"bfloat16 rows' tanh error {err:.3g}"
    assert torch.isnan(fast_tanh(torch.tensor([float("nan")] * 16), torch.zeros(16), 3)).all()


def test_isa_forced_in_a_fresh_process():
    """The variable also works when set before import (what a user would do), on every path."""
    code = (
        "import torch, seq2seq_fast\n"
        "q = torch.randn(2, 5, 16); k = torch.randn(2, 7, 16); val = torch.randn(2, 7, 3)\n"
        "v = torch.randn(16) / 4\n"
        "c, w = seq2seq_fast.additive_attention(q, k, val, v)\n"
        "r, rw = seq2seq_fast.additive_attention_ref(q, k, val, v)\n"
        "torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5)\n"
        "print(torch.ops.seq2seq_fast._cpu_isa())\n"
    )
    env = dict(os.environ, SEQ2SEQ_FAST_ISA="portable")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "portable"


def test_no_batch_by_queries_by_keys_by_hidden_memory():
    """Forward + backward at a shape whose [B, Tq, Tk, H] tensor would be 128 MiB: peak RSS grows
    by far less (measured in a fresh process, whose ru_maxrss only this work can raise)."""
    code = (
        "import resource, torch, seq2seq_fast\n"
        "torch.manual_seed(0)\n"
        "B, Tq, Tk, H = 8, 64, 64, 1024\n"
        "q = torch.randn(B, Tq, H, requires_grad=True)\n"
        "k = torch.randn(B, Tk, H, requires_grad=True)\n"
        "val = torch.randn(B, Tk, 64, requires_grad=True)\n"
        "v = (torch.randn(H) / 32).requires_grad_()\n"
        "seq2seq_fast.additive_attention(q[:1, :4], k[:1], val[:1], v)[0].sum().backward()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "c, w = seq2seq_fast.additive_attention(q, k, val, v)\n"
        "(c.sum() + w.square().sum()).backward()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown_mib = int(out.stdout.strip()) / 1024
    assert grown_mib < 32, f"peak RSS grew by {grown_mib:.1f} MiB (the 4-D tensor is 128 MiB)"


# --- bad input -------------------------------------------------------------------------------


def _good():
    return make_inputs(2, 3, 4, 5, 6, torch.float32)


def _bad_cases():
    q, k, val, v, b = _good()
    return [
        ("rank", dict(query=q[0, 0]), "query"),
        ("keys rank", dict(keys=k[0]), "keys"),
        ("values rank", dict(values=val[0]), "values"),
        ("batch", dict(keys=k[:1], values=val[:1]), "query"),
        ("hidden", dict(keys=k[..., :3]), "query"),
        ("num keys", dict(values=val[:, :3]), "values"),
        ("v shape", dict(v=v[:3]), "v"),
        ("bias shape", dict(bias=b[:2]), "bias"),
        ("mixed dtypes", dict(keys=k.double()), "keys"),
        ("integer query", dict(query=q.long()), "query"),
        ("integer values", dict(values=val.int()), "values"),
        ("lengths too long", dict(lengths=torch.tensor([4, 5])), "lengths"),
        ("negative lengths", dict(lengths=torch.tensor([-1, 2])), "lengths"),
        ("lengths shape", dict(lengths=torch.tensor([1, 2, 3])), "lengths"),
        ("float lengths", dict(lengths=torch.tensor([1.0, 2.0])), "lengths"),
        (
            "both",
            dict(lengths=torch.tensor([1, 2]), mask=torch.ones(2, 4, dtype=torch.bool)),
            "mask",
        ),
        ("mask shape", dict(mask=torch.ones(2, 5, dtype=torch.bool)), "mask"),
        ("mask dtype", dict(mask=torch.ones(2, 4)), "mask"),
        ("not a tensor", dict(query=[[1.0]]), "query"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, override, name = case
    q, k, val, v, b = _good()
    args = dict(query=q, keys=k, values=val, v=v, bias=b, lengths=None, mask=None)
    args.update(override)
    with pytest.raises((ValueError, TypeError)) as info:
        additive_attention(
            args["query"],
            args["keys"],
            args["values"],
            args["v"],
            args["bias"],
            lengths=args["lengths"],
            mask=args["mask"],
        )
    assert name in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "sizes", [(0, 3, 4, 5, 6), (2, 0, 4, 5, 6), (2, 3, 0, 5, 6), (2, 3, 4, 0, 6), (2, 3, 4, 5, 0)]
)
def test_raw_ops_on_empty_sizes(sizes):
    """The ops themselves (not only the functional, which routes these to the reference)."""
    batch, num_queries, num_keys, hidden, value_dim = sizes
    query, keys, values, v, bias = make_inputs(*sizes, torch.float32)
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
        query, keys, values, v, bias, None, None, True
    )
    want_context, want_weights = additive_attention_ref(query, keys, values, v, bias)
    torch.testing.assert_close(context, want_context)
    torch.testing.assert_close(weights, want_weights)
    assert lse.shape == (batch, num_queries) and lse.dtype == torch.float32
    grads = torch.ops.seq2seq_fast.additive_attention_bwd(
        torch.ones_like(context), None, query, keys, values, v, bias, None, None, context, lse
    )
    for grad, like in zip(grads, (query, keys, values, v, bias), strict=True):
        assert grad.shape == like.shape and torch.isfinite(grad).all()


def test_cpp_checks_its_inputs():
    """The op itself rejects what the functional would have caught, with the argument's name."""
    q, k, val, v, b = _good()
    fwd = torch.ops.seq2seq_fast.additive_attention_fwd
    with pytest.raises(ValueError, match="lengths"):  # (a value, not a type or a shape)
        fwd(q, k, val, v, b, torch.tensor([5, 1]), None, True)
    with pytest.raises(RuntimeError, match="keys"):
        fwd(q, k[..., :2], val, v, b, None, None, True)
    with pytest.raises(RuntimeError, match="mask"):
        fwd(q, k, val, v, b, None, torch.ones(2, 3, dtype=torch.bool), True)
    with pytest.raises(RuntimeError, match="dtype"):
        fwd(q, k.double(), val, v, b, None, None, True)


def test_second_order_gradient_is_a_clear_error_not_a_silently_wrong_one():
    leaves = [t.requires_grad_(True) for t in make_inputs(2, 3, 4, 8, 3, torch.float64)]
    context, _ = additive_attention(*leaves)
    # First order under create_graph=True: right values...
    (grad_keys,) = torch.autograd.grad(context.sum(), leaves[1], create_graph=True)
    context_ref, _ = additive_attention_ref(*leaves)
    (grad_keys_ref,) = torch.autograd.grad(context_ref.sum(), leaves[1], create_graph=True)
    torch.testing.assert_close(grad_keys, grad_keys_ref)
    # ... and differentiating them again raises (the reference gives second derivatives).
    with pytest.raises(RuntimeError, match="not differentiable .a second-order gradient"):
        grad_keys.pow(2).sum().backward()
    grad_keys_ref.pow(2).sum().backward()
    assert leaves[0].grad is not None


def test_torch_func_grad_works():
    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 3, torch.float64)

    def loss(k, fn):
        return fn(query, k, values, v, bias)[0].sum()

    fused = torch.func.grad(lambda k: loss(k, additive_attention))(keys)
    reference = torch.func.grad(lambda k: loss(k, additive_attention_ref))(keys)
    torch.testing.assert_close(fused, reference)


def test_torch_func_vmap_runs_the_reference():
    # The fused Function has no batching rule: under vmap (also vmap of grad) the dispatch runs
    # the reference, whose plain ops vmap batches; the results are a loop's over the batch.
    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 3, torch.float64)
    stacked = torch.stack([query, 2 * query, -query])
    lengths = torch.tensor([4, 2])

    def attend(q, k):
        return additive_attention(q, k, values, v, bias, lengths=lengths, backend="fused")

    context, weights = torch.func.vmap(attend, in_dims=(0, None))(stacked, keys)
    for i, q in enumerate(stacked):
        want = additive_attention_ref(q, keys, values, v, bias, lengths=lengths)
        torch.testing.assert_close(context[i], want[0])
        torch.testing.assert_close(weights[i], want[1])

    def loss(k, q, fn):
        return fn(q, k, values, v, bias, lengths=lengths)[0].sum()

    per_query = torch.func.vmap(
        torch.func.grad(lambda k, q: loss(k, q, additive_attention)), in_dims=(None, 0)
    )(keys, stacked)
    for i, q in enumerate(stacked):
        k = keys.clone().requires_grad_(True)
        loss(k, q, additive_attention_ref).backward()
        torch.testing.assert_close(per_query[i], k.grad)


def test_lengths_checked_once_per_version():
    # A decoder passes the same lengths every step: their range is read once, and again after an
    # in-place change (or against another Tk).
    from seq2seq_fast.ops import _checks as ops

    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 3, torch.float32)
    lengths = torch.tensor([4, 2])
    additive_attention(query, keys, values, v, bias, lengths=lengths)
    assert ops._checked_lengths[id(lengths)][0]() is lengths
    lengths[1] = 9
    with pytest.raises(
        ValueError, match=r"lengths must lie in \[0, Tk=4\], got values from 4 to 9"
    ):
        additive_attention(query, keys, values, v, bias, lengths=lengths)
    lengths[1] = 4
    with pytest.raises(ValueError, match=r"\[0, Tk=3\]"):
        additive_attention(query, keys[:, :3], values[:, :3], v, bias, lengths=lengths)
    key = id(lengths)
    del lengths
    assert key not in ops._checked_lengths


@pytest.mark.parametrize("lengths", [[4, 9], [-1, 4]])
def test_lengths_out_of_range_under_compile_are_a_value_error(lengths):
    # torch.compile cannot read the lengths while tracing, so the eager check is skipped there;
    # the CPU kernel checks them at run time and raises the same kind of error.
    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 3, torch.float32)
    compiled = torch.compile(additive_attention, backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, Tk=4\]"):
        compiled(query, keys, values, v, bias, lengths=torch.tensor(lengths))


def test_the_cuda_forward_checks_lengths_first():
    # The Triton forward registered for CUDA tensors reads a length past Tk as Tk and a negative
    # one as an empty row: its registered wrapper checks the range first (a ValueError).
    from seq2seq_fast.ops._library import _lengths_checked

    calls = []
    forward = _lengths_checked(lambda *args, **kwargs: calls.append(args) or "ran")
    query, keys, values, v, bias = make_inputs(2, 3, 4, 8, 3, torch.float32)
    for bad in ([4, 5], [-1, 2]):
        with pytest.raises(ValueError, match=r"lengths must lie in \[0, Tk=4\]"):
            forward(query, keys, values, v, bias, torch.tensor(bad), None, True)
    assert not calls
    assert forward(query, keys, values, v, bias, torch.tensor([4, 0]), None, True) == "ran"
    assert forward(query, keys, values, v, bias, None, None, True) == "ran"
    assert len(calls) == 2
