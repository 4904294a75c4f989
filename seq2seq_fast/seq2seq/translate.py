"""Batched translation of text with a trained checkpoint: the :class:`Translator` API.

    translator = Translator.load("runs/translate/model.pt", beam=5)
    for result in translator.translate(["I am hungry.", "", "Where is the station?"]):
        print(result.text)          # one result per input, in input order ("" for the empty one)

Sentences are encoded, sorted by length and decoded in batches (``batch_size`` sentences, or at
most ``max_tokens`` padded source tokens); greedy decoding and beam search run over the whole
batch (B or B x beam rows) and finished sentences leave it. Batching changes no result: a
sentence gets the same tokens (and scores up to float rounding) as when translated alone.
An empty input, or one longer than ``max_source_tokens`` subword tokens, gives an empty result
with a warning naming its line instead of an error, so outputs stay aligned with inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seq2seq_fast.seq2seq.data.batching import make_batch
from seq2seq_fast.seq2seq.data.normalize import normalize_text
from seq2seq_fast.seq2seq.decoding import DecodeOptions, Hypothesis, search
from seq2seq_fast.seq2seq.models import Seq2Seq

# Decoder rows per batch by default (sentences x beam). Fewer rows make the per-step products
# small (greedy at 64 sentences took 1.4x the CPU time of 320, 1 thread); more gain little.
ROWS_PER_BATCH = 320


@dataclass
class Translation:
    """The result for one input line: ``hypotheses`` best first (up to n_best; empty when the
    line was skipped, then ``warning`` says why), ``texts`` their decoded strings, ``source_ids``
    the encoded input."""

    source_ids: list[int]
    hypotheses: list[Hypothesis] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    warning: str | None = None

    @property
    def text(self) -> str:
        """The best translation ("" when the line was skipped)."""
        return self.texts[0] if self.texts else ""

    @property
    def tokens(self) -> int:
        """Output tokens of the best hypothesis."""
        return len(self.hypotheses[0].tokens) if self.hypotheses else 0


class Translator:
    """A model and its vocabularies, loaded once, translating lists of strings in batches.

    ``batch_size``: sentences per batch (default: ``ROWS_PER_BATCH // beam``, so that a batch
    holds ~320 decoder rows: 320 sentences greedy, 64 with beam 5); ``max_tokens``: or at most
    this many source tokens per batch, padding included (whichever is reached first); ``max_source_tokens``: longer inputs
    are skipped with a warning. ``normalization``: the Unicode form the corpus was read with.
    ``workers``: batches decoded at once on this many Python threads (the ops release the GIL);
    with torch's intra-op threads at 1 this uses a CPU's cores better than intra-op threads do on
    decoding's small products (the CLI's ``--threads N`` on CPU: min(N, 4) workers sharing N).
    """

    def __init__(
        self,
        model: Seq2Seq,
        src_vocab,
        tgt_vocab,
        *,
        options: DecodeOptions | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        max_source_tokens: int = 256,
        normalization: str = "NFKC",
        device: torch.device | str = "cpu",
        workers: int = 1,
    ) -> None:
        self.options = options or DecodeOptions()
        if batch_size is None:
            batch_size = max(1, ROWS_PER_BATCH // self.options.beam)
        for name, value in (
            ("batch_size", batch_size),
            ("max_source_tokens", max_source_tokens),
            ("workers", workers),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {max_tokens!r}")
        self.model = model  # the searches run it in eval mode
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.max_source_tokens = max_source_tokens
        self.normalization = normalization
        self.device = torch.device(device)
        self.workers = workers

    @classmethod
    def load(
        cls, path: str | Path, *, backend: str = "auto", device: str = "cpu", **kwargs
    ) -> Translator:
        """Load a checkpoint (training or exported) once; ``kwargs`` as for the constructor, and
        ``options``, or the :class:`DecodeOptions` fields (``beam``, ``n_best``, ``alpha``...)."""
        from seq2seq_fast.seq2seq.checkpoint import load_model

        if "options" not in kwargs:
            kwargs["options"] = DecodeOptions.from_kwargs(kwargs)
        model, src_vocab, tgt_vocab, payload = load_model(path, backend=backend, device=device)
        normalization = payload.get("normalization") or dict(payload.get("train_config") or {}).get(
            "normalization", "NFKC"
        )
        return cls(
            model, src_vocab, tgt_vocab, device=device, normalization=normalization, **kwargs
        )

    def encode(self, texts: Sequence[str]) -> list[Translation]:
        """Encode every input; empty and over-long ones get their warning (line = position + 1)."""
        results = []
        for line, text in enumerate(texts, start=1):
            ids = self.src_vocab.encode(normalize_text(text, self.normalization))
            result = Translation(ids)
            if not ids:
                result.warning = f"line {line}: empty input, empty output"
            elif len(ids) > self.max_source_tokens:
                result.warning = (
                    f"line {line}: {len(ids)} source tokens, over the limit of "
                    f"{self.max_source_tokens} (max_source_tokens): empty output"
                )
            results.append(result)
        return results

    def batches(self, results: Sequence[Translation]) -> list[list[int]]:
        """Index lists of the inputs to decode (warnings skipped), sorted by source length, each
        within ``batch_size`` sentences and ``max_tokens`` padded source tokens."""
        order = sorted(
            (i for i, r in enumerate(results) if r.warning is None),
            key=lambda i: len(results[i].source_ids),
        )
        batch_size = self.batch_size
        if self.workers > 1:  # at least two batches per worker, so that all are kept busy
            batch_size = min(batch_size, max(1, -(-len(order) // (2 * self.workers))))
        batches: list[list[int]] = []
        for i in order:
            width = len(results[i].source_ids)  # the longest so far: sorted ascending
            current = batches[-1] if batches else None
            if (
                current is None
                or len(current) >= batch_size
                or (self.max_tokens is not None and (len(current) + 1) * width > self.max_tokens)
            ):
                batches.append([i])
            else:
                current.append(i)
        return batches

    def translate(
        self, texts: Sequence[str], *, progress: Callable[[int], None] | None = None
    ) -> list[Translation]:
        """Translate ``texts``: -> one :class:`Translation` per input, in input order.
        ``progress`` is called with the number of sentences of each finished batch."""
        results = self.encode(texts)
        skipped = sum(r.warning is not None for r in results)
        if progress is not None and skipped:
            progress(skipped)
        batches = self.batches(results)
        was_training = self.model.training
        self.model.eval()  # once, not by each search: the workers' searches overlap
        try:
            for batch, decoded in zip(batches, self._decoded(batches, results), strict=True):
                for i, hyps in zip(batch, decoded, strict=True):
                    results[i].hypotheses = hyps
                    results[i].texts = [self.tgt_vocab.decode(h.tokens) for h in hyps]
                if progress is not None:
                    progress(len(batch))
        finally:
            self.model.train(was_training)
        return results

    def _decoded(
        self, batches: list[list[int]], results: list[Translation]
    ) -> Iterator[list[list[Hypothesis]]]:
        """Each batch's hypotheses, in batch order; on ``workers`` threads when there are more."""

        def decode(batch: list[int]) -> list[list[Hypothesis]]:
            return self._decode([results[i].source_ids for i in batch])

        if self.workers == 1 or len(batches) < 2:
            yield from map(decode, batches)
            return
        pool = ThreadPoolExecutor(min(self.workers, len(batches)))
        try:
            yield from pool.map(decode, batches)
        finally:  # an error or Ctrl-C: the batches not started yet are dropped, not decoded
            pool.shutdown(wait=True, cancel_futures=True)

    def _decode(self, sources: list[list[int]]) -> list[list[Hypothesis]]:
        batch = make_batch([(s, [0]) for s in sources])
        src, lengths = batch.src.to(self.device), batch.src_lengths.to(self.device)
        return search(self.model, src, lengths, self.options)


class InputError(ValueError):
    """Input text that cannot be read (not UTF-8); the message names the line."""


def split_lines(data: bytes | str, name: str = "<stdin>") -> list[str]:
    """The lines of ``data`` as ``wc -l`` counts them (a last line without a newline included),
    each line's trailing carriage return dropped (CRLF files), a UTF-8 byte-order mark skipped.
    Bytes must be UTF-8: :class:`InputError` names the first line that is not."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    lines = []
    for number, line in enumerate(raw, start=1):
        try:
            lines.append(line.removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{name}: line {number} is not valid UTF-8 ({exc.reason} at byte {exc.start} of "
                f"the line); convert the file to UTF-8, e.g. with iconv"
            ) from None
    return lines


# Lines read, translated and written at a time by the ``translate`` command (iter_chunks; fewer
# when a pipe pauses):
# memory stays bounded for any input, and output comes before the input ends (pipelines).
CHUNK_LINES = 1000


@dataclass
class Chunk:
    """Consecutive input lines: ``texts`` (line ``first`` first), and ``warnings`` by index into
    ``texts`` (lines that were not valid UTF-8, decoded with U+FFFD replacements)."""

    first: int
    texts: list[str] = field(default_factory=list)
    warnings: dict[int, str] = field(default_factory=dict)


def _decode_line(raw: bytes | str, number: int) -> tuple[str, str | None]:
    """One line without its line end (LF, CRLF): its text, and a warning when not UTF-8."""
    if isinstance(raw, str):
        return raw.removesuffix("\n").removesuffix("\r"), None
    raw = raw.removesuffix(b"\n").removesuffix(b"\r")
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return raw.decode("utf-8", errors="replace"), (
            f"line {number}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line): "
            f"read with U+FFFD for the bad bytes"
        )


def _open_input(path: str | Path | None):
    """A binary stream of the file at ``path`` (the caller closes it), or of stdin when None."""
    import sys

    if path is None:
        stream = sys.stdin
        return getattr(stream, "buffer", stream), False
    try:
        return open(path, "rb"), True  # noqa: SIM115 (closed by iter_chunks)
    except IsADirectoryError:
        raise InputError(f"--input {path}: is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"--input {path}: cannot read it ({exc.strerror or exc})") from None


def _pipe_lines(stream, wait: float) -> Iterator[bytes | str | None]:
    """The lines of ``stream`` with their line ends, and None wherever a pipe (or a terminal)
    has had no further input for ``wait`` seconds: a pause, at which a partial chunk is worth
    translating. Regular files and streams without a file descriptor just give their lines."""
    import os
    import select
    import stat

    try:
        fd = stream.fileno()
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (AttributeError, OSError, ValueError):  # io.BytesIO and the like
        fd, regular = None, True
    if regular or os.name == "nt" or not hasattr(stream, "read1"):
        yield from stream
        return
    pending = b""
    # read1 returns what is buffered or else one read's worth (what the pipe holds), and leaves
    # the buffer empty (64 KiB > its 8 KiB): then select on the descriptor sees all there is.
    while data := stream.read1(1 << 16):
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line + b"\n"
        if not select.select([fd], [], [], wait)[0]:
            yield None
    if pending:
        yield pending


def iter_chunks(
    path: str | Path | None, lines: int = CHUNK_LINES, *, wait: float = 0.05
) -> Iterator[Chunk]:
    """The lines of the file at ``path`` (stdin when None) in chunks of up to ``lines``, each
    yielded once full, at the end, or (from a pipe) when no more input came for ``wait`` s, so
    that only one chunk is held and a pipeline gets answers as it sends lines: lines as ``wc -l``
    counts them (a last line without a newline included), line ends LF or CRLF, a UTF-8
    byte-order mark skipped; a line that is not UTF-8 is decoded with replacements and named in
    the chunk's ``warnings``. The file is opened at the first ``next()``."""
    if lines < 1:
        raise ValueError(f"chunk lines must be >= 1, got {lines}")
    stream, close = _open_input(path)
    try:
        chunk, number = Chunk(1), 0
        for raw in _pipe_lines(stream, wait):
            if raw is None:  # the input paused: translate what came
                if chunk.texts:
                    yield chunk
                    chunk = Chunk(number + 1)
                continue
            number += 1
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf" if isinstance(raw, bytes) else "\ufeff")
            text, warning = _decode_line(raw, number)
            if warning is not None:
                chunk.warnings[len(chunk.texts)] = warning
            chunk.texts.append(text)
            if len(chunk.texts) >= lines:
                yield chunk
                chunk = Chunk(number + 1)
        if chunk.texts:
            yield chunk
    finally:
        if close:
            stream.close()


def count_lines(path: str | Path) -> int:
    """Lines of a file as :func:`iter_chunks` reads them (for a progress bar's total)."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def read_lines(path: str | Path | None) -> list[str]:
    """All lines of the file at ``path``, or of stdin when None (see :func:`split_lines`)."""
    import sys

    if path is None:
        stream = sys.stdin
        return split_lines(stream.buffer.read() if hasattr(stream, "buffer") else stream.read())
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise InputError(f"--input {path}: is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"--input {path}: cannot read it ({exc.strerror or exc})") from None
    return split_lines(data, str(path))
