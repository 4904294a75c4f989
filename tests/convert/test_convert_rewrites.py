"""Every rewrite the general path's matcher can produce, through its probe, on random weights.

Modules are generated from the matcher's forms (tests/convert/layouts_traced.py has them one by
one, in the conventions of real code): each projection onto the score vector (a Linear with or
without its bias, matmul by [H] or [H, 1], a product summed over the last axis, einsum, bmm by
the vector repeated over the batch), a bias inside the tanh or not, one or several queries per
batch row, memory batch-first or time-major, the steps between the scores and the normaliser
(scales by a number, a buffer or a parameter, multiplying or dividing; shifts by a number or a
parameter; masks by masked_fill, masked_fill_ through .data, where, or an additive float mask),
and softmax or sigmoid normalisation. Each module is handed to ``fuse_attention``, called, and:

- the probe must never refuse a rewrite ("differs from the fused op": a wrong rewrite, a bug);
- it must convert, unless its form is one the op cannot give (listed: a shift after the mask
  under the sigmoid), and then be left alone;
- later calls of other sizes give the original's outputs and gradients (float64).

The combinations are drawn by a fixed seed so that every option of every dimension appears with
each normalisation; the test names say which.
"""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass

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

Q, K, A = 5, 6, 4
PROJECTIONS = ("linear", "linear_bias", "matmul", "matmul_column", "mul_sum", "einsum", "bmm")
SCALES = (None, "mul_number", "div_number", "div_buffer", "mul_buffer", "div_param", "mul_param")
SHIFTS = (None, "number", "param", "neg_number")
MASKS = (None, "fill_inf", "fill_1e9", "data_fill", "where", "additive")
NORMALIZE = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Form:
    projection: str
    inner_bias: bool
    queries: int  # per batch row: 1 (a decoder step) or 3
    time_major: bool
    scale: str | None
    shift: str | None
    shift_after_mask: bool
    mask: str | None
    normalize: str

    def converts(self) -> bool:
        """Whether the op can give it (see the module docstring)."""
        shifted_late = self.shift is not None and self.mask is not None and self.shift_after_mask
        return not (self.normalize == "sigmoid" and shifted_late)

    @property
    def name(self) -> str:
        parts = [
            self.projection,
            "bias" if self.inner_bias else "nobias",
            f"q{self.queries}",
            "tmajor" if self.time_major else "bfirst",
            self.scale or "noscale",
            (self.shift or "noshift") + ("-late" if self.shift_after_mask else ""),
            self.mask or "nomask",
            self.normalize,
        ]
        return "-".join(parts)


class Generated(nn.Module):
    """forward(memory [B, T, K] (time-major: [T, B, K]), state [B, Q] or [B, n, Q], valid [B, T]
    True = real) -> weights [B, T] or [B, n, T] (time-major: [T, B] or [n, T, B] transposed
    back), through ``form``'s steps."""

    def __init__(self, form: Form) -> None:
        super().__init__()
        self.form = form
        self.wk = nn.Linear(K, A, bias=False)
        self.wq = nn.Linear(Q, A, bias=form.inner_bias)
        if form.projection.startswith("linear"):
            self.score = nn.Linear(A, 1, bias=form.projection == "linear_bias")
            if self.score.bias is not None:
                with torch.no_grad():
                    self.score.bias.fill_(0.8)
        else:
            self.v = nn.Parameter(torch.randn(A))
        if form.scale in ("div_buffer", "mul_buffer"):
            self.register_buffer("scale", torch.tensor(1.7 if "div" in form.scale else 0.6))
        elif form.scale in ("div_param", "mul_param"):
            self.scale = nn.Parameter(torch.tensor(1.3 if "div" in form.scale else 0.8))
        if form.shift == "param":
            self.offset = nn.Parameter(torch.tensor([-0.9]))

    def _project(self, u):
        p = self.form.projection
        if p.startswith("linear"):
            return self.score(u).squeeze(-1)
        if p == "matmul":
            return u @ self.v
        if p == "matmul_column":
            return (u @ self.v.unsqueeze(1)).squeeze(-1)
        if p == "mul_sum":
            return (u * self.v).sum(-1)
        if p == "einsum":
            return torch.einsum("bta,a->bt" if u.dim() == 3 else "bnta,a->bnt", u, self.v)
        # bmm of the vector repeated over the batch with tanh^T (rank 3 only)
        return torch.bmm(self.v.expand(u.shape[0], 1, A), u.transpose(1, 2)).squeeze(1)

    def _scale(self, e):
        s = self.form.scale
        if s is None:
            return e
        factor = {"mul_number": 0.5, "div_number": 2.0}.get(s, None)
        factor = self.scale if factor is None else factor
        return e * factor if s.startswith("mul") else e / factor

    def _shift(self, e):
        s = self.form.shift
        if s == "number":
            return e + 0.75
        if s == "neg_number":
            return e - 0.4
        if s == "param":
            return e + self.offset
        return e

    def _mask(self, e, valid):
        m = self.form.mask
        if m is None:
            return e
        if m == "fill_inf":
            return e.masked_fill(~valid, float("-inf"))
        if m == "fill_1e9":
            return e.masked_fill(~valid, -1e9)
        if m == "data_fill":
            e.data.masked_fill_(~valid, -1e9)
            return e
        if m == "where":
            return torch.where(valid, e, e.new_full((), -1e9))
        return e + (~valid).to(e.dtype) * -1e4  # an additive float mask

    def forward(self, memory, state, valid):
        form = self.form
        if form.time_major:
            memory = memory.transpose(0, 1)
        keys = self.wk(memory)  # [B, T, A]
        if form.queries == 1:
            pre = keys + self.wq(state).unsqueeze(1)
        else:
            keys, valid = keys.unsqueeze(1), valid.unsqueeze(1)  # [B, 1, T, A], [B, 1, T]
            pre = keys + self.wq(state).unsqueeze(2)
        e = self._scale(self._project(torch.tanh(pre)))
        if not form.shift_after_mask:
            e = self._shift(e)
        e = self._mask(e, valid)
        if form.shift_after_mask:
            e = self._shift(e)
        if form.normalize == "sigmoid":
            s = torch.sigmoid(e)
            w = s / s.sum(-1, keepdim=True)
        else:
            w = torch.softmax(e, dim=-1)
        return w.transpose(0, -1) if form.time_major else w


def _forms() -> list[Form]:
    """Every option of every dimension with each normalisation (the others drawn by a fixed
    seed), plus the late shifts."""
    rng = random.Random(36)
    dims = {
        "projection": PROJECTIONS,
        "inner_bias": (False, True),
        "queries": (1, 3),
        "time_major": (False, True),
        "scale": SCALES,
        "shift": SHIFTS,
        "mask": MASKS,
    }
    forms = {}
    for normalize, (dim, options) in itertools.product(NORMALIZE, dims.items()):
        for option in options:
            pick = {d: rng.choice(o) for d, o in dims.items()}
            pick[dim] = option
            if pick["projection"] == "bmm":
                pick["queries"] = 1
            form = Form(**pick, shift_after_mask=False, normalize=normalize)
            forms[form.name] = form
    for normalize, shift, mask in itertools.product(NORMALIZE, ("number", "param"), MASKS[1:3]):
        form = Form("linear", True, 1, False, "div_number", shift, True, mask, normalize)
        forms[form.name] = form
    return list(forms.values())


FORMS = _forms()


def _inputs(form: Form, batch: int, frames: int):
    gen = torch.Generator().manual_seed(batch * 100 + frames)
    dtype = torch.float64
    memory = torch.randn(frames, batch, K, generator=gen, dtype=dtype)
    memory = memory if form.time_major else memory.transpose(0, 1).contiguous()
    shape = (batch, Q) if form.queries == 1 else (batch, form.queries, Q)
    state = torch.randn(shape, generator=gen, dtype=dtype)
    lengths = torch.tensor([frames] + [max(1, frames - 1 - i) for i in range(batch - 1)])
    return memory, state, torch.arange(frames) < lengths.unsqueeze(1)


def test_the_forms_cover_every_option():
    names = {f.name for f in FORMS}
    assert len(names) == len(FORMS) >= 40
    for normalize in NORMALIZE:
        mine = [f for f in FORMS if f.normalize == normalize]
        for attr, options in (
            ("projection", PROJECTIONS),
            ("scale", SCALES),
            ("shift", SHIFTS),
            ("mask", MASKS),
        ):
            assert {getattr(f, attr) for f in mine} == set(options), (normalize, attr)
    assert any(not f.converts() for f in FORMS) and any(f.converts() for f in FORMS)


@pytest.mark.parametrize("form", FORMS, ids=[f.name for f in FORMS])
def test_every_rewrite_passes_the_probe(form):
    torch.manual_seed(0)
    original = nn.ModuleDict({"att": Generated(form)}).double()
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    first = _inputs(form, 4, 7)
    _assert_close([model["att"](*first)], [original["att"](*first)], torch.float64, "first call")
    # a refusal by the probe is a wrong rewrite: a bug, whatever the form
    assert not any("differs from the fused op" in s.reason for s in report.skipped), str(report)
    converted = [r.path for r in report.replaced]
    if not form.converts():
        assert converted == [], str(report)
        return
    assert converted == ["att"], str(report)
    assert isinstance(model["att"], FusedStandIn)
    for batch, frames in ((3, 5), (2, 9)):
        args = _inputs(form, batch, frames)
        calls = TracedWeights.calls
        got, want = _run(model["att"], args), _run(original["att"], args)
        assert TracedWeights.calls > calls
        _assert_close(got[0], want[0], torch.float64, "outputs")
        _assert_close(got[1], want[1], torch.float64, "gradients")
