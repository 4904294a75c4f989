"""The training job's configuration: :class:`TrainConfig`, the per-task defaults, TrainError."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from seq2seq_fast.nn.attention import BACKENDS
from seq2seq_fast.seq2seq.data.split import MAX_HELD_OUT
from seq2seq_fast.seq2seq.data.tokenizers import SPM_SAMPLE_SIZE

# The fields whose default depends on the task. A TrainConfig field left at None takes its
# task's value from here, so that ``TrainConfig(task="translate", data=...)`` in Python and
# ``seq2seq-fast train --task translate --data ...`` build the same job. The reversal main job
# runs on torch's threads (faster than one; bench/RESULTS.md has the times). Why each default
# is what it is, with the runs that chose it: bench/RESULTS.md, "Figures formerly in code
# comments".
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "reverse": {
        "embed_size": 64,
        "hidden_size": 128,
        "dropout": 0.0,
        "epochs": 4,  # the fewest that reach full held-out accuracy on every run tried
        "batch_size": 64,
        "lr": 3e-3,
        "warmup_steps": 100,
        "min_lr_ratio": 0.1,  # ends at full held-out accuracy where 0.02 fell short
        "label_smoothing": 0.0,
        "decoder": "bahdanau",  # on reversal it needs fewer steps than gnmt
        "output_layer": "concat",
    },
    "translate": {
        "embed_size": 256,
        "hidden_size": 256,
        "dropout": 0.1,  # not 0.2: better BLEU at equal short time; more is for longer runs
        "epochs": 10,
        "batch_size": 64,
        "lr": 3e-3,  # near the best of a sweep, a 2x margin below the rate that diverged
        "warmup_steps": 200,
        "min_lr_ratio": 0.02,
        "label_smoothing": 0.1,
        "decoder": "gnmt",
        "output_layer": "attentional",
    },
}

PRECISIONS = ("fp32", "bf16")


class TrainError(RuntimeError):
    """A training job that cannot run as configured."""


@dataclass
class TrainConfig:
    """One training job. Fields left at None marked "task default" take the value of
    ``TASK_DEFAULTS[task]`` when the config is made (``TrainConfig.for_task("translate", ...)``
    says the same); with no argument at all it is the reversal main job (``seq2seq-fast train``).
    """

    task: str = "reverse"
    data: str | None = None
    out: str | None = None  # default runs/<task>
    seed: int = 0
    backend: str = "auto"  # attention backend: auto, fused or reference
    # torch.compile of the whole model (RNN layers and the attention inside one graph)
    compile: bool = False
    # model
    decoder: str | None = None  # task default
    cell: str = "gru"
    embed_size: int | None = None  # task default
    hidden_size: int | None = None  # task default
    attention_size: int | None = None
    encoder_layers: int = 1
    decoder_layers: int = 1
    bidirectional: bool = True
    dropout: float | None = None  # task default
    # task default; "attentional": tanh(W_a [s; c]) of hidden width, then softmax
    output_layer: str | None = None
    # optimisation
    epochs: int | None = None  # task default
    steps_per_epoch: int = 200  # reverse only; translate runs over the training split
    batch_size: int | None = None  # task default
    # translate: batches of length-similar pairs of at most this many padded tokens
    # (pairs x max(source, target + 1) widths) instead of batch_size pairs; None: batch_size
    batch_tokens: int | None = None
    lr: float | None = None  # task default
    weight_decay: float = 0.01
    warmup_steps: int | None = None  # task default
    min_lr_ratio: float | None = None  # task default
    clip_norm: float = 1.0
    # Gradients of this many batches summed (each weighted by its share of the target tokens)
    # before one optimiser step: the step of a batch N times larger, in N batches' memory.
    accum_steps: int = 1
    # Fine-tuning: start from this checkpoint's weights (its vocabularies too), with a fresh
    # optimiser and schedule; its model shape must be this config's. Not --resume (exact
    # continuation).
    init_from: str | None = None
    label_smoothing: float | None = None  # task default
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
    # Their own data (seq2seq/data/store.py, seq2seq/data/vocab.py): a two-file corpus (one sentence a
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
    # token stores and trained tokenizers (default: a per-user cache, data/options.default_cache_dir)
    cache_dir: str | None = None
    spm_sample_size: int = SPM_SAMPLE_SIZE  # pairs the sentencepiece models are trained on (0: all)
    max_held_out: int = MAX_HELD_OUT  # pairs each at most in valid and test carved from a file
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
    # Also write the metrics (metrics.jsonl, always written) as TensorBoard events here.
    tensorboard: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASK_DEFAULTS:
            raise TrainError(f"task must be one of {tuple(TASK_DEFAULTS)}, got {self.task!r}")
        for name, value in TASK_DEFAULTS[self.task].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.task == "translate" and not (self.data or self.src or self.tgt):
            raise TrainError(
                "--task translate needs --data PATH (a .txt/.tsv file or a .zip) "
                "or --src FILE --tgt FILE (one sentence a line)"
            )
        from seq2seq_fast.seq2seq.data.options import check_data_options

        try:
            check_data_options(self)
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        if self.test_data and not self.valid_data:
            raise TrainError("--test-data needs --valid-data (official splits come together)")
        if self.valid_data and self.task != "translate":
            raise TrainError("--valid-data and --test-data are for --task translate")
        if self.backend == "compile":
            raise TrainError(
                "backend 'compile' is now a flag of its own: compile=True (--compile), with "
                "backend 'auto'"
            )
        if self.backend not in BACKENDS:
            raise TrainError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
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
        if not isinstance(self.accum_steps, int) or self.accum_steps < 1:
            raise TrainError(f"accum_steps must be an int >= 1, got {self.accum_steps!r}")
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
        from seq2seq_fast.seq2seq.data.options import uses_token_store

        return uses_token_store(self)

    @classmethod
    def for_task(cls, task: str, **overrides: Any) -> TrainConfig:
        """The job of ``task`` with its defaults (TASK_DEFAULTS), ``overrides`` on top: the
        config ``seq2seq-fast train --task TASK`` builds from the same options."""
        return cls(task=task, **overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A config stored in a checkpoint (``asdict``); keys of other versions are dropped, and
        the old ``backend="compile"`` reads as ``compile=True`` with the "auto" backend."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("backend") == "compile":
            values["backend"], values["compile"] = "auto", True
        return cls(**values)
