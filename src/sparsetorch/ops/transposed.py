"""``Aᵀ X`` for a CSR ``A`` and a dense ``X``: each thread scatters into the output rows it
owns, with no re-laid copy of ``A``.

``out[j, k] = c * sum_i A[i, j] X[i, k]`` is the backward of every ``A @ X`` (``dX = Aᵀ dY``)
and attention's ``dV = Pᵀ dO`` and ``dK = dSᵀ Q``. Run as written, row ``i`` of ``A`` adds
into scattered rows ``j`` of the result, which threads splitting ``i`` would race on; the
compiler's schedule therefore re-lays ``A`` column-major (``relaid.py``: its pattern once,
its values gathered through a permutation on every call) and runs a plain SpMM. Here the
threads split the *output* rows instead: thread ``t`` owns rows ``[split[t], split[t+1])``
(equal shares of the stored entries), walks every row ``i`` of ``A`` and, the columns of a
row being sorted, takes exactly its own entries from a per-pattern table of where each
thread's range starts in each row. No two threads write one row, nothing is gathered.

Memory traffic: ``A``'s column indices and values read once in all (each thread its own
share), ``X``'s row ``i`` read by each thread with entries in that row (a banded pattern:
about once; a scattered graph: up to once per thread), each output row zeroed and then
updated in place once per stored entry of its column (read-modify-write, in L1/L2 while
the columns a thread touches stay close together). Parallel strategy: output rows in
contiguous ranges balanced by stored entries, one range per thread; below
``_PARALLEL_WORK`` multiply-adds one thread. Measured on Sapphire Rapids, 2 threads,
against the re-laid gather and SpMM (each call with new values, as in training): a
Longformer attention pattern of 4.2M entries (16384 rows, 32 columns of ``X``) 3.7 ms
against 5.9; random graphs of 2708 nodes x 16 (Cora's size) 49 against 72 us, 7650 x 64
(Amazon-Photo's, 237k entries) 0.78 against 0.93 ms, 18333 x 64 0.89 against 1.0 ms.

``execute.run`` sends such products here (``transposed_product``): CSR with sorted
columns in float32 or float64 on the CPU, a dense ``X``, a dense result, the C backend,
nothing traced. The common widths of ``X`` (8 to 128 columns) are compiled as
constants, the row updates unrolled into whole vectors of the CPU's register width; one
kernel serves the others. (With AVX2, vectors of AVX-512's width went through the stack:
a Longformer pattern of 1M entries x 32 float32 columns took 13.4 ms, now 1.6 ms; Amazon
Photo's adjacency x 64 3.8 -> 1.5 ms; AMD Zen 3, 2 threads.)

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.tensor([[0., 2., 0.], [3., 0., 4.]]), format="csr")
    >>> X = torch.tensor([[1., 10.], [2., 20.]])
    >>> spmm_transposed(A, X, 0.5)
    tensor([[ 3., 30.],
            [ 1., 10.],
            [ 4., 40.]])
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import runtime
from .._modes import version
from ..compiler.notation import Access, Assignment, Mul, Scale
from ..formats.tensor import SparseTensor
from .custom_ops import is_tracing
from .policy import asks_dense, backend

# Below this many multiply-adds one thread: waking the team and the table's row walk per
# thread cost more (Cora's 13.5k entries x 16 columns ran 1.4x faster on two).
_PARALLEL_WORK = 1 << 15

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <omp.h>
#define K $width   /* a constant for the common widths, else the argument k */
typedef $value T;
typedef $index I;
/* One vector of the CPU's register width: AVX-512's 64 bytes where it has them, else 32.
   (A 64-byte vector on AVX2 compiled to a scalar times a vector through 16 stores and
   vector reloads of the stack, stalled on store forwarding: 12x slower in attention's
   backward on AMD Zen 3.) */
#ifdef __AVX512F__
#define VB 64
#else
#define VB 32
#endif
typedef T vec __attribute__((vector_size(VB)));
#define VL ((int64_t)(VB / sizeof(T)))
#define NV (K / VL)
#define REM (K % VL)
static inline vec load(const T* p) { vec v; memcpy(&v, p, VB); return v; }
static inline void store(T* p, vec v) { memcpy(p, &v, VB); }

/* out[j, :] = c * sum_i A[i, j] x[i, :]; thread t owns out rows [split[t], split[t+1]) and
   in row i the entries [lo_t[i], lo_{t+1}[i]): lo_0 = pos, lo_nt = pos + 1, the others
   rows of ``first`` ((nt - 1) x n). */
void st_spmm_transposed(int64_t n, int64_t k, int64_t nt, const I* restrict pos,
                        const I* restrict crd, const T* restrict val, const T* restrict x,
                        T* restrict out, const int64_t* restrict split,
                        const I* restrict first, const double* restrict scale) {
  const T c = (T)scale[0];
  #pragma omp parallel num_threads(nt) if(nt > 1)
  {
    const int64_t t = omp_get_thread_num();
    memset(out + split[t] * K, 0, (size_t)(split[t + 1] - split[t]) * K * sizeof(T));
    const I* lo = t == 0 ? pos : first + (t - 1) * n;
    const I* hi = t == nt - 1 ? pos + 1 : first + t * n;
    for (int64_t i = 0; i < n; i++) {
      int64_t e = lo[i];
      const int64_t end = hi[i];
      if (e == end) continue;
      vec xv[NV > 0 ? NV : 1];
      T xr[REM > 0 ? REM : 1];
      for (int64_t q = 0; q < NV; q++) xv[q] = c * load(x + i * K + q * VL);
      for (int64_t r = 0; r < REM; r++) xr[r] = c * x[i * K + NV * VL + r];
      for (; e < end; e++) {
        const T v = val[e];
        T* restrict o = out + (int64_t)crd[e] * K;
        for (int64_t q = 0; q < NV; q++) store(o + q * VL, load(o + q * VL) + v * xv[q]);
        for (int64_t r = 0; r < REM; r++) o[NV * VL + r] += v * xr[r];
      }
    }
  }
}
"""


def spmm_transposed(A: SparseTensor, X: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * Aᵀ X`` for a CSR ``A`` (n x m, columns sorted in each row) and a dense
    ``X`` (n x k) of A's dtype (float32 or float64) on the CPU: an (m x k) tensor. No
    gradient is recorded (``execute.run`` calls it inside autograd's own node).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.], [3., 0.]]), format="csr")
        >>> spmm_transposed(A, torch.ones(3, 1)).flatten().tolist()
        [4.0, 2.0]
    """
    (n, m), k = A.shape, X.shape[1]
    if X.shape[0] != n:
        raise ValueError(f"A^T X: A has {n} rows but X {X.shape[0]}; they must agree")
    if m == 0 or k == 0 or n == 0:
        return torch.zeros(m, k, dtype=X.dtype)
    X = X.contiguous()
    nt = runtime.num_threads() if A.nnz * k >= _PARALLEL_WORK else 1
    split, first = _table(A, nt)
    out = torch.empty(m, k, dtype=X.dtype)
    c = torch.tensor([scale], dtype=torch.float64)
    kernel = _kernel(k if k in _CONSTANT_WIDTHS else None, X.dtype, A.index_dtype)
    kernel(n, k, nt, A._pos1.data_ptr(), A._crd1.data_ptr(), A._checked_values().data_ptr(),
           X.data_ptr(), out.data_ptr(), split.data_ptr(), first.data_ptr(), c.data_ptr())
    return out


def transposed_product(assignment: Assignment, operands, out_format):
    """A function of the operands computing ``assignment`` by ``spmm_transposed`` when it
    is ``[c *] sum_i A[i, j] X[i, k]`` into a dense ``out[j, k]`` and the operands qualify
    (module docstring); else None. It serves every later call with the same call signature
    (``execute._signature``: the same structure; shapes may differ)."""
    found = _sparse_dense_scale(assignment, operands, out_format)
    if found is None:
        return None
    sparse, dense, scale = found
    return lambda ops: spmm_transposed(ops[sparse], ops[dense], scale)


def prefetch_transposed(assignment: Assignment, operands, out_format) -> bool:
    """Start building the kernel ``transposed_product`` would run for these operands, in
    the background (``execute.prefetch``: a backward's ``A^T G``); False where it would not
    run."""
    found = _sparse_dense_scale(assignment, operands, out_format)
    if found is None:
        return False
    A, X = operands[found[0]], operands[found[1]]
    k = X.shape[1]
    runtime.prefetch(_source(k if k in _CONSTANT_WIDTHS else None, X.dtype, A.index_dtype),
                     _SIGNATURE)
    return True


def _sparse_dense_scale(assignment: Assignment, operands, out_format):
    """``(A's operand index, X's, c)`` where ``transposed_product`` applies, else None."""
    if not (out_format is None or asks_dense(out_format)) or len(operands) != 2 or \
            backend() != "c" or is_tracing(operands):
        return None
    expr, scale = assignment.expr, 1.0
    if isinstance(expr, Scale):
        expr, scale = expr.a, expr.factor
    if not (isinstance(expr, Mul) and isinstance(expr.a, Access) and
            isinstance(expr.b, Access)):
        return None
    a, x = (expr.a, expr.b) if type(operands[expr.a.operand]) is SparseTensor else \
        (expr.b, expr.a)
    A, X = operands[a.operand], operands[x.operand]
    if not (type(A) is SparseTensor and type(X) is torch.Tensor and X.dim() == 2 and
            len(a.indices) == 2 and len(x.indices) == 2 and a.indices[0] == x.indices[0]
            and assignment.out_vars == (a.indices[1], x.indices[1])
            and len(set(assignment.out_vars + a.indices[:1])) == 3 and _csr_sorted(A)
            and A.dtype in (torch.float32, torch.float64) and X.dtype == A.dtype
            and A.device.type == "cpu" and X.device.type == "cpu"):
        return None
    return a.operand, x.operand, scale


def _csr_sorted(A: SparseTensor) -> bool:
    fmt = A._format
    return (fmt.name == "csr" and fmt.mode_order == (0, 1) and fmt.blocksize is None and
            A.dim() == 2 and all(level.ordered for level in fmt.levels))


# first level array (pos) -> {threads: (versions of pos and crd, crd, split, first)}
_TABLES = WeakIdKeyDictionary()


def _table(A: SparseTensor, nt: int):
    """``(split, first)`` for ``A``'s pattern and ``nt`` threads, kept with its arrays
    (rebuilt if they changed in place): ``split`` (int64, nt + 1) the output rows each
    thread owns, equal shares of the stored entries; ``first`` ((nt - 1) x n, A's index
    dtype) where thread t's columns start in each row, for t = 1 .. nt - 1."""
    pos, crd = A._pos1, A._crd1
    versions = (version(pos), version(crd))
    kept = _TABLES.get(pos)
    found = kept.get(nt) if kept is not None else None
    if found is not None:
        made_for, source, split, first = found
        if made_for == versions and source is crd:
            return split, first
    (n, m), nnz = A.shape, A.nnz
    cols = crd.long()
    bounds = torch.zeros(0, dtype=torch.int64)   # (one thread: it owns every row)
    if nt > 1:
        counts = torch.bincount(cols, minlength=m).cumsum(0)
        bounds = torch.searchsorted(counts, torch.arange(1, nt) * nnz // nt, right=True)
    split = torch.cat([torch.zeros(1, dtype=torch.int64), bounds,
                       torch.tensor([m], dtype=torch.int64)])
    starts, ends = pos[:-1].long(), pos[1:].long()
    firsts = []
    for s in bounds.tolist():   # entries of each row below column s, by a running count
        below = torch.cat([torch.zeros(1, dtype=torch.int64), (cols < s).long().cumsum(0)])
        firsts.append(starts + below[ends] - below[starts])
    first = (torch.stack(firsts) if firsts else torch.zeros(1, n, dtype=torch.int64))
    first = first.to(pos.dtype).contiguous()
    if kept is None:
        kept = _TABLES[pos] = {}
    kept[nt] = (versions, crd, split, first)
    return split, first


# Widths compiled as constants (the row updates unrolled, X's row held in registers);
# others share one kernel with the width an argument: a kernel per width would compile
# anew for every width a model or a test uses.
_CONSTANT_WIDTHS = frozenset((8, 16, 32, 64, 128))


_SIGNATURE = {"st_spmm_transposed": [runtime.I64] * 3 + [runtime.PTR] * 8}


@lru_cache(maxsize=None)
def _kernel(width: int | None, dtype: torch.dtype, index_dtype: torch.dtype):
    return runtime.load_entries(_source(width, dtype, index_dtype),
                                _SIGNATURE)["st_spmm_transposed"]


def _source(width: int | None, dtype: torch.dtype, index_dtype: torch.dtype) -> str:
    return (_SOURCE.replace("$width", "k" if width is None else str(width))
            .replace("$value", "float" if dtype == torch.float32 else "double")
            .replace("$index", "int32_t" if index_dtype == torch.int32 else "int64_t"))
