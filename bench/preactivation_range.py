"""A real training run, watched: the largest |q + k + b| its attention saw, and its non-finite steps.

    python -m bench.preactivation_range --data corpus.zip --lr 3e-3 --time-budget-min 15

Runs ``seq2seq-fast train --task translate`` (the translate defaults, plus whatever options follow
``--``) and records, over the whole run:

- the largest |pre-activation| |q + k + b| inside the attention's tanh, and the largest |q|, |k|
  and |b| alone (``seq2seq_fast.seq2seq.canary.PreactivationRecorder``, exact, no [B,Tq,Tk,H]
  tensor), over every attention call the model makes, training and evaluation;
- every step whose gradient norm came out non-finite (the steps the loop skips), and how the run
  ended: finished, stopped by the canary with a fused-kernel fault, or diverged.

With fused kernels on, the training loop re-runs a non-finite step on plain PyTorch (the canary):
a fused-kernel fault stops the run with FusedKernelError, so "no FusedKernelError and N skipped
steps" means every skipped step was non-finite on the reference as well.

Prints one markdown row for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time

import torch

from seq2seq_fast.nn.attention import BahdanauAttention
from seq2seq_fast.seq2seq import cli
from seq2seq_fast.seq2seq.canary import FusedKernelError, PreactivationRecorder, cpu_isa


class _Watch:
    """Class-level hooks on BahdanauAttention.attend_projected and clip_grad_norm_, undone on exit."""

    def __init__(self) -> None:
        self.recorder = PreactivationRecorder(torch.nn.Module())  # modules: none; fed by the hook
        self.norm_calls = 0
        self.nonfinite_norms: list[int] = []

    def __enter__(self) -> _Watch:
        self._attend = BahdanauAttention.attend_projected
        self._clip = torch.nn.utils.clip_grad_norm_
        watch, attend, clip = self, self._attend, self._clip

        def attend_projected(module, projected_query, projected_keys, values, **kwargs):
            score = kwargs.get("score_vector")
            bias = (score if score is not None else module.score_vector())[1]
            watch.recorder.record(projected_query, projected_keys, bias, kwargs.get("lengths"))
            return attend(module, projected_query, projected_keys, values, **kwargs)

        def clip_grad_norm_(*args, **kwargs):
            norm = clip(*args, **kwargs)
            watch.norm_calls += 1
            if not bool(torch.isfinite(norm)):
                watch.nonfinite_norms.append(watch.norm_calls)
            return norm

        BahdanauAttention.attend_projected = attend_projected
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        return self

    def __exit__(self, *exc) -> None:
        BahdanauAttention.attend_projected = self._attend
        torch.nn.utils.clip_grad_norm_ = self._clip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="source<TAB>target file or .zip")
    parser.add_argument("--lr", type=float, default=None, help="default: the translate default")
    parser.add_argument("--time-budget-min", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    parser.add_argument("rest", nargs="*", help="further train options, after --")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="preactivation-range-")
    train_args = ["train", "--task", "translate", "--data", args.data, "--out", out]
    if args.lr is not None:
        train_args += ["--lr", str(args.lr)]
    if args.time_budget_min is not None:
        train_args += ["--time-budget-min", str(args.time_budget_min)]
    if args.threads is not None:
        train_args += ["--threads", str(args.threads)]
    train_args += args.rest
    print("running: seq2seq-fast " + " ".join(train_args), flush=True)
    started = time.perf_counter()
    outcome = "finished"
    with _Watch() as watch:
        try:
            code = cli.main(train_args)
            if code:
                outcome = f"exit code {code}"
        except FusedKernelError as error:
            outcome = f"FusedKernelError: {error}"
        except Exception as error:  # a diverged run (TrainError) or anything else: say which
            outcome = f"{type(error).__name__}: {error}"
    wall = time.perf_counter() - started
    s = watch.recorder.summary()
    print(
        f"\nCPU: {platform.processor() or platform.machine()}, kernels: {cpu_isa()}, "
        f"torch {torch.__version__}, threads {args.threads}"
    )
    print(f"outcome: {outcome}")
    print(
        "| lr | optimizer steps | non-finite steps (skipped) | first | largest abs(q+k+b) | "
        "abs(q) | abs(k) | abs(b) | attention calls | wall |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    first = watch.nonfinite_norms[0] if watch.nonfinite_norms else "-"
    lr = args.lr if args.lr is not None else "default"
    print(
        f"| {lr} | {watch.norm_calls} | {len(watch.nonfinite_norms)} | {first} | "
        f"{s['max_preactivation']:.1f} | {s['max_query']:.1f} | {s['max_keys']:.1f} | "
        f"{s['max_bias']:.2f} | {watch.recorder.calls} | {wall:.0f} s |"
    )
    return 0 if outcome == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
