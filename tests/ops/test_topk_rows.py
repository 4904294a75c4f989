"""The extension's ``_topk_rows`` (the searches' per-row top-k) against torch.topk."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.ops import _library

if _library.CPU_KERNEL_ERROR is not None or not hasattr(torch.ops.seq2seq_fast, "_topk_rows"):
    pytest.skip("the C++ extension with _topk_rows is not built", allow_module_level=True)

topk_rows = torch.ops.seq2seq_fast._topk_rows


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(320, 4000, 10), (64, 50, 10), (7, 13, 13), (5, 3, 1), (33, 4001, 1), (3, 37, 5), (2, 16, 16)],
)
@pytest.mark.parametrize("kind", ["random", "ascending", "descending", "ties", "masked"])
def test_topk_rows_equals_torch_topk(rows, n, k, kind):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, n, generator=g)
    if kind == "ascending":
        x = x.sort(-1).values
    elif kind == "descending":
        x = x.sort(-1, descending=True).values
    elif kind == "ties":
        x = x.round()
    elif kind == "masked":  # log-probabilities of rows allowed one token: -inf elsewhere
        x.fill_(-torch.inf)
        x[:, n // 2] = 0.0
    values, indices = topk_rows(x, k)
    expected, _ = x.topk(k, dim=-1)
    assert values.shape == indices.shape == (rows, k) and indices.dtype == torch.int64
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, indices), values)
    # equal entries in index order: within each run of equal values the indices ascend
    same = values[:, 1:] == values[:, :-1]
    assert bool((indices[:, 1:] > indices[:, :-1])[same].all())
    assert all(len(set(row)) == k for row in indices.tolist())


def test_topk_rows_nan_and_errors():
    x = torch.tensor([[float("nan"), 1.0, float("nan"), 0.0], [2.0, float("nan"), 5.0, 1.0]])
    values, indices = topk_rows(x, 3)
    assert indices[0, :2].tolist() == [1, 3] and indices[0, 2] == 0  # NaN only to fill
    assert indices[1].tolist() == [2, 0, 3]
    with pytest.raises(RuntimeError, match="k must be in"):
        topk_rows(x, 5)
    with pytest.raises(RuntimeError, match="float32"):
        topk_rows(x.double(), 1)
    with pytest.raises(RuntimeError, match="rows, n"):
        topk_rows(x[0], 1)


@pytest.mark.parametrize(("rows", "n", "k", "exclude"), [(320, 4000, 10, 0), (5, 300, 3, -1),
                                                         (7, 4001, 1, 4000), (3, 20, 4, 19)])  # fmt: skip
def test_log_softmax_topk_equals_log_softmax_then_topk(rows, n, k, exclude):
    g = torch.Generator().manual_seed(n + k)
    logits = torch.randn(rows, n, generator=g) * 4
    logits[0, 3] = -torch.inf  # a masked entry
    values, indices = torch.ops.seq2seq_fast._log_softmax_topk(logits, k, exclude)
    logp = logits.log_softmax(-1)  # the excluded entry is in the normaliser, never chosen
    if exclude >= 0:
        logp[:, exclude] = -torch.inf
    expected, expected_indices = logp.topk(k, dim=-1)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    assert torch.equal(indices, expected_indices)
    assert not (indices == exclude).any()


def test_log_softmax_topk_one_allowed_token_and_errors():
    logits = torch.full((2, 300), -torch.inf)
    logits[:, 7] = 3.0
    values, indices = torch.ops.seq2seq_fast._log_softmax_topk(logits, 2, 0)
    assert values[:, 0].tolist() == [0.0, 0.0] and indices[:, 0].tolist() == [7, 7]
    assert values[:, 1].tolist() == [-torch.inf, -torch.inf]
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.seq2seq_fast._log_softmax_topk(logits, 300, 0)
    with pytest.raises(RuntimeError, match="exclude"):
        torch.ops.seq2seq_fast._log_softmax_topk(logits, 2, 300)
