"""seq2seq_fast: fused additive (Bahdanau) attention and the attention seq2seq models built on it."""

import importlib

from seq2seq_fast.nn import BahdanauAttention
from seq2seq_fast.ops._library import fused_available
from seq2seq_fast.ops.additive_attention import AdditiveAttentionFunction, additive_attention
from seq2seq_fast.ops.reference import additive_attention_ref

__all__ = [
    "BahdanauAttention",
    "fuse_attention",
    "AdditiveAttentionFunction",
    "additive_attention",
    "additive_attention_ref",
    "fused_available",
]


def __getattr__(name: str):
    # The converter on first use: ``import seq2seq_fast`` (and the translate command) stays
    # without torch.fx and the model families' stand-ins.
    if name == "fuse_attention":
        value = importlib.import_module("seq2seq_fast.nn").fuse_attention
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("seq2seq-fast")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


__version__ = _version()
