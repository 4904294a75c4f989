"""Unicode normalisation of corpus text: a sentence at a time (the in-memory reader, translate's
input) or a block of lines at once (the token store's streamed reader), with the same result."""

from __future__ import annotations

import re
import unicodedata


def normalize_text(text: str, form: str = "NFKC") -> str:
    """Unicode normalisation, with U+202F/U+00A0 (French spacing before ! ?) and runs of
    whitespace turned into single spaces."""
    text = unicodedata.normalize(form, text)
    text = text.replace("\u202f", " ").replace("\u00a0", " ")
    return " ".join(text.split())


_SPACES = re.compile(r"[^\S\n]+")  # runs of whitespace within a line (U+00A0, U+202F included)


def normalize_block(lines: list, form: str) -> tuple[list, dict[int, str]]:
    """:func:`~seq2seq_fast.seq2seq.data.corpus.normalize_text` of many lines at once (one decode, one
    Unicode normalisation, one regex over the block: what costs per line in Python is the
    call) -> (texts, {index: why} of the lines that are not valid UTF-8; their text is None).
    None lines stay None."""
    texts: list = []
    bad: dict[int, str] = {}
    present = [line if line is not None else b"" for line in lines]
    blob = b"\n".join(line.rstrip(b"\n") for line in present)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        decoded = []
        for i, line in enumerate(present):
            try:
                decoded.append(line.rstrip(b"\n").decode("utf-8"))
            except UnicodeDecodeError as exc:
                bad[i] = f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
                decoded.append("")
        text = "\n".join(decoded)
    if not text.isascii():
        text = unicodedata.normalize(form, text)
    texts = [line.strip(" ") for line in _SPACES.sub(" ", text).split("\n")]
    for i, line in enumerate(lines):
        if line is None or i in bad:
            texts[i] = None
    return texts, bad
