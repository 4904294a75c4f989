"""The one atomic write (seq2seq/atomic.py) behind checkpoints, config files, trained tokenizers
and the token store: a failed write keeps the old file and leaves no temporary behind."""

from __future__ import annotations

import pytest

from seq2seq_fast.seq2seq.atomic import atomic_write, temporary_name
from seq2seq_fast.seq2seq.configfile import write_config


def test_atomic_write_replaces_and_cleans_up(tmp_path):
    path = tmp_path / "sub" / "file.bin"
    atomic_write(path, b"one")
    atomic_write(path, lambda handle: handle.write(b"two"))
    assert path.read_bytes() == b"two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["file.bin"]


def test_a_failing_writer_keeps_the_old_file(tmp_path):
    path = tmp_path / "file.bin"
    atomic_write(path, b"old")

    def half_then_fail(handle):
        handle.write(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old" and not temporary_name(path).exists()


def test_config_files_are_written_through_it(tmp_path, monkeypatch):
    import seq2seq_fast.seq2seq.configfile as configfile

    seen = []
    monkeypatch.setattr(configfile, "atomic_write", lambda p, c: seen.append(p) or p)
    write_config({"lr": 0.1}, tmp_path / "config.yaml")
    assert seen == [tmp_path / "config.yaml"]
