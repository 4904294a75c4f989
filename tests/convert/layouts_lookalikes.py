"""More look-alikes for the converter's general path: the parts of additive attention (sum, tanh,
projection, softmax) in math the fused op does not compute. Each must be left alone: converting
one would change what the model computes (the probe would catch it, but a rewrite the probe
refuses is a matcher bug: tests/convert/test_convert_lookalikes.py fails on it too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.convert.layouts_traced import (
    Case,
    ShowAttendRelu,
    _feature_call,
    _wrap,
    lengths_mask,
)


class SigmoidTimesMask(ShowAttendRelu):
    """Independent gates: sigmoid(e) times the mask, never renormalised to sum to one."""

    def forward(self, features, hidden, valid):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        gates = torch.sigmoid(self.full(torch.tanh(pre)).squeeze(2)) * valid
        return (features * gates.unsqueeze(2)).sum(1), gates


class SoftmaxOverBatch(ShowAttendRelu):
    """The softmax over the batch axis: rows mixed with each other."""

    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        alpha = F.softmax(self.full(torch.tanh(pre)).squeeze(2), dim=0)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class TanhOfProduct(ShowAttendRelu):
    """Multiplicative inside the tanh: tanh(W h * U s), not a sum."""

    def forward(self, features, hidden):
        pre = self.encoder_proj(features) * self.decoder_proj(hidden).unsqueeze(1)
        alpha = F.softmax(self.full(torch.tanh(pre)).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class ReluBeforeTanh(ShowAttendRelu):
    """tanh(relu(W h + U s)): the tanh's input is not the sum."""

    def forward(self, features, hidden):
        pre = F.relu(self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1))
        alpha = F.softmax(self.full(torch.tanh(pre)).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class GatedTanh(ShowAttendRelu):
    """Gated attention (multiple-instance learning's): the tanh times a sigmoid gate of its own
    shape, then the score layer: w . (tanh(V h) * sigmoid(U h)), a gate the op has no term for."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(self.encoder_proj.in_features, self.encoder_proj.out_features)

    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        gated = torch.tanh(pre) * torch.sigmoid(self.gate(features))
        alpha = F.softmax(self.full(gated).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


def _masked_feature_call(b, t, dtype):
    features, hidden = _feature_call(b, t, dtype)
    return (features, hidden, lengths_mask(b, t).to(dtype))


LOOKALIKES = [
    Case("sigmoid_times_mask", _wrap(SigmoidTimesMask), _masked_feature_call, None),
    Case("softmax_over_batch", _wrap(SoftmaxOverBatch), _feature_call, None),
    Case("tanh_of_product", _wrap(TanhOfProduct), _feature_call, None),
    Case("relu_before_tanh", _wrap(ReluBeforeTanh), _feature_call, None),
    Case("gated_tanh", _wrap(GatedTanh), _feature_call, None),
]
