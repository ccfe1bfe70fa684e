"""Broadcasting: an index used with size 1 by some operands and size n by others, which
``torch.einsum`` reads as those operands being constant along it.

Such a dimension is taken out before scheduling: a dense operand is viewed without it
(``squeeze``, no copy) and a sparse one regrouped without it (one pass over its stored
entries, ``diagonal.regroup``), and the index leaves that operand's subscript. The kernels then
see every index at one size. Gradients flow through the squeeze and the regrouping.

Reference: ``torch.einsum`` on the same operands. Shape rule: for each index, every size is 1
or one common size n, and the result takes n.
"""
from __future__ import annotations

from ..compiler.notation import Access, Assignment, product
from ..formats.tensor import SparseTensor
from .diagonal import regroup


def squeeze_broadcast(assignment: Assignment, operands):
    """``(assignment, operands)`` with every size-1 dimension whose index has another size
    elsewhere removed from its operand and subscript; the arguments themselves when there is
    none (or when sizes disagree otherwise: the size check then reports it).
    ``assignment`` is an einsum product.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> a, ops = squeeze_broadcast(parse_einsum("bij,bjk->bik", [3, 3]),
        ...                            [torch.ones(1, 2, 3), torch.ones(4, 3, 5)])
        >>> str(a), tuple(ops[0].shape)
        ('out[b,i,k] = sum_{j} T0[i,j] * T1[b,j,k]', (2, 3))
    """
    if not any(1 in t.shape for t in operands):   # no size 1 anywhere: the common case
        return assignment, operands
    accesses = assignment.expr.accesses()
    size: dict = {}
    for acc in accesses:
        for v, n in zip(acc.indices, operands[acc.operand].shape):
            if n != 1:
                if size.setdefault(v, n) != n:
                    return assignment, operands
    unit = {acc.operand: [d for d, (v, n) in enumerate(zip(acc.indices,
                                                           operands[acc.operand].shape))
                          if n == 1 and size.get(v, 1) != 1] for acc in accesses}
    if not any(unit.values()):
        return assignment, operands
    operands, factors = list(operands), []
    for acc in accesses:
        dims = unit[acc.operand]
        if dims:
            t = operands[acc.operand]
            kept = [d for d in range(t.dim()) if d not in dims]
            if not isinstance(t, SparseTensor):
                t = t.squeeze(tuple(dims))
            elif kept and not t.format.is_dense:
                t = regroup(t, kept)
            else:   # nothing left to store sparsely: the dense values
                t = t.to_dense().squeeze(tuple(dims))
            operands[acc.operand] = t
            acc = Access(acc.operand, tuple(acc.indices[d] for d in kept))
        factors.append(acc)
    return Assignment(assignment.out_vars, product(factors)), operands
