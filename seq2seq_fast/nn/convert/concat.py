"""The "concat" layout: one Linear over [decoder state; encoder output] and a score vector.

Written from bentrevett/pytorch-seq2seq (notebooks 3 and 4, ``Attention``), the PyTorch chatbot
tutorial (``Attn("concat", H)``) and their many copies. Parameters: ``attn`` (or ``attention``),
a Linear (Dq + Dk -> H, with bias), and ``v``: a Linear (H -> 1, no bias) or a Parameter [H].

Original math: energy = tanh(attn([hidden repeated over S; encoder_outputs])), scores = v . energy,
masked (``mask == 0``) scores set to -1e10, weights = softmax over the source. The module returns
the weights only; the caller forms the context. Splitting attn's weight at the query width,
W = [W_q | W_k], gives scores = v . tanh(W_q hidden + W_k enc + b): the fused op's form, with the
encoder part projected once per encoder_outputs tensor (the caller passes the same one at every
step) and the steps' gradients gathered once per sequence.

Call conventions, one registered layout each (the safety check keeps the one the module follows):

- ``concat``: bentrevett: ``forward(hidden [B, Dq], encoder_outputs [S, B, Dk], mask [B, S]
  = None) -> weights [B, S]`` (time-major memory);
- ``concat_batch_first``: the copies with ``encoder_outputs [B, S, Dk]`` (``hidden`` may be
  [1, B, Dq] there, squeezed);
- ``chatbot_concat``: the chatbot tutorial's ``Attn``: ``forward(hidden [1, B, H],
  encoder_outputs [S, B, H]) -> weights [B, 1, S]``, score vector ``v`` a Parameter, attribute
  ``method == "concat"``.

A row whose keys are all masked gets uniform weights, as in the original (all its scores equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    is_linear,
    own_parameter_names,
    register,
)
from seq2seq_fast.nn.keycache import ProjectionCache
from seq2seq_fast.nn.stepwise import StepMemory, step_memory
from seq2seq_fast.ops.additive_attention import additive_attention


class FusedConcatAttention(FusedStandIn):
    """Fused stand-in for the concat layout (see the module docstring). Keeps the original's
    parameters under their names (``attn`` or ``attention``; ``v``) and its plain attributes."""

    def __init__(self, original: nn.Module, backend: str, *, time_major: bool, layout: str) -> None:
        super().__init__(backend)
        self.layout = layout
        self._linear_name = "attn" if "attn" in child_names(original) else "attention"
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for key, value in vars(original).items():
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.time_major = time_major
        self.returns_3d = layout == "chatbot_concat"
        self.key_cache = ProjectionCache()

    @property
    def _linear(self) -> nn.Linear:
        return getattr(self, self._linear_name)

    def _score_vector(self) -> Tensor:
        v = self.v
        return v if isinstance(v, nn.Parameter) else v.weight[0]

    def _memory(self, encoder_outputs: Tensor, query_width: int) -> StepMemory:
        """The steps' memory: projected keys [B, S, H] and dummy values [B, S, 1]."""
        linear = self._linear
        projected = F.linear(encoder_outputs, linear.weight[:, query_width:], linear.bias)
        if self.time_major:
            projected = projected.transpose(0, 1)
        projected = projected.contiguous()
        # the caller forms the context; the op gets a one-feature value it ignores
        values = projected.new_zeros(projected.shape[0], projected.shape[1], 1)
        return step_memory(projected, values, self.backend)

    def forward(
        self, hidden: Tensor, encoder_outputs: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden.squeeze(0)
        linear = self._linear
        width = hidden.shape[-1]
        memory = self.key_cache.get(
            encoder_outputs,
            (linear.weight, linear.bias, width),
            lambda: self._memory(encoder_outputs, width),
            watch=lambda m: (m.projection,),
        )
        query = F.linear(hidden, linear.weight[:, :width])
        valid = None if mask is None else mask != 0
        _, weights = additive_attention(
            query,
            memory.keys,
            memory.values,
            self._score_vector(),
            mask=valid,
            stepwise=memory.stepwise,
            backend=self.backend,
        )
        if valid is not None:  # no valid key: the original's scores are all -1e10, uniform weights
            empty = ~valid.any(dim=1, keepdim=True)
            weights = torch.where(empty, 1.0 / weights.shape[-1], weights)
        return weights.unsqueeze(1) if self.returns_3d else weights


def _score_ok(module: nn.Module, hidden: int) -> bool:
    v = getattr(module, "v", None)
    if isinstance(v, nn.Parameter):
        return v.shape == (hidden,)
    return is_linear(v, bias=False, in_features=hidden, out_features=1)


def _match_common(module: nn.Module) -> bool:
    names = child_names(module) - {"v"}
    if names not in ({"attn"}, {"attention"}):
        return False
    linear = getattr(module, next(iter(names)))
    if not is_linear(linear, bias=True) or linear.in_features <= linear.out_features:
        return False
    own = own_parameter_names(module)
    return own in (set(), {"v"}) and _score_ok(module, linear.out_features)


def _match_bentrevett(module: nn.Module) -> bool:
    return _match_common(module) and not hasattr(module, "method")


def _match_chatbot(module: nn.Module) -> bool:
    return (
        _match_common(module)
        and getattr(module, "method", None) == "concat"
        and isinstance(getattr(module, "v", None), nn.Parameter)
    )


def _widths(module: nn.Module) -> tuple[int, int]:
    """(query width, key width): bentrevett's decoder state is attn's output width."""
    linear = module.attn if "attn" in child_names(module) else module.attention
    query_width = linear.out_features
    return query_width, linear.in_features - query_width


def _example(module: nn.Module, dtype: torch.dtype, *, time_major: bool, chatbot: bool):
    batch, num_keys = 3, 5
    query_width, key_width = _widths(module)
    hidden = torch.randn(batch, query_width, dtype=dtype)
    keys = torch.randn(batch, num_keys, key_width, dtype=dtype)
    if time_major:
        keys = keys.transpose(0, 1).contiguous()
    if chatbot:
        return (hidden.unsqueeze(0), keys), {}
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    return (hidden, keys, mask), {}


def _builder(time_major: bool, layout: str):
    def build(module: nn.Module, backend: str) -> nn.Module:
        return FusedConcatAttention(module, backend, time_major=time_major, layout=layout)

    return build


CONCAT = register(
    Layout(
        "concat",
        _match_bentrevett,
        _builder(True, "concat"),
        lambda m, dtype: _example(m, dtype, time_major=True, chatbot=False),
    )
)
CONCAT_BATCH_FIRST = register(
    Layout(
        "concat_batch_first",
        _match_bentrevett,
        _builder(False, "concat_batch_first"),
        lambda m, dtype: _example(m, dtype, time_major=False, chatbot=False),
    )
)
CHATBOT = register(
    Layout(
        "chatbot_concat",
        _match_chatbot,
        _builder(True, "chatbot_concat"),
        lambda m, dtype: _example(m, dtype, time_major=True, chatbot=True),
    )
)
