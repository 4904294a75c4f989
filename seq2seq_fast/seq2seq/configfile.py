"""Configuration files (``--config run.yaml``) for ``train`` and ``translate``.

A YAML mapping of option names, spelled as the command line's (``hidden-size``) or as the
Python fields (``hidden_size``). Precedence, lowest first: the defaults (for ``train``, the task's:
``TASK_DEFAULTS``), the file, the command line's flags. A key that names no option is an error
that names the key and the file. ``train`` writes the resolved configuration beside its checkpoint
as ``config.yaml`` (the same is stored in the checkpoint as ``train_config``): given back to
``--config`` it describes the same job.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"


class ConfigFileError(ValueError):
    """A configuration file that cannot be used; the message names the file (and the key)."""


def read_config_file(path: str | Path, allowed: Iterable[str]) -> dict[str, Any]:
    """The options of the YAML file at ``path``, keys as field names (dashes to underscores);
    ConfigFileError for an unreadable file, one that is not a mapping, or an unknown key."""
    import yaml

    allowed = sorted(allowed)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"--config {path}: expected a mapping of option: value, got a {type(data).__name__}"
        )
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigFileError(f"--config {path}: unknown key {key!r}{hint}")
        values[name] = value
    return values


def dump_config(values: dict[str, Any]) -> str:
    """``values`` as YAML, in their order."""
    import yaml

    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True)


def write_config(values: dict[str, Any], path: str | Path) -> Path:
    """``values`` as YAML at ``path``, atomically (a temporary file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(dump_config(values))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
