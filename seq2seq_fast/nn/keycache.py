"""A stand-in's cache of its fixed memory's projection, reused across a decoder's steps.

Many decoders call their attention once per target step with the same encoder outputs, and the
attention projects them again every time (the PyTorch tutorial's ``Ua(keys)``): per step a
[B*S, D] x [D, H] product forward and two backward, the larger part of the attention's cost.
:class:`ProjectionCache` computes it once and hands the same result to the later steps, when all
of these are unchanged since it was computed:

- the keys: the same tensor object (held by a weak reference) at the same version (``_version``,
  which every in-place operation bumps) and ``requires_grad``;
- each projection parameter: the same object, version, storage and ``requires_grad``;
- the grad mode, inference mode and autocast state of the calling thread.

Training: the steps share the one projection in the graph, so one backward after all the steps
gives the gradients of the original (summed over the steps in another order). A backward that
runs through the projection (between steps, with or without ``retain_graph``) drops the entry:
the next step projects again, as the original does, so a later backward never meets a freed
graph. With a :class:`~seq2seq_fast.ops.stepwise.StepwiseMemory` in the cached value (built by the
``compute`` function, see ``FusedTutorialAttention``), the values' and keys' gradients of all the
steps are gathered once per sequence.

The one limit: a change that bypasses the version counters (``tensor.data.add_(...)``, or
assigning through ``.data`` to the keys in place) is not seen; call :meth:`clear` after one.

Bypassed (``compute`` runs every call): under torch.compile / torch.jit tracing or scripting and
inside torch.func transforms, whose graphs must not capture Python-side state, and under
saved-tensor hooks (``torch.utils.checkpoint`` without reentrance re-runs the forward in the
backward and checks that it saves the same tensors; ``save_on_cpu``), and for inference tensors
(made under ``torch.inference_mode``), which keep no version counter. Beam search that
reorders or expands the memory passes a new tensor: a miss, so it projects again (correct, and
the cache then serves the following steps over that tensor).

Memory: each calling thread holds at most one entry (the last keys it projected), at most
:data:`MAX_THREADS` threads. The entry goes when its keys die (inference), when a backward runs
through it (training), when other keys come, or with :meth:`clear`. While a graph that saved the
keys is held (a forward with gradients and no backward yet), the keys stay alive through it.

Deep copies and pickles of a module start with an empty cache.

Usage in a stand-in (a family in :mod:`seq2seq_fast.nn.convert` may use it the same way)::

    self._key_cache = ProjectionCache()
    ...
    projected = self._key_cache.get(keys, (lin.weight, lin.bias), lambda: lin(keys))

A ``compute`` may also return more than the projection (a tuple with a StepwiseMemory built on
it); then pass ``watch=`` the function that picks the projection itself from the value.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from seq2seq_fast.ops._autograd import traced_or_transformed
from seq2seq_fast.ops._checks import autocast_dtype
from seq2seq_fast.ops._torch_private import pytree, saved_tensors_hooks_active

T = TypeVar("T")
MAX_THREADS = 8


def cache_bypassed() -> bool:
    """True where a cache must not be used: torch.compile, torch.jit, torch.func, and under
    saved-tensor hooks (activation checkpointing re-runs the forward and expects the same saved
    tensors; offloading hooks)."""
    return (
        traced_or_transformed()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or saved_tensors_hooks_active()
    )


class Weak:
    """A tensor parameter of :meth:`ProjectionCache.get` held weakly: compared like any tensor
    (identity, version, storage, requires_grad), but the cache does not keep it alive (the
    call's own values, which a decoder's steps pass again and again: the cache must not hold the
    last batch's memory after decoding ends)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _param_state(param: object) -> tuple | None:
    """A tensor by identity, version, storage and requires_grad; anything else by value. None
    for an inference tensor: it has no version counter, so a change in place cannot be seen."""
    weak = isinstance(param, Weak)
    if weak:
        param = param.tensor
    if not isinstance(param, Tensor):
        return (None, param)
    if param.is_inference():
        return None
    # (a basic weak reference is one object per tensor: identity compares as the tensor's)
    held = weakref.ref(param) if weak else param
    return (held, param._version, param.data_ptr(), param.requires_grad)


class _Entry:
    __slots__ = ("keys_ref", "state", "value", "token", "watched")

    def __init__(self, keys_ref, state, value, token, watched: frozenset) -> None:
        self.keys_ref, self.state, self.value, self.token = keys_ref, state, value, token
        self.watched = watched  # ids of the tensors whose gradient drops the entry


class ProjectionCache:
    """One cached projection per calling thread (see the module docstring)."""

    def __init__(self) -> None:
        # (reentrant: a weak reference's callback may run while this thread holds it)
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        # the tensors that carry this cache's gradient hook, by id: one hook each, however many
        # entries watch them (a memo that misses at every step over the same keys)
        self._hooked: dict[int, weakref.ref] = {}
        self.hits = 0  # counters for tests and benchmarks
        self.misses = 0

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def clear(self) -> None:
        """Drop every entry (e.g. after changing keys or weights through ``.data``)."""
        with self._lock:
            self._entries.clear()

    def get(
        self,
        keys: Tensor,
        params: Sequence[object],
        compute: Callable[[], T],
        watch: Callable[[T], Sequence[Tensor]] | None = None,
    ) -> T:
        """``compute()``, or the value it returned for these ``keys`` and ``params`` before when
        nothing listed in the module docstring has changed since. ``params``: the projection's
        parameters (None for a missing bias) and any plain values the projection depends on
        (compared by equality). ``watch(value)``: the tensors
        of the value whose gradient a backward computes when it runs through the cached graph
        (default: every tensor in the value); the entry is dropped when one gets its gradient."""
        if cache_bypassed() or not isinstance(keys, Tensor) or keys.is_inference():
            return compute()  # (an inference tensor has no version counter to watch)
        state = (
            keys._version,
            keys.requires_grad,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast_dtype(keys.device),
            *map(_param_state, params),
        )
        if None in state[5:]:
            return compute()
        thread = threading.get_ident()
        entry = self._entries.get(thread)
        if entry is not None and entry.keys_ref() is keys and _same(entry.state, state):
            self.hits += 1
            return entry.value
        self.misses += 1
        value = compute()
        watched = pytree.tree_leaves(value) if watch is None else watch(value)
        self._store(thread, keys, state, value, watched)
        return value

    def _store(self, thread: int, keys: Tensor, state: tuple, value: Any, watched) -> None:
        token = object()
        this = weakref.ref(self)

        def drop(_=None) -> None:
            cache = this()
            if cache is not None:
                cache._drop(token)

        try:
            keys_ref = weakref.ref(keys, drop)
        except TypeError:  # not weak-referenceable: nothing cached
            return
        graded = [t for t in watched if isinstance(t, Tensor) and t.grad_fn is not None]
        with self._lock:
            for tensor in graded:
                self._hook(tensor)
            self._entries.pop(thread, None)
            while len(self._entries) >= MAX_THREADS:
                self._entries.pop(next(iter(self._entries)))
            watching = frozenset(id(t) for t in graded)
            self._entries[thread] = _Entry(keys_ref, state, value, token, watching)

    def _hook(self, tensor: Tensor) -> None:
        """Have a backward that reaches ``tensor`` drop every entry watching it (once per
        tensor; under the lock)."""
        key = id(tensor)
        known = self._hooked.get(key)
        if known is not None and known() is tensor:
            return
        this = weakref.ref(self)

        def reached(grad, key=key) -> None:
            cache = this()
            if cache is not None:
                cache._drop_watching(key)

        def died(ref, key=key) -> None:
            cache = this()
            if cache is not None and cache._hooked.get(key) is ref:
                del cache._hooked[key]

        tensor.register_hook(reached)
        self._hooked[key] = weakref.ref(tensor, died)

    def _drop(self, token: object) -> None:
        with self._lock:
            for thread, entry in list(self._entries.items()):
                if entry.token is token:
                    del self._entries[thread]

    def _drop_watching(self, key: int) -> None:
        with self._lock:
            for thread, entry in list(self._entries.items()):
                if key in entry.watched:
                    del self._entries[thread]


def _same(a: tuple, b: tuple) -> bool:
    """Element-wise equality where tensors compare by identity (a tensor's state is a tuple
    led by the tensor: see _param_state)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.__class__ is tuple:
            # (a shorter or longer y differs in its tail; x is never empty)
            if y.__class__ is not tuple or x[0] is not y[0] or x[1:] != y[1:]:
                return False
        elif x != y:
            return False
    return True
