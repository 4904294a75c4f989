"""Training options: --precision bf16 (and its fallback), --output-layer attentional."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.seq2seq import builders, evaluation
from seq2seq_fast.seq2seq import train as train_module
from seq2seq_fast.seq2seq.checkpoint import load_checkpoint, load_model
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.train import train

TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=50,
    embed_size=16,
    hidden_size=32,
    batch_size=32,
    lr=1e-2,
    warmup_steps=10,
    backend="reference",
    progress=False,
    heatmap=False,
    threads=1,
    epochs=1,
    steps_per_epoch=30,
)


def test_bf16_without_hardware_support_says_so_and_trains_in_fp32(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(builders, "bf16_unavailable_reason", lambda device: "no bf16 here")
    result = train(TrainConfig(**TINY, out=str(tmp_path), precision="bf16"))
    out = capsys.readouterr().out
    assert "--precision bf16: no bf16 here; training in fp32" in out
    assert "autocast bf16" not in out
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_bf16_autocast_trains_with_fp32_master_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(builders, "bf16_unavailable_reason", lambda device: None)
    result = train(TrainConfig(**TINY, out=str(tmp_path), precision="bf16"))
    assert "autocast bf16" in capsys.readouterr().out
    losses = torch.tensor(result.losses)
    assert torch.isfinite(losses).all() and losses[-5:].mean() < losses[:5].mean()
    model, *_ = load_model(result.checkpoint)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_attentional_output_layer_learns_and_reloads(tmp_path):
    result = train(TrainConfig(**TINY, out=str(tmp_path), output_layer="attentional"))
    losses = torch.tensor(result.losses)
    assert losses[-5:].mean() < losses[:5].mean()
    model, *_ = load_model(result.checkpoint)
    assert model.config.output_layer == "attentional"
    assert model.decoder.output.in_features == TINY["hidden_size"]


def test_bf16_reason_on_this_machine_is_none_or_names_the_missing_instructions():
    reason = builders.bf16_unavailable_reason(torch.device("cpu"))
    assert reason is None or ("AVX512-BF16" in reason and "AMX" in reason)


@pytest.mark.parametrize(("field", "value"), [("precision", "fp16"), ("output_layer", "wide")])
def test_bad_options_are_named(field, value):
    with pytest.raises(TrainError, match=field):
        TrainConfig(**{field: value})


def test_interval_evaluation_keeps_best_and_stops_early(tmp_path, capsys):
    # lr 0: the model never changes, so the second evaluation cannot beat the first
    config = TrainConfig(
        **TINY | {"epochs": 3, "lr": 0.0}, out=str(tmp_path), eval_every=5, patience=1
    )
    result = train(config)
    assert result.step == 10
    assert "early stop at step 10" in capsys.readouterr().out
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == 5 and best["best"]["score"] == best["metrics"]["seq_acc"]
    assert load_checkpoint(result.checkpoint)["best"]["evals_since"] == 1


def test_best_checkpoint_follows_improvement(tmp_path):
    result = train(TrainConfig(**TINY | {"epochs": 2}, out=str(tmp_path), eval_every=10))
    final = load_checkpoint(result.checkpoint)
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["best"]["score"] == final["best"]["score"] == best["metrics"]["seq_acc"]
    assert best["step"] <= result.step


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_final_test_bleu_and_heatmap_are_of_the_best_checkpoint(tmp_path, monkeypatch, capsys):
    """Validation scores that only fall: best.pt is the first evaluation (step 2); the final test
    BLEU and the heatmap must be computed with its weights, not the last ones (model.pt)."""
    from seq2seq_fast.seq2seq import plot
    from tests.seq2seq.test_train import _toy_corpus, tiny_config

    calls = []

    def fake_bleu(model, pairs, src_vocab, tgt_vocab, device, beam=1):
        calls.append(_state(model))
        return 50.0 - len(calls)

    drawn = []
    monkeypatch.setattr(evaluation, "bleu_score", fake_bleu)
    monkeypatch.setattr(
        plot, "plot_translation", lambda model, *a, **k: drawn.append(_state(model))
    )
    corpus = _toy_corpus(tmp_path / "toy.tsv")
    config = tiny_config(
        tmp_path / "run",
        task="translate",
        data=str(corpus),
        epochs=2,
        spm_vocab_size=40,
        valid_fraction=0.1,
        test_fraction=0.1,
        eval_every=2,
        heatmap=True,
    )
    result = train(config)
    best, last = load_checkpoint(tmp_path / "run/best.pt"), load_checkpoint(result.checkpoint)
    assert best["step"] == 2 and last["step"] == result.step > 4
    assert not _same(best["model"], last["model"])  # the test below can tell them apart
    assert _same(calls[-1], best["model"]) and _same(drawn[-1], best["model"])
    assert result.metrics["test_bleu"] == 50.0 - len(calls)
    assert result.metrics["valid_bleu"] == best["best"]["score"] == 49.0
    assert (result.final_checkpoint, result.final_step) == (tmp_path / "run/best.pt", 2)
    assert (
        f"test_bleu {result.metrics['test_bleu']:.2f} (best.pt, step 2)" in capsys.readouterr().out
    )
    # model.pt stays the last state, and says which checkpoint its final metrics are of.
    assert last["final"] == {"checkpoint": "best.pt", "step": 2}
    assert last["metrics"] == best["metrics"] == result.metrics


def test_a_stale_best_checkpoint_is_not_used(tmp_path, capsys):
    """A best.pt left by an earlier run in the folder: refused without --overwrite; with it, the
    earlier run's files go, and a run that never evaluates (stopped after 5 steps) reports the
    last model."""
    train(TrainConfig(**TINY, out=str(tmp_path)))
    assert (tmp_path / "best.pt").exists()
    capsys.readouterr()
    with pytest.raises(TrainError, match=r"holds another run \(model.pt, best.pt"):
        train(TrainConfig(**TINY, out=str(tmp_path), stop_after_steps=5))
    result = train(TrainConfig(**TINY, out=str(tmp_path), stop_after_steps=5), overwrite=True)
    assert (result.final_checkpoint.name, result.final_step) == ("model.pt", 5)
    printed = capsys.readouterr().out
    assert "(model.pt, step 5)" in printed and "removed the earlier run's" in printed
    assert not (tmp_path / "best.pt").exists()


def test_a_time_budget_spent_between_evaluations_scores_the_last_model(tmp_path, monkeypatch):
    """Evaluations every 5 steps, the budget spent at step 7: the last model is scored too, and
    being the best (scores rise with the step here) it, not step 5's best.pt, is the final one."""
    ticks = iter(range(1000))
    monkeypatch.setattr(train_module, "synced_elapsed", lambda started, ctx: 10.0 * next(ticks))
    monkeypatch.setattr(
        train_module,
        "evaluate",
        lambda job, final=False, model=None: {"seq_acc": job.step / 100, "tok_acc": 1.0},
    )
    config = TrainConfig(
        **TINY | {"epochs": 3}, out=str(tmp_path), eval_every=5, time_budget_min=1.0
    )
    result = train(config)
    assert result.step == 7  # elapsed 0, 10, ..., 60 s after steps 1..7
    assert (result.final_checkpoint.name, result.final_step) == ("best.pt", 7)
    assert load_checkpoint(tmp_path / "best.pt")["step"] == 7
    assert result.metrics["seq_acc"] == 0.07


def _nonfinite_norm_at(monkeypatch, bad_calls: set[int]):
    """Make clip_grad_norm_ report a NaN gradient norm at the given (1-based) calls."""
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def fake(parameters, max_norm, *args, **kwargs):
        calls.append(1)
        norm = real(parameters, max_norm, *args, **kwargs)
        return torch.full_like(norm, float("nan")) if len(calls) in bad_calls else norm

    monkeypatch.setattr(train_module.nn.utils, "clip_grad_norm_", fake)


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_a_nonfinite_gradient_skips_the_update(tmp_path, monkeypatch, capsys, clip_norm):
    _nonfinite_norm_at(monkeypatch, {4, 5, 6})
    result = train(TrainConfig(**TINY, out=str(tmp_path), clip_norm=clip_norm))
    out = capsys.readouterr().out
    assert "step 4: non-finite gradient" in out
    summary = (
        "warning: 3 of the run's updates were skipped for a non-finite gradient (steps 4, 5, 6)"
    )
    assert summary + "\n" in out  # said again at the end, and the run did not end diverging
    payload = load_checkpoint(result.checkpoint)
    assert payload["step"] == TINY["steps_per_epoch"]
    # the optimiser updated on the other steps only, and the weights stayed finite
    adam_steps = {float(s["step"]) for s in payload["optimizer"]["state"].values()}
    assert adam_steps == {TINY["steps_per_epoch"] - 3.0}
    assert all(torch.isfinite(w).all() for w in payload["model"].values())


def test_a_run_that_ends_diverging_says_so(tmp_path, monkeypatch, capsys):
    last = TINY["steps_per_epoch"]
    _nonfinite_norm_at(monkeypatch, {last - 2, last - 1, last})
    train(TrainConfig(**TINY | {"epochs": 1}, out=str(tmp_path)))
    out = capsys.readouterr().out
    assert (
        f"(steps {last - 2}, {last - 1}, {last}); the last 3 steps all were: the run ended "
        f"diverging, and its checkpoint holds the weights of step {last - 3}"
    ) in out


def test_a_diverged_run_stops_with_a_clear_error_and_finite_weights(tmp_path, monkeypatch):
    _nonfinite_norm_at(monkeypatch, set(range(6, 6 + train_module.MAX_NONFINITE_STEPS)))
    with pytest.raises(TrainError, match=r"diverged: .* 20 steps in a row \(steps 6-25.*--lr"):
        train(TrainConfig(**TINY, out=str(tmp_path)))
    payload = load_checkpoint(tmp_path / "model.pt")
    assert payload["step"] == 24
    assert all(torch.isfinite(w).all() for w in payload["model"].values())


def test_keep_checkpoints_keeps_the_last_epochs_weights(tmp_path, capsys):
    from seq2seq_fast.seq2seq.checkpoint import export_inference

    stale = tmp_path / "model.epoch9.pt"
    stale.write_bytes(b"an earlier run's snapshot")
    config = TrainConfig(
        **TINY | {"epochs": 3, "steps_per_epoch": 5}, out=str(tmp_path), keep_checkpoints=2
    )
    with pytest.raises(TrainError, match="holds another run \\(model.epoch9.pt\\)"):
        train(config)
    result = train(config, overwrite=True)
    assert "--overwrite: removed the earlier run's model.epoch9.pt" in capsys.readouterr().out
    kept = sorted(p.name for p in tmp_path.glob("model.epoch*.pt"))
    assert kept == ["model.epoch2.pt", "model.epoch3.pt"]
    last = load_checkpoint(tmp_path / "model.epoch3.pt")
    assert last["kind"] == "inference" and last["step"] == 15
    final, *_ = load_model(result.checkpoint)  # epoch 3's end is the last state
    assert _same(_state(load_model(tmp_path / "model.epoch3.pt")[0]), _state(final))
    export_inference([tmp_path / n for n in kept], tmp_path / "averaged.pt")
    averaged, *_ = load_model(tmp_path / "averaged.pt")
    second, *_ = load_model(tmp_path / "model.epoch2.pt")
    for name, tensor in _state(averaged).items():
        expected = (_state(second)[name].double() + _state(final)[name].double()) / 2
        torch.testing.assert_close(tensor, expected.float(), atol=0, rtol=0, msg=name)
    with pytest.raises(TrainError, match="keep_checkpoints"):
        TrainConfig(keep_checkpoints=-1)
