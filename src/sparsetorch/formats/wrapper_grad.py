"""Autograd on a SparseTensor's wrapper, beside autograd on its values.

Eager ops differentiate ``values``; a ``torch.compile``d function is one autograd node
whose inputs and outputs are whole SparseTensors, so there the wrapper carries the history.
These pieces keep the two consistent: a wrapper built from values that require grad is one
node (``_FromValues``), ``values`` of a wrapper with history reads through one
(``_ValuesOf``), and a gradient accumulated on a leaf wrapper moves onto its values
(``_move_wrapper_grad``).
"""
from __future__ import annotations

import torch

from .tensor import SparseTensor, _DisableTorchFunction


# The wrapper's own autograd state (the class overrides the Python properties). Read with
# torch functions off: through ``__torch_function__`` the getter costs ~1.7 us, ~0.35 here.
def wrapper_requires_grad(t) -> bool:
    """Whether autograd tracks the SparseTensor ``t`` itself (its wrapper), not only its
    values: a leaf flagged by ``requires_grad_`` for compiled graphs, or a recorded wrapper.

    Example:
        >>> import torch, sparsetorch as st
        >>> wrapper_requires_grad(st.tensor(torch.eye(2), "csr").requires_grad_())
        True
    """
    with _DisableTorchFunction():
        return torch.Tensor.requires_grad.__get__(t)


def _wrapper_grad_fn(t):
    with _DisableTorchFunction():
        return torch.Tensor.grad_fn.__get__(t)


def _move_wrapper_grad(t: SparseTensor) -> None:
    """Move a gradient that autograd accumulated on the leaf wrapper ``t`` onto its values.

    Eager ops differentiate the values, but a ``torch.compile``d function is one autograd
    node whose inputs are whole SparseTensors: it can only reach the values through the
    wrapper, so ``requires_grad_`` flags the wrapper too and this hook (run after each
    accumulation) keeps ``.grad`` in one place, the values."""
    with _DisableTorchFunction():
        grad = torch.Tensor.grad.__get__(t)
        torch.Tensor.grad.__set__(t, None)
    if grad is None:
        return
    grad = grad._values if isinstance(grad, SparseTensor) else grad
    old = t._values.grad
    t._values.grad = grad if old is None else old + grad


class _FromValues(torch.autograd.Function):
    """A SparseTensor built from values that require grad, as one autograd node: the
    wrapper's gradient (a SparseTensor on the same pattern) is its values' gradient. The
    wrapped ``values`` keep their own history, which is what eager code differentiates."""

    @staticmethod
    def forward(ctx, shape, fmt, arrays, values):
        out = SparseTensor(shape, fmt, arrays, values)   # grad mode is off in here
        out._wrapper_grad = True
        return out

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, SparseTensor):
            grad = grad._values
        elif grad.layout == torch.strided and grad.dim() != 1:
            raise RuntimeError(
                f"SparseTensor: the gradient of a sparse tensor arrived as a dense tensor of "
                f"shape {tuple(grad.shape)}; pass a SparseTensor with the same pattern (or "
                "differentiate .values)")
        return None, None, None, grad


class _ValuesOf(torch.autograd.Function):
    """``t.values`` of a SparseTensor whose history is on the wrapper (an output of a
    ``torch.compile``d function): the values' gradient is the wrapper's, on its pattern."""

    @staticmethod
    def forward(ctx, t):
        ctx.pattern = t.with_values(t._values.detach())
        return t._values.view_as(t._values)

    @staticmethod
    def backward(ctx, grad):
        return ctx.pattern.with_values(grad)
