"""A decoder's step memory for the converter's stand-ins: the projected keys and values its steps
attend to, through a :class:`~seq2seq_fast.ops.stepwise.StepwiseMemory` (the steps' key and value
gradients gathered once per sequence) where that applies. The memories and their autograd
Functions live in :mod:`seq2seq_fast.ops.stepwise`; ``StepwiseMemory`` is re-exported here (it is
``seq2seq_fast.nn.StepwiseMemory``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from seq2seq_fast.ops.stepwise import StepwiseMemory

__all__ = ["StepMemory", "StepwiseMemory", "step_memory"]


class StepMemory(NamedTuple):
    """What a stand-in's decoder steps attend to, as :func:`step_memory` makes it."""

    keys: Tensor  # [B, S, H]: the projected keys, or the StepwiseMemory's alias of them
    values: Tensor  # [B, S, Dv], or the StepwiseMemory's alias of them
    stepwise: StepwiseMemory | None  # pass as additive_attention(..., stepwise=); None: n/a
    projection: Tensor  # the projected keys themselves (what a ProjectionCache should watch)


def step_memory(
    keys: Tensor,
    values: Tensor,
    backend: str,
    *,
    stepwise: bool = True,
) -> StepMemory:
    """The memory of a decoder's steps: projected keys [B, S, H] and values [B, S, Dv], through a
    :class:`StepwiseMemory` where it applies (``stepwise`` steps, training on the CPU kernel;
    :meth:`StepwiseMemory.for_training`), else as given."""
    memory = StepwiseMemory.for_training(keys, values, backend) if stepwise else None
    if memory is None:
        return StepMemory(keys, values, None, keys)
    return StepMemory(memory.keys, memory.values, memory, keys)
