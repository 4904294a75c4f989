"""The tasks a training job draws its batches from: the built-in reversal task and a parallel
corpus to translate. Both give the training loop the same things (:class:`Task`): the two
vocabularies, one epoch's plan, the pairs of one optimiser step and an example sentence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from seq2seq_fast.seq2seq.data.batching import epoch_batches, max_lengths, token_batches
from seq2seq_fast.seq2seq.data.corpus import TranslationData
from seq2seq_fast.seq2seq.data.vocab import SPECIALS, SymbolVocab

_SYMBOL_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def reverse_symbols(vocab_size: int) -> list[str]:
    """Single characters while they last (so "abc" reads as a sequence), then w62, w63, ..."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return [_SYMBOL_CHARS[i] if i < len(_SYMBOL_CHARS) else f"w{i}" for i in range(vocab_size)]


class Task:
    """What the training loop needs from a task. ``config`` is the job's TrainConfig (its seed,
    batch_size, batch_tokens and accum_steps are read), ``ctx`` its process (rank, world_size).

    ``steps_per_epoch`` counts optimiser steps, ``pad_src``/``pad_tgt`` are the padded widths under
    torch.compile, ``info`` is stored in the checkpoint, and ``generator`` (None when the batches
    are a fixed plan) draws the training batches and travels in the checkpoint for resume."""

    kind: str
    src_vocab: Any
    tgt_vocab: Any
    steps_per_epoch: int
    pad_src: int
    pad_tgt: int
    info: dict[str, Any]
    generator: torch.Generator | None = None

    def epoch_plan(self, config: Any, epoch: int, ctx: Any) -> list[list[int]] | None:
        """This rank's batches (index lists) of one epoch, or None when batches are drawn."""
        raise NotImplementedError

    def step_pairs(self, config: Any, plan: list[list[int]] | None, step: int) -> list:
        """The id pairs of each of the ``accum_steps`` batches of the epoch's step ``step``."""
        raise NotImplementedError

    def example(self) -> str:
        """The held-out sentence drawn in the final heatmap."""
        raise NotImplementedError


@dataclass
class ReverseTask(Task):
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
    steps_per_epoch: int = 100
    rank: int = 0  # of the process: each draws its own training batches

    kind = "reverse"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={self.min_len} max_len={self.max_len}"
            )
        self.vocab = SymbolVocab(reverse_symbols(self.vocab_size))
        self.src_vocab = self.tgt_vocab = self.vocab
        self.pad_src, self.pad_tgt = self.max_len, self.max_len + 1
        self.info = {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "min_len": self.min_len,
            "max_len": self.max_len,
        }
        self.generator = torch.Generator().manual_seed(self.seed * 7919 + 17 + self.rank)
        self.heldout_pairs = self.heldout()

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

    def epoch_plan(self, config: Any, epoch: int, ctx: Any) -> None:
        return None  # drawn fresh

    def step_pairs(self, config: Any, plan: None, step: int) -> list:
        return [self.sample(self.generator, config.batch_size) for _ in range(config.accum_steps)]

    def example(self) -> str:
        return self.src_vocab.decode(self.heldout_pairs[0][0])


@dataclass
class TranslationTask(Task):
    """A parallel corpus's encoded training pairs, cut into batches by a seeded plan per epoch,
    with its valid and test sentences (``corpus``)."""

    corpus: TranslationData
    info: dict[str, Any]
    steps_per_epoch: int = 0  # set by the caller from epoch 0's plan
    last_plan: tuple | None = field(default=None, repr=False)  # (its key, the plan)

    kind = "translate"

    def __post_init__(self) -> None:
        self.src_vocab, self.tgt_vocab = self.corpus.src_vocab, self.corpus.tgt_vocab
        self.generator = None
        self.pad_src, longest_tgt = max_lengths(self.corpus.train)
        self.pad_tgt = longest_tgt + 1

    def epoch_plan(self, config: Any, epoch: int, ctx: Any) -> list[list[int]]:
        """The last plan is kept: the caller counts epoch 0's batches, the first epoch then uses
        them (over millions of pairs a plan takes seconds)."""
        key = (epoch, ctx.rank, ctx.world_size, config.seed, config.batch_tokens, config.batch_size)
        if self.last_plan is not None and self.last_plan[0] == key:
            return self.last_plan[1]
        common = {"seed": config.seed, "epoch": epoch, "rank": ctx.rank}
        if config.batch_tokens is not None:
            plan = token_batches(
                self.corpus.train, config.batch_tokens, world_size=ctx.world_size, **common
            )
        else:
            plan = epoch_batches(
                self.corpus.train, config.batch_size, world_size=ctx.world_size, **common
            )
        self.last_plan = (key, plan)
        return plan

    def step_pairs(self, config: Any, plan: list[list[int]], step: int) -> list:
        """The plan's batches step * N ... step * N + N - 1 (N = accum_steps), fewer at the
        epoch's end."""
        n, train = config.accum_steps, self.corpus.train
        return [[train[i] for i in plan[b]] for b in range(step * n, min(len(plan), step * n + n))]

    def example(self) -> str:
        return (self.corpus.test or self.corpus.valid)[0][0]
