"""torch.library.opcheck over every op of the ``seq2seq_fast`` library: schema, fake kernel (shapes
for torch.compile / FakeTensor), autograd registration and AOT dispatch agree with the CPU kernel.

The attention's public ops (additive_attention_fwd / _bwd) have their opcheck cases with every key
mask in tests/ops/test_ops.py; here one case per op, and a check that no op of the library is missed.
"""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from tests.ops.test_ops import key_masks, make_inputs

pytestmark = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)

OPS = torch.ops.seq2seq_fast
# Ops without tensors (opcheck has nothing to check): the ISA name.
NO_TENSORS = {"_cpu_isa"}


def _attention_samples() -> dict[str, tuple]:
    query, keys, values, v, bias = make_inputs(3, 5, 6, 17, 4, torch.float32)
    lengths, _ = key_masks("lengths", 3, 6)
    context, weights, lse = OPS.additive_attention_fwd(
        query, keys, values, v, bias, lengths, None, True
    )
    grad_context = torch.randn_like(context)
    inputs = (query, keys, values, v, bias, lengths, None)
    return {
        "additive_attention_fwd": (*inputs, True),
        "additive_attention_bwd": (grad_context, None, *inputs, context, lse, weights),
        "additive_attention_bwd.score_bias": (
            grad_context,
            None,
            *inputs,
            context,
            lse,
            None,
            "sigmoid",
            torch.tensor(-0.5),
        ),
        "_additive_attention_bwd_accumulate": (
            grad_context,
            torch.randn_like(weights),
            *inputs,
            weights,
            torch.randn_like(keys),
        ),
        "_fast_tanh": (torch.randn(5, 7), torch.randn(5, 7), 1),
    }


def _recurrent_samples() -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    B, T, H = 3, 4, 5
    gx, h0, w_hh, b_hh = randn(B, T, 3 * H), randn(B, H), randn(3 * H, H), randn(3 * H)
    hs, saved = OPS._gru_recurrence_fwd(gx, h0, w_hh, b_hh)
    h = randn(B, H)
    gru_saved = OPS._gru_cell_fwd(randn(B, 3 * H), randn(B, 3 * H), h)[1]
    lstm_saved = OPS._lstm_cell_fwd(randn(B, 4 * H), randn(B, 4 * H), h)[2]
    return {
        "_gru_recurrence_fwd": (gx, h0, w_hh, b_hh),
        "_gru_recurrence_bwd": (randn(B, T, H), h0, hs, saved, w_hh, True),
        "_gru_cell_fwd": (randn(B, 3 * H), randn(B, 3 * H), h),
        "_gru_cell_bwd": (randn(B, H), gru_saved, h),
        "_lstm_cell_fwd": (randn(B, 4 * H), randn(B, 4 * H), h),
        "_lstm_cell_bwd": (randn(B, H), randn(B, H), lstm_saved, h),
    }


def _location_samples() -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(1)
    features, weight = torch.randn(3, 2, 9, generator=gen), torch.randn(4, 2, 5, generator=gen)
    grad = torch.randn(27, 4, generator=gen)
    query, projected, values, v, bias = make_inputs(3, 1, 9, 16, 5, torch.float32)
    lengths, _ = key_masks("lengths", 3, 9)
    conv, dense = torch.randn(27, 4, generator=gen), torch.randn(16, 4, generator=gen)
    inputs = (query, projected, conv, dense, values, v, bias, lengths, None)
    context, weights = OPS._location_attention_fwd(*inputs)
    return {
        "_location_conv_fwd": (features, weight),
        "_location_conv_bwd": (grad, features, weight, True, False),
        "_location_attention_fwd": inputs,
        "_location_attention_bwd": (
            torch.randn_like(context),
            torch.randn_like(weights),
            *inputs,
            weights,
            torch.randn_like(projected),
        ),
        "_location_attention_bwd.score_bias": (
            torch.randn_like(context),
            torch.randn_like(weights),
            *inputs,
            weights,
            torch.randn_like(projected),
            "sigmoid",
            torch.tensor(0.3),
        ),
    }


def _search_samples() -> dict[str, tuple]:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    return {"_topk_rows": (logits, 10), "_log_softmax_topk": (logits, 10, 0)}


SAMPLES = {
    **_attention_samples(),
    **_recurrent_samples(),
    **_location_samples(),
    **_search_samples(),
}


def test_every_op_of_the_library_is_covered():
    names = {
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("seq2seq_fast::")
    }
    assert names - NO_TENSORS - set(SAMPLES) == set(), "ops without an opcheck case here"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name):
    packet, _, overload = name.partition(".")  # name.overload: an overload, not the default
    op = getattr(getattr(OPS, packet), overload or "default")
    args = SAMPLES[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("batch", [3, 0])
def test_opcheck_backward_of_time_major_views(batch):
    """Keys and values that are views of time-major tensors, and an empty batch: the backward's
    gradients are contiguous in the kernel and the fake kernel alike."""
    query, keys, values, v, bias = make_inputs(batch, 2, 6, 8, 4, torch.float32)
    keys, values = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (keys, values))
    assert not keys.is_contiguous() or batch == 0
    context, weights, lse = OPS.additive_attention_fwd(
        query, keys, values, v, bias, None, None, True
    )
    args = (torch.randn_like(context), None, query, keys, values, v, bias, None, None)
    torch.library.opcheck(OPS.additive_attention_bwd.default, (*args, context, lse, weights))
    grads = OPS.additive_attention_bwd(*args, context, lse, weights)
    assert all(g.is_contiguous() for g in grads)


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16], ids=["f32-acc", "bf16-acc"])
def test_opcheck_location_step_in_bf16(acc_dtype):
    """The location-aware step ops on bfloat16 tensors (grad_projected float32 or bfloat16)."""
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    query, projected, values, v, bias = (
        t.to(bf16) for t in make_inputs(3, 1, 9, 16, 5, torch.float32)
    )
    lengths, _ = key_masks("lengths", 3, 9)
    conv = torch.randn(27, 4, generator=gen).to(bf16)
    dense = torch.randn(16, 4, generator=gen).to(bf16)
    inputs = (query, projected, conv, dense, values, v, bias, lengths, None)
    context, weights = OPS._location_attention_fwd(*inputs)
    torch.library.opcheck(OPS._location_attention_fwd.default, inputs)
    grads = (torch.randn_like(context), torch.randn_like(weights))
    acc = torch.randn(projected.shape, generator=gen).to(acc_dtype)
    args = (*grads, *inputs, weights, acc)
    torch.library.opcheck(OPS._location_attention_bwd.default, args)
