"""Differential fuzzing: the fused op against the reference over random problems (hypothesis).

Every example draws sizes (B, Tq, Tk, H, Dv, with 1 and primes favoured), a [B, H] or [B, Tq, H]
query, lengths (int64, int32 or a list) or a mask (empty and all-valid rows included), a memory
layout per input (contiguous, sliced from a wider buffer, time-major transposed, batch-expanded
with stride 0), which inputs need gradients and whether the weights enter the loss; then compares
forward and backward with the float64 reference.

C++ kernel (public functional, autograd): float32, float64 and bfloat16 (float32 inside).
Triton launchers under TRITON_INTERPRET=1 (or CUDA): float32, float16, bfloat16, small sizes.

Tolerances (max-norm over each output, relative to 1 + its largest entry):
    float64: 1e-10. float32: 1e-5 plus a few times the tanh error bound times sum|v| (the score
    error; see tests/ops/test_ops.py). float16/bfloat16: at most 2x the error of plain PyTorch in that
    dtype (the reference run in float16/bfloat16) against the float64 truth, plus one ulp of floor.

Example counts come from the hypothesis profile (tests/conftest.py): "ci" by default,
``pytest tests/ops/test_fuzz.py --hypothesis-profile=long --hypothesis-show-statistics`` for many more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from seq2seq_fast import additive_attention
from seq2seq_fast.reference import additive_attention_ref
from tests.reliability import (
    GRAD_NAMES,
    fp32_tolerance,
    normwise_error,
    requires_cpp,
    triton_attention,
    triton_device,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYOUTS = ("contiguous", "strided", "transposed", "expanded")


def _examples(fraction: float) -> settings:
    """A share of the active profile's example count (the Triton interpreter is ~500x slower)."""
    return settings(max_examples=max(3, int(settings().max_examples * fraction)))


# --- problem generation ------------------------------------------------------------------------


@dataclass
class Problem:
    sizes: tuple[int, int, int, int, int]  # B, Tq, Tk, H, Dv
    single_step: bool
    masking: str  # none / lengths64 / lengths32 / lengths_list / mask
    layouts: tuple[str, str, str, str, str]  # query, keys, values, v, bias
    has_bias: bool
    needs_grad: tuple[bool, bool, bool, bool, bool]
    weights_in_loss: bool
    return_weights: bool
    scale: float  # of query and keys (large: the C++ rational tanh path, saturated tanh)
    seed: int


def _dim(low: int, high: int):
    """Sizes in [low, high] with 1, 2, primes and powers of two around the tile sizes favoured."""
    special = [n for n in (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33) if low <= n <= high]
    return (
        st.one_of(st.sampled_from(special), st.integers(low, high))
        if special
        else st.integers(low, high)
    )


@st.composite
def problems(draw, *, max_batch, max_queries, max_keys, max_hidden, max_dv, allow_big=False):
    if allow_big and draw(st.integers(0, 9)) == 0:
        # Occasionally big enough for the C++ kernel to split work over threads and query blocks.
        sizes = (
            draw(st.integers(1, 3)),
            draw(st.integers(8, 24)),
            draw(st.integers(48, 130)),
            draw(st.integers(40, 100)),
            draw(st.integers(1, 20)),
        )
    else:
        sizes = (
            draw(_dim(1, max_batch)),
            draw(_dim(1, max_queries)),
            draw(_dim(1, max_keys)),
            draw(_dim(1, max_hidden)),
            draw(_dim(1, max_dv)),
        )
    single_step = draw(st.integers(0, 3)) == 0
    if single_step:
        sizes = (sizes[0], 1, *sizes[2:])
    needs_grad = tuple(draw(st.booleans()) or draw(st.booleans()) for _ in GRAD_NAMES)
    if not any(needs_grad):
        needs_grad = (True,) * 5
    return Problem(
        sizes=sizes,
        single_step=single_step,
        masking=draw(st.sampled_from(["none", "lengths64", "lengths32", "lengths_list", "mask"])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in GRAD_NAMES),
        has_bias=draw(st.booleans()),
        needs_grad=needs_grad,
        weights_in_loss=draw(st.booleans()),
        return_weights=draw(st.integers(0, 4)) > 0,
        scale=draw(st.sampled_from([0.05, 0.5, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _lay_out(t: torch.Tensor, layout: str, gen: torch.Generator) -> torch.Tensor:
    """The same values as ``t`` in another memory layout (a leaf that autograd can differentiate)."""
    if layout == "contiguous" or t.numel() == 0:
        return t.clone()
    if layout == "strided":  # a slice of a wider buffer with garbage around it
        wide = torch.randn(*t.shape[:-1], 2 * t.shape[-1] + 1, generator=gen).to(t.dtype)
        view = wide[..., 1::2]
        view.copy_(t)
        return view
    if layout == "transposed":  # [B, T, X] stored time-major; vectors stored reversed-ish
        if t.dim() == 1:
            wide = torch.empty(t.shape[0], 3, dtype=t.dtype)
            wide[:, 1] = t
            return wide[:, 1]
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    # expanded: batch stride 0 (every batch row equal to row 0); vectors: stride 0 impossible
    if t.dim() == 1:
        return t.clone()
    return t[:1].expand_as(t)


def make_tensors(problem: Problem, dtype: torch.dtype):
    """(inputs, lengths, mask, grad_context, grad_weights) for a problem, inputs laid out as asked."""
    batch, num_queries, num_keys, hidden, value_dim = problem.sizes
    gen = torch.Generator().manual_seed(problem.seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    base = [
        randn(batch, num_queries, hidden, scale=problem.scale),
        randn(batch, num_keys, hidden, scale=problem.scale),
        randn(batch, num_keys, value_dim),
        randn(hidden, scale=2.0 / math.sqrt(hidden)),
        randn(hidden, scale=0.3),
    ]
    inputs = [_lay_out(t, layout, gen) for t, layout in zip(base, problem.layouts, strict=True)]
    if problem.single_step:
        inputs[0] = inputs[0][:, 0]  # [B, H], keeping the layout's strides
    if not problem.has_bias:
        inputs[4] = None

    lengths = mask = None
    if problem.masking.startswith("lengths"):
        lengths = torch.randint(0, num_keys + 1, (batch,), generator=gen)
        if batch >= 2:
            lengths[0] = 0
            lengths[1] = num_keys
        if problem.masking == "lengths32":
            lengths = lengths.to(torch.int32)
        elif problem.masking == "lengths_list":
            lengths = lengths.tolist()
    elif problem.masking == "mask":
        mask = torch.rand(batch, num_keys, generator=gen) < 0.5
        if batch >= 2:
            mask[0] = False
            mask[1] = True

    ctx_shape = (batch, value_dim) if problem.single_step else (batch, num_queries, value_dim)
    w_shape = (batch, num_keys) if problem.single_step else (batch, num_queries, num_keys)
    grad_context = randn(*ctx_shape)
    grad_weights = randn(*w_shape) if problem.weights_in_loss and problem.return_weights else None
    return inputs, lengths, mask, grad_context, grad_weights


def run(fn, inputs, lengths, mask, grad_context, grad_weights, needs_grad, return_weights, dtype):
    """Outputs and gradients (None where not asked) of sum(ctx*gc) + sum(w*gw), computed in dtype."""
    leaves = []
    for t, need in zip(inputs, needs_grad, strict=True):
        if t is None:
            leaves.append(None)
            continue
        leaf = t.detach().to(dtype) if t.dtype != dtype else t.detach()
        leaves.append(leaf.requires_grad_(need))
    if fn is additive_attention_ref and isinstance(lengths, list):
        lengths = torch.tensor(lengths)  # the reference takes tensors only
    context, weights = fn(*leaves, lengths=lengths, mask=mask, return_weights=return_weights)
    loss = (context * grad_context.to(dtype)).sum()
    if grad_weights is not None:
        loss = loss + (weights * grad_weights.to(dtype)).sum()
    wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
    grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True) if wanted else ())
    out_grads = [
        (next(grads) if leaf is not None and leaf.requires_grad else None) for leaf in leaves
    ]
    return context.detach(), (None if weights is None else weights.detach()), out_grads


# --- C++ kernel: the public functional with autograd -------------------------------------------


def check_cpp(problem: Problem, dtype: torch.dtype) -> None:
    """float64 / float32: within the fixed tolerances; bfloat16 (float32 inside the kernel): at
    most 2x plain PyTorch's error in bfloat16, plus one ulp of floor."""
    note(repr(problem))
    inputs, lengths, mask, gc, gw = make_tensors(problem, dtype)
    common = (lengths, mask, gc, gw, problem.needs_grad, problem.return_weights)
    fused = run(additive_attention, inputs, *common, dtype)
    truth = run(additive_attention_ref, inputs, *common, torch.float64)
    plain = run(additive_attention_ref, inputs, *common, dtype) if dtype == torch.bfloat16 else None
    tol = 1e-10 if dtype == torch.float64 else fp32_tolerance(inputs[3])

    def allowed(index: int, want: torch.Tensor) -> float:
        if plain is None:
            return tol
        base = (plain[0], plain[1], *plain[2])[index]
        return 2 * normwise_error(base, want) + torch.finfo(dtype).eps

    batch, num_queries, num_keys, _, value_dim = problem.sizes
    lead = (batch,) if problem.single_step else (batch, num_queries)
    assert fused[0].shape == (*lead, value_dim) and fused[0].dtype == dtype
    assert torch.isfinite(fused[0]).all(), "context has non-finite values"
    assert normwise_error(fused[0], truth[0]) <= allowed(0, truth[0]), "context"
    if problem.return_weights:
        assert fused[1].shape == (*lead, num_keys) and fused[1].dtype == dtype
        assert normwise_error(fused[1], truth[1]) <= allowed(1, truth[1]), "weights"
        valid = _valid(problem, lengths, mask)
        if valid is not None:  # masked keys get exactly zero weight
            assert not fused[1][~valid.expand_as(fused[1])].any(), "masked weight not zero"
    else:
        assert fused[1] is None
    for i, (name, got, want, leaf) in enumerate(
        zip(GRAD_NAMES, fused[2], truth[2], inputs, strict=True)
    ):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == leaf.shape and got.dtype == dtype, f"grad {name}"
        assert torch.isfinite(got).all(), f"grad {name} has non-finite values"
        error, limit = normwise_error(got, want), allowed(2 + i, want)
        assert error <= limit, f"grad {name}: normwise error {error:.3e} > {limit:.1e}"


def _valid(problem: Problem, lengths, mask) -> torch.Tensor | None:
    """Bool [B, 1, Tk] (or [B, Tk] for one step): True where a key may be attended."""
    batch, _, num_keys = problem.sizes[:3]
    if lengths is not None:
        lengths = torch.as_tensor(lengths)
        valid = torch.arange(num_keys) < lengths.reshape(batch, 1)
    elif mask is not None:
        valid = mask
    else:
        return None
    return valid if problem.single_step else valid.unsqueeze(1)


CPP_PROBLEMS = problems(
    max_batch=5, max_queries=9, max_keys=40, max_hidden=40, max_dv=12, allow_big=True
)


@requires_cpp
@_examples(1.5)
@given(problem=CPP_PROBLEMS)
def test_cpp_fp64_matches_reference(problem):
    check_cpp(problem, torch.float64)


@requires_cpp
@_examples(1.5)
@given(problem=CPP_PROBLEMS)
def test_cpp_fp32_matches_reference(problem):
    check_cpp(problem, torch.float32)


@requires_cpp
@_examples(0.5)
@given(problem=CPP_PROBLEMS)
def test_cpp_bf16_within_twice_plain_error(problem):
    check_cpp(problem, torch.bfloat16)


# --- Triton launchers (interpreter on CPU, compiled on CUDA) -----------------------------------


TRITON_PROBLEMS = problems(max_batch=3, max_queries=5, max_keys=9, max_hidden=9, max_dv=5)


def check_triton(problem: Problem, dtype: torch.dtype) -> None:
    note(repr(problem))
    device = triton_device()
    inputs, lengths, mask, gc, gw = make_tensors(problem, dtype)
    inputs = [None if t is None else t.to(device) for t in inputs]
    gc = gc.to(device)
    gw = None if gw is None else gw.to(device)
    mask = None if mask is None else mask.to(device)
    common = (lengths, mask, gc, gw, problem.needs_grad, problem.return_weights)
    fused = run(triton_attention, inputs, *common, dtype)
    truth = run(additive_attention_ref, inputs, *common, torch.float64)
    plain = None
    if dtype != torch.float32:
        plain = run(additive_attention_ref, inputs, *common, dtype)

    names = ("context", "weights", *(f"grad {n}" for n in GRAD_NAMES))
    outs = (fused[0], fused[1], *fused[2])
    truths = (truth[0], truth[1], *truth[2])
    plains = (plain[0], plain[1], *plain[2]) if plain is not None else (None,) * 7
    for name, got, want, base in zip(names, outs, truths, plains, strict=True):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == dtype and got.shape == want.shape, name
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        error = normwise_error(got, want)
        if dtype == torch.float32:
            allowed = fp32_tolerance(inputs[3])
        else:  # 2x plain PyTorch in that dtype, plus one ulp (of 1 + max|truth|) of floor
            allowed = 2 * normwise_error(base, want) + torch.finfo(dtype).eps
        assert error <= allowed, f"{name}: normwise error {error:.3e} > allowed {allowed:.3e}"


@pytest.mark.triton
@_examples(0.25)
@given(problem=TRITON_PROBLEMS)
def test_triton_fp32_matches_reference(problem):
    check_triton(problem, torch.float32)


@pytest.mark.triton
@_examples(0.15)
@given(problem=TRITON_PROBLEMS)
def test_triton_fp16_within_twice_plain_error(problem):
    check_triton(problem, torch.float16)


@pytest.mark.triton
@_examples(0.15)
@given(problem=TRITON_PROBLEMS)
def test_triton_bf16_within_twice_plain_error(problem):
    check_triton(problem, torch.bfloat16)
