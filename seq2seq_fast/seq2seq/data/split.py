"""Held-out sets carved from one corpus: every translation of one source sentence on the same
side. In memory, a seeded shuffle of the distinct sources (:func:`split_by_source`); streamed, a
seeded hash of each source chosen in one pass (:class:`SplitRule`, :func:`choose_held_out`).
Either way at most ``MAX_HELD_OUT`` pairs each by default."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from seq2seq_fast.seq2seq.data.errors import CorpusError

if TYPE_CHECKING:
    from seq2seq_fast.seq2seq.data.stream import Options


# Validation and test sets carved from one corpus file hold at most this many source sentences
# each (NMT toolkits use a few thousand; 3% of a 2M-pair corpus was 60k test pairs).
MAX_HELD_OUT = 3000


def split_by_source(
    pairs: Sequence[tuple[str, str]],
    valid_fraction: float,
    test_fraction: float,
    seed: int,
    max_held_out: int | None = MAX_HELD_OUT,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Fixed-seed train/valid/test split that keeps every translation of one source sentence in the
    same split (Tatoeba repeats sources), so held-out sources are never seen in training. The
    valid and test sets take their fraction of the sources, at most ``max_held_out`` each."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for pair in pairs:
        groups.setdefault(pair[0], []).append(pair)
    sources = list(groups)
    random.Random(seed).shuffle(sources)
    n_valid = max(1, round(len(sources) * valid_fraction)) if valid_fraction > 0 else 0
    n_test = max(1, round(len(sources) * test_fraction)) if test_fraction > 0 else 0
    if max_held_out is not None:
        n_valid, n_test = min(n_valid, max_held_out), min(n_test, max_held_out)
    if n_valid + n_test >= len(sources):
        raise CorpusError(
            f"too few distinct source sentences ({len(sources)}) for a train/valid/test split"
        )
    valid = [p for s in sources[:n_valid] for p in groups[s]]
    test = [p for s in sources[n_valid : n_valid + n_test] for p in groups[s]]
    train = [p for s in sources[n_valid + n_test :] for p in groups[s]]
    return train, valid, test


@dataclass(frozen=True)
class SplitRule:
    """Which pairs are held out: a seeded hash of the source sentence; hashes up to
    ``valid_upto`` go to the validation set, then up to ``test_upto`` to the test set (-1: none),
    so every pair of one source lands on one side."""

    seed: int
    valid_upto: int = -1
    test_upto: int = -1

    def source_hash(self, source: str) -> int:
        return zlib.crc32(source.encode(), self.seed * 2654435761 % (1 << 32))

    def side(self, source: str) -> int:
        """0 train, 1 valid, 2 test (of the normalised source sentence)."""
        if self.test_upto < 0 and self.valid_upto < 0:
            return 0
        h = self.source_hash(source)
        if h <= self.valid_upto:
            return 1
        return 2 if h <= self.test_upto else 0


def choose_held_out(
    hashes: np.ndarray, options: Options, name: str = "the corpus"
) -> tuple[int, int]:
    """-> (valid_upto, test_upto) from the source hashes of the usable pairs: whole source groups
    in hash order, each set up to its fraction of the pairs and ``max_held_out`` pairs, at least
    one group each, at least one group left to train on. CorpusError when the corpus has too few
    distinct sources for that."""
    values, counts = np.unique(np.asarray(hashes, np.uint32), return_counts=True)
    usable = int(counts.sum())
    fractions = (options.valid_fraction, options.test_fraction)
    sets = sum(f > 0 for f in fractions)
    if len(values) < sets + 1:
        wanted = " and a test" if sets == 2 else ""
        raise CorpusError(
            f"{name}: {len(values)} distinct source sentence(s) in {usable} usable pairs: too few "
            f"to carve a validation{wanted} set and keep pairs to train on (pairs with one source "
            "stay on one side); give an official split (--valid-data, or --valid-src/--valid-tgt)"
            + (", or --test-fraction 0" if sets == 2 else "")
        )
    bounds, cursor = [-1, -1], 0
    for k, fraction in enumerate(fractions):
        if fraction > 0:
            room = min(options.max_held_out, max(1, round(fraction * usable)))
            last = len(values) - 1 - (k == 0 and fractions[1] > 0)  # groups left for the rest
            first = cursor
            while cursor < last and (cursor == first or counts[cursor] <= room):
                room -= int(counts[cursor])
                cursor += 1
                if room <= 0:
                    break
        bounds[k] = int(values[cursor - 1]) if cursor else -1
    if fractions[1] > 0 and bounds[1] == bounds[0]:
        bounds[1] = -1
    return bounds[0], max(bounds)
