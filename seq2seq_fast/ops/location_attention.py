"""The location-aware attention step and the location convolution, as ops (ESPnet AttLoc,
SpeechBrain's location-aware attention, fairseq's LocationAttention, Tacotron 2, Coqui): keys_t =
P + conv_t @ W^T over fixed values, where P [B, T, A] is the projected memory, conv_t [B*T, C] the
location convolution of step t's previous weights and W [A, C] the location dense layer's weight.

    seq2seq_fast::_location_attention_fwd / _bwd   one step; the keys are formed per batch row
                                                    inside the kernels (csrc/), never written;
                                                    normalize and score_bias as the attention op's
                                                    (backward with a score bias: the overload
                                                    _location_attention_bwd.score_bias)
    seq2seq_fast::_location_conv_fwd / _bwd         the location convolution (csrc/location_conv.cpp)
    location_columns(), location_keys()             the convolution and the keys, by the kernel
                                                    where it serves, else by plain products

Through plain ops (and the original), a step writes the location term [B, T, A], then the keys,
and its backward a keys gradient [B, T, A] and a values gradient [B, T, Dv] that autograd adds
into P's and the values'. The fused step's forward forms each batch row's keys P + conv_t W^T in
per-thread scratch and scores them there (no [B, T, A] tensor is written or saved), and its
backward forms them again, adds the keys gradient into the sequence's P gradient (a buffer the
step's gatherer owns) and multiplies it out to conv_t's and W's gradients in the same pass (no
values' gradient: the gatherer forms it once for all the steps). The ops are defined by the
extension; their fake kernels are registered here when it loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq_fast.ops._autograd import guard_double_backward, traced_or_transformed
from seq2seq_fast.ops._library import CPU_KERNEL_ERROR, kernel_serves, new_output_like

if CPU_KERNEL_ERROR is None:  # shapes for torch.compile / FakeTensor tracing of the ops

    @torch.library.register_fake("seq2seq_fast::_location_attention_fwd")
    def _location_attention_fwd_fake(
        query, projected, conv, weight, values, v, bias, lengths, mask, normalize="softmax",
        score_bias=None,
    ):  # fmt: skip
        batch, frames = projected.shape[:2]
        return query.new_empty(batch, 1, values.shape[2]), query.new_empty(batch, 1, frames)

    @torch.library.register_fake("seq2seq_fast::_location_attention_bwd")
    def _location_attention_bwd_fake(
        grad_context,
        grad_weights,
        query,
        projected,
        conv,
        weight,
        values,
        v,
        bias,
        lengths,
        mask,
        weights,
        grad_projected,
        normalize="softmax",
    ):
        # grad_projected is updated in place; (dquery, dconv, dweight, dv, dbias) are new
        return (
            new_output_like(query),
            new_output_like(conv),
            new_output_like(weight),
            new_output_like(v),
            new_output_like(bias),
        )

    @torch.library.register_fake("seq2seq_fast::_location_attention_bwd.score_bias")
    def _location_attention_bwd_score_bias_fake(*args):
        *rest, score_bias = args
        return (*_location_attention_bwd_fake(*rest), new_output_like(score_bias))

    @torch.library.register_fake("seq2seq_fast::_location_conv_fwd")
    def _location_conv_fwd_fake(features, weight):
        return features.new_empty(features.shape[0] * features.shape[2], weight.shape[0])

    @torch.library.register_fake("seq2seq_fast::_location_conv_bwd")
    def _location_conv_bwd_fake(grad, features, weight, need_features, need_weight):
        return (
            new_output_like(features) if need_features else features.new_empty(0),
            new_output_like(weight) if need_weight else weight.new_empty(0),
        )


# Without the extension's kernel (not built; bfloat16 features; an even kernel width), window
# products pay off for narrow windows (1-2 channels x 15-31 taps) and lose to conv1d for wide
# ones (ESPnet's default 201 taps); the kernel (csrc/location_conv.cpp) beats either at those
# sizes (bench/RESULTS.md, "Figures formerly in code comments").
MAX_WINDOW = 64


def _windows(features: Tensor, width: int) -> Tensor:
    """[B*T, Cin*K]: each frame's zero-padded window of features [B, Cin, T] (im2col)."""
    batch, channels, frames = features.shape
    padded = F.pad(features, (width // 2, width // 2))
    return padded.unfold(2, width, 1).transpose(1, 2).reshape(batch * frames, channels * width)


class _WindowConv(torch.autograd.Function):
    """conv1d(features [B, Cin, T], weight [C, Cin, K], padding K // 2) as [B*T, C], by one
    product of the frames' windows with the weight; the backward forms the windows again and
    folds the windows' gradient back onto the frames (col2im)."""

    @staticmethod
    def forward(ctx, features: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(features, weight)
        rows = weight.reshape(weight.shape[0], -1)
        return _windows(features, weight.shape[-1]).mm(rows.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        features, weight = ctx.saved_tensors
        batch, channels, frames = features.shape
        width = weight.shape[-1]
        rows = weight.reshape(weight.shape[0], -1)
        grad_features = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(_windows(features, width)).view_as(weight)
        if ctx.needs_input_grad[0]:
            cols = grad.mm(rows).view(batch, frames, channels * width).transpose(1, 2)
            padded = F.fold(cols, output_size=(1, frames + width - 1), kernel_size=(1, width))
            grad_features = padded.view(batch, channels, -1)[:, :, width // 2 : width // 2 + frames]
        return grad_features, grad_weight


class _KernelConv(torch.autograd.Function):
    """conv1d(features [B, Cin, T], weight [C, Cin, K], padding K // 2, K odd) as [B*T, C], by the
    extension's location convolution (csrc/location_conv.cpp): one pass per batch row forward and
    one backward, no im2col or col2im tensors."""

    @staticmethod
    def forward(ctx, features: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(features, weight)
        return torch.ops.seq2seq_fast._location_conv_fwd(features, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        features, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_features, grad_weight = torch.ops.seq2seq_fast._location_conv_bwd(
            grad, features, weight, needs[0], needs[1]
        )  # a gradient not asked for comes back empty
        return guard_double_backward(
            (grad_features if needs[0] else None, grad_weight if needs[1] else None)
        )


def location_columns(features: Tensor, conv_weight: Tensor) -> Tensor:
    """[B*T, C]: the location convolution of features [B, Cin, T] (conv_weight [C, Cin, K], or a
    Conv2d's [C, 1, 1, K]: bias-free, stride 1, zero padding K // 2), frames as rows."""
    weight = conv_weight.reshape(conv_weight.shape[0], -1, conv_weight.shape[-1])
    same_dtype, odd = features.dtype == weight.dtype, weight.shape[-1] % 2 == 1
    if same_dtype and odd and kernel_serves("location_conv", features, weight):
        return _KernelConv.apply(features, weight)
    plain = traced_or_transformed() or torch.is_autocast_enabled("cpu")
    if (
        features.device.type == "cpu"
        and not plain
        and weight.shape[1] * weight.shape[2] <= MAX_WINDOW
    ):
        return _WindowConv.apply(features, weight)
    conv = F.conv1d(features, weight, padding=weight.shape[-1] // 2)  # [B, C, T]
    return conv.transpose(1, 2).reshape(-1, weight.shape[0])


def location_keys(
    projected: Tensor, features: Tensor, conv_weight: Tensor, dense_weight: Tensor
) -> Tensor:
    """A location-aware step's keys: ``projected + dense(conv(features))``.

    projected [B, T, A] (the projected memory, plus the dense layer's bias where it has one);
    features [B, Cin, T] (previous / cumulative weights); conv_weight as :func:`location_columns`
    takes it; dense_weight [A, C] (a bias-free Linear's). Returns [B, T, A]. The same sums as the
    original's conv, transpose, Linear and add; the dense layer's product is added into the
    projected memory by one ``addmm``.
    """
    batch, frames, width = projected.shape
    conv = location_columns(features, conv_weight)
    keys = torch.addmm(projected.reshape(batch * frames, width), conv, dense_weight.t())
    return keys.view(batch, frames, width)


class _LocationStep(torch.autograd.Function):
    """One step: (context [B, 1, Dv], weights [B, 1, T]) of query [B, 1, A] against keys
    projected + conv @ weight^T, formed inside the kernels (see the module docstring);
    ``normalize`` and ``score_bias`` as the attention op takes them."""

    @staticmethod
    def forward(
        ctx, query, projected, conv, weight, values, v, bias, lengths, mask, memory,
        normalize="softmax", score_bias=None,
    ):  # fmt: skip
        context, weights = torch.ops.seq2seq_fast._location_attention_fwd(
            query, projected, conv, weight, values, v, bias, lengths, mask, normalize, score_bias
        )
        saved = (query, projected, conv, weight, values, v, bias, lengths, mask, weights)
        ctx.save_for_backward(*saved, score_bias)
        ctx.memory = memory
        ctx.normalize = normalize
        ctx.set_materialize_grads(False)
        return context, weights

    @staticmethod
    def backward(ctx, grad_context, grad_weights):
        saved = ctx.saved_tensors
        query, projected, conv, weight, values, v, bias, lengths, mask, weights = saved[:10]
        score_bias = saved[10]
        memory = ctx.memory
        if grad_context is None:
            grad_context = query.new_zeros((*query.shape[:2], values.shape[2]))
        else:
            grad_context = grad_context.contiguous()
        ops = torch.ops.seq2seq_fast
        args = (
            grad_context,
            None if grad_weights is None else grad_weights.contiguous(),
            query,
            projected,
            conv,
            weight,
            values,
            v,
            bias,
            lengths,
            mask,
            weights,
            memory.buffer(projected),  # the steps' sum (ops._autograd.gradient_sum_dtype)
            ctx.normalize,
        )
        if score_bias is None:
            grads = (*ops._location_attention_bwd.default(*args), None)
        else:
            grads = ops._location_attention_bwd.score_bias(*args, score_bias)
        grad_query, grad_conv, grad_weight, grad_v, grad_bias, grad_score_bias = grads
        needs = ctx.needs_input_grad
        if needs[4]:  # the values' gradient: one product over all the steps, in the gatherer
            memory.record(weights, grad_context)
        return guard_double_backward(
            (
                grad_query,
                None,
                grad_conv if needs[2] else None,
                grad_weight if needs[3] else None,
                None,
                grad_v,
                grad_bias,
                None,
                None,
                None,
                None,
                grad_score_bias,
            )
        )
