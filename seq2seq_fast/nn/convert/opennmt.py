"""OpenNMT-py / Eole ``GlobalAttention(dim, attn_type="mlp", attn_func="softmax")``.

Original parameters: ``linear_context`` (dim -> dim, no bias), ``linear_query`` (dim -> dim, with
bias), ``v`` (dim -> 1, no bias), ``linear_out`` (2 dim -> dim, with bias); ``linear_cover`` when
built with coverage. Attributes ``dim``, ``attn_type``, ``attn_func``.

Original math and call::

    forward(source [B, Tt, dim] or [B, dim], memory_bank [B, S, dim], src_len [B] = None,
            coverage = None)        (older releases: memory_lengths for src_len)
    scores = v(tanh(linear_query(source) + linear_context(memory_bank)))     # [B, Tt, S]
    scores[position >= src_len] = -inf; align = softmax(scores); c = align @ memory_bank
    attn_h = linear_out([c; source])
    returns (attn_h, align): batch-major [B, Tt, .] (time-major [Tt, B, .] in older releases,
    the ``opennmt_mlp_time_major`` layout), squeezed to [B, .] for a [B, dim] source.

The input-feeding decoder calls it once per target step over the same memory_bank: the stand-in
projects it once per memory_bank tensor, and the general path's runtime (``_planned.py``) keeps
its layout and gathers the steps' gradients once per sequence. Not converted: coverage attention
(``linear_cover``) and sparsemax. A row with no valid key gives NaN, as there (a softmax of -inf
only).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    forward_defined_in,
    is_linear,
    register,
)
from seq2seq_fast.nn.convert._planned import PlannedAttention
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedGlobalAttention(FusedStandIn):
    """Fused stand-in for OpenNMT's mlp GlobalAttention (see the module docstring): the same
    four Linears and attributes, the same call and return values."""

    def __init__(self, original: nn.Module, backend: str, *, time_major_output: bool) -> None:
        super().__init__(backend)
        self.layout = "opennmt_mlp_time_major" if time_major_output else "opennmt_mlp"
        for name, child in original.named_children():
            self.add_module(name, child)
        for key in ("dim", "attn_type", "attn_func"):
            setattr(self, key, getattr(original, key))
        self.time_major_output = time_major_output
        self.key_cache = ProjectionCache()  # linear_context(memory_bank), per memory_bank
        self.mask_cache = ProjectionCache()  # the lengths' mask, per lengths tensor
        # the general path's runtime: scores at and past a row's length -inf, a softmax
        self.masked = PlannedAttention(backend, masks=("keep",), description=self.layout)
        self.unmasked = PlannedAttention(backend, description=self.layout)

    def _mask(self, lengths: Tensor, frames: int) -> Tensor:
        """[B, 1, S], True where a frame is within its row's length, as the original's
        ``sequence_mask`` (one tensor per lengths tensor and S: the runtime's mask cache goes by
        identity)."""
        return self.mask_cache.get(
            lengths,
            (frames,),
            lambda: (torch.arange(frames, device=lengths.device) < lengths[:, None]).unsqueeze(1),
        )

    def forward(
        self,
        source: Tensor,
        memory_bank: Tensor,
        src_len: Tensor | None = None,
        coverage: Tensor | None = None,
        *,
        memory_lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        if coverage is not None:
            raise NotImplementedError(
                "seq2seq_fast's fused GlobalAttention does not support coverage (coverage was "
                f"given, shape {list(coverage.shape)}); keep the original module for coverage"
            )
        lengths = src_len if src_len is not None else memory_lengths
        one_step = source.dim() == 2
        source3 = source.unsqueeze(1) if one_step else source
        layer = self.linear_context
        keys = self.key_cache.get(memory_bank, (layer.weight,), lambda: layer(memory_bank))
        if lengths is None:
            masks = ()
        else:
            masks = (self._mask(lengths, memory_bank.shape[1]),)
        attention = self.masked if masks else self.unmasked
        align, context = attention(
            self.linear_query(source3),
            keys,
            self.v.weight,
            memory_bank,
            masks=masks,
            fills=(float("-inf"),) * len(masks),
        )
        attn_h = self.linear_out(torch.cat([context, source3], dim=2))
        if one_step:
            return attn_h.squeeze(1), align.squeeze(1)
        if self.time_major_output:
            return attn_h.transpose(0, 1).contiguous(), align.transpose(0, 1).contiguous()
        return attn_h, align


def _match(module: nn.Module) -> bool:
    if type(module).__name__ != "GlobalAttention" or not forward_defined_in(
        module, "GlobalAttention"
    ):
        return False
    if getattr(module, "attn_type", None) != "mlp":
        return False
    dim = getattr(module, "dim", None)
    names = child_names(module)
    if names - {"linear_cover"} != {"linear_context", "linear_query", "v", "linear_out"}:
        return False
    return (
        is_linear(module.linear_context, bias=False, in_features=dim, out_features=dim)
        and is_linear(module.linear_query, bias=True, in_features=dim, out_features=dim)
        and is_linear(module.v, bias=False, in_features=dim, out_features=1)
        and is_linear(module.linear_out, bias=True, in_features=2 * dim, out_features=dim)
        and not list(module.named_parameters(recurse=False))
    )


def _unsupported(module: nn.Module) -> str | None:
    if getattr(module, "attn_func", "softmax") != "softmax":
        return f"attn_func={module.attn_func!r}: only softmax has a fused equivalent"
    if "linear_cover" in child_names(module):
        return "coverage attention (linear_cover) is not supported"
    return None


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, tgt_len, src_len = 3, 2, 5
    source = torch.randn(batch, tgt_len, module.dim, dtype=dtype)
    memory_bank = torch.randn(batch, src_len, module.dim, dtype=dtype)
    return (source, memory_bank, torch.tensor([5, 3, 1])), {}


def _builder(time_major_output: bool):
    def build(module: nn.Module, backend: str) -> nn.Module:
        return FusedGlobalAttention(module, backend, time_major_output=time_major_output)

    return build


OPENNMT = register(
    Layout("opennmt_mlp", _match, _builder(False), _example_call, unsupported=_unsupported)
)
OPENNMT_TIME_MAJOR = register(
    Layout(
        "opennmt_mlp_time_major", _match, _builder(True), _example_call, unsupported=_unsupported
    )
)
