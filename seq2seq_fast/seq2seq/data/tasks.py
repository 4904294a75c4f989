"""The tasks a training job draws its batches from: the built-in reversal task."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seq2seq_fast.seq2seq.data.vocab import SPECIALS, SymbolVocab

_SYMBOL_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def reverse_symbols(vocab_size: int) -> list[str]:
    """Single characters while they last (so "abc" reads as a sequence), then w62, w63, ..."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return [_SYMBOL_CHARS[i] if i < len(_SYMBOL_CHARS) else f"w{i}" for i in range(vocab_size)]


@dataclass
class ReverseTask:
    """Random token sequences and their reversal; training data is drawn fresh every batch.

    Lengths are uniform in [min_len, max_len]; tokens uniform over ``vocab_size`` symbols. The
    held-out set is drawn from its own seed; with these sizes (>= 26^8 sequences) a training draw
    repeats a held-out sequence with negligible probability.
    """

    vocab_size: int = 32
    min_len: int = 8
    max_len: int = 24
    seed: int = 0
    heldout_size: int = 1000

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={self.min_len} max_len={self.max_len}"
            )
        self.vocab = SymbolVocab(reverse_symbols(self.vocab_size))

    def sample(self, generator: torch.Generator, count: int) -> list[tuple[list[int], list[int]]]:
        lengths = torch.randint(self.min_len, self.max_len + 1, (count,), generator=generator)
        tokens = torch.randint(
            len(SPECIALS),
            len(SPECIALS) + self.vocab_size,
            (count, self.max_len),
            generator=generator,
        )
        pairs = []
        for n, row in zip(lengths.tolist(), tokens.tolist(), strict=True):
            src = row[:n]
            pairs.append((src, src[::-1]))
        return pairs

    def heldout(self) -> list[tuple[list[int], list[int]]]:
        generator = torch.Generator().manual_seed(self.seed + 1_000_003)
        return self.sample(generator, self.heldout_size)
