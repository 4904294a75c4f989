"""Training tokens/s of the Seq2Seq model per attention backend, side by side in one run.

    python bench/train_throughput.py                       # both decoders, both sizes, all providers
    python bench/train_throughput.py --sizes small --steps 5 --providers fused,reference,zero

Providers:
    reference   the plain PyTorch attention (builds the [B, Tq, Tk, H] tensor)
    fused       the fused op (C++ on CPU, Triton on CUDA)
    compile     torch.compile of the whole model as one graph (fused op and RNN layers inside)
    zero        the same model with an attention that costs nothing (context = mean of the
                encoder states, no scores): the upper bound any attention kernel can reach

One training step = forward, loss, backward, AdamW step on a full batch (every row at full length,
tokens = batch * target length). Prints a markdown table: median tokens/s over ``--steps`` timed
steps after ``--warmup`` untimed ones (providers timed round-robin, so changing machine load hits
them alike), tokens per CPU-second of this process (robust to other jobs when --threads 1), the
step time, the share of the zero-cost bound, and gnmt over bahdanau tokens/s per backend. The first
call (compile time for ``compile``) is reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from seq2seq_fast.ops.additive_attention import fused_unavailable_reason
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, compile_model, sequence_loss

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

    def attend_projected(self, query, projected_keys, values, *, lengths=None, mask=None,
                         score_vector=None, stepwise=None):  # fmt: skip
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


def make_step(provider: str, decoder: str, size: Size, vocab: int, device: str, cell: str = "gru"):
    torch.manual_seed(0)
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


def measure_interleaved(steps: dict, count: int, warmup: int, device: str):
    """Time the providers' steps round-robin (one step each per round), so a machine whose load
    changes during the run slows them alike. -> {provider: (first-call s, median wall s,
    median CPU s of this process)}."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    first = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        sync()
        first[name] = time.perf_counter() - start
        for _ in range(max(0, warmup - 1)):
            step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            sync()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {
        name: (first[name], statistics.median(wall[name]), statistics.median(cpu[name]))
        for name in steps
    }


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
    parser.add_argument("--cell", default="gru", choices=("gru", "lstm"), help="RNN cell type")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    providers = [p for p in args.providers.split(",") if p]
    fused_reason = fused_unavailable_reason(args.device, torch.float32)
    if fused_reason is not None:
        print(f"note: no fused kernel ({fused_reason}); fused/compile/zero use the reference")
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"vocab {args.vocab}, embed = hidden, {args.cell.upper()}, bidirectional 1-layer encoder, 1-layer decoder, "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    rows = []
    results: dict[tuple[str, str, str], float] = {}
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        tokens = size.batch * size.length
        for decoder in args.decoders.split(","):
            steps = {
                p: make_step(p, decoder, size, args.vocab, args.device, args.cell)
                for p in providers
            }
            timings = measure_interleaved(steps, args.steps, args.warmup, args.device)
            for provider in providers:
                first, wall, cpu = timings[provider]
                results[(size_name, decoder, provider)] = tokens / wall
                rows.append((size, decoder, provider, tokens / wall, tokens / cpu, wall, first))
                print(
                    f"  {size_name} {decoder:8s} {provider:9s} {tokens / wall:9.0f} tok/s "
                    f"({wall * 1e3:.0f} ms/step wall, {cpu * 1e3:.0f} ms CPU; first call "
                    f"{first:.1f} s)",
                    flush=True,
                )
            del steps
    print()
    print(
        "| hidden, length, batch | decoder | backend | tokens/s (wall) | tokens/CPU-s | ms/step "
        "| of zero-cost bound (wall / CPU) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    cpu_rates = {(r[0].name, r[1], r[2]): r[4] for r in rows}
    for size, decoder, provider, rate, cpu_rate, wall, first in rows:
        bound = results.get((size.name, decoder, "zero"))
        cpu_bound = cpu_rates.get((size.name, decoder, "zero"))
        share = f"{rate / bound:.0%} / {cpu_rate / cpu_bound:.0%}" if bound else "-"
        note = f" (compile {first:.0f} s)" if provider == "compile" else ""
        print(
            f"| {size.hidden}, {size.length}, {size.batch} | {decoder} | {provider}{note} | "
            f"{rate:,.0f} | {cpu_rate:,.0f} | {wall * 1e3:.0f} | {share} |"
        )
    print()
    for size_name in args.sizes.split(","):
        for provider in providers:
            g = results.get((size_name, "gnmt", provider))
            b = results.get((size_name, "bahdanau", provider))
            gc = cpu_rates.get((size_name, "gnmt", provider))
            bc = cpu_rates.get((size_name, "bahdanau", provider))
            if g and b:
                print(
                    f"{size_name} {provider}: gnmt / bahdanau tokens/s = {g / b:.2f}x wall, "
                    f"{gc / bc:.2f}x CPU"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
