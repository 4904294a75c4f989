"""Vocabularies: the reversal task's symbols, sentencepiece subword models (trained here or the
user's own), and word lists for pre-tokenised text; how they serialise into checkpoints and the
checks that a user's tokenizer fits a corpus or a checkpoint.

Every vocabulary here puts <pad>=0, <unk>=1, <s>=2, </s>=3 and serialises to a plain dict stored in
checkpoints (a sentencepiece model travels as its serialized bytes), so a checkpoint is
self-contained. A sentencepiece model trained with other special ids is used as is, its ids mapped
onto ours (:class:`SentencePieceVocab`).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from seq2seq_fast.seq2seq.data.errors import CorpusError

# Token ids: every vocabulary in this package puts <pad>=0, <unk>=1, <s>=2, </s>=3.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


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
        try:
            _train_sentencepiece(spm, sentences, model, vocab_size)
        except RuntimeError as exc:  # e.g. fewer pieces than the corpus has characters
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(
                f"--spm-vocab-size {vocab_size}: sentencepiece could not train a vocabulary of "
                f"that size on this corpus ({first[:300]})"
            ) from None
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


# Spellings of the special tokens that toolkits write into their vocabulary files: they are ours
# already (ids 0-3), so a file listing them does not add them again.
SPECIAL_SPELLINGS = frozenset(
    {
        *SPECIALS,
        "<blank>",
        "<bos>",
        "<eos>",
        "<unk>",
        "<UNK>",
        "<PAD>",
        "<S>",
        "</S>",
        "<BOS>",
        "<EOS>",
    }
)


class WordVocab:
    """A list of tokens for pre-tokenised text: a sentence is its whitespace-separated tokens,
    a token not in the list is <unk>, and decoding joins tokens with single spaces."""

    kind = "words"

    def __init__(self, tokens: Sequence[str], lines: Sequence[int] | None = None) -> None:
        self.tokens = list(tokens)
        self.lines = list(lines) if lines is not None else None  # of the file, per token
        self.itos = list(SPECIALS) + self.tokens
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("vocabulary tokens must be unique and differ from the specials")

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        get = self.stoi.get
        return [get(token, UNK_ID) for token in text.split()]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(p for p in self.pieces(ids) if p not in SPECIALS[:1] + SPECIALS[2:])

    def pieces(self, ids: Sequence[int]) -> list[str]:
        itos = self.itos
        return [itos[i] if 0 <= i < len(itos) else "<unk>" for i in map(int, ids)]

    def to_state(self) -> dict:
        return {"kind": self.kind, "tokens": list(self.tokens)}


def read_vocab_file(path: str | Path) -> WordVocab:
    """A vocabulary file: one token per line, optionally ``token<TAB>count`` (or ``token count``)
    as toolkits write them; the specials' spellings (<unk>, <s>, </s>, <pad>, <blank>) are
    skipped. Errors name the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"vocabulary file not found: {path}")
    tokens: list[str] = []
    seen: dict[str, int] = {}
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{path} line {number}: not valid UTF-8 ({exc.reason})") from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                raise CorpusError(f"{path} line {number}: empty line, expected a token")
            parts = line.split("\t") if "\t" in line else line.split(" ")
            parts = [p for p in parts if p != ""]
            if len(parts) > 2:
                raise CorpusError(
                    f"{path} line {number}: expected 'token' or 'token<TAB>count', got {line!r}"
                )
            if len(parts) == 2:
                try:
                    int(float(parts[1]))
                except ValueError:
                    raise CorpusError(
                        f"{path} line {number}: the count {parts[1]!r} is not a number"
                    ) from None
            token = parts[0]
            if token in SPECIAL_SPELLINGS:
                continue
            if token in seen:
                raise CorpusError(
                    f"{path} line {number}: token {token!r} is already on line {seen[token]}"
                )
            seen[token] = number
            tokens.append(token)
    if not tokens:
        raise CorpusError(f"{path}: the vocabulary file lists no token")
    return WordVocab(tokens, [seen[t] for t in tokens])


def read_spm_model(path: str | Path) -> SentencePieceVocab:
    """An existing sentencepiece model file (``*.model``), used as is."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"sentencepiece model not found: {path}")
    try:
        return SentencePieceVocab(path.read_bytes())
    except (RuntimeError, OSError) as exc:
        raise CorpusError(f"{path}: not a sentencepiece model ({exc})") from None


def vocab_digest(vocab) -> str:
    """A short hash of a vocabulary's content (what a token store is keyed by)."""
    state = vocab.to_state()
    digest = hashlib.sha256(state["kind"].encode())
    if "model" in state:
        digest.update(bytes(state["model"]))
    else:
        digest.update(json.dumps(state, sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def check_vocab_fits(vocab, saved_state: dict, *, side: str, source: str, checkpoint: str) -> None:
    """Raise CorpusError when ``vocab`` (from the file ``source``) is not the vocabulary the
    checkpoint's model was trained with: kind, size, or the first token that differs."""
    saved = vocab_from_state(saved_state)
    where = f"the {side} vocabulary {source} does not fit {checkpoint}"
    if saved.kind != vocab.kind:
        raise CorpusError(
            f"{where}: it is a {vocab.kind} vocabulary, the checkpoint's is {saved.kind}"
        )
    if len(saved) != len(vocab):
        raise CorpusError(f"{where}: {len(vocab)} entries, the checkpoint's has {len(saved)}")
    if vocab_digest(saved) == vocab_digest(vocab):
        return
    pieces = vocab.pieces(range(len(vocab)))
    for index, (ours, theirs) in enumerate(
        zip(pieces, saved.pieces(range(len(saved))), strict=True)
    ):
        if ours != theirs:
            lines = getattr(vocab, "lines", None)
            line = (
                f" (line {lines[index - len(SPECIALS)]})"
                if lines and index >= len(SPECIALS)
                else ""
            )
            raise CorpusError(
                f"{where}: entry {index}{line} is {ours!r}, the checkpoint's is {theirs!r}"
            )
    raise CorpusError(f"{where}: same entries, different model settings")


def vocab_from_state(state: dict) -> SymbolVocab | SentencePieceVocab:
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind == SymbolVocab.kind:
        return SymbolVocab(state["symbols"])
    if kind == SentencePieceVocab.kind:
        return SentencePieceVocab(state["model"])
    if kind == WordVocab.kind:  # pre-tokenised text with a vocabulary file
        return WordVocab(state["tokens"])
    raise ValueError(f"unknown vocabulary kind {kind!r}")


def shared_vocab(holder) -> bool:
    """Whether ``holder``'s (a task's or a corpus's) two vocabularies are one: the same object
    or the same content (a checkpoint's, read back as two)."""
    src, tgt = holder.src_vocab, holder.tgt_vocab
    return src is tgt or src.to_state() == tgt.to_state()


def _train_sentencepiece(spm, sentences: Iterable[str], model, vocab_size: int) -> None:
    """SentencePiece's unigram training on ``sentences`` into ``model`` (a BytesIO)."""
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
