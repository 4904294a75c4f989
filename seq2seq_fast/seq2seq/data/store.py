"""Corpora larger than memory: a parallel corpus encoded once into an on-disk token store.

The corpus (two files, ``--src``/``--tgt``, one sentence a line; or one ``source<TAB>target``
file) is streamed, never held as Python strings: one pass counts the lines (and checks that the
two files have as many), one reads a seeded sample to train the sentencepiece models when none is
given, one normalises, filters, splits and encodes in chunks. The store is a folder of

    src.bin, tgt.bin     token ids, uint16 (vocabularies up to 65,536) or int32, back to back
    offsets.npy          int64 [N, 2]: where pair i's source and target start in them
    lengths.npy          int32 [N, 2]: their lengths
    heldout.json         the validation and test pairs carved from the file (text, capped)
    manifest.json        written last: format, key, counts, dtype, file sizes, the corpus report

read when training a pair at a time (``os.pread``: only what the batches need is read; the
length index alone is held in memory, 8 bytes a pair). It is keyed by the corpus
files (resolved path, size, mtime and a hash of their first and last MiB), the tokenizers (a
hash of each) and the options that change its content, and lives in ``cache_dir`` (default
a per-user cache: ``$SEQ2SEQ_FAST_CACHE_DIR``, else ``$XDG_CACHE_HOME/seq2seq-fast``, else
``~/.cache/seq2seq-fast``): a second run with the same key, whatever its run folder, opens it at
once. It is built in a temporary folder ``.tmp-<store>-<pid>-<random>`` whose builder holds an
exclusive ``flock`` on its ``.lock`` file (a build removes only temporary folders whose lock it
can take: their builder is gone), every file fsynced, the manifest last, then renamed into place:
an interrupted build never leaves a store that looks complete, and a store whose manifest is
missing or does not match its files is rebuilt (with a message). Builds of one store are
serialised by a lock file beside it; the second opens what the first built.

Held-out pairs: the pairs are grouped by a seeded hash of their source sentence, so every
translation of one source lands in the same split; the validation set takes the first groups in
hash order, the test set the next ones, each up to its fraction of the usable pairs and at most
``max_held_out`` pairs (a first group bigger than that is held out whole, its pairs over the cap
dropped, never trained on). A pass over the corpus's sources chooses them before the build.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import unicodedata
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from seq2seq_fast.seq2seq.data.corpus import (
    MAX_HELD_OUT,
    CorpusReport,
    TranslationData,
    read_parallel_corpus,
)
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.vocab import SentencePieceVocab

STORE_FORMAT = "seq2seq-fast-token-store"
STORE_VERSION = 2  # 2: held-out sets chosen by source groups
CHUNK_PAIRS = 8192  # pairs normalised and encoded per call
HASH_SPAN = 1 << 20  # bytes of a corpus file's head and tail in its identity
MALFORMED_LISTED = 100  # malformed lines listed with their numbers (the rest only counted)
SPM_SAMPLE_SIZE = 100_000  # default pairs the sentencepiece models are trained on

Log = Callable[[str], None]


# --- the corpus files ------------------------------------------------------------------------------


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


# --- splitting -------------------------------------------------------------------------------------


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


# --- the store -------------------------------------------------------------------------------------


class TokenStore:
    """A built store: ``src_ids``, ``tgt_ids`` and ``offsets`` memory-mapped (np.memmap), the
    length index ``lengths`` (int32 [N, 2], 8 bytes a pair) in memory; what the batching of
    :mod:`seq2seq_fast.seq2seq.data.corpus` reads is ``lengths``.

    ``store[i]`` -> (source ids, target ids) as lists, read with ``os.pread``: a page fault on a
    memory map brings in its neighbours too (the kernel's fault-around, 64 KB), and those count as
    the process's resident memory, so batches of random pairs read through the maps grew the RSS
    by ~150 KB a pair (600 MB per 4,000 pairs at 10M pairs); a read brings in what it asks for."""

    def __init__(self, folder: Path, manifest: dict) -> None:
        self.folder, self.manifest = folder, manifest
        self.dtype = dtype = np.dtype(manifest["dtype"])
        self.src_ids = (
            np.memmap(folder / "src.bin", dtype=dtype, mode="r")
            if manifest["src_tokens"]
            else np.zeros(0, dtype)
        )
        self.tgt_ids = (
            np.memmap(folder / "tgt.bin", dtype=dtype, mode="r")
            if manifest["tgt_tokens"]
            else np.zeros(0, dtype)
        )
        # numpy arrays, never Python lists (at 10M pairs those would outweigh the store)
        self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        self.lengths = np.load(folder / "lengths.npy")
        self._offsets_at = self.offsets.offset  # the .npy header's length
        self._fds = {
            name: os.open(folder / name, os.O_RDONLY)
            for name in ("src.bin", "tgt.bin", "offsets.npy")
        }

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index) -> tuple[list[int], list[int]]:
        i = int(index)
        if not 0 <= i < len(self.lengths):
            raise IndexError(f"pair {index} of a store of {len(self.lengths)}")
        fds, size = self._fds, self.dtype.itemsize
        s, t = np.frombuffer(
            os.pread(fds["offsets.npy"], 16, self._offsets_at + 16 * i), np.int64
        ).tolist()
        n, m = self.lengths[i].tolist()
        src = np.frombuffer(os.pread(fds["src.bin"], n * size, s * size), self.dtype)
        tgt = np.frombuffer(os.pread(fds["tgt.bin"], m * size, t * size), self.dtype)
        return src.tolist(), tgt.tolist()

    def heldout(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        data = json.loads((self.folder / "heldout.json").read_text(encoding="utf-8"))
        return [tuple(p) for p in data["valid"]], [tuple(p) for p in data["test"]]

    def report(self) -> CorpusReport:
        fields = dict(self.manifest["report"])
        fields["malformed"] = [tuple(m) for m in fields["malformed"]]
        return CorpusReport(**fields)


def _fsync_write(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_npy(path: Path, array: np.ndarray) -> None:
    with path.open("wb") as handle:
        np.save(handle, array)
        handle.flush()
        os.fsync(handle.fileno())


def verify_store(folder: Path, key: str) -> tuple[dict | None, str | None]:
    """-> (manifest, None) for a complete store of this key, else (None, why not)."""
    manifest_path = folder / "manifest.json"
    if not folder.exists():
        return None, None
    if not manifest_path.exists():
        return None, "it has no manifest (an interrupted build)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"its manifest is unreadable ({exc})"
    if manifest.get("format") != STORE_FORMAT or manifest.get("version") != STORE_VERSION:
        return None, f"its format is {manifest.get('format')} {manifest.get('version')}"
    if manifest.get("key") != key:
        return None, "its manifest is of another corpus or tokenizer"
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.exists() or path.stat().st_size != size:
            actual = path.stat().st_size if path.exists() else "missing"
            return None, f"{name} is {actual} bytes, the manifest says {size}"
    # the index the batches are cut from (read whole anyway; 8 bytes a pair)
    if _file_sha256(folder / "lengths.npy") != manifest.get("lengths_sha256"):
        return None, "lengths.npy does not match the manifest's hash"
    return manifest, None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


# --- temporary folders, locks -------------------------------------------------------------------

LOCK_NAME = ".lock"  # in a temporary folder: its builder holds an exclusive flock on it


def _lock(path: Path, blocking: bool = True) -> int | None:
    """An exclusive flock on ``path`` (created if missing) -> its fd (close it to release); None
    when not blocking and another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _exclusive(path: Path, what: str, log: Log):
    """Hold the lock file ``path`` (one builder of ``what`` at a time across processes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock(path, blocking=False)
    if fd is None:
        log(f"waiting for another process building {what} (lock {path})")
        fd = _lock(path)
    try:
        yield
    finally:
        os.close(fd)


def _new_temp(folder: Path) -> tuple[Path, int]:
    """A fresh ``.tmp-<store>-<pid>-<random>`` folder beside ``folder`` -> (it, the fd of its held
    lock). It is made under another name and renamed once its lock is held, so a temporary folder
    is never seen without a live lock while its builder runs."""
    prefix = f".new-{folder.name}-{os.getpid()}-"
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
    try:
        fd = _lock(staging / LOCK_NAME)
        tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}-{staging.name[len(prefix) :]}"
        os.rename(staging, tmp)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return tmp, fd


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary folders of builds of ``folder`` whose builder is gone (its lock can
    be taken; robust to pid reuse); a live build's folder is left alone. -> those removed."""
    removed = []
    staged = folder.parent.glob(f".new-{folder.name}-*")  # killed before its rename
    for tmp in itertools.chain(folder.parent.glob(f".tmp-{folder.name}-*"), staged):
        if not tmp.is_dir():
            continue
        try:
            fd = os.open(tmp / LOCK_NAME, os.O_RDWR)
        except FileNotFoundError:
            if tmp.name.startswith(".new-"):
                continue  # its lock may be about to be made
            fd = None  # no lock file: left by an earlier version, or being removed
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its builder is alive
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _install(tmp: Path, folder: Path, key: str, manifest: dict, log: Log) -> dict:
    """Rename the complete ``tmp`` to ``folder`` (atomic). When another build got there first
    with a complete store, ours is discarded and its manifest returned; an incomplete one found
    there is moved aside and removed."""
    for _ in range(3):
        try:
            os.rename(tmp, folder)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            theirs, _ = verify_store(folder, key)
            if theirs is not None:
                log(f"token store {folder}: built meanwhile by another process; using it")
                shutil.rmtree(tmp, ignore_errors=True)
                return theirs
            aside = folder.parent / f".old-{folder.name}-{os.getpid()}"
            try:
                os.rename(folder, aside)
            except FileNotFoundError:
                continue
            shutil.rmtree(aside, ignore_errors=True)
            continue
        try:
            (folder / LOCK_NAME).unlink()
        except OSError:
            pass
        _fsync_dir(folder.parent)
        return manifest
    raise OSError(errno.EEXIST, f"could not move the token store into place: {folder}")


def _encoded_chunks(
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


def build_store(
    folder: Path,
    key: str,
    identity: dict,
    files: CorpusFiles,
    lines: int,
    options: Options,
    vocabs,
    *,
    rule: SplitRule | None = None,
    progress: bool = False,
    log: Log = print,
) -> TokenStore:
    """Encode the corpus into ``folder`` (built beside it, renamed into place when complete).
    ``rule``: the held-out sets (:func:`plan_split` when not given)."""
    src_vocab, tgt_vocab = vocabs
    dtype = np.dtype(np.uint16 if max(len(src_vocab), len(tgt_vocab)) <= 1 << 16 else np.int32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if rule is None:
        rule = plan_split(files, lines, options, progress)
    remove_stale_temps(folder)
    tmp, lock = _new_temp(folder)
    report = CorpusReport(files.name)
    dropped = [0, 0]
    heldout: list[list] = [[], []]
    lengths: list[np.ndarray] = []
    totals = [0, 0]
    empty = 0
    try:
        with (tmp / "src.bin").open("wb") as src_out, (tmp / "tgt.bin").open("wb") as tgt_out:
            stream = clean_pairs(files, lines, options, rule, report, progress, "encoding")
            chunks = _encoded_chunks(vocabs, stream, heldout, options.max_held_out, dropped)
            for src_rows, tgt_rows in chunks:
                src_len = np.fromiter(map(len, src_rows), np.int32, len(src_rows))
                tgt_len = np.fromiter(map(len, tgt_rows), np.int32, len(tgt_rows))
                ok = (src_len > 0) & (tgt_len > 0)  # a side that encodes to nothing
                if not ok.all():
                    empty += int((~ok).sum())
                    src_rows = list(itertools.compress(src_rows, ok.tolist()))
                    tgt_rows = list(itertools.compress(tgt_rows, ok.tolist()))
                    src_len, tgt_len = src_len[ok], tgt_len[ok]
                for rows, count, out, side in (
                    (src_rows, src_len, src_out, 0),
                    (tgt_rows, tgt_len, tgt_out, 1),
                ):
                    total = int(count.sum())
                    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype, total)
                    out.write(flat.tobytes())
                    totals[side] += total
                lengths.append(np.stack([src_len, tgt_len], axis=1))
            for out in (src_out, tgt_out):
                out.flush()
                os.fsync(out.fileno())
        pair_lengths = np.concatenate(lengths) if lengths else np.zeros((0, 2), np.int32)
        del lengths[:]  # the chunks: as big as pair_lengths
        valid, test = heldout[0], heldout[1]
        report.pairs = len(pair_lengths) + len(valid) + len(test)
        if len(pair_lengths) == 0:
            raise CorpusError(f"no usable sentence pairs in {report.summary()}")
        offsets = np.zeros((len(pair_lengths), 2), np.int64)
        np.cumsum(pair_lengths[:-1], axis=0, out=offsets[1:])
        _save_npy(tmp / "offsets.npy", offsets)
        _save_npy(tmp / "lengths.npy", pair_lengths)
        _fsync_write(
            tmp / "heldout.json",
            json.dumps(
                {"valid": valid, "test": test, "dropped_over_cap": dropped, "encoded_empty": empty},
                ensure_ascii=False,
            ).encode(),
        )
        files_sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.name != LOCK_NAME}
        index_hash = _file_sha256(tmp / "lengths.npy")
        manifest = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "key": key,
            "identity": identity,
            "pairs": len(pair_lengths),
            "dtype": dtype.name,
            "src_tokens": totals[0],
            "tgt_tokens": totals[1],
            "valid": len(valid),
            "test": len(test),
            "files": files_sizes,
            "lengths_sha256": index_hash,
            "report": asdict(report),
        }
        _fsync_write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        manifest = _install(tmp, folder, key, manifest, log)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)  # releases the temporary folder's lock
    if empty:
        log(f"{empty} training pairs encode to no token on a side: left out")
    if any(dropped):
        log(
            f"held-out sets capped at {options.max_held_out} pairs each: {dropped[0]} valid and "
            f"{dropped[1]} test pairs over the cap left out (never trained on)"
        )
    return TokenStore(folder, manifest)


# --- tokenizers ------------------------------------------------------------------------------------


def sample_sentences(
    files: CorpusFiles,
    lines: int,
    options: Options,
    rule: SplitRule,
    size: int,
    progress: bool = False,
) -> tuple[list[str], list[str]]:
    """A seeded random sample of about ``size`` training pairs (held-out ones left out), as
    (sources, targets): what the sentencepiece models are trained on."""
    rng = np.random.default_rng(options.seed + 17)
    chosen = None
    if lines > size:
        chosen = np.zeros(lines + 1, dtype=bool)
        chosen[1 + rng.choice(lines, size=size, replace=False)] = True
    sources, targets = [], []
    report = CorpusReport(files.name)
    for side, src, tgt in clean_pairs(
        files, lines, options, rule, report, progress, "sampling", only=chosen
    ):
        if side == 0:
            sources.append(src)
            targets.append(tgt)
    return sources, targets


@dataclass
class TokenizerSpec:
    """Where each side's tokenizer comes from: a sentencepiece model file, a vocabulary file, or
    (neither) a sentencepiece model trained on a sample of the training split."""

    src_spm: str | None = None
    tgt_spm: str | None = None
    src_vocab: str | None = None
    tgt_vocab: str | None = None
    share: bool = False
    vocab_size: int = 4000
    sample_size: int = SPM_SAMPLE_SIZE


def _given(spec: TokenizerSpec):
    from seq2seq_fast.seq2seq.data.vocab import read_spm_model, read_vocab_file

    cache: dict[tuple[str, str], object] = {}

    def load(kind: str, path: str | None):
        if path is None:
            return None
        key = (kind, str(Path(path).resolve()))
        if key not in cache:
            cache[key] = read_spm_model(path) if kind == "spm" else read_vocab_file(path)
        return cache[key]

    for side in ("src", "tgt"):
        if getattr(spec, f"{side}_spm") and getattr(spec, f"{side}_vocab"):
            raise CorpusError(f"--{side}-spm and --{side}-vocab both given: one tokenizer a side")
    return (
        load("spm", spec.src_spm) or load("vocab", spec.src_vocab),
        load("spm", spec.tgt_spm) or load("vocab", spec.tgt_vocab),
    )


def resolve_tokenizers(
    spec: TokenizerSpec,
    files: CorpusFiles,
    count: Callable[[], int],
    options: Options,
    cache_dir: Path,
    identity: dict,
    *,
    plan: Callable[[], SplitRule] | None = None,
    progress: bool = False,
    log: Log = print,
):
    """-> (source vocabulary, target vocabulary); the same object twice when shared. Trained
    sentencepiece models are cached beside the stores (keyed like them: the corpus's identity and
    the options), so a second run neither re-reads the corpus nor trains again. ``count()``: the
    corpus's line count; ``plan()``: the held-out sets (the sample is of the training split)."""
    from seq2seq_fast.seq2seq.data.vocab import vocab_digest

    src, tgt = _given(spec)
    if spec.share:
        if src is not None and tgt is not None and vocab_digest(src) != vocab_digest(tgt):
            raise CorpusError(
                "--share-vocab needs one vocabulary for both sides: give --spm, or the same file "
                f"to both sides (got {spec.src_spm or spec.src_vocab} and "
                f"{spec.tgt_spm or spec.tgt_vocab})"
            )
        src = tgt = src or tgt
    if src is not None and tgt is not None:
        return src, tgt
    wanted = ["shared"] if spec.share else [s for s, v in (("src", src), ("tgt", tgt)) if v is None]
    key = _digest(
        {
            "identity": identity,
            "options": asdict(options),
            "size": spec.vocab_size,
            "sample": spec.sample_size,
            "wanted": wanted,
            "split": 2,  # the held-out sets chosen by source groups
        }
    )
    paths = {w: cache_dir / f"spm-{key}.{w}.model" for w in wanted}
    trained = {}
    if not all(p.exists() for p in paths.values()):
        with _exclusive(cache_dir / f".lock-spm-{key}", "the sentencepiece models", log):
            if not all(p.exists() for p in paths.values()):  # else trained meanwhile
                trained = _train_spm(spec, files, count, options, paths, plan, progress, log)
    if not trained:
        for w, p in paths.items():
            trained[w] = SentencePieceVocab(p.read_bytes())
        log(f"sentencepiece model(s) from the cache: {', '.join(str(p) for p in paths.values())}")
    if spec.share:
        return trained["shared"], trained["shared"]
    return src or trained["src"], tgt or trained["tgt"]


def _train_spm(spec, files, count, options, paths, plan, progress, log) -> dict:
    lines = count()
    rule = plan() if plan is not None else plan_split(files, lines, options, progress)
    sources, targets = sample_sentences(files, lines, options, rule, spec.sample_size, progress)
    if not sources:
        raise CorpusError(f"no usable training pair in {files.name} to train a tokenizer on")
    texts = {"shared": sources + targets, "src": sources, "tgt": targets}
    trained = {}
    for w, path in paths.items():
        log(
            f"training a {spec.vocab_size}-piece sentencepiece model ({w}) on "
            f"{len(texts[w])} sampled sentences"
        )
        vocab = SentencePieceVocab.train(texts[w], spec.vocab_size)
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        _fsync_write(tmp, vocab.model_proto)
        os.replace(tmp, path)
        trained[w] = vocab
    return trained


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


# --- what the training job calls -------------------------------------------------------------------


def _read_official(
    path: str | None, tgt: str | None, options: Options, swap: bool, what: str
) -> list[tuple[str, str]]:
    """An official valid/test split, small enough to read whole: two files or one TSV."""
    if path is None:
        return []
    if tgt is None:
        return read_parallel_corpus(path, normalization=options.normalization, swap=swap)[0]
    files = CorpusFiles(path, tgt)
    lines = corpus_lines(files)
    report = CorpusReport(files.name)
    rule = SplitRule(0)
    plain = Options(normalization=options.normalization)
    pairs = [(s, t) for _, s, t in clean_pairs(files, lines, plain, rule, report)]
    if not pairs:
        raise CorpusError(f"no usable sentence pairs in the {what} split: {report.summary()}")
    return pairs


def load_store_corpus(
    files: CorpusFiles,
    spec: TokenizerSpec,
    options: Options,
    cache_dir: str | Path,
    *,
    vocabs=None,
    valid: tuple[str | None, str | None] = (None, None),
    test: tuple[str | None, str | None] = (None, None),
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
    progress: bool = True,
    log: Log = print,
) -> TranslationData:
    """The corpus as a :class:`TranslationData` whose ``train`` is a :class:`TokenStore`: built
    (rank 0; the other ranks wait at ``barrier``) or opened from ``cache_dir``. ``vocabs``: the
    vocabularies to use (a resumed checkpoint's); ``valid``/``test``: official splits (a TSV, or
    two files), then nothing is carved from the corpus."""
    cache_dir = Path(cache_dir)
    options.carve = valid[0] is None
    if test[0] is not None and valid[0] is None:
        raise CorpusError(
            "a test split needs a validation split too (--valid-src/--valid-tgt or --valid-data)"
        )
    check_files(files)
    identity = {"files": [file_identity(p) for p in files.paths()], "swap": files.swap}
    counted: list[int] = []

    def count() -> int:  # counted (and the two files' counts compared) only to build
        if not counted:
            counted.append(corpus_lines(files, progress and rank == 0))
        return counted[0]

    planned: list[SplitRule] = []

    def plan() -> SplitRule:  # the held-out sets: one pass over the sources, only to build
        if not planned:
            planned.append(plan_split(files, count(), options, progress and rank == 0))
        return planned[0]

    if vocabs is None:
        if rank == 0:
            vocabs = resolve_tokenizers(
                spec,
                files,
                count,
                options,
                cache_dir,
                identity,
                plan=plan,
                progress=progress,
                log=log,
            )
        if barrier is not None:
            barrier()
        if rank != 0:
            vocabs = resolve_tokenizers(
                spec,
                files,
                count,
                options,
                cache_dir,
                identity,
                plan=plan,
                progress=False,
                log=lambda _: None,
            )
    from seq2seq_fast.seq2seq.data.vocab import vocab_digest

    key = _digest(
        {
            "identity": identity,
            "options": asdict(options),
            "vocabs": [vocab_digest(v) for v in vocabs],
        }
    )
    folder = cache_dir / f"store-{key}"
    store = None
    if rank == 0:
        manifest, why = verify_store(folder, key)
        if manifest is not None:
            log(f"token store: {folder} ({manifest['pairs']} pairs, reused)")
            store = TokenStore(folder, manifest)
        else:
            with _exclusive(cache_dir / f".lock-{folder.name}", "this token store", log):
                manifest, again = verify_store(folder, key)  # built meanwhile by another run?
                if manifest is not None:
                    log(f"token store: {folder} ({manifest['pairs']} pairs, built by another run)")
                    store = TokenStore(folder, manifest)
                else:
                    if why or again:
                        log(f"token store {folder}: {again or why}; rebuilding it")
                    log(f"token store: encoding {files.name} into {folder}")
                    store = build_store(
                        folder,
                        key,
                        identity,
                        files,
                        count(),
                        options,
                        vocabs,
                        rule=plan(),
                        progress=progress,
                        log=log,
                    )
    if barrier is not None:
        barrier()
    if store is None:
        manifest, why = verify_store(folder, key)
        if manifest is None:
            raise CorpusError(f"token store {folder} is not usable on rank {rank}: {why}")
        store = TokenStore(folder, manifest)
    held_valid, held_test = store.heldout()
    if not options.carve:
        held_valid = _read_official(valid[0], valid[1], options, files.swap, "validation")
        held_test = _read_official(test[0], test[1], options, files.swap, "test")
    elif not held_valid:
        raise CorpusError(
            f"{files.name}: no validation pair carved from {store.report().pairs} usable pairs: "
            "raise --valid-fraction or --max-held-out, or give --valid-data "
            "(or --valid-src/--valid-tgt)"
        )
    return TranslationData(vocabs[0], vocabs[1], store, held_valid, held_test, store.report())


# --- the training configuration's side (TrainConfig, duck-typed: no import of train.py) -------------

_TOKENIZER_OPTIONS = ("spm", "src_spm", "tgt_spm", "src_vocab_file", "tgt_vocab_file")
_FLAG = {"src_vocab_file": "--src-vocab", "tgt_vocab_file": "--tgt-vocab"}


def _flag(name: str) -> str:
    return _FLAG.get(name, "--" + name.replace("_", "-"))


# A --data file bigger than this (not a .zip) goes through the token store by itself: read in
# memory it would take ~15x its size (1.6 KB a pair: 4 GB at 2M pairs, 262 MB).
BIG_CORPUS_BYTES = 100 * 2**20


def uses_token_store(config) -> bool:
    """The token store is used for a two-file corpus, with any tokenizer option, and for a
    --data file over BIG_CORPUS_BYTES; a smaller --data alone is read in memory as before;
    ``token_store`` True/False forces either."""
    if config.token_store is not None:
        return bool(config.token_store)
    if (
        config.src
        or config.share_vocab
        or config.cache_dir
        or any(getattr(config, n) for n in _TOKENIZER_OPTIONS)
    ):
        return True
    data = Path(config.data) if config.data else None
    try:
        return bool(
            data and data.suffix.lower() != ".zip" and data.stat().st_size > BIG_CORPUS_BYTES
        )
    except OSError:
        return False  # the in-memory reader names the problem


def check_data_options(config) -> None:
    """ValueError naming the options when the data options do not go together."""
    given = [
        n
        for n in (
            "src",
            "tgt",
            "valid_src",
            "valid_tgt",
            "test_src",
            "test_tgt",
            *_TOKENIZER_OPTIONS,
            "share_vocab",
            "cache_dir",
            "token_store",
        )
        if getattr(config, n) not in (None, False)
    ]
    if config.task != "translate" and given:
        raise ValueError(f"{', '.join(_flag(n) for n in given)}: for --task translate")
    for a, b in (("src", "tgt"), ("valid_src", "valid_tgt"), ("test_src", "test_tgt")):
        if bool(getattr(config, a)) != bool(getattr(config, b)):
            have, lack = (a, b) if getattr(config, a) else (b, a)
            raise ValueError(
                f"{_flag(have)} needs {_flag(lack)} (a two-file corpus: one file a side)"
            )
    if config.src and config.data:
        raise ValueError("--data and --src/--tgt both given: one training corpus")
    if config.valid_src and config.valid_data:
        raise ValueError("--valid-data and --valid-src/--valid-tgt both given: one validation set")
    if config.test_src and config.test_data:
        raise ValueError("--test-data and --test-src/--test-tgt both given: one test set")
    if config.test_src and not (config.valid_src or config.valid_data):
        raise ValueError(
            "--test-src/--test-tgt need a validation split too (--valid-src/"
            "--valid-tgt or --valid-data)"
        )
    if config.spm and (config.src_spm or config.tgt_spm):
        raise ValueError("--spm (one model for both sides) and --src-spm/--tgt-spm both given")
    for side in ("src", "tgt"):
        if (config.spm or getattr(config, f"{side}_spm")) and getattr(config, f"{side}_vocab_file"):
            raise ValueError(
                f"{_flag(side + '_vocab_file')} and a sentencepiece model both "
                f"given for the {side} side: one tokenizer a side"
            )
    if config.token_store is False and (
        config.src or any(getattr(config, n) for n in _TOKENIZER_OPTIONS)
    ):
        raise ValueError(
            "--token-store off: two-file corpora and tokenizer files are read "
            "through the token store"
        )
    if config.spm_sample_size < 0:
        raise ValueError(f"spm_sample_size must be >= 0, got {config.spm_sample_size}")
    if config.max_held_out < 1:
        raise ValueError(f"max_held_out must be >= 1, got {config.max_held_out}")


def tokenizer_spec(config) -> TokenizerSpec:
    return TokenizerSpec(
        src_spm=config.spm or config.src_spm,
        tgt_spm=config.spm or config.tgt_spm,
        src_vocab=config.src_vocab_file,
        tgt_vocab=config.tgt_vocab_file,
        share=bool(config.share_vocab or config.spm),
        vocab_size=config.spm_vocab_size,
        sample_size=config.spm_sample_size or 1 << 62,
    )


def default_cache_dir() -> Path:
    """Where token stores and trained tokenizers are kept without --cache-dir: shared by every
    run of this user, so a new --out on the same corpus reuses them. ``$SEQ2SEQ_FAST_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/seq2seq-fast``, else ``~/.cache/seq2seq-fast``."""
    env = os.environ.get("SEQ2SEQ_FAST_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # a relative one is to be ignored (the XDG spec)
        return Path(xdg) / "seq2seq-fast"
    return Path.home() / ".cache" / "seq2seq-fast"


def open_store_corpus(
    config, *, vocabs=None, rank: int = 0, world_size: int = 1, log: Log = print
) -> TranslationData:
    """The training job's corpus through the token store (see :func:`load_store_corpus`)."""
    swap = config.direction == "2-1"
    if config.src:
        files = CorpusFiles(config.tgt, config.src) if swap else CorpusFiles(config.src, config.tgt)
    else:
        files = CorpusFiles(config.data, swap=swap)

    def pair(a: str | None, b: str | None) -> tuple[str | None, str | None]:
        return (b, a) if swap and b is not None else (a, b)

    valid = (
        pair(config.valid_src, config.valid_tgt) if config.valid_src else (config.valid_data, None)
    )
    test = pair(config.test_src, config.test_tgt) if config.test_src else (config.test_data, None)
    options = Options(
        normalization=config.normalization,
        max_words=config.max_words,
        max_pairs=config.max_pairs,
        seed=config.seed,
        valid_fraction=config.valid_fraction,
        test_fraction=config.test_fraction,
        max_held_out=config.max_held_out,
    )
    barrier = None
    if world_size > 1:
        import torch.distributed as dist

        barrier = dist.barrier
    if config.cache_dir:
        cache_dir = Path(config.cache_dir).expanduser()
        log(f"corpus cache: {cache_dir} (--cache-dir)")
    else:
        cache_dir = default_cache_dir()
        log(f"corpus cache: {cache_dir} (the per-user default; --cache-dir to change)")
    return load_store_corpus(
        files,
        tokenizer_spec(config),
        options,
        cache_dir,
        vocabs=vocabs,
        valid=valid,
        test=test,
        rank=rank,
        barrier=barrier,
        progress=config.progress,
        log=log,
    )


def check_tokenizers_fit(config, payload: dict, checkpoint: str) -> None:
    """Tokenizer files given together with a checkpoint (``--resume``; fine-tuning) must be the
    vocabularies its model was trained with: CorpusError naming the file and what differs."""
    from seq2seq_fast.seq2seq.data.vocab import check_vocab_fits

    if not any(getattr(config, n, None) for n in _TOKENIZER_OPTIONS):
        return
    spec = tokenizer_spec(config)
    given = _given(spec)
    sources = (spec.src_spm or spec.src_vocab, spec.tgt_spm or spec.tgt_vocab)
    for side, vocab, source, key in zip(
        ("source", "target"), given, sources, ("src_vocab", "tgt_vocab"), strict=True
    ):
        if vocab is not None:
            check_vocab_fits(vocab, payload[key], side=side, source=source, checkpoint=checkpoint)
