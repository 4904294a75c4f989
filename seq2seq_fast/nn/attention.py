"""Drop-in additive-attention modules built on the fused op, and ``fuse_attention(model)``.

The modules only hold parameters and call the functional; the backend is picked per call:
``"auto"`` uses the fused kernel where one serves the tensors' device and dtype and otherwise the
reference (warning once), ``"fused"`` raises instead, ``"reference"`` always uses the reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.stepwise import StepwiseMemory
from seq2seq_fast.ops.additive_attention import (
    check_inputs,
    fused_unavailable_reason,
    run_checked,
    warn_fallback_once,
)

BACKENDS = ("auto", "fused", "reference")


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def attend(
    backend: str,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    mask: Tensor | None = None,
    return_weights: bool = True,
    stepwise: StepwiseMemory | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``additive_attention`` through ``backend`` ("auto", "fused" or "reference"); same contract.
    ``stepwise``: a :class:`~seq2seq_fast.nn.stepwise.StepwiseMemory` whose ``keys`` and ``values``
    are the ones passed (a decoder's steps; used only where the fused CPU kernel runs)."""
    checked = check_inputs(query, keys, values, v, bias, lengths, mask)
    use_reference = backend == "reference"
    if not use_reference:
        reason = fused_unavailable_reason(query.device, query.dtype)
        if reason is not None:
            if backend == "fused":
                raise RuntimeError(f"backend='fused' but {reason}")
            warn_fallback_once(query.device, query.dtype, reason)
            use_reference = True
    return run_checked(checked, return_weights, use_reference, stepwise)


class BahdanauAttention(nn.Module):
    """Additive attention e = v^T tanh(W_q q + W_k k [+ b]), alpha = softmax(e), c = sum alpha * values.

    Args:
        query_size: size of the decoder state (query) features.
        key_size: size of the encoder state (key) features.
        hidden_size: H, the attention hidden size.
        normalize: weight-normalised score vector as in GNMT / TensorFlow: v_eff = g * v / ||v||
            with a scalar g initialised to 1/sqrt(H), and a bias b inside the tanh initialised to 0.
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
        normalize: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (
            ("query_size", query_size),
            ("key_size", key_size),
            ("hidden_size", hidden_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.query_size, self.key_size, self.hidden_size = query_size, key_size, hidden_size
        self.normalize = normalize
        self.backend = _check_backend(backend)
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)
        self.key_proj = nn.Linear(key_size, hidden_size, bias=False)
        self.v = nn.Parameter(torch.empty(hidden_size))
        if normalize:
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
        if self.normalize:
            nn.init.constant_(self.g, bound)
            nn.init.zeros_(self.b)

    def extra_repr(self) -> str:
        return (
            f"query_size={self.query_size}, key_size={self.key_size}, hidden_size={self.hidden_size}, "
            f"normalize={self.normalize}, backend={self.backend!r}"
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
        if value.dtype != param.dtype and not torch.is_autocast_enabled(value.device.type):
            raise TypeError(
                f"{name} has dtype {value.dtype} but the module's parameters are {param.dtype} "
                f"(convert the module, e.g. .to({value.dtype}), or the input)"
            )

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
        if self.normalize:
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
        context, weights = attend(
            self.backend, projected_query, projected_keys, values, v_eff, bias,
            lengths=lengths, mask=mask, stepwise=stepwise,
        )  # fmt: skip
        return context, weights


# --- drop-in replacements for attention modules found in existing models ---------------------------


class FusedTutorialAttention(nn.Module):
    """Fused stand-in for the PyTorch seq2seq tutorial's ``BahdanauAttention`` (Wa, Ua, Va Linears).

    Same parameters (the very same Parameter objects, same state_dict keys) and call convention:
    ``forward(query [B,1,H], keys [B,S,H]) -> (context [B,1,H], weights [B,1,S])`` with
    scores = Va(tanh(Wa(query) + Ua(keys))). Va's bias shifts every score of a row equally, so it
    cancels in the softmax and is left out of the kernel.
    """

    def __init__(self, Wa: nn.Linear, Ua: nn.Linear, Va: nn.Linear, backend: str = "auto") -> None:  # noqa: N803
        super().__init__()
        self.Wa, self.Ua, self.Va = Wa, Ua, Va
        self.backend = _check_backend(backend)

    def forward(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        context, weights = attend(
            self.backend, self.Wa(query), self.Ua(keys), keys, self.Va.weight[0]
        )
        return context, weights


class FusedGNMTAttention(nn.Module):
    """Fused stand-in for NVIDIA GNMT's ``BahdanauAttention`` (linear_q, linear_k, linear_att, ...).

    Same parameters and state_dict keys, same ``set_mask(context_len, context)`` and
    ``forward(query, keys)`` with query [B,H] or [B,Tq,H] (time-major [Tq,B,H] when
    ``batch_first=False``), returning (context, weights) with context = weights @ keys. One
    difference: a row whose keys are all masked gets zero weights here, uniform weights there.
    """

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__()
        self.linear_q, self.linear_k = original.linear_q, original.linear_k
        self.linear_att = original.linear_att
        self.normalize = bool(getattr(original, "normalize", original.normalize_scalar is not None))
        self.batch_first = bool(getattr(original, "batch_first", True))
        self.num_units = self.linear_att.shape[0]
        if self.normalize:
            self.normalize_scalar = original.normalize_scalar
            self.normalize_bias = original.normalize_bias
        else:
            self.register_parameter("normalize_scalar", None)
            self.register_parameter("normalize_bias", None)
        self.mask = getattr(original, "mask", None)  # True = padding, as in GNMT
        self.backend = _check_backend(backend)

    def set_mask(self, context_len: Tensor, context: Tensor) -> None:
        max_len = context.size(1) if self.batch_first else context.size(0)
        indices = torch.arange(max_len, dtype=torch.int64, device=context.device)
        self.mask = indices >= context_len.unsqueeze(1)

    def forward(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        if not self.batch_first:
            keys = keys.transpose(0, 1)
            if query.dim() == 3:
                query = query.transpose(0, 1)
        if self.normalize:
            v_eff = self.linear_att / self.linear_att.norm() * self.normalize_scalar
            bias = self.normalize_bias
        else:
            v_eff, bias = self.linear_att, None
        mask = None if self.mask is None else ~self.mask
        context, weights = attend(
            self.backend, self.linear_q(query), self.linear_k(keys), keys, v_eff, bias, mask=mask
        )
        if query.dim() == 3 and not self.batch_first:
            context, weights = context.transpose(0, 1), weights.transpose(0, 1)
        return context, weights


def _is_linear(
    module: object, *, bias: bool | None = None, out_features: int | None = None
) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if bias is not None and (module.bias is not None) != bias:
        return False
    return out_features is None or module.out_features == out_features


def _own_parameter_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters(recurse=False)}


def _fused_replacement(module: nn.Module, backend: str) -> nn.Module | None:
    """The fused module for a recognised attention layout, or None."""
    if isinstance(module, (BahdanauAttention, FusedTutorialAttention, FusedGNMTAttention)):
        return None
    children = dict(module.named_children())
    # PyTorch seq2seq translation tutorial: Wa, Ua (H->H), Va (H->1), all Linear, nothing else.
    if set(children) == {"Wa", "Ua", "Va"} and not _own_parameter_names(module):
        wa, ua, va = children["Wa"], children["Ua"], children["Va"]
        if (
            _is_linear(wa)
            and _is_linear(ua, out_features=wa.out_features)
            and _is_linear(va, out_features=1)
            and va.in_features == wa.out_features
            and ua.in_features == va.in_features
        ):
            return FusedTutorialAttention(wa, ua, va, backend)
    # NVIDIA GNMT: linear_q, linear_k (no bias), linear_att [H] (+ normalize_scalar [1], normalize_bias [H]).
    if set(children) == {"linear_q", "linear_k"}:
        linear_q, linear_k = children["linear_q"], children["linear_k"]
        att = getattr(module, "linear_att", None)
        if (
            _is_linear(linear_q, bias=False)
            and _is_linear(linear_k, bias=False, out_features=linear_q.out_features)
            and isinstance(att, nn.Parameter)
            and att.shape == (linear_q.out_features,)
        ):
            scalar = getattr(module, "normalize_scalar", None)
            norm_bias = getattr(module, "normalize_bias", None)
            own = _own_parameter_names(module)
            if scalar is None and norm_bias is None and own == {"linear_att"}:
                return FusedGNMTAttention(module, backend)
            if (
                isinstance(scalar, nn.Parameter)
                and scalar.numel() == 1
                and isinstance(norm_bias, nn.Parameter)
                and norm_bias.shape == att.shape
                and own == {"linear_att", "normalize_scalar", "normalize_bias"}
            ):
                return FusedGNMTAttention(module, backend)
    return None


def fuse_attention(model: nn.Module, *, backend: str = "auto") -> int:
    """Replace, in place, every recognised additive-attention submodule of ``model`` by a fused one.

    Recognised layouts: the PyTorch seq2seq tutorial's (``Wa``, ``Ua``, ``Va``) and NVIDIA GNMT's
    (``linear_q``, ``linear_k``, ``linear_att`` [, ``normalize_scalar``, ``normalize_bias``]). The
    replacements share the original Parameter objects (optimisers keep working, state_dict keys are
    unchanged) and keep the call convention. Other modules are left alone.

    Returns:
        How many submodules were replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_backend(backend)
    if _fused_replacement(model, backend) is not None:
        raise ValueError(
            f"model itself is a recognised attention module ({type(model).__name__}); fuse_attention "
            "replaces submodules in place: wrap it in a parent module (e.g. nn.Sequential) first"
        )
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            fused = _fused_replacement(child, backend)
            if fused is not None:
                fused.train(child.training)
                setattr(parent, child_name, fused)
                replaced += 1
    return replaced
