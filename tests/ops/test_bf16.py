"""bfloat16 on CPU: the fused attention, the location-aware step and the GRU/LSTM ops take
bfloat16 tensors (float32 inside) and serve under torch.autocast("cpu", dtype=torch.bfloat16).

Accuracy rule (as for the Triton kernels' float16/bfloat16): against the float64 truth, each output
and gradient errs at most twice as much as plain PyTorch computing in bfloat16, plus 2 eps of the
value's scale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seq2seq_fast
from bench.harness import peak_extra_bytes
from seq2seq_fast import additive_attention
from seq2seq_fast.nn.attention import BahdanauAttention
from seq2seq_fast.ops import recurrent
from seq2seq_fast.reference import additive_attention_ref
from tests.ops.test_ops import GRAD_NAMES, forward_backward, key_masks, make_inputs

pytestmark = pytest.mark.skipif(
    not seq2seq_fast.fused_available("cpu", torch.float32),
    reason="the C++ extension seq2seq_fast._C is not built",
)

BF16 = torch.bfloat16
EPS = torch.finfo(BF16).eps


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def _assert_within_twice_plain(names, ours, truth, plain):
    for name, out, want, base in zip(names, ours, truth, plain, strict=True):
        assert out.dtype == BF16, f"{name}: {out.dtype}"
        assert torch.isfinite(out).all(), name
        scale = max(1.0, want.abs().max().item())
        allowed = 2 * _max_error(base, want) + 2 * EPS * scale
        err = _max_error(out, want)
        assert err <= allowed, f"{name}: error {err:.3e} > allowed {allowed:.3e}"


# --- the attention op ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,kind",
    [((2, 3, 7, 12, 5), "none"), ((3, 1, 10, 16, 8), "lengths"), ((2, 16, 16, 32, 16), "mask")],
    ids=["train", "decode", "mask"],
)
def test_attention_bf16_within_twice_plain_pytorch_error(shape, kind):
    batch, num_queries, num_keys, _, value_dim = shape
    inputs = make_inputs(*shape, torch.float64, seed=19)
    lengths, mask = key_masks(kind, batch, num_keys, seed=19)
    gen = torch.Generator().manual_seed(21)
    gc = torch.randn(batch, num_queries, value_dim, generator=gen, dtype=torch.float64)
    gw = torch.randn(batch, num_queries, num_keys, generator=gen, dtype=torch.float64)

    def run(fn, dtype):
        cast = [t.to(dtype) for t in inputs]
        context, weights, grads = forward_backward(
            fn, cast, lengths, mask, gc.to(dtype), gw.to(dtype)
        )
        return [context, weights, *grads]

    names = ("context", "weights", *(f"grad {n}" for n in GRAD_NAMES))
    truth = run(additive_attention_ref, torch.float64)
    _assert_within_twice_plain(
        names, run(additive_attention, BF16), truth, run(additive_attention_ref, BF16)
    )


ISAS = ("portable", "avx2", "avx512")


def _use_isa(isa, monkeypatch):
    monkeypatch.setenv("SEQ2SEQ_FAST_ISA", isa)
    if torch.ops.seq2seq_fast._cpu_isa() != isa:
        pytest.skip(f"this CPU has no {isa}")


def _bf16_against_plain(inputs, lengths, mask, *, step=False, strided=False, seed=23):
    """Every output and gradient of the fused op in bfloat16 within twice plain PyTorch's bfloat16
    error against the float64 truth. step: query [B, H] (a decoding step); strided: every input a
    non-contiguous slice of a wider buffer."""
    query = inputs[0]
    gen = torch.Generator().manual_seed(seed)
    ctx_shape = (query.shape[0], query.shape[1], inputs[2].shape[-1])
    gc = torch.randn(ctx_shape, generator=gen, dtype=torch.float64)
    gw = torch.randn((*query.shape[:2], inputs[1].shape[1]), generator=gen, dtype=torch.float64)
    if step:
        inputs = (query[:, 0], *inputs[1:])
        gc, gw = gc[:, 0], gw[:, 0]

    def cast(t, dtype):
        t = t.to(dtype)
        if not strided:
            return t
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=dtype)
        wide[..., ::2] = t
        out = wide[..., ::2]
        assert not out.is_contiguous()
        return out

    def run(fn, dtype):
        context, weights, grads = forward_backward(
            fn, [cast(t, dtype) for t in inputs], lengths, mask, gc.to(dtype), gw.to(dtype)
        )
        return [context, weights, *grads]

    names = ("context", "weights", *(f"grad {n}" for n in GRAD_NAMES))
    truth = run(additive_attention_ref, torch.float64)
    _assert_within_twice_plain(
        names, run(additive_attention, BF16), truth, run(additive_attention_ref, BF16)
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "shape,kind,step,strided",
    [
        ((3, 5, 9, 12, 7), "lengths", False, False),  # H not a multiple of 16: packed keys
        ((2, 1, 11, 16, 5), "mask", True, False),  # a decoding step: raw bfloat16 keys rows
        ((3, 1, 13, 32, 8), "lengths", True, True),  # strided step, empty row
        ((1, 24, 10, 16, 6), "none", False, False),  # one batch row: queries split over items
        ((2, 6, 7, 20, 9), "mask", False, True),  # strided, an all-masked row
        ((4, 1, 21, 64, 8), "lengths", True, False),  # a step: 8-key, 4-key and single tiles
        ((2, 1, 33, 1024, 16), "none", True, False),  # a wide step: 1024 tanh terms a score
    ],
    ids=[
        "packed",
        "step-raw-keys",
        "step-strided",
        "split-rows",
        "strided-mask",
        "step-h64",
        "step-wide",
    ],
)
def test_attention_bf16_every_path_and_isa(isa, shape, kind, step, strided, monkeypatch):
    _use_isa(isa, monkeypatch)
    inputs = make_inputs(*shape, torch.float64, seed=29)
    lengths, mask = key_masks(kind, shape[0], shape[2], seed=29)
    _bf16_against_plain(inputs, lengths, mask, step=step, strided=strided)


@pytest.mark.parametrize("isa", ISAS)
def test_attention_bf16_product_path_large_preactivations(isa, monkeypatch):
    """Pre-activations where e^{2a} e^{2b} overflows (the capped product path, issue 24): finite
    and within the bfloat16 rule, on every instruction set."""
    _use_isa(isa, monkeypatch)
    inputs = list(make_inputs(2, 6, 8, 16, 4, torch.float64, seed=31))
    inputs[0] = inputs[0].sign() * 30 + inputs[0]  # |q| + |k| up to ~35..40: past the safe sum
    inputs[1] = inputs[1].sign() * 10 + inputs[1]
    _bf16_against_plain(inputs, torch.tensor([8, 5]), None)


def test_attention_bf16_backward_without_saved_weights():
    """The backward op called without the forward's weights recomputes them (in float32) and gives
    what the backward with them gives, up to bfloat16 rounding of the saved weights."""
    inputs = [t.to(BF16) for t in make_inputs(2, 5, 9, 16, 6, torch.float32, seed=37)]
    lengths = torch.tensor([9, 0])
    ctx, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(*inputs, lengths, None, True)
    gc = torch.randn(ctx.shape, generator=torch.Generator().manual_seed(3)).to(BF16)
    bwd = torch.ops.seq2seq_fast.additive_attention_bwd
    with_p = bwd(gc, None, *inputs, lengths, None, ctx, lse, weights)
    without = bwd(gc, None, *inputs, lengths, None, ctx, lse, None)
    for a, b in zip(with_p, without, strict=True):
        assert a.dtype == b.dtype == BF16
        torch.testing.assert_close(
            a.float(), b.float(), rtol=0.02, atol=0.02 * a.abs().max().item()
        )
    assert (without[0][1] == 0).all()  # the empty row's query gradient


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_attention_bf16_extra_memory_is_what_float32_needs(backward):
    """No whole-tensor float32 copies around the kernel: the bfloat16 op's extra memory (beyond
    its inputs and outputs) is at most the float32 op's, which is O(B * Tq)."""
    shape = (8, 1, 64, 256, 256)

    def extra(dtype):
        inputs = [t.to(dtype) for t in make_inputs(*shape, torch.float32, seed=41)]
        inputs[0] = inputs[0][:, 0]
        gc = torch.randn(shape[0], shape[4]).to(dtype)

        def call():
            leaves = [t.detach().requires_grad_(backward) for t in inputs]
            if not backward:
                with torch.no_grad():
                    return additive_attention(*leaves)
            context, _ = additive_attention(*leaves)
            grads = torch.autograd.grad(context, leaves, gc)
            return (context, *grads)

        call()
        return peak_extra_bytes(call, "cpu")

    bf16, fp32 = extra(BF16), extra(torch.float32)
    batch_by_keys = shape[0] * shape[2] * 4  # one float per (row, key): weights-sized
    assert bf16 <= fp32 + batch_by_keys, f"extra bytes: bfloat16 {bf16}, float32 {fp32}"


# --- the location-aware step ops -------------------------------------------------------------------


def _location_case(kind, filters, hidden=24, seed=3):
    """A location-aware step's inputs rounded to bfloat16 (query, projected, conv, dense, values,
    v, bias), lengths, mask, and upstream gradients (float64)."""
    batch, frames, value_dim = 5, 11, 7
    query, projected, values, v, bias = make_inputs(
        batch, 1, frames, hidden, value_dim, torch.float64, seed=seed
    )
    lengths, mask = key_masks(kind, batch, frames, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    conv = torch.randn(batch * frames, filters, generator=gen, dtype=torch.float64)
    dense = torch.randn(hidden, filters, generator=gen, dtype=torch.float64) * 0.3
    gc = torch.randn(batch, 1, value_dim, generator=gen, dtype=torch.float64)
    gw = torch.randn(batch, 1, frames, generator=gen, dtype=torch.float64)
    inputs = [t.to(BF16) for t in (query, projected, conv, dense, values, v, bias)]
    return inputs, lengths, mask, gc.to(BF16), gw.to(BF16)


def _location_plain(inputs, lengths, mask, gc, gw, dtype):
    """(context, weights, grads of query, projected, conv, dense, v, bias) by plain ops on the
    materialised keys P + conv W^T, in dtype."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    q, p, c, w, val, vv, b = leaves
    keys = p + (c @ w.t()).view_as(p)
    context, weights = additive_attention_ref(q, keys, val, vv, b, lengths=lengths, mask=mask)
    wrt = (q, p, c, w, vv, b)  # the values' gradient is formed by the caller, once for all steps
    grads = torch.autograd.grad((context, weights), wrt, (gc.to(dtype), gw.to(dtype)))
    return [context.detach(), weights.detach(), *grads]


@pytest.mark.parametrize("acc_dtype", [torch.float32, BF16], ids=["f32-acc", "bf16-acc"])
@pytest.mark.parametrize("filters", [6, 8])  # conv's gradient by dots / by a product over W's rows
@pytest.mark.parametrize("kind", ["none", "lengths", "mask"])
def test_location_step_bf16_within_twice_plain_pytorch_error(kind, filters, acc_dtype):
    """The location-aware step's ops on bfloat16 tensors: every output and gradient within twice
    plain PyTorch bfloat16's error against the float64 truth; projected's gradient added into a
    float32 (the gatherer's) or bfloat16 buffer that already held a sum."""
    inputs, lengths, mask, gc, gw = _location_case(kind, filters)
    truth = _location_plain(inputs, lengths, mask, gc, gw, torch.float64)
    plain = _location_plain(inputs, lengths, mask, gc, gw, BF16)
    ops = torch.ops.seq2seq_fast
    args = (*inputs, lengths, mask)
    context, weights = ops._location_attention_fwd(*args)
    held = torch.randn(inputs[1].shape, generator=torch.Generator().manual_seed(8)).to(acc_dtype)
    acc = held.clone()
    dq, dconv, ddense, dv, dbias = ops._location_attention_bwd(gc, gw, *args, weights, acc)
    assert acc.dtype == acc_dtype
    dproj = (acc.double() - held.double()).to(BF16)  # (one more rounding: within the 2 eps floor)
    names = ["context", "weights", "query", "projected", "conv", "dense", "v", "bias"]
    ours = [context, weights, dq, dproj, dconv, ddense, dv, dbias]
    _assert_within_twice_plain(names, ours, truth, plain)


def test_location_step_bf16_extra_memory_is_what_float32_needs():
    """No whole-tensor float32 copies in the bfloat16 location step (forward and backward): its
    extra memory is at most the float32 op's, plus the float32 copy of the weight W [H, C]."""
    batch, frames, hidden, filters, value_dim = 8, 64, 256, 32, 256

    def extra(dtype):
        query, projected, values, v, bias = (
            t.to(dtype)
            for t in make_inputs(batch, 1, frames, hidden, value_dim, torch.float32, seed=41)
        )
        gen = torch.Generator().manual_seed(42)
        conv = torch.randn(batch * frames, filters, generator=gen).to(dtype)
        dense = torch.randn(hidden, filters, generator=gen).to(dtype)
        gc = torch.randn(batch, 1, value_dim, generator=gen).to(dtype)
        acc = torch.zeros(projected.shape)  # float32: the gatherer's buffer for either dtype
        args = (query, projected, conv, dense, values, v, bias, None, None)
        ops = torch.ops.seq2seq_fast

        def call():
            context, weights = ops._location_attention_fwd(*args)
            return (context, weights, *ops._location_attention_bwd(gc, None, *args, weights, acc))

        call()
        return peak_extra_bytes(call, "cpu")

    bf16, fp32 = extra(BF16), extra(torch.float32)
    slack = batch * frames * 4 + hidden * filters * 4  # weights-sized, and W in float32
    assert bf16 <= fp32 + slack, f"extra bytes: bfloat16 {bf16}, float32 {fp32}"


def test_location_step_refuses_float16_by_name():
    inputs, lengths, mask, _, _ = _location_case("none", 8)
    half = [t.to(torch.float16) for t in inputs]
    with pytest.raises(
        RuntimeError,
        match="_location_attention_fwd: CPU kernel supports float32, float64 and bfloat16",
    ):
        torch.ops.seq2seq_fast._location_attention_fwd(*half, lengths, mask)


def test_attention_module_under_autocast_runs_the_fused_op():
    """float32 module and inputs under autocast: the fused op runs in bfloat16 (backend="fused":
    no reference fallback), its outputs are bfloat16 and the parameters' gradients float32."""
    torch.manual_seed(0)
    module = BahdanauAttention(12, 10, 16, weight_norm=True, backend="fused")
    query, keys = torch.randn(3, 4, 12), torch.randn(3, 7, 10)
    lengths = torch.tensor([7, 3, 5])
    with torch.autocast("cpu", dtype=BF16):
        context, weights = module(query, keys, lengths=lengths)
    assert context.dtype == BF16 and weights.dtype == BF16
    context.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())
    with torch.no_grad():
        want, _ = module.double()(query.double(), keys.double(), lengths=lengths)
    assert _max_error(context, want) <= 0.05 * want.abs().max().item()


def test_attention_op_takes_bf16_directly():
    inputs = [t.to(BF16) for t in make_inputs(2, 3, 5, 16, 4, torch.float32)]
    context, weights, lse = torch.ops.seq2seq_fast.additive_attention_fwd(*inputs, None, None, True)
    assert context.dtype == BF16 and weights.dtype == BF16 and lse.dtype == torch.float32
    torch.library.opcheck(
        torch.ops.seq2seq_fast.additive_attention_fwd.default, (*inputs, None, None, True)
    )


# --- the recurrent ops -----------------------------------------------------------------------------


def _gru_outputs(rnn: nn.GRU, x, h0, fused: bool):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, h0)]
    if fused:
        out, _ = recurrent.gru_layer(leaves[0], leaves[1], *rnn.parameters())
    else:
        out, _ = rnn(leaves[0], leaves[1].unsqueeze(0))
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), [*leaves, *rnn.parameters()])
    return [out, *grads]


def test_gru_layer_bf16_within_twice_plain_pytorch_error():
    torch.manual_seed(0)
    rnn = nn.GRU(24, 32, batch_first=True).double()
    x, h0 = torch.randn(4, 9, 24, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    truth = _gru_outputs(rnn, x, h0, fused=False)
    rnn_bf16 = rnn.to(BF16)
    plain = _gru_outputs(rnn_bf16, x.to(BF16), h0.to(BF16), fused=False)
    ours = _gru_outputs(rnn_bf16, x.to(BF16), h0.to(BF16), fused=True)
    names = ("output", "grad x", "grad h0", "grad w_ih", "grad w_hh", "grad b_ih", "grad b_hh")
    _assert_within_twice_plain(names, ours, truth, plain)


def test_gru_layer_bf16_input_with_float32_weights():
    """The autocast plan: bfloat16 x (so bfloat16 gx), float32 W_hh / b_hh used as they are in
    the float32 per-step product; W_hh's and b_hh's gradients come back float32, and everything
    stays within twice plain PyTorch bfloat16's error against float64."""
    torch.manual_seed(3)
    rnn = nn.GRU(24, 32, batch_first=True).double()
    x, h0 = torch.randn(4, 9, 24, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    truth = _gru_outputs(rnn, x, h0, fused=False)
    plain = _gru_outputs(rnn.to(BF16), x.to(BF16), h0.to(BF16), fused=False)
    rnn_ih_bf16 = nn.GRU(24, 32, batch_first=True)
    rnn_ih_bf16.load_state_dict(rnn.state_dict())
    rnn_ih_bf16.weight_ih_l0.data = rnn_ih_bf16.weight_ih_l0.data.to(BF16)
    rnn_ih_bf16.bias_ih_l0.data = rnn_ih_bf16.bias_ih_l0.data.to(BF16)
    ours = _gru_outputs(rnn_ih_bf16, x.to(BF16), h0.to(BF16), fused=True)
    dtypes = [t.dtype for t in ours]
    assert dtypes == [BF16, BF16, BF16, BF16, torch.float32, BF16, torch.float32], dtypes
    names = ("output", "grad x", "grad h0", "grad w_ih", "grad w_hh", "grad b_ih", "grad b_hh")
    for name, out, want, base in zip(names, ours, truth, plain, strict=True):
        scale = max(1.0, want.abs().max().item())
        allowed = 2 * _max_error(base, want) + 2 * EPS * scale
        assert _max_error(out, want) <= allowed, name


@pytest.mark.parametrize("cell_type", ["gru", "lstm"])
def test_cells_bf16_within_twice_plain_pytorch_error(cell_type):
    torch.manual_seed(1)
    gates, H = (3, 16) if cell_type == "gru" else (4, 16)
    gen = torch.Generator().manual_seed(2)
    gi, gh = (torch.randn(5, gates * H, generator=gen, dtype=torch.float64) for _ in range(2))
    state = torch.randn(5, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, H, generator=gen, dtype=torch.float64)

    def run(dtype, fused):
        leaves = [t.to(dtype).requires_grad_(True) for t in (gi, gh, state)]
        if cell_type == "gru":
            fn = recurrent.gru_cell if fused else _plain_gru_cell
            out = fn(*leaves)
        else:
            fn = recurrent.lstm_cell if fused else _plain_lstm_cell
            out = fn(*leaves)[0]
        return [out, *torch.autograd.grad((out * weight.to(dtype)).sum(), leaves)]

    names = ("output", "grad gates_in", "grad gates_hidden", "grad state")
    _assert_within_twice_plain(names, run(BF16, True), run(torch.float64, False), run(BF16, False))


def _plain_gru_cell(gi, gh, h):
    H = h.shape[1]
    r = torch.sigmoid(gi[:, :H] + gh[:, :H])
    z = torch.sigmoid(gi[:, H : 2 * H] + gh[:, H : 2 * H])
    n = torch.tanh(gi[:, 2 * H :] + r * gh[:, 2 * H :])
    return (1 - z) * n + z * h


def _plain_lstm_cell(gi, gh, c):
    i, f, g, o = (gi + gh).chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def test_recurrent_ops_serve_bf16_and_autocast():
    x = torch.randn(2, 3, 4)
    assert recurrent.applies(x.to(BF16))
    with torch.autocast("cpu", dtype=BF16):
        assert recurrent.applies(x)
        rnn = nn.GRU(4, 6, batch_first=True)
        out = recurrent.gru_layer_or_none(x, torch.zeros(2, 6), *rnn.parameters())
        assert out is not None and out[0].dtype == BF16
    with torch.autocast("cpu", dtype=torch.float16):
        assert not recurrent.applies(x)  # no float16 kernel: PyTorch's ops


@pytest.mark.parametrize("acc_dtype", [torch.float32, BF16], ids=["f32-acc", "bf16-acc"])
def test_accumulating_backward_takes_bf16(acc_dtype):
    """The decoder steps' backward (StepwiseMemory): bfloat16 inputs, dkeys added into a float32
    (exact sums) or bfloat16 buffer; equal to the float32 op's up to bfloat16 rounding."""
    inputs = make_inputs(3, 1, 9, 16, 8, torch.float32, seed=5)
    lengths = torch.tensor([9, 4, 6])
    gc = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(6))

    def run(dtype, acc):
        q, k, val, v, b = (t.to(dtype) for t in inputs)
        _, weights, _ = torch.ops.seq2seq_fast.additive_attention_fwd(
            q, k, val, v, b, lengths, None, True
        )
        grad_keys = torch.ones(k.shape, dtype=acc)
        grads = torch.ops.seq2seq_fast._additive_attention_bwd_accumulate(
            gc.to(dtype), None, q, k, val, v, b, lengths, None, weights, grad_keys
        )
        return [grad_keys, *grads]

    want = run(torch.float32, torch.float32)
    got = run(BF16, acc_dtype)
    assert got[0].dtype == acc_dtype and all(g.dtype == BF16 for g in got[1:])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=0.03, atol=0.03 * w.abs().max().item())


# --- a model trained under autocast ----------------------------------------------------------------


@pytest.mark.parametrize(
    "decoder,cell", [("bahdanau", "gru"), ("bahdanau", "lstm"), ("gnmt", "gru")]
)
def test_model_under_autocast_uses_the_ops_within_twice_plain_error(monkeypatch, decoder, cell):
    """float32 master weights, forward under torch.autocast("cpu", bfloat16): the fused attention
    and recurrent ops run, and the loss and gradients err against float32 at most twice as much
    as the same model under autocast with PyTorch's own ops and the reference attention."""
    from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, sequence_loss

    if cell == "lstm" and not _torch_lstm_runs_under_autocast():
        pytest.skip("PyTorch's CPU LSTM (oneDNN) has no bfloat16 primitive on this CPU")
    config = dict(
        src_vocab_size=13,
        tgt_vocab_size=11,
        embed_size=16,
        hidden_size=32,
        decoder=decoder,
        cell=cell,
        decoder_layers=2,
    )
    torch.manual_seed(0)
    fused = Seq2Seq(Seq2SeqConfig(**config, backend="fused"))
    plain = Seq2Seq(Seq2SeqConfig(**config, backend="reference"))
    plain.load_state_dict(fused.state_dict())
    src = torch.randint(4, 13, (6, 9))
    lengths = torch.tensor([9, 7, 9, 3, 5, 8])
    tgt = torch.randint(4, 11, (6, 7))

    def loss_and_grads(model, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = sequence_loss(model(src, lengths, tgt)[0].float(), tgt)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert grads.dtype == torch.float32 and torch.isfinite(grads).all()
        return loss.detach(), grads

    calls = []
    for name in ("gru_layer", "gru_cell", "lstm_cell"):
        real = getattr(recurrent, name)
        monkeypatch.setattr(recurrent, name, lambda *a, real=real: calls.append(1) or real(*a))
    want = loss_and_grads(fused, False)
    calls.clear()
    ours = loss_and_grads(fused, True)
    assert calls, "no fused recurrent op ran under autocast"
    monkeypatch.setattr(recurrent, "_serves", lambda x: False)
    base = loss_and_grads(plain, True)
    for name, i in (("loss", 0), ("gradients", 1)):
        err = (ours[i] - want[i]).norm().item()
        allowed = 2 * (base[i] - want[i]).norm().item() + 2 * EPS * want[i].norm().item()
        assert err <= allowed, f"{name}: error {err:.3e} > allowed {allowed:.3e}"


def _torch_lstm_runs_under_autocast() -> bool:
    try:
        with torch.autocast("cpu", dtype=BF16):
            nn.LSTM(4, 4, batch_first=True)(torch.randn(1, 2, 4))
    except RuntimeError:
        return False
    return True
