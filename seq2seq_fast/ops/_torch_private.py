"""Every private torch API the package uses, in one place, each with the reason it is needed.

A private name (``torch._C._*``, ``torch._dynamo``, ``torch.utils._pytree``, a leading-underscore
op) may change or go in any torch release. Everything above this module reaches them only through
the names here, and ``tests/ops/test_torch_private.py`` checks each of them against the installed
torch, failing with the name, what uses it and what to change when an upgrade removed one. Add a
new use here, with its reason, and to :data:`PRIVATE_APIS`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

# Why: nested args/kwargs/outputs (tuples, lists, dicts, NamedTuples, dataclasses registered with
# torch) flattened to their tensors exactly as torch.compile and torch.export see them; the
# converter's probe and the projection cache need the same leaves. No public module offers it.
from torch.utils import _pytree as pytree  # noqa: F401 (re-exported)

# (dotted name, what uses it): what the test checks exists in the installed torch.
PRIVATE_APIS: tuple[tuple[str, str], ...] = (
    ("torch._C._are_functorch_transforms_active", "ops._autograd.traced_or_transformed"),
    ("torch._C._current_graph_task_id", "ops._autograd.StepGradients (per backward pass)"),
    (
        "torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters",
        "ops.additive_attention (the reference under torch.func.vmap)",
    ),
    ("torch._C._functorch.TransformType.Vmap", "ops.additive_attention (the same)"),
    ("torch._C._functions.DelayedError", "ops._autograd.guard_double_backward"),
    (
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "nn.keycache.cache_bypassed, nn.convert.traced (a first call under checkpointing)",
    ),
    ("torch._C._nn.linear", "nn.convert (F.linear as FX graphs record it)"),
    ("torch.utils._pytree.tree_leaves", "nn.keycache, nn.convert (nested inputs' tensors)"),
    ("torch.utils._pytree.tree_map", "nn.convert (copies of nested inputs)"),
    ("torch.utils._pytree.tree_flatten", "nn.convert (comparing nested outputs)"),
    ("torch._dynamo.config.allow_rnn", "seq2seq.models.compile_model, nn.convert.traced"),
    (
        "torch._dynamo.config.recompile_limit",
        "nn.convert.traced (its modules' trace limit, and when one gives up)",
    ),
    (
        "torch._dynamo.config.capture_scalar_outputs",
        "nn.convert.traced (a mask built from int(lengths.max()) inside the trace)",
    ),
    ("torch._guards.CompileContext.current_compile_id", "nn.convert.traced (compiles per frame)"),
    ("torch._dynamo.utils.counters", "nn.convert.traced (a graph break's reason, in the report)"),
    ("torch._subclasses.fake_tensor", "nn.convert.traced (its log quiet while the probe traces)"),
    ("torch._dynamo.eval_frame.OptimizedModule", "nn.convert (a model torch.compile wrapped)"),
    ("torch._make_per_channel_quantized_tensor", "seq2seq.inference (int8 rows as a qint8 weight)"),
    ("torch.ops.mkldnn._reorder_linear_weight", "seq2seq.inference (weights packed once)"),
    ("torch.ops.mkldnn._linear_pointwise", "seq2seq.inference (products on packed weights)"),
    (
        "torch.nn.modules.module._global_forward_hooks",
        "nn.convert._base (a stand-in's parts unchanged since the conversion)",
    ),
    ("torch.nn.modules.module._global_forward_pre_hooks", "nn.convert._base (the same)"),
)


def global_module_hooks() -> tuple[int, int]:
    """How many forward hooks and forward pre-hooks are registered for every module
    (``nn.modules.module.register_module_forward_hook``). Why: a converted stand-in reads some
    parts' weights without calling them, so such a hook registered after the conversion would
    not run on them; the stand-in then runs the original's code. torch keeps them in private
    module dicts and offers no public way to read them."""
    return len(_nn_module._global_forward_hooks), len(_nn_module._global_forward_pre_hooks)


@contextlib.contextmanager
def quiet_trace_errors() -> Iterator[None]:
    """The fake-tensor log of TorchDynamo quiet (errors only at CRITICAL), and its advice on a
    graph break at ``Tensor.item()``, for the block. Why: when the converter's own trace of a
    module fails (the module does what fake tensors cannot follow), torch logs every failed op's
    traceback at ERROR (170 lines for one module) before raising; the converter catches the error
    and says in one line why it left the module. A forward that reads ``.item()`` (a mask built
    in a Python loop) makes TorchDynamo print a dozen lines advising ``capture_scalar_outputs``
    to a user who compiled nothing; the converter says itself what it could not convert. The
    loggers' names are torch's private modules'."""
    import logging

    loggers = [
        logging.getLogger("torch._subclasses.fake_tensor"),
        logging.getLogger("torch._dynamo.variables.tensor"),
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds (``module`` itself if it is none).
    Why private: torch names the wrapper's class and its ``_orig_mod`` only privately; the
    converter calls the original eagerly, outside the user's compiled region."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        module = module._orig_mod
    return module


def functorch_transforms_active() -> bool:
    """Inside a torch.func transform (grad, vmap, ...). Why private: torch has no public test,
    and the Functions with Python-side state must stay out of transforms."""
    return torch._C._are_functorch_transforms_active()


def vmap_active() -> bool:
    """Inside torch.func.vmap (at any level of nested transforms). Why private: torch has no
    public test; the fused attention's Function has no batching rule, so its dispatch runs the
    reference (plain PyTorch ops, which vmap batches) there."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def current_graph_task_id() -> int:
    """The id of the running backward pass (-1 outside one). Why private: the step memories keep
    each backward pass's gathered gradients apart by it; there is no public equivalent."""
    return torch._C._current_graph_task_id()


def delayed_error(message: bytes, count: int) -> Callable[..., Any]:
    """An autograd node that raises ``message`` when differentiated (what torch itself uses for
    once-differentiable Functions). Why private: the public ``once_differentiable`` decorator
    cannot wrap the gradients of a Function whose backward returns them from a kernel call."""
    return torch._C._functions.DelayedError(message, count)


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed (activation checkpointing, offloading). Why
    private: no public query exists, and a cache must not return tensors those hooks expect to
    be recomputed."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def nn_linear() -> Callable[..., Any]:
    """``torch._C._nn.linear``: what ``F.linear`` calls appear as in an FX graph traced by
    TorchDynamo. Why private: the converter matches and builds such graph nodes."""
    return torch._C._nn.linear


def dynamo_config() -> Any:
    """``torch._dynamo.config``, imported on first use (importing torch._dynamo takes time).
    Why private: ``allow_rnn`` and ``recompile_limit`` have no public switch."""
    import torch._dynamo

    return torch._dynamo.config


def dynamo_graph_breaks() -> dict[str, int]:
    """How many times TorchDynamo gave each reason for a graph break in this process so far (read
    before and after a trace: the new ones are that trace's). Why private: the reasons are kept
    only in TorchDynamo's counters (and its logs); the converter names the break that cut an
    attention's graph in its report."""
    from torch._dynamo.utils import counters

    return {**counters["unimplemented"], **counters["graph_break"]}


def compile_frame() -> tuple[int, int] | None:
    """(frame id, how many times that frame was compiled before) of the graph TorchDynamo is
    compiling now, or None outside a compile. Why private: TorchDynamo counts its recompiles per
    frame (code object) and gives up on a frame at ``recompile_limit``; nothing public says which
    frame a backend's graph comes from, and one call of a forward with graph breaks compiles
    several frames (its resume functions, the functions it calls)."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else (compile_id.frame_id, compile_id.frame_compile_id)


@contextlib.contextmanager
def dynamo_capture_scalars() -> Iterator[None]:
    """TorchDynamo traces ``tensor.item()`` and ``int(tensor)`` into the graph inside the block
    (``capture_scalar_outputs``; torch keeps its config per thread: other threads are not
    affected), restored after. Why private: without it such a call ends TorchDynamo's graph, and
    a module that builds its pad mask from ``int(lengths.max())`` between its scores and its
    softmax (ESPnet's ``make_pad_mask``) splits the attention into two graphs, neither of which
    holds the whole pattern. There is no per-compile switch for it."""
    config = dynamo_config()
    before = config.capture_scalar_outputs
    config.capture_scalar_outputs = True
    try:
        yield
    finally:
        config.capture_scalar_outputs = before


@contextlib.contextmanager
def dynamo_tracing(recompile_limit: int | None = None, allow_rnn: bool = False) -> Iterator[None]:
    """Inside the block: TorchDynamo's recompile limit at least ``recompile_limit`` (when given),
    and nn.GRU/nn.LSTM traced into the graph (``allow_rnn``) when asked; restored after (plain
    attribute sets: ``config.patch`` costs five times as much, and this runs at calls). Why
    private: both are global settings with no public switch, nor any per compiled function; a
    converted module's own forward may need more traces than the default 8 for one model's
    ordinary calls, and a forward that runs an RNN before its attention breaks TorchDynamo's
    graph there without ``allow_rnn`` (the attention after it is then never traced)."""
    config = dynamo_config()
    limit_before, rnn_before = config.recompile_limit, config.allow_rnn
    if recompile_limit is not None:
        config.recompile_limit = max(limit_before, recompile_limit)
    if allow_rnn:
        config.allow_rnn = True
    try:
        yield
    finally:
        config.recompile_limit = limit_before
        config.allow_rnn = rnn_before


def mkldnn_bf16_supported() -> bool | None:
    """Whether oneDNN runs bf16 products natively on this CPU (AVX512-BF16 or AMX); None where
    this torch has no such query. Why private: ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` is
    the only test of it; callers treat None as "not known", so its loss is not an error."""
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return None if query is None else bool(query())


def per_channel_qint8(rows: torch.Tensor, scales: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """int8 ``rows`` with one scale per row as a qint8 tensor (zero points 0). Why private:
    torch.ao's dynamic Linear takes its weight as a quantized tensor, and only this builds one
    from int8 values already computed (``quantize_per_channel`` would round floats again)."""
    zero_points = torch.zeros_like(scales, dtype=torch.long)
    return torch._make_per_channel_quantized_tensor(rows, scales.double(), zero_points, axis)


def mkldnn_linear_available() -> bool:
    """Whether oneDNN's packed-weight linear ops exist in this torch (CPU builds with oneDNN)."""
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def mkldnn_pack_linear_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """``weight`` [out, in] laid out once for oneDNN's products. Why private: the packed layout is
    what Inductor's CPU linear uses; torch's public F.linear repacks (or goes through MKL's sgemm,
    slow on AMD CPUs) at every call of a decoding step."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def mkldnn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` on a weight from :func:`mkldnn_pack_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
