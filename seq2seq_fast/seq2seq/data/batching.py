"""Batching: padded id tensors (:class:`Batch`), and the index lists of one epoch's batches, of
a fixed number of pairs (``epoch_batches``) or of at most a number of padded tokens
(``token_batches``), over pairs in memory or a token store's length index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq_fast.seq2seq.data.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """src [B, S], src_lengths [B], tgt_in [B, T] (<s> y...), tgt_out [B, T] (y... </s>), pad = 0."""

    src: Tensor
    src_lengths: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    @property
    def num_target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            *(t.to(device) for t in (self.src, self.src_lengths, self.tgt_in, self.tgt_out))
        )


def make_batch(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    src_pad_to: int | None = None,
    tgt_pad_to: int | None = None,
) -> Batch:
    """Pad id sequences into a Batch; ``*_pad_to`` fixes the padded widths (for torch.compile)."""
    batch = len(pairs)
    src_width = max(len(s) for s, _ in pairs)
    tgt_width = max(len(t) for _, t in pairs) + 1
    src_width = max(src_width, src_pad_to or 0)
    tgt_width = max(tgt_width, tgt_pad_to or 0)
    # Padded rows as Python lists, then one tensor each: a copy per row was much slower.
    src_rows, in_rows, out_rows = [], [], []
    for s, t in pairs:
        s, t = _id_list(s), _id_list(t)
        src_rows.append(s + [PAD_ID] * (src_width - len(s)))
        in_rows.append([BOS_ID] + t + [PAD_ID] * (tgt_width - 1 - len(t)))
        out_rows.append(t + [EOS_ID] + [PAD_ID] * (tgt_width - 1 - len(t)))
    src, tgt_in, tgt_out = (
        torch.tensor(rows, dtype=torch.long).reshape(batch, -1)
        for rows in (src_rows, in_rows, out_rows)
    )
    return Batch(src, torch.tensor([len(s) for s, _ in pairs], dtype=torch.long), tgt_in, tgt_out)


def _id_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else torch.as_tensor(ids, dtype=torch.long).tolist()


def epoch_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    bucket: int = 50,
) -> list[list[int]]:
    """The index lists of one epoch's batches for this rank: a fixed-seed shuffle per epoch, sorted
    by length within buckets of ``bucket`` batches (less padding), batch order shuffled again.
    Every rank gets the same number of batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    lengths = _store_lengths(pairs)
    if lengths is not None:  # a token store: the same batches, from its length index
        return _epoch_batches_indexed(lengths, batch_size, generator, rank, world_size, bucket)
    order = torch.randperm(len(pairs), generator=generator).tolist()
    chunk = batch_size * bucket
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: len(pairs[i][0]))
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return _rank_share([batches[i] for i in shuffle], rank, world_size)


def max_lengths(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int]:
    """-> (longest source, longest target) of the pairs (a token store: from its index)."""
    lengths = _store_lengths(pairs)
    if lengths is not None:
        return int(lengths[:, 0].max()), int(lengths[:, 1].max())
    return max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)


def padded_width(pair: tuple[Sequence[int], Sequence[int]]) -> int:
    """What one pair takes in a token-limited batch: the longer of its source and its target with
    </s> (the widths a batch pads to)."""
    return max(len(pair[0]), len(pair[1]) + 1)


def token_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """The index lists of one epoch's batches for this rank, each of length-similar pairs holding
    at most ``max_tokens`` padded tokens: pairs x max(longest source, longest target + 1).

    The pairs are sorted by (target, source) length, pairs of equal lengths in a fresh seeded
    order every epoch, cut greedily into batches, and the batch order shuffled (seeded). A pair
    wider than ``max_tokens`` by itself gets a batch of its own (so none is dropped). The cuts
    depend on the lengths only, so every epoch has the same number of batches (what the
    learning-rate schedule and the progress bar count) while their contents change. Every rank
    gets the same number of batches (the surplus of an uneven split is left out)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    lengths = _store_lengths(pairs)
    if lengths is not None:
        return _token_batches_indexed(lengths, max_tokens, generator, rank, world_size)
    order = torch.randperm(len(pairs), generator=generator).tolist()
    order.sort(key=lambda i: (len(pairs[i][1]), len(pairs[i][0])))  # stable: random among ties
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index in order:
        grown = max(width, padded_width(pairs[index]))
        if current and grown * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, grown = [], padded_width(pairs[index])
        current.append(index)
        width = grown
    if current:
        batches.append(current)
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return _rank_share([batches[i] for i in shuffle], rank, world_size)


def padding_fractions(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batches: Sequence[Sequence[int]]
) -> tuple[float, float]:
    """-> (source, target) share of padding positions in these batches (target with </s>)."""
    lengths = _store_lengths(pairs)
    if lengths is not None and batches:
        import numpy as np

        sizes = np.fromiter(map(len, batches), np.int64, len(batches))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        widths = lengths[np.concatenate(batches)]  # int32 [N, 2]: a copy, changed in place
        widths[:, 1] += 1  # target with </s>
        real = widths.sum(axis=0, dtype=np.int64)
        padded = (np.maximum.reduceat(widths, starts, axis=0) * sizes[:, None]).sum(axis=0)
        src_pad, tgt_pad = (1.0 - r / p if p else 0.0 for r, p in zip(real, padded, strict=True))
        return float(src_pad), float(tgt_pad)
    real = [0, 0]
    padded = [0, 0]
    for batch in batches:
        src = [len(pairs[i][0]) for i in batch]
        tgt = [len(pairs[i][1]) + 1 for i in batch]
        for side, lengths in enumerate((src, tgt)):
            real[side] += sum(lengths)
            padded[side] += max(lengths) * len(lengths)
    src_pad, tgt_pad = (1.0 - r / p if p else 0.0 for r, p in zip(real, padded, strict=True))
    return src_pad, tgt_pad


# --- batches from a length index (a token store: seq2seq/data/store.py) ----------------------------
#
# The batching above reads len(pairs[i]) for every pair: over a memory-mapped store of millions of
# pairs that is millions of reads and Python lists. These read the store's int32 [N, 2] length
# index instead, with numpy, and give batches of the same kind.


def _store_lengths(pairs):
    """The int32 [N, 2] (source, target) length index of a token store, else None."""
    return getattr(pairs, "lengths", None)


def _rank_share(batches: list, rank: int, world_size: int) -> list:
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    return batches[rank::world_size][:per_rank]


def _epoch_batches_indexed(
    lengths, batch_size: int, generator: torch.Generator, rank: int, world_size: int, bucket: int
) -> list:
    """epoch_batches over a length index: the same draws and sorts, so the same batches."""
    import numpy as np

    order = torch.randperm(len(lengths), generator=generator).numpy()
    chunk = batch_size * bucket
    # sort by source length within each chunk of the shuffled order (stable, as sorted() is);
    # one int64 key, built in place: at 10M pairs every temporary array is 80 MB
    key = np.arange(len(order), dtype=np.int64)
    key //= chunk
    key *= int(lengths[:, 0].max()) + 1
    key += lengths[order, 0]
    order = order[np.argsort(key, kind="stable")]
    del key
    batches = np.split(order, np.arange(batch_size, len(order), batch_size))
    # a chunk that is not a multiple of batch_size is only the last one: the cuts agree
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return _rank_share([batches[i] for i in shuffle], rank, world_size)


def _token_batches_indexed(
    lengths, max_tokens: int, generator: torch.Generator, rank: int, world_size: int
) -> list:
    """token_batches over a length index: pairs sorted by (padded width, target, source), ties in
    a fresh seeded order every epoch, cut greedily at ``max_tokens`` padded tokens. Sorted by
    width first, the width of a batch is that of its last pair, so a cut is found per batch (not
    per pair) from the boundaries of the runs of equal width."""
    import numpy as np

    # one int64 key (width, target, source), 21 bits each, sorted stably after a seeded shuffle:
    # fewer big temporaries than a lexsort of three gathered columns
    if int(lengths.max()) >= 1 << 20:
        raise ValueError(f"a sentence of {int(lengths.max())} tokens: at most 2^20 - 1 here")
    key = np.maximum(lengths[:, 0], lengths[:, 1] + 1).astype(np.int64)
    key <<= 21
    key |= lengths[:, 1]
    key <<= 21
    key |= lengths[:, 0]
    order = torch.randperm(len(lengths), generator=generator).numpy()
    order = order[np.argsort(key[order], kind="stable")]
    sorted_width = (key[order] >> 42).astype(np.int32)
    del key
    run_starts = np.flatnonzero(np.diff(sorted_width, prepend=-1))
    run_widths = sorted_width[run_starts].tolist()
    run_ends = np.append(run_starts[1:], len(order)).tolist()
    run_starts = run_starts.tolist()
    cuts, start, run, total = [0], 0, 0, len(order)
    while start < total:
        while run_ends[run] <= start:
            run += 1
        end, r = start + 1, run  # a pair wider than max_tokens gets a batch of its own
        while r < len(run_starts):
            fit = start + max_tokens // run_widths[r]  # the batch may end before this index
            if fit <= run_starts[r]:
                break
            end = max(end, min(fit, run_ends[r]))
            if fit < run_ends[r]:
                break
            r += 1
        cuts.append(end)
        start = end
    batches = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    shuffle = torch.randperm(len(batches), generator=generator).tolist()
    return _rank_share([batches[i] for i in shuffle], rank, world_size)
