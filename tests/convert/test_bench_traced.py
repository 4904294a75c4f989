"""The general path's benchmark runs (at size tiny, few calls): its per-call table has a row
per family asked for, with a time for each provider."""

from __future__ import annotations

import pytest
import torch

from seq2seq_fast.ops import fused_available

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float32), reason="the C++ extension is not built"
)


def test_the_per_call_table_times_each_provider():
    from bench.bench_convert_traced import per_call

    threads = torch.get_num_threads()
    try:
        table = per_call("tiny", 1, 3, ["espnet AttAdd"])
    finally:
        torch.set_num_threads(threads)
    row = next(line for line in table.splitlines() if line.startswith("| espnet AttAdd"))
    times = [float(cell) for cell in row.strip("|").split("|")[1:]]
    assert len(times) == 3 and all(t > 0 for t in times), row
