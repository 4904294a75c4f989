"""Parallel corpora read into memory: a tab-separated file (or a .zip holding one), Unicode
normalisation, the split into train/valid/test by source sentence, and the encoded splits with
their two subword vocabularies (:class:`TranslationData`). Big corpora go through the on-disk
token store instead (seq2seq/data/store.py)."""

from __future__ import annotations

import random
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.normalize import normalize_text
from seq2seq_fast.seq2seq.data.split import MAX_HELD_OUT, split_by_source
from seq2seq_fast.seq2seq.data.vocab import (
    SentencePieceVocab,
)


@dataclass
class CorpusReport:
    path: str
    lines: int = 0
    pairs: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)
    too_long: int = 0
    more_malformed: int = 0  # malformed lines counted beyond those listed (big corpora)

    def summary(self, shown: int = 5) -> str:
        malformed = len(self.malformed) + self.more_malformed
        text = (
            f"{self.path}: {self.lines} lines, {self.pairs} pairs kept, "
            f"{malformed} malformed, {self.too_long} over the length limit"
        )
        if self.malformed:
            examples = "; ".join(f"line {n}: {why}" for n, why in self.malformed[:shown])
            more = malformed - shown
            text += f" (malformed {examples}{f'; and {more} more' if more > 0 else ''})"
        return text


def _read_corpus_bytes(path: Path) -> tuple[bytes, str]:
    if not path.exists():
        raise CorpusError(f"corpus file not found: {path}")
    if path.is_dir():
        raise CorpusError(f"corpus path is a directory, not a file: {path}")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                members = [
                    m
                    for m in archive.infolist()
                    if not m.is_dir() and m.filename.lower().endswith((".txt", ".tsv"))
                ]
                data_members = [m for m in members if not Path(m.filename).name.startswith("_")]
                candidates = data_members or members
                if not candidates:
                    raise CorpusError(f"{path}: the zip archive holds no .txt or .tsv file")
                member = max(candidates, key=lambda m: m.file_size)
                return archive.read(member), f"{path}:{member.filename}"
        except zipfile.BadZipFile as exc:
            raise CorpusError(f"{path}: not a readable zip archive ({exc})") from exc
    if path.suffix.lower() == ".zip":
        raise CorpusError(f"{path}: not a readable zip archive (truncated or corrupt)")
    try:
        return path.read_bytes(), str(path)
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc}") from exc


def read_parallel_corpus(
    path: str | Path,
    *,
    normalization: str = "NFKC",
    max_words: int | None = None,
    swap: bool = False,
) -> tuple[list[tuple[str, str]], CorpusReport]:
    """Read ``source<TAB>target[<TAB>anything]`` lines from a text file or a .zip holding one.

    Lines that are not valid UTF-8, have fewer than two columns or an empty side are malformed:
    counted and reported with their line numbers. Pairs with more than ``max_words`` words on a
    side are dropped. ``swap`` reads column 2 as the source. A file with no usable pair raises
    :class:`CorpusError`.
    """
    if normalization not in ("NFC", "NFKC", "NFD", "NFKD"):
        raise ValueError(f"normalization must be NFC, NFKC, NFD or NFKD, got {normalization!r}")
    raw, name = _read_corpus_bytes(Path(path))
    report = CorpusReport(name)
    pairs = []
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    for number, line in enumerate(raw.splitlines(), start=1):
        report.lines += 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.malformed.append((number, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            continue
        if not text.strip():
            report.malformed.append((number, "empty line"))
            continue
        columns = text.split("\t")
        if len(columns) < 2:
            report.malformed.append((number, "no tab-separated target column"))
            continue
        src, tgt = (normalize_text(c, normalization) for c in columns[:2])
        if not src or not tgt:
            report.malformed.append((number, "empty source or target"))
            continue
        if swap:
            src, tgt = tgt, src
        if max_words is not None and max(len(src.split()), len(tgt.split())) > max_words:
            report.too_long += 1
            continue
        pairs.append((src, tgt))
    report.pairs = len(pairs)
    if not pairs:
        raise CorpusError(f"no usable sentence pairs in {report.summary()}")
    return pairs, report


@dataclass
class TranslationData:
    """Encoded splits and the two subword vocabularies of a parallel corpus."""

    src_vocab: SentencePieceVocab
    tgt_vocab: SentencePieceVocab
    train: list[tuple[list[int], list[int]]]
    valid: list[tuple[str, str]]
    test: list[tuple[str, str]]
    report: CorpusReport

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        swap: bool = False,
        max_words: int | None = 12,
        max_pairs: int | None = None,
        vocab_size: int = 4000,
        normalization: str = "NFKC",
        valid_fraction: float = 0.02,
        test_fraction: float = 0.03,
        seed: int = 0,
        vocabs: tuple[SentencePieceVocab, SentencePieceVocab] | None = None,
        valid_path: str | Path | None = None,
        test_path: str | Path | None = None,
        max_held_out: int | None = MAX_HELD_OUT,
    ) -> TranslationData:
        """Read, filter, split; train the two subword vocabularies on the training split (or use
        ``vocabs``, e.g. a checkpoint's, when resuming) and encode the training pairs.

        With ``valid_path`` (and optionally ``test_path``) the corpora are official splits, used
        as given: ``path`` is all training data (``max_words``/``max_pairs`` apply to it only),
        the valid and test files are read whole and not split; no test file: no test set."""
        if test_path is not None and valid_path is None:
            raise CorpusError("a test file needs a validation file too (--valid-data)")
        pairs, report = read_parallel_corpus(
            path, normalization=normalization, max_words=max_words, swap=swap
        )
        if max_pairs is not None and len(pairs) > max_pairs:
            pairs = random.Random(seed).sample(pairs, max_pairs)
        if valid_path is None:
            train, valid, test = split_by_source(
                pairs, valid_fraction, test_fraction, seed, max_held_out
            )
        else:
            train, test = pairs, []
            valid = read_parallel_corpus(valid_path, normalization=normalization, swap=swap)[0]
            if test_path is not None:
                test = read_parallel_corpus(test_path, normalization=normalization, swap=swap)[0]
        if vocabs is not None:
            src_vocab, tgt_vocab = vocabs
        else:
            src_vocab = SentencePieceVocab.train([s for s, _ in train], vocab_size)
            tgt_vocab = SentencePieceVocab.train([t for _, t in train], vocab_size)
        encoded = [(src_vocab.encode(s), tgt_vocab.encode(t)) for s, t in train]
        encoded = [(s, t) for s, t in encoded if s and t]
        return cls(src_vocab, tgt_vocab, encoded, valid, test, report)
