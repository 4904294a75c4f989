"""Where the time of one ``seq2seq-fast translate`` command goes, phase by phase.

    python -m bench.translate_profile --checkpoint MODEL --input FILE [--beam 5] \\
        [--precision fp32] [--tree PATH ...] [--rounds 3] [--json out.json]

Each round runs the real command (``seq2seq_fast.seq2seq.cli.main``) in a fresh process on one
thread, with wall-clock timers wrapped around the functions that do each part of the work:

    start-up              interpreter start to the command's first work (imports included)
    loading the model     Translator.load (checkpoint read, model built, precision applied)
    reading + encoding    the input's lines read (iter_chunks) and turned into subword ids
    encoder               Seq2Seq.encode: embedding, bi-GRU, bridge, keys projected once
    decoder cell          the decoder's recurrent layer, one step at a time
    attention             the attention module per step (query projection and the fused op)
    output + softmax      the rest of a decoder step: attentional layer, vocabulary projection,
                          log-softmax and the masks (the step minus cell and attention)
    search bookkeeping    the search minus encoder and steps: top-k, reordering the states,
                          histories, finished hypotheses
    writing               detokenising and writing the output lines (the rest of the command)

``--tree`` runs the same measurement on other source trees (e.g. a worktree of the baseline
commit) in the same rounds, interleaved, so that their figures are side by side. The phases
are found by name; a tree without one of the functions reports it as 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = (
    "start-up",
    "loading the model",
    "reading + encoding input",
    "encoder",
    "decoder cell",
    "attention",
    "output + softmax",
    "search bookkeeping",
    "writing",
)


def worker(argv: list[str], spawned: float, out_json: str) -> None:
    """Run the translate command in this process with timers; write the phase seconds."""
    import functools

    from seq2seq_fast.nn import attention
    from seq2seq_fast.seq2seq import cli, decoding, models, translate

    spent: dict[str, float] = {}
    first_work: list[float] = []

    def timed(name):
        def wrap(fn):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

            return inner

        return wrap

    def patch(owner, name, label, static=False):
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            return
        if static:
            setattr(owner, name, staticmethod(timed(label)(fn.__func__)))
        elif isinstance(fn, classmethod):
            setattr(owner, name, classmethod(timed(label)(fn.__func__)))
        else:
            setattr(owner, name, timed(label)(fn))

    original_load = translate.Translator.load.__func__

    def load(cls, *args, **kwargs):
        first_work.append(time.time())
        started = time.perf_counter()
        try:
            return original_load(cls, *args, **kwargs)
        finally:
            spent["load"] = time.perf_counter() - started

    translate.Translator.load = classmethod(load)
    original_chunks = translate.iter_chunks

    def iter_chunks(*args, **kwargs):
        chunks = original_chunks(*args, **kwargs)
        while True:
            started = time.perf_counter()
            try:
                chunk = next(chunks)
            except StopIteration:
                spent["read"] = spent.get("read", 0.0) + time.perf_counter() - started
                return
            spent["read"] = spent.get("read", 0.0) + time.perf_counter() - started
            yield chunk

    translate.iter_chunks = iter_chunks
    patch(translate.Translator, "encode", "encode")
    patch(translate.Translator, "_decode", "decode")
    patch(models.Seq2Seq, "encode", "encoder")
    patch(models.GNMTDecoder, "_run_layer", "cell", static=True)
    patch(models.BahdanauDecoder, "_step", "bahdanau step")
    patch(attention.BahdanauAttention, "forward", "attention")
    patch(attention.BahdanauAttention, "attend_projected", "attention (projected)")
    try:  # the prepared decoding path, where the tree has it
        from seq2seq_fast.seq2seq import inference
    except ImportError:
        inference = None
    if inference is not None:
        patch(inference._Cell, "forward", "cell")
        patch(inference.DecodingModel, "encode", "encoder")
        patch(inference.DecodingModel, "_attend", "attention")
    # the step and its top-k where the tree fuses them (then "output + softmax" holds the top-k)
    patch(decoding, "_step_topk" if hasattr(decoding, "_step_topk") else "_step_log_probs", "step")
    started = time.perf_counter()
    code = cli.main(argv)
    total = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"translate failed with status {code}")
    attention_s = spent.get("attention", 0.0) or spent.get("attention (projected)", 0.0)
    cell = spent.get("cell", 0.0)
    step = spent.get("step", 0.0)
    search = spent.get("decode", 0.0)
    encoder = spent.get("encoder", 0.0)
    result = {
        "start-up": first_work[0] - spawned if first_work else 0.0,
        "loading the model": spent.get("load", 0.0),
        "reading + encoding input": spent.get("read", 0.0) + spent.get("encode", 0.0),
        "encoder": encoder,
        "decoder cell": cell,
        "attention": attention_s,
        "output + softmax": step - cell - attention_s,
        "search bookkeeping": search - encoder - step,
    }
    accounted = sum(v for k, v in result.items() if k != "start-up")
    result["writing"] = total - accounted
    Path(out_json).write_text(json.dumps(result))


def run_tree(tree: Path, args, folder: Path, tag: str, own: bool) -> dict[str, float]:
    out_json = folder / f"{tag}.json"
    output = folder / f"{tag}.out"
    argv = [
        "translate",
        "--checkpoint",
        *args.checkpoint,
        "--input",
        args.input,
        "--output",
        str(output),
        "--no-progress",
        "--beam",
        str(args.beam),
        "--threads",
        "1",
    ]
    if args.precision is not None and own:  # the other trees: their default (float32)
        argv += ["--precision", args.precision]
    script = Path(__file__).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    command = [sys.executable, str(script), "--worker", json.dumps(argv), "--out", str(out_json)]
    command += ["--spawned", repr(time.time())]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {proc.stderr[-3000:]}")
    result = json.loads(out_json.read_text())
    result["total"] = sum(result[p] for p in PHASES)
    return result


def table(results: dict[str, list[dict[str, float]]]) -> str:
    names = list(results)
    header = "| phase | " + " | ".join(f"{n}: s (share)" for n in names) + " |"
    lines = [header, "| --- |" + " ---: |" * len(names)]
    medians = {
        n: {p: statistics.median(r[p] for r in runs) for p in (*PHASES, "total")}
        for n, runs in results.items()
    }
    for phase in (*PHASES, "total"):
        cells = []
        for n in names:
            value, total = medians[n][phase], medians[n]["total"]
            cells.append(f"{value:.2f} ({value / total:.0%})")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", nargs="+")
    p.add_argument("--input")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--precision", help="passed as --precision (this tree only)")
    p.add_argument("--tree", action="append", default=[], help="another source tree to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker), args.spawned, args.out)
        return
    if not args.checkpoint or not args.input:
        p.error("--checkpoint and --input are required")
    trees = [Path(__file__).resolve().parent.parent] + [Path(t).resolve() for t in args.tree]
    results: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = trees[round_index % len(trees) :] + trees[: round_index % len(trees)]
            for tree in order:
                run = run_tree(
                    tree, args, Path(tmp), f"{tree.name}-{round_index}", tree == trees[0]
                )
                results[str(tree)].append(run)
                print(f"  {tree}: {run['total']:.2f} s", file=sys.stderr)
    print(f"beam {args.beam}, 1 thread, {args.rounds} round(s), medians; input {args.input}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
