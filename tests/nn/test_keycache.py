"""The projected-key cache (nn/keycache.py) as the tutorial stand-in uses it: reuse across a
decoder's steps, what invalidates it, backward between steps, no-grad decoding, weak keys,
torch.func, threads, copies."""

from __future__ import annotations

import copy
import gc
import pickle
import threading

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from seq2seq_fast import fuse_attention
from seq2seq_fast.nn.keycache import ProjectionCache
from seq2seq_fast.ops import fused_available
from tests.layouts import TutorialAttention

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

B, S, H = 3, 7, 6


def _pair(dtype=torch.float64):
    torch.manual_seed(0)
    plain = nn.ModuleDict({"attn": TutorialAttention(H)}).to(dtype)
    fused = copy.deepcopy(plain)
    assert fuse_attention(fused) == 1
    return plain["attn"], fused["attn"]


def _inputs(dtype=torch.float64):
    torch.manual_seed(1)
    keys = torch.randn(B, S, H, dtype=dtype, requires_grad=True)
    query = torch.randn(B, H, dtype=dtype, requires_grad=True)
    return keys, query


def _steps(module, keys, query, steps, between=None):
    """A recurrence over ``steps``; ``between(t)`` runs after step t (may return a new loss)."""
    loss, state = 0, query
    for t in range(steps):
        context, weights = module(state.unsqueeze(1), keys)
        loss = loss + context.square().sum() + (weights * torch.arange(S)).sum()
        state = torch.tanh(state + context.squeeze(1))
        if between is not None:
            loss, state = between(t, loss, state)
    return loss


def _grads(module, keys, query):
    named = dict(module.named_parameters())
    grads = {n: p.grad for n, p in named.items()}
    grads = {n: torch.zeros_like(named[n]) if g is None else g.clone() for n, g in grads.items()}
    return grads | {"keys": keys.grad.clone(), "query": query.grad.clone()}


def _assert_same(a: dict, b: dict, tol=1e-10):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=tol, rtol=tol, msg=key)


def test_one_projection_per_sequence_and_same_gradients():
    plain, fused = _pair()
    results = []
    for module in (plain, fused):
        keys, query = _inputs()
        _steps(module, keys, query, 5).backward()
        results.append(_grads(module, keys, query))
    _assert_same(*results)
    assert (fused.key_cache.misses, fused.key_cache.hits) == (1, 4)
    assert not fused.key_cache._entries  # the backward ran through the projection: dropped


def test_backward_between_steps():
    plain, fused = _pair()

    def between(t, loss, state):
        if t == 1:
            loss.backward()  # no retain_graph: the first projection's graph is freed
            return 0, state.detach()
        return loss, state

    results = []
    for module in (plain, fused):
        keys, query = _inputs()
        _steps(module, keys, query, 4, between).backward()
        results.append(_grads(module, keys, query))
    _assert_same(*results)
    assert fused.key_cache.misses == 2  # projected again after the backward


def test_what_invalidates_an_entry():
    _, fused = _pair()
    keys, query = _inputs()
    cache = fused.key_cache
    with torch.no_grad():
        fused(query.unsqueeze(1), keys)
        fused(query.unsqueeze(1), keys)
        assert (cache.misses, cache.hits) == (1, 1)
        keys.mul_(1.0)  # in place: a new version
        fused(query.unsqueeze(1), keys)
        assert cache.misses == 2
        fused.Ua.weight.add_(0.0)  # what an optimiser step does
        fused(query.unsqueeze(1), keys)
        assert cache.misses == 3
        fused(query.unsqueeze(1), keys.clone())  # another tensor (beam reordering, new batch)
        assert cache.misses == 4
    fused(query.unsqueeze(1), keys)  # grad mode on
    assert cache.misses == 5


def test_changes_through_data_need_clear():
    plain, fused = _pair()
    keys, query = _inputs()
    with torch.no_grad():
        fused(query.unsqueeze(1), keys)
        for module in (plain, fused):
            module.Ua.weight.data.mul_(2.0)  # bypasses the version counter: the documented limit
        fused.key_cache.clear()
        expected, _ = plain(query.unsqueeze(1), keys)
        got, _ = fused(query.unsqueeze(1), keys)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_no_grad_decoding_holds_keys_weakly():
    plain, fused = _pair(torch.float32)
    keys, query = _inputs(torch.float32)
    with torch.no_grad():
        keys = keys.detach().clone()
        for _ in range(3):
            expected, _ = plain(query.unsqueeze(1), keys)
            got, _ = fused(query.unsqueeze(1), keys)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(fused.key_cache._entries) == 1
    del keys
    gc.collect()
    assert not fused.key_cache._entries


def test_transposed_keys_made_contiguous_once():
    """Keys that are a view (nn.GRU(batch_first=True) returns its output transposed): the same
    results and gradients, and in no-grad decoding the one contiguous copy goes with the keys."""
    plain, fused = _pair()
    results = []
    for module in (plain, fused):
        torch.manual_seed(1)
        time_major = torch.randn(S, B, H, dtype=torch.float64, requires_grad=True)
        keys = time_major.transpose(0, 1)
        assert not keys.is_contiguous()
        query = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
        _steps(module, keys, query, 4).backward()
        results.append(_grads(module, time_major, query))  # "keys": the leaf's gradient
    _assert_same(*results)
    with torch.no_grad():
        keys = torch.randn(S, B, H, dtype=torch.float64).transpose(0, 1)
        query = torch.randn(B, 1, H, dtype=torch.float64)
        for _ in range(2):
            torch.testing.assert_close(fused(query, keys), plain(query, keys), atol=1e-12, rtol=0)
    assert fused.key_cache.hits >= 1 and len(fused.key_cache._entries) == 1
    del keys
    gc.collect()
    assert not fused.key_cache._entries


def test_torch_func_bypasses_the_cache():
    plain, fused = _pair()
    keys, query = _inputs()
    keys, query = keys.detach(), query.detach()

    def loss(module, q):
        context, _ = module(q.unsqueeze(1), keys)
        return context.square().sum()

    expected = torch.func.grad(lambda q: loss(plain, q))(query)
    got = torch.func.grad(lambda q: loss(fused, q))(query)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    assert fused.key_cache.misses == fused.key_cache.hits == 0


def test_threads_get_their_own_entries():
    plain, fused = _pair()
    inputs = [(torch.randn(B, S, H).double(), torch.randn(B, 1, H).double()) for _ in range(4)]
    with torch.no_grad():
        expected = [plain(q, k)[0] for k, q in inputs]
    got = [None] * len(inputs)
    barrier = threading.Barrier(len(inputs))

    def run(i):
        keys, query = inputs[i]
        barrier.wait()
        with torch.no_grad():
            for _ in range(20):
                got[i] = fused(query, keys)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)
    assert fused.key_cache.misses == len(inputs)  # one per thread, the other calls hit


def test_copies_and_pickles_start_empty():
    _, fused = _pair()
    keys, query = _inputs()
    fused(query.unsqueeze(1), keys)  # a populated entry, with a graph
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert not clone.key_cache._entries and clone.key_cache is not fused.key_cache
        torch.testing.assert_close(
            clone(query.unsqueeze(1), keys)[0], fused(query.unsqueeze(1), keys)[0]
        )


def test_plain_cache_api():
    cache = ProjectionCache()
    linear = nn.Linear(4, 3)
    keys = torch.randn(2, 5, 4)
    calls = []

    def compute():
        calls.append(1)
        return linear(keys)

    first = cache.get(keys, (linear.weight, linear.bias, 7), compute)
    assert cache.get(keys, (linear.weight, linear.bias, 7), compute) is first
    cache.get(keys, (linear.weight, linear.bias, 8), compute)  # a plain value changed
    assert len(calls) == 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    plain, fused = _pair()
    results = []
    for module in (plain, fused):
        keys, query = _inputs()

        def step(q, k, module=module):
            return module(q, k)

        loss, state = 0, query
        for _ in range(3):
            context, _ = torch.utils.checkpoint.checkpoint(
                step, state.unsqueeze(1), keys, use_reentrant=reentrant
            )
            loss = loss + context.square().sum()
            state = torch.tanh(state + context.squeeze(1))
        loss.backward()
        results.append(_grads(module, keys, query))
    _assert_same(*results)
