"""Hostile and malformed inputs to every public entry point: a clear error, never a crash or a hang.

Entry points: ``additive_attention``, the raw ops ``torch.ops.seq2seq_fast.additive_attention_fwd``
/ ``_bwd`` (C++ kernel), ``BahdanauAttention``, ``fuse_attention``, the checkpoint loader
(``load_checkpoint`` / ``load_model``), the corpus loader (``read_parallel_corpus``) and the
``seq2seq-fast`` command.

Every case in ``CASES`` runs in a child process (``python tests/reliability/test_hostile.py``), so a segfault
or a floating-point trap fails that case instead of killing pytest, and a hang is cut off by a
timeout; after a crash the remaining cases run in a fresh child. A case expects either an
exception of a given type whose message contains given words (the argument it names, what was
wrong), or success with its own checks (degenerate sizes: right shapes, zeros, no NaN).
docs/RELIABILITY.md lists the cases and what each gives.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

B, TQ, TK, H, DV = 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Path], object]  # runs in the child with a scratch folder
    error: str | None  # expected exception class name (a base class name matches too); None: ok
    words: tuple[str, ...] = ()  # must all appear in the message (case-insensitive)
    xfail: str | None = None  # a known bug: strict xfail with this reason


# --- inputs ------------------------------------------------------------------------------------


def T(dtype=torch.float32):  # noqa: N802
    """Fresh valid (query, keys, values, v, bias)."""
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, TQ, H, generator=gen).to(dtype),
        torch.randn(B, TK, H, generator=gen).to(dtype),
        torch.randn(B, TK, DV, generator=gen).to(dtype),
        torch.randn(H, generator=gen).to(dtype),
        torch.randn(H, generator=gen).to(dtype),
    )


def attn(*args, **kwargs):
    from seq2seq_fast import additive_attention

    return additive_attention(*args, **kwargs)


def with_input(index, value, **kwargs):
    """additive_attention on valid inputs with input ``index`` replaced by ``value(inputs)``."""

    def call(_):
        inputs = list(T())
        inputs[index] = value(inputs)
        return attn(*inputs, **kwargs)

    return call


def with_kwargs(**kwargs):
    def call(_):
        made = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
        return attn(*T(), **made)

    return call


def bool_mask(*shape):
    return lambda: torch.ones(*shape, dtype=torch.bool)


def check_degenerate(query_shape, keys_shape, values_shape, h=H, lengths=None):
    """Degenerate sizes: outputs of the right shape, zero context when no key, finite grads."""

    def call(_):
        gen = torch.Generator().manual_seed(1)
        leaves = [
            torch.randn(*shape, generator=gen).requires_grad_()
            for shape in (query_shape, keys_shape, values_shape, (h,), (h,))
        ]
        context, weights = attn(*leaves, lengths=lengths)
        lead = tuple(query_shape[:-1])
        assert context.shape == (*lead, values_shape[-1]), context.shape
        assert weights.shape == (*lead, keys_shape[1]), weights.shape
        assert torch.isfinite(context).all() and torch.isfinite(weights).all()
        if keys_shape[1] == 0:
            assert not context.any(), "no key: zero context"
        (context.sum() + weights.sum()).backward()
        for leaf in leaves:
            assert leaf.grad is None or (
                leaf.grad.shape == leaf.shape and torch.isfinite(leaf.grad).all()
            )
        return "ok"

    return call


def raw_fwd(change: Callable[[list], list]):
    """torch.ops.seq2seq_fast.additive_attention_fwd on the C++ kernel, arguments changed."""

    def call(_):
        import seq2seq_fast  # noqa: F401  (registers the ops)

        q, k, val, v, b = T()
        args = change([q, k, val, v, b, None, None, True])
        out = torch.ops.seq2seq_fast.additive_attention_fwd(*args)
        return [tuple(o.shape) for o in out]

    return call


def raw_bwd(change: Callable[[list], list], *, zero: bool = False):
    """The raw backward with arguments changed; ``zero``: every gradient must be 0 (no pairs)."""

    def call(_):
        import seq2seq_fast  # noqa: F401

        q, k, val, v, b = T()
        lengths = torch.tensor([4, 2])
        context, _, lse = torch.ops.seq2seq_fast.additive_attention_fwd(
            q, k, val, v, b, lengths, None, False
        )
        args = [torch.ones_like(context), None, q, k, val, v, b, lengths, None, context, lse]
        out = torch.ops.seq2seq_fast.additive_attention_bwd(*change(args))
        assert all(torch.isfinite(o).all() for o in out), "non-finite gradients"
        assert not zero or not any(o.any() for o in out), "gradients must be zero"
        return [tuple(o.shape) for o in out]

    return call


def returning(call, expected):
    """``call`` must return ``expected`` (e.g. the list of output shapes)."""

    def checked(folder):
        result = call(folder)
        assert result == expected, f"got {result}, expected {expected}"
        return result

    return checked


def _replacer(names):
    def replace(**changes):
        def change(args):
            args = list(args)
            for name, make in changes.items():
                args[names.index(name)] = make(args)
            return args

        return change

    return replace


replace_at = _replacer(["q", "k", "val", "v", "b", "lengths", "mask", "return_weights"])
bwd_replace_at = _replacer(
    ["gc", "gw", "q", "k", "val", "v", "b", "lengths", "mask", "context", "lse"]
)


def empty_batch(args):
    args = list(args)
    for i in (0, 1, 2):
        args[i] = args[i][:0]
    return args


def empty_queries(args):
    args = list(args)
    args[0] = args[0][:, :0]
    return args


def empty_batch_bwd(args):
    args = list(args)
    for i in (0, 2, 3, 4, 9, 10):
        args[i] = args[i][:0]
    args[7] = args[7][:0]
    return args


def empty_queries_bwd(args):
    args = list(args)
    for i in (0, 2, 9, 10):
        args[i] = args[i][:, :0]
    return args


# --- module and fuse_attention -------------------------------------------------------------------


def module(*args, **kwargs):
    from seq2seq_fast import BahdanauAttention

    return BahdanauAttention(*args, **kwargs)


def module_call(query, keys, values=None, **kwargs):
    def call(_):
        m = module(6, 8, 5)
        made = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
        return m(query(), keys(), values() if values else None, **made)

    return call


def q6():
    return torch.randn(B, TQ, 6)


def k8():
    return torch.randn(B, TK, 8)


def fuse(model_factory, **kwargs):
    def call(_):
        from seq2seq_fast import fuse_attention

        return fuse_attention(model_factory(), **kwargs)

    return call


# --- checkpoints ---------------------------------------------------------------------------------

TINY_TRAIN = dict(
    vocab_size=6,
    min_len=2,
    max_len=5,
    heldout_size=10,
    embed_size=8,
    hidden_size=8,
    batch_size=4,
    lr=1e-2,
    warmup_steps=1,
    backend="reference",
    progress=False,
    heatmap=False,
    threads=1,
    epochs=1,
    steps_per_epoch=1,
)


def good_checkpoint(folder: Path) -> Path:
    """A real checkpoint from a one-step training run (cached in the scratch folder)."""
    path = folder / "good" / "model.pt"
    if not path.exists():
        from seq2seq_fast.seq2seq.train import TrainConfig, train

        train(TrainConfig(**TINY_TRAIN, out=str(path.parent)))
    return path


def load_bytes(make: Callable[[Path], bytes | None], *, model=False):
    """load_checkpoint (or load_model) of a file whose bytes ``make(folder)`` returns."""

    def call(folder):
        from seq2seq_fast.seq2seq.checkpoint import load_checkpoint, load_model

        path = folder / "case.pt"
        data = make(folder)
        if data is not None:
            path.write_bytes(data)
        (load_model if model else load_checkpoint)(path)
        return "loaded"

    return call


def saved(obj) -> Callable[[Path], bytes]:
    def make(_):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    return make


def edited_checkpoint(edit: Callable[[dict], None]) -> Callable[[Path], bytes]:
    """The good checkpoint's payload, edited, saved again."""

    def make(folder):
        payload = torch.load(good_checkpoint(folder), weights_only=True)
        edit(payload)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue()

    return make


def truncated(fraction: float) -> Callable[[Path], bytes]:
    def make(folder):
        data = good_checkpoint(folder).read_bytes()
        return data[: max(1, int(len(data) * fraction))]

    return make


def flipped_tensor_byte(folder: Path) -> bytes:
    """The good checkpoint with one bit flipped inside a stored tensor's data."""
    path = good_checkpoint(folder)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    data[start + 9] ^= 0x40
    return bytes(data)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-checkpoint",))


def code_running_pickle(folder: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"format": "seq2seq-fast checkpoint", "version": 1, "x": _RunsCode()}, buffer)
    return buffer.getvalue()


def check_not_pwned(call):
    def wrapped(folder):
        try:
            return call(folder)
        finally:
            assert not Path("pwned-by-checkpoint").exists(), "the pickle ran code on load"

    return wrapped


# --- corpora -----------------------------------------------------------------------------------


def corpus(data: bytes | None, name="corpus.tsv", **kwargs):
    def call(folder):
        from seq2seq_fast.seq2seq.data.corpus import read_parallel_corpus

        path = folder / name
        if data is not None:
            path.write_bytes(data)
        pairs, report = read_parallel_corpus(path, **kwargs)
        return {"pairs": len(pairs), "malformed": len(report.malformed)}

    return call


def corpus_expect(data: bytes, pairs: int, malformed: int, **kwargs):
    def call(folder):
        result = corpus(data, **kwargs)(folder)
        assert result == {"pairs": pairs, "malformed": malformed}, result
        return result

    return call


def zipped(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


GOOD_LINES = b"hello\tbonjour\ngood night\tbonne nuit\n"

# --- the table ---------------------------------------------------------------------------------

f64 = lambda inputs: inputs[0].double()  # noqa: E731
meta = lambda t: t.to("meta")  # noqa: E731

# fmt: off
CASES: list[Case] = [
    # additive_attention: non-tensors, dtypes, devices
    Case("op: query None", with_input(0, lambda i: None), "TypeError", ("query", "Tensor")),
    Case("op: query list", with_input(0, lambda i: i[0].tolist()), "TypeError", ("query", "list")),
    Case("op: query numpy", with_input(0, lambda i: i[0].numpy()), "TypeError", ("query", "ndarray")),
    Case("op: keys None", with_input(1, lambda i: None), "TypeError", ("keys",)),
    Case("op: values int list", with_input(2, lambda i: [1, 2]), "TypeError", ("values",)),
    Case("op: v python float", with_input(3, lambda i: 1.0), "TypeError", ("v", "float")),
    Case("op: bias numpy", with_input(4, lambda i: i[4].numpy()), "TypeError", ("bias",)),
    Case("op: int64 inputs", lambda _: attn(*(t.long() for t in T())), "TypeError", ("query", "floating")),
    Case("op: complex inputs", lambda _: attn(*(t.cfloat() for t in T())), "TypeError", ("floating",)),
    Case("op: float16 on CPU", lambda _: attn(*T(torch.float16)), "TypeError", ("float16", "cpu")),
    Case("op: keys bfloat16, query float32", with_input(1, lambda i: i[1].bfloat16()), "TypeError", ("keys", "bfloat16")),
    Case("op: keys float64, query float32", with_input(1, lambda i: i[1].double()), "TypeError", ("keys", "float64")),
    Case("op: bias float64", with_input(4, lambda i: i[4].double()), "TypeError", ("bias", "float64")),
    Case("op: all on meta", lambda _: attn(*(meta(t) for t in T())), "TypeError", ("meta",)),
    Case("op: meta inputs + meta lengths", lambda _: attn(*(meta(t) for t in T()), lengths=meta(torch.tensor([1, 2]))), "TypeError", ("meta",)),
    Case("op: keys on meta", with_input(1, lambda i: meta(i[1])), "ValueError", ("keys", "meta")),
    Case("op: lengths on meta", with_kwargs(lengths=lambda: meta(torch.tensor([1, 2]))), "ValueError", ("lengths", "meta")),
    Case("op: mask on meta", with_kwargs(mask=lambda: meta(torch.ones(B, TK, dtype=torch.bool))), "ValueError", ("mask", "meta")),
    # ranks and sizes
    Case("op: query 1-D", with_input(0, lambda i: i[0][0, 0]), "ValueError", ("query", "[5]")),
    Case("op: query 4-D", with_input(0, lambda i: i[0][None]), "ValueError", ("query",)),
    Case("op: keys 2-D", with_input(1, lambda i: i[1][0]), "ValueError", ("keys", "[4, 5]")),
    Case("op: values 2-D", with_input(2, lambda i: i[2][0]), "ValueError", ("values",)),
    Case("op: values 4-D", with_input(2, lambda i: i[2][None]), "ValueError", ("values",)),
    Case("op: v 2-D", with_input(3, lambda i: i[3][None]), "ValueError", ("v", "[1, 5]")),
    Case("op: v wrong H", with_input(3, lambda i: i[3][:-1]), "ValueError", ("v", "[4]")),
    Case("op: bias wrong H", with_input(4, lambda i: i[4][:-1]), "ValueError", ("bias", "[4]")),
    Case("op: bias 0-D", with_input(4, lambda i: i[4][0]), "ValueError", ("bias",)),
    Case("op: query batch mismatch", with_input(0, lambda i: i[0][:1]), "ValueError", ("query", "B=2")),
    Case("op: query H mismatch", with_input(0, lambda i: i[0][..., :-1]), "ValueError", ("query", "H=5")),
    Case("op: values Tk mismatch", with_input(2, lambda i: i[2][:, :-1]), "ValueError", ("values", "Tk=4")),
    Case("op: values batch mismatch", with_input(2, lambda i: i[2][:1]), "ValueError", ("values",)),
    # lengths and masks
    Case("op: lengths negative", with_kwargs(lengths=lambda: torch.tensor([-1, 2])), "ValueError", ("lengths", "-1")),
    Case("op: lengths > Tk", with_kwargs(lengths=lambda: torch.tensor([5, 2])), "ValueError", ("lengths", "Tk=4")),
    Case("op: lengths 2^62", with_kwargs(lengths=lambda: torch.tensor([2**62, 2])), "ValueError", ("lengths",)),
    Case("op: lengths float tensor", with_kwargs(lengths=lambda: torch.tensor([1.0, 2.0])), "TypeError", ("lengths", "float")),
    Case("op: lengths bool tensor", with_kwargs(lengths=lambda: torch.tensor([True, False])), "TypeError", ("lengths", "bool")),
    Case("op: lengths wrong batch", with_kwargs(lengths=lambda: torch.tensor([1, 2, 3])), "ValueError", ("lengths", "[3]")),
    Case("op: lengths 2-D", with_kwargs(lengths=lambda: torch.tensor([[1, 2]])), "ValueError", ("lengths",)),
    Case("op: lengths list of floats", with_kwargs(lengths=[1.5, 2]), "TypeError", ("lengths", "float")),
    Case("op: lengths list of str", with_kwargs(lengths=["a", "b"]), "TypeError", ("lengths",)),
    Case("op: lengths numpy", with_kwargs(lengths=lambda: __import__("numpy").array([1, 2])), "TypeError", ("lengths", "ndarray")),
    Case("op: lengths str", with_kwargs(lengths="12"), "TypeError", ("lengths", "str")),
    Case("op: lengths int", with_kwargs(lengths=3), "TypeError", ("lengths", "int")),
    Case("op: mask int64", with_kwargs(mask=lambda: torch.ones(B, TK, dtype=torch.long)), "TypeError", ("mask", "bool")),
    Case("op: mask wrong shape", with_kwargs(mask=bool_mask(B, TK + 1)), "ValueError", ("mask", "[2, 5]")),
    Case("op: mask 3-D", with_kwargs(mask=bool_mask(B, 1, TK)), "ValueError", ("mask",)),
    Case("op: mask list", with_kwargs(mask=[[True] * TK] * B), "TypeError", ("mask", "list")),
    Case("op: mask and lengths", with_kwargs(mask=bool_mask(B, TK), lengths=[1, 2]), "ValueError", ("lengths", "mask")),
    Case("op: return_weights str", with_kwargs(return_weights="no"), "TypeError", ("return_weights",)),
    Case("op: too many positionals", lambda _: attn(*T(), torch.tensor([1, 2])), "TypeError", ("positional",)),
    # degenerate sizes: routed to the reference, exact
    Case("op: B=0", check_degenerate((0, TQ, H), (0, TK, H), (0, TK, DV)), None),
    Case("op: B=0 one step", check_degenerate((0, H), (0, TK, H), (0, TK, DV)), None),
    Case("op: Tq=0", check_degenerate((B, 0, H), (B, TK, H), (B, TK, DV)), None),
    Case("op: Tk=0", check_degenerate((B, TQ, H), (B, 0, H), (B, 0, DV)), None),
    Case("op: Tk=0 one step", check_degenerate((B, H), (B, 0, H), (B, 0, DV)), None),
    Case("op: Tk=0 lengths 0", check_degenerate((B, TQ, H), (B, 0, H), (B, 0, DV), lengths=[0, 0]), None),
    Case("op: H=0", check_degenerate((B, TQ, 0), (B, TK, 0), (B, TK, DV), h=0), None),
    Case("op: Dv=0", check_degenerate((B, TQ, H), (B, TK, H), (B, TK, 0)), None),
    # raw C++ ops (what torch.compile / opcheck call directly)
    Case("raw fwd: lengths -1", raw_fwd(replace_at(lengths=lambda a: torch.tensor([-1, 2]))), "ValueError", ("lengths", "-1")),
    Case("raw fwd: lengths > Tk", raw_fwd(replace_at(lengths=lambda a: torch.tensor([5, 2]))), "ValueError", ("lengths", "Tk=4")),
    Case("raw fwd: lengths 2^62", raw_fwd(replace_at(lengths=lambda a: torch.tensor([2**62, 2]))), "ValueError", ("lengths",)),
    Case("raw fwd: lengths int32", raw_fwd(replace_at(lengths=lambda a: torch.tensor([1, 2], dtype=torch.int32))), "RuntimeError", ("lengths", "int64")),
    Case("raw fwd: lengths wrong batch", raw_fwd(replace_at(lengths=lambda a: torch.tensor([1, 2, 3]))), "RuntimeError", ("lengths",)),
    Case("raw fwd: lengths strided", raw_fwd(replace_at(lengths=lambda a: torch.tensor([1, 9, 2, 9])[::2])), None),
    Case("raw fwd: mask uint8", raw_fwd(replace_at(mask=lambda a: torch.ones(B, TK, dtype=torch.uint8))), "RuntimeError", ("mask", "bool")),
    Case("raw fwd: mask wrong shape", raw_fwd(replace_at(mask=lambda a: torch.ones(B, 7, dtype=torch.bool))), "RuntimeError", ("mask",)),
    Case("raw fwd: mask transposed view", raw_fwd(replace_at(mask=lambda a: torch.ones(TK, B, dtype=torch.bool).t())), None),
    Case("raw fwd: lengths and mask", raw_fwd(replace_at(lengths=lambda a: torch.tensor([1, 2]), mask=lambda a: torch.ones(B, TK, dtype=torch.bool))), "RuntimeError", ("lengths or mask",)),
    Case("raw fwd: query 2-D", raw_fwd(replace_at(q=lambda a: a[0][:, 0])), "RuntimeError", ("query",)),
    Case("raw fwd: keys batch mismatch", raw_fwd(replace_at(k=lambda a: a[1][:1])), "RuntimeError", ("keys",)),
    Case("raw fwd: values batch mismatch", raw_fwd(replace_at(val=lambda a: a[2][:1])), "RuntimeError", ("values",)),
    Case("raw fwd: v wrong H", raw_fwd(replace_at(v=lambda a: a[3][:2])), "RuntimeError", ("v must be",)),
    Case("raw fwd: bias 2-D", raw_fwd(replace_at(b=lambda a: a[4][None])), "RuntimeError", ("bias",)),
    Case("raw fwd: keys float64", raw_fwd(replace_at(k=lambda a: a[1].double())), "RuntimeError", ("dtype",)),
    Case("raw fwd: float16", raw_fwd(lambda a: [t.half() for t in a[:5]] + a[5:]), "RuntimeError", ("float32",)),
    Case("raw fwd: int32", raw_fwd(lambda a: [t.int() for t in a[:5]] + a[5:]), "RuntimeError", ("float32",)),
    Case("raw fwd: return_weights str", raw_fwd(replace_at(return_weights=lambda a: "yes")), "RuntimeError", ("return_weights",)),
    Case("raw fwd: expanded keys (stride 0)", raw_fwd(replace_at(k=lambda a: a[1][:1].expand(B, TK, H))), None),
    Case("raw fwd: meta (fake kernel)", raw_fwd(lambda a: [meta(t) for t in a[:5]] + a[5:]), None),
    Case("raw fwd: Tk=0", raw_fwd(replace_at(k=lambda a: a[1][:, :0], val=lambda a: a[2][:, :0])), None),
    Case("raw fwd: H=0", raw_fwd(replace_at(q=lambda a: a[0][..., :0], k=lambda a: a[1][..., :0], v=lambda a: a[3][:0], b=lambda a: a[4][:0])), None),
    Case("raw fwd: Dv=0", raw_fwd(replace_at(val=lambda a: a[2][..., :0])), None),
    Case("raw fwd: B=0", returning(raw_fwd(empty_batch), [(0, TQ, DV), (0, TQ, TK), (0, TQ)]), None),
    Case("raw fwd: Tq=0", returning(raw_fwd(empty_queries), [(B, 0, DV), (B, 0, TK), (B, 0)]), None),
    Case("raw bwd: grad_context wrong shape", raw_bwd(bwd_replace_at(gc=lambda a: a[0][:, :1])), "RuntimeError", ("grad_context",)),
    Case("raw bwd: grad_context float64", raw_bwd(bwd_replace_at(gc=lambda a: a[0].double())), "RuntimeError", ("grad_context", "dtype")),
    Case("raw bwd: grad_weights wrong shape", raw_bwd(bwd_replace_at(gw=lambda a: torch.randn(B, TQ, TK + 1))), "RuntimeError", ("grad_weights",)),
    Case("raw bwd: grad_weights float64", raw_bwd(bwd_replace_at(gw=lambda a: torch.randn(B, TQ, TK).double())), "RuntimeError", ("grad_weights",)),
    Case("raw bwd: lse wrong shape", raw_bwd(bwd_replace_at(lse=lambda a: a[10][:1])), "RuntimeError", ("lse",)),
    Case("raw bwd: lengths > Tk", raw_bwd(bwd_replace_at(lengths=lambda a: torch.tensor([7, 2]))), "ValueError", ("lengths",)),
    Case("raw bwd: non-contiguous grads", raw_bwd(bwd_replace_at(gc=lambda a: torch.randn(B, DV, TQ).transpose(1, 2), gw=lambda a: torch.randn(B, TK, TQ).transpose(1, 2))), None),
    Case("raw bwd: Tk=0", raw_bwd(bwd_replace_at(k=lambda a: a[3][:, :0], val=lambda a: a[4][:, :0], lengths=lambda a: None)), None),
    Case("raw bwd: B=0", returning(raw_bwd(empty_batch_bwd, zero=True), [(0, TQ, H), (0, TK, H), (0, TK, DV), (H,), (H,)]), None),
    Case("raw bwd: Tq=0", returning(raw_bwd(empty_queries_bwd, zero=True), [(B, 0, H), (B, TK, H), (B, TK, DV), (H,), (H,)]), None),
    Case("raw: _fast_tanh shape mismatch", lambda _: torch.ops.seq2seq_fast._fast_tanh(torch.randn(3), torch.randn(4), 1), "RuntimeError", ("shape",)),
    Case("raw: _fast_tanh bad path", lambda _: torch.ops.seq2seq_fast._fast_tanh(torch.randn(3), torch.randn(3), 7), "RuntimeError", ("path",)),
    # BahdanauAttention
    Case("module: query_size 0", lambda _: module(0, 8, 5), "ValueError", ("query_size",)),
    Case("module: hidden_size -1", lambda _: module(6, 8, -1), "ValueError", ("hidden_size",)),
    Case("module: hidden_size 2.5", lambda _: module(6, 8, 2.5), "ValueError", ("hidden_size",)),
    Case("module: hidden_size True", lambda _: module(6, 8, True), "ValueError", ("hidden_size",)),
    Case("module: hidden_size '5'", lambda _: module(6, 8, "5"), "ValueError", ("hidden_size",)),
    Case("module: backend 'cuda'", lambda _: module(6, 8, 5, backend="cuda"), "ValueError", ("backend",)),
    Case("module: query None", module_call(lambda: None, k8), "TypeError", ("query", "Tensor")),
    Case("module: keys None", module_call(q6, lambda: None), "TypeError", ("keys",)),
    Case("module: query numpy", module_call(lambda: q6().numpy(), k8), "TypeError", ("query", "ndarray")),
    Case("module: query list", module_call(lambda: q6().tolist(), k8), "TypeError", ("query", "list")),
    Case("module: query wrong size", module_call(lambda: q6()[..., :5], k8), "ValueError", ("query", "query_size=6")),
    Case("module: keys wrong size", module_call(q6, lambda: k8()[..., :5]), "ValueError", ("keys", "key_size=8")),
    Case("module: query 4-D", module_call(lambda: q6()[None], k8), "ValueError", ("query",)),
    Case("module: keys 2-D", module_call(q6, lambda: k8()[0]), "ValueError", ("keys",)),
    Case("module: values batch mismatch", module_call(q6, k8, lambda: k8()[:1]), "ValueError", ("values",)),
    Case("module: query float64", module_call(lambda: q6().double(), k8), "TypeError", ("query", "float64")),
    Case("module: int64 inputs", module_call(lambda: q6().long(), lambda: k8().long()), "TypeError", ("query", "floating")),
    Case("module: float16 inputs", module_call(lambda: q6().half(), lambda: k8().half()), "TypeError", ("float16",)),
    Case("module: query on meta", module_call(lambda: meta(q6()), lambda: meta(k8())), "ValueError", ("query", "meta")),
    Case("module: lengths negative", module_call(q6, k8, lengths=lambda: torch.tensor([-1, 2])), "ValueError", ("lengths",)),
    Case("module: lengths > Tk", module_call(q6, k8, lengths=lambda: torch.tensor([9, 2])), "ValueError", ("lengths",)),
    Case("module: projected_keys wrong H", module_call(q6, k8, projected_keys=lambda: torch.randn(B, TK, 4)), "ValueError", ("keys",)),
    Case("module: projected_keys numpy", module_call(q6, k8, projected_keys=lambda: torch.randn(B, TK, 5).numpy()), "TypeError", ("projected_keys",)),
    Case("module: B=0", module_call(lambda: q6()[:0], lambda: k8()[:0]), None),
    Case("module: Tk=0", module_call(q6, lambda: k8()[:, :0]), None),
    Case("module: on meta, meta inputs", lambda _: module(6, 8, 5).to("meta")(meta(q6()), meta(k8())), None),
    # fuse_attention
    Case("fuse: None", fuse(lambda: None), "TypeError", ("model", "NoneType")),
    Case("fuse: a list of modules", fuse(lambda: [torch.nn.Linear(2, 2)]), "TypeError", ("model", "list")),
    Case("fuse: bad backend", fuse(lambda: torch.nn.Sequential(), backend="x"), "ValueError", ("backend",)),
    Case("fuse: model without attention", fuse(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2))), None),
    # checkpoints
    Case("ckpt: missing file", load_bytes(lambda f: None), "CheckpointError", ("not found",)),
    Case("ckpt: a directory", lambda f: importlib.import_module("seq2seq_fast.seq2seq.checkpoint").load_checkpoint(f), "CheckpointError", ("directory",)),
    Case("ckpt: empty file", load_bytes(lambda f: b""), "CheckpointError", ("corrupt",)),
    Case("ckpt: text file", load_bytes(lambda f: b"not a checkpoint\n"), "CheckpointError", ("corrupt",)),
    Case("ckpt: random bytes", load_bytes(lambda f: os.urandom(4096)), "CheckpointError", ("corrupt",)),
    Case("ckpt: truncated to 1 byte", load_bytes(truncated(0.0)), "CheckpointError", ("corrupt",)),
    Case("ckpt: truncated to 10%", load_bytes(truncated(0.1)), "CheckpointError", ("corrupt",)),
    Case("ckpt: truncated to 50%", load_bytes(truncated(0.5)), "CheckpointError", ("corrupt",)),
    Case("ckpt: truncated to 99%", load_bytes(truncated(0.99)), "CheckpointError", ("corrupt",)),
    Case("ckpt: a bare tensor", load_bytes(saved(torch.zeros(3))), "CheckpointError", ("not a seq2seq-fast",)),
    Case("ckpt: a foreign state_dict", load_bytes(saved({"w": torch.zeros(2)})), "CheckpointError", ("not a seq2seq-fast",)),
    Case("ckpt: a plain pickle", load_bytes(lambda f: pickle.dumps({"a": 1})), "CheckpointError", ("corrupt",)),
    Case("ckpt: pickle that runs code", check_not_pwned(load_bytes(code_running_pickle)), "CheckpointError", ("corrupt",)),
    Case("ckpt: version 99", load_bytes(edited_checkpoint(lambda p: p.update(version=99))), "CheckpointError", ("version",)),
    Case("ckpt: version '1'", load_bytes(edited_checkpoint(lambda p: p.update(version="1"))), "CheckpointError", ("version",)),
    Case("ckpt: lacks 'model'", load_bytes(edited_checkpoint(lambda p: p.pop("model"))), "CheckpointError", ("model",)),
    Case("ckpt: lacks 'src_vocab'", load_bytes(edited_checkpoint(lambda p: p.pop("src_vocab"))), "CheckpointError", ("src_vocab",)),
    Case("ckpt: model config hidden_size -3", load_bytes(edited_checkpoint(lambda p: p["model_config"].update(hidden_size=-3)), model=True), "CheckpointError", ("usable model", "hidden_size")),
    Case("ckpt: model config unknown key", load_bytes(edited_checkpoint(lambda p: p["model_config"].update(flux=1)), model=True), "CheckpointError", ("usable model",)),
    Case("ckpt: weights of the wrong shape", load_bytes(edited_checkpoint(lambda p: p["model"].update({k: torch.zeros(1) for k in list(p["model"])[:1]})), model=True), "CheckpointError", ("usable model",)),
    Case("ckpt: weights missing", load_bytes(edited_checkpoint(lambda p: p["model"].pop(next(iter(p["model"])))), model=True), "CheckpointError", ("usable model",)),
    Case("ckpt: unknown vocabulary kind", load_bytes(edited_checkpoint(lambda p: p["src_vocab"].update(kind="bpe")), model=True), "CheckpointError", ("usable model", "vocabulary")),
    Case("ckpt: model_config not a dict", load_bytes(edited_checkpoint(lambda p: p.update(model_config=[1, 2])), model=True), "CheckpointError", ("usable model",)),
    Case("ckpt: one bit flipped in a weight", load_bytes(flipped_tensor_byte, model=True), "CheckpointError", ("corrupt", "crc")),
    # corpora
    Case("corpus: missing file", corpus(None), "CorpusError", ("not found",)),
    Case("corpus: a directory", lambda f: corpus(None, name=".")(f), "CorpusError", ("directory",)),
    Case("corpus: empty file", corpus(b""), "CorpusError", ("no usable",)),
    Case("corpus: only empty lines", corpus(b"\n\n  \n\t\n"), "CorpusError", ("no usable", "malformed")),
    Case("corpus: no tabs at all", corpus(b"hello bonjour\ngood night\n"), "CorpusError", ("no usable", "tab")),
    Case("corpus: latin-1 encoded", corpus("caf\u00e9\tcoffee\n".encode("latin-1")), "CorpusError", ("UTF-8",)),
    Case("corpus: random bytes", corpus(os.urandom(2048)), "CorpusError", ("no usable",)),
    Case("corpus: empty source side", corpus(b"\tbonjour\n \tnuit\n"), "CorpusError", ("empty source",)),
    Case("corpus: good lines among bad ones", corpus_expect(GOOD_LINES + b"no tab\n\n\xff\xfe\tx\n\tright only\n", 2, 4), None),
    Case("corpus: BOM, CRLF, extra columns", corpus_expect(b"\xef\xbb\xbfhi\tsalut\tCC-BY\r\nyes\toui\r\n", 2, 0), None),
    Case("corpus: NUL bytes in a line", corpus_expect(b"a\x00b\tc\nhello\tbonjour\n", 2, 0), None),
    Case("corpus: a 1 MB line", corpus_expect(b"x " * 500_000 + b"\ty\nhello\tbonjour\n", 2, 0), None),
    Case("corpus: zip without text member", corpus(zipped({"README.md": b"hi"}), name="c.zip"), "CorpusError", ("no .txt",)),
    Case("corpus: truncated zip", corpus(zipped({"fra.txt": GOOD_LINES * 50})[:60], name="c.zip"), "CorpusError", ("zip",)),
    Case("corpus: zip of a latin-1 file", corpus(zipped({"fra.txt": "\u00e9\tx\n".encode("latin-1")}), name="c.zip"), "CorpusError", ("UTF-8",)),
    Case("corpus: bad normalization", corpus(GOOD_LINES, normalization="NFX"), "ValueError", ("normalization",)),
]
# fmt: on


# --- the child process ---------------------------------------------------------------------------


def _describe(result) -> str:
    if isinstance(result, torch.Tensor):
        return f"tensor{list(result.shape)}"
    if isinstance(result, (tuple, list)):
        return "(" + ", ".join(_describe(r) for r in result) + ")"
    return repr(result)[:120]


def _child(folder: Path, names: list[str]) -> None:
    import warnings

    import seq2seq_fast  # noqa: F401  (registers the ops every case may call)

    warnings.simplefilter("ignore")
    os.chdir(folder)
    by_name = {case.name: case for case in CASES}
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        try:
            result = by_name[name].call(folder)
            record = {"name": name, "ok": _describe(result)}
        except Exception as exc:
            classes = [c.__name__ for c in type(exc).__mro__]
            record = {
                "name": name,
                "error": type(exc).__name__,
                "classes": classes,
                "message": str(exc)[:2000],
            }
        print(json.dumps(record), flush=True)


def run_isolated(names: list[str], folder: Path, timeout: float = 240) -> dict[str, dict]:
    """Run the named cases in child processes; a crash or hang is recorded against its case."""
    results: dict[str, dict] = {}
    pending = list(names)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    while pending:
        cmd = [sys.executable, str(Path(__file__).resolve()), str(folder), *pending]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            stdout, returncode = proc.stdout, proc.returncode
            tail = proc.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            returncode, tail = "timeout", "hang"
        started = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                results[record["name"]] = record
                started = None
        done = [n for n in pending if n in results]
        if started is not None:  # it began and never finished: crashed or hung
            results[started] = {"name": started, "crash": returncode, "stderr": tail}
            done.append(started)
        elif returncode != 0 and len(done) < len(pending):
            first = pending[len(done)]  # died before starting any case
            results[first] = {"name": first, "crash": returncode, "stderr": tail}
            done.append(first)
        pending = [n for n in pending if n not in done]
    return results


def run_each_apart(names: list[str], folder: Path, timeout: float = 240) -> dict[str, dict]:
    """Each case in its own child, all at once (for cases known to crash their process)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(folder), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in names
    }
    results = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            results[name] = {"name": name, "crash": "timeout", "stderr": "hang"}
            continue
        records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        finished = [r for r in records if "start" not in r]
        if finished:
            results[name] = finished[0]
        else:
            results[name] = {"name": name, "crash": proc.returncode, "stderr": stderr[-2000:]}
    return results


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def isolated_results(scratch):
    # Cases expected to work or to raise share one child; known crashers get one child each,
    # started together once the shared child is done (it leaves the good checkpoint behind).
    results = run_isolated([case.name for case in CASES if not case.xfail], scratch)
    results.update(run_each_apart([case.name for case in CASES if case.xfail], scratch))
    return results


def _param(case: Case):
    marks = [pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_hostile_input(case: Case, isolated_results):
    result = isolated_results[case.name]
    assert "crash" not in result, (
        f"{case.name}: the process died ({result['crash']}): {result.get('stderr', '')[-500:]}"
    )
    if case.error is None:
        assert "ok" in result, (
            f"{case.name}: expected success, got {result.get('error')}: {result.get('message')}"
        )
        return
    assert "error" in result, f"{case.name}: expected {case.error}, but it returned {result['ok']}"
    assert case.error in result["classes"], (
        f"{case.name}: expected {case.error}, got {result['error']}: {result['message']}"
    )
    message = result["message"].lower()
    missing = [w for w in case.words if w.lower() not in message]
    assert not missing, f"{case.name}: message lacks {missing}: {result['message']!r}"


def test_table_covers_every_entry_point():
    prefixes = {case.name.split(":")[0] for case in CASES}
    assert {"op", "raw fwd", "raw bwd", "module", "fuse", "ckpt", "corpus"} <= prefixes


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2:])


# --- the command line --------------------------------------------------------------------------

CLI_TINY = [
    "--vocab-size",
    "6",
    "--min-len",
    "2",
    "--max-len",
    "5",
    "--heldout-size",
    "10",
    "--embed-size",
    "8",
    "--hidden-size",
    "8",
    "--batch-size",
    "4",
    "--epochs",
    "1",
    "--steps-per-epoch",
    "1",
    "--no-progress",
    "--no-heatmap",
]
CK = "{checkpoint}"  # replaced by a real checkpoint's path
BAD = "{garbage}"  # replaced by a file of garbage

# (argv, words the error line must hold or None when it must succeed, xfail reason or None)
# fmt: off
CLI_CASES = {
    "no command": ([], ("usage",), None),
    "unknown command": (["frobnicate"], ("invalid choice",), None),
    "translate without --checkpoint": (["translate", "a b"], ("--checkpoint",), None),
    "translate missing checkpoint": (["translate", "--checkpoint", "/nonexistent/model.pt", "a b"], ("not found",), None),
    "translate garbage checkpoint": (["translate", "--checkpoint", BAD, "a b"], ("corrupt",), None),
    "translate directory as checkpoint": (["translate", "--checkpoint", "{folder}", "a b"], ("directory",), None),
    "translate --beam abc": (["translate", "--checkpoint", CK, "--beam", "abc", "a b"], ("--beam",), None),
    "translate --backend gpu": (["translate", "--checkpoint", CK, "--backend", "gpu", "a b"], ("--backend",), None),
    "translate empty sentence": (["translate", "--checkpoint", CK, ""], ("empty",), None),
    "translate unknown symbols": (["translate", "--checkpoint", CK, "zz 9 ?"], None, None),
    "translate, empty stdin": (["translate", "--checkpoint", CK], None, None),
    "plot-attention empty sentence": (["plot-attention", "--checkpoint", CK, "", "-o", "{folder}/x.png"], ("empty",), None),
    "translate --beam 0": (["translate", "--checkpoint", CK, "--beam", "0", "a b"], ("beam",), None),
    "translate --beam -3": (["translate", "--checkpoint", CK, "--beam", "-3", "a b"], ("beam",), None),
    "translate --max-len-factor -1": (["translate", "--checkpoint", CK, "--max-len-factor", "-1", "a b"], ("max-len-factor",), None),
    "translate --max-len-factor nan": (["translate", "--checkpoint", CK, "--max-len-factor", "nan", "a b"], ("max-len-factor",), None),
    "train --epochs 0": (["train", *CLI_TINY, "--epochs", "0"], ("epochs",), None),
    "train --batch-size 0": (["train", *CLI_TINY, "--batch-size", "0"], ("batch_size",), None),
    "train --hidden-size 0": (["train", *CLI_TINY, "--hidden-size", "0"], ("hidden_size",), None),
    "train --lr nan": (["train", *CLI_TINY, "--lr", "nan"], ("learning rate",), None),
    "train --dropout 2": (["train", *CLI_TINY, "--dropout", "2"], ("dropout",), None),
    "train --vocab-size 1": (["train", *CLI_TINY, "--vocab-size", "1"], ("vocab_size",), None),
    "train --min-len 9 --max-len 3": (["train", *CLI_TINY, "--min-len", "9", "--max-len", "3"], ("min_len",), None),
    "train --encoder-layers 0": (["train", *CLI_TINY, "--encoder-layers", "0"], ("layers",), None),
    "train --bidirectional maybe": (["train", *CLI_TINY, "--bidirectional", "maybe"], ("bidirectional",), None),
    "train --epochs x": (["train", *CLI_TINY, "--epochs", "x"], ("--epochs",), None),
    "train translate without --data": (["train", *CLI_TINY, "--task", "translate"], ("--data",), None),
    "train translate missing corpus": (["train", *CLI_TINY, "--task", "translate", "--data", "/nonexistent.tsv"], ("not found",), None),
    "train translate corpus of garbage": (["train", *CLI_TINY, "--task", "translate", "--data", BAD], ("no usable",), None),
    "train --resume missing": (["train", "--resume", "/nonexistent/model.pt", "--no-progress"], ("not found",), None),
    "train --resume garbage": (["train", "--resume", BAD, "--no-progress"], ("corrupt",), None),
    "train --label-smoothing 2": (["train", *CLI_TINY, "--label-smoothing", "2"], ("label_smoothing",), None),
    "train --heldout-size 0": (["train", *CLI_TINY, "--heldout-size", "0"], ("heldout",), None),
    "train --clip-norm nan": (["train", *CLI_TINY, "--clip-norm", "nan"], ("clip",), None),
}
# fmt: on


@pytest.fixture(scope="module")
def cli_files(scratch):
    folder = scratch / "cli"
    folder.mkdir(exist_ok=True)
    garbage = folder / "garbage.pt"
    garbage.write_bytes(b"\x00\x01 not a checkpoint, not a corpus \xff\n")
    return {
        "checkpoint": str(good_checkpoint(scratch)),
        "garbage": str(garbage),
        "folder": str(folder),
    }


def _cli_param(name):
    reason = CLI_CASES[name][2]
    marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_cli_param(n) for n in CLI_CASES])
def test_cli_hostile(name, cli_files, tmp_path, capsys, monkeypatch):
    from seq2seq_fast.seq2seq.cli import main

    argv, words, _ = CLI_CASES[name]
    argv = [a.format(**cli_files) for a in argv]
    if argv and argv[0] == "train":
        argv += ["--out", str(tmp_path)]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))

    def hang(signum, frame):
        raise TimeoutError(f"{name}: no answer within 120 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(120)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if words is None:
        assert code == 0, err
        return
    assert code == 2, f"exit status {code}; stdout {out[-300:]!r}; stderr {err[-300:]!r}"
    text = (err or out).lower()
    assert "error" in text or "usage" in text
    missing = [w for w in words if w.lower() not in text]
    assert not missing, f"message lacks {missing}: {err!r}"


@pytest.mark.parametrize(
    "argv,words",
    [(["translate", "--checkpoint", "{garbage}", "a"], "corrupt")],
    ids=["garbage-checkpoint"],
)
def test_cli_real_process_exits_2_without_traceback(argv, words, cli_files):
    argv = [a.format(**cli_files) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "seq2seq_fast", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-500:]
    assert "Traceback" not in proc.stderr
    assert words in (proc.stderr + proc.stdout).lower()
