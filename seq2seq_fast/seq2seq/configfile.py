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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from seq2seq_fast.seq2seq.atomic import atomic_write

CONFIG_FILE = "config.yaml"


class ConfigFileError(ValueError):
    """A configuration file that cannot be used; the message names the file (and the key)."""


def read_config_file(
    path: str | Path, allowed: Iterable[str], actions: Iterable[Any] = ()
) -> dict[str, Any]:
    """The options of the YAML file at ``path``, keys as field names; ConfigFileError for an
    unreadable file, one that is not a mapping, an unknown key or a value of the wrong type.

    ``actions`` (the command's argparse actions) give each key its flag spellings (``src-vocab``
    for the field ``src_vocab_file``) and convert each value as the flag would (``lr: 3e-3``,
    which YAML 1.1 reads as a string, is the float 0.003); a choice outside the flag's choices,
    or a value that does not convert, is an error naming the key, the value and the type."""
    import yaml

    allowed = sorted(allowed)
    by_name = _actions_by_name(actions, allowed)
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
        spelled = str(key).lstrip("-")
        action = by_name.get(spelled) or by_name.get(spelled.replace("_", "-"))
        name = action.dest if action is not None else spelled.replace("-", "_")
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigFileError(f"--config {path}: unknown key {key!r}{hint}")
        try:
            values[name] = value if action is None else convert_value(value, action)
            if _negating(action, spelled) and values[name] is not None:
                values[name] = not values[name]  # no-heatmap: true is heatmap: false
        except ValueError as exc:
            raise ConfigFileError(f"--config {path}: key {key!r}: {exc}") from None
    return values


def _negating(action: Any, spelled: str) -> bool:
    """The key is a store_false flag's spelling (``no-heatmap``), not its field's name."""
    return (
        action is not None
        and action.const is False
        and action.nargs == 0
        and spelled.replace("-", "_") != action.dest
    )


def _actions_by_name(actions: Iterable[Any], allowed: list[str]) -> dict[str, Any]:
    """Each action under its dest and its long flags without the dashes."""
    names: dict[str, Any] = {}
    for action in actions:
        if action.dest not in allowed:
            continue
        names.setdefault(action.dest, action)
        for option in action.option_strings:
            if option.startswith("--"):
                names[option[2:]] = action
    return names


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def convert_value(value: Any, action: Any) -> Any:
    """``value`` as the flag of ``action`` would give it; ValueError saying what was expected."""
    if value is None:
        return None
    if isinstance(action.const, bool) and action.nargs == 0:  # store_true / store_false
        return _as_bool(value)
    several = action.nargs in ("+", "*") or type(action).__name__ == "_AppendAction"
    if isinstance(value, (list, tuple)) and several:
        return [_convert_one(item, action) for item in value]
    return _convert_one(value, action)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def _convert_one(value: Any, action: Any) -> Any:
    kind = action.type
    if isinstance(value, (dict, list, tuple)):
        raise ValueError(f"expected a single value, got {value!r}")
    if kind in (int, float) and isinstance(value, bool):
        raise ValueError(f"expected {_type_name(kind)}, got {value!r}")
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is not None and not (kind in (int, float) and type(value) is kind):
        import argparse

        try:
            value = kind(str(value)) if kind is not float else float(value)
        except argparse.ArgumentTypeError as exc:  # the flag's own check says what it wants
            raise ValueError(str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expected {_type_name(kind)}, got {value!r}") from exc
    elif kind is None and not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"expected one of {choices}, got {value!r}")
    return value


def _type_name(kind: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string"}
    if kind in names:
        return names[kind]
    doc = (getattr(kind, "__doc__", None) or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else f"a value {getattr(kind, '__name__', kind)} accepts"


def dump_config(values: dict[str, Any]) -> str:
    """``values`` as YAML, in their order."""
    import yaml

    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True)


def write_config(values: dict[str, Any], path: str | Path) -> Path:
    """``values`` as YAML at ``path``, atomically (a temporary file, fsync, os.replace)."""
    return atomic_write(path, dump_config(values).encode("utf-8"))
