"""Start-up of ``seq2seq-fast translate``: time to its first output line, against bare Python and
``import torch`` alone, and what the command imports besides torch.

    python -m bench.translate_startup --checkpoint runs/reverse/model.pt [--rounds 7] \\
        [--baseline-tree PATH] [--sentence "a b c d"]

Each round runs, in a fresh process and in rotated order: ``python -c pass``, ``python -c
"import torch; print()"``, ``python -m seq2seq_fast translate --checkpoint … SENTENCE`` of this tree (and of
``--baseline-tree``, e.g. a checkout of an older commit), timing each from the start of the
process to its first line on stdout (the translation) and to its exit. Reported: medians, the
per-round ratio baseline/this tree, and from one ``python -X importtime`` run per tree the
milliseconds of the modules imported after torch (ours and what they pull in), the largest first.
On a shared machine read the ratios, not the times.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.report import CoRunnerMeter, format_machine, load_average, machine_info

_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def first_line_and_exit(
    command: list[str], env: dict | None, cwd: str | None
) -> tuple[float, float]:
    """-> (seconds to the first line on stdout (the exit when none), seconds to the exit)."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    line = proc.stdout.readline()
    first = time.perf_counter() - started
    rest, err = proc.communicate()
    total = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (rc {proc.returncode}):\n{err[-2000:]}")
    return (first if line else total), total


def translate_command(args: argparse.Namespace) -> list[str]:
    checkpoint = str(Path(args.checkpoint).resolve())
    return [sys.executable, "-m", "seq2seq_fast", "translate", "--checkpoint", checkpoint]


def tree_env(tree: str) -> tuple[dict, str]:
    root = str(Path(tree).resolve())
    return dict(os.environ, PYTHONPATH=root), root


def import_split(args: argparse.Namespace, tree: str) -> dict[str, float]:
    """Milliseconds of one ``-X importtime`` run of the command: torch (cumulative), the modules of
    seq2seq_fast (their own time), the rest (interpreter start-up, what ours pulls in besides
    torch), and the converter (cumulative; 0 when not imported)."""
    env, cwd = tree_env(tree)
    command = [sys.executable, "-X", "importtime", *translate_command(args)[1:], args.sentence]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    split = {"all": 0.0, "torch": 0.0, "seq2seq_fast": 0.0, "seq2seq_fast.nn.convert": 0.0}
    for line in proc.stderr.splitlines():
        found = _IMPORT_LINE.match(line)
        if found is None:
            continue
        own, cumulative, name = (
            int(found.group(1)) / 1000,
            int(found.group(2)) / 1000,
            found.group(4),
        )
        split["all"] += own
        if name in ("torch", "seq2seq_fast.nn.convert"):
            split[name] = cumulative
        if name.split(".")[0] == "seq2seq_fast":
            split["seq2seq_fast"] += own
    split["rest"] = split["all"] - split["torch"] - split["seq2seq_fast"]
    return split


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a small model, e.g. train --task reverse")
    p.add_argument("--baseline-tree", help="also time this source tree's translate command")
    p.add_argument("--sentence", default="a b c d")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    info = machine_info("cpu")
    meter = CoRunnerMeter()
    here = str(Path(__file__).resolve().parents[1])
    commands = {
        "python -c pass": ([sys.executable, "-c", "pass"], None, None),
        # prints once imported: its first line is the import, its exit adds torch's teardown
        "python -c 'import torch; print()'": (
            [sys.executable, "-c", "import torch; print(flush=True)"],
            None,
            None,
        ),
        "translate (this tree)": (translate_command(args) + [args.sentence], *tree_env(here)),
    }
    if args.baseline_tree:
        commands["translate (baseline tree)"] = (
            translate_command(args) + [args.sentence],
            *tree_env(args.baseline_tree),
        )
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    names = list(commands)
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(first_line_and_exit(*commands[name]))
    info["load_average_at_end"] = load_average()
    info["other_processes_busy_cores"] = meter.stop()
    print(format_machine(info))
    print(f"- {args.rounds} rounds, sentence {args.sentence!r}, checkpoint {args.checkpoint}\n")
    print("| command | first output line, s (median) | exit, s (median) |")
    print("| --- | ---: | ---: |")
    for name, runs in times.items():
        first = statistics.median(f for f, _ in runs)
        total = statistics.median(t for _, t in runs)
        print(f"| {name} | {first:.2f} | {total:.2f} |")
    if args.baseline_tree:
        per_round = [
            b[0] / h[0]
            for b, h in zip(
                times["translate (baseline tree)"], times["translate (this tree)"], strict=True
            )
        ]
        print(f"- first line, baseline / this tree: {statistics.median(per_round):.2f}x")
    print("\n| tree | imports, ms | torch | seq2seq_fast's own | the rest | of which converter |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    trees = [("this tree", here)] + (
        [("baseline", args.baseline_tree)] if args.baseline_tree else []
    )
    for name, tree in trees:
        split = import_split(args, tree)
        print(
            f"| {name} | {split['all']:.0f} | {split['torch']:.0f} | {split['seq2seq_fast']:.0f} "
            f"| {split['rest']:.0f} | {split['seq2seq_fast.nn.convert']:.0f} |"
        )


if __name__ == "__main__":
    main()
