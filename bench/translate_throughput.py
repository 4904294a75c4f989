"""Translation throughput of the whole ``seq2seq-fast translate`` command, start-up included.

    python -m bench.translate_throughput --checkpoint runs/translate/model.pt \\
        --corpus PATH/fra-eng.zip [--sentences 1000] [--threads 1,2] [--beams 1,5] \\
        [--backends fused,reference] [--rounds 2] [--check-exact] [--json out.json]

Each configuration (beam, threads, attention backend) runs the real command in a fresh process on
the same input file (``--input FILE``, or ``--corpus``: ``--sentences`` source sentences of
``--min-words`` to ``--max-words`` words drawn with a fixed seed from a tab-separated corpus or a
.zip holding one), configurations interleaved round by round so that a co-runner hits them alike.
Reported per configuration: the median wall time (and the part after start-up and loading, from
the command's closing line), the process's CPU time (user + system: on one thread, what the wall
time would be on an idle machine; ``--threads N`` runs N one-thread workers, each decoding its
own batches, so the CPU time is close to N times the wall time of the decoding), sentences/s
and output tokens/s over the wall time, the start-up alone (an empty input), and the per-round
ratios reference/fused and 1/2 threads.
``--check-exact`` also runs each beam one sentence at a time (``--batch-size 1``) and counts the
lines that differ from the batched output (expected: none).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import CoRunnerMeter, format_machine, load_average, machine_info

CLOSING_LINE = re.compile(r"(\d+) sentences, (\d+) tokens in ([0-9.]+) s")


def sample_sentences(corpus: Path, count: int, min_words: int, max_words: int, seed: int = 0):
    """``count`` distinct first-column sentences of min..max words, drawn with a fixed seed."""
    from seq2seq_fast.seq2seq.data.corpus import read_parallel_corpus

    pairs, _ = read_parallel_corpus(corpus)
    sources = sorted({s for s, _ in pairs if min_words <= len(s.split()) <= max_words})
    if len(sources) < count:
        raise SystemExit(
            f"{corpus}: only {len(sources)} sentences of {min_words}-{max_words} words"
        )
    return random.Random(seed).sample(sources, count)


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(args: argparse.Namespace, source: Path, output: Path, **options) -> dict:
    """One ``seq2seq-fast translate`` process: -> wall seconds, the command's own translation
    seconds (its closing line: after start-up and loading), sentences and output tokens."""
    command = [
        sys.executable,
        "-m",
        "seq2seq_fast",
        "translate",
        "--checkpoint",
        args.checkpoint,
        "--input",
        str(source),
        "--output",
        str(output),
        "--no-progress",
        "--device",
        args.device,
    ]
    batch_size = options.get("batch_size", args.batch_size)
    if batch_size is not None:  # else the command's default (~320 decoder rows)
        command += ["--batch-size", str(batch_size)]
    for name in ("beam", "threads", "backend"):
        command += [f"--{name}", str(options[name])]
    cpu_before = _children_cpu_seconds()
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    cpu_seconds = _children_cpu_seconds() - cpu_before
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    match = CLOSING_LINE.search(proc.stderr)
    if match is None:
        raise SystemExit(f"no closing line in the output of {' '.join(command)}")
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "translate_seconds": float(match.group(3)),
        "sentences": int(match.group(1)),
        "tokens": int(match.group(2)),
    }


def configurations(args: argparse.Namespace) -> list[dict]:
    return [
        {"beam": beam, "threads": threads, "backend": backend}
        for beam in args.beams
        for threads in args.threads
        for backend in args.backends
    ]


def key(config: dict) -> str:
    return f"beam {config['beam']}, {config['threads']} thread(s), {config['backend']}"


def measure(args: argparse.Namespace, source: Path, folder: Path) -> dict:
    """All configurations, ``rounds`` times, order rotated each round; and the start-up alone."""
    configs = configurations(args)
    times: dict[str, list[dict]] = {key(c): [] for c in configs}
    empty = folder / "empty.txt"
    empty.write_text("")
    startup = []
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            output = folder / f"out-{config['beam']}-{config['threads']}-{config['backend']}.txt"
            times[key(config)].append(run_command(args, source, output, **config))
            print(f"  {key(config)}: {times[key(config)][-1]['seconds']:.2f} s", file=sys.stderr)
        probe = dict(beam=1, threads=args.threads[-1], backend=args.backends[0])
        startup.append(run_command(args, empty, folder / "empty.out", **probe)["seconds"])
    return {"runs": times, "startup_s": startup}


def check_exact(args: argparse.Namespace, source: Path, folder: Path) -> dict[str, dict]:
    """Per beam: one sentence at a time (``--batch-size 1``, the first thread count and
    backend): its run and the number of lines that differ from the batched output."""
    out = {}
    for beam in args.beams:
        config = dict(beam=beam, threads=args.threads[0], backend=args.backends[0])
        batched = folder / f"out-{beam}-{config['threads']}-{config['backend']}.txt"
        alone = folder / f"alone-{beam}.txt"
        run = run_command(args, source, alone, batch_size=1, **config)
        a, b = alone.read_text().split("\n"), batched.read_text().split("\n")
        run["differing_lines"] = sum(x != y for x, y in zip(a, b, strict=True))
        out[f"{key(config)}, batch size 1"] = run
    return out


def ratios(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, float]:
    """Median per-round time ratios: reference/fused (same beam, threads), 1/2 threads (same
    beam, backend); > 1 means the second is faster."""
    out = {}
    for c in configurations(args):
        for field, slower in (("backend", "reference"), ("threads", 1)):
            if c[field] == slower:
                continue
            base = dict(c, **{field: slower})
            if key(base) in runs:
                per_round = [
                    s["seconds"] / f["seconds"]
                    for s, f in zip(runs[key(base)], runs[key(c)], strict=True)
                ]
                out[f"{key(base)} / {key(c)}"] = round(statistics.median(per_round), 3)
    return out


def table(result: dict) -> str:
    lines = [
        "| configuration | wall s (median) | of which translating | CPU s | sentences/s "
        "| tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in result["runs"].items():
        seconds = statistics.median(r["seconds"] for r in runs)
        translating = statistics.median(r["translate_seconds"] for r in runs)
        cpu = statistics.median(r["cpu_seconds"] for r in runs)
        sentences, tokens = runs[0]["sentences"], runs[0]["tokens"]
        lines.append(
            f"| {name} | {seconds:.2f} | {translating:.2f} | {cpu:.2f} "
            f"| {sentences / seconds:.0f} | {tokens / seconds:,.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--input", help="sentences, one a line (instead of --corpus)")
    p.add_argument("--corpus", help="parallel corpus (.tsv/.txt or .zip) to draw sentences from")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--min-words", type=int, default=11)
    p.add_argument("--max-words", type=int, default=15)
    p.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--beams", default="1,5", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--backends", default="fused,reference", type=lambda s: s.split(","))
    p.add_argument("--batch-size", type=int, help="default: the command's (320 // beam)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--check-exact", action="store_true")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if (args.input is None) == (args.corpus is None):
        p.error("give exactly one of --input and --corpus")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    info = machine_info(args.device)
    meter = CoRunnerMeter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = Path(args.input) if args.input else folder / "source.txt"
        if args.corpus:
            sentences = sample_sentences(
                Path(args.corpus), args.sentences, args.min_words, args.max_words
            )
            source.write_text("\n".join(sentences) + "\n", encoding="utf-8")
        words = [len(line.split()) for line in source.read_text(encoding="utf-8").splitlines()]
        result = measure(args, source, folder)
        if args.check_exact:
            result["one_at_a_time"] = check_exact(args, source, folder)
    info["load_average_at_end"] = load_average()
    info["other_processes_busy_cores"] = meter.stop()
    result["ratios"] = ratios(result["runs"], args)
    result["input"] = {"sentences": len(words), "mean_words": statistics.mean(words)}
    print(format_machine(info))
    print(
        f"- input: {len(words)} sentences, {statistics.mean(words):.1f} words on average; "
        f"batch size {args.batch_size or 'the default, 320 // beam'}; start-up alone (empty input): "
        f"{statistics.median(result['startup_s']):.2f} s"
    )
    print(table(result))
    for name, value in result["ratios"].items():
        print(f"- {name}: {value}x")
    for name, run in result.get("one_at_a_time", {}).items():
        print(
            f"- {name}: {run['seconds']:.2f} s; lines differing from the batched output: "
            f"{run['differing_lines']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, **result}, indent=1))


if __name__ == "__main__":
    main()
