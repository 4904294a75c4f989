"""A training step of a small attention decoder around each speech / NLP toolkit layout that
``fuse_attention`` converts (ESPnet, SpeechBrain, fairseq, Tacotron 2, Coqui, AllenNLP, d2l):
the toolkit's attention as it is, converted, and replaced by one that costs nothing.

The model (one per family, the same weights for every provider): an LSTMCell decoder over a fixed
memory [B, T, E] (the "encoder output", a leaf that takes gradients), which at each of ``steps``
target steps calls the family's attention as that toolkit's decoder does (with its state: reset,
cached projection, previous and cumulative weights), then an output layer and cross-entropy; a
step is forward, backward and an SGD update. The attentions are the re-creations of
``tests/layouts_speech.py`` (same math, parameters and call as the toolkits').

Providers: ``original`` (the toolkit's layout), ``fused`` (after ``fuse_attention``), ``zero``
(context = the memory's mean, taken once per sequence, no attention work: the bound any
attention can reach; for the location-aware layouts it also drops their location convolution).

    python -m bench.bench_convert_speech --threads 1 2 --rounds 7      # table, side by side
    pytest bench/bench_convert_speech.py --benchmark-only              # pytest-benchmark view

The table gives wall ms per step (median of the rounds), the speed-up of ``fused`` over
``original`` and the bound (original / zero), and ``fused`` as a share of the zero-cost bound
(zero's time / fused time), each a median of per-round ratios of wall and of process-CPU time. Sizes follow ``SEQ2SEQ_FAST_BENCH_SIZE`` (tiny in CI) or ``--size``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench import shapes, timing
from bench.shapes import SPEECH_SIZES as SIZES
from bench.shapes import SpeechSize as Size
from seq2seq_fast.nn.convert import fuse_attention_report
from tests import layouts_speech as L  # the re-creations live with the tests (run from the root)

PROVIDERS = ("original", "fused", "zero")


def _lengths(size: Size) -> Tensor:
    """Every row padded a little differently; the first is full."""
    return (size.frames - torch.arange(size.batch) * size.frames // (2 * size.batch)).long()


# --- one adapter per family: build its attention, and call it one step as its decoder does --------


class _Family:
    """``make(size)`` -> attention; ``start(attn, memory, lengths)`` -> per-utterance context
    (whatever the steps need); ``step(attn, ctx, query)`` -> context [B, E]."""

    def __init__(self, make, start, step) -> None:
        self.make, self.start, self.step = make, start, step


def _padding(lengths: Tensor, frames: int) -> Tensor:
    return torch.arange(frames).unsqueeze(0) >= lengths.unsqueeze(1)


def _espnet_start(attn, memory, lengths):
    attn.reset()
    return {"memory": memory, "lengths": lengths.tolist(), "w": None}


def _espnet_step(attn, ctx, query):
    context, ctx["w"] = attn(ctx["memory"], ctx["lengths"], query, ctx["w"])
    return context


def _speechbrain_start(attn, memory, lengths):
    attn.reset()
    return {"memory": memory, "enc_len": lengths.to(memory.dtype)}


def _speechbrain_step(attn, ctx, query):
    return attn(ctx["memory"], ctx["enc_len"], query)[0]


def _location_start(attn, memory, lengths):
    """Previous and cumulative weights, as Tacotron 2 decoders keep them."""
    zeros = memory.new_zeros(memory.shape[:2])
    ctx = {"memory": memory, "padding": _padding(lengths, memory.shape[1]), "prev": zeros}
    ctx["cum"] = zeros
    if hasattr(attn, "clear_cache"):
        attn.clear_cache()
    if hasattr(attn, "memory_layer"):
        ctx["processed"] = attn.memory_layer(memory)
    return ctx


def _fairseq_location_step(attn, ctx, query):
    state = torch.stack((ctx["prev"], ctx["cum"]), dim=1)
    context, ctx["prev"] = attn(ctx["memory"], ctx["padding"], query, state)
    ctx["cum"] = ctx["cum"] + ctx["prev"]
    return context


def _tacotron2_step(attn, ctx, query):
    cat = torch.cat((ctx["prev"].unsqueeze(1), ctx["cum"].unsqueeze(1)), dim=1)
    context, ctx["prev"] = attn(query, ctx["memory"], ctx["processed"], cat, ctx["padding"])
    ctx["cum"] = ctx["cum"] + ctx["prev"]
    return context


def _coqui_start(attn, memory, lengths):
    attn.init_states(memory)
    valid = ~_padding(lengths, memory.shape[1])
    return {"memory": memory, "processed": attn.preprocess_inputs(memory), "mask": valid}


def _coqui_step(attn, ctx, query):
    return attn(query, ctx["memory"], ctx["processed"], ctx["mask"])


def _fairseq_mlp_start(attn, memory, lengths):
    padding = _padding(lengths, memory.shape[1])
    return {"source": memory.transpose(0, 1), "padding": padding.t()}


def _fairseq_mlp_step(attn, ctx, query):
    return attn(query, ctx["source"], ctx["padding"])[0]


def _allennlp_start(attn, memory, lengths):
    return {"memory": memory, "mask": ~_padding(lengths, memory.shape[1])}


def _allennlp_step(attn, ctx, query):
    weights = attn(query, ctx["memory"], ctx["mask"])
    return torch.bmm(weights.unsqueeze(1), ctx["memory"]).squeeze(1)


def _d2l_start(attn, memory, lengths):
    return {"memory": memory, "lengths": lengths}


def _d2l_step(attn, ctx, query):
    memory = ctx["memory"]
    return attn(query.unsqueeze(1), memory, memory, ctx["lengths"]).squeeze(1)


def _families() -> dict[str, _Family]:
    def w(size: Size) -> int:
        return size.width

    def conv(size: Size) -> tuple[int, int]:
        return size.conv_channels, size.conv_half_width

    def _coqui(size: Size, norm: str) -> nn.Module:
        # Coqui's positional arguments: location attention on, no windowing, `norm`, no forward
        # attention, no transition agent, no forward-attention mask
        return L.CoquiOriginalAttention(
            w(size), w(size), w(size), True, size.conv_channels, 2 * size.conv_half_width + 1,
            False, norm, False, False, False,
        )  # fmt: skip

    return {
        "espnet AttAdd": _Family(lambda s: L.AttAdd(w(s), w(s), w(s)), _espnet_start, _espnet_step),
        "espnet AttLoc": _Family(
            lambda s: L.AttLoc(w(s), w(s), w(s), *conv(s)), _espnet_start, _espnet_step
        ),
        # coverage: the previous weights as a list, appended to each step (the same step call)
        "espnet AttCov": _Family(lambda s: L.AttCov(w(s), w(s), w(s)), _espnet_start, _espnet_step),
        "espnet AttCovLoc": _Family(
            lambda s: L.AttCovLoc(w(s), w(s), w(s), *conv(s)), _espnet_start, _espnet_step
        ),
        "speechbrain content": _Family(
            lambda s: L.ContentBasedAttention(w(s), w(s), w(s), w(s)),
            _speechbrain_start,
            _speechbrain_step,
        ),
        "speechbrain location": _Family(
            lambda s: L.LocationAwareAttention(w(s), w(s), w(s), w(s), *conv(s)),
            _speechbrain_start,
            _speechbrain_step,
        ),
        "fairseq LocationAttention": _Family(
            lambda s: L.LocationAttention(w(s), w(s), w(s), 2, *conv(s)),
            _location_start,
            _fairseq_location_step,
        ),
        "fairseq MLPAttention": _Family(
            lambda s: L.MLPAttention(w(s), w(s), w(s)), _fairseq_mlp_start, _fairseq_mlp_step
        ),
        "tacotron2 (NVIDIA)": _Family(
            lambda s: L.NvidiaTacotron2Attention(
                w(s), w(s), w(s), s.conv_channels, 2 * s.conv_half_width + 1
            ),
            _location_start,
            _tacotron2_step,
        ),
        "coqui OriginalAttention": _Family(
            lambda s: _coqui(s, "softmax"),
            _coqui_start,
            _coqui_step,
        ),
        # Coqui's Tacotron default: sigmoid normalisation, the score layer's bias kept
        "coqui OriginalAttention (sigmoid)": _Family(
            lambda s: _coqui(s, "sigmoid"),
            _coqui_start,
            _coqui_step,
        ),
        "allennlp AdditiveAttention": _Family(
            lambda s: L.AllenNLPAdditiveAttention(w(s), w(s)), _allennlp_start, _allennlp_step
        ),
        "d2l AdditiveAttention": _Family(
            lambda s: L.D2LAdditiveAttentionSized(w(s), w(s), w(s), 0.0), _d2l_start, _d2l_step
        ),
    }


FAMILIES = _families()


class _ZeroCost(nn.Module):
    """Stands for any family: the memory's mean as the context, nothing else."""

    def forward(self, *args):
        raise RuntimeError("called through the zero family adapter only")


class Decoder(nn.Module):
    """LSTMCell decoder around one attention: embed, cell, attend, output layer."""

    def __init__(self, family: _Family, size: Size) -> None:
        super().__init__()
        self.family, self.size = family, size
        self.embed = nn.Embedding(size.vocab, size.width)
        self.cell = nn.LSTMCell(2 * size.width, size.width)
        self.attn = family.make(size)
        self.out = nn.Linear(2 * size.width, size.vocab)

    def forward(self, memory: Tensor, lengths: Tensor, tokens: Tensor) -> Tensor:
        batch = memory.shape[0]
        zero = isinstance(self.attn, _ZeroCost)
        # zero: the memory's mean, taken once per sequence (the strictest bound)
        ctx = memory.mean(dim=1) if zero else self.family.start(self.attn, memory, lengths)
        hidden = cell = memory.new_zeros(batch, self.size.width)
        context = memory.new_zeros(batch, self.size.width)
        logits = []
        for t in range(tokens.shape[1]):
            step_in = torch.cat((self.embed(tokens[:, t]), context), dim=1)
            hidden, cell = self.cell(step_in, (hidden, cell))
            context = ctx if zero else self.family.step(self.attn, ctx, hidden)
            logits.append(self.out(torch.cat((hidden, context), dim=1)))
        return torch.stack(logits, dim=1)


def make_step(family: str, provider: str, size: Size) -> Callable[[], float]:
    """A zero-argument training step (returns the loss) of the family's decoder."""
    torch.manual_seed(0)
    model = Decoder(FAMILIES[family], size).train()
    if provider == "fused":
        report = fuse_attention_report(model)
        if report.count != 1:
            raise RuntimeError(f"{family}: not converted:\n{report}")
    elif provider == "zero":
        model.attn = _ZeroCost()
    elif provider == "traced":  # the general path alone (bench/bench_convert_traced.py)
        report = fuse_attention_report(model, named=False)
    elif provider != "original":
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    memory = torch.randn(size.batch, size.frames, size.width, generator=gen).requires_grad_()
    lengths = _lengths(size)
    tokens = torch.randint(0, size.vocab, (size.batch, size.steps + 1), generator=gen)

    def step() -> float:
        logits = model(memory, lengths, tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, size.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        memory.grad = None
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    step.report = report if provider in ("fused", "traced") else None
    return step


# --- pytest-benchmark -----------------------------------------------------------------------------


def _bench_size() -> Size:
    return SIZES["tiny" if shapes.default_size() == "tiny" else "small"]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_convert_speech_step(benchmark, family, provider):
    size = _bench_size()
    benchmark.group = f"converted {family}: train step, {size.name}"
    step = make_step(family, provider, size)
    timing.warm_up(step, "cpu")
    benchmark.extra_info.update(
        family=family, provider=provider, size=size.name, threads=torch.get_num_threads()
    )
    loss = benchmark(step)
    assert loss == loss  # not NaN


# --- side-by-side table ---------------------------------------------------------------------------


def table(families: list[str], size: Size, threads: int, rounds: int, min_sample_s: float) -> str:
    torch.set_num_threads(threads)
    lines = [
        f"{size.name} (B={size.batch}, T={size.frames}, E=A={size.width}, {size.steps} steps, "
        f"conv {size.conv_channels}x{2 * size.conv_half_width + 1}), {threads} thread(s):",
        "",
        "| layout | original ms | fused ms | zero ms | speed-up wall / CPU | bound wall / CPU "
        "| of bound wall / CPU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for family in families:
        calls = {p: make_step(family, p, size) for p in PROVIDERS}
        samples = timing.time_interleaved(calls, "cpu", rounds, min_sample_s)
        med = {p: timing.Summary.of(samples[p].wall_s).median * 1e3 for p in PROVIDERS}
        ratios = []
        for a, b in (("original", "fused"), ("original", "zero"), ("zero", "fused")):
            ratios.append(
                [
                    timing.ratio_summary(getattr(samples[a], t), getattr(samples[b], t)).median
                    for t in ("wall_s", "cpu_s")
                ]
            )
        (speed, speed_cpu), (bound, bound_cpu), (share, share_cpu) = ratios
        lines.append(
            f"| {family} | {med['original']:.1f} | {med['fused']:.1f} | {med['zero']:.1f} "
            f"| {speed:.2f}x / {speed_cpu:.2f}x | {bound:.2f}x / {bound_cpu:.2f}x "
            f"| {share:.0%} / {share_cpu:.0%} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-sample-s", type=float, default=0.0)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), metavar="FAMILY")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    for threads in args.threads:
        print(table(args.families, SIZES[args.size], threads, args.rounds, args.min_sample_s))
        print()


if __name__ == "__main__":
    main()
