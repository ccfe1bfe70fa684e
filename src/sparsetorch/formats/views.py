"""Free views of a SparseTensor: transpose and permute change only the mode order.

Level ``k`` stores mode ``mode_order[k]``; permuting the modes relabels them, so the same
level arrays and values describe the permuted tensor (CSR of ``A`` is CSC of ``A^T``). No
entry moves, nothing is copied, and the values tensor is shared (gradients flow through).

A view is kept with its source (unless the values require grad: then each view records an
autograd node of its own), so ``x @ W.T`` in a loop meets the same ``W.T`` each time, with
its call signature, raw pointers and row profile already worked out: ``X.T @ A.T`` of a
38 x 128 X and a 38 x 38 CSR A took 149 us a call with a new view each time, 51 us with
the view kept (the strided kernel it then ran: ``ops/relayout.py`` has since removed that).
"""
from __future__ import annotations

import torch

from .format import Format
from .tensor import SparseTensor

_is_compiling = torch.compiler.is_compiling


def _dim(d, ndim: int, what: str) -> int:
    if not isinstance(d, int) or isinstance(d, bool):
        raise TypeError(f"{what}: dimension {d!r} must be an int")
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise IndexError(f"{what}: dimension {d} is out of range for a {ndim}-D SparseTensor "
                         f"(valid: {-ndim}..{ndim - 1})")
    return d % max(ndim, 1)


def permute(t: SparseTensor, dims) -> SparseTensor:
    """``t`` with its modes reordered (result dimension ``i`` is ``t``'s dimension
    ``dims[i]``), sharing every array.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2., 0.], [3., 0., 0.]]), "csr")
        >>> B = permute(A, (1, 0))
        >>> B.format.name, tuple(B.shape), B.values.data_ptr() == A.values.data_ptr()
        ('csc', (3, 2), True)
    """
    # (values that require grad, perhaps since the views were kept: a recorded view each
    # time; fake values while tracing: none kept)
    keep = type(t._values) is torch.Tensor and not t._values.requires_grad and \
        not _is_compiling()
    views = t.__dict__.get("_views") if keep else None
    found = views.get(dims) if views is not None and type(dims) is tuple else None
    if found is not None:
        return found
    n = t.dim()
    dims = tuple(_dim(d, n, "permute") for d in dims)
    if sorted(dims) != list(range(n)):
        raise ValueError(f"permute: dims {dims} are not a permutation of 0..{n - 1} for a "
                         f"{n}-D SparseTensor")
    if dims == tuple(range(n)):
        return t
    found = views.get(dims) if views is not None else None   # (asked with negative dims)
    if found is None:
        found = _permuted(t, dims)
        if keep:
            t.__dict__.setdefault("_views", {})[dims] = found
    return found


def _permuted(t: SparseTensor, dims: tuple) -> SparseTensor:
    n = len(dims)
    inverse = [0] * n
    for new, old in enumerate(dims):
        inverse[old] = new
    fmt = t.format
    blocks = None if fmt.blocksize is None else tuple(fmt.blocksize[d] for d in dims)
    new_fmt = Format(fmt.levels, tuple(inverse[m] for m in fmt.mode_order), blocks)
    shape = tuple(t.shape[d] for d in dims)
    return SparseTensor(shape, new_fmt, t._level_arrays, t.values)


def transpose(t: SparseTensor, dim0: int, dim1: int) -> SparseTensor:
    """``t`` with dimensions ``dim0`` and ``dim1`` swapped, as a free view.

    Example:
        >>> import torch, sparsetorch as st
        >>> transpose(st.tensor(torch.eye(2), "csc"), 0, 1).format.name
        'csr'
    """
    n = t.dim()
    dims = list(range(n))
    a, b = _dim(dim0, n, "transpose"), _dim(dim1, n, "transpose")
    dims[a], dims[b] = dims[b], dims[a]
    return permute(t, dims)


def t(x: SparseTensor) -> SparseTensor:
    """Matrix transpose (``.t()``; a 1-D tensor is returned as is).

    Example:
        >>> import torch, sparsetorch as st
        >>> tuple(t(st.tensor(torch.ones(2, 3), "coo")).shape)
        (3, 2)
    """
    if x.dim() > 2:
        raise ValueError(f"t(): a {x.dim()}-D SparseTensor has no matrix transpose; use "
                         ".transpose(d0, d1) or .mT")
    return x if x.dim() < 2 else permute(x, (1, 0))


def matrix_transpose(x: SparseTensor) -> SparseTensor:
    """``.mT``: swap the last two dimensions.

    Example:
        >>> import torch, sparsetorch as st
        >>> tuple(matrix_transpose(st.tensor(torch.ones(4, 2, 3), "csf")).shape)
        (4, 3, 2)
    """
    if x.dim() < 2:
        raise ValueError(f".mT needs at least 2 dimensions, this SparseTensor has {x.dim()}")
    return transpose(x, -2, -1)
