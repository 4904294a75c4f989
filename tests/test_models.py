"""Seq2Seq models: shapes, masks, one key projection per batch, search, fused == reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from seq2seq_fast.models import (
    EOS_ID,
    PAD_ID,
    Encoder,
    Seq2Seq,
    Seq2SeqConfig,
    beam_search,
    coverage_penalty,
    greedy_decode,
    length_penalty,
    sequence_loss,
)
from seq2seq_fast.ops import fused_available

CONFIGS = [
    pytest.param(
        dict(decoder=d, cell=c, bidirectional=b, encoder_layers=el, decoder_layers=dl),
        id=f"{d}-{c}-{'bi' if b else 'uni'}-{el}x{dl}",
    )  # fmt: skip
    for d, c, b, el, dl in [
        ("gnmt", "gru", True, 1, 1),
        ("gnmt", "lstm", False, 2, 3),
        ("bahdanau", "gru", True, 2, 2),
        ("bahdanau", "lstm", True, 1, 1),
    ]
]


def _model(backend: str = "reference", seed: int = 0, **overrides) -> Seq2Seq:
    torch.manual_seed(seed)
    config = dict(src_vocab_size=13, tgt_vocab_size=11, embed_size=8, hidden_size=16,
                  attention_size=12, backend=backend)  # fmt: skip
    config.update(overrides)
    return Seq2Seq(Seq2SeqConfig(**config))


def _batch(seed: int = 1, lengths=(7, 3, 5, 1, 6)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    src = torch.randint(4, 13, (len(lengths), int(lengths.max())), generator=g)
    src[torch.arange(src.shape[1])[None, :] >= lengths[:, None]] = PAD_ID
    tgt_in = torch.randint(4, 11, (len(lengths), 6), generator=g)
    tgt_out = torch.randint(4, 11, (len(lengths), 6), generator=g)
    tgt_out[1, 4:] = PAD_ID
    return src, lengths, tgt_in, tgt_out


@pytest.mark.parametrize("overrides", CONFIGS)
def test_forward_shapes_and_padding_mask(overrides):
    model = _model(**overrides)
    src, lengths, tgt_in, _ = _batch()
    logits, weights = model(src, lengths, tgt_in)
    assert logits.shape == (5, 6, 11)
    assert weights.shape == (5, 6, 7)
    for b, n in enumerate(lengths.tolist()):
        assert torch.all(weights[b, :, n:] == 0)
        torch.testing.assert_close(weights[b].sum(-1), torch.ones(6))


@pytest.mark.parametrize("overrides", CONFIGS)
def test_padding_does_not_change_results(overrides):
    """A row's logits do not depend on how much padding its batch adds."""
    model = _model(**overrides).eval()
    src, lengths, tgt_in, _ = _batch()
    logits, _ = model(src, lengths, tgt_in)
    wide = torch.cat([src, torch.zeros(5, 4, dtype=torch.long)], dim=1)
    logits_wide, weights_wide = model(wide, lengths, tgt_in)
    torch.testing.assert_close(logits_wide, logits, rtol=1e-5, atol=1e-5)
    assert torch.all(weights_wide[:, :, 7:] == 0)


@pytest.mark.parametrize("decoder", ["gnmt", "bahdanau"])
def test_keys_projected_once_per_batch(decoder):
    model = _model(decoder=decoder)
    calls = []
    model.attention.key_proj.register_forward_hook(lambda *_: calls.append(1))
    src, lengths, tgt_in, _ = _batch()
    model(src, lengths, tgt_in)
    assert len(calls) == 1
    calls.clear()
    greedy_decode(model, src, lengths)
    assert len(calls) == 1
    calls.clear()
    beam_search(model, src, lengths, beam_size=3)
    assert len(calls) == 1


def test_gnmt_attends_all_target_steps_in_one_call():
    model = _model(decoder="gnmt", decoder_layers=2)
    queries = []
    model.attention.register_forward_hook(lambda _m, args, _out: queries.append(args[0].shape))
    src, lengths, tgt_in, _ = _batch()
    model(src, lengths, tgt_in)
    assert queries == [torch.Size([5, 6, 16])]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_beam_one_equals_greedy(overrides):
    model = _model(**overrides)
    src, lengths, _, _ = _batch()
    greedy = greedy_decode(model, src, lengths, max_len_factor=1.5)
    beam = beam_search(model, src, lengths, beam_size=1, max_len_factor=1.5)
    for g, b in zip(greedy, beam, strict=True):
        assert g.tokens == b.tokens
        torch.testing.assert_close(g.attention, b.attention)
        assert g.score == pytest.approx(b.score * length_penalty(b.attention.shape[0], 0.6))


def test_beam_search_outputs():
    model = _model(decoder="gnmt")
    src, lengths, _, _ = _batch()
    for hyp, n in zip(beam_search(model, src, lengths, beam_size=4, beta=0.2), lengths.tolist(),
                      strict=True):  # fmt: skip
        assert EOS_ID not in hyp.tokens and PAD_ID not in hyp.tokens
        assert len(hyp.tokens) <= 2 * n + 1
        assert hyp.attention.shape[1] == n
        torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(hyp.attention.shape[0]))


def test_beam_search_finds_a_better_sequence_than_greedy():
    """With the length penalty off, beam search's best log-probability is never below greedy's."""
    model = _model(decoder="bahdanau", seed=3)
    src, lengths, _, _ = _batch(seed=5)
    greedy = greedy_decode(model, src, lengths)
    beam = beam_search(model, src, lengths, beam_size=5, alpha=0.0)
    for g, b in zip(greedy, beam, strict=True):
        if g.attention.shape[0] > len(g.tokens):  # greedy finished with </s>
            assert b.score >= g.score - 1e-9


def test_length_and_coverage_penalties():
    assert length_penalty(1, 0.0) == 1.0
    assert length_penalty(7, 1.0) == pytest.approx(2.0)
    full = torch.tensor([1.0, 2.0, 1.5])
    assert float(coverage_penalty(full, 0.5)) == 0.0
    partial = torch.tensor([0.5, 1.0])
    assert float(coverage_penalty(partial, 2.0)) == pytest.approx(
        2.0 * torch.log(torch.tensor(0.5))
    )


@pytest.mark.parametrize("decoder", ["gnmt", "bahdanau"])
def test_fused_and_reference_give_same_loss_and_gradients(decoder):
    if not fused_available("cpu", torch.float32):
        pytest.skip("the C++ kernel (seq2seq_fast._C) is not built")
    src, lengths, tgt_in, tgt_out = _batch()
    results = []
    for backend in ("reference", "fused"):
        model = _model(backend=backend, decoder=decoder, seed=7)
        loss = sequence_loss(model(src, lengths, tgt_in)[0], tgt_out)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss_fused, grads_fused) = results
    torch.testing.assert_close(loss_fused, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads_ref.keys() == grads_fused.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads_fused[name], grads_ref[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="decoder"):
        Seq2SeqConfig(5, 5, decoder="transformer")
    with pytest.raises(ValueError, match="cell"):
        Seq2SeqConfig(5, 5, cell="rnn")
    with pytest.raises(ValueError, match="unknown model config"):
        Seq2SeqConfig.from_dict({"src_vocab_size": 5, "tgt_vocab_size": 5, "colour": "red"})


def test_no_graph_break_in_attention_and_decoder_step():
    """torch.compile sees the fused op and the decoder step as one graph; in the whole model the
    only breaks are the encoder's packing and the ATen RNN layers (GRU/LSTM modules)."""
    if not fused_available("cpu", torch.float32):
        pytest.skip("the C++ kernel (seq2seq_fast._C) is not built")
    src, lengths, tgt_in, _ = _batch()
    bahdanau = _model(backend="fused", decoder="bahdanau")
    memory, state = bahdanau.encode(src, lengths)
    explained = torch._dynamo.explain(bahdanau.decoder.step)(tgt_in[:, 0], state, memory)
    assert explained.graph_break_count == 0, explained.break_reasons
    gnmt = _model(backend="fused", decoder="gnmt")
    memory, _ = gnmt.encode(src, lengths)
    query = torch.randn(5, 6, 16)
    explained = torch._dynamo.explain(gnmt.attention)(
        query, memory.values, lengths=memory.lengths, projected_keys=memory.keys
    )
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    explained = torch._dynamo.explain(bahdanau)(src, lengths, tgt_in)
    lines, first = inspect.getsourcelines(Encoder.forward)
    encoder_lines = range(first, first + len(lines))
    assert explained.break_reasons
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1]
        assert frame.filename.endswith("models.py") and frame.lineno in encoder_lines, reason
    torch._dynamo.reset()
