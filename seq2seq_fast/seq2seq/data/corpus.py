"""Tasks, vocabularies and batching: the built-in reversal task and parallel-corpus translation.

Vocabularies put <pad>=0, <unk>=1, <s>=2, </s>=3 (see ``seq2seq_fast.seq2seq.models``) and serialise to
plain dicts stored in checkpoints (a sentencepiece model travels as its serialized bytes), so a
checkpoint is self-contained.
"""

from __future__ import annotations

import io
import math
import random
import unicodedata
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

# Token ids: every vocabulary in this package puts <pad>=0, <unk>=1, <s>=2, </s>=3.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


class CorpusError(ValueError):
    """A corpus file that cannot be used (missing, unreadable, or yielding no sentence pairs)."""


# --- vocabularies ----------------------------------------------------------------------------------


class SymbolVocab:
    """A fixed list of whitespace-separated symbols (the reversal task's vocabulary)."""

    kind = "symbols"

    def __init__(self, symbols: Sequence[str]) -> None:
        self.symbols = list(symbols)
        self.itos = list(SPECIALS) + self.symbols
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("vocabulary symbols must be unique and differ from the specials")

    def __len__(self) -> int:
        return len(self.itos)

    def split(self, text: str) -> list[str]:
        parts = text.split()
        # With single-character symbols, "abc" and "hello world" read as "a b c", "h e l l o ...".
        if any(p not in self.stoi for p in parts) and all(c in self.stoi for c in "".join(parts)):
            return list("".join(parts))
        return parts

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(s, UNK_ID) for s in self.split(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.pieces(ids))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.itos[i] if 0 <= i < len(self.itos) else "<unk>" for i in ids]

    def to_state(self) -> dict:
        return {"kind": self.kind, "symbols": list(self.symbols)}


class SentencePieceVocab:
    """A sentencepiece subword model (trained offline on the training split)."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        # A model trained elsewhere (unk=0, bos=1, eos=2, no pad, as sentencepiece's defaults
        # are) is used as is: its ids mapped onto ours, its own specials onto ours, every other
        # piece after them in its order. None: the ids are ours already.
        self._to_ours: list[int] | None = None
        self._to_spm: list[int] | None = None
        sp = self.sp
        if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            specials = {
                sp.pad_id(): PAD_ID,
                sp.unk_id(): UNK_ID,
                sp.bos_id(): BOS_ID,
                sp.eos_id(): EOS_ID,
            }
            specials.pop(-1, None)
            to_ours, to_spm = [], [sp.unk_id()] * len(SPECIALS)
            for i in range(sp.get_piece_size()):
                if i in specials:
                    to_ours.append(specials[i])
                    to_spm[specials[i]] = i
                else:
                    to_ours.append(len(to_spm))
                    to_spm.append(i)
            self._to_ours, self._to_spm = to_ours, to_spm

    @classmethod
    def train(cls, sentences: Iterable[str], vocab_size: int) -> SentencePieceVocab:
        """Train on ``sentences`` (any iterable, read once; seq2seq/data/store.py passes a sample)."""
        import sentencepiece as spm

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            hard_vocab_limit=False,  # small corpora get a smaller vocabulary instead of an error
            num_threads=1,  # deterministic: the same corpus gives the same vocabulary
            minloglevel=2,
        )
        return cls(model.getvalue())

    def __len__(self) -> int:
        return self.sp.get_piece_size() if self._to_spm is None else len(self._to_spm)

    def encode(self, text: str) -> list[int]:
        ids = self.sp.encode(text, out_type=int)
        if self._to_ours is not None:
            to_ours = self._to_ours
            ids = [to_ours[i] for i in ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of many sentences in one call (sentencepiece's C++ loop)."""
        rows = self.sp.encode(list(texts), out_type=int)
        if self._to_ours is not None:
            to_ours = self._to_ours
            rows = [[to_ours[i] for i in row] for row in rows]
        return rows

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._to_spm is not None:  # our specials other than <unk> are not text
            to_spm = self._to_spm
            ids = [to_spm[i] for i in ids if i == UNK_ID or len(SPECIALS) <= i < len(to_spm)]
        return self.sp.decode(ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        if self._to_spm is None:
            return [self.sp.id_to_piece(int(i)) for i in ids]
        return [
            SPECIALS[i]
            if 0 <= i < len(SPECIALS)
            else self.sp.id_to_piece(self._to_spm[i])
            if i < len(self._to_spm)
            else "<unk>"
            for i in map(int, ids)
        ]

    def to_state(self) -> dict:
        return {"kind": self.kind, "model": self.model_proto}


def vocab_from_state(state: dict) -> SymbolVocab | SentencePieceVocab:
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind == SymbolVocab.kind:
        return SymbolVocab(state["symbols"])
    if kind == SentencePieceVocab.kind:
        return SentencePieceVocab(state["model"])
    if kind == "words":  # pre-tokenised text with a vocabulary file (seq2seq/data/vocab.py)
        from seq2seq_fast.seq2seq.data.vocab import WordVocab

        return WordVocab(state["tokens"])
    raise ValueError(f"unknown vocabulary kind {kind!r}")


# --- batching --------------------------------------------------------------------------------------


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
    # Padded rows as Python lists, then one tensor each: a copy per row took 5 ms a batch.
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


# --- the reversal task -----------------------------------------------------------------------------

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


# --- parallel corpora ------------------------------------------------------------------------------


def normalize_text(text: str, form: str = "NFKC") -> str:
    """Unicode normalisation, with U+202F/U+00A0 (French spacing before ! ?) and runs of
    whitespace turned into single spaces."""
    text = unicodedata.normalize(form, text)
    text = text.replace("\u202f", " ").replace("\u00a0", " ")
    return " ".join(text.split())


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
    batches = [batches[i] for i in shuffle]
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    return batches[rank::world_size][:per_rank]


def max_lengths(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int]:
    """-> (longest source, longest target) of the pairs (a token store: from its index)."""
    lengths = _store_lengths(pairs)
    if lengths is not None:
        return int(lengths[:, 0].max()), int(lengths[:, 1].max())
    return max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)


def shared_vocab(holder) -> bool:
    """Whether ``holder``'s (a task's or a corpus's) two vocabularies are one: the same object
    or the same content (a checkpoint's, read back as two)."""
    src, tgt = holder.src_vocab, holder.tgt_vocab
    return src is tgt or src.to_state() == tgt.to_state()


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
    batches = [batches[i] for i in shuffle]
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    return batches[rank::world_size][:per_rank]


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


# --- batches from a length index (a token store: seq2seq/data/store.py) ---------------------------------
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


def chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
