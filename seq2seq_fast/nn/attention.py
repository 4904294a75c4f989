"""The additive-attention module built on the fused op (the converter's stand-ins are in
:mod:`seq2seq_fast.nn.convert`).

The modules only hold parameters and call the functional
:func:`~seq2seq_fast.ops.additive_attention.additive_attention` with their backend, which picks
the kernel per call: ``"auto"`` uses the fused kernel where one serves the tensors' device and
dtype and otherwise the reference (warning once), ``"fused"`` raises instead, ``"reference"``
always uses the reference.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from seq2seq_fast.ops._checks import autocast_dtype
from seq2seq_fast.ops.additive_attention import BACKENDS, additive_attention, check_backend
from seq2seq_fast.ops.stepwise import StepwiseMemory

__all__ = ["BACKENDS", "BahdanauAttention", "check_backend"]


class BahdanauAttention(nn.Module):
    """Additive attention e = v^T tanh(W_q q + W_k k [+ b]), alpha = softmax(e), c = sum alpha * values.

    Args:
        query_size: size of the decoder state (query) features.
        key_size: size of the encoder state (key) features.
        hidden_size: H, the attention hidden size.
        weight_norm: weight-normalised score vector as in GNMT / TensorFlow: v_eff = g * v / ||v||
            with a scalar g initialised to 1/sqrt(H), and a bias b inside the tanh initialised to 0.
            (Formerly ``normalize=``, still accepted with a DeprecationWarning: in the op,
            ``normalize`` names the normalisation of the scores, "softmax" or "sigmoid".)
        backend: "auto", "fused" or "reference" (see module docstring).

    ``forward(query [B,Tq,Dq] or [B,Dq], keys [B,Tk,Dk], values=None (= keys), *, lengths=None,
    mask=None, projected_keys=None) -> (context [B,Tq,Dv] or [B,Dv], weights [B,Tq,Tk] or [B,Tk])``.
    When decoding step by step, call ``project_keys(keys)`` once per source batch and pass the
    result as ``projected_keys`` so the encoder states are not projected again every step.
    """

    def __init__(
        self,
        query_size: int,
        key_size: int,
        hidden_size: int,
        *,
        weight_norm: bool = False,
        backend: str = "auto",
        normalize: bool | None = None,
    ) -> None:
        super().__init__()
        if normalize is not None:
            warnings.warn(
                "BahdanauAttention(normalize=) is now weight_norm= (normalize names the score "
                "normalisation in the op)",
                DeprecationWarning,
                stacklevel=2,
            )
            weight_norm = bool(normalize)
        for name, value in (
            ("query_size", query_size),
            ("key_size", key_size),
            ("hidden_size", hidden_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.query_size, self.key_size, self.hidden_size = query_size, key_size, hidden_size
        self.weight_norm = weight_norm
        self.backend = check_backend(backend)
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)
        self.key_proj = nn.Linear(key_size, hidden_size, bias=False)
        self.v = nn.Parameter(torch.empty(hidden_size))
        if weight_norm:
            self.g = nn.Parameter(torch.empty(()))
            self.b = nn.Parameter(torch.empty(hidden_size))
        else:
            self.register_parameter("g", None)
            self.register_parameter("b", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.query_proj.reset_parameters()
        self.key_proj.reset_parameters()
        bound = 1.0 / math.sqrt(self.hidden_size)
        nn.init.uniform_(self.v, -bound, bound)
        if self.weight_norm:
            nn.init.constant_(self.g, bound)
            nn.init.zeros_(self.b)

    def extra_repr(self) -> str:
        return (
            f"query_size={self.query_size}, key_size={self.key_size}, hidden_size={self.hidden_size}, "
            f"weight_norm={self.weight_norm}, backend={self.backend!r}"
        )

    def _check_tensor(self, name: str, value: object) -> None:
        """A floating-point tensor on the parameters' device, in their dtype (unless autocast)."""
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        param = self.v
        if value.device != param.device:
            raise ValueError(
                f"{name} is on {value.device} but the module's parameters are on {param.device}"
            )
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        if value.dtype != param.dtype and autocast_dtype(value.device) is None:
            raise TypeError(
                f"{name} has dtype {value.dtype} but the module's parameters are {param.dtype} "
                f"(convert the module, e.g. .to({value.dtype}), or the input)"
            )

    @property
    def normalize(self) -> bool:
        """The former name of :attr:`weight_norm` (read-only)."""
        return self.weight_norm

    def project_keys(self, keys: Tensor) -> Tensor:
        """[B, Tk, key_size] -> [B, Tk, H]; compute once per source batch, reuse every step."""
        self._check_tensor("keys", keys)
        if keys.dim() != 3 or keys.shape[-1] != self.key_size:
            raise ValueError(
                f"keys must be [B, Tk, key_size={self.key_size}], got {list(keys.shape)}"
            )
        return self.key_proj(keys)

    def score_vector(self) -> tuple[Tensor, Tensor | None]:
        """(v_eff [H], bias [H] or None) as the op takes them."""
        if self.weight_norm:
            return self.g * self.v / self.v.norm(), self.b
        return self.v, None

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        *,
        lengths: Tensor | None = None,
        mask: Tensor | None = None,
        projected_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        self._check_tensor("query", query)
        if projected_keys is None or keys is not None:
            self._check_tensor("keys", keys)
        if values is not None:
            self._check_tensor("values", values)
        if projected_keys is not None:
            self._check_tensor("projected_keys", projected_keys)
        if query.dim() not in (2, 3) or query.shape[-1] != self.query_size:
            raise ValueError(
                f"query must be [B, Tq, query_size={self.query_size}] or [B, query_size], "
                f"got {list(query.shape)}"
            )
        if projected_keys is None:
            projected_keys = self.project_keys(keys)
        values = keys if values is None else values
        return self.attend_projected(
            self.query_proj(query), projected_keys, values, lengths=lengths, mask=mask
        )

    def attend_projected(
        self,
        projected_query: Tensor,
        projected_keys: Tensor,
        values: Tensor,
        *,
        lengths: Tensor | None = None,
        mask: Tensor | None = None,
        score_vector: tuple[Tensor, Tensor | None] | None = None,
        stepwise: StepwiseMemory | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``forward`` for a query already projected (``query_proj``), without the module-level
        checks (the op still checks shapes): projected_query [B, Tq, H] or [B, H], projected_keys
        [B, Tk, H], values [B, Tk, Dv] -> (context, weights). A caller that attends many times with
        the same parameters (a decoder, step by step) passes ``score_vector=self.score_vector()``
        computed once, and, when training, ``stepwise=StepwiseMemory.for_training(...)`` built
        once per sequence (its ``keys`` and ``values`` passed here)."""
        v_eff, bias = self.score_vector() if score_vector is None else score_vector
        context, weights = additive_attention(
            projected_query,
            projected_keys,
            values,
            v_eff,
            bias,
            lengths=lengths,
            mask=mask,
            backend=self.backend,
            stepwise=stepwise,
        )
        return context, weights
