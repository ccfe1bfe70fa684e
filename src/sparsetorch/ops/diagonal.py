"""Diagonals of sparse operands: an index repeated within one subscript (``ii->i``,
``ii->`` (the trace), ``iij,j->i``).

The kernels co-iterate each operand along distinct variables, so a repeated index is taken
out before scheduling: the operand is replaced by its diagonal -- the stored entries whose
coordinates agree along the repeated dimensions, those dimensions merged into the first one
-- a SparseTensor with one level of compressed coordinates per remaining dimension. That is
one vectorised pass over the stored entries (O(nnz), never a dense temporary), and the new
values are an index of the old ones, so gradients flow back to the operand's stored values
through torch's autograd.

Reference: ``torch.einsum`` takes the same diagonal of a dense operand. Shape rule: the
repeated dimensions must have one size. Format rule: the diagonal's levels are compressed;
dense operands, and SparseTensors in a dense layout (passed on as plain tensors), keep their
repeated indices: the kernels read a dense diagonal in place.
"""
from __future__ import annotations

from ..compiler.notation import Access, Assignment, product
from ..formats.format import Format, compressed
from ..formats.pack import pack, unpack
from ..formats.tensor import SparseTensor


def take_diagonals(assignment: Assignment, operands, what: str = "einsum"):
    """``(assignment, operands)`` with every sparse operand whose subscript repeats an index
    replaced by its diagonal and that subscript by its distinct letters; the arguments
    themselves when no sparse operand repeats one. ``assignment`` is an einsum product.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> A = st.tensor(torch.tensor([[1., 2.], [0., 3.]]), "csr")
        >>> a, ops = take_diagonals(parse_einsum("ii->i", [2]), [A])
        >>> str(a), ops[0].to_dense().tolist()
        ('out[i] = T0[i]', [1.0, 3.0])
    """
    if not has_sparse_diagonal(assignment, operands):
        return assignment, operands
    operands, factors = list(operands), []
    for acc in assignment.expr.accesses():
        t = operands[acc.operand]
        if len(set(acc.indices)) != len(acc.indices) and isinstance(t, SparseTensor):
            if t.format.is_dense:   # a dense layout stays dense: read in place, as a tensor
                operands[acc.operand] = t.to_dense()
            else:
                operands[acc.operand] = diagonal(t, acc.indices,
                                                 f"{what}: operand {acc.operand}")
                acc = Access(acc.operand, tuple(dict.fromkeys(acc.indices)))
        factors.append(acc)
    return Assignment(assignment.out_vars, product(factors)), operands


def has_sparse_diagonal(assignment: Assignment, operands) -> bool:
    """Whether a SparseTensor operand's subscript repeats an index."""
    return any(len(set(a.indices)) != len(a.indices) and
               isinstance(operands[a.operand], SparseTensor)
               for a in assignment.expr.accesses())


def diagonal(t: SparseTensor, indices, what: str = "diagonal") -> SparseTensor:
    """The entries of ``t`` whose coordinates agree wherever ``indices`` (one letter per
    dimension) repeats a letter, as a tensor over the distinct letters in first-use order;
    duplicates of a non-unique format are summed.

    Example:
        >>> import torch, sparsetorch as st
        >>> T = st.tensor(torch.arange(8.).reshape(2, 2, 2), "csf")
        >>> diagonal(T, "iij").to_dense().tolist()      # T[i, i, j]
        [[0.0, 1.0], [6.0, 7.0]]
    """
    first = {}
    for d, v in enumerate(indices):
        if v in first and t.shape[d] != t.shape[first[v]]:
            raise ValueError(f"{what}: index {v!r} repeats over dimensions {first[v]} and {d} "
                             f"of sizes {t.shape[first[v]]} and {t.shape[d]}; a diagonal needs "
                             "one size")
        first.setdefault(v, d)
    coords, values = unpack(t.format, t.shape, t._level_arrays, t.values)
    on_diagonal = None
    for d, v in enumerate(indices):
        if first[v] != d:
            same = coords[d] == coords[first[v]]
            on_diagonal = same if on_diagonal is None else on_diagonal & same
    keep = on_diagonal.nonzero().flatten()
    return regroup(t, list(first.values()), coords.index_select(1, keep),
                   values.index_select(0, keep))


def regroup(t: SparseTensor, kept, coords=None, values=None) -> SparseTensor:
    """Stored entries of ``t`` (``coords`` ``[ndim, n]`` and ``values``, default all of
    them) as a tensor over dimensions ``kept`` of ``t``, one compressed level each; the
    entries are sorted (and duplicates summed) into that layout.

    Example:
        >>> import torch, sparsetorch as st
        >>> regroup(st.tensor(torch.ones(1, 3), "csr"), [1]).to_dense().tolist()
        [1.0, 1.0, 1.0]
    """
    if coords is None:
        coords, values = unpack(t.format, t.shape, t._level_arrays, t.values)
    shape = tuple(t.shape[d] for d in kept)
    fmt = Format((compressed,) * len(kept))
    arrays, stored = pack(fmt, shape, coords[kept], values, t.index_dtype)
    return SparseTensor(shape, fmt, arrays, stored)
