"""Modules: :class:`BahdanauAttention`, the converter :func:`fuse_attention` and its stand-ins, and the
stepwise memory that gathers a decoder's per-step attention gradients once per sequence.

Imports only :mod:`seq2seq_fast.ops` of ours; a test enforces it.
"""

from seq2seq_fast.nn.attention import BahdanauAttention, fuse_attention
from seq2seq_fast.nn.stepwise import StepwiseMemory

__all__ = ["BahdanauAttention", "StepwiseMemory", "fuse_attention"]
