"""Refuse a sparse result that cannot fit in memory before assembling it.

A result of unknown pattern is assembled in two passes (count, fill; ``compiler/assemble.py``),
and the count pass alone walks every product: one dense column times one dense row, 200k
long, walks 4e10 of them (26-59 s here) only to fail allocating the result. Where even the
dense result would fit in memory nothing is checked (one multiplication per call). Past
that, a product of two 2-D sparse operands in any format and orientation (``ij,jk->ik``,
``ji,jk->ki``, ...) is bounded from row lengths (O(entries), milliseconds, after converting
an operand not stored by rows of the product): row ``i`` of the result holds at least the
longest row of B that A's row ``i`` gathers, and at most ``min(columns, sum of those rows'
lengths)``. A lower bound beyond memory is refused at once with the sizes named.

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.ones(3, 1), "csr"); B = st.tensor(torch.ones(1, 3), "csr")
    >>> entry_bounds(A, B)
    (9, 9)
"""
from __future__ import annotations

import torch

from ..formats.tensor import SparseTensor
from ..formats.memory import ResultTooLarge, memory_bytes


def entry_bytes(dtype: torch.dtype) -> int:
    """Bytes a stored result entry needs at least: its value and a 32-bit coordinate."""
    return torch.empty((), dtype=dtype).element_size() + 4


def _coordinates(t: SparseTensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` of ``t``'s stored entries (of its transpose where ``transposed``), as
    int64: O(entries) for every format, hypersparse ones included (a conversion to CSR
    would allocate a row pointer per row: 2^31 rows of 3 entries were killed for memory)."""
    c = t.asformat("coo")
    rows, cols = (c._level_arrays[f"crd{k}"].to(torch.int64) for k in (0, 1))
    return (cols, rows) if transposed else (rows, cols)


def entry_bounds(a, b, a_transposed: bool = False, b_transposed: bool = False
                 ) -> tuple[int, int]:
    """``(lower, upper)`` bounds on the stored entries of the product ``a @ b`` of 2-D
    SparseTensors in any format (``a.T`` / ``b.T`` where ``*_transposed``), from row
    lengths alone; time and memory O(entries log entries), whatever the shapes."""
    a_rows, a_cols = _coordinates(a, a_transposed)
    b_rows, counts = torch.unique(_coordinates(b, b_transposed)[0], return_counts=True)
    at = torch.searchsorted(b_rows, a_cols).clamp_(max=max(b_rows.numel() - 1, 0))
    gathered = torch.where(b_rows[at] == a_cols, counts[at], 0) if b_rows.numel() else \
        torch.zeros_like(a_cols)                             # per entry of a: its B row's length
    rows_of_a, row_of = torch.unique(a_rows, return_inverse=True)
    groups = rows_of_a.numel()
    longest = torch.zeros(groups, dtype=torch.int64).scatter_reduce_(
        0, row_of, gathered, "amax")
    summed = torch.zeros(groups, dtype=torch.int64).index_add_(0, row_of, gathered)
    columns = int(b._size[0 if b_transposed else 1])
    return int(longest.sum()), int(summed.clamp_(max=columns).sum())


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
            type(t) is SparseTensor and t.dim() == 2 and t._format.blocksize is None
            and not t._format.is_dense for t in tensors):
        return
    first, second = (accesses[0], accesses[1]) if accesses[0].operand == 0 else \
        (accesses[1], accesses[0])
    shared = set(first.indices) & set(second.indices)
    if len(shared) != 1 or len(set(first.indices)) != 2 or len(set(second.indices)) != 2:
        return
    (j,) = shared
    i = next(v for v in first.indices if v != j)
    k = next(v for v in second.indices if v != j)
    if set(a.out_vars) != {i, k} or len(a.out_vars) != 2:
        return                         # (an index kept or summed otherwise: not a product)
    lower, upper = entry_bounds(tensors[0], tensors[1], a_transposed=first.indices[0] == j,
                                b_transposed=second.indices[0] != j)
    if lower * per_entry > limit:
        raise ResultTooLarge(
            f"{what}: the sparse result of shape {tuple(out_shape)} would store at least "
            f"{lower:,} entries (at most {upper:,}), {lower * per_entry / 2**30:,.1f} GiB of "
            f"values and coordinates at {per_entry} bytes each, more than this machine's "
            f"{limit / 2**30:,.1f} GiB of memory; compute it in blocks of rows (slice the "
            "first operand), or make the operands sparser")
