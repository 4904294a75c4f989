"""Converted models and the op under ``torch.inference_mode``: tensors made there keep no version
counter, so the caches that watch versions (the step memo, the key caches, the lengths check)
compute afresh for them instead of reading one. Each step equals the original's, for every speech
family the benchmarks run, named and general path, and inference tensors used after the mode
ends work too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bench import bench_convert_speech as speech
from seq2seq_fast import additive_attention
from seq2seq_fast.nn.convert import fuse_attention_report
from seq2seq_fast.ops import additive_attention_ref, fused_available

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)

SIZE = speech.SIZES["tiny"]


def _run(attn, family, memory, lengths, queries):
    ctx = family.start(attn, memory, lengths)
    return [family.step(attn, ctx, q) for q in queries]


@pytest.mark.parametrize("named", [True, False], ids=["named", "traced"])
@pytest.mark.parametrize("family_name", list(speech.FAMILIES))
def test_converted_families_run_under_inference_mode(family_name, named):
    family = speech.FAMILIES[family_name]
    # (Coqui's attention makes its step states in the default dtype)
    dtype = torch.float32 if family_name.startswith("coqui") else torch.float64
    torch.manual_seed(0)
    base = family.make(SIZE).to(dtype)
    original = nn.ModuleDict({"attn": base})
    converted = copy.deepcopy(original)
    report = fuse_attention_report(converted, named=named)
    gen = torch.Generator().manual_seed(1)
    shape = (SIZE.batch, SIZE.frames, SIZE.width)
    for outside in (False, True):  # made in the mode and run there; made there, run after
        with torch.inference_mode():
            memory = torch.randn(*shape, generator=gen, dtype=dtype)
            queries = [
                torch.randn(SIZE.batch, SIZE.width, generator=gen, dtype=dtype) for _ in range(4)
            ]
            lengths = speech._lengths(SIZE)
        for attn_of in (original, converted):
            attn_of.eval()
        mode = torch.no_grad() if outside else torch.inference_mode()
        with mode:
            want = _run(original["attn"], family, memory, lengths, queries)
            got = _run(converted["attn"], family, memory, lengths, queries)
        # (fairseq's MLPAttention rounds its masked scores to float32 and back)
        rounded = family_name == "fairseq MLPAttention" or dtype == torch.float32
        tol = 1e-5 if rounded else 1e-9
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                g, w, rtol=tol, atol=tol / 100, msg=f"{report}: step {step}, outside={outside}"
            )


@pytest.mark.parametrize("by", ["lengths", "mask"])
def test_the_op_takes_inference_tensors(by):
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        query = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
        keys = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
        values = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
        v = torch.randn(8, generator=gen, dtype=torch.float64)
        lengths = torch.tensor([5, 3, 1])
        masking = {"lengths": lengths} if by == "lengths" else {"mask": torch.arange(5) < 4}
        if by == "mask":
            masking["mask"] = masking["mask"].expand(3, 5).contiguous()
        for _ in range(2):  # the second call meets the lengths already checked
            got = additive_attention(query, keys, values, v, **masking)
            want = additive_attention_ref(query, keys, values, v, **masking)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        if by == "lengths":
            with pytest.raises(ValueError, match="lengths must lie in"):
                additive_attention(query, keys, values, v, lengths=torch.tensor([6, 1, 1]))


@pytest.mark.parametrize("named", [True, False], ids=["named", "traced"])
@pytest.mark.parametrize("which", ["tutorial", "gnmt"])
def test_nlp_layouts_run_under_inference_mode(which, named):
    from tests.layouts import GNMTAttention, TutorialAttention

    torch.manual_seed(0)
    if which == "tutorial":
        original = nn.ModuleDict({"attn": TutorialAttention(8).double()})
    else:
        original = nn.ModuleDict({"attn": GNMTAttention(8, 8, 8, normalize=True).double()})
    converted = copy.deepcopy(original)
    report = fuse_attention_report(converted, named=named)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        keys = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
        lengths = torch.tensor([5, 2, 4])
        for model in (original, converted):
            if which == "gnmt":
                model["attn"].set_mask(lengths, keys.transpose(0, 1))
        for step in range(4):
            query = torch.randn(3, 1, 8, generator=gen, dtype=torch.float64)
            memory = keys if which == "tutorial" else keys.transpose(0, 1)
            if which == "gnmt":
                query = query.squeeze(1)
            want = original["attn"](query, memory)
            got = converted["attn"](query, memory)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=f"{report}: {step}")
