"""BahdanauAttention in a greedy-decoding loop over cached projected keys, Tq=1 steps; fused vs reference.

Providers: "fused" (backend="fused") and "eager" (backend="reference"). The keys are projected
once outside the timed region; each timed step projects its query and attends.
"""

from __future__ import annotations

import pytest

from bench import harness as sb

DEVICE = sb.default_device()
SHAPE = sb.decode_shape_for(sb.default_size(), DEVICE)

_cases: dict[sb.DecodeShape, sb.DecodeCase] = {}


@pytest.mark.parametrize(
    "provider", [p for p in sb.DECODE_PROVIDERS if p in sb.default_providers()]
)
def test_decode(benchmark, provider, bench_device, bench_dtype):
    reason = sb.provider_unavailable_reason(provider, bench_device, bench_dtype)
    if reason is not None:
        pytest.skip(reason)
    if SHAPE not in _cases:
        _cases[SHAPE] = sb.make_decode_case(SHAPE, bench_device, bench_dtype)
    benchmark.group = f"decode loop {SHAPE.name}: {SHAPE.label}"
    call = sb.make_decode_call(provider, _cases[SHAPE])
    sb.warm_up(call, bench_device)
    peak = sb.peak_extra_bytes(call, bench_device)
    benchmark.extra_info.update(
        sb.benchmark_extra_info(
            provider=provider, mode="forward", device=bench_device, dtype=bench_dtype,
            shape=SHAPE, peak_extra=peak,
        )
    )  # fmt: skip
    context, weights = benchmark(sb.synchronized(call, bench_device))
    sb.add_rate(benchmark.extra_info, benchmark)
    assert context.shape == (SHAPE.batch, SHAPE.value_dim)
    assert weights.shape == (SHAPE.batch, SHAPE.k_len)
