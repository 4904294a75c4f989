"""A GRU layer whose recurrence is two C++ ops (forward over all steps, backward over all steps).

PyTorch runs a CPU GRU as a dozen small ops per time step, each recorded by autograd, with the
weight gradient formed step by step; at the sizes of a Seq2Seq model (batch 64, hidden 256) those
per-step costs are about half of the layer's time. ``gru_layer`` computes the same function with
nn.GRU's parameters and gate equations (csrc/gru.cpp):

- the input projection x W_ih^T + b_ih for all steps is one product (autograd as usual);
- the recurrence is one autograd node: per step one product h W_hh^T and one fused gate pass
  forward, one product and one fused pass backward; dW_hh and db_hh once at the end.

``gru_cell`` is one step of the same gates from projections the caller formed (the Bahdanau
decoder's, which projects the context and the query with them); ``lstm_cell`` the same for an
LSTM cell (nn.LSTM layers stay on PyTorch's own kernel: oneDNN on CPU).

The kernel choice is made here, in one place: the models call :func:`gru_layer_or_none`,
:func:`gru_cell_or_none` and :func:`lstm_cell_or_none`, which run the op where it serves the tensor
(:func:`applies`, :func:`cell_applies`: CPU, float32/64, the extension loaded, no autocast, not
inside torch.compile or a torch.func transform) and return None elsewhere, where the models call
PyTorch's own ops as before. Results equal nn.GRU's, nn.GRUCell's
and nn.LSTMCell's to float rounding (tests/ops/test_gru.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq_fast.ops._autograd import guard_double_backward
from seq2seq_fast.ops._library import CPU_KERNEL_ERROR, kernel_serves, note_served


def _saved_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the tensors an op keeps for its backward: float32 for bfloat16 inputs (the
    ops compute in float32 and keep what they computed), else the input's."""
    return torch.float32 if x.dtype == torch.bfloat16 else x.dtype


if CPU_KERNEL_ERROR is None:  # shapes for torch.compile / FakeTensor tracing of the ops

    @torch.library.register_fake("seq2seq_fast::_gru_recurrence_fwd")
    def _(gx, h0, w_hh, b_hh):
        B, T, G = gx.shape
        # bfloat16: [r | z | n | gh_n | h_t] in float32 (the state in float32 too)
        gates = 5 if gx.dtype == torch.bfloat16 else 4
        saved = gx.new_empty(B, T, gates * (G // 3), dtype=_saved_dtype(gx))
        return gx.new_empty(B, T, G // 3), saved

    @torch.library.register_fake("seq2seq_fast::_gru_recurrence_bwd")
    def _(grad_hs, h0, hs, saved, w_hh, has_bias):
        B, T, H = hs.shape
        bias = w_hh.new_empty(3 * H) if has_bias else w_hh.new_empty(0)
        return hs.new_empty(B, T, 3 * H), h0.new_empty(B, H), w_hh.new_empty(3 * H, H), bias

    @torch.library.register_fake("seq2seq_fast::_gru_cell_fwd")
    def _(gates_in, gates_hidden, h):
        B, H = h.shape
        return h.new_empty(B, H), h.new_empty(B, 4 * H, dtype=_saved_dtype(h))

    @torch.library.register_fake("seq2seq_fast::_gru_cell_bwd")
    def _(grad_h, saved, h):
        B, H = h.shape
        return h.new_empty(B, 3 * H), h.new_empty(B, 3 * H), h.new_empty(B, H)

    @torch.library.register_fake("seq2seq_fast::_lstm_cell_fwd")
    def _(gates_in, gates_hidden, c):
        B, H = c.shape
        return c.new_empty(B, H), c.new_empty(B, H), c.new_empty(B, 5 * H, dtype=_saved_dtype(c))

    @torch.library.register_fake("seq2seq_fast::_lstm_cell_bwd")
    def _(grad_h, grad_c, saved, c):
        B, H = c.shape
        return c.new_empty(B, 4 * H), c.new_empty(B, H)


class _GRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gx: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
        hs, saved = torch.ops.seq2seq_fast._gru_recurrence_fwd(gx, h0, w_hh, b_hh)
        ctx.save_for_backward(h0, hs, saved, w_hh)
        ctx.has_bias = b_hh is not None
        return hs

    @staticmethod
    def backward(ctx, grad_hs: Tensor):
        h0, hs, saved, w_hh = ctx.saved_tensors
        dgx, dh0, dw, db = torch.ops.seq2seq_fast._gru_recurrence_bwd(
            grad_hs, h0, hs, saved, w_hh, ctx.has_bias
        )
        return guard_double_backward((dgx, dh0, dw, db if ctx.has_bias else None))


class _GRUCell(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates_in: Tensor, gates_hidden: Tensor, h: Tensor) -> Tensor:
        h_new, saved = torch.ops.seq2seq_fast._gru_cell_fwd(gates_in, gates_hidden, h)
        ctx.save_for_backward(saved, h)
        return h_new

    @staticmethod
    def backward(ctx, grad_h: Tensor):
        saved, h = ctx.saved_tensors
        return guard_double_backward(torch.ops.seq2seq_fast._gru_cell_bwd(grad_h, saved, h))


class _LSTMCell(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates_in: Tensor, gates_hidden: Tensor, c: Tensor):
        h, c_new, saved = torch.ops.seq2seq_fast._lstm_cell_fwd(gates_in, gates_hidden, c)
        ctx.save_for_backward(saved, c)
        return h, c_new

    @staticmethod
    def backward(ctx, grad_h: Tensor, grad_c: Tensor):
        saved, c = ctx.saved_tensors
        d_gates, dc = torch.ops.seq2seq_fast._lstm_cell_bwd(grad_h, grad_c, saved, c)
        # gates = gates_in + gates_hidden: both get the same gradient (as AddBackward gives it)
        return guard_double_backward((d_gates, d_gates, dc))


def _autocast_dtype() -> torch.dtype | None:
    """The CPU autocast dtype while autocast is on, else None."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _serves(x: Tensor) -> bool:
    """Whether the fused recurrent ops serve a tensor: not empty, and the library's one kernel
    decision (:func:`~seq2seq_fast.ops._library.kernel_unavailable_reason`, "recurrent": CPU,
    float32/64 or bfloat16, the extension loaded, no autocast or autocast to bfloat16, not inside
    torch.compile's tracing or a torch.func transform)."""
    return x.numel() > 0 and kernel_serves("recurrent", x)


def prefer_packed(x: Tensor) -> bool:
    """Whether a variable-length RNN over x [B, S, E] should run packed (PyTorch's packed
    sequence, cuDNN's native path on CUDA, and without autograd it skips the padding) rather than
    layer by layer on the padded batch (traced by torch.compile without a graph break; on the CPU
    in training, the fused GRU ops, and no [tokens, 3H] zero-filled gradient per step)."""
    return not torch.compiler.is_compiling() and (x.is_cuda or not torch.is_grad_enabled())


def _common_dtype(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Under CPU autocast: every tensor in the autocast dtype (a differentiable cast, as autocast
    casts a product's inputs; a no-op for tensors already in it); else as given."""
    dtype = _autocast_dtype()
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def applies(x: Tensor) -> bool:
    """Whether :func:`gru_layer` serves x [B, T, F] (else use nn.GRU / torch.gru)."""
    return x.dim() == 3 and _serves(x)


def cell_applies(h: Tensor) -> bool:
    """Whether :func:`gru_cell` / :func:`lstm_cell` serve the state h or c [B, H] (else the
    cell's plain ops)."""
    return h.dim() == 2 and _serves(h)


def gru_layer_or_none(
    x: Tensor,
    h0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias_ih: Tensor | None = None,
    bias_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """:func:`gru_layer` where the fused ops serve x [B, T, F] (:func:`applies`), else None: the
    caller then runs PyTorch's GRU (nn.GRU / torch.gru) with the same weights."""
    if not applies(x):
        return None
    note_served("seq2seq_fast::_gru_recurrence_fwd/_bwd")
    return gru_layer(x, h0, weight_ih, weight_hh, bias_ih, bias_hh)


def gru_cell_or_none(gates_in: Tensor, gates_hidden: Tensor, h: Tensor) -> Tensor | None:
    """:func:`gru_cell` where the fused op serves the state h [B, H] (:func:`cell_applies`), else
    None: the caller then forms the update from plain ops."""
    if not cell_applies(h):
        return None
    note_served("seq2seq_fast::_gru_cell_fwd/_bwd")
    return gru_cell(gates_in, gates_hidden, h)


def lstm_cell_or_none(
    gates_in: Tensor, gates_hidden: Tensor, c: Tensor
) -> tuple[Tensor, Tensor] | None:
    """:func:`lstm_cell` where the fused op serves the cell state c [B, H] (:func:`cell_applies`),
    else None: the caller then forms the update from plain ops."""
    if not cell_applies(c):
        return None
    note_served("seq2seq_fast::_lstm_cell_fwd/_bwd")
    return lstm_cell(gates_in, gates_hidden, c)


def lstm_cell(gates_in: Tensor, gates_hidden: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """nn.LSTMCell's update from its two gate projections, biases included: gates_in = x W_ih^T +
    b_ih, gates_hidden = h W_hh^T + b_hh, both [B, 4H], c [B, H] -> (h', c'); one op forward,
    one backward. float32/64 or bfloat16 (float32 inside); under CPU autocast the inputs are cast
    to its dtype."""
    return _LSTMCell.apply(*_common_dtype(gates_in, gates_hidden, c))


def gru_cell(gates_in: Tensor, gates_hidden: Tensor, h: Tensor) -> Tensor:
    """nn.GRUCell's update from its two gate projections, biases included: gates_in = x W_ih^T +
    b_ih, gates_hidden = h W_hh^T + b_hh, both [B, 3H], h [B, H] -> h' [B, H]; one op forward,
    one backward. float32/64 or bfloat16 (float32 inside); under CPU autocast the inputs are cast
    to its dtype."""
    return _GRUCell.apply(*_common_dtype(gates_in, gates_hidden, h))


def gru_layer(
    x: Tensor,
    h0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias_ih: Tensor | None = None,
    bias_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One unidirectional GRU layer, batch first: x [B, T, F], h0 [B, H] -> (outputs [B, T, H],
    last state [B, H]), as ``nn.GRU(F, H, batch_first=True)`` with those parameters.

    float32/64 or bfloat16; under CPU autocast (bfloat16) the input product over all steps runs in
    bfloat16 and the recurrence reads the bfloat16 gx, while its per-step product h W_hh^T runs
    in float32 with W_hh as given (float32 master weights are not cast; their gradients come back
    float32). Gates, state and gradient sums are float32 inside the ops."""
    gx = F.linear(x, weight_ih, bias_ih)
    dtype = gx.dtype
    # bfloat16 gx takes float32 W_hh / b_hh as they are; otherwise one dtype throughout
    w_dtype = (
        torch.float32 if dtype == torch.bfloat16 and weight_hh.dtype == torch.float32 else dtype
    )
    b_hh = None if bias_hh is None else bias_hh.to(w_dtype)
    hs = _GRURecurrence.apply(
        gx.contiguous(), h0.to(dtype).contiguous(), weight_hh.to(w_dtype), b_hh
    )
    return hs, hs[:, -1]
