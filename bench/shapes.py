"""What the benchmarks run: the one shape list, the size sets and the knobs that pick them.

Shared by the report (``python -m bench.harness``), the pytest-benchmark files (``bench_*.py``),
the training benchmarks and the GPU check. Importing this module imports nothing heavy (no torch),
so a script may set environment variables (``TRITON_INTERPRET``) before it imports torch.

Sizes (``SEQ2SEQ_FAST_BENCH_SIZE``, or ``--size`` of the report):

    tiny    seconds: what CI runs (tests/reliability/test_bench.py), to keep the benchmarks from rotting
    quick   two real shapes (a training one and a decoding step)
    full    every shape (default)

On CUDA the full shapes are used as they are; on CPU the batch of the large ones is divided by 8
(``CPU_SHAPES``) so that a 2-core machine finishes: the eager reference runs ~0.3 G tanh/s there
and holds the B*Tq*Tk*H tensor several times over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SIZES = ("tiny", "quick", "full")
MODES = ("forward", "forward+backward")
PROVIDERS = ("fused", "eager", "compile")

SIZE_ENV = "SEQ2SEQ_FAST_BENCH_SIZE"
DEVICE_ENV = "SEQ2SEQ_FAST_BENCH_DEVICE"
THREADS_ENV = "SEQ2SEQ_FAST_BENCH_THREADS"
PROVIDERS_ENV = "SEQ2SEQ_FAST_BENCH_PROVIDERS"

# Tanh-equivalent work per call, in units of N = B*Tq*Tk*H: the forward evaluates N tanh; the
# backward recomputes them and does about as much again, so forward+backward counts 3N.
WORK_FACTOR = {"forward": 1, "forward+backward": 3}


@dataclass(frozen=True)
class Shape:
    """One op shape: batch B, query length Tq, key length Tk, hidden H, value size Dv."""

    name: str
    batch: int
    q_len: int
    k_len: int
    hidden: int
    value_dim: int
    note: str = ""

    @property
    def tanh_count(self) -> int:
        """N = B*Tq*Tk*H tanh evaluations in one forward."""
        return self.batch * self.q_len * self.k_len * self.hidden

    @property
    def label(self) -> str:
        return f"B={self.batch} Tq={self.q_len} Tk={self.k_len} H={self.hidden} Dv={self.value_dim}"


@dataclass(frozen=True)
class DecodeShape:
    """A greedy-decoding loop: ``steps`` calls of one query [B, H] against cached keys [B, Tk, H]."""

    name: str
    batch: int
    k_len: int
    hidden: int
    value_dim: int
    steps: int
    note: str = ""

    @property
    def tanh_count(self) -> int:
        return self.steps * self.batch * self.k_len * self.hidden

    @property
    def label(self) -> str:
        return (
            f"B={self.batch} Tk={self.k_len} H={self.hidden} Dv={self.value_dim} steps={self.steps}"
        )


@dataclass(frozen=True)
class TrainSize:
    """A Seq2Seq training step: hidden (= embedding) size, sequence length, batch, vocabulary."""

    name: str
    hidden: int
    length: int
    batch: int
    vocab: int = 1000

    @property
    def label(self) -> str:
        return f"hidden={self.hidden} length={self.length} batch={self.batch} vocab={self.vocab}"


# The full shapes (B, Tq, Tk, H, Dv): a small training batch, GNMT training, a GNMT decoding step
# (beam 10 x batch 128), a long source, long source and target. Dv is 512 for the small one and H
# otherwise (GNMT attends over encoder states of the attention size).
FULL_SHAPES = (
    Shape("small-train", 32, 30, 30, 256, 512),
    Shape("gnmt-train", 128, 50, 50, 1024, 1024),
    Shape("decode-step", 1280, 1, 66, 1024, 1024),
    Shape("long-source", 128, 10, 128, 1024, 1024),
    Shape("long-both", 32, 74, 75, 1024, 1024),
)

# The same shapes with the batch cut for a 2-core CPU; Tq, Tk, H, Dv are kept.
CPU_SHAPES = (
    FULL_SHAPES[0],
    Shape("gnmt-train/8", 16, 50, 50, 1024, 1024, "B/8"),
    Shape("decode-step/8", 160, 1, 66, 1024, 1024, "B/8"),
    Shape("long-source/8", 16, 10, 128, 1024, 1024, "B/8"),
    Shape("long-both/8", 4, 74, 75, 1024, 1024, "B/8"),
)

TINY_SHAPES = (
    Shape("tiny", 2, 3, 5, 8, 6),
    Shape("tiny-decode-step", 3, 1, 7, 8, 8),
)

FULL_DECODE = DecodeShape("decode-loop", 1280, 66, 1024, 1024, 32)
CPU_DECODE = DecodeShape("decode-loop/8", 160, 66, 1024, 1024, 16, "B/8, 16 steps")
CPU_QUICK_DECODE = DecodeShape("decode-loop/8", 160, 66, 1024, 1024, 4, "B/8, 4 steps")
TINY_DECODE = DecodeShape("tiny-decode-loop", 3, 7, 8, 8, 3)

TRAIN_SIZES = {
    "tiny": TrainSize("tiny", hidden=8, length=5, batch=3, vocab=20),
    "small": TrainSize("small", hidden=256, length=30, batch=64),
    "large": TrainSize("large", hidden=512, length=50, batch=64),
}


@dataclass(frozen=True)
class ConvertSize:
    """A training step of a small NLP model around a converted layout (bench/bench_convert.py):
    batch, source length S, decoder steps, hidden size, vocabularies."""

    name: str
    batch: int
    source: int  # S
    target: int  # decoder steps
    hidden: int
    src_vocab: int = 4345  # the PyTorch tutorial's French and English vocabularies
    tgt_vocab: int = 2803


@dataclass(frozen=True)
class SpeechSize:
    """A training step of a small speech-style decoder around a converted layout
    (bench/bench_convert_speech.py): batch, memory length T, width E, target steps."""

    name: str
    batch: int
    frames: int  # T, memory length
    width: int  # E = decoder state = attention width
    steps: int  # target steps
    vocab: int = 64
    conv_channels: int = 16
    conv_half_width: int = 7  # location conv of width 2 * 7 + 1


CONVERT_SIZES = {
    "tiny": ConvertSize("tiny", batch=2, source=5, target=3, hidden=8, src_vocab=11, tgt_vocab=13),
    "small": ConvertSize("small", batch=64, source=50, target=20, hidden=256),
    "large": ConvertSize("large", batch=64, source=50, target=20, hidden=512),
}

SPEECH_SIZES = {
    "tiny": SpeechSize(
        "tiny", batch=2, frames=5, width=8, steps=2, vocab=10, conv_channels=2, conv_half_width=1
    ),
    "small": SpeechSize("small", batch=32, frames=100, width=256, steps=20),
}


def _is_cuda(device: str) -> bool:
    return str(device).split(":")[0] == "cuda"


def check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    return size


def default_size() -> str:
    """``$SEQ2SEQ_FAST_BENCH_SIZE`` or ``full``."""
    size = os.environ.get(SIZE_ENV, "full")
    if size not in SIZES:
        raise ValueError(f"{SIZE_ENV} must be one of {SIZES}, got {size!r}")
    return size


def default_device() -> str:
    """``$SEQ2SEQ_FAST_BENCH_DEVICE``, else cuda when available, else cpu."""
    device = os.environ.get(DEVICE_ENV)
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_providers() -> tuple[str, ...]:
    """``$SEQ2SEQ_FAST_BENCH_PROVIDERS`` (comma-separated subset of ``PROVIDERS``) or all."""
    names = os.environ.get(PROVIDERS_ENV)
    if not names:
        return PROVIDERS
    chosen = tuple(name.strip() for name in names.split(",") if name.strip())
    unknown = [name for name in chosen if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"{PROVIDERS_ENV}: unknown providers {unknown}; known: {PROVIDERS}")
    return chosen


def shapes_for(size: str, device: str) -> tuple[Shape, ...]:
    """The op shapes of a size on a device: tiny, quick (two real shapes) or full."""
    if check_size(size) == "tiny":
        return TINY_SHAPES
    full = FULL_SHAPES if _is_cuda(device) else CPU_SHAPES
    return (full[0], full[2]) if size == "quick" else full


def decode_shape_for(size: str, device: str) -> DecodeShape:
    """The decoding-loop shape of a size on a device."""
    if check_size(size) == "tiny":
        return TINY_DECODE
    if _is_cuda(device):
        return FULL_DECODE
    return CPU_QUICK_DECODE if size == "quick" else CPU_DECODE


def train_sizes_for(size: str) -> tuple[TrainSize, ...]:
    """The training-step sizes of a size: tiny, quick (small) or full (small and large)."""
    if check_size(size) == "tiny":
        return (TRAIN_SIZES["tiny"],)
    if size == "quick":
        return (TRAIN_SIZES["small"],)
    return (TRAIN_SIZES["small"], TRAIN_SIZES["large"])


def shape_by_name(name: str) -> Shape | DecodeShape:
    """Any shape above by its name (e.g. ``"gnmt-train"``, ``"decode-step/8"``, ``"tiny"``)."""
    every = (*FULL_SHAPES, *CPU_SHAPES, *TINY_SHAPES, FULL_DECODE, CPU_DECODE, TINY_DECODE)
    for shape in every:
        if shape.name == name:
            return shape
    raise ValueError(f"unknown shape {name!r}; known: {sorted({s.name for s in every})}")
