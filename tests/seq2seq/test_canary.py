"""The training canary: a non-finite step re-run on plain PyTorch (seq2seq_fast/seq2seq/canary.py).

Faults are injected into the fused path only by wrapping ``seq2seq_fast.nn.attention.attend`` (the
call every attention module makes, with its backend): NaN added to the context of the calls whose
backend is not "reference", during chosen training steps. The reference path stays correct, so
the canary must name a fused-kernel fault; poisoning every backend makes the model "diverge".
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import seq2seq_fast.nn.attention as attention_module
from seq2seq_fast.ops._library import CPU_KERNEL_ERROR, forced_reference
from seq2seq_fast.seq2seq import canary
from seq2seq_fast.seq2seq import train as train_module
from seq2seq_fast.seq2seq.canary import FusedKernelError
from seq2seq_fast.seq2seq.config import TrainConfig, TrainError
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig
from seq2seq_fast.seq2seq.train import train

pytestmark = pytest.mark.skipif(CPU_KERNEL_ERROR is not None, reason="the C++ extension is needed")

# train() runs on CUDA where there is a GPU (Triton attention, no fused recurrent ops there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TINY = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=20,
    embed_size=16,
    hidden_size=32,
    batch_size=32,
    lr=1e-2,
    warmup_steps=5,
    backend="auto",
    progress=False,
    heatmap=False,
    threads=1,
    epochs=1,
    steps_per_epoch=8,
)


def poison(monkeypatch, steps: set[int], *, reference_too: bool = False) -> dict:
    """NaN in the attention's context during the given (1-based) training steps, on the fused
    backends only (or on every backend). -> the state dict the fault reads ("step")."""
    state = {"step": 0}
    real_attend, real_step = attention_module.additive_attention, train_module.train_step

    def attend(*args, backend="fused", **kwargs):
        context, weights = real_attend(*args, backend=backend, **kwargs)
        fused = backend != "reference" and not forced_reference("attention")
        if state["step"] in steps and (reference_too or fused):
            context = context + float("nan")
        return context, weights

    def train_step(job, batch):
        state["step"] = job.step + 1
        return real_step(job, batch)

    monkeypatch.setattr(attention_module, "additive_attention", attend)
    monkeypatch.setattr(train_module, "train_step", train_step)
    return state


@pytest.mark.parametrize("decoder", ["bahdanau", "gnmt"])
def test_a_fused_fault_stops_training_with_a_named_error_and_a_dump(tmp_path, monkeypatch, decoder):
    state = poison(monkeypatch, {3})
    with pytest.raises(FusedKernelError) as caught:
        train(TrainConfig(**TINY, out=str(tmp_path), decoder=decoder, dropout=0.1))
    assert isinstance(caught.value, RuntimeError)
    message = str(caught.value)
    path = tmp_path / "fused-failure-step3.pt"
    assert caught.value.path == path and path.exists()
    isa = torch.ops.seq2seq_fast._cpu_isa()
    for needle in (
        "a fused kernel failed at step 3",
        "seq2seq_fast::additive_attention_fwd/_bwd",  # the op
        "--backend auto",
        "reproduced by the fused attention alone",  # the probes found the part
        "batch: src [32, ",  # the shapes
        "tgt_in/tgt_out [32, ",
        f"dtype: float32 (no autocast) on {DEVICE}",
        f"CPU ISA {isa}",
        "largest |pre-activation| |q + k + b| in the reference re-run: ",
        f"batch and weights: {path}",
    ):
        assert needle in message, (needle, message)
    if DEVICE == "cpu":  # the fused GRU ops served too
        assert "recurrent seq2seq_fast::_gru" in message
        assert "seq2seq_fast::_gru_recurrence_fwd/_bwd" in message
    assert not list(tmp_path.glob(".fused-failure*"))  # no temporary left: written atomically

    dump = torch.load(path, map_location="cpu", weights_only=True)
    assert dump["step"] == 3 and dump["train_config"]["decoder"] == decoder
    batch = dump["batch"]
    assert set(batch) == {"src", "src_lengths", "tgt_in", "tgt_out"}
    assert batch["src"].shape[0] == 32 and batch["tgt_in"].shape == batch["tgt_out"].shape
    model = Seq2Seq(Seq2SeqConfig.from_dict(dump["model_config"]))
    model.load_state_dict(dump["model"])  # every weight, strictly
    assert all(torch.isfinite(w).all() for w in dump["model"].values())
    pre = dump["preactivation"]
    assert 0 < pre["max_preactivation"] <= pre["max_query"] + pre["max_keys"] + pre["max_bias"]
    assert f"{pre['max_preactivation']:.6g}" in message
    assert math.isnan(dump["fused_loss"]) and math.isfinite(dump["reference_loss"])

    # The file reproduces the fault while it is there, and replays the same dropout masks.
    replayed = canary.replay(path, device=DEVICE)
    assert replayed["fused"].finite is False and replayed["reference"].finite is True
    assert replayed["reference"].loss == pytest.approx(dump["reference_loss"], rel=1e-6)
    state["step"] = 0  # the fault gone: the fused run gives the reference's loss
    assert canary.replay(path, device=DEVICE)["fused"].loss == pytest.approx(
        dump["reference_loss"], rel=1e-5
    )


@pytest.mark.skipif(DEVICE != "cpu", reason="the fused recurrent ops are CPU kernels")
def test_a_fault_of_the_fused_gru_ops_is_put_down_to_them(tmp_path, monkeypatch):
    from seq2seq_fast.ops import recurrent

    real_layer, real_step, state = recurrent.gru_layer_or_none, train_module.train_step, {}

    def gru_layer_or_none(*args, **kwargs):
        result = real_layer(*args, **kwargs)
        if result is not None and state.get("step") == 2:
            result = (result[0] + float("nan"), result[1])
        return result

    def train_step(job, batch):
        state["step"] = job.step + 1
        return real_step(job, batch)

    monkeypatch.setattr(recurrent, "gru_layer_or_none", gru_layer_or_none)
    monkeypatch.setattr(train_module, "train_step", train_step)
    with pytest.raises(FusedKernelError, match="at step 2") as caught:
        train(TrainConfig(**TINY, out=str(tmp_path)))
    assert "reproduced by the fused GRU/LSTM ops alone (reference attention)" in str(caught.value)
    assert "fused attention alone" not in str(caught.value)
    assert recurrent.gru_layer_or_none is gru_layer_or_none  # the canary put it back


def test_a_nonfinite_reference_skips_the_step_and_says_the_model_diverged(
    tmp_path, monkeypatch, capsys
):
    poison(monkeypatch, {3, 4, 5}, reference_too=True)
    result = train(TrainConfig(**TINY, out=str(tmp_path)))
    out = capsys.readouterr().out
    assert (
        "step 3: non-finite gradient (loss nan), update skipped: the model itself diverged (the "
        "plain-PyTorch reference re-run of the step gives non-finite values as well)"
    ) in out
    assert result.step == TINY["steps_per_epoch"]
    assert not list(tmp_path.glob("fused-failure*"))
    payload = torch.load(result.checkpoint, weights_only=True)
    adam_steps = {float(s["step"]) for s in payload["optimizer"]["state"].values()}
    assert adam_steps == {TINY["steps_per_epoch"] - 3.0}  # three updates skipped, as before
    assert all(torch.isfinite(w).all() for w in payload["model"].values())


def test_a_diverged_run_stops_saying_the_model_itself_diverged(tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "MAX_NONFINITE_STEPS", 3)
    poison(monkeypatch, set(range(2, 9)), reference_too=True)
    with pytest.raises(
        TrainError,
        match=r"training diverged: the model itself diverged \(the "
        r"plain-PyTorch reference re-run .* 3 steps in a row \(steps 2-4",
    ):
        train(TrainConfig(**TINY, out=str(tmp_path)))
    assert not list(tmp_path.glob("fused-failure*"))


def test_finite_steps_and_the_reference_backend_never_rerun(tmp_path, monkeypatch, capsys):
    def no_rerun(*args, **kwargs):
        raise AssertionError("the canary ran")

    monkeypatch.setattr(canary, "reference_rerun", no_rerun)
    train(TrainConfig(**TINY | {"steps_per_epoch": 4}, out=str(tmp_path / "auto")))
    poison(monkeypatch, {2}, reference_too=True)
    train(
        TrainConfig(
            **TINY | {"steps_per_epoch": 4, "backend": "reference"}, out=str(tmp_path / "reference")
        )
    )
    assert "(on the reference attention backend: no re-run)" in capsys.readouterr().out


def test_the_canary_leaves_the_training_random_stream_alone(tmp_path, monkeypatch):
    """With dropout, a step re-run by the canary (model diverged) continues as one that was not."""
    poison(monkeypatch, {3}, reference_too=True)
    config = dict(TINY, dropout=0.2, heldout_size=5)
    with_canary = train(TrainConfig(**config, out=str(tmp_path / "a"))).losses
    monkeypatch.setattr(
        canary, "check_step", lambda job, batch, loss, rng: canary.Rerun(math.nan, False)
    )
    without = train(TrainConfig(**config, out=str(tmp_path / "b"))).losses
    assert math.isnan(with_canary[2]) and math.isnan(without[2])
    assert with_canary[3:] == without[3:]


def test_plain_pytorch_switches_back_even_on_error():
    """The switch is ops' force_reference: nothing of the model or of ops' functions is
    replaced, and everything is served again after the block, whatever happened in it."""
    from seq2seq_fast.ops import recurrent

    model = Seq2Seq(Seq2SeqConfig(src_vocab_size=6, tgt_vocab_size=6, embed_size=8, hidden_size=8))
    layer = recurrent.gru_layer_or_none
    x = torch.zeros(1, 2, 3)
    with pytest.raises(KeyError), canary.plain_pytorch(model):
        assert forced_reference("attention") and model.attention.backend == "auto"
        assert recurrent.gru_layer_or_none(x, None, None, None) is None
        raise KeyError
    assert not forced_reference("attention") and model.config.backend == "auto"
    assert recurrent.gru_layer_or_none is layer
    assert recurrent.applies(x) == (CPU_KERNEL_ERROR is None)


def test_the_preactivation_recorder_is_exact():
    g = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 5, generator=g) * 3
    keys = torch.randn(3, 6, 5, generator=g) * 2
    keys[0, 4:] = 100.0  # padding beyond row 0's length: not counted
    bias = torch.randn(5, generator=g)
    lengths = torch.tensor([4, 6, 1])
    valid = (torch.arange(6) < lengths[:, None])[:, None, :, None]
    pre = (query[:, :, None] + keys[:, None] + bias).abs().masked_fill(~valid, 0)
    recorder = canary.PreactivationRecorder(torch.nn.Module())
    recorder.record(query, keys, bias, lengths)
    recorder.record(query[:, 0], keys, bias, lengths)  # a [B, H] query: one decoder step
    assert recorder.max_pre == pytest.approx(float(pre.max()), rel=1e-6)
    valid_keys = (torch.arange(6) < lengths[:, None])[..., None]
    assert recorder.max_keys == pytest.approx(float(keys.masked_fill(~valid_keys, 0).abs().max()))
    assert recorder.max_bias == pytest.approx(float(bias.abs().max()))


DDP_SCRIPT = """
import os, sys
import seq2seq_fast.nn.attention as att
from seq2seq_fast.ops._library import forced_reference
from seq2seq_fast.seq2seq import train as tm
from seq2seq_fast.seq2seq.canary import FusedKernelError
from seq2seq_fast.seq2seq.config import TrainConfig

real_attend, real_step, state = att.additive_attention, tm.train_step, {"step": 0}
bad_rank = os.environ["RANK"] == "1"  # the fault on one rank only

def attend(*args, backend="fused", **kwargs):
    context, weights = real_attend(*args, backend=backend, **kwargs)
    fused = backend != "reference" and not forced_reference("attention")
    # step 2: the model "diverges" on rank 1 (both paths); step 4: a fused fault on rank 1
    if bad_rank and (state["step"] == 2 or (state["step"] == 4 and fused)):
        context = context + float("nan")
    return context, weights

def train_step(job, batch):
    state["step"] = job.step + 1
    return real_step(job, batch)

att.additive_attention, tm.train_step = attend, train_step
config = TrainConfig(out=sys.argv[1], epochs=1, steps_per_epoch=5, batch_size=16,
    hidden_size=16, embed_size=8, vocab_size=6, min_len=2, max_len=4, heldout_size=20,
    backend="auto", progress=False, heatmap=False, threads=1)
try:
    tm.train(config)
except FusedKernelError as exc:
    # one write a line: the two ranks share the pipe, and print writes the newline apart
    sys.stdout.write(f"rank {os.environ['RANK']}: FusedKernelError {exc.path}\\n")
    sys.stdout.flush()
    sys.exit(3)
sys.stdout.write(f"rank {os.environ['RANK']}: trained on\\n")
sys.stdout.flush()
"""


def test_ddp_ranks_agree_on_skipping_and_on_stopping(tmp_path):
    """torchrun, 2 ranks (gloo): rank 1 alone diverges at step 2, then has a fused fault at 4."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("DDP on CUDA needs two GPUs")
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT, encoding="utf-8")
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [torchrun, "--standalone", "--nproc_per_node=2", str(script), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "rank 0: FusedKernelError" in proc.stdout, log[-3000:]
    assert "rank 1: FusedKernelError" in proc.stdout, log[-3000:]
    assert "trained on" not in proc.stdout
    # Step 2: every rank skipped the update (rank 1's reference decided for rank 0 as well), and
    # DDP trained on; step 4 stopped both.
    assert "step 2: non-finite gradient (loss " in proc.stdout
    assert "update skipped: the model itself diverged (the plain-PyTorch reference" in proc.stdout
    assert not (out / "fused-failure-step2.pt").exists()
    dump = torch.load(out / "fused-failure-step4.pt", weights_only=True)
    assert dump["world_size"] == 2 and len(dump["rank_batches"]) == 2
    assert not torch.equal(dump["rank_batches"][0]["src"], dump["rank_batches"][1]["src"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
