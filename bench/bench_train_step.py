"""A training step of the Seq2Seq model: tokens/s per attention backend and decoder.

The pytest-benchmark view of ``bench/train_throughput.py``: the model, batch and step (forward,
loss, backward, AdamW on a full batch) come from its ``make_step``, the sizes from
``bench.shapes.train_sizes_for($SEQ2SEQ_FAST_BENCH_SIZE)``. Providers: fused, eager
(``backend="reference"``), compile (``torch.compile`` of the whole model, compiled during warm-up)
and zero (an attention that costs nothing: the bound any kernel can reach). One group per
(decoder, size).
"""

from __future__ import annotations

import pytest
import torch

from bench import harness, report, shapes, timing, train_throughput

PROVIDERS = [p for p in shapes.PROVIDERS if p in shapes.default_providers()] + ["zero"]
SIZES = shapes.train_sizes_for(shapes.default_size())
_SCRIPT_NAME = {"eager": "reference"}  # our provider name -> train_throughput's


@pytest.mark.parametrize("size", SIZES, ids=lambda s: s.name)
@pytest.mark.parametrize("decoder", ["gnmt", "bahdanau"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_train_step(benchmark, provider, decoder, size, bench_device, bench_dtype):
    if provider in ("fused", "compile"):
        reason = harness.provider_unavailable_reason("fused", bench_device, bench_dtype)
        if reason is not None:
            pytest.skip(reason)
    benchmark.group = f"train step {decoder} decoder, {size.name}: {size.label}"
    step = train_throughput.make_step(
        _SCRIPT_NAME.get(provider, provider), decoder, size, bench_device
    )
    timing.warm_up(step, bench_device)  # compiles the "compile" provider outside the timed region
    tokens = size.batch * size.length
    benchmark.extra_info.update(
        provider=provider,
        decoder=decoder,
        device=bench_device,
        dtype=str(bench_dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        triton=report.package_version("triton"),
        size=size.name,
        tokens_per_step=tokens,
        attention_tanh_count=size.batch * size.length * size.length * size.hidden,
    )
    loss = benchmark(timing.synchronized(step, bench_device))
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if getattr(stats, "median", None):
        benchmark.extra_info["tokens_per_s"] = tokens / stats.median
    assert loss == loss  # not NaN
