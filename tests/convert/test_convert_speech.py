"""fuse_attention on the attentions of speech and NLP toolkits: each converted module against its
plain-PyTorch re-creation (tests/layouts_speech.py) over several decoding steps with state,
padding and masks, in float64 and float32: outputs, every parameter's and input's gradient,
state_dict, optimiser, reset between utterances; look-alikes refused, inexact variants skipped."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize, prune

from seq2seq_fast.nn.convert import FusedStandIn, fuse_attention, fuse_attention_report
from seq2seq_fast.ops import fused_available
from tests import layouts_speech as L

requires_cpu_kernel = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)

# --- drivers: a decoder's use of each module, two utterances with a reset between -----------------


def _lengths(batch: int, frames: int) -> list[int]:
    """Padding in every row but the first; every row keeps at least one frame."""
    return [frames] + [max(1, frames - 2 - 2 * i) for i in range(batch - 1)]


def _rand(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=dtype)


def drive_espnet(module, dtype, gen, inputs):
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        module.reset()
        enc = _rand(gen, dtype, batch, frames, module.eprojs).requires_grad_()
        inputs.append(enc)
        lengths, w = _lengths(batch, frames), None
        for _ in range(3):
            c, w = module(enc, lengths, _rand(gen, dtype, batch, module.dunits), w, scaling=1.7)
            # the coverage attentions pass back the list of all previous weights, appended to
            outs += [c, w[-1] if isinstance(w, list) else w]
        assert not isinstance(w, list) or len(w) == 4  # the uniform start and one per step
    return outs


def drive_speechbrain(module, dtype, gen, inputs):
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        module.reset()
        enc = _rand(gen, dtype, batch, frames, module.mlp_enc.in_features).requires_grad_()
        inputs.append(enc)
        enc_len = torch.tensor(_lengths(batch, frames), dtype=dtype)
        for step in range(3):
            if step == 2 and hasattr(module, "prev_attn"):  # a beam searcher's permute_mem
                module.prev_attn = module.prev_attn.index_select(0, torch.arange(batch).flip(0))
            out, w = module(enc, enc_len, _rand(gen, dtype, batch, module.mlp_dec.in_features))
            outs += [out, w]
    if hasattr(module, "prev_attn"):
        outs.append(module.prev_attn)
    return outs


def drive_fairseq_location(module, dtype, gen, inputs):
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        module.clear_cache()
        enc = _rand(gen, dtype, batch, frames, module.proj_enc.in_features).requires_grad_()
        inputs.append(enc)
        padding = L.espnet_pad_mask(_lengths(batch, frames))
        prev = cum = torch.zeros(batch, frames, dtype=dtype)
        for step in range(3):
            state = torch.stack((prev, cum), dim=1)
            dec = None if step == 0 else _rand(gen, dtype, batch, module.decoder_dim)
            c, prev = module(enc, padding, dec, state)
            cum = cum + prev
            outs += [c, prev]
    return outs


def drive_tacotron2(module, dtype, gen, inputs):
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        memory_layer = module.memory_layer
        width_in = getattr(memory_layer, "linear_layer", memory_layer).in_features
        memory = _rand(gen, dtype, batch, frames, width_in).requires_grad_()
        inputs.append(memory)
        processed = memory_layer(memory)
        mask = L.espnet_pad_mask(_lengths(batch, frames))
        prev = cum = torch.zeros(batch, frames, dtype=dtype)
        query = getattr(module.query_layer, "linear_layer", module.query_layer)
        for _ in range(3):
            cat = torch.cat((prev.unsqueeze(1), cum.unsqueeze(1)), dim=1)
            hidden = _rand(gen, dtype, batch, query.in_features)
            c, prev = module(hidden, memory, processed, cat, mask)
            cum = cum + prev
            outs += [c, prev]
    return outs


def drive_coqui(module, dtype, gen, inputs):
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        inputs_width = module.inputs_layer.linear_layer.in_features
        enc = _rand(gen, dtype, batch, frames, inputs_width).requires_grad_()
        inputs.append(enc)
        module.init_states(enc)
        module.attention_weights = module.attention_weights.to(dtype)
        if module.location_attention:
            module.attention_weights_cum = module.attention_weights_cum.to(dtype)
        processed = module.preprocess_inputs(enc)
        mask = ~L.espnet_pad_mask(_lengths(batch, frames))
        query_width = module.query_layer.linear_layer.in_features
        for _ in range(3):
            outs.append(module(_rand(gen, dtype, batch, query_width), enc, processed, mask))
            outs.append(module.attention_weights)
        if module.location_attention:
            outs.append(module.attention_weights_cum)
    return outs


def drive_fairseq_mlp(module, dtype, gen, inputs):
    outs = []
    for batch, src_len in ((3, 7), (2, 5)):  # a new source: the cached projection is replaced
        source = _rand(gen, dtype, src_len, batch, module.context_dim).requires_grad_()
        inputs.append(source)
        padding = L.espnet_pad_mask(_lengths(batch, src_len)).t()
        for step in range(3):
            state = _rand(gen, dtype, batch, module.decoder_proj.in_features)
            c, w = module(state, source, padding if step < 2 else None)
            outs += [c, w]
    return outs


def drive_allennlp(module, dtype, gen, inputs):
    outs = []
    for batch, rows in ((3, 7), (2, 5)):
        matrix = _rand(gen, dtype, batch, rows, module._u_matrix.shape[0]).requires_grad_()
        inputs.append(matrix)
        mask = ~L.espnet_pad_mask(_lengths(batch, rows))
        mask[-1] = False  # a row with nothing kept: zeros in both
        for step in range(3):
            vector = _rand(gen, dtype, batch, module._w_matrix.shape[0])
            outs.append(module(vector, matrix, mask if step != 1 else None))
        outs.append(module(vector, matrix, mask.to(dtype)))  # a float mask: the plain path
    return outs


def drive_d2l(module, dtype, gen, inputs):
    """d2l's Seq2SeqAttentionDecoder calls it with keys = values = the encoder outputs."""
    outs = []
    for batch, frames in ((3, 7), (2, 5)):
        enc = _rand(gen, dtype, batch, frames, module.W_k.in_features).requires_grad_()
        inputs.append(enc)
        valid_lens = torch.tensor(_lengths(batch, frames))
        valid_lens[-1] = 0  # d2l: uniform weights over all keys
        for _ in range(3):
            query = _rand(gen, dtype, batch, 1, module.W_q.in_features)
            outs += [module(query, enc, enc, valid_lens), module.attention_weights]
        per_query = torch.stack((valid_lens, valid_lens.clamp(max=2)), dim=1)  # differ: plain path
        queries = _rand(gen, dtype, batch, 2, module.W_q.in_features)
        values = _rand(gen, dtype, batch, frames, 3)
        outs.append(module(queries, enc, values, per_query))
        outs.append(module(queries, enc, values, valid_lens.to(dtype) - 0.5))
    return outs


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    drive: Callable
    layout: str


CASES = {
    "espnet_att_add": Case(lambda: L.AttAdd(10, 6, 8), drive_espnet, "espnet_att_add"),
    "espnet_att_loc": Case(lambda: L.AttLoc(10, 6, 8, 4, 2), drive_espnet, "espnet_att_loc"),
    "espnet_att_cov": Case(lambda: L.AttCov(10, 6, 8), drive_espnet, "espnet_att_cov"),
    "espnet_att_cov_loc": Case(
        lambda: L.AttCovLoc(10, 6, 8, 4, 2), drive_espnet, "espnet_att_cov_loc"
    ),
    "speechbrain_content": Case(
        lambda: L.ContentBasedAttention(10, 6, 8, 5, scaling=1.3),
        drive_speechbrain,
        "speechbrain_content",
    ),
    "speechbrain_location": Case(
        lambda: L.LocationAwareAttention(10, 6, 8, 5, 3, 2),
        drive_speechbrain,
        "speechbrain_location",
    ),
    "fairseq_location": Case(
        lambda: L.LocationAttention(8, 10, 6, 2, 4, 3), drive_fairseq_location, "fairseq_location"
    ),
    "tacotron2_nvidia": Case(
        lambda: L.NvidiaTacotron2Attention(6, 10, 8, 4, 5), drive_tacotron2, "tacotron2"
    ),
    "tacotron2_torchaudio": Case(
        lambda: L.TorchaudioTacotron2Attention(6, 10, 8, 4, 5), drive_tacotron2, "tacotron2"
    ),
    "coqui_location": Case(
        lambda: L.CoquiOriginalAttention(
            6, 10, 8, True, 4, 5, False, "softmax", False, False, False
        ),
        drive_coqui,
        "coqui_original",
    ),
    "coqui_content": Case(
        lambda: L.CoquiOriginalAttention(
            6, 10, 8, False, 4, 5, False, "softmax", False, True, False
        ),
        drive_coqui,
        "coqui_original",
    ),
    # Coqui's Tacotron default: sigmoid normalisation, the score layer's bias kept (score_bias)
    "coqui_sigmoid_location": Case(
        lambda: L.CoquiOriginalAttention(
            6, 10, 8, True, 4, 5, False, "sigmoid", False, False, False
        ),
        drive_coqui,
        "coqui_original",
    ),
    "coqui_sigmoid_content": Case(
        lambda: L.CoquiOriginalAttention(
            6, 10, 8, False, 4, 5, False, "sigmoid", False, False, False
        ),
        drive_coqui,
        "coqui_original",
    ),
    "coqui_sigmoid_in_place": Case(
        lambda: L.CoquiOriginalAttentionInPlace(
            6, 10, 8, True, 4, 5, False, "sigmoid", False, False, False
        ),
        drive_coqui,
        "coqui_original",
    ),
    "fairseq_mlp": Case(lambda: L.MLPAttention(6, 10, 8), drive_fairseq_mlp, "fairseq_mlp"),
    "allennlp_additive": Case(
        lambda: L.AllenNLPAdditiveAttention(6, 10), drive_allennlp, "allennlp_additive"
    ),
    "d2l_sized": Case(
        lambda: L.D2LAdditiveAttentionSized(10, 6, 8, 0.0), drive_d2l, "d2l_additive"
    ),
    "d2l_dropout": Case(
        lambda: L.D2LAdditiveAttentionSized(10, 6, 8, 0.3), drive_d2l, "d2l_additive"
    ),
}


def _run(case: Case, model: nn.Module, dtype: torch.dtype, seed: int):
    """Outputs, and gradients (parameters by name, then inputs) of a random projection of them."""
    gen = torch.Generator().manual_seed(seed)
    inputs: list[Tensor] = []
    torch.manual_seed(seed)  # the same dropout draws on both sides
    outs = case.drive(model["attn"], dtype, gen, inputs)
    loss = sum((o * _rand(gen, dtype, *o.shape)).sum() for o in outs if o.requires_grad)
    named = list(model.named_parameters()) + [(f"input {i}", t) for i, t in enumerate(inputs)]
    grads = torch.autograd.grad(loss, [t for _, t in named], allow_unused=True)
    grads = {
        n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(named, grads, strict=True)
    }
    return [o.detach() for o in outs], grads


def _pair(case: Case, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    plain = nn.ModuleDict({"attn": case.make()}).to(dtype)
    fused = copy.deepcopy(plain)
    params_before = [id(p) for p in fused.parameters()]
    report = fuse_attention_report(fused)
    assert [r.layout for r in report.replaced] == [case.layout], str(report)
    assert isinstance(fused["attn"], FusedStandIn)
    assert [id(p) for p in fused.parameters()] == params_before  # the very Parameter objects
    assert list(fused.state_dict()) == list(plain.state_dict())
    return plain, fused


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_converted_matches_recreation(name, dtype):
    case = CASES[name]
    plain, fused = _pair(case, dtype)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    outs_a, grads_a = _run(case, plain, dtype, seed=1)
    outs_b, grads_b = _run(case, fused, dtype, seed=1)
    assert len(outs_a) == len(outs_b)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        torch.testing.assert_close(b, a, **tol, msg=lambda m, i=i: f"output {i}: {m}")
    assert grads_a.keys() == grads_b.keys()
    for key, grad in grads_a.items():
        unused = "bias" in key or ".ta." in key  # biases that cancel; Coqui's unused ta
        assert grad.abs().sum() > 0 or unused, key  # every gradient is exercised
        torch.testing.assert_close(grads_b[key], grad, **tol, msg=lambda m, k=key: f"{k}: {m}")


# the stand-ins that run their attention as a plan on the general path's runtime (_planned.py)
_ON_THE_RUNTIME = [
    name for name in CASES if not name.startswith(("fairseq_mlp", "allennlp", "d2l"))
]


@requires_cpu_kernel
@pytest.mark.parametrize("name", _ON_THE_RUNTIME)
def test_a_row_without_a_valid_frame_gives_what_the_original_gives(name, monkeypatch):
    """A row whose frames are all padding: NaN where the original gives NaN (its -inf fill, then
    the softmax or sigmoid), the other rows as the original's. The stand-ins before the runtime
    gave zeros there."""
    monkeypatch.setattr(
        f"{__name__}._lengths", lambda batch, frames: [frames] + [0] + [2] * (batch - 2)
    )
    case = CASES[name]
    plain, fused = _pair(case, torch.float64)
    with torch.no_grad():
        outs_a = case.drive(plain["attn"], torch.float64, torch.Generator().manual_seed(4), [])
        outs_b = case.drive(fused["attn"], torch.float64, torch.Generator().manual_seed(4), [])
    assert any(bool(o.isnan().any()) for o in outs_a)  # the case reaches the empty row
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        torch.testing.assert_close(
            b, a, atol=1e-10, rtol=1e-9, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}"
        )


@requires_cpu_kernel
@pytest.mark.parametrize(
    "name",
    [
        "d2l_sized",  # a row of valid length 0: uniform weights, as d2l's -1e6 fill gives
        "speechbrain_location",  # a bias term, a scale, a location term
    ],
)
def test_a_plan_inside_torch_compile_gives_the_originals_results(name):
    """Inside the user's torch.compile a stand-in's plan goes to the op directly: outputs and
    gradients as the original's (float32)."""
    case = CASES[name]
    plain, fused = _pair(case, torch.float32)
    torch._dynamo.reset()
    fused_drive = torch.compile(case.drive, backend="aot_eager")
    outs_a, grads_a = _run(case, plain, torch.float32, seed=2)
    outs_b, grads_b = _run(Case(case.make, fused_drive, case.layout), fused, torch.float32, seed=2)
    tol = dict(atol=2e-5, rtol=2e-4)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        torch.testing.assert_close(b, a, **tol, msg=lambda m, i=i: f"output {i}: {m}")
    for key, grad in grads_a.items():
        torch.testing.assert_close(grads_b[key], grad, **tol, msg=lambda m, k=key: f"{k}: {m}")


@requires_cpu_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_every_parameter_the_original_trains_gets_a_gradient(name):
    """A score layer's bias that a softmax cancels got no gradient at all after conversion (None,
    where the original's is 0 up to rounding): DistributedDataParallel then stops at its next step
    (a parameter that took no part), and AdamW skips it (no weight decay). It gets a zero
    gradient now."""
    case = CASES[name]
    missing = []
    for model in _pair(case, torch.float64):
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(5)
        outs = case.drive(model["attn"], torch.float64, gen, [])
        sum(o.sum() for o in outs if o.requires_grad).backward()
        missing.append({n for n, p in model.named_parameters() if p.grad is None})
    assert missing[1] == missing[0], f"no gradient after conversion: {missing[1] - missing[0]}"


@requires_cpu_kernel
@pytest.mark.parametrize(
    "name",
    [
        "espnet_att_add",
        "speechbrain_location",
        "fairseq_mlp",
        "tacotron2_nvidia",
        "coqui_location",
        "d2l_dropout",
    ],
)
def test_parameters_state_dict_and_optimiser_kept(name):
    case = CASES[name]
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": case.make()}).double()
    fused = copy.deepcopy(plain)
    # SGD, not Adam: Adam would scale the rounding noise in the gradient of a bias that cancels in
    # the softmax (the original computes one, the stand-in leaves it None) up to full steps.
    optimiser = torch.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)  # before the conversion
    reference_optimiser = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    params_before = [id(p) for p in fused.parameters()]
    assert fuse_attention(fused) == 1
    assert [id(p) for p in fused.parameters()] == params_before
    assert list(fused.state_dict()) == list(plain.state_dict())
    for _ in range(2):  # the optimiser's steps reach the stand-in's parameters
        for model, opt in ((plain, reference_optimiser), (fused, optimiser)):
            opt.zero_grad()
            torch.manual_seed(5)
            outs = case.drive(model["attn"], torch.float64, torch.Generator().manual_seed(2), [])
            sum(o.square().sum() for o in outs if o.requires_grad).backward()
            opt.step()
    tol = 1e-9
    for (key, a), b in zip(plain.state_dict().items(), fused.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=key)
    plain.load_state_dict(fused.state_dict())  # and back


class _Adapted(nn.Module):
    """A layer with an adapter added after it (NeMo's ``add_adapter`` on its ``ConvNorm``):
    no longer the plain layer the stand-in reads the weights of."""

    def __init__(self, layer: nn.Module, width: int) -> None:
        super().__init__()
        self.layer = layer
        self.adapter = nn.Linear(width, width)

    def forward(self, x):
        out = self.layer(x)
        return out + self.adapter(out.transpose(1, 2)).transpose(1, 2)


class _Doubled(nn.Module):
    """A parametrization: the weight twice over."""

    def forward(self, weight):
        return 2 * weight


def _score_layer(attention: nn.Module) -> nn.Linear:
    return next(m for m in attention.modules() if isinstance(m, nn.Linear) and m.out_features == 1)


def _change(attention: nn.Module, change: str) -> None:
    """A change users make to a converted model: an adapter after the location conv (NeMo's
    add_adapter), a forward hook on the score layer, pruning it (a pre-hook that recomputes
    its weight), or a parametrization of its weight."""
    torch.manual_seed(7)
    if change == "adapter":
        for parent in attention.modules():
            for name, child in parent.named_children():
                conv = getattr(child, "conv", child)
                if isinstance(conv, nn.Conv1d):
                    setattr(parent, name, _Adapted(child, conv.out_channels).double())
                    return
        raise AssertionError("no location conv")
    score = _score_layer(attention)
    if change == "hook":
        score.register_forward_hook(lambda module, args, out: 2 * out)
    elif change == "prune":
        prune.l1_unstructured(score, "weight", amount=0.5)
    else:
        parametrize.register_parametrization(score, "weight", _Doubled())


LOCATED = ["tacotron2_nvidia", "tacotron2_torchaudio", "coqui_location"]  # (a Conv1d)
CHANGED = [(name, "adapter") for name in LOCATED] + [
    (name, change)
    for name in [
        *LOCATED,
        "espnet_att_loc",
        "speechbrain_location",
        "fairseq_location",
        "d2l_sized",
        "fairseq_mlp",
    ]
    for change in ("hook", "prune", "parametrize")
]


@pytest.mark.parametrize(("name", "change"), CHANGED, ids=[f"{n}-{c}" for n, c in CHANGED])
def test_a_part_changed_after_the_conversion(name, change):
    """The stand-ins read the score layer's and the location conv's weights directly: a hook
    or an adapter added after the conversion was silently skipped (outputs off by 0.16), a
    pruned weight was read stale (the second backward failed), and a wrapper without
    ``.weight`` raised AttributeError. Such a call now runs the original's own code, and says
    so once."""
    case = CASES[name]
    plain, fused = _pair(case, torch.float64)
    for model in (plain, fused):
        _change(model["attn"], change)
    results = []
    with pytest.warns(UserWarning, match="changed after the conversion"):
        for model in (plain, fused):
            torch.manual_seed(5)
            gen = torch.Generator().manual_seed(5)
            for _ in range(2):  # (a second backward reaches what the first one freed)
                inputs = []
                outs = case.drive(model["attn"], torch.float64, gen, inputs)
                grads = torch.autograd.grad(sum(o.sum() for o in outs), inputs)
                results.append(outs + list(grads))
    half = len(results) // 2
    for want, got in zip(results[:half], results[half:], strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


# --- what is left alone ---------------------------------------------------------------------------


class SharperAttLoc(L.AttLoc):
    """A look-alike: ESPnet's parts and state, another temperature inside."""

    def forward(self, enc_hs_pad, enc_hs_len, dec_z, att_prev, scaling=2.0):
        return super().forward(enc_hs_pad, enc_hs_len, dec_z, att_prev, scaling=2 * scaling)


class ReluTacotron2Attention(L.TorchaudioTacotron2Attention):
    """A look-alike: Tacotron 2's parts, relu for tanh."""

    def forward(
        self, attention_hidden_state, memory, processed_memory, attention_weights_cat, mask
    ):
        query = self.query_layer(attention_hidden_state.unsqueeze(1))
        keys = processed_memory + self.location_layer(attention_weights_cat)
        energies = self.v(torch.relu(query + keys)).squeeze(-1).masked_fill(mask, -float("inf"))
        weights = torch.softmax(energies, dim=1)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


class NoMaskContentAttention(L.ContentBasedAttention):
    """A look-alike: SpeechBrain's parts, the padding not masked."""

    def forward(self, enc_states, enc_len, dec_states):
        self.mask = torch.ones(enc_states.shape[:2], dtype=enc_len.dtype)
        return super().forward(enc_states, torch.full_like(enc_len, enc_states.size(1)), dec_states)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SharperAttLoc(10, 6, 8, 4, 2),
        lambda: ReluTacotron2Attention(6, 10, 8, 4, 5),
        lambda: NoMaskContentAttention(10, 6, 8, 5),
    ],
    ids=["espnet_temperature", "tacotron2_relu", "speechbrain_unmasked"],
)
def test_lookalikes_are_refused(make):
    model = nn.ModuleDict({"attn": make()})
    before = type(model["attn"])
    report = fuse_attention_report(model)
    assert report.count == 0 and type(model["attn"]) is before
    assert len(report.skipped) == 1 and "differs" in report.skipped[0].reason, str(report)


class _MellotronAttention(L.NvidiaTacotron2Attention):
    """NVIDIA/mellotron's ``Attention``: Tacotron 2's, with a sixth parameter ``attention_weights``
    (its ``Decoder.decode`` passes it at every step, None but in ``inference_noattention``,
    where the given weights are used and the energies are not computed)."""

    def forward(self, hidden, memory, processed, weights_cat, mask, attention_weights=None):
        if attention_weights is not None:
            return torch.bmm(attention_weights.unsqueeze(1), memory).squeeze(1), attention_weights
        return super().forward(hidden, memory, processed, weights_cat, mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_tacotron2_attention_with_another_parameter_is_left_to_the_general_path(dtype):
    """It was taken for 'tacotron2' by its parts, and the stand-in, which takes the five
    arguments of Tacotron 2's call, raised TypeError at the first step. A stand-in must take every
    call the original takes; here the general path converts the module at its first call."""
    torch.manual_seed(0)
    original = nn.ModuleDict({"attn": _MellotronAttention(6, 10, 8, 4, 5)}).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    assert report.count == 0 and report.skipped == [] and "attn" in report.watching, str(report)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    results = []
    for m in (model, original):
        outs = drive_tacotron2(m["attn"], dtype, torch.Generator().manual_seed(2), [])
        loss = sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=dtype)).sum() for o in outs)
        results.append((outs, torch.autograd.grad(loss, list(m.parameters()))))
    assert "traced" in str(report) and "attn" not in report.watching, str(report)
    for got, want in zip(*[outs + list(grads) for outs, grads in results], strict=True):
        torch.testing.assert_close(got, want, **tol)
    gen = torch.Generator().manual_seed(3)
    memory = torch.randn(2, 5, 10, dtype=dtype, generator=gen)
    given = torch.softmax(torch.randn(2, 5, dtype=dtype, generator=gen), -1)
    args = (torch.randn(2, 6, dtype=dtype, generator=gen), memory, None, None, None, given)
    torch.testing.assert_close(model["attn"](*args), original["attn"](*args))


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (dict(norm="entmax"), "softmax and sigmoid only"),
        (dict(forward_attn=True), "forward attention"),
        (dict(windowing=True), "windowing"),
    ],
)
def test_coqui_inexact_variants_are_skipped_with_the_reason(flags, reason):
    settings = dict(windowing=False, norm="softmax", forward_attn=False, trans_agent=False)
    settings.update(flags)
    attn = L.CoquiOriginalAttention(6, 10, 8, True, 4, 5, forward_attn_mask=False, **settings)
    model = nn.ModuleDict({"attn": attn})
    report = fuse_attention_report(model)
    assert report.count == 0 and model["attn"] is attn
    assert report.skipped[0].layouts == ("coqui_original",) and reason in report.skipped[0].reason


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "name",
    ["coqui_sigmoid_location", "coqui_sigmoid_content", "coqui_sigmoid_in_place", "coqui_location"],
)
def test_coqui_through_the_general_path(name, dtype, monkeypatch):
    """Coqui's attention with the names off: the general path converts it at its first call and
    runs the op, the sigmoid's score bias included (never the plain fallback), exactly."""
    from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights

    def no_plain(*args, **kwargs):
        raise AssertionError("the replacement fell back to plain ops")

    monkeypatch.setattr(TracedWeights, "_plain", no_plain)
    case = CASES[name]
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": case.make()}).to(dtype)
    fused = copy.deepcopy(plain)
    report = fuse_attention_report(fused, named=False)
    calls = TracedWeights.calls
    outs_a, grads_a = _run(case, plain, dtype, seed=1)
    outs_b, grads_b = _run(case, fused, dtype, seed=1)
    assert [r.path for r in report.replaced] == ["attn"], str(report)
    assert report.replaced[0].layout.startswith("traced"), str(report)
    assert TracedWeights.calls > calls
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        torch.testing.assert_close(b, a, **tol, msg=lambda m, i=i: f"output {i}: {m}")
    for key, grad in grads_a.items():
        torch.testing.assert_close(grads_b[key], grad, **tol, msg=lambda m, k=key: f"{k}: {m}")
    if "sigmoid" in name:  # the score layer's bias moves the weights: it has a gradient
        assert grads_b["attn.v.linear_layer.bias"].abs().sum() > 1e-6


LOCATION_CASES = [
    "espnet_att_loc",  # a Conv2d (1, K) over [B, 1, 1, T]
    "speechbrain_location",  # the location dense layer has a bias
    "fairseq_location",
    "tacotron2_nvidia",
    "tacotron2_torchaudio",
    "coqui_location",
]


@requires_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", LOCATION_CASES)
def test_location_families_through_the_general_path(name, dtype, monkeypatch):
    """With the names off, every location-aware family's location term and context are formed
    inside the kernels (the location-aware step op, never plain ops), and the steps match the
    original."""
    from seq2seq_fast.nn.convert.traced import rewrite as traced_rewrite
    from seq2seq_fast.ops.stepwise import LocationMemory

    took = []
    real = traced_rewrite.traced_context
    monkeypatch.setattr(
        traced_rewrite,
        "traced_context",
        lambda form, ours, *a: took.append(ours is not None) or real(form, ours, *a),
    )

    seen = []
    attend = LocationMemory.attend
    monkeypatch.setattr(
        LocationMemory, "attend", lambda self, *a, **k: seen.append(1) or attend(self, *a, **k)
    )
    case = CASES[name]
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": case.make()}).to(dtype)
    fused = copy.deepcopy(plain)
    report = fuse_attention_report(fused, named=False)
    outs_a, grads_a = _run(case, plain, dtype, seed=2)
    outs_b, grads_b = _run(case, fused, dtype, seed=2)
    assert [r.layout.split(" ")[0] for r in report.replaced] == ["traced"], str(report)
    assert len(seen) >= 3, f"{name}: the location-aware step op ran {len(seen)} times"
    assert took and all(took), f"{name}: the op's context taken {sum(took)} of {len(took)} times"
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        torch.testing.assert_close(b, a, **tol, msg=lambda m, i=i: f"output {i}: {m}")
    for key, grad in grads_a.items():
        torch.testing.assert_close(grads_b[key], grad, **tol, msg=lambda m, k=key: f"{k}: {m}")


@requires_cpu_kernel
@pytest.mark.parametrize("name", ["espnet_att_add", "espnet_att_loc"])
def test_the_general_path_keeps_espnet_converted_over_utterances(name):
    """ESPnet's forward builds its padding mask from ``int(lengths.max())`` at the first step of
    an utterance, between the scores and the softmax: a graph break there, scores and softmax in
    two graphs. The runtime traces such a module again with scalars captured, so from then on
    every step runs fused, first steps included, with nothing to warn about. Utterances of other
    sizes do not count as the recompile limit of one frame: the module stays converted."""
    from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights

    case = CASES[name]
    torch.manual_seed(0)
    fused = nn.ModuleDict({"attn": case.make()})
    report = fuse_attention_report(fused, named=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3, 8):  # 2 utterances of 3 steps each, sizes (3, 7) and (2, 5)
            calls = TracedWeights.calls
            _run(case, fused, torch.float32, seed=seed)
            # the first run: the converting call and the call that traces again run unfused
            least = 4 if seed == 3 else 6
            assert TracedWeights.calls - calls >= least, (
                f"run {seed}: {TracedWeights.calls - calls}"
            )
    assert report.count == 1 and isinstance(fused["attn"], FusedStandIn), str(report)
    said = [str(w.message) for w in caught if "fuse_attention" in str(w.message)]
    assert not said, said
    assert fused["attn"].__dict__["_fuse_attention_traced"].capture_scalars


def _memory_products(case: Case, model: nn.Module) -> int:
    """How many matrix products of the memory projection over the first utterance (its
    flattened memory: 3 x 7 = 21 frames of 10 features in the drivers above) one run of the case
    makes, forward and backward."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        _run(case, model, torch.float32, seed=4)
    return sum(
        any(len(s) == 2 and 21 in s for s in event.input_shapes)
        and any(len(s) == 2 and 10 in s for s in event.input_shapes)
        for event in prof.events()
        if event.name in ("aten::mm", "aten::addmm")
    )


@requires_cpu_kernel
@pytest.mark.parametrize("name", ["speechbrain_content", "espnet_att_add"])
def test_the_general_path_projects_a_kept_memory_once(name):
    """A memory projection the module keeps (SpeechBrain's precomputed_enc_h, made at the first
    step): the general path uses the module's own, never a second projection of its own."""
    case = CASES[name]
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": case.make()})
    fused = copy.deepcopy(plain)
    report = fuse_attention_report(fused, named=False)
    _run(case, fused, torch.float32, seed=3)  # converts
    assert report.count == 1, str(report)
    assert _memory_products(case, fused) == _memory_products(case, plain) == 3


@requires_cpu_kernel
def test_coqui_sigmoid_trains_through_the_location_step(monkeypatch):
    """Coqui's default (location-sensitive, sigmoid, score bias) trains through the location-aware
    step op (keys formed inside the kernels), its score bias's gradient from the op."""
    from seq2seq_fast.nn.convert._location import LocationMemory

    seen = []
    attend = LocationMemory.attend

    def spy(self, *args, **kwargs):
        seen.append(args[5:] if len(args) > 5 else tuple(kwargs.values()))
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(LocationMemory, "attend", spy)
    case = CASES["coqui_sigmoid_location"]
    plain, fused = _pair(case, torch.float64)
    outs_a, grads_a = _run(case, plain, torch.float64, seed=3)
    outs_b, grads_b = _run(case, fused, torch.float64, seed=3)
    assert len(seen) >= 6 and all(s[0] == "sigmoid" and s[1] is not None for s in seen)
    for a, b in zip(outs_a, outs_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-9)
    for key, grad in grads_a.items():
        torch.testing.assert_close(grads_b[key], grad, atol=1e-10, rtol=1e-9, msg=key)
    assert grads_b["attn.v.linear_layer.bias"].abs().sum() > 1e-6


def test_espnet_attloc_is_not_taken_for_coverage():
    """AttCovLoc has AttLoc's parts: only its own layout takes it (its location convolution reads
    the sum of a list of weights), and AttLoc's does not take AttCovLoc."""
    report = fuse_attention_report(nn.ModuleDict({"a": L.AttCovLoc(10, 6, 8, 4, 2)}))
    assert [r.layout for r in report.replaced] == ["espnet_att_cov_loc"], str(report)
    report = fuse_attention_report(nn.ModuleDict({"a": L.AttLoc(10, 6, 8, 4, 2)}))
    assert [r.layout for r in report.replaced] == ["espnet_att_loc"], str(report)


@requires_cpu_kernel
def test_espnet_monotonic_constraint_masks_like_the_original():
    torch.manual_seed(3)
    plain = nn.ModuleDict({"attn": L.AttLoc(10, 6, 8, 4, 2)}).double()
    fused = copy.deepcopy(plain)
    assert fuse_attention(fused) == 1
    enc = torch.randn(1, 9, 10, dtype=torch.float64)
    dec = torch.randn(1, 6, dtype=torch.float64)
    for last in (0, 2, 4, 8):
        results = []
        for model in (plain, fused):
            model["attn"].reset()
            results.append(model["attn"](enc, [9], dec, None, last_attended_idx=last))
        torch.testing.assert_close(results[1], results[0], atol=1e-12, rtol=1e-10)
        assert (results[1][1] == 0).any()  # the window excluded frames
    fused["attn"].reset()
    with pytest.raises(NotImplementedError, match="Batch"):
        fused["attn"](torch.randn(2, 9, 10).double(), [9, 9], None, None, last_attended_idx=3)


@requires_cpu_kernel
@pytest.mark.parametrize("name", ["fairseq_mlp", "allennlp_additive", "d2l_sized"])
def test_fixed_memory_projected_once_and_reordering_projects_again(name):
    """The decoder passes the same source every step: one projection per source tensor. A beam
    search's reordering (index_select) makes a new tensor: projected again, results still equal."""
    case = CASES[name]
    plain, fused = _pair(case, torch.float64)
    attn = fused["attn"]
    time_major = name == "fairseq_mlp"
    batch, length = 3, 6
    gen = torch.Generator().manual_seed(4)
    if name == "fairseq_mlp":
        source = _rand(gen, torch.float64, length, batch, 10)
        call = lambda m, src, q: m(q, src, None)[0]  # noqa: E731
        query_shape = (batch, 6)
    elif name == "allennlp_additive":
        source = _rand(gen, torch.float64, batch, length, 10)
        call = lambda m, src, q: m(q, src)  # noqa: E731
        query_shape = (batch, 6)
    else:
        source = _rand(gen, torch.float64, batch, length, 10)
        call = lambda m, src, q: m(q, src, src, None)  # noqa: E731
        query_shape = (batch, 1, 6)
    order = torch.tensor([2, 2, 0])
    for step in range(4):
        if step == 2:  # beam search reorders the memory
            source = source.index_select(1 if time_major else 0, order)
        query = _rand(gen, torch.float64, *query_shape)
        torch.testing.assert_close(call(attn, source, query), call(plain["attn"], source, query))
    assert (attn.key_cache.misses, attn.key_cache.hits) == (2, 2)
    source.add_(1.0)  # changed in place: projected again
    query = _rand(gen, torch.float64, *query_shape)
    torch.testing.assert_close(call(attn, source, query), call(plain["attn"], source, query))
    assert attn.key_cache.misses == 3


@requires_cpu_kernel
def test_jit_trace_keeps_the_mask_a_mask():
    """torch.jit.trace of a converted attention traced with a padding mask, then called with a
    mask with holes: the trace must not have frozen the choice of lengths over the mask (it read
    the first mask's values), which gave other weights than the original's."""
    plain, fused = _pair(CASES["allennlp_additive"], torch.float32)
    gen = torch.Generator().manual_seed(8)
    vector, matrix = _rand(gen, torch.float32, 3, 6), _rand(gen, torch.float32, 3, 5, 10)
    padding = torch.arange(5) < torch.tensor([5, 3, 2]).unsqueeze(1)
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation and tracer warnings
        traced = torch.jit.trace(fused["attn"], (vector, matrix, padding), check_trace=False)
        for mask in (padding, holes):
            want = plain["attn"](vector, matrix, mask)
            torch.testing.assert_close(traced(vector, matrix, mask), want)


@requires_cpu_kernel
def test_converted_location_attention_compiles_as_one_graph():
    """torch.compile of two Tacotron 2 steps through the stand-in: one graph, same results."""
    case = CASES["tacotron2_torchaudio"]
    plain, fused = _pair(case, torch.float32)
    gen = torch.Generator().manual_seed(6)
    memory = _rand(gen, torch.float32, 3, 7, 10).requires_grad_()
    mask = L.espnet_pad_mask(_lengths(3, 7))
    hidden = _rand(gen, torch.float32, 2, 3, 6)

    def steps(attn, memory):
        processed = attn.memory_layer(memory)
        prev = cum = torch.zeros(3, 7)
        outs = []
        for t in range(2):
            context, prev = attn(hidden[t], memory, processed, torch.stack((prev, cum), 1), mask)
            cum = cum + prev
            outs += [context, prev]
        return outs

    compiled = torch.compile(steps, fullgraph=True, backend="aot_eager")
    results = []
    for fn, model in ((steps, plain), (compiled, fused)):
        outs = fn(model["attn"], memory)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [memory, *model.parameters()])
        results.append((outs, grads))
    expected, got = results[0][0] + list(results[0][1]), results[1][0] + list(results[1][1])
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-4)


@requires_cpu_kernel
def test_location_attention_backward_between_steps():
    """A backward after each step (retain_graph, as a truncated loop would need for the shared
    processed memory): the values' gradients gathered per backward, equal to the original's."""
    case = CASES["tacotron2_nvidia"]
    plain, fused = _pair(case, torch.float64)
    grads = []
    for model in (plain, fused):
        gen = torch.Generator().manual_seed(8)
        attn = model["attn"]
        memory = _rand(gen, torch.float64, 3, 7, 10).requires_grad_()
        processed = attn.memory_layer(memory)
        prev = cum = torch.zeros(3, 7, dtype=torch.float64)
        for _ in range(3):
            hidden = _rand(gen, torch.float64, 3, 6)
            context, prev = attn(hidden, memory, processed, torch.stack((prev, cum), 1), None)
            (context * _rand(gen, torch.float64, 3, 10)).sum().backward(retain_graph=True)
            prev = prev.detach()
            cum = cum + prev
        grads.append([memory.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-9)


@requires_cpu_kernel
def test_converted_stateless_layout_copies_and_saves_after_a_step():
    """Tacotron 2's attention keeps no state; its stand-in's per-sequence helper must not stop a
    deep copy (e.g. an EMA model) or torch.save of the model after a forward with gradients."""
    _, fused = _pair(CASES["tacotron2_torchaudio"], torch.float32)
    outs = drive_tacotron2(fused["attn"], torch.float32, torch.Generator().manual_seed(9), [])
    copied = copy.deepcopy(fused)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    assert list(copied.state_dict()) == list(fused.state_dict())
    sum(o.sum() for o in outs).backward()  # the original graph still works


@requires_cpu_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_a_converted_model_copies_and_saves_after_a_step_where_the_original_does(name):
    """The runtime a stand-in keeps (its plans, their caches and step state) must not stop a deep
    copy (an EMA model) or torch.save after a forward with gradients where the original's own
    state allows them."""

    def copies_and_saves(model) -> bool:
        outs = CASES[name].drive(model["attn"], torch.float32, torch.Generator().manual_seed(9), [])
        try:
            copied = copy.deepcopy(model)
            torch.save(model, io.BytesIO())
        except RuntimeError:  # (e.g. a projection with a graph kept in the module's state)
            return False
        assert list(copied.state_dict()) == list(model.state_dict())
        sum(o.sum() for o in outs if o.requires_grad).backward()  # the graph still works
        return True

    plain, fused = _pair(CASES[name], torch.float32)
    assert copies_and_saves(fused) == copies_and_saves(plain)


@requires_cpu_kernel
@pytest.mark.parametrize("name", ["tacotron2_torchaudio", "fairseq_location"])
def test_location_steps_two_passes_over_one_memory_then_one_backward(name):
    """Two decoding passes share one memory (and, for Tacotron 2, one processed memory) before a
    single backward: the gradients gathered by the fused steps equal the original's."""
    case = CASES[name]
    plain, fused = _pair(case, torch.float64)
    grads = []
    for model in (plain, fused):
        gen = torch.Generator().manual_seed(11)
        attn = model["attn"]
        inputs: list[Tensor] = []
        outs = case.drive(attn, torch.float64, gen, inputs)
        outs += case.drive(attn, torch.float64, torch.Generator().manual_seed(11), inputs)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        leaves = [*model.parameters(), *inputs]
        found = torch.autograd.grad(loss, leaves, allow_unused=True)  # None: a bias that cancels
        pairs = zip(leaves, found, strict=True)
        grads.append([torch.zeros_like(t) if g is None else g for t, g in pairs])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-9)


@requires_cpu_kernel
@pytest.mark.parametrize("name", ["espnet_att_loc", "tacotron2_nvidia", "coqui_content"])
def test_location_and_gathered_steps_train_under_autocast(name):
    """Under CPU autocast (bfloat16) the gathered steps and the location term run forward and
    backward (the dtypes of a step's saved tensors and of its incoming gradient differ there) and
    give the original's gradients to bfloat16 precision."""
    case = CASES[name]
    plain, fused = _pair(case, torch.float32)
    grads = []
    for model in (plain, fused):
        inputs: list[Tensor] = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = case.drive(
                model["attn"], torch.float32, torch.Generator().manual_seed(5), inputs
            )
            loss = sum(o.float().sum() for o in outs if o.requires_grad)
        grads.append(torch.autograd.grad(loss, inputs))
    for a, b in zip(*grads, strict=True):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, atol=3e-2 * float(a.abs().max()), rtol=0)


@requires_cpu_kernel
@pytest.mark.parametrize(
    "name", ["espnet_att_loc", "fairseq_location", "tacotron2_nvidia", "coqui_location"]
)
def test_location_steps_of_a_bfloat16_model_run_the_fused_step(name, monkeypatch):
    """A location-aware module in bfloat16 (no autocast) trains through the fused step ops in
    bfloat16: its outputs and gradients err at most twice as much as the original's in bfloat16
    against the float64 truth (same bfloat16 parameters and inputs), plus 2 eps of the scale."""
    from seq2seq_fast.ops import location_attention

    calls = []
    step = location_attention._LocationStep.apply

    def counted(*args):
        calls.append(args[0].dtype)
        return step(*args)

    monkeypatch.setattr(location_attention._LocationStep, "apply", counted)
    # every random input and projection drawn in bfloat16, then widened: the same values for all
    monkeypatch.setattr(
        f"{__name__}._rand",
        lambda gen, dtype, *shape: torch.randn(shape, generator=gen, dtype=torch.bfloat16).to(
            dtype
        ),
    )
    case = CASES[name]
    plain, fused = _pair(case, torch.bfloat16)
    truth_model = copy.deepcopy(plain).to(torch.float64)
    calls.clear()  # (the conversion's own checks)
    outs_t, grads_t = _run(case, truth_model, torch.float64, seed=1)
    outs_a, grads_a = _run(case, plain, torch.bfloat16, seed=1)
    assert not calls
    outs_b, grads_b = _run(case, fused, torch.bfloat16, seed=1)
    assert calls and set(calls) == {torch.bfloat16}
    eps = torch.finfo(torch.bfloat16).eps
    pairs = [
        (f"output {i}", t, a, b)
        for i, (t, a, b) in enumerate(zip(outs_t, outs_a, outs_b, strict=True))
    ]
    pairs += [(k, grads_t[k], grads_a[k], grads_b[k]) for k in grads_t]
    for key, want, a, b in pairs:
        assert b.dtype == torch.bfloat16, key
        scale = float(want.abs().max())
        allowed = 2 * float((a.double() - want).abs().max()) + 2 * eps * max(scale, 1e-3)
        err = float((b.double() - want).abs().max())
        assert err <= allowed, f"{key}: error {err:.3e} > allowed {allowed:.3e}"
