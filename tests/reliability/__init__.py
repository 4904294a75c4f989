"""Shared helpers of the reliability tests (test_fuzz, test_extremes, test_hostile, ...).

``triton_attention`` runs the Triton launchers as the op would (differentiable), on CUDA when
there is a GPU and through Triton's interpreter on CPU tensors otherwise (tests/conftest.py sets
TRITON_INTERPRET=1 before the package is imported).
"""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from seq2seq_fast import additive_attention
from seq2seq_fast.ops.additive_attention import attention_function

GRAD_NAMES = ("query", "keys", "values", "v", "bias")
TANH_BOUND = 1e-6  # |fast tanh - tanh| in float32, C++ and Triton "exp" paths (their own tests)

requires_cpp = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)


def triton_module():
    """seq2seq_fast._triton.additive_attention, or skip the test when it cannot run here."""
    pytest.importorskip("triton")
    tk = pytest.importorskip("seq2seq_fast._triton.additive_attention")
    if not torch.cuda.is_available() and not tk.is_interpreted():
        pytest.skip("no CUDA and the Triton kernels were imported without TRITON_INTERPRET=1")
    return tk


def triton_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def triton_attention(
    query, keys, values, v, bias=None, *, lengths=None, mask=None, return_weights=True
):
    """The launchers as the op calls them (inputs normalised as ``additive_attention`` does)."""
    tk = triton_module()
    single_step = query.dim() == 2
    if lengths is not None:
        lengths = torch.as_tensor(lengths).to(device=query.device, dtype=torch.int64).contiguous()
    if mask is not None:
        mask = mask.to(query.device).contiguous()
    bias_t = bias if bias is not None else query.new_zeros(query.shape[-1])

    query3 = query.unsqueeze(1) if single_step else query
    function = attention_function(tk.additive_attention_fwd, tk.additive_attention_bwd)
    context, weights, _ = function.apply(
        query3, keys, values, v, bias_t, lengths, mask, return_weights
    )
    if single_step:
        context = context.squeeze(1)
        weights = weights.squeeze(1) if return_weights else weights
    return context, (weights if return_weights else None)


BACKENDS = {"cpp": additive_attention, "triton": triton_attention}


def backend_params(dtypes_cpp=(torch.float32, torch.float64), dtypes_triton=(torch.float32,)):
    """pytest params (backend name, dtype) with the right marks and readable ids."""
    params = []
    for dtype in dtypes_cpp:
        params.append(pytest.param("cpp", dtype, marks=requires_cpp, id=f"cpp-{_short(dtype)}"))
    for dtype in dtypes_triton:
        params.append(
            pytest.param("triton", dtype, marks=pytest.mark.triton, id=f"triton-{_short(dtype)}")
        )
    return params


def _short(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, "bf16")


def device_for(backend: str) -> str:
    return triton_device() if backend == "triton" else "cpu"


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / (1 + max|expected|), in float64; 0 for empty tensors."""
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).abs().max() / (1.0 + expected.abs().max())).item()


def fp32_tolerance(v: torch.Tensor) -> float:
    """1e-5 plus a few times the score error bound sum|v| * TANH_BOUND (see tests/ops/test_ops.py)."""
    return 1e-5 + 4 * TANH_BOUND * float(v.detach().double().abs().sum())


def tolerance(dtype: torch.dtype, v: torch.Tensor) -> float:
    return 1e-10 if dtype == torch.float64 else fp32_tolerance(v)


def forward_backward(
    fn,
    inputs,
    *,
    lengths=None,
    mask=None,
    grad_context=None,
    grad_weights=None,
    dtype=None,
    return_weights=True,
):
    """(context, weights, grads) of sum(ctx*gc) + sum(w*gw); inputs cast to dtype when given.

    gc and gw default to fixed pseudo-random tensors (seed 0), the same for every backend.
    """
    leaves = []
    for t in inputs:
        if t is None:
            leaves.append(None)
            continue
        t = t.detach()
        leaves.append((t.to(dtype) if dtype is not None else t.clone()).requires_grad_(True))
    context, weights = fn(*leaves, lengths=lengths, mask=mask, return_weights=return_weights)
    gen = torch.Generator().manual_seed(0)
    if grad_context is None:
        grad_context = torch.randn(context.shape, generator=gen, dtype=torch.float64)
    loss = (context * grad_context.to(context)).sum()
    if weights is not None:
        if grad_weights is None:
            grad_weights = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
        loss = loss + (weights * grad_weights.to(weights)).sum()
    wanted = [leaf for leaf in leaves if leaf is not None]
    grads = iter(torch.autograd.grad(loss, wanted))
    out_grads = [None if leaf is None else next(grads) for leaf in leaves]
    return context.detach(), (None if weights is None else weights.detach()), out_grads
