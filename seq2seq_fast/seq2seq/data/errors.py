"""The data side's one error type."""

from __future__ import annotations


class CorpusError(ValueError):
    """A corpus file that cannot be used (missing, unreadable, or yielding no sentence pairs)."""
