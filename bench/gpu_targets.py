"""The GPU check's judgements: correctness gates, the summary table and the GPU targets.

Pure functions of the report dict that ``bench/gpu_check.py`` builds (plus the correctness and
int64 checks, which take torch as an argument), so the summary can be rebuilt from a saved
gpu_check.json: ``python -m bench.gpu_targets OUT/gpu_check.json``.

Targets (H200), each reported line by line as met / MISSED / unmeasured:
    T1  training-shape forward, bf16: >= 2x torch.compile of the reference
    T2  training-shape forward, bf16: >= 50% of the tanh ceiling (TANH_CEILING)
    T3  training-shape forward, fp32: >= 1.5x torch.compile
    T4  training-shape forward+backward (bf16 and fp32): >= 2x torch.compile
    T5  decoding-step forward: keys + values read at >= 70% of the measured copy bandwidth
    T6  memory O(B*Tq*Tk): the fused op's peak extra memory <= 16 bytes per (query, key) pair
        plus twice its inputs and outputs (the [B,Tq,Tk,H] tensor would be >= 512 bytes a pair)
A row whose correctness gate failed counts as MISSED for every target, whatever its speed.
"""

from __future__ import annotations

import json
import math
import sys

from bench.shapes import WORK_FACTOR

TANH_CEILING = 4.2e12  # tanh.approx per second on an H200: 16/clk/SM x 132 SMs x ~1.98 GHz
COPY_BANDWIDTH = 4.3e12  # bytes/s read + written, measured on an H200 here (used if unmeasured)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# --- correctness -----------------------------------------------------------------------------------


def _outputs(torch, attention, inputs, mode: str, grad_context):
    """(context, weights[, 5 grads]) of ``attention`` on copies of ``inputs``."""
    leaves = [t.detach().clone().requires_grad_(mode != "forward") for t in inputs]
    with torch.set_grad_enabled(mode != "forward"):
        context, weights = attention(*leaves)
    if mode == "forward":
        return [context.detach(), weights.detach()]
    torch.autograd.backward([context], [grad_context.to(context.dtype)])
    return [context.detach(), weights.detach(), *(leaf.grad for leaf in leaves)]


def correctness(torch, fused, make_inputs, shape, dtype, mode: str, device: str, batch: int):
    """Fused against float64 at ``shape`` (batch cut to ``batch``): fp32 within 1e-4 of the
    largest reference value; bf16/fp16 within 2x the error of PyTorch's own reference in that
    dtype (+ 2 eps of the scale). Returns {"ok", "worst", "errors": {name: [error, allowed]}}."""
    from seq2seq_fast.reference import additive_attention_ref

    inputs = make_inputs(torch, shape, dtype, device, seed=1, batch=batch)
    gen = torch.Generator(device=device).manual_seed(3)
    grad_context = torch.randn(
        inputs[0].shape[0], shape.q_len, shape.value_dim, device=device, generator=gen
    )
    names = ["context", "weights"] + [f"grad_{n}" for n in ("query", "keys", "values", "v", "bias")]
    ours = _outputs(torch, fused, inputs, mode, grad_context)
    truth = _outputs(
        torch, additive_attention_ref, [t.double() for t in inputs], mode, grad_context
    )
    plain = None
    if dtype != torch.float32:
        plain = _outputs(torch, additive_attention_ref, inputs, mode, grad_context)
    errors, ok = {}, True
    for i, (name, out, ref) in enumerate(zip(names, ours, truth, strict=False)):
        scale = max(ref.abs().max().item(), 1e-30)
        error = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        if not math.isfinite(error):
            error = math.inf
        if plain is None:
            allowed = 1e-4 * max(scale, 1.0)
        else:
            eps = torch.finfo(dtype).eps
            allowed = 2 * (plain[i].double() - ref).abs().max().item() + 2 * eps * max(scale, 1.0)
        errors[name] = [error, allowed]
        ok = ok and error <= allowed
    worst = max(errors, key=lambda n: errors[n][0] / max(errors[n][1], 1e-300))
    return {
        "ok": ok,
        "worst": f"{worst} {errors[worst][0]:.2e} (allowed {errors[worst][1]:.2e})",
        "errors": errors,
        "batch": inputs[0].shape[0],
    }


def int64_offset_check(tk, torch, device: str, num_keys: int = (1 << 21) + 37, hidden: int = 1024):
    """Keys of more than 2^31 elements: the rows past 2^31 must be read and written correctly.

    keys[0, s, :] starts at element s * 1024, so the default rows >= 2^21 lie past 2^31. Small
    sizes (CPU, interpreter) check the arithmetic of this check itself.
    """
    value_dim = 8
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if free < 24 * 2**30:
            return {"status": f"skipped (only {free / 2**30:.0f} GiB free)"}
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    query = torch.randn(1, 1, hidden, device=device, generator=gen).to(dtype)
    keys = torch.randn(1, num_keys, hidden, device=device, generator=gen).to(dtype)
    values = torch.randn(1, num_keys, value_dim, device=device, generator=gen).to(dtype)
    v = (torch.randn(hidden, device=device, generator=gen) * 0.1).to(dtype)
    bias = torch.zeros(hidden, device=device, dtype=dtype)
    context, weights, lse = tk.additive_attention_fwd(
        query, keys, values, v, bias, None, None, True
    )
    scores = torch.empty(num_keys, device=device)  # float32 reference scores, in chunks
    qf, vf = query[0, 0].float(), v.float()
    for start in range(0, num_keys, 1 << 18):
        chunk = keys[0, start : start + (1 << 18)].float()
        scores[start : start + chunk.shape[0]] = torch.tanh(chunk + qf) @ vf
    ref_weights = torch.softmax(scores, dim=0)
    grad_context = torch.ones_like(context)
    grads = tk.additive_attention_bwd(
        grad_context, None, query, keys, values, v, bias, None, None, context, lse
    )
    tail = slice(num_keys - 64, num_keys)
    # d loss / d values[s] = p[s] * grad_context; d / d keys[s] = ds[s] * v * (1 - u^2).
    dp = values[0, tail].float() @ grad_context[0, 0].float()
    delta = (ref_weights * (values[0].float() @ grad_context[0, 0].float())).sum()
    u = torch.tanh(keys[0, tail].float() + qf)
    pairs = {  # (actual, expected): bf16 rounding is 2^-8 relative, an indexing error O(1)
        "lse": (lse[0, :1].float(), torch.logsumexp(scores, 0)[None]),
        "weights_tail": (weights[0, 0, tail].float(), ref_weights[tail]),
        "context": (context[0, 0].float(), ref_weights @ values[0].float()),
        "grad_values_tail": (
            grads[2][0, tail].float(),
            ref_weights[tail, None].expand(-1, value_dim),
        ),
        "grad_keys_tail": (
            grads[1][0, tail].float(),
            (ref_weights[tail] * (dp - delta))[:, None] * vf * (1 - u * u),
        ),
    }
    errors = {
        name: ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        for name, (a, e) in pairs.items()
    }
    ok = all(err <= 2e-2 for err in errors.values())
    return {"status": "passed" if ok else "FAILED", "errors": errors, "num_keys": num_keys}


# --- derived numbers -------------------------------------------------------------------------------


def tanh_count(row: dict) -> int:
    batch, q_len, k_len, hidden, _ = row["dims"]
    return batch * q_len * k_len * hidden


def min_bytes(row: dict) -> int:
    """Fewest bytes the fused op must move: inputs read once, outputs (context, weights) written
    once; forward+backward also reads grad context and inputs again and writes the grads."""
    batch, q_len, k_len, hidden, value_dim = row["dims"]
    size = ELEMENT_BYTES[row["dtype"]]
    inputs = batch * (q_len + k_len) * hidden + batch * k_len * value_dim + 2 * hidden
    outputs = batch * q_len * (value_dim + k_len)
    if row["mode"] == "forward":
        return size * (inputs + outputs)
    return size * (3 * inputs + outputs + batch * q_len * value_dim)


def keys_values_bytes(row: dict) -> int:
    batch, _, k_len, hidden, value_dim = row["dims"]
    return ELEMENT_BYTES[row["dtype"]] * batch * k_len * (hidden + value_dim)


def ms(row: dict, provider: str, key: str = "ms") -> float | None:
    cell = row.get(provider) or {}
    value = cell.get(key)
    return value if isinstance(value, (int, float)) and value > 0 else None


def device_ms(row: dict) -> float | None:
    """The fused op's device time per call: graph replay when measured, else wall time."""
    return ms(row, "fused", "kernel_ms") or ms(row, "fused")


def correct(row: dict) -> bool | None:
    return (row.get("correct") or {}).get("ok")


# --- the table -------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(value, spec)


HEADER = (
    f"{'shape':16s} {'dtype':5s} {'mode':8s} {'ok':4s} {'fused':>8s} {'kernel':>8s} {'launch':>7s}"
    f" {'eager':>8s} {'compile':>8s} {'xcomp':>6s} {'Gtanh/s':>8s} {'%ceil':>6s} {'GB/s':>7s}"
    f" {'peakMiB':>8s} {'cmpMiB':>8s}"
)


def row_line(row: dict, report: dict | None = None) -> str:
    """One table row: times in ms (fused = wall per call, kernel = graph replay, launch = host
    enqueue time), speedup over compile, tanh rate and bandwidth from the device time."""
    del report
    fused, comp, dev = ms(row, "fused"), ms(row, "compile"), device_ms(row)
    mode = "fwd" if row["mode"] == "forward" else "fwd+bwd"
    work = WORK_FACTOR[row["mode"]] * tanh_count(row)
    ok = {True: "yes", False: "NO", None: "-"}[correct(row)]
    if "error" in row:
        ok = "ERR"
    return (
        f"{row['shape']:16s} {row['dtype']:5s} {mode:8s} {ok:4s} {_fmt(fused, '8.3f')}"
        f" {_fmt(ms(row, 'fused', 'kernel_ms'), '8.3f')} {_fmt(ms(row, 'fused', 'launch_ms'), '7.3f')}"
        f" {_fmt(ms(row, 'eager'), '8.3f')} {_fmt(comp, '8.3f')}"
        f" {_fmt(comp / fused if comp and fused else None, '6.2f')}"
        f" {_fmt(work / (dev * 1e-3) / 1e9 if dev else None, '8.1f')}"
        f" {_fmt(100 * work / (dev * 1e-3) / TANH_CEILING if dev else None, '6.1f')}"
        f" {_fmt(min_bytes(row) / (dev * 1e-3) / 1e9 if dev else None, '7.0f')}"
        f" {_fmt(ms(row, 'fused', 'peak_mib'), '8.1f')} {_fmt(ms(row, 'compile', 'peak_mib'), '8.1f')}"
    )


def summary_lines(report: dict) -> list[str]:
    """The whole summary: stages, probes, the table, errors, then the targets line by line."""
    stages = report.get("stages", {})
    env = stages.get("env", {})
    lines = [
        f"SUMMARY gpu_check {report.get('date')} device={env.get('device')} "
        f"versions={json.dumps(env.get('versions'))}",
        "stages: " + ", ".join(f"{name} {rec.get('status')}" for name, rec in stages.items()),
    ]
    lines += _probe_lines(stages.get("probes", {}), stages.get("bandwidth", {}))
    lines += [
        "",
        "ms per call (median); xcomp = compile / fused; rates from the kernel time; "
        "GB/s = fewest bytes / kernel time",
        HEADER,
    ]
    rows = report.get("rows", [])
    lines += [row_line(row) for row in rows]
    problems = [
        f"  {r['shape']} {r['dtype']} {r['mode']}: {r['error']}" for r in rows if "error" in r
    ]
    problems += [
        f"  {r['shape']} {r['dtype']} {r['mode']} {p}: {r[p]['error']}"
        for r in rows
        for p in ("fused", "eager", "compile")
        if isinstance(r.get(p), dict) and "error" in r[p]
    ]
    problems += [
        f"  {r['shape']} {r['dtype']} {r['mode']}: INCORRECT {r['correct']['worst']}"
        for r in rows
        if correct(r) is False
    ]
    if problems:
        lines += ["problems:", *problems]
    if report.get("sweep"):
        lines += ["", "sweep (ms per call; cost = the tile model's prediction, lower is better):"]
        lines += ["  " + sweep_line(entry) for entry in report["sweep"]]
    lines += target_lines(report)
    return lines


def sweep_line(entry: dict) -> str:
    cost = entry.get("cost")
    result = entry.get("ms")
    shown = (
        f"{result:9.3f} ms"
        if isinstance(result, (int, float))
        else str((entry.get("result") or {}).get("status", "-"))[:80]
    )
    return (
        f"{entry['shape']:16s} {entry['dtype']:5s} {entry['what']:15s} {entry['label']:16s}"
        f" cost {'-' if cost is None else format(cost, '.3f'):>6s} {shown}"
    )


def _probe_lines(probes: dict, bandwidth: dict) -> list[str]:
    parts = []
    for mode in ("exp", "product", "approx", "packed"):
        probe = probes.get(f"tanh_{mode}") or {}
        if "max_abs" in probe:
            ran = "" if probe.get("ran_as", mode) == mode else f" (ran as {probe['ran_as']})"
            parts.append(f"{mode}{ran} abs {probe['max_abs']:.1e} rel 2^{probe['log2_rel']:.1f}")
        elif probe:
            parts.append(f"{mode} {probe.get('status')}")
    int64 = (probes.get("int64_offsets") or {}).get("status", "unmeasured")
    copy = bandwidth.get("copy_bytes_per_s")
    copy_text = f"{copy / 1e12:.2f} TB/s" if copy else "unmeasured"
    return [f"tanh: {'; '.join(parts) or 'unmeasured'} | int64 offsets: {int64} | copy {copy_text}"]


# --- targets ---------------------------------------------------------------------------------------


def _verdict(row: dict | None, value: float | None, goal: float, text: str) -> str:
    if row is None:
        return "unmeasured (no row)"
    if correct(row) is False:
        return f"MISSED (incorrect: {row['correct']['worst']})"
    if value is None:
        return "unmeasured" + (f" ({row['error'][:80]})" if "error" in row else "")
    return f"{text.format(value)}: " + ("met" if value >= goal else "MISSED")


def _find(rows: list[dict], shape: str, dtype: str, mode: str) -> dict | None:
    for row in rows:
        if (row["shape"], row["dtype"], row["mode"]) == (shape, dtype, mode):
            return row
    return None


def _speedup(row: dict | None) -> float | None:
    if row is None:
        return None
    fused, comp = ms(row, "fused"), ms(row, "compile")
    return comp / fused if fused and comp else None


def target_lines(report: dict) -> list[str]:
    rows = report.get("rows", [])
    names = list(dict.fromkeys(r["shape"] for r in rows))
    train = [
        n
        for n in names
        if _find(rows, n, "bf16", "forward") is None
        or _find(rows, n, "bf16", "forward")["dims"][1] > 1
    ]
    decode = [n for n in names if n not in train]
    copy = report.get("stages", {}).get("bandwidth", {}).get("copy_bytes_per_s") or COPY_BANDWIDTH
    out = ["", "targets (H200):"]
    if report.get("dry_run"):
        out[-1] += " DRY RUN on CPU: the speeds below mean nothing"
    for name in train:
        row = _find(rows, name, "bf16", "forward")
        rate = tanh_count(row) / (device_ms(row) * 1e-3) if row and device_ms(row) else None
        out.append(
            f"  T1 {name} bf16 fwd >= 2x compile: " + _verdict(row, _speedup(row), 2.0, "{:.2f}x")
        )
        out.append(
            f"  T2 {name} bf16 fwd >= 50% tanh ceiling: "
            + _verdict(row, rate / TANH_CEILING if rate else None, 0.5, "{:.0%}")
        )
        row = _find(rows, name, "fp32", "forward")
        out.append(
            f"  T3 {name} fp32 fwd >= 1.5x compile: " + _verdict(row, _speedup(row), 1.5, "{:.2f}x")
        )
        for dtype in ("bf16", "fp32"):
            row = _find(rows, name, dtype, "forward+backward")
            out.append(
                f"  T4 {name} {dtype} fwd+bwd >= 2x compile: "
                + _verdict(row, _speedup(row), 2.0, "{:.2f}x")
            )
    for name in decode:
        for dtype in ("bf16", "fp32"):
            row = _find(rows, name, dtype, "forward")
            share = None
            if row and device_ms(row):
                share = keys_values_bytes(row) / (device_ms(row) * 1e-3) / copy
            out.append(
                f"  T5 {name} {dtype} fwd keys+values >= 70% of copy bandwidth: "
                + _verdict(row, share, 0.7, "{:.0%}")
            )
    out += _memory_lines(rows)
    return out


def _memory_lines(rows: list[dict]) -> list[str]:
    """T6: peak extra memory of the fused op against 16 B per pair + 2x inputs and outputs."""
    measured, worst = 0, None
    for row in rows:
        peak = ms(row, "fused", "peak_mib")
        if peak is None or correct(row) is False:
            continue
        batch, q_len, k_len, _, _ = row["dims"]
        allowed = (16 * batch * q_len * k_len + 2 * min_bytes(row)) / 2**20
        measured += 1
        share = peak / allowed
        if worst is None or share > worst[0]:
            worst = (share, f"{row['shape']} {row['dtype']} {row['mode']}")
    if not measured:
        return ["  T6 memory O(B*Tq*Tk): unmeasured"]
    verdict = "met" if worst[0] <= 1.0 else "MISSED"
    return [
        f"  T6 memory O(B*Tq*Tk) over {measured} rows: worst {worst[0]:.2f} of the allowance "
        f"({worst[1]}): {verdict}"
    ]


def any_failure(report: dict) -> bool:
    """A wrong result anywhere (row gate, int64 check, tests): the check's exit status is 1."""
    probes = report.get("stages", {}).get("probes", {})
    tests = report.get("stages", {}).get("tests", {})
    return (
        any(correct(row) is False for row in report.get("rows", []))
        or str((probes.get("int64_offsets") or {}).get("status", "")).startswith("FAILED")
        or str(tests.get("status", "")).startswith("FAILED")
    )


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print("\n".join(summary_lines(json.load(handle))))
