"""Translate training steps batched by sentences (--batch-size) and by tokens (--batch-tokens),
side by side in one process, on a real corpus.

    python -m bench.bench_batch_tokens --data fra-eng.zip --max-pairs 29000 --direction 2-1 \\
        --batch-tokens 1000 --steps 10 --rounds 3 --threads 1

One corpus, split and sentencepiece vocabularies (the translate task's defaults of
``seq2seq-fast train``), then one model per batching mode from the same seed, each stepping
through its own epoch-0 batches (``Task.epoch_plan``, as training draws them): one untimed
warm-up step each, then ``--rounds`` rounds of ``--steps`` full training steps (batch padding,
forward, loss, backward, clipping, fused AdamW), modes in rotated order. Reported: target tokens
(with </s>, padding excluded) per second of this process's CPU time (not inflated by waiting on a
busy machine) and of wall time, medians over rounds, the ratio to --batch-size, and each mode's
batches per epoch, mean pairs and target tokens per batch and padding shares, the per-round
ratios, and each model's validation loss (cross-entropy per target token, teacher-forced, the
valid split) after its steps: a first look at quality per step, not a BLEU measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from seq2seq_fast.seq2seq.builders import Clock, build_model, build_optimizer, build_task
from seq2seq_fast.seq2seq.config import TrainConfig
from seq2seq_fast.seq2seq.data.batching import make_batch, padding_fractions
from seq2seq_fast.seq2seq.distributed import Dist
from seq2seq_fast.seq2seq.train import Job, train_step


def _job(config: TrainConfig, task, ctx: Dist) -> Job:
    torch.manual_seed(config.seed)
    model, backend = build_model(config, task, ctx)
    clock = Clock(time.perf_counter(), None)
    optimizer, scheduler = build_optimizer(config, model, 10 * task.steps_per_epoch, clock)
    return Job(config, ctx, task, model, model, backend, optimizer, scheduler, clock)


def _run(job: Job, plan: list[list[int]], position: int, steps: int) -> tuple[int, float, float]:
    """``steps`` training steps from ``position`` of ``plan`` -> (target tokens, CPU s, wall s)."""
    tokens = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for k in range(steps):
        batch = make_batch([job.task.corpus.train[i] for i in plan[(position + k) % len(plan)]])
        train_step(job, batch)
        tokens += batch.num_target_tokens
    return tokens, time.process_time() - cpu, time.perf_counter() - wall


def _valid_loss(job: Job) -> float:
    """Mean cross-entropy per target token on the valid split, in batches of 64 pairs."""
    task, model = job.task, job.model
    pairs = [(task.src_vocab.encode(s), task.tgt_vocab.encode(t)) for s, t in task.corpus.valid]
    pairs = sorted((p for p in pairs if p[0] and p[1]), key=lambda p: len(p[1]))
    total = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), 64):
            batch = make_batch(pairs[start : start + 64])
            loss, _ = model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out)
            total += float(loss) * batch.num_target_tokens
            tokens += batch.num_target_tokens
    model.train()
    return total / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-pairs", type=int, default=29000)
    parser.add_argument("--direction", default="2-1")
    parser.add_argument("--spm-vocab-size", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[1000])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="split, vocabularies, init, batches")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = TrainConfig.for_task(
        "translate",
        data=args.data,
        max_pairs=args.max_pairs,
        direction=args.direction,
        spm_vocab_size=args.spm_vocab_size,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=False,
        heatmap=False,
    )
    ctx = Dist()
    task = build_task(base, ctx, None)
    modes = {f"--batch-size {args.batch_size}": base}
    modes |= {f"--batch-tokens {n}": replace(base, batch_tokens=n) for n in args.batch_tokens}
    jobs, plans = {}, {}
    for name, config in modes.items():
        plans[name] = task.epoch_plan(config, 0, ctx)
        jobs[name] = _job(config, task, ctx)
        _run(jobs[name], plans[name], 0, 1)  # warm-up
    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in modes}
    names = list(modes)
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            results[name].append(_run(jobs[name], plans[name], 1 + r * args.steps, args.steps))
    first = None
    print(
        f"{args.steps} steps x {args.rounds} rounds, {args.threads} thread(s), "
        f"{len(task.corpus.train)} training pairs, target vocabulary {len(task.tgt_vocab)}"
    )
    print(
        "| batching | batches/epoch | pairs/batch | target tok/batch | padding src / tgt "
        "| tok/CPU-s | tok/s wall | vs batch-size (CPU) | per round | valid loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name in names:
        plan, rows = plans[name], results[name]
        train = task.corpus.train
        pairs = sum(map(len, plan)) / len(plan)
        target = sum(len(train[i][1]) + 1 for b in plan for i in b) / len(plan)
        src_pad, tgt_pad = padding_fractions(train, plan)
        cpu = statistics.median(t / c for t, c, _ in rows)
        wall = statistics.median(t / w for t, _, w in rows)
        per_round = [t / c for t, c, _ in rows]
        first = first or per_round
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(per_round, first, strict=True))
        print(
            f"| {name} | {len(plan)} | {pairs:.1f} | {target:.0f} | {src_pad:.1%} / "
            f"{tgt_pad:.1%} | {cpu:,.0f} | {wall:,.0f} | {cpu / statistics.median(first):.2f}x "
            f"| {ratios} | {_valid_loss(jobs[name]):.3f} |"
        )


if __name__ == "__main__":
    main()
