"""The whole input range of the fused attention, swept against the float64 reference.

Random small inputs and a few extremes miss the band where a formula changes: 0.1.0's CPU kernel
returned NaN for pre-activations q + k + bias in ~44..79 with two or more queries per item, the
product path's e^{2a} e^{2b} overflowing to inf inside a SIMD reciprocal. Here the magnitude of the
pre-activation walks densely through 0..120 (step 0.5, across the product limit, the safe sum and
the rational tanh's clamp) and then sparsely to 1e4, both signs, in five splits between query,
keys and bias (same sign, all in the query, all in the keys, opposite signs, cancelling parts),
with a bias that shifts it and one that does not. One batch row per (magnitude, split), so every
row is its own work item and picks its own tanh path; each row's outputs are compared on their
own, and every gradient as a whole.

Paths: the [B, H] step, Tq = 1, Tq > 1; no mask, lengths, a bool mask (empty rows included);
dtypes float32, float64, bfloat16; every CPU instruction set this machine runs (portable always;
float64 has the portable table only); the Triton kernels through the interpreter (or CUDA) on
each tanh path it can run. The ISAs covered are printed at the end of the run.
"""

from __future__ import annotations

import math

import pytest
import torch

from seq2seq_fast import additive_attention
from seq2seq_fast.reference import additive_attention_ref
from tests.reliability import (
    GRAD_NAMES,
    fp32_tolerance,
    requires_cpp,
    triton_attention,
    triton_device,
)

ISAS = ("portable", "avx2", "avx512")
SPLITS = ("same", "query", "keys", "opposite", "cancel")
COVERED_ISAS: set[str] = set()  # read by tests/conftest.py's terminal summary
BF16_EPS = torch.finfo(torch.bfloat16).eps


def magnitudes(step: float = 0.5, coarse_from: float = 120.0) -> torch.Tensor:
    """0..coarse_from every step, on to 120 every 4, then 15 log-spaced magnitudes up to 1e4
    (float64)."""
    dense = torch.arange(0, int(coarse_from / step) + 1, dtype=torch.float64) * step
    coarse = torch.arange(coarse_from, 120, 4, dtype=torch.float64)[1:]
    sparse = torch.logspace(math.log10(125), 4, 15, dtype=torch.float64)
    return torch.cat([dense, coarse, sparse])


def sweep_inputs(
    num_queries: int,
    num_keys: int,
    hidden: int,
    value_dim: int,
    *,
    bias_shift: float,
    seed: int = 0,
    splits=SPLITS,
    step=0.5,
    coarse_from=120.0,
):
    """(query, keys, values, v, bias, preact, rows) in float64, one batch row per (magnitude p,
    sign, split); preact [B] is p, the row's q + k + bias (the size of each part for "cancel");
    rows lists (p, split)."""
    gen = torch.Generator().manual_seed(seed)
    mags = magnitudes(step, coarse_from)
    targets = torch.cat([mags, -mags])
    rows = [(p.item(), split) for split in splits for p in targets]
    batch = len(rows)

    def noise(*size, s=0.5):
        return torch.randn(*size, generator=gen, dtype=torch.float64) * s

    bias = bias_shift + noise(hidden, s=0.3)
    query = noise(batch, num_queries, hidden)
    keys = noise(batch, num_keys, hidden)
    for b, (p, split) in enumerate(rows):
        # The query part carries -bias_shift, so the bias moves the parts but not the sum.
        if split == "same":
            q_part, k_part = p / 2, p / 2
        elif split == "query":
            q_part, k_part = p, 0.0
        elif split == "keys":
            q_part, k_part = 0.0, p
        elif split == "opposite":  # q and k of opposite signs, each larger than the sum
            c = 15.0 + abs(p) / 4
            q_part, k_part = p + math.copysign(c, p), -math.copysign(c, p)
        else:  # "cancel": |p| in each, the sum near 0
            q_part, k_part = p, -p
        query[b] += q_part - bias_shift
        keys[b] += k_part
    values = noise(batch, num_keys, value_dim, s=1.0)
    v = noise(hidden, s=1.0 / math.sqrt(hidden))
    preact = torch.tensor([p for p, _ in rows], dtype=torch.float64)
    return query, keys, values, v, bias, preact, rows


def key_validity(kind: str, batch: int, num_keys: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "lengths":
        lengths = torch.randint(0, num_keys + 1, (batch,), generator=gen)
        lengths[::7] = num_keys
        lengths[3::11] = 0  # empty rows
        return lengths, None
    if kind == "mask":
        mask = torch.rand(batch, num_keys, generator=gen) < 0.7
        mask[::5, 0] = True
        mask[2::13] = False  # empty rows
        return None, mask
    return None, None


def run(fn, inputs, *, lengths, mask, step: bool, dtype):
    """(context, weights, grads of query, keys, values, v, bias) of a fixed random loss."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    query = leaves[0][:, 0] if step else leaves[0]
    context, weights = fn(query, *leaves[1:], lengths=lengths, mask=mask)
    gen = torch.Generator().manual_seed(5)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(context)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights)
    loss = (context * gc).sum() + (weights * gw).sum()
    grads = torch.autograd.grad(loss, leaves)
    if step:
        grads = (grads[0][:, :1], *grads[1:])
    return [context.detach(), weights.detach(), *grads]


NAMES = ("context", "weights", *(f"grad {n}" for n in GRAD_NAMES))


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per batch row: max|got - want| / (1 + max|want|), float64."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (got - want).abs().reshape(got.shape[0], -1).amax(1)
    scale = want.abs().reshape(want.shape[0], -1).amax(1)
    diff = torch.where(torch.isfinite(got.reshape(got.shape[0], -1)).all(1), diff, math.inf)
    return diff / (1 + scale)


def whole_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / (1 + want.abs().max())).item()


def assert_sweep_matches(ours, truth, rows, allowed, names=NAMES):
    """Every output and gradient finite and within allowed[name] (per row where it has rows)."""
    failures = []
    for name, got, want in zip(names, ours, truth, strict=True):
        assert got.shape == want.shape, name
        if name in ("grad v", "grad bias"):
            err = whole_error(got, want)
            if not err <= allowed[name]:
                failures.append(f"{name}: error {err:.3g} > {allowed[name]:.3g}")
            continue
        errs = row_errors(got, want)
        limit = torch.as_tensor(allowed[name], dtype=torch.float64).expand_as(errs)
        bad = (~(errs <= limit)).nonzero().flatten().tolist()
        if bad:
            worst = [  # "split p": the row's pre-activation q + k + b is p (cancel: its parts)
                f"{rows[b][1]} {rows[b][0]:g}: {errs[b]:.3g} > {limit[b]:.3g}" for b in bad[:6]
            ]
            failures.append(f"{name}: {len(bad)} rows over the limit, e.g. " + "; ".join(worst))
    assert not failures, "\n".join(failures)


SHAPES = {"step": (1, 6), "tq1": (1, 6), "tq4": (4, 5)}  # (Tq, Tk); "step" passes query [B, H]


def truth_of(inputs, lengths, mask, step):
    return run(
        additive_attention_ref, inputs, lengths=lengths, mask=mask, step=step, dtype=torch.float64
    )


def allowed_errors(inputs, lengths, mask, step, truth, dtype, tol):
    """tol, plus twice the error of plain PyTorch in dtype against the float64 truth (per row
    where the output has rows). In float32 that term matters only where the pre-activation's
    parts are large and cancel: any float32 sum of them rounds by an ulp of the parts."""
    if dtype == torch.float64:
        return dict.fromkeys(NAMES, tol)
    plain = run(additive_attention_ref, inputs, lengths=lengths, mask=mask, step=step, dtype=dtype)
    folded = run_folded(inputs, lengths=lengths, mask=mask, step=step, dtype=dtype)
    return twice_plain_errors(NAMES, plain, folded, truth, tol)


def twice_plain_errors(names, plain, folded, truth, tol):
    """allowed[name]: tol plus twice the larger error of the two plain runs (both associations)."""
    allowed = {}
    for name, base, base2, want in zip(names, plain, folded, truth, strict=True):
        if name in ("grad v", "grad bias"):
            allowed[name] = tol + 2 * max(whole_error(base, want), whole_error(base2, want))
        else:
            err = torch.maximum(row_errors(base, want), row_errors(base2, want))
            allowed[name] = tol + 2 * err.nan_to_num(posinf=0.0)
    return allowed


def run_folded(inputs, *, lengths, mask, step, dtype):
    """Plain PyTorch in dtype with the kernels' association: the bias added to the query first,
    (q + bias) + k, as every fused kernel does (the bias is folded into the packed query)."""
    query, keys, values, v, bias = (t.detach().to(dtype) for t in inputs)
    folded = (query + bias).requires_grad_(True)
    leaves = [folded, *(t.requires_grad_(True) for t in (keys, values, v))]
    q = folded[:, 0] if step else folded
    context, weights = additive_attention_ref(q, *leaves[1:], lengths=lengths, mask=mask)
    gen = torch.Generator().manual_seed(5)
    gc = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(context)
    gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights)
    loss = (context * gc).sum() + (weights * gw).sum()
    gq, gk, gvals, gv = torch.autograd.grad(loss, leaves)
    if step:
        gq = gq[:, :1]
    return [context.detach(), weights.detach(), gq, gk, gvals, gv, gq.double().sum((0, 1))]


def _use_isa(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    if torch.ops.seq2seq_fast._cpu_isa() != isa:
        pytest.skip(f"this CPU has no {isa}: its kernels cannot run here")


CPP_CASES = [
    pytest.param(isa, dtype, id=f"{isa}-{name}")
    for isa in ISAS
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
] + [pytest.param("portable", torch.float64, id="portable-fp64")]


@requires_cpp
@pytest.mark.parametrize("isa,dtype", CPP_CASES)
@pytest.mark.parametrize("path", list(SHAPES))
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("bias_shift", [0.0, 25.0], ids=["bias0", "bias25"])
def test_cpu_kernels_over_the_whole_range(isa, dtype, path, kind, bias_shift, monkeypatch):
    _use_isa(isa, monkeypatch)
    num_queries, num_keys = SHAPES[path]
    hidden = 37 if bias_shift else 32  # a scalar tail in the packing, and none
    *inputs, _, rows = sweep_inputs(num_queries, num_keys, hidden, 3, bias_shift=bias_shift)
    # Round to the dtype first: the truth is of the inputs the kernel actually gets.
    inputs = [t.to(dtype).double() for t in inputs]
    lengths, mask = key_validity(kind, len(rows), num_keys)
    step = path == "step"
    truth = truth_of(inputs, lengths, mask, step)
    ours = run(additive_attention, inputs, lengths=lengths, mask=mask, step=step, dtype=dtype)
    for out in ours:
        assert out.dtype == dtype
    if dtype == torch.float64:
        tol = 1e-10
    elif dtype == torch.float32:
        tol = fp32_tolerance(inputs[3])
    else:  # bfloat16: the output's own rounding, 2 eps of its scale
        tol = 2 * torch.finfo(torch.bfloat16).eps
    allowed = allowed_errors(inputs, lengths, mask, step, truth, dtype, tol)
    assert_sweep_matches(ours, truth, rows, allowed)
    COVERED_ISAS.add(isa)


def run_steps(fn, inputs, *, lengths, mask, dtype, memory: bool):
    """Two decoder steps over the same keys and values (queries: the inputs' and half of it), as
    run(): outputs of both steps, then the gradients. With memory, through a StepwiseMemory: the
    steps' backwards add their keys' gradients into one sum in place (the accumulating kernel,
    its second step into a sum that is not zero)."""
    from seq2seq_fast.nn.stepwise import StepwiseMemory

    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    query, keys, values, v, bias = leaves
    stepwise = StepwiseMemory.for_training(keys, values, "fused") if memory else None
    if memory:
        assert stepwise is not None, f"no step memory for {dtype}"
        keys, values = stepwise.keys, stepwise.values
    outs, loss = [], 0
    gen = torch.Generator().manual_seed(5)
    for scale in (1.0, 0.5):
        extra = {"stepwise": stepwise, "backend": "fused"} if memory else {}
        context, weights = fn(
            query * scale, keys, values, v, bias, lengths=lengths, mask=mask, **extra
        )
        gc = torch.randn(context.shape, generator=gen, dtype=torch.float64).to(context)
        gw = torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights)
        loss = loss + (context * gc).sum() + (weights * gw).sum()
        outs += [context.detach(), weights.detach()]
    return [*outs, *torch.autograd.grad(loss, leaves)]


def _folded_ref(query, keys, values, v, bias, **kwargs):
    """The reference with the kernels' association, (q + bias) + k (run_folded's)."""
    return additive_attention_ref(query + bias, keys, values, v, torch.zeros_like(bias), **kwargs)


STEP_NAMES = (
    "context 1",
    "weights 1",
    "context 2",
    "weights 2",
    *(f"grad {n}" for n in GRAD_NAMES),
)


@requires_cpp
@pytest.mark.parametrize("isa,dtype", CPP_CASES)
@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("hidden", [32, 37], ids=["H32", "H37"])
def test_cpu_decoder_steps_over_the_whole_range(isa, dtype, num_queries, kind, hidden, monkeypatch):
    """The decoder-step path (StepwiseMemory: the accumulating backward) through the range. 40
    keys per row, so that one query's kernels run whole key tiles with tiles ahead to prefetch
    (kStreamed) and the keys' gradient is added into the sum by the kernel (kAddGrads; H = 32,
    rows unpadded); H = 37 takes the packed rows and the scratch."""
    _use_isa(isa, monkeypatch)
    *inputs, _, rows = sweep_inputs(num_queries, 40, hidden, 3, bias_shift=0.0, seed=7)
    inputs = [t.to(dtype).double() for t in inputs]
    lengths, mask = key_validity(kind, len(rows), 40)
    truth = run_steps(
        additive_attention_ref,
        inputs,
        lengths=lengths,
        mask=mask,
        dtype=torch.float64,
        memory=False,
    )
    ours = run_steps(
        additive_attention, inputs, lengths=lengths, mask=mask, dtype=dtype, memory=True
    )
    for out in ours:
        assert out.dtype == dtype
    if dtype == torch.float64:
        allowed = dict.fromkeys(STEP_NAMES, 1e-10)
    else:
        floor = fp32_tolerance(inputs[3]) if dtype == torch.float32 else 2 * BF16_EPS
        plain, folded = (
            run_steps(fn, inputs, lengths=lengths, mask=mask, dtype=dtype, memory=False)
            for fn in (additive_attention_ref, _folded_ref)
        )
        allowed = twice_plain_errors(STEP_NAMES, plain, folded, truth, floor)
    assert_sweep_matches(ours, truth, rows, allowed, STEP_NAMES)
    COVERED_ISAS.add(isa)


# The interpreter runs one Python program per (row, query block): a coarser grid (every 1.0 to
# 40, past the tanh's saturation and the pair path's limit of 34, then every 4 to 120) and the
# splits that differ most, so that each case takes about a minute, not several.
@pytest.mark.triton
@pytest.mark.parametrize("tanh_path,path", [("product", "tq4"), ("exp", "step")])
def test_triton_kernels_over_the_whole_range(tanh_path, path):
    pytest.importorskip("triton")
    tanh = pytest.importorskip("seq2seq_fast._triton.tanh")
    device = triton_device()
    num_queries, num_keys = SHAPES[path]
    *inputs, _, rows = sweep_inputs(
        num_queries,
        num_keys,
        24,
        3,
        bias_shift=25.0,
        seed=3,
        splits=("same", "opposite", "cancel"),
        step=1.0,
        coarse_from=40.0,
    )
    inputs = [t.float().double() for t in inputs]
    lengths, mask = key_validity("lengths", len(rows), num_keys)
    step = path == "step"
    truth = truth_of(inputs, lengths, mask, step)
    on_device = [t.to(device) for t in inputs]
    with tanh.tanh_override(tanh_path):
        ours = run(
            triton_attention,
            on_device,
            lengths=lengths.to(device),
            mask=None,
            step=step,
            dtype=torch.float32,
        )
    allowed = allowed_errors(
        inputs, lengths, None, step, truth, torch.float32, fp32_tolerance(inputs[3])
    )
    assert_sweep_matches(ours, truth, rows, allowed)


def test_the_sweep_reaches_every_band():
    """The sweep itself: rows in the old NaN band, past the product limit and at 1e4, both signs,
    and splits whose parts exceed the sum."""
    query, keys, _, _, bias, preact, rows = sweep_inputs(4, 5, 32, 3, bias_shift=25.0)
    actual = query.mean((1, 2)) + keys.mean((1, 2)) + bias.mean()
    cancel = torch.tensor([s == "cancel" for _, s in rows])
    assert torch.allclose(actual[~cancel], preact[~cancel], atol=0.5)
    assert actual[cancel].abs().max() < 0.5  # the parts are +-p, the sum near 0
    for lo, hi in ((44, 80), (80, 120), (9000, 10001)):
        assert ((preact >= lo) & (preact < hi)).any() and ((-preact >= lo) & (-preact < hi)).any()
    opposite = [b for b, (p, s) in enumerate(rows) if s == "opposite" and p > 40]
    assert (query[opposite].mean((1, 2)) > 0).all() and (keys[opposite].mean((1, 2)) < 0).all()


@requires_cpp
@pytest.mark.parametrize("isa", ISAS)
def test_product_tanh_paths_over_their_whole_domain(isa, monkeypatch):
    """tanh(a + b) from e^{2a} e^{2b}: the plain product path wherever |a| + |b| <= 43 (the safe
    sum, csrc/kernels/kernels.h), the capped one over all |a|, |b| <= 40, sums to 80 included; the
    bfloat16 rows' one (2^{2 log2(e) (a + b)}) over the grid and parts to 1e4."""
    _use_isa(isa, monkeypatch)
    fast_tanh = torch.ops.seq2seq_fast._fast_tanh
    grid = torch.linspace(-40, 40, 1601)
    a, b = (t.reshape(-1) for t in torch.meshgrid(grid, grid, indexing="ij"))
    exact = torch.tanh(a.double() + b.double())
    capped = fast_tanh(a, b, 2)
    assert torch.isfinite(capped).all()
    assert (capped.double() - exact).abs().max().item() < 1e-6
    safe = (a.abs() + b.abs()) <= 43
    plain = fast_tanh(a[safe], b[safe], 0)
    assert (plain.double() - exact[safe]).abs().max().item() < 1e-6
    # The bfloat16 rows' product path (any a, b): the same grid; parts to 100 that cancel (the
    # float32 rounding of the scaled query, 2^-24 |a|, stays far below the bound there; bfloat16
    # inputs of that size are themselves rounded by 2^-9 |a|); parts to 1e4 of either sign.
    bf16_rows = fast_tanh(a, b, 3)
    assert (bf16_rows.double() - exact).abs().max().item() < 1.5e-4
    mid = torch.linspace(-100, 100, 20001)
    big = torch.logspace(0, 4, 2001)
    a = torch.cat([mid, big, -big, big, -big])
    b = torch.cat([-mid + torch.linspace(-3, 3, 20001), big, -big, -big / 3, big / 3])
    got = fast_tanh(a, b, 3)
    assert torch.isfinite(got).all()
    assert (got.double() - torch.tanh(a.double() + b.double())).abs().max().item() < 1.5e-4
