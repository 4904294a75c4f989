"""Checkpoint IO: atomic writes, checked reads, and loading a model for inference.

A checkpoint is a ``torch.save`` zip holding plain containers and tensors (read back with
``weights_only=True``): a format marker and version, the model config, the two vocabularies, the
model's state_dict and, for training checkpoints, the optimiser/scheduler/RNG state and the data
position (see :mod:`seq2seq_fast.seq2seq.train`).
"""

from __future__ import annotations

import os
import random
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from seq2seq_fast.seq2seq.atomic import atomic_write
from seq2seq_fast.seq2seq.data.vocab import vocab_from_state
from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig

CHECKPOINT_FORMAT = "seq2seq-fast checkpoint"
CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, truncated or not written by seq2seq-fast."""


def save_checkpoint(payload: dict[str, Any], path: Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then os.replace.

    The folder is fsynced after the rename (so the new name survives a power loss), and temporary
    files that killed processes left next to ``path`` are removed.
    """
    atomic_write(path, lambda handle: torch.save(payload, handle))
    _remove_stale_temporaries(path)


def _remove_stale_temporaries(path: Path) -> None:
    """Delete .NAME.tmp-PID files of processes that no longer exist (killed mid-write)."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            pid = int(stale.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # raises ProcessLookupError when no such process is running
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            continue  # not ours, or a live process of another user


def _member_failing_crc(path: Path) -> str | None:
    """The first archive member whose data does not match its CRC-32, else None.

    torch.load does not check the CRCs, so a flipped bit inside a stored tensor would load
    silently. Files that are not readable zip archives are left to torch.load's own error.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except Exception:  # not a zip / truncated: torch.load reports it
        return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``; raise CheckpointError saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"checkpoint path is a directory: {path}")
    bad_member = _member_failing_crc(path)
    if bad_member is not None:
        raise CheckpointError(
            f"cannot read checkpoint {path}: corrupt ({bad_member} fails its CRC-32 check)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, random bytes, foreign pickles all end up here
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path}: corrupt, truncated or not a seq2seq-fast checkpoint "
            f"({type(exc).__name__}: {first_line[:200]})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a seq2seq-fast checkpoint (no format marker)")
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {payload.get('version')!r} is not supported "
            f"(this seq2seq-fast reads version {CHECKPOINT_VERSION})"
        )
    for key in ("model_config", "model", "src_vocab", "tgt_vocab"):
        if key not in payload:
            raise CheckpointError(f"{path}: checkpoint lacks {key!r}")
    return payload


def load_model(path: str | Path, *, backend: str = "auto", device: str = "cpu"):
    """-> (model in eval mode, src_vocab, tgt_vocab, checkpoint payload)."""
    payload = load_checkpoint(path)
    model, src_vocab, tgt_vocab = _build_model(payload, path, backend)
    return model.to(device).eval(), src_vocab, tgt_vocab, payload


def _build_model(payload: dict[str, Any], path: str | Path, backend: str = "auto"):
    """-> (model with the payload's weights, src_vocab, tgt_vocab); CheckpointError naming
    ``path`` when they do not make one."""
    try:
        config = Seq2SeqConfig.from_dict(dict(payload["model_config"]))
        config.backend = backend
        model = Seq2Seq(config)
        model.load_state_dict(payload["model"])
        src_vocab = vocab_from_state(payload["src_vocab"])
        tgt_vocab = vocab_from_state(payload["tgt_vocab"])
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: checkpoint does not describe a usable model ({exc})"
        ) from None
    return model, src_vocab, tgt_vocab


INFERENCE_KIND = "inference"
EXPORT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_inference_only(payload: dict[str, Any]) -> bool:
    """True for a file written by :func:`export_inference` (no optimiser state: not resumable)."""
    return payload.get("kind") == INFERENCE_KIND


def inference_payload(payload: dict[str, Any], weights: dict[str, Any], dtype: str) -> dict:
    """The content of an inference-only file: ``weights`` (a state_dict, floating-point tensors
    stored as ``dtype``) with the model config, vocabularies and metadata of ``payload``."""
    target = EXPORT_DTYPES[dtype]
    train_config = dict(payload.get("train_config") or {})
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "kind": INFERENCE_KIND,
        "dtype": dtype,
        "model_config": payload["model_config"],
        "src_vocab": payload["src_vocab"],
        "tgt_vocab": payload["tgt_vocab"],
        "model": {
            name: (t.to(target) if t.is_floating_point() else t).clone()
            for name, t in weights.items()
        },
        "task": payload.get("task", {}),
        "metrics": payload.get("metrics", {}),
        "step": payload.get("step"),
        "normalization": payload.get("normalization", train_config.get("normalization", "NFKC")),
    }


# What checkpoints must share to be averaged, and how to read it from one.
_SAME_FOR_AVERAGING = {
    "model config": lambda p: {k: v for k, v in dict(p["model_config"]).items() if k != "backend"},
    "source vocabulary": lambda p: p["src_vocab"],
    "target vocabulary": lambda p: p["tgt_vocab"],
}


def average_weights(paths: Sequence[str | Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mean of the weights of several checkpoints of one model (training checkpoints or
    exports, e.g. the last epochs' snapshots that ``train --keep-checkpoints N`` keeps): ->
    (the last checkpoint's payload, the averaged state_dict). Floating-point tensors are averaged
    in float64 and stored as float32; other tensors must be equal. The checkpoints must share
    the model config, the vocabularies and the parameter names and shapes: CheckpointError names
    the file that differs and how."""
    if not paths:
        raise ValueError("no checkpoint to average")
    payloads = [load_checkpoint(path) for path in paths]
    first = payloads[0]
    sums: dict[str, Any] = {}
    for path, payload in zip(paths, payloads, strict=True):
        mismatch = f"cannot average {path} with {paths[0]}"
        for what, read in _SAME_FOR_AVERAGING.items():
            if read(payload) != read(first):
                raise CheckpointError(
                    f"{mismatch}: their {what}s differ (checkpoints of one run can be averaged)"
                )
        weights = payload["model"]
        if set(weights) != set(first["model"]):
            names = sorted(set(first["model"]) ^ set(weights))[:3]
            raise CheckpointError(f"{mismatch}: different parameters ({names})")
        for name, tensor in weights.items():
            reference = first["model"][name]
            if tensor.shape != reference.shape:
                raise CheckpointError(
                    f"{mismatch}: {name} has shape {list(tensor.shape)}, not "
                    f"{list(reference.shape)}"
                )
            if tensor.is_floating_point():
                sums[name] = sums.get(name, 0) + tensor.double()
            elif torch.equal(tensor, reference):
                sums[name] = tensor
            else:
                raise CheckpointError(f"{mismatch}: {name} differs (not a floating-point tensor)")
    mean = {
        name: (t / len(paths)).float() if t.is_floating_point() else t for name, t in sums.items()
    }
    return payloads[-1], mean


def export_inference(
    checkpoint: str | Path | Sequence[str | Path], output: str | Path, *, dtype: str = "float32"
) -> tuple[int, int]:
    """Write the weights and vocabularies of ``checkpoint`` (a training checkpoint or an export;
    several: their averaged weights, see :func:`average_weights`) to ``output``, floating-point
    tensors stored as ``dtype`` ("float32", "float16", "bfloat16"; loading casts them back to
    float32). -> (size of output, size of the (last) checkpoint) in bytes."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    paths = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
    output = Path(output)
    for path in paths:
        if output.resolve() == Path(path).resolve():
            raise ValueError(f"-o {output}: would overwrite the checkpoint it is exported from")
    if len(paths) == 1:
        payload = load_checkpoint(paths[0])
        weights = payload["model"]
    else:
        payload, weights = average_weights(paths)
    _build_model(payload | {"model": weights}, paths[-1])  # CheckpointError unless a model
    exported = inference_payload(payload, weights, dtype)
    if len(paths) > 1:  # the last one's metrics are not the average's
        exported["averaged_from"] = [str(path) for path in paths]
        exported["metrics"] = {}
    save_checkpoint(exported, output)
    return output.stat().st_size, Path(paths[-1]).stat().st_size


# --- training state: RNG streams, epoch snapshots -------------------------------------------------


def rng_state(data_generator: torch.Generator | None) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if data_generator is not None:
        state["data"] = data_generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], data_generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if data_generator is not None and "data" in state:
        data_generator.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


SNAPSHOT = re.compile(r"model\.epoch(\d+)\.pt")


def snapshots(folder: Path) -> list[Path]:
    """The epoch snapshots (model.epochE.pt) in ``folder``, oldest epoch first."""
    epochs = {}
    for path in folder.glob("model.epoch*.pt"):
        match = SNAPSHOT.fullmatch(path.name)
        if match:
            epochs[path] = int(match.group(1))
    return sorted(epochs, key=epochs.__getitem__)


def write_snapshot(
    header: dict[str, Any], weights: dict[str, Any], folder: Path, epoch: int, keep: int
) -> None:
    """The weights at an epoch's end as model.epochE.pt in ``folder`` (weights and vocabularies
    only, as ``export`` writes them), then the snapshots older than the last ``keep`` removed."""
    save_checkpoint(
        inference_payload(header, weights, "float32"), folder / f"model.epoch{epoch}.pt"
    )
    for old in snapshots(folder)[:-keep]:
        old.unlink(missing_ok=True)
