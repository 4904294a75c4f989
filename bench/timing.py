"""The one timer of the benchmarks: side by side in one process, interleaved round by round.

    samples = time_interleaved({"fused": f, "eager": g}, "cpu", rounds=15, min_sample_s=0.1)
    summary = Summary.of(samples["fused"].wall_s)             # median, quartiles, min, max
    speedup = ratio_summary(samples["eager"].wall_s, samples["fused"].wall_s)

Each callable is warmed up (compiles, autotunes, faults pages in), then every round times each of
them once, in an order that rotates every round, so a machine whose load changes slows them alike.
A sample repeats its call enough times to last ``min_sample_s`` (calibrated after warm-up) and
divides. On CUDA the device is synchronised around every sample. Garbage collection is off while
timing. Speedups are medians of per-round ratios, not ratios of medians.

Importing this module imports no torch; the CUDA synchronisation imports it when first needed.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _is_cuda(device: str) -> bool:
    return str(device).split(":")[0] == "cuda"


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize()


def synchronized(call: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``call`` followed by a device synchronisation, so an outside timer sees the whole of it."""
    if not _is_cuda(device):
        return call

    def run() -> Any:
        out = call()
        synchronize(device)
        return out

    return run


def warm_up(call: Callable[[], Any], device: str, times: int = 2) -> float:
    """Run ``call`` ``times`` times; return the duration of the last run in seconds."""
    elapsed = 0.0
    for _ in range(times):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        elapsed = time.perf_counter() - start
    return elapsed


@dataclass
class Samples:
    """What ``time_interleaved`` measured of one callable; times are seconds per call."""

    wall_s: list[float]  # one per round, wall clock
    cpu_s: list[float]  # one per round, CPU time of this process (all its threads)
    first_s: float  # the first call alone (compilation, autotuning)
    repeats: int  # calls per sample


@dataclass
class Summary:
    """Order statistics of a list of samples."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        ordered = sorted(values)
        if not ordered:
            raise ValueError("Summary.of: no values")
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))


def ratio_summary(numerator_s: Sequence[float], denominator_s: Sequence[float]) -> Summary:
    """Per-round ratios (e.g. eager time / fused time = the speedup of fused), summarised."""
    return Summary.of([n / d for n, d in zip(numerator_s, denominator_s, strict=True)])


def _calibrate(call: Callable[[], Any], device: str, warmup: int, min_sample_s: float):
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    first = time.perf_counter() - start
    one = warm_up(call, device, warmup - 1) if warmup > 1 else first
    return first, max(1, math.ceil(min_sample_s / max(one, 1e-9)))


def time_interleaved(
    calls: dict[str, Callable[[], Any]],
    device: str,
    rounds: int,
    min_sample_s: float = 0.0,
    warmup: int = 2,
) -> dict[str, Samples]:
    """Time ``calls`` side by side: ``rounds`` samples each, interleaved, order rotated.

    ``warmup`` (>= 1) untimed calls each first, the first of them reported as ``first_s``.
    ``min_sample_s=0`` times one call per sample.
    """
    if rounds < 1 or warmup < 1:
        raise ValueError(f"rounds and warmup must be >= 1, got {rounds} and {warmup}")
    names = list(calls)
    first, repeats = {}, {}
    for name in names:
        first[name], repeats[name] = _calibrate(calls[name], device, warmup, min_sample_s)
    out = {name: Samples([], [], first[name], repeats[name]) for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                call, n = calls[name], repeats[name]
                synchronize(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    call()
                synchronize(device)
                out[name].wall_s.append((time.perf_counter() - start) / n)
                out[name].cpu_s.append((time.process_time() - start_cpu) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out
