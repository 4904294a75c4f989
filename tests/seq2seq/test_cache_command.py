"""``seq2seq-fast cache``: the cache's token stores and tokenizers listed with their sizes, and
removed on request, never one that a build holds locked."""

from __future__ import annotations

import fcntl
import os
import time

from seq2seq_fast.seq2seq.cli import main
from tests.seq2seq.test_store import write_corpus

TRAIN = [
    "--embed-size", "16", "--hidden-size", "16", "--batch-size", "16", "--epochs", "1",
    "--spm-vocab-size", "60", "--no-progress", "--no-heatmap", "--threads", "1",
    "--backend", "reference", "--eval-size", "5",
]  # fmt: skip


def _listing(capsys, *argv) -> str:
    assert main(["cache", *argv]) == 0
    return capsys.readouterr().out


def test_cache_lists_and_clears_what_a_run_built(tmp_path, capsys):
    cache = tmp_path / "cache"
    src, tgt = write_corpus(tmp_path, lines=300)
    run = ["train", "--src", str(src), "--tgt", str(tgt), "--cache-dir", str(cache), *TRAIN]
    assert main([*run, "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    listed = _listing(capsys, "--cache-dir", str(cache))
    assert f"cache folder: {cache}" in listed
    assert "token store" in listed and "sentencepiece models" in listed
    on_disk = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(cache) for f in files
    )
    assert on_disk > 0 and "2 entries" in listed
    # --older-than keeps what was used since
    assert "removed 0 entries" in _listing(capsys, "--cache-dir", str(cache), "--older-than", "1")
    cleared = _listing(capsys, "--cache-dir", str(cache), "--clear")
    assert "removed 2 entries" in cleared and "0 entries, 0 B in all" in cleared
    assert not [p for p in cache.iterdir() if not p.name.startswith(".lock")]
    # the next run builds them again
    assert main([*run, "--out", str(tmp_path / "b")]) == 0
    assert "2 entries" in _listing(capsys, "--cache-dir", str(cache))


def test_an_entry_being_built_is_left_alone(tmp_path, capsys):
    cache = tmp_path / "cache"
    (cache / "store-abc").mkdir(parents=True)
    (cache / "store-abc" / "src.bin").write_bytes(b"x" * 5000)
    old = cache / "store-old"
    old.mkdir()
    (old / "src.bin").write_bytes(b"y" * 100)
    week_ago = time.time() - 7 * 86400
    os.utime(old / "src.bin", (week_ago, week_ago))
    os.utime(old, (week_ago, week_ago))
    fd = os.open(cache / ".lock-store-abc", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build of store-abc in progress
        out = _listing(capsys, "--cache-dir", str(cache), "--older-than", "3")
        assert "removed 1 entries" in out and "store-old" not in out.split("freed", 1)[1]
        out = _listing(capsys, "--cache-dir", str(cache), "--clear")
        assert "store-abc: being built by another process, left alone" in out
        assert (cache / "store-abc" / "src.bin").exists() and not old.exists()
    finally:
        os.close(fd)
    assert "removed 1 entries" in _listing(capsys, "--cache-dir", str(cache), "--clear")


def test_bad_older_than_is_a_clean_error(tmp_path, capsys):
    assert main(["cache", "--cache-dir", str(tmp_path), "--older-than", "-2"]) == 2
    assert "--older-than must be a number of days >= 0, got -2" in capsys.readouterr().err
