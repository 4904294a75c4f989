"""The named stand-ins' plans on the general path's runtime (``nn/convert/_planned.py``): a
plan built from a layout's structure, run by ``TracedWeights``, gives the original's math over a
decoder's steps (masks, a cancelled shift, sigmoid normalisation, whole-sequence calls), inside
torch.compile too, and sees every change of a mask."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.nn.convert._planned import PlannedAttention
from seq2seq_fast.ops import fused_available

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

B, S, H, DV = 3, 6, 5, 4


def _original(query, keys, vector, values, masks=(), kinds=(), shift=None, sigmoid=False):
    """The plan's math in plain PyTorch: [B, Tq, S] weights, [B, Tq, DV] context."""
    scores = torch.tanh(query.unsqueeze(2) + keys.unsqueeze(1)) @ vector.reshape(-1)
    if shift is not None:
        scores = scores + shift
    for mask, kind in zip(masks, kinds, strict=True):
        leave = ~mask if kind == "keep" else mask
        scores = scores.masked_fill(leave, float("-inf"))
    if sigmoid:
        weights = torch.sigmoid(scores) / torch.sigmoid(scores).sum(-1, keepdim=True)
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights, weights @ values


def _inputs(seed: int, steps: int = 1):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()

    return randn(B, steps, H), randn(B, S, H), randn(1, H), randn(B, S, DV)


def _valid() -> torch.Tensor:
    return (torch.arange(S) < torch.tensor([6, 4, 1])[:, None]).unsqueeze(1)


def _close(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize(
    "kinds, shifted, sigmoid",
    [
        ((), False, False),
        (("keep",), False, False),
        (("fill",), True, False),
        (("keep",), True, True),
    ],
)
def test_a_plan_over_a_decoders_steps_gives_the_originals_math(steps, kinds, shifted, sigmoid):
    attention = PlannedAttention(
        "auto", shifted=shifted, masks=kinds, normalisation="sigmoid" if sigmoid else "softmax"
    )
    _, keys, vector, values = _inputs(0, steps)
    shift = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    masks = tuple(_valid() if kind == "keep" else ~_valid() for kind in kinds)
    shifts = (shift,) if shifted else ()
    fills = (float("-inf"),) * len(kinds)
    for t in range(3):  # the same memory every step
        query = _inputs(10 + t, steps)[0]
        got = attention(query, keys, vector, values, masks=masks, fills=fills, shifts=shifts)
        want = _original(
            query, keys, vector, values, masks, kinds, shift if shifted else None, sigmoid
        )
        _close(got, want)
        leaves = (query, keys, vector, values, shift)
        grads = [
            torch.autograd.grad(out[0].sum() + out[1].square().sum(), leaves, allow_unused=True)
            for out in (got, want)
        ]
        for g, w in zip(*grads, strict=True):
            if w is None:  # (a shift a softmax cancels: zero where the plan joins it in)
                assert g is None or not g.any()
            else:
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_a_row_without_a_valid_key_is_nan_as_in_the_original():
    attention = PlannedAttention("auto", masks=("keep",))
    query, keys, vector, values = _inputs(1)
    valid = _valid().clone()
    valid[1] = False
    got = attention(query, keys, vector, values, masks=(valid,), fills=(float("-inf"),))
    _close(got, _original(query, keys, vector, values, (valid,), ("keep",)))
    assert got[0][1].isnan().all() and got[0][[0, 2]].isfinite().all()


def test_inside_torch_compile_the_plan_goes_to_the_op():
    attention = PlannedAttention("auto", shifted=True, masks=("keep",))
    query, keys, vector, values = _inputs(2, 3)
    shift = torch.tensor([0.5], dtype=torch.float64)

    def run(query, keys, vector, values, valid):
        return attention(query, keys, vector, values, (valid,), (float("-inf"),), (shift,))

    got = torch.compile(run, backend="aot_eager", fullgraph=True)(
        query, keys, vector, values, _valid()
    )
    _close(got, _original(query, keys, vector, values, (_valid(),), ("keep",)))


def test_an_equal_mask_passed_again_is_compared_once_and_a_change_in_place_is_seen(monkeypatch):
    # A decoder that makes its mask once per sequence passes a new tensor equal to the last
    # sequence's at every step of the next: compared once, then known by identity and versions,
    # and compared again after a change in place (of it, or of the mask it stands for).
    from seq2seq_fast.nn.convert.traced import rewrite

    attention = PlannedAttention("auto", masks=("keep",))
    _, keys, vector, values = _inputs(3)
    compared = []
    same_content = rewrite._same_content
    monkeypatch.setattr(
        rewrite, "_same_content", lambda a, b: compared.append(1) or same_content(a, b)
    )

    def step(t, valid):
        query = _inputs(20 + t)[0]
        got = attention(query, keys, vector, values, masks=(valid,), fills=(float("-inf"),))
        _close(got, _original(query, keys, vector, values, (valid,), ("keep",)))

    first = _valid()
    step(0, first)
    step(1, first)
    again = first.clone()
    for t in range(2, 6):
        step(t, again)
    assert len(compared) == 1
    again[0, 0, 1:] = False  # the new tensor changed
    step(6, again)
    assert len(compared) == 2
    copy = again.clone()  # (again is the last mask now) equal to it, then it changes
    step(7, copy)
    step(8, copy)
    assert len(compared) == 3
    again[1, 0, 3:] = False
    step(9, copy)
    assert len(compared) == 4


def _one_query_original(query, keys, vector, values, *, bias=None, scale=1.0, location=None,
                        mask=None, kind="keep", product=None, rounded=False):  # fmt: skip
    """One query per call, [B, H] -> weights [B, S], context [B, DV], in plain PyTorch."""
    if location is not None:
        features, conv_weight, dense_weight = location
        conv = torch.nn.functional.conv1d(features, conv_weight, padding=conv_weight.shape[-1] // 2)
        keys = keys + conv.transpose(1, 2) @ dense_weight.t()
    pre = query.unsqueeze(1) + keys + (0 if bias is None else bias)
    scores = torch.tanh(pre) @ vector.reshape(-1)
    if rounded:
        scores = scores.float().type_as(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask if kind == "keep" else mask, float("-inf"))
    if product is not None:
        scores = scores * product
    weights = torch.softmax(scores * scale, dim=-1)
    if product is not None:  # AllenNLP's masked softmax
        weights = weights * product
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-13)
    return weights, (weights.unsqueeze(1) @ values).squeeze(1)


def _one_query_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()

    return randn(B, H), randn(B, S, H), randn(H), randn(B, S, DV), gen


@pytest.mark.parametrize("training", [True, False])
def test_one_query_with_a_bias_a_scale_and_a_location_term(training):
    """The speech stand-ins' plan: keys plus a location term, a bias inside the tanh, a mask and
    a temperature, over a decoder's steps, outputs and gradients."""
    attention = PlannedAttention(
        "auto", masks=("keep",), scaled=True, one_query=True, biased=True, located=True
    )
    _, keys, vector, values, gen = _one_query_inputs(3)
    bias = torch.randn(H, dtype=torch.float64, generator=gen, requires_grad=True)
    conv_weight = torch.randn(4, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    dense_weight = torch.randn(H, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    valid = _valid().squeeze(1)
    with torch.set_grad_enabled(training):
        for t in range(3):
            query = _one_query_inputs(20 + t)[0]
            features = torch.rand(B, 2, S, dtype=torch.float64, generator=gen)
            location = (features, conv_weight, dense_weight)
            got = attention(
                query, keys, vector, values, masks=(valid,), fills=(float("-inf"),),
                scales=(1.5,), biases=(bias,), location=location,
            )  # fmt: skip
            want = _one_query_original(
                query, keys, vector, values, bias=bias, scale=1.5, location=location, mask=valid
            )
            assert got[0].shape == (B, S) and got[1].shape == (B, DV)
            _close(got, want)
            if training:
                leaves = (query, keys, vector, values, bias, conv_weight, dense_weight)
                grads = [
                    torch.autograd.grad(o[0].square().sum() + o[1].sum(), leaves)
                    for o in (got, want)
                ]
                for g, w in zip(*grads, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype_of_mask", [torch.bool, torch.float64])
def test_a_product_mask_is_allennlps_masked_softmax(dtype_of_mask):
    """0/1 masks (bool or float) through the op, a row with nothing kept giving zeros as
    AllenNLP's; a float mask that is not 0/1 through the plain path, as the original."""
    attention = PlannedAttention("auto", masks=("product",), one_query=True)
    query, keys, vector, values, _ = _one_query_inputs(4)
    keep = _valid().squeeze(1).clone()
    keep[2] = False  # a row with nothing kept
    product = keep.to(dtype_of_mask)
    got = attention(query, keys, vector, None, masks=(product,))
    assert got[1] is None  # the caller forms the context
    want = _one_query_original(query, keys, vector, values, product=keep.double())[0]
    torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-12)
    assert not got[0][2].any()
    if dtype_of_mask == torch.float64:  # weights of a mask that is not 0/1: the plain path
        product = keep.double() * 0.5 + 0.25
        got = attention(query, keys, vector, None, masks=(product,))[0]
        want = _one_query_original(query, keys, vector, values, product=product)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        # a 0/1 mask that wants gradients: the plain path, the mask's gradient the original's
        product = keep.double().requires_grad_()
        got = attention(query, keys, vector, None, masks=(product,))[0]
        want = _one_query_original(query, keys, vector, values, product=product)[0]
        weights = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
        grads = [torch.autograd.grad((w * weights).sum(), product)[0] for w in (got, want)]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-11)
        assert grads[1].abs().sum() > 0


def test_a_round_step_rounds_float64_scores_as_the_original():
    """fairseq's MLPAttention fills its mask in float32: a float64 call rounds its scores there
    (the plain path), exactly; a float32 call runs the op."""
    attention = PlannedAttention("auto", rounded=True, masks=("fill",), one_query=True)
    query, keys, vector, values, _ = _one_query_inputs(5)
    padding = ~_valid().squeeze(1)
    args = dict(masks=(padding,), fills=(float("-inf"),))
    got = attention(query * 7, keys, vector * 5, values, **args)
    want = _one_query_original(
        query * 7, keys, vector * 5, values, mask=padding, kind="fill", rounded=True
    )
    _close(got, want)
    unrounded = _one_query_original(query * 7, keys, vector * 5, values, mask=padding, kind="fill")
    assert not torch.equal(want[0], unrounded[0])  # (the rounding is seen at this scale)
    got32 = attention(*(t.float() for t in (query, keys, vector, values)), **args)
    want32 = _one_query_original(
        query.float(), keys.float(), vector.float(), values.float(), mask=padding, kind="fill"
    )
    for g, w in zip(got32, want32, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)
