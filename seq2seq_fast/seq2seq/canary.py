"""The training canary: a step whose gradient is non-finite, re-run on plain PyTorch.

A fused kernel that returns NaN for some inputs looks, from the training loop, exactly like a
model that diverged: the gradient norm is NaN. So when a step's gradient is non-finite and fused
kernels are in use, :func:`train_step <seq2seq_fast.seq2seq.train.train_step>` calls
:func:`check_step`, which runs that batch once more (same weights, same dropout masks, model in the same mode and under the same autocast)
on the plain-PyTorch path (:func:`plain_pytorch`: the reference attention and PyTorch's own
GRU/LSTM ops), and, when that is finite, twice more to say which fused part reproduces the fault
on its own (:func:`probe_fused_parts`). Finite steps pay nothing: the loop's finiteness check
already existed.

- Reference finite: a fused kernel failed. Training stops with :class:`FusedKernelError`, whose
  message (:func:`failure_message`) names the ops and backend, the batch shapes, the dtype, the CPU
  ISA, the largest |pre-activation| (|q + k + b| inside the tanh, recorded by
  :class:`PreactivationRecorder` during the reference re-run) and a file with the batch and the
  weights (:func:`write_failure`); :func:`replay` re-runs such a file.
- Reference non-finite too: the model itself diverged; the loop skips the update as before.

Nothing here changes the model for good: the backend switch and the recorder are undone on exit,
and the re-runs take their gradients with ``torch.autograd.grad`` (the parameters' ``.grad`` and
any DDP hooks are not touched).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from seq2seq_fast.seq2seq.data.batching import Batch

FAILURE_FORMAT = "seq2seq-fast-fused-failure"
FAILURE_VERSION = 1

# The fused kernels of the attention (the op, the gathering step, the location-aware step and
# its convolution) and of the recurrent ops, as ops._library.force_reference names them.
_ATTENTION_KERNELS = ("attention", "attention_step", "location", "location_conv")
_RECURRENT_KERNELS = ("recurrent",)


class FusedKernelError(RuntimeError):
    """A step whose gradient was non-finite on the fused kernels and finite on the plain-PyTorch
    reference: a kernel bug, not a diverged model. ``path`` is the file with the batch and the
    weights (None when it could not be written), ``details`` what the message says, as data."""

    def __init__(self, message: str, path: Path | None = None, details: dict | None = None):
        super().__init__(message)
        self.path = path
        self.details = details or {}


# --- switching the model to plain PyTorch ----------------------------------------------------------


@contextlib.contextmanager
def plain_pytorch(
    model: nn.Module, *, attention: bool = True, recurrent: bool = True
) -> Iterator[set[str]]:
    """Inside the block the model runs plain PyTorch: ``attention`` makes every attention call
    run the reference, ``recurrent`` makes the fused GRU/LSTM ops step aside (the models then call
    PyTorch's own), both through :func:`seq2seq_fast.ops._library.force_reference` (``model``
    is the one the block runs; the switch is the op library's). Restored on exit, whatever
    happens. Yields the set of fused recurrent ops that served a call inside the block (with
    ``recurrent=False``)."""
    from seq2seq_fast.ops._library import force_reference

    kernels = (
        *(_ATTENTION_KERNELS if attention else ()),
        *(_RECURRENT_KERNELS if recurrent else ()),
    )
    with force_reference(kernels) as served:
        yield served


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from seq2seq_fast.nn.attention import BahdanauAttention

    return [m for m in model.modules() if isinstance(m, BahdanauAttention)]


class PreactivationRecorder:
    """Records, while active, the largest |pre-activation| |q + k + b| of every attention call
    (query and keys projected, b the score bias; valid keys only), exactly and cheaply: over
    query positions i and keys j the largest q_i + k_j is max_i q_i + max_j k_j, per batch row and
    feature, so no [B, Tq, Tk, H] tensor is formed. Also the largest |q|, |k| and |b| alone."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = _attention_modules(model)
        self.max_pre = 0.0
        self.max_query = 0.0
        self.max_keys = 0.0
        self.max_bias = 0.0
        self.calls = 0
        self._keys_cache: tuple[Tensor, Tensor | None, tuple] | None = None

    def __enter__(self) -> PreactivationRecorder:
        for module in self.modules:
            original = module.attend_projected  # the bound method

            def recording(
                projected_query,
                projected_keys,
                values,
                *,
                _module=module,
                _original=original,
                **kwargs,
            ):
                score = kwargs.get("score_vector")
                bias = (score if score is not None else _module.score_vector())[1]
                self.record(projected_query, projected_keys, bias, kwargs.get("lengths"))
                return _original(projected_query, projected_keys, values, **kwargs)

            module.attend_projected = recording  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            module.__dict__.pop("attend_projected", None)
        self._keys_cache = None

    @torch.no_grad()
    def record(self, query: Tensor, keys: Tensor, bias: Tensor | None, lengths) -> None:
        self.calls += 1
        query = (query if query.dim() == 3 else query.unsqueeze(1)).float()
        cached = self._keys_cache
        if cached is not None and cached[0] is keys and cached[1] is lengths:
            key_max, key_min, key_abs = cached[2]
        else:  # a decoder's steps share one keys tensor: its extremes once
            k = keys.float()
            if lengths is not None:
                valid = torch.arange(k.shape[1], device=k.device) < lengths.to(k.device)[:, None]
                valid = valid.unsqueeze(-1)
                key_max = k.masked_fill(~valid, -math.inf).amax(1)
                key_min = k.masked_fill(~valid, math.inf).amin(1)
                key_abs = float(k.masked_fill(~valid, 0).abs().max()) if k.numel() else 0.0
            else:
                key_max, key_min = k.amax(1), k.amin(1)
                key_abs = float(k.abs().max()) if k.numel() else 0.0
            self._keys_cache = (keys, lengths, (key_max, key_min, key_abs))
        if query.numel() == 0 or keys.numel() == 0:
            return
        b = 0.0 if bias is None else bias.detach().float()
        high = query.amax(1) + key_max + b  # [B, H]
        low = query.amin(1) + key_min + b
        self.max_pre = max(self.max_pre, float(torch.maximum(high, -low).max()))
        self.max_query = max(self.max_query, float(query.abs().max()))
        self.max_keys = max(self.max_keys, key_abs)
        if bias is not None:
            self.max_bias = max(self.max_bias, float(bias.detach().abs().max()))

    def summary(self) -> dict[str, float]:
        return {
            "max_preactivation": self.max_pre,
            "max_query": self.max_query,
            "max_keys": self.max_keys,
            "max_bias": self.max_bias,
        }


# --- one re-run ------------------------------------------------------------------------------------


def forward_rng_state(device: torch.device) -> dict[str, Tensor]:
    """The generator states a training forward draws its dropout masks from (CPU, and the CUDA
    device it runs on), to run the same forward again with the same masks."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def _rng_as(state: dict[str, Tensor] | None, device: torch.device) -> Iterator[None]:
    """Run the block from ``state`` (None: as things are), then put every generator back as it
    was before the block: the training's own random stream goes on as if nothing had run."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if state is not None:
            torch.set_rng_state(state["cpu"])
            if "cuda" in state and device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda"], device)
        yield


@dataclass
class Rerun:
    """One re-run of a batch: its loss, whether loss and gradients were finite, or the error that
    stopped it (then ``finite`` is None)."""

    loss: float
    finite: bool | None
    nonfinite_params: list[str] = field(default_factory=list)
    error: str | None = None


def rerun(
    model: nn.Module,
    batch,
    *,
    label_smoothing: float = 0.0,
    autocast: torch.dtype | None = None,
    rng_state: dict[str, Tensor] | None = None,
) -> Rerun:
    """Forward and backward of ``batch`` (src, src_lengths, tgt_in, tgt_out) through ``model`` as
    it is (mode, backend), from ``rng_state``; gradients by ``torch.autograd.grad``, so the
    parameters' ``.grad`` stay as they were. An out-of-memory error is returned, not raised."""
    device = batch.src.device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        with _rng_as(rng_state, device):
            with torch.autocast(
                device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None
            ):
                loss, _ = model(
                    batch.src,
                    batch.src_lengths,
                    batch.tgt_in,
                    batch.tgt_out,
                    label_smoothing=label_smoothing,
                )
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    except torch.OutOfMemoryError as exc:
        return Rerun(math.nan, None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    bad = [
        n
        for (n, _), g in zip(named, grads, strict=True)
        if g is not None and not bool(torch.isfinite(g).all())
    ]
    loss_value = float(loss.detach())
    return Rerun(loss_value, math.isfinite(loss_value) and not bad, bad)


def reference_rerun(model: nn.Module, batch, **kwargs) -> tuple[Rerun, dict[str, float]]:
    """``rerun`` on the plain-PyTorch path, recording the attention's pre-activations."""
    with plain_pytorch(model), PreactivationRecorder(model) as recorder:
        result = rerun(model, batch, **kwargs)
    return result, recorder.summary()


def probe_fused_parts(model: nn.Module, batch, *, recurrent: bool = True, **kwargs):
    """After a finite reference re-run: each fused part alone, the rest plain PyTorch.
    -> (parts that reproduce the non-finite step on their own, fused recurrent ops that served).
    ``recurrent=False``: the recurrent ops were not in the failed step (torch.compile)."""
    reproduced, served = [], set()
    with plain_pytorch(model, attention=False, recurrent=True):
        if rerun(model, batch, **kwargs).finite is False:
            reproduced.append("attention")
    if recurrent:
        with plain_pytorch(model, attention=True, recurrent=False) as used:
            result = rerun(model, batch, **kwargs)
        served = set(used)
        if served and result.finite is False:
            reproduced.append("recurrent")
    return reproduced, served


# --- what the error says ---------------------------------------------------------------------------


def cpu_isa() -> str | None:
    """The CPU kernels' instruction set (``torch.ops.seq2seq_fast._cpu_isa()``), None without
    the extension."""
    from seq2seq_fast.ops._library import CPU_KERNEL_ERROR

    if CPU_KERNEL_ERROR is not None:
        return None
    try:
        return str(torch.ops.seq2seq_fast._cpu_isa())
    except (AttributeError, RuntimeError):
        return None


def attention_ops(device: torch.device, decoder: str) -> str:
    """The fused attention ops a training step on ``device`` runs."""
    if device.type == "cuda":
        return "seq2seq_fast::additive_attention_fwd/_bwd (Triton CUDA kernels)"
    ops = "seq2seq_fast::additive_attention_fwd/_bwd"
    if decoder == "bahdanau":  # the decoder's steps through StepwiseMemory (ops/stepwise.py)
        ops += " and _additive_attention_bwd_accumulate"
    return ops + " (C++ CPU kernel)"


def batch_tensors(batch) -> dict[str, Tensor]:
    return {
        name: getattr(batch, name).detach().cpu()
        for name in ("src", "src_lengths", "tgt_in", "tgt_out")
    }


def describe_batch(batch) -> str:
    lengths = batch.src_lengths
    return (
        f"src {list(batch.src.shape)} (lengths {int(lengths.min())}..{int(lengths.max())}), "
        f"tgt_in/tgt_out {list(batch.tgt_in.shape)}"
    )


def failure_message(details: dict[str, Any]) -> str:
    """The FusedKernelError text from what :func:`write_failure` stores."""
    reproduced = details["reproduced_by"]
    where = {
        "attention": "the fused attention alone (recurrent ops on PyTorch)",
        "recurrent": "the fused GRU/LSTM ops alone (reference attention)",
    }
    if reproduced:
        culprit = "reproduced by " + " and by ".join(where[p] for p in reproduced)
    else:
        culprit = (
            "neither fused part alone reproduces it eagerly (the combination, the compiled graph, "
            "or a fault that depends on more than the inputs)"
        )
    pre = details["preactivation"]
    rank = f", on {details['world_size']} ranks (every rank's batch in the file)"
    rank = rank if details["world_size"] > 1 else ""
    path = details.get("path")
    lines = [
        f"a fused kernel failed at step {details['step']}: the step's gradient was non-finite "
        f"(loss {details['fused_loss']:.6g}) but its plain-PyTorch reference re-run (same batch, "
        f"weights and dropout masks) is finite (loss {details['reference_loss']:.6g}, finite "
        f"gradients){rank}",
        f"  fused op(s) in use: {'; '.join(details['ops'])} (--backend "
        f"{details['backend']}); {culprit}",
        f"  batch: {details['batch']}; model {details['model']}",
        f"  dtype: {details['dtype']} on {details['device']}; CPU ISA {details['isa'] or 'n/a'}; "
        f"torch {details['torch']}",
        f"  largest |pre-activation| |q + k + b| in the reference re-run: "
        f"{pre['max_preactivation']:.6g} (max |q| {pre['max_query']:.6g}, max |k| "
        f"{pre['max_keys']:.6g}, max |b| {pre['max_bias']:.6g})",
        f"  parameters with non-finite gradients on the fused path: "
        f"{_names(details['nonfinite_params'])}",
        (
            f"  batch and weights: {path} (torch.load(path); "
            f"seq2seq_fast.seq2seq.canary.replay(path) re-runs it); attach it to the bug report"
            if path
            else f"  the batch and weights could not be written: {details.get('write_error')}"
        ),
    ]
    return "\n".join(lines)


def _names(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none recorded"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more + f" ({len(names)})"


def write_failure(path: Path, payload: dict[str, Any]) -> None:
    """The dump, atomically (temporary file, fsync, os.replace: ``save_checkpoint``)."""
    from seq2seq_fast.seq2seq.checkpoint import save_checkpoint

    save_checkpoint({"format": FAILURE_FORMAT, "version": FAILURE_VERSION, **payload}, path)


def replay(path: str | Path, *, device: str = "cpu") -> dict[str, Any]:
    """Re-run a fused-failure file's batch on its weights: -> {"fused": Rerun, "reference":
    Rerun, "preactivation": {...}}, the fused run with the recorded backend and dropout masks."""
    from seq2seq_fast.seq2seq.data.batching import Batch
    from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig

    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != FAILURE_FORMAT:
        raise ValueError(f"{path} is not a fused-failure file (format {payload.get('format')!r})")
    model = Seq2Seq(Seq2SeqConfig.from_dict(payload["model_config"])).to(device)
    model.load_state_dict(payload["model"])
    model.train(payload.get("training", True))
    batch = Batch(**payload["batch"]).to(device)
    rng = payload.get("forward_rng")
    if rng is not None and torch.device(device).type != "cuda":
        rng = {"cpu": rng["cpu"]}
    options = dict(
        label_smoothing=payload["label_smoothing"],
        rng_state=rng,
        autocast=getattr(torch, payload["autocast"]) if payload["autocast"] else None,
    )
    fused = rerun(model, batch, **options)
    reference, pre = reference_rerun(model, batch, **options)
    return {"fused": fused, "reference": reference, "preactivation": pre}


# --- the verdict on a training step ---------------------------------------------------------


# The canary's verdicts on a non-finite step, ordered so that the largest over ranks decides.
CANARY_FUSED_FAULT, CANARY_DIVERGED, CANARY_UNVERIFIED = 0, 1, 2


def check_step(job: Any, batch: Batch, loss: float, rng) -> Rerun:
    """A non-finite step on fused kernels: the batch again on plain PyTorch (this module).
    Finite on every rank: raise FusedKernelError, the batch and weights written beside the
    checkpoint. Otherwise -> the rank's reference re-run (``finite`` False: the model itself
    diverged on some rank; None: the re-run could not run), and the step is skipped.

    Under DDP every rank re-runs its own batch on the bare module (no gradient all-reduce), and
    the verdicts are combined with one all_reduce (MAX), so every rank decides the same."""
    from seq2seq_fast.seq2seq.distributed import max_over_ranks

    model, ctx, config = job.model, job.ctx, job.config
    # What the fused path got wrong, then its gradients freed: the re-runs need the memory, and
    # the skipped update never reads them (the next step sets them to None anyway).
    nonfinite = [
        n
        for n, p in model.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    ]
    for p in model.parameters():
        p.grad = None
    options = dict(label_smoothing=config.label_smoothing, autocast=job.autocast, rng_state=rng)
    reference, pre = reference_rerun(model, batch, **options)
    code = {True: CANARY_FUSED_FAULT, False: CANARY_DIVERGED, None: CANARY_UNVERIFIED}
    verdict = max_over_ranks(ctx, [code[reference.finite]])[0]
    if verdict != CANARY_FUSED_FAULT:
        if verdict != code[reference.finite]:  # another rank decided
            reference.finite = None if verdict == CANARY_UNVERIFIED else False
            reference.error = reference.error or "on another rank"
        return reference
    compiled = config.compile
    reproduced, served = probe_fused_parts(model, batch, recurrent=not compiled, **options)
    parts = ("attention", "recurrent")
    flags = max_over_ranks(
        ctx, [float(p in reproduced) for p in parts] + [float(bool(served)), *pre.values()]
    )
    reproduced = [p for p, flag in zip(parts, flags, strict=False) if flag]
    pre = dict(zip(pre, flags[3:], strict=True))
    step = job.step + 1
    ops = [attention_ops(ctx.device, config.decoder)]
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
        "backend": config.backend + (" --compile" if config.compile else ""),
        "reproduced_by": reproduced,
        "batch": describe_batch(batch),
        "model": f"{config.decoder} decoder, {config.cell} {config.hidden_size}, attention "
        f"{config.attention_size or config.hidden_size}",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")
        + (
            f" under autocast {str(job.autocast).removeprefix('torch.')}"
            if job.autocast
            else " (no autocast)"
        ),
        "device": str(ctx.device),
        "isa": cpu_isa(),
        "torch": str(torch.__version__),
        "preactivation": pre,
        "nonfinite_params": nonfinite,
    }
    written = _dump_failure(job, batch, details, rng)
    details["path"] = str(written) if written else None
    raise FusedKernelError(failure_message(details), written, details)


def _dump_failure(job: Any, batch: Batch, details: dict[str, Any], rng) -> Path | None:
    """The batch (every rank's), the weights and the run's settings written by the main rank
    beside the checkpoint (:func:`write_failure`) -> its path, None when it could not be written
    (``details["write_error"]`` says why). Every rank waits until it is complete."""
    import torch.distributed as dist

    model, ctx, config = job.model, job.ctx, job.config
    batches = [batch_tensors(batch)]
    if ctx.enabled:
        batches = [None] * ctx.world_size
        dist.all_gather_object(batches, batch_tensors(batch))
    path = config.out_dir / f"fused-failure-step{details['step']}.pt"
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
            write_failure(path, payload)
        except OSError as exc:
            written, details["write_error"] = None, f"{type(exc).__name__}: {exc}"
    if ctx.enabled:
        dist.barrier()  # the file is complete before any rank stops
    return written
