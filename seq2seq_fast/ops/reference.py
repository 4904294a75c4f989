"""Plain-PyTorch additive (Bahdanau) attention: the specification every fused backend is tested against.

    e[b,t,s] = sum_h v[h] * tanh(query[b,t,h] + keys[b,s,h] + bias[h])
    alpha[b,t,:] = softmax of e[b,t,:] over the valid key positions (masked ones get exactly 0),
                   or with normalize="sigmoid": sigmoid(e) / sum of sigmoid(e) over them
                   (with a score_bias b: of e + b, which only the sigmoid does not cancel)
    context[b,t] = sum_s alpha[b,t,s] * values[b,s]

It builds the full [B, Tq, Tk, H] tensor on purpose: it is the readable truth, not the fast path.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["additive_attention_ref", "valid_key_mask"]


def valid_key_mask(
    batch: int, num_keys: int, lengths: Tensor | None, mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Bool [B, Tk] (True = may attend) from ``lengths`` [B] or ``mask`` [B, Tk]; None = all valid."""
    if mask is not None:
        return mask.to(device=device, dtype=torch.bool)
    if lengths is not None:  # a tensor or, as the fused op takes it, a sequence of ints
        positions = torch.arange(num_keys, device=device)
        return positions.unsqueeze(0) < torch.as_tensor(lengths, device=device).reshape(batch, 1)
    return None


def additive_attention_ref(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    lengths: Tensor | list[int] | tuple[int, ...] | None = None,
    mask: Tensor | None = None,
    return_weights: bool = True,
    upcast: bool = False,
    normalize: str = "softmax",
    score_bias: Tensor | float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference additive attention, same contract as :func:`seq2seq_fast.additive_attention`.

    Args:
        query: [B, Tq, H] or [B, H] (one decoding step) projected decoder states.
        keys: [B, Tk, H] projected encoder states.
        values: [B, Tk, Dv].
        v: [H] score vector.
        bias: [H] or None, added inside the tanh.
        lengths: integer [B] (a tensor or a sequence of ints), valid key positions per row
            (0 <= length <= Tk), or None.
        mask: bool [B, Tk], True = may attend, or None. Not together with ``lengths``.
        return_weights: return the [B, Tq, Tk] weights too (else None).
        upcast: compute in float32 when the inputs are float16/bfloat16, return the input dtype.
        normalize: "softmax", or "sigmoid" (sigmoid(e) / sum of sigmoid(e) over the valid keys:
            the "smoothing" of Tacotron-style and LAS-style attention). Computed as the softmax of
            log sigmoid(e): the same weights, and no 0/0 where every sigmoid(e) underflows.
        score_bias: a number or a one-element tensor b added to every score before the
            normalisation (sigmoid(e + b) / sum sigmoid(e + b)); a tensor gets its gradient.

    Returns:
        (context [B, Tq, Dv] or [B, Dv], weights [B, Tq, Tk] or [B, Tk] or None).
    """
    if lengths is not None and mask is not None:
        raise ValueError("pass either lengths or mask, not both")
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize must be 'softmax' or 'sigmoid', got {normalize!r}")
    out_dtype = query.dtype
    if upcast and query.dtype in (torch.float16, torch.bfloat16):
        query, keys, values, v = (t.float() for t in (query, keys, values, v))
        bias = None if bias is None else bias.float()
    single_step = query.dim() == 2
    q = query.unsqueeze(1) if single_step else query
    batch, num_keys = keys.shape[0], keys.shape[1]

    pre = q.unsqueeze(2) + keys.unsqueeze(1)  # [B, Tq, Tk, H]
    if bias is not None:
        pre = pre + bias
    scores = torch.tanh(pre) @ v  # [B, Tq, Tk]
    if isinstance(score_bias, Tensor):
        scores = scores + score_bias.to(scores.dtype).reshape(())
    elif score_bias is not None:
        scores = scores + float(score_bias)
    if normalize == "sigmoid":  # sigmoid(e) / sum sigmoid(e) = softmax(log sigmoid(e))
        scores = torch.nn.functional.logsigmoid(scores)

    valid = valid_key_mask(batch, num_keys, lengths, mask, scores.device)
    if valid is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        valid = valid.unsqueeze(1)  # [B, 1, Tk]
        row_has_key = valid.any(dim=-1, keepdim=True)
        # Rows without any valid key are softmaxed over zeros and then zeroed: no NaN, zero gradients.
        scores = scores.masked_fill(~valid, float("-inf")).masked_fill(~row_has_key, 0.0)
        weights = torch.softmax(scores, dim=-1) * valid
    context = weights @ values  # [B, Tq, Dv]

    if single_step:
        context, weights = context.squeeze(1), weights.squeeze(1)
    context = context.to(out_dtype)
    return context, (weights.to(out_dtype) if return_weights else None)
