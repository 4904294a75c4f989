"""A whole training step of a small model around each NLP layout that ``fuse_attention`` converts
(the PyTorch tutorial's AttnDecoderRNN, bentrevett's concat decoder, OpenNMT input-feeding and
whole-sequence decoders, JoeyNMT's recurrent decoder, GNMT's attention layer): the model as it
is, converted, and with an attention that costs nothing.

Each model is written after its project's decoder (the attentions are the re-creations of
``tests/layouts.py``): a GRU encoder over the source (B x S tokens), a decoder that calls the
attention as the project does (one step at a time over the same encoder outputs, or once with all
target steps), an output layer and NLL / cross-entropy; a step is forward, backward and an Adam
update, as the tutorial trains.

Providers: ``original``, ``fused`` (after ``fuse_attention``) and ``zero`` (the attention replaced
by one returning a slice of the memory and constant weights: no attention work at all, the bound
any attention can reach).

    python -m bench.bench_convert --threads 1 2 --rounds 7      # table, side by side
    pytest bench/bench_convert.py --benchmark-only             # pytest-benchmark view

The table gives ms per step (median of the rounds), the speed-up of ``fused`` over ``original``
(median of per-round ratios), the bound (``original`` / ``zero``) and ``fused`` as a share of it
(``zero`` time / ``fused`` time), from wall time and from process CPU time (steadier on a shared
machine). Sizes: ``--size`` or ``SEQ2SEQ_FAST_BENCH_SIZE`` (tiny in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench import shapes, timing
from bench.shapes import CONVERT_SIZES as SIZES
from bench.shapes import ConvertSize as Size
from seq2seq_fast.nn.convert import fuse_attention_report
from tests import layouts as L  # the re-creations live with the tests (run from the root)

PROVIDERS = ("original", "fused", "zero")


def _lengths(size: Size) -> Tensor:
    """Source lengths: the first row full, the others a little shorter each."""
    return (size.source - torch.arange(size.batch) * size.source // (2 * size.batch)).long()


class Encoder(nn.Module):
    def __init__(self, size: Size, bidirectional: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(size.src_vocab, size.hidden)
        self.gru = nn.GRU(size.hidden, size.hidden, batch_first=True, bidirectional=bidirectional)

    def forward(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return self.gru(self.embedding(src))


# --- zero-cost attentions: the call convention, none of the work -----------------------------------


class ZeroTutorial(nn.Module):
    def forward(self, query, keys):
        return keys[:, :1], keys.new_zeros(keys.shape[0], 1, keys.shape[1])


class ZeroConcat(nn.Module):
    def forward(self, hidden, encoder_outputs, mask=None):
        return encoder_outputs.new_full((hidden.shape[0], encoder_outputs.shape[0]), 0.0)


class ZeroGlobal(nn.Module):
    def __init__(self, linear_out: nn.Linear) -> None:
        super().__init__()
        self.linear_out = linear_out  # not attention: it stays

    def forward(self, source, memory_bank, src_len=None):
        one_step = source.dim() == 2
        source3 = source.unsqueeze(1) if one_step else source
        context = memory_bank[:, :1].expand(-1, source3.shape[1], -1)
        attn_h = self.linear_out(torch.cat([context, source3], 2))
        align = source3.new_zeros(source3.shape[0], source3.shape[1], memory_bank.shape[1])
        return (attn_h.squeeze(1), align.squeeze(1)) if one_step else (attn_h, align)


class ZeroJoey(nn.Module):
    def compute_proj_keys(self, keys):
        pass

    def forward(self, query, mask, values):
        return values[:, :1], values.new_zeros(values.shape[0], 1, values.shape[1])


class ZeroGNMT(nn.Module):
    def set_mask(self, context_len, context):
        pass

    def forward(self, query, keys):  # time-major, query [Tq, B, H]
        context = keys[:1].expand(query.shape[0], -1, -1)
        return context, query.new_zeros(query.shape[0], query.shape[1], keys.shape[0])


# --- the models ------------------------------------------------------------------------------------


class TutorialModel(nn.Module):
    """The tutorial's EncoderRNN + AttnDecoderRNN (teacher forcing, log_softmax, NLL)."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        h = size.hidden
        self.encoder = Encoder(size)
        self.embedding = nn.Embedding(size.tgt_vocab, h)
        self.attention = L.TutorialAttention(h)
        self.gru = nn.GRU(2 * h, h, batch_first=True)
        self.out = nn.Linear(h, size.tgt_vocab)
        self.dropout = nn.Dropout(0.1)

    def zero_attention(self) -> None:
        self.attention = ZeroTutorial()

    def forward(self, src, lengths, tgt_in):
        encoder_outputs, hidden = self.encoder(src)
        outputs = []
        for t in range(tgt_in.shape[1]):
            embedded = self.dropout(self.embedding(tgt_in[:, t : t + 1]))
            context, _ = self.attention(hidden.permute(1, 0, 2), encoder_outputs)
            output, hidden = self.gru(torch.cat((embedded, context), dim=2), hidden)
            outputs.append(self.out(output))
        return F.log_softmax(torch.cat(outputs, dim=1), dim=-1)


class ConcatModel(nn.Module):
    """bentrevett notebook 4: bidirectional encoder, time-major memory, source mask."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        h = size.hidden
        self.encoder = Encoder(size, bidirectional=True)
        self.fc = nn.Linear(2 * h, h)
        self.attention = L.ConcatAttention(h, h)
        self.embedding = nn.Embedding(size.tgt_vocab, h)
        self.rnn = nn.GRUCell(2 * h + h, h)
        self.fc_out = nn.Linear(2 * h + h + h, size.tgt_vocab)

    def zero_attention(self) -> None:
        self.attention = ZeroConcat()

    def forward(self, src, lengths, tgt_in):
        outputs, final = self.encoder(src)
        hidden = torch.tanh(self.fc(torch.cat((final[-2], final[-1]), dim=1)))
        encoder_outputs = outputs.transpose(0, 1)  # [S, B, 2h], as the notebook's
        mask = torch.arange(src.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        logits = []
        for t in range(tgt_in.shape[1]):
            embedded = self.embedding(tgt_in[:, t])
            a = self.attention(hidden, encoder_outputs, mask)
            weighted = torch.bmm(a.unsqueeze(1), outputs).squeeze(1)
            hidden = self.rnn(torch.cat((embedded, weighted), dim=1), hidden)
            logits.append(self.fc_out(torch.cat((hidden, weighted, embedded), dim=1)))
        return torch.stack(logits, dim=1)


class OpenNMTModel(nn.Module):
    """OpenNMT-py RNN decoders: input feeding (one attention call per step) or the standard
    decoder (one call with all target steps)."""

    def __init__(self, size: Size, input_feed: bool) -> None:
        super().__init__()
        h = size.hidden
        self.input_feed = input_feed
        self.encoder = Encoder(size)
        self.embedding = nn.Embedding(size.tgt_vocab, h)
        if input_feed:
            self.rnn = nn.LSTMCell(2 * h, h)
        else:
            self.rnn = nn.LSTM(h, h, batch_first=True)
        self.attn = L.GlobalAttention(h, attn_type="mlp")
        self.generator = nn.Linear(h, size.tgt_vocab)

    def zero_attention(self) -> None:
        self.attn = ZeroGlobal(self.attn.linear_out)

    def forward(self, src, lengths, tgt_in):
        memory_bank, final = self.encoder(src)
        embedded = self.embedding(tgt_in)
        if not self.input_feed:
            rnn_output, _ = self.rnn(embedded, (final, torch.zeros_like(final)))
            attn_h, _ = self.attn(rnn_output, memory_bank, lengths)
            return self.generator(attn_h)
        hidden, cell = final[0], torch.zeros_like(final[0])
        input_feed = torch.zeros_like(hidden)
        outputs = []
        for t in range(tgt_in.shape[1]):
            hidden, cell = self.rnn(torch.cat([embedded[:, t], input_feed], 1), (hidden, cell))
            input_feed, _ = self.attn(hidden, memory_bank, lengths)
            outputs.append(input_feed)
        return self.generator(torch.stack(outputs, dim=1))


class JoeyModel(nn.Module):
    """JoeyNMT's RecurrentDecoder (GRU, input feeding, Bahdanau attention, attention vector)."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        h = size.hidden
        self.encoder = Encoder(size)
        self.embedding = nn.Embedding(size.tgt_vocab, h)
        self.rnn = nn.GRU(2 * h, h, batch_first=True)
        self.attention = L.BahdanauAttention(hidden_size=h, key_size=h, query_size=h)
        self.att_vector_layer = nn.Linear(2 * h, h)
        self.output_layer = nn.Linear(h, size.tgt_vocab, bias=False)

    def zero_attention(self) -> None:
        self.attention = ZeroJoey()

    def forward(self, src, lengths, tgt_in):
        encoder_output, hidden = self.encoder(src)
        mask = (torch.arange(src.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)
        self.attention.compute_proj_keys(keys=encoder_output)
        embedded = self.embedding(tgt_in)
        att_vector = encoder_output.new_zeros(src.shape[0], 1, hidden.shape[-1])
        vectors = []
        for t in range(tgt_in.shape[1]):
            rnn_input = torch.cat([embedded[:, t : t + 1], att_vector], dim=2)
            _, hidden = self.rnn(rnn_input, hidden)
            query = hidden[-1].unsqueeze(1)
            context, _ = self.attention(query=query, values=encoder_output, mask=mask)
            att_vector = torch.tanh(self.att_vector_layer(torch.cat([query, context], dim=2)))
            vectors.append(att_vector)
        return self.output_layer(torch.cat(vectors, dim=1))


class GNMTModel(nn.Module):
    """GNMT's first decoder layer: an LSTM over the target, attention once for all steps
    (time-major, normalised score vector), an output layer."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        h = size.hidden
        self.encoder = Encoder(size)
        self.embedding = nn.Embedding(size.tgt_vocab, h)
        self.rnn = nn.LSTM(h, h)
        self.attn = L.GNMTAttention(h, h, h, normalize=True, batch_first=False)
        self.classifier = nn.Linear(2 * h, size.tgt_vocab)

    def zero_attention(self) -> None:
        self.attn = ZeroGNMT()

    def forward(self, src, lengths, tgt_in):
        encoder_outputs, _ = self.encoder(src)
        context = encoder_outputs.transpose(0, 1)  # [S, B, h]
        self.attn.set_mask(lengths, context)
        output, _ = self.rnn(self.embedding(tgt_in.t()))
        attn, _ = self.attn(output, context)
        return self.classifier(torch.cat([output, attn], dim=2)).transpose(0, 1)


MODELS: dict[str, Callable[[Size], nn.Module]] = {
    "tutorial": TutorialModel,
    "concat": ConcatModel,
    "opennmt-input-feed": lambda size: OpenNMTModel(size, input_feed=True),
    "joeynmt": JoeyModel,
    "opennmt-whole-sequence": lambda size: OpenNMTModel(size, input_feed=False),
    "gnmt": GNMTModel,
}


def make_step(model_name: str, provider: str, size: Size) -> Callable[[], float]:
    """A zero-argument training step (returns the loss) of the named model."""
    torch.manual_seed(0)
    model = MODELS[model_name](size).train()
    if provider == "fused":
        report = fuse_attention_report(model)
        if report.count != 1:
            raise RuntimeError(f"{model_name}: not converted:\n{report}")
    elif provider == "zero":
        model.zero_attention()
    elif provider == "traced":  # the general path alone (bench/bench_convert_traced.py)
        report = fuse_attention_report(model, named=False)
    elif provider != "original":
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, size.src_vocab, (size.batch, size.source), generator=gen)
    tgt = torch.randint(0, size.tgt_vocab, (size.batch, size.target + 1), generator=gen)
    lengths = _lengths(size)

    def step() -> float:
        scores = model(src, lengths, tgt[:, :-1]).reshape(-1, size.tgt_vocab)
        target = tgt[:, 1:].reshape(-1)
        loss = (
            F.nll_loss(scores, target)
            if model_name == "tutorial"
            else F.cross_entropy(scores, target)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    step.report = report if provider in ("fused", "traced") else None
    return step


# --- pytest-benchmark ------------------------------------------------------------------------------


def _bench_size() -> Size:
    return SIZES["tiny" if shapes.default_size() == "tiny" else "small"]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_convert_step(benchmark, model_name, provider):
    size = _bench_size()
    benchmark.group = f"converted {model_name}: train step, {size.name}"
    step = make_step(model_name, provider, size)
    timing.warm_up(step, "cpu")
    benchmark.extra_info.update(
        model=model_name, provider=provider, size=size.name, threads=torch.get_num_threads()
    )
    loss = benchmark(step)
    assert loss == loss  # not NaN


# --- side-by-side table ----------------------------------------------------------------------------


def _row(name: str, samples: dict, kind: str) -> str:
    times = {p: getattr(samples[p], kind) for p in PROVIDERS}
    med = {p: timing.Summary.of(times[p]).median * 1e3 for p in PROVIDERS}
    speedup = timing.ratio_summary(times["original"], times["fused"])
    bound = timing.ratio_summary(times["original"], times["zero"]).median
    share = timing.ratio_summary(times["zero"], times["fused"]).median
    return (
        f"| {name} | {kind[:-2]} | {med['original']:.0f} | {med['fused']:.0f} | {med['zero']:.0f} "
        f"| {speedup.median:.2f}x ({speedup.q1:.2f}-{speedup.q3:.2f}) | {bound:.2f}x "
        f"| {share:.0%} |"
    )


def table(names: list[str], size: Size, threads: int, rounds: int, min_sample_s: float) -> str:
    torch.set_num_threads(threads)
    lines = [
        f"{size.name} (B={size.batch}, S={size.source}, {size.target} target steps, "
        f"hidden {size.hidden}), {threads} thread(s):",
        "",
        "| model | time | original ms | fused ms | zero ms | fused speed-up (IQR) | bound "
        "| of bound |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        calls = {p: make_step(name, p, size) for p in PROVIDERS}
        samples = timing.time_interleaved(calls, "cpu", rounds, min_sample_s)
        for kind in ("wall_s", "cpu_s"):
            lines.append(_row(name, samples, kind))
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-sample-s", type=float, default=0.0)
    parser.add_argument(
        "--steps", type=int, default=None, help="target steps (default: the size's)"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), metavar="MODEL")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    size = SIZES[args.size]
    if args.steps is not None:
        size = dataclasses.replace(size, target=args.steps)
    for threads in args.threads:
        print(table(args.models, size, threads, args.rounds, args.min_sample_s))
        print()


if __name__ == "__main__":
    main()
