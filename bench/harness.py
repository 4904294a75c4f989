"""Benchmarks of the fused additive attention: shared measurement code and the report command.

    python -m bench.harness [--device cuda] [--quick] [--threads N] [--json PATH] [--rss]

One implementation of shapes, providers, timing and memory serves both this report and the
pytest-benchmark files in ``bench/`` (``pytest bench/ --benchmark-only``).

Providers:
    fused    ``seq2seq_fast.additive_attention`` (C++ kernel on CPU, Triton on CUDA)
    eager    ``additive_attention_ref``, the plain PyTorch reference the tests use
    compile  ``torch.compile(additive_attention_ref, dynamic=False)``, compiled and warmed up
             before anything is timed

Modes:
    forward           one call under ``torch.no_grad()`` (inference)
    forward+backward  one call on inputs that require grad, then ``context.backward(grad)``

Timing: the providers of one (shape, mode) are timed in one process, interleaved round by round
(the order rotates every round), each sample long enough to swamp timer noise; the report gives
the median with the interquartile range and min, and speedups as medians of per-round ratios.

Memory: the peak of the bytes allocated during one call (after warm-up), minus the bytes of what
the call returns (context, weights and, in forward+backward, the gradients): "extra" memory
beyond inputs and outputs. On CUDA it is ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``; on CPU it is the running sum of the allocations and frees that
``torch.profiler`` records from PyTorch's CPU allocator (``profile_memory=True``). Memory that a
kernel takes with plain ``malloc`` outside PyTorch's allocator is not seen there; ``--rss`` adds a
cross-check that sees it: the resident-set peak of the same call in a fresh process.

Size knob: ``SEQ2SEQ_FAST_BENCH_SIZE`` = ``tiny`` (CI: seconds), ``quick`` (two real shapes) or
``full`` (default); on CPU the shapes of DESIGN.md are scaled down (smaller batch) so a 2-core
machine finishes, on CUDA they are used as they are.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from seq2seq_fast.ops.additive_attention import additive_attention, fused_unavailable_reason
from seq2seq_fast.reference import additive_attention_ref

PROVIDERS = ("fused", "eager", "compile")
MODES = ("forward", "forward+backward")
SIZES = ("tiny", "quick", "full")
SIZE_ENV = "SEQ2SEQ_FAST_BENCH_SIZE"
DEVICE_ENV = "SEQ2SEQ_FAST_BENCH_DEVICE"
THREADS_ENV = "SEQ2SEQ_FAST_BENCH_THREADS"
PROVIDERS_ENV = "SEQ2SEQ_FAST_BENCH_PROVIDERS"

# Tanh-equivalent work per call, in units of N = B*Tq*Tk*H: the forward evaluates N tanh; the
# backward is about 2N worth of work (DESIGN.md), so forward+backward counts 3N.
WORK_FACTOR = {"forward": 1, "forward+backward": 3}


# --- shapes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: batch B, query length Tq, key length Tk, hidden H, value size Dv."""

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


# DESIGN.md's shapes (B, Tq, Tk, H); Dv is 512 for the small one (its measured row) and H otherwise
# (GNMT attends over encoder states of the attention size).
DESIGN_SHAPES = (
    Shape("small-train", 32, 30, 30, 256, 512),
    Shape("gnmt-train", 128, 50, 50, 1024, 1024),
    Shape("decode-step", 1280, 1, 66, 1024, 1024),
    Shape("long-source", 128, 10, 128, 1024, 1024),
    Shape("long-both", 32, 74, 75, 1024, 1024),
)

# The same shapes with the batch cut for a 2-core CPU (the eager reference runs ~0.3 G tanh/s there
# and holds the B*Tq*Tk*H tensor several times over); Tq, Tk, H, Dv are kept.
CPU_SHAPES = (
    DESIGN_SHAPES[0],
    Shape("gnmt-train/8", 16, 50, 50, 1024, 1024, "B/8"),
    Shape("decode-step/8", 160, 1, 66, 1024, 1024, "B/8"),
    Shape("long-source/8", 16, 10, 128, 1024, 1024, "B/8"),
    Shape("long-both/8", 4, 74, 75, 1024, 1024, "B/8"),
)

TINY_SHAPES = (
    Shape("tiny", 2, 3, 5, 8, 6),
    Shape("tiny-decode-step", 3, 1, 7, 8, 8),
)

DESIGN_DECODE = DecodeShape("decode-loop", 1280, 66, 1024, 1024, 32)
CPU_DECODE = DecodeShape("decode-loop/8", 160, 66, 1024, 1024, 16, "B/8, 16 steps")
TINY_DECODE = DecodeShape("tiny-decode-loop", 3, 7, 8, 8, 3)


def default_size() -> str:
    size = os.environ.get(SIZE_ENV, "full")
    if size not in SIZES:
        raise ValueError(f"{SIZE_ENV} must be one of {SIZES}, got {size!r}")
    return size


def default_device() -> str:
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


def default_providers() -> tuple[str, ...]:
    names = os.environ.get(PROVIDERS_ENV)
    if not names:
        return PROVIDERS
    chosen = tuple(name.strip() for name in names.split(",") if name.strip())
    unknown = [name for name in chosen if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"{PROVIDERS_ENV}: unknown providers {unknown}; known: {PROVIDERS}")
    return chosen


def shapes_for(size: str, device: str) -> tuple[Shape, ...]:
    """The op shapes of a size: tiny (CI), quick (two real shapes) or full."""
    if size == "tiny":
        return TINY_SHAPES
    full = DESIGN_SHAPES if torch.device(device).type == "cuda" else CPU_SHAPES
    if size == "quick":
        return (full[0], full[2])
    if size == "full":
        return full
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def decode_shape_for(size: str, device: str) -> DecodeShape:
    if size == "tiny":
        return TINY_DECODE
    if torch.device(device).type == "cuda":
        return DESIGN_DECODE
    if size == "quick":
        return DecodeShape("decode-loop/8", 160, 66, 1024, 1024, 4, "B/8, 4 steps")
    return CPU_DECODE


# --- inputs and providers --------------------------------------------------------------------------


@dataclass
class Case:
    """Inputs of one op benchmark. ``lengths`` pads about a third of the keys of some rows."""

    shape: Shape
    device: str
    dtype: torch.dtype
    query: Tensor
    keys: Tensor
    values: Tensor
    v: Tensor
    bias: Tensor
    lengths: Tensor
    grad_context: Tensor

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return (self.query, self.keys, self.values, self.v, self.bias)

    @property
    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors, self.lengths))


def random_lengths(batch: int, k_len: int, generator: torch.Generator) -> Tensor:
    """Valid key counts in [ceil(0.6 Tk), Tk], the longest row full (as a padded batch is)."""
    low = max(1, math.ceil(0.6 * k_len))
    lengths = torch.randint(low, k_len + 1, (batch,), generator=generator)
    lengths[0] = k_len
    return lengths


def make_case(
    shape: Shape, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> Case:
    """Random inputs for ``shape``, made on CPU with a fixed seed and moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    b, tq, tk, h, dv = shape.batch, shape.q_len, shape.k_len, shape.hidden, shape.value_dim

    def rand(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    return Case(
        shape=shape,
        device=device,
        dtype=dtype,
        query=rand(b, tq, h),
        keys=rand(b, tk, h),
        values=rand(b, tk, dv),
        v=rand(h, scale=h**-0.5),
        bias=rand(h, scale=0.1),
        lengths=random_lengths(b, tk, gen).to(device),
        grad_context=rand(b, tq, dv),
    )


def provider_unavailable_reason(provider: str, device: str, dtype: torch.dtype) -> str | None:
    """None when ``provider`` can run on this device and dtype, else why not."""
    if provider not in PROVIDERS:
        return f"unknown provider {provider!r} (known: {PROVIDERS})"
    if provider == "fused":
        return fused_unavailable_reason(device, dtype)
    return None


def _raise_recompile_limit(limit: int = 256) -> None:
    # Every (shape, mode) is its own graph of one function; past dynamo's recompile limit (8) it
    # would silently run eager, so the "compile" provider would time the reference instead.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name) and getattr(config, name) < limit:
            setattr(config, name, limit)


def provider_function(provider: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The callable a provider runs, with ``additive_attention``'s signature."""
    if provider == "fused":
        return additive_attention
    if provider == "eager":
        return additive_attention_ref
    if provider == "compile":
        _raise_recompile_limit()
        return torch.compile(additive_attention_ref, dynamic=False)
    raise ValueError(f"unknown provider {provider!r} (known: {PROVIDERS})")


def make_call(provider: str, mode: str, case: Case) -> Callable[[], tuple[Tensor, ...]]:
    """A zero-argument callable running one (provider, mode) step on ``case``; returns its outputs.

    Not warmed up: call ``warm_up`` before timing (for ``compile`` the first call compiles).
    """
    fn = provider_function(provider)
    lengths = case.lengths
    if mode == "forward":
        query, keys, values, v, bias = case.tensors

        def forward() -> tuple[Tensor, ...]:
            with torch.no_grad():
                context, weights = fn(query, keys, values, v, bias, lengths=lengths)
            return (context, weights)

        return forward
    if mode == "forward+backward":
        leaves = [t.detach().clone().requires_grad_(True) for t in case.tensors]
        grad_context = case.grad_context

        def forward_backward() -> tuple[Tensor, ...]:
            context, weights = fn(*leaves, lengths=lengths)
            context.backward(grad_context)
            grads = [leaf.grad for leaf in leaves]
            for leaf in leaves:  # the caller owns the gradients: nothing outlives its outputs
                leaf.grad = None
            return (context, weights, *grads)

        return forward_backward
    raise ValueError(f"unknown mode {mode!r} (known: {MODES})")


# --- the module in a decoding loop -----------------------------------------------------------------

DECODE_PROVIDERS = ("fused", "eager")
_DECODE_BACKEND = {"fused": "fused", "eager": "reference"}


@dataclass
class DecodeCase:
    shape: DecodeShape
    device: str
    dtype: torch.dtype
    encoder_states: Tensor  # [B, Tk, Dv]: keys before projection, and the values
    decoder_states: Tensor  # [steps, B, H]: one query per step
    lengths: Tensor
    state_dict: dict[str, Tensor]


def make_decode_case(
    shape: DecodeShape, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> DecodeCase:
    from seq2seq_fast.nn.attention import BahdanauAttention

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = BahdanauAttention(shape.hidden, shape.value_dim, shape.hidden, normalize=True)
    b, tk = shape.batch, shape.k_len
    return DecodeCase(
        shape=shape,
        device=device,
        dtype=dtype,
        encoder_states=torch.randn(b, tk, shape.value_dim, generator=gen).to(device, dtype),
        decoder_states=torch.randn(shape.steps, b, shape.hidden, generator=gen).to(device, dtype),
        lengths=random_lengths(b, tk, gen).to(device),
        state_dict={k: t.to(device, dtype) for k, t in module.state_dict().items()},
    )


def make_decode_call(provider: str, case: DecodeCase) -> Callable[[], tuple[Tensor, ...]]:
    """Greedy-decoding attention: ``steps`` [B, H] queries against keys projected once, cached.

    ``BahdanauAttention(normalize=True)`` with ``backend="fused"`` or ``"reference"``, under
    ``torch.no_grad()``. The keys are projected here, outside the timed region (once per source
    batch, the same work for both providers); each timed step projects its query and attends.
    """
    from seq2seq_fast.nn.attention import BahdanauAttention

    shape = case.shape
    module = BahdanauAttention(
        shape.hidden,
        shape.value_dim,
        shape.hidden,
        normalize=True,
        backend=_DECODE_BACKEND[provider],
    ).to(case.device, case.dtype)
    module.load_state_dict(case.state_dict)
    module.eval()
    encoder_states, decoder_states, lengths = case.encoder_states, case.decoder_states, case.lengths

    with torch.no_grad():
        projected = module.project_keys(encoder_states)

    def decode() -> tuple[Tensor, ...]:
        with torch.no_grad():
            for step in range(decoder_states.shape[0]):
                context, weights = module(
                    decoder_states[step], encoder_states, projected_keys=projected, lengths=lengths
                )
        return (context, weights)

    return decode


# --- timing ----------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def synchronized(call: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``call`` followed by a device synchronisation, so an outside timer sees the whole of it."""
    if torch.device(device).type != "cuda":
        return call

    def run() -> Any:
        out = call()
        torch.cuda.synchronize()
        return out

    return run


def warm_up(call: Callable[[], Any], device: str, times: int = 2) -> float:
    """Run ``call`` ``times`` times (compiles, autotunes, faults pages in); return the last duration."""
    elapsed = 0.0
    for _ in range(times):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        elapsed = time.perf_counter() - start
    return elapsed


def time_interleaved(
    calls: dict[str, Callable[[], Any]],
    device: str,
    rounds: int,
    min_sample_s: float,
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Seconds per call of each callable: ``rounds`` samples each, interleaved, order rotated.

    Each sample repeats a call enough times to last ``min_sample_s`` (calibrated after warm-up) and
    divides; garbage collection is off while timing.
    """
    names = list(calls)
    repeats = {}
    for name in names:
        one = warm_up(calls[name], device, warmup)
        repeats[name] = max(1, math.ceil(min_sample_s / max(one, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                call, n = calls[name], repeats[name]
                synchronize(device)
                start = time.perf_counter()
                for _ in range(n):
                    call()
                synchronize(device)
                samples[name].append((time.perf_counter() - start) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


@dataclass
class Summary:
    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        ordered = sorted(values)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))


# --- memory ----------------------------------------------------------------------------------------


def _output_bytes(outputs: Sequence[Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in outputs:
        if isinstance(t, Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _cpu_allocation_peak(call: Callable[[], Any]) -> tuple[int, Any]:
    """Peak of (bytes allocated - bytes freed) on PyTorch's CPU allocator during ``call``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        if event.device_type() != torch.autograd.DeviceType.CPU:
            continue
        live += event.nbytes()
        peak = max(peak, live)
    return peak, outputs


def peak_extra_bytes(call: Callable[[], Sequence[Tensor | None]], device: str) -> int:
    """Peak bytes allocated during one ``call`` beyond its inputs (made before) and its outputs.

    Run it after warm-up so that one-time allocations (compilation, caches) are not counted.
    """
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outputs = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak, outputs = _cpu_allocation_peak(call)
    extra = peak - _output_bytes(outputs)
    del outputs
    return max(0, extra)


# Fresh-process cross-check on Linux: glibc serves every block >= 64 KiB with mmap and unmaps it
# on free (fixed threshold, no trimming delay), so resident memory follows live memory, including
# what a kernel takes with plain malloc/std::vector outside PyTorch's allocator.
RSS_PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def rss_peak_extra_bytes(call: Callable[[], Sequence[Tensor | None]]) -> int:
    """Peak resident memory during one ``call`` beyond what was resident before it and its outputs.

    Resets the process's peak RSS (``/proc/self/clear_refs``, Linux >= 4.0) first. Meant for a fresh
    process started with ``RSS_PROBE_ENV``, after warm-up (see ``rss_probe_in_subprocess``).
    """
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _proc_status_bytes("VmRSS")
    outputs = call()
    peak = _proc_status_bytes("VmHWM")
    extra = peak - before - _output_bytes(outputs)
    del outputs
    return max(0, extra)


def _rss_probe(spec: dict[str, Any]) -> int:
    """Run in the child: build the case of ``spec``, warm the call up, measure it once."""
    torch.set_num_threads(spec["threads"])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    if spec["kind"] == "decode":
        shape = decode_shape_for(spec["size"], device)
        call = make_decode_call(
            spec["provider"], make_decode_case(shape, device, dtype, spec["seed"])
        )
    else:
        shape = next(s for s in shapes_for(spec["size"], device) if s.name == spec["shape"])
        case = make_case(shape, device, dtype, spec["seed"])
        call = make_call(spec["provider"], spec["mode"], case)
    warm_up(call, device)
    return rss_peak_extra_bytes(call)


def rss_probe_in_subprocess(spec: dict[str, Any], timeout_s: float = 900) -> int | None:
    """``rss_peak_extra_bytes`` of one (kind, provider, mode, shape) in a fresh Python process."""
    env = dict(os.environ, **RSS_PROBE_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.harness", "--rss-probe", json.dumps(spec)],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the repository root
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["rss_extra_bytes"]
    print(f"# RSS probe failed for {spec}: {proc.stderr[-2000:]}", file=sys.stderr)
    return None


# --- machine and versions --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if dirty else commit


class CoRunnerMeter:
    """Mean number of CPU cores that *other* processes kept busy between start and ``stop()``.

    Busy time of the whole machine from /proc/stat minus this process's own CPU time (and its
    children's, e.g. the --rss probes): on a 2-core machine anything near 1 means the timings shared
    the cores with someone else's work. None where /proc/stat is missing.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        import resource

        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / ticks  # all but idle and iowait
        own = sum(
            getattr(resource.getrusage(who), field)
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
            for field in ("ru_utime", "ru_stime")
        )
        return busy, own, time.monotonic()

    def stop(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start, strict=True))
        return round(max(0.0, busy - own) / wall, 2)


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: str) -> dict[str, Any]:
    """CPU model, cores, threads, GPU, versions, commit and date: the header of every result."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "fused_cpu": fused_unavailable_reason("cpu", torch.float32) or "available",
        # Other processes on the machine: a co-runner on a 2-core machine changes everything.
        "load_average_at_start": _load_average(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["fused_cuda"] = fused_unavailable_reason("cuda", torch.float32) or "available"
    return info


def benchmark_extra_info(
    *,
    provider: str,
    mode: str,
    device: str,
    dtype: torch.dtype,
    shape: Shape | DecodeShape,
    peak_extra: int | None,
) -> dict[str, Any]:
    """The ``extra_info`` of a pytest-benchmark entry (G tanh/s is added once timed)."""
    return {
        "provider": provider,
        "mode": mode,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "shape": asdict(shape),
        "tanh_count": shape.tanh_count,
        "tanh_work": shape.tanh_count * WORK_FACTOR.get(mode, 1),
        "peak_extra_bytes": peak_extra,
    }


def add_rate(extra_info: dict[str, Any], benchmark: Any) -> None:
    """Add G tanh/s from pytest-benchmark's median, when it timed (not under --benchmark-disable)."""
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    median = getattr(stats, "median", None)
    if median:
        extra_info["median_s"] = median
        extra_info["gtanh_per_s"] = extra_info["tanh_work"] / median / 1e9


# --- the report ------------------------------------------------------------------------------------


@dataclass
class ProviderResult:
    provider: str
    skipped: str | None = None
    times_s: list[float] = field(default_factory=list)
    summary: Summary | None = None
    gtanh_per_s: float | None = None
    peak_extra_bytes: int | None = None
    rss_extra_bytes: int | None = None


@dataclass
class GroupResult:
    """The providers of one (shape, mode), measured side by side."""

    kind: str  # "op" or "decode"
    shape: Shape | DecodeShape
    mode: str
    tanh_work: int
    providers: list[ProviderResult]
    speedups: dict[str, Summary] = field(default_factory=dict)  # "fused/eager": t_eager / t_fused


def _speedups(results: list[ProviderResult]) -> dict[str, Summary]:
    by_name = {r.provider: r for r in results if r.summary is not None}
    fused = by_name.get("fused")
    out = {}
    if fused is None:
        return out
    for other in ("eager", "compile"):
        if other in by_name:
            ratios = [t / f for t, f in zip(by_name[other].times_s, fused.times_s, strict=True)]
            out[f"fused/{other}"] = Summary.of(ratios)
    return out


def run_group(
    kind: str,
    shape: Shape | DecodeShape,
    mode: str,
    calls: dict[str, Callable[[], Any]],
    skipped: dict[str, str],
    device: str,
    rounds: int,
    min_sample_s: float,
    memory: bool,
    rss_probe: Callable[[str], int | None] | None = None,
) -> GroupResult:
    """Time ``calls`` interleaved, then measure each one's peak extra memory (and, with
    ``rss_probe(provider)``, its peak extra RSS in a fresh process)."""
    tanh_work = shape.tanh_count * WORK_FACTOR[mode]
    samples = time_interleaved(calls, device, rounds, min_sample_s) if calls else {}
    results = []
    for name in list(calls) + list(skipped):
        if name in skipped:
            results.append(ProviderResult(name, skipped=skipped[name]))
            continue
        summary = Summary.of(samples[name])
        peak = peak_extra_bytes(calls[name], device) if memory else None
        results.append(
            ProviderResult(
                name,
                times_s=samples[name],
                summary=summary,
                gtanh_per_s=tanh_work / summary.median / 1e9,
                peak_extra_bytes=peak,
                rss_extra_bytes=rss_probe(name) if rss_probe is not None else None,
            )
        )
    return GroupResult(kind, shape, mode, tanh_work, results, _speedups(results))


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"


def _fmt_ratio(s: Summary | None) -> str:
    if s is None:
        return "–"
    return f"{s.median:.2f}× ({s.q1:.2f}–{s.q3:.2f})"


def format_machine(info: dict[str, Any]) -> str:
    lines = [
        f"- date: {info['date_utc']}; commit: {info['commit'] or 'unknown'}",
        f"- CPU: {info['cpu']}; cores: {info['cpu_cores']} ({info['cpu_cores_usable']} usable); "
        f"torch threads: {info['torch_threads']}",
        f"- device: {info['device']}; GPU: {info['gpu'] or 'none'}",
        f"- python {info['python']}, torch {info['torch']}, triton {info['triton'] or 'not installed'}",
        f"- fused CPU kernel: {info['fused_cpu']}",
        f"- load average (1, 5, 15 min) at start: {info['load_average_at_start']}"
        + (f", at end: {info['load_average_at_end']}" if info.get("load_average_at_end") else ""),
    ]
    if info.get("other_processes_busy_cores") is not None:
        lines.append(
            f"- other processes kept {info['other_processes_busy_cores']} cores busy on average "
            "during the run (from /proc/stat minus this process)"
        )
    if "fused_cuda" in info:
        lines.append(f"- fused CUDA kernel: {info['fused_cuda']}")
    return "\n".join(lines)


def format_group(group: GroupResult) -> str:
    shape = group.shape
    with_rss = any(r.rss_extra_bytes is not None for r in group.providers)
    title = "additive_attention" if group.kind == "op" else "BahdanauAttention decoding loop"
    note = f" ({shape.note})" if shape.note else ""
    columns = ["provider", "median", "IQR", "min", "G tanh/s", "peak extra memory"]
    columns += ["peak extra RSS (fresh process)"] if with_rss else []
    columns += ["speedup of fused"]
    lines = [
        f"### {title} · {group.mode} · {shape.name}: {shape.label}{note}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
    ]
    notes = []
    for r in group.providers:
        if r.summary is None:
            lines.append(f"| {r.provider} | skipped¹ |" + " |" * (len(columns) - 2))
            notes.append(f"¹ {r.provider}: {r.skipped}")
            continue
        s = r.summary
        speedup = (
            "–" if r.provider == "fused" else _fmt_ratio(group.speedups.get(f"fused/{r.provider}"))
        )
        cells = [
            r.provider,
            _fmt_time(s.median),
            f"{_fmt_time(s.q1)}–{_fmt_time(s.q3)}",
            _fmt_time(s.min),
            f"{r.gtanh_per_s:.2f}",
            _fmt_bytes(r.peak_extra_bytes),
        ]
        cells += [_fmt_bytes(r.rss_extra_bytes)] if with_rss else []
        cells += [speedup]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def format_summary(groups: list[GroupResult]) -> str:
    lines = [
        "| what | shape | mode | fused/eager | fused/compile | fused G tanh/s | fused extra memory "
        "| eager extra memory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in groups:
        by_name = {r.provider: r for r in g.providers}
        fused, eager = by_name.get("fused"), by_name.get("eager")
        rate = f"{fused.gtanh_per_s:.2f}" if fused and fused.gtanh_per_s else "–"
        what = "op" if g.kind == "op" else "decode loop"
        lines.append(
            f"| {what} | {g.shape.name} | {g.mode} | {_fmt_ratio(g.speedups.get('fused/eager'))} "
            f"| {_fmt_ratio(g.speedups.get('fused/compile'))} | {rate} "
            f"| {_fmt_bytes(fused.peak_extra_bytes if fused else None)} "
            f"| {_fmt_bytes(eager.peak_extra_bytes if eager else None)} |"
        )
    return "\n".join(lines)


def format_report(info: dict[str, Any], config: dict[str, Any], groups: list[GroupResult]) -> str:
    parts = [
        "## additive attention benchmark",
        "",
        format_machine(info),
        f"- dtype {config['dtype']}; {config['rounds']} interleaved rounds per group, samples of "
        f"≥ {config['min_sample_s'] * 1e3:.0f} ms; size {config['size']}",
        "",
        "Speedups are medians of per-round ratios (time of the other provider / time of fused), "
        "with their IQR. G tanh/s counts N = B·Tq·Tk·H per forward and 3N per forward+backward "
        "(DESIGN.md's work model). Peak extra memory: bytes allocated during one call (after "
        "warm-up) beyond its inputs and outputs, from PyTorch's allocator (CPU: torch.profiler's "
        "allocation events; CUDA: max_memory_allocated). Peak extra RSS, where shown: the same "
        "call in a fresh process, resident-set peak over the resident set before it, minus outputs "
        "(glibc set to return every block >= 64 KiB to the OS on free).",
        "",
        "#### summary",
        "",
        format_summary(groups),
    ]
    for g in groups:
        parts += ["", format_group(g)]
    return "\n".join(parts) + "\n"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def report_json(info: dict[str, Any], config: dict[str, Any], groups: list[GroupResult]) -> dict:
    return {
        "machine": info,
        "config": config,
        "groups": [
            {
                "kind": g.kind,
                "shape": asdict(g.shape),
                "mode": g.mode,
                "tanh_count": g.shape.tanh_count,
                "tanh_work": g.tanh_work,
                "speedups": {k: asdict(v) for k, v in g.speedups.items()},
                "providers": [asdict(r) for r in g.providers],
            }
            for g in groups
        ],
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.harness",
        description="Time and memory of the fused additive attention against the eager reference "
        "and torch.compile of it, side by side; prints markdown tables.",
    )
    parser.add_argument(
        "--device", default=default_device(), help="cpu or cuda (default: %(default)s)"
    )
    parser.add_argument("--dtype", default="float32", help="float32, float64, float16, bfloat16")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and two shapes")
    parser.add_argument(
        "--size", choices=SIZES, default=None, help=f"shape set (default: ${SIZE_ENV} or full)"
    )
    parser.add_argument("--providers", default=",".join(default_providers()))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per group")
    parser.add_argument("--min-sample-ms", type=float, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding-loop table")
    parser.add_argument(
        "--rss",
        action="store_true",
        help="CPU: also measure peak extra RSS of each provider in a fresh process (slower)",
    )
    parser.add_argument("--rss-probe", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report; returns a process exit status. ``argv`` excludes the program name."""
    args = _parse_args(argv)
    if args.rss_probe:  # the child of rss_probe_in_subprocess
        print(json.dumps({"rss_extra_bytes": _rss_probe(json.loads(args.rss_probe))}))
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    dtype = getattr(torch, args.dtype)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype: not a torch dtype: {args.dtype}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    size = args.size or (default_size() if os.environ.get(SIZE_ENV) else None)
    size = size or ("quick" if args.quick else "full")
    rounds = args.rounds or (5 if args.quick else 15)
    min_sample_s = (
        args.min_sample_ms if args.min_sample_ms is not None else (20 if args.quick else 100)
    ) / 1e3
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for p in providers:
        if p not in PROVIDERS:
            raise SystemExit(f"--providers: unknown provider {p!r} (known: {', '.join(PROVIDERS)})")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    use_rss = args.rss and torch.device(device).type == "cpu" and not args.no_memory

    def rss_probe(kind: str, shape_name: str, mode: str) -> Callable[[str], int | None] | None:
        if not use_rss:
            return None
        base = {
            "kind": kind,
            "shape": shape_name,
            "mode": mode,
            "size": size,
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "seed": args.seed,
        }
        return lambda provider: rss_probe_in_subprocess(base | {"provider": provider})

    co_runners = CoRunnerMeter()
    info = machine_info(device)
    config = {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "rounds": rounds,
        "min_sample_s": min_sample_s,
        "providers": providers,
        "modes": modes,
        "seed": args.seed,
        "rss": use_rss,
    }
    groups: list[GroupResult] = []
    for shape in shapes_for(size, device):
        case = make_case(shape, device, dtype, args.seed)
        for mode in modes:
            calls, skipped = {}, {}
            for p in providers:
                reason = provider_unavailable_reason(p, device, dtype)
                if reason is None:
                    calls[p] = make_call(p, mode, case)
                else:
                    skipped[p] = reason
            print(f"# {shape.name} {mode} ...", file=sys.stderr, flush=True)
            groups.append(
                run_group(
                    "op",
                    shape,
                    mode,
                    calls,
                    skipped,
                    device,
                    rounds,
                    min_sample_s,
                    not args.no_memory,
                    rss_probe("op", shape.name, mode),
                )
            )
        del case
    if not args.no_decode:
        dshape = decode_shape_for(size, device)
        dcase = make_decode_case(dshape, device, dtype, args.seed)
        calls, skipped = {}, {}
        for p in DECODE_PROVIDERS:
            if p not in providers:
                continue
            reason = provider_unavailable_reason(p, device, dtype)
            if reason is None:
                calls[p] = make_decode_call(p, dcase)
            else:
                skipped[p] = reason
        print(f"# {dshape.name} decode loop ...", file=sys.stderr, flush=True)
        groups.append(
            run_group(
                "decode", dshape, "forward", calls, skipped, device, rounds, min_sample_s,
                not args.no_memory, rss_probe("decode", dshape.name, "forward"),
            )
        )  # fmt: skip
    info["load_average_at_end"] = _load_average()
    info["other_processes_busy_cores"] = co_runners.stop()
    print(format_report(info, config, groups), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report_json(info, config, groups), f, indent=2, default=_json_default)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
