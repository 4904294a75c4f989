"""Training: the reversal and translation tasks, checkpoints, exact resume, DDP through torchrun.

``train(TrainConfig(...))`` runs one training job and returns a :class:`TrainResult`; the command
line (``seq2seq-fast train``) is a thin wrapper around it. One job:

- builds the task (reverse: sequences drawn fresh from a seeded generator; translate: a corpus
  file split with a fixed seed, sentencepiece vocabularies trained on the training split),
- trains with AdamW, gradient clipping and a warmup + cosine learning-rate schedule, a tqdm bar
  showing loss and target tokens/s,
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

The parts: ``build_task`` (vocabularies, batches, held-out data), ``build_model`` and
``build_optimizer`` (put together, with a resumed checkpoint restored, by ``build_job``),
``run_epoch`` (``train_step`` per batch), ``evaluate``, ``save_job`` (the checkpoint) and
``finish`` (final evaluation, heatmap, report). Checkpoint files are read and written by
:mod:`seq2seq_fast.seq2seq.checkpoint`, decoding is :mod:`seq2seq_fast.seq2seq.decoding`.
"""

from __future__ import annotations

import copy
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from seq2seq_fast.seq2seq import canary
from seq2seq_fast.seq2seq.canary import FusedKernelError  # noqa: F401 (raised here)
from seq2seq_fast.seq2seq.checkpoint import (  # noqa: F401 (re-exported: the names' old home)
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    CheckpointError,
    inference_payload,
    is_inference_only,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from seq2seq_fast.seq2seq.data import (
    Batch,
    ReverseTask,
    TranslationData,
    epoch_batches,
    make_batch,
    max_lengths,
    padding_fractions,
    shared_vocab,
    token_batches,
    vocab_from_state,
)
from seq2seq_fast.seq2seq.decoding import Hypothesis, decode  # noqa: F401 (re-exported)
from seq2seq_fast.seq2seq.models import (
    Seq2Seq,
    Seq2SeqConfig,
    compile_model,
    sequence_loss,
)

TRAIN_BACKENDS = ("auto", "fused", "reference", "compile")
PRECISIONS = ("fp32", "bf16")


class TrainError(RuntimeError):
    """A training job that cannot run as configured."""


@dataclass
class TrainConfig:
    """One training job. Defaults are the reversal main job (``seq2seq-fast train``)."""

    task: str = "reverse"
    data: str | None = None
    out: str | None = None  # default runs/<task>
    seed: int = 0
    backend: str = "auto"
    # model
    decoder: str = "bahdanau"  # on reversal it needs ~2x fewer steps than gnmt for 99%
    cell: str = "gru"
    embed_size: int = 64
    hidden_size: int = 128
    attention_size: int | None = None
    encoder_layers: int = 1
    decoder_layers: int = 1
    bidirectional: bool = True
    dropout: float = 0.0
    output_layer: str = "concat"  # "attentional": tanh(W_a [s; c]) of hidden width, then softmax
    # optimisation
    epochs: int = 3
    steps_per_epoch: int = 200  # reverse only; translate runs over the training split
    batch_size: int = 64
    # translate: batches of length-similar pairs of at most this many padded tokens
    # (pairs x max(source, target + 1) widths) instead of batch_size pairs; None: batch_size
    batch_tokens: int | None = None
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    # 0.1: the reversal job ends at 100% held-out (0.02: 99.8%, seeds 0 and 1, 2 threads)
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    label_smoothing: float = 0.0
    # bf16: the forward under torch.autocast (bf16 products, fp32 master weights and optimiser);
    # falls back to fp32, saying why, where the hardware has no native bf16 products.
    precision: str = "fp32"
    # reverse task
    vocab_size: int = 32
    min_len: int = 8
    max_len: int = 24
    heldout_size: int = 1000
    # translate task
    direction: str = "1-2"  # "1-2": column 1 -> column 2; "2-1": the other way
    max_words: int | None = None  # None: keep every pair (the drop is reported when set)
    max_pairs: int | None = None
    spm_vocab_size: int = 4000
    normalization: str = "NFKC"
    valid_fraction: float = 0.02
    test_fraction: float = 0.03
    # Official splits, used as given (then ``data`` is the training split, not split again).
    valid_data: str | None = None
    test_data: str | None = None  # needs valid_data; none: no test BLEU
    # Their own data (seq2seq/store.py, seq2seq/vocab.py): a two-file corpus (one sentence a
    # line), official splits as two files, tokenizers (an existing sentencepiece model per side,
    # or one shared; or vocabulary files for pre-tokenised text), tied embeddings, and the on-disk
    # token store (on for --src/--tgt, with any tokenizer option and for a --data file over
    # 100 MB; a smaller --data alone: in memory, as before).
    src: str | None = None
    tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    test_src: str | None = None
    test_tgt: str | None = None
    spm: str | None = None  # one sentencepiece model for both sides (a shared vocabulary)
    src_spm: str | None = None
    tgt_spm: str | None = None
    src_vocab_file: str | None = None  # one token a line, or token<TAB>count
    tgt_vocab_file: str | None = None
    share_vocab: bool = False  # one vocabulary for both sides (trained on both when not given)
    # decoder input embedding = output projection; with a shared vocabulary the encoder's too
    tie_embeddings: bool = False
    token_store: bool | None = None  # None: as above; True/False force it on/off
    cache_dir: str | None = None  # token stores and trained tokenizers (default <out>/data-cache)
    spm_sample_size: int = 100_000  # pairs the sentencepiece models are trained on (0: all)
    max_held_out: int = 3000  # at most this many pairs each in valid and test carved from a file
    eval_size: int = 500  # valid pairs scored with BLEU after each epoch
    eval_beam: int = 1  # beam for the final test BLEU
    # Also evaluate every N steps (0: at epoch ends only). Each evaluation that beats the best so
    # far (valid BLEU; reverse: held-out sequence accuracy) writes best.pt beside model.pt.
    eval_every: int = 0
    patience: int = 0  # stop after this many evaluations without a new best (0: never)
    # Stop training (then evaluate) after this many minutes; the learning-rate decay then follows
    # the clock too. Such a run depends on the machine's speed: not reproducible, resume not exact.
    time_budget_min: float | None = None
    # bookkeeping
    save_every: int = 0  # also checkpoint every N steps (0 = at epoch ends only)
    # Keep the weights of the last N epoch ends as model.epochE.pt (inference-only files, to
    # average with ``seq2seq-fast export --checkpoint model.epoch*.pt``); 0: none.
    keep_checkpoints: int = 0
    stop_after_steps: int | None = (
        None  # stop (checkpoint) early, schedule unchanged: simulates a kill
    )
    progress: bool = True
    heatmap: bool = True
    threads: int | None = None  # torch intra-op threads (None = torch's default)

    def __post_init__(self) -> None:
        if self.task not in ("reverse", "translate"):
            raise TrainError(f"task must be 'reverse' or 'translate', got {self.task!r}")
        if self.task == "translate" and not (self.data or self.src or self.tgt):
            raise TrainError("--task translate needs --data PATH (a .txt/.tsv file or a .zip) "
                             "or --src FILE --tgt FILE (one sentence a line)")  # fmt: skip
        from seq2seq_fast.seq2seq.store import check_data_options

        try:
            check_data_options(self)
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        if self.test_data and not self.valid_data:
            raise TrainError("--test-data needs --valid-data (official splits come together)")
        if self.valid_data and self.task != "translate":
            raise TrainError("--valid-data and --test-data are for --task translate")
        if self.backend not in TRAIN_BACKENDS:
            raise TrainError(f"backend must be one of {TRAIN_BACKENDS}, got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise TrainError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.output_layer not in ("concat", "attentional"):
            raise TrainError(
                f"output_layer must be 'concat' or 'attentional', got {self.output_layer!r}"
            )
        if self.direction not in ("1-2", "2-1"):
            raise TrainError(f"direction must be '1-2' or '2-1', got {self.direction!r}")
        for name in ("epochs", "steps_per_epoch", "batch_size", "heldout_size"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise TrainError(f"keep_checkpoints must be >= 0, got {self.keep_checkpoints}")
        if self.batch_tokens is not None:
            if self.task != "translate":
                raise TrainError("--batch-tokens is for --task translate")
            if self.batch_tokens < 1:
                raise TrainError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if not 0.0 <= self.label_smoothing < 1.0:  # also rejects nan
            raise TrainError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise TrainError(f"clip_norm must be finite and >= 0 (0 = off), got {self.clip_norm}")

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/{self.task}")

    @property
    def uses_token_store(self) -> bool:
        from seq2seq_fast.seq2seq.store import uses_token_store

        return uses_token_store(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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


# --- distributed ---------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed() -> Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Dist(0, 1, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


# --- evaluation ------------------------------------------------------------------------------------


def reverse_accuracy(model: Seq2Seq, pairs, device: torch.device) -> dict[str, float]:
    hyps = decode(model, [s for s, _ in pairs], device=device, max_len_factor=1.0)
    seq_ok = tok_ok = tok_total = 0
    for hyp, (_, ref) in zip(hyps, pairs, strict=True):
        seq_ok += hyp.tokens == ref
        tok_ok += sum(a == b for a, b in zip(hyp.tokens, ref, strict=False))
        tok_total += len(ref)
    return {"seq_acc": seq_ok / len(pairs), "tok_acc": tok_ok / tok_total}


def bleu_score(
    model: Seq2Seq, pairs: list[tuple[str, str]], src_vocab, tgt_vocab, device, beam: int = 1
) -> float:
    import sacrebleu

    hyps = decode(model, [src_vocab.encode(s) for s, _ in pairs], device=device, beam=beam)
    outputs = [tgt_vocab.decode(h.tokens) for h in hyps]
    return float(sacrebleu.BLEU().corpus_score(outputs, [[t for _, t in pairs]]).score)


def bleu_signature() -> str:
    """sacreBLEU's signature of the BLEU that :func:`bleu_score` computes (one reference)."""
    import sacrebleu

    metric = sacrebleu.BLEU()
    metric.corpus_score(["a"], [["a"]])  # the signature counts the references of the last call
    return str(metric.get_signature())


def describe(metrics: dict[str, float]) -> str:
    """One line for the log: accuracies for reverse, BLEU scores for translate."""
    if "seq_acc" in metrics:
        return (
            f"held-out sequence accuracy {metrics['seq_acc']:.2%} (token {metrics['tok_acc']:.2%})"
        )
    return ", ".join(f"{k} {v:.2f}" for k, v in metrics.items())


# --- the training job ------------------------------------------------------------------------------


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


def _rng_state(data_generator: torch.Generator | None) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if data_generator is not None:
        state["data"] = data_generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], data_generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if data_generator is not None and "data" in state:
        data_generator.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _synced_elapsed(started: float, ctx: Dist) -> float:
    """Seconds since ``started``; under DDP the maximum over ranks, so all ranks agree."""
    elapsed = time.perf_counter() - started
    if not ctx.enabled:
        return elapsed
    value = torch.tensor([elapsed], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _log(message: str, rank: Dist) -> None:
    if rank.is_main:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)


@dataclass
class Task:
    """What the training loop needs from a task: vocabularies, batches, held-out data."""

    kind: str
    src_vocab: Any
    tgt_vocab: Any
    steps_per_epoch: int
    pad_src: int  # padded widths under torch.compile
    pad_tgt: int
    info: dict[str, Any]  # stored in the checkpoint
    reverse: ReverseTask | None = None
    heldout: list | None = None  # reverse: held-out id pairs
    generator: torch.Generator | None = None  # reverse: draws the training batches
    corpus: TranslationData | None = None  # translate: the encoded splits
    last_plan: tuple | None = None  # (its key, the plan) of epoch_plan's last call

    def epoch_plan(self, config: TrainConfig, epoch: int, ctx: Dist) -> list[list[int]] | None:
        """translate: this rank's batches (index lists) of one epoch; reverse: None. The last
        plan is kept: build_task counts epoch 0's batches, the first epoch then uses them (over
        millions of pairs a plan takes seconds)."""
        if self.corpus is None:
            return None
        key = (epoch, ctx.rank, ctx.world_size, config.seed, config.batch_tokens,
               config.batch_size)  # fmt: skip
        if self.last_plan is not None and self.last_plan[0] == key:
            return self.last_plan[1]
        if config.batch_tokens is not None:
            plan = token_batches(self.corpus.train, config.batch_tokens, seed=config.seed,
                                 epoch=epoch, rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
        else:
            plan = epoch_batches(self.corpus.train, config.batch_size, seed=config.seed,
                                 epoch=epoch, rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
        self.last_plan = (key, plan)
        return plan

    def pairs(self, batch_size: int, plan: list[list[int]] | None, position: int) -> list:
        """The id pairs of the batch at ``position`` of the epoch (reverse: drawn fresh)."""
        if self.reverse is not None:
            return self.reverse.sample(self.generator, batch_size)
        return [self.corpus.train[i] for i in plan[position]]

    def example(self) -> str:
        """The held-out sentence drawn in the final heatmap."""
        if self.reverse is not None:
            return self.src_vocab.decode(self.heldout[0][0])
        return (self.corpus.test or self.corpus.valid)[0][0]


def build_task(config: TrainConfig, ctx: Dist, payload: dict[str, Any] | None) -> Task:
    """The reversal task, or the translation corpus with its vocabularies (a checkpoint's on
    resume, else trained on the training split)."""
    if config.task == "reverse":
        reverse = ReverseTask(
            config.vocab_size, config.min_len, config.max_len, config.seed, config.heldout_size
        )
        return Task(
            "reverse", reverse.vocab, reverse.vocab, config.steps_per_epoch,
            config.max_len, config.max_len + 1,
            {"kind": "reverse", "vocab_size": config.vocab_size, "min_len": config.min_len,
             "max_len": config.max_len},
            reverse=reverse, heldout=reverse.heldout(),
            generator=torch.Generator().manual_seed(config.seed * 7919 + 17 + ctx.rank),
        )  # fmt: skip
    vocabs = None
    if payload is not None:  # on resume, the vocabularies the model was trained with
        vocabs = (vocab_from_state(payload["src_vocab"]), vocab_from_state(payload["tgt_vocab"]))
    if config.uses_token_store:  # streamed into an on-disk token store (seq2seq/store.py)
        from seq2seq_fast.seq2seq.store import open_store_corpus

        corpus = open_store_corpus(config, vocabs=vocabs, rank=ctx.rank,
                                   world_size=ctx.world_size, log=lambda m: _log(m, ctx))  # fmt: skip
    else:
        corpus = TranslationData.load(
            config.data, swap=config.direction == "2-1", max_words=config.max_words,
            max_pairs=config.max_pairs, vocab_size=config.spm_vocab_size,
            normalization=config.normalization, valid_fraction=config.valid_fraction,
            test_fraction=config.test_fraction, seed=config.seed, vocabs=vocabs,
            valid_path=config.valid_data, test_path=config.test_data,
            max_held_out=config.max_held_out,
        )  # fmt: skip
    _log(corpus.report.summary(), ctx)
    if corpus.report.too_long:
        share = corpus.report.too_long / max(1, corpus.report.too_long + corpus.report.pairs)
        _log(f"--max-words {config.max_words} dropped {corpus.report.too_long} pairs "
             f"({share:.0%} of the usable ones)", ctx)  # fmt: skip
    _log(
        f"{'official splits' if config.valid_data else 'split'}: {len(corpus.train)} train / "
        f"{len(corpus.valid)} valid / {len(corpus.test)} test pairs; subword vocab "
        f"{len(corpus.src_vocab)} source, {len(corpus.tgt_vocab)} target",
        ctx,
    )
    longest_src, longest_tgt = max_lengths(corpus.train)
    task = Task(
        "translate", corpus.src_vocab, corpus.tgt_vocab, 0, longest_src, longest_tgt + 1,
        {"kind": "translate", "data": str(config.data), "direction": config.direction,
         "valid_data": config.valid_data, "test_data": config.test_data,
         "src": config.src, "tgt": config.tgt, "shared_vocab": shared_vocab(corpus)},
        corpus=corpus,
    )  # fmt: skip
    plan = task.epoch_plan(config, 0, ctx)
    task.steps_per_epoch = len(plan)
    src_pad, tgt_pad = padding_fractions(corpus.train, plan)
    how = (f"of at most {config.batch_tokens} padded tokens" if config.batch_tokens is not None
           else f"of {config.batch_size} pairs")  # fmt: skip
    _log(f"batches {how}: {len(plan)} per epoch and process, "
         f"{sum(map(len, plan)) / max(1, len(plan)):.1f} pairs each on average, padding "
         f"{src_pad:.1%} of source and {tgt_pad:.1%} of target positions", ctx)  # fmt: skip
    return task


def build_model(config: TrainConfig, task: Task, ctx: Dist) -> tuple[Seq2Seq, str]:
    """-> (the model on ctx.device, its attention backend). ``--backend compile`` runs the "auto"
    attention inside the compiled graph."""
    from seq2seq_fast.ops.additive_attention import fused_unavailable_reason

    attention_backend = "auto" if config.backend == "compile" else config.backend
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
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if native is not None and native():
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
    # fused: one kernel over all parameters (CPU and CUDA), ~4x faster than the per-tensor loop
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True
    )
    time_progress = None if config.time_budget_min is None else clock.progress
    schedule = _lr_lambda(config.warmup_steps, total_steps, config.min_lr_ratio, time_progress)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


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
        _set_rng_state(rng, self.task.generator)


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
    rng_state = _rng_state(job.task.generator)
    if ctx.enabled:
        states = [None] * ctx.world_size
        dist.all_gather_object(states, rng_state)
        rng_state = states
    if ctx.is_main:
        save_checkpoint(
            {
                "format": CHECKPOINT_FORMAT,
                "version": CHECKPOINT_VERSION,
                **_model_header(job),
                "model": job.model.state_dict(),
                "optimizer": job.optimizer.state_dict(),
                "scheduler": job.scheduler.state_dict(),
                "rng": rng_state,
                "epoch": job.epoch,
                "batch_in_epoch": job.batch_in_epoch,
                "world_size": ctx.world_size,
                "best": {"score": job.best_score, "evals_since": job.evals_since_best},
            },
            path or job.checkpoint_path,
        )
    if ctx.enabled:
        dist.barrier()


SNAPSHOT = re.compile(r"model\.epoch(\d+)\.pt")


def snapshots(folder: Path) -> list[Path]:
    """The epoch snapshots (model.epochE.pt) in ``folder``, oldest epoch first."""
    epochs = {}
    for path in folder.glob("model.epoch*.pt"):
        match = SNAPSHOT.fullmatch(path.name)
        if match:
            epochs[path] = int(match.group(1))
    return sorted(epochs, key=epochs.__getitem__)


def save_snapshot(job: Job) -> None:
    """``keep_checkpoints`` N > 0: the weights at this epoch's end as model.epochE.pt beside
    model.pt (weights and vocabularies only, as ``export`` writes them), then the snapshots
    older than the last N removed. Rank 0 writes."""
    keep = job.config.keep_checkpoints
    if not keep or not job.ctx.is_main:
        return
    folder = job.checkpoint_path.parent
    save_checkpoint(
        inference_payload(_model_header(job), job.model.state_dict(), "float32"),
        folder / f"model.epoch{job.epoch}.pt",
    )
    for old in snapshots(folder)[:-keep]:
        old.unlink(missing_ok=True)


def evaluate(job: Job, final: bool = False, model: Seq2Seq | None = None) -> dict[str, float]:
    """reverse: held-out accuracies; translate: valid BLEU (``eval_size`` pairs, greedy), or with
    ``final`` the test BLEU (beam ``eval_beam``). Of ``model``, default the job's (last) model."""
    config, task, device = job.config, job.task, job.ctx.device
    model = job.model if model is None else model
    if task.reverse is not None:
        return reverse_accuracy(model, task.heldout, device)
    if final:
        if not task.corpus.test:  # official splits without a test file
            return {}
        return {"test_bleu": bleu_score(model, task.corpus.test, task.src_vocab,
                                        task.tgt_vocab, device, beam=config.eval_beam)}  # fmt: skip
    return {"valid_bleu": bleu_score(model, task.corpus.valid[: config.eval_size],
                                     task.src_vocab, task.tgt_vocab, device)}  # fmt: skip


def train_step(job: Job, batch: Batch) -> float:
    """One optimiser step on ``batch``; -> its loss."""
    config = job.config
    # The dropout masks' generator state, for the canary's re-run of a non-finite step (a 5 KB
    # copy, only with dropout and fused kernels).
    rng = canary.forward_rng_state(job.ctx.device) if job.canary and config.dropout > 0 else None
    with torch.autocast(job.ctx.device.type, dtype=job.autocast or torch.bfloat16,
                        enabled=job.autocast is not None):  # fmt: skip
        if config.backend == "compile":  # the loss outside the compiled graph, as before
            logits, _ = job.run_model(batch.src, batch.src_lengths, batch.tgt_in)
            loss = sequence_loss(logits.float(), batch.tgt_out, config.label_smoothing)
        else:  # output layer + loss by chunks of rows (ops/linear_cross_entropy.py)
            loss, _ = job.run_model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out,
                                    label_smoothing=config.label_smoothing)  # fmt: skip
    job.optimizer.zero_grad(set_to_none=True)
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
        verdict = _canary(job, batch, float(loss.detach()), rng) if job.canary else None
        _skip_nonfinite_step(job, float(loss.detach()), verdict)
    if config.time_budget_min is not None:
        job.clock.elapsed = _synced_elapsed(job.clock.started, job.ctx)
    job.scheduler.step()
    job.step += 1
    job.batch_in_epoch += 1
    loss_value = float(loss.detach())
    job.losses.append(loss_value)
    return loss_value


# Steps in a row with a non-finite gradient norm after which a run counts as diverged.
MAX_NONFINITE_STEPS = 20

# The canary's verdicts on a non-finite step, ordered so that the largest over ranks decides.
CANARY_FUSED_FAULT, CANARY_DIVERGED, CANARY_UNVERIFIED = 0, 1, 2


def _canary(job: Job, batch: Batch, loss: float, rng) -> canary.Rerun:
    """A non-finite step on fused kernels: the batch again on plain PyTorch (seq2seq/canary.py).
    Finite on every rank: raise FusedKernelError, the batch and weights written beside the
    checkpoint. Otherwise -> the rank's reference re-run (``finite`` False: the model itself
    diverged on some rank; None: the re-run could not run), and the step is skipped.

    Under DDP every rank re-runs its own batch on the bare module (no gradient all-reduce), and
    the verdicts are combined with one all_reduce (MAX), so every rank decides the same."""
    model, ctx, config = job.model, job.ctx, job.config
    # What the fused path got wrong, then its gradients freed: the re-runs need the memory, and
    # the skipped update never reads them (the next step sets them to None anyway).
    nonfinite = [n for n, p in model.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())]  # fmt: skip
    for p in model.parameters():
        p.grad = None
    options = dict(label_smoothing=config.label_smoothing, autocast=job.autocast, rng_state=rng)
    reference, pre = canary.reference_rerun(model, batch, **options)
    code = {True: CANARY_FUSED_FAULT, False: CANARY_DIVERGED, None: CANARY_UNVERIFIED}
    verdict = _max_over_ranks(ctx, [code[reference.finite]])[0]
    if verdict != CANARY_FUSED_FAULT:
        if verdict != code[reference.finite]:  # another rank decided
            reference.finite = None if verdict == CANARY_UNVERIFIED else False
            reference.error = reference.error or "on another rank"
        return reference
    compiled = config.backend == "compile"
    reproduced, served = canary.probe_fused_parts(model, batch, recurrent=not compiled, **options)
    parts = ("attention", "recurrent")
    flags = _max_over_ranks(ctx, [float(p in reproduced) for p in parts]
                            + [float(bool(served)), *pre.values()])  # fmt: skip
    reproduced = [p for p, flag in zip(parts, flags, strict=False) if flag]
    pre = dict(zip(pre, flags[3:], strict=True))
    step = job.step + 1
    ops = [canary.attention_ops(ctx.device, config.decoder)]
    if served:
        ops.append("recurrent " + ", ".join(sorted(served)) + " (C++ CPU kernels)")
    elif flags[2]:
        ops.append("recurrent GRU/LSTM ops (C++ CPU kernels, on another rank)")
    if compiled:
        ops[0] += " inside torch.compile's graph"
    details = {
        "step": step,
        "fused_loss": loss,
        "reference_loss": reference.loss,
        "world_size": ctx.world_size,
        "ops": ops,
        "backend": config.backend,
        "reproduced_by": reproduced,
        "batch": canary.describe_batch(batch),
        "model": f"{config.decoder} decoder, {config.cell} {config.hidden_size}, attention "
        f"{config.attention_size or config.hidden_size}",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")
        + (
            f" under autocast {str(job.autocast).removeprefix('torch.')}"
            if job.autocast
            else " (no autocast)"
        ),
        "device": str(ctx.device),
        "isa": canary.cpu_isa(),
        "torch": str(torch.__version__),
        "preactivation": pre,
        "nonfinite_params": nonfinite,
    }
    batches = [canary.batch_tensors(batch)]
    if ctx.enabled:
        batches = [None] * ctx.world_size
        dist.all_gather_object(batches, canary.batch_tensors(batch))
    path = config.out_dir / f"fused-failure-step{step}.pt"
    written: Path | None = path
    if ctx.is_main:
        payload = {
            **details,
            "model_config": model.config.to_dict(),
            "train_config": asdict(config),
            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "batch": batches[0],
            "rank_batches": batches,
            "forward_rng": rng,
            "training": model.training,
            "autocast": None if job.autocast is None else str(job.autocast).split(".")[-1],
            "label_smoothing": config.label_smoothing,
        }
        try:
            canary.write_failure(path, payload)
        except OSError as exc:
            written, details["write_error"] = None, f"{type(exc).__name__}: {exc}"
    if ctx.enabled:
        dist.barrier()  # the file is complete before any rank stops
    details["path"] = str(written) if written else None
    raise FusedKernelError(canary.failure_message(details), written, details)


def _max_over_ranks(ctx: Dist, values: list[float]) -> list[float]:
    """``values`` unchanged in one process; under DDP the elementwise maximum over ranks."""
    if not ctx.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _skip_nonfinite_step(job: Job, loss: float, reference: canary.Rerun | None = None) -> None:
    """A step whose gradient norm is inf or NaN: no update (the weights stay finite). One is
    reported; MAX_NONFINITE_STEPS in a row save the run's last finite state and stop it.
    ``reference``: the canary's plain-PyTorch re-run of the step (None: fused kernels were not
    in use, --backend reference)."""
    job.nonfinite_steps += 1
    config = job.config
    if reference is None:
        cause = "the model itself diverged (on the reference attention backend: no re-run)"
    elif reference.finite is False:
        cause = ("the model itself diverged (the plain-PyTorch reference re-run of the step "
                 "gives non-finite values as well)")  # fmt: skip
    else:
        cause = (f"not verified (the plain-PyTorch reference re-run could not run: "
                 f"{reference.error}; a fused-kernel fault is not ruled out)")  # fmt: skip
    if job.nonfinite_steps == 1:
        _log(f"step {job.step + 1}: non-finite gradient (loss {loss}), update skipped: {cause}",
             job.ctx)  # fmt: skip
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
    if job.clock.expired:
        _log(f"time budget of {job.config.time_budget_min} min reached at step {job.step}", job.ctx)
        return True
    return False


def run_epoch(job: Job) -> bool:
    """Train from the job's position to the end of its epoch; -> True when stopped early."""
    from tqdm import tqdm

    config, ctx, task = job.config, job.ctx, job.task
    compiled = config.backend == "compile"
    plan = task.epoch_plan(config, job.epoch, ctx)
    if plan is not None and len(plan) != task.steps_per_epoch:  # the schedule counted them once
        raise TrainError(f"epoch {job.epoch + 1} has {len(plan)} batches, the first had "
                         f"{task.steps_per_epoch}")  # fmt: skip
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
    window_tokens, window_start = 0, time.perf_counter()
    try:
        while job.batch_in_epoch < task.steps_per_epoch:
            batch = make_batch(
                task.pairs(config.batch_size, plan, job.batch_in_epoch),
                src_pad_to=task.pad_src if compiled else None,
                tgt_pad_to=task.pad_tgt if compiled else None,
            ).to(ctx.device)
            loss_value = train_step(job, batch)
            window_tokens += batch.num_target_tokens * ctx.world_size
            bar.update(1)
            if job.step % 10 == 0 or job.batch_in_epoch == task.steps_per_epoch:
                now = time.perf_counter()
                bar.set_postfix(
                    loss=f"{loss_value:.3f}",
                    tok_s=f"{window_tokens / max(now - window_start, 1e-9):,.0f}",
                    lr=f"{job.scheduler.get_last_lr()[0]:.1e}",
                )
                window_tokens, window_start = 0, now
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


def _score(metrics: dict[str, float]) -> float | None:
    return metrics.get("valid_bleu", metrics.get("seq_acc"))


def track_best(job: Job) -> bool:
    """After an evaluation: write best.pt when it beats the best so far; -> True when
    ``patience`` evaluations in a row brought nothing better (early stop). Rank 0's metrics
    decide, for every rank."""
    job.scored_step = job.step
    score = _score(job.metrics) if job.ctx.is_main else None
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
        _log(f"early stop at step {job.step}: {job.evals_since_best} evaluations without a "
             f"better score than {job.best_score:.4g} (best.pt)", job.ctx)  # fmt: skip
        return True
    return False


def _evaluate_now(job: Job) -> bool:
    """The interval evaluation inside an epoch; -> True to stop early."""
    if job.ctx.is_main:
        job.metrics = evaluate(job)
    _log(f"step {job.step}: {describe(job.metrics)}", job.ctx)
    job.model.train()
    return track_best(job)


def train(config: TrainConfig, *, resume: str | Path | None = None) -> TrainResult:
    """Run one training job (see module docstring). ``resume`` continues a checkpoint exactly."""
    threads = torch.get_num_threads()
    try:
        return _train(config, resume)
    finally:
        torch.set_num_threads(threads)


def _resume_config(config: TrainConfig, resume: str | Path) -> tuple[TrainConfig, dict[str, Any]]:
    """-> (the checkpoint's config, with the output folder and run-length options of ``config``;
    the checkpoint)."""
    payload = load_checkpoint(resume)
    if is_inference_only(payload):
        raise TrainError(
            f"{resume} is an exported inference model (weights and vocabularies, no optimiser "
            "state): it cannot be resumed; resume from the training checkpoint instead"
        )
    from seq2seq_fast.seq2seq.store import check_tokenizers_fit

    check_tokenizers_fit(config, payload, str(resume))  # tokenizer files given with --resume
    saved = TrainConfig.from_dict(dict(payload.get("train_config", {})))
    # Everything comes from the checkpoint, except where the files go and how long to run.
    saved.out = config.out if config.out is not None else str(Path(resume).parent)
    saved.stop_after_steps = config.stop_after_steps
    saved.progress = config.progress
    # The thread count changes the products' summation order: keep the saved one (exact resume)
    # unless one is given.
    if config.threads is not None:
        saved.threads = config.threads
    return saved, payload


def build_job(config: TrainConfig, ctx: Dist, payload: dict[str, Any] | None, started: float):
    """Seed, build the task, the model and its optimiser (in this order: the seeded RNG streams
    depend on it), and restore ``payload`` when resuming."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    task = build_task(config, ctx, payload)
    model, attention_backend = build_model(config, task, ctx)
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
        job.run_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
        )
    if config.backend == "compile":
        # one graph: RNN layers and the fused op inside
        job.run_model = compile_model(job.run_model)
    return job


def _train(config: TrainConfig, resume: str | Path | None) -> TrainResult:
    started = time.perf_counter()
    ctx = setup_distributed()
    payload = None
    if resume is not None:
        config, payload = _resume_config(config, resume)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    job = build_job(config, ctx, payload, started)
    if resume is None and config.keep_checkpoints and ctx.is_main:
        stale = snapshots(job.checkpoint_path.parent)  # not this run's: they would mix in
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            _log(f"removed {len(stale)} epoch snapshot(s) of an earlier run: "
                 f"{', '.join(p.name for p in stale)}", ctx)  # fmt: skip
    if ctx.is_main:
        params = sum(p.numel() for p in job.model.parameters())
        _log(
            f"task {config.task}: {config.decoder} decoder, {config.cell} {config.hidden_size}, "
            f"{params / 1e6:.2f}M parameters, attention backend "
            f"{'compile+' if config.backend == 'compile' else ''}{job.attention_backend}, "
            f"{ctx.world_size} process(es), {job.total_steps} steps"
            f"{', autocast bf16' if job.autocast is not None else ''}",
            ctx,
        )
    stopped_early = False
    while job.epoch < config.epochs and not stopped_early:
        stopped_early = run_epoch(job)
        if job.batch_in_epoch >= job.task.steps_per_epoch:
            job.epoch, job.batch_in_epoch = job.epoch + 1, 0
            if ctx.is_main:
                job.metrics = evaluate(job)
            _log(
                f"epoch {job.epoch}/{config.epochs} step {job.step}: loss {job.losses[-1]:.4f}, "
                f"{describe(job.metrics)} [{time.perf_counter() - started:.0f}s]",
                ctx,
            )
            stopped_early = track_best(job) or stopped_early
            save_job(job)
            save_snapshot(job)
        else:
            save_job(job)
    if job.clock.expired and job.best_score is not None and job.scored_step != job.step:
        # The budget ran out between evaluations: score the last model too, or the final
        # evaluation would take an older best.pt over a better, never scored, last state.
        _evaluate_now(job)
        save_job(job)
    return finish(job, payload, stopped_early)


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
        _log(f"{path} holds another run's best (score {payload.get('best', {}).get('score')}, "
             f"this run's {job.best_score}): evaluating the last model", job.ctx)  # fmt: skip
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
            plot_translation(final.model, job.task.src_vocab, job.task.tgt_vocab,
                             job.task.example(), heatmap_path, device=ctx.device)  # fmt: skip
        _record_final(job, final, payload)
    if ctx.enabled:
        dist.barrier()
    seconds = time.perf_counter() - job.clock.started
    if ctx.is_main:
        _log(f"{describe(job.metrics)} ({final})", ctx)
        if config.task == "translate":
            _log(f"BLEU: sacreBLEU {bleu_signature()}", ctx)
        _log(f"checkpoint: {job.checkpoint_path}", ctx)
        if heatmap_path is not None:
            _log(f"attention heatmap: {heatmap_path}", ctx)
        _log(f"trained {job.step} steps in {seconds:.0f}s", ctx)
    return TrainResult(
        job.checkpoint_path, heatmap_path, job.metrics, job.losses, job.step, job.epoch, seconds,
        final_checkpoint=job.checkpoint_path.with_name(final.name) if final else None,
        final_step=final.step if final else job.step,
    )  # fmt: skip


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
