"""The op benchmark report: fused vs eager reference vs torch.compile, side by side.

    python -m bench.harness [--device cuda] [--quick] [--threads N] [--json PATH] [--rss]

The shapes come from ``bench/shapes.py`` and the timer from ``bench/timing.py``, the same ones the
pytest-benchmark files (``pytest bench/ --benchmark-only``) and the GPU check use; the inputs,
providers and memory measurement below are shared with the pytest-benchmark files too.

Providers:
    fused    ``seq2seq_fast.additive_attention`` (C++ kernel on CPU, Triton on CUDA)
    eager    ``additive_attention_ref``, the plain PyTorch reference the tests use
    compile  ``torch.compile(additive_attention_ref, dynamic=False)``, compiled and warmed up
             before anything is timed

Modes:
    forward           one call under ``torch.no_grad()`` (inference)
    forward+backward  one call on inputs that require grad, then ``context.backward(grad)``

Memory: the peak of the bytes allocated during one call (after warm-up), minus the bytes of what
the call returns (context, weights and, in forward+backward, the gradients): "extra" memory
beyond inputs and outputs. On CUDA it is ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``; on CPU it is the running sum of the allocations and frees that
``torch.profiler`` records from PyTorch's CPU allocator (``profile_memory=True``). Memory that a
kernel takes with plain ``malloc`` outside PyTorch's allocator is not seen there; ``--rss`` adds a
cross-check that sees it: the resident-set peak of the same call in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from bench.report import (
    CoRunnerMeter,
    GroupResult,
    ProviderResult,
    format_report,
    json_default,
    load_average,
    machine_info,
    report_json,
    speedups,
)
from bench.shapes import (
    MODES,
    PROVIDERS,
    SIZE_ENV,
    SIZES,
    WORK_FACTOR,
    DecodeShape,
    Shape,
    decode_shape_for,
    default_device,
    default_providers,
    default_size,
    shapes_for,
)
from bench.timing import Summary, time_interleaved, warm_up
from seq2seq_fast.ops import fused_unavailable_reason
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.reference import additive_attention_ref

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
    module = BahdanauAttention(shape.hidden, shape.value_dim, shape.hidden, weight_norm=True)
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

    ``BahdanauAttention(weight_norm=True)`` with ``backend="fused"`` or ``"reference"``, under
    ``torch.no_grad()``. The keys are projected here, outside the timed region (once per source
    batch, the same work for both providers); each timed step projects its query and attends.
    """
    from seq2seq_fast.nn.attention import BahdanauAttention

    shape = case.shape
    module = BahdanauAttention(
        shape.hidden,
        shape.value_dim,
        shape.hidden,
        weight_norm=True,
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


# --- running groups --------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """What one report run measures, and how."""

    size: str
    device: str
    dtype: torch.dtype
    rounds: int
    min_sample_s: float
    providers: list[str]
    modes: list[str]
    seed: int
    memory: bool
    rss: bool
    # "wall", or "cpu": this process's CPU time per call (robust to co-runners at 1 thread)
    clock: str = "wall"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out


RSSProbe = Callable[[str], "int | None"]


def run_group(
    kind: str,
    shape: Shape | DecodeShape,
    mode: str,
    calls: dict[str, Callable[[], Any]],
    skipped: dict[str, str],
    cfg: RunConfig,
    rss_probe: RSSProbe | None = None,
) -> GroupResult:
    """Time ``calls`` interleaved, then measure each one's peak extra memory (and, with
    ``rss_probe(provider)``, its peak extra RSS in a fresh process)."""
    tanh_work = shape.tanh_count * WORK_FACTOR[mode]
    samples = time_interleaved(calls, cfg.device, cfg.rounds, cfg.min_sample_s) if calls else {}
    results = []
    for name in list(calls) + list(skipped):
        if name in skipped:
            results.append(ProviderResult(name, skipped=skipped[name]))
            continue
        times = samples[name].cpu_s if cfg.clock == "cpu" else samples[name].wall_s
        summary = Summary.of(times)
        results.append(
            ProviderResult(
                name,
                times_s=times,
                summary=summary,
                gtanh_per_s=tanh_work / summary.median / 1e9,
                peak_extra_bytes=peak_extra_bytes(calls[name], cfg.device) if cfg.memory else None,
                rss_extra_bytes=rss_probe(name) if rss_probe is not None else None,
            )
        )
    return GroupResult(kind, shape, mode, tanh_work, results, speedups(results))


def _rss_probe_for(cfg: RunConfig, kind: str, shape_name: str, mode: str) -> RSSProbe | None:
    if not cfg.rss:
        return None
    base = {
        "kind": kind,
        "shape": shape_name,
        "mode": mode,
        "size": cfg.size,
        "device": cfg.device,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "seed": cfg.seed,
    }
    return lambda provider: rss_probe_in_subprocess(base | {"provider": provider})


def _split_available(
    providers: Sequence[str], cfg: RunConfig, make: Callable[[str], Callable[[], Any]]
) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    calls, skipped = {}, {}
    for p in providers:
        reason = provider_unavailable_reason(p, cfg.device, cfg.dtype)
        if reason is None:
            calls[p] = make(p)
        else:
            skipped[p] = reason
    return calls, skipped


def run_op_groups(cfg: RunConfig) -> list[GroupResult]:
    """One group per (shape, mode) of ``shapes_for(cfg.size, cfg.device)``."""
    groups = []
    for shape in shapes_for(cfg.size, cfg.device):
        case = make_case(shape, cfg.device, cfg.dtype, cfg.seed)
        for mode in cfg.modes:
            calls, skipped = _split_available(
                cfg.providers, cfg, lambda p, mode=mode, case=case: make_call(p, mode, case)
            )
            print(f"# {shape.name} {mode} ...", file=sys.stderr, flush=True)
            probe = _rss_probe_for(cfg, "op", shape.name, mode)
            groups.append(run_group("op", shape, mode, calls, skipped, cfg, probe))
        del case
    return groups


def run_decode_group(cfg: RunConfig) -> GroupResult:
    """The BahdanauAttention decoding loop of ``decode_shape_for(cfg.size, cfg.device)``."""
    shape = decode_shape_for(cfg.size, cfg.device)
    case = make_decode_case(shape, cfg.device, cfg.dtype, cfg.seed)
    providers = [p for p in DECODE_PROVIDERS if p in cfg.providers]
    calls, skipped = _split_available(providers, cfg, lambda p: make_decode_call(p, case))
    print(f"# {shape.name} decode loop ...", file=sys.stderr, flush=True)
    probe = _rss_probe_for(cfg, "decode", shape.name, "forward")
    return run_group("decode", shape, "forward", calls, skipped, cfg, probe)


# --- the command -----------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.harness",
        description="Time and memory of the fused additive attention against the eager reference "
        "and torch.compile of it, side by side; prints markdown tables.",
    )
    add = parser.add_argument
    add("--device", default=default_device(), help="cpu or cuda (default: %(default)s)")
    add("--dtype", default="float32", help="float32, float64, float16, bfloat16")
    add("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    add("--quick", action="store_true", help="fewer rounds and two shapes")
    add("--size", choices=SIZES, default=None, help=f"shape set (default: ${SIZE_ENV} or full)")
    add("--providers", default=",".join(default_providers()))
    add("--modes", default=",".join(MODES))
    add("--rounds", type=int, default=None, help="interleaved rounds per group")
    add("--min-sample-ms", type=float, default=None)
    add("--no-memory", action="store_true", help="skip the peak-memory measurement")
    add("--no-decode", action="store_true", help="skip the decoding-loop table")
    add(
        "--rss",
        action="store_true",
        help="CPU: also measure peak extra RSS of each provider in a fresh process (slower)",
    )
    add("--rss-probe", metavar="SPEC", help=argparse.SUPPRESS)
    add(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time by wall clock, or by this process's CPU time (with --threads 1 on a machine "
        "busy with other jobs; with more threads it also counts their spin-waiting)",
    )
    add("--seed", type=int, default=0)
    add("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def _names(text: str, known: Sequence[str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in known:
            raise SystemExit(f"{flag}: unknown name {n!r} (known: {', '.join(known)})")
    return names


def _run_config(args: argparse.Namespace) -> RunConfig:
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype: not a torch dtype: {args.dtype}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    size = args.size or (default_size() if os.environ.get(SIZE_ENV) else None)
    min_sample_ms = args.min_sample_ms
    if min_sample_ms is None:
        min_sample_ms = 20 if args.quick else 100
    return RunConfig(
        size=size or ("quick" if args.quick else "full"),
        device=args.device,
        dtype=dtype,
        rounds=args.rounds or (5 if args.quick else 15),
        min_sample_s=min_sample_ms / 1e3,
        providers=_names(args.providers, PROVIDERS, "--providers"),
        modes=_names(args.modes, MODES, "--modes"),
        seed=args.seed,
        memory=not args.no_memory,
        rss=args.rss and torch.device(args.device).type == "cpu" and not args.no_memory,
        clock=args.clock,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report; returns a process exit status. ``argv`` excludes the program name."""
    args = _parse_args(argv)
    if args.rss_probe:  # the child of rss_probe_in_subprocess
        print(json.dumps({"rss_extra_bytes": _rss_probe(json.loads(args.rss_probe))}))
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = _run_config(args)
    co_runners = CoRunnerMeter()
    info = machine_info(cfg.device)
    groups = run_op_groups(cfg)
    if not args.no_decode:
        groups.append(run_decode_group(cfg))
    info["load_average_at_end"] = load_average()
    info["other_processes_busy_cores"] = co_runners.stop()
    config = cfg.as_dict()
    print(format_report(info, config, groups), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report_json(info, config, groups), f, indent=2, default=json_default)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
