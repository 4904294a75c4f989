"""Autograd helpers the ops' Functions share: where Python-side autograd state must stay out
(tracing and torch.func transforms), and the guard that makes a kernel's backward refuse to be
differentiated again."""

from __future__ import annotations

import torch
from torch import Tensor


def traced_or_transformed() -> bool:
    """Inside torch.compile's tracing or a torch.func transform: where only the setup_context-style
    Function works and Python-side autograd state (StepwiseMemory) must stay out."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


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
    error = torch._C._functions.DelayedError(
        b"seq2seq_fast: the fused attention's backward is not differentiable (a second-order "
        b"gradient through it); use backend='reference' for higher-order gradients",
        len(tensors),
    )
    wrapped = error(*[t.detach().requires_grad_(True) for t in tensors])
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return tuple(next(wrapped) if isinstance(g, Tensor) else g for g in grads)
