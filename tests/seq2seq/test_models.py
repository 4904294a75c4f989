"""Seq2Seq models: shapes, masks, one key projection per batch, search, fused == reference."""

from __future__ import annotations

import re

import pytest
import torch

from seq2seq_fast.ops import fused_available
from seq2seq_fast.seq2seq.decoding import (
    DecodeOptions,
    beam_search,
    coverage_penalty,
    greedy_search,
    length_penalty,
    search,
)
from seq2seq_fast.seq2seq.models import (
    EOS_ID,
    PAD_ID,
    Encoder,
    Seq2Seq,
    Seq2SeqConfig,
    compile_model,
    sequence_loss,
)

CONFIGS = [
    pytest.param(
        dict(decoder=d, cell=c, bidirectional=b, encoder_layers=el, decoder_layers=dl),
        id=f"{d}-{c}-{'bi' if b else 'uni'}-{el}x{dl}",
    )
    for d, c, b, el, dl in [
        ("gnmt", "gru", True, 1, 1),
        ("gnmt", "lstm", False, 2, 3),
        ("bahdanau", "gru", True, 2, 2),
        ("bahdanau", "lstm", True, 1, 1),
    ]
]


def _model(backend: str = "reference", seed: int = 0, **overrides) -> Seq2Seq:
    torch.manual_seed(seed)
    config = dict(
        src_vocab_size=13,
        tgt_vocab_size=11,
        embed_size=8,
        hidden_size=16,
        attention_size=12,
        backend=backend,
    )
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
    greedy_search(model, src, lengths)
    assert len(calls) == 1
    calls.clear()
    beam_search(model, src, lengths, DecodeOptions(beam=3))
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
    greedy = greedy_search(model, src, lengths, DecodeOptions(max_len_factor=1.5))
    beam = beam_search(model, src, lengths, DecodeOptions(beam=1, max_len_factor=1.5))
    assert [[h.tokens] for h in greedy] == [[h[0].tokens] for h in beam]
    for g, (b,) in zip(greedy, beam, strict=True):
        assert g.tokens == b.tokens
        torch.testing.assert_close(g.attention, b.attention)
        assert g.score == pytest.approx(b.score * length_penalty(b.attention.shape[0], 0.6))


def test_beam_search_outputs():
    model = _model(decoder="gnmt")
    src, lengths, _, _ = _batch()
    for (hyp,), n in zip(
        beam_search(model, src, lengths, DecodeOptions(beam=4, beta=0.2)),
        lengths.tolist(),
        strict=True,
    ):
        assert EOS_ID not in hyp.tokens and PAD_ID not in hyp.tokens
        assert len(hyp.tokens) <= 2 * n + 1
        assert hyp.attention.shape[1] == n
        torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(hyp.attention.shape[0]))


def test_beam_search_finds_a_better_sequence_than_greedy():
    """With the length penalty off, beam search's best log-probability is never below greedy's."""
    model = _model(decoder="bahdanau", seed=3)
    src, lengths, _, _ = _batch(seed=5)
    greedy = greedy_search(model, src, lengths)
    beam = beam_search(model, src, lengths, DecodeOptions(beam=5, alpha=0.0))
    for g, (b,) in zip(greedy, beam, strict=True):
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
        torch.testing.assert_close(
            grads_fused[name],
            grads_ref[name],
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="decoder"):
        Seq2SeqConfig(5, 5, decoder="transformer")
    with pytest.raises(ValueError, match="cell"):
        Seq2SeqConfig(5, 5, cell="rnn")
    with pytest.raises(ValueError, match="unknown model config"):
        Seq2SeqConfig.from_dict({"src_vocab_size": 5, "tgt_vocab_size": 5, "colour": "red"})


ENCODERS = [
    pytest.param(
        cell, bidirectional, layers, id=f"{cell}-{'bi' if bidirectional else 'uni'}-{layers}"
    )
    for cell in ("gru", "lstm")
    for bidirectional in (True, False)
    for layers in (1, 2)
]


@pytest.mark.parametrize(("cell", "bidirectional", "layers"), ENCODERS)
def test_unpacked_encoder_equals_packed(cell, bidirectional, layers):
    """The padded-batch RNN path (reversed rows for the backward direction) gives the packed path's
    outputs at valid positions, zeros in the padding, the same final states and gradients."""
    torch.manual_seed(0)
    encoder = Encoder(
        Seq2SeqConfig(
            13,
            11,
            embed_size=8,
            hidden_size=16,
            cell=cell,
            bidirectional=bidirectional,
            encoder_layers=layers,
        )
    ).double()
    lengths = torch.tensor([7, 3, 5, 1, 6, 7])
    x = torch.randn(6, 9, 8, dtype=torch.float64)  # two columns of padding past the longest row
    valid = (torch.arange(9)[None, :] < lengths[:, None]).unsqueeze(-1)
    results = []
    for packed in (True, False):
        leaf = x.clone().requires_grad_(True)
        outputs, final = encoder.run_rnn(leaf, lengths, packed=packed)
        weights = torch.linspace(-1, 1, outputs.numel(), dtype=torch.float64).view_as(outputs)
        ((outputs * weights).sum() + final.pow(2).sum()).backward()
        grads = [leaf.grad] + [p.grad for p in encoder.rnn.parameters()]
        results.append((outputs, final, grads))
        encoder.zero_grad()
    (out_packed, final_packed, grads_packed), (out, final, grads) = results
    assert torch.all(out.masked_select(~valid) == 0)
    torch.testing.assert_close(out, out_packed, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_packed, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_packed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bahdanau_decoder_equals_the_cells_it_holds():
    """The rearranged recurrence (hoisted embedding projection, W_hh stacked on W_q) computes what
    the nn.GRUCell/nn.LSTMCell modules and the attention module compute step by step."""
    src, lengths, tgt_in, _ = _batch()
    for cell in ("gru", "lstm"):
        model = _model(decoder="bahdanau", cell=cell, decoder_layers=2).double()
        decoder = model.decoder
        memory, state = model.encode(src, lengths)
        logits, weights, final = decoder(tgt_in, state, memory)
        embedded = decoder.embedding(tgt_in)
        features, expected_weights = [], []
        for t in range(tgt_in.shape[1]):
            query = state[-1] if cell == "gru" else state[-1][0]
            context, w = decoder.attention(
                query, memory.values, lengths=memory.lengths, projected_keys=memory.keys
            )
            x, new_state = torch.cat([embedded[:, t], context], dim=-1), []
            for module, layer_state in zip(decoder.cells, state, strict=True):
                layer_state = module(x, layer_state)
                new_state.append(layer_state)
                x = layer_state if cell == "gru" else layer_state[0]
            state = tuple(new_state)
            features.append(torch.cat([x, context], dim=-1))
            expected_weights.append(w)
        expected = decoder.output(torch.stack(features, 1))
        torch.testing.assert_close(logits, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weights, torch.stack(expected_weights, 1))


def _loss_fn(model):
    def loss(src, lengths, tgt_in, tgt_out):
        return sequence_loss(model(src, lengths, tgt_in)[0], tgt_out)

    return loss


@pytest.mark.parametrize("overrides", CONFIGS)
def test_whole_training_loss_traces_without_graph_break(overrides):
    """torch.compile sees the whole forward and loss -- embedding, encoder RNN (variable lengths),
    bridge, decoder with the fused op, output layer -- as one graph."""
    if not fused_available("cpu", torch.float32):
        pytest.skip("the C++ kernel (seq2seq_fast._C) is not built")
    model = _model(backend="fused", **overrides)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(allow_rnn=True):
            explained = torch._dynamo.explain(_loss_fn(model))(*_batch())
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize(("decoder", "cell"), [("gnmt", "gru"), ("bahdanau", "lstm")])
def test_compiled_loss_and_gradients_equal_eager(decoder, cell):
    """compile_model traces with fullgraph=True (a graph break would raise) and gives the eager
    loss and gradients. aot_eager runs the traced forward/backward graphs without inductor's code
    generation (minutes of C++ compiling; the benchmark's compile provider runs inductor)."""
    if not fused_available("cpu", torch.float32):
        pytest.skip("the C++ kernel (seq2seq_fast._C) is not built")
    batch = _batch()
    model = _model(backend="fused", decoder=decoder, cell=cell)
    eager = _loss_fn(model)(*batch)
    eager.backward()
    eager_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    try:
        compiled = compile_model(_loss_fn(model), backend="aot_eager", fullgraph=True)(*batch)
        compiled.backward()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_no_graph_break_in_attention_and_decoder_step():
    """The fused op and a decoding step (what greedy/beam search call) are one graph each."""
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


@pytest.mark.parametrize(("beam", "n_best"), [(1, 1), (3, 1), (3, 2)])
def test_search_is_greedy_at_beam_one_and_the_beam_search_above(beam, n_best):
    model = _model(decoder="gnmt")
    src, lengths, _, _ = _batch()
    options = DecodeOptions(beam=beam, n_best=n_best, beta=0.1)
    found = search(model, src, lengths, options)
    if beam == 1:
        expected = [[h] for h in greedy_search(model, src, lengths, options)]
    else:
        expected = beam_search(model, src, lengths, options)
    assert [len(h) for h in found] == [n_best] * src.shape[0]
    assert [[(h.tokens, h.score) for h in row] for row in found] == [
        [(h.tokens, h.score) for h in row] for row in expected
    ]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(beam=0), "beam must be an int >= 1, got 0"),
        (dict(beam=2, n_best=3), "n_best 3 needs beam >= 3, got 2"),
        (dict(max_len_factor=0.0), "max_len_factor must be finite and > 0, got 0.0"),
        (dict(max_len=0), "max_len must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_decode_options_are_named(options, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        DecodeOptions(**options)
