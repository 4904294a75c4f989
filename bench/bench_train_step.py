"""A training step of the Seq2Seq model: tokens/s per attention backend and decoder.

The pytest-benchmark view of ``bench/train_throughput.py`` (the Seq2Seq engineer's table): the model,
batch and step (forward, loss, backward, AdamW on a full batch) come from its ``make_step``.
Providers: fused, eager (``backend="reference"``), compile (``torch.compile`` of the whole model,
compiled during warm-up) and zero (an attention that costs nothing: the bound any kernel can
reach). One group per (decoder, size). Skipped with the reason when ``seq2seq_fast.seq2seq.models`` or the
script is missing.
"""

from __future__ import annotations

import pytest
import torch

from bench import harness as sb

DEVICE = sb.default_device()
SIZE = sb.default_size()
PROVIDERS = [p for p in sb.PROVIDERS if p in sb.default_providers()] + ["zero"]
_SCRIPT_NAME = {"eager": "reference"}  # our provider name -> train_throughput's


def _train_throughput():
    try:
        import train_throughput  # bench/ is on sys.path: pytest inserts the conftest's folder
    except ImportError as exc:
        pytest.skip(f"bench/train_throughput.py or seq2seq_fast.seq2seq.models missing: {exc}")
    return train_throughput


def _sizes() -> list[str]:
    if SIZE == "tiny":
        return ["tiny"]
    return ["small"] if SIZE == "quick" else ["small", "large"]


@pytest.mark.parametrize("size_name", _sizes())
@pytest.mark.parametrize("decoder", ["gnmt", "bahdanau"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_train_step(benchmark, provider, decoder, size_name, bench_device, bench_dtype):
    tt = _train_throughput()
    if provider in ("fused", "compile"):
        reason = sb.provider_unavailable_reason("fused", bench_device, bench_dtype)
        if reason is not None:
            pytest.skip(reason)
    size = (
        tt.Size("tiny", hidden=8, length=5, batch=3) if size_name == "tiny" else tt.SIZES[size_name]
    )
    vocab = 20 if size_name == "tiny" else 1000
    benchmark.group = (
        f"train step {decoder} decoder, {size_name}: hidden={size.hidden} length={size.length} "
        f"batch={size.batch} vocab={vocab}"
    )
    step = tt.make_step(_SCRIPT_NAME.get(provider, provider), decoder, size, vocab, bench_device)
    sb.warm_up(step, bench_device)  # compiles the "compile" provider outside the timed region
    tokens = size.batch * size.length
    benchmark.extra_info.update(
        provider=provider,
        decoder=decoder,
        device=bench_device,
        dtype=str(bench_dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        triton=sb.package_version("triton"),
        size=size_name,
        tokens_per_step=tokens,
        attention_tanh_count=size.batch * size.length * size.length * size.hidden,
    )
    loss = benchmark(sb.synchronized(step, bench_device))
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if getattr(stats, "median", None):
        benchmark.extra_info["tokens_per_s"] = tokens / stats.median
    assert loss == loss  # not NaN
