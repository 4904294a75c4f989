"""A training step of the Seq2Seq model (seq2seq_fast.models), fused vs reference attention.

One group per decoder ("gnmt": one attention call over all target steps; "bahdanau": one call per
target step). extra_info adds tokens per step and, once timed, tokens/s. Skipped, with the reason,
when seq2seq_fast.models is not importable.
"""

from __future__ import annotations

import pytest

from seq2seq_fast import bench as sb

DEVICE = sb.default_device()
SHAPE = sb.train_shape_for(sb.default_size(), DEVICE)


@pytest.mark.parametrize("decoder", sb.TRAIN_DECODERS)
@pytest.mark.parametrize("provider", [p for p in sb.TRAIN_PROVIDERS if p in sb.default_providers()])
def test_train_step(benchmark, provider, decoder, bench_device, bench_dtype):
    reason = sb.models_unavailable_reason() or sb.provider_unavailable_reason(
        provider, bench_device, bench_dtype
    )
    if reason is not None:
        pytest.skip(reason)
    benchmark.group = f"train step {decoder} decoder {SHAPE.name}: {SHAPE.label}"
    call = sb.make_train_call(provider, decoder, SHAPE, bench_device, bench_dtype)
    sb.warm_up(call, bench_device)
    peak = sb.peak_extra_bytes(call, bench_device)
    info = sb.benchmark_extra_info(
        provider=provider, mode="train step", device=bench_device, dtype=bench_dtype, shape=SHAPE,
        peak_extra=peak,
    )  # fmt: skip
    info.update(decoder=decoder, tokens_per_step=SHAPE.tokens)
    benchmark.extra_info.update(info)
    (loss,) = benchmark(sb.synchronized(call, bench_device))
    sb.add_rate(benchmark.extra_info, benchmark)
    if "median_s" in benchmark.extra_info:
        benchmark.extra_info["tokens_per_s"] = SHAPE.tokens / benchmark.extra_info["median_s"]
    assert loss.isfinite()
