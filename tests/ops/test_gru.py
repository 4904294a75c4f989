"""The GRU recurrence ops (seq2seq_fast/gru.py, csrc/gru.cpp) against nn.GRU, the truth here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seq2seq_fast.ops import recurrent as fused_gru
from seq2seq_fast.ops._library import CPU_KERNEL_ERROR
from seq2seq_fast.seq2seq.models import GNMTDecoder, Seq2Seq, Seq2SeqConfig, sequence_loss

pytestmark = pytest.mark.skipif(CPU_KERNEL_ERROR is not None, reason="C++ extension not built")


def _both(B, T, F, H, dtype, bias=True, seed=0):
    """(nn.GRU outputs, last state, grads) and the same from gru_layer, for one random loss."""
    torch.manual_seed(seed)
    rnn = nn.GRU(F, H, batch_first=True, bias=bias).to(dtype)
    x = torch.randn(B, T, F, dtype=dtype, requires_grad=True)
    h0 = torch.randn(B, H, dtype=dtype, requires_grad=True)
    w_out, w_last = torch.randn(B, T, H, dtype=dtype), torch.randn(B, H, dtype=dtype)
    inputs = [x, h0, *rnn.parameters()]

    out, last = rnn(x, h0.unsqueeze(0))
    last = last[0]
    expected = (out, last, torch.autograd.grad((out * w_out).sum() + (last * w_last).sum(), inputs))
    out2, last2 = fused_gru.gru_layer(x, h0, *rnn.parameters())
    got = (out2, last2, torch.autograd.grad((out2 * w_out).sum() + (last2 * w_last).sum(), inputs))
    return expected, got


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("B, T, F, H", [(1, 1, 1, 1), (3, 5, 4, 6), (2, 7, 3, 17), (5, 2, 9, 40)])
def test_equals_nn_gru_float64(B, T, F, H, bias):
    (out, last, grads), (out2, last2, grads2) = _both(B, T, F, H, torch.float64, bias)
    torch.testing.assert_close(out2, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last2, last, rtol=1e-12, atol=1e-12)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("B, T, F, H", [(4, 9, 16, 32), (64, 30, 64, 256)])
def test_equals_nn_gru_float32(B, T, F, H):
    # float32 sigmoid/tanh through the SIMD exp: a few ulp of the gates per step
    (out, last, grads), (out2, last2, grads2) = _both(B, T, F, H, torch.float32)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(last2, last, rtol=1e-5, atol=2e-6)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g, rtol=1e-4, atol=1e-4)


def test_gates_saturate_and_propagate_nonfinite_like_nn_gru():
    torch.manual_seed(0)
    rnn = nn.GRU(3, 4, batch_first=True)
    x = torch.tensor([[[200.0, -200.0, 0.5], [-1e30, 1e30, 0.0], [float("nan"), 0.0, 0.0]]])
    h0 = torch.zeros(1, 4)
    out, _ = rnn(x, h0.unsqueeze(0))
    out2, _ = fused_gru.gru_layer(x, h0, *rnn.parameters())
    assert torch.isfinite(out2[:, :2]).all()
    torch.testing.assert_close(out2[:, :2], out[:, :2], rtol=1e-5, atol=1e-6)
    assert torch.isnan(out2[:, 2]).all() and torch.isnan(out[:, 2]).all()


def test_applies_only_where_the_ops_serve():
    x = torch.randn(2, 3, 4)
    assert fused_gru.applies(x)
    assert fused_gru.applies(x.to(torch.bfloat16))  # float32 inside (tests/ops/test_bf16.py)
    assert not fused_gru.applies(x.to(torch.float16))
    assert not fused_gru.applies(torch.randn(2, 0, 4))
    assert not fused_gru.applies(torch.randn(0, 3, 4))
    with torch.autocast("cpu", dtype=torch.float16):  # bfloat16 autocast: tests/ops/test_bf16.py
        assert not fused_gru.applies(x)
    seen = []
    torch.func.vmap(lambda row: seen.append(fused_gru.applies(row.unsqueeze(0))) or row)(x)
    assert seen == [False]


def test_second_order_gradient_raises():
    rnn = nn.GRU(3, 4, batch_first=True)
    x = torch.randn(2, 3, 3, requires_grad=True)
    out, _ = fused_gru.gru_layer(x, torch.zeros(2, 4), *rnn.parameters())
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order"):
        gx.sum().backward()


def _compare_model_with_and_without(monkeypatch, config, wrapped, switch, expected_calls):
    """Loss and every gradient of a small float64 Seq2Seq with the op ``wrapped`` (counted) and
    then with ``switch`` forced False (PyTorch's own ops): equal to float64 rounding."""
    torch.manual_seed(0)
    model = Seq2Seq(config).double()
    src = torch.randint(4, config.src_vocab_size, (3, 6))
    lengths = torch.tensor([6, 4, 1])
    tgt = torch.randint(4, config.tgt_vocab_size, (3, 5))
    calls = []
    real = getattr(fused_gru, wrapped)
    monkeypatch.setattr(fused_gru, wrapped, lambda *a: calls.append(1) or real(*a))

    def loss_and_grads():
        model.zero_grad()
        loss = sequence_loss(model(src, lengths, tgt)[0], tgt)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    assert len(calls) == expected_calls
    monkeypatch.setattr(fused_gru, switch, lambda x: False)
    loss_ref, grads_ref = loss_and_grads()
    assert len(calls) == expected_calls
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)
    return model


def test_models_use_it_and_match_nn_gru(monkeypatch):
    """A GRU Seq2Seq (bidirectional encoder, GNMT decoder) gives the same loss and gradients with
    the fused recurrence as with nn.GRU's own (applies() forced False)."""
    config = Seq2SeqConfig(
        src_vocab_size=13,
        tgt_vocab_size=11,
        embed_size=8,
        hidden_size=16,
        decoder="gnmt",
        decoder_layers=2,
        backend="reference",
    )
    # encoder: 2 directions; decoder: 2 layers
    model = _compare_model_with_and_without(monkeypatch, config, "gru_layer", "applies", 4)
    assert isinstance(model.decoder, GNMTDecoder)


def test_bad_shapes_raise_clear_errors():
    op = torch.ops.seq2seq_fast._gru_recurrence_fwd
    with pytest.raises(RuntimeError, match=r"h0 must be \[B=2, H=4\]"):
        op(torch.randn(2, 3, 12), torch.randn(3, 4), torch.randn(12, 4), None)
    with pytest.raises(RuntimeError, match="last size must be 3H"):
        op(torch.randn(2, 3, 10), torch.randn(2, 4), torch.randn(10, 4), None)
    with pytest.raises(RuntimeError, match=r"w_hh must be \[3H=12, H=4\]"):
        op(torch.randn(2, 3, 12), torch.randn(2, 4), torch.randn(12, 5), None)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_cell_equals_nn_gru_cell(dtype, tol):
    torch.manual_seed(1)
    B, F, H, A = 5, 7, 19, 4
    cell = nn.GRUCell(F, H).to(dtype)
    x = torch.randn(B, F, dtype=dtype, requires_grad=True)
    h = torch.randn(B, H, dtype=dtype, requires_grad=True)
    w = torch.randn(B, H, dtype=dtype)
    inputs = [x, h, *cell.parameters()]
    expected = cell(x, h)
    grads = torch.autograd.grad((expected * w).sum(), inputs)
    # gates_hidden as a strided view: the first 3H columns of a [B, 3H + A] product, as the
    # Bahdanau decoder's stacked [W_hh; W_q] gives it
    extra = torch.zeros(A, H, dtype=dtype)
    stacked = nn.functional.linear(
        h, torch.cat([cell.weight_hh, extra]), torch.cat([cell.bias_hh, extra[:, 0]])
    )
    gates_hidden = stacked[:, : 3 * H]
    assert gates_hidden.stride() == (3 * H + A, 1)
    got = fused_gru.gru_cell(nn.functional.linear(x, cell.weight_ih, cell.bias_ih), gates_hidden, h)
    grads2 = torch.autograd.grad((got * w).sum(), inputs)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g, rtol=10 * tol, atol=10 * tol)


def test_cell_bad_shapes_raise_clear_errors():
    op = torch.ops.seq2seq_fast._gru_cell_fwd
    with pytest.raises(RuntimeError, match=r"gate projections must be \[B=2, 3H=12\]"):
        op(torch.randn(2, 12), torch.randn(2, 11), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="one dtype"):
        op(torch.randn(2, 12), torch.randn(2, 12, dtype=torch.float64), torch.randn(2, 4))
    assert not fused_gru.cell_applies(torch.randn(2, 3, 4))
    assert fused_gru.cell_applies(torch.randn(2, 4))


def test_ops_trace_under_torch_compile():
    """The models take nn.GRU's ops inside torch.compile, but a user's compiled code may call
    gru_layer / gru_cell directly: the ops have fake kernels, one graph, same results."""
    torch.manual_seed(0)
    rnn = nn.GRU(4, 6, batch_first=True)
    params = list(rnn.parameters())
    x = torch.randn(3, 5, 4, requires_grad=True)
    h0 = torch.randn(3, 6)
    compiled = torch.compile(lambda x, h0: fused_gru.gru_layer(x, h0, *params), fullgraph=True)
    out, _ = compiled(x, h0)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected, _ = rnn(x, h0.unsqueeze(0))
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)

    cell = nn.GRUCell(4, 6)
    xc, hc = torch.randn(3, 4), torch.randn(3, 6)

    def step(xc, hc):
        gates_in = nn.functional.linear(xc, cell.weight_ih, cell.bias_ih)
        return fused_gru.gru_cell(
            gates_in, nn.functional.linear(hc, cell.weight_hh, cell.bias_hh), hc
        )

    torch.testing.assert_close(
        torch.compile(step, fullgraph=True)(xc, hc), cell(xc, hc), rtol=1e-5, atol=1e-6
    )


def test_ops_take_empty_sizes():
    """Direct calls with no step or no row (the layer itself hands those to nn.GRU)."""
    rnn = nn.GRU(3, 4, batch_first=True)
    for B, T in ((2, 0), (0, 3)):
        gx = torch.randn(B, T, 12, requires_grad=True)
        h0 = torch.randn(B, 4, requires_grad=True)
        hs = fused_gru._GRURecurrence.apply(gx, h0, rnn.weight_hh_l0, rnn.bias_hh_l0)
        assert hs.shape == (B, T, 4)
        hs.sum().backward()
        assert gx.grad.shape == gx.shape and torch.equal(h0.grad, torch.zeros_like(h0))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(1, 7),
    F=st.integers(1, 9),
    H=st.sampled_from([1, 2, 3, 5, 8, 15, 16, 17, 31, 33]),
    bias=st.booleans(),
    strided_x=st.booleans(),
    scale=st.sampled_from([0.1, 1.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_layer_against_nn_gru(B, T, F, H, bias, strided_x, scale, seed):
    """Differential fuzzing (hypothesis) of the layer against nn.GRU in float64: sizes around the
    vector widths, inputs sliced from wider buffers, saturating gates (scale 10)."""
    torch.manual_seed(seed)
    rnn = nn.GRU(F, H, batch_first=True, bias=bias).double()
    with torch.no_grad():
        for p in rnn.parameters():
            p.mul_(scale)
    x = torch.randn(B, T, F + 3 if strided_x else F, dtype=torch.float64)[..., :F]
    x.requires_grad_(True)
    h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, T, H, dtype=torch.float64)
    inputs = [x, h0, *rnn.parameters()]
    out, _ = rnn(x, h0.unsqueeze(0))
    grads = torch.autograd.grad((out * w).sum(), inputs)
    out2, _ = fused_gru.gru_layer(x, h0, *rnn.parameters())
    grads2 = torch.autograd.grad((out2 * w).sum(), inputs)
    torch.testing.assert_close(out2, out, rtol=1e-10, atol=1e-10)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_lstm_cell_equals_nn_lstm_cell(dtype, tol):
    torch.manual_seed(2)
    B, F, H = 4, 6, 21
    cell = nn.LSTMCell(F, H).to(dtype)
    x = torch.randn(B, F, dtype=dtype, requires_grad=True)
    h = torch.randn(B, H, dtype=dtype, requires_grad=True)
    c = torch.randn(B, H, dtype=dtype, requires_grad=True)
    w_h, w_c = torch.randn(B, H, dtype=dtype), torch.randn(B, H, dtype=dtype)
    inputs = [x, h, c, *cell.parameters()]
    h1, c1 = cell(x, (h, c))
    grads = torch.autograd.grad((h1 * w_h).sum() + (c1 * w_c).sum(), inputs)
    gates_in = nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    gates_hidden = nn.functional.linear(h, cell.weight_hh, cell.bias_hh)
    h2, c2 = fused_gru.lstm_cell(gates_in, gates_hidden, c)
    grads2 = torch.autograd.grad((h2 * w_h).sum() + (c2 * w_c).sum(), inputs)
    torch.testing.assert_close(h2, h1, rtol=tol, atol=tol)
    torch.testing.assert_close(c2, c1, rtol=tol, atol=tol)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g, rtol=10 * tol, atol=10 * tol)
    # only h used downstream: c's gradient arrives as None and counts as zero
    gates_in = nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    gates_hidden = nn.functional.linear(h, cell.weight_hh, cell.bias_hh)
    (gx,) = torch.autograd.grad(fused_gru.lstm_cell(gates_in, gates_hidden, c)[0].sum(), x)
    (gx_ref,) = torch.autograd.grad(cell(x, (h, c))[0].sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=10 * tol, atol=10 * tol)


def test_bahdanau_decoders_use_the_cell_ops_and_match_plain_ops(monkeypatch):
    for cell, wrapped in (("gru", "gru_cell"), ("lstm", "lstm_cell")):
        config = Seq2SeqConfig(
            src_vocab_size=13,
            tgt_vocab_size=11,
            embed_size=8,
            hidden_size=16,
            decoder="bahdanau",
            cell=cell,
            decoder_layers=2,
            backend="reference",
        )
        # 5 target steps x 2 decoder layers
        with monkeypatch.context() as patch:
            _compare_model_with_and_without(patch, config, wrapped, "cell_applies", 10)
