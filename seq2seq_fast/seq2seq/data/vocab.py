"""The user's own tokenizers: an existing sentencepiece model, or a vocabulary file for
pre-tokenised text, and the checks that they fit a corpus or a checkpoint.

Every vocabulary here puts <pad>=0, <unk>=1, <s>=2, </s>=3 (``seq2seq_fast.seq2seq.data.corpus``); a
sentencepiece model trained with other special ids is used as is, its ids mapped onto ours
(:class:`~seq2seq_fast.seq2seq.data.corpus.SentencePieceVocab`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from seq2seq_fast.seq2seq.data.corpus import (
    SPECIALS,
    UNK_ID,
    CorpusError,
    SentencePieceVocab,
)

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
    from seq2seq_fast.seq2seq.data.corpus import vocab_from_state

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
