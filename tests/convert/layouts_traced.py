"""Additive attentions no named layout knows, for the converter's general path (``nn/convert/traced/``).

Each is written for the tests from the math of a kind of public attention code (the project it
follows is named in a word; names, argument orders and return conventions are our own), and each
comes with look-alikes that differ in the math and must be left alone. ``CASES`` lists them:
(name, factory of the model to convert (a parent holding the attention where the pattern spans
a module and its caller), factory of a call's inputs (batch, frames, dtype), the dotted path the
general path must convert, or None for a look-alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Q, K, A = 5, 6, 4  # query width, memory width, attention width


def lengths_mask(batch: int, frames: int) -> torch.Tensor:
    """bool [B, T], True = a real frame; the first row full, one row with a single frame."""
    lengths = torch.tensor([frames, max(1, frames - 2), 1, frames - 1][:batch])
    return torch.arange(frames) < lengths.unsqueeze(1)


# --- 1. a code-summarisation model's concat attention: hidden repeated, one Linear over the join --


class JoinScorer(nn.Module):
    """score(dec [B, Q], memory [B, T, K]) -> weights [B, T]; Linear over [dec; memory], v Linear."""

    def __init__(self, squash=torch.tanh) -> None:
        super().__init__()
        self.joint = nn.Linear(Q + K, A)
        self.to_score = nn.Linear(A, 1, bias=False)
        self.squash = squash

    def forward(self, dec, memory):
        frames = memory.shape[1]
        tiled = dec.unsqueeze(1).repeat(1, frames, 1)
        hidden = self.squash(self.joint(torch.cat((tiled, memory), dim=2)))
        return F.softmax(self.to_score(hidden).squeeze(2), dim=1)


# --- 2. a chatbot's time-major concat over [T, B, K], softmax over dim 0, context by bmm ------------


class TimeMajorJoin(nn.Module):
    """forward(memory [T, B, K], state [1, B, Q]) -> (context [1, B, K], weights [T, B, 1])."""

    def __init__(self) -> None:
        super().__init__()
        self.fuse = nn.Linear(K + Q, A)
        self.score = nn.Linear(A, 1, bias=False)

    def forward(self, memory, state):
        state = state.repeat(memory.size(0), 1, 1)
        energy = torch.tanh(self.fuse(torch.cat((memory, state), dim=2)))
        weights = torch.softmax(self.score(energy), dim=0)
        context = weights.transpose(0, 1).transpose(1, 2).bmm(memory.transpose(0, 1))
        return context.transpose(0, 1), weights


# --- 3. a TTS vocoder-style attention: memory projected outside, query projected inside ----------


class PreProjected(nn.Module):
    """forward(memory_proj [B, T, A], query [B, Q], step) -> weights [B, 1, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Linear(Q, A, bias=False)
        self.v = nn.Linear(A, 1, bias=False)

    def forward(self, memory_proj, query, step):
        u = self.v(torch.tanh(memory_proj + self.W(query).unsqueeze(1)))
        return F.softmax(u, dim=1).transpose(1, 2)


class PreProjectedHolder(nn.Module):
    """The caller: projects the memory once and calls the attention."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_proj = nn.Linear(K, A)
        self.attention = PreProjected()

    def forward(self, memory, query):
        weights = self.attention(self.memory_proj(memory), query, 0)
        return torch.bmm(weights, memory).squeeze(1)


# --- 4. a pointer network with a bias Parameter inside the tanh and a padding mask ----------------


class Pointer(nn.Module):
    """forward(encoded [B, T, K], decoded [B, Q], pad [B, T] True = padding) -> (logits' softmax
    [B, T], pointed [B, K])."""

    def __init__(self, fill: float = -1e9) -> None:
        super().__init__()
        self.enc_w = nn.Linear(K, A, bias=False)
        self.dec_w = nn.Linear(Q, A, bias=False)
        self.b = nn.Parameter(torch.randn(A) * 0.1)
        self.v = nn.Linear(A, 1, bias=False)
        self.fill = fill

    def forward(self, encoded, decoded, pad):
        e = self.v(torch.tanh(self.enc_w(encoded) + self.dec_w(decoded).unsqueeze(1) + self.b))
        e = e.squeeze(-1).masked_fill(pad, self.fill)
        probs = torch.softmax(e, dim=-1)
        return probs, (probs.unsqueeze(-1) * encoded).sum(1)


# --- 5. the energy in one module, mask / softmax / context in an RNN-cell wrapper ----------------


class EnergyOnly(nn.Module):
    """energy(memory [B, T, K], h [B, Q]) -> [B, T] (no normalisation here)."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = nn.Linear(K, A)
        self.qry = nn.Linear(Q, A, bias=False)
        self.vec = nn.Parameter(torch.randn(A) / math.sqrt(A))

    def forward(self, memory, h):
        return torch.tanh(self.mem(memory) + self.qry(h)[:, None, :]) @ self.vec


class AttentiveCell(nn.Module):
    """step(x [B, Q], state [B, Q], memory [B, T, K], valid [B, T]) -> (new state, weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = EnergyOnly()
        self.cell = nn.GRUCell(Q + K, Q)

    def forward(self, x, state, memory, valid):
        scores = self.energy(memory, state)
        scores = scores.masked_fill(valid.logical_not(), float("-inf"))
        alpha = scores.softmax(-1)
        context = torch.einsum("bt,btk->bk", alpha, memory)
        return self.cell(torch.cat([x, context], -1), state), alpha


# --- 6. temperature dividing the energies (a buffer), kwargs-only mask --------------------------


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keys_in = nn.Linear(K, A)
        self.query_in = nn.Linear(Q, A)
        self.out = nn.Linear(A, 1)
        self.register_buffer("temperature", torch.tensor(2.5))

    def forward(self, query, *, memory, valid=None):
        energy = self.out(torch.tanh(self.keys_in(memory) + self.query_in(query).unsqueeze(-2)))
        energy = energy.squeeze(-1) / self.temperature
        if valid is not None:
            energy = energy.masked_fill(~valid, -1e30)
        weights = torch.softmax(energy, dim=-1)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


# --- 7. Linear layers wrapped in a small module (``.linear``), several queries at once -----------


class Affine(nn.Module):
    def __init__(self, n_in, n_out, bias=True) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=bias)

    def forward(self, x):
        return self.linear(x)


class WrappedMulti(nn.Module):
    """forward(queries [B, Tq, Q], memory [B, T, K], valid [B, T]) -> (context [B, Tq, K],
    weights [B, Tq, T])."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_q = Affine(Q, A, bias=False)
        self.proj_m = Affine(K, A)
        self.score = Affine(A, 1, bias=False)

    def forward(self, queries, memory, valid):
        pre = self.proj_q(queries).unsqueeze(2) + self.proj_m(memory).unsqueeze(1)
        e = self.score(torch.tanh(pre)).squeeze(-1)
        e = e.masked_fill(~valid.unsqueeze(1), -1e9)
        w = F.softmax(e, dim=-1)
        return w @ memory, w


# --- 8. time-major memory with an additive float mask, context summed by products ---------------


class TimeMajorFloatMask(nn.Module):
    """forward(state [B, Q], memory [T, B, K], additive [T, B] (0 or -1e4 and below)) ->
    (context [B, K], weights [T, B])."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Linear(Q, A)
        self.m = nn.Linear(K, A, bias=False)
        self.e = nn.Linear(A, 1)

    def forward(self, state, memory, additive):
        energies = self.e(torch.tanh(self.s(state) + self.m(memory))).squeeze(2)
        weights = F.softmax(energies + additive, dim=0)
        return (weights.unsqueeze(2) * memory).sum(0), weights


# --- 9. residual context + query after the attention, weight-normalised score vector -------------


class ResidualNormed(nn.Module):
    """forward(query [B, A], memory [B, T, A], lengths [B]) -> query + context [B, A]; the score
    vector g * w / ||w|| (TensorFlow's normalised Bahdanau)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(A, A, bias=False)
        self.wk = nn.Linear(A, A, bias=False)
        self.w = nn.Parameter(torch.randn(A) / math.sqrt(A))
        self.g = nn.Parameter(torch.tensor(1 / math.sqrt(A)))
        self.inner_bias = nn.Parameter(torch.zeros(A) + 0.05)

    def forward(self, query, memory, lengths):
        v = self.g * self.w / self.w.norm()
        energy = (torch.tanh(self.wq(query)[:, None] + self.wk(memory) + self.inner_bias) * v).sum(
            -1
        )
        pad = torch.arange(memory.shape[1], device=memory.device)[None, :] >= lengths[:, None]
        energy = energy.masked_fill(pad, float("-inf"))
        weights = torch.softmax(energy, dim=1)
        return query + torch.bmm(weights.unsqueeze(1), memory).squeeze(1)


# --- 10. location-sensitive (Tacotron-style block: conv without bias, dense; memory projected) ----


class LocationBlock(nn.Module):
    def __init__(self, filters=3, width=5) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, filters, width, padding=width // 2, bias=False)
        self.projection = nn.Linear(filters, A, bias=False)

    def forward(self, previous):
        return self.projection(self.conv(previous).transpose(1, 2))


class LocationSensitive(nn.Module):
    """forward(state [B, Q], memory [B, T, K], memory_proj [B, T, A], previous [B, 2, T],
    pad [B, T] True = padding) -> (context [B, K], weights [B, T])."""

    def __init__(self) -> None:
        super().__init__()
        self.query_layer = nn.Linear(Q, A, bias=False)
        self.v = nn.Linear(A, 1)
        self.location = LocationBlock()

    def forward(self, state, memory, memory_proj, previous, pad):
        processed = self.query_layer(state.unsqueeze(1))
        energies = self.v(torch.tanh(processed + self.location(previous) + memory_proj))
        energies = energies.squeeze(-1).masked_fill(pad, -float("inf"))
        weights = F.softmax(energies, dim=1)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


class LocationHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.memory_layer = nn.Linear(K, A, bias=False)
        self.attention = LocationSensitive()

    def forward(self, state, memory, previous, pad):
        return self.attention(state, memory, self.memory_layer(memory), previous, pad)


# --- 11. LAS-style location-aware: a conv with bias feeding the tanh directly (no dense) ----------


class ConvLocation(nn.Module):
    """forward(memory [B, T, K], dec [B, Q], last [B, T]) -> (context [B, K], weights [B, T])."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Conv1d(1, A, 3, padding=1)
        self.enc = nn.Linear(K, A)
        self.dec = nn.Linear(Q, A, bias=False)
        self.w = nn.Linear(A, 1, bias=False)

    def forward(self, memory, dec, last):
        location = self.loc(last.unsqueeze(1)).transpose(1, 2)
        scores = self.w(torch.tanh(self.enc(memory) + self.dec(dec).unsqueeze(1) + location))
        weights = torch.softmax(scores.squeeze(-1), -1)
        return torch.sum(weights.unsqueeze(-1) * memory, dim=1), weights


# --- look-alikes: the same parts, other math --------------------------------------------------------


class ShowAttendRelu(nn.Module):
    """Image captioning's attention: relu of the sum (not tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_proj = nn.Linear(K, A)
        self.decoder_proj = nn.Linear(Q, A)
        self.full = nn.Linear(A, 1)

    def forward(self, features, hidden):
        att = self.full(
            F.relu(self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1))
        )
        alpha = F.softmax(att.squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class SigmoidGate(ShowAttendRelu):
    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        alpha = F.softmax(self.full(torch.sigmoid(pre)).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class TanhOfOne(ShowAttendRelu):
    """The tanh over the memory alone; the query added after it."""

    def forward(self, features, hidden):
        pre = torch.tanh(self.encoder_proj(features)) + self.decoder_proj(hidden).unsqueeze(1)
        alpha = F.softmax(self.full(pre).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class TemperatureInside(ShowAttendRelu):
    def forward(self, features, hidden):
        pre = (self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)) / 3.0
        alpha = F.softmax(self.full(torch.tanh(pre)).squeeze(2), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class PaddingByZero(Pointer):
    """Padding filled with 0 (it keeps a share of the weight)."""

    def __init__(self) -> None:
        super().__init__(fill=0.0)


class ExplorationTanh(ShowAttendRelu):
    """A pointer network's "tanh exploration": C * tanh(u) before the softmax."""

    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        u = self.full(torch.tanh(pre)).squeeze(2)
        alpha = F.softmax(10.0 * torch.tanh(u), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class LogSoftmaxScores(ShowAttendRelu):
    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        return F.log_softmax(self.full(torch.tanh(pre)).squeeze(2), dim=1)


class NoVector(ShowAttendRelu):
    """The tanh summed over the hidden axis: no projection vector."""

    def forward(self, features, hidden):
        pre = self.encoder_proj(features) + self.decoder_proj(hidden).unsqueeze(1)
        alpha = F.softmax(torch.tanh(pre).sum(-1), dim=1)
        return (features * alpha.unsqueeze(2)).sum(1), alpha


class MaskPerQuery(WrappedMulti):
    """A mask that differs between the queries (causal-like): not the op's [B, T] mask."""

    def forward(self, queries, memory, valid):
        pre = self.proj_q(queries).unsqueeze(2) + self.proj_m(memory).unsqueeze(1)
        e = self.score(torch.tanh(pre)).squeeze(-1)
        steps = torch.arange(queries.shape[1])[:, None] < torch.arange(memory.shape[1])[None, :]
        e = e.masked_fill(steps.unsqueeze(0), -1e9)
        w = F.softmax(e, dim=-1)
        return w @ memory, w


# --- the cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]  # the model handed to fuse_attention
    inputs: Callable[[int, int, torch.dtype], tuple]  # (batch, frames, dtype) -> args
    converts: str | None  # the path converted; None: a look-alike left alone
    converts_in: tuple | None = None  # the dtypes it converts in (None: every one)

    def converts_at(self, dtype: torch.dtype) -> str | None:
        """The path converted in ``dtype``, or None where it is left alone."""
        return self.converts if self.converts_in is None or dtype in self.converts_in else None


def _rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


class _Holder(nn.Module):
    """A parent that passes its call on (the attention is converted as a submodule)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.att = attention

    def forward(self, *args):
        return self.att(*args)


def _wrap(cls) -> Callable[[], nn.Module]:
    return lambda: _Holder(cls())


def _feature_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), _rand(b, Q, dtype=dtype))


def _pointer_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), _rand(b, Q, dtype=dtype), ~lengths_mask(b, t))


def _multi_call(b, t, dtype):
    return (_rand(b, 3, Q, dtype=dtype), _rand(b, t, K, dtype=dtype), lengths_mask(b, t))


def _float_mask_call(b, t, dtype):
    additive = torch.zeros(t, b, dtype=dtype).masked_fill(~lengths_mask(b, t).t(), -1e4)
    return (_rand(b, Q, dtype=dtype), _rand(t, b, K, dtype=dtype), additive)


def _location_call(b, t, dtype):
    previous = torch.softmax(_rand(b, 2, t, dtype=dtype), -1)
    return (_rand(b, Q, dtype=dtype), _rand(b, t, K, dtype=dtype), previous, ~lengths_mask(b, t))


def _cell_call(b, t, dtype):
    return (
        _rand(b, Q, dtype=dtype),
        _rand(b, Q, dtype=dtype),
        _rand(b, t, K, dtype=dtype),
        lengths_mask(b, t),
    )


def _residual_call(b, t, dtype):
    lengths = lengths_mask(b, t).sum(1)
    return (_rand(b, A, dtype=dtype), _rand(b, t, A, dtype=dtype), lengths)


class _Call(nn.Module):
    """Calls its attention with keyword arguments (Tempered takes memory and valid by keyword)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.att = attention

    def forward(self, query, memory, valid):
        return self.att(query, memory=memory, valid=valid)


CASES = [
    Case(
        "join_scorer",
        _wrap(JoinScorer),
        lambda b, t, d: (_rand(b, Q, dtype=d), _rand(b, t, K, dtype=d)),
        "att",
    ),
    Case(
        "time_major_join",
        _wrap(TimeMajorJoin),
        lambda b, t, d: (_rand(t, b, K, dtype=d), _rand(1, b, Q, dtype=d)),
        "att",
    ),
    Case(
        "pre_projected",
        PreProjectedHolder,
        lambda b, t, d: (_rand(b, t, K, dtype=d), _rand(b, Q, dtype=d)),
        "attention",
    ),
    Case("pointer_bias", _wrap(Pointer), _pointer_call, "att"),
    Case("cell_wrapper", _wrap(AttentiveCell), _cell_call, "att"),
    Case(
        "tempered_kwargs",
        lambda: _Call(Tempered()),
        lambda b, t, d: (_rand(b, Q, dtype=d), _rand(b, t, K, dtype=d), lengths_mask(b, t)),
        "att",
    ),
    Case("wrapped_multi_query", _wrap(WrappedMulti), _multi_call, "att"),
    Case("time_major_float_mask", _wrap(TimeMajorFloatMask), _float_mask_call, "att"),
    Case("residual_normed", _wrap(ResidualNormed), _residual_call, "att"),
    Case("location_block", LocationHolder, _location_call, "attention"),
    Case(
        "conv_location",
        _wrap(ConvLocation),
        lambda b, t, d: (
            _rand(b, t, K, dtype=d),
            _rand(b, Q, dtype=d),
            torch.softmax(_rand(b, t, dtype=d), -1),
        ),
        "att",
    ),
    # look-alikes
    Case("relu_show_attend", _wrap(ShowAttendRelu), _feature_call, None),
    Case("sigmoid_gate", _wrap(SigmoidGate), _feature_call, None),
    Case("tanh_of_one", _wrap(TanhOfOne), _feature_call, None),
    Case("temperature_inside", _wrap(TemperatureInside), _feature_call, None),
    Case("padding_by_zero", _wrap(PaddingByZero), _pointer_call, None),
    Case("exploration_tanh", _wrap(ExplorationTanh), _feature_call, None),
    Case("log_softmax", _wrap(LogSoftmaxScores), _feature_call, None),
    Case("no_vector", _wrap(NoVector), _feature_call, None),
    Case("mask_per_query", _wrap(MaskPerQuery), _multi_call, None),
    Case(
        "join_relu",
        _wrap(lambda: JoinScorer(squash=torch.relu)),
        lambda b, t, d: (_rand(b, Q, dtype=d), _rand(b, t, K, dtype=d)),
        None,
    ),
]


# --- more layouts: the projection by a batch-repeated vector, einsum, in-place masks ----------------


class RepeatedVectorBmm(nn.Module):
    """An older tutorial's form: v [A] repeated over the batch, bmm with the transposed energy;
    time-major memory [T, B, K]; forward(state [B, Q], memory, keep [B, T] 1 = real) -> [B, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(Q + K, A)
        self.direction = nn.Parameter(torch.rand(A))

    def forward(self, state, memory, keep):
        frames, batch = memory.shape[0], memory.shape[1]
        state = state.unsqueeze(1).repeat(1, frames, 1)
        memory = memory.permute(1, 0, 2)
        energy = torch.tanh(self.mix(torch.cat((state, memory), dim=2))).permute(0, 2, 1)
        v = self.direction.repeat(batch, 1).unsqueeze(1)
        scores = torch.bmm(v, energy).squeeze(1)
        return F.softmax(scores.masked_fill(keep == 0, -1e10), dim=1)


class EinsumInPlace(nn.Module):
    """einsum projection, an in-place masked_fill_, several queries: forward(memory [B, T, K],
    queries [B, Tq, Q], pad [B, T]) -> context [B, Tq, K]."""

    def __init__(self) -> None:
        super().__init__()
        self.km = nn.Linear(K, A)
        self.qm = nn.Linear(Q, A)
        self.u = nn.Parameter(torch.randn(A) * 0.3)

    def forward(self, memory, queries, pad):
        e = torch.tanh(self.km(memory)[:, None] + self.qm(queries)[:, :, None])
        scores = torch.einsum("bqth,h->bqt", e, self.u)
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        return torch.softmax(scores, -1) @ memory


class EinsumOtherAxis(EinsumInPlace):
    """Look-alike: the einsum contracts the memory axis, not the hidden one."""

    def forward(self, memory, queries, pad):
        e = torch.tanh(self.km(memory)[:, None] + self.qm(queries)[:, :, None])
        scores = torch.einsum("bqth,t->bqh", e, torch.ones(memory.shape[1], dtype=memory.dtype))
        return torch.softmax(scores, -1)


def _bmm_call(b, t, dtype):
    return (_rand(b, Q, dtype=dtype), _rand(t, b, K, dtype=dtype), lengths_mask(b, t).long())


def _einsum_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), _rand(b, 2, Q, dtype=dtype), ~lengths_mask(b, t))


CASES += [
    Case("repeated_vector_bmm", _wrap(RepeatedVectorBmm), _bmm_call, "att"),
    Case("einsum_in_place_mask", _wrap(EinsumInPlace), _einsum_call, "att"),
    Case("einsum_other_axis", _wrap(EinsumOtherAxis), _einsum_call, None),
]


# --- more: .data.masked_fill_ on time-major energies, a query repeated up a rank ------------------


class DataFilled(nn.Module):
    """An NMT repository's QKV attention: time-major [T, B, K], the mask written through
    ``.data`` in place, weights returned batch-major [B, T]: forward(hidden [B, Q], memory,
    src_mask [T, B] 1 = real)."""

    def __init__(self) -> None:
        super().__init__()
        self.query_layer = nn.Linear(Q, A)
        self.key_layer = nn.Linear(K, A)
        self.energy_layer = nn.Linear(A, 1)

    def forward(self, hidden, memory, src_mask):
        e = self.energy_layer(torch.tanh(self.query_layer(hidden) + self.key_layer(memory)))
        e = e.squeeze(2)
        e.data.masked_fill_(src_mask == 0, float("-inf"))
        return F.softmax(e, dim=0).transpose(0, 1)


class RepeatedUpARank(nn.Module):
    """hidden [B, Q] repeated to [T, B, Q] (a rank added), joined with time-major memory;
    softmax over the frames, weights [T, B, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(Q + K, A)
        self.out = nn.Linear(A, 1, bias=False)

    def forward(self, hidden, memory):
        tiled = hidden.repeat(memory.size(0), 1, 1)
        return torch.softmax(self.out(torch.tanh(self.lin(torch.cat((tiled, memory), 2)))), 0)


def _data_call(b, t, dtype):
    return (_rand(b, Q, dtype=dtype), _rand(t, b, K, dtype=dtype), lengths_mask(b, t).t().long())


CASES += [
    Case("data_masked_fill", _wrap(DataFilled), _data_call, "att"),
    Case(
        "repeated_up_a_rank",
        _wrap(RepeatedUpARank),
        lambda b, t, d: (_rand(b, Q, dtype=d), _rand(t, b, K, dtype=d)),
        "att",
    ),
]


# --- a pointer network (combinatorial optimisation): Conv1d over [B, H, T], v from the left --------


class ConvPointer(nn.Module):
    """forward(query [B, H], ref [B, H, T]) -> (ref_proj [B, H, T], probs [B, T]); the hidden
    axis is the middle one."""

    def __init__(self, exploration: float | None = None) -> None:
        super().__init__()
        self.project_query = nn.Linear(A, A)
        self.project_ref = nn.Conv1d(A, A, 1, 1)
        self.vec = nn.Parameter(torch.rand(A) - 0.5)
        self.exploration = exploration

    def forward(self, query, ref):
        e = self.project_ref(ref)
        q = self.project_query(query).unsqueeze(2)
        v = self.vec.unsqueeze(0).expand(ref.size(0), -1).unsqueeze(1)
        u = torch.bmm(v, torch.tanh(q + e)).squeeze(1)
        if self.exploration is not None:
            u = self.exploration * torch.tanh(u)
        return e, F.softmax(u, dim=1)


def _pointer_conv_call(b, t, dtype):
    return (_rand(b, A, dtype=dtype), _rand(b, A, t, dtype=dtype))


CASES += [
    Case("conv_pointer", _wrap(ConvPointer), _pointer_conv_call, "att"),
    Case("conv_pointer_exploration", _wrap(lambda: ConvPointer(10.0)), _pointer_conv_call, None),
]


# --- a speech toolkit's MLP attention: float round trip around the mask, time-major ----------------


class FloatRoundTrip(nn.Module):
    """forward(state [B, Q], memory [T, B, K], pad [T, B] True = padding) -> weights [T, B]; the
    scores masked in float32 and cast back (type_as), as mixed-precision code does."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(K, A, bias=False)
        self.dec = nn.Linear(Q, A, bias=True)
        self.to_scores = nn.Linear(A, 1, bias=False)

    def forward(self, state, memory, pad):
        x = torch.tanh(self.enc(memory) + self.dec(state).unsqueeze(0))
        scores = self.to_scores(x).squeeze(2)
        scores = scores.float().masked_fill(pad, float("-inf")).type_as(scores)
        return F.softmax(scores, dim=0)


def _round_trip_call(b, t, dtype):
    return (_rand(b, Q, dtype=dtype), _rand(t, b, K, dtype=dtype), ~lengths_mask(b, t).t())


CASES += [
    # exact in float32, where .float() changes nothing (probed in float32); in float64 the scores'
    # rounding through float32 is not the op's: left alone there, by the matcher
    Case("float_round_trip", _wrap(FloatRoundTrip), _round_trip_call, "att", (torch.float32,)),
]


# --- a summariser's coverage attention (pointer-generator): masked and renormalised after it ------


class CoverageAttention(nn.Module):
    """forward(s_t [B, Q], enc_feats [B*T, A] (projected outside, flattened), enc_out [B, T, K],
    pad [B, T] 1 = real, coverage [B, T]) -> (context [B, K], weights [B, T], coverage [B, T])."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_proj = nn.Linear(Q, A)
        self.W_c = nn.Linear(1, A, bias=False)
        self.v = nn.Linear(A, 1, bias=False)

    def forward(self, s_t, enc_feats, enc_out, pad, coverage):
        b, t, _ = enc_out.shape
        dec = self.decode_proj(s_t).unsqueeze(1).expand(b, t, A).contiguous().view(-1, A)
        feats = enc_feats + dec + self.W_c(coverage.view(-1, 1))
        scores = self.v(torch.tanh(feats)).view(-1, t)
        weights = F.softmax(scores, dim=1) * pad
        weights = weights / weights.sum(1, keepdim=True)
        context = torch.bmm(weights.unsqueeze(1), enc_out).view(-1, enc_out.shape[2])
        return context, weights, coverage + weights


def _coverage_call(b, t, dtype):
    return (
        _rand(b, Q, dtype=dtype),
        _rand(b * t, A, dtype=dtype),
        _rand(b, t, K, dtype=dtype),
        lengths_mask(b, t).to(dtype),
        torch.rand(b, t, dtype=dtype),
    )


class CoverageBatched(CoverageAttention):
    """The same with [B, T, A] features (not flattened)."""

    def forward(self, s_t, enc_feats, enc_out, pad, coverage):
        feats = enc_feats + self.decode_proj(s_t).unsqueeze(1) + self.W_c(coverage.unsqueeze(2))
        weights = F.softmax(self.v(torch.tanh(feats)).squeeze(2), dim=1) * pad
        weights = weights / weights.sum(1, keepdim=True)
        return torch.bmm(weights.unsqueeze(1), enc_out).squeeze(1), weights, coverage + weights


def _coverage_batched_call(b, t, dtype):
    call = _coverage_call(b, t, dtype)
    return (call[0], call[1].view(b, t, A), *call[2:])


CASES += [
    Case("coverage_batched", _wrap(CoverageBatched), _coverage_batched_call, "att"),
    # batch and frames flattened into one axis ([B*T, A]), split where the scores are viewed
    # back to [B, T]
    Case("coverage_flattened", _wrap(CoverageAttention), _coverage_call, "att"),
]


# --- a TTS decoder's attention cell: the energy in a child, softmax without a dim in its caller ----


class StepEnergy(nn.Module):
    """energy(query [B, Q] or [B, 1, Q], keys_proj [B, T, A]) -> [B, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.to_hidden = nn.Linear(Q, A, bias=False)
        self.score = nn.Linear(A, 1, bias=False)

    def forward(self, query, keys_proj):
        if query.dim() == 2:
            query = query.unsqueeze(1)
        return self.score(torch.tanh(self.to_hidden(query) + keys_proj)).squeeze(-1)


class ImplicitDimCell(nn.Module):
    """forward(memory [B, T, K], query [B, Q], pad [B, T] True = padding) -> (context, weights):
    the memory projected here, the mask filled with -inf, and ``nn.Softmax()`` with no dim (for a
    2-D input PyTorch takes dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = StepEnergy()
        self.memory_proj = nn.Linear(K, A, bias=False)
        self.normalise = nn.Softmax()

    def forward(self, memory, query, pad):
        scores = self.energy(query, self.memory_proj(memory))
        scores = scores.masked_fill(pad, float("-inf"))
        weights = self.normalise(scores)  # PyTorch warns: "Implicit dimension choice for softmax"
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


CASES += [
    Case("implicit_softmax_dim", _wrap(ImplicitDimCell), _pointer_call, "att"),
]


# --- a textbook's attention: lengths to a mask written by index into flattened scores ------------


def _masked_normalise(scores: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis with positions at or past ``lengths`` written to -1e6 through
    a flattened view (a textbook's helper: ``x[~keep] = value`` on ``scores.reshape(-1, T)``)."""
    if lengths is None:
        return F.softmax(scores, dim=-1)
    shape = scores.shape
    flat = scores.reshape(-1, shape[-1])
    per_row = torch.repeat_interleave(lengths, shape[1])
    keep = torch.arange(shape[-1], dtype=torch.float32)[None, :] < per_row[:, None]
    flat[~keep] = -1e6
    return F.softmax(flat.reshape(shape), dim=-1)


class TextbookAdditive(nn.Module):
    """forward(queries [B, 1, Q], memory [B, T, K], lengths [B]) -> context [B, 1, K]; the weights
    kept on the module (``last_weights``), as the textbook does for plotting."""

    def __init__(self) -> None:
        super().__init__()
        self.w_mem = nn.Linear(K, A, bias=False)
        self.w_query = nn.Linear(Q, A, bias=False)
        self.w_out = nn.Linear(A, 1, bias=False)

    def forward(self, queries, memory, lengths):
        feats = self.w_query(queries).unsqueeze(2) + self.w_mem(memory).unsqueeze(1)
        scores = self.w_out(torch.tanh(feats)).squeeze(-1)
        self.last_weights = _masked_normalise(scores, lengths)
        return torch.bmm(self.last_weights, memory)


def _textbook_call(b, t, dtype):
    lengths = lengths_mask(b, t).sum(1)
    return (_rand(b, 1, Q, dtype=dtype), _rand(b, t, K, dtype=dtype), lengths)


CASES += [
    Case("textbook_index_mask", _wrap(TextbookAdditive), _textbook_call, "att"),
]


class ExpandedPointer(ConvPointer):
    """The query term expanded along the frames first ([B, H] -> [B, H, T]), an implicit-dim
    softmax, and padding filled with -inf: a combinatorial pointer network's form."""

    def forward(self, query, ref, pad):
        e = self.project_ref(ref)
        q = self.project_query(query).unsqueeze(2).expand(-1, -1, ref.size(2))
        v = self.vec.unsqueeze(0).expand(ref.size(0), -1).unsqueeze(1)
        u = torch.bmm(v, torch.tanh(q + e)).squeeze(1).masked_fill(pad, float("-inf"))
        return e, nn.Softmax()(u)


def _expanded_pointer_call(b, t, dtype):
    return (*_pointer_conv_call(b, t, dtype), ~lengths_mask(b, t))


CASES += [
    Case("expanded_pointer", _wrap(ExpandedPointer), _expanded_pointer_call, "att"),
]


# --- whole-sequence attention normalised over [B * Tq, S] rows ---------------------------------


class MergedRows(nn.Module):
    """forward(queries [B, Tq, Q], memory [B, T, K], valid [B, T]) -> (context, weights): the
    scores [B, Tq, T] masked with [B, 1, T], then viewed as [B * Tq, T] for the softmax and back
    (an NMT toolkit's whole-sequence form). ``late_mask``: the mask is written after the view, one
    row per (batch, query) pair: left alone (a known limit: the op's mask is per batch row)."""

    def __init__(self, late_mask: bool = False) -> None:
        super().__init__()
        self.mem = nn.Linear(K, A, bias=False)
        self.qry = nn.Linear(Q, A)
        self.out = nn.Linear(A, 1, bias=False)
        self.late_mask = late_mask

    def forward(self, queries, memory, valid):
        b, tq, _ = queries.shape
        t = memory.size(1)
        x = self.qry(queries).unsqueeze(2) + self.mem(memory).unsqueeze(1)
        scores = self.out(torch.tanh(x)).squeeze(3)
        if self.late_mask:
            rows = scores.view(b * tq, t)
            keep = valid.unsqueeze(1).expand(b, tq, t).reshape(b * tq, t)
            weights = F.softmax(rows.masked_fill(~keep, -float("inf")), -1).view(b, tq, t)
        else:
            scores = scores.masked_fill(~valid.unsqueeze(1), -float("inf"))
            weights = F.softmax(scores.view(b * tq, t), -1).view(b, tq, t)
        return torch.bmm(weights, memory), weights


CASES += [
    Case("merged_rows", _wrap(MergedRows), _multi_call, "att"),
    Case("merged_rows_late_mask", _wrap(lambda: MergedRows(late_mask=True)), _multi_call, None),
]


# --- an NMT toolkit's MLP attention: time-major, the inner bias added in place, a temperature -------


class InPlaceInnerBias(nn.Module):
    """forward(hid [1, B, Q], ctx [T, B, K], ctx_mask [T, B] float, 1 = real) -> (alpha [T, B],
    z [B, Q]): ``inner.add_(bias)`` in place (the traced graph keeps reading ``inner``'s node),
    scores divided (or multiplied) by a temperature, filled in place with -1e8, softmax over dim
    0, the context mapped back to the query width. ``through_view``: the in-place add goes through
    a slice of ``inner`` (a view): left alone."""

    def __init__(self, temp=0.5, score_bias=True, multiply=False, through_view=False) -> None:
        super().__init__()
        self.temperature = temp
        self.hid2ctx = nn.Linear(Q, A, bias=False)
        self.ctx2ctx = nn.Linear(K, A, bias=False)
        self.ctx2hid = nn.Linear(K, Q, bias=False)
        self.bias = nn.Parameter(torch.randn(A) * 0.5)
        self.mlp = nn.Linear(A, 1, bias=score_bias)  # under a softmax the score bias cancels
        self.multiply, self.through_view = multiply, through_view

    def forward(self, hid, ctx, ctx_mask):
        inner = self.ctx2ctx(ctx) + self.hid2ctx(hid)
        if self.through_view:
            inner[..., : A // 2].add_(self.bias[: A // 2])
        else:
            inner.add_(self.bias)
        scores = self.mlp(torch.tanh(inner))
        if self.multiply:
            scores = scores * (1.0 / self.temperature)
        else:
            scores = scores.div(self.temperature)
        scores = scores.squeeze(-1)
        scores.masked_fill_((1 - ctx_mask).bool(), -1e8)
        alpha = F.softmax(scores, dim=0)
        return alpha, self.ctx2hid((alpha.unsqueeze(-1) * ctx).sum(0))


def _time_major_call(b, t, dtype):
    return (
        _rand(1, b, Q, dtype=dtype),
        _rand(t, b, K, dtype=dtype),
        lengths_mask(b, t).t().to(dtype),
    )


CASES += [
    Case("in_place_inner_bias_temperature", _wrap(InPlaceInnerBias), _time_major_call, "att"),
    Case(
        "in_place_inner_bias_times_inverse",
        _wrap(lambda: InPlaceInnerBias(temp=2.0, score_bias=False, multiply=True)),
        _time_major_call,
        "att",
    ),
    Case(
        "in_place_add_through_a_view",
        _wrap(lambda: InPlaceInnerBias(through_view=True)),
        _time_major_call,
        None,
    ),
]


# --- a tutorial's concat attention over a time-major memory, at small widths -------------------------


class ConcatTimeMajor(nn.Module):
    """forward(hidden [B, D], outputs [T, B, 2E]) -> weights [B, T]: hidden repeated along the
    frames, the memory permuted to batch-major, one Linear over [hidden; memory], a bias-free
    score Linear, softmax over the frames. Every width a symbol in a dynamic trace: the join's
    parts are cut at the call's own widths."""

    def __init__(self, enc: int, dec: int) -> None:
        super().__init__()
        self.enc, self.dec = enc, dec
        self.attn_fc = nn.Linear(2 * enc + dec, dec)
        self.v_fc = nn.Linear(dec, 1, bias=False)

    def forward(self, hidden, outputs):
        frames = outputs.shape[0]
        hidden = hidden.unsqueeze(1).repeat(1, frames, 1)
        outputs = outputs.permute(1, 0, 2)
        energy = torch.tanh(self.attn_fc(torch.cat((hidden, outputs), dim=2)))
        return torch.softmax(self.v_fc(energy).squeeze(2), dim=1)


def _concat_case(enc: int, dec: int) -> Case:
    return Case(
        f"concat_time_major_{enc}x{dec}",
        _wrap(lambda: ConcatTimeMajor(enc, dec)),
        lambda b, t, d: (_rand(b, dec, dtype=d), _rand(t, b, 2 * enc, dtype=d)),
        "att",
    )


CASES += [_concat_case(2, 2), _concat_case(2, 3), _concat_case(1, 4), _concat_case(16, 16)]


# --- attention pooling with a learned query (a document classifier's word attention) ----------------


class LearnedQueryPool(nn.Module):
    """forward(h [B, T, K], valid [B, T]) -> (pooled [B, K], alpha [B, T]): u = tanh(W h + b)
    scored against a learned context vector (a Parameter, no query from the call), masked,
    softmax over the words. ``squash``: relu instead of tanh, a look-alike left alone."""

    def __init__(self, bias: bool = True, squash=torch.tanh) -> None:
        super().__init__()
        self.proj = nn.Linear(K, A, bias=bias)
        self.context = nn.Parameter(torch.randn(A))
        self.squash = squash

    def forward(self, h, valid):
        scores = self.squash(self.proj(h)) @ self.context
        alpha = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=1)
        return (alpha.unsqueeze(-1) * h).sum(1), alpha


class LearnedQueryScorer(nn.Module):
    """forward(h [T, B, K]) -> weights [T, B, 1]: time-major, the vector a bias-free Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K, A)
        self.u = nn.Linear(A, 1, bias=False)

    def forward(self, h):
        return F.softmax(self.u(torch.tanh(self.proj(h))), dim=0)


def _pool_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), lengths_mask(b, t))


CASES += [
    Case("learned_query_pool", _wrap(LearnedQueryPool), _pool_call, "att"),
    Case(
        "learned_query_pool_no_bias", _wrap(lambda: LearnedQueryPool(bias=False)), _pool_call, "att"
    ),
    Case(
        "learned_query_time_major",
        _wrap(LearnedQueryScorer),
        lambda b, t, d: (_rand(t, b, K, dtype=d),),
        "att",
    ),
    Case(
        "learned_query_relu",
        _wrap(lambda: LearnedQueryPool(squash=torch.relu)),
        _pool_call,
        None,
    ),
]


# === issue 36: biased sigmoid, scaled scores, multi-head, learned queries, small concat ===========
#
# Each re-created from the math and call conventions of a kind of public code not used above.

# --- a listen-attend-spell-style smoothing attention: sigmoid of a score layer with its bias -------


class SmoothedScores(nn.Module):
    """forward(memory [B, T, K], state [B, Q], valid [B, T] True = real) -> (context [B, K],
    weights [B, T]): sigmoid(v . tanh(W m + U s) + b) renormalised over the real frames, the
    padding filled with -inf first (a TTS/ASR "smoothing" attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_layer = nn.Linear(K, A, bias=False)
        self.query_layer = nn.Linear(Q, A, bias=False)
        self.v = nn.Linear(A, 1, bias=True)
        with torch.no_grad():
            self.v.bias.fill_(1.5)  # far enough from 0 that a dropped bias shows

    def forward(self, memory, state, valid):
        energies = self.v(
            torch.tanh(self.memory_layer(memory) + self.query_layer(state).unsqueeze(1))
        ).squeeze(-1)
        energies = energies.masked_fill(~valid, float("-inf"))
        weights = torch.sigmoid(energies) / torch.sigmoid(energies).sum(dim=1, keepdim=True)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


def _smooth_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), _rand(b, Q, dtype=dtype), lengths_mask(b, t))


# --- monotonic-attention-style energy: g v/||v|| . tanh(W s + V h + b) + r, under the sigmoid ------


class OffsetEnergy(nn.Module):
    """forward(memory [B, T, K], state [B, Q]) -> weights [B, T]: the energy of online monotonic
    attention (a weight-normalised score vector and a learned scalar offset r), here normalised
    by the sum of its sigmoids; ``after_mask``: r added after the padding is filled (left alone:
    a filled frame's sigmoid need not stay 0)."""

    def __init__(self, after_mask: bool = False) -> None:
        super().__init__()
        self.W = nn.Linear(Q, A, bias=False)
        self.V = nn.Linear(K, A)
        self.v = nn.Parameter(torch.randn(A))
        self.g = nn.Parameter(torch.tensor(1.0 / math.sqrt(A)))
        self.r = nn.Parameter(torch.tensor(-1.0))
        self.after_mask = after_mask

    def forward(self, memory, state, valid):
        v = self.g * self.v / self.v.norm()
        e = (torch.tanh(self.W(state).unsqueeze(1) + self.V(memory)) * v).sum(-1)
        if not self.after_mask:
            e = e + self.r
        e = e.masked_fill(~valid, -1e5)
        if self.after_mask:
            e = e + self.r
        s = torch.sigmoid(e)
        return s / s.sum(-1, keepdim=True)


# --- a learned temperature (a Parameter) dividing the energies ------------------------------------


class LearnedTemperature(nn.Module):
    """forward(memory [B, T, K], state [B, Q], valid) -> (context, weights): energies divided by
    a learned temperature, softmax (a distillation-style sharpened attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(K, A)
        self.q = nn.Linear(Q, A, bias=False)
        self.score = nn.Linear(A, 1, bias=False)
        self.tau = nn.Parameter(torch.tensor(0.7))

    def forward(self, memory, state, valid):
        e = self.score(torch.tanh(self.k(memory) + self.q(state)[:, None, :])).squeeze(-1)
        e = e.div(self.tau).masked_fill(~valid, -1e9)
        w = e.softmax(-1)
        return torch.einsum("bt,btk->bk", w, memory), w


# --- a scaled additive attention: energies times a buffer 1/sqrt(A) -------------------------------


class ScaledByBuffer(nn.Module):
    """forward(memory [B, T, K], state [B, Q], valid) -> weights: (v . tanh(...)) * scale with
    scale = 1/sqrt(A) a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(K, A, bias=False)
        self.q = nn.Linear(Q, A)
        self.v = nn.Parameter(torch.randn(A))
        self.register_buffer("scale", torch.tensor([1.0 / math.sqrt(A)]))

    def forward(self, memory, state, valid):
        e = torch.matmul(torch.tanh(self.k(memory) + self.q(state).unsqueeze(1)), self.v)
        e = (e * self.scale).masked_fill(~valid, float("-inf"))
        return F.softmax(e, dim=-1)


# --- sigmoid smoothing with a biased score layer and a constant temperature -----------------------


class SmoothedTempered(SmoothedScores):
    """As SmoothedScores, the energies (bias included) divided by 2.0 before the sigmoid, and a
    constant subtracted: sigmoid((v . tanh + b) / 2 - 0.25)."""

    def forward(self, memory, state, valid):
        energies = self.v(
            torch.tanh(self.memory_layer(memory) + self.query_layer(state).unsqueeze(1))
        ).squeeze(-1)
        energies = energies / 2.0 - 0.25
        energies = energies.masked_fill(~valid, float("-inf"))
        weights = torch.sigmoid(energies) / torch.sigmoid(energies).sum(dim=1, keepdim=True)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


# --- multi-head additive attention -----------------------------------------------------------------

HEADS, HEAD_DIM = 3, 4


class HeadsPerVector(nn.Module):
    """forward(memory [B, T, K], state [B, Q], valid) -> (context [B, heads, K], weights [B, T,
    heads]): one additive attention per head, each head its own score vector (v [heads, d]),
    projections split into heads by view."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.wq = nn.Linear(Q, HEADS * HEAD_DIM)
        self.wk = nn.Linear(K, HEADS * HEAD_DIM, bias=False)
        self.v = nn.Parameter(torch.randn(HEAD_DIM) if shared else torch.randn(HEADS, HEAD_DIM))
        self.shared = shared

    def forward(self, memory, state, valid):
        b, t = memory.shape[:2]
        q = self.wq(state).view(b, 1, HEADS, HEAD_DIM)
        k = self.wk(memory).view(b, t, HEADS, HEAD_DIM)
        if self.shared:
            e = torch.tanh(q + k) @ self.v
        else:
            e = (torch.tanh(q + k) * self.v).sum(-1)
        e = e.masked_fill(~valid.unsqueeze(-1), -1e9)
        w = torch.softmax(e, dim=1)
        return torch.einsum("bth,btk->bhk", w, memory), w


class HeadModules(nn.Module):
    """An ASR toolkit's multi-head additive attention: per-head Linear layers in ModuleLists, a
    loop over the heads, each head's energy filled in place and scaled, the heads' contexts
    joined and projected. forward(memory [B, T, K], pad [B, T] True = padding, state [B, Q])."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp_q = nn.ModuleList([nn.Linear(Q, HEAD_DIM) for _ in range(HEADS)])
        self.mlp_k = nn.ModuleList([nn.Linear(K, HEAD_DIM, bias=False) for _ in range(HEADS)])
        self.mlp_v = nn.ModuleList([nn.Linear(K, HEAD_DIM, bias=False) for _ in range(HEADS)])
        self.gvec = nn.ModuleList([nn.Linear(HEAD_DIM, 1) for _ in range(HEADS)])
        self.mlp_o = nn.Linear(HEADS * HEAD_DIM, K, bias=False)
        self.scaling = 2.0

    def forward(self, memory, pad, state):
        b, t = memory.shape[:2]
        keys = [self.mlp_k[h](memory) for h in range(HEADS)]
        values = [self.mlp_v[h](memory) for h in range(HEADS)]
        contexts, weights = [], []
        for h in range(HEADS):
            e = self.gvec[h](torch.tanh(keys[h] + self.mlp_q[h](state).view(b, 1, HEAD_DIM)))
            e = e.squeeze(2)
            e.masked_fill_(pad, -float("inf"))
            weights.append(F.softmax(self.scaling * e, dim=1))
            contexts.append(torch.sum(values[h] * weights[h].view(b, t, 1), dim=1))
        return self.mlp_o(torch.cat(contexts, dim=1)), torch.stack(weights, dim=1)


class HeadsPerPosition(HeadsPerVector):
    """Look-alike: a score vector per frame (v [T, d]), not per head: not one attention per row."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(9, HEAD_DIM))

    def forward(self, memory, state, valid):
        b, t = memory.shape[:2]
        q = self.wq(state).view(b, 1, HEADS, HEAD_DIM)[:, :, 0]
        k = self.wk(memory).view(b, t, HEADS, HEAD_DIM)[:, :, 0]
        e = (torch.tanh(q + k) * self.v[:t]).sum(-1)
        return torch.softmax(e.masked_fill(~valid, -1e9), dim=1)


def _heads_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), _rand(b, Q, dtype=dtype), lengths_mask(b, t))


def _head_modules_call(b, t, dtype):
    return (_rand(b, t, K, dtype=dtype), ~lengths_mask(b, t), _rand(b, Q, dtype=dtype))


# --- several learned queries pooling a sequence (additive, set-pooling style) ----------------------


class LearnedQueries(nn.Module):
    """forward(h [B, T, K], valid) -> (pooled [B, n, K], weights [B, n, T]): n learned seed
    vectors, each projected, attend to the sequence additively (a pooling by multiple queries)."""

    def __init__(self, seeds: int = 3) -> None:
        super().__init__()
        self.seeds = nn.Parameter(torch.randn(seeds, Q))
        self.wq = nn.Linear(Q, A, bias=False)
        self.wk = nn.Linear(K, A)
        self.u = nn.Linear(A, 1, bias=False)

    def forward(self, h, valid):
        pre = self.wq(self.seeds)[None, :, None, :] + self.wk(h)[:, None, :, :]
        e = self.u(torch.tanh(pre)).squeeze(-1)  # [B, n, T]
        e = e.masked_fill(~valid[:, None, :], -1e9)
        w = torch.softmax(e, dim=-1)
        return w @ h, w


# --- a time-series input attention over a handful of driving series (concat of width 1 and 2) ------


class SeriesAttention(nn.Module):
    """forward(series [B, N, S] (N driving series of S steps), hidden [B, 2], cell [B, 2]) ->
    weights [B, N]: v . tanh(W [h; c] + U x_k) per series k, the state and cell repeated over the
    series and joined with each series (tiny widths), softmax over the series."""

    def __init__(self, steps: int = 1, width: int = 2) -> None:
        super().__init__()
        self.attn = nn.Linear(2 * width + steps, A)
        self.v = nn.Linear(A, 1, bias=False)

    def forward(self, series, hidden, cell):
        n = series.shape[1]
        joined = torch.cat(
            (hidden.unsqueeze(1).repeat(1, n, 1), cell.unsqueeze(1).repeat(1, n, 1), series), dim=2
        )
        e = self.v(torch.tanh(self.attn(joined))).squeeze(2)
        return F.softmax(e, dim=1)


def _series_call(b, t, dtype):
    return (_rand(b, t, 1, dtype=dtype), _rand(b, 2, dtype=dtype), _rand(b, 2, dtype=dtype))


# --- look-alikes ------------------------------------------------------------------------------------


class SigmoidMasked(SmoothedScores):
    """sigmoid(e) * mask, not renormalised (a gating, not a distribution)."""

    def forward(self, memory, state, valid):
        energies = self.v(
            torch.tanh(self.memory_layer(memory) + self.query_layer(state).unsqueeze(1))
        ).squeeze(-1)
        weights = torch.sigmoid(energies) * valid
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


class SoftmaxOverBatch(LearnedTemperature):
    """Softmax over the batch axis of batch-first energies (a wrong dim)."""

    def forward(self, memory, state, valid):
        e = self.score(torch.tanh(self.k(memory) + self.q(state)[:, None, :])).squeeze(-1)
        w = e.softmax(0)
        return torch.einsum("bt,btk->bk", w, memory), w


class TanhOfProduct(LearnedTemperature):
    """tanh(W m * U s): a multiplicative interaction inside the tanh."""

    def forward(self, memory, state, valid):
        e = self.score(torch.tanh(self.k(memory) * self.q(state)[:, None, :])).squeeze(-1)
        w = e.masked_fill(~valid, -1e9).softmax(-1)
        return torch.einsum("bt,btk->bk", w, memory), w


class BiasAfterSoftmax(LearnedTemperature):
    """A learned bias added to the weights after the softmax (converts: the graph keeps the
    addition after the fused op's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.after = nn.Parameter(torch.tensor(0.05))

    def forward(self, memory, state, valid):
        e = self.score(torch.tanh(self.k(memory) + self.q(state)[:, None, :])).squeeze(-1)
        w = e.masked_fill(~valid, -1e9).softmax(-1) + self.after
        return torch.einsum("bt,btk->bk", w, memory), w


class LocationFromThisStep(nn.Module):
    """A location term convolved from this step's own energies (not the previous step's weights):
    e' = e + conv(e), then the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(K, A, bias=False)
        self.q = nn.Linear(Q, A)
        self.v = nn.Linear(A, 1, bias=False)
        self.conv = nn.Conv1d(1, 1, 3, padding=1, bias=False)

    def forward(self, memory, state, valid):
        e = self.v(torch.tanh(self.k(memory) + self.q(state).unsqueeze(1))).squeeze(-1)
        e = e + self.conv(e.unsqueeze(1)).squeeze(1)
        return torch.softmax(e.masked_fill(~valid, -1e9), dim=-1)


CASES += [
    Case("smoothed_score_bias", _wrap(SmoothedScores), _smooth_call, "att"),
    Case("monotonic_offset_sigmoid", _wrap(OffsetEnergy), _smooth_call, "att"),
    Case("learned_temperature", _wrap(LearnedTemperature), _smooth_call, "att"),
    Case("scaled_by_buffer", _wrap(ScaledByBuffer), _smooth_call, "att"),
    Case("smoothed_tempered_shifted", _wrap(SmoothedTempered), _smooth_call, "att"),
    Case("heads_per_head_vector", _wrap(HeadsPerVector), _heads_call, "att"),
    Case("heads_shared_vector", _wrap(lambda: HeadsPerVector(shared=True)), _heads_call, "att"),
    Case("heads_module_lists", _wrap(HeadModules), _head_modules_call, "att"),
    # not a look-alike: only the sum ... softmax is replaced, the addition after it runs as traced
    Case("bias_after_softmax", _wrap(BiasAfterSoftmax), _smooth_call, "att"),
    Case("learned_queries", _wrap(LearnedQueries), _pool_call, "att"),
    Case("series_concat_width_1", _wrap(SeriesAttention), _series_call, "att"),
    # look-alikes, left alone
    Case("offset_after_the_mask", _wrap(lambda: OffsetEnergy(after_mask=True)), _smooth_call, None),
    Case("sigmoid_times_mask", _wrap(SigmoidMasked), _smooth_call, None),
    Case("softmax_over_batch", _wrap(SoftmaxOverBatch), _smooth_call, None),
    Case("tanh_of_product", _wrap(TanhOfProduct), _smooth_call, None),
    Case("location_from_this_step", _wrap(LocationFromThisStep), _smooth_call, None),
    Case("heads_per_position", _wrap(HeadsPerPosition), _heads_call, None),
]


# --- the concat form's children, called otherwise (keon's seq2seq) ---------------------------------


class ConcatChildrenOwnCall(nn.Module):
    """keon/seq2seq's attention: the concat form's ``attn`` Linear(2A, A) and ``v`` vector, called
    with (hidden [B, A], encoder_outputs [T, B, A]) and returning the weights [B, 1, T]: the named
    concat layouts' call does not fit it, so the general path takes it at its first call."""

    def __init__(self, activation=torch.tanh) -> None:
        super().__init__()
        self.attn = nn.Linear(2 * A, A)
        self.v = nn.Parameter(torch.rand(A) - 0.5)
        self.activation = activation

    def forward(self, hidden, encoder_outputs):
        steps = encoder_outputs.size(0)
        h = hidden.repeat(steps, 1, 1).transpose(0, 1)
        memory = encoder_outputs.transpose(0, 1)
        energy = self.activation(self.attn(torch.cat([h, memory], 2))).transpose(1, 2)
        v = self.v.repeat(memory.size(0), 1).unsqueeze(1)
        return F.softmax(torch.bmm(v, energy).squeeze(1), dim=1).unsqueeze(1)


def _time_major_pair_call(b, t, dtype):
    return (_rand(b, A, dtype=dtype), _rand(t, b, A, dtype=dtype))


CASES += [
    Case("concat_children_own_call", _wrap(ConcatChildrenOwnCall), _time_major_pair_call, "att"),
    # its ReLU version (keon's own): a look-alike
    Case(
        "concat_children_own_call_relu",
        _wrap(lambda: ConcatChildrenOwnCall(F.relu)),
        _time_major_pair_call,
        None,
    ),
]


# --- a decoder whose output layer has a tanh (openspeech's LSTMAttentionDecoder) ------------------


class AdditiveWithBias(nn.Module):
    """openspeech's AdditiveAttention: forward(query [B, 1, D], key [B, T, D], value [B, T, D])
    -> (context [B, 1, D] plus the query, weights [B, T]), a bias inside the tanh."""

    def __init__(self, dim: int = A) -> None:
        super().__init__()
        self.query_proj = nn.Linear(dim, dim, bias=False)
        self.key_proj = nn.Linear(dim, dim, bias=False)
        self.score_proj = nn.Linear(dim, 1)
        self.bias = nn.Parameter(torch.rand(dim).uniform_(-0.1, 0.1))

    def forward(self, query, key, value):
        pre = self.key_proj(key) + self.query_proj(query) + self.bias
        score = self.score_proj(torch.tanh(pre)).squeeze(-1)
        attn = F.softmax(score, dim=-1)
        context = torch.bmm(attn.unsqueeze(1), value)
        context += query
        return context, attn


class TanhOutputDecoder(nn.Module):
    """A decoder stepping an RNN and the attention, its output layer Linear, tanh, Linear to the
    vocabulary, log_softmax (openspeech's LSTMAttentionDecoder): only the attention converts,
    not the decoder around it. forward(encoder_outputs [B, T, A], targets [B, steps] ints)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, A)
        self.rnn = nn.GRU(A, A, batch_first=True)
        self.attention = AdditiveWithBias()
        self.fc = nn.Sequential(nn.Linear(2 * A, A), nn.Tanh(), nn.Linear(A, vocab))

    def forward(self, encoder_outputs, targets):
        hidden, logits = None, []
        for step in range(targets.size(1)):
            out, hidden = self.rnn(self.embedding(targets[:, step : step + 1]), hidden)
            context, _ = self.attention(out, encoder_outputs, encoder_outputs)
            logits.append(self.fc(torch.cat((out, context), dim=2)).log_softmax(dim=-1))
        return torch.cat(logits, 1)


def tanh_output_decoder_call(b, t, dtype):
    return (_rand(b, t, A, dtype=dtype), torch.randint(0, 11, (b, 3)))


# --- image captioning's attention, the projection run on flat rows (self-critical.pytorch) --------


class FlatRowsCaptioning(nn.Module):
    """self-critical.pytorch's ``Attention`` (and the UpDown / AoANet copies of it): the keys'
    projection given precomputed, the query's expanded over the regions, the tanh viewed flat to
    [B*T, A] for the score Linear and the scores viewed back to [B, T]; a float mask applied
    after the softmax, the weights renormalised. forward(h [B, Q], feats [B, T, K],
    projected [B, T, A], masks [B, T]) -> context [B, K]."""

    def __init__(self) -> None:
        super().__init__()
        self.h2att = nn.Linear(Q, A)
        self.alpha_net = nn.Linear(A, 1)

    def forward(self, h, feats, projected, masks=None):
        regions = feats.numel() // feats.size(0) // feats.size(-1)
        keys = projected.view(-1, regions, A)
        dot = torch.tanh(keys + self.h2att(h).unsqueeze(1).expand_as(keys))
        dot = self.alpha_net(dot.view(-1, A)).view(-1, regions)
        weight = F.softmax(dot, dim=1)
        if masks is not None:
            weight = weight * masks.view(-1, regions).to(weight)
            weight = weight / weight.sum(1, keepdim=True)
        return torch.bmm(weight.unsqueeze(1), feats.view(-1, regions, feats.size(-1))).squeeze(1)


def _captioning_call(b, t, dtype):
    masks = lengths_mask(b, t).to(dtype)
    return (
        _rand(b, Q, dtype=dtype),
        _rand(b, t, K, dtype=dtype),
        _rand(b, t, A, dtype=dtype),
        masks,
    )


CASES += [Case("captioning_flat_rows", _wrap(FlatRowsCaptioning), _captioning_call, "att")]


class FlatRowsRegrouped(FlatRowsCaptioning):
    """The flat scores viewed back with the axes the other way round ([T, B], then transposed):
    each row mixes scores of other rows, not attention over its own regions (left alone)."""

    def forward(self, h, feats, projected, masks=None):
        regions = feats.size(1)
        dot = torch.tanh(projected + self.h2att(h).unsqueeze(1))
        dot = self.alpha_net(dot.view(-1, A)).view(regions, -1).t()
        weight = F.softmax(dot, dim=1)
        return torch.bmm(weight.unsqueeze(1), feats).squeeze(1)


CASES += [Case("captioning_regrouped", _wrap(FlatRowsRegrouped), _captioning_call, None)]


# --- intra-decoder attention over the decoder's own past states (a summariser's) ------------------


class IntraDecoderAttention(nn.Module):
    """Attention over the decoder's previous states, which grow by one each step; at the first
    step there are none, so its first call computes no tanh. forward(state [B, Q], past [B, n, Q]
    or None) -> (context [B, Q], past with state appended)."""

    def __init__(self) -> None:
        super().__init__()
        self.W_prev = nn.Linear(Q, A, bias=False)
        self.W_s = nn.Linear(Q, A)
        self.v = nn.Linear(A, 1, bias=False)

    def forward(self, state, past):
        if past is None:
            return torch.zeros_like(state), state.unsqueeze(1)
        energy = torch.tanh(self.W_prev(past) + self.W_s(state).unsqueeze(1))
        weights = F.softmax(self.v(energy).squeeze(2), dim=1)
        context = torch.bmm(weights.unsqueeze(1), past).squeeze(1)
        return context, torch.cat([past, state.unsqueeze(1)], dim=1)


class IntraDecoder(nn.Module):
    """Steps IntraDecoderAttention over states [B, steps, Q]; returns the contexts [B, steps, Q]."""

    def __init__(self) -> None:
        super().__init__()
        self.att = IntraDecoderAttention()
        self.mix = nn.Linear(2 * Q, Q)

    def forward(self, states):
        past, outs = None, []
        for step in range(states.size(1)):
            context, past = self.att(states[:, step], past)
            outs.append(torch.tanh(self.mix(torch.cat([states[:, step], context], 1))))
        return torch.stack(outs, 1)


class TemporalAttention(nn.Module):
    """Intra-temporal attention (a summariser's): exp of the scores divided by the sum of those
    of the earlier steps, not a softmax (left alone, reported once). forward(state [B, Q],
    memory [B, T, K], past_sum [B, T] or None) -> (context [B, K], new past_sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.W_h = nn.Linear(K, A, bias=False)
        self.W_s = nn.Linear(Q, A)
        self.v = nn.Linear(A, 1, bias=False)

    def forward(self, state, memory, past_sum):
        e = self.v(torch.tanh(self.W_h(memory) + self.W_s(state).unsqueeze(1))).squeeze(2)
        exp_e = torch.exp(e)
        if past_sum is None:
            weights, past_sum = exp_e, exp_e + 1e-10
        else:
            weights, past_sum = exp_e / past_sum, past_sum + exp_e
        weights = weights / weights.sum(1, keepdim=True)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), past_sum


class TemporalDecoder(nn.Module):
    """Steps TemporalAttention over states [B, steps, Q] and a memory [B, T, K]."""

    def __init__(self) -> None:
        super().__init__()
        self.att = TemporalAttention()

    def forward(self, states, memory):
        past, outs = None, []
        for step in range(states.size(1)):
            context, past = self.att(states[:, step], memory, past)
            outs.append(context)
        return torch.stack(outs, 1)


# --- the padding of TensorFlow ports: where(mask, scores, ones_like(scores) * -big) -----------------


class LikeFilledPooling(nn.Module):
    """Attention pooling of a behaviour sequence [B, T, K] by a candidate [B, Q] whose padded
    positions are filled through a tensor made like the scores (DeepCTR-Torch's sequence pooling
    with a tanh activation, and other TensorFlow ports): ``torch.where(valid, scores,
    torch.ones_like(scores) * (-2**32 + 1))``, or ``full_like``. ``fill``: the fill value (0
    makes a look-alike: the padded positions keep a weight)."""

    def __init__(self, spelling: str = "ones_like", fill: float = -(2**32) + 1) -> None:
        super().__init__()
        self.spelling, self.fill = spelling, fill
        self.query = nn.Linear(Q, A)
        self.keys = nn.Linear(K, A, bias=False)
        self.score = nn.Linear(A, 1)

    def forward(self, candidate, behaviours, valid):
        hidden = torch.tanh(self.query(candidate).unsqueeze(1) + self.keys(behaviours))
        scores = self.score(hidden).transpose(1, 2)  # [B, 1, T]
        if self.spelling == "ones_like":
            paddings = torch.ones_like(scores) * self.fill
        else:
            paddings = torch.full_like(scores, self.fill)
        scores = torch.where(valid.unsqueeze(1), scores, paddings)
        return torch.matmul(torch.softmax(scores, dim=-1), behaviours).squeeze(1)


def _pooling_call(b, t, dtype):
    return (_rand(b, Q, dtype=dtype), _rand(b, t, K, dtype=dtype), lengths_mask(b, t))


CASES += [
    Case("like_filled_ones", lambda: _Holder(LikeFilledPooling()), _pooling_call, "att"),
    Case("like_filled_full", lambda: _Holder(LikeFilledPooling("full_like")), _pooling_call, "att"),
    # a fill of 0 is not a mask: the padded positions keep exp(0) of the weight
    Case("like_filled_zero", lambda: _Holder(LikeFilledPooling(fill=0.0)), _pooling_call, None),
]
