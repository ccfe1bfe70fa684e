"""Sparse factors on one pattern, multiplied into one before a kernel runs.

A product term that reads two SparseTensors stored on the very same pattern (the same
level arrays) with the same indices, ``T0[i,j] * T1[i,j] * T2[i,k]``, co-iterates two value
arrays over one set of coordinates: their elementwise product is one operand on that
pattern, and the kernel reads one value array instead of two (and a schedule that re-lays
its sparse operands, ``relaid.py``, gathers once instead of twice). Attention's backward
asks for such terms: the scores' ``A * (Q Kᵀ)`` give ``dQ = (A * dS) K`` and
``dK = (A * dS)ᵀ Q``, with ``A`` the mask's values. At L = 4096 (4.2M stored entries) a
product of two value arrays takes 1-3 ms.

Where one factor's values are all one number (SparseAttention's mask holds the score
scale) it is dropped for a ``Scale`` of the expression: no product pass at all. Otherwise,
inside ``sharing_products()`` (which the autograd node's backward opens) a product of the
same two value arrays is computed once, for ``dQ`` and ``dK`` alike.

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

import threading
from contextlib import contextmanager
from functools import lru_cache

import torch

from ..compiler.notation import Access, Assignment, Mul, Scale
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
            for drop in (b, a):   # a factor of one value: a scale
                c = _uniform(operands[drop]._values)
                if c is not None:
                    return (_scaled(_without(assignment, drop), c),
                            tuple(t for n, t in enumerate(operands) if n != drop))
            product = ta.with_values(_multiply(ta._values, tb._values)) if multiply else ta
            rest = tuple(product if n == a else t for n, t in enumerate(operands) if n != b)
            return _without(assignment, b), rest
    return None


def _uniform(values: torch.Tensor) -> float | None:
    """The value every entry of ``values`` holds, or None: float or double values in
    memory. Checked on every call (values change in place, through ``.data`` too, which
    no version counter sees): two entries turn most arrays down, else one pass, ~0.5 ms
    for 4.2M values where their product took 1-3 ms."""
    if type(values) is not torch.Tensor or values.numel() == 0 or \
            values.dtype not in (torch.float32, torch.float64):
        return None
    if values[0].item() != values[-1].item():
        return None
    low, high = torch.aminmax(values)
    low, high = low.item(), high.item()
    return low if low == high else None   # (NaN: never equal)


_SHARED = threading.local()   # .products: {value ids: (a, b, a * b)} while sharing


@contextmanager
def sharing_products():
    """Within the block, ``merged`` multiplies each pair of value arrays once (this thread).
    The arrays must not change inside the block: a backward pass's saved values and
    gradients do not.

    Example:
        >>> a, b = torch.tensor([2., 3.]), torch.tensor([5., 7.])
        >>> with sharing_products():
        ...     _multiply(a, b) is _multiply(b, a)
        True
    """
    outer = getattr(_SHARED, "products", None)
    _SHARED.products = {} if outer is None else outer
    try:
        yield
    finally:
        _SHARED.products = outer


def _multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    products = getattr(_SHARED, "products", None)
    if products is None:
        return a * b
    # (the entry holds both arrays, so their ids are not reused while it lives; a * b and
    # b * a are the same floats)
    key = (id(a), id(b)) if id(a) < id(b) else (id(b), id(a))
    entry = products.get(key)
    if entry is None:
        entry = products[key] = (a, b, a * b)
    return entry[2]


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
def _scaled(assignment: Assignment, factor: float) -> Assignment:
    return assignment if factor == 1.0 else Assignment(assignment.out_vars,
                                                       Scale(factor, assignment.expr))


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
