"""The op: fused vs eager reference vs torch.compile of the reference, forward and forward+backward.

Each benchmark group holds the providers of one (mode, shape); the shapes are
``bench.shapes.shapes_for($SEQ2SEQ_FAST_BENCH_SIZE, device)``, the report's. extra_info: provider,
device, dtype, threads, versions, tanh count, G tanh/s, peak extra memory (see bench/harness.py).
"""

from __future__ import annotations

import pytest

from bench import harness, report, shapes, timing

DEVICE = shapes.default_device()
SHAPES = shapes.shapes_for(shapes.default_size(), DEVICE)

_cases: dict[shapes.Shape, harness.Case] = {}


def _case(shape: shapes.Shape, device: str, dtype) -> harness.Case:
    # Inputs are shared by the providers and modes of a shape; only the latest shape is kept.
    if shape not in _cases:
        _cases.clear()
        _cases[shape] = harness.make_case(shape, device, dtype)
    return _cases[shape]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", shapes.MODES)
@pytest.mark.parametrize("provider", shapes.default_providers())
def test_additive_attention(benchmark, provider, mode, shape, bench_device, bench_dtype):
    reason = harness.provider_unavailable_reason(provider, bench_device, bench_dtype)
    if reason is not None:
        pytest.skip(reason)
    benchmark.group = f"additive_attention {mode} {shape.name}: {shape.label}"
    call = harness.make_call(provider, mode, _case(shape, bench_device, bench_dtype))
    timing.warm_up(call, bench_device)  # compiles the "compile" provider outside the timed region
    peak = harness.peak_extra_bytes(call, bench_device)
    benchmark.extra_info.update(
        report.benchmark_extra_info(
            provider=provider,
            mode=mode,
            device=bench_device,
            dtype=bench_dtype,
            shape=shape,
            peak_extra=peak,
        )
    )
    outputs = benchmark(timing.synchronized(call, bench_device))
    report.add_rate(benchmark.extra_info, benchmark)
    assert outputs[0].shape == (shape.batch, shape.q_len, shape.value_dim)
