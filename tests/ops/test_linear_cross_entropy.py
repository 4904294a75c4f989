"""The chunked linear + cross-entropy op against F.linear + F.cross_entropy (float64, gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seq2seq_fast.ops.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

PAD = 0


def _inputs(shape, features, vocab, *, dtype=torch.float64, seed=0, pad_fraction=0.3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, features, generator=gen, dtype=dtype).requires_grad_(True)
    weight = torch.randn(vocab, features, generator=gen, dtype=dtype) / features**0.5
    bias = torch.randn(vocab, generator=gen, dtype=dtype)
    target = torch.randint(1, vocab, shape, generator=gen)
    target[torch.rand(shape, generator=gen) < pad_fraction] = PAD
    return x, weight.requires_grad_(True), bias.requires_grad_(True), target


def _reference(x, weight, bias, target, eps, ignore_index=PAD):
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=eps,
    )


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("chunk_rows", [1, 5, None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_cross_entropy_float64(eps, chunk_rows, with_bias):
    x, weight, bias, target = _inputs((4, 9), 12, 37, seed=int(eps * 10) + (chunk_rows or 0))
    bias = bias if with_bias else None
    inputs = (x, weight) + ((bias,) if with_bias else ())
    expected = _reference(x, weight, bias, target, eps)
    expected_grads = torch.autograd.grad(expected * 1.3, inputs)
    got = linear_cross_entropy(
        x, weight, bias, target, label_smoothing=eps, ignore_index=PAD, chunk_rows=chunk_rows
    )
    got_grads = torch.autograd.grad(got * 1.3, inputs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-13)


def test_padding_rows_get_zero_gradient_and_no_cost():
    x, weight, bias, target = _inputs((3, 7), 8, 20, pad_fraction=0.5)
    loss = linear_cross_entropy(x, weight, bias, target, label_smoothing=0.1, ignore_index=PAD)
    (grad_x,) = torch.autograd.grad(loss, x)
    assert (target == PAD).any()
    assert torch.all(grad_x[target == PAD] == 0)
    assert torch.all(grad_x[target != PAD].abs().sum(-1) > 0)


def test_default_ignore_index_and_gradcheck():
    x, weight, bias, target = _inputs((5,), 4, 6, pad_fraction=0.0)
    target[1] = -100
    torch.testing.assert_close(
        linear_cross_entropy(x, weight, bias, target, label_smoothing=0.2),
        F.cross_entropy(F.linear(x, weight, bias), target, label_smoothing=0.2),
    )
    assert torch.autograd.gradcheck(
        lambda a, w, b: linear_cross_entropy(a, w, b, target, label_smoothing=0.2, chunk_rows=2),
        (x, weight, bias),
    )


def test_no_valid_target_gives_zero_loss_and_gradients():
    x, weight, bias, target = _inputs((2, 3), 4, 5)
    target.fill_(PAD)
    loss = linear_cross_entropy(x, weight, bias, target, ignore_index=PAD)
    grads = torch.autograd.grad(loss, (x, weight, bias))
    assert float(loss.detach()) == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_without_grad_only_the_loss():
    x, weight, bias, target = _inputs((4, 6), 8, 30)
    expected = _reference(x, weight, bias, target, 0.1)
    with torch.no_grad():
        got = linear_cross_entropy(x, weight, bias, target, label_smoothing=0.1, ignore_index=PAD)
    assert not got.requires_grad
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)


def test_only_some_inputs_need_gradients():
    x, weight, bias, target = _inputs((4, 6), 8, 30)
    weight.requires_grad_(False)
    expected = torch.autograd.grad(_reference(x, weight, bias, target, 0.1), (x, bias))
    loss = linear_cross_entropy(x, weight, bias, target, label_smoothing=0.1, ignore_index=PAD)
    got = torch.autograd.grad(loss, (x, bias))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-13)


def test_bf16_autocast_close_to_float32_with_float32_gradients():
    x, weight, bias, target = _inputs((8, 12), 32, 300, dtype=torch.float32, seed=3)
    expected = _reference(x, weight, bias, target, 0.1)
    expected_grads = torch.autograd.grad(expected, (x, weight, bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(
            x, weight, bias, target, label_smoothing=0.1, ignore_index=PAD, chunk_rows=16
        )
    assert got.dtype == torch.float32
    got_grads = torch.autograd.grad(got, (x, weight, bias))
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.dtype == torch.float32
        # bf16 products: relative error of the whole gradient, not per element
        assert float((g - e).norm() / e.norm()) < 3e-2


def test_float32_matches_unfused_float32():
    x, weight, bias, target = _inputs((16, 20), 64, 500, dtype=torch.float32, seed=5)
    expected = _reference(x, weight, bias, target, 0.1)
    expected_grads = torch.autograd.grad(expected, (x, weight, bias))
    got = linear_cross_entropy(
        x, weight, bias, target, label_smoothing=0.1, ignore_index=PAD, chunk_rows=37
    )
    got_grads = torch.autograd.grad(got, (x, weight, bias))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_default_chunk_rows():
    assert default_chunk_rows(8000) * 8000 <= 1 << 23
    assert default_chunk_rows(10**9) == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, w, b, t: (x, w, b, t.clone().fill_(99)), "target holds 99"),
        (lambda x, w, b, t: (x, w, b, t.clone().fill_(-3)), "target holds -3"),
        (lambda x, w, b, t: (x, w[:, :-1], b, t), "weight must be"),
        (lambda x, w, b, t: (x, w, b[:-1], t), "bias must be"),
        (lambda x, w, b, t: (x, w, b, t[:, :-1]), "target must be int64"),
        (lambda x, w, b, t: (x, w, b, t.int()), "target must be int64"),
        (lambda x, w, b, t: (x, w.float(), b, t), "same dtype"),
        (lambda x, w, b, t: (x.long(), w, b, t), "floating point"),
    ],
)
def test_bad_input_raises_naming_it(change, message):
    args = change(*_inputs((2, 3), 4, 5))
    with pytest.raises((ValueError, TypeError), match=message):
        linear_cross_entropy(*args, ignore_index=PAD)


@pytest.mark.parametrize("eps", [-0.1, 1.0, float("nan")])
def test_bad_label_smoothing(eps):
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(*_inputs((2, 3), 4, 5), label_smoothing=eps)


def test_bad_chunk_rows():
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(*_inputs((2, 3), 4, 5), chunk_rows=0)


@pytest.mark.parametrize("decoder", ["bahdanau", "gnmt"])
@pytest.mark.parametrize("output_layer", ["concat", "attentional"])
def test_model_loss_through_forward_matches_logits_and_sequence_loss(decoder, output_layer):
    from seq2seq_fast.seq2seq.models import Seq2Seq, Seq2SeqConfig, sequence_loss

    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=13,
        tgt_vocab_size=17,
        embed_size=8,
        hidden_size=12,
        decoder=decoder,
        output_layer=output_layer,
        backend="reference",
    )
    model = Seq2Seq(config).double()
    src = torch.randint(4, 13, (3, 5))
    lengths = torch.tensor([5, 3, 4])
    tgt_in = torch.randint(4, 17, (3, 6))
    tgt_out = torch.randint(4, 17, (3, 6))
    tgt_out[1, 4:] = PAD
    params = [p for p in model.parameters()]
    expected = sequence_loss(model(src, lengths, tgt_in)[0], tgt_out, 0.1)
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    loss, weights = model(src, lengths, tgt_in, tgt_out, label_smoothing=0.1)
    got_grads = torch.autograd.grad(loss, params, allow_unused=True)
    assert weights.shape == (3, 6, 5)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, expected_grads, strict=True):
        if e is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    if output_layer == "attentional":  # the vocabulary projection reads the hidden width
        assert model.decoder.output.in_features == 12
        assert model.decoder.attentional.weight.shape[0] == 12
