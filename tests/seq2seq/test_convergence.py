"""Convergence: a small Seq2Seq trained with the fused kernels and on plain PyTorch, same batches.

The unit tests compare one call at a time; a training run compares thousands, at whatever
magnitudes the weights grow into. Here the attention's key and query projections are scaled up
so that |keys| reaches ~30 and the pre-activation q + k + b sweeps through the band where the
CPU kernels once returned NaN (44..80, CHANGELOG 0.2.0): the losses of both runs must agree at
every step. The run records the largest |q + k + b| it saw and asserts that it covered that band,
so the test cannot pass by never reaching it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor

from seq2seq_fast.ops import fused_available
from seq2seq_fast.seq2seq.canary import PreactivationRecorder, plain_pytorch
from seq2seq_fast.seq2seq.models import BOS_ID, EOS_ID, PAD_ID, Seq2Seq, Seq2SeqConfig

pytestmark = pytest.mark.skipif(
    not fused_available(torch.device("cpu"), torch.float32),
    reason="the CPU extension _C is not built",
)

VOCAB = 12
STEPS = 300
BATCH = 16


def _batches(steps: int, seed: int = 0):
    """Reversal batches of random lengths (padding included): (src, lengths, tgt_in, tgt_out)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(3, 11, (BATCH,), generator=g)
        width = int(lengths.max())
        src = torch.randint(4, VOCAB, (BATCH, width), generator=g)
        src[torch.arange(width)[None, :] >= lengths[:, None]] = PAD_ID
        tgt_out = torch.full((BATCH, width + 1), PAD_ID)
        for i, n in enumerate(lengths.tolist()):
            tgt_out[i, :n] = src[i, :n].flip(0)
            tgt_out[i, n] = EOS_ID
        tgt_in = torch.cat([torch.full((BATCH, 1), BOS_ID), tgt_out[:, :-1]], 1)
        tgt_in[tgt_in == EOS_ID] = PAD_ID
        out.append((src, lengths, tgt_in, tgt_out))
    return out


def _model(decoder: str, cell: str, scale: float) -> Seq2Seq:
    """A small model whose attention projections are ``scale`` times their initial size."""
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        embed_size=16,
        hidden_size=32,
        attention_size=24,
        decoder=decoder,
        cell=cell,
        backend="fused",
    )
    model = Seq2Seq(config)
    with torch.no_grad():
        model.attention.key_proj.weight.mul_(scale)
        model.attention.query_proj.weight.mul_(scale)
    return model


def _loss_and_grads(model: Seq2Seq, batch, *, plain: bool) -> tuple[Tensor, list[Tensor]]:
    context = plain_pytorch(model) if plain else contextlib.nullcontext()
    with context:
        loss, _ = model(*batch)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads


def _train(model: Seq2Seq, batches, *, plain: bool) -> tuple[Tensor, float]:
    """Adam on ``batches``; -> (the loss of every step, the largest |q + k + b| seen)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    with PreactivationRecorder(model) as recorder:
        for batch in batches:
            loss, grads = _loss_and_grads(model, batch, plain=plain)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            optimizer.step()
            losses.append(loss)
    return torch.stack(losses), recorder.max_pre


CASES = [("gnmt", "gru"), ("bahdanau", "lstm")]


@pytest.mark.parametrize("decoder,cell", CASES)
def test_fused_and_plain_pytorch_runs_give_the_same_losses(decoder, cell):
    """Two runs from one initialisation on the same batches: the fused one and a plain-PyTorch one
    (reference attention, PyTorch's GRU/LSTM). Scale 25: |keys| ~30, q + k + b up to ~64."""
    batches = _batches(STEPS)
    fused, fused_pre = _train(_model(decoder, cell, 25.0), batches, plain=False)
    plain, plain_pre = _train(_model(decoder, cell, 25.0), batches, plain=True)
    assert torch.isfinite(fused).all(), f"fused run: non-finite loss at steps {_bad(fused)}"
    assert torch.isfinite(plain).all(), f"plain run: non-finite loss at steps {_bad(plain)}"
    assert fused_pre > 55 and plain_pre > 55, (fused_pre, plain_pre)  # inside the old NaN band
    assert fused[-20:].mean() < 0.6 * fused[:20].mean()  # it learned: not two flat lines
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decoder,cell", CASES)
def test_fused_matches_plain_pytorch_at_every_step_of_a_saturated_run(decoder, cell):
    """Scale 40 drives q + k + b to ~100, through the whole band where the kernels switch
    paths. Two separate runs there drift apart after ~100 steps from rounding alone (tanh is
    saturated, Adam amplifies tiny differences), so the fused run is checked in lockstep: at
    every step, the plain-PyTorch loss and gradients at the same weights and batch."""
    model = _model(decoder, cell, 40.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    names = [name for name, _ in model.named_parameters()]
    with PreactivationRecorder(model) as recorder:
        for step, batch in enumerate(_batches(STEPS // 2, seed=1)):
            loss, grads = _loss_and_grads(model, batch, plain=False)
            ref_loss, ref_grads = _loss_and_grads(model, batch, plain=True)
            assert torch.isfinite(loss), f"step {step}: fused loss {float(loss)}"
            torch.testing.assert_close(
                loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: loss: {m}"
            )
            for name, g, r in zip(names, grads, ref_grads, strict=True):
                error = float((g - r).norm() / r.norm().clamp_min(1e-12))
                assert error < 1e-4, f"step {step}: grad of {name}: relative error {error:.2e}"
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            optimizer.step()
    assert recorder.max_pre > 85, recorder.max_pre  # past the old NaN band (44..80)


def _bad(losses: Tensor) -> list[int]:
    return (~torch.isfinite(losses)).nonzero().flatten().tolist()[:10]
