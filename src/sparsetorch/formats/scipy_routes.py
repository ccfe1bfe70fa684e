"""2-D conversions on the CPU by scipy's C routines, where they are faster than the general
``pack``/``unpack_rows`` path (which sorts, and runs torch's parallel ops).

Why scipy: its routines are single-threaded O(entries) loops (counting sorts, pointer
expansion), so on the graphs and pruned weights users convert (10^4-10^6 entries) they beat a
general sort, and a busy core does not stall them the way it stalls torch's OpenMP ops. The
C routines (``scipy.sparse._sparsetools``, unchanged across scipy releases for over a decade)
are called on the arrays directly: building scipy array objects around them cost more than
the routine itself on a Cora-sized graph (~140 us of ~200 us). Each route returns ``None`` where it does not
apply (another format or device, a tracer's arrays, values that record a gradient or of a dtype
scipy does not take), and the caller takes the general path. Results own their memory.

Routes (``benchmarks/conversions.py`` times each against scipy's and torch's own calls):
  compressed_to_coo   CSR -> COO: row coordinates expanded from ``pos`` (one pass), columns
                      copied, values shared (as torch's and scipy's CSR -> COO share them).
  swap_compressed     CSR <-> CSC: scipy's counting sort (``tocsc``/``tocsr``).
  coo_to_compressed   COO data -> CSR/CSC: scipy's counting sort by the outer dimension, then
                      per-segment sort and duplicate summation (``coo_array.tocsr``); a COO
                      SparseTensor (sorted, unique) needs the counting sort alone.
"""
from __future__ import annotations

import numpy as np
import torch

from .format import Format
from .pack import choose_index_dtype
from .tensor import SparseTensor

# Value dtypes scipy's sparse routines take as they are (others: their positions are sorted).
SCIPY_VALUES = (torch.float32, torch.float64, torch.int32, torch.int64)
_COMPRESSED = ("csr", "csc")
_PLAIN = (torch.Tensor, torch.nn.Parameter)     # not a tracer's FakeTensor or FunctionalTensor


def _tools():
    """scipy's C routines, imported at first use: ``import scipy.sparse`` takes ~0.3 s,
    which ``import sparsetorch`` should not pay before a conversion needs it."""
    from scipy.sparse import _sparsetools

    return _sparsetools


def plain_cpu(*tensors: torch.Tensor) -> bool:
    """Whether numpy may read these tensors' memory: plain CPU tensors (or parameters)
    outside a tracer."""
    return not torch.compiler.is_compiling() and all(
        type(t) in _PLAIN and t.is_cpu for t in tensors)


def scipy_takes_values(v: torch.Tensor) -> bool:
    """Whether scipy may take ``v`` as values as they are: one per entry, of a dtype it knows,
    recording no gradient (scipy's results would not carry it)."""
    return v.dtype in SCIPY_VALUES and v.dim() == 1 and type(v) is torch.Tensor and \
        not (v.requires_grad and torch.is_grad_enabled())


def scipy_takes_arrays(t: SparseTensor) -> bool:
    """Whether scipy's routines for compressed arrays may run on ``t``'s: CSR or CSC on the
    CPU, outside a tracer (whose arrays have no data)."""
    return t.format.name in _COMPRESSED and plain_cpu(t.values, *t._level_arrays.values())


def as_scipy(t: SparseTensor, data: np.ndarray):
    """``t`` (``scipy_takes_arrays``) as a scipy array over its index arrays, with ``data``
    for values."""
    import scipy.sparse as sp

    kind = sp.csr_array if t.format.name == "csr" else sp.csc_array
    return kind((data, t._level_arrays["crd1"].numpy(), t._level_arrays["pos1"].numpy()),
                shape=tuple(t.shape))


def compressed_to_coo(t: SparseTensor, fmt: Format, index_dtype) -> SparseTensor | None:
    """CSR -> COO (a CSC source's entries come out sorted by column, so it needs a stable
    sort by row and takes the general path)."""
    if t.format.name != "csr" or fmt.name != "coo" or not scipy_takes_arrays(t):
        return None
    pos, crd = t._level_arrays["pos1"], t._level_arrays["crd1"]
    want = choose_index_dtype(fmt.storage_dims(t.shape), t.nnz, index_dtype)
    rows = np.empty(t.nnz, dtype=pos.numpy().dtype)
    _tools().expandptr(t.shape[0], pos.numpy(), rows)
    rows = torch.from_numpy(rows).to(want)
    # the columns copied (a module may write its pattern buffers in place, e.g.
    # load_state_dict); the values shared, as torch's to_sparse_coo and scipy's tocoo do
    arrays = {"pos0": torch.tensor([0, t.nnz], dtype=want), "crd0": rows,
              "crd1": crd.to(want, copy=True)}
    return SparseTensor(t.shape, fmt, arrays, t.values)


def swap_compressed(t: SparseTensor, fmt: Format, index_dtype) -> SparseTensor | None:
    """CSR <-> CSC by scipy's counting sort (one pass over the entries, where ``pack`` sorts
    them). Values that record a gradient, or of a dtype scipy does not take, are gathered by
    torch along the entries' sorted positions."""
    if {t.format.name, fmt.name} != set(_COMPRESSED) or not scipy_takes_arrays(t):
        return None
    values = t.values
    direct = scipy_takes_values(values)
    data = values.detach().numpy() if direct else np.arange(t.nnz, dtype=np.int64)
    outer, inner = t.shape if t.format.name == "csr" else t.shape[::-1]
    pos, crd = (t._level_arrays[k].numpy() for k in ("pos1", "crd1"))
    new_pos = np.empty(inner + 1, dtype=pos.dtype)
    new_crd = np.empty(t.nnz, dtype=crd.dtype)
    moved = np.empty(t.nnz, dtype=data.dtype)
    # a CSC is the CSR of the transpose: one routine serves both directions
    _tools().csr_tocsc(outer, inner, pos, crd, data, new_pos, new_crd, moved)
    want = choose_index_dtype(fmt.storage_dims(t.shape), t.nnz, index_dtype)
    new = {"pos1": torch.from_numpy(new_pos).to(want), "crd1": torch.from_numpy(new_crd).to(want)}
    moved = torch.from_numpy(moved)
    return SparseTensor(t.shape, fmt, new, moved if direct else values.index_select(0, moved))


def coo_to_compressed(fmt: Format, shape, rows: list, values: torch.Tensor, index_dtype, *,
                      canonical: bool = False) -> SparseTensor | None:
    """Validated COO coordinates (two 1-D index tensors, any order, duplicates allowed) and
    values -> CSR or CSC, duplicates summed in the values' dtype (as ``pack`` does).
    ``canonical=True`` promises unique entries sorted row-major (a COO SparseTensor's): the
    counting sort is stable, so its output is then sorted already."""
    if fmt.name not in _COMPRESSED or len(rows) != 2 or not scipy_takes_values(values) \
            or not plain_cpu(values, *rows):
        return None
    want = choose_index_dtype(fmt.storage_dims(shape), values.numel(), index_dtype)
    outer, inner = (rows[0], rows[1]) if fmt.name == "csr" else (rows[1], rows[0])
    n_outer, n_inner = shape if fmt.name == "csr" else shape[::-1]
    nnz = values.numel()
    pos = np.empty(n_outer + 1, dtype=_np(want))
    crd = np.empty(nnz, dtype=_np(want))
    data = np.empty(nnz, dtype=values.numpy().dtype)
    # counting sort by the outer coordinate into fresh arrays (nothing aliases the caller's),
    # then each segment sorted and its duplicates summed in place, as scipy's tocsr does
    _tools().coo_tocsr(n_outer, n_inner, nnz, outer.to(want).numpy(),
                           inner.to(want).numpy(), values.numpy(), pos, crd, data)
    if not canonical:
        _tools().csr_sort_indices(n_outer, pos, crd, data)
        _tools().csr_sum_duplicates(n_outer, n_inner, pos, crd, data)
    kept = int(pos[-1])
    return SparseTensor(tuple(shape), fmt, {"pos1": torch.from_numpy(pos),
                                            "crd1": torch.from_numpy(crd[:kept].copy())},
                        torch.from_numpy(data[:kept].copy()))


def compressed_is_valid(fmt: Format, dims, arrays: dict, values: torch.Tensor) -> bool:
    """True when CSR/CSC level arrays (plain CPU, one index dtype) are certainly valid:
    ``pos`` starts at 0, ends at the entry count and never decreases, every coordinate is in
    range, and each segment's coordinates strictly increase; two reductions and scipy's one
    pass (``csr_has_canonical_format``) instead of ~10 torch ops. False means "not shown
    here": the caller's general check then finds the problem and words it."""
    if fmt.name not in _COMPRESSED or fmt.blocksize is not None or set(arrays) != {"pos1", "crd1"}:
        return False
    pos, crd = arrays["pos1"], arrays["crd1"]
    if not (plain_cpu(pos, crd) and pos.is_contiguous() and crd.is_contiguous()):
        return False
    nnz = crd.numel()
    if pos.numel() != dims[0] + 1 or values.numel() != nnz:
        return False
    p, c = pos.numpy(), crd.numpy()
    # pos within [0, nnz] first: the scipy routine reads crd up to each pos without checks
    if p[0] != 0 or p[-1] != nnz or p.min() < 0 or p.max() > nnz:
        return False
    if nnz and (c.min() < 0 or c.max() >= dims[1]):
        return False
    return bool(_tools().csr_has_canonical_format(dims[0], p, c))


def coo_tensor_to_compressed(t: SparseTensor, fmt: Format, index_dtype) -> SparseTensor | None:
    """A 2-D COO SparseTensor -> CSR or CSC by one stable counting sort."""
    if t.format.name != "coo" or t.dim() != 2:
        return None
    rows = [t._level_arrays["crd0"], t._level_arrays["crd1"]]
    return coo_to_compressed(fmt, t.shape, rows, t.values, index_dtype, canonical=True)


def _np(dtype: torch.dtype):
    return np.int32 if dtype == torch.int32 else np.int64
