"""The attention op's scalar score bias: sigmoid(e + b) / sum of sigmoid(e + b) over the valid keys
(a score layer Linear(A, 1, bias=True) under the sigmoid normalisation, as Coqui TTS's default
attention has; under a softmax b cancels). The reference against a slow loop oracle; the CPU kernel
and the Triton kernels (through the interpreter here) against the reference, forward and backward
(the score bias's gradient included), with lengths, masks and rows without a valid key; gradcheck
in float64, opcheck of the ops' new argument and overload, and the old calls unchanged. The sweep
of e + b through the overflow ranges is in tests/ops/test_range_sweep_ops.py.
"""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.reference import additive_attention_ref
from tests.ops.test_smoothing import MASKS, key_masks, loop_oracle, make_inputs

CPU_KERNEL = seq2seq_fast.fused_available("cpu", torch.float32)
requires_cpu_kernel = pytest.mark.skipif(not CPU_KERNEL, reason="seq2seq_fast._C is not built")
OPS = torch.ops.seq2seq_fast
NAMES = ("query", "keys", "values", "v", "bias", "score_bias")


def oracle(query, keys, values, v, bias, score_bias, lengths, mask, normalize):
    """The weights and context key by key in Python floats, with e + b."""
    return loop_oracle(
        query, keys, values, v, bias, lengths, mask, score_bias=score_bias, normalize=normalize
    )


def score_bias_of(value: float, dtype, shape=()) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


def run(fn, inputs, score_bias, lengths, mask, normalize="sigmoid", grad_seed=5):
    """Outputs of ``fn`` and the gradients of a random linear loss of context and weights, for the
    five tensors and the score bias (a leaf too)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (*inputs, score_bias)]
    context, weights = fn(
        *leaves[:5], lengths=lengths, mask=mask, normalize=normalize, score_bias=leaves[5]
    )
    gen = torch.Generator().manual_seed(grad_seed)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(context.dtype)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights.dtype)
    loss = (context * gc).sum() + (weights * gw).sum()
    grads = torch.autograd.grad(loss, leaves)
    return context.detach(), weights.detach(), grads


def assert_close_all(got, want, **tol):
    for name, g, w in zip(("context", "weights"), got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for name, g, w in zip(NAMES, got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


def as_dtype(result, dtype):
    return result[0].to(dtype), result[1].to(dtype), tuple(g.to(dtype) for g in result[2])


# --- the reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["sigmoid", "softmax"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 3])
def test_reference_matches_loop_oracle(normalize, kind, num_queries):
    inputs = make_inputs(3, num_queries, 5, 4, 3, torch.float64, scale=3.0)
    lengths, mask = key_masks(kind, 3, 5)
    context, weights = additive_attention_ref(
        *inputs, lengths=lengths, mask=mask, normalize=normalize, score_bias=-1.75
    )
    want = oracle(*inputs, -1.75, lengths, mask, normalize)
    torch.testing.assert_close(weights, want[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(context, want[0], rtol=1e-12, atol=1e-14)


def test_reference_bias_moves_the_sigmoid_not_the_softmax():
    inputs = make_inputs(2, 3, 6, 4, 3, torch.float64, scale=2.0)
    for b in (-3.0, 2.5):
        _, plain = additive_attention_ref(*inputs, normalize="sigmoid")
        _, shifted = additive_attention_ref(*inputs, normalize="sigmoid", score_bias=b)
        assert (plain - shifted).abs().max() > 1e-3
        torch.testing.assert_close(shifted.sum(-1), torch.ones(2, 3, dtype=torch.float64))
        _, soft = additive_attention_ref(*inputs)
        _, soft_shifted = additive_attention_ref(*inputs, score_bias=b)
        torch.testing.assert_close(soft_shifted, soft, rtol=1e-14, atol=1e-15)


# --- the CPU kernel --------------------------------------------------------------------------------


@requires_cpu_kernel
@pytest.mark.parametrize("normalize", ["sigmoid", "softmax"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 1, 7])
def test_cpu_kernel_matches_reference_float64(normalize, kind, num_queries):
    inputs = make_inputs(4, num_queries, 9, 20, 5, torch.float64, scale=4.0)
    lengths, mask = key_masks(kind, 4, 9)
    b = score_bias_of(-1.3, torch.float64)
    got = run(additive_attention, inputs, b, lengths, mask, normalize)
    want = run(additive_attention_ref, inputs, b, lengths, mask, normalize)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)
    if normalize == "sigmoid":  # the bias matters: its gradient is not zero
        assert got[2][5].abs() > 1e-6
    else:  # the softmax cancels it: its gradient is zero up to rounding
        assert got[2][5].abs() < 1e-12


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 6, 40])
def test_cpu_kernel_matches_reference_float32(kind, num_queries):
    # 40 queries: several query blocks per batch row (the product tanh path, split key rows)
    inputs = make_inputs(3, num_queries, 11, 24, 6, torch.float32, scale=4.0)
    lengths, mask = key_masks(kind, 3, 11)
    b = score_bias_of(0.8, torch.float32, (1,))
    got = run(additive_attention, inputs, b, lengths, mask)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), b.double(), lengths, mask)
    assert_close_all(got, as_dtype(want, torch.float32), rtol=2e-4, atol=2e-5)
    assert got[2][5].shape == (1,) and got[2][5].dtype == torch.float32


@requires_cpu_kernel
def test_bfloat16_close_to_reference():
    inputs = make_inputs(3, 5, 9, 16, 4, torch.bfloat16, scale=3.0)
    lengths, _ = key_masks("lengths", 3, 9)
    b = score_bias_of(-0.5, torch.float32)  # a float32 score bias with bfloat16 inputs
    got = run(additive_attention, inputs, b, lengths, None)
    want = run(additive_attention_ref, tuple(t.double() for t in inputs), b.double(), lengths, None)
    for g, w in zip((*got[:2], *got[2]), (*want[:2], *want[2]), strict=True):
        torch.testing.assert_close(g.double(), w, rtol=3e-2, atol=3e-2)
    assert got[2][5].dtype == torch.float32


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [None, 3])
def test_cpu_kernel_gradcheck(kind, num_queries):
    inputs = make_inputs(3, num_queries, 5, 6, 3, torch.float64, scale=3.0)
    lengths, mask = key_masks(kind, 3, 5)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    leaves.append(score_bias_of(0.9, torch.float64).requires_grad_(True))

    def f(*xs):
        return additive_attention(
            *xs[:5], lengths=lengths, mask=mask, normalize="sigmoid", score_bias=xs[5]
        )

    assert torch.autograd.gradcheck(f, leaves)


@requires_cpu_kernel
def test_number_and_tensor_forms_agree():
    inputs = make_inputs(2, 3, 6, 8, 3, torch.float64, scale=3.0)
    results = [
        additive_attention(*inputs, normalize="sigmoid", score_bias=form)[1]
        for form in (1.5, torch.tensor(1.5, dtype=torch.float64), torch.tensor([1.5]))
    ]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=0, atol=0)
    plain = additive_attention(*inputs, normalize="sigmoid")[1]
    assert (plain - results[0]).abs().max() > 1e-4
    # a score bias that needs no gradient: the others' gradients as with one that does
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    context, _ = additive_attention(*leaves, normalize="sigmoid", score_bias=1.5)
    grads = torch.autograd.grad(context.sum(), leaves)
    leaves_ref = [t.clone().requires_grad_(True) for t in inputs]
    c_ref, _ = additive_attention_ref(*leaves_ref, normalize="sigmoid", score_bias=1.5)
    for g, w in zip(grads, torch.autograd.grad(c_ref.sum(), leaves_ref), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@requires_cpu_kernel
@pytest.mark.parametrize("kind", ("lengths", "mask"))
@pytest.mark.parametrize("b", [-40.0, 0.5, 40.0])
def test_rows_without_a_valid_key_are_zero(kind, b):
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float32, scale=50.0)
    lengths, mask = key_masks(kind, 3, 6)
    context, weights, grads = run(
        additive_attention, inputs, score_bias_of(b, torch.float32), lengths, mask
    )
    assert torch.equal(weights[1], torch.zeros_like(weights[1]))
    assert torch.equal(context[1], torch.zeros_like(context[1]))
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))  # dquery of the empty row
    # every row empty: the score bias's gradient is exactly zero
    empty = torch.zeros(3, dtype=torch.long)
    _, _, none_valid = run(additive_attention, inputs, score_bias_of(b, torch.float32), empty, None)
    assert float(none_valid[5]) == 0.0


@requires_cpu_kernel
def test_lse_slot_holds_the_shifted_statistic():
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float64, scale=6.0)
    lengths, _ = key_masks("lengths", 3, 6)
    b = score_bias_of(2.25, torch.float64)
    _, _, lse = OPS.additive_attention_fwd(*inputs, lengths, None, True, "sigmoid", b)
    q, k, _, v, bias = inputs
    e = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1) + bias) @ v + 2.25
    valid = (torch.arange(6) < lengths[:, None])[:, None, :]
    want = torch.log((torch.sigmoid(e) * valid).sum(-1)).float()
    torch.testing.assert_close(lse[[0, 2]], want[[0, 2]])
    assert torch.isinf(lse[1]).all() and (lse[1] > 0).all()


@requires_cpu_kernel
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("normalize", ["sigmoid", "softmax"])
def test_opcheck(kind, normalize):
    inputs = make_inputs(3, 5, 6, 17, 4, torch.float32, scale=3.0)
    lengths, mask = key_masks(kind, 3, 6)
    for b in (score_bias_of(-0.7, torch.float32), score_bias_of(0.3, torch.float64, (1,))):
        fwd_args = (*inputs, lengths, mask, True, normalize, b)
        torch.library.opcheck(OPS.additive_attention_fwd.default, fwd_args)
        context, weights, lse = OPS.additive_attention_fwd(*fwd_args)
        grad_context = torch.randn_like(context)
        bwd_args = (grad_context, torch.randn_like(weights), *inputs, lengths, mask, context, lse)
        overload = OPS.additive_attention_bwd.score_bias
        torch.library.opcheck(overload, (*bwd_args, weights, normalize, b))
        torch.library.opcheck(overload, (*bwd_args, None, normalize, b))
        grads = overload(*bwd_args, None, normalize, b)
        assert len(grads) == 6 and grads[5].shape == b.shape and grads[5].dtype == b.dtype


@requires_cpu_kernel
def test_old_calls_keep_working():
    """The schemas' new argument has a default and the backward's is an overload: calls written
    for the earlier schemas give the same results as before (no score bias)."""
    inputs = make_inputs(2, 3, 5, 8, 4, torch.float64, scale=2.0)
    old = OPS.additive_attention_fwd(*inputs, None, None, True, "sigmoid")
    new = OPS.additive_attention_fwd(*inputs, None, None, True, "sigmoid", None)
    older = OPS.additive_attention_fwd(*inputs, None, None, True)
    for a, b in zip(old, new, strict=True):
        assert torch.equal(a, b)
    context, weights, lse = older
    grads = OPS.additive_attention_bwd(
        torch.ones_like(context), None, *inputs, None, None, context, lse
    )
    assert len(grads) == 5
    zero = score_bias_of(0.0, torch.float64)
    biased = OPS.additive_attention_bwd.score_bias(
        torch.ones_like(context), None, *inputs, None, None, context, lse, None, "softmax", zero
    )
    for a, b in zip(grads, biased[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@requires_cpu_kernel
@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.zeros(2), ValueError, r"score_bias must have one element.*\[2\]"),
        (torch.zeros(1, 1), ValueError, r"score_bias must have one element.*\[1, 1\]"),
        (torch.tensor(1), TypeError, "score_bias must be a floating tensor, got torch.int64"),
        (True, TypeError, "score_bias must be None, a number or a one-element tensor, got bool"),
        ("0.5", TypeError, "score_bias must be None, a number.*got str"),
        (float("nan"), ValueError, "score_bias must be finite, got nan"),
        (float("-inf"), ValueError, "score_bias must be finite, got -inf"),
    ],
)
def test_bad_score_bias_is_refused(bad, error, match):
    inputs = make_inputs(2, 3, 4, 4, 3, torch.float32)
    with pytest.raises(error, match=match):
        additive_attention(*inputs, normalize="sigmoid", score_bias=bad)


@requires_cpu_kernel
def test_op_refuses_a_bad_score_bias():
    inputs = make_inputs(2, 3, 4, 4, 3, torch.float32)
    with pytest.raises(RuntimeError, match=r"score_bias must be a one-element floating CPU"):
        OPS.additive_attention_fwd(*inputs, None, None, True, "sigmoid", torch.zeros(3))


@requires_cpu_kernel
def test_under_torch_compile():
    """The Function's setup_context path (tracing) carries the score bias to the backward."""
    inputs = make_inputs(2, 3, 5, 4, 3, torch.float64, scale=3.0)
    b = score_bias_of(-0.6, torch.float64)

    def f(*xs, lengths=None, mask=None, normalize="sigmoid", score_bias=None):
        return compiled(*xs, score_bias)

    compiled = torch.compile(
        lambda *xs: additive_attention(*xs[:5], normalize="sigmoid", score_bias=xs[5]),
        backend="aot_eager",
        fullgraph=True,
    )
    got = run(f, inputs, b, None, None)
    want = run(additive_attention_ref, inputs, b, None, None)
    assert_close_all(got, want, rtol=1e-10, atol=1e-12)


# --- the Triton kernels (interpreter on CPU) ------------------------------------------------------


def _triton():
    tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
    if not torch.cuda.is_available() and not tk.is_interpreted():
        pytest.skip("no CUDA and Triton was imported without TRITON_INTERPRET=1")
    return tk


def _triton_run(tk, inputs, score_bias, lengths, mask, normalize="sigmoid"):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, x, v, bias = (t.to(device) for t in inputs)
    b = score_bias.to(device)
    lengths = None if lengths is None else lengths.to(device)
    mask = None if mask is None else mask.to(device)
    context, weights, lse = tk.additive_attention_fwd(
        q, k, x, v, bias, lengths, mask, True, normalize, b
    )
    gen = torch.Generator().manual_seed(5)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    grads = tk.additive_attention_bwd(
        gc.to(context), gw.to(weights), q, k, x, v, bias, lengths, mask, context, lse, None,
        normalize, b,
    )  # fmt: skip
    assert len(grads) == 6
    return context.cpu(), weights.cpu(), tuple(g.cpu() for g in grads)


@pytest.mark.triton
@pytest.mark.parametrize("normalize", ["sigmoid", "softmax"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("num_queries", [1, 5])
def test_triton_matches_reference(normalize, kind, num_queries):
    tk = _triton()
    inputs = make_inputs(3, num_queries, 7, 12, 5, torch.float32, scale=4.0)
    lengths, mask = key_masks(kind, 3, 7)
    b = score_bias_of(1.1, torch.float32)
    got = _triton_run(tk, inputs, b, lengths, mask, normalize)
    want = run(
        additive_attention_ref, tuple(t.double() for t in inputs), b.double(), lengths, mask,
        normalize,
    )  # fmt: skip
    assert_close_all(got, as_dtype(want, torch.float32), rtol=1e-3, atol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("b", [-1e4, -60.0, 60.0, 1e4])
def test_triton_large_shifted_scores(b):
    tk = _triton()
    inputs = make_inputs(3, 4, 6, 8, 3, torch.float32, scale=30.0, seed=3)
    lengths, _ = key_masks("lengths", 3, 6)
    sb = score_bias_of(b, torch.float32)
    got = _triton_run(tk, inputs, sb, lengths, None)
    for t in (*got[:2], *got[2]):
        assert torch.isfinite(t).all()
    want = run(
        additive_attention_ref, tuple(t.double() for t in inputs), sb.double(), lengths, None
    )
    assert_close_all(got, as_dtype(want, torch.float32), rtol=1e-3, atol=2e-4 * abs(b) / 30)


# --- the location-aware step ops (Coqui's location-sensitive attention under the sigmoid) ----------


def _location_case(dtype, kind, seed=4):
    gen = torch.Generator().manual_seed(seed)
    B, T, A, C, Dv = 4, 9, 12, 5, 3

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s).to(dtype)

    tensors = dict(
        query=randn(B, 1, A),
        projected=randn(B, T, A),
        conv=randn(B * T, C, s=0.5),
        weight=randn(A, C, s=0.5),
        values=randn(B, T, Dv),
        v=randn(A, s=0.7),
        bias=randn(A, s=0.3),
    )
    lengths, mask = key_masks(kind, B, T)
    return tensors, lengths, mask


@requires_cpu_kernel
@pytest.mark.parametrize("isa", ["default", "portable"])
@pytest.mark.parametrize("normalize", ["sigmoid", "softmax"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_location_step_with_a_score_bias(dtype, kind, normalize, isa, monkeypatch):
    """The location-aware step's ops with normalize and a score bias against the reference on
    materialised keys P + conv W^T: outputs and every gradient, the score bias's included."""
    if isa != "default":
        monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    t, lengths, mask = _location_case(dtype, kind)
    sb = score_bias_of(-0.8, dtype)
    names = ("query", "projected", "conv", "weight", "values", "v", "bias")
    leaves = {n: t[n].double().requires_grad_() for n in names}
    sb_ref = sb.double().requires_grad_()
    B, T, A = t["projected"].shape
    keys = leaves["projected"] + (leaves["conv"] @ leaves["weight"].t()).view(B, T, A)
    context, weights = additive_attention_ref(
        leaves["query"], keys, leaves["values"], leaves["v"], leaves["bias"],
        lengths=lengths, mask=mask, normalize=normalize, score_bias=sb_ref,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(8)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((context, weights), [*leaves.values(), sb_ref], (gc, gw))

    inputs = (*(t[n] for n in names), lengths, mask)
    got_context, got_weights = OPS._location_attention_fwd(*inputs, normalize, sb)
    acc = torch.zeros_like(t["projected"])
    dq, dconv, dweight, dv, dbias, dsb = OPS._location_attention_bwd.score_bias(
        gc.to(dtype), gw.to(dtype), *inputs, got_weights, acc, normalize, sb
    )
    dvalues = torch.bmm(got_weights.transpose(1, 2), gc.to(dtype))
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=3e-5)
    pairs = [
        ("context", got_context, context),
        ("weights", got_weights, weights),
        ("query", dq, want[0]),
        ("projected", acc, want[1]),
        ("conv", dconv, want[2]),
        ("weight", dweight, want[3]),
        ("values", dvalues, want[4]),
        ("v", dv, want[5]),
        ("bias", dbias, want[6]),
        ("score_bias", dsb, want[7]),
    ]
    for name, g, w in pairs:
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, n=name: f"{n}: {m}")
    # the default overload, normalize given: the same five gradients
    acc2 = torch.zeros_like(t["projected"])
    if normalize == "sigmoid":
        plain = OPS._location_attention_fwd(*inputs, normalize)
        five = OPS._location_attention_bwd(
            gc.to(dtype), gw.to(dtype), *inputs, plain[1], acc2, normalize
        )
        assert len(five) == 5
        assert (plain[1] - got_weights).abs().max() > 1e-4  # the bias moves the weights


@requires_cpu_kernel
def test_location_step_opcheck_with_a_score_bias():
    t, lengths, _ = _location_case(torch.float32, "lengths")
    names = ("query", "projected", "conv", "weight", "values", "v", "bias")
    inputs = (*(t[n] for n in names), lengths, None)
    sb = score_bias_of(0.4, torch.float32)
    torch.library.opcheck(OPS._location_attention_fwd.default, (*inputs, "sigmoid", sb))
    context, weights = OPS._location_attention_fwd(*inputs, "sigmoid", sb)
    args = (torch.randn_like(context), torch.randn_like(weights), *inputs, weights)
    torch.library.opcheck(
        OPS._location_attention_bwd.score_bias,
        (*args, torch.zeros_like(t["projected"]), "sigmoid", sb),
    )
