"""AllenNLP's ``AdditiveAttention`` (allennlp/modules/attention/additive_attention.py).

Original parameters: ``_w_matrix`` [Dv, Dv], ``_u_matrix`` [Dm, Dv], ``_v_vector`` [Dv, 1] (own
parameters, no children); ``_normalize`` (bool). Original math and call::

    forward(vector [B, Dv], matrix [B, T, Dm], matrix_mask [B, T] (True = keep) or None)
        -> weights [B, T]   (no context: the caller forms it, e.g. util.weighted_sum)
    s = tanh(vector @ W + matrix @ U) @ v
    normalize: masked_softmax(s, mask) = softmax(s * mask) * mask / (sum + 1e-13)
    not normalize: s itself

The masked softmax is the softmax over the kept positions divided by (1 + 1e-13 / sum): the
stand-in's weights equal it to 1e-13 relative; a row with nothing kept gives zeros in both. A
decoder calls it once per step with the same ``matrix``: the stand-in projects a given matrix
once and reuses it (:class:`~seq2seq_fast.nn.keycache.ProjectionCache`). A float mask that is not
0/1 (it multiplies the scores there) runs the original's math in plain PyTorch.
``_normalize=False`` (raw similarities, no softmax) is skipped: nothing for the kernel to fuse.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    own_parameter_names,
    register,
)
from seq2seq_fast.nn.convert._planned import planned
from seq2seq_fast.nn.convert._speech import adopt
from seq2seq_fast.nn.keycache import ProjectionCache


class FusedAllenNLPAdditiveAttention(FusedStandIn):
    """Fused stand-in for AllenNLP's AdditiveAttention (normalised): same parameters (the very
    objects, same state_dict keys) and ``forward(vector, matrix, matrix_mask=None)`` -> weights.
    Its attention is a typed plan on the general path's runtime (``_planned.py``), with the
    masked softmax as a "product" mask; the fused op forms a one-column context nobody reads
    (O(B * T))."""

    layout = "allennlp_additive"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)
        self.key_cache = ProjectionCache()  # matrix @ U, per matrix tensor

    def forward(self, vector: Tensor, matrix: Tensor, matrix_mask: Tensor | None = None) -> Tensor:
        u = self._u_matrix
        keys = self.key_cache.get(matrix, (u,), lambda: matrix.matmul(u))
        masks = () if matrix_mask is None else (matrix_mask,)
        attention = planned(self, masks=("product",) * len(masks), one_query=True)
        weights, _ = attention(
            vector.matmul(self._w_matrix), keys, self._v_vector, None, masks=masks
        )
        return weights


def _match(module: nn.Module) -> bool:
    if child_names(module) or own_parameter_names(module) != {
        "_w_matrix",
        "_u_matrix",
        "_v_vector",
    }:
        return False
    if not isinstance(getattr(module, "_normalize", None), bool):
        return False
    w, u, v = module._w_matrix, module._u_matrix, module._v_vector
    width = w.shape[0] if w.dim() == 2 else -1
    return (
        w.shape == (width, width) and u.dim() == 2 and u.shape[1] == width and v.shape == (width, 1)
    )


def _unsupported(module: nn.Module) -> str | None:
    if not module._normalize:
        return "normalize=False returns the raw similarities: no softmax and context to fuse"
    return None


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, rows = 3, 6
    vector = torch.randn(batch, module._w_matrix.shape[0], dtype=dtype)
    matrix = torch.randn(batch, rows, module._u_matrix.shape[0], dtype=dtype)
    mask = torch.arange(rows) < torch.tensor([6, 4, 0]).unsqueeze(1)
    return (vector, matrix, mask), {}


register(
    Layout(
        "allennlp_additive",
        _match,
        lambda module, backend: FusedAllenNLPAdditiveAttention(module, backend),
        _example_call,
        unsupported=_unsupported,
    )
)
