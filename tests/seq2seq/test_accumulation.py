"""--accum-steps N: N batches' gradients summed into one step equal the step of one batch N times
larger (same loss, gradient and parameters after the step, to float32 rounding), in one process
and under DDP, where only the last batch's backward all-reduces (no_sync before)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest
import torch

from seq2seq_fast.seq2seq.builders import Clock, build_model, build_optimizer, build_task
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.data.batching import make_batch
from seq2seq_fast.seq2seq.distributed import Dist
from seq2seq_fast.seq2seq.train import Job, merge_batches, train, train_step

TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=7,
    heldout_size=20,
    embed_size=16,
    hidden_size=32,
    batch_size=8,
    lr=1e-3,
    warmup_steps=1,
    progress=False,
    heatmap=False,
    threads=1,
    epochs=1,
    steps_per_epoch=4,
    label_smoothing=0.1,
)
EPS = 1e-3


def _job(config: TrainConfig) -> Job:
    torch.manual_seed(config.seed)
    ctx = Dist()
    task = build_task(config, ctx, None)
    model, backend = build_model(config, task, ctx)
    optimizer, scheduler = build_optimizer(config, model, 10, Clock(0.0, None))
    # Adam's first step is lr * g / (|g| + eps): about lr * sign(g) where |g| >> eps, so that a
    # gradient of ~1e-9 rounded differently can move a weight by ~lr. A large eps makes the step
    # a smooth function of the gradient: equal gradients then give weights equal to rounding.
    optimizer.param_groups[0]["eps"] = EPS
    return Job(config, ctx, task, model, model, backend, optimizer, scheduler, Clock(0.0, None))


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("accum", [2, 3])
def test_accumulated_batches_step_as_one_big_batch(backend, accum):
    config = TrainConfig(**TINY, backend=backend, accum_steps=accum)
    small, big = _job(config), _job(config)
    assert all(
        torch.equal(a, b)
        for a, b in zip(small.model.parameters(), big.model.parameters(), strict=True)
    )
    g = torch.Generator().manual_seed(1)
    # batches of different sizes and widths: the token weighting and the padding both matter
    parts = [small.task.sample(g, n) for n in (5, 8, 3)[:accum]]
    batches = [make_batch(pairs) for pairs in parts]
    assert len({b.src.shape[1] for b in batches}) > 1 or accum == 2
    loss_small = train_step(small, batches)
    loss_big = train_step(big, make_batch([p for pairs in parts for p in pairs]))
    assert loss_small == pytest.approx(loss_big, rel=1e-6)
    for (name, a), b in zip(small.model.named_parameters(), big.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_one_batch_is_the_plain_step():
    """A list of one batch and the batch itself give the same step (the path without
    accumulation is the code as it was)."""
    config = TrainConfig(**TINY, backend="reference")
    a, b = _job(config), _job(config)
    batch = make_batch(a.task.sample(torch.Generator().manual_seed(2), 6))
    assert train_step(a, [batch]) == train_step(b, batch)
    assert all(
        torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )


def test_merge_batches_keeps_every_row():
    g = torch.Generator().manual_seed(3)
    task = _job(TrainConfig(**TINY, backend="reference")).task
    parts = [task.sample(g, n) for n in (2, 5)]
    merged = merge_batches([make_batch(p) for p in parts])
    whole = make_batch(parts[0] + parts[1])
    for name in ("src", "src_lengths", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name


def test_a_run_counts_optimiser_steps(tmp_path):
    result = train(TrainConfig(**TINY, backend="reference", accum_steps=2, out=str(tmp_path)))
    assert result.step == TINY["steps_per_epoch"]
    payload = torch.load(result.checkpoint, weights_only=True)
    adam_steps = {float(s["step"]) for s in payload["optimizer"]["state"].values()}
    assert adam_steps == {float(TINY["steps_per_epoch"])}


def test_accum_steps_must_be_positive():
    with pytest.raises(TrainError, match="accum_steps must be an int >= 1, got 0"):
        TrainConfig(accum_steps=0)


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from seq2seq_fast.seq2seq.builders import Clock, build_model, build_optimizer, build_task
    from seq2seq_fast.seq2seq.config import TrainConfig
    from seq2seq_fast.seq2seq.data.batching import make_batch
    from seq2seq_fast.seq2seq.distributed import setup_distributed
    from seq2seq_fast.seq2seq.train import Job, train_step

    ctx = setup_distributed()
    config = TrainConfig(**eval(sys.argv[1]))

    def job():
        torch.manual_seed(0)
        task = build_task(config, ctx, None)
        model, backend = build_model(config, task, ctx)
        optimizer, scheduler = build_optimizer(config, model, 10, Clock(0.0, None))
        optimizer.param_groups[0]["eps"] = 1e-3  # as in test_accumulated_batches_step_as_one...
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        calls = []
        ddp.register_comm_hook(calls, lambda state, bucket: (state.append(1),
                                                             allreduce_hook(None, bucket))[1])
        j = Job(config, ctx, task, model, ddp, backend, optimizer, scheduler, Clock(0.0, None))
        j.ddp = ddp
        return j, calls

    small, small_calls = job()
    big, big_calls = job()
    g = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own batches
    parts = [small.task.sample(g, n) for n in (4 + ctx.rank, 7)]
    loss_small = train_step(small, [make_batch(p) for p in parts])
    loss_big = train_step(big, make_batch(parts[0] + parts[1]))
    assert abs(loss_small - loss_big) <= 1e-6 * abs(loss_big), (loss_small, loss_big)
    assert len(small_calls) == len(big_calls) > 0, (small_calls, big_calls)  # one all-reduce
    for a, b in zip(small.model.parameters(), big.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the gradients are the all-reduced ones: the same on both ranks
    flat = torch.cat([p.grad.reshape(-1) for p in small.model.parameters()])
    other = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(other, flat)
    assert torch.equal(other[0], other[1])
    # one write a line: the two ranks share the pipe, and print writes the newline apart
    sys.stdout.write(f"rank {ctx.rank} ok\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_accumulation_under_ddp_all_reduces_once(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    script = tmp_path / "ddp_accum.py"
    script.write_text(DDP_SCRIPT, encoding="utf-8")
    config = dict(TINY, backend="reference", accum_steps=2)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", str(script), repr(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
