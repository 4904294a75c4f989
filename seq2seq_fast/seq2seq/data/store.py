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
import functools
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from seq2seq_fast.seq2seq.atomic import fsync_dir, write_synced
from seq2seq_fast.seq2seq.data.corpus import CorpusReport, TranslationData, read_parallel_corpus
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.files import (
    CorpusFiles,
    check_files,
    corpus_lines,
    file_identity,
    key_digest,
)
from seq2seq_fast.seq2seq.data.split import SplitRule
from seq2seq_fast.seq2seq.data.staging import (
    LOCK_NAME,
    Log,
    exclusive,
    new_temp_folder,
    remove_stale_temps,
)
from seq2seq_fast.seq2seq.data.stream import Options, clean_pairs, encoded_chunks, plan_split
from seq2seq_fast.seq2seq.data.tokenizers import TokenizerSpec, resolve_tokenizers
from seq2seq_fast.seq2seq.data.vocab import vocab_digest

STORE_FORMAT = "seq2seq-fast-token-store"
STORE_VERSION = 2  # 2: held-out sets chosen by source groups


class TokenStore:
    """A built store: ``src_ids``, ``tgt_ids`` and ``offsets`` memory-mapped (np.memmap), the
    length index ``lengths`` (int32 [N, 2], 8 bytes a pair) in memory; what the batching of
    :mod:`seq2seq_fast.seq2seq.data.corpus` reads is ``lengths``.

    ``store[i]`` -> (source ids, target ids) as lists, read with ``os.pread``: a page fault on a
    memory map brings in its neighbours too (the kernel's fault-around, 64 KB), and those count as
    the process's resident memory, so batches of random pairs read through the maps grew the RSS
    by far more than the pairs (bench/RESULTS.md); a read brings in what it asks for."""

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
        fsync_dir(folder.parent)
        return manifest
    raise OSError(errno.EEXIST, f"could not move the token store into place: {folder}")


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
    tmp, lock = new_temp_folder(folder)
    report = CorpusReport(files.name)
    dropped = [0, 0]
    heldout: list[list] = [[], []]
    try:
        stream = clean_pairs(files, lines, options, rule, report, progress, "encoding")
        chunks = encoded_chunks(vocabs, stream, heldout, options.max_held_out, dropped)
        pair_lengths, totals, empty = _write_tokens(tmp, chunks, dtype)
        valid, test = heldout
        report.pairs = len(pair_lengths) + len(valid) + len(test)
        if len(pair_lengths) == 0:
            raise CorpusError(f"no usable sentence pairs in {report.summary()}")
        offsets = np.zeros((len(pair_lengths), 2), np.int64)
        np.cumsum(pair_lengths[:-1], axis=0, out=offsets[1:])
        write_synced(tmp / "offsets.npy", lambda handle: np.save(handle, offsets))
        write_synced(tmp / "lengths.npy", lambda handle: np.save(handle, pair_lengths))
        held = {"valid": valid, "test": test, "dropped_over_cap": dropped, "encoded_empty": empty}
        write_synced(tmp / "heldout.json", json.dumps(held, ensure_ascii=False).encode())
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
            "files": {p.name: p.stat().st_size for p in tmp.iterdir() if p.name != LOCK_NAME},
            "lengths_sha256": _file_sha256(tmp / "lengths.npy"),
            "report": asdict(report),
        }
        write_synced(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
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


def _write_tokens(tmp: Path, chunks, dtype: np.dtype) -> tuple[np.ndarray, list[int], int]:
    """The encoded chunks' ids into ``tmp``/src.bin and tgt.bin, back to back, fsynced ->
    (int32 [N, 2] pair lengths, [source, target] token totals, pairs left out because a side
    encodes to nothing)."""
    lengths: list[np.ndarray] = []
    totals = [0, 0]
    empty = 0
    with (tmp / "src.bin").open("wb") as src_out, (tmp / "tgt.bin").open("wb") as tgt_out:
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
    return pair_lengths, totals, empty


def _lazy_passes(
    files: CorpusFiles, options: Options, progress: bool
) -> tuple[Callable[[], int], Callable[[], SplitRule]]:
    """-> (count, plan): the corpus's line count (the two files' counts compared) and its
    held-out sets (one pass over the sources), each computed on first call only: a reused store
    needs neither."""

    @functools.cache
    def count() -> int:
        return corpus_lines(files, progress)

    @functools.cache
    def plan() -> SplitRule:
        return plan_split(files, count(), options, progress)

    return count, plan


def _open_or_build(
    folder: Path, key: str, files: CorpusFiles, build: Callable[[], TokenStore], log: Log
) -> TokenStore:
    """The store of ``key`` at ``folder``: reused when complete, else built (one builder at a
    time across processes; a store built meanwhile by another run is opened)."""
    manifest, why = verify_store(folder, key)
    if manifest is not None:
        log(f"token store: {folder} ({manifest['pairs']} pairs, reused)")
        return TokenStore(folder, manifest)
    with exclusive(folder.parent / f".lock-{folder.name}", "this token store", log):
        manifest, again = verify_store(folder, key)  # built meanwhile by another run?
        if manifest is not None:
            log(f"token store: {folder} ({manifest['pairs']} pairs, built by another run)")
            return TokenStore(folder, manifest)
        if why or again:
            log(f"token store {folder}: {again or why}; rebuilding it")
        log(f"token store: encoding {files.name} into {folder}")
        return build()


def _held_out(
    store: TokenStore, files: CorpusFiles, options: Options, valid: tuple, test: tuple
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """-> (validation, test) pairs: those carved into the store, or the official splits."""
    if not options.carve:
        return (
            _read_official(valid[0], valid[1], options, files.swap, "validation"),
            _read_official(test[0], test[1], options, files.swap, "test"),
        )
    held_valid, held_test = store.heldout()
    if not held_valid:
        raise CorpusError(
            f"{files.name}: no validation pair carved from {store.report().pairs} usable pairs: "
            "raise --valid-fraction or --max-held-out, or give --valid-data "
            "(or --valid-src/--valid-tgt)"
        )
    return held_valid, held_test


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


def _store_on_rank(folder: Path, key: str, files: CorpusFiles, build: Callable[[], TokenStore],
                   rank: int, barrier: Callable[[], None] | None, log: Log) -> TokenStore:  # fmt: skip
    """Rank 0 opens or builds the store; the other ranks open it after ``barrier``."""
    store = _open_or_build(folder, key, files, build, log) if rank == 0 else None
    if barrier is not None:
        barrier()
    if store is None:
        manifest, why = verify_store(folder, key)
        if manifest is None:
            raise CorpusError(f"token store {folder} is not usable on rank {rank}: {why}")
        store = TokenStore(folder, manifest)
    return store


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
    count, plan = _lazy_passes(files, options, progress and rank == 0)
    if vocabs is None:  # rank 0 trains or reads them, the other ranks then read them

        def resolve(quiet: bool):
            return resolve_tokenizers(
                spec,
                files,
                count,
                options,
                cache_dir,
                identity,
                plan=plan,
                progress=progress and not quiet,
                log=(lambda _: None) if quiet else log,
            )

        vocabs = resolve(False) if rank == 0 else None
        if barrier is not None:
            barrier()
        vocabs = vocabs or resolve(True)
    key = key_digest(
        {
            "identity": identity,
            "options": asdict(options),
            "vocabs": [vocab_digest(v) for v in vocabs],
        }
    )
    folder = cache_dir / f"store-{key}"

    def build() -> TokenStore:
        rule = plan()
        return build_store(
            folder,
            key,
            identity,
            files,
            count(),
            options,
            vocabs,
            rule=rule,
            progress=progress,
            log=log,
        )

    store = _store_on_rank(folder, key, files, build, rank, barrier, log)
    held_valid, held_test = _held_out(store, files, options, valid, test)
    return TranslationData(vocabs[0], vocabs[1], store, held_valid, held_test, store.report())
