"""Modules: :class:`BahdanauAttention`, the converter :func:`fuse_attention` and its stand-ins
(:mod:`seq2seq_fast.nn.convert`), the projected-key cache the stand-ins share, and the stepwise
memory that gathers a decoder's per-step attention gradients once per sequence.

Imports only :mod:`seq2seq_fast.ops` of ours; a test enforces it.
"""

from seq2seq_fast.nn.attention import BahdanauAttention
from seq2seq_fast.nn.convert import ConversionReport, fuse_attention, fuse_attention_report
from seq2seq_fast.nn.stepwise import StepwiseMemory

__all__ = [
    "BahdanauAttention",
    "ConversionReport",
    "StepwiseMemory",
    "fuse_attention",
    "fuse_attention_report",
]
