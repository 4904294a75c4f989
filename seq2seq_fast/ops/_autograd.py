"""Autograd helpers the ops' Functions share: where Python-side autograd state must stay out
(tracing and torch.func transforms), and the guard that makes a kernel's backward refuse to be
differentiated again."""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq_fast.ops._torch_private import (
    current_graph_task_id,
    delayed_error,
    functorch_transforms_active,
)


def traced_or_transformed() -> bool:
    """Inside torch.compile's tracing or a torch.func transform: where only the setup_context-style
    Function works and Python-side autograd state (StepwiseMemory) must stay out."""
    return torch.compiler.is_compiling() or functorch_transforms_active()


def guard_double_backward(grads: tuple) -> tuple:
    """A backward's results, made to raise when differentiated again (a backward run with
    create_graph=True, then differentiated): the kernels' backward has no derivative of its own,
    and autograd would otherwise treat it as a constant, silently. First-order results (also under
    create_graph=True, and torch.func.grad) are unchanged."""
    if not torch.is_grad_enabled() or traced_or_transformed():
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    if not tensors:
        return grads
    error = delayed_error(
        b"seq2seq_fast: the fused attention's backward is not differentiable (a second-order "
        b"gradient through it); use backend='reference' for higher-order gradients",
        len(tensors),
    )
    wrapped = error(*[t.detach().requires_grad_(True) for t in tensors])
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return tuple(next(wrapped) if isinstance(g, Tensor) else g for g in grads)


def gradient_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient summed over many steps is kept in: float32 for bfloat16 (each step
    adds into it exactly enough, rounded once at the end; the kernels accept it), else the
    tensor's own. The one place this rule is written."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _nothing() -> None:
    return None


class _GatheredNode(torch.autograd.Function):
    """tensors -> aliases of them; the backward, which autograd runs after every step's backward
    that read the aliases, returns what the gatherer gathered for them (plus any gradient that
    reached the aliases directly)."""

    @staticmethod
    def forward(ctx, gatherer: StepGradients, *tensors: Tensor):
        ctx.gatherer = gatherer
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        gathered = ctx.gatherer.gathered()
        summed = tuple(
            grad if mine is None else (mine if grad is None else mine + grad)
            for mine, grad in zip(gathered, grads, strict=True)
        )
        return guard_double_backward((None, *summed))


class StepGradients:
    """Gradients of tensors that many steps read (a decoder's memory: keys and values), gathered
    in each backward pass and returned once, instead of one tensor of the memory's size written
    and summed per step.

    :meth:`attach` gives aliases of the memory tensors that the steps read. In a step's backward
    the step's Function calls :meth:`buffer` (a gradient sum that its kernel adds into, in place)
    and :meth:`record` (its weights and context gradient). When the backward reaches the aliases,
    :meth:`collect` returns (buffer, values' gradient = one batched product of every step's
    weights^T and context gradient). Each backward pass is told apart by autograd's graph task,
    so a backward that reached the steps but not the aliases leaves nothing for the next one.

    Deep copies and pickles of a module that holds one hold None instead (its graph is one
    forward pass's). Subclasses say in :meth:`gathered` which gradient goes to which alias.
    """

    def __init__(self) -> None:
        self._begin(None)

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return (_nothing, ())

    def attach(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        """Aliases of ``tensors`` whose gradients :meth:`gathered` gives."""
        return _GatheredNode.apply(self, *tensors)

    def gathered(self) -> tuple[Tensor | None, ...]:
        """The gradients of the attached tensors gathered in this backward pass, in their order
        (None: nothing gathered). Default: (buffer, values' gradient) for (keys, values)."""
        return self.collect()

    def _begin(self, task: int | None) -> None:
        self._task = task
        self._buffer: Tensor | None = None
        self._weights: list[Tensor] = []
        self._grad_contexts: list[Tensor] = []

    def _this_pass(self) -> None:
        task = current_graph_task_id()
        if task != self._task:  # a new backward pass: nothing of an earlier one counts
            self._begin(task)

    def buffer(self, like: Tensor) -> Tensor:
        """This backward pass's gradient sum, shaped as ``like`` in :func:`gradient_sum_dtype`
        (zeros at its first step)."""
        self._this_pass()
        if self._buffer is None:
            dtype = gradient_sum_dtype(like.dtype)
            self._buffer = torch.zeros(like.shape, dtype=dtype, device=like.device)
        return self._buffer

    def record(self, weights: Tensor, grad_context: Tensor) -> None:
        """A step's weights [B, Tq, T] and context gradient [B, Tq, Dv], for the values' gradient."""
        self._this_pass()
        self._weights.append(weights)
        self._grad_contexts.append(grad_context)

    def collect(self) -> tuple[Tensor | None, Tensor | None]:
        """(buffer, values' gradient) gathered in this backward pass, each None where no step
        contributed, and a fresh start for the next pass."""
        same_pass = self._task == current_graph_task_id()
        buffer, weights, grads = self._buffer, self._weights, self._grad_contexts
        self._begin(None)
        if not same_pass:
            return None, None
        grad_values = None
        if weights:
            weights = torch.cat(weights, dim=1)  # [B, sum Tq, T]
            grads = torch.cat(grads, dim=1).to(weights.dtype)  # [B, sum Tq, Dv]
            grad_values = torch.bmm(weights.transpose(1, 2), grads)
        return buffer, grad_values
