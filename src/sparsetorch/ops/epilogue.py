"""``st.einsum(..., bias=, activation=)``: a layer's bias add and activation fused into the
kernel that computes the product (an ``Epilogue`` in the notation; ``compiler/lower.py``
applies it where each output element is written, e.g. when an SpMM register tile is
flushed, so the output is written once instead of three times).

Reference: ``act(torch.einsum(equation, *dense) + bias)``. Shape rule: ``bias`` broadcasts
against the result like a torch tensor (aligned on the right; size-1 dims broadcast).
Format rule: the result is dense (``act(0 + b)`` is nonzero where the product is absent).
With gradients required the same computation runs unfused through differentiable ops.
"""
from __future__ import annotations

import torch

from ..compiler.notation import UNARY, Access, Add, Assignment, Epilogue, Result, Unary

ACTIVATIONS = tuple(UNARY)

_TORCH = {"neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "exp": torch.exp,
          "sqrt": torch.sqrt, "relu6": torch.nn.functional.relu6, "sigmoid": torch.sigmoid}


def with_epilogue(assignment: Assignment, operands, out_shape, bias, activation, what):
    """``(assignment', operands')`` computing ``activation(assignment + bias)`` in one kernel.

    Example:
        >>> import torch
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> a, ops = with_epilogue(parse_einsum("ij,jk->ik", [2, 2]), [torch.eye(2)] * 2,
        ...                        (2, 2), torch.ones(2), "relu", "einsum")
        >>> str(a)
        'out[i,k] = sum_{j} relu((sum + T2[k])) <- T0[i,j] * T1[j,k]'
    """
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"{what}: activation={activation!r} is not supported; use one of "
                         f"{', '.join(ACTIVATIONS)} or None")
    fn = Result()
    operands = list(operands)
    if bias is not None:
        access, b = _bias_access(assignment.out_vars, out_shape, bias, len(operands), what)
        operands.append(b)
        fn = Add(fn, access)
    if activation is not None:
        fn = Unary(activation, fn)
    return Assignment(assignment.out_vars, Epilogue(assignment.expr, fn)), operands


def unfused(result, bias, activation):
    """The same epilogue with torch ops on a computed (dense or sparse) result."""
    if type(result) is not torch.Tensor or result.layout != torch.strided:
        result = result.to_dense()   # (not for a dense one: vmap has no rule for to_dense)
    if bias is not None:
        result = result + bias
    return _TORCH[activation](result) if activation is not None else result


def check_bias(bias, what) -> None:
    """A bias is a dense torch.Tensor (or None)."""
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or getattr(bias, "format", None) is not None):
        raise TypeError(f"{what}: bias must be a dense torch.Tensor, got "
                        f"{type(bias).__name__}")


def _bias_access(out_vars, out_shape, bias, operand, what):
    check_bias(bias, what)
    if bias.dim() > len(out_shape):
        raise ValueError(f"{what}: bias of shape {tuple(bias.shape)} has more dimensions than "
                         f"the result {tuple(out_shape)}")
    aligned = out_vars[len(out_shape) - bias.dim():]
    keep = []
    for v, s, n in zip(aligned, bias.shape, out_shape[len(out_shape) - bias.dim():]):
        if s != 1 and s != n:
            raise ValueError(f"{what}: bias of shape {tuple(bias.shape)} does not broadcast "
                             f"against the result {tuple(out_shape)}")
        if s != 1:
            keep.append(v)
    b = bias.reshape([s for s in bias.shape if s != 1])
    return Access(operand, tuple(keep)), b
