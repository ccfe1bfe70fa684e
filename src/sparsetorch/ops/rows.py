"""``sparse_linear``: ``activation(x @ W^T + bias)`` (``F.linear``'s rows) for a CSR weight
``W`` and a batch ``x`` of dense rows or of CSR rows, the product of a ``SparseLinear`` layer
on a batch (an autoencoder's 256 MNIST digits).

The compiler's kernel for ``x W^T`` vectorises over the batch: it needs ``x`` batch-last,
so ``ops/relayout.py`` copies ``x`` transposed and the result back, and at 256 x 784 those
two copies and the cache misses between them cost twice the product (MNIST's encoder: the
kernel 110 us, the layer 300). Here the transposes happen in cache, ``ROWS`` (32) rows at
a time: a thread copies 32 rows of ``x`` transposed into its scratch (``k x 32``: 8 x 8
register transposes for dense rows; for CSR rows the zeroed scratch takes each stored
entry), then for each output column ``o`` sums ``W[o, i] * scratch[i, :]`` over the stored
entries of ``W``'s row ``o`` in 32 lanes (two AVX-512 or four AVX2 registers; two entries
a trip into twin accumulators, so four or eight FMA chains cover their latency), adds the
bias, applies the activation, keeps the 32 results in a second scratch (``m x 32``) and
finally transposes that into the 32 output rows. Memory traffic: ``x`` read once, the
output written once, ``W``'s arrays read once per 32 rows (from cache); the scratches
(32 x (k + m) floats) stay in L2. Each stored weight's load and broadcast serve 32 rows:
blocks of 16 took twice as long (2 threads, 256 rows, 20K entries: 182 -> 88 us).
Parallel strategy: blocks of 32 rows split statically across threads.

Training: the backward goes by the same blocks (``_Recorded``): the output gradient
through the activation and transposed in one C pass (``gt``), ``dx = g W`` by the forward
kernel on ``W^T``'s CSR arrays (the pattern re-laid once and kept, the values gathered)
copying each block's columns of ``gt`` as they are, ``dvalues`` as dots of ``gt``'s and
the transposed ``x``'s rows at the stored entries (four entries a pass over ``gt``'s
row, eight FMA chains; the rows of ``W``, or of ``W^T`` where ``x`` has more columns
than ``W`` rows, split across threads; a CSR batch's columns with few entries dotted at
those alone). The MNIST autoencoder's training step: 3.4 ->
2.7-3.2 ms (the transposing copies of the compiler's path gone), then on a Zen 4 1.50 ->
1.21 ms (one pass for the activation's gradient and its transpose, no re-laid wrapper or
transposed copy of ``g`` for ``dx``, a CSR batch transposed through a tile).

Used for float32 CPU operands on AVX2 (or AVX-512) CPUs with the C backend, while
``torch.compile`` is not tracing, for at least ``MIN_ROWS`` rows (a block's unused rows
are computed too; where autograd records, for any number: einsum's recorded path cost
more, a training step of a 784 -> 256 layer at batch 1-15 1.5-1.9x as long) and no
gradient wanted for CSR rows; everything else runs ``st.einsum``, which this matches up
to rounding. CSR rows under ``SPARSE_ROWS_BELOW`` (3%) full go by their entries instead
(``sparse_rows.py``: bag-of-words batches, float32 or float64, any number of rows).

Example:
    >>> import torch, sparsetorch as st
    >>> W = st.tensor(torch.randn(8, 20) * (torch.rand(8, 20) < 0.3), format="csr")
    >>> x, b = torch.randn(40, 20), torch.randn(8)
    >>> y = sparse_linear(x, W, b, "relu")
    >>> torch.allclose(y, torch.relu(x @ W.to_dense().T + b), atol=1e-5)
    True
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from string import Template

import torch

from .. import runtime
from .._modes import materialized, refuse_ad_transforms
from ..codegen.intrinsics import prelude
from ..compiler.kernel import vector_isa
from ..formats import SparseTensor
from .depthwise import _Scratch, _scratch as _buffers   # (each Python thread's buffers)
from .einsum import einsum
from .epilogue import ACTIVATIONS as _EINSUM_ACTIVATIONS, unfused
from .policy import backend
from .relaid import gather, relaid, relaid_pattern, transposed_format
from .sparse_rows import (SPARSE_ROWS_BELOW, batch_arrays, recomputed_grads,
                          sparse_rows_linear)
from .transpose import BLOCK4_C

MIN_ROWS = 16   # (below it, most of a block's rows would be padding)
ROWS = 32       # rows of x a block transposes (R in the kernel)
_ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2, "sigmoid": 3}
_INDEX = {torch.int32: "int32_t", torch.int64: "int64_t"}
_PARALLEL_WORK = 1 << 16   # stored entries of W x rows below which one thread is as fast
_PARALLEL_ELEMENTS = 1 << 15   # elementwise: below, one thread is as fast
_is_compiling = torch.compiler.is_compiling

# The ISA's names in the kernel text below: vector type ($V), intrinsic prefix ($P), lanes
# ($N), approximate reciprocal, exp (codegen's prelude), horizontal sum and the bits of
# the nonzero lanes of the vector at p (NaN counts as nonzero). A block's R rows are
# VR = R / lanes registers.
_ISA = {
    "avx2": dict(V="__m256", P="_mm256", N=8, RCP="_mm256_rcp_ps", EXP="st_exp_ps256",
                 SUM="st_hsum256", NONZERO="(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps("
                 "_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_NEQ_UQ))"),
    "avx512": dict(V="__m512", P="_mm512", N=16, RCP="_mm512_rcp14_ps", EXP="st_exp_ps512",
                   SUM="_mm512_reduce_add_ps", NONZERO="(uint32_t)_mm512_cmp_ps_mask("
                   "_mm512_loadu_ps(p), _mm512_setzero_ps(), _CMP_NEQ_UQ)"),
}
# A column's R results (``st_column``'s body): two entries a trip into twin accumulators.
_COLUMN = r"""  $V a[VR], c[VR];
  for (int v = 0; v < VR; v++) { a[v] = ${P}_set1_ps(b); c[v] = ${P}_setzero_ps(); }
  for (; q + 1 < q1; q += 2) {
    const $V w = ${P}_set1_ps(val[q]), u = ${P}_set1_ps(val[q + 1]);
    const float *p = xt + R * (int64_t)crd[q], *r = xt + R * (int64_t)crd[q + 1];
    for (int v = 0; v < VR; v++) {
      a[v] = ${P}_fmadd_ps(w, ${P}_loadu_ps(p + $N * v), a[v]);
      c[v] = ${P}_fmadd_ps(u, ${P}_loadu_ps(r + $N * v), c[v]);
    }
  }
  if (q < q1) {
    const $V w = ${P}_set1_ps(val[q]);
    const float* p = xt + R * (int64_t)crd[q];
    for (int v = 0; v < VR; v++) a[v] = ${P}_fmadd_ps(w, ${P}_loadu_ps(p + $N * v), a[v]);
  }
  for (int v = 0; v < VR; v++) {
    $V y = ${P}_add_ps(a[v], c[v]);
    if (act == 1 || act == 2) {   /* (y second: max and min return their second operand
                                     where either is NaN, so a NaN passes, as through torch's) */
      y = ${P}_max_ps(${P}_setzero_ps(), y);
      if (act == 2) y = ${P}_min_ps(${P}_set1_ps(6.0f), y);
    }
    ${P}_storeu_ps(yt + $N * v, y);
  }"""
# The dots of row g (n values) with rows x[0..3] (``st_dots``' vector loop): each load of
# g serves four rows, eight chains (two per row); the loop is bound by its loads, 1.25 per
# FMA where two rows took 1.5.
_DOTS = r"""  $V a[4], c[4];
  for (int r = 0; r < 4; r++) { a[r] = ${P}_setzero_ps(); c[r] = a[r]; }
  int64_t j = 0;
  for (; j + 2 * $N <= n; j += 2 * $N) {
    const $V u = ${P}_loadu_ps(g + j), v = ${P}_loadu_ps(g + j + $N);
    for (int r = 0; r < 4; r++) {
      a[r] = ${P}_fmadd_ps(u, ${P}_loadu_ps(x[r] + j), a[r]);
      c[r] = ${P}_fmadd_ps(v, ${P}_loadu_ps(x[r] + j + $N), c[r]);
    }
  }
  for (int r = 0; r < 4; r++) out[r] = $SUM(${P}_add_ps(a[r], c[r]));"""
# 1 / (1 + e^-v) of vector v: e^-v with -v clamped to 88 (min's second operand: a NaN
# passes; e^88 < FLT_MAX: a finite denominator, whose reciprocal's Newton step cannot meet
# inf x 0), the reciprocal as the approximate one refined by a Newton step (~2^-22
# relative: a division cost 2x more here).
_SIGMOID = r"""
    const $V one = ${P}_set1_ps(1.0f);
    const $V d = ${P}_add_ps(one, $EXP(${P}_min_ps(
        ${P}_set1_ps(88.0f), ${P}_sub_ps(${P}_setzero_ps(), v))));
    const $V r = $RCP(d);
    return ${P}_mul_ps(r, ${P}_fnmadd_ps(d, r, ${P}_set1_ps(2.0f)));"""
_LINEAR = r"""
/* The R results of output column o (rows of the block): bias, then two stored entries a
   trip into twin accumulators, then ReLU (act 1) or ReLU6 (2), into yt[o][0..R). */
#define ST_COLUMN(I)                                                                      \
static inline void st_column_##I(const I* crd, const float* val, int64_t q, int64_t q1,  \
    const float* xt, float b, int64_t act, float* yt) {                                  \
  $COLUMN                                                                                 \
}
/* x = 1 / (1 + e^-x) in place, n a multiple of the vector width: a pass of its own, where
   the exps of successive vectors overlap (in the column loop each waited on the last) */
static inline $V st_sigmoid_v($V v) {$SIGMOID
}
static void st_sigmoid(float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += $N) ${P}_storeu_ps(x + j, st_sigmoid_v(${P}_loadu_ps(x + j)));
}
/* y (n x m) = act(x W^T + bias) (act 3: sigmoid): W m x k CSR (pos, crd, val); x n x k,
   dense rows (x, ldt 0), the same transposed (x, k rows ldt >= the blocks' span apart:
   a block's columns copied as they are) or CSR rows (xpos, xcrd, xval; x null).
   scratch: nt x R x (k + m). */
#define ST_LINEAR(I, J)                                                                   \
void st_sparse_linear_##I##_##J(int64_t n, int64_t k, int64_t m, const I* pos,           \
    const I* crd, const float* val, const float* x, const J* xpos, const J* xcrd,         \
    const float* xval, int64_t ldt, const float* bias, int64_t act, float* y,             \
    float* scratch, int64_t nt) {                                                         \
  const int64_t blocks = (n + R - 1) / R;                                                   \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                      \
  {                                                                                       \
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                    \
    float* xt = scratch + R * (k + m) * t;                                               \
    float* yt = xt + R * k;                                                              \
    for (int64_t bl = blocks * t / T; bl < blocks * (t + 1) / T; bl++) {                 \
      const int64_t r0 = R * bl, rows = n - r0 < R ? n - r0 : R;                       \
      /* xt[i][r] = x[r0 + r][i] (0 for rows past n) */                                  \
      if (x == 0) {                                                                       \
        memset(xt, 0, (size_t)(R * k) * sizeof(float));                                  \
        for (int64_t r = 0; r < rows; r++)                                                \
          for (J q = xpos[r0 + r]; q < xpos[r0 + r + 1]; q++)                             \
            xt[R * (int64_t)xcrd[q] + r] = xval[q];                                      \
      } else if (ldt) {                                                                   \
        for (int64_t c = 0; c < k; c++)                                                   \
          memcpy(xt + R * c, x + c * ldt + r0, R * sizeof(float));                       \
      } else {                                                                            \
        const int64_t kb = rows == R ? k - k % 8 : 0;                                     \
        for (int64_t c = 0; c < kb; c += 8)                                               \
          for (int64_t g = 0; g < R; g += 8)                                              \
            st_block4(x + (r0 + g) * k + c, k, xt + R * c + g, R);                        \
        for (int64_t c = kb; c < k; c++)                                                  \
          for (int64_t r = 0; r < R; r++)                                                 \
            xt[R * c + r] = r < rows ? x[(r0 + r) * k + c] : 0.0f;                       \
      }                                                                                   \
      for (int64_t o = 0; o < m; o++)                                                     \
        st_column_##I(crd, val, pos[o], pos[o + 1], xt, bias ? bias[o] : 0.0f, act,      \
                      yt + R * o);                                                        \
      if (act == 3) st_sigmoid(yt, R * m);                                                \
      /* y[r0 + r][o] = yt[o][r] */                                                      \
      const int64_t mb = rows == R ? m - m % 8 : 0;                                       \
      for (int64_t o = 0; o < mb; o += 8)                                                 \
        for (int64_t g = 0; g < R; g += 8)                                                \
          st_block4(yt + R * o + g, R, y + (r0 + g) * m + o, m);                          \
      for (int64_t r = 0; r < rows; r++)                                                  \
        for (int64_t o = mb; o < m; o++)                                                  \
          y[(r0 + r) * m + o] = yt[R * o + r];                                            \
    }                                                                                     \
  }                                                                                       \
}
static inline float st_row_sum(const float* g, int64_t n) {
  float sum = 0.0f;
  #pragma omp simd reduction(+:sum)
  for (int64_t j = 0; j < n; j++) sum += g[j];
  return sum;
}
/* out[r] = g . x[r] for r < 4 (rows of n values; the vector loop, then the rest) */
static inline void st_dots(int64_t n, const float* g, const float* const* x, float* out) {
$DOTS
  for (; j < n; j++)
    for (int r = 0; r < 4; r++) out[r] += g[j] * x[r][j];
}
/* out[r] = g . x[r] for r < 4 at g's nonzeros alone (their count positions in idx) */
static inline void st_sparse_dots(int64_t count, const int64_t* idx, const float* g,
                                  const float* const* x, float* out) {
  for (int r = 0; r < 4; r++) out[r] = 0.0f;
  for (int64_t u = 0; u < count; u++) {
    const int64_t j = idx[u];
    for (int r = 0; r < 4; r++) out[r] += g[j] * x[r][j];
  }
}
/* How many of g's n values are nonzero (or NaN); where at most `most`, their positions in
   idx, in order: a count by vector masks, then the few set bits of each. */
static inline int64_t st_nonzeros(int64_t n, const float* g, int64_t most, int64_t* idx) {
  int64_t count = 0, j = 0;
  for (; j + $N <= n; j += $N) { const float* p = g + j; count += __builtin_popcount($NONZERO); }
  for (int64_t i = j; i < n; i++) count += !(g[i] == 0.0f);
  if (count > most) return count;
  int64_t c = 0;
  for (j = 0; j + $N <= n; j += $N) {
    const float* p = g + j;
    for (uint32_t bits = $NONZERO; bits; bits &= bits - 1) idx[c++] = j + __builtin_ctz(bits);
  }
  for (; j < n; j++) if (!(g[j] == 0.0f)) idx[c++] = j;
  return count;
}
/* The weight gradient on W's pattern: dvalues[q] = gt[o] . xt[crd[q]] for stored entry q
   of row o, gt (m x n) and xt (k x n) the output gradient and the input transposed (rows
   of n batch values, ld apart); dbias[o] = the sum of gt[o] (unless dbias is null), read
   while the row is in cache. The same on W^T's pattern (perm not null: pos, crd W^T's
   arrays, a = xt, b = gt, entry q of W^T is W's perm[q]; dbias from b's m rows in a loop
   of its own): the rows of b are the ones read out of order, again and again, so the
   caller passes as b the operand with fewer rows, the one that stays in L2 (the MNIST
   encoder's, xt 784 rows of 1 KB, in the training step: 221 -> 166 us, with the dots by
   fours). skip (a's rows from a CSR batch: the input's columns): a row of a with at most
   n / 16 nonzeros is dotted at those alone, four entries a pass (a vector's worth of
   loads or less where the whole rows took n / 16 vector loads of b from L2): binarised
   MNIST has 35% of its pixels off in a whole batch of 256 digits and 58% on in at most
   16, and the encoder's weight gradient took 82-109 us where it took 121-163 (2 threads,
   Zen 4; n / 8: the same, n / 4: no gain). The caller skips only where b is finite: the
   zeros skipped would have made an inf or NaN of b NaN, as they do in the whole rows'
   dots. Parallel: the pattern's rows (and b's) split statically across threads. */
#define ST_GRAD_VALUES(I)                                                                 \
void st_linear_grad_values_##I(int64_t rows, int64_t n, const I* pos, const I* crd,      \
    const I* perm, const float* a, const float* b, int64_t ld, float* dvalues,           \
    float* dbias, int64_t m, int64_t skip, int64_t nt) {                                  \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                      \
  {                                                                                       \
  const int64_t most = skip ? n / 16 : -1;                                                \
  int64_t* idx = skip ? (int64_t*)malloc((size_t)(most + 1) * sizeof(int64_t)) : 0;      \
  if (dbias && perm) {                                                                    \
    _Pragma("omp for schedule(static) nowait")                                            \
    for (int64_t o = 0; o < m; o++) dbias[o] = st_row_sum(b + o * ld, n);                 \
  }                                                                                       \
  _Pragma("omp for schedule(static)")                                                     \
  for (int64_t o = 0; o < rows; o++) {                                                    \
    const float* g = a + o * ld;                                                          \
    if (dbias && !perm) dbias[o] = st_row_sum(g, n);                                      \
    const int64_t nonzeros = idx ? st_nonzeros(n, g, most, idx) : n;                      \
    /* four entries a call; the last call's missing ones repeat its first (not stored) */ \
    for (int64_t q = pos[o]; q < pos[o + 1]; q += 4) {                                    \
      const int64_t left = pos[o + 1] - q;                                                \
      const float* x[4];                                                                  \
      float dots[4];                                                                      \
      for (int64_t r = 0; r < 4; r++) x[r] = b + (int64_t)crd[r < left ? q + r : q] * ld; \
      if (nonzeros <= most)                                                               \
        st_sparse_dots(nonzeros, idx, g, x, dots);                                        \
      else                                                                                \
        st_dots(n, g, x, dots);                                                           \
      for (int64_t r = 0; r < 4 && r < left; r++)                                         \
        dvalues[perm ? (int64_t)perm[q + r] : q + r] = dots[r];                           \
    }                                                                                     \
  }                                                                                       \
  free(idx);                                                                              \
  }                                                                                       \
}
/* The 8 x 8 block of g = dy x act'(y) at dy, y (rows ld apart) into tmp (rows 8 apart),
   for the activation's output y: act 0 none, 1 relu, 2 relu6, 3 sigmoid; the lanes of g
   that are inf or NaN (g x 0 not 0) or'ed into *bad. */
static inline void st_grad8(const float* dy, const float* y, int64_t ld, int64_t act,
                            float* tmp, __m256* bad) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < 8; i++) {
    __m256 d = _mm256_loadu_ps(dy + i * ld);
    if (act) {
      const __m256 v = _mm256_loadu_ps(y + i * ld);
      if (act == 3) {
        d = _mm256_mul_ps(_mm256_mul_ps(d, v), _mm256_sub_ps(one, v));
      } else {   /* (relu: unordered "not <= 0", a NaN output passes its gradient, as
                    through torch's relu; relu6: ordered "< 6", it does not, as torch's
                    vectorised relu6 backward) */
        __m256 keep = _mm256_cmp_ps(v, zero, _CMP_NLE_UQ);
        if (act == 2) keep = _mm256_and_ps(keep, _mm256_cmp_ps(v, _mm256_set1_ps(6.0f),
                                                                _CMP_LT_OQ));
        d = _mm256_and_ps(d, keep);
      }
    }
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_mul_ps(d, zero), zero, _CMP_NEQ_UQ));
    _mm256_storeu_ps(tmp + 8 * i, d);
  }
}
/* gt (m x n, rows ld apart) = (dy x act'(y))^T for dy, y (n x m): the output gradient
   through the activation, transposed in the same pass (8 x 8 blocks, computed then
   transposed, down each 8 rows of gt in turn: its writes in order; the edges one value at
   a time); lanes n up to the last block's end zeroed; *nonfinite = 1 where any of it is
   inf or NaN (unless nonfinite is null: then left as it is). The forward's blocks of R rows
   split across threads as there, so the thread that takes a block for dx wrote its
   columns. */
void st_activation_grad_t(int64_t n, int64_t m, const float* restrict dy,
                          const float* restrict y, int64_t act, float* restrict gt,
                          int64_t ld, int64_t* nonfinite, int64_t nt) {
  const int64_t blocks = (n + R - 1) / R, mb = m - m % 8;
  #pragma omp parallel num_threads(nt) if(nt > 1)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t r0 = R * (blocks * t / T), end = R * (blocks * (t + 1) / T);
    const int64_t r1 = end < n ? end : n, rb = r0 + (r1 - r0) / 8 * 8;
    float tmp[64];
    __m256 bad = _mm256_setzero_ps();
    int some_bad = 0;
    for (int64_t o = 0; o < mb; o += 8)
      for (int64_t r = r0; r < rb; r += 8) {
        st_grad8(dy + r * m + o, y + r * m + o, m, act, tmp, &bad);
        st_block4(tmp, 8, gt + o * ld + r, ld);
      }
    for (int64_t r = r0; r < r1; r++)
      for (int64_t o = r < rb ? mb : 0; o < m; o++) {
        const float d = dy[r * m + o], v = y[r * m + o];
        const float g = act == 0 ? d : act == 3 ? d * v * (1.0f - v)
                                     : !(v <= 0.0f) && (act == 1 || v < 6.0f) ? d : 0.0f;
        gt[o * ld + r] = g;
        some_bad |= !(g * 0.0f == 0.0f);
      }
    if (nonfinite && (some_bad || _mm256_movemask_ps(bad)))
      __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
    if (end > r1)
      for (int64_t o = 0; o < m; o++) memset(gt + o * ld + r1, 0, (size_t)(end - r1) * 4);
  }
}
/* xt (k x n, rows ld apart) = the n CSR rows (xpos, xcrd, xval) of width k, transposed
   into zeros, 16 rows at a time (a cache line of each row of xt): scattered into a zeroed
   contiguous tile (k x 16, a thread's scratch), then copied out a line per row of xt.
   Scattered straight into xt, the writes went to lines 1 KB apart (256 rows) that evicted
   each other (MNIST's 256 x 784 batch: 120 us). The groups split across threads. */
#define ST_SCATTER_T(J)                                                                   \
void st_rows_transposed_##J(int64_t n, int64_t k, const J* xpos, const J* xcrd,         \
    const float* xval, float* xt, int64_t ld, float* scratch, int64_t nt) {               \
  const int64_t groups = (n + 15) / 16;                                                   \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                      \
  {                                                                                       \
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                    \
    float* tile = scratch + 16 * k * t;                                                   \
    for (int64_t gr = groups * t / T; gr < groups * (t + 1) / T; gr++) {                 \
      const int64_t r0 = 16 * gr, rows = n - r0 < 16 ? n - r0 : 16;                      \
      memset(tile, 0, (size_t)(16 * k) * sizeof(float));                                  \
      for (int64_t r = 0; r < rows; r++)                                                  \
        for (J q = xpos[r0 + r]; q < xpos[r0 + r + 1]; q++)                               \
          tile[16 * (int64_t)xcrd[q] + r] = xval[q];                                      \
      if (rows == 16)                                                                     \
        for (int64_t i = 0; i < k; i++)                                                   \
          memcpy(xt + i * ld + r0, tile + 16 * i, 16 * sizeof(float));                    \
      else                                                                                \
        for (int64_t i = 0; i < k; i++)                                                   \
          memcpy(xt + i * ld + r0, tile + 16 * i, (size_t)rows * sizeof(float));          \
    }                                                                                     \
  }                                                                                       \
}
/* xt (k x n, rows ld apart) = x (n x k) transposed: 8 x 8 transposes, down each 8 rows
   of xt in turn (its writes in order); the rows of x split across threads. */
void st_rows_dense_transposed(int64_t n, int64_t k, const float* restrict x,
                              float* restrict xt, int64_t ld, int64_t nt) {
  #pragma omp parallel num_threads(nt) if(nt > 1)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t r0 = n * t / T, r1 = n * (t + 1) / T;
    const int64_t rb = r0 + (r1 - r0) / 8 * 8, kb = k - k % 8;
    for (int64_t i = 0; i < kb; i += 8)
      for (int64_t r = r0; r < rb; r += 8) st_block4(x + r * k + i, k, xt + i * ld + r, ld);
    for (int64_t r = r0; r < r1; r++)
      for (int64_t i = r < rb ? kb : 0; i < k; i++) xt[i * ld + r] = x[r * k + i];
  }
}
ST_COLUMN(int32_t)
ST_COLUMN(int64_t)
ST_GRAD_VALUES(int32_t)
ST_GRAD_VALUES(int64_t)
ST_SCATTER_T(int32_t)
ST_SCATTER_T(int64_t)
ST_LINEAR(int32_t, int32_t)
ST_LINEAR(int32_t, int64_t)
ST_LINEAR(int64_t, int32_t)
ST_LINEAR(int64_t, int64_t)
"""


def _source(isa: str) -> str:
    names = _ISA[isa]

    def fill(text):
        return Template(text).substitute(names)

    column = " \\\n".join(fill(_COLUMN).split("\n"))
    return ("/* the row-block sparse linear kernel (ops/rows.py) */\n#include <stdint.h>\n"
            f"#include <stdlib.h>\n#include <string.h>\n#include <omp.h>\n#define R {ROWS}\n"
            f"#define VR {ROWS // names['N']}\n" + prelude(isa) + BLOCK4_C
            + Template(_LINEAR).substitute(COLUMN=column, SIGMOID=fill(_SIGMOID),
                                           DOTS=fill(_DOTS), **names))


def sparse_linear(x, weight: SparseTensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, fallback: bool = True):
    """``activation(x @ weight^T + bias)``: ``x`` (n, k) a dense tensor or a CSR
    SparseTensor of rows, ``weight`` (m, k) a SparseTensor, ``bias`` None or (m,),
    ``activation`` None or one of ``st.einsum``'s ("relu", "relu6", "sigmoid", ...); the
    dense (n, m) result. This module's kernels where they apply (see the module
    docstring), differentiable in ``weight.values``, a dense ``x`` and ``bias``; else
    ``st.einsum`` (``fallback=False``: None instead, for a caller with its own).

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> sparse_linear(torch.full((2, 3), -1.0), W, torch.ones(3), "relu").tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    refuse_ad_transforms("sparse_linear", (x, weight, bias))
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise TypeError(f"sparse_linear: {name} must be a 2-D tensor or SparseTensor, got "
                            f"{type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
    if x.shape[1] != weight.shape[1]:   # (einsum would broadcast a size of 1)
        raise ValueError(f"sparse_linear: x has {x.shape[1]} columns but weight "
                         f"{tuple(weight.shape)} takes {weight.shape[1]}; they must be equal")
    if activation is not None and activation not in _EINSUM_ACTIVATIONS:
        raise ValueError(f"sparse_linear: activation must be None or one of "
                         f"{_EINSUM_ACTIVATIONS}, got {activation!r}")
    # (the kernels take the values apart from a wrapper holding a plain tensor without
    # grad: a Parameter, even a frozen one, is a subclass, whose re-laid pattern is not kept)
    values = weight._values
    kept = weight if type(values) is torch.Tensor and not values.requires_grad else \
        weight.with_values(values.detach())
    out = _very_sparse_rows(x, kept, values, bias, activation)
    if out is not None:
        return out
    fn = _kernel_for(x, kept, bias, activation, values)
    if fn is None:
        if not fallback:
            return None
        if isinstance(x, SparseTensor):   # (a sparse x sparse product: dense, then the rest)
            return unfused(einsum("ni,oi->no", x, weight, out_format="dense"), bias,
                           activation)
        return einsum("ni,oi->no", x, weight, bias=bias, activation=activation)
    return _run(fn, x, kept, values, bias, activation)


def linear_rows(x, weight: SparseTensor, values: torch.Tensor, bias, activation):
    """``sparse_linear`` by this module's kernels for ``weight``'s pattern with ``values``
    (a Parameter, say) in place of its own, which alias them without a gradient (a layer's
    kept wrapper): no wrapper is made per call; None where the kernels do not apply.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> values = W.values.clone().requires_grad_()
        >>> kept = W.with_values(values.detach())
        >>> y = linear_rows(torch.ones(16, 3), kept, values, None, None)
        >>> y is None or torch.equal(y, torch.ones(16, 3))   # (None: no AVX2 or no compiler)
        True
    """
    refuse_ad_transforms("SparseLinear", (x, values, bias))
    out = _very_sparse_rows(x, weight, values, bias, activation)
    if out is not None:
        return out
    fn = _kernel_for(x, weight, bias, activation, values)
    return None if fn is None else _run(fn, x, weight, values, bias, activation)


def _very_sparse_rows(x, weight, values, bias, activation):
    """``sparse_rows.py``'s product for a batch of CSR rows holding less than
    ``SPARSE_ROWS_BELOW`` of their entries (the activation then applied by torch), or
    None."""
    if type(x) is not SparseTensor or len(x._size) != 2 or \
            x._crd1.numel() >= SPARSE_ROWS_BELOW * x._size[0] * x._size[1]:
        return None
    out = sparse_rows_linear(x, weight, values, bias)
    return None if out is None else unfused(out, None, activation)


def _run(fn, x, weight, values, bias, activation):
    """The kernel's forward, recorded for autograd where a gradient is wanted; ``weight``
    holds ``values`` without a gradient."""
    sparse = type(x) is SparseTensor
    if _records(x, values, bias):
        return _Recorded.apply(fn, None if sparse else x, values, bias, weight,
                               x if sparse else None, activation)
    return _forward(fn, x, weight, bias, activation)


def _forward(fn, x, weight, bias, activation) -> torch.Tensor:
    (m, k), n = weight._size, x.shape[0]
    return _launch(fn, x, weight._pos1, weight._crd1, weight._values, n, k, m, bias,
                   activation)


def _launch(fn, x, pos, crd, values, n, k, m, bias, activation, *,
            ldt: int = 0) -> torch.Tensor:
    """The kernel on ``x``'s n rows by the (m, k) CSR arrays ``pos``, ``crd``, ``values``;
    ``ldt``: ``x`` holds them transposed, k rows ``ldt`` apart (the backward's ``gt``)."""
    out = torch.empty((n, m), dtype=torch.float32)
    nt = runtime.num_threads()
    scratch = _buffers.get(torch.float32, nt * ROWS * (k + m))
    nt = nt if crd.numel() * n >= _PARALLEL_WORK else 1
    sparse = type(x) is SparseTensor
    fn(n, k, m, pos.data_ptr(), crd.data_ptr(), values.data_ptr(),
       0 if sparse else x.data_ptr(), x._pos1.data_ptr() if sparse else 0,
       x._crd1.data_ptr() if sparse else 0, x._values.data_ptr() if sparse else 0,
       ldt, 0 if bias is None else bias.data_ptr(),
       _ACTIVATIONS[activation], out.data_ptr(), scratch.data_ptr(), nt)
    return out


class _Recorded(torch.autograd.Function):
    """The kernel's forward; backward by the same row blocks: the output gradient through
    the activation (from the saved output) and transposed, ``gt``; ``dx`` as ``g W`` (the
    row-block kernel on ``gt`` and ``W^T``'s CSR arrays: the pattern re-laid once and
    kept, ``relaid.py``); ``dvalues`` as dots of ``gt``'s and ``x``'s columns at the
    stored entries (``x`` transposed once); ``dbias`` as ``gt``'s row sums. A gradient of
    the gradient (``create_graph``) is taken through einsum's differentiable path,
    recomputed."""

    @staticmethod
    def forward(ctx, fn, x, values, bias, weight, x_sparse, activation):
        y = _forward(fn, x_sparse if x is None else x, weight, bias, activation)
        # (the output only for its activation's derivative: without one, a residual
        # ``y += skip`` before backward is fine, as after nn.Linear)
        ctx.save_for_backward(x, values, bias, None if activation is None else y,
                              *batch_arrays(x_sparse))
        ctx.weight, ctx.x_sparse, ctx.activation = weight, x_sparse, activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, values, bias, y, *_ = ctx.saved_tensors
        dy = materialized(dy)
        weight, x_sparse, activation = ctx.weight, ctx.x_sparse, ctx.activation
        if torch.is_grad_enabled():   # create_graph: a differentiable backward
            return (None, *recomputed_grads(x_sparse if x is None else x, weight, values,
                                            bias, activation, dy), None, None, None)
        return (None, *gradients(dy, x, x_sparse, weight, values, y, activation,
                                 ctx.needs_input_grad[1:4]), None, None, None)


def gradients(dy, x, x_sparse, weight: SparseTensor, values, y, activation, needs) -> tuple:
    """``(dx, dvalues, dbias)`` of ``activation(x W^T + bias)`` at the output gradient
    ``dy`` (``_Recorded``'s backward, and the traced op's, ``rows_op.py``): ``x`` dense or
    None with ``x_sparse`` its CSR rows, ``weight`` ``W``'s pattern over ``values``, ``y``
    the output (None without an activation); ``needs`` says which of the three to compute
    (None for the others)."""
    need_x, need_values, need_bias = needs
    (m, k), n = weight._size, dy.shape[0]
    fns, nt = _library(vector_isa()), runtime.num_threads()
    ld = _leading(n)
    gt = _scratch(_GT, m * ld)   # (the output gradient through the activation)
    dy = dy.contiguous()   # (held: a temporary's memory is freed before the call)
    # (no activation: the kernel reads no output, dy stands in for it; the sparse dots of
    # _grad_values skip a CSR batch's zeros, so they run only where nothing of gt is inf or
    # NaN, which those zeros would turn into NaN, as they do in the dense dots)
    nonfinite = ctypes.c_int64(0)
    fns["st_activation_grad_t"](n, m, dy.data_ptr(), (dy if y is None else y).data_ptr(),
                                _ACTIVATIONS[activation], gt.data_ptr(), ld,
                                ctypes.addressof(nonfinite),
                                nt if dy.numel() >= _PARALLEL_ELEMENTS else 1)
    dx = _grad_x(weight, gt, n, ld) if need_x else None
    dvalues = dbias = None
    if need_values:   # (dbias summed in the same pass)
        dbias = torch.empty(m, dtype=torch.float32) if need_bias else None
        nt = nt if values.numel() * n >= _PARALLEL_WORK else 1
        xt = _scratch(_XT, k * ld)
        if x is not None:
            x = x.contiguous()
            fns["st_rows_dense_transposed"](n, k, x.data_ptr(), xt.data_ptr(), ld, nt)
        else:
            tiles = _buffers.get(torch.float32, nt * 16 * k)
            fns["st_rows_transposed_" + _INDEX[x_sparse._crd1.dtype]](
                n, k, x_sparse._pos1.data_ptr(), x_sparse._crd1.data_ptr(),
                x_sparse._values.data_ptr(), xt.data_ptr(), ld, tiles.data_ptr(), nt)
        dvalues = torch.empty_like(values)
        _grad_values(fns, weight, gt, xt, n, ld, dvalues, dbias, nt,
                     x is None and not nonfinite.value)
    elif need_bias:
        dbias = gt[:m * ld].view(m, ld)[:, :n].sum(1)
    return dx, dvalues, dbias


def _grad_values(fns, weight: SparseTensor, gt, xt, n: int, ld: int, dvalues, dbias,
                 nt: int, sparse_x: bool) -> None:
    """``dvalues`` (and ``dbias``, unless None): the dots of ``gt``'s and ``xt``'s rows at
    ``weight``'s stored entries, walking whichever of ``W``'s and ``W^T``'s patterns reads
    the operand with fewer rows out of order (``W^T``'s is ``_grad_x``'s, kept); with
    ``sparse_x`` (``xt`` from a CSR batch), ``xt``'s rows held by ``W^T``'s walk are
    dotted at their nonzeros where they have few."""
    (m, k), index = weight._size, _INDEX[weight._crd1.dtype]
    # (not for a pattern of no entries: the empty permutation's pointer is null, which the
    # kernel reads as W's own pattern, with W^T's k rows: dbias written past its m)
    found = relaid_pattern(weight, transposed_format(weight._format)) \
        if k > m and weight._crd1.numel() else None
    if found is not None and found[1].dtype == weight._crd1.dtype:
        (arrays, perm), rows, a, b, skip = found, k, xt, gt, sparse_x
        pos, crd, perm = arrays["pos1"], arrays["crd1"], perm.data_ptr()
    else:
        rows, a, b, pos, crd, perm, skip = m, gt, xt, weight._pos1, weight._crd1, 0, False
    fns["st_linear_grad_values_" + index](
        rows, n, pos.data_ptr(), crd.data_ptr(), perm, a.data_ptr(), b.data_ptr(), ld,
        dvalues.data_ptr(), 0 if dbias is None else dbias.data_ptr(), m, int(skip), nt)


def _leading(n: int) -> int:
    """The row length the backward's transposed temporaries (rows of ``n`` batch values)
    are stored at: whole blocks of ``ROWS``, so the forward kernel copies a last partial
    block's columns as it copies the others (the lanes past ``n`` zeroed), plus 16 lanes,
    so that rows are an odd number of cache lines apart: the line-per-row copies into the
    transposed input then spread over the cache's sets (MNIST's 256 x 784 batch: 29 ->
    21 us; at 1 KB apart they all fell into 1/16 of them)."""
    return -(-n // ROWS) * ROWS + 16


def _grad_x(weight: SparseTensor, gt: torch.Tensor, n: int, ld: int) -> torch.Tensor:
    """``dx = g W`` (n x k) from the transposed output gradient ``gt`` (m rows ``ld``
    apart), by the forward kernel on ``W^T``'s CSR pattern (kept, ``relaid.py``) and
    ``W``'s values gathered into its order (read through the permutation instead, once
    per block of rows, the scattered reads cost more than the gather: 146 against 96 us
    for the MNIST decoder)."""
    (m, k), fmt = weight._size, transposed_format(weight._format)
    found = relaid_pattern(weight, fmt)
    if found is None:   # (arrays or values of a tensor subclass: converted whole)
        t = relaid(weight, fmt)
        pos, crd, values = t._pos1, t._crd1, t._values
    else:
        arrays, perm = found
        pos, crd, values = arrays["pos1"], arrays["crd1"], gather(weight._values, perm)
    return _launch(_kernel(crd.dtype, crd.dtype), gt, pos, crd, values, n, m, k, None, None,
                   ldt=ld)


# The backward's temporaries (the output gradient through the activation and transposed,
# the input transposed), each kept per Python thread up to _KEEP_ELEMENTS: a fresh 800 KB
# buffer per step came back from the allocator as new pages, ~190 page faults in the MNIST
# autoencoder's step (0.1-0.2 ms).
_GT, _XT = _Scratch(), _Scratch()
_KEEP_ELEMENTS = 1 << 22


def _scratch(kept, size: int) -> torch.Tensor:
    """A float32 buffer of at least ``size`` elements (flat: the kernels take pointers)."""
    if size > _KEEP_ELEMENTS:
        return torch.empty(size, dtype=torch.float32)
    return kept.get(torch.float32, size)


def _records(x, values, bias) -> bool:
    """Whether autograd records the product (a gradient wanted for ``values``, ``bias`` or a
    dense ``x``)."""
    return torch.is_grad_enabled() and (
        values.requires_grad or (bias is not None and bias.requires_grad)
        or type(x) is not SparseTensor and x.requires_grad)


def _kernel_for(x, weight, bias, activation, values):
    """The kernel for these operands (``values`` in place of ``weight``'s), or None where
    einsum runs (and checks and reports every bad operand)."""
    if (_is_compiling() or type(weight) is not SparseTensor or weight._format.name != "csr"
            or activation not in _ACTIVATIONS or backend() != "c"):
        return None
    m, k = weight._size
    if k == 0 or m == 0:   # (a dense x's null pointer would read as "x is CSR rows")
        return None
    if type(x) is SparseTensor:
        if (x._format.name != "csr" or len(x._size) != 2 or not _plain(x._values)
                or x._values.requires_grad or x._values.numel() != x._crd1.numel()):
            return None   # (values replaced by another count: einsum says so)
        rows, x_index = x._size, x._crd1.dtype
    elif type(x) is torch.Tensor and x.dim() == 2 and _plain(x):
        rows, x_index = x.shape, weight._crd1.dtype
    else:
        return None
    least = 1 if _records(x, values, bias) else MIN_ROWS
    if rows[0] < least or rows[1] != k or not _plain(weight._values):
        return None
    if bias is not None and (not isinstance(bias, torch.Tensor) or not _plain(bias)
                             or bias.shape != (m,)):
        return None
    return _kernel(weight._crd1.dtype, x_index)


def _plain(t) -> bool:
    """A contiguous float32 CPU tensor."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


@lru_cache(maxsize=None)
def _kernel(index_dtype: torch.dtype, x_index_dtype: torch.dtype):
    """The forward kernel for these index dtypes (W's, x's) on this CPU's vector ISA; None
    without AVX2 or a C compiler."""
    fns = _library(vector_isa())
    if fns is None or index_dtype not in _INDEX or x_index_dtype not in _INDEX:
        return None
    return fns[f"st_sparse_linear_{_INDEX[index_dtype]}_{_INDEX[x_index_dtype]}"]


@lru_cache(maxsize=None)
def _library(isa):
    """Every entry of ``_source(isa)`` by name; None for no ISA or no C compiler."""
    if isa is None:
        return None
    I, P = runtime.I64, runtime.PTR
    entries = {"st_activation_grad_t": [I, I, P, P, I, P, I, P, I],
               "st_rows_dense_transposed": [I, I, P, P, I, I]}
    for w in _INDEX.values():
        entries[f"st_linear_grad_values_{w}"] = [I, I, P, P, P, P, P, I, P, P, I, I, I]
        entries[f"st_rows_transposed_{w}"] = [I, I, P, P, P, P, I, P, I]
        for xw in _INDEX.values():
            entries[f"st_sparse_linear_{w}_{xw}"] = [I, I, I] + [P] * 7 + [I, P, I, P, P, I]
    try:
        return runtime.load_entries(_source(isa), entries)
    except runtime.KernelBuildError:
        return None
