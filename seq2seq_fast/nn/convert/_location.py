"""Training steps of location-aware attention (ESPnet AttLoc, SpeechBrain's location-aware
attention, fairseq's LocationAttention, Tacotron 2, Coqui): keys_t = P + conv_t @ W^T over fixed
values, where P [B, T, A] is the projected memory, conv_t [B*T, C] the location convolution of
step t's previous weights and W [A, C] the location dense layer's weight.

Through plain ops (and the original), a step writes the location term [B, T, A], then the keys,
and its backward a keys gradient [B, T, A] and a values gradient [B, T, Dv] that autograd adds
into P's and the values'. On the fused CPU kernel, :class:`LocationMemory` runs a step as the
location-aware step op (:mod:`seq2seq_fast.ops.location_attention`), which forms the keys inside
the kernels and adds the keys gradient into the sequence's P gradient. The values' and P's
gradients of all the steps are returned once, when the backward reaches them. Results equal the
plain computation's up to float rounding (sums taken in another order).

Not a layout itself (the leading underscore keeps the package from importing it as one).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._speech import attend_gathered, prefix_lengths
from seq2seq_fast.ops._autograd import StepGradients
from seq2seq_fast.ops._checks import check_inputs
from seq2seq_fast.ops._library import kernel_serves
from seq2seq_fast.ops.additive_attention import check_normalize, check_score_bias
from seq2seq_fast.ops.location_attention import _LocationStep, location_columns, location_keys


class LocationMemory(StepGradients):
    """The projected memory P [B, T, A] and values [B, T, Dv] of one sequence's location-aware
    steps, for training on the fused CPU kernel (see the module docstring). Build it with
    :meth:`for_training` (None where it does not apply), then call :meth:`attend` per step. A
    backward that reaches P and the values spends it (:attr:`spent`); each backward's gathering
    is kept apart by its graph task."""

    def __init__(self, projected: Tensor, values: Tensor) -> None:
        super().__init__()
        self.sources = (projected, values)
        self.projected, self.values = self.attach(projected, values)
        self.spent = False

    @classmethod
    def for_training(cls, projected: Tensor, values: Tensor, backend: str) -> LocationMemory | None:
        if backend == "reference" or not torch.is_grad_enabled():
            return None
        if not kernel_serves("location", projected, values):
            return None
        if projected.dim() != 3 or values.dim() != 3 or min(values.shape) == 0:
            return None
        if min(projected.shape) == 0 or not projected.is_contiguous():
            return None
        return cls(projected, values)

    def serves(self, projected: Tensor, values: Tensor) -> bool:
        return not self.spent and self.sources[0] is projected and self.sources[1] is values

    def attend(
        self,
        query: Tensor,
        conv: Tensor,
        weight: Tensor,
        v: Tensor,
        mask: Tensor | None,
        normalize: str = "softmax",
        score_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """query [B, A], conv [B*T, C], weight [A, C], v [A], mask bool [B, T] (True = valid) or
        None -> (context [B, Dv], weights [B, T]); ``normalize`` and ``score_bias`` as
        ``additive_attention`` takes them."""
        checked = check_inputs(query, self.projected, self.values, v, mask=mask)
        query3, v, mask = checked.query, checked.v, checked.mask
        batch, frames, width = self.projected.shape
        if conv.shape != (batch * frames, weight.shape[1]) or weight.shape[0] != width:
            raise ValueError(
                f"location term: conv {list(conv.shape)} and weight {list(weight.shape)} do not "
                f"match keys [{batch}, {frames}, {width}]"
            )
        lengths = prefix_lengths(mask)
        mask = None if lengths is not None else mask
        # (under autocast: the casts check_inputs made of query and v, differentiable)
        conv, weight = conv.to(query3.dtype), weight.to(query3.dtype)
        bias = query3.new_zeros(width)
        score_bias = check_score_bias(score_bias, query3)
        context, weights = _LocationStep.apply(
            query3,
            self.projected,
            conv,
            weight,
            self.values,
            v,
            bias,
            lengths,
            mask,
            self,
            check_normalize(normalize),
            score_bias,
        )
        return context.squeeze(1), weights.squeeze(1)

    def gathered(self) -> tuple[Tensor | None, Tensor | None]:
        """(dP, dvalues) gathered in this backward pass (None: no step contributed). The memory
        is spent: it lets go of its tensors (the module keeps it until its next sequence)."""
        self.spent = True
        self.sources = (None, None)
        self.projected = self.values = None
        return self.collect()


def attend_location(
    owner: nn.Module,
    backend: str,
    query: Tensor,
    projected: Tensor,
    location: tuple[Tensor, Tensor, Tensor],
    values: Tensor,
    v: Tensor,
    mask: Tensor | None,
    normalize: str = "softmax",
    score_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A location-aware step: ``attend(backend, query [B, A], projected + dense(conv(features)),
    values [B, T, Dv], v, mask)`` with ``location = (features [B, Cin, T], conv_weight,
    dense_weight [A, C])`` (see :func:`location_keys`); mask bool [B, T] (True = valid) or None.
    When training on the fused CPU kernel, through ``owner``'s :class:`LocationMemory` for these
    projected memory and values (kept in ``owner._location``); else through
    :func:`~seq2seq_fast.nn.convert._speech.attend_gathered` (``normalize`` and ``score_bias`` as
    ``additive_attention`` takes them). Returns (context [B, Dv],
    weights [B, T])."""
    features, conv_weight, dense_weight = location
    memory = getattr(owner, "_location", None)
    if not (isinstance(memory, LocationMemory) and memory.serves(projected, values)):
        memory = LocationMemory.for_training(projected, values, backend)
        owner._location = memory
    if memory is None or query.dim() != 2:
        keys = location_keys(projected, features, conv_weight, dense_weight)
        return attend_gathered(owner, backend, query, keys, values, v, mask, normalize, score_bias)
    conv = location_columns(features, conv_weight)
    return memory.attend(query, conv, dense_weight, v, mask, normalize, score_bias)
