"""bf16 against fp32 on this CPU, side by side in one process.

    python -m bench.bench_bf16                          # small training size, quick op shapes
    python -m bench.bench_bf16 --size tiny --op-size tiny --rounds 2   # what CI runs

Prints four markdown tables:

    hardware     whether the CPU has native bf16 products (oneDNN's check, AVX512-BF16, AMX) and
                 which instruction set the extension's kernels run
    training     a whole Seq2Seq training step and its parts (encoder, decoder, output+loss,
                 optimizer; bench/train_step_profile.py's split), fp32 and ``--precision bf16``
                 (autocast with fp32 master weights, seq2seq_fast/seq2seq/precision.py), median ms
                 and the bf16/fp32 time ratio (below 1: bf16 is faster)
    conversion   the dtype casts of one bf16 step (torch.profiler): the share of the step's CPU
                 time in ``aten::copy_`` calls that change dtype, and the bytes they read and write
    op           the fused attention op at the harness shapes (bench/shapes.py), forward and
                 forward+backward: median ms in fp32 and bf16, their ratio, and each one's extra
                 memory beyond inputs and outputs (bench/harness.py's measure)

Times are medians of ``bench.timing.time_interleaved`` (fp32 and bf16 calls interleaved round by
round, so a co-running job slows both alike), by wall clock or, with ``--clock cpu``, by this
process's CPU time (with ``--threads 1``: robust to other jobs on the machine). Nothing here decides anything: on a CPU without
native bf16 products ``--precision bf16`` trains in fp32 (with its message), and the table then
shows what bf16 would cost there.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import make_call, make_case, peak_extra_bytes
from bench.shapes import CPU_SHAPES, TINY_SHAPES, TRAIN_SIZES, TrainSize
from bench.timing import time_interleaved
from seq2seq_fast.ops.linear_cross_entropy import linear_cross_entropy
from seq2seq_fast.seq2seq.data.vocab import PAD_ID
from seq2seq_fast.seq2seq.models import Memory, Seq2Seq, Seq2SeqConfig
from seq2seq_fast.seq2seq.precision import conversion_profile

BF16 = torch.bfloat16
PARTS = ("whole step", "encoder", "decoder", "output+loss", "optimizer")


def hardware() -> dict[str, Any]:
    """What this CPU offers for bf16, and the kernels' instruction set."""
    mkldnn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        isa = torch.ops.seq2seq_fast._cpu_isa()
    except (AttributeError, RuntimeError):
        isa = "extension not loaded"
    from seq2seq_fast.seq2seq.builders import bf16_unavailable_reason

    return {
        "native bf16 products (oneDNN)": bool(mkldnn()) if mkldnn else None,
        "AVX512-BF16": bool(avx512_bf16()) if avx512_bf16 else None,
        "AMX": bool(amx()) if amx else None,
        "--precision bf16 trains in bf16": bf16_unavailable_reason(torch.device("cpu")) or "yes",
        "kernel instruction set (_C)": isa,
    }


def _model(size: TrainSize, decoder: str, seed: int = 0) -> Seq2Seq:
    torch.manual_seed(seed)
    config = Seq2SeqConfig(
        src_vocab_size=size.vocab,
        tgt_vocab_size=size.vocab,
        embed_size=size.hidden,
        hidden_size=size.hidden,
        decoder=decoder,
        backend="fused",
    )
    return Seq2Seq(config).train()


def step_parts(size: TrainSize, decoder: str, autocast: bool) -> dict[str, Callable[[], None]]:
    """One training step and its parts as calls (each part a forward and a backward on detached
    inputs), with the forward under bf16 autocast when ``autocast``."""
    model = _model(size, decoder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    shape = (size.batch, size.length)
    src, tgt_in, tgt_out = (torch.randint(4, size.vocab, shape, generator=gen) for _ in range(3))
    lengths = torch.full((size.batch,), size.length, dtype=torch.long)

    def cast():
        return torch.autocast("cpu", dtype=BF16, enabled=autocast)

    def step() -> None:  # as seq2seq/train.py's train_step: output layer + loss fused
        with cast():
            loss = model(src, lengths, tgt_in, tgt_out)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def encoder() -> None:
        with cast():
            outputs, summary = model.encoder(src, lengths)
        (outputs.float().sum() + summary.float().sum()).backward()

    with torch.no_grad(), cast():
        outputs, summary = model.encoder(src, lengths)
        keys = model.attention.project_keys(outputs)
        state = torch.tanh(model.bridge(summary))
        start = state
        without_output = _without_output(model)
        features = without_output(tgt_in, (start,), Memory(outputs, keys, lengths))[0]

    def decoder_part() -> None:
        memory = Memory(outputs, keys.detach().requires_grad_(True), lengths)
        h = state.detach().requires_grad_(True)
        with cast():
            out = without_output(tgt_in, (h,), memory)[0]
        out.float().sum().backward()

    features = features.detach().requires_grad_(True)

    def output_loss() -> None:
        output = model.decoder.output
        with cast():
            loss = linear_cross_entropy(
                features, output.weight, output.bias, tgt_out, ignore_index=PAD_ID
            )
        loss.backward()

    step()  # the optimizer's state exists from here on
    return {
        "whole step": step,
        "encoder": encoder,
        "decoder": decoder_part,
        "output+loss": output_loss,
        "optimizer": optimizer.step,
    }


def _without_output(model: Seq2Seq) -> torch.nn.Module:
    """The model's decoder (its parameters shared) returning the output layer's input."""
    import copy

    decoder = copy.copy(model.decoder)
    decoder._modules = dict(model.decoder._modules)
    decoder.output = torch.nn.Identity()
    return decoder


def training_table(
    size: TrainSize, decoder: str, rounds: int, clock: str = "wall"
) -> list[dict[str, Any]]:
    calls = {}
    for precision, autocast in (("fp32", False), ("bf16", True)):
        for name, call in step_parts(size, decoder, autocast).items():
            calls[(name, precision)] = call
    keyed = {f"{name}|{precision}": call for (name, precision), call in calls.items()}
    samples = time_interleaved(keyed, "cpu", rounds, warmup=1)
    rows = []
    for name in PARTS:
        fp32 = getattr(samples[f"{name}|fp32"], f"{clock}_s")
        bf16 = getattr(samples[f"{name}|bf16"], f"{clock}_s")
        ratio = statistics.median(b / f for b, f in zip(bf16, fp32, strict=True))
        rows.append(
            {
                "part": name,
                "fp32_ms": statistics.median(fp32) * 1e3,
                "bf16_ms": statistics.median(bf16) * 1e3,
                "ratio": ratio,
            }
        )
    return rows


def conversion_share(size: TrainSize, decoder: str) -> dict[str, float]:
    """The dtype casts of one bf16 training step (seq2seq_fast.seq2seq.precision's measure)."""
    step = step_parts(size, decoder, autocast=True)["whole step"]
    step()
    return conversion_profile(step)


def op_table(op_size: str, rounds: int, clock: str = "wall") -> list[dict[str, Any]]:
    shapes = TINY_SHAPES if op_size == "tiny" else CPU_SHAPES
    if op_size == "quick":
        shapes = tuple(s for s in CPU_SHAPES if s.name in ("small-train", "decode-step/8"))
    rows = []
    for shape in shapes:
        for mode in ("forward", "forward+backward"):
            calls = {}
            for dtype in (torch.float32, BF16):
                case = make_case(shape, "cpu", dtype, seed=0)
                calls[str(dtype)] = make_call("fused", mode, case)
            samples = time_interleaved(calls, "cpu", rounds, min_sample_s=0.02, warmup=2)
            fp32 = getattr(samples[str(torch.float32)], f"{clock}_s")
            bf16 = getattr(samples[str(BF16)], f"{clock}_s")
            rows.append(
                {
                    "shape": shape.name,
                    "mode": mode,
                    "fp32_ms": statistics.median(fp32) * 1e3,
                    "bf16_ms": statistics.median(bf16) * 1e3,
                    "ratio": statistics.median(b / f for b, f in zip(bf16, fp32, strict=True)),
                    "fp32_extra": peak_extra_bytes(calls[str(torch.float32)], "cpu"),
                    "bf16_extra": peak_extra_bytes(calls[str(BF16)], "cpu"),
                }
            )
    return rows


def _bytes(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_bf16", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--size", default="small", choices=sorted(TRAIN_SIZES))
    parser.add_argument("--decoder", default="bahdanau", choices=("bahdanau", "gnmt"))
    parser.add_argument("--op-size", default="quick", choices=("tiny", "quick", "full"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall clock, or this process's CPU time (with --threads 1 on a machine shared with "
        "other jobs)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = TRAIN_SIZES[args.size]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock, "
        f"median of {args.rounds} interleaved rounds; ratio = bf16 time / fp32 time"
    )
    print("\n## hardware\n\n| what | value |\n| --- | --- |")
    for key, value in hardware().items():
        print(f"| {key} | {value} |")
    print(f"\n## training ({size.label}, decoder {args.decoder})\n")
    print("| part | fp32 ms | bf16 ms | bf16/fp32 |\n| --- | ---: | ---: | ---: |")
    for row in training_table(size, args.decoder, args.rounds, args.clock):
        print(
            f"| {row['part']} | {row['fp32_ms']:.2f} | {row['bf16_ms']:.2f} | {row['ratio']:.2f} |",
            flush=True,
        )
    conv = conversion_share(size, args.decoder)
    print("\n## conversion (one bf16 step, torch.profiler)\n")
    print("| what | value |\n| --- | ---: |")
    print(f"| dtype-changing aten::copy_ share of step CPU time | {conv['cast_share']:.1%} |")
    print(f"| dtype-changing aten::copy_ calls | {conv['casts']} |")
    print(f"| MiB read + written by them | {conv['cast_bytes'] / 2**20:.1f} |")
    print(f"| all aten::copy_ share | {conv['copy_share']:.1%} |")
    print(f"| step CPU self time ms | {conv['step_ms']:.1f} |")
    print(f"\n## op (fused additive attention, {args.op_size} shapes)\n")
    print(
        "| shape | mode | fp32 ms | bf16 ms | bf16/fp32 | fp32 extra memory | "
        "bf16 extra memory |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for row in op_table(args.op_size, args.rounds, args.clock):
        print(
            f"| {row['shape']} | {row['mode']} | {row['fp32_ms']:.3f} | {row['bf16_ms']:.3f} | "
            f"{row['ratio']:.2f} | {_bytes(row['fp32_extra'])} | {_bytes(row['bf16_extra'])} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
