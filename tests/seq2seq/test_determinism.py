"""Determinism and thread safety.

- Same inputs, same thread count: bitwise the same outputs and gradients, call after call and in
  fresh processes (C++ kernel; Triton under the interpreter or on CUDA).
- 1 vs 2 intra-op threads (the C++ kernel splits rows differently): equal within tolerance.
- The op called from several Python threads at once (a thread pool serving requests): every
  result bitwise equal to the serial one, forward and backward, C++ kernel and module.
- A fixed-seed training run on the fused backend: the same losses twice.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from seq2seq_fast import BahdanauAttention, additive_attention
from tests.reliability import (
    GRAD_NAMES,
    forward_backward,
    normwise_error,
    requires_cpp,
    tolerance,
    triton_attention,
    triton_device,
)

# (B, Tq, Tk, H, Dv): tiny (inline), rows split into query blocks (small B), and enough work for
# the C++ kernel to wake its threads (>= 2 * 65536 tanh per call).
SHAPES = [(3, 5, 7, 9, 4), (1, 24, 128, 96, 8), (8, 12, 40, 64, 16)]


def make_case(shape, dtype, seed=0, device="cpu"):
    batch, num_queries, num_keys, hidden, value_dim = shape
    gen = torch.Generator().manual_seed(seed)
    inputs = [
        torch.randn(batch, num_queries, hidden, generator=gen),
        torch.randn(batch, num_keys, hidden, generator=gen),
        torch.randn(batch, num_keys, value_dim, generator=gen),
        torch.randn(hidden, generator=gen) / hidden**0.5,
        torch.randn(hidden, generator=gen) * 0.3,
    ]
    lengths = torch.randint(1, num_keys + 1, (batch,), generator=gen)
    lengths[0] = num_keys
    return [t.to(dtype).to(device) for t in inputs], lengths.to(device)


def flat(result):
    context, weights, grads = result
    return [context, weights, *grads]


def assert_bitwise(a, b, what):
    for name, x, y in zip(("context", "weights", *GRAD_NAMES), flat(a), flat(b), strict=True):
        assert torch.equal(x, y), f"{what}: {name} differs"


@pytest.fixture
def threads():
    """Set torch's intra-op thread count for one test, restoring it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# --- run to run ----------------------------------------------------------------------------------


@requires_cpp
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", SHAPES, ids=["tiny", "split-rows", "threaded"])
def test_cpp_bitwise_run_to_run(shape, dtype, num_threads, threads):
    threads(num_threads)
    inputs, lengths = make_case(shape, dtype)
    first = forward_backward(additive_attention, inputs, lengths=lengths)
    for _ in range(3):
        assert_bitwise(
            forward_backward(additive_attention, inputs, lengths=lengths), first, "rerun"
        )


@pytest.mark.triton
def test_triton_bitwise_run_to_run():
    inputs, lengths = make_case((2, 5, 7, 9, 3), torch.float32, device=triton_device())
    first = forward_backward(triton_attention, inputs, lengths=lengths)
    again = forward_backward(triton_attention, inputs, lengths=lengths)
    assert_bitwise(again, first, "triton rerun")


_HASH_SCRIPT = """
import hashlib, sys, torch
sys.path.insert(0, {root!r})
from tests.seq2seq.test_determinism import make_case, flat
from tests.reliability import forward_backward
from seq2seq_fast import additive_attention
torch.set_num_threads(2)
digest = hashlib.sha256()
for shape in {shapes!r}:
    inputs, lengths = make_case(shape, torch.float32)
    for t in flat(forward_backward(additive_attention, inputs, lengths=lengths)):
        digest.update(t.contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


@requires_cpp
def test_cpp_bitwise_across_processes(threads):
    """A fresh process (other allocations, other buffer alignments) gives the same bits."""
    root = str(Path(__file__).resolve().parents[2])
    script = _HASH_SCRIPT.format(root=root, shapes=SHAPES)
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True
    ).stdout.strip()
    threads(2)
    digest = hashlib.sha256()
    for shape in SHAPES:
        inputs, lengths = make_case(shape, torch.float32)
        for t in flat(forward_backward(additive_attention, inputs, lengths=lengths)):
            digest.update(t.contiguous().numpy().tobytes())
    assert child == digest.hexdigest()


# --- across thread counts ------------------------------------------------------------------------


@requires_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=["split-rows", "threaded"])
def test_cpp_one_vs_two_threads_within_tolerance(shape, dtype, threads):
    inputs, lengths = make_case(shape, dtype, seed=1)
    threads(1)
    one = forward_backward(additive_attention, inputs, lengths=lengths)
    threads(2)
    two = forward_backward(additive_attention, inputs, lengths=lengths)
    tol = 1e-12 if dtype == torch.float64 else tolerance(dtype, inputs[3])
    for name, a, b in zip(("context", "weights", *GRAD_NAMES), flat(one), flat(two), strict=True):
        assert normwise_error(b, a) <= tol, name


# --- thread safety -------------------------------------------------------------------------------


@requires_cpp
@pytest.mark.parametrize("with_grad", [False, True], ids=["forward", "forward+backward"])
def test_cpp_concurrent_calls_equal_serial(with_grad, threads):
    threads(2)
    cases = [make_case(SHAPES[i % 3], torch.float32, seed=i) for i in range(12)]

    def run(case):
        inputs, lengths = case
        if with_grad:
            return flat(forward_backward(additive_attention, inputs, lengths=lengths))
        with torch.no_grad():
            return list(additive_attention(*inputs, lengths=lengths))

    serial = [run(case) for case in cases]
    for _ in range(2):
        with ThreadPoolExecutor(max_workers=4) as pool:
            concurrent = list(pool.map(run, cases))
        for i, (a, b) in enumerate(zip(serial, concurrent, strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), f"request {i} differs when run concurrently"


@requires_cpp
def test_module_shared_by_threads_equals_serial(threads):
    """One BahdanauAttention (eval, no grad) serving decoding steps from several threads."""
    threads(2)
    torch.manual_seed(0)
    module = BahdanauAttention(16, 24, 32, weight_norm=True, backend="fused").eval()
    requests = []
    gen = torch.Generator().manual_seed(3)
    for i in range(16):
        batch, num_keys = 1 + i % 4, 5 + 3 * i
        keys = torch.randn(batch, num_keys, 24, generator=gen)
        query = torch.randn(batch, 16, generator=gen)
        lengths = torch.randint(1, num_keys + 1, (batch,), generator=gen)
        requests.append((query, keys, lengths))

    def serve(request):
        query, keys, lengths = request
        with torch.no_grad():
            projected = module.project_keys(keys)
            return module(query, keys, lengths=lengths, projected_keys=projected)

    serial = [serve(r) for r in requests]
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(serve, requests))
    for (c1, w1), (c2, w2) in zip(serial, concurrent, strict=True):
        assert torch.equal(c1, c2) and torch.equal(w1, w2)


# --- training ------------------------------------------------------------------------------------

TINY_TRAIN = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=20,
    embed_size=12,
    hidden_size=16,
    batch_size=8,
    lr=1e-2,
    warmup_steps=2,
    progress=False,
    heatmap=False,
    threads=2,
    epochs=1,
    steps_per_epoch=6,
    dropout=0.1,
)


@requires_cpp
@pytest.mark.parametrize("decoder", ["bahdanau", "gnmt"])
def test_fixed_seed_training_on_the_fused_kernel_repeats_exactly(decoder, tmp_path):
    train_module = pytest.importorskip("seq2seq_fast.seq2seq.train")
    config = dict(TINY_TRAIN, decoder=decoder, backend="fused")
    a = train_module.train(train_module.TrainConfig(**config, out=str(tmp_path / "a")))
    b = train_module.train(train_module.TrainConfig(**config, out=str(tmp_path / "b")))
    assert len(a.losses) == 6 and a.losses == b.losses
    state_a = torch.load(a.checkpoint, weights_only=True)["model"]
    state_b = torch.load(b.checkpoint, weights_only=True)["model"]
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
