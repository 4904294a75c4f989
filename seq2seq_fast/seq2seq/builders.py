"""What a training job is built from: the task (vocabularies, batches, held-out data), the model,
the optimiser and its learning-rate schedule, and the autocast dtype."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from seq2seq_fast.ops._torch_private import mkldnn_bf16_supported
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.data.batching import (
    padding_fractions,
)
from seq2seq_fast.seq2seq.data.corpus import TranslationData
from seq2seq_fast.seq2seq.data.tasks import ReverseTask, Task, TranslationTask
from seq2seq_fast.seq2seq.data.vocab import shared_vocab, vocab_from_state
from seq2seq_fast.seq2seq.distributed import Dist
from seq2seq_fast.seq2seq.distributed import log as _log
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig


def _lr_lambda(warmup: int, total: int, min_ratio: float, time_progress=None):
    """Linear warmup, then cosine decay to ``min_ratio``. With ``time_progress`` (a callable giving
    the elapsed fraction of a time budget) the decay follows whichever is further along, steps or
    time, so a time-budgeted run still ends at a low learning rate."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if time_progress is not None:
            progress = max(progress, min(1.0, time_progress()))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_task(config: TrainConfig, ctx: Dist, payload: dict[str, Any] | None) -> Task:
    """The reversal task, or the translation corpus with its vocabularies (a checkpoint's on
    resume, else trained on the training split)."""
    if config.task == "reverse":
        return ReverseTask(
            config.vocab_size,
            config.min_len,
            config.max_len,
            config.seed,
            config.heldout_size,
            steps_per_epoch=config.steps_per_epoch,
            rank=ctx.rank,
        )
    corpus = _read_corpus(config, ctx, payload)
    task = TranslationTask(
        corpus,
        {
            "kind": "translate",
            "data": str(config.data),
            "direction": config.direction,
            "valid_data": config.valid_data,
            "test_data": config.test_data,
            "src": config.src,
            "tgt": config.tgt,
            "shared_vocab": shared_vocab(corpus),
        },
    )
    plan = task.epoch_plan(config, 0, ctx)
    task.steps_per_epoch = -(-len(plan) // config.accum_steps)  # optimiser steps
    _log_plan(config, ctx, corpus, plan)
    return task


def _read_corpus(config: TrainConfig, ctx: Dist, payload: dict[str, Any] | None):
    """The encoded splits, read into memory or from a token store, with a log of what was kept.
    On resume (``payload``) with the vocabularies the model was trained with."""
    vocabs = None
    if payload is not None:  # on resume, the vocabularies the model was trained with
        vocabs = (vocab_from_state(payload["src_vocab"]), vocab_from_state(payload["tgt_vocab"]))
    if config.uses_token_store:  # streamed into an on-disk token store (seq2seq/data/store.py)
        from seq2seq_fast.seq2seq.data.options import open_store_corpus

        corpus = open_store_corpus(
            config,
            vocabs=vocabs,
            rank=ctx.rank,
            world_size=ctx.world_size,
            log=lambda m: _log(m, ctx),
        )
    else:
        corpus = TranslationData.load(
            config.data,
            swap=config.direction == "2-1",
            max_words=config.max_words or None,  # (0: every pair)
            max_pairs=config.max_pairs,
            vocab_size=config.spm_vocab_size,
            normalization=config.normalization,
            valid_fraction=config.valid_fraction,
            test_fraction=config.test_fraction,
            seed=config.seed,
            vocabs=vocabs,
            valid_path=config.valid_data,
            test_path=config.test_data,
            max_held_out=config.max_held_out,
        )
    _log(corpus.report.summary(), ctx)
    if corpus.report.too_long:
        share = corpus.report.too_long / max(1, corpus.report.too_long + corpus.report.pairs)
        _log(
            f"--max-words {config.max_words} dropped {corpus.report.too_long} pairs "
            f"({share:.0%} of the usable ones)",
            ctx,
        )
    _log(
        f"{'official splits' if config.valid_data else 'split'}: {len(corpus.train)} train / "
        f"{len(corpus.valid)} valid / {len(corpus.test)} test pairs; subword vocab "
        f"{len(corpus.src_vocab)} source, {len(corpus.tgt_vocab)} target",
        ctx,
    )
    return corpus


def _log_plan(config: TrainConfig, ctx: Dist, corpus, plan: list) -> None:
    src_pad, tgt_pad = padding_fractions(corpus.train, plan)
    how = (
        f"of at most {config.batch_tokens} padded tokens"
        if config.batch_tokens is not None
        else f"of {config.batch_size} pairs"
    )
    _log(
        f"batches {how}: {len(plan)} per epoch and process, "
        f"{sum(map(len, plan)) / max(1, len(plan)):.1f} pairs each on average, padding "
        f"{src_pad:.1%} of source and {tgt_pad:.1%} of target positions",
        ctx,
    )


def build_model(config: TrainConfig, task: Task, ctx: Dist) -> tuple[Seq2Seq, str]:
    """-> (the model on ctx.device, its attention backend). Under ``compile`` the attention runs
    inside the compiled graph with the same backend."""
    from seq2seq_fast.ops import fused_unavailable_reason

    attention_backend = config.backend
    if attention_backend == "fused":
        reason = fused_unavailable_reason(ctx.device, torch.float32)
        if reason is not None:
            raise TrainError(f"--backend fused is not available: {reason}")
    model_config = Seq2SeqConfig(
        src_vocab_size=len(task.src_vocab),
        tgt_vocab_size=len(task.tgt_vocab),
        embed_size=config.embed_size,
        hidden_size=config.hidden_size,
        attention_size=config.attention_size,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        cell=config.cell,
        bidirectional=config.bidirectional,
        decoder=config.decoder,
        dropout=config.dropout,
        backend=attention_backend,
        output_layer=config.output_layer,
        tie_embeddings=config.tie_embeddings,
        share_embeddings=config.tie_embeddings and shared_vocab(task),
    )
    try:
        model = Seq2Seq(model_config)
    except ValueError as exc:  # e.g. tied embeddings with a projection of another width
        raise TrainError(str(exc).replace("tie_embeddings", "--tie-embeddings")) from None
    return model.to(ctx.device), attention_backend


def bf16_unavailable_reason(device: torch.device) -> str | None:
    """None when ``device`` runs bf16 matrix products natively (CUDA with bf16, or a CPU with
    AVX512-BF16 or AMX through oneDNN), else why not."""
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU has no bf16 support"
    if device.type != "cpu":
        return f"bf16 training is not set up for {device.type} devices"
    if mkldnn_bf16_supported():
        return None
    return (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither AVX512-BF16 nor AMX: "
        "bf16 products would be emulated, slower than fp32"
    )


def autocast_dtype(config: TrainConfig, ctx: Dist) -> torch.dtype | None:
    """The autocast dtype the steps run under (None = fp32), after the hardware check."""
    if config.precision == "fp32":
        return None
    reason = bf16_unavailable_reason(ctx.device)
    if reason is not None:
        _log(f"--precision bf16: {reason}; training in fp32", ctx)
        return None
    return torch.bfloat16


class Clock:
    """Seconds since the job started, the same on every rank (max over ranks), against the time
    budget; updated once per step only when there is a budget."""

    def __init__(self, started: float, budget_min: float | None) -> None:
        self.started = started
        self.budget_s = 60 * budget_min if budget_min is not None else math.inf
        self.elapsed = 0.0

    def progress(self) -> float:
        return self.elapsed / self.budget_s

    @property
    def expired(self) -> bool:
        return self.elapsed >= self.budget_s


def build_optimizer(config: TrainConfig, model: nn.Module, total_steps: int, clock: Clock):
    """-> (AdamW, LambdaLR with linear warmup and cosine decay, following the clock too when
    there is a time budget)."""
    # fused: one kernel over all parameters (CPU and CUDA), faster than the per-tensor loop
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True
    )
    time_progress = None if config.time_budget_min is None else clock.progress
    schedule = _lr_lambda(config.warmup_steps, total_steps, config.min_lr_ratio, time_progress)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
