"""Training tokens/s of the Seq2Seq model per attention backend, side by side in one run.

    python bench/train_throughput.py                       # both decoders, both sizes, all providers
    python bench/train_throughput.py --sizes small --steps 5 --providers fused,reference,zero

Providers:
    reference   the plain PyTorch attention (builds the [B, Tq, Tk, H] tensor)
    fused       the fused op (C++ on CPU, Triton on CUDA)
    compile     torch.compile of the whole model (fused op inside; RNN layers stay ATen calls)
    zero        the same model with an attention that costs nothing (context = mean of the
                encoder states, no scores): the upper bound any attention kernel can reach

One training step = forward, loss, backward, AdamW step on a full batch (every row at full length,
tokens = batch * target length). Prints a markdown table: median tokens/s over ``--steps`` timed
steps after ``--warmup`` untimed ones, the step time, fused as a share of the zero-cost bound, and
gnmt tokens/s over bahdanau tokens/s per backend. Compile time is reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from seq2seq_fast.models import Seq2Seq, Seq2SeqConfig, sequence_loss
from seq2seq_fast.ops import fused_unavailable_reason

PROVIDERS = ("reference", "fused", "compile", "zero")


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    length: int
    batch: int


SIZES = {
    "small": Size("small", hidden=256, length=30, batch=64),
    "large": Size("large", hidden=512, length=50, batch=64),
}


class ZeroCostAttention(nn.Module):
    """Stand-in with BahdanauAttention's call convention whose work is negligible: context = mean
    of the values over valid positions (keeps gradients flowing to the encoder), weights = 0."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original  # keeps the parameter count identical

    def project_keys(self, keys: Tensor) -> Tensor:
        return keys[..., :1]

    def forward(self, query, keys, values=None, *, lengths=None, mask=None, projected_keys=None):
        values = keys if values is None else values
        context = values.mean(1)
        weights = values.new_zeros(values.shape[0], values.shape[1])
        if query.dim() == 3:
            t = query.shape[1]
            context = context.unsqueeze(1).expand(-1, t, -1)
            weights = weights.unsqueeze(1).expand(-1, t, -1)
        return context, weights


def make_step(provider: str, decoder: str, size: Size, vocab: int, device: str):
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        embed_size=size.hidden,
        hidden_size=size.hidden,
        decoder=decoder,
        backend="reference" if provider == "reference" else "fused",
    )
    model = Seq2Seq(config).to(device).train()
    if provider == "zero":
        model.decoder.attention = ZeroCostAttention(model.decoder.attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model) if provider == "compile" else model
    gen = torch.Generator().manual_seed(0)
    shape = (size.batch, size.length)
    src = torch.randint(4, vocab, shape, generator=gen).to(device)
    tgt_in = torch.randint(4, vocab, shape, generator=gen).to(device)
    tgt_out = torch.randint(4, vocab, shape, generator=gen).to(device)
    lengths = torch.full((size.batch,), size.length, dtype=torch.long, device=device)

    def step() -> float:
        logits, _ = run(src, lengths, tgt_in)
        loss = sequence_loss(logits, tgt_out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def measure(step, steps: int, warmup: int, device: str) -> tuple[float, float, list[float]]:
    """-> (first-call seconds, median step seconds, all timed step seconds)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large", help="small (256, 30), large (512, 50)")
    parser.add_argument("--decoders", default="gnmt,bahdanau")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--vocab", type=int, default=1000, help="source and target vocabulary")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    providers = [p for p in args.providers.split(",") if p]
    fused_reason = fused_unavailable_reason(args.device, torch.float32)
    if fused_reason is not None:
        print(f"note: no fused kernel ({fused_reason}); fused/compile/zero use the reference")
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"vocab {args.vocab}, embed = hidden, GRU, bidirectional 1-layer encoder, 1-layer decoder, "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    rows = []
    results: dict[tuple[str, str, str], float] = {}
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        for decoder in args.decoders.split(","):
            for provider in providers:
                step = make_step(provider, decoder, size, args.vocab, args.device)
                first, median, _ = measure(step, args.steps, args.warmup, args.device)
                tokens = size.batch * size.length
                results[(size_name, decoder, provider)] = tokens / median
                rows.append((size, decoder, provider, tokens / median, median, first))
                print(
                    f"  {size_name} {decoder:8s} {provider:9s} {tokens / median:9.0f} tok/s "
                    f"({median * 1e3:.0f} ms/step, first call {first:.1f} s)",
                    flush=True,
                )
    print()
    print("| hidden, length, batch | decoder | backend | tokens/s | ms/step | of zero-cost bound |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for size, decoder, provider, rate, median, first in rows:
        bound = results.get((size.name, decoder, "zero"))
        share = f"{rate / bound:.0%}" if bound else "-"
        note = f" (compile {first:.0f} s)" if provider == "compile" else ""
        print(
            f"| {size.hidden}, {size.length}, {size.batch} | {decoder} | {provider}{note} | "
            f"{rate:,.0f} | {median * 1e3:.0f} | {share} |"
        )
    print()
    for size_name in args.sizes.split(","):
        for provider in providers:
            g = results.get((size_name, "gnmt", provider))
            b = results.get((size_name, "bahdanau", provider))
            if g and b:
                print(f"{size_name} {provider}: gnmt / bahdanau tokens/s = {g / b:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
