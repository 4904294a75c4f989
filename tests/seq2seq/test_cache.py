"""The corpus cache: concurrent builds, stale temporary folders, failed builds, the per-user
default location, and held-out sets carved by source groups (tiny corpora in tmp_path)."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from seq2seq_fast.seq2seq.config import TrainConfig
from seq2seq_fast.seq2seq.data import files, options, split, staging, store
from seq2seq_fast.seq2seq.data.errors import CorpusError
from seq2seq_fast.seq2seq.data.stream import Options
from seq2seq_fast.seq2seq.data.vocab import SentencePieceVocab
from tests.seq2seq.test_store import WORDS, load, write_corpus

ROOT = Path(__file__).resolve().parents[2]

BUILD = """
import sys, time
from seq2seq_fast.seq2seq.data import files, store, stream, tokenizers
from seq2seq_fast.seq2seq.data.vocab import SentencePieceVocab
src, tgt, cache, mode = sys.argv[1:5]
if mode == "hang":  # stop for good in the middle of encoding (the test kills us)
    real = SentencePieceVocab.encode_batch
    calls = []
    def slow(self, texts):
        calls.append(1)
        if len(calls) == 3:
            print("ENCODING", flush=True)
            time.sleep(600)
        return real(self, texts)
    SentencePieceVocab.encode_batch = slow
    stream.CHUNK_PAIRS = 64
corpus = store.load_store_corpus(
    files.CorpusFiles(src, tgt),
    tokenizers.TokenizerSpec(vocab_size=60),
    stream.Options(valid_fraction=0.05, test_fraction=0.05),
    cache,
    progress=False,
)
print("PAIRS", len(corpus.train), len(corpus.valid), len(corpus.test), flush=True)
"""

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("LOCKED", flush=True)
time.sleep(600)
"""


def _python(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _store_folders(cache: Path) -> list[Path]:
    return sorted(cache.glob("store-*"))


# --- concurrent builds -----------------------------------------------------------------------------


def test_two_concurrent_builds_of_one_store_both_succeed(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=3000)
    cache = tmp_path / "cache"
    procs = [_python(BUILD, str(src), str(tgt), str(cache), "plain") for _ in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            outputs.append([line for line in out.splitlines() if line.startswith("PAIRS")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 1
    assert len(_store_folders(cache)) == 1
    assert not list(cache.glob(".tmp-*")) and not list(cache.glob(".new-*"))
    folder = _store_folders(cache)[0]
    key = json.loads((folder / "manifest.json").read_text())["key"]
    manifest, why = store.verify_store(folder, key)
    assert manifest is not None, why


def test_loser_of_the_rename_race_uses_the_winners_store(tmp_path):
    """build_store called without the store lock (as by a concurrent process that got past it):
    the second finds a complete store in place, discards its own and opens the winner's."""
    src, tgt = write_corpus(tmp_path, lines=300)
    cache = tmp_path / "cache"
    corpus, _ = load(src, tgt, cache)
    folder = corpus.train.folder
    key = corpus.train.manifest["key"]
    inode = folder.stat().st_ino
    logs = []
    again = store.build_store(
        folder,
        key,
        corpus.train.manifest["identity"],
        files.CorpusFiles(str(src), str(tgt)),
        300,
        Options(valid_fraction=0.05, test_fraction=0.05),
        (corpus.src_vocab, corpus.tgt_vocab),
        log=logs.append,
    )
    assert folder.stat().st_ino == inode  # the winner's store, untouched
    assert any("built meanwhile by another process" in line for line in logs)
    assert len(again) == len(corpus.train) and not list(cache.glob(".tmp-*"))


# --- stale temporary folders ----------------------------------------------------------------------


def _temp(cache: Path, name: str, lock: bool = True) -> Path:
    folder = cache / f".tmp-store-abc-{name}"
    folder.mkdir(parents=True)
    (folder / "src.bin").write_bytes(b"\0" * 16)
    if lock:
        (folder / staging.LOCK_NAME).touch()
    return folder


def test_stale_temp_folder_is_removed_a_live_one_is_not(tmp_path):
    cache = tmp_path / "cache"
    stale = _temp(cache, "999999-dead")  # lock file, nobody holds it
    legacy = _temp(cache, "999998", lock=False)  # an earlier version's: no lock file
    live = _temp(cache, f"{os.getpid()}-live")
    staged = cache / ".new-store-abc-999997-x"  # killed between making it and renaming it
    staged.mkdir()
    (staged / staging.LOCK_NAME).touch()
    holder = _python(HOLD, str(live / staging.LOCK_NAME))
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        removed = staging.remove_stale_temps(cache / "store-abc")
        assert sorted(removed) == sorted([stale, legacy, staged])
        assert live.is_dir() and not stale.exists() and not legacy.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # its holder gone, the folder is stale (whatever process now has its pid)
    assert staging.remove_stale_temps(cache / "store-abc") == [live]
    assert not live.exists()


def test_killed_build_leaves_no_store_and_the_next_build_succeeds(tmp_path):
    src, tgt = write_corpus(tmp_path, lines=3000)
    cache = tmp_path / "cache"
    proc = _python(BUILD, str(src), str(tgt), str(cache), "hang")
    try:
        line = ""
        while line.strip() != "ENCODING":
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
        assert len(list(cache.glob(".tmp-store-*"))) == 1  # its live temporary folder
        assert not _store_folders(cache)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _store_folders(cache)
    corpus, logs = load(src, tgt, cache)
    assert any("from the cache" in line for line in logs)  # the tokenizers were complete
    assert len(corpus.train) + len(corpus.valid) + len(corpus.test) == 3000
    assert not list(cache.glob(".tmp-*"))


# --- a failed build --------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["lengths", "manifest"])
def test_os_error_mid_build_leaves_no_complete_looking_store(tmp_path, monkeypatch, failing):
    src, tgt = write_corpus(tmp_path, lines=500)
    cache = tmp_path / "cache"
    real_write = store.write_synced

    def full_disk(path, content):
        if path.name == f"{failing}.{'npy' if failing == 'lengths' else 'json'}":
            path.write_bytes(b"\x93NUMPY" if failing == "lengths" else b'{"format"')  # a part
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, content)

    monkeypatch.setattr(store, "write_synced", full_disk)
    with pytest.raises(OSError, match="No space left"):
        load(src, tgt, cache)
    assert not _store_folders(cache) and not list(cache.glob(".tmp-*"))
    monkeypatch.setattr(store, "write_synced", real_write)
    corpus, logs = load(src, tgt, cache)
    assert any("token store: encoding" in line for line in logs)
    assert len(corpus.train) + len(corpus.valid) + len(corpus.test) == 500
    folder = _store_folders(cache)[0]
    assert store.verify_store(folder, corpus.train.manifest["key"])[0] is not None


# --- the per-user default location ----------------------------------------------------------------


def test_default_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQ2SEQ_FAST_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert options.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("SEQ2SEQ_FAST_CACHE_DIR")
    assert options.default_cache_dir() == tmp_path / "xdg" / "seq2seq-fast"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert options.default_cache_dir() == tmp_path / "home" / ".cache" / "seq2seq-fast"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert options.default_cache_dir() == tmp_path / "home" / ".cache" / "seq2seq-fast"


def test_second_run_with_another_out_reuses_store_and_tokenizers(tmp_path, monkeypatch):
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("SEQ2SEQ_FAST_CACHE_DIR", str(cache))
    src, tgt = write_corpus(tmp_path, lines=300)

    def open_with(out: str) -> tuple[object, list[str]]:
        config = TrainConfig(
            task="translate", src=str(src), tgt=str(tgt), out=out, spm_vocab_size=60, progress=False
        )
        logs: list[str] = []
        return options.open_store_corpus(config, log=logs.append), logs

    first, logs = open_with(str(tmp_path / "run1"))
    assert f"corpus cache: {cache} (the per-user default; --cache-dir to change)" in logs
    assert any("training a 60-piece" in line for line in logs)
    assert list(cache.glob("spm-*.model")) and len(_store_folders(cache)) == 1

    def fail(*args, **kwargs):
        raise AssertionError("trained or encoded again")

    monkeypatch.setattr(SentencePieceVocab, "train", fail)
    monkeypatch.setattr(store, "build_store", fail)
    monkeypatch.setattr(store, "plan_split", fail)
    second, logs = open_with(str(tmp_path / "run2"))
    assert any("pairs, reused)" in line for line in logs)
    assert any("sentencepiece model(s) from the cache" in line for line in logs)
    assert second.train.folder == first.train.folder and len(second.train) == len(first.train)
    assert not (tmp_path / "run1" / "data-cache").exists()
    # --cache-dir still wins, and says so
    config = TrainConfig(
        task="translate",
        src=str(src),
        tgt=str(tgt),
        cache_dir=str(cache),
        spm_vocab_size=60,
        progress=False,
    )
    logs = []
    options.open_store_corpus(config, log=logs.append)
    assert f"corpus cache: {cache} (--cache-dir)" in logs


# --- held-out sets by source groups ---------------------------------------------------------------


def _repeated_corpus(folder: Path, distinct: int, repeats: int) -> tuple[Path, Path]:
    rng = random.Random(5)
    sources = set()
    while len(sources) < distinct:
        sources.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))))
    src_lines, tgt_lines = [], []
    for k in range(repeats):
        for s in sorted(sources):
            src_lines.append(s)
            tgt_lines.append(" ".join(w.upper() for w in reversed(s.split())) + f" V{k % 3}")
    src, tgt = folder / "rep.src", folder / "rep.tgt"
    src.write_text("\n".join(src_lines) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(tgt_lines) + "\n", encoding="utf-8")
    return src, tgt


def test_split_with_repeated_sources_and_a_small_cap_is_source_disjoint(tmp_path):
    src, tgt = _repeated_corpus(tmp_path, distinct=300, repeats=20)  # 6000 pairs
    options = Options(valid_fraction=0.02, test_fraction=0.03, max_held_out=10)
    corpus, _ = load(src, tgt, tmp_path / "cache", options=options)
    assert 0 < len(corpus.valid) <= 10 and 0 < len(corpus.test) <= 10
    valid = {s for s, _ in corpus.valid}
    test = {s for s, _ in corpus.test}
    train = {corpus.src_vocab.decode(corpus.train[i][0]) for i in range(len(corpus.train))}
    assert valid and test and not valid & test and not (valid | test) & train
    # every pair of a held-out source is held out (those over the cap dropped, not trained on)
    assert len(corpus.train) == 20 * len(train)


def test_choose_held_out_at_scale_carves_whole_groups_under_the_cap():
    rule = split.SplitRule(0)
    sources = [f"source sentence {i}" for i in range(29_000)]
    per_source = np.array([rule.source_hash(s) for s in sources], np.uint32)
    hashes = np.repeat(per_source, 20)  # 580k pairs, each source 20 times
    for cap in (10, 50, 3000):
        options = Options(valid_fraction=0.02, test_fraction=0.03, max_held_out=cap)
        valid_upto, test_upto = split.choose_held_out(hashes, options)
        sides = np.where(per_source <= valid_upto, 1, np.where(per_source <= test_upto, 2, 0))
        held = [int((sides == k).sum()) * 20 for k in (1, 2)]
        assert all(0 < n <= max(cap, 20) for n in held), (cap, held)
        assert (sides == 0).sum() > 28_000


def test_too_few_distinct_sources_names_the_options(tmp_path):
    src, tgt = _repeated_corpus(tmp_path, distinct=2, repeats=50)
    with pytest.raises(CorpusError) as info:
        load(src, tgt, tmp_path / "cache", options=Options(valid_fraction=0.1, test_fraction=0.1))
    message = str(info.value)
    assert "2 distinct source sentence(s) in 100 usable pairs" in message
    assert "--valid-data" in message and "--test-fraction 0" in message
    # two distinct sources are enough for a validation set alone
    corpus, _ = load(src, tgt, tmp_path / "cache2", options=Options(test_fraction=0))
    assert corpus.valid and not corpus.test and len(corpus.train) == 50
