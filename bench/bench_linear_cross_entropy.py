"""The output layer + loss of a training step: chunked fused op against F.linear + F.cross_entropy.

    python -m bench.bench_linear_cross_entropy                  # translate-default shapes, 2 threads
    python -m bench.bench_linear_cross_entropy --features 256,768 --vocab 8000 --threads 2

Forward + backward of one batch's output layer and label-smoothed loss (B x T rows, a share of
them padding; B and T of bench.shapes.TRAIN_SIZES["small"]), timed side by side in one process
(bench.timing.time_interleaved, medians), with each variant's peak of extra
memory (the logits and their gradient) estimated from the tensors it must hold.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench import shapes, timing
from seq2seq_fast.ops.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

SIZE = shapes.TRAIN_SIZES["small"]  # batch and target length of the training benchmarks


def _fresh_grads(run, *leaves):
    def call() -> None:
        for leaf in leaves:
            leaf.grad = None
        run()

    return call


def _variants(x, weight, bias, target, eps):
    def unfused() -> None:
        logits = F.linear(x, weight, bias)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=0,
            label_smoothing=eps,
        )
        loss.backward()

    def fused() -> None:
        linear_cross_entropy(
            x, weight, bias, target, label_smoothing=eps, ignore_index=0
        ).backward()

    def fused_bf16() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(
                x, weight, bias, target, label_smoothing=eps, ignore_index=0
            )
        loss.backward()

    def unfused_bf16() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(x, weight, bias)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                target.reshape(-1),
                ignore_index=0,
                label_smoothing=eps,
            )
        loss.backward()

    return {
        "F.linear + F.cross_entropy": unfused,
        "fused, chunked": fused,
        "unfused, autocast bf16": unfused_bf16,
        "fused, autocast bf16": fused_bf16,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", default="256,768", help="output layer input widths")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=SIZE.batch)
    parser.add_argument("--length", type=int, default=SIZE.length)
    parser.add_argument("--pad-fraction", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="also time the autocast bf16 variants")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = args.batch * args.length
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rows} rows "
        f"({args.pad_fraction:.0%} padding), vocab {args.vocab}, chunk "
        f"{default_chunk_rows(args.vocab)} rows, median of {args.rounds} rounds\n"
    )
    print("| features | variant | ms | vs unfused | logits held (MB) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for features in (int(f) for f in args.features.split(",")):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, args.length, features, generator=gen).requires_grad_(True)
        weight = torch.randn(args.vocab, features, generator=gen) / features**0.5
        weight.requires_grad_(True)
        bias = torch.zeros(args.vocab, requires_grad=True)
        target = torch.randint(4, args.vocab, (args.batch, args.length), generator=gen)
        target[torch.rand(target.shape, generator=gen) < args.pad_fraction] = 0
        variants = _variants(x, weight, bias, target, 0.1)
        if not args.bf16:
            variants = {k: v for k, v in variants.items() if "bf16" not in k}
        calls = {name: _fresh_grads(run, x, weight, bias) for name, run in variants.items()}
        samples = timing.time_interleaved(calls, "cpu", args.rounds)
        base = statistics.median(samples["F.linear + F.cross_entropy"].wall_s)
        valid = int((target != 0).sum())
        for name, sample in samples.items():
            ms = statistics.median(sample.wall_s)
            held = (
                2 * rows * args.vocab * 4
                if name.startswith("F.") or name.startswith("unfused")
                else min(valid, default_chunk_rows(args.vocab)) * args.vocab * 4
            )
            print(
                f"| {features} | {name} | {ms * 1e3:.1f} | {base / ms:.2f}x | {held / 2**20:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
