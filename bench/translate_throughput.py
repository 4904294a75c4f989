"""Translation throughput of the whole ``seq2seq-fast translate`` command, start-up included.

    python -m bench.translate_throughput --checkpoint runs/translate/model.pt \\
        --corpus PATH/fra-eng.zip --test-split [--sentences 1000] [--precisions fp32,bf16,int8] \\
        [--threads 1,2] [--beams 1,5] [--backends fused] [--baseline-tree PATH] [--rounds 2] \\
        [--check-exact] [--json out.json]
    python -m bench.translate_throughput --checkpoint OURS.pt --corpus PATH/fra-eng.zip \\
        --opennmt ONMT.pt [--opennmt-work /tmp/peer_opennmt] --precisions fp32

Each configuration (precision, beam, threads, attention backend) runs the real command in a
fresh process on the same input file (``--input FILE`` with ``--references FILE``, or
``--corpus``: ``--sentences`` source sentences drawn with a fixed seed from a tab-separated
corpus or a .zip holding one: with ``--test-split`` from the held-out test split that ``train``
carves (its default fractions and seed) with their references, else of ``--min-words`` to
``--max-words`` words from all of it), configurations interleaved round by round so that a
co-runner hits them alike. With references, each configuration's output is scored (sacreBLEU).
``--baseline-tree PATH`` runs the float32 configurations of another source tree too (e.g. a
worktree of the baseline commit), in the same rounds: the ratios of sentences/s past start-up
(the command's own translating time) say what changed.
Reported per configuration: the median wall time (and the part after start-up and loading, from
the command's closing line), the process's CPU time (user + system: on one thread, what the wall
time would be on an idle machine; ``--threads N`` runs N one-thread workers, each decoding its
own batches, so the CPU time is close to N times the wall time of the decoding), sentences/s
and output tokens/s over the wall time, the start-up alone (an empty input), and the per-round
ratios reference/fused and 1/2 threads.
``--opennmt MODEL.pt`` also runs OpenNMT-py 3.5's ``onmt_translate`` (same beams and thread
counts, ``OMP_NUM_THREADS``) side by side, in the same rounds, on an OpenNMT-py model trained on
the same data (``python -m bench.peer_opennmt --phase bleu``, which sets OpenNMT-py up in a
scratch virtual environment under ``--opennmt-work`` and trains both tools for equal time). The
input is then that script's test split (``bench.peer_opennmt.prepare_data``: its ``--direction``,
``--max-pairs``, ``--spm-vocab-size``, seed 0): raw text for ours, the same sentences cut into
the subword pieces OpenNMT-py was trained on for ``onmt_translate`` (the cutting and joining of
pieces are not timed: ours does its own inside the command). OpenNMT-py's translating time is its
``-report_time`` line; its output is joined back into text and scored like ours. Ratios
ours/OpenNMT-py of sentences/s (per round, median), whole command and past start-up.
``--check-exact`` also runs each beam one sentence at a time (``--batch-size 1``) and counts the
lines that differ from the batched output (expected: none).
"""

from __future__ import annotations

import argparse
import json
import os
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
BASELINE = "baseline"
ONMT = "opennmt"


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


def test_split_pairs(corpus: Path, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` pairs of the test split ``train --data corpus`` holds out (default fractions
    and seed), drawn with a fixed seed (all of them when ``count`` is 0 or more than there are)."""
    from seq2seq_fast.seq2seq.config import TrainConfig
    from seq2seq_fast.seq2seq.data.corpus import read_parallel_corpus
    from seq2seq_fast.seq2seq.data.split import split_by_source

    defaults = TrainConfig.for_task("translate", data=str(corpus))
    pairs, _ = read_parallel_corpus(corpus, normalization=defaults.normalization)
    _, _, test = split_by_source(
        pairs,
        defaults.valid_fraction,
        defaults.test_fraction,
        defaults.seed,
        defaults.max_held_out,
    )
    if 0 < count < len(test):
        test = random.Random(seed).sample(test, count)
    return test


def bleu(output: Path, references: list[str]) -> float:
    import sacrebleu

    hypotheses = output.read_text(encoding="utf-8").split("\n")[: len(references)]
    return float(sacrebleu.BLEU().corpus_score(hypotheses, [references]).score)


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(args: argparse.Namespace, source: Path, output: Path, **options) -> dict:
    """One ``seq2seq-fast translate`` process: -> wall seconds, the command's own translation
    seconds (its closing line: after start-up and loading), sentences and output tokens."""
    if options.get("precision") == ONMT:
        return run_opennmt(args, output, **options)
    command = [
        sys.executable,
        "-m",
        "seq2seq_fast",
        "translate",
        "--checkpoint",
        *(str(Path(c).resolve()) for c in args.checkpoint),
        "--input",
        str(source.resolve()),
        "--output",
        str(output.resolve()),
        "--no-progress",
        "--device",
        args.device,
    ]
    batch_size = options.get("batch_size", args.batch_size)
    if batch_size is not None:  # else the command's default (~320 decoder rows)
        command += ["--batch-size", str(batch_size)]
    for name in ("beam", "threads", "backend"):
        command += [f"--{name}", str(options[name])]
    env = cwd = None
    if options.get("precision", BASELINE) != BASELINE:
        command += ["--precision", options["precision"]]
    else:  # the baseline tree's code, float32 (it may have no --precision)
        cwd = str(Path(args.baseline_tree).resolve())
        env = dict(os.environ, PYTHONPATH=cwd)
    cpu_before = _children_cpu_seconds()
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
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
        "words": len(output.read_text(encoding="utf-8").split()),
    }


def run_opennmt(args: argparse.Namespace, output: Path, **options) -> dict:
    """One ``onmt_translate`` process on the subword pieces of the input, the same fields as
    ``run_command``; its output joined back into text in ``output``."""
    from bench import peer_opennmt

    pieces = output.with_suffix(".pieces")
    command = peer_opennmt.translate_command(
        args.opennmt_python,
        Path(args.opennmt).resolve(),
        args.opennmt_source,
        pieces,
        beam=options["beam"],
        batch_size=args.opennmt_batch_size,
    )
    env = peer_opennmt._env(options["threads"])
    cpu_before = _children_cpu_seconds()
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    cpu_seconds = _children_cpu_seconds() - cpu_before
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    lines = pieces.read_text(encoding="utf-8").splitlines()
    text = [peer_opennmt.detokenize(line) for line in lines]
    output.write_text("".join(line + "\n" for line in text), encoding="utf-8")
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "translate_seconds": peer_opennmt.translating_seconds(
            proc.stdout + proc.stderr, len(lines)
        ),
        "sentences": len(lines),
        "tokens": sum(len(line.split()) + 1 for line in lines),  # pieces and </s>, as ours counts
        "words": sum(len(line.split()) for line in text),
    }


def configurations(args: argparse.Namespace) -> list[dict]:
    precisions = list(args.precisions) + ([BASELINE] if args.baseline_tree else [])
    ours = [
        {"precision": precision, "beam": beam, "threads": threads, "backend": backend}
        for precision in precisions
        for beam in args.beams
        for threads in args.threads
        for backend in args.backends
    ]
    onmt = [
        {"precision": ONMT, "beam": beam, "threads": threads, "backend": ONMT}
        for beam in args.beams
        for threads in args.threads
    ]
    return ours + (onmt if getattr(args, "opennmt", None) else [])


def peer_opennmt_version() -> str:
    from bench.peer_opennmt import ONMT_VERSION

    return ONMT_VERSION


def key(config: dict) -> str:
    mode = "greedy" if config["beam"] == 1 else f"beam {config['beam']}"
    if config.get("precision") == ONMT:
        return f"OpenNMT-py {peer_opennmt_version()}, {mode}, {config['threads']} thread(s)"
    return (
        f"{config.get('precision', 'fp32')}, {mode}, {config['threads']} thread(s), "
        f"{config['backend']}"
    )


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
            output = folder / ("out-" + key(config).replace(", ", "-").replace(" ", "") + ".txt")
            run = run_command(args, source, output, **config)
            if args.reference_lines:
                run["bleu"] = bleu(output, args.reference_lines)
            times[key(config)].append(run)
            print(f"  {key(config)}: {times[key(config)][-1]['seconds']:.2f} s", file=sys.stderr)
        probe = dict(
            precision=args.precisions[0], beam=1, threads=args.threads[-1], backend=args.backends[0]
        )
        startup.append(run_command(args, empty, folder / "empty.out", **probe)["seconds"])
    return {"runs": times, "startup_s": startup}


def check_exact(args: argparse.Namespace, source: Path, folder: Path) -> dict[str, dict]:
    """Per beam: one sentence at a time (``--batch-size 1``, the first thread count and
    backend): its run and the number of lines that differ from the batched output."""
    out = {}
    for beam in args.beams:
        config = dict(
            precision=args.precisions[0], beam=beam, threads=args.threads[0],
            backend=args.backends[0],
        )  # fmt: skip
        batched = folder / ("out-" + key(config).replace(", ", "-").replace(" ", "") + ".txt")
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
        if c["precision"] == ONMT:
            continue
        for field, slower in (("backend", "reference"), ("threads", 1), ("precision", BASELINE)):
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


def translating_ratios(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, float]:
    """Median per-round ratios of the translating time (past start-up): baseline / this tree,
    for each precision against the baseline's float32 at the same beam, threads and backend."""
    out = {}
    if not args.baseline_tree:
        return out
    for c in configurations(args):
        if c["precision"] in (BASELINE, ONMT):
            continue
        base = key(dict(c, precision=BASELINE))
        per_round = [
            b["translate_seconds"] / f["translate_seconds"]
            for b, f in zip(runs[base], runs[key(c)], strict=True)
        ]
        out[f"{key(c)} vs baseline"] = round(statistics.median(per_round), 2)
    return out


def opennmt_ratios(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, str]:
    """Per precision of ours, beam and threads (our first backend): the median per-round ratio
    ours/OpenNMT-py of sentences/s, whole command (wall) and past start-up (translating)."""
    out = {}
    if not getattr(args, "opennmt", None):
        return out
    for c in configurations(args):
        if c["precision"] in (BASELINE, ONMT) or c["backend"] != args.backends[0]:
            continue
        peer = key({"precision": ONMT, "beam": c["beam"], "threads": c["threads"]})
        # sentences/s ours / OpenNMT-py = OpenNMT-py's seconds / ours (same sentences)
        rounds = list(zip(runs[key(c)], runs[peer], strict=True))
        wall = statistics.median(onmt["seconds"] / us["seconds"] for us, onmt in rounds)
        past = statistics.median(
            onmt["translate_seconds"] / us["translate_seconds"] for us, onmt in rounds
        )
        out[f"{key(c)} / OpenNMT-py"] = f"{wall:.2f}x wall, {past:.2f}x past start-up"
    return out


def table(result: dict) -> str:
    lines = [
        "| configuration | wall s (median) | of which translating | CPU s | sentences/s "
        "(translating) | words/s (translating) | BLEU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in result["runs"].items():
        seconds = statistics.median(r["seconds"] for r in runs)
        translating = statistics.median(r["translate_seconds"] for r in runs)
        cpu = statistics.median(r["cpu_seconds"] for r in runs)
        sentences, words = runs[0]["sentences"], runs[0]["words"]
        score = f"{runs[0]['bleu']:.2f}" if "bleu" in runs[0] else ""
        lines.append(
            f"| {name} | {seconds:.2f} | {translating:.2f} | {cpu:.2f} "
            f"| {sentences / seconds:.0f} ({sentences / translating:.0f}) "
            f"| {words / seconds:,.0f} ({words / translating:,.0f}) | {score} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True, nargs="+", help="several: an ensemble")
    p.add_argument("--input", help="sentences, one a line (instead of --corpus)")
    p.add_argument("--references", help="with --input: their reference translations (BLEU)")
    p.add_argument("--corpus", help="parallel corpus (.tsv/.txt or .zip) to draw sentences from")
    p.add_argument(
        "--test-split",
        action="store_true",
        help="draw from the corpus's held-out test split, with references (--sentences 0: all)",
    )
    p.add_argument(
        "--precisions", default="fp32,bf16,int8", type=lambda s: s.split(","), help="of translate"
    )
    p.add_argument("--baseline-tree", help="also run this source tree's float32 command")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--min-words", type=int, default=11)
    p.add_argument("--max-words", type=int, default=15)
    p.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--beams", default="1,5", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--backends", default="fused", type=lambda s: s.split(","))
    p.add_argument("--batch-size", type=int, help="default: the command's (320 // beam)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--check-exact", action="store_true")
    p.add_argument(
        "--opennmt",
        metavar="MODEL.pt",
        help="also run OpenNMT-py's onmt_translate on this model of its (bench.peer_opennmt)",
    )
    p.add_argument(
        "--opennmt-work",
        default="/tmp/peer_opennmt",
        help="bench.peer_opennmt's --work: its virtual environment (venv/) and data",
    )
    p.add_argument(
        "--opennmt-args",
        default="",
        help="bench.peer_opennmt options that fix the data (e.g. '--max-pairs 29000')",
    )
    p.add_argument("--opennmt-batch-size", type=int, default=64, help="onmt_translate's, sents")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if (args.input is None) == (args.corpus is None):
        p.error("give exactly one of --input and --corpus")
    if args.opennmt and args.corpus is None:
        p.error("--opennmt needs --corpus (the corpus both models were trained on)")
    return args


def opennmt_input(args: argparse.Namespace, source: Path) -> None:
    """The test split ``bench.peer_opennmt`` trained both tools beside: raw sources for ours in
    ``source``, references, OpenNMT-py's python and its subword-piece input (``--sentences``
    of them, drawn with a fixed seed, when fewer than the split)."""
    from bench import peer_opennmt

    peer = peer_opennmt.parse_args(
        ["--data", args.corpus, "--work", args.opennmt_work, *args.opennmt_args.split()]
    )
    args.opennmt_python = peer_opennmt.setup_venv(Path(peer.venv or Path(peer.work) / "venv"))
    files = peer_opennmt.prepare_data(peer)
    pieces = Path(files["test_src"]).read_text(encoding="utf-8").splitlines()
    rows = list(zip(files["corpus"].test, pieces, strict=True))
    if 0 < args.sentences < len(rows):
        rows = random.Random(0).sample(rows, args.sentences)
    source.write_text("".join(s + "\n" for (s, _), _ in rows), encoding="utf-8")
    args.opennmt_source = source.with_suffix(".pieces")
    args.opennmt_source.write_text("".join(p + "\n" for _, p in rows), encoding="utf-8")
    args.reference_lines = [t for (_, t), _ in rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    info = machine_info(args.device)
    meter = CoRunnerMeter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = Path(args.input) if args.input else folder / "source.txt"
        args.reference_lines = None
        if args.references:
            args.reference_lines = Path(args.references).read_text(encoding="utf-8").splitlines()
        if args.opennmt:
            opennmt_input(args, source)
        elif args.corpus and args.test_split:
            pairs = test_split_pairs(Path(args.corpus), args.sentences)
            source.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
            args.reference_lines = [t for _, t in pairs]
        elif args.corpus:
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
    result["ratios"] = (
        ratios(result["runs"], args)
        | translating_ratios(result["runs"], args)
        | opennmt_ratios(result["runs"], args)
    )
    result["input"] = {"sentences": len(words), "mean_words": statistics.mean(words)}
    print(format_machine(info))
    print(
        f"- input: {len(words)} sentences, {statistics.mean(words):.1f} words on average; "
        f"batch size {args.batch_size or 'the default, 320 // beam'}; start-up alone (empty input): "
        f"{statistics.median(result['startup_s']):.2f} s"
    )
    print(table(result))
    for name, value in result["ratios"].items():
        print(f"- {name}: {value}" + ("" if isinstance(value, str) else "x"))
    for name, run in result.get("one_at_a_time", {}).items():
        print(
            f"- {name}: {run['seconds']:.2f} s; lines differing from the batched output: "
            f"{run['differing_lines']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, **result}, indent=1))


if __name__ == "__main__":
    main()
