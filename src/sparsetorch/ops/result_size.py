"""Refuse a sparse result that cannot fit in memory before assembling it.

A result of unknown pattern is assembled in two passes (count, fill; ``compiler/assemble.py``),
and the count pass alone walks every product: one dense column times one dense row, 200k
long, walks 4e10 of them (26-59 s here) only to fail allocating the result. Where even the
dense result would fit in memory nothing is checked (one multiplication per call). Past
that, a Gustavson product ``ij,jk->ik`` of CSR-like operands is bounded from row lengths
(O(entries of A), milliseconds): row ``i`` of the result holds at least the longest row of
B that A's row ``i`` gathers, and at most ``min(columns, sum of those rows' lengths)``. A
lower bound beyond memory is refused at once with the sizes named.

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.ones(3, 1), "csr"); B = st.tensor(torch.ones(1, 3), "csr")
    >>> entry_bounds(A, B)
    (9, 9)
"""
from __future__ import annotations

import os

import torch

from ..formats.levels import Compressed, Dense
from ..formats.tensor import SparseTensor


class ResultTooLarge(ValueError, MemoryError):
    """A result that cannot fit in memory: a ``ValueError`` (bad input for this machine)
    that ``except MemoryError`` also catches."""


def memory_bytes() -> int:
    """Physical memory of this machine (a generous limit: 2**62 where unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def entry_bytes(dtype: torch.dtype) -> int:
    """Bytes a stored result entry needs at least: its value and a 32-bit coordinate."""
    return torch.empty((), dtype=dtype).element_size() + 4


def _csr_like(t) -> bool:
    fmt = t._format
    return (len(fmt.levels) == 2 and fmt.blocksize is None and fmt.mode_order == (0, 1)
            and isinstance(fmt.levels[0], Dense) and isinstance(fmt.levels[1], Compressed))


def entry_bounds(a, b) -> tuple[int, int]:
    """``(lower, upper)`` bounds on the stored entries of the CSR-like product ``a @ b``
    (both CSR-like SparseTensors), from row lengths alone."""
    b_rows = torch.diff(b._pos1.to(torch.int64))
    gathered = b_rows.index_select(0, a._crd1.to(torch.int64))   # per entry of a
    a_rows = torch.diff(a._pos1.to(torch.int64))
    row_of = torch.repeat_interleave(torch.arange(a_rows.numel()), a_rows)
    longest = torch.zeros(a_rows.numel(), dtype=torch.int64).scatter_reduce_(
        0, row_of, gathered, "amax")
    summed = torch.zeros(a_rows.numel(), dtype=torch.int64).index_add_(0, row_of, gathered)
    return int(longest.sum()), int(summed.clamp_(max=int(b._size[1])).sum())


def dense_fits(dtype) -> int:
    """Result cells below which even a dense result's entries would fit in memory."""
    return memory_bytes() // entry_bytes(dtype)


def check_result_fits(kernel, tensors, out_shape, dtype, what: str = "einsum") -> None:
    """Raise ``ResultTooLarge`` when the sparse result of ``kernel`` on ``tensors`` (after
    its conversions) is sure not to fit in memory; return at once when the dense result
    would fit."""
    cells = 1
    for n in out_shape:
        cells *= int(n)
    if cells <= dense_fits(dtype):
        return
    limit, per_entry = memory_bytes(), entry_bytes(dtype)
    a = kernel.assignment
    accesses = a.expr.accesses()
    if len(accesses) != 2 or len(tensors) != 2 or not all(
            type(t) is SparseTensor and _csr_like(t) for t in tensors):
        return
    (i, j), (j2, k) = accesses[0].indices, accesses[1].indices
    if j != j2 or tuple(a.out_vars) != (i, k) or accesses[0].operand != 0:
        return
    lower, upper = entry_bounds(tensors[0], tensors[1])
    if lower * per_entry > limit:
        raise ResultTooLarge(
            f"{what}: the sparse result of shape {tuple(out_shape)} would store at least "
            f"{lower:,} entries (at most {upper:,}), {lower * per_entry / 2**30:,.1f} GiB of "
            f"values and coordinates at {per_entry} bytes each, more than this machine's "
            f"{limit / 2**30:,.1f} GiB of memory; compute it in blocks of rows (slice the "
            "first operand), or make the operands sparser")
