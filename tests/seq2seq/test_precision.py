"""The bf16 training step's dtype plan (seq2seq_fast/seq2seq/precision.py): weights cast once per
step, not once per decoder step; the model's parameters and state_dict keys unchanged."""

from __future__ import annotations

import pytest
import torch

import seq2seq_fast
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig
from seq2seq_fast.seq2seq.precision import cast_once, conversion_profile

BF16 = torch.bfloat16


def test_cast_once_only_under_autocast_and_differentiable():
    weight = torch.randn(6, 4, requires_grad=True)
    derived = torch.cat([weight, weight])
    assert cast_once(derived) is derived and cast_once(None) is None
    with torch.autocast("cpu", dtype=BF16):
        cast = cast_once(derived)
        assert cast.dtype == BF16 and cast_once(cast) is cast
        assert cast_once(torch.arange(3)).dtype == torch.int64
    cast.float().sum().backward()
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, torch.full_like(weight, 2.0))


def test_conversion_profile_counts_the_casts_and_their_bytes():
    x = torch.randn(64, 32)

    def step():
        return x.to(BF16).float().sum() + x.sum()

    profile = conversion_profile(step)
    assert profile["casts"] == 2
    assert profile["cast_bytes"] == 2 * x.numel() * (4 + 2)
    assert 0 < profile["cast_share"] <= profile["copy_share"] <= 1
    assert profile["step_ms"] > 0


def _bf16_step(decoder: str, tgt_len: int):
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=13,
        tgt_vocab_size=11,
        embed_size=16,
        hidden_size=16,
        decoder=decoder,
        backend="fused",
    )
    model = Seq2Seq(config).train()
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, 13, (3, 6), generator=gen)
    tgt_in, tgt_out = (torch.randint(4, 11, (3, tgt_len), generator=gen) for _ in range(2))
    lengths = torch.tensor([6, 4, 5])

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            loss = model(src, lengths, tgt_in, tgt_out)[0]
        loss.backward()

    return model, step


@pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)
@pytest.mark.parametrize("decoder", ["bahdanau", "gnmt"])
def test_bf16_step_casts_do_not_grow_with_the_target_length(decoder):
    """Weights are cast once per step: four more decoder steps add no per-step cast (a weight
    cast at each decoder step, and its gradient cast back, would add at least eight; a changed
    shape may move an activation cast or two)."""
    counts = []
    for tgt_len in (4, 8):
        _, step = _bf16_step(decoder, tgt_len)
        step()
        counts.append(conversion_profile(step)["casts"])
    assert counts[1] - counts[0] < 4, counts


def test_bf16_step_keeps_float32_parameters_and_state_dict_keys():
    model, step = _bf16_step("bahdanau", 4)
    keys = {name: p.dtype for name, p in model.state_dict().items()}
    step()
    assert {name: p.dtype for name, p in model.state_dict().items()} == keys
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
