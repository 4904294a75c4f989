"""What a user of the installed wheel runs first, checked from outside the checkout.

Run by tests/reliability/test_wheel.py as ``VENV/bin/python -I wheel_smoke.py WORKDIR`` in a fresh
virtual environment holding torch and the wheel only (no Triton, no test extras), with WORKDIR as
the current folder: nothing of the checkout can be imported. Each check prints one line
``ok: NAME`` or raises; the last line is ``N passed, 0 failed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def _command(*args: str, stdin: str | None = None) -> str:
    """``seq2seq-fast ARGS`` through the console script the wheel installed."""
    exe = Path(sys.executable).with_name("seq2seq-fast")
    done = subprocess.run(
        [str(exe), *args], input=stdin, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise AssertionError(f"seq2seq-fast {' '.join(args)} -> {done.returncode}\n{done.stderr}")
    return done.stdout


@check
def installed_outside_the_checkout():
    import importlib.metadata

    import seq2seq_fast

    where = Path(seq2seq_fast.__file__).resolve()
    assert Path(sys.prefix).resolve() in where.parents, f"imported from {where}, not the venv"
    assert seq2seq_fast.__version__ == importlib.metadata.version("seq2seq-fast")
    assert seq2seq_fast.__version__ != "0+unknown"


@check
def op_forward_and_backward_match_the_reference():
    import torch

    from seq2seq_fast import additive_attention, additive_attention_ref, fused_available

    assert fused_available(torch.device("cpu"), torch.float32), "the wheel's _C did not load"
    g = torch.Generator().manual_seed(0)
    B, Tq, Tk, H, Dv = 3, 5, 7, 24, 10

    def inputs():
        g.manual_seed(0)
        shapes = [(B, Tq, H), (B, Tk, H), (B, Tk, Dv), (H,), (H,)]
        return [
            torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes
        ]

    lengths = torch.tensor([7, 3, 0])
    results = []
    for fn in (additive_attention, additive_attention_ref):
        args = inputs()
        context, weights = fn(*args, lengths=lengths)
        (context.square().sum() + weights.sum()).backward()
        results.append([context, weights, *[a.grad for a in args]])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@check
def one_openmp_runtime_in_the_process():
    import torch  # noqa: F401  (torch loads its OpenMP runtime; _C must reuse it)

    from seq2seq_fast.ops import _library  # noqa: F401  (loads _C)

    names = {"gomp", "iomp", "libomp"}
    maps = Path("/proc/self/maps").read_text().splitlines()
    loaded = {line.split()[-1] for line in maps if any(n in line.rsplit("/", 1)[-1] for n in names)}
    assert len(loaded) == 1, f"OpenMP runtimes loaded: {sorted(loaded)}"
    assert "torch" in next(iter(loaded)), f"not torch's own OpenMP runtime: {loaded}"


@check
def fuse_attention_converts_a_small_module():
    import torch

    from seq2seq_fast import fuse_attention

    class Attention(torch.nn.Module):  # the PyTorch tutorial's Wa/Ua/Va layout
        def __init__(self, h):
            super().__init__()
            self.Wa, self.Ua, self.Va = (
                torch.nn.Linear(h, h),
                torch.nn.Linear(h, h),
                torch.nn.Linear(h, 1),
            )

        def forward(self, query, keys):
            scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
            weights = scores.squeeze(2).unsqueeze(1).softmax(-1)
            return torch.bmm(weights, keys), weights

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attention": Attention(16)})
    query, keys = torch.randn(2, 1, 16), torch.randn(2, 9, 16)
    want = model["attention"](query, keys)
    assert fuse_attention(model) == 1
    assert type(model["attention"]) is not Attention
    got = model["attention"](query, keys)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@check
def main_job_trains_and_translates():
    out = Path("run")
    log = _command(
        "train",
        "--out",
        str(out),
        "--stop-after-steps",
        "12",
        "--threads",
        "1",
        "--no-progress",
        "--no-heatmap",
        "--eval-size",
        "20",
    )
    assert (out / "model.pt").is_file() and (out / "config.yaml").is_file(), log
    model = str(out / "model.pt")
    one = _command("translate", "--checkpoint", model, "abcdef")
    assert len(one.splitlines()) == 1, one
    lines = ["abc", "", "fedcba"]
    piped = _command(
        "translate",
        "--checkpoint",
        model,
        "--no-progress",
        stdin="".join(line + "\n" for line in lines),
    )
    assert len(piped.splitlines()) == len(lines) and piped.splitlines()[1] == "", piped


@check
def ran_without_triton():
    import importlib.util

    # The wheel's default install has no Triton (an extra): every check above ran without it.
    assert importlib.util.find_spec("triton") is None, "this environment has Triton installed"


def main() -> int:
    os.chdir(sys.argv[1] if len(sys.argv) > 1 else ".")
    for fn in CHECKS:
        fn()
        print(f"ok: {fn.__name__}", flush=True)
    print(f"{len(CHECKS)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
