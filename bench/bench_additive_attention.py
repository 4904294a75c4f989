"""The op: fused vs eager reference vs torch.compile of the reference, forward and forward+backward.

Each benchmark group holds the providers of one (mode, shape). extra_info: provider, device, dtype,
threads, versions, tanh count, G tanh/s, peak extra memory (see seq2seq_fast/bench.py).
"""

from __future__ import annotations

import pytest

from bench import harness as sb

DEVICE = sb.default_device()
SHAPES = sb.shapes_for(sb.default_size(), DEVICE)

_cases: dict[sb.Shape, sb.Case] = {}


def _case(shape: sb.Shape, device: str, dtype) -> sb.Case:
    # Inputs are shared by the providers and modes of a shape; only the latest shape is kept.
    if shape not in _cases:
        _cases.clear()
        _cases[shape] = sb.make_case(shape, device, dtype)
    return _cases[shape]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", sb.MODES)
@pytest.mark.parametrize("provider", sb.default_providers())
def test_additive_attention(benchmark, provider, mode, shape, bench_device, bench_dtype):
    reason = sb.provider_unavailable_reason(provider, bench_device, bench_dtype)
    if reason is not None:
        pytest.skip(reason)
    benchmark.group = f"additive_attention {mode} {shape.name}: {shape.label}"
    call = sb.make_call(provider, mode, _case(shape, bench_device, bench_dtype))
    sb.warm_up(call, bench_device)  # compiles the "compile" provider outside the timed region
    peak = sb.peak_extra_bytes(call, bench_device)
    benchmark.extra_info.update(
        sb.benchmark_extra_info(
            provider=provider, mode=mode, device=bench_device, dtype=bench_dtype, shape=shape,
            peak_extra=peak,
        )
    )  # fmt: skip
    outputs = benchmark(sb.synchronized(call, bench_device))
    sb.add_rate(benchmark.extra_info, benchmark)
    assert outputs[0].shape == (shape.batch, shape.q_len, shape.value_dim)
