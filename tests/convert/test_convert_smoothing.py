"""The converter's general path on location-aware attention normalised by "smoothing"
(sigmoid(e) / sum sigmoid(e), as Tacotron-style TTS and LAS-style ASR do): converted at its first
call to the fused op with normalize="sigmoid", exact afterwards (float64; float32 close), and
look-alikes of the normalisation left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights
from seq2seq_fast.ops import fused_available
from tests.convert.test_convert_traced import _assert_close, _run

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

ENC, DEC, ATT, CHANNELS, KERNEL = 6, 5, 8, 3, 2


class _AttLoc(nn.Module):
    """An AttLoc-style step (ESPnet layout re-created): a 2-D location convolution over the
    previous weights, a dense layer, a score vector; padding filled with -inf. Subclasses
    normalise (each its own forward: the converter traces each forward once).
    forward(enc [B, T, ENC], enc_len [B], dec [B, DEC], prev [B, T]) -> (context [B, ENC],
    weights [B, T])."""

    def __init__(self, score_bias: bool = False) -> None:
        super().__init__()
        self.mlp_enc = nn.Linear(ENC, ATT)
        self.mlp_dec = nn.Linear(DEC, ATT, bias=False)
        self.mlp_att = nn.Linear(CHANNELS, ATT, bias=False)
        self.loc_conv = nn.Conv2d(1, CHANNELS, (1, 2 * KERNEL + 1), padding=(0, KERNEL), bias=False)
        # a bias on the scores: the softmax ignores it, the sigmoid does not (the op's score_bias)
        self.gvec = nn.Linear(ATT, 1, bias=score_bias)

    def energies(self, enc, enc_len, dec, prev):
        batch, frames = enc.shape[:2]
        pre = self.mlp_enc(enc)
        dec_tiled = self.mlp_dec(dec).view(batch, 1, ATT)
        conv = self.loc_conv(prev.view(batch, 1, 1, frames)).squeeze(2).transpose(1, 2)
        e = self.gvec(torch.tanh(self.mlp_att(conv) + pre + dec_tiled)).squeeze(2)
        pad = torch.arange(frames, device=enc.device)[None, :] >= enc_len[:, None]
        return e.masked_fill(pad, -float("inf"))


class Smooth(_AttLoc):
    def forward(self, enc, enc_len, dec, prev):
        s = torch.sigmoid(self.energies(enc, enc_len, dec, prev))
        w = s / s.sum(dim=1, keepdim=True)
        return torch.sum(enc * w.unsqueeze(2), dim=1), w


class SmoothBiased(_AttLoc):
    def __init__(self) -> None:
        super().__init__(score_bias=True)

    def forward(self, enc, enc_len, dec, prev):
        s = torch.sigmoid(self.energies(enc, enc_len, dec, prev))
        w = s / s.sum(dim=1, keepdim=True)
        return torch.sum(enc * w.unsqueeze(2), dim=1), w


class SmoothTwice(_AttLoc):
    """The sigmoid written twice, as TTS code does."""

    def forward(self, enc, enc_len, dec, prev):
        e = self.energies(enc, enc_len, dec, prev)
        w = torch.sigmoid(e) / torch.sigmoid(e).sum(dim=1, keepdim=True)
        return torch.bmm(w.unsqueeze(1), enc).squeeze(1), w


class SigmoidOnly(_AttLoc):
    """Look-alike: no normalisation (a monotonic attention's choice probabilities)."""

    def forward(self, enc, enc_len, dec, prev):
        w = torch.sigmoid(self.energies(enc, enc_len, dec, prev))
        return torch.sum(enc * w.unsqueeze(2), dim=1), w


class SumPlusOne(_AttLoc):
    """Look-alike: another denominator."""

    def forward(self, enc, enc_len, dec, prev):
        s = torch.sigmoid(self.energies(enc, enc_len, dec, prev))
        w = s / (s.sum(dim=1, keepdim=True) + 1.0)
        return torch.sum(enc * w.unsqueeze(2), dim=1), w


class BatchAxis(_AttLoc):
    """Look-alike: normalised over the batch axis."""

    def forward(self, enc, enc_len, dec, prev):
        s = torch.sigmoid(self.energies(enc, enc_len, dec, prev))
        w = s / s.sum(dim=0, keepdim=True)
        return torch.sum(enc * w.unsqueeze(2), dim=1), w


def _inputs(batch, frames, dtype):
    enc = torch.randn(batch, frames, ENC, dtype=dtype)
    enc_len = torch.randint(1, frames + 1, (batch,))
    enc_len[0] = frames
    dec = torch.randn(batch, DEC, dtype=dtype)
    prev = torch.softmax(torch.randn(batch, frames, dtype=dtype), dim=1)
    return enc, enc_len, dec, prev


@pytest.mark.parametrize(
    "layout, converts",
    [
        (Smooth, True),
        (SmoothTwice, True),
        (SmoothBiased, True),
        (SigmoidOnly, False),
        (SumPlusOne, False),
        (BatchAxis, False),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else str(x),
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_smoothing_converted_exactly_look_alikes_left(layout, converts, dtype):
    torch.manual_seed(0)
    original = layout().to(dtype)
    model = copy.deepcopy(original)
    keys = list(model.state_dict())
    report = fuse_attention_report(model)
    torch.manual_seed(1)
    first = _inputs(4, 7, dtype)
    _assert_close(_run(model, first)[0], _run(original, first)[0], dtype, "first call")
    assert list(model.state_dict()) == keys
    converted = [r.path for r in report.replaced]
    if converts:
        assert converted == ["(model)"], str(report)
        assert isinstance(model, FusedStandIn)
    else:
        assert converted == [], str(report)
        assert not isinstance(model, FusedStandIn)
    for batch, frames in ((3, 5), (4, 9)):
        torch.manual_seed(batch * frames)
        args = _inputs(batch, frames, dtype)
        calls = TracedWeights.calls
        got, want = _run(model, args), _run(original, args)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
        if converts:
            assert TracedWeights.calls > calls  # the fused op computed the weights
