"""The step memory of a decoder's steps (the steps' key and value gradients gathered once per
sequence), re-exported from :mod:`seq2seq_fast.ops.stepwise`, where the memories and their
autograd Functions live: ``seq2seq_fast.nn.StepwiseMemory``. The converter's runtime makes one
per sequence where it applies (``nn/convert/traced/rewrite.py``).
"""

from __future__ import annotations

from seq2seq_fast.ops.stepwise import StepwiseMemory

__all__ = ["StepwiseMemory"]
