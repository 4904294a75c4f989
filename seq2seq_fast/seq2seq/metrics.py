"""The run's metrics as a file: ``metrics.jsonl`` in the run folder, and TensorBoard events.

One JSON object a line, appended as training goes (a resumed run appends to its file, after
dropping the records of steps after its checkpoint, which it trains again):

    {"kind": "train", "step": 10, "time": 1796246679.1, "elapsed_s": 4.2, "loss": 2.31,
     "lr": 0.0003, "tokens_per_s": 51234.0}
    {"kind": "valid", "step": 200, ..., "valid_bleu": 21.4}        (reverse: seq_acc, tok_acc)
    {"kind": "final", "step": 2000, ..., "test_bleu": 30.2}

``time`` is the wall clock (Unix seconds), ``elapsed_s`` the seconds since the job started. With
``tensorboard_dir`` the same values go to TensorBoard as ``<kind>/<name>`` scalars at their step
(``torch.utils.tensorboard``, which needs the ``tensorboard`` package: the ``tensorboard`` extra).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends records to ``folder/metrics.jsonl`` (and TensorBoard); a disabled log (DDP ranks
    other than 0) writes nothing. ``fresh``: start the file anew (a new run), else append."""

    def __init__(
        self,
        folder: Path,
        *,
        started: float,
        tensorboard_dir: str | Path | None = None,
        fresh: bool = True,
        resumed_at: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.path = Path(folder) / METRICS_FILE
        self.started = started  # time.perf_counter() at the job's start
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.write_text("", encoding="utf-8")
        elif resumed_at is not None and self.path.exists():
            self._drop_after(resumed_at)
        if tensorboard_dir is not None:
            self.writer = tensorboard_writer(tensorboard_dir)

    def _drop_after(self, step: int) -> None:
        """Drop the records of steps after ``step``, the checkpoint a resumed run goes on from:
        the run trains those steps again and writes their records anew (kept, they would be
        there twice, the first time from a run whose later steps were lost)."""
        from seq2seq_fast.seq2seq.atomic import atomic_write

        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) < len(lines):
            atomic_write(self.path, "".join(kept).encode("utf-8"))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        """One record: ``values`` (numbers) of ``kind`` ("train", "valid", "final") at ``step``."""
        if not self.enabled:
            return
        numbers = {k: float(v) for k, v in values.items()}
        record = {
            "kind": kind,
            "step": step,
            "time": round(time.time(), 3),
            "elapsed_s": round(time.perf_counter() - self.started, 3),
        }
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in numbers.items()})
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in numbers.items():
                self.writer.add_scalar(f"{kind}/{name}", value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _step_of(line: str) -> float:
    """A metrics.jsonl line's step; -inf for a line that is not a record (kept as it is)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -math.inf


def read_metrics(folder: str | Path) -> list[dict[str, Any]]:
    """The records of a run folder's metrics.jsonl, in order."""
    text = (Path(folder) / METRICS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def tensorboard_writer(folder: str | Path):
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``folder``; a ValueError naming
    the option and the install command when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises ImportError without the tensorboard package
        raise ValueError(
            f"--tensorboard {folder} needs the tensorboard package ({exc}): "
            "pip install 'seq2seq-fast[tensorboard]' (or pip install tensorboard)"
        ) from None
    return SummaryWriter(log_dir=str(folder))
