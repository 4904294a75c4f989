"""Accuracy of the fused CPU attention where its shortcuts could lose it: bfloat16 gradients of
peaked rows (the backward reads the forward's weights rounded to bfloat16), and the float32
product path (tanh(a + b) from e^{2a} e^{2b}) with small pre-activations.

The truth is the float64 reference on the same (rounded) inputs; the bar is what the reference
computing in float32 meets (bfloat16: ``additive_attention_ref(..., upcast=True)``), so that input
rounding does not count and only the kernels' own arithmetic does.
"""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from seq2seq_fast import additive_attention
from seq2seq_fast.ops.stepwise import StepwiseMemory
from seq2seq_fast.reference import additive_attention_ref

pytestmark = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)

BF16 = torch.bfloat16
ISAS = ("portable", "avx2", "avx512")
LEAVES = ("query", "keys", "values", "v", "bias")


def _use_isa(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    if torch.ops.seq2seq_fast._cpu_isa() != isa:
        pytest.skip(f"this CPU has no {isa}")


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (normwise)."""
    return ((got.detach().double().cpu() - want).abs().max() / want.abs().max()).item()


# --- bfloat16: peaked rows ------------------------------------------------------------------------


def _peaked_inputs(max_weight: float, num_queries: int, seed: int = 0):
    """bfloat16-representable float64 inputs whose every row's largest weight is about
    ``max_weight`` (v scaled by bisection), and the output gradients."""
    gen = torch.Generator().manual_seed(seed)

    def rounded(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(BF16).double()

    batch, num_keys, hidden, value_dim = 2, 7, 32, 8
    query, keys = rounded(batch, num_queries, hidden), rounded(batch, num_keys, hidden)
    values, v0, bias = (
        rounded(batch, num_keys, value_dim),
        rounded(hidden),
        rounded(hidden, scale=0.1),
    )

    def least_max_weight(scale: float) -> float:
        v = (v0 * scale).to(BF16).double()
        return additive_attention_ref(query, keys, values, v, bias)[1].amax(-1).min().item()

    low, high = 0.0, 1.0
    while least_max_weight(high) < max_weight:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if least_max_weight(mid) < max_weight else (low, mid)
    v = (v0 * high).to(BF16).double()
    grad_context = rounded(batch, num_queries, value_dim)
    grad_weights = rounded(batch, num_queries, num_keys)
    return (query, keys, values, v, bias), grad_context, grad_weights


def _outputs_and_grads(fn, inputs, grad_context, grad_weights, dtype, stepwise=False):
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    query, keys, values, v, bias = leaves
    extra = {}
    if stepwise:
        memory = StepwiseMemory.for_training(keys, values, "fused")
        assert memory is not None
        keys, values, extra = memory.keys, memory.values, {"stepwise": memory}
    context, weights = fn(query, keys, values, v, bias, **extra)
    loss = (context.double() * grad_context).sum() + (weights.double() * grad_weights).sum()
    return [context, weights, *torch.autograd.grad(loss, leaves)]


MAX_WEIGHTS = [0.5, 0.9, 0.99, 1 - 1e-3, 1 - 1e-4, 1 - 1e-5, 1 - 1e-6, 1 - 1e-7]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", ["plain", "stepwise"])
@pytest.mark.parametrize("max_weight", MAX_WEIGHTS, ids=lambda w: f"{w:.7f}")
def test_bf16_gradients_of_peaked_rows(max_weight, path, isa, monkeypatch):
    """Every output and gradient in bfloat16 errs at most twice as much as the reference computing
    in float32 (then rounded to bfloat16), plus one bfloat16 eps, normwise, however peaked the
    rows: from a largest weight of 0.5 to one within 1e-7 of 1, whose bfloat16 rounding is 1.
    Three queries a row: the product path (a decoding step's bfloat16 tanh is tested below)."""
    _use_isa(isa, monkeypatch)
    inputs, grad_context, grad_weights = _peaked_inputs(max_weight, num_queries=3)
    truth = _outputs_and_grads(
        additive_attention_ref, inputs, grad_context, grad_weights, torch.float64
    )

    def upcast(*args, **kwargs):
        return additive_attention_ref(*args, upcast=True, **kwargs)

    floor = _outputs_and_grads(upcast, inputs, grad_context, grad_weights, BF16)
    fused = _outputs_and_grads(
        additive_attention, inputs, grad_context, grad_weights, BF16, stepwise=path == "stepwise"
    )
    names = ("context", "weights", *(f"grad {n}" for n in LEAVES))
    for name, got, base, want in zip(names, fused, floor, truth, strict=True):
        assert got.dtype == BF16, name
        allowed = 2 * _rel_error(base, want) + torch.finfo(BF16).eps
        err = _rel_error(got, want)
        assert err <= allowed, f"{name}: rel error {err:.3e} > allowed {allowed:.3e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("max_weight", [0.9, 1 - 1e-4, 1 - 1e-6], ids=lambda w: f"{w:.7f}")
def test_bf16_step_backward_from_saved_weights_matches_recomputed(max_weight, isa, monkeypatch):
    """A decoding step (one query): the backward given the forward's bfloat16 weights is as
    accurate as the one that recomputes them in float32 (it was off by the gradients' own size
    where the top weight rounds to 1)."""
    _use_isa(isa, monkeypatch)
    inputs, grad_context, grad_weights = _peaked_inputs(max_weight, num_queries=1)
    truth = _outputs_and_grads(
        additive_attention_ref, inputs, grad_context, grad_weights, torch.float64
    )
    args = [t.to(BF16) for t in inputs]
    gc, gw = grad_context.to(BF16), grad_weights.to(BF16)
    ops = torch.ops.seq2seq_fast
    context, weights, lse = ops.additive_attention_fwd(*args, None, None, True)
    saved = ops.additive_attention_bwd(gc, gw, *args, None, None, context, lse, weights)
    recomputed = ops.additive_attention_bwd(gc, gw, *args, None, None, context, lse, None)
    for name, got, base, want in zip(LEAVES, saved, recomputed, truth[2:], strict=True):
        allowed = 1.5 * _rel_error(base, want) + torch.finfo(BF16).eps / 4
        err = _rel_error(got, want)
        assert err <= allowed, f"grad {name}: rel error {err:.3e} > allowed {allowed:.3e}"


# --- float32: the product path with small pre-activations -----------------------------------------

MAGNITUDES = [1e-7, 1e-5, 1e-3, 1e-1, 0.5, 1.0, 3.0, 10.0, 30.0]


def _small_preactivation_inputs(magnitude: float, seed: int = 0):
    """float64 inputs of query, keys and bias ~ magnitude (four queries a row: the product path
    unless it is ruled out) and v scaled so that the scores spread over about +-10."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_queries, num_keys, hidden, value_dim = 2, 4, 8, 32, 4

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float().double()

    query = rand(batch, num_queries, hidden, scale=magnitude)
    keys = rand(batch, num_keys, hidden, scale=magnitude)
    values, bias = rand(batch, num_keys, value_dim), rand(hidden, scale=magnitude)
    tanh_scale = min(magnitude, 1.0)
    v = rand(hidden, scale=10.0 / (tanh_scale * hidden**0.5))
    inputs = (query, keys, values, v, bias)
    grad_context = rand(batch, num_queries, value_dim)
    grad_weights = rand(batch, num_queries, num_keys)
    return inputs, grad_context, grad_weights


def _float32_against_reference(fn, magnitude):
    """(name, fused error, float32 reference error) normwise against float64, every output."""
    inputs, grad_context, grad_weights = _small_preactivation_inputs(magnitude)
    truth = _outputs_and_grads(
        additive_attention_ref, inputs, grad_context, grad_weights, torch.float64
    )
    plain = _outputs_and_grads(
        additive_attention_ref, inputs, grad_context, grad_weights, torch.float32
    )
    fused = _outputs_and_grads(fn, inputs, grad_context, grad_weights, torch.float32)
    names = ("context", "weights", *(f"grad {n}" for n in LEAVES))
    for name, got, base, want in zip(names, fused, plain, truth, strict=True):
        yield name, _rel_error(got, want), _rel_error(base, want)


# the kernels' product path: its tanh's absolute error, and the smallest max |a| + max |b| of a
# work item it serves (csrc/kernels/kernels.h kProductMinSum, triton_kernels/tanh.py)
PRODUCT_TANH_ERROR = 3.2e-7
PRODUCT_MIN_SUM = 0.25


def _product_bound(magnitude) -> float:
    """0 where every row's max |q + bias| + max |keys| is below PRODUCT_MIN_SUM (the accurate
    path serves every item: float32's own bound applies); else the product path's normwise
    bound on the scores, its tanh error summed over |v|, a few times over."""
    (query, keys, _, v, bias), _, _ = _small_preactivation_inputs(magnitude)
    row_max = (query + bias).abs().amax((1, 2)) + keys.abs().amax((1, 2))
    if bool((row_max < PRODUCT_MIN_SUM).all()):
        return 0.0
    return 4 * PRODUCT_TANH_ERROR * float(v.abs().sum())


def _assert_float32_accuracy(fn, magnitude, factor=8):
    product = _product_bound(magnitude)
    for name, err, base in _float32_against_reference(fn, magnitude):
        if base > 1e-3:
            # float32 cannot resolve it at all (tiny pre-activations: sech^2 ~ 1, and the query's
            # and bias's gradients v sum_s de_s sech^2 cancel to ~x^2 while sum_s de_s = 0)
            continue
        # float32 math: a few times the plain float32 reference's error, at least 1e-6 normwise;
        # where the product path may serve, its own bound
        allowed = max(factor * base, 1e-6, product)
        assert err <= allowed, f"{name}: rel error {err:.3e} > allowed {allowed:.3e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_float32_small_preactivations_with_large_v(magnitude, isa, monkeypatch):
    """From |q|, |k|, |bias| ~ 1e-7 to 1e2 with a v that spreads the scores over +-10: float32
    accuracy on every output (the product path's absolute tanh error, ~1e-7, was 1e-2 of the
    weights at 1e-5)."""
    _use_isa(isa, monkeypatch)
    _assert_float32_accuracy(additive_attention, magnitude)


@pytest.mark.parametrize("magnitude", [1e-5, 1e-3, 1.0, 10.0])
def test_triton_float32_small_preactivations_with_large_v(magnitude):
    """The same on the Triton kernels' product path (under the interpreter without a GPU)."""
    tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
    if not torch.cuda.is_available() and not tk.is_interpreted():
        pytest.skip("no CUDA and the Triton kernels were imported without TRITON_INTERPRET=1")
    from seq2seq_fast.ops.additive_attention import attention_function

    function = attention_function(tk.additive_attention_fwd, tk.additive_attention_bwd)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def fused(query, keys, values, v, bias):
        args = [t.to(device) for t in (query, keys, values, v, bias)]
        context, weights, _ = function.apply(*args, None, None, True, "softmax")
        return context, weights

    with tk.tanh_override("product"):  # (the "exp" fallback sums in another order: 16x)
        _assert_float32_accuracy(fused, magnitude, factor=16)
