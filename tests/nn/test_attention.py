"""BahdanauAttention and fuse_attention: equivalence with plain-PyTorch modules, backends, errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import seq2seq_fast
from seq2seq_fast import BahdanauAttention, fuse_attention
from seq2seq_fast.nn.convert import FusedStandIn, fuse_attention_report
from seq2seq_fast.nn.convert.traced.rewrite import recorded_runs
from seq2seq_fast.nn.convert.tutorial import FusedTutorialAttention
from seq2seq_fast.ops import fused_available
from tests.layouts import GNMTAttention, GNMTDecoderLayer, TutorialAttention, TutorialDecoder

requires_cpu_kernel = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)


def assert_grads_close(model_a: nn.Module, model_b: nn.Module, atol: float, rtol: float) -> None:
    grads_a = {n: p.grad for n, p in model_a.named_parameters()}
    grads_b = {n: p.grad for n, p in model_b.named_parameters()}
    assert grads_a.keys() == grads_b.keys()
    for name, grad_a in grads_a.items():
        grad_b = grads_b[name]
        # A parameter whose true gradient is zero (e.g. the tutorial's Va.bias, which cancels in the
        # softmax) may get None on one side and rounding noise on the other.
        param = dict(model_a.named_parameters())[name]
        grad_a = torch.zeros_like(param) if grad_a is None else grad_a
        grad_b = torch.zeros_like(param) if grad_b is None else grad_b
        torch.testing.assert_close(grad_a, grad_b, atol=atol, rtol=rtol, msg=name)


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_norm", [False, True])
@pytest.mark.parametrize("query_rank", [2, 3])
def test_module_fused_matches_reference(dtype, weight_norm, query_rank):
    torch.manual_seed(0)
    fused = BahdanauAttention(12, 10, 17, weight_norm=weight_norm, backend="fused").to(dtype)
    ref = copy.deepcopy(fused)
    ref.backend = "reference"
    query = torch.randn((3, 5, 12) if query_rank == 3 else (3, 12), dtype=dtype)
    keys = torch.randn(3, 7, 10, dtype=dtype)
    values = torch.randn(3, 7, 9, dtype=dtype)
    lengths = torch.tensor([7, 0, 3])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    outs = []
    for module in (fused, ref):
        context, weights = module(query, keys, values, lengths=lengths)
        (context.square().sum() + (weights * torch.arange(7, dtype=dtype)).sum()).backward()
        outs.append((context, weights))
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], **tol)
    assert outs[0][0].shape == ((3, 5, 9) if query_rank == 3 else (3, 9))
    assert torch.all(outs[0][1][1] == 0) and torch.all(outs[0][0][1] == 0)  # empty row
    assert_grads_close(fused, ref, **tol)


def test_weight_norm_old_keyword_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match="weight_norm"):
        old = BahdanauAttention(4, 4, 16, normalize=True)
    new = BahdanauAttention(4, 4, 16, weight_norm=True)
    assert old.weight_norm and old.normalize and new.normalize
    assert old.state_dict().keys() == new.state_dict().keys()  # checkpoints load either way
    assert "weight_norm=True" in repr(new)


def test_weight_norm_initialisation_and_score_vector():
    module = BahdanauAttention(4, 4, 16, weight_norm=True)
    assert module.g.item() == pytest.approx(0.25)
    assert torch.all(module.b == 0)
    v_eff, bias = module.score_vector()
    assert v_eff.norm().item() == pytest.approx(0.25, rel=1e-5)
    assert bias is module.b
    plain = BahdanauAttention(4, 4, 16)
    assert plain.g is None and plain.b is None and plain.score_vector()[1] is None


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_projected_keys_reused_gives_same_result(backend):
    torch.manual_seed(1)
    module = BahdanauAttention(6, 5, 8, backend=backend)
    keys = torch.randn(2, 4, 5)
    projected = module.project_keys(keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            query = torch.randn(2, 6)
            direct = module(query, keys, lengths=torch.tensor([4, 2]))
            cached = module(query, keys, projected_keys=projected, lengths=torch.tensor([4, 2]))
            torch.testing.assert_close(direct[0], cached[0], msg=f"step {step}")
            torch.testing.assert_close(direct[1], cached[1], msg=f"step {step}")


def test_backend_fused_raises_where_no_kernel_serves():
    module = BahdanauAttention(4, 4, 4, backend="fused").half()
    with pytest.raises(RuntimeError, match="float16"):
        module(torch.randn(2, 4).half(), torch.randn(2, 3, 4).half())


def test_backend_auto_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(seq2seq_fast.ops._library, "_warned", set())
    # float16 on the CPU: no fused kernel serves it (bfloat16 is served there)
    module = BahdanauAttention(4, 4, 4).to(torch.float16)
    query, keys = torch.randn(2, 4).half(), torch.randn(2, 3, 4).half()
    with pytest.warns(UserWarning, match="falling back to the reference"):
        context, _ = module(query, keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = module(query, keys)
    torch.testing.assert_close(context, again)


def test_bad_constructor_and_call_arguments():
    with pytest.raises(ValueError, match="backend"):
        BahdanauAttention(4, 4, 4, backend="cuda")
    with pytest.raises(ValueError, match="hidden_size"):
        BahdanauAttention(4, 4, 0)
    module = BahdanauAttention(4, 6, 8)
    with pytest.raises(ValueError, match="query"):
        module(torch.randn(2, 5), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match="keys"):
        module(torch.randn(2, 4), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="lengths"):
        module(torch.randn(2, 4), torch.randn(2, 3, 6), lengths=torch.tensor([4, 1]))


@requires_cpu_kernel
def test_module_compiles_fullgraph_with_backward():
    torch.manual_seed(2)
    module = BahdanauAttention(8, 8, 16, weight_norm=True)
    reference = copy.deepcopy(module)
    reference.backend = "reference"

    def step(mod, query, keys, lengths):
        context, weights = mod(query, keys, lengths=lengths)
        return context.sum() + weights.square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    query, keys, lengths = torch.randn(3, 4, 8), torch.randn(3, 5, 8), torch.tensor([5, 2, 1])
    compiled(module, query, keys, lengths).backward()
    step(reference, query, keys, lengths).backward()
    assert_grads_close(module, reference, atol=1e-5, rtol=1e-5)


# --- fuse_attention --------------------------------------------------------------------------------


@requires_cpu_kernel
def test_fuse_tutorial_decoder_same_outputs_and_grads():
    torch.manual_seed(3)
    plain = TutorialDecoder(hidden_size=16, vocab=11)
    fused = copy.deepcopy(plain)
    keys_before = list(fused.state_dict())
    params_before = {id(p) for p in fused.parameters()}
    assert fuse_attention(fused) == 1
    assert isinstance(fused.attention, FusedTutorialAttention)
    assert list(fused.state_dict()) == keys_before
    assert {id(p) for p in fused.parameters()} == params_before  # optimisers keep working

    tokens = torch.randint(0, 11, (4, 1))
    hidden = torch.randn(1, 4, 16)
    encoder_outputs = torch.randn(4, 9, 16)
    outs = []
    for model in (plain, fused):
        logits, new_hidden, weights = model(tokens, hidden, encoder_outputs)
        assert weights.shape == (4, 1, 9)
        (logits.square().mean() + new_hidden.sum()).backward()
        outs.append((logits, new_hidden, weights))
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_grads_close(plain, fused, atol=1e-5, rtol=1e-4)


@requires_cpu_kernel
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_fuse_gnmt_layer_same_outputs_and_grads(normalize, batch_first):
    torch.manual_seed(4)
    plain = GNMTDecoderLayer(hidden_size=12, normalize=normalize, batch_first=batch_first)
    fused = copy.deepcopy(plain)
    attention = fused.attn
    report = fuse_attention_report(fused)
    assert report.count == 1, str(report)  # converted at once (a thin matcher, traced runtime)
    assert [(r.path, r.layout, bool(r.traced)) for r in report.replaced] == [("attn", "gnmt", True)]
    assert fused.attn is attention and isinstance(attention, FusedStandIn)  # in place
    assert list(fused.state_dict()) == list(plain.state_dict())

    batch, src_len, tgt_len = 3, 7, 5
    context = torch.randn(batch, src_len, 12) if batch_first else torch.randn(src_len, batch, 12)
    inputs = torch.randn(batch, tgt_len, 12) if batch_first else torch.randn(tgt_len, batch, 12)
    context_len = torch.tensor([7, 4, 1])
    with torch.no_grad(), recorded_runs() as ran:
        fused(inputs, context, context_len)  # the layer's own first call, watched: attn unfused
    assert not ran and report.count == 1  # (the layer is not converted: its attention was)
    outs = []
    for model in (plain, fused):
        with recorded_runs() as ran:
            out, weights = model(inputs, context, context_len)
        assert bool(ran) == (model is fused)  # the fused op computed the converted one's weights
        (out.square().sum() + weights.sum()).backward()
        outs.append((out, weights))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    assert_grads_close(plain, fused, atol=1e-4, rtol=1e-4)


@requires_cpu_kernel
def test_fuse_gnmt_single_query_step():
    torch.manual_seed(5)
    plain = nn.ModuleDict({"attn": GNMTAttention(6, 8, 10, normalize=True, batch_first=True)})
    fused = copy.deepcopy(plain)
    assert fuse_attention(fused) == 1
    keys = torch.randn(4, 6, 8)
    for model in (plain, fused):
        model["attn"].set_mask(torch.tensor([6, 3, 2, 5]), keys)
    query = torch.randn(4, 6)
    context_a, weights_a = plain["attn"](query, keys)
    context_b, weights_b = fused["attn"](query, keys)
    assert context_b.shape == (4, 8) and weights_b.shape == (4, 6)
    torch.testing.assert_close(context_a, context_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights_a, weights_b, atol=1e-5, rtol=1e-5)


def test_fuse_leaves_unrecognised_modules_alone():
    class NotAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.Wa, self.Ua, self.Va = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    class ExtraParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.Wa, self.Ua, self.Va = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
            self.dropout_proj = nn.Linear(4, 4)

    model = nn.Sequential(nn.Linear(4, 4), NotAttention(), ExtraParts(), nn.GRU(4, 4))
    before = [type(m) for m in model.modules()]
    assert fuse_attention(model) == 0
    assert [type(m) for m in model.modules()] == before


def test_fuse_counts_every_instance_and_is_idempotent():
    model = nn.ModuleList([TutorialAttention(4), GNMTAttention(4, 4, 4), TutorialAttention(4)])
    assert fuse_attention(model) == 3
    assert fuse_attention(model) == 0


def test_fuse_attention_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        fuse_attention("not a module")
    with pytest.raises(ValueError, match="backend"):
        fuse_attention(nn.Linear(2, 2), backend="triton")
    with pytest.raises(ValueError, match="wrap it"):
        fuse_attention(TutorialAttention(4))
