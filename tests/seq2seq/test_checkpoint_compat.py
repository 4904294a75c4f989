"""Checkpoints written before the package was split into layers (version 0.1.0, flat layout) still
load, keep every state_dict key, and decode to the same tokens (greedy and beam) as they did then.

The fixtures are two tiny untrained models (reversal, and a GNMT translate model with its
sentencepiece vocabularies) written by the 0.1.0 code; checkpoints-0.1.0.json holds what that code
decoded from them, with the reference attention, for a few inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seq2seq_fast.seq2seq.checkpoint import load_model
from seq2seq_fast.seq2seq.decoding import DecodeOptions
from seq2seq_fast.seq2seq.translate import Translator

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = json.loads((FIXTURES / "checkpoints-0.1.0.json").read_text())
FILES = {"rev": "reverse-0.1.0.pt", "tr": "translate-0.1.0.pt"}


@pytest.mark.parametrize("name", sorted(FILES))
def test_old_checkpoint_loads_and_decodes_the_same(name):
    expected = EXPECTED[name]
    model, src_vocab, tgt_vocab, payload = load_model(FIXTURES / FILES[name], backend="reference")
    assert sorted(payload["model"].keys()) == expected["state_dict_keys"]
    assert sorted(model.state_dict().keys()) == expected["state_dict_keys"]
    assert set(expected["payload_keys"]) <= set(payload.keys())
    for key, want in expected["outputs"].items():
        text, beam = key.rsplit("|", 1)
        translator = Translator(model, src_vocab, tgt_vocab, options=DecodeOptions(beam=int(beam)))
        hyp = translator.translate([text])[0].hypotheses[0]
        assert list(map(int, hyp.tokens)) == want["tokens"], key
        assert tgt_vocab.decode(hyp.tokens) == want["text"], key
