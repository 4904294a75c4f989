"""TrainConfig: the per-task defaults resolved in Python as on the command line, --compile."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from seq2seq_fast.seq2seq.cli import build_parser, train_config
from seq2seq_fast.seq2seq.config import TASK_DEFAULTS, TrainConfig, TrainError


def cli_config(*args: str) -> TrainConfig:
    return train_config(build_parser().parse_args(["train", *args]))


@pytest.mark.parametrize("task", ["reverse", "translate"])
def test_python_and_cli_build_the_same_job(task):
    data = ["--data", "corpus.tsv"] if task == "translate" else []
    kwargs = {"data": "corpus.tsv"} if task == "translate" else {}
    from_cli = cli_config("--task", task, *data)
    assert TrainConfig(task=task, **kwargs) == from_cli
    assert TrainConfig.for_task(task, **kwargs) == from_cli
    for name, value in TASK_DEFAULTS[task].items():
        assert getattr(from_cli, name) == value, name


def test_the_task_defaults_differ_and_each_task_gets_its_own():
    reverse, translate = TrainConfig(), TrainConfig.for_task("translate", data="c.tsv")
    differing = {
        k
        for k in TASK_DEFAULTS["translate"]
        if TASK_DEFAULTS["translate"][k] != TASK_DEFAULTS["reverse"][k]
    }
    assert differing  # else the test below checks nothing
    for name in differing:
        assert getattr(translate, name) != getattr(reverse, name), name


def test_an_option_given_beats_the_task_default():
    assert TrainConfig.for_task(
        "translate", data="c.tsv", lr=1e-3, decoder="bahdanau"
    ) == cli_config(
        "--task", "translate", "--data", "c.tsv", "--lr", "1e-3", "--decoder", "bahdanau"
    )
    config = cli_config("--task", "translate", "--data", "c.tsv", "--dropout", "0")
    assert config.dropout == 0.0 != TASK_DEFAULTS["translate"]["dropout"]


def test_a_stored_config_reads_back_unchanged():
    config = TrainConfig.for_task("translate", data="c.tsv", hidden_size=48)
    assert TrainConfig.from_dict(asdict(config)) == config


def test_compile_is_a_flag_and_backend_compile_an_alias():
    flag = cli_config("--compile")
    assert flag.compile and flag.backend == "auto"
    assert cli_config("--backend", "compile") == flag
    assert cli_config("--compile", "--backend", "reference").backend == "reference"
    # a checkpoint written when compile was a backend
    old = asdict(TrainConfig()) | {"backend": "compile"}
    assert TrainConfig.from_dict(old) == flag
    with pytest.raises(TrainError, match=r"compile=True \(--compile\)"):
        TrainConfig(backend="compile")


def test_an_unknown_task_is_named():
    with pytest.raises(TrainError, match="'summarise'"):
        TrainConfig(task="summarise")


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        (
            "--lr",
            "-0.001",
            r"lr \(the learning rate\) must be finite and >= 0 \(0: the weights stay\), got -0.001",
        ),
        ("--lr", "nan", "learning rate\\) must be finite and >= 0.*got nan"),
        ("--lr", "inf", "learning rate\\) must be finite and >= 0.*got inf"),
        ("--weight-decay", "-1", "weight_decay must be finite and >= 0, got -1.0"),
        ("--warmup-steps", "-5", r"warmup_steps must be >= 0 \(0: none\), got -5"),
        ("--min-lr-ratio", "1.5", r"min_lr_ratio must be in \[0, 1\].*got 1.5"),
        ("--min-lr-ratio", "-0.1", r"min_lr_ratio must be in \[0, 1\].*got -0.1"),
        ("--time-budget-min", "-3", "time_budget_min must be finite and > 0.*got -3.0"),
        ("--time-budget-min", "0", "time_budget_min must be finite and > 0.*got 0.0"),
    ],
)
def test_a_bad_schedule_value_is_named(flag, value, match):
    """Each was taken before: a negative warmup or a ratio above 1 ran a schedule nobody asked
    for, a negative budget stopped at once, all without a word; a negative lr got torch's words."""
    with pytest.raises(TrainError, match=match):
        cli_config(flag, value)


def test_the_schedule_edges_are_allowed():
    config = cli_config("--warmup-steps", "0", "--min-lr-ratio", "1", "--min-lr-ratio", "0")
    assert (config.warmup_steps, config.min_lr_ratio) == (0, 0.0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--max-pairs", "0"), r"max_pairs must be >= 1 \(leave it out for all\), got 0"),
        (("--max-pairs", "-1"), "max_pairs must be >= 1.*got -1"),
        (("--max-words", "-2"), r"max_words must be >= 0 \(0: keep every pair\), got -2"),
        (("--spm-vocab-size", "0"), "spm_vocab_size must be >= 8.*got 0"),
        (("--spm-vocab-size", "5"), "spm_vocab_size must be >= 8.*got 5"),
        (("--valid-fraction", "1.5"), "must each be in \\[0, 1\\).*got 1.5 and 0.03"),
        (("--valid-fraction", "-0.1"), "must each be in \\[0, 1\\).*got -0.1"),
        (("--test-fraction", "1"), "must each be in \\[0, 1\\).*got 0.02 and 1.0"),
        (("--valid-fraction", "0.6", "--test-fraction", "0.4"), "sum to less than 1.*0.6 and 0.4"),
        (("--valid-fraction", "nan"), "must each be in \\[0, 1\\).*got nan"),
        (("--save-every", "-3"), r"save_every must be >= 0 \(0: off\), got -3"),
    ],
)
def test_a_bad_data_or_run_value_is_named(args, match):
    """Each was taken before: --max-pairs 0 and -1 ended in an IndexError and a negative
    dimension, fractions of 1 and more trained on one pair with exit status 0, a tiny
    sentencepiece vocabulary in sentencepiece's own traceback, --save-every -3 silently."""
    with pytest.raises(TrainError, match=match):
        cli_config("--task", "translate", "--data", "corpus.tsv", *args)


def test_long_pairs_are_dropped_by_default_and_zero_keeps_them():
    """A very long line in a training corpus (20,000 words) grew a run past 24 GB: pairs longer
    than 256 words are dropped by default (and counted in the log); --max-words 0 keeps all."""
    assert cli_config("--task", "translate", "--data", "c.tsv").max_words == 256
    assert cli_config("--task", "translate", "--data", "c.tsv", "--max-words", "0").max_words == 0
