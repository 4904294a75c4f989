"""The whole input range of the other fused ops, swept against float64 plain PyTorch.

0.1.0's CPU attention kernel returned NaN for pre-activations in ~44..79, a band that random small
inputs and a few extremes never reached (tests/ops/test_range_sweep.py sweeps that op). Here the same
sweep runs over the other fused ops: the magnitude of each pre-activation walks densely through
0..120 (step 0.5) and then sparsely to 1e4 (15 log-spaced values), both signs, one batch row per
signed magnitude, and every output and every gradient is compared per batch row with plain PyTorch
in float64 on the same (dtype-rounded) inputs:

- the GRU recurrence (``gru_layer``'s op), the GRU cell and the LSTM cell ops
  (seq2seq_fast/ops/recurrent.py): each hidden unit of a row has its own pattern of gate signs
  (every combination: gates saturating in different directions) and of splits of a gate's
  pre-activation between the inputs part and the hidden part (all in one, halves, opposite large
  signs, cancelling parts); the LSTM's cell state runs through the range too;
- the location-aware step ops (``_location_attention_fwd`` / ``_bwd``, seq2seq_fast/ops/
  location_attention.py), with q + projected + conv W^T + bias driven through the range in seven splits;
- linear + cross-entropy (seq2seq_fast/ops/linear_cross_entropy.py), logits up to 1e4 of either
  sign, with and without label smoothing, rows ignored by ignore_index;
- the attention op's score bias under the sigmoid normalisation: scores e through the signed
  magnitudes, b through the exp overflow and underflow bands of float32 and float64, both signs.

Tolerances, per batch row as max|got - want| / (1 + max|want|). float64: 1e-10. float32 and
bfloat16: the rule of tests/ops/test_bf16.py, per row: at most twice plain PyTorch's error in that
dtype against the float64 truth (the worst of the sums' orders the ops use, where they differ),
plus a floor (bfloat16: 2 eps of the value's scale; float32: 64 ulp, and for the location step
the fast tanh's bound as tests/reliability/__init__.py's fp32_tolerance). In float32 the doubled term
matters only where large parts cancel: any float32 sum of them rounds by an ulp of the parts.
A gradient summed over the batch (a shared weight's) is compared as a whole, by the same rule.

The C++ ops run on every CPU instruction set this machine has (SEQ2SEQ_FAST_ISA, read on every
call; portable always). float64 has the portable table only today; its cases run under every ISA
anyway, so that a future float64 SIMD table is swept too. linear + cross-entropy is plain PyTorch
(no C++ kernel, no ISA choice): it runs once per dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq_fast.ops import recurrent
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.ops.linear_cross_entropy import linear_cross_entropy
from seq2seq_fast.ops.reference import additive_attention_ref
from tests.reliability import fp32_tolerance, requires_cpp

ISAS = ("portable", "avx2", "avx512")
COVERED_ISAS: set[str] = set()  # read by tests/conftest.py's terminal summary
BF16 = torch.bfloat16
F64 = torch.float64
TOL64 = 1e-10
TOL32 = 64 * torch.finfo(torch.float32).eps  # the float32 floor, ~7.6e-6 of the row's scale
SPLITS = ("inputs", "hidden", "same", "opposite", "cancel")
DTYPE_NAMES = {torch.float32: "fp32", F64: "fp64", BF16: "bf16"}


def magnitudes() -> Tensor:
    """0..120 every 0.5, then 15 log-spaced magnitudes up to 1e4 (float64)."""
    dense = torch.arange(0, 241, dtype=F64) * 0.5
    sparse = torch.logspace(math.log10(125), 4, 15, dtype=F64)
    return torch.cat([dense, sparse])


def signed_magnitudes() -> Tensor:
    """[512]: every magnitude with either sign, one batch row each."""
    mags = magnitudes()
    return torch.cat([mags, -mags])


def _use_isa(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    if torch.ops.seq2seq_fast._cpu_isa() != isa:
        pytest.skip(f"this CPU has no {isa}: its kernels cannot run here")


def isa_cases(dtypes: Sequence[torch.dtype]) -> list:
    return [
        pytest.param(isa, dtype, id=f"{isa}-{DTYPE_NAMES[dtype]}")
        for isa in ISAS
        for dtype in dtypes
    ]


# --- comparison --------------------------------------------------------------------------------


def row_errors(got: Tensor, want: Tensor) -> tuple[Tensor, Tensor]:
    """Per batch row: (max|got - want| / (1 + max|want|) in float64, inf where got is not finite;
    the flat index within the row of the worst element)."""
    got = got.detach().double().reshape(got.shape[0], -1)
    want = want.detach().double().reshape(want.shape[0], -1)
    if got.shape[1] == 0:
        zeros = torch.zeros(got.shape[0], dtype=F64)
        return zeros, zeros.long()
    diff = (got - want).abs().nan_to_num(nan=math.inf)
    worst, where = diff.max(1)
    return worst / (1 + want.abs().amax(1)), where


def row_scale(want: Tensor) -> Tensor:
    """max|want| per batch row."""
    want = want.detach().double().reshape(want.shape[0], -1)
    return want.abs().amax(1) if want.shape[1] else torch.zeros(want.shape[0], dtype=F64)


def floor_of(dtype: torch.dtype, want: Tensor) -> Tensor:
    """The dtype's floor per row, in the units of :func:`row_errors`: float64 1e-10, float32
    TOL32, bfloat16 2 eps of the row's scale max(1, max|want|) (tests/ops/test_bf16.py)."""
    scale = row_scale(want)
    if dtype == BF16:
        eps = torch.finfo(BF16).eps
        return 2 * eps * scale.clamp(min=1.0) / (1 + scale)
    return torch.full_like(scale, TOL64 if dtype == F64 else TOL32)


def allowed_rows(dtype: torch.dtype, truth: Sequence[Tensor], plains: Sequence[Sequence[Tensor]]):
    """Per output, the allowed row errors: the floor plus twice the largest error of the plain
    PyTorch runs in dtype (``plains``: one list of outputs per association; none for float64)."""
    allowed = []
    for i, want in enumerate(truth):
        limit = floor_of(dtype, want)
        if dtype != F64:
            plain = torch.stack([row_errors(p[i], want)[0] for p in plains]).amax(0)
            limit = limit + 2 * plain.nan_to_num(posinf=0.0)
        allowed.append(limit)
    return allowed


class Sweep:
    """Collects the failures of one case's comparisons; :meth:`finish` asserts there are none,
    listing per output which rows (magnitudes) failed and by how much."""

    def __init__(self, title: str, labels: Sequence[str]) -> None:
        self.title = title
        self.labels = labels
        self.failures: list[str] = []

    def rows(
        self,
        name: str,
        got: Tensor,
        want: Tensor,
        limit: Tensor,
        where: Callable[[int], str] | None = None,
    ) -> None:
        """got, want [B, ...], compared per batch row against limit [B]."""
        assert got.shape == want.shape, f"{self.title} {name}: {got.shape} != {want.shape}"
        self._finite(name, got, want)
        errs, index = row_errors(got, want)
        bad = (~(errs <= limit)).nonzero().flatten().tolist()
        if bad:
            worst = sorted(bad, key=lambda b: -float(errs[b]))[:8]
            shown = []
            for b in worst:
                at = f" at {where(int(index[b]))}" if where is not None else ""
                shown.append(f"{self.labels[b]}: {float(errs[b]):.3g} > {float(limit[b]):.3g}{at}")
            rows_listed = ", ".join(self.labels[b] for b in bad[:40])
            more = f" (+{len(bad) - 40} more)" if len(bad) > 40 else ""
            self.failures.append(
                f"{name}: {len(bad)} of {len(errs)} rows over the limit: {rows_listed}{more}; "
                "worst: " + "; ".join(shown)
            )

    def whole(self, name: str, got: Tensor, want: Tensor, limit: float) -> None:
        """A tensor summed over the batch (a shared parameter's gradient), compared as a whole."""
        assert got.shape == want.shape, f"{self.title} {name}: {got.shape} != {want.shape}"
        self._finite(name, got.reshape(1, -1), want.reshape(1, -1))
        err = float(row_errors(got.reshape(1, -1), want.reshape(1, -1))[0][0])
        if not err <= limit:
            self.failures.append(f"{name} (summed over all rows): error {err:.3g} > {limit:.3g}")

    def _finite(self, name: str, got: Tensor, want: Tensor) -> None:
        want_finite = torch.isfinite(want.detach().double()).reshape(want.shape[0], -1)
        got_finite = torch.isfinite(got.detach().double()).reshape(got.shape[0], -1)
        bad = (want_finite & ~got_finite).any(1).nonzero().flatten().tolist()
        if bad:
            labels = self.labels if got.shape[0] == len(self.labels) else None
            rows_listed = ", ".join(labels[b] if labels else "all" for b in bad[:40])
            self.failures.append(
                f"{name}: not finite where the reference is, in {len(bad)} rows: {rows_listed}"
            )

    def finish(self) -> None:
        assert not self.failures, f"{self.title}:\n" + "\n".join(self.failures)


def whole_limit(dtype: torch.dtype, want: Tensor, plains: Sequence[Tensor]) -> float:
    """The allowed error of a whole (batch-summed) tensor, as :func:`allowed_rows` for one row."""
    flat = want.reshape(1, -1)
    limit = float(floor_of(dtype, flat)[0])
    if dtype != F64:
        plain = [float(row_errors(p.reshape(1, -1), flat)[0][0]) for p in plains]
        limit += 2 * max((e for e in plain if math.isfinite(e)), default=0.0)
    return limit


_REFERENCES: dict = {}


def cached(key, make: Callable):
    """The references of a case are the same under every ISA: formed once per key."""
    if key not in _REFERENCES:
        _REFERENCES[key] = make()
    return _REFERENCES[key]


def magnitude_labels(mags: Tensor) -> list[str]:
    return [f"p={float(m):+g}" for m in mags]


# --- the recurrent ops: gate patterns ----------------------------------------------------------


def gate_patterns(num_gates: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every combination of gate signs, each with splits of its pre-activation that differ between
    the gates: [(signs, splits)], 2^G * 5 patterns."""
    patterns = []
    for k in range(5 * 2**num_gates):
        code, shift = k % 2**num_gates, k // 2**num_gates
        signs = tuple(1 if code >> g & 1 else -1 for g in range(num_gates))
        splits = tuple(SPLITS[(shift + g) % len(SPLITS)] for g in range(num_gates))
        patterns.append((signs, splits))
    return patterns


def split_parts(total: Tensor, split: str, noise_in: Tensor, noise_hidden: Tensor):
    """(inputs part, hidden part) of a gate's pre-activation ``total`` [B] (float64)."""
    if split == "inputs":
        return total + noise_in, noise_hidden
    if split == "hidden":
        return noise_in, total + noise_hidden
    if split == "same":
        return total / 2 + noise_in, total / 2 + noise_hidden
    if split == "opposite":  # parts of opposite signs, each larger than the sum
        sign = torch.where(total < 0, -1.0, 1.0).to(F64)
        c = 15.0 + total.abs() / 4
        return total + sign * c + noise_in, -sign * c + noise_hidden
    # "cancel": the magnitude in each part, the sum near 0
    return total + noise_in, -total + noise_hidden


def cell_gate_inputs(num_gates: int, mags: Tensor, seed: int):
    """(gates_in, gates_hidden [B, G*H], H, patterns, unit_pattern): unit j of every row follows
    pattern j % len(patterns); H = len(patterns) + 3 (a vector tail at every SIMD width)."""
    patterns = gate_patterns(num_gates)
    hidden = len(patterns) + 3
    gen = torch.Generator().manual_seed(seed)
    batch = mags.shape[0]
    gi = torch.empty(batch, num_gates, hidden, dtype=F64)
    gh = torch.empty(batch, num_gates, hidden, dtype=F64)
    for j in range(hidden):
        signs, splits = patterns[j % len(patterns)]
        for g in range(num_gates):
            noise = torch.randn(2, batch, generator=gen, dtype=F64) * 0.5
            gi[:, g, j], gh[:, g, j] = split_parts(signs[g] * mags, splits[g], noise[0], noise[1])
    return gi.reshape(batch, -1), gh.reshape(batch, -1), hidden, patterns


def describe_unit(patterns, gate_names: str, unit: int, shift: int = 0) -> str:
    signs, splits = patterns[(unit + shift) % len(patterns)]
    parts = [
        f"{name}{'+' if s > 0 else '-'}({split})"
        for name, s, split in zip(gate_names, signs, splits, strict=True)
    ]
    return f"unit {unit} [{' '.join(parts)}]"


def gate_where(patterns, gate_names: str, hidden: int) -> Callable[[int], str]:
    """Flat index within a row of a [B, G*H] gate tensor -> which gate of which unit."""
    return lambda i: (
        f"gate {gate_names[i // hidden]} of " + describe_unit(patterns, gate_names, i % hidden)
    )


def unit_where(patterns, gate_names: str, hidden: int) -> Callable[[int], str]:
    return lambda i: describe_unit(patterns, gate_names, i % hidden)


def grad_weights(shapes: Sequence[torch.Size], seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def outputs_and_grads(fn, inputs: Sequence[Tensor | None], dtype, weights_seed: int):
    """[outputs..., grads of every non-None input] of sum(out * w) for fixed random w."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    weights = grad_weights([o.shape for o in outs], weights_seed)
    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, weights, strict=True))
    wanted = [t for t in leaves if t is not None]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, wanted))


# --- references (plain ops, any dtype) ----------------------------------------------------------


def gru_step_ref(gi: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    """nn.GRUCell's gates from the two projections (biases included)."""
    H = h.shape[1]
    r = torch.sigmoid(gi[:, :H] + gh[:, :H])
    z = torch.sigmoid(gi[:, H : 2 * H] + gh[:, H : 2 * H])
    n = torch.tanh(gi[:, 2 * H :] + r * gh[:, 2 * H :])
    return (1 - z) * n + z * h


def lstm_step_ref(gi: Tensor, gh: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    i, f, g, o = (gi + gh).chunk(4, dim=1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def gru_recurrence_ref(gx: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    h, outs = h0, []
    for t in range(gx.shape[1]):
        gh = F.linear(h, w_hh, b_hh)
        h = gru_step_ref(gx[:, t], gh, h)
        outs.append(h)
    return torch.stack(outs, dim=1)


def gru_recurrence_op(gx, h0, w_hh, b_hh):
    return recurrent._GRURecurrence.apply(gx, h0, w_hh, b_hh)


def test_references_equal_torch_modules():
    """The plain references used below against nn.GRU and nn.LSTMCell (float64): the identity as
    the input weight makes the modules' input projection the given gate inputs."""
    torch.manual_seed(0)
    B, T, H = 4, 3, 5
    gx = torch.randn(B, T, 3 * H, dtype=F64) * 5
    h0 = torch.randn(B, H, dtype=F64)
    rnn = nn.GRU(3 * H, H, batch_first=True).double()
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(torch.eye(3 * H))
        rnn.bias_ih_l0.zero_()
    want, _ = rnn(gx, h0.unsqueeze(0))
    got = gru_recurrence_ref(gx, h0, rnn.weight_hh_l0, rnn.bias_hh_l0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    cell = nn.LSTMCell(4 * H, H).double()
    gi, gh = torch.randn(2, B, 4 * H, dtype=F64) * 5
    c = torch.randn(B, H, dtype=F64) * 3
    with torch.no_grad():
        cell.weight_ih.copy_(torch.eye(4 * H))
        cell.weight_hh.zero_()
        cell.bias_ih.zero_()
        cell.bias_hh.zero_()
    want_h, want_c = cell(gi + gh, (torch.zeros(B, H, dtype=F64), c))
    got_h, got_c = lstm_step_ref(gi, gh, c)
    torch.testing.assert_close(got_h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-12)


def test_the_sweeps_reach_every_band():
    """The sweep itself: both signs through the old NaN band, past 120 and at 1e4; every gate
    sign combination with opposite large parts; gate totals at the magnitude."""
    mags = signed_magnitudes()
    assert mags.shape == (512,)
    for lo, hi in ((44, 80), (80, 120), (9000, 10001)):
        assert ((mags >= lo) & (mags < hi)).any() and ((-mags >= lo) & (-mags < hi)).any()
    assert torch.allclose(magnitudes()[:241], torch.arange(241, dtype=F64) * 0.5)
    for gates in (3, 4):
        patterns = gate_patterns(gates)
        assert len({signs for signs, _ in patterns}) == 2**gates
        for g in range(gates):
            assert {splits[g] for _, splits in patterns} == set(SPLITS)
        gi, gh, hidden, _ = cell_gate_inputs(gates, mags, seed=0)
        gi, gh = gi.view(512, gates, hidden), gh.view(512, gates, hidden)
        opposite = (gi.sign() * gh.sign() < 0) & (gi.abs() > 40) & (gh.abs() > 40)
        assert opposite.any(dim=(0, 2)).all()  # every gate somewhere
        big = mags.abs() >= 50
        total = (gi + gh)[big].abs()
        for j in range(hidden):  # at the magnitude, but where the parts cancel
            signs, splits = patterns[j % len(patterns)]
            for g in range(gates):
                if splits[g] == "cancel":
                    assert total[:, g, j].max() < 5
                else:
                    assert torch.allclose(total[:, g, j], mags.abs()[big], atol=5)
    h = location_inputs(32, 8, 0.0, seed=0)
    total = h["query"].mean((1, 2)) + h["pre_keys"].mean((1, 2)) + h["bias"].mean()
    cancel = torch.tensor([split == "cancel" for split, _ in h["rows"]])
    signed = torch.tensor([p for _, p in h["rows"]], dtype=F64) * h["sigma"].mean()
    assert torch.allclose(total[~cancel], signed[~cancel], rtol=0.02, atol=0.5)


# --- the GRU recurrence (gru_layer's op) --------------------------------------------------------

GRU_STEPS = 3
GRU_GATES = "rzn"


def gru_layer_inputs(mags: Tensor, hidden_bias: float | None, seed: int = 0):
    """(gx [B, T, 3H], h0, w_hh, b_hh or None, H, patterns): at step t unit j follows pattern
    (j + 11 t) % 40 with its gates' totals at the row's magnitude; b_hh = +-hidden_bias per unit,
    cancelled out of gx on half the units (the inputs part and hidden part opposite) and shifting
    the total on the other half."""
    patterns = gate_patterns(3)
    H = len(patterns) + 3
    gen = torch.Generator().manual_seed(seed)
    B = mags.shape[0]
    sigma = torch.where(torch.arange(3 * H) % 3 == 0, -1.0, 1.0).to(F64)
    b_hh = None
    if hidden_bias is not None:
        b_hh = hidden_bias * sigma + torch.randn(3 * H, generator=gen, dtype=F64) * 0.3
    gx = torch.randn(B, GRU_STEPS, 3, H, generator=gen, dtype=F64) * 0.5
    for t in range(GRU_STEPS):
        for j in range(H):
            signs, _ = patterns[(j + 11 * t) % len(patterns)]
            for g in range(3):
                gx[:, t, g, j] += signs[g] * mags
                if b_hh is not None and (j + t) % 2 == 0:
                    gx[:, t, g, j] -= hidden_bias * sigma[g * H + j]
    h0 = torch.tanh(torch.randn(B, H, generator=gen, dtype=F64))
    w_hh = torch.randn(3 * H, H, generator=gen, dtype=F64) * (2.0 / math.sqrt(H))
    return gx.reshape(B, GRU_STEPS, 3 * H), h0, w_hh, b_hh, H, patterns


@requires_cpp
@pytest.mark.parametrize("hidden_bias", [None, 60.0], ids=["no-bias", "bias60"])
@pytest.mark.parametrize("isa,dtype", isa_cases([torch.float32, F64, BF16]))
def test_gru_recurrence_over_the_whole_range(isa, dtype, hidden_bias, monkeypatch):
    _use_isa(isa, monkeypatch)
    mags = signed_magnitudes()
    gx, h0, w_hh, b_hh, H, patterns = gru_layer_inputs(mags, hidden_bias)
    inputs = [t if t is None else t.to(dtype) for t in (gx, h0, w_hh, b_hh)]
    exact = [t if t is None else t.double() for t in inputs]
    truth, plains = cached(
        ("gru", dtype, hidden_bias),
        lambda: (
            outputs_and_grads(gru_recurrence_ref, exact, F64, 7),
            [] if dtype == F64 else [outputs_and_grads(gru_recurrence_ref, inputs, dtype, 7)],
        ),
    )
    ours = outputs_and_grads(gru_recurrence_op, inputs, dtype, 7)
    for out in ours:
        assert out.dtype == dtype

    names = ["output", "grad gx", "grad h0", "grad w_hh", "grad b_hh"][: len(truth)]
    per_row = 3  # output, grad gx, grad h0 have batch rows; w_hh's and b_hh's are sums
    allowed = allowed_rows(dtype, truth[:per_row], [p[:per_row] for p in plains])
    sweep = Sweep(f"GRU recurrence, {DTYPE_NAMES[dtype]}, {isa}", magnitude_labels(mags))

    def step_unit(i: int) -> str:  # output [T, H]
        t, j = divmod(i, H)
        return f"step {t} " + describe_unit(patterns, GRU_GATES, j, 11 * t)

    def step_gate(i: int) -> str:  # grad gx [T, 3H]
        t, rest = divmod(i, 3 * H)
        g, j = divmod(rest, H)
        return f"step {t} gate {GRU_GATES[g]} of " + describe_unit(patterns, GRU_GATES, j, 11 * t)

    wheres = [step_unit, step_gate, lambda j: describe_unit(patterns, GRU_GATES, j)]
    for i in range(per_row):
        sweep.rows(names[i], ours[i], truth[i], allowed[i], wheres[i])
    for i in range(per_row, len(truth)):
        limit = whole_limit(dtype, truth[i], [p[i] for p in plains])
        sweep.whole(names[i], ours[i], truth[i], limit)
    sweep.finish()
    COVERED_ISAS.add(isa)


# --- the GRU and LSTM cell ops ------------------------------------------------------------------


@requires_cpp
@pytest.mark.parametrize("isa,dtype", isa_cases([torch.float32, F64, BF16]))
def test_gru_cell_over_the_whole_range(isa, dtype, monkeypatch):
    _use_isa(isa, monkeypatch)
    mags = signed_magnitudes()
    gi, gh, H, patterns = cell_gate_inputs(3, mags, seed=1)
    h = torch.tanh(
        torch.randn(mags.shape[0], H, generator=torch.Generator().manual_seed(2), dtype=F64)
    )
    inputs = [t.to(dtype) for t in (gi, gh, h)]
    truth, plains = cached(
        ("gru cell", dtype),
        lambda: (
            outputs_and_grads(gru_step_ref, [t.double() for t in inputs], F64, 3),
            [] if dtype == F64 else [outputs_and_grads(gru_step_ref, inputs, dtype, 3)],
        ),
    )
    ours = outputs_and_grads(recurrent.gru_cell, inputs, dtype, 3)
    for out in ours:
        assert out.dtype == dtype
    allowed = allowed_rows(dtype, truth, plains)
    sweep = Sweep(f"GRU cell, {DTYPE_NAMES[dtype]}, {isa}", magnitude_labels(mags))
    unit, gate = unit_where(patterns, GRU_GATES, H), gate_where(patterns, GRU_GATES, H)
    names = ("output", "grad gates_in", "grad gates_hidden", "grad h")
    for name, got, want, limit, where in zip(
        names, ours, truth, allowed, (unit, gate, gate, unit), strict=True
    ):
        sweep.rows(name, got, want, limit, where)
    sweep.finish()
    COVERED_ISAS.add(isa)


def lstm_inputs(mags: Tensor, seed: int = 4):
    """Gate inputs as :func:`cell_gate_inputs`; the cell state c at +-p/2 (units j % 3 = 0, 1)
    or small (j % 3 = 2), so that tanh(c') runs through the range too."""
    gi, gh, H, patterns = cell_gate_inputs(4, mags, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sign_c = torch.tensor([(1.0, -1.0, 0.0)[j % 3] for j in range(H)], dtype=F64)
    c = mags[:, None] * sign_c / 2 + torch.randn(mags.shape[0], H, generator=gen, dtype=F64)
    return gi, gh, c, H, patterns


@requires_cpp
@pytest.mark.parametrize("isa,dtype", isa_cases([torch.float32, F64, BF16]))
def test_lstm_cell_over_the_whole_range(isa, dtype, monkeypatch):
    _use_isa(isa, monkeypatch)
    mags = signed_magnitudes()
    gi, gh, c, H, patterns = lstm_inputs(mags)
    inputs = [t.to(dtype) for t in (gi, gh, c)]
    truth, plains = cached(
        ("lstm cell", dtype),
        lambda: (
            outputs_and_grads(lstm_step_ref, [t.double() for t in inputs], F64, 5),
            [] if dtype == F64 else [outputs_and_grads(lstm_step_ref, inputs, dtype, 5)],
        ),
    )
    ours = outputs_and_grads(recurrent.lstm_cell, inputs, dtype, 5)
    for out in ours:
        assert out.dtype == dtype
    allowed = allowed_rows(dtype, truth, plains)
    sweep = Sweep(f"LSTM cell, {DTYPE_NAMES[dtype]}, {isa}", magnitude_labels(mags))

    def unit(i: int) -> str:
        state = ("c +p/2", "c -p/2", "c small")[i % H % 3]
        return describe_unit(patterns, "ifgo", i % H) + f", {state}"

    gate = gate_where(patterns, "ifgo", H)
    names = ("h", "c", "grad gates_in", "grad gates_hidden", "grad c")
    for name, got, want, limit, where in zip(
        names, ours, truth, allowed, (unit, unit, gate, gate, unit), strict=True
    ):
        sweep.rows(name, got, want, limit, where)
    sweep.finish()
    COVERED_ISAS.add(isa)


# --- the location-aware step ops ----------------------------------------------------------------

LOCATION_SPLITS = (
    "same",
    "query",
    "projected",
    "location",
    "query-vs-keys",
    "proj-vs-loc",
    "cancel",
)
LOCATION_FRAMES = 6
LOCATION_VALUES = 3


def location_inputs(hidden: int, filters: int, bias_shift: float, seed: int = 0):
    """The step's inputs in float64, one batch row per (split, signed magnitude p): the
    pre-activation q + P + conv W^T + bias of unit h is about sigma_h * p (sigma_h = -1 on every
    third unit, else +1), its parts split as named; the query carries -bias_shift * sigma, so that
    the bias moves the parts but not the sum."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(split, float(p)) for split in LOCATION_SPLITS for p in signed_magnitudes()]
    B, T, A, C = len(rows), LOCATION_FRAMES, hidden, filters

    def noise(*size, s=0.5):
        return torch.randn(*size, generator=gen, dtype=F64) * s

    sigma = torch.where(torch.arange(A) % 3 == 2, -1.0, 1.0).to(F64)
    parts = torch.zeros(B, 3, dtype=F64)  # (query, projected, location) per row
    for b, (split, p) in enumerate(rows):
        c = 15.0 + abs(p) / 4
        s = math.copysign(1.0, p)
        parts[b] = torch.tensor(
            {
                "same": (p / 3, p / 3, p / 3),
                "query": (p, 0.0, 0.0),
                "projected": (0.0, p, 0.0),
                "location": (0.0, 0.0, p),
                "query-vs-keys": (p + s * c, -s * c / 2, -s * c / 2),
                "proj-vs-loc": (0.0, p + s * c, -s * c),
                "cancel": (p, 0.0, -p),
            }[split],
            dtype=F64,
        )
    bias = bias_shift * sigma + noise(A, s=0.3)
    query = noise(B, 1, A) + (parts[:, 0, None, None] - bias_shift) * sigma
    projected = noise(B, T, A) + parts[:, 1, None, None] * sigma
    # W's first column is sigma: conv's first channel carries the location part
    dense = torch.cat([sigma[:, None], noise(A, C - 1, s=0.3)], dim=1)
    conv = noise(B, T, C, s=0.3)
    conv[:, :, 0] += parts[:, 2, None]
    conv = conv.reshape(B * T, C)
    values = noise(B, T, LOCATION_VALUES, s=1.0)
    v = noise(A, s=1.0 / math.sqrt(A))
    pre_keys = projected + (conv @ dense.t()).view(B, T, A)
    return dict(
        query=query,
        projected=projected,
        conv=conv,
        dense=dense,
        values=values,
        v=v,
        bias=bias,
        rows=rows,
        sigma=sigma,
        pre_keys=pre_keys,
    )


def location_validity(kind: str, batch: int, seed: int = 1, frames: int = LOCATION_FRAMES):
    gen = torch.Generator().manual_seed(seed)
    if kind == "lengths":
        lengths = torch.randint(0, frames + 1, (batch,), generator=gen)
        lengths[::7] = frames
        lengths[3::11] = 0  # rows with no valid frame
        return lengths, None
    if kind == "mask":
        mask = torch.rand(batch, frames, generator=gen) < 0.7
        mask[::5, 0] = True
        mask[2::13] = False
        return None, mask
    return None, None


LOCATION_NAMES = (
    "context",
    "weights",
    "grad query",
    "grad projected",
    "grad conv",
    "grad values",
    "grad dense",
    "grad v",
    "grad bias",
)
LOCATION_ROWS = 6  # the first six have batch rows; dense's, v's and bias's are sums


def location_reference(t: dict, lengths, mask, dtype, folded: bool = False):
    """[context, weights, grads of query, projected, conv, values, dense, v, bias] by plain ops on
    materialised keys P + conv W^T, in dtype; ``folded``: the bias added to the query first, as
    the kernel adds it."""
    names = ("query", "projected", "conv", "dense", "values", "v", "bias")
    q, p, c, w, val, vv, b = (t[n].detach().to(dtype).requires_grad_(True) for n in names)
    B, T, A = p.shape
    keys = p + (c @ w.t()).view(B, T, A)
    if folded:
        context, weights = additive_attention_ref(
            q + b, keys, val, vv, None, lengths=lengths, mask=mask
        )
    else:
        context, weights = additive_attention_ref(q, keys, val, vv, b, lengths=lengths, mask=mask)
    gc, gw = location_upstream(B, dtype)
    grads = torch.autograd.grad((context, weights), (q, p, c, val, w, vv, b), (gc, gw))
    outs = [context.detach(), weights.detach(), *grads]
    outs[4] = outs[4].reshape(B, -1)  # conv's gradient: [B*T, C] as rows [B, T*C]
    return outs


def location_upstream(batch: int, dtype):
    gen = torch.Generator().manual_seed(9)
    gc = torch.randn(batch, 1, LOCATION_VALUES, generator=gen, dtype=F64)
    gw = torch.randn(batch, 1, LOCATION_FRAMES, generator=gen, dtype=F64)
    return gc.to(dtype), gw.to(dtype)


@requires_cpp
@pytest.mark.parametrize("bias_shift", [0.0, 25.0], ids=["bias0", "bias25"])
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("isa,dtype", isa_cases([torch.float32, F64, BF16]))
def test_location_step_ops_over_the_whole_range(isa, dtype, kind, bias_shift, monkeypatch):
    """The location-aware step's ops (keys formed inside the kernels) as the autograd Function of
    seq2seq_fast/ops/location_attention.py calls them, against plain ops on materialised keys
    (tests/ops/test_location_attention.py) over the whole range. bfloat16: projected's gradient
    is added into a float32 buffer, as the Function's gatherer holds it."""
    _use_isa(isa, monkeypatch)
    hidden, filters = (37, 6) if bias_shift else (32, 8)  # a scalar tail / none; C by dots / rows
    t = location_inputs(hidden, filters, bias_shift)
    names = ("query", "projected", "conv", "dense", "values", "v", "bias")
    t.update({n: t[n].to(dtype) for n in names})  # the truth is of the rounded inputs
    B = len(t["rows"])
    lengths, mask = location_validity(kind, B)
    truth, plains = cached(
        ("location", dtype, kind, bias_shift),
        lambda: (
            location_reference(t, lengths, mask, F64),
            []
            if dtype == F64
            else [location_reference(t, lengths, mask, dtype, folded) for folded in (False, True)],
        ),
    )

    ops = torch.ops.seq2seq_fast
    inputs = (*(t[n] for n in names), lengths, mask)
    context, weights = ops._location_attention_fwd(*inputs)
    gc, gw = location_upstream(B, dtype)
    acc_dtype = torch.float32 if dtype == BF16 else dtype
    acc = torch.zeros_like(t["projected"], dtype=acc_dtype)
    dq, dconv, ddense, dv, dbias = ops._location_attention_bwd(gc, gw, *inputs, weights, acc)
    # the values' gradient as LocationMemory forms it (once for all steps) from the weights
    dvalues = torch.bmm(weights.transpose(1, 2), gc)
    ours = [context, weights, dq, acc, dconv.reshape(B, -1), dvalues, ddense, dv, dbias]
    for i, out in enumerate(ours):
        assert out.dtype == (acc_dtype if i == 3 else dtype), LOCATION_NAMES[i]

    labels = [f"{split} p={p:+g}" for split, p in t["rows"]]
    sweep = Sweep(
        f"location step ({kind}, bias {bias_shift:g}), {DTYPE_NAMES[dtype]}, {isa}", labels
    )
    allowed = allowed_rows(dtype, truth[:LOCATION_ROWS], [p[:LOCATION_ROWS] for p in plains])
    if (
        dtype == torch.float32
    ):  # the score's float32 tanh: sum|v| * TANH_BOUND (tests/ops/test_ops.py)
        allowed = [a + fp32_tolerance(t["v"]) for a in allowed]
    for i in range(LOCATION_ROWS):
        sweep.rows(LOCATION_NAMES[i], ours[i], truth[i], allowed[i])
    for i in range(LOCATION_ROWS, len(truth)):
        limit = whole_limit(dtype, truth[i], [p[i] for p in plains])
        if dtype == torch.float32:
            limit += fp32_tolerance(t["v"])
        sweep.whole(LOCATION_NAMES[i], ours[i], truth[i], limit)
    sweep.finish()
    COVERED_ISAS.add(isa)


# --- the attention op's score bias (sigmoid normalisation) -------------------------------------

# b walks past where exp(+-(e + b)) overflows or underflows in float32 (88.7, 103.9) and float64
# (709.8, 745.1), both signs, up to 1e4; every call's rows carry e through the dense magnitudes
# (0..120 every 0.5, both signs), so that e + b crosses every band in some row, and cancels to
# about 0 in another. (e itself stays within 120: a score of 1e4 takes |v| in the hundreds, and
# then the gradients cancel so much that float32 compares noise with noise.)
SCORE_BIASES = (0.0, 0.5, 5.0, 30.0, 88.0, 89.0, 104.0, 709.0, 710.0, 746.0, 1e3, 1e4)
BIAS_KEYS, BIAS_QUERIES, BIAS_HIDDEN, BIAS_VALUES = 5, 2, 19, 3
BIAS_SUM_V = 150.0  # sum of v: scores up to 120 from pre-activations up to atanh(0.8)
BIAS_NAMES = ("context", "weights", "grad query", "grad keys", "grad values")
BIAS_WHOLE = ("grad v", "grad bias", "grad score_bias")


def score_bias_magnitudes() -> Tensor:
    """[482]: 0..120 every 0.5, both signs."""
    dense = magnitudes()[:241]
    return torch.cat([dense, -dense])


def score_bias_inputs(seed: int = 0) -> list[Tensor]:
    """[query, keys, values, v, bias] in float64, one batch row per magnitude p of
    :func:`score_bias_magnitudes`: every score of row r is p_r within about +-0.1 (v sums to
    BIAS_SUM_V, the query is atanh(p / BIAS_SUM_V), keys and bias noise)."""
    gen = torch.Generator().manual_seed(seed)

    def noise(*size, s):
        return torch.randn(*size, generator=gen, dtype=F64) * s

    mags = score_bias_magnitudes()
    B, H = mags.shape[0], BIAS_HIDDEN
    v = 1 + noise(H, s=0.1)
    v = v * (BIAS_SUM_V / v.sum())
    query = torch.atanh(mags / BIAS_SUM_V)[:, None, None] + noise(B, BIAS_QUERIES, H, s=1e-3)
    keys = noise(B, BIAS_KEYS, H, s=3e-3)
    values = noise(B, BIAS_KEYS, BIAS_VALUES, s=1.0)
    bias = noise(H, s=1e-3)
    return [query, keys, values, v, bias]


def score_bias_call(reference: bool, lengths, mask):
    """f(query, keys, values, v, bias, score_bias) -> (context, weights), sigmoid-normalised."""
    attention = additive_attention_ref if reference else additive_attention

    def f(q, k, x, v, bias, score_bias):
        return attention(
            q, k, x, v, bias, lengths=lengths, mask=mask, normalize="sigmoid", score_bias=score_bias
        )

    return f


@requires_cpp
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
@pytest.mark.parametrize("isa,dtype", isa_cases([torch.float32, F64, BF16]))
def test_score_bias_over_the_whole_range(isa, dtype, kind, monkeypatch):
    """sigmoid(e + b) / sum sigmoid(e + b) by the C++ op with e + b through the overflow bands of
    both dtypes, both signs: outputs and every gradient (the score bias's included) against the
    reference in float64, per batch row (shared parameters' gradients as a whole)."""
    _use_isa(isa, monkeypatch)
    inputs = [t.to(dtype) for t in score_bias_inputs()]  # the truth is of the rounded inputs
    B = inputs[0].shape[0]
    lengths, mask = location_validity(kind, B, frames=BIAS_KEYS)
    labels = magnitude_labels(score_bias_magnitudes())
    sweep = Sweep(f"score bias ({kind}), {DTYPE_NAMES[dtype]}, {isa}", labels)
    for b in sorted({sign * b for b in SCORE_BIASES for sign in (1.0, -1.0)}):
        score_bias = torch.tensor(b, dtype=F64).to(dtype)
        args = [*inputs, score_bias]
        truth, plains = cached(
            ("score bias", dtype, kind, b),
            lambda args=args: (
                outputs_and_grads(score_bias_call(True, lengths, mask), args, F64, 11),
                []
                if dtype == F64
                else [outputs_and_grads(score_bias_call(True, lengths, mask), args, dtype, 11)],
            ),
        )
        ours = outputs_and_grads(score_bias_call(False, lengths, mask), args, dtype, 11)
        for i, out in enumerate(ours):
            assert out.dtype == dtype, (b, i)
        rows = len(BIAS_NAMES)
        allowed = allowed_rows(dtype, truth[:rows], [p[:rows] for p in plains])
        extra = fp32_tolerance(inputs[3]) if dtype == torch.float32 else 0.0
        if dtype != F64:  # e + b rounded to float32 (the kernels' arithmetic), here and in plain
            extra += 2 * torch.finfo(torch.float32).eps * abs(b)
        for i, name in enumerate(BIAS_NAMES):
            sweep.rows(f"{name} (b={b:g})", ours[i], truth[i], allowed[i] + extra)
        for i, name in enumerate(BIAS_WHOLE, start=rows):
            limit = whole_limit(dtype, truth[i], [p[i] for p in plains]) + extra
            sweep.whole(f"{name} (b={b:g})", ours[i], truth[i], limit)
    sweep.finish()
    COVERED_ISAS.add(isa)


# --- linear + cross-entropy --------------------------------------------------------------------

CE_KINDS = ("spread", "far", "tie")  # the others in [-|m|, |m|]; at -m/2..-m; one equal to m
CE_VOCAB, CE_FEATURES = 37, 45


def ce_inputs(seed: int = 0):
    """(x [N, D], weight [V, D], bias [V], target [N], rows) in float64: row (kind, m) has the
    target's logit at m (m through the signed magnitudes) and the others as kind says; x solves
    x W^T + b = logits exactly (W has orthonormal rows). Every 9th row is padding (target -1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(kind, float(m)) for kind in CE_KINDS for m in signed_magnitudes()]
    N, V = len(rows), CE_VOCAB
    q, _ = torch.linalg.qr(torch.randn(CE_FEATURES, V, generator=gen, dtype=F64))
    weight = q.t().contiguous()  # [V, D], orthonormal rows
    bias = torch.randn(V, generator=gen, dtype=F64)
    target = torch.randint(0, V, (N,), generator=gen)
    u = torch.rand(N, V, generator=gen, dtype=F64) * 2 - 1
    m = torch.tensor([mm for _, mm in rows], dtype=F64)
    kind = [k for k, _ in rows]
    logits = u * m.abs()[:, None]
    for b in range(N):
        if kind[b] == "far":
            logits[b] = -m[b] * (0.5 + 0.5 * (u[b] + 1) / 2)
        elif kind[b] == "tie":
            logits[b, (target[b] + 1) % V] = m[b]
    logits[torch.arange(N), target] = m
    x = (logits - bias) @ weight
    target[::9] = -1
    return x, weight, bias, target, rows


def ce_reference(x, weight, bias, target, eps, dtype, autocast=False, order="batch"):
    """(per-row losses [N], mean loss, grads of (mean * count) w.r.t. x, weight, bias) by
    F.linear + F.cross_entropy in dtype (float32 losses under autocast, as the op gives). The
    logits' products by ``order``: one for the batch, or as the op forms them: chunks of 100 of
    the valid rows ("chunks"), each row alone ("rows", its per-row losses)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, bias)]
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        if order == "batch":
            logits = F.linear(*leaves)
        else:
            rows = (target != -1).nonzero().flatten() if order == "chunks" else None
            size = 100 if order == "chunks" else 1
            rows = torch.arange(len(target)) if rows is None else rows
            parts = torch.cat(
                [
                    F.linear(leaves[0][rows[i : i + size]], *leaves[1:])
                    for i in range(0, len(rows), size)
                ]
            )
            logits = parts.new_zeros(len(target), parts.shape[1]).index_copy(0, rows, parts)
        losses = F.cross_entropy(
            logits, target, ignore_index=-1, label_smoothing=eps, reduction="none"
        )
        mean = F.cross_entropy(logits, target, ignore_index=-1, label_smoothing=eps)
    count = int((target != -1).sum())
    grads = torch.autograd.grad(mean * count, leaves)
    return [losses.detach(), mean.detach(), *grads]


def ce_ours(x, weight, bias, target, eps, dtype, autocast=False):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, bias)]
    kwargs = dict(label_smoothing=eps, ignore_index=-1, chunk_rows=100)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        mean = linear_cross_entropy(*leaves, target, **kwargs)
        with torch.no_grad():  # each row alone: the op gives only the mean
            rows = torch.stack(
                [
                    linear_cross_entropy(
                        leaves[0][b : b + 1], *leaves[1:], target[b : b + 1], **kwargs
                    )
                    for b in range(x.shape[0])
                ]
            )
    count = int((target != -1).sum())
    grads = torch.autograd.grad(mean * count, leaves)
    return [rows, mean.detach(), *grads]


CE_CASES = [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(F64, False, id="fp64"),
    pytest.param(BF16, False, id="bf16"),
    pytest.param(torch.float32, True, id="fp32-autocast-bf16"),
]


@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["no-smoothing", "smoothing0.1"])
@pytest.mark.parametrize("dtype,autocast", CE_CASES)
def test_linear_cross_entropy_over_the_whole_range(dtype, autocast, eps):
    """Logits to +-1e4 (the target's at the magnitude; the others spread, far on the other side,
    or one tied with it), label smoothing, padding rows: the per-row losses (each row alone), the
    mean, and every gradient (x's per row) against F.cross_entropy in float64. Plain PyTorch: no
    instruction-set choice."""
    x, weight, bias, target, rows = ce_inputs()
    inputs = [t.to(dtype) for t in (x, weight, bias)]
    truth = ce_reference(*(t.double() for t in inputs), target, eps, F64)
    ours = ce_ours(*inputs, target, eps, dtype, autocast)
    plain_dtype = BF16 if autocast else dtype  # the products' dtype
    plains = []
    if dtype != F64:
        plains = [
            ce_reference(*inputs, target, eps, dtype, autocast, order)
            for order in ("batch", "chunks", "rows")
        ]
    loss_dtype = torch.float32 if dtype == BF16 or autocast else dtype
    assert ours[0].dtype == ours[1].dtype == loss_dtype
    assert all(g.dtype == dtype for g in ours[2:])
    names = ("row loss", "mean loss", "grad x", "grad weight", "grad bias")
    labels = [
        f"{kind} m={m:+g}" + (" (padding)" if target[b] == -1 else "")
        for b, (kind, m) in enumerate(rows)
    ]
    mode = DTYPE_NAMES[dtype] + (" under bf16 autocast" if autocast else "")
    sweep = Sweep(f"linear + cross-entropy (label smoothing {eps:g}), {mode}", labels)

    padding = target == -1
    assert torch.all(ours[2][padding] == 0), "padding rows got a gradient"
    assert torch.all(ours[0][padding] == 0), "a padding row alone has a nonzero loss"
    for i in (0, 2):  # [N] losses as rows of one element, x's gradient per row
        got, want = ours[i].reshape(len(rows), -1), truth[i].reshape(len(rows), -1)
        limit = floor_of(plain_dtype, want)
        if plains:
            plain = [row_errors(p[i].reshape(len(rows), -1), want)[0] for p in plains]
            limit = limit + 2 * torch.stack(plain).amax(0)
        sweep.rows(names[i], got, want, limit)
    for i in (1, 3, 4):
        sweep.whole(
            names[i], ours[i], truth[i], whole_limit(plain_dtype, truth[i], [p[i] for p in plains])
        )
    sweep.finish()
