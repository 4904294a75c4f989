"""A corpus on disk: its files (one TSV, or one file a side), their line counts, the identity a
cached store is keyed by (resolved path, size, mtime, a hash of head and tail), and their lines
read back by blocks."""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from seq2seq_fast.seq2seq.data.errors import CorpusError

HASH_SPAN = 1 << 20  # bytes of a corpus file's head and tail in its identity


@dataclass(frozen=True)
class CorpusFiles:
    """A parallel corpus on disk: two files (``tgt`` set) or one ``source<TAB>target`` file."""

    src: str
    tgt: str | None = None
    swap: bool = False  # one file: column 2 is the source

    @property
    def name(self) -> str:
        return f"{self.src} + {self.tgt}" if self.tgt else self.src

    def paths(self) -> list[Path]:
        return [Path(self.src)] + ([Path(self.tgt)] if self.tgt else [])


def _check_file(path: Path, what: str) -> None:
    if not path.exists():
        raise CorpusError(f"{what} not found: {path}")
    if path.is_dir():
        raise CorpusError(f"{what} is a directory, not a file: {path}")


def count_lines(path: Path, progress: bool = False) -> int:
    """Lines of a text file (a last line without a newline counts), read in 16 MiB blocks."""
    from tqdm import tqdm

    lines, last = 0, b"\n"
    size = path.stat().st_size
    with (
        path.open("rb") as handle,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            leave=False,
            desc=f"counting {path.name}",
            disable=not progress,
            file=sys.stderr,
        ) as bar,
    ):
        while block := handle.read(1 << 24):
            lines += block.count(b"\n")
            last = block[-1:]
            bar.update(len(block))
    return lines + (last != b"\n")


def check_files(files: CorpusFiles) -> None:
    """CorpusError naming a corpus file that is missing, a folder, or a .zip."""
    for path, side in zip(files.paths(), ("source", "target"), strict=False):
        _check_file(path, f"{side} corpus file" if files.tgt else "corpus file")
        if path.suffix.lower() == ".zip":
            raise CorpusError(
                f"{path}: a .zip corpus is read in memory: use --data without "
                "the token store options, or unzip it"
            )


def corpus_lines(files: CorpusFiles, progress: bool = False) -> int:
    """The corpus's line count; two files with different counts are an error naming both."""
    check_files(files)
    counts = [count_lines(path, progress) for path in files.paths()]
    if len(counts) == 2 and counts[0] != counts[1]:
        raise CorpusError(
            f"the two corpus files have different line counts: {files.src} has {counts[0]} "
            f"lines, {files.tgt} has {counts[1]} (line i of one must translate line i of the other)"
        )
    return counts[0]


def file_identity(path: Path) -> dict:
    """What a cached store is keyed by for one file: resolved path, size, mtime, and a hash of
    its first and last MiB (a file rewritten with the same size and mtime is still seen)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(HASH_SPAN))
        if stat.st_size > HASH_SPAN:
            handle.seek(max(HASH_SPAN, stat.st_size - HASH_SPAN))
            digest.update(handle.read(HASH_SPAN))
    return {
        "path": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "head_tail_sha256": digest.hexdigest(),
    }


def raw_blocks(files: CorpusFiles, size: int) -> Iterator[tuple[list[bytes], list]]:
    """The corpus's lines by blocks of ``size``: (source lines, target lines) as bytes; one file:
    its columns, target None for a line without a tab."""
    if files.tgt is not None:
        with open(files.src, "rb") as src, open(files.tgt, "rb") as tgt:
            while src_block := list(itertools.islice(src, size)):
                yield src_block, list(itertools.islice(tgt, size))
        return
    with open(files.src, "rb") as handle:
        while block := list(itertools.islice(handle, size)):
            columns = [line.split(b"\t", 2) for line in block]
            first = [c[0] if len(c) > 1 else line for c, line in zip(columns, block, strict=True)]
            second = [c[1] if len(c) > 1 else None for c in columns]
            yield (second, first) if files.swap else (first, second)


def key_digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]
