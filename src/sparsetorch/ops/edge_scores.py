"""``additive_scores``: ``leaky_relu(a[dst] + a[src])``, one score per stored entry, and its
gradient: GAT's attention logits (``nn.GATConv``), each entry's target and source terms
gathered from the per-node terms ``a`` and added.

As torch ops this is two gathers, an add and a LeakyReLU forward (three temporaries of
the entry count), and a LeakyReLU gradient and two ``index_add_`` scatters backward: on
Cora's first GAT layer (106K entries, 8 heads) 0.85 ms of an 8.5 ms training step. Here
it is one pass each way.

Memory traffic: forward, per entry its two indices, two gathers from ``a`` (which fits in
L2 for any graph a step can hold: 4 bytes per node and term), one score written.
Backward, per entry its two indices, the two gathers again (the sign of the sum decides
LeakyReLU's slope; recomputing it costs less than saving it), its gradient read and two
scattered adds. Parallel strategy: forward, static ranges of entries; backward, static
ranges of entries, each thread adding into its own zeroed copy of ``da`` (two entries'
scatters may hit one term from different threads), then the copies summed by ranges of
terms. Calls under ``_PARALLEL_ENTRIES`` entries run on one thread.

Float32 and float64 CPU tensors with int64 indices on the C backend; elsewhere (other
devices or dtypes, ``SPARSETORCH_BACKEND=torch``, no C compiler, traced graphs) and for a
gradient of the gradient (``create_graph``), the same torch ops.

Example:
    >>> import torch
    >>> a = torch.tensor([1.0, -3.0, 0.5])
    >>> additive_scores(a, torch.tensor([0, 0, 2]), torch.tensor([1, 2, 2]), 0.2).tolist()
    [-0.4000000059604645, 1.5, 1.0]
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .. import runtime
from .._modes import materialized
from .policy import backend

_PARALLEL_ENTRIES = 1 << 15   # below, one thread is as fast
_VALUE = {torch.float32: "float", torch.float64: "double"}
_is_compiling = torch.compiler.is_compiling


def additive_scores(a: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                    negative_slope: float) -> torch.Tensor:
    """``F.leaky_relu(a[dst] + a[src], negative_slope)`` for a 1-D ``a`` and 1-D int64
    ``dst``, ``src`` of one length, in one pass (see the module docstring); differentiable
    in ``a``. The indices are trusted to lie in ``[0, a.numel())``: the caller built them.

    Example:
        >>> import torch
        >>> a = torch.tensor([2.0, 1.0], requires_grad=True)
        >>> additive_scores(a, torch.tensor([0, 1]), torch.tensor([1, 1]), 0.2).sum().backward()
        >>> a.grad.tolist()
        [1.0, 3.0]
    """
    if _runs_here(a, dst, src):
        return _AdditiveScores.apply(a, dst, src, float(negative_slope))
    return _scores_by_torch(a, dst, src, negative_slope)


def _runs_here(a, dst, src) -> bool:
    return (type(a) is torch.Tensor and a.dtype in _VALUE and a.device.type == "cpu"
            and a.dim() == 1 and dst.dtype == src.dtype == torch.int64
            and not _is_compiling() and backend() == "c" and _library() is not None)


def _scores_by_torch(a, dst, src, negative_slope):
    return F.leaky_relu(a.index_select(0, dst) + a.index_select(0, src), negative_slope)


class _AdditiveScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, dst, src, negative_slope):
        # (``a`` itself is saved: a gradient of the gradient differentiates through it)
        terms, dst, src = a.contiguous(), dst.contiguous(), src.contiguous()
        out = torch.empty(dst.numel(), dtype=a.dtype)
        slope = torch.tensor([negative_slope], dtype=a.dtype)   # (entries take pointers)
        _library()[f"st_scores_{_VALUE[a.dtype]}"](
            dst.numel(), terms.data_ptr(), dst.data_ptr(), src.data_ptr(), slope.data_ptr(),
            out.data_ptr(), _threads(dst.numel()))
        ctx.save_for_backward(a, dst, src)
        ctx.negative_slope = negative_slope
        return out

    @staticmethod
    def backward(ctx, grad):
        a, dst, src = ctx.saved_tensors
        if torch.is_grad_enabled():   # (create_graph: a gradient differentiable in a)
            out = _scores_by_torch(a, dst, src, ctx.negative_slope)
            return torch.autograd.grad(out, a, grad, create_graph=True)[0], None, None, None
        a, grad = a.contiguous(), materialized(grad).contiguous()
        nt = _threads(dst.numel())
        da = torch.empty(a.numel(), dtype=a.dtype)
        scratch = torch.empty((nt - 1) * a.numel(), dtype=a.dtype)
        slope = torch.tensor([ctx.negative_slope], dtype=a.dtype)
        _library()[f"st_scores_grad_{_VALUE[a.dtype]}"](
            dst.numel(), a.numel(), a.data_ptr(), dst.data_ptr(), src.data_ptr(),
            slope.data_ptr(), grad.data_ptr(), da.data_ptr(), scratch.data_ptr(), nt)
        return da, None, None, None


def _threads(entries: int) -> int:
    return runtime.num_threads() if entries >= _PARALLEL_ENTRIES else 1


_SOURCE = r"""/* GAT's additive scores (ops/edge_scores.py) */
#include <stdint.h>
#include <string.h>
#include <omp.h>
/* No branch on a score's sign: it is random, and a mispredicted branch that waits on the
   gathers stalls the loop on each (Cora's first GAT layer: 580 us with the branch, 80
   without, one thread). The slope at x, 1 above 0 and s otherwise (NaN included: torch's
   leaky_relu and its gradient take x * s there), is picked by a mask of bits: a float
   select compiled to a branch. */
#define ST_PICK(T, U)                                                                    \
static inline T st_slope_##T(T x, T s) {                                                 \
  const T one = 1;                                                                       \
  U a, b, m = (U)0 - (U)(x > 0);                                                         \
  memcpy(&a, &one, sizeof a);                                                            \
  memcpy(&b, &s, sizeof b);                                                              \
  a = (a & m) | (b & ~m);                                                                \
  T r;                                                                                   \
  memcpy(&r, &a, sizeof r);                                                              \
  return r;                                                                              \
}
/* out[e] = leaky(a[dst[e]] + a[src[e]]) */
#define ST_SCORES(T)                                                                     \
void st_scores_##T(int64_t n, const T* a, const int64_t* dst, const int64_t* src,        \
                   const T* slope, T* out, int64_t nt) {                                 \
  const T s = *slope;                                                                    \
  _Pragma("omp parallel for num_threads(nt) if(nt > 1) schedule(static)")                \
  for (int64_t e = 0; e < n; e++) {                                                      \
    const T x = a[dst[e]] + a[src[e]];                                                   \
    out[e] = x * st_slope_##T(x, s);                                                     \
  }                                                                                      \
}
/* da[i] = sum over entries e with dst[e] == i or src[e] == i of g[e] times the slope at
   a[dst[e]] + a[src[e]]. Thread t adds into da (t = 0) or scratch + (t - 1) * m, all
   zeroed first; then the copies are summed into da by ranges of terms. */
#define ST_SCORES_GRAD(T)                                                                \
void st_scores_grad_##T(int64_t n, int64_t m, const T* a, const int64_t* dst,            \
                        const int64_t* src, const T* slope, const T* g, T* da,           \
                        T* scratch, int64_t nt) {                                        \
  const T s = *slope;                                                                    \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                     \
  {                                                                                      \
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();             \
    T* part = t == 0 ? da : scratch + (t - 1) * m;                                       \
    memset(part, 0, (size_t)m * sizeof(T));                                              \
    _Pragma("omp barrier")                                                               \
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;                      \
    for (int64_t e = lo; e < hi; e++) {                                                  \
      const int64_t i = dst[e], j = src[e];                                              \
      const T d = g[e] * st_slope_##T(a[i] + a[j], s);                             \
      part[i] += d;                                                                      \
      part[j] += d;                                                                      \
    }                                                                                    \
    _Pragma("omp barrier")                                                               \
    if (threads > 1) {                                                                   \
      const int64_t from = m * t / threads, to = m * (t + 1) / threads;                  \
      for (int64_t u = 1; u < threads; u++) {                                            \
        const T* other = scratch + (u - 1) * m;                                          \
        for (int64_t i = from; i < to; i++) da[i] += other[i];                           \
      }                                                                                  \
    }                                                                                    \
  }                                                                                      \
}
ST_PICK(float, uint32_t)
ST_PICK(double, uint64_t)
ST_SCORES(float)
ST_SCORES(double)
ST_SCORES_GRAD(float)
ST_SCORES_GRAD(double)
"""


@lru_cache(maxsize=None)
def _library():
    """Every entry of ``_SOURCE`` by name; None without a C compiler."""
    I, P = runtime.I64, runtime.PTR
    entries = {}
    for t in _VALUE.values():
        entries[f"st_scores_{t}"] = [I, P, P, P, P, P, I]
        entries[f"st_scores_grad_{t}"] = [I, I, P, P, P, P, P, P, P, I]
    try:
        return runtime.load_entries(_SOURCE, entries)
    except runtime.KernelBuildError:
        return None
