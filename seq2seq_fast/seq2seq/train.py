"""Training: the reversal and translation tasks, checkpoints, exact resume, DDP through torchrun.

``train(TrainConfig(...))`` runs one training job and returns a :class:`TrainResult`; the command
line (``seq2seq-fast train``) is a thin wrapper around it. One job:

- builds the task (reverse: sequences drawn fresh from a seeded generator; translate: a corpus
  file split with a fixed seed, sentencepiece vocabularies trained on the training split),
- trains with AdamW, gradient clipping and a warmup + cosine learning-rate schedule (with
  ``accum_steps`` N: the gradients of N batches per step), a tqdm bar showing loss and target
  tokens/s, the same every 10 steps in ``metrics.jsonl`` (and TensorBoard with ``tensorboard``),
- skips the update of a step whose gradient is non-finite, after the canary (fused kernels in
  use: :mod:`seq2seq_fast.seq2seq.canary`) re-ran its batch on plain PyTorch and found that
  non-finite too (the model itself diverged; 20 such steps in a row stop the run); a finite
  re-run is a fused-kernel fault: ``FusedKernelError``, the batch and weights in
  ``fused-failure-stepN.pt`` beside the checkpoint,
- evaluates after every epoch and every ``eval_every`` steps (sequence/token accuracy for
  reverse, sacreBLEU for translate), keeping ``best.pt`` beside ``model.pt`` and stopping after
  ``patience`` evaluations without a new best; the final test BLEU and heatmap are of best.pt's
  model when there is one (model.pt stays the last state, for resuming),
- writes ``model.pt`` atomically (model config, vocabularies, model/optimizer/scheduler state, RNG
  states, data position, epoch, step) and a heatmap ``attention.png`` of a held-out example.

Under ``torchrun`` (WORLD_SIZE > 1) it trains with DistributedDataParallel: gloo on CPU, nccl on
CUDA; every rank draws its own batches, rank 0 evaluates and writes the files.

The loop is here: ``build_job`` (seed, task, model, optimiser, a resumed checkpoint restored),
``run_epoch`` (``train_step`` per batch), ``track_best``, ``save_job`` (the checkpoint) and
``finish`` (final evaluation, heatmap, report). The rest lives beside it:

    config.py        TrainConfig (with the per-task defaults), TrainError
    builders.py      the task (vocabularies, batches, held-out data), model, optimiser, schedule
    evaluation.py    held-out accuracy, sacreBLEU, the metrics' log line
    distributed.py   DDP set-up (torchrun), the collectives the loop uses, rank-0 logging
    checkpoint.py    checkpoint files, RNG states, epoch snapshots and their rotation
    canary.py        the verdict on a non-finite step (re-run on plain PyTorch)
    configfile.py    --config files, config.yaml (the resolved config, beside the checkpoint)
    metrics.py       metrics.jsonl and TensorBoard events
    finetune.py      --init-from: a trained model's weights, checked against the new model
    decoding.py      search: greedy or beam
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seq2seq_fast.seq2seq import canary
from seq2seq_fast.seq2seq.builders import (
    Clock,
    Task,
    autocast_dtype,
    build_model,
    build_optimizer,
    build_task,
)
from seq2seq_fast.seq2seq.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    is_inference_only,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    snapshots,
    write_snapshot,
)
from seq2seq_fast.seq2seq.config import TOKENIZER_FIELDS, TrainConfig, TrainError
from seq2seq_fast.seq2seq.configfile import CONFIG_FILE, write_config
from seq2seq_fast.seq2seq.data.batching import Batch, make_batch
from seq2seq_fast.seq2seq.data.vocab import PAD_ID
from seq2seq_fast.seq2seq.distributed import (
    Dist,
    log,
    setup_distributed,
    synced_elapsed,
)
from seq2seq_fast.seq2seq.evaluation import bleu_signature, describe, evaluate, score_of
from seq2seq_fast.seq2seq.finetune import init_from, load_init
from seq2seq_fast.seq2seq.metrics import METRICS_FILE, MetricsLog
from seq2seq_fast.seq2seq.models import Seq2Seq, compile_model, sequence_loss


@dataclass
class TrainResult:
    checkpoint: Path
    heatmap: Path | None
    metrics: dict[str, float]
    losses: list[float] = field(default_factory=list)
    step: int = 0
    epoch: int = 0
    seconds: float = 0.0
    # The checkpoint whose model the final metrics (test BLEU) and heatmap are of: best.pt when
    # the run wrote one, else model.pt (the last state); and its step.
    final_checkpoint: Path | None = None
    final_step: int = 0


@dataclass
class Job:
    """One training run's objects and position (what a checkpoint stores)."""

    config: TrainConfig
    ctx: Dist
    task: Task
    model: Seq2Seq
    run_model: Any  # the model as the steps call it: DDP-wrapped and/or compiled
    attention_backend: str
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clock: Clock
    autocast: torch.dtype | None = None  # bf16 under --precision bf16 where the hardware has it
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    best_score: float | None = None  # the best evaluation so far (what best.pt holds)
    evals_since_best: int = 0
    scored_step: int | None = None  # the step whose model track_best scored last
    nonfinite_steps: int = 0  # steps in a row skipped for a non-finite gradient norm
    skipped_steps: list[int] = field(default_factory=list)  # every such step (this process's run)
    ddp: Any = None  # the DistributedDataParallel wrapper under DDP (for no_sync)
    metrics_log: MetricsLog | None = None  # metrics.jsonl (and TensorBoard), rank 0
    interrupted: bool = False  # Ctrl-C: stop after this step, checkpointed (_interrupts_deferred)

    @property
    def canary(self) -> bool:
        """Whether a non-finite step is re-run on plain PyTorch: fused kernels in use."""
        return self.attention_backend != "reference"

    @property
    def checkpoint_path(self) -> Path:
        return self.config.out_dir / "model.pt"

    @property
    def total_steps(self) -> int:
        return self.config.epochs * self.task.steps_per_epoch

    def restore(self, payload: dict[str, Any]) -> None:
        """Continue a checkpoint: weights, optimiser, schedule, position, metrics, RNG states."""
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.epoch, self.batch_in_epoch = payload["epoch"], payload["batch_in_epoch"]
        self.step = payload["step"]
        self.metrics = dict(payload.get("metrics", {}))
        best = payload.get("best", {})  # absent in older checkpoints
        self.best_score = best.get("score")
        self.evals_since_best = best.get("evals_since", 0)
        rng = payload["rng"]
        rng = rng[self.ctx.rank] if isinstance(rng, list) else rng
        set_rng_state(rng, self.task.generator)


def _model_header(job: Job) -> dict[str, Any]:
    """What every file of the run says about its model: configs, task, vocabularies, position
    and metrics (training checkpoints and epoch snapshots alike)."""
    return {
        "model_config": job.model.config.to_dict() | {"backend": "auto"},
        "train_config": asdict(job.config),
        "task": job.task.info,
        "src_vocab": job.task.src_vocab.to_state(),
        "tgt_vocab": job.task.tgt_vocab.to_state(),
        "step": job.step,
        "metrics": job.metrics,
    }


def save_job(job: Job, path: Path | None = None) -> None:
    """Checkpoint the job at its position (to ``path``, default model.pt). Every rank's RNG state
    is gathered (so a resumed DDP run continues exactly too); rank 0 writes."""
    ctx = job.ctx
    rng = rng_state(job.task.generator)
    if ctx.enabled:
        states = [None] * ctx.world_size
        dist.all_gather_object(states, rng)
        rng = states
    if ctx.is_main:
        save_checkpoint(
            {
                "format": CHECKPOINT_FORMAT,
                "version": CHECKPOINT_VERSION,
                **_model_header(job),
                "model": job.model.state_dict(),
                "optimizer": job.optimizer.state_dict(),
                "scheduler": job.scheduler.state_dict(),
                "rng": rng,
                "epoch": job.epoch,
                "batch_in_epoch": job.batch_in_epoch,
                "world_size": ctx.world_size,
                "best": {"score": job.best_score, "evals_since": job.evals_since_best},
            },
            path or job.checkpoint_path,
        )
    if ctx.enabled:
        dist.barrier()


def save_snapshot(job: Job) -> None:
    """``keep_checkpoints`` N > 0: the weights at this epoch's end as model.epochE.pt beside
    model.pt (weights and vocabularies only, as ``export`` writes them), then the snapshots
    older than the last N removed. Rank 0 writes."""
    keep = job.config.keep_checkpoints
    if not keep or not job.ctx.is_main:
        return
    write_snapshot(
        _model_header(job), job.model.state_dict(), job.checkpoint_path.parent, job.epoch, keep
    )


def merge_batches(batches: list[Batch]) -> Batch:
    """One batch of the rows of ``batches`` (padded to the widest), in order."""

    def cat(tensors: list[Tensor]) -> Tensor:
        width = max(t.shape[1] for t in tensors)
        return torch.cat(
            [nn.functional.pad(t, (0, width - t.shape[1]), value=PAD_ID) for t in tensors]
        )

    return Batch(
        cat([b.src for b in batches]),
        torch.cat([b.src_lengths for b in batches]),
        cat([b.tgt_in for b in batches]),
        cat([b.tgt_out for b in batches]),
    )


def _loss(job: Job, batch: Batch) -> Tensor:
    """The forward of one batch: its loss, the mean over its target tokens."""
    config = job.config
    with torch.autocast(
        job.ctx.device.type, dtype=job.autocast or torch.bfloat16, enabled=job.autocast is not None
    ):
        if config.compile:  # the loss outside the compiled graph, as before
            logits, _ = job.run_model(batch.src, batch.src_lengths, batch.tgt_in)
            return sequence_loss(logits.float(), batch.tgt_out, config.label_smoothing)
        # output layer + loss by chunks of rows (ops/linear_cross_entropy.py)
        loss, _ = job.run_model(
            batch.src,
            batch.src_lengths,
            batch.tgt_in,
            batch.tgt_out,
            label_smoothing=config.label_smoothing,
        )
        return loss


def _accumulate(job: Job, batches: list[Batch]) -> Tensor:
    """Forward and backward of several batches into one gradient: each loss weighted by its
    batch's share of the target tokens, so that the sum is the gradient of the mean loss over
    all their tokens (what one batch of them all gives). Under DDP the gradients are
    all-reduced once, with the last batch's backward (no_sync before). -> the weighted loss."""
    total = sum(b.num_target_tokens for b in batches)
    loss_sum = torch.zeros((), device=job.ctx.device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last or job.ddp is None else job.ddp.no_sync():
            loss = _loss(job, batch) * (batch.num_target_tokens / total)
            loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def train_step(job: Job, batch: Batch | list[Batch]) -> float:
    """One optimiser step on ``batch`` (a list: its gradients accumulated, ``accum_steps``);
    -> its loss."""
    config = job.config
    # The dropout masks' generator state, for the canary's re-run of a non-finite step (a 5 KB
    # copy, only with dropout and fused kernels).
    rng = canary.forward_rng_state(job.ctx.device) if job.canary and config.dropout > 0 else None
    job.optimizer.zero_grad(set_to_none=True)
    if isinstance(batch, list):
        loss = _accumulate(job, batch)
        batch = merge_batches(batch)  # what the canary re-runs, should the step be non-finite
    else:
        loss = _loss(job, batch)
        loss.backward()
    # The norm of the (all-reduced) gradient, the same on every rank: a non-finite one skips
    # the update, so that one bad batch does not turn every weight into NaN -- after the canary
    # (with fused kernels) re-ran the batch on plain PyTorch and found it non-finite too.
    max_norm = config.clip_norm if config.clip_norm > 0 else math.inf
    norm = nn.utils.clip_grad_norm_(job.model.parameters(), max_norm)
    if bool(torch.isfinite(norm)):
        job.optimizer.step()
        job.nonfinite_steps = 0
    else:
        verdict = canary.check_step(job, batch, float(loss.detach()), rng) if job.canary else None
        _skip_nonfinite_step(job, float(loss.detach()), verdict)
    if config.time_budget_min is not None:
        job.clock.elapsed = synced_elapsed(job.clock.started, job.ctx)
    job.scheduler.step()
    job.step += 1
    job.batch_in_epoch += 1
    loss_value = float(loss.detach())
    job.losses.append(loss_value)
    return loss_value


# Steps in a row with a non-finite gradient norm after which a run counts as diverged.
MAX_NONFINITE_STEPS = 20


def _skip_nonfinite_step(job: Job, loss: float, reference: canary.Rerun | None = None) -> None:
    """A step whose gradient norm is inf or NaN: no update (the weights stay finite). One is
    reported; MAX_NONFINITE_STEPS in a row save the run's last finite state and stop it.
    ``reference``: the canary's plain-PyTorch re-run of the step (None: fused kernels were not
    in use, --backend reference)."""
    job.nonfinite_steps += 1
    job.skipped_steps.append(job.step + 1)
    config = job.config
    if reference is None:
        cause = "the model itself diverged (on the reference attention backend: no re-run)"
    elif reference.finite is False:
        cause = (
            "the model itself diverged (the plain-PyTorch reference re-run of the step "
            "gives non-finite values as well)"
        )
    else:
        cause = (
            f"not verified (the plain-PyTorch reference re-run could not run: "
            f"{reference.error}; a fused-kernel fault is not ruled out)"
        )
    if job.nonfinite_steps == 1:
        log(
            f"step {job.step + 1}: non-finite gradient (loss {loss}), update skipped: {cause}",
            job.ctx,
        )
    if job.nonfinite_steps >= MAX_NONFINITE_STEPS:
        save_job(job)
        raise TrainError(
            f"training diverged: {cause}; the gradient was non-finite for {job.nonfinite_steps} "
            f"steps in a row (steps {job.step + 2 - job.nonfinite_steps}-{job.step + 1}, loss "
            f"{loss}) at --lr {config.lr:g}; start again with a lower --lr or --clip-norm on (now "
            f"{config.clip_norm:g}); {job.checkpoint_path} holds the last finite weights"
        )


def _should_stop(job: Job) -> bool:
    """Stop (and checkpoint) now: ``stop_after_steps`` reached or the time budget spent."""
    if job.config.stop_after_steps is not None and job.step >= job.config.stop_after_steps:
        return True
    if job.interrupted:
        return True
    if job.clock.expired:
        log(f"time budget of {job.config.time_budget_min} min reached at step {job.step}", job.ctx)
        return True
    return False


def run_epoch(job: Job) -> bool:
    """Train from the job's position to the end of its epoch; -> True when stopped early."""
    from tqdm import tqdm

    config, ctx, task = job.config, job.ctx, job.task
    compiled = config.compile
    plan = task.epoch_plan(config, job.epoch, ctx)
    steps = None if plan is None else -(-len(plan) // config.accum_steps)
    if steps is not None and steps != task.steps_per_epoch:  # the schedule counted them once
        raise TrainError(
            f"epoch {job.epoch + 1} has {steps} steps, the first had {task.steps_per_epoch}"
        )
    job.model.train()
    bar = tqdm(
        total=task.steps_per_epoch,
        initial=job.batch_in_epoch,
        desc=f"epoch {job.epoch + 1}/{config.epochs}",
        disable=not (config.progress and ctx.is_main),
        dynamic_ncols=True,
        leave=False,
        file=sys.stderr,
    )
    window_tokens, window_losses, window_start = 0, [], time.perf_counter()
    try:
        while job.batch_in_epoch < task.steps_per_epoch:
            batches = [
                make_batch(
                    pairs,
                    src_pad_to=task.pad_src if compiled else None,
                    tgt_pad_to=task.pad_tgt if compiled else None,
                ).to(ctx.device)
                for pairs in task.step_pairs(config, plan, job.batch_in_epoch)
            ]
            loss_value = train_step(job, batches if len(batches) > 1 else batches[0])
            window_tokens += sum(b.num_target_tokens for b in batches) * ctx.world_size
            window_losses.append(loss_value)
            bar.update(1)
            if job.step % 10 == 0 or job.batch_in_epoch == task.steps_per_epoch:
                now = time.perf_counter()
                tokens_per_s = window_tokens / max(now - window_start, 1e-9)
                lr = job.scheduler.get_last_lr()[0]
                bar.set_postfix(
                    loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.1e}"
                )
                if job.metrics_log is not None:
                    loss_mean = sum(window_losses) / len(window_losses)
                    job.metrics_log.write(
                        "train",
                        job.step,
                        {"loss": loss_mean, "lr": lr, "tokens_per_s": tokens_per_s},
                    )
                window_tokens, window_losses, window_start = 0, [], now
            if _should_stop(job):
                return True
            at_epoch_end = job.batch_in_epoch == task.steps_per_epoch
            if config.eval_every and job.step % config.eval_every == 0 and not at_epoch_end:
                if _evaluate_now(job):
                    return True
            if config.save_every and job.step % config.save_every == 0:
                save_job(job)
        return False
    finally:
        bar.close()


def track_best(job: Job) -> bool:
    """After an evaluation: write best.pt when it beats the best so far; -> True when
    ``patience`` evaluations in a row brought nothing better (early stop). Rank 0's metrics
    decide, for every rank."""
    job.scored_step = job.step
    score = score_of(job.metrics) if job.ctx.is_main else None
    if job.ctx.enabled:
        box = [score]
        dist.broadcast_object_list(box, src=0)
        score = box[0]
    if score is None:
        return False
    if job.best_score is None or score > job.best_score:
        job.best_score, job.evals_since_best = score, 0
        save_job(job, job.checkpoint_path.with_name("best.pt"))
        return False
    job.evals_since_best += 1
    if job.config.patience and job.evals_since_best >= job.config.patience:
        log(
            f"early stop at step {job.step}: {job.evals_since_best} evaluations without a "
            f"better score than {job.best_score:.4g} (best.pt)",
            job.ctx,
        )
        return True
    return False


def _evaluate_now(job: Job) -> bool:
    """The interval evaluation inside an epoch; -> True to stop early."""
    if job.ctx.is_main:
        job.metrics = evaluate(job)
        if job.metrics_log is not None:
            job.metrics_log.write("valid", job.step, job.metrics)
    log(f"step {job.step}: {describe(job.metrics)}", job.ctx)
    job.model.train()
    return track_best(job)


def train(
    config: TrainConfig | None = None,
    *,
    resume: str | Path | None = None,
    changes: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Run one training job (see module docstring).

    A new job refuses an output folder that holds another run's files (model.pt, best.pt,
    metrics.jsonl, config.yaml, epoch snapshots) unless ``overwrite``, which removes them first.
    ``resume`` continues a checkpoint exactly, with the checkpoint's options: ``changes`` (field
    -> value, e.g. ``{"epochs": 8}``) are the options given again, applied where they may change
    mid-run and refused by name where they differ from the checkpoint's
    (:meth:`TrainConfig.resumed`). ``config`` given with ``resume`` contributes its out,
    stop_after_steps, progress and threads (the pre-0.3 call; ``changes`` override them)."""
    threads = torch.get_num_threads()
    try:
        return _train(config if config is not None else TrainConfig(), resume, changes, overwrite)
    finally:
        torch.set_num_threads(threads)


# The files a run writes into its folder: a new run there would overwrite or mix with them.
RUN_FILES = ("model.pt", "best.pt", METRICS_FILE, CONFIG_FILE, "attention.png")


def run_files(folder: Path) -> list[Path]:
    """The files of a run in ``folder`` (none when the folder is new or holds other things)."""
    found = [folder / name for name in RUN_FILES if (folder / name).exists()]
    return found + snapshots(folder)


def claim_run_folder(config: TrainConfig, overwrite: bool, ctx: Dist) -> list[Path]:
    """Before a new run writes anything: refuse a folder that holds another run (TrainError
    naming its files and the way out); with ``overwrite``, the files that
    :func:`clear_run_folder` removes once the run has shown it can start."""
    found = run_files(config.out_dir)
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:6]) + (" ..." if len(found) > 6 else "")
        raise TrainError(
            f"--out {config.out_dir} holds another run ({names}): pass --overwrite to replace "
            f"it, --resume {config.out_dir / 'model.pt'} to continue it, or another --out"
        )
    return found


@contextlib.contextmanager
def run_folder_lock(folder: Path, ctx: Dist):
    """Hold ``folder`` (made if new) for one training at a time: two runs into one --out mixed
    their checkpoints, config.yaml and metrics, and the second crashed. An advisory lock
    (``fcntl.flock`` on the folder itself: no file is added to it, the system releases the lock
    when the process ends, so a killed run leaves none behind, and a refused run changes nothing
    in the folder); rank 0 holds it for a DDP run. TrainError naming --out when another training
    holds it."""
    import os

    if folder.exists() and not folder.is_dir():
        raise TrainError(f"--out {folder} is a file, not a folder: pass a folder for the run")
    try:
        import fcntl
    except ImportError:  # (not POSIX: no lock)
        yield
        return
    if not ctx.is_main:
        yield
        return
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainError(
                f"--out {folder} is in use by another training running now: wait for it to "
                "end, or pass another --out"
            ) from None
        try:
            yield
        finally:
            if created and not any(folder.iterdir()):  # a run that could not start leaves
                folder.rmdir()  # no folder it made
    finally:
        os.close(handle)  # (releases the lock)


def clear_run_folder(found: list[Path], ctx: Dist) -> None:
    """Remove the earlier run's files (rank 0), after the new run's data and model are built:
    a run that cannot start (a typo in a path, a bad option) keeps the earlier one."""
    if ctx.enabled:  # every rank has looked before rank 0 removes or writes anything
        dist.barrier()
    if found and ctx.is_main:
        for path in found:
            path.unlink(missing_ok=True)
        log(f"--overwrite: removed the earlier run's {', '.join(p.name for p in found)}", ctx)


def _resume_config(
    config: TrainConfig, resume: str | Path, changes: dict[str, Any] | None, ctx: Dist
) -> tuple[TrainConfig, dict[str, Any]]:
    """-> (the config the resumed run continues with, the checkpoint)."""
    payload = load_checkpoint(resume)
    if is_inference_only(payload):
        raise TrainError(
            f"{resume} is an exported inference model (weights and vocabularies, no optimiser "
            "state): it cannot be resumed; resume from the training checkpoint instead"
        )
    given = {
        name: getattr(config, name)
        for name in ("out", "stop_after_steps", "threads")
        if getattr(config, name) is not None
    }
    if not config.progress:
        given["progress"] = False
    given.update(changes or {})
    saved = dict(payload.get("train_config", {}))
    resumed = TrainConfig.resumed(saved, given, str(resume))
    from seq2seq_fast.seq2seq.data.options import check_tokenizers_fit

    # tokenizer files given with --resume: the vocabularies the checkpoint was trained with?
    checked = {n: given[n] for n in TOKENIZER_FIELDS if given.get(n) is not None}
    check_tokenizers_fit(replace(resumed, **checked), payload, str(resume))
    if "out" not in given:
        resumed = replace(resumed, out=str(Path(resume).parent))
    for name, value in sorted(given.items()):
        if name in saved and saved[name] != value and name not in TOKENIZER_FIELDS:
            log(f"resume: {name} {saved[name]!r} -> {value!r}", ctx)
    return resumed, payload


def build_job(
    config: TrainConfig,
    ctx: Dist,
    payload: dict[str, Any] | None,
    started: float,
    init: dict[str, Any] | None = None,
):
    """Seed, build the task, the model and its optimiser (in this order: the seeded RNG streams
    depend on it), and restore ``payload`` when resuming. ``init``: the checkpoint of
    ``--init-from``, whose vocabularies the task takes and whose weights the model starts from."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    task = build_task(config, ctx, payload if payload is not None else init)
    model, attention_backend = build_model(config, task, ctx)
    if init is not None:
        init_from(model, task.src_vocab, task.tgt_vocab, init, config.init_from)
    clock = Clock(started, config.time_budget_min)
    optimizer, scheduler = build_optimizer(
        config, model, config.epochs * task.steps_per_epoch, clock
    )
    run_model: Any = model
    job = Job(config, ctx, task, model, run_model, attention_backend, optimizer, scheduler, clock)
    job.autocast = autocast_dtype(config, ctx)
    if payload is not None:
        job.restore(payload)
    if ctx.enabled:
        job.run_model = job.ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
        )
    if config.compile:
        # one graph: RNN layers and the fused op inside
        job.run_model = compile_model(job.run_model)
    return job


def _train(
    config: TrainConfig,
    resume: str | Path | None,
    changes: dict[str, Any] | None,
    overwrite: bool,
) -> TrainResult:
    started = time.perf_counter()
    ctx = setup_distributed()
    payload = None
    if resume is not None:
        config, payload = _resume_config(config, resume, changes, ctx)
    elif changes:
        raise TrainError("changes are the options given again with resume=; without it, set them")
    config = replace(config, out=str(config.out_dir))  # resolved: config.yaml names the folder
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    with run_folder_lock(config.out_dir, ctx):
        return _train_in_folder(config, payload, resume, overwrite, ctx, started)


def _train_in_folder(
    config: TrainConfig,
    payload: dict[str, Any] | None,
    resume: str | Path | None,
    overwrite: bool,
    ctx: Dist,
    started: float,
) -> TrainResult:
    """The run itself, its output folder held (:func:`run_folder_lock`)."""
    earlier = claim_run_folder(config, overwrite, ctx) if resume is None else []
    init = load_init(config.init_from) if config.init_from and payload is None else None
    # the job first (data, model): a run that cannot start leaves its folder as it was
    job = build_job(config, ctx, payload, started, init)
    if resume is None:
        clear_run_folder(earlier, ctx)
    job.metrics_log = MetricsLog(
        config.out_dir,
        started=started,
        tensorboard_dir=config.tensorboard,
        fresh=resume is None,
        resumed_at=job.step,
        enabled=ctx.is_main,
    )
    if ctx.is_main:  # the resolved configuration, beside the checkpoint (which stores it too)
        write_config(asdict(config), config.out_dir / CONFIG_FILE)
    if ctx.is_main:
        params = sum(p.numel() for p in job.model.parameters())
        log(
            f"task {config.task}: {config.decoder} decoder, {config.cell} {config.hidden_size}, "
            f"{params / 1e6:.2f}M parameters, attention backend "
            f"{'compile+' if config.compile else ''}{job.attention_backend}, "
            f"{ctx.world_size} process(es), {job.total_steps} steps"
            f"{', autocast bf16' if job.autocast is not None else ''}",
            ctx,
        )
    stopped_early = False
    with _interrupts_deferred(job):
        stopped_early = _run_epochs(job, started)
    if job.interrupted:
        raise TrainInterrupted(job)
    if job.clock.expired and job.best_score is not None and job.scored_step != job.step:
        # The budget ran out between evaluations: score the last model too, or the final
        # evaluation would take an older best.pt over a better, never scored, last state.
        _evaluate_now(job)
        save_job(job)
    _report_skipped_steps(job)
    return finish(job, payload, stopped_early)


def _report_skipped_steps(job: Job) -> None:
    """Say at the end how many updates were skipped for a non-finite gradient (each streak's
    first step was logged as it came; a run that ends inside one has diverged without reaching
    MAX_NONFINITE_STEPS, and says so)."""
    skipped = job.skipped_steps
    if not skipped:
        return
    steps = ", ".join(str(s) for s in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
    message = (
        f"warning: {len(skipped)} of the run's updates were skipped for a non-finite gradient "
        f"(steps {steps})"
    )
    if job.nonfinite_steps:
        message += (
            f"; the last {job.nonfinite_steps} steps all were: the run ended diverging, and its "
            f"checkpoint holds the weights of step {job.step - job.nonfinite_steps} (lower --lr "
            f"or turn --clip-norm on)"
        )
    log(message, job.ctx)


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C during training: the run stopped after its step, checkpointed; says how to go on."""

    def __init__(self, job: Job) -> None:
        path = job.checkpoint_path
        super().__init__(
            f"interrupted at step {job.step} (epoch {job.epoch + 1}, batch {job.batch_in_epoch}): "
            f"the run is saved in {path}; go on with: seq2seq-fast train --resume {path}"
        )


@contextlib.contextmanager
def _interrupts_deferred(job: Job):
    """A first Ctrl-C (SIGINT) stops the training after the step it falls in, which is then
    checkpointed (model.pt, as at an epoch's end); a second one stops at once, as before. Only
    where Python lets a handler be set (the main thread) and in one process (under DDP every
    rank would have to stop at the same step)."""
    import signal
    import threading

    if job.ctx.enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def stop_after_this_step(signum, frame):
        job.interrupted = True
        signal.signal(signal.SIGINT, previous)  # the next Ctrl-C: at once
        print(
            "\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again to stop at "
            "once, losing the steps since the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGINT, stop_after_this_step)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_epochs(job: Job, started: float) -> bool:
    """The epochs from the job's position, each ended by an evaluation and a checkpoint, or
    stopped early (checkpointed where it stopped); -> whether stopped early."""
    config, ctx, metrics_log = job.config, job.ctx, job.metrics_log
    stopped_early = False
    while job.epoch < config.epochs and not stopped_early:
        stopped_early = run_epoch(job)
        if job.batch_in_epoch >= job.task.steps_per_epoch:
            job.epoch, job.batch_in_epoch = job.epoch + 1, 0
            if ctx.is_main:
                job.metrics = evaluate(job)
                metrics_log.write("valid", job.step, job.metrics)
            log(
                f"epoch {job.epoch}/{config.epochs} step {job.step}: loss {job.losses[-1]:.4f}, "
                f"{describe(job.metrics)} [{time.perf_counter() - started:.0f}s]",
                ctx,
            )
            stopped_early = track_best(job) or stopped_early
            save_job(job)
            save_snapshot(job)
        else:
            save_job(job)
    return stopped_early


@dataclass
class FinalModel:
    """The model the final evaluation and heatmap use: best.pt's weights when this run wrote one
    (best validation score), else the last state. ``payload`` is best.pt's content, if used."""

    model: Seq2Seq
    name: str  # "best.pt" or "model.pt"
    step: int
    payload: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.name}, step {self.step}"


def final_model(job: Job) -> FinalModel:
    """best.pt when it belongs to this run (its best score is the job's: not a stale file of an
    earlier run in the same folder), loaded into a copy of the model; else the last model."""
    path = job.checkpoint_path.with_name("best.pt")
    last = FinalModel(job.model, job.checkpoint_path.name, job.step)
    if job.best_score is None or not path.exists():
        return last
    payload = load_checkpoint(path)
    if payload.get("best", {}).get("score") != job.best_score:
        log(
            f"{path} holds another run's best (score {payload.get('best', {}).get('score')}, "
            f"this run's {job.best_score}): evaluating the last model",
            job.ctx,
        )
        return last
    model = job.model
    if payload["step"] != job.step:  # a copy: job.model stays the last state (model.pt)
        model = copy.deepcopy(job.model)
        model.load_state_dict(payload["model"])
    return FinalModel(model, path.name, payload["step"], payload)


def finish(job: Job, payload: dict[str, Any] | None, stopped_early: bool) -> TrainResult:
    """Final evaluation (test BLEU for translate) and heatmap of the best model (best.pt, else
    the last), its metrics into the checkpoints (model.pt and the best.pt used), the closing log
    lines."""
    config, ctx = job.config, job.ctx
    heatmap_path = None
    final = final_model(job) if ctx.is_main else None
    if ctx.is_main:
        if final.payload is not None:  # its own validation metrics, then its test BLEU
            job.metrics = {k: v for k, v in final.payload["metrics"].items() if k != "test_bleu"}
        elif config.task == "reverse" and (not job.metrics or stopped_early):
            job.metrics = evaluate(job)
        if config.task == "translate":
            job.metrics.update(evaluate(job, final=True, model=final.model))
        if config.heatmap:
            from seq2seq_fast.seq2seq.plot import plot_translation

            heatmap_path = config.out_dir / "attention.png"
            plot_translation(
                final.model,
                job.task.src_vocab,
                job.task.tgt_vocab,
                job.task.example(),
                heatmap_path,
                device=ctx.device,
            )
        _record_final(job, final, payload)
        if job.metrics_log is not None:
            job.metrics_log.write("final", final.step, job.metrics)
            job.metrics_log.close()
    if ctx.enabled:
        dist.barrier()
    seconds = time.perf_counter() - job.clock.started
    if ctx.is_main:
        log(f"{describe(job.metrics)} ({final})", ctx)
        if config.task == "translate":
            log(f"BLEU: sacreBLEU {bleu_signature()}", ctx)
        log(f"checkpoint: {job.checkpoint_path}", ctx)
        if heatmap_path is not None:
            log(f"attention heatmap: {heatmap_path}", ctx)
        log(f"trained {job.step} steps in {seconds:.0f}s", ctx)
    return TrainResult(
        job.checkpoint_path,
        heatmap_path,
        job.metrics,
        job.losses,
        job.step,
        job.epoch,
        seconds,
        final_checkpoint=job.checkpoint_path.with_name(final.name) if final else None,
        final_step=final.step if final else job.step,
    )


def _record_final(job: Job, final: FinalModel, payload: dict[str, Any] | None) -> None:
    """The final metrics, and which checkpoint they are of, into model.pt (the last state, as
    before) and into best.pt when it was the evaluated model."""
    source = {"checkpoint": final.name, "step": final.step}
    saved = payload or {}
    if job.metrics != saved.get("metrics") or source != saved.get("final"):
        last = load_checkpoint(job.checkpoint_path)
        last["metrics"], last["final"] = job.metrics, source
        save_checkpoint(last, job.checkpoint_path)
    if final.payload is not None and final.payload["metrics"] != job.metrics:
        final.payload["metrics"] = job.metrics
        save_checkpoint(final.payload, job.checkpoint_path.with_name(final.name))
