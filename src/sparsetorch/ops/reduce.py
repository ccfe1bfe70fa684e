"""``sum`` and ``mean`` of a SparseTensor, over everything or along dimensions, as einsum
reductions (differentiable; missing entries count as zeros). Results are dense tensors of
the reduced shape, like ``torch.sum`` on the dense tensor; ``torch.sparse.sum`` over some
dimensions gives a SparseTensor (``sparse_sum``), like torch's.
"""
from __future__ import annotations

import math

import torch

from ..formats.tensor import SparseTensor
from .einsum import einsum
from .promote import sum_dtype

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _reduced_dims(t, dim) -> tuple[int, ...]:
    n = t.dim()
    if dim is None:
        return tuple(range(n))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"sum: dim must be an int or a tuple of ints, got {dim!r}")
        if not -max(n, 1) <= d < max(n, 1):
            raise IndexError(f"sum: dimension {d} is out of range for a {n}-D SparseTensor")
        out.append(d % max(n, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"sum: dim {dim!r} names a dimension twice")
    return tuple(sorted(out)) if out or dim is None else tuple(range(n))


def sum(t: SparseTensor, dim=None, keepdim: bool = False, *, dtype=None):  # noqa: A001
    """Sum of stored entries, over all dimensions (a 0-d tensor) or along ``dim``.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [2., 3.]]), "csr")
        >>> sum(A), sum(A, 1)
        (tensor(6.), tensor([1., 5.]))
    """
    dims, out = _summed(t, dim, dtype, "dense")
    if keepdim:
        out = out.reshape([1 if d in dims else s for d, s in enumerate(t.shape)])
    return out


def sparse_sum(t: SparseTensor, dim=None, dtype=None) -> SparseTensor | torch.Tensor:
    """``torch.sparse.sum``: over every dimension a 0-d dense tensor (as ``sum``); over some,
    a SparseTensor of the kept dimensions (all levels compressed, ``csf``; 1-D: ``coo``)
    that stores the slices holding entries, as torch's sparse result does.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 0.], [2., 3.]]), "csr")
        >>> r = torch.sparse.sum(A, 1)
        >>> r.nnz, r.to_dense()
        (2, tensor([1., 0., 5.]))
    """
    return _summed(t, dim, dtype, "csf")[1]


def _summed(t: SparseTensor, dim, dtype, kept_format: str):
    """``(reduced dims, sum)``: ``t`` (values in ``dtype`` if given) summed over ``dim`` by
    one einsum, the kept dimensions in ``kept_format`` (none kept: a 0-d dense tensor)."""
    # integers sum in int64, as torch.sum's (an int32 sum overflowed)
    dtype = sum_dtype(t.dtype) if dtype is None else dtype
    if dtype != t.dtype:
        t = t.with_values(t.values.to(dtype))
    dims = _reduced_dims(t, dim)
    letters = _LETTERS[: t.dim()]
    kept = "".join(c for d, c in enumerate(letters) if d not in dims)
    return dims, einsum(f"{letters}->{kept}", t, out_format=kept_format if kept else None)


def mean(t: SparseTensor, dim=None, keepdim: bool = False, *, dtype=None):
    """Mean over the full shape (missing entries are zeros), over all dimensions or ``dim``.

    Example:
        >>> import torch, sparsetorch as st
        >>> mean(st.tensor(torch.tensor([[1., 0.], [2., 3.]]), "coo"), 0)
        tensor([1.5000, 1.5000])
    """
    if not (dtype or t.dtype).is_floating_point:
        raise TypeError(f"mean: a SparseTensor of dtype {t.dtype} has no mean (not floating "
                        "point); pass dtype=torch.float32 or convert with .to(torch.float32)")
    total = sum(t, dim, keepdim, dtype=dtype)
    count = math.prod(t.shape[d] for d in _reduced_dims(t, dim))
    return total / count
