"""The location-aware attention's ops (ops/location_attention.py): the location convolution
against conv1d, the one-step ops against the reference on materialised keys, and their errors.
Their use by the converter's stand-ins is tested in tests/convert/test_convert_speech.py."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from seq2seq_fast.ops import fused_available

requires_cpu_kernel = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)


def _rand(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype)


# --- the location convolution ---------------------------------------------------------------------


@requires_cpu_kernel
@pytest.mark.parametrize("isa", ["default", "portable"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "batch,channels,frames,filters,width",
    [
        (3, 1, 9, 16, 15),  # frames shorter than the kernel
        (2, 2, 40, 32, 31),  # Tacotron 2's previous + cumulative weights
        (4, 1, 37, 10, 201),  # ESPnet AttLoc's defaults: 10 filters, 201 taps
        (1, 3, 16, 7, 1),  # a 1-tap kernel, odd channel and filter counts
    ],
)
def test_location_convolution_equals_conv1d(
    monkeypatch, isa, dtype, batch, channels, frames, filters, width
):
    """The location convolution (the extension's kernel, and the window products it replaced) and
    both its gradients equal conv1d's with padding K // 2."""
    from seq2seq_fast.ops.location_attention import _KernelConv, _WindowConv

    if isa != "default":
        monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    gen = torch.Generator().manual_seed(batch * frames + width)
    features = _rand(gen, dtype, batch, channels, frames).requires_grad_()
    weight = _rand(gen, dtype, filters, channels, width).requires_grad_()
    grad = _rand(gen, dtype, batch * frames, filters)
    expected_out = nn.functional.conv1d(features, weight, padding=width // 2)
    expected_out = expected_out.transpose(1, 2).reshape(-1, filters)
    expected = [expected_out, *torch.autograd.grad(expected_out, (features, weight), grad)]
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    for conv in (_KernelConv, _WindowConv):
        out = conv.apply(features, weight)
        got = [out, *torch.autograd.grad(out, (features, weight), grad)]
        for a, b in zip(expected, got, strict=True):
            torch.testing.assert_close(b, a, **tol)


@requires_cpu_kernel
def test_location_convolution_gradients_asked_for_only():
    """A gradient that autograd does not ask for is not formed: the weight's alone, and the
    features' alone, each equal to conv1d's."""
    from seq2seq_fast.ops.location_attention import location_columns

    gen = torch.Generator().manual_seed(3)
    features, weight = _rand(gen, torch.float64, 2, 1, 12), _rand(gen, torch.float64, 4, 1, 5)
    grad = _rand(gen, torch.float64, 24, 4)
    for leaf in (features, weight):
        leaf = leaf.clone().requires_grad_()
        args = (leaf, weight) if leaf.shape == features.shape else (features, leaf)
        (got,) = torch.autograd.grad(location_columns(*args), leaf, grad)
        out = nn.functional.conv1d(*args, padding=2).transpose(1, 2).reshape(-1, 4)
        (expected,) = torch.autograd.grad(out, leaf, grad)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


@requires_cpu_kernel
def test_location_convolution_refuses_bad_input_by_name():
    ops = torch.ops.seq2seq_fast
    with pytest.raises(RuntimeError, match="kernel width must be odd, got 4"):
        ops._location_conv_fwd(torch.randn(2, 1, 8), torch.randn(3, 1, 4))
    with pytest.raises(RuntimeError, match=r"weight \[3, 2, 5\] does not match features"):
        ops._location_conv_fwd(torch.randn(2, 1, 8), torch.randn(3, 2, 5))
    with pytest.raises(RuntimeError, match=r"grad must be \[B\*T, C\]=\[16, 3\]"):
        ops._location_conv_bwd(
            torch.randn(16, 4), torch.randn(2, 1, 8), torch.randn(3, 1, 5), True, True
        )


@requires_cpu_kernel
@pytest.mark.parametrize("filters", [6, 8])  # conv's gradient by dots / by a product over W's rows
@pytest.mark.parametrize("hidden", [24, 32])  # rows padded / not
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_location_step_ops_equal_the_reference(dtype, kind, threads, filters, hidden):
    """The location-aware step's ops (keys P + conv W^T formed inside the kernels) against the
    reference on materialised keys: context, weights, and every gradient (grad_weights given,
    rows with no valid key, P's gradient added into what the accumulator held)."""
    from seq2seq_fast.ops.reference import additive_attention_ref
    from tests.ops.test_ops import key_masks, make_inputs

    ops = torch.ops.seq2seq_fast
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        query, projected, values, v, bias = make_inputs(5, 1, 11, hidden, 7, dtype, seed=3)
        lengths, mask = key_masks(kind, 5, 11)
        gen = torch.Generator().manual_seed(4)
        conv = _rand(gen, dtype, 5 * 11, filters)
        dense = _rand(gen, dtype, hidden, filters) * 0.3
        leaves = [
            t.clone().requires_grad_() for t in (query, projected, conv, dense, values, v, bias)
        ]
        q, p, c, w, val, vv, b = leaves
        keys = p + (c @ w.t()).view_as(p)
        ref_ctx, ref_w = additive_attention_ref(q, keys, val, vv, b, lengths=lengths, mask=mask)
        grad_ctx, grad_w = _rand(gen, dtype, 5, 1, 7), _rand(gen, dtype, 5, 1, 11)
        expected = torch.autograd.grad((ref_ctx, ref_w), leaves, (grad_ctx, grad_w))

        inputs = (query, projected, conv, dense, values, v, bias, lengths, mask)
        context, weights = ops._location_attention_fwd(*inputs)
        held = _rand(gen, dtype, 5, 11, hidden)
        acc = held.clone()
        dq, dconv, ddense, dv, dbias = ops._location_attention_bwd(
            grad_ctx, grad_w, *inputs, weights, acc
        )
        tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
        torch.testing.assert_close(context, ref_ctx, **tol)
        torch.testing.assert_close(weights, ref_w, **tol)
        got = {"query": dq, "projected": acc - held, "conv": dconv, "dense": ddense, "v": dv}
        got["bias"] = dbias
        names = ["query", "projected", "conv", "dense", "values", "v", "bias"]
        for name, exp in zip(names, expected, strict=True):
            if name != "values":  # formed by the caller, once for all steps
                torch.testing.assert_close(got[name], exp, **tol, msg=name)
    finally:
        torch.set_num_threads(before)


@requires_cpu_kernel
def test_location_step_ops_refuse_bad_input_by_name():
    ops = torch.ops.seq2seq_fast
    q, p, val = torch.randn(2, 1, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 3)
    v, b = torch.randn(8), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"conv must be \[B\*Tk, C\]=\[10, 4\], got \[9, 4\]"):
        ops._location_attention_fwd(
            q, p, torch.randn(9, 4), torch.randn(8, 4), val, v, b, None, None
        )
    with pytest.raises(RuntimeError, match=r"weight must be \[H=8, C\], got \[7, 4\]"):
        ops._location_attention_fwd(
            q, p, torch.randn(10, 4), torch.randn(7, 4), val, v, b, None, None
        )
    with pytest.raises(RuntimeError, match="one query per batch row"):
        ops._location_attention_fwd(
            torch.randn(2, 2, 8), p, torch.randn(10, 4), torch.randn(8, 4), val, v, b, None, None
        )
