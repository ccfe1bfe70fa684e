"""Constructors users expect beside ``st.tensor``: ``st.eye`` and ``st.random``.

In: a shape (and a density). Out: a validated ``SparseTensor`` in any format, built from
coordinates without ever allocating the dense tensor, so ``st.random((10**6, 10**6), 1e-6)``
costs memory in proportion to its entries.
"""
from __future__ import annotations

import math

import torch

from .convert import tensor
from .tensor import SparseTensor
from .validate import check_dtype_argument, check_shape


def eye(n: int, m: int | None = None, *, format="csr", dtype=None, device=None,
        index_dtype=None, blocksize=None) -> SparseTensor:
    """The ``n x m`` identity (``m`` defaults to ``n``) as a SparseTensor, like ``torch.eye``.

    Example:
        >>> import sparsetorch as st
        >>> I = st.eye(3, format="coo")
        >>> I.nnz, I.format.name, I.to_dense().trace().item()
        (3, 'coo', 3.0)
    """
    shape = check_shape((n, n if m is None else m), "st.eye")
    check_dtype_argument(dtype, "st.eye")
    k = min(shape)
    diag = torch.arange(k, dtype=torch.int64)
    values = torch.ones(k, dtype=dtype or torch.get_default_dtype())
    return tensor((torch.stack([diag, diag]), values), format, shape=shape, device=device,
                  index_dtype=index_dtype, blocksize=blocksize)


def random(shape, density: float, *, format="csr", dtype=None, device=None,
           generator: torch.Generator | None = None, index_dtype=None,
           blocksize=None) -> SparseTensor:
    """A tensor of ``shape`` with exactly ``round(density * numel)`` entries at distinct
    positions drawn uniformly, values uniform in [0, 1) (as ``scipy.sparse.random``).

    ``generator`` makes the draw reproducible. Memory is proportional to the entries, never to
    ``numel``, so very large sparse shapes are fine.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.random((100, 50), 0.1, generator=torch.Generator().manual_seed(0))
        >>> A.nnz, A.shape
        (500, torch.Size([100, 50]))
    """
    shape = check_shape(shape, "st.random")
    check_dtype_argument(dtype, "st.random")
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"st.random: values are drawn uniform in [0, 1), so dtype must be a "
                        f"floating type, got {dtype}; cast the result (A.to(dtype)) if needed")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (
            0.0 <= float(density) <= 1.0):
        raise ValueError(f"st.random: density must be a number in [0, 1], got {density!r}")
    numel = math.prod(shape)
    count = round(float(density) * numel)
    flat = _distinct_positions(numel, count, generator)
    coords = torch.stack(torch.unravel_index(flat, shape))
    values = torch.rand(count, generator=generator, dtype=dtype or torch.get_default_dtype())
    return tensor((coords, values), format, shape=shape, device=device,
                  index_dtype=index_dtype, blocksize=blocksize)


def _distinct_positions(numel: int, count: int, generator) -> torch.Tensor:
    """``count`` distinct flat positions below ``numel``, in random order. Dense draws take a
    permutation; sparse ones draw with replacement and drop repeats until enough remain,
    which needs memory for the draws only."""
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    if 2 * count >= numel:
        return torch.randperm(numel, generator=generator)[:count]
    found = torch.zeros(0, dtype=torch.int64)
    while found.numel() < count:
        extra = int((count - found.numel()) * 1.2) + 16
        draws = torch.randint(numel, (extra,), generator=generator, dtype=torch.int64)
        found = torch.unique(torch.cat([found, draws]))
    # unique() sorts; shuffle before cutting so the kept positions stay uniform
    return found[torch.randperm(found.numel(), generator=generator)[:count]]
