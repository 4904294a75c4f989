"""Ensembles: several checkpoints decoding as one, log-probabilities averaged at each step."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.seq2seq.data.tasks import reverse_symbols
from seq2seq_fast.seq2seq.data.vocab import SymbolVocab
from seq2seq_fast.seq2seq.decoding import DecodeOptions, beam_search, greedy_search
from seq2seq_fast.seq2seq.inference import DecodingModel, Ensemble
from seq2seq_fast.seq2seq.translate import Translator
from tests.seq2seq.test_translate import _checkpoint_of, _model, _run, _sources


def _members():
    """Three models of one vocabulary, of different shapes and decoders."""
    a, vocab = _model("auto", seed=0, eos_bias=0.3, output_layer="attentional")
    b, _ = _model("auto", seed=1, eos_bias=0.3, attention_size=12, cell="lstm")
    c, _ = _model("auto", seed=2, eos_bias=0.3, decoder="bahdanau")
    return [a, b, c], vocab


def test_ensemble_step_is_the_mean_of_its_members():
    models, _ = _members()
    members = [DecodingModel(m) for m in models]
    ensemble = Ensemble(members)
    src, lengths = torch.tensor([[4, 5, 6, 7], [8, 9, 0, 0]]), torch.tensor([4, 2])
    y = torch.tensor([5, 6])
    with torch.no_grad():
        memory, state = ensemble.encode(src, lengths)
        logp, weights, new_state = ensemble.step_log_probs(y, state, memory)
        expected_logp, expected_weights = [], []
        for member in members:
            m_memory, m_state = member.encode(src, lengths)
            m_logp, m_weights, _ = member.step_log_probs(y, m_state, m_memory)
            expected_logp.append(m_logp)
            expected_weights.append(m_weights)
    torch.testing.assert_close(logp, torch.stack(expected_logp).mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(weights, torch.stack(expected_weights).mean(0), atol=1e-6, rtol=0)
    assert len(new_state) == 3
    assert not ensemble.groups_rows  # the Bahdanau member takes a memory row per decoder row
    assert Ensemble(members[:2]).groups_rows


def test_an_ensemble_of_one_is_the_model():
    model, _ = _model("auto", eos_bias=0.3)
    single, ensemble = DecodingModel(model), Ensemble([DecodingModel(model)])
    for ids in _sources(6):
        src, lengths = torch.tensor([ids]), torch.tensor([len(ids)])
        (a,), (b,) = greedy_search(single, src, lengths), greedy_search(ensemble, src, lengths)
        assert a.tokens == b.tokens and abs(a.score - b.score) <= 1e-6
        (x,) = beam_search(single, src, lengths, DecodeOptions(beam=3, n_best=2))
        (y,) = beam_search(ensemble, src, lengths, DecodeOptions(beam=3, n_best=2))
        assert [h.tokens for h in x] == [h.tokens for h in y]


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("count", [2, 3])
def test_ensemble_batched_equals_one_sentence_at_a_time(beam, count):
    models, vocab = _members()
    ensemble = Ensemble([DecodingModel(m) for m in models[:count]])
    texts = ["a b c", "d e f g h", "b", "c d e f", "j i h g f e"]
    options = DecodeOptions(beam=beam)
    batched = Translator(ensemble, vocab, vocab, options=options).translate(texts)
    alone = Translator(ensemble, vocab, vocab, options=options, batch_size=1).translate(texts)
    for x, y in zip(batched, alone, strict=True):
        assert x.texts == y.texts
        assert abs(x.hypotheses[0].score - y.hypotheses[0].score) <= 1e-5


def test_translate_with_several_checkpoints(tmp_path, capsys):
    models, vocab = _members()
    paths = [_checkpoint_of(m, vocab, tmp_path / f"m{i}.pt") for i, m in enumerate(models)]
    source = tmp_path / "in.txt"
    source.write_text("a b c\n\nd e f g\n")
    argv = ["translate", "-i", source, "--beam", 3, "--no-progress"]
    for path in paths:
        argv += ["--checkpoint", path]
    for precision in ("fp32", "int8"):
        code, out, err = _run(capsys, *argv, "--precision", precision)
        assert code == 0, err
        assert out.split("\n")[1] == "" and len(out.split("\n")) == 4
    loaded = Translator.load(paths, beam=3)
    assert isinstance(loaded.model, Ensemble) and len(loaded.model.members) == 3
    expected = [r.text for r in loaded.translate(["a b c", "", "d e f g"])]
    code, out, _ = _run(capsys, *argv)
    assert out.split("\n")[:3] == expected


def test_ensemble_vocabulary_mismatch_is_a_clear_error(tmp_path, capsys):
    models, vocab = _members()
    first = _checkpoint_of(models[0], vocab, tmp_path / "a.pt")
    other_vocab = SymbolVocab(reverse_symbols(10)[::-1])
    other = _checkpoint_of(models[1], other_vocab, tmp_path / "b.pt")
    code, _, err = _run(capsys, "translate", "--checkpoint", first, "--checkpoint", other, "a b")
    assert code == 2 and "Traceback" not in err
    assert "b.pt" in err and "a.pt" in err and "source vocabulary" in err
    with pytest.raises(ValueError, match="share both vocabularies"):
        Translator.load([first, other])
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])


def test_dump_config_of_an_ensemble_reads_back(tmp_path, capsys):
    """--dump-config writes one checkpoint as a path and several as a list; both read back."""
    import yaml

    models, vocab = _members()
    paths = [str(_checkpoint_of(m, vocab, tmp_path / f"m{i}.pt")) for i, m in enumerate(models)]
    argv = ["translate", "--checkpoint", paths[0], "--checkpoint", paths[1], "--dump-config"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and yaml.safe_load(out)["checkpoint"] == paths[:2]
    config = tmp_path / "ensemble.yaml"
    config.write_text(out)
    code, out, err = _run(capsys, "translate", "--config", config, "a b c")
    assert code == 0 and len(out.splitlines()) == 1, err
    code, out, _ = _run(capsys, "translate", "--checkpoint", paths[2], "--dump-config")
    assert yaml.safe_load(out)["checkpoint"] == paths[2]
