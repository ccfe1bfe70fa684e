"""C helpers of the intrinsics rendering (``vector.py``), as source text: lane masks,
horizontal adds and AVX2's scalar-load gathers per ISA (``prelude``), and the sorting
networks that order a sparse result row's cells (``SORT_PRELUDE`` for AVX-512,
``SORT_PRELUDE_AVX2``; used by ``c.py``'s "dense_sort"). Each is pasted once into a kernel
that calls it.

Example:
    >>> "st_gather_ps_i32" in prelude("avx2"), "st_mask16" in prelude("avx512")
    (True, True)
"""
from __future__ import annotations

# Helpers of every ISA, then of each (``prelude``).
PRELUDE = """\
#include <immintrin.h>
/* e^x in each lane (st_exp_ps*, st_exp_pd* below): x clamped to where e^x is neither 0 nor
   inf in float or double (a NaN passes: min and max return their second operand when one is
   NaN), x = n ln2 + r with n rounded and ln2 in two parts (n ln2 exact, |r| <= ln2 / 2), e^r
   by Cephes' degree-6 polynomial (float, ~1 ulp) or Taylor's to degree 13 (double: the
   next term, r^14 / 14!, is under 1e-17), then times 2^n by SCALE (which gives 0 and inf
   past the range). Memory traffic: none; ~20 (float) or ~27 (double) vector operations. */
#define ST_EXP_PS_BODY(P, ROUND, SCALE)                                               \
  x = P##_max_ps(P##_set1_ps(-104.0f), P##_min_ps(P##_set1_ps(89.0f), x));           \
  const __typeof__(x) n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));   \
  __typeof__(x) r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                  \
  r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                              \
  __typeof__(x) y = P##_set1_ps(1.9875691500e-4f);                                    \
  y = P##_fmadd_ps(y, r, P##_set1_ps(1.3981999507e-3f));                             \
  y = P##_fmadd_ps(y, r, P##_set1_ps(8.3334519073e-3f));                             \
  y = P##_fmadd_ps(y, r, P##_set1_ps(4.1665795894e-2f));                             \
  y = P##_fmadd_ps(y, r, P##_set1_ps(1.6666665459e-1f));                             \
  y = P##_fmadd_ps(y, r, P##_set1_ps(5.0000001201e-1f));                             \
  y = P##_fmadd_ps(y, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));          \
  return SCALE(y, n);
#define ST_EXP_PD_BODY(P, ROUND, SCALE)                                               \
  x = P##_max_pd(P##_set1_pd(-746.0), P##_min_pd(P##_set1_pd(710.0), x));            \
  const __typeof__(x) n = ROUND(P##_mul_pd(x, P##_set1_pd(1.4426950408889634074)));  \
  __typeof__(x) r = P##_fnmadd_pd(n, P##_set1_pd(6.93145751953125e-1), x);           \
  r = P##_fnmadd_pd(n, P##_set1_pd(1.42860682030941723212e-6), r);                    \
  __typeof__(x) y = P##_set1_pd(1.0 / 6227020800.0);                                  \
  static const double st_inv_fact[13] = {1.0 / 479001600.0, 1.0 / 39916800.0,        \
      1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,      \
      1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};                             \
  for (int64_t st_k = 0; st_k < 13; st_k++)                                           \
    y = P##_fmadd_pd(y, r, P##_set1_pd(st_inv_fact[st_k]));                          \
  return SCALE(y, n);
#define ST_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ST_ROUND256_PS(v) _mm256_round_ps((v), ST_NEAREST)
static inline float st_hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* The largest lane (maximum reductions), halving as st_hsum256 does. */
static inline float st_hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline double st_hmax256d(__m256d v) {
  __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
}
"""

AVX512_PRELUDE = """\
/* e^x (see PRELUDE): scalef multiplies by 2^n with exp's underflow and overflow. */
#define ST_ROUND512_PS(v) _mm512_roundscale_ps((v), ST_NEAREST)
#define ST_ROUND512_PD(v) _mm512_roundscale_pd((v), ST_NEAREST)
static inline __m512 st_exp_ps512(__m512 x) {
  ST_EXP_PS_BODY(_mm512, ST_ROUND512_PS, _mm512_scalef_ps)
}
static inline __m256 st_exp_ps256(__m256 x) {
  ST_EXP_PS_BODY(_mm256, ST_ROUND256_PS, _mm256_scalef_ps)
}
static inline __m512d st_exp_pd512(__m512d x) {
  ST_EXP_PD_BODY(_mm512, ST_ROUND512_PD, _mm512_scalef_pd)
}
static inline __mmask16 st_mask16(int64_t r) {
  return r >= 16 ? (__mmask16)0xFFFF : r <= 0 ? (__mmask16)0 : (__mmask16)((1u << r) - 1u);
}
static inline __mmask8 st_mask8(int64_t r) {
  return r >= 8 ? (__mmask8)0xFF : r <= 0 ? (__mmask8)0 : (__mmask8)((1u << r) - 1u);
}

/* The four sums of a, b, c, d in one register: halves, then quarters, of the four added
   pairwise across registers, then the four lanes within each quarter. */
static inline __m128 st_hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44),
                                  _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44),
                                  _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88),
                           _mm512_shuffle_f32x4(ab, cd, 0xDD));   /* a | b | c | d */
  q = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));
  q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), q));
}
"""

AVX2_PRELUDE = """\
/* e^x (see PRELUDE): 2^n as two factors of 2^(n/2), each a normal number built in the
   exponent bits, so the product underflows and overflows as e^x does. */
#define ST_ROUND256_PD(v) _mm256_round_pd((v), ST_NEAREST)
static inline __m256 st_pow2_ps256(__m256 y, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(k, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(k, h), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, a), b);
}
static inline __m256d st_pow2_pd256(__m256d y, __m256d n) {
  const __m128i k = _mm256_cvtpd_epi32(n), h = _mm_srai_epi32(k, 1);
  const __m256i bias = _mm256_set1_epi64x(1023);
  const __m256d a = _mm256_castsi256_pd(_mm256_slli_epi64(
      _mm256_add_epi64(_mm256_cvtepi32_epi64(h), bias), 52));
  const __m256d b = _mm256_castsi256_pd(_mm256_slli_epi64(
      _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm_sub_epi32(k, h)), bias), 52));
  return _mm256_mul_pd(_mm256_mul_pd(y, a), b);
}
static inline __m256 st_exp_ps256(__m256 x) {
  ST_EXP_PS_BODY(_mm256, ST_ROUND256_PS, st_pow2_ps256)
}
static inline __m256d st_exp_pd256(__m256d x) {
  ST_EXP_PD_BODY(_mm256, ST_ROUND256_PD, st_pow2_pd256)
}
/* Lane masks (all ones in lanes [0, r)) for maskload and maskstore: 8 x 32-bit
   lanes (float, int32 indices) and 4 x 64-bit lanes (double). */
static inline __m256i st_vmask8(int64_t r) {
  const int32_t k = r >= 8 ? 8 : r <= 0 ? 0 : (int32_t)r;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __m256i st_vmask4(int64_t r) {
  const int64_t k = r >= 4 ? 4 : r <= 0 ? 0 : r;
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(k), _mm256_setr_epi64x(0, 1, 2, 3));
}
/* Lanes [0, r) of p = base + i (0 < r < a register's lanes; the others undefined: every
   reader masks them) without maskload, which ran 2.3x slower than a plain load on AMD Zen
   in an SpMM's loop over stored entries (7 columns): where the register ending at p + r
   starts inside the array (i + r >= lanes; p[r - 1] is an element), that load, its lanes
   moved down by lanes - r; else (the array's first elements) maskload. */
static inline __m256 st_tail_load_ps256(const float* base, int64_t i, int64_t r,
                                        __m256i m) {
  if (i + r >= 8) {
    const __m256i down = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32((int32_t)(8 - r)));
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(base + i + r - 8), down);
  }
  return _mm256_maskload_ps(base + i, m);
}
static inline __m256d st_tail_load_pd256(const double* base, int64_t i, int64_t r,
                                         __m256i m) {
  if (i + r >= 4) {   /* 64-bit lane l takes 32-bit lanes 2l, 2l + 1 from l + 4 - r */
    const __m256i down = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32((int32_t)(2 * (4 - r))));
    return _mm256_castps_pd(_mm256_permutevar8x32_ps(
        _mm256_castpd_ps(_mm256_loadu_pd(base + i + r - 4)), down));
  }
  return _mm256_maskload_pd(base + i, m);
}
/* Lanes [0, r) of v to p (0 < r < a register's lanes) by plain stores of 4, 2 and 1
   lanes as r's bits ask: maskstore, which it replaces, is microcoded on AMD Zen before
   Zen 4 (a register's partial tile stored once per row of a narrow SpMM). */
static inline void st_tail_store_ps256(float* p, __m256 v, int64_t r) {
  __m128 x = _mm256_castps256_ps128(v);
  if (r & 4) { _mm_storeu_ps(p, x); x = _mm256_extractf128_ps(v, 1); p += 4; }
  if (r & 2) { _mm_storel_pi((__m64*)p, x); x = _mm_movehl_ps(x, x); p += 2; }
  if (r & 1) _mm_store_ss(p, x);
}
static inline void st_tail_store_pd256(double* p, __m256d v, int64_t r) {
  __m128d x = _mm256_castpd256_pd128(v);
  if (r & 2) { _mm_storeu_pd(p, x); x = _mm256_extractf128_pd(v, 1); p += 2; }
  if (r & 1) _mm_store_sd(p, x);
}
static inline double st_hsum256d(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
/* The four sums of a, b, c, d in one register: pairwise horizontal adds within each
   128-bit half (a0+a1, a2+a3, b0+b1, ...; then a0-3, b0-3, c0-3, d0-3), then the halves. */
static inline __m128 st_hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}
/* x[c[0]], ..., x[c[L-1]] by scalar loads, for int32 or int64 indices c: AVX2's gather
   instructions ran 1.3-1.7x slower than this on AMD Zen 3 (SpMV rows of 17-614 entries,
   one thread). int32 indices are read in pairs, one 64-bit load split by a shift (x86 is
   little-endian, so the low half is c[0]; indices are validated non-negative): loads, not
   arithmetic, bound this loop, and the pairs made SpMV 1.06x faster (geomean over 70
   SuiteSparse and DLMC matrices, one thread; 1.1-1.2x on DLMC rows of 50-900 entries). */
static inline __m256 st_gather_ps_i32(const float* x, const int32_t* c) {
  uint64_t a, b, d, e;
  memcpy(&a, c, 8); memcpy(&b, c + 2, 8); memcpy(&d, c + 4, 8); memcpy(&e, c + 6, 8);
  return _mm256_setr_ps(x[(uint32_t)a], x[a >> 32], x[(uint32_t)b], x[b >> 32],
                        x[(uint32_t)d], x[d >> 32], x[(uint32_t)e], x[e >> 32]);
}
static inline __m256 st_gather_ps_i64(const float* x, const int64_t* c) {
  return _mm256_setr_ps(x[c[0]], x[c[1]], x[c[2]], x[c[3]], x[c[4]], x[c[5]], x[c[6]], x[c[7]]);
}
static inline __m256d st_gather_pd_i32(const double* x, const int32_t* c) {
  uint64_t a, b;
  memcpy(&a, c, 8); memcpy(&b, c + 2, 8);
  return _mm256_setr_pd(x[(uint32_t)a], x[a >> 32], x[(uint32_t)b], x[b >> 32]);
}
static inline __m256d st_gather_pd_i64(const double* x, const int64_t* c) {
  return _mm256_setr_pd(x[c[0]], x[c[1]], x[c[2]], x[c[3]]);
}
"""

# Sorting a row's touched workspace cells (SpGEMM's fill pass, ``c.py``'s "dense_sort")
# when it holds 6-64 of them: a bitonic network, 16 keys per register, branch-free.
# Insertion sort mispredicts on irregular rows (power grids, circuits); the network costs
# the same for any order: 45-70 ns for 16-32 random keys against 270-600 ns (a C
# microbenchmark here), and for 33-64 keys less than the bitmap scan or quicksort.
# Workspace cells are below ``lower.MAX_WORKSPACE`` (2^24), so the keys narrow to int32
# exactly (padding: INT32_MAX). ``st_sorted32`` first tests for a list already in order,
# which banded matrices hand over (insertion sort was linear on them).
SORT_PRELUDE = """\
#include <immintrin.h>
/* Bitonic network on 16 int32 lanes: stage s pairs lane i with st_bitonic_idx[s][i];
   lanes set in st_bitonic_max[s] keep the larger key. Stages 0-9 sort 16 keys, stages
   10-13 turn a bitonic sequence of 16 into ascending order. */
static const int32_t st_bitonic_idx[14][16] __attribute__((aligned(64))) = {
  {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
  {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
  {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
  {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
  {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
  {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
  {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
  {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
  {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
  {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
  {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
  {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
  {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
  {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
};
static const uint16_t st_bitonic_max[14] = {0x6666, 0x3c3c, 0x5a5a, 0x0ff0, 0x33cc, 0x55aa,
                                             0xff00, 0xf0f0, 0xcccc, 0xaaaa,
                                             0xff00, 0xf0f0, 0xcccc, 0xaaaa};
static inline __m512i st_bitonic(__m512i v, int first, int last) {
  for (int s = first; s < last; s++) {
    const __m512i p = _mm512_permutexvar_epi32(_mm512_load_si512(st_bitonic_idx[s]), v);
    v = _mm512_mask_blend_epi32((__mmask16)st_bitonic_max[s], _mm512_min_epi32(v, p),
                                _mm512_max_epi32(v, p));
  }
  return v;
}
/* Keys a[0, n) (n <= 16, each below 2^31) as int32 lanes, INT32_MAX past n; and back. */
static inline __m512i st_keys16(const int64_t* a, int64_t n) {
  const __m512i pad = _mm512_set1_epi64(0x7FFFFFFF);
  const int64_t n1 = n < 8 ? n : 8, n2 = n - n1;
  const __m256i lo = _mm512_cvtepi64_epi32(
      _mm512_mask_loadu_epi64(pad, (__mmask8)((1u << n1) - 1u), a));
  const __m256i hi = _mm512_cvtepi64_epi32(
      _mm512_mask_loadu_epi64(pad, (__mmask8)((1u << n2) - 1u), a + 8));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline void st_store_keys16(int64_t* a, int64_t n, __m512i v) {
  const int64_t n1 = n < 8 ? n : 8, n2 = n - n1;
  _mm512_mask_storeu_epi64(a, (__mmask8)((1u << n1) - 1u),
                           _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)));
  _mm512_mask_storeu_epi64(a + 8, (__mmask8)((1u << n2) - 1u),
                           _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
}
/* Whether a[0, n) is ascending, 2 <= n <= 32: each key against its successor. */
static inline int st_sorted32(const int64_t* a, int64_t n) {
  const int64_t m = n - 1 < 16 ? n - 1 : 16;
  __mmask16 down = _mm512_mask_cmpgt_epi32_mask((__mmask16)((1u << m) - 1u),
                                                st_keys16(a, m), st_keys16(a + 1, m));
  if (n > 17)
    down |= _mm512_mask_cmpgt_epi32_mask((__mmask16)((1u << (n - 17)) - 1u),
                                         st_keys16(a + 16, n - 17), st_keys16(a + 17, n - 17));
  return down == 0;
}
static inline __m512i st_reversed16(__m512i v) {
  return _mm512_permutexvar_epi32(
      _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), v);
}
/* A bitonic sequence of 32 keys in (*lo, *hi) into ascending order: the lower 16 by min,
   the upper 16 by max, each a bitonic 16. */
static inline void st_merge32(__m512i* lo, __m512i* hi) {
  const __m512i l = _mm512_min_epi32(*lo, *hi), h = _mm512_max_epi32(*lo, *hi);
  *lo = st_bitonic(l, 10, 14);
  *hi = st_bitonic(h, 10, 14);
}
/* Sort a[0, n), 2 <= n <= 32, keys below 2^31: two sorted registers, the second reversed
   (ascending then descending is bitonic), merged. */
static inline void st_sort32(int64_t* a, int64_t n) {
  if (n <= 16) {
    st_store_keys16(a, n, st_bitonic(st_keys16(a, n), 0, 10));
    return;
  }
  __m512i x = st_bitonic(st_keys16(a, 16), 0, 10);
  __m512i y = st_reversed16(st_bitonic(st_keys16(a + 16, n - 16), 0, 10));
  st_merge32(&x, &y);
  st_store_keys16(a, 16, x);
  st_store_keys16(a + 16, n - 16, y);
}
/* Sort a[0, n), 33 <= n <= 64: two sorted 32s, the second reversed, split by min/max into
   the lower and upper 32 (each bitonic), each merged. */
static inline void st_sort64(int64_t* a, int64_t n) {
  const int64_t n3 = n - 32 < 16 ? n - 32 : 16, n4 = n - 32 - n3;
  __m512i r0 = st_bitonic(st_keys16(a, 16), 0, 10);
  __m512i r1 = st_reversed16(st_bitonic(st_keys16(a + 16, 16), 0, 10));
  __m512i r2 = st_bitonic(st_keys16(a + 32, n3), 0, 10);
  __m512i r3 = st_reversed16(st_bitonic(st_keys16(a + 48, n4), 0, 10));
  st_merge32(&r0, &r1);
  st_merge32(&r2, &r3);
  const __m512i s2 = st_reversed16(r3), s3 = st_reversed16(r2);
  __m512i l0 = _mm512_min_epi32(r0, s2), l1 = _mm512_min_epi32(r1, s3);
  __m512i h0 = _mm512_max_epi32(r0, s2), h1 = _mm512_max_epi32(r1, s3);
  st_merge32(&l0, &l1);
  st_merge32(&h0, &h1);
  st_store_keys16(a, 16, l0);
  st_store_keys16(a + 16, 16, l1);
  st_store_keys16(a + 32, n3, h0);
  st_store_keys16(a + 48, n4, h1);
}
"""


# The AVX2 counterpart of ``SORT_PRELUDE`` (``c.py``'s "dense_sort_avx2"): a bitonic network
# on 8 int32 lanes per register, up to 8 registers (64 keys). Keys are narrowed into an
# int32 buffer padded with INT32_MAX to 8, 16, 32 or 64 and sorted there (scalar copies:
# building the registers by masked loads measured slower). C microbenchmark here (AMD Zen
# 3), random keys: 12-23 ns for 8-16 keys, 100 ns for 24-32, 245 ns for 48-64, against
# 60-200, 300-590 and 800-1600 ns by insertion sort. The network costs the same on keys
# nearly in order, which insertion sort takes in linear time, so ``st_sort_avx2`` counts
# the places where the keys fall first: none, done; one, insertion sort.
SORT_PRELUDE_AVX2 = """\
#include <immintrin.h>
/* One compare-exchange stage on 8 int32 lanes: partner lanes P (a shuffle of v), lanes in
   the immediate mask M keep the larger key. */
#define ST_CX8(v, P, M) do { const __m256i p_ = (P); \\
  v = _mm256_blend_epi32(_mm256_min_epi32(v, p_), _mm256_max_epi32(v, p_), M); } while (0)
#define ST_X1(v) _mm256_shuffle_epi32(v, 0xB1)
#define ST_X2(v) _mm256_shuffle_epi32(v, 0x4E)
#define ST_X4(v) _mm256_permute4x64_epi64(v, 0x4E)
/* A bitonic sequence of 8 keys into ascending order; 8 keys sorted. */
static inline __m256i st_merge8(__m256i v) {
  ST_CX8(v, ST_X4(v), 0xf0); ST_CX8(v, ST_X2(v), 0xcc); ST_CX8(v, ST_X1(v), 0xaa);
  return v;
}
static inline __m256i st_sort8(__m256i v) {
  ST_CX8(v, ST_X1(v), 0x66); ST_CX8(v, ST_X2(v), 0x3c); ST_CX8(v, ST_X1(v), 0x5a);
  return st_merge8(v);
}
/* r[0, n) (n = 1, 2, 4 or 8, a constant once inlined) sorted as one sequence of 8n keys:
   each register sorted, then runs of w/2 registers merged pairwise into runs of w (the
   second run reversed makes the pair bitonic; min/max at distance w/2, w/4, ..., then
   each register's bitonic 8). */
static inline void st_sort_regs(__m256i* r, const int n) {
  const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < n; i++) r[i] = st_sort8(r[i]);
  for (int w = 2; w <= n; w *= 2)
    for (int b = 0; b < n; b += w) {
      for (int i = 0; i < w / 4; i++) {
        const __m256i t = r[b + w / 2 + i];
        r[b + w / 2 + i] = r[b + w - 1 - i];
        r[b + w - 1 - i] = t;
      }
      for (int i = b + w / 2; i < b + w; i++) r[i] = _mm256_permutevar8x32_epi32(r[i], reverse);
      for (int h = w / 2; h >= 1; h /= 2)
        for (int i = b; i < b + w; i++)
          if (((i - b) & h) == 0) {
            const __m256i lo = _mm256_min_epi32(r[i], r[i + h]);
            r[i + h] = _mm256_max_epi32(r[i], r[i + h]);
            r[i] = lo;
          }
      for (int i = b; i < b + w; i++) r[i] = st_merge8(r[i]);
    }
}
#define ST_SORT_REGS(N) static void st_sort_regs##N(int32_t* k) { __m256i r[N]; \\
  for (int i = 0; i < N; i++) r[i] = _mm256_loadu_si256((const __m256i*)(k + 8 * i)); \\
  st_sort_regs(r, N); \\
  for (int i = 0; i < N; i++) _mm256_storeu_si256((__m256i*)(k + 8 * i), r[i]); }
ST_SORT_REGS(1) ST_SORT_REGS(2) ST_SORT_REGS(4) ST_SORT_REGS(8)
/* Sort a[0, n), 2 <= n <= 64, keys below 2^31: nothing when in order, insertion sort when
   the keys fall at one place only, else the network. */
static void st_sort_avx2(int64_t* a, int64_t n) {
  int64_t falls = 0;
  for (int64_t i = 1; i < n; i++) falls += a[i - 1] > a[i];
  if (falls == 0) return;
  if (falls == 1) {
    for (int64_t i = 1; i < n; i++) {
      const int64_t v = a[i];
      int64_t j = i - 1;
      while (j >= 0 && a[j] > v) { a[j + 1] = a[j]; j--; }
      a[j + 1] = v;
    }
    return;
  }
  int32_t k[64];
  const int64_t m = n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : 64;
  for (int64_t i = 0; i < n; i++) k[i] = (int32_t)a[i];
  for (int64_t i = n; i < m; i++) k[i] = 0x7FFFFFFF;
  if (m == 8) st_sort_regs1(k);
  else if (m == 16) st_sort_regs2(k);
  else if (m == 32) st_sort_regs4(k);
  else st_sort_regs8(k);
  for (int64_t i = 0; i < n; i++) a[i] = k[i];
}
"""

def prelude(isa: str) -> str:
    """The helpers vector loops of ``isa`` use (masks, horizontal adds, gathers)."""
    return PRELUDE + (AVX512_PRELUDE if isa == "avx512" else AVX2_PRELUDE)
