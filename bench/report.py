"""The report of ``python -m bench.harness``: machine header, results, markdown tables, JSON.

Every result carries the date, the commit, the CPU/GPU, the thread count, the versions and how busy
the machine was (load average, and the cores other processes kept busy during the run): on a small
shared machine a co-runner changes everything, so read ratios measured side by side, not times.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.shapes import WORK_FACTOR, DecodeShape, Shape
from bench.timing import Summary, ratio_summary
from seq2seq_fast.ops import fused_unavailable_reason

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


def load_average() -> list[float] | None:
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
        "load_average_at_start": load_average(),
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


# --- results ----------------------------------------------------------------------------------------


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


def speedups(results: list[ProviderResult]) -> dict[str, Summary]:
    by_name = {r.provider: r for r in results if r.summary is not None}
    fused = by_name.get("fused")
    out = {}
    if fused is None:
        return out
    for other in ("eager", "compile"):
        if other in by_name:
            out[f"fused/{other}"] = ratio_summary(by_name[other].times_s, fused.times_s)
    return out


# --- tables and JSON ------------------------------------------------------------------------------


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
        f"≥ {config['min_sample_s'] * 1e3:.0f} ms; size {config['size']}; "
        f"clock: {config.get('clock', 'wall')}",
        "",
        "Speedups are medians of per-round ratios (time of the other provider / time of fused), "
        "with their IQR. G tanh/s counts N = B·Tq·Tk·H per forward and 3N per forward+backward "
        "(the backward recomputes the tanh and does as much again). Peak extra memory: bytes allocated during one call (after "
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


def json_default(obj: Any) -> Any:
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
