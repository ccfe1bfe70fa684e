"""A SparseTensor re-laid in another mode order, its pattern converted once and kept.

The scheduler asks for such a conversion where an operand's storage order would make a
kernel scatter into its dense result from one thread (``A.T @ X`` of a CSR ``A``, and so
the backward of every ``A @ X``: dX = A^T dY). Converting the whole tensor on every call
costs a sort; but a pattern that is used once is usually used again (a graph's adjacency,
a pruned weight, every training step), while its values change. So the conversion is done
once per pattern, on the entry numbers ``0..nnz-1`` instead of the values: that gives the
new level arrays and the permutation that moves each stored value to its new place. A
later call only gathers the values through it (nnz reads and writes, against the sort):
on a 4096 x 4096 matrix of 167k entries the conversion took 7.6 ms, the gather 0.16 ms.

From 4K entries the gather is a C loop (``gather``), split across threads from 16K:
torch's ``index_select`` took 170-350 us for 168k float32 values, this loop 110 us on two
threads (220 us on one); for the 20K of an MNIST autoencoder's weight, 13-17 us against
10 us on one thread and 8 on two (below 4K, ``index_select`` serves: it calls faster).
Memory traffic: the permutation and the result streamed once, the values read once in
permuted order (they fit in L2 for most weights and graphs).

The kept pattern lives as long as the level arrays it was made from (keyed by the array
tensors themselves, so the views, ``with_values`` results and autograd wrappers that share
them share it too) and is dropped if any of them was modified in place.

Example:
    >>> import torch, sparsetorch as st
    >>> from sparsetorch.formats.format import Format
    >>> A = st.tensor(torch.tensor([[0., 2., 0.], [3., 0., 4.]]), "csr")
    >>> B = relaid(A, Format(A.format.levels, (1, 0)))       # CSC of A
    >>> B.format.name, B.values.tolist()
    ('csc', [3.0, 2.0, 4.0])
    >>> relaid(A.with_values(A.values * 10), B.format).values.tolist()   # pattern kept
    [30.0, 20.0, 40.0]
"""
from __future__ import annotations

import weakref
from functools import lru_cache

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import runtime
from .._modes import outside_inference_mode, version
from ..formats.format import Format
from ..formats.pack import choose_index_dtype, pack, unpack_rows
from ..formats.tensor import SparseTensor, inherit_pattern_facts, layout
from .policy import backend

# first level array -> {(source format, format, index dtype): _Kept}
_KEPT = WeakIdKeyDictionary()


class _Kept:
    """One pattern re-laid: the source arrays it came from (weak references: a strong one
    would keep the key alive) and their versions, the new arrays and the permutation, and
    the last tensor made with them (whose facts about the pattern the next one inherits)."""

    __slots__ = ("sources", "versions", "parts", "arrays", "perm", "last")

    def __init__(self, sources, versions, fmt, arrays, perm):
        self.sources, self.versions = tuple(weakref.ref(a) for a in sources), versions
        self.parts = layout(fmt)
        self.arrays, self.perm, self.last = arrays, perm, None

    def matches(self, arrays, versions) -> bool:
        return self.versions == versions and all(
            r() is a for r, a in zip(self.sources, arrays))

    def tensor(self, t: SparseTensor) -> SparseTensor:
        """``t`` with its values gathered into the new order: on every call, since values
        can change without a trace (through ``.data``, which has its own version counter:
        ``gradcheck`` perturbs inputs that way). Facts the kernels worked out about the
        pattern (``PATTERN_FACTS``: the call key, the row-length profile) carry over from
        the last tensor made."""
        values = gather(t._values, self.perm)
        if values.requires_grad:   # recorded: the wrapper's constructor connects it
            return SparseTensor(t._size, self.parts[0], self.arrays, values)
        out = SparseTensor._from_parts(t._size, self.parts,
                                       [self.arrays[n] for n in self.parts[1]], values)
        if self.last is not None:
            inherit_pattern_facts(self.last, out)
        self.last = out
        return out


def relaid(t: SparseTensor, fmt: Format) -> SparseTensor:
    """``t`` stored in ``fmt``: the same level kinds as ``t.format`` in another mode order,
    with ``t``'s index dtype. Differentiable in ``t.values`` (a gather).

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.formats.format import Format
        >>> A = st.tensor(torch.tensor([[0., 1.], [2., 3.]]), "csr")
        >>> relaid(A, Format(A.format.levels, (1, 0))).to_dense().equal(A.to_dense())
        True
    """
    found = _found(t, fmt)
    return t.asformat(fmt, index_dtype=t.index_dtype) if found is None else found.tensor(t)


def relaid_pattern(t: SparseTensor, fmt: Format):
    """``(arrays, perm)``: ``t``'s pattern in ``fmt`` (index array name -> tensor, as
    ``fmt``'s level arrays are named) and the permutation whose entry ``e`` numbers the
    stored value of ``t`` that goes to place ``e``, both kept as ``relaid`` keeps them; or
    None where ``relaid`` would convert the whole tensor. For a caller that gathers the
    values itself (``gather(t.values, perm)``) without a SparseTensor made around them.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.formats.format import Format
        >>> A = st.tensor(torch.tensor([[0., 2., 0.], [3., 0., 4.]]), "csr")
        >>> arrays, perm = relaid_pattern(A, Format(A.format.levels, (1, 0)))
        >>> arrays["crd1"].tolist(), A.values[perm].tolist()
        ([1, 0, 1], [3.0, 2.0, 4.0])
    """
    found = _found(t, fmt)
    return None if found is None else (found.arrays, found.perm)


def _found(t: SparseTensor, fmt: Format):
    """The ``_Kept`` of ``t`` in ``fmt``, or None: first the wrapper's own note (its arrays
    never change identity, only in place), then the table shared by every wrapper of the
    same arrays."""
    arrays = [getattr(t, "_" + n) for n in t._array_names]
    versions = tuple([version(a) for a in arrays])
    own = t.__dict__.get("_relaid")
    found = own.get(fmt) if own is not None else None
    if found is None or found.versions != versions:
        found = _shared(t, fmt, arrays, versions)
        if found is not None:
            t.__dict__.setdefault("_relaid", {})[fmt] = found
    return found


def _shared(t: SparseTensor, fmt: Format, arrays, versions):
    """The ``_Kept`` for ``t``'s arrays in ``fmt`` from the shared table (made if missing or
    stale), or None where the pattern cannot be kept: not plain tensors in memory, or a
    format with padding."""
    if not _keepable(arrays, t._values):
        return None
    key = (t._format, fmt, t.index_dtype)
    kept = _KEPT.get(arrays[0])
    found = kept.get(key) if kept is not None else None
    if found is None or not found.matches(arrays, versions):
        found = _Kept(arrays, versions, fmt, *_pattern(t, fmt))
        if kept is None:
            kept = _KEPT[arrays[0]] = {}
        kept[key] = found
    return None if found.perm is None else found   # (padding: no plain gather)


def _keepable(arrays, values) -> bool:
    """Plain tensors in memory: not a tracer's fake or functional tensors (whose identity
    means nothing across calls) and not meta tensors (no data to convert)."""
    return bool(arrays) and all(type(a) is torch.Tensor and a.device.type != "meta"
                                for a in arrays) and type(values) is torch.Tensor


@outside_inference_mode
def _pattern(t: SparseTensor, fmt: Format):
    """``(arrays, permutation)`` of ``t``'s pattern in ``fmt``: stored entry ``e`` of the
    result holds ``t``'s entry ``permutation[e]`` (int32 where it fits: half the reads);
    the permutation is None when ``fmt`` stores padding (entries ``t`` does not have)."""
    nnz = t._values.numel()
    numbers = torch.arange(nnz, dtype=torch.int64, device=t._values.device)
    rows = unpack_rows(t._format, t._size, t._level_arrays, t._values.device)
    ordered = all(level.ordered for level in t._format.levels)
    arrays, perm = pack(fmt, t._size, rows, numbers, t.index_dtype,
                        source=t._format if ordered else None)
    if perm.numel() != nnz:
        return arrays, None
    return arrays, perm.to(choose_index_dtype((), nnz))


_C_ENTRIES = 1 << 12
_PARALLEL_ENTRIES = 1 << 14

_SOURCE = r"""
#include <stdint.h>
/* o[e] = v[perm[e]] for e < n, elements moved as bits; the entries split across nt threads */
#define ST_GATHER(NAME, T, I)                                                         \
void NAME(int64_t n, const T* restrict v, const I* restrict perm, T* restrict o,      \
          int64_t nt) {                                                               \
  _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")             \
  for (int64_t e = 0; e < n; e++) o[e] = v[perm[e]];                                  \
}
ST_GATHER(st_gather4_i32, uint32_t, int32_t)
ST_GATHER(st_gather4_i64, uint32_t, int64_t)
ST_GATHER(st_gather8_i32, uint64_t, int32_t)
ST_GATHER(st_gather8_i64, uint64_t, int64_t)
"""


@lru_cache(maxsize=None)
def transposed_format(fmt: Format) -> Format:
    """A 2-D format's levels in the other mode order (CSR -> CSC: the pattern of the
    transpose stored row-major), made once per format (a Format checks itself).

    Example:
        >>> import sparsetorch as st
        >>> import torch
        >>> transposed_format(st.tensor(torch.eye(2), "csr").format).mode_order
        (1, 0)
    """
    return Format(fmt.levels, (1, 0))


def gather(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``values.index_select(0, perm)`` (a permutation of a 1-D tensor's entries), by the C
    loop above where it applies: 4K entries or more, contiguous CPU values of 4- or 8-byte
    elements that do not need a gradient, on the C backend; by torch otherwise (recorded
    where it must be).

    Example:
        >>> import torch
        >>> gather(torch.tensor([10., 20., 30.]), torch.tensor([2, 0, 1])).tolist()
        [30.0, 10.0, 20.0]
    """
    n = perm.numel()
    fn = _kernel(values.element_size(), perm.dtype) if n >= _C_ENTRIES and _c_backend() \
        else None
    if fn is None or not values.is_cpu or not values.is_contiguous() or \
            values.numel() != n or (values.requires_grad and torch.is_grad_enabled()):
        return values.index_select(0, perm)
    out = torch.empty_like(values)
    fn(n, values.data_ptr(), perm.data_ptr(), out.data_ptr(),
       runtime.num_threads() if n >= _PARALLEL_ENTRIES else 1)
    return out


def _c_backend() -> bool:
    return backend() == "c"


@lru_cache(maxsize=None)
def _kernel(element_bytes: int, index_dtype: torch.dtype):
    """The gather for this element size and permutation dtype, or None (torch's then): no
    C compiler, or another element size."""
    if element_bytes not in (4, 8) or index_dtype not in (torch.int32, torch.int64):
        return None
    symbol = f"st_gather{element_bytes}_i{32 if index_dtype == torch.int32 else 64}"
    try:
        return runtime.load_entries(_SOURCE, {symbol: [runtime.I64] + [runtime.PTR] * 3 +
                                              [runtime.I64]})[symbol]
    except runtime.KernelBuildError:
        return None
