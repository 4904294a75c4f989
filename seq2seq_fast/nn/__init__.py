"""Modules: :class:`BahdanauAttention`, the converter :func:`fuse_attention` and its stand-ins
(:mod:`seq2seq_fast.nn.convert`), the projected-key cache the stand-ins share, and the stepwise
memory that gathers a decoder's per-step attention gradients once per sequence.

Imports only :mod:`seq2seq_fast.ops` of ours; a test enforces it. The converter is imported on
first use of one of its names (it pulls in torch.fx and every model family's stand-ins, which
``seq2seq-fast translate`` does not need: start-up time).
"""

import importlib

from seq2seq_fast.nn.attention import BahdanauAttention
from seq2seq_fast.nn.stepwise import StepwiseMemory

_CONVERTER_NAMES = ("ConversionReport", "fuse_attention", "fuse_attention_report")

__all__ = [
    "BahdanauAttention",
    "ConversionReport",
    "StepwiseMemory",
    "fuse_attention",
    "fuse_attention_report",
]


def __getattr__(name: str):
    if name in _CONVERTER_NAMES:
        value = getattr(importlib.import_module("seq2seq_fast.nn.convert"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
