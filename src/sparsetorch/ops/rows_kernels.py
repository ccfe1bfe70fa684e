"""The C text of ``rows.py``'s kernels (``source(isa)``: AVX2 or AVX-512, one library of
every entry the Python side binds): ``activation(x W^T + bias)`` for a CSR weight ``W`` and
a batch ``x`` of dense or CSR rows, and its backward's passes.

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

Training: the backward goes by the same blocks (``rows._Recorded``): the output gradient
through the activation and transposed in one C pass (``gt``), ``dx = g W`` by the forward
kernel on ``W^T``'s CSR arrays (the pattern re-laid once and kept, the values gathered)
copying each block's columns of ``gt`` as they are, ``dvalues`` as dots of ``gt``'s and
the transposed ``x``'s rows at the stored entries (four entries a pass over ``gt``'s
row, eight FMA chains; the rows of ``W``, or of ``W^T`` where ``x`` has more columns
than ``W`` rows, split across threads; a CSR batch's columns with few entries dotted at
those alone).

Activations are passed as ``ACTIVATION_CODES``; each pass's own comment gives its layout,
memory traffic and the measurements behind it.

Example:
    >>> "ST_LINEAR(int32_t, int32_t)" in source("avx2")   # (st_sparse_linear_int32_t_int32_t)
    True
"""
from __future__ import annotations

from string import Template

from ..codegen.intrinsics import prelude
from .transpose import BLOCK4_C

ROWS = 32   # rows of x a block transposes (R in the kernel)
ACTIVATION_CODES = {None: 0, "relu": 1, "relu6": 2, "sigmoid": 3}

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
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t u = 0;
  for (; u + 1 < count; u += 2) {   /* (two entries a trip into twin sums, eight chains:
                                       the MNIST encoder's weight gradient 2-4% faster, Zen 3) */
    const int64_t i = idx[u], j = idx[u + 1];
    for (int r = 0; r < 4; r++) {
      a[r] += g[i] * x[r][i];
      c[r] += g[j] * x[r][j];
    }
  }
  if (u < count)
    for (int r = 0; r < 4; r++) a[r] += g[idx[u]] * x[r][idx[u]];
  for (int r = 0; r < 4; r++) out[r] = a[r] + c[r];
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


def source(isa: str) -> str:
    """The kernels' C text for vector ISA ``isa`` ("avx2" or "avx512")."""
    names = _ISA[isa]

    def fill(text):
        return Template(text).substitute(names)

    column = " \\\n".join(fill(_COLUMN).split("\n"))
    return ("/* the row-block sparse linear kernel (ops/rows.py) */\n#include <stdint.h>\n"
            f"#include <stdlib.h>\n#include <string.h>\n#include <omp.h>\n#define R {ROWS}\n"
            f"#define VR {ROWS // names['N']}\n" + prelude(isa) + BLOCK4_C
            + Template(_LINEAR).substitute(COLUMN=column, SIGMOID=fill(_SIGMOID),
                                           DOTS=fill(_DOTS), **names))
