"""The files of a run: metrics.jsonl (and TensorBoard events), config.yaml and --config files,
--dump-config, and fine-tuning with --init-from."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict

import pytest
import torch
import yaml

from seq2seq_fast.seq2seq.checkpoint import load_checkpoint
from seq2seq_fast.seq2seq.cli import build_parser, main, train_config
from seq2seq_fast.seq2seq.config import TASK_DEFAULTS, TrainConfig, TrainError
from seq2seq_fast.seq2seq.metrics import read_metrics
from seq2seq_fast.seq2seq.train import train

TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=20,
    embed_size=16,
    hidden_size=32,
    batch_size=16,
    lr=1e-2,
    warmup_steps=5,
    backend="reference",
    progress=False,
    heatmap=False,
    threads=1,
    epochs=2,
    steps_per_epoch=12,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return train(TrainConfig(**TINY, out=str(out), eval_every=5))


# --- metrics.jsonl ---------------------------------------------------------------------------


def test_metrics_jsonl_holds_the_training_curve_and_the_evaluations(run):
    records = read_metrics(run.checkpoint.parent)
    train_rows = [r for r in records if r["kind"] == "train"]
    # every 10 steps and at each epoch's end: steps 10, 12, 20, 24
    assert [r["step"] for r in train_rows] == [10, 12, 20, 24]
    assert train_rows[0]["loss"] == pytest.approx(sum(run.losses[:10]) / 10, rel=1e-12)
    assert train_rows[1]["loss"] == pytest.approx(sum(run.losses[10:12]) / 2, rel=1e-12)
    for row in train_rows:
        assert row["lr"] > 0 and row["tokens_per_s"] > 0 and row["elapsed_s"] >= 0
    times = [r["time"] for r in records]
    assert times == sorted(times) and all(math.isfinite(t) for t in times)
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [5, 10, 12, 15, 20, 24]  # eval_every 5, epoch ends
    assert all(0.0 <= r["seq_acc"] <= 1.0 and 0.0 <= r["tok_acc"] <= 1.0 for r in valid)
    final = records[-1]
    assert final["kind"] == "final" and final["seq_acc"] == run.metrics["seq_acc"]


def test_a_resumed_run_appends_and_a_new_one_starts_afresh(tmp_path):
    config = TrainConfig(**TINY, out=str(tmp_path))
    train(TrainConfig(**asdict(config) | {"stop_after_steps": 10}))
    first = read_metrics(tmp_path)
    assert max(r["step"] for r in first) == 10
    train(config, resume=tmp_path / "model.pt")
    resumed = read_metrics(tmp_path)
    assert resumed[: len(first)] == first and resumed[-1]["kind"] == "final"
    with pytest.raises(TrainError, match="holds another run"):
        train(TrainConfig(**asdict(config) | {"epochs": 1}))
    assert read_metrics(tmp_path) == resumed  # refused before anything was written
    train(TrainConfig(**asdict(config) | {"epochs": 1}), overwrite=True)
    fresh = read_metrics(tmp_path)
    assert fresh[0]["step"] == 10 and max(r["step"] for r in fresh) == 12


def test_a_resumed_run_drops_the_records_of_the_steps_it_trains_again(tmp_path):
    # A run killed at step 20 after its last checkpoint at step 10: the records of steps 11-20
    # are in metrics.jsonl, and the resumed run trains those steps again.
    config = TrainConfig(**TINY, out=str(tmp_path))
    train(TrainConfig(**asdict(config) | {"stop_after_steps": 10}))
    first = read_metrics(tmp_path)
    lost = {"kind": "train", "step": 20, "time": 0.0, "elapsed_s": 0.0, "loss": 9.9}
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(lost) + "\n")
    train(config, resume=tmp_path / "model.pt")
    resumed = read_metrics(tmp_path)
    assert resumed[: len(first)] == first and lost not in resumed
    steps = [r["step"] for r in resumed if r["kind"] == "train"]
    assert steps == [10, 12, 20, 24]


def test_tensorboard_events_hold_the_same_values(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    train(
        TrainConfig(
            **TINY | {"epochs": 1}, out=str(tmp_path / "run"), tensorboard=str(tmp_path / "tb")
        )
    )
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [r["step"] for r in rows]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"train/lr", "train/tokens_per_s", "valid/seq_acc", "final/seq_acc"} <= set(
        events.Tags()["scalars"]
    )


def test_tensorboard_missing_names_the_flag_and_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    code = main(
        [
            "train",
            "--out",
            str(tmp_path),
            "--tensorboard",
            str(tmp_path / "tb"),
            "--steps-per-epoch",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"--tensorboard {tmp_path / 'tb'} needs the tensorboard package" in err
    assert "pip install" in err


# --- config files ----------------------------------------------------------------------------


def _cli(*args):
    return train_config(build_parser().parse_args(["train", *args]))


def test_config_file_precedence_task_defaults_then_file_then_flags(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "task: translate\ndata: corpus.tsv\nhidden-size: 48\nlr: 0.001\nlabel_smoothing: 0.0\n",
        encoding="utf-8",
    )
    assert main(["train", "--config", str(path), "--lr", "0.002", "--dump-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["hidden_size"] == 48  # the file
    assert resolved["lr"] == 0.002  # the flag over the file
    assert resolved["label_smoothing"] == 0.0  # the file over the task default (0.1)
    assert resolved["embed_size"] == TASK_DEFAULTS["translate"]["embed_size"]  # task default
    expected = TrainConfig.for_task(
        "translate", data="corpus.tsv", hidden_size=48, lr=0.002, label_smoothing=0.0
    )
    assert resolved == asdict(expected)


def test_a_flag_equal_to_its_default_still_beats_the_file(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text("beam: 4\ndevice: cuda\nn-best: 2\n", encoding="utf-8")
    argv = [
        "translate",
        "--config",
        str(path),
        "--checkpoint",
        "x.pt",
        "--device",
        "cpu",
        "--dump-config",
    ]
    assert main(argv) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert (resolved["beam"], resolved["n_best"], resolved["device"]) == (4, 2, "cpu")
    assert resolved["alpha"] == 0.6 and resolved["checkpoint"] == "x.pt"


@pytest.mark.parametrize(
    ("text", "heatmap", "progress"),
    [
        ("no-heatmap: true\nno_progress: true\n", False, False),
        ("no-heatmap: false\n", True, True),
        ("heatmap: false\nprogress: false\n", False, False),
        ("heatmap: true\n", True, True),
    ],
)
def test_a_negating_flag_spelled_in_a_config_file_means_what_the_flag_means(
    tmp_path, capsys, text, heatmap, progress
):
    path = tmp_path / "flags.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["train", "--config", str(path), "--dump-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert (resolved["heatmap"], resolved["progress"]) == (heatmap, progress)


@pytest.mark.parametrize("command", ["train", "translate"])
def test_an_unknown_key_names_the_key_and_the_file(tmp_path, capsys, command):
    path = tmp_path / "bad.yaml"
    path.write_text("lr: 0.1\nhiden-size: 3\n" if command == "train" else "beam: 2\nbem: 2\n")
    assert main([command, "--config", str(path), "--dump-config"]) == 2
    err = capsys.readouterr().err
    key = "hiden-size" if command == "train" else "bem"
    assert f"--config {path}: unknown key {key!r}" in err


def test_a_config_file_that_is_not_a_mapping(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- lr\n- 0.1\n")
    assert main(["train", "--config", str(path)]) == 2
    assert f"--config {path}: expected a mapping" in capsys.readouterr().err


def test_the_resolved_config_is_written_beside_the_checkpoint_and_reads_back(run, capsys):
    folder = run.checkpoint.parent
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written == load_checkpoint(run.checkpoint)["train_config"]
    assert written["hidden_size"] == TINY["hidden_size"] and written["eval_every"] == 5
    assert not list(folder.glob(".config.yaml.tmp-*"))
    assert main(["train", "--config", str(folder / "config.yaml"), "--dump-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == written


def test_translate_reads_its_options_from_a_config_file(run, tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps({"checkpoint": str(run.checkpoint), "beam": 3}))  # JSON is YAML
    assert main(["translate", "--config", str(path), "a b c"]) == 0
    from_file = capsys.readouterr().out
    assert main(["translate", "--checkpoint", str(run.checkpoint), "--beam", "3", "a b c"]) == 0
    assert from_file == capsys.readouterr().out != ""


# --- --init-from -----------------------------------------------------------------------------


def test_init_from_takes_the_weights_with_a_fresh_optimiser(run, tmp_path):
    config = TrainConfig(
        **TINY | {"lr": 0.0, "epochs": 1, "steps_per_epoch": 3},
        out=str(tmp_path),
        init_from=str(run.checkpoint),
        seed=5,
    )
    result = train(config)
    old, new = load_checkpoint(run.checkpoint), load_checkpoint(result.checkpoint)
    # lr 0: the weights are the checkpoint's, untouched
    assert all(torch.equal(old["model"][k], new["model"][k]) for k in old["model"])
    # a fresh optimiser and schedule: 3 steps, not the checkpoint's 24 + 3
    assert {float(s["step"]) for s in new["optimizer"]["state"].values()} == {3.0}
    assert new["scheduler"]["last_epoch"] == 3 and new["step"] == 3
    assert new["train_config"]["init_from"] == str(run.checkpoint)
    assert result.step == 3


def test_init_from_a_different_shape_says_what_differs(run, tmp_path, capsys):
    config = TrainConfig(
        **TINY | {"hidden_size": 48, "vocab_size": 7},
        out=str(tmp_path),
        init_from=str(run.checkpoint),
    )
    with pytest.raises(TrainError) as info:
        train(config)
    message = str(info.value)
    assert f"--init-from {run.checkpoint}" in message
    assert "hidden_size: 48 (checkpoint: 32)" in message
    assert "src_vocab_size: 11 (checkpoint: 10)" in message
    assert "source vocabulary" in message and "target vocabulary" in message
    assert "embed_size" not in message and "dropout" not in message
    code = main(
        [
            "train",
            "--out",
            str(tmp_path / "cli"),
            "--init-from",
            str(run.checkpoint),
            "--hidden-size",
            "48",
            "--no-progress",
        ]
    )
    # the command line takes the shape from the checkpoint: a shape flag that differs is refused
    assert code == 2 and "--hidden-size 48 (checkpoint: 32)" in capsys.readouterr().err


def test_init_from_another_task_is_refused_by_name(run, tmp_path, capsys):
    """A reversal checkpoint given to a translation job ended in an AttributeError (its symbol
    vocabulary has no sentencepiece batch encoder)."""
    corpus = tmp_path / "c.tsv"
    corpus.write_text("".join(f"a{i} b\tc d{i}\n" for i in range(40)))
    argv = ["train", "--task", "translate", "--data", str(corpus), "--out", str(tmp_path / "o")]
    code = main([*argv, "--init-from", str(run.checkpoint), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "a --task reverse checkpoint cannot start a --task translate job" in err, err


def test_init_from_a_missing_file_is_a_clean_error(tmp_path, capsys):
    code = main(["train", "--out", str(tmp_path), "--init-from", str(tmp_path / "nope.pt")])
    assert code == 2 and "nope.pt" in capsys.readouterr().err


def test_fine_tuning_a_translate_model_on_new_data_keeps_its_vocabularies(tmp_path):
    """--init-from on a new corpus: the checkpoint's sentencepiece models (not ones trained on
    the new data), its weights, and (with --accum-steps 2) half as many optimiser steps."""
    from tests.seq2seq.test_train import _toy_corpus, tiny_config

    first = train(
        tiny_config(
            tmp_path / "a",
            task="translate",
            data=str(_toy_corpus(tmp_path / "a.tsv")),
            epochs=1,
            spm_vocab_size=40,
            valid_fraction=0.1,
            test_fraction=0.1,
            eval_size=10,
        )
    )
    new_corpus = tmp_path / "b.tsv"
    lines = (tmp_path / "a.tsv").read_text(encoding="utf-8").splitlines()
    new_corpus.write_text("\n".join(line.upper() for line in lines[:120]) + "\n", encoding="utf-8")
    config = tiny_config(
        tmp_path / "b",
        task="translate",
        data=str(new_corpus),
        epochs=1,
        spm_vocab_size=40,
        valid_fraction=0.1,
        test_fraction=0.1,
        eval_size=10,
        lr=0.0,
        init_from=str(first.checkpoint),
    )
    plain = train(replace_config(config, out=str(tmp_path / "c")))  # same job, no accumulation
    accumulated = train(replace_config(config, accum_steps=2))
    old, new = load_checkpoint(first.checkpoint), load_checkpoint(accumulated.checkpoint)
    assert new["src_vocab"] == old["src_vocab"] and new["tgt_vocab"] == old["tgt_vocab"]
    assert all(torch.equal(old["model"][k], new["model"][k]) for k in old["model"])
    assert accumulated.step == -(-plain.step // 2) and plain.step > 2


def replace_config(config: TrainConfig, **changes) -> TrainConfig:
    return TrainConfig(**asdict(config) | changes)


def test_dump_config_of_a_resumed_run_is_the_checkpoints(run, capsys):
    assert main(["train", "--resume", str(run.checkpoint), "--dump-config"]) == 0
    assert (
        yaml.safe_load(capsys.readouterr().out) == load_checkpoint(run.checkpoint)["train_config"]
    )
