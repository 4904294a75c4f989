"""The converter's general path (``fuse_attention(model, named=False)``: additive attention found
in a trace of each module's first call) against the named layouts' stand-ins, on the models of
``bench.bench_convert`` and ``bench.bench_convert_speech``: a whole training step each, side by
side in one process.

Providers: ``original``, ``named`` (``fuse_attention`` as it is: the named layouts first) and
``traced`` (the general path alone). The first call of a ``traced`` model converts it (a trace and
a float64 probe); the warm-up steps take that cost, the timed ones do not. A model the general
path does not convert is listed with its report instead.

    python -m bench.bench_convert_traced --threads 1 --rounds 3

``--per-call`` times one speech family's attention call instead (forward only, no gradients,
microseconds per call after a warm-up, the three providers in turn on the same inputs): the
Python each path adds around the same kernels.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from bench import bench_convert, bench_convert_speech, timing

PROVIDERS = {"original": "original", "named": "fused", "traced": "traced"}


def _suites(size: str):
    return [
        ("nlp", bench_convert, list(bench_convert.MODELS), bench_convert.SIZES[size]),
        (
            "speech",
            bench_convert_speech,
            list(bench_convert_speech.FAMILIES),
            bench_convert_speech.SIZES[size],
        ),
    ]


def table(size: str, threads: int, rounds: int, only: list[str] | None) -> str:
    torch.set_num_threads(threads)
    lines = [
        f"{size}, {threads} thread(s); CPU time per step (ms), medians; speed-ups = median of "
        "per-round ratios over original:",
        "",
        "| model | original | named | traced | named speed-up | traced speed-up | traced / named "
        "| first traced step (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for _, module, names, shape in _suites(size):
        for name in names:
            if only and name not in only:
                continue
            calls = {p: module.make_step(name, inner, shape) for p, inner in PROVIDERS.items()}
            start = time.process_time()
            calls["traced"]()  # converts
            first = time.process_time() - start
            report = calls["traced"].report
            if report.count != 1:
                lines.append(f"| {name} | not converted by the general path: {report} |")
                print(lines[-1], flush=True)
                continue
            samples = timing.time_interleaved(calls, "cpu", rounds, 0.0)
            times = {p: samples[p].cpu_s for p in PROVIDERS}
            med = {p: timing.Summary.of(times[p]).median * 1e3 for p in PROVIDERS}
            named = timing.ratio_summary(times["original"], times["named"]).median
            traced = timing.ratio_summary(times["original"], times["traced"]).median
            lines.append(
                f"| {name} | {med['original']:.0f} | {med['named']:.0f} | {med['traced']:.0f} "
                f"| {named:.2f}x | {traced:.2f}x | {traced / named:.0%} | {first:.1f} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def per_call(size: str, threads: int, calls: int, only: list[str] | None) -> str:
    """Forward time per attention call (us) of the speech families: original / named / traced."""
    from seq2seq_fast.nn.convert import fuse_attention_report

    torch.set_num_threads(threads)
    shape = bench_convert_speech.SIZES[size]
    lines = [
        f"{size}, {threads} thread(s); one attention call, forward, no gradients, us per call "
        f"(median of 3 runs of {calls} calls):",
        "",
        "| family | original | named | traced |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, family in bench_convert_speech.FAMILIES.items():
        if only and name not in only:
            continue
        gen = torch.Generator().manual_seed(0)
        memory = torch.randn(shape.batch, shape.frames, shape.width, generator=gen)
        query = torch.randn(shape.batch, shape.width, generator=gen)
        lengths = bench_convert_speech._lengths(shape)
        torch.manual_seed(0)
        base = family.make(shape)
        row = []
        for provider in ("original", "named", "traced"):
            holder = torch.nn.ModuleDict({"attn": copy.deepcopy(base)})
            if provider != "original":
                fuse_attention_report(holder, named=provider == "named")
            attn = holder["attn"]
            runs = []
            with torch.no_grad():
                context = family.start(attn, memory, lengths)
                for _ in range(5):  # the first converts
                    family.step(attn, context, query)
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(calls):
                        family.step(attn, context, query)
                    runs.append((time.perf_counter() - start) / calls * 1e6)
            row.append(sorted(runs)[1])
        lines.append(f"| {name} | " + " | ".join(f"{t:.0f}" for t in row) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=None, metavar="MODEL")
    parser.add_argument(
        "--per-call",
        type=int,
        default=0,
        metavar="CALLS",
        help="time one speech family's attention call (forward) instead, CALLS calls a run",
    )
    args = parser.parse_args(argv)
    for threads in args.threads:
        if args.per_call:
            print(per_call(args.size, threads, args.per_call, args.models))
        else:
            print(table(args.size, threads, args.rounds, args.models))
        print()


if __name__ == "__main__":
    main()
