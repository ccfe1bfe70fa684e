"""Transposing copies: ``t.permute(perm).contiguous()`` by AVX2 block transposes.

``relayout.py`` runs an equation with its vectorised index moved last, which costs a
transposing copy of a dense operand and one of the result (``F.linear``'s ``x`` and output).
torch's copy of a transposed view moves one element at a time: 0.3-0.4 ns per element here,
5-10x its plain copy of the same bytes, and at 256 x 1024 float32 the two copies took as
long as the sparse kernel between them. Here each 8 x 8 block (4-byte elements; 4 x 4 for
8-byte ones) is loaded as 8 rows, transposed in registers by unpacks and lane shuffles,
and stored as 8 rows; a pass covers 16 rows of the source, so every output row segment it
writes is a whole 64-byte line. Memory traffic: the source read once, the result written
once. Parallel strategy: (batch, 16-row block) pairs split statically across threads, from
64K elements (below, one thread is faster); edges (the last ``rows % 8`` rows and
``cols % 8`` columns) are copied element by element on one thread.

Measured against ``t.T.contiguous()`` (float32, AMD Zen 3, in one process): 256 x 1024
404 -> 119 us on one thread, 315 -> 73 us on two; 1024 x 256 799 -> 144 / 390 -> 75 us;
1024 x 1024 4.7 -> 1.9 ms / 2.7 -> 0.39 ms; 64 x 256 28 -> 9 us. Elements are moved as bits
(shuffles, no arithmetic), so any 4- or 8-byte dtype is copied exactly.

Used where the CPU has AVX2 (``compiler.kernel.vector_isa``) and the C backend is on, for a
contiguous CPU tensor whose permutation moves a trailing group of dimensions ahead of the
group before it (``x.T``; ``bni -> bin``; the inverse); anything else is torch's copy. A
tensor that needs a gradient is copied the same way, recorded (``_PermutedCopy``): its
gradient comes back through the inverse copy. ``contiguous`` applies it to a permuted view
(the kernels' dense operands: ``shim.py``, ``execute.py``).

Example:
    >>> import torch
    >>> from sparsetorch.ops.transpose import permuted
    >>> x = torch.arange(6.).reshape(2, 3)
    >>> permuted(x, (1, 0))
    tensor([[0., 3.],
            [1., 4.],
            [2., 5.]])
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from .. import runtime
from .._modes import materialized
from .policy import backend

_MIN_ELEMENTS = 1024       # below: torch's copy costs the same (16 x 30: 7.7 vs 7.1 us)
_PARALLEL_ELEMENTS = 1 << 16

# (``rows.py`` transposes with it too)
BLOCK4_C = r"""
/* 8 x 8 block of 4-byte elements: rows of x (stride ldx) become rows of o (stride ldo). */
static inline void st_block4(const float* x, int64_t ldx, float* o, int64_t ldo) {
  const __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ldx);
  const __m256 r2 = _mm256_loadu_ps(x + 2 * ldx), r3 = _mm256_loadu_ps(x + 3 * ldx);
  const __m256 r4 = _mm256_loadu_ps(x + 4 * ldx), r5 = _mm256_loadu_ps(x + 5 * ldx);
  const __m256 r6 = _mm256_loadu_ps(x + 6 * ldx), r7 = _mm256_loadu_ps(x + 7 * ldx);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(o, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(o + ldo, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(o + 2 * ldo, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(o + 3 * ldo, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(o + 4 * ldo, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(o + 5 * ldo, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(o + 6 * ldo, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(o + 7 * ldo, _mm256_permute2f128_ps(s3, s7, 0x31));
}
"""

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
""" + BLOCK4_C + r"""

/* 4 x 4 block of 8-byte elements. */
static inline void st_block8(const double* x, int64_t ldx, double* o, int64_t ldo) {
  const __m256d r0 = _mm256_loadu_pd(x), r1 = _mm256_loadu_pd(x + ldx);
  const __m256d r2 = _mm256_loadu_pd(x + 2 * ldx), r3 = _mm256_loadu_pd(x + 3 * ldx);
  const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
  const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
  _mm256_storeu_pd(o, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(o + ldo, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(o + 2 * ldo, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(o + 3 * ldo, _mm256_permute2f128_pd(t1, t3, 0x31));
}

/* o[a][c][r] = x[a][r][c] for a < na, r < nr, c < nc; ``B`` x ``B`` blocks, 16 rows of x
   per pass; (a, pass) pairs split across nt threads. */
#define ST_TRANSPOSE(NAME, T, B, BLOCK)                                                \
void NAME(int64_t na, int64_t nr, int64_t nc, const T* restrict x, T* restrict o,      \
          int64_t nt) {                                                                \
  const int64_t rb = nr - nr % B, cb = nc - nc % B, passes = (rb + 15) / 16;            \
  _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")            \
  for (int64_t q = 0; q < na * passes; q++) {                                           \
    const int64_t a = q / passes, r0 = (q % passes) * 16;                               \
    const int64_t r1 = r0 + 16 < rb ? r0 + 16 : rb;                                     \
    const T* xa = x + a * nr * nc;                                                      \
    T* oa = o + a * nr * nc;                                                            \
    for (int64_t c = 0; c < cb; c += B)                                                 \
      for (int64_t r = r0; r < r1; r += B)                                              \
        BLOCK(xa + r * nc + c, nc, oa + c * nr + r, nr);                                \
  }                                                                                     \
  for (int64_t a = 0; a < na; a++) {   /* (memcpy: bits, whatever the dtype) */         \
    const T* xa = x + a * nr * nc;                                                      \
    T* oa = o + a * nr * nc;                                                            \
    for (int64_t r = 0; r < nr; r++)                                                    \
      for (int64_t c = r < rb ? cb : 0; c < nc; c++)                                    \
        memcpy(oa + c * nr + r, xa + r * nc + c, sizeof(T));                            \
  }                                                                                     \
}
ST_TRANSPOSE(st_transpose4, float, 8, st_block4)
ST_TRANSPOSE(st_transpose8, double, 4, st_block8)
"""


def permuted(t: torch.Tensor, perm, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t.permute(perm).contiguous()``, copied by the block transposes of this module where
    they apply (see the module docstring), else by torch. Always a new tensor or ``t``
    itself where the permutation leaves it contiguous, exactly as torch's copy; recorded by
    autograd where ``t`` needs a gradient (whose copy back is a block transpose too).
    ``out`` (no gradient recorded): a contiguous tensor of the result's shape and dtype to
    write the copy into and return (a kernel's reused scratch).

    Example:
        >>> import torch
        >>> x = torch.randn(2, 40, 30)
        >>> torch.equal(permuted(x, (0, 2, 1)), x.permute(0, 2, 1).contiguous())
        True
    """
    perm = tuple(perm)
    split = _split(tuple(t.shape), perm) if t.numel() >= _MIN_ELEMENTS else None
    fn = _kernel(t.element_size()) if split is not None and backend() == "c" else None
    if fn is None or not t.is_contiguous() or t.layout != torch.strided or not t.is_cpu:
        return t.permute(perm).contiguous() if out is None else out.copy_(t.permute(perm))
    if t.requires_grad and torch.is_grad_enabled():
        return _PermutedCopy.apply(t, perm)
    na, nr, nc = split
    if out is None:   # (t's device: CPU, whatever the default)
        out = t.new_empty([t.shape[p] for p in perm])
    nt = runtime.num_threads() if t.numel() >= _PARALLEL_ELEMENTS else 1
    fn(na, nr, nc, t.data_ptr(), out.data_ptr(), nt)
    return out


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, by the block transposes where ``t`` is a permuted view of a
    contiguous tensor (``x.T``, a gradient that autograd permuted back): torch copies such a
    view one element at a time.

    Example:
        >>> import torch
        >>> x = torch.randn(30, 40)
        >>> torch.equal(contiguous(x.T), x.T.contiguous())
        True
    """
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    base = t.permute(order)
    if not base.is_contiguous():
        return t.contiguous()
    return permuted(base, sorted(range(t.dim()), key=order.__getitem__))


class _PermutedCopy(torch.autograd.Function):
    """``permuted`` recorded: the gradient is copied back by the inverse permutation."""

    @staticmethod
    def forward(ctx, t, perm):
        ctx.inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
        return permuted(t, perm)   # (grad mode is off here: the copy itself)

    @staticmethod
    def backward(ctx, grad):
        return permuted(contiguous(materialized(grad)), ctx.inverse), None


def _split(shape: tuple, perm: tuple):
    """``(batch, rows, cols)`` when ``perm`` keeps the first dimensions and moves the
    trailing group (cols) ahead of the group before it (rows), each at least 8 long (a
    shorter side is all edge: torch's copy is as fast), else None."""
    d = next((n for n, p in enumerate(perm) if p != n), None)
    if d is None:
        return None
    e = perm[d]
    if perm[d:] != (*range(e, len(perm)), *range(d, e)):
        return None
    rows, cols = math.prod(shape[d:e]), math.prod(shape[e:])
    return (math.prod(shape[:d]), rows, cols) if rows >= 8 and cols >= 8 else None


@lru_cache(maxsize=None)
def _kernel(element_bytes: int):
    """The transpose for elements of this size, or None where torch's copy is used: no
    AVX2, another size, or no C compiler."""
    from ..compiler.kernel import vector_isa

    if element_bytes not in (4, 8) or vector_isa() is None:
        return None
    symbol = f"st_transpose{element_bytes}"
    try:
        return runtime.load_entries(_SOURCE, {symbol: [runtime.I64] * 3 + [runtime.PTR] * 2 +
                                              [runtime.I64]})[symbol]
    except runtime.KernelBuildError:
        return None
