"""Training tokens/s of the Seq2Seq model per attention backend, side by side in one run.

    python -m bench.train_throughput                   # both decoders, small and large, all providers
    python -m bench.train_throughput --sizes small --steps 5 --providers fused,reference,zero

Providers:
    reference   the plain PyTorch attention (builds the [B, Tq, Tk, H] tensor)
    fused       the fused op (C++ on CPU, Triton on CUDA)
    compile     torch.compile of the whole model as one graph (fused op and RNN layers inside)
    zero        the same model with an attention that costs nothing (context = mean of the
                encoder states, no scores): the upper bound any attention kernel can reach

Sizes are ``bench.shapes.TRAIN_SIZES`` (tiny, small, large). One training step = forward, loss,
backward, AdamW step on a full batch (every row at full length, tokens = batch * target length).
Timed with ``bench.timing.time_interleaved`` (one step per sample, providers round-robin, so a
changing machine load hits them alike). Prints a markdown table: median tokens/s, tokens per
CPU-second of this process (robust to other jobs when --threads 1), the step time, the share of the
zero-cost bound, and gnmt over bahdanau tokens/s per backend. The first call (compile time for
``compile``) is reported separately.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import Tensor, nn

from bench.shapes import TRAIN_SIZES, TrainSize
from bench.timing import time_interleaved
from seq2seq_fast.ops import fused_unavailable_reason
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, compile_model, sequence_loss

PROVIDERS = ("reference", "fused", "compile", "zero")


class _NoQueryProjection(nn.Module):
    """Stands in for the query projection: a weight with no rows, so a decoder that stacks it on
    another matrix product (the bahdanau decoder's [W_hh; W_q]) does no extra work."""

    def __init__(self, query_size: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0, query_size), persistent=False)

    def forward(self, query: Tensor) -> Tensor:
        return query[..., :0]


class ZeroCostAttention(nn.Module):
    """Stand-in with BahdanauAttention's call convention whose work is negligible: context = mean
    of the values over all positions (keeps gradients flowing to the encoder), weights = 0; no key
    or query projection, no scores."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original  # keeps the parameter count identical
        self.query_proj = _NoQueryProjection(original.query_size)
        self.backend = "reference"  # no fused kernel (and no stepwise memory) behind this one
        self._last: tuple[Tensor, Tensor] | None = None

    def project_keys(self, keys: Tensor) -> Tensor:
        return keys[..., :1]

    def score_vector(self) -> tuple[None, None]:
        return None, None

    def forward(self, query, keys, values=None, *, lengths=None, mask=None, projected_keys=None):
        values = keys if values is None else values
        return self.attend_projected(query, projected_keys, values)

    def attend_projected(
        self,
        query,
        projected_keys,
        values,
        *,
        lengths=None,
        mask=None,
        score_vector=None,
        stepwise=None,
    ):
        # The mean once per sequence (a step-by-step decoder passes the same values every step),
        # so that the steps do not each add a [B, S, D] gradient: nothing here costs per step.
        if self._last is not None and self._last[0] is values:
            context = self._last[1]
        else:
            context = values.mean(1)
            self._last = (values, context)
        weights = values.new_zeros(values.shape[0], values.shape[1])
        if query.dim() == 3:
            t = query.shape[1]
            context = context.unsqueeze(1).expand(-1, t, -1)
            weights = weights.unsqueeze(1).expand(-1, t, -1)
        return context, weights


def make_step(
    provider: str,
    decoder: str,
    size: TrainSize,
    device: str,
    cell: str = "gru",
    vocab: int | None = None,
):
    """A zero-argument training step (returns the loss) of a fresh model; ``vocab`` overrides
    ``size.vocab`` for source and target."""
    torch.manual_seed(0)
    vocab = size.vocab if vocab is None else vocab
    config = Seq2SeqConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        embed_size=size.hidden,
        hidden_size=size.hidden,
        decoder=decoder,
        cell=cell,
        backend="reference" if provider == "reference" else "fused",
    )
    model = Seq2Seq(config).to(device).train()
    if provider == "zero":
        model.decoder.attention = ZeroCostAttention(model.decoder.attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as train.py
    run = compile_model(model) if provider == "compile" else model
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
        return float(loss.detach())

    return step


Row = tuple[TrainSize, str, str, float, float, float, float]


def measure(args: argparse.Namespace) -> list[Row]:
    """(size, decoder, provider, tokens/s wall, tokens/CPU-s, step s, first call s) per case."""
    providers = [p for p in args.providers.split(",") if p]
    rows = []
    for size_name in args.sizes.split(","):
        size = TRAIN_SIZES[size_name]
        tokens = size.batch * size.length
        for decoder in args.decoders.split(","):
            steps = {
                p: make_step(p, decoder, size, args.device, args.cell, args.vocab)
                for p in providers
            }
            samples = time_interleaved(steps, args.device, args.steps, warmup=args.warmup)
            for provider in providers:
                s = samples[provider]
                wall, cpu = statistics.median(s.wall_s), statistics.median(s.cpu_s)
                rows.append((size, decoder, provider, tokens / wall, tokens / cpu, wall, s.first_s))
                print(
                    f"  {size_name} {decoder:8s} {provider:9s} {tokens / wall:9.0f} tok/s "
                    f"({wall * 1e3:.0f} ms/step wall, {cpu * 1e3:.0f} ms CPU; first call "
                    f"{s.first_s:.1f} s)",
                    flush=True,
                )
            del steps
    return rows


def print_tables(rows: list[Row]) -> None:
    print()
    print(
        "| hidden, length, batch | decoder | backend | tokens/s (wall) | tokens/CPU-s | ms/step "
        "| of zero-cost bound (wall / CPU) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    rates = {(r[0].name, r[1], r[2]): r[3] for r in rows}
    cpu_rates = {(r[0].name, r[1], r[2]): r[4] for r in rows}
    for size, decoder, provider, rate, cpu_rate, wall, first in rows:
        bound = rates.get((size.name, decoder, "zero"))
        cpu_bound = cpu_rates.get((size.name, decoder, "zero"))
        share = f"{rate / bound:.0%} / {cpu_rate / cpu_bound:.0%}" if bound else "-"
        note = f" (compile {first:.0f} s)" if provider == "compile" else ""
        print(
            f"| {size.hidden}, {size.length}, {size.batch} | {decoder} | {provider}{note} | "
            f"{rate:,.0f} | {cpu_rate:,.0f} | {wall * 1e3:.0f} | {share} |"
        )
    print()
    for size_name, _, provider in dict.fromkeys((k[0], "", k[2]) for k in rates):
        g, b = (
            rates.get((size_name, "gnmt", provider)),
            rates.get((size_name, "bahdanau", provider)),
        )
        gc, bc = (cpu_rates.get((size_name, d, provider)) for d in ("gnmt", "bahdanau"))
        if g and b:
            print(
                f"{size_name} {provider}: gnmt / bahdanau tokens/s = {g / b:.2f}x wall, "
                f"{gc / bc:.2f}x CPU"
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large", help=f"of {sorted(TRAIN_SIZES)}")
    parser.add_argument("--decoders", default="gnmt,bahdanau")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--vocab", type=int, default=None, help="default: the size's (1000)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cell", default="gru", choices=("gru", "lstm"), help="RNN cell type")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fused_reason = fused_unavailable_reason(args.device, torch.float32)
    if fused_reason is not None:
        print(f"note: no fused kernel ({fused_reason}); fused/compile/zero use the reference")
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"vocab {args.vocab or 'per size'}, embed = hidden, {args.cell.upper()}, bidirectional "
        f"1-layer encoder, 1-layer decoder, median of {args.steps} steps after {args.warmup} "
        "warm-up"
    )
    print_tables(measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
