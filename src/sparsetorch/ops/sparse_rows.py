"""``x W^T + bias`` for a batch ``x`` of very sparse CSR rows (bag-of-words documents, a
few hundred words of a vocabulary of tens of thousands) and a CSR weight ``W``: work and
memory traffic in proportion to ``x``'s stored entries, not to the batch times ``W``.

``rows.py``'s kernel copies each block of 32 rows into a dense ``(k, 32)`` scratch and
walks all of ``W``'s entries for it: right for MNIST digits (13% of pixels on), but at
0.3% of a 30000-word vocabulary that is 300 times the useful work, and its backward
takes a dot over the whole batch for every stored weight. Here each stored entry
``(r, i)`` of ``x`` adds ``x[r, i] * W[:, i]`` into output row ``r`` (Gustavson's
row-by-row product, against ``W^T``'s CSR pattern, re-laid once per pattern and kept by
``relaid.py``; the values are read through its permutation, so only the columns the batch
uses are touched, or, for a batch that uses most columns, gathered into that order first:
``GATHER_FROM``). The backward's weight gradient goes the other way round: ``x`` is
transposed by a counting sort (one pass, O(nnz + k)), and each stored weight ``W[o, i]`` of
a column ``i`` the batch uses gets ``sum_r x[r, i] * g[r, o]`` over ``x``'s few entries in
that column; the others get 0.

Memory traffic: forward, ``x`` read once, for each of its entries the ``W^T`` row of its
column (indices, and permutation and values through it or the gathered values), the
output written once (a row is
accumulated while it sits in L1: ``m`` values). Backward, ``x`` and its transpose once,
for each column the batch uses its ``W^T`` row and, per stored weight, the output
gradient at that column in the batch's rows that use it; ``dvalues`` zeroed, then written
once at the used columns. Parallel strategy: forward, the rows of ``x``; backward, the
columns of ``x`` (both dynamic, in small chunks: documents and words differ in length).
Scalar loops: each step scatters to or gathers from another output column.

Float32 and float64 CPU operands on the C backend, ``x``'s values without a gradient
(where they need one, ``st.einsum`` runs); ``rows.py`` sends batches below
``SPARSE_ROWS_BELOW`` density here. A gradient of the gradient (``create_graph``) goes
through einsum's differentiable path, recomputed (``recomputed_grads``, ``rows.py``'s
too).

Example:
    >>> import torch, sparsetorch as st
    >>> x = st.tensor(torch.tensor([[0., 2., 0., 0.], [1., 0., 0., 3.]]), format="csr")
    >>> W = st.tensor(torch.tensor([[1., 0., 0., 1.], [0., 5., 0., 0.]]), format="csr")
    >>> y = sparse_rows_linear(x, W, W.values, torch.tensor([0.5, 0.0]))
    >>> y is None or y.tolist() == [[0.5, 10.0], [4.5, 0.0]]   # (None: no C compiler)
    True
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import runtime
from .._modes import materialized
from ..formats import SparseTensor
from .einsum import einsum
from .epilogue import unfused
from .policy import backend
from .relaid import gather, relaid_pattern, transposed_format

# Below this share of stored entries a CSR batch runs here, above it ``rows.py``'s block
# kernel (whose work does not depend on the density). Against it, 2 threads, 256 random
# rows by a 10%-dense weight of 256 outputs, a training step (forward): 784 inputs 1.55x
# (1.44x) at 1%, 1.17x (0.93x) at 3%, 0.93x (0.85x) at 5%; 4096 inputs 2.50x (2.58x),
# 1.37x (1.29x), 0.96x (0.90x); 30000 inputs 3.14x (2.91x), 1.51x (1.30x), 1.09x (0.96x).
SPARSE_ROWS_BELOW = 0.03
_PARALLEL_WORK = 1 << 15   # multiply-adds below which one thread is as fast
# The forward gathers W's values into W^T's order (all of them, one pass) where ``x``
# holds at least GATHER_FROM entries per column of W, and reads them through the
# permutation (only those the batch uses, out of order) below. 256 rows by a 10%-dense
# weight of 256 outputs, 2 threads, gathered against read through: uniform columns, 4096
# inputs 1.13x as long at 0.5 entries a column, 0.91x at 2; 30000 inputs 1.21x at 0.5,
# 0.86x at 1; Zipf-distributed words, 30000 inputs 2.37x at 0.17, 1.48x at 0.85, 4096 inputs
# 1.17x at 1.25, 0.84x at 6.25.
GATHER_FROM = 1.0
_INDEX = {torch.int32: "int32_t", torch.int64: "int64_t"}
_VALUE = {torch.float32: "float", torch.float64: "double"}

_SOURCE = r"""/* very sparse rows times a CSR weight (ops/sparse_rows.py) */
#include <stdint.h>
#include <string.h>
#include <omp.h>
/* y (n x m) = x W^T + bias: x's n CSR rows (xpos, xcrd, xval); W^T's CSR pattern (tpos:
   k + 1 row starts, tcrd: output columns), entry e of which holds val[perm[e]] (W's
   values), or val[e] where perm is null (the values gathered into W^T's order). */
#define ST_FORWARD(I, P, J, T)                                                           \
void st_sparse_rows_##I##_##P##_##J##_##T(int64_t n, int64_t m, const J* xpos,           \
    const J* xcrd, const T* xval, const I* tpos, const I* tcrd, const P* perm,           \
    const T* val, const T* bias, T* y, int64_t nt) {                                     \
  _Pragma("omp parallel for num_threads(nt) if(nt > 1) schedule(dynamic, 8)")            \
  for (int64_t r = 0; r < n; r++) {                                                      \
    T* row = y + r * m;                                                                  \
    if (bias) memcpy(row, bias, (size_t)m * sizeof(T));                                  \
    else memset(row, 0, (size_t)m * sizeof(T));                                          \
    for (J q = xpos[r]; q < xpos[r + 1]; q++) {                                          \
      const T v = xval[q];                                                               \
      const I i = (I)xcrd[q];                                                            \
      if (perm)                                                                          \
        for (I e = tpos[i]; e < tpos[i + 1]; e++) row[tcrd[e]] += v * val[perm[e]];      \
      else                                                                               \
        for (I e = tpos[i]; e < tpos[i + 1]; e++) row[tcrd[e]] += v * val[e];            \
    }                                                                                    \
  }                                                                                      \
}
/* dvalues[perm[e]] = sum over x's entries (r, i) in column i of x[r, i] * g[r][tcrd[e]],
   for W^T's entries e of row i (dvalues zeroed by the caller: the columns x does not use
   stay 0). x^T is built first in tp (k + 1), tr, tv (x's nnz each) by a counting sort. */
#define ST_GRAD(I, P, J, T)                                                              \
void st_sparse_rows_grad_##I##_##P##_##J##_##T(int64_t n, int64_t k, int64_t m,          \
    const J* xpos, const J* xcrd, const T* xval, const I* tpos, const I* tcrd,          \
    const P* perm, const T* g, T* dvalues, int64_t* tp, int64_t* tr, T* tv,             \
    int64_t nt) {                                                                        \
  memset(tp, 0, (size_t)(k + 1) * sizeof(int64_t));                                      \
  for (J q = xpos[0]; q < xpos[n]; q++) tp[(int64_t)xcrd[q] + 1]++;                      \
  for (int64_t i = 0; i < k; i++) tp[i + 1] += tp[i];                                    \
  for (int64_t r = 0; r < n; r++)       /* (tp[i] runs on to column i + 1's start) */   \
    for (J q = xpos[r]; q < xpos[r + 1]; q++) {                                          \
      const int64_t d = tp[xcrd[q]]++;                                                   \
      tr[d] = r;                                                                         \
      tv[d] = xval[q];                                                                   \
    }                                                                                    \
  for (int64_t i = k; i > 0; i--) tp[i] = tp[i - 1];                                     \
  tp[0] = 0;                                                                             \
  _Pragma("omp parallel for num_threads(nt) if(nt > 1) schedule(dynamic, 16)")           \
  for (int64_t i = 0; i < k; i++) {                                                      \
    const int64_t d0 = tp[i], d1 = tp[i + 1];                                            \
    if (d0 == d1) continue;                                                              \
    for (I e = tpos[i]; e < tpos[i + 1]; e++) {                                          \
      const int64_t o = tcrd[e];                                                         \
      T acc = 0;                                                                         \
      for (int64_t d = d0; d < d1; d++) acc += tv[d] * g[tr[d] * m + o];                 \
      dvalues[perm[e]] = acc;                                                            \
    }                                                                                    \
  }                                                                                      \
}
#define ST_BOTH(I, P, J, T) ST_FORWARD(I, P, J, T) ST_GRAD(I, P, J, T)
#define ST_ALL(I, J, T) ST_BOTH(I, int32_t, J, T) ST_BOTH(I, int64_t, J, T)
ST_ALL(int32_t, int32_t, float)
ST_ALL(int32_t, int64_t, float)
ST_ALL(int64_t, int32_t, float)
ST_ALL(int64_t, int64_t, float)
ST_ALL(int32_t, int32_t, double)
ST_ALL(int32_t, int64_t, double)
ST_ALL(int64_t, int32_t, double)
ST_ALL(int64_t, int64_t, double)
"""


def sparse_rows_linear(x: SparseTensor, weight: SparseTensor, values: torch.Tensor,
                       bias: torch.Tensor | None):
    """``x @ W^T + bias``, dense ``(n, m)``, for ``x`` a 2-D CSR SparseTensor ``(n, k)``
    and ``weight`` ``W`` an ``(m, k)`` CSR SparseTensor whose values are ``values`` (a
    Parameter, say; ``weight`` may hold a detached alias of them), differentiable in
    ``values`` and ``bias``; None where these kernels do not apply (see the module
    docstring: the caller runs its own path, which also reports any bad operand).

    Example:
        >>> import torch, sparsetorch as st
        >>> x = st.tensor(torch.eye(3)[:2], format="csr")
        >>> W = st.tensor(2 * torch.eye(3), format="csr")
        >>> y = sparse_rows_linear(x, W, W.values, None)
        >>> y is None or y.tolist() == [[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]
        True
    """
    plan = _plan(x, weight, values, bias)
    if plan is None:
        return None
    if torch.is_grad_enabled() and (values.requires_grad or
                                    bias is not None and bias.requires_grad):
        return _Recorded.apply(plan, x, weight, values, bias)
    return _forward(plan, x, weight, values, bias)


def _plan(x, weight, values, bias):
    """``(fns, tpos, tcrd, perm)`` for these operands, or None where the kernels do not
    apply: CSR operands of matching sizes and one value dtype, contiguous CPU arrays,
    ``x``'s values without a gradient, ``W^T``'s pattern kept (``relaid.py``)."""
    if (type(x) is not SparseTensor or type(weight) is not SparseTensor
            or x._format.name != "csr" or weight._format.name != "csr"
            or len(x._size) != 2 or x._size[1] != weight._size[1] or backend() != "c"
            or torch.compiler.is_compiling()):
        return None
    dtype = values.dtype
    xv = x._values
    if (dtype not in _VALUE or xv.requires_grad or not all(
            t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in (xv, values))
            or xv.numel() != x._crd1.numel() or values.numel() != weight._crd1.numel()):
        return None
    if bias is not None and (type(bias) not in (torch.Tensor, torch.nn.Parameter)
                             or bias.dtype != dtype or bias.shape != (weight._size[0],)
                             or not bias.is_cpu):
        return None
    if x._crd1.dtype not in _INDEX:
        return None
    found = relaid_pattern(weight, transposed_format(weight._format)) \
        if weight._crd1.numel() else None
    if found is None:
        return None
    arrays, perm = found
    index = arrays["crd1"].dtype
    if arrays["pos1"].dtype != index or index not in _INDEX or perm.dtype not in _INDEX:
        return None
    fns = _library()
    if fns is None:
        return None
    names = f"{_INDEX[index]}_{_INDEX[perm.dtype]}_{_INDEX[x._crd1.dtype]}_{_VALUE[dtype]}"
    return ((fns[f"st_sparse_rows_{names}"], fns[f"st_sparse_rows_grad_{names}"]),
            arrays["pos1"], arrays["crd1"], perm)


def _threads(x: SparseTensor, weight: SparseTensor) -> int:
    """Threads for a call: one below ``_PARALLEL_WORK`` estimated multiply-adds (``x``'s
    entries times ``W``'s mean column length)."""
    k = weight._size[1]
    work = x._crd1.numel() * weight._crd1.numel() // max(k, 1)
    return runtime.num_threads() if work >= _PARALLEL_WORK else 1


def _forward(plan, x, weight, values, bias) -> torch.Tensor:
    (forward, _), tpos, tcrd, perm = plan
    n, m = x._size[0], weight._size[0]
    out = torch.empty((n, m), dtype=values.dtype)
    # W's values gathered into W^T's order where the batch reads many of them, else read
    # through the permutation (see GATHER_FROM)
    gathered = x._crd1.numel() * GATHER_FROM >= weight._size[1]
    read = gather(values.detach(), perm) if gathered else values
    bias = None if bias is None else bias.detach().contiguous()
    forward(n, m, x._pos1.data_ptr(), x._crd1.data_ptr(), x._values.data_ptr(),
            tpos.data_ptr(), tcrd.data_ptr(), 0 if gathered else perm.data_ptr(),
            read.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            _threads(x, weight))
    return out


class _Recorded(torch.autograd.Function):
    """The forward kernel; backward: ``dvalues`` by the gradient kernel (``x`` transposed
    in it), ``dbias`` as the output gradient's column sums."""

    @staticmethod
    def forward(ctx, plan, x, weight, values, bias):
        ctx.plan, ctx.x, ctx.weight = plan, x, weight
        ctx.save_for_backward(values, bias, *batch_arrays(x))
        return _forward(plan, x, weight, values, bias)

    @staticmethod
    def backward(ctx, dy):
        values, bias, *_ = ctx.saved_tensors
        dy = materialized(dy)
        x, weight = ctx.x, ctx.weight
        need_values, need_bias = ctx.needs_input_grad[3:5]
        if torch.is_grad_enabled():   # create_graph: a differentiable backward
            _, dvalues, dbias = recomputed_grads(x, weight, values, bias, None, dy)
            return None, None, None, dvalues, dbias
        return (None, None, None, *entry_gradients(ctx.plan, x, weight, values, dy,
                                                   need_values, need_bias))


def batch_arrays(x) -> tuple:
    """A CSR batch's values and index arrays (three Nones for None), for
    ``save_for_backward``: autograd then refuses a backward after one of them was written
    in place (a batch buffer reused), where the weight gradient came out from the new
    contents, silently (a probe's finding)."""
    return (None, None, None) if x is None else (x._values, x._pos1, x._crd1)


def entry_gradients(plan, x: SparseTensor, weight: SparseTensor, values, dy, need_values: bool,
                    need_bias: bool) -> tuple:
    """``(dvalues, dbias)`` of ``x W^T + bias`` at the output gradient ``dy`` by the
    gradient kernel (``_plan``'s; ``x`` transposed in it) and ``dy``'s column sums; None
    for the one not asked for. (``_Recorded``'s backward, and the traced op's,
    ``rows_op.py``.)"""
    dvalues = None
    if need_values:
        (_, grad), tpos, tcrd, perm = plan
        (n, k), m = x._size, weight._size[0]
        nnz = x._crd1.numel()
        dy = dy.contiguous()
        dvalues = torch.zeros_like(values)
        # the transposed x's column starts, rows and values (int64: one scratch array)
        arrays = torch.empty(k + 1 + nnz, dtype=torch.int64)
        tv = torch.empty(nnz, dtype=values.dtype)
        grad(n, k, m, x._pos1.data_ptr(), x._crd1.data_ptr(), x._values.data_ptr(),
             tpos.data_ptr(), tcrd.data_ptr(), perm.data_ptr(), dy.data_ptr(),
             dvalues.data_ptr(), arrays.data_ptr(), arrays[k + 1:].data_ptr(),
             tv.data_ptr(), _threads(x, weight))
    return dvalues, dy.sum(0) if need_bias else None


def recomputed_grads(x, weight: SparseTensor, values, bias, activation, dy) -> tuple:
    """``(dx, dvalues, dbias)``: the gradients of ``activation(x W^T + bias)`` (``W``:
    ``weight``'s pattern holding ``values``) at the output gradient ``dy``, themselves
    recorded (a backward under ``create_graph``), through einsum's differentiable path,
    recomputed; None for each of a dense ``x``, ``values``, ``bias`` that wants no
    gradient (and for a SparseTensor ``x``).

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(2), format="csr")
        >>> values = W.values.clone().requires_grad_()
        >>> _, dv, _ = recomputed_grads(torch.ones(3, 2), W, values, None, None,
        ...                             torch.ones(3, 2))
        >>> dv.tolist()
        [3.0, 3.0]
    """
    tensors = (None if type(x) is SparseTensor else x, values, bias)
    inputs = [t for t in tensors if t is not None and t.requires_grad]
    with torch.enable_grad():
        y = unfused(einsum("ni,oi->no", x, weight.with_values(values), out_format="dense"),
                    bias, activation)
        grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=True))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in tensors)


@lru_cache(maxsize=None)
def _library():
    """Every entry of ``_SOURCE`` by name; None without a C compiler."""
    I, P = runtime.I64, runtime.PTR
    entries = {}
    for w in _INDEX.values():
        for xw in _INDEX.values():
            for pw in _INDEX.values():
                for t in _VALUE.values():
                    names = f"{w}_{pw}_{xw}_{t}"
                    entries[f"st_sparse_rows_{names}"] = [I, I] + [P] * 9 + [I]
                    entries[f"st_sparse_rows_grad_{names}"] = [I, I, I] + [P] * 11 + [I]
    try:
        return runtime.load_entries(_SOURCE, entries)
    except runtime.KernelBuildError:
        return None
