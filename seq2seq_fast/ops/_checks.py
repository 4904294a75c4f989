"""Input checks of the attention ops' public contract: types, shapes, devices, dtypes, lengths and
masks, with errors that name the argument and what it got, before any kernel runs."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import traced_or_transformed


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _require_float_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def _as_lengths(lengths: object, batch: int, num_keys: int, device: torch.device) -> Tensor:
    if isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        items = list(lengths)
        try:  # no dtype forced: [1.5, 2] must fail the integer check below, not be truncated
            lengths = (
                torch.tensor(items, device=device)
                if items
                else torch.zeros(0, dtype=torch.int64, device=device)
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"lengths must be an integer tensor or a sequence of ints, got {items!r:.80} ({exc})"
            ) from None
    if not isinstance(lengths, Tensor):
        raise TypeError(
            f"lengths must be an integer tensor of shape [{batch}], got {type(lengths).__name__}"
        )
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [B]=[{batch}], got {_shape(lengths)}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but query is on {device}")
    # Values cannot be read while compiling or on the meta device (shapes only).
    if not torch.compiler.is_compiling() and lengths.numel() > 0 and lengths.device.type != "meta":
        check_lengths_range(lengths, num_keys)
    return lengths.to(torch.int64).contiguous()


# Lengths tensors whose range was checked: id -> (weak reference, version, Tk). A decoder passes the
# same lengths at every step; reading their range each time costs two reductions and, on CUDA, two
# host synchronisations per call. An in-place change bumps the version and checks again.
_checked_lengths: dict[int, tuple] = {}


def _check_range_now(lengths: Tensor, num_keys: int) -> None:
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0 or high > num_keys:
        raise ValueError(f"lengths must lie in [0, Tk={num_keys}], got values from {low} to {high}")


def check_lengths_range(lengths: Tensor, num_keys: int) -> None:
    if lengths.is_inference():  # (made under inference_mode: no version counter to watch)
        _check_range_now(lengths, num_keys)
        return
    key = id(lengths)
    entry = _checked_lengths.get(key)
    if entry is not None and entry[0]() is lengths and entry[1:] == (lengths._version, num_keys):
        return
    _check_range_now(lengths, num_keys)
    try:
        ref = weakref.ref(lengths, lambda _, key=key: _checked_lengths.pop(key, None))
    except TypeError:  # not weak-referenceable: check every time
        return
    _checked_lengths[key] = (ref, lengths._version, num_keys)


def _as_mask(mask: object, batch: int, num_keys: int, device: torch.device) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be a bool tensor of shape [{batch}, {num_keys}], got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
    if mask.shape != (batch, num_keys):
        raise ValueError(f"mask must have shape [B, Tk]=[{batch}, {num_keys}], got {_shape(mask)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but query is on {device}")
    return mask.contiguous()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype while autocast is on for this device (CPU or CUDA), else None: what
    the layers above ops ask instead of testing autocast themselves."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off (CPU, and CUDA where there is one) inside the block: for the converter's own
    calls, the safety check and the probe, which compare in float64 and which a caller's autocast
    region would turn into bfloat16 (and every conversion made there into a refusal)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def prefix_lengths(valid: Tensor | None) -> Tensor | None:
    """int64 [B]: each row's number of valid keys when they are a prefix of the row (a padding
    mask, True = valid), else None. The fused op then scores only those keys. None while tracing
    (torch.compile, torch.func, torch.jit.trace): the choice reads the mask's values, which a
    trace would freeze, so a later mask with holes would be read as lengths."""
    if valid is None or valid.dim() != 2 or valid.dtype != torch.bool:
        return None
    if torch.jit.is_tracing() or traced_or_transformed():
        return None
    lengths = valid.sum(1)
    prefix = torch.arange(valid.shape[1], device=valid.device) < lengths.unsqueeze(1)
    return lengths if torch.equal(prefix, valid) else None


def masking(valid: Tensor | None) -> dict[str, Tensor | None]:
    """The attention's keyword for a bool [B, T] mask (True = valid): on the CPU ``lengths`` for
    a padding mask (the fused op then skips the padded keys instead of scoring and dropping them;
    the one difference: a non-finite value in the padding does not reach the context), else
    ``mask``. Elsewhere the mask as given (reading it would wait for the device), and never while
    tracing."""
    if valid is not None and valid.device.type == "cpu":
        lengths = prefix_lengths(valid)
        if lengths is not None:
            return {"lengths": lengths}
    return {"mask": valid}


class AttentionInputs(NamedTuple):
    """The attention's inputs as :func:`check_inputs` returns them, checked and normalised."""

    query: Tensor  # [B, Tq, H]; a [B, H] query (one decoding step) made [B, 1, H]
    keys: Tensor  # [B, Tk, H]
    values: Tensor  # [B, Tk, Dv]
    v: Tensor  # [H]
    bias: Tensor | None  # [H]
    lengths: Tensor | None  # int64 [B], contiguous, in [0, Tk]
    mask: Tensor | None  # bool [B, Tk], contiguous; never together with lengths
    single_step: bool  # the query was [B, H]: the outputs drop the Tq axis


def check_inputs(query, keys, values, v, bias=None, lengths=None, mask=None) -> AttentionInputs:
    """Validate the public contract; return the inputs as :class:`AttentionInputs`.

    Under torch.autocast on the query's device the floating inputs are first cast to the autocast
    dtype (differentiable casts, as autocast casts a product's inputs: float32 parameters keep
    float32 gradients). Raises TypeError for non-tensors / wrong dtypes and ValueError for shapes,
    devices, ranges.
    """
    tensors = {"query": query, "keys": keys, "values": values, "v": v}
    if bias is not None:
        tensors["bias"] = bias
    for name, value in tensors.items():
        _require_float_tensor(name, value)
    autocast = autocast_dtype(query.device)
    if autocast is not None:
        tensors = {name: value.to(autocast) for name, value in tensors.items()}
        query, keys, values, v = (tensors[n] for n in ("query", "keys", "values", "v"))
        bias = tensors.get("bias")
    if query.dim() not in (2, 3):
        raise ValueError(f"query must be [B, Tq, H] or [B, H], got shape {_shape(query)}")
    if keys.dim() != 3:
        raise ValueError(f"keys must be [B, Tk, H], got shape {_shape(keys)}")
    if values.dim() != 3:
        raise ValueError(f"values must be [B, Tk, Dv], got shape {_shape(values)}")
    batch, num_keys, hidden = keys.shape
    if query.shape[0] != batch or query.shape[-1] != hidden:
        raise ValueError(
            f"query {_shape(query)} does not match keys {_shape(keys)}: "
            f"need query [B={batch}, Tq, H={hidden}] or [B={batch}, H={hidden}]"
        )
    if values.shape[0] != batch or values.shape[1] != num_keys:
        raise ValueError(
            f"values {_shape(values)} does not match keys {_shape(keys)}: need [B={batch}, Tk={num_keys}, Dv]"
        )
    if v.shape != (hidden,):
        raise ValueError(f"v must have shape [H]=[{hidden}], got {_shape(v)}")
    if bias is not None and bias.shape != (hidden,):
        raise ValueError(f"bias must have shape [H]=[{hidden}] or be None, got {_shape(bias)}")
    for name, value in tensors.items():
        if value.device != query.device:
            raise ValueError(f"{name} is on {value.device} but query is on {query.device}")
        if value.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but query has dtype {query.dtype}")
    if lengths is not None and mask is not None:
        raise ValueError("pass either lengths or mask, not both")
    if lengths is not None:
        lengths = _as_lengths(lengths, batch, num_keys, query.device)
    if mask is not None:
        mask = _as_mask(mask, batch, num_keys, query.device)
    single_step = query.dim() == 2
    query3 = query.unsqueeze(1) if single_step else query
    return AttentionInputs(query3, keys, values, v, bias, lengths, mask, single_step)
