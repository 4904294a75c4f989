"""The training job's configuration: :class:`TrainConfig`, one typed schema for every spelling.

Each field of :class:`TrainConfig` carries its :class:`Option`: its section, help text, flag and
what ``--resume`` and ``--init-from`` may do with it. The ``train`` command's flags
(:func:`add_train_arguments`), the YAML keys of ``--config`` and ``config.yaml``
(``seq2seq_fast.seq2seq.configfile``), ``--dump-config``, and the resume and fine-tune rules
(:meth:`TrainConfig.resumed`, :func:`init_shape`) are all read from it, so a new option is one
field. Each section validates its own fields (``SECTION_CHECKS``).
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from seq2seq_fast.nn.attention import BACKENDS
from seq2seq_fast.seq2seq.data.split import MAX_HELD_OUT
from seq2seq_fast.seq2seq.data.tokenizers import SPM_SAMPLE_SIZE

# The fields whose default depends on the task. A TrainConfig field left at None takes its
# task's value from here, so that ``TrainConfig(task="translate", data=...)`` in Python and
# ``seq2seq-fast train --task translate --data ...`` build the same job. Why each value was
# chosen, with the measurements: bench/RESULTS.md ("Defaults").
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "reverse": {
        "embed_size": 64,
        "hidden_size": 128,
        "dropout": 0.0,
        "epochs": 4,
        "batch_size": 64,
        "lr": 3e-3,
        "warmup_steps": 100,
        "min_lr_ratio": 0.1,
        "label_smoothing": 0.0,
        "decoder": "bahdanau",
        "output_layer": "concat",
    },
    "translate": {
        "embed_size": 256,
        "hidden_size": 256,
        "dropout": 0.1,
        "epochs": 10,
        "batch_size": 64,
        "lr": 3e-3,
        "warmup_steps": 200,
        "min_lr_ratio": 0.02,
        "label_smoothing": 0.1,
        "decoder": "gnmt",
        "output_layer": "attentional",
    },
}

PRECISIONS = ("fp32", "bf16")
SECTIONS = ("run", "model", "optimisation", "data", "evaluation")

# What --resume does with an option given again: CHANGE applies it (the run goes on with it);
# CHECKED is compared with the checkpoint's own files (the tokenizers: same content, any path);
# FIXED must equal the checkpoint's value, else the resume is refused naming the option.
CHANGE, CHECKED, FIXED = "change", "checked", "fixed"
# The tokenizer options (CHECKED on resume).
TOKENIZER_FIELDS = ("spm", "src_spm", "tgt_spm", "src_vocab_file", "tgt_vocab_file")


class TrainError(RuntimeError):
    """A training job that cannot run as configured."""


def parse_bool(text: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (a flag's BOOL value)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


@dataclass(frozen=True)
class Option:
    """How one TrainConfig field is spelled and treated outside Python.

    ``flag``: the long flag (default ``--field-name``); ``switch``: a bool given by its bare flag
    (``--compile``); ``negated``: a bool turned off by this flag (``--no-progress``); other bools
    take a BOOL value. ``choices``/``metavar``/``help`` are argparse's (``help=None`` hides the
    flag). ``resume``: CHANGE, CHECKED or FIXED (above). ``shape``: part of the model's shape,
    taken from the checkpoint by ``--init-from``. ``inherited=False``: an option for one
    process only (``--stop-after-steps``), which a resumed run does not take over."""

    section: str
    help: str | None = ""
    flag: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    switch: bool = False
    negated: str | None = None
    resume: str = FIXED
    shape: bool = False
    inherited: bool = True  # False: a resumed run starts from the default, not the checkpoint's

    def flag_for(self, name: str) -> str:
        return self.negated or self.flag or "--" + name.replace("_", "-")


def opt(default: Any, section: str, help: str | None = "", **kwargs: Any) -> Any:
    """A TrainConfig field with its :class:`Option`."""
    return field(default=default, metadata={"option": Option(section, help, **kwargs)})


def option_of(f) -> Option:
    return f.metadata["option"]


@dataclass
class TrainConfig:
    """One training job. Fields left at None marked "task default" take the value of
    ``TASK_DEFAULTS[task]`` when the config is made (``TrainConfig.for_task("translate", ...)``
    says the same); with no argument at all it is the reversal main job (``seq2seq-fast train``).
    """

    # -- run: what runs where, and its bookkeeping
    task: str = opt("reverse", "run", choices=tuple(TASK_DEFAULTS))
    data: str | None = opt(
        None, "data", "translate: parallel corpus, source<TAB>target lines (.txt/.tsv or .zip)"
    )
    out: str | None = opt(
        None,
        "run",
        "output folder for model.pt and attention.png (default runs/<task>)",
        resume=CHANGE,
    )
    seed: int = opt(0, "run")
    backend: str = opt(
        "auto",
        "run",
        "attention backend (compile: the same as --compile, kept as an alias)",
        choices=(*BACKENDS, "compile"),
        resume=CHANGE,
    )
    compile: bool = opt(
        False,
        "run",
        "torch.compile the whole model, RNN layers and attention in one graph",
        switch=True,
        resume=CHANGE,
    )
    # -- model
    decoder: str | None = opt(None, "model", choices=("gnmt", "bahdanau"), shape=True)
    cell: str = opt("gru", "model", choices=("gru", "lstm"), shape=True)
    embed_size: int | None = opt(None, "model", shape=True)
    hidden_size: int | None = opt(None, "model", shape=True)
    attention_size: int | None = opt(None, "model", shape=True)
    encoder_layers: int = opt(1, "model", shape=True)
    decoder_layers: int = opt(1, "model", shape=True)
    bidirectional: bool = opt(True, "model", metavar="BOOL", shape=True)
    dropout: float | None = opt(None, "model")
    output_layer: str | None = opt(
        None,
        "model",
        "softmax input: [s; c] itself, or tanh(W [s; c]) of hidden width",
        choices=("concat", "attentional"),
        shape=True,
    )
    # decoder input embedding = output projection; with a shared vocabulary the encoder's too
    tie_embeddings: bool = opt(
        False,
        "model",
        "the decoder's output projection is its input embedding; with a shared vocabulary the "
        "encoder's embedding too",
        switch=True,
        shape=True,
    )
    # -- optimisation
    epochs: int | None = opt(None, "optimisation", resume=CHANGE)
    steps_per_epoch: int = opt(200, "optimisation", "reverse task: batches per epoch")
    batch_size: int | None = opt(None, "optimisation", "pairs per batch")
    batch_tokens: int | None = opt(
        None,
        "optimisation",
        "translate: instead, batches of length-similar pairs of at most N padded tokens "
        "(pairs x max(source, target+1) widths)",
        metavar="N",
    )
    accum_steps: int = opt(
        1,
        "optimisation",
        "sum the gradients of N batches per optimiser step (a batch N times larger, in one "
        "batch's memory)",
        metavar="N",
    )
    lr: float | None = opt(None, "optimisation")
    weight_decay: float = opt(0.01, "optimisation")
    warmup_steps: int | None = opt(None, "optimisation")
    min_lr_ratio: float | None = opt(None, "optimisation")
    clip_norm: float = opt(1.0, "optimisation")
    label_smoothing: float | None = opt(None, "optimisation")
    init_from: str | None = opt(
        None,
        "optimisation",
        "fine-tune: start from this checkpoint's weights, vocabularies and model shape, with a "
        "fresh optimiser and schedule",
        metavar="CHECKPOINT",
    )
    precision: str = opt(
        "fp32",
        "optimisation",
        "bf16: autocast with fp32 master weights (fp32 where the CPU lacks AVX512-BF16/AMX)",
        choices=PRECISIONS,
    )
    time_budget_min: float | None = opt(
        None,
        "optimisation",
        "stop training after this many minutes; the learning rate's cosine decay then follows "
        "the elapsed time or the steps, whichever is further along, so the run ends at a low rate",
        resume=CHANGE,
    )
    # -- data: the reversal task's
    vocab_size: int = opt(32, "data", "reverse task: number of symbols (default 32)", shape=True)
    min_len: int = opt(8, "data", "reverse task: shortest sequence (default 8)")
    max_len: int = opt(24, "data", "reverse task: longest sequence (default 24)")
    heldout_size: int = opt(1000, "data", "reverse task: held-out sequences (default 1000)")
    # -- data: translation's
    direction: str = opt(
        "1-2",
        "data",
        "1-2: column 1 -> column 2 (default); 2-1: the other way",
        choices=("1-2", "2-1"),
    )
    max_words: int | None = opt(
        256,
        "data",
        "drop pairs with a side longer than this many words (default 256: one very long line "
        "makes a batch's memory grow with its length; 0 keeps every pair)",
    )
    max_pairs: int | None = opt(None, "data", "use a fixed-seed random subset of the pairs")
    spm_vocab_size: int = opt(4000, "data", "sentencepiece vocabulary per side")
    normalization: str = opt("NFKC", "data", choices=("NFKC", "NFC"))
    valid_fraction: float = opt(0.02, "data")
    test_fraction: float = opt(0.03, "data")
    valid_data: str | None = opt(
        None,
        "data",
        "official validation split: used as given, and --data is then the training split "
        "(not split again)",
        metavar="PATH",
    )
    test_data: str | None = opt(
        None,
        "data",
        "official test split (with --valid-data): the final test BLEU",
        metavar="PATH",
    )
    src: str | None = opt(None, "data", "training source sentences, one a line", metavar="FILE")
    tgt: str | None = opt(None, "data", "training target sentences, line by line", metavar="FILE")
    valid_src: str | None = opt(
        None, "data", "official validation split, source side", metavar="FILE"
    )
    valid_tgt: str | None = opt(
        None, "data", "official validation split, target side", metavar="FILE"
    )
    test_src: str | None = opt(None, "data", "official test split, source side", metavar="FILE")
    test_tgt: str | None = opt(None, "data", "official test split, target side", metavar="FILE")
    spm: str | None = opt(
        None,
        "data",
        "an existing sentencepiece model for both sides (a shared vocabulary)",
        metavar="MODEL",
        resume=CHECKED,
    )
    src_spm: str | None = opt(
        None, "data", "an existing sentencepiece model, source", metavar="MODEL", resume=CHECKED
    )
    tgt_spm: str | None = opt(
        None, "data", "an existing sentencepiece model, target", metavar="MODEL", resume=CHECKED
    )
    src_vocab_file: str | None = opt(
        None,
        "data",
        "pre-tokenised source text: its vocabulary, one token a line (or token<TAB>count)",
        flag="--src-vocab",
        metavar="FILE",
        resume=CHECKED,
    )
    tgt_vocab_file: str | None = opt(
        None,
        "data",
        "pre-tokenised target text: its vocabulary file",
        flag="--tgt-vocab",
        metavar="FILE",
        resume=CHECKED,
    )
    share_vocab: bool = opt(
        False,
        "data",
        "one vocabulary for both sides (trained on both when not given)",
        switch=True,
    )
    token_store: bool | None = opt(
        None,
        "data",
        "the on-disk token store on or off (default: on for --src/--tgt, with a tokenizer "
        "option, and for a --data file over 100 MB)",
        metavar="BOOL",
    )
    cache_dir: str | None = opt(
        None,
        "data",
        "where token stores and trained tokenizers are kept (default $SEQ2SEQ_FAST_CACHE_DIR, "
        "else $XDG_CACHE_HOME/seq2seq-fast, else ~/.cache/seq2seq-fast: shared by runs)",
        metavar="DIR",
        resume=CHANGE,
    )
    spm_sample_size: int = opt(
        SPM_SAMPLE_SIZE,
        "data",
        f"train sentencepiece on a random sample of N pairs (default {SPM_SAMPLE_SIZE}; 0: all)",
        metavar="N",
    )
    max_held_out: int = opt(
        MAX_HELD_OUT,
        "data",
        f"valid and test sets carved from one file: at most N pairs each (default {MAX_HELD_OUT})",
        metavar="N",
    )
    # -- evaluation
    eval_size: int = opt(500, "evaluation", "valid pairs scored after each epoch", resume=CHANGE)
    eval_beam: int = opt(1, "evaluation", "beam size for the final test BLEU", resume=CHANGE)
    eval_every: int = opt(
        0,
        "evaluation",
        "also evaluate every N steps; a new best score writes best.pt",
        resume=CHANGE,
    )
    patience: int = opt(
        0,
        "evaluation",
        "stop after N evaluations without a new best (default: never)",
        resume=CHANGE,
    )
    # -- run: bookkeeping
    save_every: int = opt(0, "run", "also checkpoint every N steps", resume=CHANGE)
    keep_checkpoints: int = opt(
        0,
        "run",
        "keep the weights of the last N epochs as model.epochE.pt, to average with export",
        metavar="N",
        resume=CHANGE,
    )
    # stop (checkpoint) early, schedule unchanged: simulates a kill
    stop_after_steps: int | None = opt(None, "run", None, resume=CHANGE, inherited=False)
    progress: bool = opt(True, "run", "no progress bar", negated="--no-progress", resume=CHANGE)
    heatmap: bool = opt(
        True, "run", "no attention heatmap at the end", negated="--no-heatmap", resume=CHANGE
    )
    threads: int | None = opt(
        None, "run", "torch CPU threads (default: torch's choice)", resume=CHANGE
    )
    tensorboard: str | None = opt(
        None,
        "run",
        "also write the metrics as TensorBoard events to DIR (needs the tensorboard package; "
        "metrics.jsonl is always written)",
        metavar="DIR",
        resume=CHANGE,
    )

    def __post_init__(self) -> None:
        if self.task not in TASK_DEFAULTS:
            raise TrainError(f"task must be one of {tuple(TASK_DEFAULTS)}, got {self.task!r}")
        for name, value in TASK_DEFAULTS[self.task].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for check in SECTION_CHECKS.values():
            check(self)

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

    @classmethod
    def resumed(cls, saved: dict[str, Any], given: dict[str, Any], source: str) -> TrainConfig:
        """The config a resumed run continues with: the checkpoint's (``saved``, its
        ``train_config``), with the options ``given`` again that may change mid-run (CHANGE)
        applied. A FIXED option given with another value than the checkpoint's is refused,
        all of them named in one TrainError; CHECKED ones (tokenizer files) are not applied:
        the caller compares them with the checkpoint's tokenizers."""
        config = cls.from_dict(saved)
        given = _normalised(given)
        changed, refused = {}, []
        for f in fields(cls):
            if not option_of(f).inherited:
                changed[f.name] = f.default
        for f in fields(cls):
            if f.name not in given:
                continue
            option, value = option_of(f), given[f.name]
            if option.resume == FIXED and value != getattr(config, f.name):
                refused.append(
                    f"{option.flag_for(f.name)} {_show(value)} "
                    f"(checkpoint: {_show(getattr(config, f.name))})"
                )
            elif option.resume == CHANGE:
                changed[f.name] = value
        if refused:
            raise TrainError(
                f"--resume {source}: these options differ from the checkpoint's and cannot change "
                f"in a resumed run: {'; '.join(refused)}. Resume without them, or start a new run "
                "(--init-from to start from its weights)"
            )
        return replace(config, **changed)


def _normalised(values: dict[str, Any]) -> dict[str, Any]:
    """Given options as TrainConfig fields: the old ``backend="compile"`` is ``compile=True``."""
    values = dict(values)
    if values.get("backend") == "compile":
        values["backend"], values["compile"] = "auto", True
    return values


def _show(value: Any) -> str:
    """A value as a flag would be written (a string bare, unless empty or with spaces)."""
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return "(none)" if value is None else repr(value) if isinstance(value, str) else str(value)


def _check_run(config: TrainConfig) -> None:
    if config.backend == "compile":
        raise TrainError(
            "backend 'compile' is now a flag of its own: compile=True (--compile), with "
            "backend 'auto'"
        )
    if config.backend not in BACKENDS:
        raise TrainError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
    if config.save_every < 0:
        raise TrainError(f"save_every must be >= 0 (0: off), got {config.save_every}")
    if config.keep_checkpoints < 0:
        raise TrainError(f"keep_checkpoints must be >= 0, got {config.keep_checkpoints}")
    if config.threads is not None and config.threads < 1:
        raise TrainError(f"threads must be >= 1, got {config.threads}")


def _check_model(config: TrainConfig) -> None:
    if config.output_layer not in ("concat", "attentional"):
        raise TrainError(
            f"output_layer must be 'concat' or 'attentional', got {config.output_layer!r}"
        )


def _check_optimisation(config: TrainConfig) -> None:
    if config.precision not in PRECISIONS:
        raise TrainError(f"precision must be one of {PRECISIONS}, got {config.precision!r}")
    for name in ("epochs", "steps_per_epoch", "batch_size"):
        if getattr(config, name) < 1:
            raise TrainError(f"{name} must be >= 1, got {getattr(config, name)}")
    if not isinstance(config.accum_steps, int) or config.accum_steps < 1:
        raise TrainError(f"accum_steps must be an int >= 1, got {config.accum_steps!r}")
    if config.batch_tokens is not None:
        if config.task != "translate":
            raise TrainError("--batch-tokens is for --task translate")
        if config.batch_tokens < 1:
            raise TrainError(f"batch_tokens must be >= 1, got {config.batch_tokens}")
    if not 0.0 <= config.label_smoothing < 1.0:  # also rejects nan
        raise TrainError(f"label_smoothing must be in [0, 1), got {config.label_smoothing}")
    if not (_finite(config.clip_norm) and config.clip_norm >= 0):
        raise TrainError(f"clip_norm must be finite and >= 0 (0 = off), got {config.clip_norm}")
    _check_schedule(config)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _check_schedule(config: TrainConfig) -> None:
    """The learning rate and its schedule, and the time budget (None: the task's default or no
    budget)."""
    if config.lr is not None and not (_finite(config.lr) and config.lr >= 0):
        raise TrainError(
            f"lr (the learning rate) must be finite and >= 0 (0: the weights stay), got {config.lr}"
        )
    if not (_finite(config.weight_decay) and config.weight_decay >= 0):
        raise TrainError(f"weight_decay must be finite and >= 0, got {config.weight_decay}")
    if config.warmup_steps is not None and config.warmup_steps < 0:
        raise TrainError(f"warmup_steps must be >= 0 (0: none), got {config.warmup_steps}")
    ratio = config.min_lr_ratio
    if ratio is not None and not (_finite(ratio) and 0.0 <= ratio <= 1.0):
        raise TrainError(f"min_lr_ratio must be in [0, 1] (of lr, the schedule's end), got {ratio}")
    budget = config.time_budget_min
    if budget is not None and not (_finite(budget) and budget > 0):
        raise TrainError(f"time_budget_min must be finite and > 0 (minutes), got {budget}")


# the smallest --spm-vocab-size taken (sentencepiece refuses fewer pieces than the corpus's
# characters with an error of its own, which the vocabulary's training names the flag in)
MIN_SPM_VOCAB = 8


def _check_data(config: TrainConfig) -> None:
    if config.task == "translate" and not (config.data or config.src or config.tgt):
        raise TrainError(
            "--task translate needs --data PATH (a .txt/.tsv file or a .zip) "
            "or --src FILE --tgt FILE (one sentence a line)"
        )
    from seq2seq_fast.seq2seq.data.options import check_data_options

    try:
        check_data_options(config)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    if config.test_data and not config.valid_data:
        raise TrainError("--test-data needs --valid-data (official splits come together)")
    if config.valid_data and config.task != "translate":
        raise TrainError("--valid-data and --test-data are for --task translate")
    if config.direction not in ("1-2", "2-1"):
        raise TrainError(f"direction must be '1-2' or '2-1', got {config.direction!r}")
    if config.heldout_size < 1:
        raise TrainError(f"heldout_size must be >= 1, got {config.heldout_size}")
    if config.max_words is not None and config.max_words < 0:
        raise TrainError(f"max_words must be >= 0 (0: keep every pair), got {config.max_words}")
    if config.max_pairs is not None and config.max_pairs < 1:
        raise TrainError(f"max_pairs must be >= 1 (leave it out for all), got {config.max_pairs}")
    if config.spm_vocab_size < MIN_SPM_VOCAB:
        raise TrainError(
            f"spm_vocab_size must be >= {MIN_SPM_VOCAB} (sentencepiece needs room for its 4 "
            f"special pieces and the corpus's characters), got {config.spm_vocab_size}"
        )
    fractions = (config.valid_fraction, config.test_fraction)
    if not all(_finite(f) and 0.0 <= f < 1.0 for f in fractions) or sum(fractions) >= 1.0:
        raise TrainError(
            "valid_fraction and test_fraction must each be in [0, 1) and sum to less than 1 "
            f"(the rest is trained on), got {fractions[0]} and {fractions[1]}"
        )


def _check_evaluation(config: TrainConfig) -> None:
    for name in ("eval_size", "eval_beam"):
        if getattr(config, name) < 1:
            raise TrainError(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("eval_every", "patience"):
        if getattr(config, name) < 0:
            raise TrainError(f"{name} must be >= 0 (0: off), got {getattr(config, name)}")


# Each section validates its own fields, in this order (the run's first: a bad backend is named
# before anything reads data).
SECTION_CHECKS: dict[str, Callable[[TrainConfig], None]] = {
    "run": _check_run,
    "model": _check_model,
    "optimisation": _check_optimisation,
    "data": _check_data,
    "evaluation": _check_evaluation,
}


def _argument_type(hint: Any) -> Any:
    """The argparse type of a field's type hint (``int | None`` -> int)."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    kind = kinds[0]
    return parse_bool if kind is bool else kind if kind in (int, float) else None


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, grouped by section, every default None (a flag left out
    takes the config's default, or on resume the checkpoint's value)."""
    hints = typing.get_type_hints(TrainConfig)
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    for f in fields(TrainConfig):
        option = option_of(f)
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": None,
            "help": argparse.SUPPRESS if option.help is None else option.help,
        }
        if option.switch:
            kwargs["action"] = "store_true"
        elif option.negated:
            kwargs["action"] = "store_false"
        else:
            kwargs["type"] = _argument_type(hints[f.name])
            if option.choices is not None:
                kwargs["choices"] = list(option.choices)
            if option.metavar is not None:
                kwargs["metavar"] = option.metavar
        groups[option.section].add_argument(option.flag_for(f.name), **kwargs)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields given on the command line (or by --config): those not None."""
    return {
        f.name: getattr(args, f.name)
        for f in fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }


def shape_options() -> tuple[str, ...]:
    """The fields that make the model's shape (``--init-from`` takes them from the checkpoint)."""
    return tuple(f.name for f in fields(TrainConfig) if option_of(f).shape)


def init_shape(payload: dict[str, Any], given: dict[str, Any], source: str) -> dict[str, Any]:
    """The model-shape options of a fine-tuning job (``--init-from``): the checkpoint's (the
    Seq2SeqConfig it stores; the reversal task's vocabulary size from its training config, when
    the new job is that task too), refusing by name a given one that differs."""
    model_config = dict(payload.get("model_config") or {})
    trained = dict(payload.get("train_config") or {})
    same_task = trained.get("task") == given.get("task", "reverse")
    if trained.get("task") is not None and not same_task:
        raise TrainError(
            f"--init-from {source}: a --task {trained['task']} checkpoint cannot start a "
            f"--task {given.get('task', 'reverse')} job (its vocabularies are that task's); "
            "fine-tune it on the same task"
        )
    taken, refused = {}, []
    for f in fields(TrainConfig):
        if not option_of(f).shape:
            continue
        if f.name in model_config:
            theirs = model_config[f.name]
        elif same_task and f.name in trained:
            theirs = trained[f.name]
        else:
            continue
        if f.name in given and given[f.name] != theirs:
            refused.append(
                f"{option_of(f).flag_for(f.name)} {_show(given[f.name])} "
                f"(checkpoint: {_show(theirs)})"
            )
        taken[f.name] = theirs
    if refused:
        raise TrainError(
            f"--init-from {source}: the model shape is the checkpoint's, and these options "
            f"differ from it: {'; '.join(refused)}. Leave them out"
        )
    return taken
