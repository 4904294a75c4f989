"""``seq2seq-fast cache``: see and reclaim the per-user cache of token stores and tokenizers.

Every translate job keeps its encoded corpus (a token store folder) and the sentencepiece models
it trained in one cache folder (``--cache-dir``, else :func:`~seq2seq_fast.seq2seq.data.options.
default_cache_dir`), shared by runs, so they grow with every new corpus or tokenizer option.
This lists what is there (kind, size, last use) and removes it on request. An entry that a build
holds locked right now is left alone; a run that already opened a store keeps reading its open
files (a later run builds the store again).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CacheEntry:
    """One thing in the cache: a token store, a tokenizer's files, or an unfinished build."""

    name: str
    kind: str
    paths: list[Path]
    size: int  # bytes
    last_used: float  # the newest modification time among its files

    def lock_path(self, root: Path) -> Path:
        """The lock file its builder holds while building it: beside it in the cache for a store
        or tokenizer, inside the temporary folder for an unfinished build."""
        if self.kind == "unfinished build":
            return self.paths[0] / ".lock"
        return root / f".lock-{self.name}"


def _size_and_mtime(path: Path) -> tuple[int, float]:
    if not path.is_dir():
        info = path.stat()
        return info.st_size, info.st_mtime
    size, newest = 0, path.stat().st_mtime
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                info = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            size, newest = size + info.st_size, max(newest, info.st_mtime)
    return size, newest


def cache_entries(root: Path) -> list[CacheEntry]:
    """What the cache folder ``root`` holds, largest first (lock files are not entries)."""
    groups: dict[tuple[str, str], list[Path]] = {}
    if not root.is_dir():
        return []
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith(".lock"):
            continue
        if name.startswith((".tmp-", ".new-", ".old-")):
            key = (name, "unfinished build")
        elif name.startswith("spm-") and path.is_file():
            key = (name.split(".", 1)[0], "sentencepiece models")
        elif path.is_dir():
            key = (name, "token store")
        else:
            key = (name, "other")
        groups.setdefault(key, []).append(path)
    entries = []
    for (name, kind), paths in groups.items():
        sizes = [_size_and_mtime(p) for p in paths]
        entries.append(
            CacheEntry(name, kind, paths, sum(s for s, _ in sizes), max(m for _, m in sizes))
        )
    return sorted(entries, key=lambda e: -e.size)


def _held_by_a_build(lock: Path) -> bool:
    """True when another process holds ``lock`` (a build in progress)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_entries(root: Path, entries: list[CacheEntry]) -> tuple[list[CacheEntry], list[str]]:
    """Remove ``entries`` -> (those removed, one line for each left alone and why)."""
    removed, kept = [], []
    for entry in entries:
        if _held_by_a_build(entry.lock_path(root)):
            kept.append(f"{entry.name}: being built by another process, left alone")
            continue
        for path in entry.paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        removed.append(entry)
    for lock in root.glob(".lock-*"):  # the locks of what is gone
        name = lock.name[len(".lock-") :]
        if not any(root.glob(f"{name}*")) and not _held_by_a_build(lock):
            lock.unlink(missing_ok=True)
    return removed, kept


def human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def run_cache_command(root: Path, *, clear: bool, older_than_days: float | None) -> str:
    """The report ``seq2seq-fast cache`` prints (after removing what was asked)."""
    entries = cache_entries(root)
    lines = [f"cache folder: {root}"]
    if clear or older_than_days is not None:
        cutoff = time.time() - 86400 * (older_than_days or 0.0)
        chosen = [e for e in entries if older_than_days is None or e.last_used < cutoff]
        removed, kept = remove_entries(root, chosen)
        freed = sum(e.size for e in removed)
        lines.append(f"removed {len(removed)} entries, {human_size(freed)} freed")
        lines.extend(kept)
        entries = cache_entries(root)
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        lines.append(f"{human_size(e.size):>10}  {used}  {e.kind:<20}  {e.name}")
    total = sum(e.size for e in entries)
    lines.append(f"{len(entries)} entries, {human_size(total)} in all")
    return "\n".join(lines) + "\n"
