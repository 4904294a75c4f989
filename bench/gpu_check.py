"""One prepared GPU check of the Triton kernels, built to come back with a table whatever happens.

Run it through ``bench/gpu_check.sh`` (it builds the package view that an editable install gives,
without the C++ extension, and tees the log into $OUT). Stages, in order, each guarded (an
exception is recorded and the next stage runs), within ``--budget-s``:

  1. environment: device, versions, date
  2. copy bandwidth: a device-to-device copy, bytes read + written per second (the decode ceiling)
  3. probes: max error of each tanh path against float64; an int64-offset check with keys past
     2^31 elements
  4. benchmark rows, most valuable first (bench/shapes.py's FULL_SHAPES; Dv as there): per
     (shape, dtype, mode) a correctness gate (fp32 against float64; bf16 within 2x the error of
     PyTorch's own bf16 against float64; at a batch slice, forward and backward), then fused vs
     eager vs torch.compile of the reference timed side by side (bench/timing.py), the fused
     op's kernel time (CUDA graph replay) and host launch time apart, peak memory
  5. a tile sweep of the fused forward over the cost model's best candidates (tiles.rank_forward)
  6. the CUDA tests (pytest tests/ops/test_triton.py), capped by what is left of the budget
  7. the summary table and the GPU targets (gpu_targets.py), met / MISSED / unmeasured, last

gpu_check.json and gpu_check_summary.txt are rewritten after every row and stage, so a run
killed at its time limit still leaves them. ``--dry-run`` runs the same stages on tiny shapes on
the CPU under TRITON_INTERPRET=1 (numbers meaningless; it proves the check itself);
``--inject-failure STAGE`` makes a stage raise, to test the guards.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

if __package__ in (None, ""):  # run as a script: bench/ is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gpu_targets  # noqa: E402
from bench.shapes import FULL_SHAPES, TINY_SHAPES, Shape  # noqa: E402
from bench.timing import Summary, time_interleaved  # noqa: E402

STAGES = ("env", "bandwidth", "probes", "benchmark", "launch", "sweep", "tests")
DEFAULT_STAGES = ("bandwidth", "probes", "benchmark", "sweep", "tests")
CHECK_BATCH = 16  # batch slice of the correctness gate (the kernels treat batch rows alike)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def log(*parts: object) -> None:
    print(*parts, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, interpreter")
    parser.add_argument("--budget-s", type=float, default=450.0, help="no new work after this")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument(
        "--stages",
        help="comma-separated stages after env, run in this order (default: "
        + ",".join(DEFAULT_STAGES)
        + "; 'launch' times the public op's host overhead)",
    )
    parser.add_argument(
        "--wide-sweep",
        action="store_true",
        help="sweep every forward tile candidate (block_q up to 32) and every grad-kernel tile, "
        "the data to refit tiles.py from, instead of the best few",
    )
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--max-rows", type=int, default=None, help="stop after this many rows")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or None)
    parser.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        choices=STAGES + ("row",),
        help="make this stage (or every benchmark row) raise: tests the guards",
    )
    return parser.parse_args(argv)


# --- the report: rewritten after every row ---------------------------------------------------------


class Check:
    """Arguments, budget, the JSON report and its files; ``write`` after every piece of work."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.budget = Budget(args.budget_s)
        self.device = "cpu" if args.dry_run else "cuda"
        self.report: dict = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "stages": {},
            "rows": [],
            "sweep": [],
            "dry_run": bool(args.dry_run),
        }

    def summary(self) -> list[str]:
        return gpu_targets.summary_lines(self.report)

    def write(self) -> None:
        if not self.args.out_dir:
            return
        os.makedirs(self.args.out_dir, exist_ok=True)
        for name, text in (
            ("gpu_check.json", json.dumps(self.report, indent=1, default=str)),
            ("gpu_check_summary.txt", "\n".join(self.summary()) + "\n"),
        ):
            path = os.path.join(self.args.out_dir, name)
            with open(path + ".tmp", "w") as handle:
                handle.write(text)
            os.replace(path + ".tmp", path)

    def maybe_fail(self, name: str) -> None:
        """Raise if ``--inject-failure name`` was given (tests of the guards)."""
        if name in self.args.inject_failure:
            raise RuntimeError(f"injected failure in {name!r}")

    @contextlib.contextmanager
    def guard(self, record: dict, key: str):
        """One item of a stage: its failure is recorded under ``key`` and the stage goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            record[key] = {"status": f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"}
            log(f"   {key}: {record[key]['status']}")
        finally:
            self.write()

    @contextlib.contextmanager
    def stage(self, name: str, min_left_s: float = 0.0):
        """Run a stage: its exception is logged and recorded, never raised; the report is written."""
        record = self.report["stages"].setdefault(name, {})
        log(f"\n== {name} ({self.budget.left():.0f} s of budget left)")
        start = time.monotonic()
        try:
            if self.budget.left() < min_left_s:
                record["status"] = "skipped: time budget"
                yield None
                return
            yield record
            record.setdefault("status", "done")
        except Exception as exc:  # noqa: BLE001 - the point: nothing stops the next stage
            record["status"] = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
            log(traceback.format_exc()[-3000:])
        finally:
            record["seconds"] = round(time.monotonic() - start, 1)
            log(f"   {name}: {record.get('status')}")
            self.write()


# --- stages 1-3: environment, copy bandwidth, probes -----------------------------------------------


def stage_env(check: Check, record: dict, torch, triton) -> None:
    import seq2seq_fast.ops._library as ops
    from seq2seq_fast._triton import additive_attention as tk

    record["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "numpy": _version("numpy"),
        "commit": _git_commit(),
    }
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        record["device"] = props.name
        record["sms"] = props.multi_processor_count
        record["memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        record["device"] = platform.processor() or platform.machine()
    record["cuda_kernel_error"] = ops.CUDA_KERNEL_ERROR
    record["cpu_kernel_error"] = ops.CPU_KERNEL_ERROR
    record["interpreted"] = tk.is_interpreted()
    log(json.dumps(record))


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001
        return None


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or os.environ.get("GPU_CHECK_COMMIT")
    except Exception:  # noqa: BLE001
        return os.environ.get("GPU_CHECK_COMMIT")


def stage_bandwidth(check: Check, record: dict, torch) -> None:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 10)."""
    if check.device != "cuda":
        record["status"] = "skipped (CPU)"
        return
    src = torch.empty(2**29, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    seconds = sorted(times[2:])[len(times[2:]) // 2]
    record["copy_bytes_per_s"] = 2 * src.numel() * 4 / seconds
    log(f"   copy bandwidth {record['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    del src, dst
    torch.cuda.empty_cache()


def tanh_errors(tk, torch, device: str, mode: str) -> dict:
    """max abs / rel error of the kernels' tanh path ``mode`` against float64 torch.tanh."""
    count = 1 << 20 if device == "cuda" else 1 << 12
    x = torch.cat([torch.linspace(-12, 12, count), torch.logspace(-10, 1, count // 4)])
    x = torch.cat([x, -x]).to(device)
    y = tk.tanh_probe(x, mode)
    exact = torch.tanh(x.double())
    err = (y.double() - exact).abs()
    rel = (err / exact.abs().clamp_min(1e-300)).max().item()
    ran_as = tk.resolve_tanh(mode, torch.float32, x.device)  # the interpreter has no PTX paths
    return {
        "max_abs": err.max().item(),
        "max_rel": rel,
        "log2_rel": math.log2(max(rel, 1e-300)),
        "ran_as": ran_as,
    }


def stage_probes(check: Check, record: dict, torch, tk) -> None:
    for mode in ("exp", "product", "approx", "packed"):
        with check.guard(record, f"tanh_{mode}"):
            record[f"tanh_{mode}"] = tanh_errors(tk, torch, check.device, mode)
            log(f"   tanh {mode}: {record[f'tanh_{mode}']}")
    with check.guard(record, "int64_offsets"):
        sizes = {"num_keys": 300, "hidden": 64} if check.args.dry_run else {}
        record["int64_offsets"] = gpu_targets.int64_offset_check(tk, torch, check.device, **sizes)
        log("   int64 offsets:", json.dumps(record["int64_offsets"]))


# --- stage 4: benchmark rows -----------------------------------------------------------------------


def make_inputs(torch, shape: Shape, dtype, device: str, seed: int = 0, batch: int | None = None):
    """query, keys, values, v, bias of ``shape`` (batch cut to ``batch``), random, never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b = shape.batch if batch is None else min(batch, shape.batch)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen) * scale).to(dtype)

    return (
        randn(b, shape.q_len, shape.hidden, scale=0.5),
        randn(b, shape.k_len, shape.hidden, scale=0.5),
        randn(b, shape.k_len, shape.value_dim),
        randn(shape.hidden, scale=shape.hidden**-0.5),
        randn(shape.hidden, scale=0.1),
    )


def fused_attention(check: Check, torch, tk):
    """(q, k, vals, v, b) -> (context, weights) through the op (CUDA) or the launchers (dry run)."""
    if check.device == "cuda":
        import seq2seq_fast

        return lambda q, k, x, v, b: seq2seq_fast.additive_attention(q, k, x, v, b)
    from seq2seq_fast.ops.additive_attention import attention_function

    function = attention_function(tk.additive_attention_fwd, tk.additive_attention_bwd)

    def fused(q, k, x, v, b):
        context, weights, _ = function.apply(q, k, x, v, b, None, None, True)
        return context, weights

    return fused


def make_call(torch, attention, inputs, mode: str):
    """A no-argument call of ``attention`` in ``mode``; forward+backward sets the leaves' grads."""
    if mode == "forward":

        def forward():
            with torch.no_grad():
                return attention(*inputs)

        return forward
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    gen = torch.Generator(device=inputs[0].device).manual_seed(7)
    batch, num_queries = inputs[0].shape[:2]
    grad_context = torch.randn(
        batch, num_queries, inputs[2].shape[2], device=inputs[0].device, generator=gen
    ).to(inputs[0].dtype)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        context, _ = attention(*leaves)
        context.backward(grad_context)
        return context

    return forward_backward


def run_row(check: Check, torch, tk, providers: dict, shape: Shape, dtype_name: str, mode: str):
    """One benchmark row: correctness gate, then the providers timed side by side."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    row = {
        "shape": shape.name,
        "dims": [shape.batch, shape.q_len, shape.k_len, shape.hidden, shape.value_dim],
        "dtype": dtype_name,
        "mode": mode,
    }
    check.report["rows"].append(row)
    try:
        check.maybe_fail("row")
        row["correct"] = gpu_targets.correctness(
            torch, providers["fused"], make_inputs, shape, dtype, mode, check.device, CHECK_BATCH
        )
        log(
            f"   {shape.name} {dtype_name} {mode}: correct={row['correct']['ok']} "
            f"{row['correct']['worst']}"
        )
        check.write()
        time_row(check, torch, providers, shape, dtype, mode, row)
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(traceback.format_exc()[-2000:])
    finally:
        gc.collect()
        if check.device == "cuda":
            torch.cuda.empty_cache()
        log("   " + gpu_targets.row_line(row, check.report))
        check.write()


def time_row(check: Check, torch, providers: dict, shape: Shape, dtype, mode: str, row: dict):
    inputs = make_inputs(torch, shape, dtype, check.device)
    calls = {}
    for name, attention in providers.items():
        if name == "compile" and check.budget.left() < 75:
            row[name] = {"error": "skipped: time budget"}
            continue
        try:
            call = make_call(torch, attention, inputs, mode)
            start = time.monotonic()
            call()  # compiles (Triton, inductor) outside the timing
            _sync(torch, check.device)
            row[name] = {"first_s": round(time.monotonic() - start, 2)}
            row[name]["peak_mib"] = peak_mib(torch, call, check.device)
            calls[name] = call
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the others still run
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    rounds, sample_s = (1, 0.0) if check.args.dry_run else (9, 0.04)
    samples = time_interleaved(
        calls,
        check.device,
        rounds=rounds,
        min_sample_s=sample_s,
        warmup=1 if check.args.dry_run else 2,
    )
    for name, sample in samples.items():
        wall = Summary.of(sample.wall_s)
        row[name].update(ms=wall.median * 1e3, q1=wall.q1 * 1e3, q3=wall.q3 * 1e3)
    if "fused" in calls:
        row["fused"].update(kernel_and_launch_ms(torch, calls["fused"], check.device))
    del inputs, calls


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mib(torch, call, device: str) -> float | None:
    """Peak bytes allocated during one call above what was allocated before it (MiB)."""
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_and_launch_ms(torch, call, device: str) -> dict:
    """kernel_ms: device time per call, replayed from a CUDA graph (no launch gaps);
    launch_ms: host time to enqueue one call with the device busy (the launcher's overhead)."""
    if device != "cuda":
        return {}
    out: dict = {}
    torch.cuda.synchronize()
    busy = torch.empty(2**27, device="cuda")
    busy.uniform_()  # queue work ahead so that the enqueues below do not wait for the device
    start = time.perf_counter()
    for _ in range(20):
        call()
    out["launch_ms"] = (time.perf_counter() - start) / 20 * 1e3
    torch.cuda.synchronize()
    del busy
    try:
        import triton.testing

        out["kernel_ms"] = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - e.g. an op that cannot be captured
        out["kernel_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        torch.cuda.synchronize()
    return out


PRIORITY = ("gnmt-train", "long-both", "decode-step")  # the shapes the GPU targets name


def row_plan(shapes: list[Shape], dry_run: bool) -> list[tuple[Shape, str, str, bool]]:
    """(shape, dtype, mode, with torch.compile), most valuable first: the targets' rows (forward
    of the PRIORITY shapes, bf16 then fp32; then their training forward+backward), then the other
    shapes' forwards, then the rest without torch.compile (its inductor compilation costs tens of
    seconds a row, which the budget cannot pay for every row)."""
    first = [s for s in shapes if s.name in PRIORITY or dry_run]
    first.sort(key=lambda s: PRIORITY.index(s.name) if s.name in PRIORITY else 0)
    rest = [s for s in shapes if s not in first]
    plan = [(s, d, "forward", True) for d in ("bf16", "fp32") for s in first]
    plan += [
        (s, d, "forward+backward", True) for d in ("bf16", "fp32") for s in first if s.q_len > 1
    ]
    plan += [(s, d, "forward", True) for d in ("bf16", "fp32") for s in rest]
    plan += [
        (s, d, "forward+backward", dry_run)
        for d in ("bf16", "fp32")
        for s in shapes
        if s.q_len == 1 or s in rest
    ]
    return plan


def stage_benchmark(check: Check, record: dict, torch, tk) -> None:
    from seq2seq_fast.reference import additive_attention_ref

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)

    def eager(q, k, x, v, b):
        return additive_attention_ref(q, k, x, v, b)

    backend = "eager" if check.args.dry_run else "inductor"  # no minutes of CPU compilation
    providers = {
        "fused": fused_attention(check, torch, tk),
        "eager": eager,
        "compile": torch.compile(additive_attention_ref, dynamic=False, backend=backend),
    }
    plan = row_plan(selected_shapes(check), check.args.dry_run)[: check.args.max_rows]
    for shape, dtype_name, mode, with_compile in plan:
        if check.budget.left() < 25:
            record["status"] = "partial: time budget"
            break
        chosen = (
            providers if with_compile else {k: v for k, v in providers.items() if k != "compile"}
        )
        run_row(check, torch, tk, chosen, shape, dtype_name, mode)


def selected_shapes(check: Check) -> list[Shape]:
    shapes = list(TINY_SHAPES if check.args.dry_run else FULL_SHAPES)
    if check.args.shapes:
        wanted = check.args.shapes.split(",")
        shapes = [s for s in shapes if s.name in wanted]
    return shapes


# --- stages 5-6: tile sweep, tests -----------------------------------------------------------------


def stage_launch(check: Check, record: dict, torch, tk) -> None:
    """The host cost on the smallest shape (where it matters most): launch_ms is the time to
    enqueue one call with the device busy, kernel_ms the device time (graph replay); through the
    public op, and the forward launcher alone (Triton's own launch cost)."""
    import seq2seq_fast

    shapes = TINY_SHAPES if check.args.dry_run else FULL_SHAPES
    shape = next((s for s in shapes if s.name == "small-train"), shapes[0])
    record["shape"] = shape.name
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        inputs = make_inputs(torch, shape, dtype, check.device)
        calls = {
            mode: make_call(torch, seq2seq_fast.additive_attention, inputs, mode)
            for mode in ("forward", "forward+backward")
        }
        calls["launcher forward"] = lambda x=inputs: tk.additive_attention_fwd(*x, None, None, True)
        for what, call in calls.items():
            entry = {
                "ms": sweep_one(check, call),
                **kernel_and_launch_ms(torch, call, check.device),
            }
            record[f"{dtype_name} {what}"] = entry
            numbers = ", ".join(f"{k} {v:.3f}" for k, v in entry.items() if isinstance(v, float))
            log(f"   launch {shape.name} {dtype_name} {what}: {numbers}")


def _fwd_tile_items(tk, shape: Shape, dtype_name: str, ranked: list) -> list:
    """Sweep items timing the forward launcher at each (tile, cost) of ``ranked``."""
    return [
        (shape, dtype_name, "fwd tiles", _label(cfg), cost,
         lambda x, cfg=cfg: tk.additive_attention_fwd(*x, None, None, True, config=cfg))
        for cfg, cost in ranked
    ]  # fmt: skip


def _grad_tile_items(check: Check, tk, tiles, shape: Shape, dtype_name: str, dtype,
                     count: int | None) -> list:  # fmt: skip
    """Sweep items timing the whole backward under the grad kernel's best ``count`` tiles (all
    with None), the ds and grad-values tiles as the launcher picks them."""
    ds_cfg, _, dv_cfg = tiles.backward_configs(*_dims(shape), dtype=dtype, sms=_sms(check))
    ranked = tiles.rank_grad(*_dims(shape)[:4], dtype=dtype, sms=_sms(check))[:count]
    return [
        (shape, dtype_name, "bwd grad tiles", _label(cfg), cost,
         _backward_factory(tk, (ds_cfg, cfg, dv_cfg)))
        for cfg, cost in ranked
    ]  # fmt: skip


def _wide_sweep_items(check: Check, tk, tiles, dtypes: dict, shapes: list) -> list:
    """Shape by shape: every forward candidate (block_q up to 32), then, for the first two
    training shapes, every grad-kernel tile: the data a refit of tiles.py's constants needs."""
    items = []
    training = [s for s in shapes if s.q_len > 1][:2]
    for shape in shapes:
        for dtype_name, dtype in dtypes.items():
            ranked = tiles.rank_forward(*_dims(shape), dtype=dtype, sms=_sms(check), max_q=32)
            items += _fwd_tile_items(tk, shape, dtype_name, ranked)
        if shape in training:
            for dtype_name, dtype in dtypes.items():
                items += _grad_tile_items(check, tk, tiles, shape, dtype_name, dtype, None)
    return items


def stage_sweep(check: Check, record: dict, torch, tk) -> None:
    """Tuning data, most valuable first: the tanh paths, the forward's best tile of each block_q
    (tiles.sweep_forward), the backward under the grad kernel's best three tiles."""
    from seq2seq_fast._triton import tiles

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    shapes = sorted(selected_shapes(check), key=lambda s: s.name not in PRIORITY)
    if check.args.wide_sweep:
        items = _wide_sweep_items(check, tk, tiles, dtypes, shapes)
        run_sweep_items(check, record, torch, dtypes, items)
        return
    items = []  # (shape, dtype name, what, label, cost, call factory)
    for shape in shapes[:2] if not check.args.dry_run else shapes:
        for dtype_name, modes in (("bf16", ("approx", "packed")), ("fp32", ("product", "exp"))):
            for mode in modes:
                items.append(
                    (
                        shape,
                        dtype_name,
                        "tanh",
                        mode,
                        None,
                        lambda x, mode=mode: tk.additive_attention_fwd(
                            *x, None, None, True, tanh=mode
                        ),
                    )
                )
    for shape in shapes:
        for dtype_name, dtype in dtypes.items():
            ranked = tiles.sweep_forward(*_dims(shape), dtype=dtype, sms=_sms(check))
            items += _fwd_tile_items(tk, shape, dtype_name, ranked)
    for shape in [s for s in shapes if s.q_len > 1][:2]:
        for dtype_name, dtype in dtypes.items():
            items += _grad_tile_items(check, tk, tiles, shape, dtype_name, dtype, 3)
    run_sweep_items(check, record, torch, dtypes, items)


def _dims(shape: Shape) -> tuple[int, int, int, int, int]:
    return shape.batch, shape.q_len, shape.k_len, shape.hidden, shape.value_dim


def _label(cfg) -> str:
    return f"{cfg.block_q}x{cfg.block_k}x{cfg.block_h} w{cfg.num_warps}"


def _backward_factory(tk, configs):
    cache: dict = {}  # one forward per input set, reused by the timings

    def call(inputs):
        if cache.get("inputs") is not inputs:
            context, _, lse = tk.additive_attention_fwd(*inputs, None, None, False)
            cache.update(inputs=inputs, saved=(context.clone().normal_(), lse, context))
        grad_context, lse, context = cache["saved"]
        return tk.additive_attention_bwd(
            grad_context, None, *inputs, None, None, context, lse, configs=configs
        )

    return call


def run_sweep_items(check: Check, record: dict, torch, dtypes: dict, items: list) -> None:
    inputs_key, inputs = None, None
    for shape, dtype_name, what, label, cost, factory in items:
        if check.budget.left() < 20:
            record["status"] = "partial: time budget"
            return
        if inputs_key != (shape.name, dtype_name):
            inputs_key, inputs = None, None
            gc.collect()
            inputs = make_inputs(torch, shape, dtypes[dtype_name], check.device)
            inputs_key = (shape.name, dtype_name)
        entry = {
            "shape": shape.name,
            "dtype": dtype_name,
            "what": what,
            "label": label,
            "cost": cost,
        }
        with check.guard(entry, "result"):
            entry["ms"] = sweep_one(check, lambda f=factory, x=inputs: f(x))
        check.report["sweep"].append(entry)
        log("   sweep " + gpu_targets.sweep_line(entry))


def sweep_one(check: Check, call) -> float:
    call()  # compiles outside the timing
    samples = time_interleaved(
        {"x": call},
        check.device,
        rounds=1 if check.args.dry_run else 7,
        min_sample_s=0.0 if check.args.dry_run else 0.03,
        warmup=1,
    )
    return Summary.of(samples["x"].wall_s).median * 1e3


def _sms(check: Check) -> int:
    return check.report["stages"].get("env", {}).get("sms") or 132


def stage_tests(check: Check, record: dict) -> None:
    if importlib.util.find_spec("pytest") is None:
        record["status"] = "skipped: no pytest"
        return
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "tests/ops/test_triton.py",
        "--tb=short",
        "--show-capture=no",  # the captured logs (torch.compile's DEBUG lines) hid the failures
        "-rfE",
    ]
    if check.args.dry_run:  # the interpreter is slow: one test proves the invocation
        cmd += ["-k", "test_fp32_matches_reference and 2x3x5x7x4"]
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # Triton and inductor compilation dominate: spread it over the cores
    timeout = max(10.0, check.budget.left() - 10)
    log("$", " ".join(cmd[2:]), f"(timeout {timeout:.0f} s)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        record["status"] = f"timeout after {timeout:.0f} s (budget)"
        return
    output = (proc.stdout + proc.stderr).strip()
    if check.args.out_dir:
        with open(os.path.join(check.args.out_dir, "gpu_check_tests.log"), "w") as handle:
            handle.write(output + "\n")
    log(output[-6000:])
    record["summary"] = output.splitlines()[-1] if output else ""
    record["status"] = "passed" if proc.returncode == 0 else f"FAILED (rc={proc.returncode})"


# --- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / seq2seq_fast import
    check = Check(args)
    import torch
    import triton

    if check.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run on a CPU machine")
        return 2
    tk = None
    with check.stage("env") as record:
        check.maybe_fail("env")
        from seq2seq_fast._triton import additive_attention as tk

        stage_env(check, record, torch, triton)
    stages = {
        "bandwidth": (0, lambda rec: stage_bandwidth(check, rec, torch)),
        "probes": (30, lambda rec: stage_probes(check, rec, torch, tk)),
        "benchmark": (30, lambda rec: stage_benchmark(check, rec, torch, tk)),
        "launch": (20, lambda rec: stage_launch(check, rec, torch, tk)),
        "sweep": (40, lambda rec: stage_sweep(check, rec, torch, tk)),
        "tests": (60, lambda rec: stage_tests(check, rec)),
    }
    order = args.stages.split(",") if args.stages else list(DEFAULT_STAGES)
    unknown = [name for name in order if name not in stages]
    if unknown:
        log(f"--stages: unknown {', '.join(unknown)} (known: {', '.join(stages)})")
        return 2
    for name in order:
        min_left, run = stages[name]
        if (name == "sweep" and args.no_sweep) or (name == "tests" and args.skip_tests):
            check.report["stages"][name] = {"status": "skipped: by argument"}
            continue
        with check.stage(name, min_left) as record:
            if record is not None:
                check.maybe_fail(name)
                run(record)
    check.write()
    log("\n== summary")
    for line in check.summary():
        log(line)
    return 1 if gpu_targets.any_failure(check.report) else 0


if __name__ == "__main__":
    sys.exit(main())
