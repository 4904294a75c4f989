"""Building a folder safely beside where it goes: a temporary folder whose builder holds an
exclusive ``flock`` on its ``.lock`` file (a build removes only temporary folders whose lock it
can take: their builder is gone), and lock files that serialise builders across processes."""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

Log = Callable[[str], None]


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
def exclusive(path: Path, what: str, log: Log):
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


def new_temp_folder(folder: Path) -> tuple[Path, int]:
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
