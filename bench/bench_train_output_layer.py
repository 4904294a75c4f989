"""Whole training steps with each output layer / loss variant, side by side in one process.

    python -m bench.bench_train_output_layer                       # translate defaults, 2 threads
    python -m bench.bench_train_output_layer --decoders gnmt --vocab 8000 --rounds 5

Variants, each a full step (forward, loss, backward, clipping, fused AdamW) of the same batches
(64 sentences, target lengths drawn from 4..--max-len, so a share of each batch is padding):

    concat, unfused       logits = W [s; c] (768 wide at hidden 256), F.cross_entropy on [B, T, V]
    concat, fused         the same layer, loss by the chunked linear + cross-entropy op
    attentional, fused    a_t = tanh(W_a [s; c]) of hidden width, then the fused op (the default)

Timed side by side by ``bench.timing.time_interleaved`` (one untimed warm-up pass, then the
variants in rotated order each round), median of ``--rounds`` rounds of ``--steps`` steps; target tokens/s and the
ratio to the first variant. Output: a markdown table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import shapes, timing
from seq2seq_fast.seq2seq.data.batching import make_batch
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, sequence_loss

VARIANTS = (("concat", False), ("concat", True), ("attentional", True))
SIZE = shapes.TRAIN_SIZES["small"]  # hidden size and batch of the training benchmarks


def _batches(vocab: int, count: int, batch: int, max_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        pairs = []
        for _ in range(batch):
            n = int(torch.randint(4, max_len + 1, (), generator=gen))
            m = max(1, n + int(torch.randint(-2, 3, (), generator=gen)))
            pairs.append(
                (
                    torch.randint(4, vocab, (n,), generator=gen).tolist(),
                    torch.randint(4, vocab, (m,), generator=gen).tolist(),
                )
            )
        out.append(make_batch(pairs))
    return out


def _stepper(decoder: str, output_layer: str, fused: bool, args):
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        args.vocab,
        args.vocab,
        embed_size=args.hidden,
        hidden_size=args.hidden,
        decoder=decoder,
        dropout=0.2,
        output_layer=output_layer,
    )
    model = Seq2Seq(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch) -> None:
        if fused:
            loss, _ = model(
                batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out, label_smoothing=0.1
            )
        else:
            logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
            loss = sequence_loss(logits, batch.tgt_out, 0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def _all_batches(step, batches):
    def run() -> None:
        for batch in batches:
            step(batch)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", default="gnmt,bahdanau")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=SIZE.hidden)
    parser.add_argument("--batch", type=int, default=SIZE.batch)
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (with 1 thread: robust to a busy machine's waiting)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = _batches(args.vocab, args.steps, args.batch, args.max_len)
    tokens = sum(b.num_target_tokens for b in batches)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), hidden {args.hidden}, "
        f"vocab {args.vocab}, {args.batch} sentences of 4-{args.max_len} tokens, median of "
        f"{args.rounds} rounds of {args.steps} steps, {args.clock} clock\n"
    )
    print("| decoder | output layer | loss | target tok/s | vs first |")
    print("| --- | --- | --- | ---: | ---: |")
    for decoder in args.decoders.split(","):
        steppers = {v: _stepper(decoder, v[0], v[1], args) for v in VARIANTS}
        calls = {v: _all_batches(step, batches) for v, step in steppers.items()}
        samples = timing.time_interleaved(calls, "cpu", args.rounds, warmup=1)
        field = "cpu_s" if args.clock == "cpu" else "wall_s"
        first = statistics.median(getattr(samples[VARIANTS[0]], field))
        for (layer, fused), sample in samples.items():
            seconds = statistics.median(getattr(sample, field))
            print(
                f"| {decoder} | {layer} | {'fused, chunked' if fused else 'F.cross_entropy'} | "
                f"{tokens / seconds:,.0f} | {first / seconds:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
