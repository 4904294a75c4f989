"""The general path's step memo (``TracedWeights._step_memo``): over a decoder's steps the
replacement derives the keys, the folded scale and the mask's rows once, and it derives them
again whenever anything they came from changes: a buffer, a parameter, the mask or the memory
changed in place, a backward through them, another grad mode. Each step's result is the
original module's."""

from __future__ import annotations

import copy

import pytest
import torch

from seq2seq_fast.nn.convert import fuse_attention_report
from seq2seq_fast.nn.convert.traced.rewrite import TracedWeights, recorded_runs
from seq2seq_fast.ops import fused_available
from tests.convert.layouts_traced import K, Q, Tempered, _Call, lengths_mask

pytestmark = pytest.mark.skipif(
    not fused_available("cpu", torch.float64), reason="the C++ extension is not built"
)

B, T = 3, 7


def _pair():
    torch.manual_seed(0)
    plain = _Call(Tempered()).double()
    fused = copy.deepcopy(plain)
    memory, valid = _inputs()
    report = fuse_attention_report(fused, named=False, example_inputs=(_query(0), memory, valid))
    assert report.count == 1, report
    return plain, fused


def _inputs():
    gen = torch.Generator().manual_seed(1)
    memory = torch.randn(B, T, K, dtype=torch.float64, generator=gen)
    return memory, lengths_mask(B, T)


def _query(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, Q, dtype=torch.float64, generator=gen)


def _step(plain, fused, query, memory, valid) -> TracedWeights:
    """One step of both; their outputs equal; the replacement that ran."""
    with recorded_runs() as ran:
        got = fused(query, memory, valid)
    want = plain(query, memory, valid)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert len(ran) == 1, "the step did not run the fused replacement"
    return ran[0]


def test_the_steps_over_one_memory_derive_their_arguments_once():
    plain, fused = _pair()
    memory, valid = _inputs()
    _step(plain, fused, _query(0), memory, valid)  # the first call converts
    replacement = _step(plain, fused, _query(1), memory, valid)
    misses, hits = replacement.step_cache.misses, replacement.step_cache.hits
    for t in range(2, 8):
        _step(plain, fused, _query(t), memory, valid)
    assert (replacement.step_cache.misses, replacement.step_cache.hits) == (misses, hits + 6)
    # a new mask tensor with the same elements each step (``self.mask == 0``) is the same mask
    for t in range(8, 11):
        _step(plain, fused, _query(t), memory, valid.clone())
    assert (replacement.step_cache.misses, replacement.step_cache.hits) == (misses, hits + 9)


@pytest.mark.parametrize(
    "change",
    [
        "temperature",
        "negative temperature",
        "score weight",
        "key weight",
        "mask in place",
        "another mask",
        "memory in place",
        "no grad",
    ],
)
def test_a_change_between_steps_is_seen(change):
    plain, fused = _pair()
    memory, valid = _inputs()
    _step(plain, fused, _query(0), memory, valid)
    replacement = _step(plain, fused, _query(1), memory, valid)
    misses = replacement.step_cache.misses
    grad = True
    with torch.no_grad():
        if change.endswith("temperature"):
            value = -1.5 if change.startswith("negative") else 0.7
            for model in (plain, fused):
                model.att.temperature.fill_(value)
        elif change in ("score weight", "key weight"):
            for model in (plain, fused):
                layer = model.att.out if change == "score weight" else model.att.keys_in
                layer.weight.mul_(1.5)
        elif change == "mask in place":
            valid[0, 1:] = False
        elif change == "another mask":
            valid = valid.clone()
            valid[1, 2:] = False
        elif change == "memory in place":
            memory.mul_(-0.5)
        else:
            grad = False
    with torch.set_grad_enabled(grad):
        ran = _step(plain, fused, _query(2), memory, valid)
        if ran is not replacement:  # another trace (no grad): its own replacement
            replacement, misses = ran, 0
        assert replacement.step_cache.misses == misses + 1, change
        _step(plain, fused, _query(3), memory, valid)  # and is kept again after
        assert replacement.step_cache.misses == misses + 1, change


def test_training_iterations_reuse_nothing_a_backward_freed():
    """Several decoder steps and a backward, twice over the same memory (gradient accumulation:
    nothing changes version in between), then an optimiser step, again: the gradients are the
    original's each time (a memo that outlived its graph would fail the second backward)."""
    plain, fused = _pair()
    memory, valid = _inputs()
    memory.requires_grad_()
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, fused)]
    for iteration in range(3):
        grads = []
        for model, optimiser in zip((plain, fused), optimisers, strict=True):
            optimiser.zero_grad()
            memory.grad = None
            for _ in range(2):
                outputs = [model(_query(t), memory, valid)[0] for t in range(4)]
                sum(out.pow(2).sum() * (t + 1) for t, out in enumerate(outputs)).backward()
            # (a score bias a softmax cancels: zero in the original, no gradient in the fused)
            grads.append(
                [memory.grad.clone()]
                + [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
            )
            optimiser.step()
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(
                got, want, rtol=1e-9, atol=1e-12, msg=f"iteration {iteration}"
            )


def test_a_memo_that_misses_every_step_hooks_each_tensor_once():
    """A buffer replaced at every step (a fresh temperature) makes the memo derive its
    arguments again each step over the same keys: the keys' projection, shared by the steps,
    carries one gradient hook however many steps stored an entry watching it, and the
    gradients stay the original's."""
    plain, fused = _pair()
    memory, valid = _inputs()
    memory.requires_grad_()
    outputs = {}
    seen: dict[int, int] = {}  # hooks on each watched tensor when first seen
    for name, model in (("plain", plain), ("fused", fused)):
        total = 0
        for t in range(6):
            model.att.temperature = torch.tensor(1.0 + 0.25 * t, dtype=torch.float64)
            with recorded_runs() as ran:
                total = total + model(_query(t), memory, valid)[0].pow(2).sum()
            if name == "fused":
                replacement = ran[0]
                key = replacement.step_cache._entries[next(iter(replacement.step_cache._entries))]
                # (the step hands its watched tensors to the memo, which hooks them and keeps
                # them weakly)
                hooked = replacement.step_cache._hooked.values()
                watched = [ref() for ref in hooked if ref() is not None]
                assert _step_of(replacement).watch == []
                assert watched, "the step watches no graded tensor"
                for tensor in watched:
                    # one hook per cache watching it (the key term's own, the key layout's and
                    # the step memo's: a key term already in the op's layout is its own key and
                    # its own raw term), not one per step
                    hooks = len(tensor._backward_hooks or {})
                    assert hooks <= 3, (t, tensor.shape)
                    assert seen.setdefault(id(tensor), hooks) == hooks, (t, tensor.shape)
                assert key.watched
        total.backward()
        # (a score bias a softmax cancels: zero in the original, no gradient in the fused)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        outputs[name] = [memory.grad.clone(), *grads]
        memory.grad = None
    for got, want in zip(outputs["fused"], outputs["plain"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _step_of(replacement: TracedWeights):
    entries = replacement.step_cache._entries
    return entries[next(iter(entries))].value


def test_the_memo_holds_its_anchor_weakly():
    """The step memo's state names its anchor (the first non-parameter key input) only through
    the weak reference: the memory dies with its last user reference, and the entry with it."""
    import gc
    import weakref

    plain, fused = _pair()
    memory, valid = _inputs()
    with torch.no_grad():
        for t in range(2):
            fused(_query(t), memory, valid)
        with recorded_runs() as ran:
            fused(_query(2), memory, valid)
    cache = ran[0].step_cache
    entry = cache._entries[next(iter(cache._entries))]
    assert entry.keys_ref() is memory
    for part in entry.state:
        assert not (isinstance(part, tuple) and part and part[0] is memory), "held strongly"
    ref = weakref.ref(memory)
    step = entry.value
    held_by_value = any(t is memory or t._base is memory for t in step.watch if t is not None)
    del memory, entry, step
    gc.collect()
    if not held_by_value:
        assert ref() is None and not cache._entries
