"""Fine-tuning (``--init-from CHECKPOINT``): a new job that starts from a trained model's weights.

Only the weights (and the vocabularies they were trained with) come from the checkpoint: the data,
the optimiser, the learning-rate schedule and the position are the new job's own. The model the
new configuration builds must have the checkpoint's shape and vocabularies, else
:class:`~seq2seq_fast.seq2seq.config.TrainError` lists what differs. ``--resume`` is the other
thing: the exact continuation of a run, its optimiser and position included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from seq2seq_fast.seq2seq.checkpoint import load_checkpoint
from seq2seq_fast.seq2seq.config import TrainError
from seq2seq_fast.seq2seq.models import Seq2Seq

# Model-config fields that may change between the checkpoint and the fine-tuning job: they do not
# change a parameter's shape or meaning.
FREE_FIELDS = ("backend", "dropout")


def load_init(path: str | Path) -> dict[str, Any]:
    """The checkpoint to start from (a training checkpoint or an exported model)."""
    payload = load_checkpoint(path)
    for key in ("model_config", "model", "src_vocab", "tgt_vocab"):
        if key not in payload:
            raise TrainError(f"--init-from {path}: the checkpoint has no {key!r}")
    return payload


def differences(model: Seq2Seq, src_vocab, tgt_vocab, payload: dict[str, Any]) -> list[str]:
    """What differs between the new job's model and vocabularies and the checkpoint's: one
    "name: new value (checkpoint: value)" line each; [] when they fit."""
    found = []
    ours = model.config.to_dict()
    theirs = dict(payload["model_config"])
    for name in sorted(set(ours) | set(theirs)):
        if name in FREE_FIELDS:
            continue
        if ours.get(name) != theirs.get(name):
            found.append(f"{name}: {ours.get(name)!r} (checkpoint: {theirs.get(name)!r})")
    for side, key, vocab in (
        ("source", "src_vocab", src_vocab),
        ("target", "tgt_vocab", tgt_vocab),
    ):
        state = payload[key]
        if vocab.to_state() != state:
            found.append(
                f"{side} vocabulary: {vocab.to_state().get('kind')} of {len(vocab)} "
                f"entries (checkpoint: a different {state.get('kind')} vocabulary)"
            )
    return found


def init_from(model: Seq2Seq, src_vocab, tgt_vocab, payload: dict[str, Any], path) -> None:
    """Check the fit (TrainError listing every difference), then load the checkpoint's weights
    into ``model`` (converted to the model's dtype)."""
    found = differences(model, src_vocab, tgt_vocab, payload)
    if found:
        raise TrainError(
            f"--init-from {path}: the model this configuration builds does not fit the "
            f"checkpoint's; set the options to the checkpoint's values: " + "; ".join(found)
        )
    model.load_state_dict(payload["model"])
