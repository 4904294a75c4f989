"""The ``translate`` command streams: chunks of lines are translated and written (flushed) before
the next is read, so it answers in a pipeline before its input ends; every input line gets its
output line(s), in order, whatever the line holds; -o FILE appears whole or not at all."""

from __future__ import annotations

import io
import os
import queue
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from seq2seq_fast.seq2seq.translate import Translator, count_lines, iter_chunks
from tests.seq2seq.test_translate import _run, checkpoint  # noqa: F401 (a fixture)

# Empty, whitespace-only, over-long (> 8 tokens), not UTF-8 (latin-1), CRLF, no final newline.
RAW = b"a b c\n\n   \nd e f g\na b c d e f g h i j\ncaf\xe9 e\r\nb\r\n\t \nc d e\r\n\xff\xfe\nj i h"
LINES = RAW.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n")
EMPTY = {2, 3, 5, 8}  # line numbers (from 1) that give empty output, with a warning
NOT_UTF8 = {6, 10}


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(
        sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data), isatty=lambda: False)
    )


def test_iter_chunks_reads_lines_like_wc_in_chunks(tmp_path, monkeypatch):
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbf" + RAW)
    chunks = list(iter_chunks(path, 4))
    assert [c.first for c in chunks] == [1, 5, 9]
    assert [t for c in chunks for t in c.texts] == LINES
    numbers = {c.first + i: w for c in chunks for i, w in c.warnings.items()}
    assert sorted(numbers) == sorted(NOT_UTF8)
    assert all(w.startswith(f"line {n}: not valid UTF-8") for n, w in numbers.items())
    assert count_lines(path) == len(LINES) == 11
    read, write = os.pipe()  # the same from a pipe (read as it comes, not as a file)
    with open(write, "wb") as sink:
        sink.write(b"\xef\xbb\xbf" + RAW)
    with open(read, "rb") as stream:
        monkeypatch.setattr(sys, "stdin", stream)
        piped = list(iter_chunks(None, 4))
    assert [t for c in piped for t in c.texts] == LINES
    assert {c.first + i for c in piped for i in c.warnings} == NOT_UTF8
    path.write_bytes(b"x\n\n")
    assert [c.texts for c in iter_chunks(path, 1)] == [["x"], [""]] and count_lines(path) == 2
    path.write_bytes(b"")
    assert list(iter_chunks(path)) == [] and count_lines(path) == 0


@pytest.mark.parametrize("chunk", ["1", "4", "1000"])
def test_every_line_answers_its_input_line_with_n_best(checkpoint, capsys, monkeypatch, chunk):  # noqa: F811
    monkeypatch.setenv("SEQ2SEQ_FAST_TRANSLATE_CHUNK", chunk)
    _stdin(monkeypatch, RAW)
    argv = ["translate", "--checkpoint", checkpoint, "--max-source-tokens", "8"]
    code, out, err = _run(capsys, *argv, "--beam", "2", "--n-best", "2")
    assert code == 0, err
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == 2 * len(LINES)
    translator = Translator.load(checkpoint, max_source_tokens=8, beam=2, n_best=2)
    for number, (expected, pair) in enumerate(
        zip(translator.translate(LINES), zip(lines[:-1:2], lines[1::2], strict=True), strict=True),
        start=1,
    ):
        texts = [line.split("\t")[0] for line in pair]
        if number in EMPTY:
            assert pair == ("", ""), number
            assert f"warning: line {number}: " in err
        else:
            assert texts == expected.texts and all("\t" in line for line in pair), number
    for number in NOT_UTF8:
        assert f"warning: line {number}: not valid UTF-8" in err
    warned = {int(w.split("line ")[1].split(":")[0]) for w in err.split("\n") if "warning" in w}
    assert warned == EMPTY | NOT_UTF8
    assert f"{len(LINES)} sentences, " in err
    # Best only: the streamed lines equal Translator.translate(all lines), line by line.
    _stdin(monkeypatch, RAW)
    code, out, err = _run(capsys, *argv)
    expected = Translator.load(checkpoint, max_source_tokens=8).translate(LINES)
    assert code == 0 and out.split("\n")[:-1] == [r.text for r in expected]


def test_output_file_appears_whole_or_not_at_all(checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SEQ2SEQ_FAST_TRANSLATE_CHUNK", "3")
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_bytes(RAW)
    argv = ["translate", "--checkpoint", checkpoint, "-i", source, "-o", target]
    code, out, err = _run(capsys, *argv, "--max-source-tokens", "8")
    assert code == 0 and out == "", err
    assert target.read_text().count("\n") == len(LINES)
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    # A run that fails after its first chunk leaves the old file and no temporary one.
    translate, calls = Translator.translate, []

    def failing(self, texts, **kwargs):
        calls.append(len(texts))
        if len(calls) == 2:
            raise OSError("disk full")
        return translate(self, texts, **kwargs)

    monkeypatch.setattr(Translator, "translate", failing)
    target.write_text("old\n")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "disk full" in err and calls == [3, 3]
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    code, _, err = _run(capsys, *argv[:-2], "-o", tmp_path / "no" / "out.txt")
    assert code == 2 and "error" in err


def test_bad_chunk_setting_is_an_error(checkpoint, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SEQ2SEQ_FAST_TRANSLATE_CHUNK", "0")
    _stdin(monkeypatch, b"a b\n")
    code, _, err = _run(capsys, "translate", "--checkpoint", checkpoint)
    assert code == 2 and "SEQ2SEQ_FAST_TRANSLATE_CHUNK=0" in err


@pytest.mark.parametrize(
    ("setting", "chunk"),
    [("3", 3), (None, 2)],  # a full chunk; two lines of 1,000, then a pause (the input waits)
    ids=["full-chunk", "pause"],
)
def test_pipe_gets_the_first_lines_before_stdin_closes(checkpoint, tmp_path, setting, chunk):  # noqa: F811
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SEQ2SEQ_FAST_TRANSLATE_CHUNK", None)
    if setting is not None:
        env["SEQ2SEQ_FAST_TRANSLATE_CHUNK"] = setting
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    with open(tmp_path / "err.txt", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "seq2seq_fast", "translate", "--checkpoint", str(checkpoint)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
    lines: queue.Queue[bytes] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(b"")  # end of output

    threading.Thread(target=read, daemon=True).start()
    texts = ["a b c", "d e", "f g h i", "j", "b c", "", "a"]

    def take(count: int) -> list[str]:
        got = []
        for _ in range(count):
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                proc.kill()
                pytest.fail(f"no output line after 60 s (got {got}): the command does not stream")
            assert line, f"output ended early: {got}; {(tmp_path / 'err.txt').read_text()}"
            got.append(line.decode().removesuffix("\n"))
        return got

    try:
        proc.stdin.write("".join(t + "\n" for t in texts[:chunk]).encode())
        proc.stdin.flush()
        first = take(chunk)  # stdin still open
        assert proc.poll() is None
        proc.stdin.write("".join(t + "\n" for t in texts[chunk:]).encode())
        proc.stdin.close()
        rest = take(len(texts) - chunk)
        assert lines.get(timeout=60) == b""
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    expected = Translator.load(checkpoint).translate(texts)
    assert first + rest == [r.text for r in expected]
    err = (tmp_path / "err.txt").read_text()
    assert f"{len(texts)} sentences, " in err and "warning: line 6: empty input" in err


def test_iter_chunks_yields_what_a_pipe_sent_when_it_pauses(monkeypatch):
    read, write = os.pipe()
    with open(read, "rb") as stream, open(write, "wb", buffering=0) as sink:
        monkeypatch.setattr(sys, "stdin", stream)  # a binary stream: read as it is
        sink.write(b"a b\nc")
        chunks, got = iter_chunks(None), queue.Queue()
        threading.Thread(target=lambda: got.put(next(chunks)), daemon=True).start()
        first = got.get(timeout=30)  # of 1,000 lines, after the pipe paused
        assert (first.first, first.texts) == (1, ["a b"])
        sink.write(b" d\r\ne\n")
        sink.close()
        assert [(c.first, c.texts) for c in chunks] == [(2, ["c d", "e"])]
