"""The converter's framework: registry, report, the safety check refusing look-alikes, the walk."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seq2seq_fast import fuse_attention
from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert import FusedStandIn, Layout, register, registered_layouts
from seq2seq_fast.nn.convert._base import check_equivalent
from seq2seq_fast.nn.convert.tutorial import LAYOUT as TUTORIAL
from seq2seq_fast.nn.convert.tutorial import FusedTutorialAttention
from tests.layouts import GNMTAttention, TutorialAttention

# --- look-alikes: the same children and shapes, other math ---------------------------------------


class NoTanh(TutorialAttention):
    def forward(self, query, keys):
        scores = self.Va(self.Wa(query) + self.Ua(keys)).squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, keys), weights


class Temperature(nn.Module):
    """Not a subclass: the same children, scores divided by a temperature."""

    def __init__(self, hidden: int, temperature: float = 1.5) -> None:
        super().__init__()
        self.Wa, self.Ua, self.Va = (
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, 1),
        )
        self.temperature = temperature

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        weights = F.softmax(scores / self.temperature, dim=-1)
        return torch.bmm(weights, keys), weights


class ContextOfProjectedKeys(TutorialAttention):
    """A subclass overriding forward: the context is taken over Ua(keys), not keys."""

    def forward(self, query, keys):
        projected = self.Ua(keys)
        scores = self.Va(torch.tanh(self.Wa(query) + projected)).squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, projected), weights


class ScaledGNMT(GNMTAttention):
    def calc_score(self, att_query, att_keys):
        return 2.0 * super().calc_score(att_query, att_keys)


LOOK_ALIKES = {
    "no tanh": lambda: NoTanh(6),
    "temperature": lambda: Temperature(6),
    "subclass forward": lambda: ContextOfProjectedKeys(6),
}


@pytest.mark.parametrize("name", list(LOOK_ALIKES))
def test_look_alikes_are_refused_and_untouched(name):
    torch.manual_seed(0)
    model = nn.Sequential(LOOK_ALIKES[name]())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fuse_attention_report(model)
    assert report.count == 0 and type(model[0]) is type(LOOK_ALIKES[name]())
    assert len(report.skipped) == 1
    skipped = report.skipped[0]
    assert skipped.path == "0" and "differs" in skipped.reason
    assert type(model[0]).__qualname__ in skipped.original
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]) and value.dtype == before[key].dtype
    assert all(p.grad is None for p in model.parameters())


def test_a_thin_matcher_converts_a_scaled_subclass_exactly():
    """GNMT is a thin matcher: the traced runtime computes what the module computes, so a subclass
    scaling the scores (a look-alike to a stand-in) converts, exactly."""
    torch.manual_seed(0)
    original = nn.Sequential(ScaledGNMT(5, 6, 7, batch_first=True)).double()
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    assert [(r.path, r.layout) for r in report.replaced] == [("0", "gnmt")], str(report)
    assert "scale" in report.replaced[0].traced
    query, keys = torch.randn(3, 2, 5).double(), torch.randn(3, 4, 6).double()
    for module in (original[0], model[0]):
        module.set_mask(torch.tensor([4, 2, 1]), keys)
    for got, want in zip(model[0](query, keys), original[0](query, keys), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_check_false_trusts_the_structure():
    model = nn.Sequential(Temperature(4))
    assert fuse_attention(model, check=False) == 1
    assert isinstance(model[0], FusedTutorialAttention)


def test_check_leaves_the_module_and_the_rng_alone():
    torch.manual_seed(1)
    model = nn.Sequential(TutorialAttention(5).float())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert fuse_attention(model) == 1
    assert torch.equal(torch.rand(3), expected)  # the check ran under fork_rng
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, params[key])
    assert all(p.grad is None for p in model.parameters())


def test_check_names_the_difference():
    reason = check_equivalent(Temperature(4), TUTORIAL, "auto")
    assert reason is not None and "output" in reason and "differ" in reason
    assert check_equivalent(TutorialAttention(4), TUTORIAL, "auto") is None


def test_modules_with_hooks_are_skipped():
    attention = TutorialAttention(4)
    attention.register_forward_hook(lambda module, args, out: None)
    model = nn.Sequential(attention)
    report = fuse_attention_report(model)
    assert report.count == 0 and "hooks" in report.skipped[0].reason


# --- the walk and the report -----------------------------------------------------------------------


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = TutorialAttention(4)
        self.encoder = nn.Sequential(nn.Linear(4, 4), shared)
        self.decoder = nn.ModuleDict({"attn": shared, "gnmt": GNMTAttention(4, 4, 8)})
        self.other = Temperature(4)


def test_report_lists_replaced_and_skipped(caplog):
    model = Parent()
    gnmt = model.decoder["gnmt"]
    keys_before = list(model.state_dict())
    with caplog.at_level(logging.DEBUG, logger="seq2seq_fast.nn.convert"):
        report = fuse_attention_report(model)
    assert [(r.path, r.layout) for r in report.replaced] == [
        ("encoder.1", "tutorial"),
        ("decoder.gnmt", "gnmt"),
    ]
    assert [(s.path, s.layouts) for s in report.skipped] == [("other", ("tutorial",))]
    # one stand-in for the module reached by two paths
    assert model.encoder[1] is model.decoder["attn"]
    assert isinstance(model.decoder["attn"], FusedTutorialAttention)
    # gnmt is a thin matcher: the same module, converted in place by the traced runtime
    assert model.decoder["gnmt"] is gnmt and isinstance(gnmt, FusedStandIn)
    assert type(gnmt).__mro__[1] is GNMTAttention
    assert list(model.state_dict()) == keys_before
    assert "2 replaced, 1 skipped" in str(report) and "decoder.gnmt" in str(report)
    assert "as 'gnmt' through the traced runtime" in str(report)
    assert "2 replaced, 1 skipped" in caplog.text


def test_a_second_call_lists_what_was_fused_before():
    model = Parent()
    first = fuse_attention_report(model)
    assert first.fused_before == []
    second = fuse_attention_report(model)
    assert second.count == 0 and second.replaced == []
    # each fused module once, by its first path; the skipped one is still skipped
    assert second.fused_before == ["encoder.1", "decoder.gnmt"]
    assert [s.path for s in second.skipped] == ["other"]
    assert "already fused before this call: encoder.1, decoder.gnmt" in str(second)


def test_vmap_over_inputs_through_a_stand_in_gives_the_originals_results():
    torch.manual_seed(0)
    original = TutorialAttention(8).double()
    model = nn.Sequential(copy.deepcopy(original))
    assert fuse_attention(model) == 1
    query, keys = torch.randn(3, 2, 1, 8).double(), torch.randn(3, 2, 4, 8).double()
    got = torch.func.vmap(model[0])(query, keys)
    want = torch.func.vmap(original)(query, keys)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_stand_ins_keep_the_training_mode():
    model = nn.Sequential(TutorialAttention(4), TutorialAttention(4))
    model[1].eval()
    fuse_attention(model)
    assert model[0].training and not model[1].training


def test_registry():
    assert {"tutorial", "gnmt"} <= {layout.name for layout in registered_layouts()}
    with pytest.raises(ValueError, match="already registered"):
        register(Layout("tutorial", TUTORIAL.match, TUTORIAL.build, TUTORIAL.example_call))
    with pytest.raises(TypeError, match="Layout"):
        register("tutorial")


def test_a_failing_build_is_a_skip_not_an_error(monkeypatch):
    class Broken(FusedStandIn):
        pass

    def build(module, backend):
        raise RuntimeError("cannot build this one")

    broken = Layout("broken-test", TUTORIAL.match, build, TUTORIAL.example_call)
    monkeypatch.setattr(
        "seq2seq_fast.nn.convert.registered_layouts", lambda: [broken], raising=True
    )
    report = fuse_attention_report(nn.Sequential(TutorialAttention(4)))
    assert report.count == 0 and "cannot build this one" in report.skipped[0].reason


def test_bad_arguments():
    with pytest.raises(TypeError, match="check"):
        fuse_attention(nn.Sequential(), check="yes")
    with pytest.raises(ValueError, match="wrap it"):
        fuse_attention_report(copy.deepcopy(TutorialAttention(3)))


def test_a_stand_in_is_an_instance_of_the_original_class_and_pickles():
    """A named stand-in was not an instance of the project's class: code dispatching on it
    (ESPnet2's calculate_all_attentions: ``isinstance(m, AttLoc)``) found nothing. Its class is
    now a subclass of both, rebuilt as such by pickle and deepcopy."""
    import io
    import pickle

    torch.manual_seed(0)
    original = nn.Sequential(TutorialAttention(4))
    model = copy.deepcopy(original)
    assert fuse_attention(model) == 1
    assert isinstance(model[0], FusedStandIn) and isinstance(model[0], TutorialAttention)
    query, keys = torch.randn(2, 1, 4), torch.randn(2, 5, 4)
    want = original[0](query, keys)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for again in (
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(buffer, weights_only=False),
    ):
        assert type(again[0]) is type(model[0]) and isinstance(again[0], TutorialAttention)
        for got, expected in zip(again[0](query, keys), want, strict=True):
            torch.testing.assert_close(got, expected)
    assert "Fused" in repr(model)  # (its own repr, not the original's)
