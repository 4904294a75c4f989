"""A corpus streamed by blocks, never held as Python strings: normalised, filtered (malformed and
over-long lines counted in a :class:`CorpusReport`), each pair tagged with its split side, and
encoded by chunks; the options that change what is kept (:class:`Options`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from seq2seq_fast.seq2seq.data.corpus import CorpusReport
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.files import CorpusFiles, raw_blocks
from seq2seq_fast.seq2seq.data.normalize import normalize_block
from seq2seq_fast.seq2seq.data.split import MAX_HELD_OUT, SplitRule, choose_held_out

CHUNK_PAIRS = 8192  # pairs normalised and encoded per call


MALFORMED_LISTED = 100  # malformed lines listed with their numbers (the rest only counted)


@dataclass
class Options:
    """What, besides the files and the tokenizers, changes a store's content."""

    normalization: str = "NFKC"
    max_words: int | None = None
    max_pairs: int | None = None
    seed: int = 0
    valid_fraction: float = 0.02
    test_fraction: float = 0.03
    max_held_out: int = MAX_HELD_OUT
    carve: bool = True  # carve valid/test from the file (False: official splits are given)


def _kept_lines(lines: int, options: Options) -> np.ndarray | None:
    """--max-pairs: a bool mask of the lines kept (a seeded random subset), else None."""
    if options.max_pairs is None or options.max_pairs >= lines:
        return None
    keep = np.zeros(lines + 1, dtype=bool)  # indexed by line number, from 1
    rng = np.random.default_rng(options.seed)
    keep[1 + rng.choice(lines, size=options.max_pairs, replace=False)] = True
    return keep


def clean_pairs(
    files: CorpusFiles,
    lines: int,
    options: Options,
    rule: SplitRule,
    report: CorpusReport,
    progress: bool = False,
    desc: str = "reading",
    only: np.ndarray | None = None,
) -> Iterator[tuple[int, str, str]]:
    """(split side, source, target) of every usable pair, normalised, in file order; malformed
    and over-long lines counted in ``report`` (the first ones listed with their numbers).
    ``only``: a bool mask by line number; the other lines are skipped unread (a sample)."""
    from tqdm import tqdm

    keep = _kept_lines(lines, options)
    if only is not None:
        keep = only if keep is None else keep & only
    form, max_words = options.normalization, options.max_words
    number = 0

    def malformed(line: int, why: str) -> None:
        if len(report.malformed) < MALFORMED_LISTED:
            report.malformed.append((line, why))
        else:
            report.more_malformed += 1

    with tqdm(
        total=lines,
        unit=" lines",
        unit_scale=True,
        leave=False,
        desc=desc,
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5,
    ) as bar:
        for src_block, tgt_block in raw_blocks(files, CHUNK_PAIRS):
            first, count = number + 1, len(src_block)
            number += count
            report.lines += count
            bar.update(count)
            if keep is not None:
                kept = np.flatnonzero(keep[first : first + count]).tolist()
                src_block = [src_block[i] for i in kept]
                tgt_block = [tgt_block[i] for i in kept]
            else:
                kept = range(count)
            src_texts, src_bad = normalize_block(src_block, form)
            tgt_texts, tgt_bad = normalize_block(tgt_block, form)
            for k, (src, tgt) in enumerate(zip(src_texts, tgt_texts, strict=True)):
                if not src or not tgt:
                    if tgt_block[k] is None:  # one file, no tab
                        why = (
                            "empty line"
                            if not src_block[k].strip()
                            else "no tab-separated target column"
                        )
                    else:
                        why = src_bad.get(k) or tgt_bad.get(k) or "empty source or target"
                    malformed(first + kept[k], why)
                    continue
                if max_words is not None and max(src.count(" "), tgt.count(" ")) + 1 > max_words:
                    report.too_long += 1
                    continue
                yield rule.side(src), src, tgt


def plan_split(
    files: CorpusFiles, lines: int, options: Options, progress: bool = False
) -> SplitRule:
    """The held-out sets of a corpus (one pass over its normalised sources; see
    :func:`choose_held_out`), or none when official splits are given."""
    probe = SplitRule(options.seed)
    if not options.carve or (options.valid_fraction <= 0 and options.test_fraction <= 0):
        return probe
    from array import array

    hashes = array("I")
    report = CorpusReport(files.name)
    for _, src, _ in clean_pairs(files, lines, options, probe, report, progress, "splitting"):
        hashes.append(probe.source_hash(src))
    if not hashes:
        raise CorpusError(f"no usable sentence pairs in {report.summary()}")
    valid_upto, test_upto = choose_held_out(np.frombuffer(hashes, np.uint32), options, files.name)
    return SplitRule(options.seed, valid_upto, test_upto)


def encoded_chunks(
    vocabs, pairs: Iterator[tuple[int, str, str]], heldout: list[list], cap: int, dropped: list[int]
):
    """Train pairs encoded by chunks -> (source rows, target rows); held-out pairs collected
    into ``heldout`` (valid, test), those over ``cap`` counted in ``dropped``."""
    src_vocab, tgt_vocab = vocabs
    src_chunk: list[str] = []
    tgt_chunk: list[str] = []
    for side, src, tgt in pairs:
        if side == 0:
            src_chunk.append(src)
            tgt_chunk.append(tgt)
            if len(src_chunk) == CHUNK_PAIRS:
                yield src_vocab.encode_batch(src_chunk), tgt_vocab.encode_batch(tgt_chunk)
                src_chunk, tgt_chunk = [], []
        elif len(heldout[side - 1]) < cap:
            heldout[side - 1].append((src, tgt))
        else:
            dropped[side - 1] += 1  # over the cap: left out, never trained on
    if src_chunk:
        yield src_vocab.encode_batch(src_chunk), tgt_vocab.encode_batch(tgt_chunk)
