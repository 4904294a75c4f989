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
plain computation's up to float rounding (sums taken in another order). The memory and its
Function live in ops (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`); this module keeps the
call the converter's runtime makes for a plan with a location term (``traced/rewrite.py``), which
holds a memory per owner (the runtime).

Not a layout itself (the leading underscore keeps the package from importing it as one).
"""

from __future__ import annotations

from torch import Tensor, nn

from seq2seq_fast.nn.convert._speech import attend_gathered
from seq2seq_fast.ops.location_attention import location_columns, location_keys
from seq2seq_fast.ops.stepwise import LocationMemory


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
    ``additive_attention`` takes them). Returns (context [B, Dv], weights [B, T])."""
    features, conv_weight, dense_weight = location
    memory = getattr(owner, "_location", None)
    if not (isinstance(memory, LocationMemory) and memory.owns(projected, values)):
        memory = LocationMemory.for_training(projected, values, backend)
        owner._location = memory
    if memory is None or query.dim() != 2:
        keys = location_keys(projected, features, conv_weight, dense_weight)
        return attend_gathered(owner, backend, query, keys, values, v, mask, normalize, score_bias)
    conv = location_columns(features, conv_weight)
    return memory.attend(query, conv, dense_weight, v, mask, normalize, score_bias)
