"""The output layer and its loss as one op: linear + (label-smoothed) cross-entropy, by row chunks.

    linear_cross_entropy(x [..., D], weight [V, D], bias [V] | None, target [...] int64,
                         label_smoothing=0.0, ignore_index=-100) -> scalar loss

equals ``F.cross_entropy(F.linear(x, weight, bias).reshape(-1, V), target.reshape(-1),
ignore_index=..., label_smoothing=...)`` (mean over the targets that are not ``ignore_index``),
gradients included, without ever holding the logits or their gradient for the whole batch: rows
whose target is ``ignore_index`` (padding) are dropped first, the rest go through in chunks of
``chunk_rows`` rows. For each chunk the forward computes the logits [C, V], their log-sum-exp and
the loss, and -- when an input needs a gradient -- the logits' gradient
``(softmax - (1 - eps) onehot(y) - eps / V) / n`` in the same buffer, from which it forms that
chunk's rows of dx and adds its share to dW and db. The backward then only scales the stored
gradients by the incoming scalar. Same number of matrix products as the unfused layer (one
forward, two backward), none over padding, and no second pass over [N, V] memory.

Precision: under ``torch.autocast`` (CPU or CUDA, bf16/fp16) the products run in the autocast
dtype while softmax, log-sum-exp, the loss and the dW/db accumulators stay fp32; otherwise
everything runs in x's dtype (float64 gives the reference to rounding). The gradients come back in
each input's own dtype (fp32 master weights keep fp32 gradients).

If no target is valid the loss is 0 with zero gradients (F.cross_entropy gives nan there).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LinearCrossEntropyFunction", "default_chunk_rows", "linear_cross_entropy"]

# Logit elements per chunk: 8 Mi (32 MiB fp32; ~1000 rows at an 8k vocabulary). Each chunk adds a
# rank-C update to dW (reads and writes all of dW) and a dozen op launches, so small chunks lose
# to the unfused layer and large ones beat it (bench/bench_linear_cross_entropy.py; the figures:
# bench/RESULTS.md, "Figures formerly in code comments").
_CHUNK_ELEMENTS = 1 << 23


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk for a vocabulary of ``vocab`` classes (at least 32)."""
    return max(32, _CHUNK_ELEMENTS // max(vocab, 1))


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, eps: float) -> None:
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"x and weight must be floating point, got x {x.dtype} and weight {weight.dtype}"
        )
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, D] with D = x.shape[-1]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if target.dtype != torch.int64 or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"target must be int64 of shape x.shape[:-1] = {tuple(x.shape[:-1])}, got "
            f"{target.dtype} {tuple(target.shape)}"
        )
    if not 0.0 <= eps < 1.0:  # also rejects nan
        raise ValueError(f"label_smoothing must be in [0, 1), got {eps}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("target", target)):
        if t is not None and t.device != weight.device:
            raise ValueError(f"{name} is on {t.device}, weight on {weight.device}")


def _compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if x.dtype != weight.dtype:
        raise TypeError(
            f"x ({x.dtype}) and weight ({weight.dtype}) must have the same dtype outside autocast"
        )
    return x.dtype


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd Function behind :func:`linear_cross_entropy` (x already [N, D], target [N])."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, label_smoothing, ignore_index, chunk_rows):
        dtype = _compute_dtype(x, weight)
        needs = ctx.needs_input_grad
        want_x, want_w, want_b = needs[0], needs[1], bias is not None and needs[2]
        with torch.autocast(x.device.type, enabled=False):
            loss, grads = _chunked(
                x,
                weight,
                bias,
                target,
                label_smoothing,
                ignore_index,
                chunk_rows,
                dtype,
                (want_x, want_w, want_b),
            )
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.have = tuple(g is not None for g in grads)
        return loss.to(torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        stored = ctx.saved_tensors
        out = [
            g * grad_loss.to(g.dtype) if have else None
            for g, have in zip(stored, ctx.have, strict=True)
        ]
        return out[0], out[1], out[2], None, None, None, None


def _chunked(x, weight, bias, target, eps, ignore_index, chunk_rows, dtype, wanted):
    """-> (loss, (dx [N, D] | None, dW [V, D] | None, db [V] | None)) for x [N, D], target [N]."""
    want_x, want_w, want_b = wanted
    any_grad = want_x or want_w or want_b
    vocab = weight.shape[0]
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    valid_rows = (target != ignore_index).nonzero().squeeze(1)
    count = int(valid_rows.numel())
    xs = x.index_select(0, valid_rows).to(dtype)
    ys = target.index_select(0, valid_rows)
    if count and (int(ys.min()) < 0 or int(ys.max()) >= vocab):
        bad = ys[(ys < 0) | (ys >= vocab)][0]
        raise ValueError(
            f"target holds {int(bad)}, outside [0, {vocab}) and not ignore_index ({ignore_index})"
        )
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    loss = torch.zeros((), dtype=acc, device=x.device)
    dxs = torch.empty_like(xs) if want_x else None
    dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if want_w else None
    db = torch.zeros(vocab, dtype=acc, device=x.device) if want_b else None
    scale = 1.0 / max(count, 1)
    for start in range(0, count, chunk_rows):
        xc, yc = xs[start : start + chunk_rows], ys[start : start + chunk_rows]
        logits = torch.addmm(b, xc, w.t()) if b is not None else xc @ w.t()
        logp = torch.log_softmax(logits.to(acc), dim=1)  # one fused pass
        rows = (1.0 - eps) * logp.gather(1, yc[:, None]).squeeze(1)
        if eps > 0:
            rows = rows + eps * logp.mean(dim=1)
        loss -= rows.sum()
        if not any_grad:
            continue
        # The logits' gradient in place: (softmax - (1 - eps) onehot(y) - eps / V) / n.
        grad = logp.exp_()
        if eps > 0:
            grad.sub_(eps / vocab)
        grad.scatter_add_(1, yc[:, None], grad.new_full((yc.numel(), 1), -(1.0 - eps)))
        grad.mul_(scale)
        if want_b:
            db += grad.sum(0)
        grad = grad.to(dtype)
        if want_x:
            torch.mm(grad, w, out=dxs[start : start + chunk_rows])
        if want_w:
            if grad.dtype == acc:
                dw.addmm_(grad.t(), xc)
            else:
                dw += (grad.t() @ xc).to(acc)
    dx = None
    if want_x:
        dx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        dx.index_copy_(0, valid_rows, dxs.to(x.dtype))
    grads = (
        dx,
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )
    return loss * scale, grads


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> Tensor:
    """Mean (label-smoothed) cross-entropy of ``x @ weight.T + bias`` against ``target``.

    x: float [..., D]; weight: [V, D]; bias: [V] or None; target: int64 [...] (x.shape[:-1]), each
    in [0, V) or ``ignore_index``. Returns a 0-dim tensor (float32 under autocast, else x's dtype),
    equal to F.cross_entropy(F.linear(x, weight, bias).flatten(0, -2), target.flatten(),
    ignore_index=ignore_index, label_smoothing=label_smoothing), computed by chunks of
    ``chunk_rows`` rows (default: :func:`default_chunk_rows`) over the non-ignored rows only.
    """
    _check(x, weight, bias, target, float(label_smoothing))
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0])
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    flat_x = x.reshape(-1, x.shape[-1])
    flat_target = target.reshape(-1)
    return LinearCrossEntropyFunction.apply(
        flat_x, weight, bias, flat_target, float(label_smoothing), int(ignore_index), chunk_rows
    )
