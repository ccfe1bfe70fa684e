"""``depthwise3x3``: a 3x3 depthwise convolution (stride 1 or 2, padding 1) with the bias and
ReLU/ReLU6 fused, by a C/OpenMP kernel that reads and writes each image's channels as
(H, W) planes in place: the (C, N, H, W) memory ``nn.SparseConv2d`` produces (and plain
NCHW), so no transposing copy around it.

Kernel: each (channel, image) plane is one task; tasks are split statically across
threads (MobileNet layers have 32-1024 planes per image, so every thread gets many); from
``ROW_SPLIT_PIXELS`` output pixels per channel on, the planes' rows are split instead, a
band of every plane to each thread, so that a pixel's channels come from one core, the one
whose thread reads them in the 1x1 convolution after (``spmm_narrow`` splits its columns
the same way; a 24 -> 144 -> 24 block's projection at 56 x 56 read its input 1.5x slower
when half of it sat in the other core's cache). A thread walks its plane's (or band's)
output rows two at a time, top to bottom, holding the input rows
they read as zero-padded rows in a per-thread buffer (the whole plane when it has up to 16
rows, else a ring of five; for stride 2 each row is stored deinterleaved, even and odd
columns apart, so every tap is a unit-stride load); an output row pair is then one loop
over vectors of pixels, the bias added first and the activation applied before the single
store. Memory traffic: the input read once (into the buffer, which stays in L1), the output
written once; filter and bias are ten values per plane. Measured at MobileNet v1/v2's
shapes (batch 1, one thread, float32, AVX2 on AMD Zen 1): 1.3-2.9x PyTorch's NCHW
depthwise kernel (3-7x at 112 x 112) and 0.7-1.9x its channels_last one (which would need
a transposing copy on each side here).

The gradient (``weight``, ``bias`` or ``x`` requiring one) is torch's: the backward runs
``torch.nn.grad.conv2d_input`` / ``conv2d_weight`` on the gradient masked by the
activation's derivative, read from the saved output.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> x, w, b = torch.randn(1, 4, 9, 9), torch.randn(4, 1, 3, 3), torch.randn(4)
    >>> y = depthwise3x3(x, w, b, stride=2, activation="relu6")
    >>> torch.allclose(y, F.relu6(F.conv2d(x, w, b, 2, 1, groups=4)), atol=1e-5)
    True
"""
from __future__ import annotations

import threading
from functools import lru_cache
from string import Template

import torch
import torch.nn.functional as F

from .. import runtime
from .._modes import refuse_ad_transforms
from .policy import backend

ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}
_is_compiling = torch.compiler.is_compiling
_TORCH_ACTIVATION = {None: None, "relu": F.relu, "relu6": F.relu6}

_HEADER = """/* the depthwise 3x3 convolution kernels (ops/depthwise.py) */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
"""
# The kernel for value type $T: the walk over planes and pairs of output rows, with $SETUP
# (per plane: the filter and bias in registers), $FILL1 (a stride-1 input row into the
# ring), $FILL2 (the first j0 column pairs of a stride-2 row, deinterleaved) and $ROW1/$ROW2 (output rows o and o2, stride 1 / stride 2) filled in per variant.
# The rows o reads are a0, a1, a2 and o2's a1 or a2, b1, b2 (padded input rows of filter
# rows 0, 1, 2); for stride 2 each holds its even padded columns and, from rw / 2 on (d*,
# e*), its odd ones.
_WALK = Template(r"""
/* out plane p = depthwise 3x3 (padding 1, stride s) of x plane p with filter and bias of
   channel (p / div) % c, then activation act (0 none, 1 relu, 2 relu6). Planes are h x w
   (output oh x ow), consecutive in memory. scratch: nt x (nr + 2) rows of rw, each
   thread's: a ring of nr padded input rows (nr = h for planes of up to 16 rows, held
   whole, else 5: the rows two output rows read), a zero row and a row that takes an odd
   plane's missing last output row; zeroed here. A padded row is, for stride 1, columns
   -1 .. w, for stride 2 the even padded columns (-1, 1, 3, ...) at 0 and the odd ones
   (0, 2, ...) at rw / 2; rw leaves a vector's room past each. Only the non-padding entries
   are ever written, so the padding stays zero through the call.
   Split across threads (nt): band 0, by planes, thread t taking planes [P t / nt,
   P (t + 1) / nt) whole; band 1 (planes of one channel consecutive, div images each), by
   rows, thread t taking output rows [R t / nt, R (t + 1) / nt) of every channel's R =
   div x oh rows (its images' rows in order: a band of each plane, or none). Every channel
   of a pixel is then written by the thread that reads them in the 1x1 convolution after
   (ops/narrow.py splits its columns the same way), from its own core's cache, not
   another's. A band's plane starts its ring at the band's first input row. */
void $NAME(int64_t planes, int64_t div, int64_t c, int64_t h, int64_t w, int64_t s,
          const $T* restrict x, const $T* restrict wt, const $T* restrict bias,
          int64_t act, $T* restrict out, $T* restrict scratch, int64_t rw, int64_t nr,
          int64_t nt, int64_t band$PARAMS) {
  const int64_t oh = (h - 1) / s + 1, ow = (w - 1) / s + 1;
  /* the activation as a clamp to [lo, hi] (a NaN passes, as through torch's) */
  const $T lo = act ? ($T)0 : -($T)INFINITY, hi = act == 2 ? ($T)6 : ($T)INFINITY;
  #pragma omp parallel num_threads(nt) if(nt > 1)
  {
    $T* ring = scratch + (nr + 2 + $EXTRA_ROWS) * rw * (int64_t)omp_get_thread_num();
    const $T* zero = ring + nr * rw;
    $T* spare = ring + (nr + 1) * rw;
    memset(ring, 0, (size_t)((nr + 2) * rw) * sizeof($T));
    $THREAD
    /* a static split by hand: the channel of the next plane is then counted, not divided
       for (two 64-bit divisions cost a third of a 7 x 7 plane) */
    const int64_t t = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t p0 = band ? 0 : planes * t / nth, p1 = band ? planes : planes * (t + 1) / nth;
    const int64_t g0 = div * oh * t / nth, g1 = div * oh * (t + 1) / nth;   /* (band 1) */
    int64_t ch = (p0 / div) % c, rep = p0 % div;
    for (int64_t p = p0; p < p1; p++, rep = rep + 1 == div ? 0 : rep + 1,
         ch = rep ? ch : ch + 1 == c ? 0 : ch + 1) {
      /* this plane's output rows [i0, i1), which read input rows up to rows_end - 1 */
      int64_t i0 = 0, i1 = oh;
      if (band) {
        i0 = g0 - rep * oh < 0 ? 0 : g0 - rep * oh;
        i1 = g1 - rep * oh > oh ? oh : g1 - rep * oh;
        if (i0 >= i1) continue;
      }
      const int64_t rows_end = (i1 - 1) * s + 2 < h ? (i1 - 1) * s + 2 : h;
      const $T* k = wt + 9 * ch;
      const $T b = bias ? bias[ch] : ($T)0;
      $SETUP
      $PLANE
      $T* op = out + p * oh * ow;
      /* input row r sits in ring slot (r - r0) % nr (r0: the plane's first row read),
         tracked without dividing; row -1 (i0 = 0) is the zero row, as if in the slot
         before r0's */
      const int64_t r0 = i0 ? i0 * s - 1 : 0;
      int64_t filled = r0 - 1, next_slot = 0, top_slot = i0 ? 0 : nr - 1;
      for (int64_t i = i0; i < i1; i += 2) {
        const int64_t top = i * s - 1, need = top + s + 2;   /* o2's last input row */
        const int64_t last = nr == h || need > rows_end - 1 ? rows_end - 1 : need;
        for (; filled < last; filled++) {   /* the next input row into the ring */
          $SOURCE
          $T* dst = ring + next_slot * rw;
          next_slot = next_slot == nr - 1 ? 0 : next_slot + 1;
          if (s == 1) {
            $FILL1
          } else {
            $T* odd = dst + rw / 2;
            int64_t j0 = 0;   /* column pairs already moved (by the vector loop, if any) */
            $FILL2
            for (int64_t j = j0; j < w / 2; j++)   /* (an odd w's last even entry: 0) */
              dst[j + 1] = src[2 * j + 1];
            for (int64_t j = j0; j < ow; j++)
              odd[j] = src[2 * j];
          }
        }
        const $T* r[5];
        for (int64_t a = 0, slot = top_slot; a < 5; a++, slot = slot == nr - 1 ? 0 : slot + 1)
          r[a] = top + a < 0 || top + a >= h ? zero : ring + slot * rw;
        for (top_slot += 2 * s; top_slot >= nr; top_slot -= nr) {}
        const $T *a0 = r[0], *a1 = r[1], *a2 = r[2];
        const $T *b1 = r[s + 1], *b2 = r[s + 2];   /* (o2's first row is one of o's) */
        $T* o = op + i * ow;
        $T* o2 = i + 1 < i1 ? o + ow : spare;
        /* the first element past what a row's last vector may write over without harm:
           for o its own end (o2, stored vector by vector in the same loop, is next), for
           o2 the band's end (the rows after are written later and overwrite a spill into
           them; past the band lie another thread's) or the spare row's */
        const $T* end = o + ow;
        const $T* end2 = i + 1 < i1 ? op + i1 * ow : spare + rw;
        (void)end; (void)end2;
        if (s == 1) {
          $ROW1
        } else {
          const $T *d0 = a0 + rw / 2, *d1 = a1 + rw / 2, *d2 = a2 + rw / 2;
          const $T *e1 = b1 + rw / 2, *e2 = b2 + rw / 2;
          $ROW2
        }
      }
    }
  }
}
""")
# Each row's taps, filter entry by filter entry: (row pointer, odd-column pointer) of
# filter rows 0-2 for output rows o and o2, by stride. o2 names the rows it shares with o
# by o's pointers (b0 = a1 for stride 1, b0 = a2 for stride 2), so the compiler loads each
# shared vector once for both rows.
_ROWS = {("o", 1): ("a0", "a1", "a2"), ("o2", 1): ("a1", "a2", "b2"),
         ("o", 2): ("a0", "a1", "a2", "d0", "d1", "d2"),
         ("o2", 2): ("a2", "b1", "b2", "d2", "e1", "e2")}


def _taps(out: str, stride: int) -> list[str]:
    """The nine ``pointer + offset`` expressions (offset from output pixel ``j``) of output
    row ``out``, in filter order."""
    rows = _ROWS[out, stride]
    if stride == 1:
        return [f"{rows[a]} + j + {kw}" for a in range(3) for kw in range(3)]
    return [t for a in range(3) for t in (f"{rows[a]} + j", f"{rows[3 + a]} + j",
                                          f"{rows[a]} + j + 1")]


def _generic_row(t: str, fma: str, stride: int) -> str:
    """Portable rows: the compiler vectorises each output row (any ISA, float and double)."""
    loops = []
    for out in ("o", "o2"):
        v = "b"
        for n, tap in enumerate(_taps(out, stride)):
            v = f"{fma}(k[{n}], *({tap}), {v})"
        loops.append("#pragma omp simd\n          for (int64_t j = 0; j < ow; j++) {\n"
                     f"            const {t} v = {v};\n"
                     f"            {out}[j] = v > hi ? hi : v < lo ? lo : v;\n          }}")
    return "\n          ".join(loops)


_MEMCPY = "memcpy(dst + 1, src, (size_t)w * sizeof(*src));"
# AVX2 float rows: 8 output pixels per vector, the nine taps and the bias held in
# registers, six independent chains per pair of vectors (each output row's three filter
# rows): Zen's FP scheduler holds too few operations to overlap the next vector's chains
# by itself, so one chain of nine FMAs left the rows latency bound (2-3x slower). A row's
# last partial vector is stored whole when its spill lands on a row written later (o2's,
# into the rows after), else by 4-, 2- and 1-lane stores: AMD's masked stores are
# microcoded, one cost as much as a 7-pixel row. Input rows are copied by vectors, the last
# under a masked load (zero lanes, which keep the padding); stride-2 rows are deinterleaved
# 16 columns at a time by shuffles.
_AVX2_LANES = "_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)"
_AVX2_SETUP = ("const __m256 K0 = _mm256_set1_ps(k[0]), K1 = _mm256_set1_ps(k[1]), "
               "K2 = _mm256_set1_ps(k[2]), K3 = _mm256_set1_ps(k[3]), K4 = _mm256_set1_ps(k[4]), "
               "K5 = _mm256_set1_ps(k[5]), K6 = _mm256_set1_ps(k[6]), K7 = _mm256_set1_ps(k[7]), "
               "K8 = _mm256_set1_ps(k[8]), B = _mm256_set1_ps(b);")
_AVX2_FILL = ("for (int64_t j = 0; j < w; j += 8) _mm256_storeu_ps(dst + 1 + j, j + 8 <= w ? "
              "_mm256_loadu_ps(src + j) : _mm256_maskload_ps(src + j, _mm256_cmpgt_epi32("
              f"_mm256_set1_epi32((int)(w - j)), {_AVX2_LANES})));")


_AVX2_FILL2 = """for (; 2 * j0 + 16 <= w; j0 += 8) {
              const __m256 lo = _mm256_loadu_ps(src + 2 * j0), hi = _mm256_loadu_ps(src + 2 * j0 + 8);
              /* even and odd source columns of 16, each in order after a lane permute */
              _mm256_storeu_ps(odd + j0, _mm256_castpd_ps(_mm256_permute4x64_pd(
                  _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8)));
              _mm256_storeu_ps(dst + 1 + j0, _mm256_castpd_ps(_mm256_permute4x64_pd(
                  _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8)));
            }"""


def _avx2_row(stride: int) -> str:
    # (two vectors per trip: 1.05x over MobileNet's shapes, mostly stride 2; four: no more)
    lines = ["_Pragma(\"GCC unroll 2\")", "for (int64_t j = 0; j < ow; j += 8) {"]
    for a in range(3):   # filter row a of both output rows, interleaved
        for out, acc in (("o", "u"), ("o2", "v")):
            taps = _taps(out, stride)[3 * a:3 * a + 3]
            v = "B" if a == 0 else None
            for n, tap in zip(range(3 * a, 3 * a + 3), taps):
                load = f"_mm256_loadu_ps({tap})"
                v = (f"_mm256_mul_ps(K{n}, {load})" if v is None
                     else f"_mm256_fmadd_ps(K{n}, {load}, {v})")
            lines.append(f"  const __m256 {acc}{a} = {v};")
    for out, acc, end in (("o", "u", "end"), ("o2", "v", "end2")):
        lines += [f"  {{ __m256 y = _mm256_add_ps(_mm256_add_ps({acc}0, {acc}1), {acc}2);",
                  "    y = _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), y));",
                  f"    if ({out} + j + 8 <= {end}) _mm256_storeu_ps({out} + j, y);",
                  f"    else st_store_part({out} + j, y, ow - j); }}"]
    return "\n          ".join(lines + ["}"])


# The first r (< 8) lanes of a float vector stored by 4-, 2- and 1-lane stores (AMD's masked
# stores are microcoded: one cost as much as a short row); ``narrow.py`` uses it too.
STORE_PART_C = r"""static inline void st_store_part(float* o, __m256 v, int64_t r) {
  __m128 q = _mm256_castps256_ps128(v);
  if (r >= 4) { _mm_storeu_ps(o, q); q = _mm256_extractf128_ps(v, 1); o += 4; r -= 4; }
  if (r >= 2) { _mm_storel_pi((__m64*)o, q); q = _mm_movehl_ps(q, q); o += 2; r -= 2; }
  if (r >= 1) _mm_store_ss(o, q);
}
"""
_AVX2_HEADER = "#include <immintrin.h>\n" + STORE_PART_C


# The walk's input rows: plane p's rows of x, read in place.
_PLAIN_ROWS = {"PARAMS": "", "EXTRA_ROWS": "0", "THREAD": "",
               "PLANE": "const $T* xp = x + p * h * w;",
               "SOURCE": "const $T* src = xp + (filled + 1) * w;"}


def walks(avx2: bool, name: str, rows: dict, index: str = "") -> str:
    """The kernel ``name`` (+ value type, + ``_avx2`` for the intrinsics variant) for float
    and double: the walk with its input rows given by ``rows`` (the ``_WALK`` hooks PARAMS,
    EXTRA_ROWS, THREAD, PLANE and SOURCE, in which ``$T`` is the value type and ``$I``
    ``index``; a hook given as a pair is (portable text, AVX2 float text)).
    ``expand_depthwise.py`` computes its rows instead of reading them.

    Example:
        >>> "void st_depthwise3x3_double(" in walks(False, "st_depthwise3x3", _PLAIN_ROWS)
        True
    """
    parts = []
    for t, fma, intrinsics in (("float", "fmaf", False), ("double", "fma", False),
                               ("float", None, True)):
        if intrinsics and not avx2:
            continue
        hooks = {k: Template(v if isinstance(v, str) else v[1 if intrinsics else 0])
                 .substitute(T=t, I=index) for k, v in rows.items()}
        if intrinsics:
            parts.append(_WALK.substitute(NAME=f"{name}_float_avx2", T=t, SETUP=_AVX2_SETUP,
                                          FILL1=_AVX2_FILL, FILL2=_AVX2_FILL2,
                                          ROW1=_avx2_row(1), ROW2=_avx2_row(2), **hooks))
        else:
            parts.append(_WALK.substitute(NAME=f"{name}_{t}", T=t, SETUP="", FILL1=_MEMCPY,
                                          FILL2="", ROW1=_generic_row(t, fma, 1),
                                          ROW2=_generic_row(t, fma, 2), **hooks))
    return "".join(parts)


def header(avx2: bool) -> str:
    """The includes and helpers ``walks``' kernels need (with the AVX2 store helper)."""
    return _HEADER + (_AVX2_HEADER if avx2 else "")


def _source(avx2: bool) -> str:
    return header(avx2) + walks(avx2, "st_depthwise3x3", _PLAIN_ROWS)


_WHOLE_PLANE_ROWS = 16   # planes of up to this many rows are copied whole (the kernel's comment)
_PARALLEL_OUTPUTS = 1 << 14   # below (a 7x7 layer of 256 channels): one thread is as fast
# Output pixels per channel (N x OH x OW) from which walks split by rows, and 1x1
# convolutions by columns. Each (plane, band) costs the walk ~0.2 us (2 threads, Sapphire
# Rapids), so splitting by rows doubles that: at 28 x 28 it cost what the projection after
# gained; at 56 x 56 and up a depthwise + 1x1 pair ran 1.1-1.3x faster.
ROW_SPLIT_PIXELS = 56 * 56


def depthwise3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 stride: int = 1, activation: str | None = None) -> torch.Tensor:
    """``activation(F.conv2d(x, weight, bias, stride, padding=1, groups=C))`` for ``x``
    (N, C, H, W) and ``weight`` (C, 1, 3, 3). The result has ``x``'s memory layout: (C, N,
    H, W) memory in, (C, N, OH, OW) memory out (``nn.SparseConv2d``'s), else NCHW. Run by
    this module's kernel for float32/float64 CPU tensors whose memory is (C, N, H, W) or
    NCHW (under the C backend, not while ``torch.compile`` traces); anything else by torch.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 2, 5, 5).permute(1, 0, 2, 3)   # N=2, C=4, (C, N, H, W) memory
        >>> y = depthwise3x3(x, torch.randn(4, 1, 3, 3), stride=2)
        >>> y.shape, y.permute(1, 0, 2, 3).is_contiguous()
        (torch.Size([2, 4, 3, 3]), True)
    """
    refuse_ad_transforms("depthwise3x3", (x, weight, bias))
    div = _kernel_div(x, weight, bias, stride, activation)
    if div is None:
        return _torch_depthwise(x, weight, bias, stride, activation)
    if _records(x, weight, bias):
        return _Depthwise.apply(x, weight, bias, stride, activation)
    return _forward(x, weight, bias, stride, activation, div)


def prepared_depthwise3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          stride: int, activation: str | None):
    """``depthwise3x3(·, weight, bias, stride, activation)`` for inputs like ``x`` (the same
    shape, strides, dtype and device) as a function of the input alone, every check and
    choice made now (bad operands raise as there); None where ``depthwise3x3`` runs torch
    or records autograd. For callers that repeat a call (``st.freeze``): the function
    trusts its input to be like ``x``, and ``weight`` and ``bias`` not to change (it holds
    them).

    Example:
        >>> import torch
        >>> x = torch.ones(1, 2, 4, 4)
        >>> run = prepared_depthwise3x3(x, torch.ones(2, 1, 3, 3), None, 1, None)
        >>> run is None or run(torch.ones(1, 2, 4, 4))[0, 0, 1, 1].item() == 9.0
        True
    """
    div = _kernel_div(x, weight, bias, stride, activation)
    if div is None or _records(x, weight, bias):
        return None
    return _launcher(x, weight, bias, stride, activation, div)


def _kernel_div(x, weight, bias, stride, activation):
    """The kernel's ``div`` (``_plane_order``) for these operands, None where torch runs;
    bad operands raise."""
    # (checks by shapes and strides, no tensor ops: at batch 1 a MobileNet layer's kernel
    # takes 20-300 us, and every torch call here costs 1-4 us)
    shape = check_image("depthwise3x3", x)
    c = shape[1]
    if not isinstance(weight, torch.Tensor) or weight.shape != (c, 1, 3, 3):
        raise ValueError(f"depthwise3x3: weight must be ({c}, 1, 3, 3) for x with {c} "
                         f"channels, got {tuple(getattr(weight, 'shape', ()))}")
    check_epilogue("depthwise3x3", bias, c, stride, activation)
    dtype = x.dtype
    div = None if _is_compiling() else _plane_order(x, shape)   # traced: torch's (no pointers)
    if (div is None or weight.dtype != dtype or not weight.is_contiguous() or not weight.is_cpu
            or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()
                                      or not bias.is_cpu))
            or backend() != "c" or _kernel(dtype) is None):
        return None
    return div


def check_image(op: str, x) -> torch.Size:
    """``x``'s (N, C, H, W) shape; a ValueError naming ``op`` unless ``x`` is a 4-D tensor.

    Example:
        >>> check_image("conv", torch.ones(1, 2, 3, 4))
        torch.Size([1, 2, 3, 4])
    """
    shape = getattr(x, "shape", None)
    if not isinstance(x, torch.Tensor) or len(shape) != 4:
        raise ValueError(f"{op}: x must be a 4-D (N, C, H, W) tensor, got "
                         f"{tuple(shape or ()) or type(x).__name__}")
    return shape


def check_epilogue(op: str, bias, channels: int, stride, activation) -> None:
    """A ValueError naming ``op`` unless ``bias`` is None or a (``channels``,) tensor,
    ``stride`` 1 or 2 and ``activation`` one of ``ACTIVATIONS``: the arguments every
    convolution kernel here shares.

    Example:
        >>> check_epilogue("conv", None, 4, 2, "relu6")
    """
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (channels,)):
        raise ValueError(f"{op}: bias must be None or ({channels},), got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if stride not in (1, 2):
        raise ValueError(f"{op}: stride must be 1 or 2, got {stride!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {tuple(ACTIVATIONS)}, got "
                         f"{activation!r}")


def _records(x, weight, bias) -> bool:
    """Whether autograd records this call."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _plane_order(x: torch.Tensor, shape):
    """``div`` such that (H, W) plane ``p`` of ``x``'s memory is channel ``(p // div) % C``:
    N for (C, N, H, W) memory, 1 for NCHW; None for other layouts, devices, and empty or
    overlapping tensors."""
    if not x.is_cpu or x.layout != torch.strided:
        return None
    n, c, h, w = shape
    if n * c * h * w == 0:
        return None
    sn, sc, sh, sw = x.stride()
    if (sw == 1 or w == 1) and (sh == w or h == 1):
        plane = h * w
        if (sc == n * plane or c == 1) and (sn == plane or n == 1):
            return n
        if (sc == plane or c == 1) and (sn == c * plane or n == 1):
            return 1
    return None


class _Scratch(threading.local):
    """Each Python thread's ring buffers, grown as needed (the kernel zeroes what it uses;
    the GIL is released while it runs, so threads must not share them)."""
    buffers: dict

    def __init__(self):
        self.buffers = {}

    def get(self, dtype, size):
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < size:
            buf = self.buffers[dtype] = torch.empty(max(size, 4096), dtype=dtype)
        return buf


_scratch = _Scratch()


def _forward(x, weight, bias, stride, activation, div):
    return _launcher(x, weight, bias, stride, activation, div)(x)


def _launcher(x, weight, bias, stride, activation, div):
    """The kernel's call for inputs like ``x`` (checked by the callers)."""
    n, c, h, w = x.shape
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    if div == 1:
        shape, strides = (n, c, oh, ow), (c * oh * ow, oh * ow, ow, 1)
    else:   # (C, N, OH, OW) memory seen as (N, C, OH, OW): one call, not empty and permute
        shape, strides = (n, c, oh, ow), (oh * ow, n * oh * ow, ow, 1)
    nt, rw, nr = walk_sizes(n * c * oh * ow, h, w)
    band = split_rows(nt, n * oh * ow) if div == n else 0
    dtype, fn, size = x.dtype, _kernel(x.dtype), nt * (nr + 2) * rw
    head = (n * c, div, c, h, w, stride)
    tail = (weight.data_ptr(), 0 if bias is None else bias.data_ptr(), ACTIVATIONS[activation])

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(shape, strides, dtype=dtype)
        fn(*head, x.data_ptr(), *tail, out.data_ptr(), _scratch.get(dtype, size).data_ptr(),
           rw, nr, nt, band)
        return out
    run.kept = (weight, bias)   # (their memory stays while the function does)
    return run


def walk_sizes(outputs: int, h: int, w: int) -> tuple[int, int, int]:
    """``(nt, rw, nr)`` of a walk over (H, W) planes writing ``outputs`` values: the
    threads, the padded row width and the ring's rows (see the kernel's comment); each
    thread's scratch is ``nr + 2`` rows of ``rw`` (and any extra rows its hooks ask for).

    Example:
        >>> walk_sizes(100, 7, 7)[1:]
        (48, 7)
    """
    nt = runtime.num_threads() if outputs >= _PARALLEL_OUTPUTS else 1
    return nt, 2 * ((w + 7) // 8 * 8 + 16), h if h <= _WHOLE_PLANE_ROWS else 5


def split_rows(nt: int, pixels: int) -> int:
    """The walk's ``band`` (1: split by rows, 0: by planes) for ``nt`` threads and
    ``pixels`` output pixels per channel (N x OH x OW; see the kernel's comment): by rows
    from ``ROW_SPLIT_PIXELS`` on, where the 1x1 convolution after splits its columns the
    same way (``nn.SparseConv2d``).

    Example:
        >>> split_rows(2, 56 * 56), split_rows(1, 56 * 56)
        (1, 0)
    """
    return int(nt > 1 and pixels >= ROW_SPLIT_PIXELS)


def _torch_depthwise(x, weight, bias, stride, activation):
    y = F.conv2d(x, weight, bias, stride, 1, 1, x.shape[1])
    act = _TORCH_ACTIVATION[activation]
    return y if act is None else act(y)


class _Depthwise(torch.autograd.Function):
    """The kernel's forward; torch's convolution gradients of the activation-masked
    output gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, activation):
        y = _forward(x, weight, bias, stride, activation, _plane_order(x, x.shape))
        # (the output only for the activation's mask: without one, an in-place op on the
        # result before backward is fine, as after F.conv2d)
        ctx.save_for_backward(x, weight, None if activation is None else y)
        ctx.stride, ctx.activation, ctx.has_bias = stride, activation, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, y = ctx.saved_tensors
        if ctx.activation is not None:
            # (a NaN output passes its gradient through relu, not relu6: as torch's)
            keep = ~(y <= 0) if ctx.activation == "relu" else (y > 0) & (y < 6)
            grad = grad * keep
        c, s = x.shape[1], ctx.stride
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = torch.nn.grad.conv2d_input(x.shape, weight, grad, s, 1, 1, c) if need_x else None
        gw = torch.nn.grad.conv2d_weight(x, weight.shape, grad, s, 1, 1, c) if need_w else None
        gb = grad.sum((0, 2, 3)) if need_b and ctx.has_bias else None
        return gx, gw, gb, None, None


@lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype):
    """The kernel for ``dtype`` (float32, float64): for float32 on an AVX2 (or AVX-512) CPU
    the intrinsics variant; None where torch runs: another dtype, or no C compiler."""
    from ..compiler.kernel import vector_isa

    avx2 = vector_isa() is not None
    symbol = {torch.float32: "st_depthwise3x3_float_avx2" if avx2 else "st_depthwise3x3_float",
              torch.float64: "st_depthwise3x3_double"}.get(dtype)
    if symbol is None:
        return None
    try:
        return runtime.load_entries(_source(avx2), {symbol: [runtime.I64] * 6 + [runtime.PTR] * 3
                                                    + [runtime.I64, runtime.PTR, runtime.PTR]
                                                    + [runtime.I64] * 4})[symbol]
    except runtime.KernelBuildError:
        return None
