"""The general path on the forms a decoder runs step after step: coverage fed back each step
(pointer-generator networks, flattened [B*T, A] rows or batched), checked over whole decoding runs
against the original (outputs and the gradients of every parameter and input, through the steps),
and that the fused op (not a plain fallback) computed the weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from seq2seq_fast.nn import fuse_attention_report
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights
from seq2seq_fast.ops import fused_available
from tests.convert import layouts_traced as T
from tests.convert.test_convert_traced import _assert_close, _run

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)


def _no_plain(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the replacement fell back to plain ops")

    monkeypatch.setattr(TracedWeights, "_plain", fail)


def _decode_coverage(model, flattened: bool, batch: int, frames: int, steps: int, dtype, seed):
    """``steps`` decoder steps, the coverage fed back each step; outputs and the gradients of a
    random projection of them (parameters by name, then the inputs)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    feats = randn(batch * frames, T.A) if flattened else randn(batch, frames, T.A)
    enc_out = randn(batch, frames, T.K)
    pad = T.lengths_mask(batch, frames).to(dtype)
    coverage = torch.zeros(batch, frames, dtype=dtype)
    inputs = [feats.requires_grad_(), enc_out.requires_grad_()]
    outs = []
    for _ in range(steps):
        state = randn(batch, T.Q).requires_grad_()
        inputs.append(state)
        context, weights, coverage = model(state, feats, enc_out, pad, coverage)
        outs += [context, weights, coverage]
    loss = sum((o * randn(*o.shape)).sum() for o in outs)
    named = sorted(model.named_parameters())
    grads = torch.autograd.grad(loss, [p for _, p in named] + inputs)
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "batched"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_coverage_fed_back_each_step(flattened, dtype, monkeypatch):
    _no_plain(monkeypatch)
    torch.manual_seed(0)
    make = T.CoverageAttention if flattened else T.CoverageBatched
    original = T._Holder(make()).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    calls = TracedWeights.calls
    for batch, frames in ((3, 6), (2, 9)):
        got = _decode_coverage(model, flattened, batch, frames, 4, dtype, seed=frames)
        want = _decode_coverage(original, flattened, batch, frames, 4, dtype, seed=frames)
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")
    assert [r.path for r in report.replaced] == ["att"], str(report)
    assert TracedWeights.calls >= calls + 7  # every step after the first by the fused op


CONVERTING = [case for case in T.CASES if case.converts is not None]


@pytest.mark.parametrize("case", CONVERTING, ids=[case.name for case in CONVERTING])
def test_converted_layouts_run_the_fused_op_not_a_fallback(case, monkeypatch):
    """Every converting layout of tests/convert/layouts_traced.py (score biases, temperatures,
    heads, learned queries, coverage, small concat widths among them) has its weights computed by
    the fused op on ordinary calls: the replacement's plain-ops fallback never runs."""
    _no_plain(monkeypatch)
    dtype = next(d for d in (torch.float64, torch.float32) if case.converts_at(d) is not None)
    torch.manual_seed(0)
    original = case.make().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    for batch, frames in ((4, 7), (3, 5)):
        torch.manual_seed(batch)
        args = case.inputs(batch, frames, dtype)
        calls = TracedWeights.calls
        got, want = model(*args), original(*args)
        assert TracedWeights.calls > calls
        _assert_close(
            [t for t in torch.utils._pytree.tree_leaves(got) if isinstance(t, torch.Tensor)],
            [t for t in torch.utils._pytree.tree_leaves(want) if isinstance(t, torch.Tensor)],
            dtype,
            "outputs",
        )
    assert [r.path for r in report.replaced] == [case.converts], str(report)


class _Smoothed(torch.nn.Module):
    """Sigmoid normalisation spelled as kospeech and ClovaCall spell it (the sum's axis put back
    by unsqueeze or an index, not keepdim); ``wrong_axis``: put back at another axis, which is
    not the normalisation (a [B, 1, T]-shaped query row times [B, T, 1]: left alone)."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.q = torch.nn.Linear(6, 6, bias=False)
        self.k = torch.nn.Linear(6, 6, bias=False)
        self.v = torch.nn.Linear(6, 1)

    def forward(self, query, memory, valid):
        e = self.v(torch.tanh(self.q(query) + self.k(memory))).squeeze(-1)
        e = torch.sigmoid(e.masked_fill(~valid, -1e4))
        total = {
            "keepdim": lambda: e.sum(-1, keepdim=True),
            "unsqueeze": lambda: e.sum(-1).unsqueeze(-1),
            "unsqueeze1": lambda: e.sum(1).unsqueeze(1),
            "unsqueeze_keyword": lambda: e.sum(dim=-1).unsqueeze(dim=-1),  # openspeech
            "index": lambda: e.sum(-1)[:, None],
            "wrong_axis": lambda: e.sum(-1)[None, :],
        }[self.spelling]()
        w = torch.div(e, total)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


def _smoothed_call(batch: int, frames: int):
    gen = torch.Generator().manual_seed(batch + frames)
    query = torch.randn(batch, 1, 6, generator=gen, dtype=torch.float64)
    memory = torch.randn(batch, frames, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([frames] + [max(1, frames - 2)] * (batch - 1))
    return query, memory, torch.arange(frames) < lengths.unsqueeze(1)


@pytest.mark.parametrize(
    "spelling", ["keepdim", "unsqueeze", "unsqueeze1", "unsqueeze_keyword", "index", "wrong_axis"]
)
def test_sigmoid_normalisation_in_its_spellings(spelling):
    """sigmoid(e) / sigmoid(e).sum(-1).unsqueeze(-1) (kospeech, ClovaCall) was refused: only
    keepdim=True was taken. Each spelling converts and matches; the wrong axis does not."""
    torch.manual_seed(0)
    original = torch.nn.ModuleDict({"att": _Smoothed(spelling)}).double()
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    if spelling == "wrong_axis":  # [B, T] / [1, B]: broadcasts only when B == T
        args = _smoothed_call(4, 4)
        _assert_close(model["att"](*args), original["att"](*args), torch.float64, "look-alike")
        assert report.count == 0, str(report)
        return
    for batch, frames in ((3, 5), (2, 7)):
        args = _smoothed_call(batch, frames)
        _assert_close(model["att"](*args), original["att"](*args), torch.float64, "outputs")
    assert report.count == 1 and "sigmoid-normalised" in str(report), str(report)


class _FlattenedPooling(torch.nn.Module):
    """Keys-only attention pooling whose [B, T, 1] scores are flattened (an nn.Sequential ending
    in nn.Flatten, as some text classifiers write it); ``merged``: [B, n, T] scores flattened
    to [B, n * T] before the softmax, which is not the op (left alone)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.score = torch.nn.Sequential(
            torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1), torch.nn.Flatten()
        )

    def forward(self, x):  # x [B, T, 6] (merged: [B, n, T, 6])
        if self.how == "merged":
            e = torch.flatten(self.score[:3](x), 1)  # [B, n * T]
            w = torch.softmax(e, -1).view(x.shape[:3])
            return (x * w.unsqueeze(-1)).sum(2)
        e = self.score(x) if self.how == "module" else torch.flatten(self.score[:3](x), 1)
        return (x * torch.softmax(e, -1).unsqueeze(2)).sum(1)


def _assert_fused_and_matching(converted, original, args, dtype) -> None:
    """The converted module's call runs the fused op, and its outputs and gradients (parameters,
    then inputs) match the original's."""
    calls = TracedWeights.calls
    got, want = _run(converted, args), _run(original, args)
    assert TracedWeights.calls > calls
    _assert_close(got[0], want[0], dtype, "outputs")
    _assert_close(got[1], want[1], dtype, "gradients")


def _converts_and_matches(attention, dtype, call, example: tuple, shapes: tuple) -> str:
    """``attention`` (in a holder) converted with ``call(*example)`` as its example call, one
    module, then fused and matching the original on ``call(*shape)`` for each of ``shapes``;
    the report's text."""
    original = T._Holder(attention).to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model, example_inputs=call(*example))
    assert report.count == 1, str(report)
    for shape in shapes:
        _assert_fused_and_matching(model.att, original.att, call(*shape), dtype)
    return str(report)


def _state_and_time_major_memory(seed: int, dtype, state: int, key: int):
    """A call maker for ``(state [B, state], memory [T, B, key])`` of a given (batch, frames)."""
    gen = torch.Generator().manual_seed(seed)

    def call(batch, frames):
        return (
            torch.randn(batch, state, generator=gen, dtype=dtype),
            torch.randn(frames, batch, key, generator=gen, dtype=dtype),
        )

    return call


class _MatmulPooling(torch.nn.Module):
    """Learned-query pooling with its projection written out, tanh(h @ W + b) against a context
    vector (HAN's matrix_mul, vectorised), over time-major or batch-major h, the bias [A] or
    [1, A]; or with no bias, tanh(h @ W) (RecBole SINE's prototype attention)."""

    def __init__(self, time_major: bool, bias_shape: tuple | None) -> None:
        super().__init__()
        self.axis = 0 if time_major else 1
        self.weight = torch.nn.Parameter(torch.randn(6, 4) * 0.3)
        self.bias = None
        if bias_shape is not None:
            self.bias = torch.nn.Parameter(torch.randn(*bias_shape) * 0.3)
        self.context = torch.nn.Parameter(torch.randn(4, 1) * 0.3)

    def forward(self, h):
        if self.bias is None:
            u = torch.tanh(h @ self.weight)
        else:
            u = torch.tanh(torch.matmul(h, self.weight) + self.bias)
        w = torch.softmax(torch.matmul(u, self.context).squeeze(-1), dim=self.axis)
        return (h * w.unsqueeze(-1)).sum(self.axis)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("bias_shape", [(4,), (1, 4), None], ids=["bias", "bias_row", "no_bias"])
@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
def test_pooling_with_its_projection_written_out(time_major, bias_shape, dtype):
    """tanh(h @ W + b) was refused ("every term of the sum varies along the softmax's axis"),
    although b varies along none: only one Linear's tanh(W h + b) was taken as pooling. Without
    the bias, tanh(h @ W) was not even watched (only a Linear's output counted as a
    projection), and went unreported."""
    torch.manual_seed(0)
    original = T._Holder(_MatmulPooling(time_major, bias_shape)).to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 6, generator=gen, dtype=dtype)
    report = fuse_attention_report(model, example_inputs=(x,))
    assert report.count == 1, str(report)
    for shape in ((5, 3, 6), (7, 2, 6)):
        x = torch.randn(shape, generator=gen, dtype=dtype)
        _assert_fused_and_matching(model.att, original.att, (x,), dtype)


class _Branches(torch.nn.Module):
    """K attentions sharing one tanh (AttentionDeepMIL's branches, CLAM's multi-branch net, the
    structured self-attention's hops): scores Linear(A, K) over tanh(Linear(D, A)), a softmax
    over the bag's instances; or, as a look-alike that is no attention, a classifier's
    log_softmax over the K outputs."""

    def __init__(self, branches: int, classifier: bool = False) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(6, 5)
        self.scores = torch.nn.Linear(5, branches)
        self.classifier = classifier

    def forward(self, h):  # h [N, 6], one bag of N instances
        scores = self.scores(torch.tanh(self.hidden(h)))  # [N, K]
        if self.classifier:
            return torch.log_softmax(scores, dim=-1)
        return torch.softmax(scores.t(), dim=1) @ h  # [K, 6]


@pytest.mark.parametrize("branches", [1, 3])
def test_attentions_sharing_one_tanh_are_reported_not_fused(branches):
    """One branch is attention pooling and converts; several were left alone without a word
    ("0 replaced, 0 skipped"): now reported, saying why. A classifier's tanh layer before its
    log_softmax over the same outputs stays unreported."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    for classifier in (False, True) if branches > 1 else (False,):
        original = T._Holder(_Branches(branches, classifier)).double()
        model = copy.deepcopy(original)
        h = torch.randn(7, 6, generator=gen, dtype=torch.float64)
        report = fuse_attention_report(model, example_inputs=(h,))
        _assert_close([model(h)], [original(h)], torch.float64, "outputs")
        if classifier:
            assert (report.count, len(report.skipped)) == (0, 0), str(report)
        elif branches == 1:
            assert report.count == 1, str(report)
        else:
            assert report.count == 0 and len(report.skipped) == 1, str(report)
            assert "several score vectors over one tanh" in str(report), str(report)


@pytest.mark.parametrize("how", ["module", "function", "merged"])
def test_scores_flattened_before_the_softmax(how):
    """torch.flatten / nn.Flatten of [B, T, 1] scores is a reshape like squeeze(-1): it was refused
    ("the scores go into flatten")."""
    torch.manual_seed(0)
    original = torch.nn.ModuleDict({"att": _FlattenedPooling(how)}).double()
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    gen = torch.Generator().manual_seed(2)
    for shape in ((3, 5, 6), (2, 7, 6)) if how != "merged" else ((3, 2, 5, 6),):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        _assert_close([model["att"](x)], [original["att"](x)], torch.float64, "outputs")
    assert report.count == (0 if how == "merged" else 1), str(report)


@pytest.mark.parametrize("relu", [False, True], ids=["tanh", "relu"])
def test_a_layouts_children_called_otherwise_go_to_the_general_path(relu):
    """A module with the concat layout's children and a call of its own (keon's seq2seq) is not
    refused for the layout's call ("TypeError: forward() takes 3 positional arguments"): the
    general path sees its real first call and converts it (tanh) or leaves it alone (ReLU)."""
    torch.manual_seed(0)
    make = (
        (lambda: T.ConcatChildrenOwnCall(torch.nn.functional.relu))
        if relu
        else T.ConcatChildrenOwnCall
    )
    model = T._Holder(make()).double()
    report = fuse_attention_report(model)
    assert report.skipped == [] and "att" in report.watching, str(report)
    args = T._time_major_pair_call(3, 5, torch.float64)
    model(*args)
    assert report.skipped == [], str(report)
    assert [r.path for r in report.replaced] == ([] if relu else ["att"]), str(report)
    # the attention itself given to fuse_attention is not "a recognised attention module"
    fuse_attention_report(make())


def test_refusal_reasons_name_the_call_and_the_number():
    """A pointer's clipped logits C * tanh(u) are refused, and the reason names the call and the
    factor as a reader knows them (not "<built-in method tanh ...>" or "a tensor of shape None")."""
    model = T._Holder(T.ConvPointer(10.0)).double()
    report = fuse_attention_report(model)
    model(*T._pointer_conv_call(3, 5, torch.float64))
    (skipped,) = report.skipped
    assert "the scores go into 'tanh' before any softmax" in skipped.reason, skipped.reason
    assert "multiplied by the number 10.0" in skipped.reason, skipped.reason
    assert "built-in" not in skipped.reason and "None" not in skipped.reason, skipped.reason


def test_a_softmax_over_the_batch_is_refused_saying_so():
    """A softmax over the batch axis (a copied decoder's dim=0): every term varies along it, and
    the reason says that, with the axis and the shape, not that no term does."""
    from tests.convert import layouts_lookalikes as L

    model = T._Holder(L.SoftmaxOverBatch()).double()
    report = fuse_attention_report(model)
    model(*T._feature_call(3, 5, torch.float64))
    (skipped,) = report.skipped
    assert "every term of the sum varies along the softmax's axis (axis 0 of" in skipped.reason
    assert "the softmax runs over the batch's axis" in skipped.reason, skipped.reason


def test_a_gated_tanh_is_refused_naming_the_gate():
    from tests.convert import layouts_lookalikes as L

    model = T._Holder(L.GatedTanh()).double()
    report = fuse_attention_report(model)
    model(*T._feature_call(3, 5, torch.float64))
    (skipped,) = report.skipped
    assert "the tanh is multiplied by a tensor of shape (3, 5, " in skipped.reason, skipped.reason
    assert "(made by 'sigmoid'), and the product goes into" in skipped.reason, skipped.reason


class _GatedWithDropouts(torch.nn.Module):
    """CLAM's ``Attn_Net_Gated``: Sequential(Linear, Tanh, Dropout) times Sequential(Linear,
    Sigmoid, Dropout), then the score layer; a softmax over the bag's instances."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Dropout())
        self.b = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Sigmoid(), torch.nn.Dropout())
        self.c = torch.nn.Linear(4, 1)

    def forward(self, h):  # h [N, 6]
        return torch.softmax(self.c(self.a(h) * self.b(h)).t(), dim=1) @ h


def test_a_gated_tanh_in_eval_mode_is_refused_naming_the_gate():
    """The dropouts do nothing in eval mode: the reason named the gate's dropout, not its
    sigmoid."""
    model = T._Holder(_GatedWithDropouts()).double().eval()
    report = fuse_attention_report(model, example_inputs=(torch.randn(7, 6).double(),))
    (skipped,) = report.skipped
    assert "(made by 'sigmoid'), and the product goes into" in skipped.reason, skipped.reason


class _HandWrittenCell(torch.nn.Module):
    """A recurrent cell written out (no attention): an LSTM's ``o * tanh(f * c + i * g)`` or a
    GRU's ``(1 - z) * tanh(W x + r * U h) + z * h``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.x2h = torch.nn.Linear(6, 4 * 5)
        self.h2h = torch.nn.Linear(5, 4 * 5)

    def forward(self, x, h, c):
        i, f, g, o = (self.x2h(x) + self.h2h(h)).chunk(4, -1)
        if self.kind == "lstm":
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        z, r = torch.sigmoid(i), torch.sigmoid(f)
        n = torch.tanh(g + r * o)
        return (1 - z) * n + z * h, c


class _Tagger(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.cell = _HandWrittenCell(kind)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, xs):
        h = c = xs.new_zeros(xs.size(0), 5)
        steps = []
        for t in range(xs.size(1)):
            h, c = self.cell(xs[:, t], h, c)
            steps.append(torch.log_softmax(self.out(h), -1))
        return torch.stack(steps, 1)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_hand_written_recurrent_cell_is_not_reported(kind):
    """It was listed among the skipped ("computes a tanh over a sum, but no softmax over it"):
    its tanh goes into a gate's elementwise product, not a projection onto a vector."""
    model = _Tagger(kind).double()
    xs = torch.randn(2, 4, 6, dtype=torch.float64)
    want = model(xs)
    report = fuse_attention_report(model, example_inputs=(xs,))
    assert (report.count, len(report.skipped), report.watching) == (0, 0, []), str(report)
    _assert_close([model(xs)], [want], torch.float64, "outputs")


class _EpsilonSoftmaxPooling(torch.nn.Module):
    """Match-LSTM's pointer attention: scores times the 0/1 mask, then a softmax written out,
    ``exp(x - max) * mask / (sum + 1e-6)`` (not the op's normaliser: the epsilon)."""

    def __init__(self) -> None:
        super().__init__()
        self.w_q = torch.nn.Linear(6, 6, bias=False)
        self.w_p = torch.nn.Linear(6, 6)
        self.w = torch.nn.Linear(6, 1)

    def forward(self, q, p, mask):
        scores = self.w(torch.tanh(self.w_q(q) + self.w_p(p).unsqueeze(1))).squeeze(-1) * mask
        e = torch.exp(scores - scores.max(-1, keepdim=True)[0]) * mask
        weights = e / (e.sum(-1, keepdim=True) + 1e-6)
        return (weights.unsqueeze(1) @ q).squeeze(1), weights


def test_scores_times_a_mask_before_a_written_out_softmax_are_reported():
    """The scores times a 0/1 mask of their shape were taken for a gate's product (as in a
    recurrent cell), and the module went unreported: "0 replaced, 0 skipped". A gate multiplies
    the tanh's own output; this product comes after the projection onto the score vector."""
    model = _EpsilonSoftmaxPooling().double()
    q, p = torch.randn(3, 7, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.float64)
    mask[1, 5:] = 0
    want = model(q, p, mask)
    report = fuse_attention_report(model, example_inputs=(q, p, mask))
    (skipped,) = report.skipped
    assert report.count == 0 and "no softmax over it" in skipped.reason, str(report)
    assert "went into 'exp'" in skipped.reason, skipped.reason
    _assert_close(model(q, p, mask), want, torch.float64, "outputs")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_decoder_around_an_attention_is_not_converted_too(dtype):
    """A decoder whose output layer is Linear, tanh, Linear to the vocabulary, log_softmax
    (openspeech's) around a converted attention: only the attention converts. Before, the
    decoder was converted as well (counted twice, run through TorchDynamo, a warning about a
    compiled model at each call)."""
    torch.manual_seed(0)
    original = T.TanhOutputDecoder().to(dtype)
    model = copy.deepcopy(original)
    args = T.tanh_output_decoder_call(3, 7, dtype)
    report = fuse_attention_report(model, example_inputs=args)
    assert [r.path for r in report.replaced] == ["attention"], str(report)
    assert report.skipped == [], str(report)
    assert type(model) is T.TanhOutputDecoder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, frames in ((3, 7), (2, 5)):
            call = T.tanh_output_decoder_call(batch, frames, dtype)
            want, got = original(*call), model(*call)
            _assert_close(got, want, dtype, "outputs")
            grads = [
                torch.autograd.grad(out.exp().sum(), list(m.parameters()))
                for m, out in ((original, want), (model, got))
            ]
            _assert_close(grads[1], grads[0], dtype, "gradients")
    ours = [str(w.message) for w in caught if "fuse_attention" in str(w.message)]
    assert ours == [], ours


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_an_attention_whose_first_call_has_none_is_watched_on(dtype):
    """An intra-decoder attention attends to nothing at the first step (its first call computes
    no tanh). It was dropped from the watch (in neither replaced nor skipped) and its caller was
    converted with it inside. Now its next calls are watched and it converts itself."""
    torch.manual_seed(0)
    original = T.IntraDecoder().to(dtype)
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    for call in range(3):
        states = torch.randn(3, 5, T.Q, dtype=dtype)
        want, got = original(states), model(states)
        _assert_close(got, want, dtype, f"outputs of call {call}")
        grads = [
            torch.autograd.grad((out * out).sum(), list(m.parameters()))
            for m, out in ((original, want), (model, got))
        ]
        _assert_close(grads[1], grads[0], dtype, f"gradients of call {call}")
    assert [r.path for r in report.replaced] == ["att"], str(report)
    assert report.skipped == [] and report.watching == [], str(report)
    assert type(model) is T.IntraDecoder


def test_a_skipped_attention_is_reported_once_not_again_for_its_caller():
    """An attention normalised otherwise than by a softmax (intra-temporal: exp over the sum of
    the earlier steps'), stepped by a decoder: reported once, at itself. Its later steps' tanh
    (in the decoder's first call) were taken for the decoder's, which was reported too."""
    torch.manual_seed(0)
    original = T.TemporalDecoder().double()
    model = copy.deepcopy(original)
    report = fuse_attention_report(model)
    args = (
        torch.randn(3, 4, T.Q, dtype=torch.float64),
        torch.randn(3, 6, T.K, dtype=torch.float64),
    )
    _assert_close(model(*args), original(*args), torch.float64, "outputs")
    assert report.replaced == [], str(report)
    assert [s.path for s in report.skipped] == ["att"], str(report)
    # the reason names where the scores went instead of a softmax
    assert "(its values went into 'exp'; the fused op normalises by" in report.skipped[0].reason


class _BreakAfterTanh(torch.nn.Module):
    """Pooling whose forward TorchDynamo breaks right after the tanh (an RNN call, a print, a
    data-dependent branch there in real code)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)
        self.v = torch.nn.Linear(4, 1, bias=False)

    def forward(self, h):
        u = torch.tanh(self.proj(h))
        torch._dynamo.graph_break()
        w = torch.softmax(self.v(u).squeeze(-1), dim=1)
        return (w.unsqueeze(-1) * h).sum(1)


def test_a_graph_break_after_the_tanh_is_named_so():
    """The reason named the graph's end as a call ("the tanh goes into 'output'")."""
    model = T._Holder(_BreakAfterTanh()).double()
    report = fuse_attention_report(
        model, example_inputs=(torch.randn(3, 5, 6, dtype=torch.float64),)
    )
    (skipped,) = report.skipped
    assert "the tanh's value leaves the traced graph" in skipped.reason, skipped.reason
    assert "'output'" not in skipped.reason, skipped.reason


class _LengthsChecked(torch.nn.Module):
    """Texar-PyTorch's ``BahdanauAttention`` with ``memory_sequence_length``: its mask helper
    checks every length in a Python loop (``for v in lengths: if v <= 0: raise``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(6, 4, bias=False)
        self.v = torch.nn.Parameter(torch.randn(4))

    def forward(self, query, memory, lengths):
        score = torch.sum(self.v * torch.tanh(self.k(memory) + self.q(query).unsqueeze(1)), 2)
        for length in lengths:
            if length <= 0:
                raise ValueError("every length must be positive")
        keep = torch.arange(score.shape[1])[None] < lengths[:, None]
        return torch.softmax(score.masked_fill(~keep, float("-inf")), dim=-1)


def test_a_frame_dynamo_runs_as_python_is_named_so():
    """A graph break inside a loop makes TorchDynamo skip the whole frame: the reason said "no
    tanh in the graphs", though the forward has one."""
    model = T._Holder(_LengthsChecked()).double()
    call = (torch.randn(3, 5).double(), torch.randn(3, 6, 6).double(), torch.tensor([6, 4, 2]))
    report = fuse_attention_report(model, example_inputs=call)
    (skipped,) = report.skipped
    assert "captured no graph of its forward" in skipped.reason, skipped.reason
    assert "graph break falls inside a loop" in skipped.reason, skipped.reason


class _NumpyFill(torch.nn.Module):
    """neural_sp's ``AttentionMechanism``: the fill value read through numpy between the scores
    and the softmax, ``float(np.finfo(torch.tensor(0, dtype=e.dtype).numpy().dtype).min)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_key = torch.nn.Linear(6, 5)
        self.w_query = torch.nn.Linear(4, 5, bias=False)
        self.v = torch.nn.Linear(5, 1, bias=False)

    def forward(self, key, query, mask):
        import numpy as np

        e = self.v(torch.tanh(self.w_key(key) + self.w_query(query).unsqueeze(1))).squeeze(2)
        fill = float(np.finfo(torch.tensor(0, dtype=e.dtype).numpy().dtype).min)
        return torch.softmax(e.masked_fill(mask == 0, fill), dim=-1)


def test_the_graph_break_that_cuts_the_scores_from_the_softmax_is_named():
    """The reason gave examples of what breaks a graph ("such as a Python loop ... or a
    .item()"), not the break: here TorchDynamo's own message about the numpy call."""
    model = T._Holder(_NumpyFill()).double()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    report = fuse_attention_report(
        model, example_inputs=(torch.randn(2, 4, 6).double(), torch.randn(2, 4).double(), mask)
    )
    (skipped,) = report.skipped
    assert "ends between the scores and the softmax" in skipped.reason, skipped.reason
    assert "TorchDynamo's graph break: " in skipped.reason, skipped.reason
    assert "ndarray" in skipped.reason.split("TorchDynamo's graph break: ")[1], skipped.reason


class _RecurrentClassifier(torch.nn.Module):
    """A text classifier's forward: a bidirectional LSTM or GRU (over a packed sequence, or the
    padded batch), then additive attention pooling over its outputs, masked by the lengths."""

    def __init__(self, cell: str, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
        self.rnn = rnn(6, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.att = torch.nn.Linear(10, 8)
        self.v = torch.nn.Linear(8, 1, bias=False)
        self.out = torch.nn.Linear(10, 3)

    def forward(self, x, lengths):
        if self.packed:
            rows = torch.nn.utils.rnn.pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=False
            )
            h, _ = self.rnn(rows)
            h, _ = torch.nn.utils.rnn.pad_packed_sequence(h, True, total_length=x.shape[1])
        else:
            h, _ = self.rnn(x)
        e = self.v(torch.tanh(self.att(h))).squeeze(-1)
        valid = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
        w = torch.softmax(e.masked_fill(~valid, float("-inf")), dim=1)
        return self.out((w.unsqueeze(-1) * h).sum(1))


@pytest.mark.parametrize(
    "cell,packed,dtype",
    [("lstm", True, torch.float64), ("gru", False, torch.float32)],
    ids=["lstm-packed-fp64", "gru-padded-fp32"],
)
def test_attention_after_an_rnn_in_the_same_forward(cell, packed, dtype):
    """TorchDynamo breaks the graph at an nn.LSTM / nn.GRU call: the attention after it was never
    traced ("no tanh in the graphs TorchDynamo captured"). The RNN is traced into the graph."""
    torch.manual_seed(0)
    original = T._Holder(_RecurrentClassifier(cell, packed)).to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(1)

    def call(batch, frames):
        lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
        lengths[0] = frames
        return torch.randn(batch, frames, 6, generator=gen, dtype=dtype), lengths

    report = fuse_attention_report(model, example_inputs=call(3, 5))
    assert report.count == 1, str(report)
    for batch, frames in ((4, 7), (1, 4)):
        args = call(batch, frames)
        _assert_fused_and_matching(model.att, original.att, args, dtype)


class _FlattenedSum(torch.nn.Module):
    """The sum q + k formed at full size [B, Tq, Tk, A], flattened into rows, then tanh and the
    score layer, viewed back (eladhoffer/seq2seq.pytorch's ``calc_score``: ``sum_qk.view(b *
    t_k * t_q, n)``), masked by a fill, softmax over the keys."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = torch.nn.Linear(6, 8)
        self.k = torch.nn.Linear(5, 8, bias=False)
        self.score = torch.nn.Linear(8, 1)

    def forward(self, query, memory, pad):  # query [B, Tq, 6], memory [B, Tk, 5], pad [B, Tk]
        b, t_q, t_k = query.shape[0], query.shape[1], memory.shape[1]
        total = self.q(query).unsqueeze(2) + self.k(memory).unsqueeze(1)  # [B, Tq, Tk, 8]
        rows = total.view(b * t_q * t_k, 8) if self.how == "view" else total.reshape(-1, 8)
        e = self.score(torch.tanh(rows)).view(b, t_q, t_k)
        e = e.masked_fill(pad.unsqueeze(1), -1e12)
        w = torch.softmax(e, dim=2)
        return torch.bmm(w, memory), w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("how", ["view", "reshape"])
def test_a_sum_flattened_into_rows_before_the_tanh(how, dtype):
    """Neither converted nor reported: the watch lost the sum at the view, and the match saw a
    tanh of a view. tanh(view(sum)) is view(tanh(sum)), which converts."""
    torch.manual_seed(0)
    attention = _FlattenedSum(how)
    gen = torch.Generator().manual_seed(2)

    def call(batch, queries, keys):
        pad = torch.arange(keys) >= torch.randint(1, keys + 1, (batch,), generator=gen)[:, None]
        return (
            torch.randn(batch, queries, 6, generator=gen, dtype=dtype),
            torch.randn(batch, keys, 5, generator=gen, dtype=dtype),
            pad,
        )

    _converts_and_matches(attention, dtype, call, (3, 1, 5), ((4, 1, 7), (2, 3, 6)))


class _SelfAttentiveRows(torch.nn.Module):
    """Lin et al.'s self-attentive sentence embedding, one hop, as ExplorerFreda's
    ``SelfAttentiveEncoder`` writes it: the keys flattened into rows before the first layer,
    ``ws2(tanh(ws1(x.view(-1, D))))``, the scores viewed back to [B, T, 1] (or [B, T]), the
    padding filled, a softmax over the words."""

    def __init__(self, back: int) -> None:
        super().__init__()
        self.back = back
        self.ws1 = torch.nn.Linear(6, 5, bias=False)
        self.ws2 = torch.nn.Linear(5, 1, bias=False)

    def forward(self, x, pad):  # x [B, T, 6], pad [B, T]
        size = x.size()
        scores = self.ws2(torch.tanh(self.ws1(x.view(-1, size[2]))))
        if self.back == 3:
            scores = scores.view(size[0], size[1], -1).transpose(1, 2).squeeze(1)
        else:
            scores = scores.view(size[0], size[1])
        w = torch.softmax(scores.masked_fill(pad, -10000.0), dim=1)
        return torch.bmm(w.unsqueeze(1), x).squeeze(1), w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("back", [3, 2], ids=["to_BT1", "to_BT"])
def test_keys_flattened_into_rows_before_the_first_layer(back, dtype):
    """Refused when viewed back to [B, T, 1]: "view [18, 1] -> [3, 6, 1] mixes axes" (only a view
    back to [B, T] was split into [B, T] rows)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(6)

    def call(batch, words):
        pad = torch.arange(words) >= torch.randint(1, words + 1, (batch,), generator=gen)[:, None]
        return torch.randn(batch, words, 6, generator=gen, dtype=dtype), pad

    _converts_and_matches(_SelfAttentiveRows(back), dtype, call, (3, 6), ((4, 7), (2, 3)))


class _TimeFirstRows(torch.nn.Module):
    """MORAN's ``AttentionCell`` (MORAN_v2, models/asrn_res.py): time-first features [T, B, C]
    flattened into rows, the state's projection ``view(1, B, H).expand(T, B, H)`` flattened the
    same way, a view of the [T*B, H] tanh to its own shape (or none), the scores viewed to
    [T, B], a softmax over time (axis 0)."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.view = view
        self.i2h = torch.nn.Linear(6, 5, bias=False)
        self.h2h = torch.nn.Linear(5, 5)
        self.score = torch.nn.Linear(5, 1, bias=False)

    def forward(self, hidden, feats):  # hidden [B, 5], feats [T, B, 6]
        t, b, c = feats.size()
        keys = self.i2h(feats.view(-1, c))
        query = self.h2h(hidden).view(1, b, 5).expand(t, b, 5).contiguous().view(-1, 5)
        energy = torch.tanh(keys + query)
        energy = energy.view(-1, 5) if self.view else energy
        alpha = torch.softmax(self.score(energy).view(t, b), 0)
        return (feats * alpha.view(t, b, 1).expand(t, b, c)).sum(0), alpha


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("view", [True, False], ids=["view", "no_view"])
def test_time_first_rows_with_the_state_expanded_over_time(view, dtype):
    """Refused: with the view, "the tanh goes into 'view'"; without, "every term of the sum
    varies along the softmax's axis" (only a state expanded along axis 1 was seen through)."""
    torch.manual_seed(0)
    call = _state_and_time_major_memory(7, dtype, 5, 6)
    report = _converts_and_matches(_TimeFirstRows(view), dtype, call, (3, 7), ((2, 5), (4, 3)))
    assert "1 query and 1 key term(s)" in report, report


class _FlattenedTanh(torch.nn.Module):
    """The tanh [B, T, A] flattened into rows for the score layer, and the scores viewed back to
    [B, T, 1] (soobinseo/Tacotron-pytorch's ``v(tanh(keys + W2(d_t)).view(-1, A)).view(-1, T,
    1)``) or to [B, T] (self-critical.pytorch's ``alpha_net``), its query expanded to the keys'
    shape before the sum."""

    def __init__(self, back: str) -> None:
        super().__init__()
        self.back = back
        self.W1 = torch.nn.Linear(5, 4, bias=False)
        self.W2 = torch.nn.Linear(6, 4, bias=False)
        self.v = torch.nn.Linear(4, 1, bias=False)

    def forward(self, d_t, memory):  # d_t [B, 6], memory [B, T, 5]
        t = memory.shape[1]
        keys = self.W1(memory.contiguous().view(-1, 5)).view(-1, t, 4)
        query = self.W2(d_t).unsqueeze(1).expand_as(keys)
        rows = self.v(torch.tanh(keys + query).view(-1, 4))
        e = rows.view(-1, t, 1).squeeze(2) if self.back == "keep_one" else rows.view(-1, t)
        w = torch.softmax(e, dim=1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("back", ["keep_one", "rows"])
def test_a_tanh_flattened_into_rows_for_the_score_layer(back, dtype):
    """Refused as "the tanh goes into 'view'" when the scores were viewed back to [B, T, 1]:
    the pass that takes the projection on the tanh itself took [B, T] only."""
    torch.manual_seed(0)
    attention = _FlattenedTanh(back)
    gen = torch.Generator().manual_seed(3)

    def call(batch, frames):
        return (
            torch.randn(batch, 6, generator=gen, dtype=dtype),
            torch.randn(batch, frames, 5, generator=gen, dtype=dtype),
        )

    _converts_and_matches(attention, dtype, call, (3, 5), ((4, 7), (2, 3)))


class _TimeMajorRowsPermuted(torch.nn.Module):
    """Attention_ocr.pytorch's ``AttentiondecoderV2`` (models/crnn_lang.py): the state [1, B, H]
    plus the time-major keys [T, B, H] flattened into rows before the tanh (or the tanh viewed
    into rows), the score layer on the rows, the scores viewed to [T, 1, B] and permuted to
    [B, 1, T], a softmax over time."""

    def __init__(self, flat_sum: bool) -> None:
        super().__init__()
        self.flat_sum = flat_sum
        self.proj = torch.nn.Linear(5, 4, bias=False)
        self.vat = torch.nn.Linear(4, 1)

    def forward(self, hidden, encoder_outputs):  # hidden [1, B, 4], encoder_outputs [T, B, 5]
        batch = encoder_outputs.shape[1]
        total = hidden + self.proj(encoder_outputs)
        if self.flat_sum:
            energy = torch.tanh(total.view(-1, total.shape[-1]))
        else:
            energy = torch.tanh(total).view(-1, total.shape[-1])
        alpha = self.vat(energy).view(-1, 1, batch).permute((2, 1, 0))
        alpha = torch.softmax(alpha, dim=2)
        return torch.matmul(alpha, encoder_outputs.permute((1, 0, 2))), alpha


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("flat_sum", [True, False], ids=["sum_flattened", "tanh_flattened"])
def test_time_major_rows_viewed_with_the_one_axis_elsewhere(flat_sum, dtype):
    """Refused: "the tanh goes into 'view', not a projection onto a vector". The scores of the
    rows were taken back only as [T, B] or [T, B, 1], not [T, 1, B] (a view that moves no
    element: only the 1-axis sits elsewhere)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(8)

    def call(batch, frames):
        return (
            torch.randn(1, batch, 4, generator=gen, dtype=dtype),
            torch.randn(frames, batch, 5, generator=gen, dtype=dtype),
        )

    attention = _TimeMajorRowsPermuted(flat_sum)
    report = _converts_and_matches(attention, dtype, call, (3, 6), ((4, 7), (2, 3), (1, 5)))
    assert "1 query and 1 key term(s)" in report, report


class _TemporalAttention(torch.nn.Module):
    """DA-RNN's temporal attention (Seanny123/da-rnn and its copies): the decoder's hidden and cell
    states repeated along time (``repeat(T, 1, 1).permute(1, 0, 2)``), concatenated with the
    encoded inputs, through ``Sequential(Linear, Tanh, Linear)`` on rows (``x.view(-1, D)``) and
    viewed back to [B, T]; a softmax over time."""

    def __init__(self, rows: bool) -> None:
        super().__init__()
        self.rows = rows
        self.attn_layer = torch.nn.Sequential(
            torch.nn.Linear(2 * 4 + 6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
        )

    def forward(self, hidden, cell, encoded):  # hidden, cell [1, B, 4], encoded [B, T, 6]
        t = encoded.shape[1]
        x = torch.cat(
            (
                hidden.repeat(t, 1, 1).permute(1, 0, 2),
                cell.repeat(t, 1, 1).permute(1, 0, 2),
                encoded,
            ),
            dim=2,
        )
        if self.rows:
            e = self.attn_layer(x.view(-1, 2 * 4 + 6)).view(-1, t)
        else:
            e = self.attn_layer(x).squeeze(-1)
        beta = torch.softmax(e, dim=1)
        return torch.bmm(beta.unsqueeze(1), encoded)[:, 0, :]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "no_view"])
def test_a_concat_of_states_repeated_and_permuted(rows, dtype):
    """Refused: the repeat then permute(1, 0, 2) hid that the states are the same along time
    ("every term varies along the softmax's axis"), and the linear map of the cat's rows made
    the tanh's input one term of [B * T] rows. Both now split into query and key terms."""
    torch.manual_seed(0)
    attention = _TemporalAttention(rows)
    gen = torch.Generator().manual_seed(4)

    def call(batch, frames):
        return (
            torch.randn(1, batch, 4, generator=gen, dtype=dtype),
            torch.randn(1, batch, 4, generator=gen, dtype=dtype),
            torch.randn(batch, frames, 6, generator=gen, dtype=dtype),
        )

    report = _converts_and_matches(attention, dtype, call, (3, 5), ((4, 7), (2, 3)))
    assert "2 query and 1 key term(s)" in report, report


class _ZeroStartedDecoder(torch.nn.Module):
    """DA-RNN's decoder as published (Zhenye-Na/DA-RNN, DSTP-RNN): its states start as
    ``X.data.new(1, B, H).zero_()``, a fresh tensor written in place before anything reads it,
    then the temporal attention (in the decoder's own forward) and an LSTM step, twice."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_layer = _TemporalAttention(rows=True).attn_layer
        self.lstm = torch.nn.LSTM(6, 4)

    def forward(self, encoded):
        hidden = encoded.data.new(1, encoded.size(0), 4).zero_()
        cell = encoded.data.new(1, encoded.size(0), 4).zero_()
        t, outputs = encoded.size(1), []
        for _ in range(2):
            x = torch.cat(
                (
                    hidden.repeat(t, 1, 1).permute(1, 0, 2),
                    cell.repeat(t, 1, 1).permute(1, 0, 2),
                    encoded,
                ),
                dim=2,
            )
            beta = torch.softmax(self.attn_layer(x.view(-1, 2 * 4 + 6)).view(-1, t), dim=1)
            context = torch.bmm(beta.unsqueeze(1), encoded)[:, 0, :]
            _, (hidden, cell) = self.lstm(context.unsqueeze(0), (hidden, cell))
            outputs.append(hidden[0])
        return torch.stack(outputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_states_started_as_fresh_tensors_written_in_place(dtype):
    """Refused: "new_empty_1 is written in place (zero_) before the tanh reads it". A tensor made
    from shapes only and written before any read holds, in the rewritten graph, what it holds in
    the original."""
    torch.manual_seed(0)
    original = _ZeroStartedDecoder().to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(5)
    report = fuse_attention_report(
        model, example_inputs=(torch.randn(3, 5, 6, generator=gen, dtype=dtype),)
    )
    assert report.count == 1, str(report)
    for shape in ((4, 7, 6), (2, 3, 6)):
        x = torch.randn(shape, generator=gen, dtype=dtype)
        calls = TracedWeights.calls
        got, want = _run(model, (x,)), _run(original, (x,))
        assert TracedWeights.calls > calls
        _assert_close(got[0], want[0], dtype, "outputs")
        _assert_close(got[1], want[1], dtype, "gradients")


class _WritesInPlace(torch.nn.Module):
    """An attention whose forward also writes a buffer in place, as a statement (a call counter,
    the last batch size, a copy of a row), and mozilla/TTS's ``scores.data.masked_fill_``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = torch.nn.Linear(6, 4)
        self.k = torch.nn.Linear(5, 4, bias=False)
        self.v = torch.nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, query, memory):
        if self.how == "add_":
            self.calls.add_(1)
        elif self.how == "fill_":
            self.seen.fill_(query.shape[0])
        elif self.how == "copy_":
            self.seen.copy_(memory[0, 0, :3])
        e = self.v(torch.tanh(self.q(query).unsqueeze(1) + self.k(memory))).squeeze(-1)
        return torch.bmm(torch.softmax(e, -1).unsqueeze(1), memory).squeeze(1)


@pytest.mark.parametrize("how", ["add_", "fill_", "copy_"])
def test_in_place_writes_of_a_converted_forward_are_kept(how):
    """FX counts every method call as pure: the rewritten graph's dead-code pass dropped these
    writes (their results are unused), so the converted module's buffers stayed as they were."""
    torch.manual_seed(0)
    original = T._Holder(_WritesInPlace(how)).double()
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    memory = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64)
    report = fuse_attention_report(model, example_inputs=(query, memory))
    assert report.count == 1, str(report)
    for batch in (3, 1, 4):
        query = torch.randn(batch, 6, generator=gen, dtype=torch.float64)
        memory = torch.randn(batch, 5, 5, generator=gen, dtype=torch.float64)
        calls = TracedWeights.calls
        _assert_close([model(query, memory)], [original(query, memory)], torch.float64, "out")
        assert TracedWeights.calls > calls
        assert torch.equal(model.att.calls, original.att.calls), (
            model.att.calls,
            original.att.calls,
        )
        assert torch.equal(model.att.seen, original.att.seen), (model.att.seen, original.att.seen)


class _FillRebound(torch.nn.Module):
    """neural_sp's ``AttentionMechanism`` ('add'): the scores masked in place and the result bound
    to them again, ``e = e.masked_fill_(mask == 0, NEG_INF)``, mask True where valid."""

    def __init__(self) -> None:
        super().__init__()
        self.w_key = torch.nn.Linear(6, 5)
        self.w_query = torch.nn.Linear(4, 5, bias=False)
        self.v = torch.nn.Linear(5, 1, bias=False)

    def forward(self, key, query, mask):  # key [B, T, 6], query [B, 1, 4], mask [B, 1, T]
        e = self.v(torch.tanh(self.w_key(key).unsqueeze(1) + self.w_query(query).unsqueeze(2)))
        e = e.squeeze(3)
        e = e.masked_fill_(mask == 0, torch.finfo(e.dtype).min)
        aw = torch.softmax(e, dim=-1)
        return torch.bmm(aw, key), aw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_scores_filled_in_place_and_bound_again(dtype):
    """Refused: "the result of an in-place masked_fill_ of the scores is used". Read through its
    result only, the in-place fill is the out-of-place one."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(9)

    def call(batch, frames):
        lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
        mask = (torch.arange(frames) < lengths[:, None]).unsqueeze(1)
        return (
            torch.randn(batch, frames, 6, generator=gen, dtype=dtype),
            torch.randn(batch, 1, 4, generator=gen, dtype=dtype),
            mask,
        )

    report = _converts_and_matches(_FillRebound(), dtype, call, (3, 6), ((4, 7), (2, 3)))
    assert "fill" in report, report


class _CoverageIntoTheMemory(torch.nn.Module):
    """OpenNMT-py's ``GlobalAttention`` (mlp) given coverage: the caller's memory bank written in
    place, ``memory_bank += linear_cover(coverage)``, and a tanh of it, before the score."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_context = torch.nn.Linear(6, 6, bias=False)
        self.linear_query = torch.nn.Linear(6, 6)
        self.v = torch.nn.Linear(6, 1, bias=False)
        self.linear_cover = torch.nn.Linear(1, 6, bias=False)

    def forward(self, query, memory_bank, coverage):
        memory_bank += self.linear_cover(coverage.unsqueeze(-1))
        memory_bank = torch.tanh(memory_bank)
        keys = self.linear_context(memory_bank)
        e = self.v(torch.tanh(self.linear_query(query).unsqueeze(1) + keys)).squeeze(-1)
        weights = torch.softmax(e, -1)
        return torch.bmm(weights.unsqueeze(1), memory_bank).squeeze(1), weights


class _Caller(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(6, 6)
        self.attention = _CoverageIntoTheMemory()

    def forward(self, query, source, coverage):
        memory = self.encoder(source)
        context, weights = self.attention(query, memory, coverage)
        return context, weights, memory  # (the memory as the attention left it)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_forward_that_writes_its_argument_in_place(dtype):
    """Skipped with the probe's own error ("a leaf Variable that requires grad is being used in
    an in-place operation"): the probe passed the call's floating arguments as leaves, which the
    model's own call does not. It passes copies made from them now."""
    torch.manual_seed(0)
    original = _Caller().to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(10)

    def call(batch, frames):
        return (
            torch.randn(batch, 6, generator=gen, dtype=dtype),
            torch.randn(batch, frames, 6, generator=gen, dtype=dtype),
            torch.rand(batch, frames, generator=gen, dtype=dtype),
        )

    report = fuse_attention_report(model, example_inputs=call(3, 5))
    assert report.count == 1 and report.skipped == [], str(report)
    for batch, frames in ((4, 7), (2, 3)):
        args = call(batch, frames)
        calls = TracedWeights.calls
        got, want = model(*args), original(*args)
        assert TracedWeights.calls > calls  # (the fused op ran)
        _assert_close(list(got), list(want), dtype, "outputs (the memory as written in place too)")
        grads = [
            torch.autograd.grad(sum(o.sum() for o in out[:2]), list(m.parameters()))
            for m, out in ((model, got), (original, want))
        ]
        _assert_close(list(grads[0]), list(grads[1]), dtype, "gradients")


class _BroadcastConcat(torch.nn.Module):
    """JHzzzzzZ/LAS-Listen-Attend-and-Spell's attention: the concat form with the state broadcast
    over the frames by ``torch.broadcast_tensors``, ``Sequential(Linear, Tanh, Linear)``, a
    softmax over the frames (axis 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.att_score = torch.nn.Sequential(
            torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def forward(self, x, h):  # x [B, L, 4], h [1, B, 4]
        att_i = torch.cat(torch.broadcast_tensors(x, h.view(x.shape[0], 1, -1)), dim=-1)
        a = torch.softmax(self.att_score(att_i), dim=1)
        return (a * x).sum(dim=1), a


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_query_broadcast_by_broadcast_tensors(dtype):
    """Refused: "every term of the sum varies along the softmax's axis ... none is a query":
    the state's term came out of torch.broadcast_tensors, which was not seen as an expand."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)

    def call(batch, frames):
        return (
            torch.randn(batch, frames, 4, generator=gen, dtype=dtype),
            torch.randn(1, batch, 4, generator=gen, dtype=dtype),
        )

    report = _converts_and_matches(_BroadcastConcat(), dtype, call, (3, 6), ((4, 7), (2, 3)))
    assert "1 query and 1 key term(s)" in report, report


class _TimeMajorSumFlattened(torch.nn.Module):
    """pytorch/translate's ``MLPAttention``: the decoder's and the encoder's projections summed
    time-major [S, B, A], flattened into rows before the tanh (``F.tanh((dec + enc).view(-1,
    A))``), the rows' scores viewed to [S, B] and transposed, a softmax over the source."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_proj = torch.nn.Linear(6, 5)
        self.decoder_proj = torch.nn.Linear(4, 5, bias=False)
        self.to_scores = torch.nn.Linear(5, 1, bias=False)

    def forward(self, decoder_state, source_hids):  # [B, 4], [S, B, 6]
        src_len, bsz, _ = source_hids.shape
        total = self.decoder_proj(decoder_state).unsqueeze(0) + self.encoder_proj(source_hids)
        hidden = torch.tanh(total.view(-1, 5))
        scores = torch.softmax(self.to_scores(hidden).view(src_len, bsz).t(), dim=-1).t()
        return (source_hids * scores.unsqueeze(2)).sum(0), scores


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_time_major_sum_flattened_before_the_tanh(dtype):
    """Refused: "the tanh's input is not a sum of two or more terms, nor one Linear". The pass
    for keys flattened into rows before their projection took the flattened sum for rows and
    formed the tanh again on its one term; the tanh now moves before the view first."""
    torch.manual_seed(0)
    call = _state_and_time_major_memory(12, dtype, 4, 6)
    report = _converts_and_matches(_TimeMajorSumFlattened(), dtype, call, (3, 6), ((4, 7), (2, 3)))
    assert "1 query and 1 key term(s)" in report, report


class _PointwiseConvPooling(torch.nn.Module):
    """wespeaker's attentive statistics pooling heads over [B, C, T]: ``Conv1d(C, A, 1)``, tanh,
    ``Conv1d(A, K, 1)``, a softmax over time; K = 1 (one score vector, ``MHASTP`` with d_s = 1)
    or K = C (channel-wise, ``ASTP``)."""

    def __init__(self, vectors: int) -> None:
        super().__init__()
        self.linear1 = torch.nn.Conv1d(6, 5, kernel_size=1)
        self.linear2 = torch.nn.Conv1d(5, vectors, kernel_size=1)

    def forward(self, x):
        alpha = torch.softmax(self.linear2(torch.tanh(self.linear1(x))), dim=2)
        return torch.sum(alpha * x, dim=2)


@pytest.mark.parametrize("vectors", [1, 6], ids=["one_vector", "channel_wise"])
def test_attention_pooling_written_with_pointwise_convolutions_is_reported(vectors):
    """It was missing from the report ("0 replaced, 0 skipped"): the watcher took only an add or
    a linear map into the tanh, and a convolution ended the scores. A kernel-size-1 convolution
    is a projection of the channels; the general path names it as what it cannot take."""
    model = torch.nn.Sequential(_PointwiseConvPooling(vectors)).double()
    x = torch.randn(3, 6, 7, dtype=torch.float64)
    want = model(x)
    report = fuse_attention_report(model, example_inputs=(x,))
    (skipped,) = report.skipped
    assert report.count == 0 and "the tanh goes into 'conv1d'" in skipped.reason, str(report)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


class _AttBLSTM(torch.nn.Module):
    """Att-BLSTM (Zhou et al., 2016) as text classifiers write it (Chinese-Text-Classification-
    Pytorch's ``TextRNN_Att``, Renovamen's ``AttBiLSTM``): a bidirectional LSTM's outputs H straight
    into the tanh, no projection, against a learned vector w, a softmax over the words."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 4, bidirectional=True, batch_first=True)
        self.w = torch.nn.Parameter(torch.randn(8) * 0.5)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        H, _ = self.lstm(x)
        alpha = torch.softmax(torch.matmul(torch.tanh(H), self.w), dim=1).unsqueeze(-1)
        return self.fc(torch.sum(H * alpha, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_tanh_of_the_keys_themselves_against_a_learned_vector(dtype):
    """Not in the report at all ("0 replaced, 0 skipped"): a tanh counted only over a sum or a
    projection. With the keys' projection the identity, it is attention pooling: the op's keys are
    H itself, the query zero."""
    torch.manual_seed(0)
    original = _AttBLSTM().to(dtype)
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(13)
    report = fuse_attention_report(model, example_inputs=(torch.randn(3, 5, 6, dtype=dtype),))
    assert report.count == 1 and "0 query and 1 key term(s)" in str(report), str(report)
    for batch, words in ((4, 7), (2, 3)):
        x = torch.randn(batch, words, 6, generator=gen, dtype=dtype)
        calls = TracedWeights.calls
        got, want = model(x), original(x)
        assert TracedWeights.calls > calls
        _assert_close([got], [want], dtype, "outputs")
        grads = [
            torch.autograd.grad(out.sum(), list(m.parameters()))
            for m, out in ((model, got), (original, want))
        ]
        _assert_close(list(grads[0]), list(grads[1]), dtype, "gradients")


class _MaxShiftedSoftmax(torch.nn.Module):
    """kenchan0226/keyphrase-generation-rl's ``MaskedSoftmax`` after its concat attention: the
    row's max subtracted before the softmax (``torch.max(e, dim, keepdim=True)[0]``, or ``amax``,
    or detached), the mask multiplied after it and the weights renormalised."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.memory_proj = torch.nn.Linear(6, 5, bias=False)
        self.decode_proj = torch.nn.Linear(4, 5)
        self.v = torch.nn.Linear(5, 1, bias=False)

    def forward(self, query, memory, mask):
        e = self.v(torch.tanh(self.memory_proj(memory) + self.decode_proj(query).unsqueeze(1)))
        e = e.squeeze(-1)
        if self.how == "max":
            top = torch.max(e, dim=1, keepdim=True)[0]
        elif self.how == "amax":
            top = e.amax(-1, keepdim=True)
        else:
            top = e.max(1, keepdim=True)[0].detach()
        w = torch.softmax(e - top, dim=1) * mask
        w = w / w.sum(1, keepdim=True)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("how", ["max", "amax", "detached"])
def test_the_row_max_subtracted_before_the_softmax(how, dtype):
    """Refused: "the scores are used 2 times": the max read them, and so did the subtraction. A
    shift of each row the softmax cancels (it subtracts the max itself) is left out."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(14)

    def call(batch, frames):
        lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
        mask = (torch.arange(frames) < lengths[:, None]).to(dtype)
        return (
            torch.randn(batch, 4, generator=gen, dtype=dtype),
            torch.randn(batch, frames, 6, generator=gen, dtype=dtype),
            mask,
        )

    report = _converts_and_matches(_MaxShiftedSoftmax(how), dtype, call, (3, 6), ((4, 7), (2, 3)))
    assert "1 query and 1 key term(s)" in report, report


@pytest.mark.parametrize("name", ["join_scorer", "learned_query_pool"])
def test_a_converted_module_under_a_non_reentrant_checkpoint(name):
    """The first call with gradients at a new shape, inside ``checkpoint(use_reentrant=False)``,
    raised CheckpointError ("Number of tensors saved during forward: 10 / during recomputation:
    8"): the trace's rewrite computed its new nodes' example values with autograd on, and the
    checkpoint counted what they saved."""
    from torch.utils.checkpoint import checkpoint

    case = next(c for c in T.CASES if c.name == name)
    torch.manual_seed(0)
    model = case.make().double()
    original = copy.deepcopy(model)
    report = fuse_attention_report(model, example_inputs=case.inputs(2, 5, torch.float64))
    assert report.count == 1, str(report)
    args = case.inputs(3, 7, torch.float64)
    grads = []
    for m in (model, original):
        out = checkpoint(m, *args, use_reentrant=False)
        out = out[0] if isinstance(out, tuple) else out
        grads.append(torch.autograd.grad(out.sum(), list(m.parameters())))
    _assert_close(list(grads[0]), list(grads[1]), torch.float64, "gradients")


def test_no_first_call_warning_under_a_checkpoint_after_example_inputs():
    """The model around a converted attention (no tanh of its own: watched quietly after the
    example call) warned at its call under a checkpoint that it "is watched by the general path
    ... pass example_inputs", which had been passed."""
    from torch.utils.checkpoint import checkpoint

    from tests.layouts import TutorialAttention

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.attn = TutorialAttention(8)

        def forward(self, q, k):
            context, _ = self.attn(self.lin(q), k)
            return context.sin()

    torch.manual_seed(0)
    model = Model()
    report = fuse_attention_report(
        model, example_inputs=(torch.randn(2, 1, 8), torch.randn(2, 5, 8))
    )
    assert report.count == 1, str(report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint(model, torch.randn(3, 1, 8), torch.randn(3, 7, 8), use_reentrant=False)
        out.sum().backward()
    ours = [str(w.message) for w in caught if "fuse_attention" in str(w.message)]
    assert ours == [], ours


def test_torch_jit_trace_of_a_model_the_general_path_converted():
    """torch.jit.trace raised "Detected that you are using FX to torch.jit.trace a
    dynamo-optimized function": the traced path's forward runs through TorchDynamo. Under
    jit.trace it runs the module's own code, so the TorchScript is the original's; eager calls
    stay fused."""
    case = next(c for c in T.CASES if c.name == "join_scorer")
    torch.manual_seed(0)
    model = case.make().eval()
    original = copy.deepcopy(model)
    args = case.inputs(2, 5, torch.float32)
    assert fuse_attention_report(model, example_inputs=args).count == 1
    scripted = torch.jit.trace(model, args, check_trace=False)
    others = case.inputs(3, 5, torch.float32)
    for got, want in zip(scripted(*others), original(*others), strict=True):
        torch.testing.assert_close(got, want)
    calls = TracedWeights.calls
    for got, want in zip(model(*others), original(*others), strict=True):
        torch.testing.assert_close(got, want)
    assert TracedWeights.calls > calls
