"""Files written so that a crash or a full disk never leaves a half-written one under the final
name: written and fsynced under a temporary name in the same folder, then renamed over the final
name (``os.replace``, atomic), the folder fsynced so the new name survives a power loss. The one
implementation behind checkpoints, config files, trained tokenizers and the token store."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

Writer = Callable[[BinaryIO], object]


def write_synced(path: Path, content: bytes | Writer) -> None:
    """Write ``content`` (bytes, or a function writing to the open binary handle) to ``path``
    and fsync it before returning: for files inside a folder that is itself renamed into place
    (the token store's) or for the temporary file of :func:`atomic_write`."""
    with open(path, "wb") as handle:
        if isinstance(content, bytes | bytearray):
            handle.write(content)
        else:
            content(handle)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    """fsync a folder (a rename in it is then durable); a platform without directory file
    descriptors is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where :func:`atomic_write` stages ``path``: ``.NAME.tmp-PID`` beside it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | Path, content: bytes | Writer) -> Path:
    """Write ``content`` to ``path`` atomically: a temporary file in the same folder, fsync,
    ``os.replace``, then fsync the folder. On any error the old file (if any) is left as it was
    and the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write_synced(tmp, content)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path
