"""Triton kernels (seq2seq_fast._triton.additive_attention) against the reference.

Without a GPU these run through Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before the package is imported), so shapes stay tiny; with CUDA they run the
compiled kernels, and the CUDA-only tests add opcheck, torch.compile and the tanh.approx path.
Run alone with ``pytest -m triton``.
"""

from __future__ import annotations

import os

import pytest
import torch

import seq2seq_fast
from seq2seq_fast.reference import additive_attention_ref

triton = pytest.importorskip("triton")
tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
tiles = pytest.importorskip("seq2seq_fast._triton.tiles")

pytestmark = pytest.mark.triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and not tk.is_interpreted():
    pytest.skip(
        "no CUDA and the Triton kernels were imported without TRITON_INTERPRET=1",
        allow_module_level=True,
    )
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

GRAD_NAMES = ("query", "keys", "values", "v", "bias")


# --- helpers ---------------------------------------------------------------------------------------


def make_inputs(batch, num_queries, num_keys, hidden, value_dim, dtype, *, strided=False, seed=0):
    """query, keys, values, v, bias on DEVICE; strided=True gives non-contiguous views of each."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    if strided:
        query = randn(batch, num_queries, 2 * hidden, scale=0.7)[:, :, ::2]
        keys = randn(num_keys, batch, hidden, scale=0.7).transpose(0, 1)  # time-major encoder
        values = randn(batch, num_keys, value_dim + 3)[:, :, 1 : value_dim + 1]
        v = randn(2 * hidden)[1::2]
        bias = randn(hidden, 3, scale=0.5)[:, 0]
    else:
        query = randn(batch, num_queries, hidden, scale=0.7)
        keys = randn(batch, num_keys, hidden, scale=0.7)
        values = randn(batch, num_keys, value_dim)
        v = randn(hidden)
        bias = randn(hidden, scale=0.5)
    return tuple(t.to(DEVICE) for t in (query, keys, values, v, bias))


def make_lengths_or_mask(kind, batch, num_keys, seed=0):
    """(lengths, mask) for kind in none / lengths / mask; row 0 is always empty when masked."""
    gen = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None, None
    if kind == "lengths":
        lengths = torch.randint(0, num_keys + 1, (batch,), generator=gen)
        lengths[0] = 0
        if batch > 1:
            lengths[-1] = num_keys
        return lengths.to(DEVICE), None
    mask = torch.rand(batch, num_keys, generator=gen) > 0.4
    mask[0] = False
    if batch > 1:
        mask[-1, 0] = True
    return None, mask.to(DEVICE)


def reference(inputs, lengths, mask, grad_context, grad_weights, dtype=torch.float64):
    """Reference outputs and the gradients of sum(ctx*gc) + sum(w*gw), computed in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    context, weights = additive_attention_ref(*leaves, lengths=lengths, mask=mask)
    loss = (context * grad_context.to(dtype)).sum()
    if grad_weights is not None:
        loss = loss + (weights * grad_weights.to(dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return context.detach(), weights.detach(), grads


def fused(inputs, lengths, mask, grad_context, grad_weights, *, fwd_config=None, bwd_configs=None):
    query, keys, values, v, bias = inputs
    context, weights, lse = tk.additive_attention_fwd(
        query, keys, values, v, bias, lengths, mask, True, config=fwd_config
    )
    grads = tk.additive_attention_bwd(
        grad_context,
        grad_weights,
        query,
        keys,
        values,
        v,
        bias,
        lengths,
        mask,
        context,
        lse,
        configs=bwd_configs,
    )
    return context, weights, lse, grads


def assert_close64(actual, expected, tol, name):
    """|actual - expected| <= tol * (1 + |expected|) elementwise, with the worst offender named."""
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} vs {expected.shape}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if actual.numel() == 0:
        return
    error = (actual - expected).abs()
    assert (error <= tol * (1.0 + expected.abs())).all(), (
        f"{name}: max error {error.max().item():.3e} exceeds {tol:.1e} * (1 + |expected|)"
    )


def max_error(actual, expected):
    if actual.numel() == 0:
        return 0.0
    return (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().max().item()


def check_fp32(shape, kind="none", strided=False, seed=0, fwd_config=None, bwd_configs=None):
    batch, num_queries, num_keys, hidden, value_dim = shape
    inputs = make_inputs(*shape, torch.float32, strided=strided, seed=seed)
    lengths, mask = make_lengths_or_mask(kind, batch, num_keys, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    grad_context = torch.randn(batch, num_queries, value_dim, generator=gen).to(DEVICE)
    grad_weights = torch.randn(batch, num_queries, num_keys, generator=gen).to(DEVICE)
    context, weights, lse, grads = fused(
        inputs,
        lengths,
        mask,
        grad_context,
        grad_weights,
        fwd_config=fwd_config,
        bwd_configs=bwd_configs,
    )
    ref_context, ref_weights, ref_grads = reference(
        inputs, lengths, mask, grad_context, grad_weights
    )
    assert context.dtype == weights.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close64(context, ref_context, 1e-5, "context")
    assert_close64(weights, ref_weights, 1e-5, "weights")
    for name, grad, ref_grad, leaf in zip(GRAD_NAMES, grads, ref_grads, inputs, strict=True):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close64(grad, ref_grad, 2e-5, f"grad {name}")
    return inputs, lengths, mask, lse


# --- forward + backward in float32 -----------------------------------------------------------------

SHAPES = [  # (B, Tq, Tk, H, Dv)
    (2, 3, 5, 7, 4),
    (1, 1, 1, 1, 1),  # everything one
    (3, 1, 66, 16, 8),  # one decoding step, Tk not a multiple of any block
    (2, 17, 3, 3, 5),  # Tq just past a power of two
    (2, 4, 9, 17, 2),  # H = 17
    (2, 16, 16, 16, 16),  # tiles large enough for tl.dot
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_matches_reference(shape):
    check_fp32(shape)


@pytest.mark.parametrize("kind", ["lengths", "mask"])
@pytest.mark.parametrize("shape", [(3, 4, 7, 5, 3), (4, 1, 9, 8, 4)], ids=["train", "decode"])
def test_fp32_lengths_and_masks_with_empty_rows(shape, kind):
    _, lengths, mask, lse = check_fp32(shape, kind=kind, seed=3)
    # Row 0 has no valid key: lse is +inf there, finite elsewhere where some key is valid.
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all()
    valid_rows = (lengths > 0) if lengths is not None else mask.any(dim=1)
    assert torch.isfinite(lse[valid_rows]).all()


@pytest.mark.parametrize("kind", ["none", "mask"])
def test_fp32_strided_inputs(kind):
    check_fp32((2, 3, 6, 9, 4), kind=kind, strided=True, seed=5)


def test_fp32_small_tiles_exercise_every_loop():
    # Tiles much smaller than the sizes: every loop runs several times and every tail is padded.
    fwd = tk.TileConfig(block_q=2, block_k=4, block_h=4, block_dv=2, block_k2=4)
    bwd = (fwd, tk.TileConfig(2, 4, 4, 1), tk.TileConfig(2, 4, 1, 2))
    assert not fwd.use_dot and fwd.rows2 == 2
    check_fp32((2, 5, 11, 17, 5), kind="lengths", seed=7, fwd_config=fwd, bwd_configs=bwd)


def test_fp32_int64_offsets_path(monkeypatch):
    # The int64 index path runs for real only past 2^31 elements (bench/gpu_check.py checks
    # that on a GPU); here it is forced on small tensors to test its arithmetic.
    assert not tk.needs_int64_offsets(torch.empty(4, 5, 6))
    huge = torch.empty(2**31 + 1, device="meta")
    assert tk.needs_int64_offsets(huge) and tk.needs_int64_offsets(huge[:: 2**20])
    monkeypatch.setattr(tk, "needs_int64_offsets", lambda *tensors: True)
    check_fp32((2, 3, 6, 9, 4), kind="mask", strided=True, seed=33)


def test_fp32_dot_tiles_with_padding():
    cfg = tk.TileConfig(block_q=16, block_k=16, block_h=8, block_dv=16, block_k2=16)
    bwd = (cfg, tk.TileConfig(16, 16, 8, 1), tk.TileConfig(16, 16, 1, 16))
    assert cfg.use_dot and cfg.rows2 == 16
    check_fp32((1, 18, 20, 11, 17), kind="mask", seed=9, fwd_config=cfg, bwd_configs=bwd)


def test_lse_is_log_sum_exp_of_scores():
    inputs = make_inputs(2, 3, 6, 5, 2, torch.float32, seed=11)
    lengths = torch.tensor([6, 2], device=DEVICE)
    _, _, lse = tk.additive_attention_fwd(*inputs, lengths, None, False)
    query, keys, _, v, bias = (t.double() for t in inputs)
    scores = torch.tanh(query[:, :, None] + keys[:, None] + bias) @ v
    scores[1, :, 2:] = float("-inf")
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)


def test_without_weights_gives_empty_weights_and_same_context():
    inputs = make_inputs(2, 3, 5, 6, 4, torch.float32, seed=13)
    context, weights, lse = tk.additive_attention_fwd(*inputs, None, None, True)
    context_nw, weights_nw, lse_nw = tk.additive_attention_fwd(*inputs, None, None, False)
    assert weights_nw.shape == (0,) and weights.shape == (2, 3, 5)
    assert torch.equal(context, context_nw) and torch.equal(lse, lse_nw)


def test_backward_without_grad_weights():
    inputs = make_inputs(2, 3, 5, 6, 4, torch.float32, seed=15)
    grad_context = torch.randn(2, 3, 4).to(DEVICE)
    _, _, _, grads = fused(inputs, None, None, grad_context, None)
    _, _, ref_grads = reference(inputs, None, None, grad_context, None)
    for name, grad, ref_grad in zip(GRAD_NAMES, grads, ref_grads, strict=True):
        assert_close64(grad, ref_grad, 2e-5, f"grad {name}")


def test_zero_keys_give_zero_context_and_infinite_lse():
    inputs = make_inputs(2, 3, 0, 4, 5, torch.float32)
    context, weights, lse = tk.additive_attention_fwd(*inputs, None, None, True)
    assert weights.shape == (2, 3, 0)
    assert torch.equal(context, torch.zeros_like(context))
    assert torch.isinf(lse).all()
    grads = tk.additive_attention_bwd(
        torch.ones_like(context), None, *inputs, None, None, context, lse
    )
    for grad, leaf in zip(grads, inputs, strict=True):
        assert grad.shape == leaf.shape and not grad.any()


def test_deterministic_bitwise():
    shape = (2, 5, 7, 9, 3)
    inputs = make_inputs(*shape, torch.float32, seed=17)
    lengths, mask = make_lengths_or_mask("mask", 2, 7, seed=17)
    grad_context = torch.randn(2, 5, 3).to(DEVICE)
    grad_weights = torch.randn(2, 5, 7).to(DEVICE)
    first = fused(inputs, lengths, mask, grad_context, grad_weights)
    second = fused(inputs, lengths, mask, grad_context, grad_weights)
    flat_first = [*first[:3], *first[3]]
    flat_second = [*second[:3], *second[3]]
    for a, b in zip(flat_first, flat_second, strict=True):
        assert torch.equal(a, b)


# --- float16 / bfloat16: at most 2x the error of plain PyTorch in that dtype ------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "shape,kind",
    [((2, 3, 7, 12, 5), "none"), ((3, 1, 10, 16, 8), "lengths"), ((2, 16, 16, 16, 16), "mask")],
    ids=["train", "decode", "dot"],
)
def test_low_precision_within_twice_plain_pytorch_error(dtype, shape, kind):
    batch, num_queries, num_keys, hidden, value_dim = shape
    inputs = make_inputs(*shape, dtype, seed=19)
    lengths, mask = make_lengths_or_mask(kind, batch, num_keys, seed=19)
    gen = torch.Generator().manual_seed(21)
    grad_context = torch.randn(batch, num_queries, value_dim, generator=gen).to(dtype).to(DEVICE)
    grad_weights = torch.randn(batch, num_queries, num_keys, generator=gen).to(dtype).to(DEVICE)

    context, weights, _, grads = fused(inputs, lengths, mask, grad_context, grad_weights)
    truth = reference(inputs, lengths, mask, grad_context, grad_weights, dtype=torch.float64)
    plain = reference(inputs, lengths, mask, grad_context, grad_weights, dtype=dtype)
    eps = torch.finfo(dtype).eps
    names = ("context", "weights", *(f"grad {n}" for n in GRAD_NAMES))
    ours = (context, weights, *grads)
    for name, out, out_truth, out_plain in zip(
        names, ours, (truth[0], truth[1], *truth[2]), (plain[0], plain[1], *plain[2]), strict=True
    ):
        assert out.dtype == dtype, name
        scale = max(1.0, out_truth.abs().max().item())
        allowed = 2 * max_error(out_plain, out_truth) + 2 * eps * scale
        assert max_error(out, out_truth) <= allowed, (
            f"{name}: error {max_error(out, out_truth):.3e} > allowed {allowed:.3e}"
        )


# --- tanh paths, tile choice, knobs ----------------------------------------------------------------


def _tanh_errors(mode):
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.logspace(-30, 1.5, 2000)])
    x = torch.cat([x, -x]).to(DEVICE)
    y = tk.tanh_probe(x, mode)
    exact = torch.tanh(x.double())
    abs_err = (y.double() - exact).abs()
    return abs_err.max().item(), (abs_err / exact.abs().clamp_min(1e-30)).max().item()


def test_exp_tanh_error_bound():
    abs_err, rel_err = _tanh_errors("exp")
    assert abs_err <= (1e-6 if CUDA else 2.5e-7), abs_err
    assert rel_err <= (2e-6 if CUDA else 1e-6), rel_err


def test_product_tanh_error_bound():
    abs_err, _ = _tanh_errors("product")
    assert abs_err <= (1e-6 if CUDA else 2.5e-7), abs_err


@requires_cuda
def test_approx_tanh_error_bound():
    _, rel_err = _tanh_errors("approx")
    assert rel_err <= 2.0**-10.9, rel_err


@pytest.mark.parametrize("mode", ["exp", "product"])
def test_fp32_each_tanh_path(mode):
    with tk.tanh_override(mode):
        check_fp32((2, 4, 9, 17, 3), kind="lengths", seed=35)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # e^86 * e^86 = inf
@tk.tanh_override("product")
def test_product_path_falls_back_on_large_preactivations():
    # q + bias and keys past +-34 on both sides (opposite signs): the clamped product formula
    # would be wrong, so those tiles must be recomputed exactly.
    inputs = list(make_inputs(2, 3, 5, 6, 2, torch.float32, seed=37))
    inputs[0] = inputs[0] + torch.tensor([50.0, -50.0, 1.0], device=DEVICE)[None, :, None]
    inputs[1] = inputs[1] - torch.tensor([49.0, 0.0, -49.5, 0.2, 45.0], device=DEVICE)[:, None]
    grad_context = torch.randn(2, 3, 2).to(DEVICE)
    grad_weights = torch.randn(2, 3, 5).to(DEVICE)
    context, weights, _, grads = fused(inputs, None, None, grad_context, grad_weights)
    ref_context, ref_weights, ref_grads = reference(inputs, None, None, grad_context, grad_weights)
    assert_close64(context, ref_context, 1e-5, "context")
    assert_close64(weights, ref_weights, 1e-5, "weights")
    for name, grad, ref_grad in zip(GRAD_NAMES, grads, ref_grads, strict=True):
        assert_close64(grad, ref_grad, 2e-5, f"grad {name}")


BENCH_SHAPES = {  # bench/shapes.py's full shapes (B, Tq, Tk, H, Dv)
    "small-train": (32, 30, 30, 256, 512),
    "gnmt-train": (128, 50, 50, 1024, 1024),
    "decode-step": (1280, 1, 66, 1024, 1024),
    "long-source": (128, 10, 128, 1024, 1024),
    "long-both": (32, 74, 75, 1024, 1024),
}


def _waste(n, block):
    return (-(-n // block) * block) / n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", BENCH_SHAPES)
def test_cost_model_ranks_benchmark_shapes(name, dtype):
    batch, num_queries, num_keys, hidden, value_dim = BENCH_SHAPES[name]
    ranked = tiles.rank_forward(batch, num_queries, num_keys, hidden, value_dim, dtype=dtype)
    costs = [cost for _, cost in ranked]
    assert costs == sorted(costs) and len(ranked) >= 4
    best = ranked[0][0]
    assert best == tk.forward_config(
        num_queries, num_keys, hidden, value_dim, dtype=dtype, batch=batch
    )
    # Minimum-programs rule: every benchmark shape can give all 132 SMs a program, so it must.
    for cfg, _ in ranked:
        assert batch * -(-num_queries // cfg.block_q) >= tiles.H200_SMS, cfg
        assert cfg.block_q * cfg.block_k * cfg.block_h <= tiles.DEFAULT_TILE
        for block in (cfg.block_q, cfg.block_k, cfg.block_h, cfg.block_dv, cfg.block_k2):
            assert block >= 1 and block & (block - 1) == 0
    if num_queries == 1:  # the decoding step: no padded query rows, a GEMV for the values
        assert best.block_q == 1 and not best.use_dot and best.rows2 == 1
    else:
        assert best.use_dot and best.rows2 == 16 and best.block_k2 >= 16
    grad = tiles.rank_grad(batch, num_queries, num_keys, hidden, dtype=dtype)
    assert [c for _, c in grad] == sorted(c for _, c in grad)
    assert batch * -(-hidden // grad[0][0].block_h) >= tiles.H200_SMS


def test_cost_model_terms():
    # Larger tiles amortise the operand loads; padding and waves each cost what they waste.
    assert tiles.tile_cost("approx", 16, 4, 64) < tiles.tile_cost("approx", 2, 4, 512)
    assert tiles.tile_cost("product", 8, 16, 32) < tiles.tile_cost("product", 1, 8, 512)
    assert tiles.tile_cost("packed", 8, 8, 64) == tiles.tile_cost("approx", 8, 8, 64)
    assert tiles._wave_factor(160, 132) > tiles._wave_factor(264, 132) == 1.0
    # Few rows and a batch of 4: only block_q = 1 gives 132 programs, so only it is kept.
    ranked = tiles.rank_forward(4, 64, 64, 512, 512, dtype=torch.bfloat16)
    assert {cfg.block_q for cfg, _ in ranked} == {1}
    # With no candidate reaching the SM count, all are kept.
    ranked = tiles.rank_forward(1, 4, 64, 512, 512, dtype=torch.bfloat16)
    assert {cfg.block_q for cfg, _ in ranked} == {1, 2, 4}


H200_SWEEP = os.path.join(os.path.dirname(__file__), "..", "fixtures", "h200_tile_sweep.json")


def test_cost_model_picks_the_measured_tiles():
    """On the tiles timed on an H200 (every candidate of four shapes), the model's pick must be
    the fastest measured tile or within 25% of it, and was measured (not a tile nobody timed)."""
    import json

    with open(H200_SWEEP) as handle:
        sweep = json.load(handle)
    groups: dict = {}
    for shape, dtype_name, kernel, label, ms in sweep["timings"]:
        groups.setdefault((shape, dtype_name, kernel), {})[label] = ms
    assert len(groups) == 12
    exact = 0
    for (shape, dtype_name, kernel), timings in groups.items():
        batch, num_queries, num_keys, hidden, value_dim = sweep["shapes"][shape]
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        if kernel == "fwd":
            cfg = tiles.forward_config(
                num_queries, num_keys, hidden, value_dim, dtype=dtype, batch=batch
            )
            pick = (cfg.block_q, cfg.block_k, cfg.block_h)
        else:
            pick = tiles.grad_tile(batch, num_queries, num_keys, hidden, dtype=dtype)
        label = "x".join(map(str, pick))
        assert label in timings, (shape, dtype_name, kernel, label)
        best = min(timings.values())
        assert timings[label] <= 1.25 * best, (shape, dtype_name, kernel, label, timings[label])
        exact += timings[label] == best
    assert exact >= 7


def test_sweep_candidates_vary_block_q():
    for batch, num_queries, num_keys, hidden, value_dim in BENCH_SHAPES.values():
        if num_queries == 1:
            continue
        picks = tiles.sweep_forward(
            batch, num_queries, num_keys, hidden, value_dim, dtype=torch.bfloat16
        )
        assert len({cfg.block_q for cfg, _ in picks}) >= 2
        assert (
            picks[0][0]
            == tiles.rank_forward(
                batch, num_queries, num_keys, hidden, value_dim, dtype=torch.bfloat16
            )[0][0]
        )


def test_every_scratch_and_gradient_element_is_written(monkeypatch):
    """No zero fills: with every fresh buffer poisoned with NaN, the results must still match
    (rows of length 0, keys past the length, masked keys, tails of every tile loop)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    fwd = tk.TileConfig(block_q=2, block_k=4, block_h=4, block_dv=2, block_k2=4)
    bwd = (fwd, tk.TileConfig(2, 2, 4, 1), tk.TileConfig(2, 4, 1, 2))
    check_fp32((3, 3, 9, 5, 3), kind="lengths", seed=43, fwd_config=fwd, bwd_configs=bwd)
    check_fp32((3, 1, 9, 8, 4), kind="mask", seed=47)  # default tiles, the decoding step


def test_tanh_choice_argument_and_context():
    device = torch.device(DEVICE)
    gpu = CUDA and not tk.is_interpreted()
    assert tk.resolve_tanh("auto", torch.float32, device) == "product"
    assert tk.resolve_tanh("auto", torch.bfloat16, device) == ("approx" if gpu else "product")
    assert tk.resolve_tanh("exp", torch.bfloat16, device) == "exp"
    # The PTX paths need compiled kernels; the interpreter runs them as "product".
    for mode in ("approx", "packed"):
        assert tk.resolve_tanh(mode, torch.float32, device) == (mode if gpu else "product")
    with tk.tanh_override("exp"):
        assert tk.resolve_tanh("auto", torch.bfloat16, device) == "exp"
        with tk.tanh_override("product"):  # the innermost context wins
            assert tk.resolve_tanh("auto", torch.float32, device) == "product"
        assert tk.resolve_tanh("auto", torch.float32, device) == "exp"
        assert tk.resolve_tanh("product", torch.float32, device) == "product"  # argument wins
    assert tk.resolve_tanh("auto", torch.float32, device) == "product"
    with pytest.raises(ValueError, match="tanh must be one of"):
        tk.resolve_tanh("fastest", torch.float32, device)
    with pytest.raises(ValueError, match="tanh_override"):
        with tk.tanh_override("fastest"):
            pass


def test_tanh_argument_reaches_the_kernels():
    # exp and product differ in the last bits: the explicit argument must change the result,
    # and the context manager must act on the launchers as the argument does.
    inputs = make_inputs(2, 3, 7, 33, 4, torch.float32, seed=39)
    by_arg = {
        m: tk.additive_attention_fwd(*inputs, None, None, True, tanh=m)[1]
        for m in ("exp", "product")
    }
    assert not torch.equal(by_arg["exp"], by_arg["product"])
    with tk.tanh_override("exp"):
        by_context = tk.additive_attention_fwd(*inputs, None, None, True)[1]
    assert torch.equal(by_context, by_arg["exp"])


# --- CUDA only: registration, compile, public op, fast tanh in the kernels --------------------------


def _op_args(dtype, kind, num_queries=3):
    inputs = make_inputs(2, num_queries, 6, 8, 4, dtype, seed=23)
    lengths, mask = make_lengths_or_mask(kind, 2, 6, seed=23)
    return inputs, lengths, mask


@requires_cuda
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("return_weights", [True, False])
def test_opcheck(kind, return_weights):
    inputs, lengths, mask = _op_args(torch.float32, kind)
    fwd_args = (*inputs, lengths, mask, return_weights)
    ops = torch.ops.seq2seq_fast
    # opcheck takes one overload: the backward has two (the default and .score_bias).
    torch.library.opcheck(ops.additive_attention_fwd.default, fwd_args)
    context, weights, lse = ops.additive_attention_fwd(*fwd_args)
    grad_weights = torch.randn_like(weights) if return_weights else None
    bwd_args = (torch.randn_like(context), grad_weights, *inputs, lengths, mask, context, lse)
    torch.library.opcheck(ops.additive_attention_bwd.default, bwd_args)
    score_bias = torch.tensor([0.3], device=DEVICE)
    torch.library.opcheck(ops.additive_attention_fwd.default, (*fwd_args, "sigmoid", score_bias))
    context, _, lse = ops.additive_attention_fwd(*fwd_args, "sigmoid", score_bias)
    bwd_args = (torch.randn_like(context), grad_weights, *inputs, lengths, mask, context, lse)
    torch.library.opcheck(
        ops.additive_attention_bwd.score_bias, (*bwd_args, None, "sigmoid", score_bias)
    )


@requires_cuda
@pytest.mark.parametrize(
    "dtype,query_rank", [(torch.float32, 3), (torch.bfloat16, 2)], ids=["fp32-train", "bf16-step"]
)
def test_public_op_and_compile_fullgraph(dtype, query_rank):
    inputs, lengths, _ = _op_args(dtype, "lengths")
    if query_rank == 2:
        inputs = (inputs[0][:, 0], *inputs[1:])

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        context, weights = fn(*leaves, lengths)
        ((context.float() ** 2).sum() + (weights.float() * 0.5).sum()).backward()
        return context, weights, [leaf.grad for leaf in leaves]

    def attention(query, keys, values, v, bias, lengths):
        return seq2seq_fast.additive_attention(query, keys, values, v, bias, lengths=lengths)

    eager = run(attention)
    compiled = run(torch.compile(attention, fullgraph=True))
    ref_context, ref_weights = additive_attention_ref(
        *(t.double() for t in inputs), lengths=lengths
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(eager[0].double(), ref_context, atol=tol, rtol=tol)
    torch.testing.assert_close(eager[1].double(), ref_weights, atol=tol, rtol=tol)
    # Same kernels on the same inputs: compiled and eager agree to rounding (bitwise, in practice).
    same = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(compiled[0], eager[0], atol=same, rtol=same)
    torch.testing.assert_close(compiled[1], eager[1], atol=same, rtol=same)
    for grad_c, grad_e in zip(compiled[2], eager[2], strict=True):
        torch.testing.assert_close(grad_c, grad_e, atol=same, rtol=same)


@requires_cuda
@tk.tanh_override("approx")
def test_fp32_with_approx_tanh_is_close():
    shape = (4, 20, 30, 256, 64)
    inputs = make_inputs(*shape, torch.float32, seed=29)
    grad_context = torch.randn(4, 20, 64, device=DEVICE)
    context, weights, _, grads = fused(inputs, None, None, grad_context, None)
    ref_context, ref_weights, ref_grads = reference(inputs, None, None, grad_context, None)
    for name, out, ref in [
        ("context", context, ref_context),
        ("weights", weights, ref_weights),
        *zip(GRAD_NAMES, grads, ref_grads, strict=True),
    ]:
        rel = max_error(out, ref) / max(1e-12, ref.abs().max().item())
        assert rel < 2e-2, f"{name}: relative error {rel:.2e}"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_realistic_shape(dtype):
    shape = (4, 50, 50, 1024, 1024) if dtype == torch.float32 else (8, 1, 66, 1024, 1024)
    inputs = make_inputs(*shape, dtype, seed=31)
    lengths, _ = make_lengths_or_mask("lengths", shape[0], shape[2], seed=31)
    grad_context = torch.randn(shape[0], shape[1], shape[4], device=DEVICE).to(dtype)
    context, weights, _, grads = fused(inputs, lengths, None, grad_context, None)
    truth = reference(inputs, lengths, None, grad_context, None)
    if dtype == torch.float32:
        # Relative to each output's largest element (as the GPU check's gate): grad v and grad
        # bias sum B x Tq x Tk terms, so an element's rounding follows the sum's scale, not its own.
        for name, out, ref in [
            ("context", context, truth[0]),
            *zip(GRAD_NAMES, grads, truth[2], strict=True),
        ]:
            scale = max(1.0, ref.abs().max().item())
            assert max_error(out, ref) <= 1e-4 * scale, f"{name}: {max_error(out, ref):.3e}"
    else:
        plain = reference(inputs, lengths, None, grad_context, None, dtype=dtype)
        eps = torch.finfo(dtype).eps
        for name, out, out_truth, out_plain in [
            ("context", context, truth[0], plain[0]),
            *zip(GRAD_NAMES, grads, truth[2], plain[2], strict=True),
        ]:
            scale = max(1.0, out_truth.abs().max().item())
            allowed = 2 * max_error(out_plain, out_truth) + 2 * eps * scale
            assert max_error(out, out_truth) <= allowed, name


def test_import_without_interpreter_or_gpu_is_clean():
    """The module must import on a CPU-only machine without TRITON_INTERPRET (ops imports it)."""
    import subprocess
    import sys

    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = (
        "import seq2seq_fast.ops._library as ops, seq2seq_fast._triton.additive_attention as tk;"
        "assert ops.load_cuda_kernels() is None, ops.CUDA_KERNEL_ERROR;"
        "assert not tk.is_interpreted()"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
