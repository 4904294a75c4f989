"""Quick CPU benchmark of the fused additive attention against the eager and compiled reference.

    python bench/cpu_quick.py [--shapes train,decode,tiny] [--reps 7] [--threads 2,1]
                              [--clock wall|cpu] [--stat median|min] [--no-compile]

Every provider runs in this one process, interleaved round by round; the table reports medians,
G tanh/s (N = B*Tq*Tk*H tanh evaluations per forward) and ratios against the reference, at 2 and
1 threads. The machine is shared: read the ratios, not the absolute times. `--clock cpu` times
with the process CPU clock, which a busy machine inflates much less than wall time when running
on one thread (with more threads it also counts their spin-waiting). `--stat min` reports the
fastest round instead of the median: on a machine shared with other jobs it estimates what an
idle machine gives (two threads suffer most: a parallel region waits for its slowest thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seq2seq_fast import additive_attention
from seq2seq_fast.reference import additive_attention_ref

SHAPES = {  # name: (B, Tq, Tk, H, Dv)
    "train": (32, 30, 30, 256, 512),
    "decode": (1280, 1, 66, 1024, 1024),
    "tiny": (1, 1, 30, 256, 256),
}


def make_inputs(shape, requires_grad):
    batch, num_queries, num_keys, hidden, value_dim = shape
    gen = torch.Generator().manual_seed(0)
    scale = hidden**-0.5
    query = torch.randn(batch, num_queries, hidden, generator=gen)
    keys = torch.randn(batch, num_keys, hidden, generator=gen)
    values = torch.randn(batch, num_keys, value_dim, generator=gen)
    v = torch.randn(hidden, generator=gen) * scale
    bias = torch.randn(hidden, generator=gen) * 0.1
    tensors = [query, keys, values, v, bias]
    for t in tensors:
        t.requires_grad_(requires_grad)
    lengths = torch.randint(num_keys // 2, num_keys + 1, (batch,), generator=gen)
    lengths[0] = num_keys
    return tensors, lengths


def fused(query, keys, values, v, bias, lengths):
    return additive_attention(query, keys, values, v, bias, lengths=lengths)


def eager(query, keys, values, v, bias, lengths):
    return additive_attention_ref(query, keys, values, v, bias, lengths=lengths)


def run_once(fn, tensors, lengths, backward):
    if backward:
        context, weights = fn(*tensors, lengths)
        context.sum().backward()
        for t in tensors:
            t.grad = None
    else:
        with torch.no_grad():
            fn(*tensors, lengths)


def measure(
    providers, shape, backward, reps, clock=time.perf_counter, stat=statistics.median, min_time=0.05
):
    """Seconds per call (median or min over rounds) of each provider, interleaved round by round."""
    tensors, lengths = make_inputs(shape, backward)
    inner = {}
    for name, fn in providers.items():
        for _ in range(2):
            run_once(fn, tensors, lengths, backward)
        start = clock()
        run_once(fn, tensors, lengths, backward)
        once = clock() - start
        inner[name] = max(1, int(min_time / max(once, 1e-6)))
    samples = {name: [] for name in providers}
    for _ in range(reps):
        for name, fn in providers.items():
            start = clock()
            for _ in range(inner[name]):
                run_once(fn, tensors, lengths, backward)
            samples[name].append((clock() - start) / inner[name])
    return {name: stat(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="train,decode,tiny")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()

    providers = {"fused": fused, "eager": eager}
    if not args.no_compile:
        compiled_ref = torch.compile(additive_attention_ref)

        def compiled(query, keys, values, v, bias, lengths):
            return compiled_ref(query, keys, values, v, bias, lengths=lengths)

        providers["compile"] = compiled

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    isa = torch.ops.seq2seq_fast._cpu_isa()
    stat = statistics.median if args.stat == "median" else min
    print(f"torch {torch.__version__}, fused kernel ISA: {isa}, {args.stat} of {args.clock} time\n")
    print(
        "| shape (B,Tq,Tk,H,Dv) | threads | mode | fused ms | G tanh/s | eager ms | compile ms "
        "| × eager | × compile |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fused_times = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        n_tanh = shape[0] * shape[1] * shape[2] * shape[3]
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                times = measure(providers, shape, backward, args.reps, clock, stat)
                fused_times[(name, threads, mode)] = times["fused"]
                # fwd+bwd: one forward, plus the backward's recomputed forward and its gradient pass
                rate = n_tanh / times["fused"] / 1e9
                comp = times.get("compile")
                comp_ms = "-" if comp is None else f"{comp * 1e3:.3f}"
                comp_x = "-" if comp is None else f"{comp / times['fused']:.1f}"
                print(
                    f"| {name} {shape} | {threads} | {mode} | {times['fused'] * 1e3:.3f} "
                    f"| {rate:.2f} | {times['eager'] * 1e3:.3f} "
                    f"| {comp_ms} "
                    f"| {times['eager'] / times['fused']:.1f} "
                    f"| {comp_x} |"
                )
    print("\nThread scaling of the fused op (time at 1 thread / time at 2 threads):")
    for (name, threads, mode), t in fused_times.items():
        if threads == 2 and (name, 1, mode) in fused_times:
            print(f"- {name} {mode}: {fused_times[(name, 1, mode)] / t:.2f}x")


if __name__ == "__main__":
    main()
