"""What one Seq2Seq training step is made of: each part timed forward+backward on its own.

    python -m bench.train_step_profile                      # both decoders, both sizes, 1 thread
    python -m bench.train_step_profile --sizes small --decoders bahdanau --threads 2

Same model, sizes (``bench.shapes.TRAIN_SIZES``) and batches as bench/train_throughput.py (fused
attention, AdamW(fused=True)).
Parts, each a forward and a backward on detached inputs (so nothing is counted twice):

    encoder        embedding + bidirectional GRU over the source
    keys+bridge    the attention's key projection (once per batch) and the decoder's initial state
    decoder        the decoder up to the output layer's input (cells, attention, embeddings)
    decoder, zero  the same with an attention that costs nothing (bench/train_throughput.py's)
    output+loss    the output layer over all target steps, log-softmax, cross-entropy
    optimizer      AdamW step

Parts are timed round-robin by ``bench.timing.time_interleaved``, medians of ``--rounds``; "sum of parts" next to the whole step shows
what the split leaves out (autograd bookkeeping across parts, allocator). The GFLOP column counts
the matrix products (forward + backward = 3x forward) of each part, so a part's GFLOP/s says how
close it runs to the machine's matrix-product rate.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn

from bench.shapes import TRAIN_SIZES, TrainSize
from bench.timing import time_interleaved
from bench.train_throughput import ZeroCostAttention
from seq2seq_fast.seq2seq.models import Memory, Seq2Seq, Seq2SeqConfig, sequence_loss


def matmul_gflop(decoder: str, size: TrainSize, vocab: int, cell: str = "gru") -> dict[str, float]:
    """Matrix-product GFLOP of one step (forward + backward) per part, bidirectional 1-layer GRU
    or LSTM encoder, embed = attention = hidden, 1-layer decoder."""
    h = size.hidden
    g = 4 if cell == "lstm" else 3  # gates per hidden unit
    e, a, d, tokens = h, h, 2 * h, size.batch * size.length
    encoder = 2 * (2 * tokens * e * g * h + 2 * tokens * h * g * h)
    keys = 2 * tokens * d * a + 2 * size.batch * d * h
    if decoder == "bahdanau":  # [emb; ctx] -> 3H per step, s_{t-1} -> [3H; A]
        cells = 2 * tokens * (e + d) * g * h + 2 * tokens * h * (g * h + a)
    else:  # one GRU layer over the target, the query projection of all steps
        cells = 2 * tokens * e * g * h + 2 * tokens * h * g * h + 2 * tokens * h * a
    output = 2 * tokens * (h + d) * vocab
    parts = {"encoder": encoder, "keys+bridge": keys, "decoder": cells, "output+loss": output}
    return {name: 3 * flop / 1e9 for name, flop in parts.items()}


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def profile(
    decoder: str, size: TrainSize, vocab: int, rounds: int, cell: str = "gru"
) -> dict[str, float]:
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        embed_size=size.hidden,
        hidden_size=size.hidden,
        decoder=decoder,
        cell=cell,
        backend="fused",
    )
    model = Seq2Seq(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    shape = (size.batch, size.length)
    src = torch.randint(4, vocab, shape, generator=gen)
    tgt_in = torch.randint(4, vocab, shape, generator=gen)
    tgt_out = torch.randint(4, vocab, shape, generator=gen)
    lengths = torch.full((size.batch,), size.length, dtype=torch.long)

    def step() -> None:
        loss = sequence_loss(model(src, lengths, tgt_in)[0], tgt_out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def encoder() -> None:
        outputs, summary = model.encoder(src, lengths)
        (outputs.sum() + summary.sum()).backward()

    with torch.no_grad():
        outputs, summary = model.encoder(src, lengths)
        keys = model.attention.project_keys(outputs)
        state = torch.tanh(model.bridge(summary))
    outputs.requires_grad_(True)
    summary.requires_grad_(True)

    def keys_bridge() -> None:
        projected = model.attention.project_keys(outputs)
        (projected.sum() + torch.tanh(model.bridge(summary)).sum()).backward()

    def decoder_part(module: nn.Module):
        def run() -> None:
            memory = Memory(outputs, keys.detach().requires_grad_(True), lengths)
            h = state.detach().requires_grad_(True)
            features, _, _ = module(
                tgt_in, ((h, torch.zeros_like(h)) if cell == "lstm" else h,), memory
            )
            features.sum().backward()

        return run

    without_output = copy.deepcopy(model.decoder)
    without_output.output = nn.Identity()  # the decoder returns the output layer's input
    zero_cost = copy.deepcopy(without_output)
    zero_cost.attention = ZeroCostAttention(zero_cost.attention)
    with torch.no_grad():
        start = (state, torch.zeros_like(state)) if cell == "lstm" else state
        features = without_output(tgt_in, (start,), Memory(outputs, keys, lengths))[0]
    features.requires_grad_(True)

    def output_loss() -> None:
        sequence_loss(model.decoder.output(features), tgt_out).backward()

    step()  # the optimizer's state exists from here on

    parts = {
        "whole step": step,
        "encoder": encoder,
        "keys+bridge": keys_bridge,
        "decoder": decoder_part(without_output),
        "decoder, zero-cost attention": decoder_part(zero_cost),
        "output+loss": output_loss,
        "optimizer": optimizer.step,
    }
    samples = time_interleaved(parts, "cpu", rounds, warmup=1)
    return {name: _median_ms(s.wall_s) for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--decoders", default="bahdanau,gnmt")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cell", default="gru", choices=("gru", "lstm"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), vocab {args.vocab}, "
        f"{args.cell.upper()}, median of {args.rounds} rounds"
    )
    print()
    print("| hidden, length, batch | decoder | part | ms | share of step | GFLOP | GFLOP/s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for size_name in args.sizes.split(","):
        size = TRAIN_SIZES[size_name]
        for decoder in args.decoders.split(","):
            times = profile(decoder, size, args.vocab, args.rounds, args.cell)
            flops = matmul_gflop(decoder, size, args.vocab, args.cell)
            whole = times["whole step"]
            listed = ("encoder", "keys+bridge", "decoder", "output+loss", "optimizer")
            times["sum of parts"] = sum(times[name] for name in listed)
            times["attention (decoder - zero-cost)"] = (
                times["decoder"] - times["decoder, zero-cost attention"]
            )
            for name, ms in times.items():
                gflop = flops.get(name)
                rate = f"{gflop / ms * 1e3:.0f}" if gflop else ""
                print(
                    f"| {size.hidden}, {size.length}, {size.batch} | {decoder} | {name} | "
                    f"{ms:.0f} | {ms / whole:.0%} | {f'{gflop:.1f}' if gflop else ''} | {rate} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
