"""Sparse factors on one pattern, multiplied into one before a kernel runs.

A product term that reads two SparseTensors stored on the very same pattern (the same
level arrays) with the same indices, ``T0[i,j] * T1[i,j] * T2[i,k]``, co-iterates two value
arrays over one set of coordinates: their elementwise product is one operand on that
pattern. Attention's backward asks for such terms (``dV = (scale * P)^T dO``: the mask's
values and the softmax's on the mask's pattern); there the kernel wants the pattern
transposed, and every sparse operand is re-laid on each call, a gather of all its values
(``relaid.py``). Multiplying first gathers once instead of twice and the kernel reads one
value array instead of two. At L = 4096 (4.2M stored entries per call, both value arrays
cold in cache) a gather took 3-8 ms and the product about as long, so the gain is the
kernel's second array: the training step 151-161 -> 146-155 ms. (A gather that multiplies
as it moves the values would save the product's pass too.)

Applies to assignments whose expression is a product of accesses (each operand read once),
with neither factor needing a gradient; the merged assignment is built once per (assignment,
pair) and memoised by the caller as any other.

Example:
    >>> import torch, sparsetorch as st
    >>> from sparsetorch.compiler.notation import parse_einsum
    >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
    >>> B = A.with_values(torch.tensor([5., 7.]))
    >>> assignment, ops = merged(parse_einsum("ij,ij,jk->ik", [2, 2, 2]), (A, B, torch.eye(2)))
    >>> str(assignment), ops[0].to_dense().tolist()
    ('out[i,k] = sum_{j} T0[i,j] * T1[j,k]', [[0.0, 10.0], [21.0, 0.0]])
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..compiler.notation import Access, Assignment, Mul
from ..formats.tensor import SparseTensor


def merged(assignment: Assignment, operands, multiply: bool = True):
    """``(assignment, operands)`` with the first pair of same-pattern sparse factors (see
    the module docstring) multiplied into one operand, or None when there is none. With
    ``multiply`` False the first factor stands for the product (the same pattern: what a
    caller building the kernel ahead, ``execute.prefetch``, needs)."""
    sparse = [n for n, t in enumerate(operands) if type(t) is SparseTensor]
    if len(sparse) < 2:
        return None
    factors = _factors(assignment)
    if factors is None:
        return None
    grads = multiply and torch.is_grad_enabled()   # (a prefetch plans the backward's call)
    for x, a in enumerate(sparse):
        for b in sparse[x + 1:]:
            ta, tb = operands[a], operands[b]
            if (factors[a] != factors[b] or not _same_pattern(ta, tb)
                    or grads and (ta._values.requires_grad or tb._values.requires_grad)):
                continue
            product = ta.with_values(ta._values * tb._values) if multiply else ta
            rest = tuple(product if n == a else t for n, t in enumerate(operands) if n != b)
            return _without(assignment, b), rest
    return None


def _same_pattern(a: SparseTensor, b: SparseTensor) -> bool:
    return (a._format == b._format and a._size == b._size and a._format.blocksize is None
            and a._values.dtype == b._values.dtype and a._values.device == b._values.device
            and all(getattr(a, "_" + n) is getattr(b, "_" + n) for n in a._array_names))


def _product(expr):
    """The accesses of ``expr``, left to right, when it is a product of accesses; else
    None."""
    accesses, stack = [], [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Mul):
            stack += [node.b, node.a]
        elif isinstance(node, Access):
            accesses.append(node)
        else:
            return None
    return accesses


@lru_cache(maxsize=256)
def _factors(assignment: Assignment):
    """The indices each operand is read with, by operand number, when the expression is a
    product of accesses reading operands 0, 1, ... once each; else None."""
    accesses = _product(assignment.expr)
    if accesses is None or sorted(acc.operand for acc in accesses) != list(range(len(accesses))):
        return None
    return tuple(acc.indices for acc in sorted(accesses, key=lambda acc: acc.operand))


@lru_cache(maxsize=256)
def _without(assignment: Assignment, dropped: int) -> Assignment:
    """``assignment`` (a product, ``_factors``) with operand ``dropped``'s factor left out,
    later operands renumbered (the product's order kept)."""
    accesses = [Access(acc.operand - (acc.operand > dropped), acc.indices)
                for acc in _product(assignment.expr) if acc.operand != dropped]
    expr = accesses[0]
    for acc in accesses[1:]:
        expr = Mul(expr, acc)
    return Assignment(assignment.out_vars, expr)
