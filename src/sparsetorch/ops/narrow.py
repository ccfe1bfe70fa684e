"""``spmm_narrow``: ``activation(W @ X + bias)`` for a CSR ``W`` and a dense ``X`` of at most
256 columns (1024 on AVX-512 CPUs: ``max_columns()``), the 1x1 convolutions of a ConvNet's
late layers (28 x 28 = 784, 14 x 14 = 196 and 7 x 7 = 49 pixels at batch 1), and of any
width split by columns (the early layers, below).

The generated SpMM kernel tiles ``X``'s columns into register tiles of 32 (AVX2), so 49
columns take two passes over each row's stored entries: a full tile and a 17-column one
under masks and blends, each a few FMA chains that wait on their latency; a 1024 x 1024
layer at 90% sparsity ran at ~40 cycles per stored entry, 1.8x dense ``conv2d``. Here a
row's columns go in chunks of 64 held in registers, one pass over the row's entries per
chunk: ``ceil(width / 8)`` accumulators (seven for 49 columns: independent chains that
cover the FMA latency), each stored weight broadcast once and multiplied into its row of
``X`` (a chunk's last vector reads on into the next row, lanes never stored; under a mask
only at the end of ``X``). The bias starts the accumulators and the activation is applied
as they are stored. Memory traffic: ``W``'s arrays read once per chunk, one row segment of
``X`` per stored entry and chunk (``X``, at most 256 columns x the input channels, mostly
stays in L2), the result written once. Parallel strategy: output rows split statically
across threads (MobileNet's rows hold equally many entries); or, given ``band`` (an image
row's width), the columns in whole bands of it, thread t taking the pixels that
``depthwise3x3``'s thread t wrote (its rows split, ``depthwise.ROW_SPLIT_PIXELS``), so
that each reads its input from its own core's cache. Measured on AMD Zen (AVX2,
one thread, 90% sparsity) against the generated kernel: 2.2x at 49 columns, 1.1-1.3x at
196; at 784 and more columns it was as often slower, so those stay with einsum unless
split in bands. On AVX-512 CPUs, past 64 columns, chunks are up to 256 columns in 16-lane
registers, up to 16 of them (Sapphire Rapids, 2 threads, against the 8-lane chunks of 64:
1.04-1.13x at 196 columns, one pass over a row's entries instead of four; 1.3-1.5x from
784 on); the 49 columns of 7 x 7 keep the 8-lane kernel, whose 7 accumulators cover the
FMA latency where four 16-lane ones do not. At 56 x 56 split in bands: 1.26-1.33x einsum.
Rows of ``X`` whose length is not a whole number of vectors (196 or 49 columns) are first
copied into each thread's scratch a whole number of vectors apart, so that no vector load
straddles two cache lines (such a load costs two): MobileNet v1's 512 x 512 layers at 14 x 14
went from 167 to 125 us in the model (2 threads), the copy included; each thread copies all
rows, as it reads them all and a shared copy would leave half of them in the other core's
cache.

On CPUs with AVX2 and not AVX-512, weights of many input channels (384 and more, or 256
read 40 times each: ``_STRIP_FROM``) run a second kernel instead, at any width, split in
bands or not: strips of 32 columns, each packed into its thread's scratch as whole cache
lines before the rows are computed from it (``_STRIPS``): MobileNet v1's 1x1 layers at 14 x
14 ran 1.16-1.25x the chunks (2 threads, AMD Zen 3), its 28 x 28 ones 1.24x einsum.

Used for float32 CPU tensors on AVX2 (or AVX-512) CPUs with the C backend, and only where
no gradient is recorded and ``torch.compile`` is not tracing; everything else is ``st.einsum("oc,cp->op", ...)``, which this
matches up to rounding (the bias is added first here, last there).

Example:
    >>> import torch, sparsetorch as st
    >>> W = st.tensor(torch.randn(8, 16) * (torch.rand(8, 16) < 0.3), format="csr")
    >>> x, b = torch.randn(16, 49), torch.randn(8)
    >>> y = spmm_narrow(W, x, b, "relu")
    >>> torch.allclose(y, torch.relu(W.to_dense() @ x + b[:, None]), atol=1e-5)
    True
"""
from __future__ import annotations

from functools import lru_cache
from string import Template

import torch
from torch import nn

from .. import runtime
from .._modes import refuse_ad_transforms
from ..compiler.kernel import vector_isa
from ..formats import SparseTensor
from .depthwise import STORE_PART_C, _scratch as _buffers, split_rows   # (each thread's buffers)
from .einsum import einsum
from .policy import backend

# Columns up to which the kernel runs unsplit: 8-lane chunks of 64 won against einsum up to
# 14 x 14 = 196 pixels (AMD Zen); on AVX-512 CPUs chunks of 256 also at 28 x 28 = 784 (512
# x 512 at 90%, 2 threads: 0.93-0.96x einsum's time alone; MobileNet v1 frozen 2.91 -> 2.82
# ms, v2 3.02 -> 2.94 ms, the layer's input fresh from the other core)
MAX_COLUMNS = {"avx2": 256, "avx512": 1024}
_ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}
_is_compiling = torch.compiler.is_compiling
_PARALLEL_WORK = 1 << 15   # stored entries x columns below which one thread is as fast

# A row's chunk of columns in ISA registers: for AVX2 8 lanes, the last vector's load masked
# only near x's end; for AVX-512 16 lanes under a k-mask (a masked load does not fault).
_ROWS = {
    "avx2": r"""  const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(width - 8 * (V - 1))),  \
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));     \
  const float* xend = x + k * xs;                                                          \
  for (int64_t o = lo; o < hi; o++) {                                                     \
    __m256 acc[V];                                                                        \
    const __m256 b = _mm256_set1_ps(bias ? bias[o] : 0.0f);                               \
    for (int v = 0; v < V; v++) acc[v] = b;                                               \
    for (int64_t e = pos[o]; e < pos[o + 1]; e++) {                                       \
      const __m256 w = _mm256_set1_ps(val[e]);                                            \
      const float* xr = x + (int64_t)crd[e] * xs + c0;                                    \
      for (int v = 0; v < V - 1; v++)                                                     \
        acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + 8 * v), acc[v]);                 \
      /* past the row's end lie the next rows' values (lanes never stored): only the     \
         last rows of x need the masked load, which costs 15% of the layer when always used */\
      const __m256 tail = xr + 8 * V <= xend ? _mm256_loadu_ps(xr + 8 * (V - 1))           \
                                             : _mm256_maskload_ps(xr + 8 * (V - 1), last); \
      acc[V - 1] = _mm256_fmadd_ps(w, tail, acc[V - 1]);                                  \
    }                                                                                     \
    float* yo = y + o * p + c0;                                                           \
    for (int v = 0; v < V; v++) {                                                         \
      const __m256 t = _mm256_min_ps(_mm256_set1_ps(mx), _mm256_max_ps(_mm256_set1_ps(mn), \
                                                                        acc[v]));          \
      if (8 * v + 8 <= width) _mm256_storeu_ps(yo + 8 * v, t);                            \
      else st_store_part(yo + 8 * v, t, width - 8 * v);                                   \
    }                                                                                     \
  }""",
    "avx512": r"""  const __mmask16 last = (__mmask16)((1u << (width - 16 * (V - 1))) - 1u);              \
  for (int64_t o = lo; o < hi; o++) {                                                     \
    __m512 acc[V];                                                                        \
    const __m512 b = _mm512_set1_ps(bias ? bias[o] : 0.0f);                               \
    for (int v = 0; v < V; v++) acc[v] = b;                                               \
    for (int64_t e = pos[o]; e < pos[o + 1]; e++) {                                       \
      const __m512 w = _mm512_set1_ps(val[e]);                                            \
      const float* xr = x + (int64_t)crd[e] * xs + c0;                                    \
      for (int v = 0; v < V - 1; v++)                                                     \
        acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr + 16 * v), acc[v]);                \
      acc[V - 1] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(last, xr + 16 * (V - 1)),     \
                                   acc[V - 1]);                                           \
    }                                                                                     \
    float* yo = y + o * p + c0;                                                           \
    for (int v = 0; v < V; v++) {                                                         \
      const __m512 t = _mm512_min_ps(_mm512_set1_ps(mx), _mm512_max_ps(_mm512_set1_ps(mn), \
                                                                        acc[v]));          \
      if (16 * v + 16 <= width) _mm512_storeu_ps(yo + 16 * v, t);                         \
      else _mm512_mask_storeu_ps(yo + 16 * v, last, t);                                   \
    }                                                                                     \
  }""",
}
_LANES = {"avx2": 8, "avx512": 16}
# Accumulators a row's chunk may take: of AVX2's 16 registers 8 (the weight and a load
# beside them), of AVX-512's 32, 16 (196 pixels, 13 registers: one pass over the row's
# entries where 8-lane chunks of 64 took four)
_MOST_VECTORS = {"avx2": 8, "avx512": 16}
# Columns up to which the 8-lane kernel runs on AVX-512 CPUs too: one chunk, whose 7-8
# accumulators cover the FMA latency where four 16-lane ones do not (49 columns: the
# 16-lane kernel 0.84-0.97x; 196: 1.04-1.13x; 784 and more: 1.3-1.5x)
_EIGHT_LANES_UP_TO = 64
_STRIP_COLUMNS = 32   # the strip kernel's width (its versions take 1-4 registers: at most 32)
# Where AVX2 CPUs run the strip kernel (``_STRIPS``) instead of the chunks: from this many
# input channels (a chunk of 64 columns then spans 96 KB of L2; 49 and 196 columns, 90%
# sparsity, 2 threads, AMD Zen 3: 1.16-1.25x at 512-1024 channels, 1.16x at 384 with 64
# outputs), or from 256 with 40 stored entries per channel (each packed row read that
# often: 512 x 256 1.15-1.18x; 64-256 outputs lost 3-32%); and, where the chunks do not run
# (more than ``MAX_COLUMNS`` columns not split in bands), instead of einsum from 8 entries
# per channel (784 columns: 1.07-1.44x; 3 per channel 0.89x).
_STRIP_FROM = {"inputs": 384, "reused inputs": 256, "reuse": 40, "reuse over einsum": 8}
_HEADER = r"""/* the narrow CSR SpMM kernels (ops/narrow.py) */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>
/* Both kernels' arguments (one Python call runs either: the strip kernel takes xpad as its
   scratch and ignores xs), and what both compute first: the activation as a clamp [mn, mx]
   (max then min: a NaN passes, as through torch's), and thread t of T's columns [cb, ce):
   all of them, or whole bands of `band` columns, the rest to the last thread. */
#define ST_KERNEL_ARGS(I) int64_t n, int64_t k, int64_t p, const I* pos, const I* crd,     \
    const float* val, const float* x, const float* bias, int64_t act, float* y,            \
    int64_t nt, int64_t band, float* xpad, int64_t xs
#define ST_CLAMP                                                                          \
  const float mn = act ? 0.0f : -__builtin_inff(), mx = act == 2 ? 6.0f : __builtin_inff();
#define ST_BAND_COLUMNS                                                                   \
  const int64_t cb = band ? p / band * t / T * band : 0;                                  \
  const int64_t ce = band ? (t + 1 == T ? p : p / band * (t + 1) / T * band) : p;
""" + STORE_PART_C
_VARIANT = Template(r"""
/* Columns [c0, c0 + width) of rows [lo, hi) of y (V = ceil(width / $LANES) vectors, a constant
   so the accumulators live in registers) = clamp(W x + bias, mn, mx); x is k x p, its rows
   xs apart, y's p apart. */
#define ST_ROWS$LANES(V, I)                                                                    \
static void st_rows$LANES##_##V##_##I(int64_t lo, int64_t hi, int64_t c0, int64_t width,          \
    int64_t k, int64_t p, int64_t xs, const I* pos,                                       \
    const I* crd, const float* val, const float* x, const float* bias, float mn, float mx,   \
    float* y) {                                                                           \
$ROWS                                                                                     \
}
#undef ST_ARGS
#define ST_ARGS lo, hi, c0, width, k, p, xs, pos, crd, val, xa, bias, mn, mx, y
#define ST_NARROW$LANES(I)                                                                     \
$DEFINE_ROWS                                                                      \
void st_spmm_lanes$LANES##_##I(ST_KERNEL_ARGS(I)) {                                     \
  ST_CLAMP                                                                                \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                      \
  {                                                                                       \
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                    \
    /* given xpad: each thread copies all of x's rows into its own k x xs part of it, the \
       pad zeroed (lanes never stored, but a denormal there would slow the FMAs) */       \
    float* xo = xpad ? xpad + t * k * xs : 0;                                             \
    if (xo) {                                                                             \
      for (int64_t r = 0; r < k; r++) {                                                   \
        memcpy(xo + r * xs, x + r * p, p * sizeof(float));                                \
        memset(xo + r * xs + p, 0, (xs - p) * sizeof(float));                             \
      }                                                                                   \
    } else xs = p;                                                                        \
    const float* xa = xo ? xo : x;                                                        \
    /* rows [lo, hi) x columns [cb, ce): by rows, or by columns in whole bands */          \
    const int64_t lo = band ? 0 : n * t / T, hi = band ? n : n * (t + 1) / T;             \
    ST_BAND_COLUMNS                                                                       \
    /* chunks of equally many vectors (at most $MOST): 196 columns as 7+6+6+6 vectors, \
       not 8+8+8+1, whose last chunk is one FMA chain waiting on its latency */            \
    const int64_t vectors = (ce - cb + $LANES - 1) / $LANES;                               \
    const int64_t chunks = vectors > $MOST ? (vectors + $MOST - 1) / $MOST : 1;           \
    const int64_t step = (vectors + chunks - 1) / chunks * $LANES;                         \
    for (int64_t c0 = cb; c0 < ce; c0 += step) {                                          \
    const int64_t width = ce - c0 < step ? ce - c0 : step;                                \
    switch ((width + $LANES - 1) / $LANES) {                                              \
$CASES    }                                                                                     \
    }                                                                                     \
  }                                                                                       \
}
ST_NARROW$LANES(int32_t)
ST_NARROW$LANES(int64_t)
""")

# AVX2 CPUs: strips of at most ``_STRIP_COLUMNS`` columns (32: four 8-lane registers; strips
# of 24, 48 and 64 ran 0.92-0.99x, 0.85-0.95x and 0.70-0.89x as fast on Zen 3), each packed
# first into its thread's scratch (k rows of 8 x V floats, V = the strip's vectors), then
# every output row's strip computed from it, a row's entries alternating between two sets
# of accumulators (four for strips of one or two registers: 4-8 FMA chains cover the
# latency), summed at the end (``CHAINS``; with four registers two sets ran 1.00-1.08x one).
# Packed rows are whole cache lines in one block, where the chunks above read a row's 56-64
# columns out of a 196-wide row (4-5 lines, some half used) from L2. Memory traffic: ``x``
# read once (each thread its strips) and written once into the scratch; the scratch (k x
# 128 bytes: 64 KB for 512 input channels, L2) read once per stored entry and strip; ``W``'s
# arrays read once per strip; ``y`` written once. Parallel strategy: threads split the
# strips (or, given ``band``, each thread the strips of its own bands); fewer strips than
# threads are also split by rows.
_STRIPS = r"""
/* Rows [lo, hi) of y's columns [c0, c0 + width) = clamp(W x + bias, mn, mx), x's columns
   packed into buf (k rows of 8 * V floats); y's rows p apart. */
#define ST_STRIP(V, CHAINS, I)                                                                \
static void st_strip_##V##_##I(int64_t lo, int64_t hi, int64_t c0, int64_t width, int64_t p, \
    const I* pos, const I* crd, const float* val, const float* buf, const float* bias,   \
    float mn, float mx, float* y) {                                                       \
  for (int64_t o = lo; o < hi; o++) {                                                     \
    __m256 acc[CHAINS][V];                                                                \
    for (int v = 0; v < V; v++) {                                                         \
      acc[0][v] = _mm256_set1_ps(bias ? bias[o] : 0.0f);                                  \
      for (int c = 1; c < CHAINS; c++) acc[c][v] = _mm256_setzero_ps();                    \
    }                                                                                     \
    int64_t e = pos[o];                                                                   \
    for (; e + CHAINS <= pos[o + 1]; e += CHAINS)                                         \
      for (int c = 0; c < CHAINS; c++) {                                                  \
        const __m256 w = _mm256_set1_ps(val[e + c]);                                      \
        const float* xr = buf + (int64_t)crd[e + c] * (8 * V);                            \
        for (int v = 0; v < V; v++)                                                       \
          acc[c][v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + 8 * v), acc[c][v]);         \
      }                                                                                   \
    for (; e < pos[o + 1]; e++) {                                                         \
      const __m256 w = _mm256_set1_ps(val[e]);                                            \
      const float* xr = buf + (int64_t)crd[e] * (8 * V);                                  \
      for (int v = 0; v < V; v++)                                                         \
        acc[0][v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + 8 * v), acc[0][v]);           \
    }                                                                                     \
    float* yo = y + o * p + c0;                                                           \
    for (int v = 0; v < V; v++) {                                                         \
      __m256 s = acc[0][v];                                                               \
      for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, acc[c][v]);                   \
      s = _mm256_min_ps(_mm256_set1_ps(mx), _mm256_max_ps(_mm256_set1_ps(mn), s));        \
      if (8 * v + 8 <= width) _mm256_storeu_ps(yo + 8 * v, s);                            \
      else st_store_part(yo + 8 * v, s, width - 8 * v);                                   \
    }                                                                                     \
  }                                                                                       \
}
#define ST_STRIPS(I)                                                                      \
ST_STRIP(1, 4, I) ST_STRIP(2, 4, I) ST_STRIP(3, 2, I) ST_STRIP(4, 2, I)                 \
void st_spmm_strips_##I(ST_KERNEL_ARGS(I)) {                                               \
  ST_CLAMP                                                                                \
  _Pragma("omp parallel num_threads(nt) if(nt > 1)")                                      \
  {                                                                                       \
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                    \
    float* buf = xpad + t * k * SW;   /* (the scratch; SW: _STRIP_COLUMNS) */             \
    /* columns [cb, ce) in strips of SW, cut into units (strip, row group) shared out over \
       `parts` threads: all threads, or given bands this thread alone over its own */     \
    ST_BAND_COLUMNS                                                                       \
    const int64_t parts = band ? 1 : T, me = band ? 0 : t, strips = (ce - cb + SW - 1) / SW; \
    const int64_t groups = strips >= parts || !strips ? 1 : (parts + strips - 1) / strips; \
    int64_t packed = -1;                                                                  \
    for (int64_t u = strips * groups * me / parts;                                        \
         u < strips * groups * (me + 1) / parts; u++) {                                   \
      const int64_t s = u / groups, g = u % groups, c0 = cb + SW * s;                     \
      const int64_t width = ce - c0 < SW ? ce - c0 : SW, V = (width + 7) / 8;             \
      if (s != packed) {   /* the pad zeroed: never stored, but a denormal slows FMAs */  \
        for (int64_t r = 0; r < k; r++) {                                                 \
          memcpy(buf + r * 8 * V, x + r * p + c0, width * sizeof(float));                 \
          memset(buf + r * 8 * V + width, 0, (8 * V - width) * sizeof(float));            \
        }                                                                                 \
        packed = s;                                                                       \
      }                                                                                   \
      const int64_t lo = n * g / groups, hi = n * (g + 1) / groups;                       \
      switch (V) {                                                                        \
        case 1: st_strip_1_##I(lo, hi, c0, width, p, pos, crd, val, buf, bias, mn, mx, y); break; \
        case 2: st_strip_2_##I(lo, hi, c0, width, p, pos, crd, val, buf, bias, mn, mx, y); break; \
        case 3: st_strip_3_##I(lo, hi, c0, width, p, pos, crd, val, buf, bias, mn, mx, y); break; \
        default: st_strip_4_##I(lo, hi, c0, width, p, pos, crd, val, buf, bias, mn, mx, y);     \
      }                                                                                   \
    }                                                                                     \
  }                                                                                       \
}
ST_STRIPS(int32_t)
ST_STRIPS(int64_t)
"""


def _source(isa: str) -> str:
    """Both variants where the CPU has AVX-512 (the 8-lane one for narrow columns: at 49 and
    196 of them its 7-8 accumulators per row beat four or five 16-lane ones, 1.0-1.2x;
    from 784 on the 16-lane one ran 1.3-1.4x faster), else the 8-lane one."""
    isas = ("avx2", "avx512") if isa == "avx512" else ("avx2",)
    strips = f"#define SW {_STRIP_COLUMNS}\n{_STRIPS}" if isa == "avx2" else ""
    return _HEADER + "".join(_variant(i) for i in isas) + strips


def _variant(isa: str) -> str:
    lanes, most = _LANES[isa], _MOST_VECTORS[isa]
    rows = " ".join(f"ST_ROWS{lanes}({v}, I)" for v in range(1, most + 1))
    cases = "".join(f"      {'default' if v == most else f'case {v}'}: "
                    f"st_rows{lanes}_{v}_##I(ST_ARGS); break;".ljust(88) + "\\\n"
                    for v in range(1, most + 1))
    return _VARIANT.substitute(ROWS=_ROWS[isa], LANES=lanes, MOST=most,
                               DEFINE_ROWS=rows, CASES=cases)


def spmm_narrow(weight: SparseTensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None, band: int = 0) -> torch.Tensor:
    """``activation(weight @ x + bias[:, None])``: ``weight`` (m, k) SparseTensor, ``x``
    (k, P) dense, ``bias`` None or (m,), ``activation`` None, ``"relu"`` or ``"relu6"``;
    the (m, P) result. This module's kernel where it applies (see the module docstring),
    else ``st.einsum``. ``band`` > 0: threads split the columns in whole bands of ``band``
    (an image row of the (C, N*H*W) activations), as ``depthwise3x3`` splits its output
    rows, and ``x`` may have any number of columns.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> spmm_narrow(W, torch.full((3, 2), -1.0), torch.ones(3), "relu6").tolist()
        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    """
    refuse_ad_transforms("spmm_narrow", (weight, x, bias))
    if activation not in _ACTIVATIONS:
        raise ValueError(f"spmm_narrow: activation must be one of {tuple(_ACTIVATIONS)}, got "
                         f"{activation!r}")
    if type(band) is not int or band < 0:
        raise ValueError(f"spmm_narrow: band must be an int >= 0 (0: split by rows), got "
                         f"{band!r}")
    run = prepared_spmm_narrow(weight, x, bias, activation, band)
    if run is None:
        return einsum("oc,cp->op", weight, x, bias=None if bias is None else bias[:, None],
                      activation=activation)
    return run(x)


def prepared_spmm_narrow(weight: SparseTensor, x: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None, band: int = 0):
    """``spmm_narrow(weight, ·, bias, activation, band)`` for operands like ``x`` (the same
    shape, strides, dtype and device) as a function of ``x`` alone, every check and choice
    made now; None where ``spmm_narrow`` runs einsum. For callers that repeat a call
    (``st.freeze``): the function trusts its ``x`` to be like this one, and ``weight`` and
    ``bias`` not to change (it holds them).

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> run = prepared_spmm_narrow(W, torch.ones(3, 5), None, None)
        >>> run is None or run(torch.full((3, 5), 2.0)).sum().item() == 30.0
        True
    """
    found = _kernel_for(weight, x, bias, band)
    if found is None:
        return None
    fn, lanes = found
    (m, k), p = weight._size, x.shape[1]
    nt = runtime.num_threads() if weight._crd1.numel() * p >= _PARALLEL_WORK else 1
    # Rows of x a whole number of vectors long, so no load straddles two cache lines (each
    # such load costs two): 196 columns copied 208 apart, 512 x 512 at 90%, the copy
    # included: 1.5x on one thread, 1.35x on two. The strip kernel packs a strip at a time.
    xs = 0 if lanes is None or band or p % lanes == 0 else -(-p // lanes) * lanes
    scratch = nt * k * (_STRIP_COLUMNS if lanes is None else xs)
    arrays = (weight._pos1.data_ptr(), weight._crd1.data_ptr(), weight._values.data_ptr())
    b, act = 0 if bias is None else bias.data_ptr(), _ACTIVATIONS[activation]

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((m, p), dtype=torch.float32)
        xpad = _buffers.get(torch.float32, scratch).data_ptr() if scratch else 0
        fn(m, k, p, *arrays, x.data_ptr(), b, act, out.data_ptr(), nt, band, xpad, xs)
        return out
    run.kept = (weight, bias)   # (their memory stays while the function does)
    return run


def max_columns() -> int:
    """The most columns ``spmm_narrow`` runs its kernel for unsplit on this CPU
    (``MAX_COLUMNS``; 0 where it has no kernel, and while ``torch.compile`` traces: einsum
    runs then, and the cached lookup would break the graph).

    Example:
        >>> max_columns() in (0, 256, 1024)
        True
    """
    return 0 if _is_compiling() else _max_columns()


@lru_cache(maxsize=None)
def _max_columns() -> int:
    return MAX_COLUMNS.get(vector_isa(), 0)


def band_of_rows(pixels: int, w: int) -> int:
    """``spmm_narrow``'s ``band`` for (C, N*H*W) activations of ``pixels`` columns and rows
    of ``w``: ``w`` where ``depthwise3x3`` splits as many output pixels by rows (so each
    thread reads the pixels it wrote), else 0; 0 while ``torch.compile`` traces (einsum
    runs then, and asking torch for its thread count would break the graph).

    Example:
        >>> band_of_rows(7 * 7, 7)
        0
    """
    if _is_compiling():
        return 0
    return w if split_rows(runtime.num_threads(), pixels) else 0


def _kernel_for(weight, x, bias, band):
    """``_kernel``'s for these operands, or None where einsum runs (see the module
    docstring); einsum also checks and reports every bad operand. (The weight's own fields
    are read, not its torch attributes: on the SparseTensor subclass each of those is a
    Python call, and a 7 x 7 layer's kernel takes only tens of microseconds.)"""
    # (compiling first: under torch.compile, reading the weight's Format breaks the graph)
    if _is_compiling() or type(weight) is not SparseTensor or weight._format.name != "csr":
        return None
    values, (m, k) = weight._values, weight._size
    if (type(x) is not torch.Tensor or x.dtype != torch.float32 or x.dim() != 2
            or x.shape[1] == 0
            or x.shape[0] != k or not x.is_cpu
            or not x.is_contiguous() or values.dtype != torch.float32 or not values.is_cpu
            or not values.is_contiguous() or backend() != "c"):
        return None
    if bias is not None and (type(bias) is not torch.Tensor and type(bias) is not nn.Parameter
                             or bias.dtype != torch.float32 or bias.shape != (m,)
                             or not bias.is_contiguous() or not bias.is_cpu):
        return None
    if torch.is_grad_enabled() and (values.requires_grad or x.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    p = x.shape[1]
    chunks_run = band > 0 or p <= max_columns()
    strips = _strips_pay(k, weight._crd1.numel(), chunks_run)
    if not (chunks_run or strips):
        return None
    return _kernel(weight._crd1.dtype, p > _EIGHT_LANES_UP_TO, strips)


def _strips_pay(k: int, nnz: int, chunks_run: bool) -> bool:
    """Whether the strip kernel runs for a weight of ``k`` input channels and ``nnz``
    stored entries (``_STRIP_FROM``), against the chunk kernel where ``chunks_run``, else
    einsum; never on AVX-512 CPUs (measured on AVX2 alone)."""
    if vector_isa() != "avx2":
        return False
    if chunks_run:
        return k >= _STRIP_FROM["inputs"] or (k >= _STRIP_FROM["reused inputs"]
                                              and nnz >= _STRIP_FROM["reuse"] * k)
    return nnz >= _STRIP_FROM["reuse over einsum"] * k


@lru_cache(maxsize=None)
def _kernel(index_dtype: torch.dtype, wide: bool = False, strips: bool = False):
    """``(kernel, its vector's lanes)`` for int32 or int64 index arrays, for at most
    ``_EIGHT_LANES_UP_TO`` columns or more (``wide``: 16 lanes where the CPU has AVX-512);
    ``strips``: the strip kernel where the CPU has AVX2 alone (lanes None), else as
    without. None without AVX2 or a C compiler."""
    isa = vector_isa()
    if isa is None:
        return None
    index = {torch.int32: "int32_t", torch.int64: "int64_t"}[index_dtype]
    I, P = runtime.I64, runtime.PTR
    names = [f"st_spmm_lanes{_LANES[i]}_{index}"
             for i in (("avx2", "avx512") if isa == "avx512" else ("avx2",))]
    names += [f"st_spmm_strips_{index}"] if isa == "avx2" else []
    try:
        fns = runtime.load_entries(_source(isa), {
            name: [I, I, I, P, P, P, P, P, I, P, I, I, P, I] for name in names})
    except runtime.KernelBuildError:
        return None
    if strips and isa == "avx2":
        return fns[f"st_spmm_strips_{index}"], None
    lanes = _LANES[isa if wide else "avx2"]
    return fns[f"st_spmm_lanes{lanes}_{index}"], lanes
