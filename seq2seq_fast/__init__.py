"""seq2seq_fast: fused additive (Bahdanau) attention and the attention seq2seq models built on it."""

from seq2seq_fast.nn import BahdanauAttention, fuse_attention
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


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("seq2seq-fast")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


__version__ = _version()
