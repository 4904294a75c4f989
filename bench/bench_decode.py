"""BahdanauAttention in a greedy-decoding loop over cached projected keys, Tq=1 steps; fused vs reference.

Providers: "fused" (backend="fused") and "eager" (backend="reference"). The keys are projected
once outside the timed region; each timed step projects its query and attends. The shape is
``bench.shapes.decode_shape_for($SEQ2SEQ_FAST_BENCH_SIZE, device)``, the report's.
"""

from __future__ import annotations

import pytest

from bench import harness, report, shapes, timing

DEVICE = shapes.default_device()
SHAPE = shapes.decode_shape_for(shapes.default_size(), DEVICE)

_cases: dict[shapes.DecodeShape, harness.DecodeCase] = {}


@pytest.mark.parametrize(
    "provider", [p for p in harness.DECODE_PROVIDERS if p in shapes.default_providers()]
)
def test_decode(benchmark, provider, bench_device, bench_dtype):
    reason = harness.provider_unavailable_reason(provider, bench_device, bench_dtype)
    if reason is not None:
        pytest.skip(reason)
    if SHAPE not in _cases:
        _cases[SHAPE] = harness.make_decode_case(SHAPE, bench_device, bench_dtype)
    benchmark.group = f"decode loop {SHAPE.name}: {SHAPE.label}"
    call = harness.make_decode_call(provider, _cases[SHAPE])
    timing.warm_up(call, bench_device)
    peak = harness.peak_extra_bytes(call, bench_device)
    benchmark.extra_info.update(
        report.benchmark_extra_info(
            provider=provider,
            mode="forward",
            device=bench_device,
            dtype=bench_dtype,
            shape=SHAPE,
            peak_extra=peak,
        )
    )
    context, weights = benchmark(timing.synchronized(call, bench_device))
    report.add_rate(benchmark.extra_info, benchmark)
    assert context.shape == (SHAPE.batch, SHAPE.value_dim)
    assert weights.shape == (SHAPE.batch, SHAPE.k_len)
