"""``stem_conv3x3``: a dense 3x3 convolution (padding 1, stride 1 or 2) of images with few
channels, a ConvNet's first layer, with the bias and ReLU/ReLU6 fused, written in the
(C, N, H, W) memory the sparse layers after it read.

PyTorch runs MobileNet's 3 -> 32 stem (stride 2, 224 x 224) in 165-270 us on 2 threads
(NCHW; its channels_last kernel takes 100 us but the NHWC -> NCHW copy after costs 300), plus
14-40 us for the ReLU: 8% of a 90%-sparse MobileNet v1; this kernel takes ~120 us alone,
146-154 us in the model. Each output row is computed for all output channels at once: for
each of its ``9 C`` taps (``C`` channels x 3 x 3) the input values that tap reads for the
row's output columns are first copied into a per-thread buffer as one zero-padded row
(for stride 2 every other column), so that every load is a unit-stride vector from L1;
then for each vector of output pixels and each block of 8 output channels, 8 accumulators
take one vector load and 8 broadcast FMAs per tap (the filters, 36 floats per output
channel for RGB, stay in L1). It runs at about 60% of the FMA units' peak.
Memory traffic: the input read once per output row that needs it (1.5 times for stride 2,
3 times for stride 1, from L1/L2), the output written once. Parallel strategy: output rows
(of all images, in order) split statically, thread t taking the same band of rows
``depthwise3x3`` gives it (``ops/depthwise.py``), so the depthwise layer after reads the
rows this core wrote. Float32 on AVX2 or AVX-512 CPUs, inference only; anything else
(other dtypes, gradients, ``torch.compile``) is ``F.conv2d`` and the activation.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> x, w, b = torch.randn(1, 3, 11, 9), torch.randn(8, 3, 3, 3), torch.randn(8)
    >>> y = stem_conv3x3(x, w, b, stride=2, activation="relu6")
    >>> torch.allclose(y, F.relu6(F.conv2d(x, w, b, 2, 1)), atol=1e-5)
    True
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .. import runtime
from .._modes import refuse_ad_transforms
from .depthwise import (ACTIVATIONS, STORE_PART_C, _TORCH_ACTIVATION, check_epilogue,
                        check_image)
from .depthwise import _scratch as _buffers   # (each Python thread's buffers)
from .policy import backend

MAX_CHANNELS = 4   # input channels the kernel is for (RGB, RGBA); more: torch
_is_compiling = torch.compiler.is_compiling
_PARALLEL_OUTPUTS = 1 << 14   # output values below which one thread is as fast

# Vector helpers per ISA: L lanes; VSTORE_PART stores the first r < L lanes.
_ISA = {
    "avx2": """#define L 8
typedef __m256 V;
#define VLOAD _mm256_loadu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VMAX _mm256_max_ps
#define VMIN _mm256_min_ps
#define VSTORE _mm256_storeu_ps
#define VSTORE_PART(p, v, r) st_store_part(p, v, r)
""" + STORE_PART_C,
    "avx512": """#define L 16
typedef __m512 V;
#define VLOAD _mm512_loadu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VMAX _mm512_max_ps
#define VMIN _mm512_min_ps
#define VSTORE _mm512_storeu_ps
#define VSTORE_PART(p, v, r) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (r)) - 1u), v)
""",
}
_KERNEL = r"""
#define OB 8   /* output channels per block: 8 accumulators */
/* y (o planes of n * oh rows of ow, the (O, N, OH, OW) memory) = clamp(conv3x3(x) + bias)
   for x (n, c, h, w) NCHW, wt (o, c, 3, 3), padding 1, stride s. scratch (64-byte
   aligned): nt x ((9 c + 1) rows of rw floats (rw: the output row rounded up to 16) + the
   filters and bias in blocks (wsize)), each thread's: a row per tap, its input row's
   columns that tap reads for each output column (so every load is aligned: none
   straddles two cache lines), and a zero row. */
void st_stem_conv3x3(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t s,
                     const float* restrict x, const float* restrict wt,
                     const float* restrict bias, int64_t act, float* restrict y,
                     float* restrict scratch, int64_t rw, int64_t nt) {
  const int64_t oh = (h - 1) / s + 1, ow = (w - 1) / s + 1, R = n * oh, k9 = 9 * c;
  /* the activation as a clamp (max then min: a NaN passes, as through torch's) */
  const float lo = act ? 0.0f : -INFINITY, hi = act == 2 ? 6.0f : INFINITY;
  const int64_t ob_all = (o + OB - 1) / OB * OB;   /* output channels in whole blocks */
  const int64_t wsize = (ob_all * (k9 + 1) + 15) / 16 * 16;
  #pragma omp parallel num_threads(nt) if(nt > 1)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    float* rows = scratch + ((9 * c + 1) * rw + wsize) * t;
    const float* zero = rows + 9 * c * rw;
    /* written below only at the same columns on every row: the padding stays zero */
    memset(rows, 0, (size_t)((9 * c + 1) * rw) * sizeof(float));
    /* the filters block by block, tap-major (wp[(o0 + k) * OB + j]: one block's 8 values of
       a tap side by side), and the bias; a short last block repeats its last channel (not
       stored) */
    float* wp = rows + (9 * c + 1) * rw;
    float* bp = wp + ob_all * k9;
    for (int64_t oc = 0; oc < ob_all; oc++) {
      const int64_t from = oc < o ? oc : o - 1;
      for (int64_t k = 0; k < k9; k++)
        wp[(oc / OB * OB) * k9 + k * OB + oc % OB] = wt[from * k9 + k];
      bp[oc] = bias ? bias[from] : 0.0f;
    }
    const float* tap[9 * MAX_CHANNELS];
    /* output columns [jlo[kx], jhi[kx]) read input column j * s + kx - 1 inside the row */
    int64_t jlo[3], jhi[3];
    for (int kx = 0; kx < 3; kx++) {
      jlo[kx] = kx == 0 ? 1 : 0;
      jhi[kx] = w < kx ? 0 : (w - kx) / s + 1 < ow ? (w - kx) / s + 1 : ow;
    }
    for (int64_t g = R * t / T; g < R * (t + 1) / T; g++) {   /* output row g of image g / oh */
      const int64_t img = g / oh, oy = g % oh;
      for (int64_t ci = 0; ci < c; ci++)
        for (int64_t ky = 0; ky < 3; ky++) {
          const int64_t iy = oy * s + ky - 1, k = 9 * ci + 3 * ky;
          if (iy < 0 || iy >= h) {
            tap[k] = zero; tap[k + 1] = zero; tap[k + 2] = zero;
            continue;
          }
          const float* src = x + ((img * c + ci) * h + iy) * w;
          for (int kx = 0; kx < 3; kx++) {   /* row r[j] = src[j * s + kx - 1], 0 outside */
            float* r = rows + (k + kx) * rw;
            const float* from = src + kx - 1;
            if (s == 1)
              memcpy(r + jlo[kx], from + jlo[kx], (size_t)(jhi[kx] - jlo[kx]) * sizeof(float));
            else
              for (int64_t j = jlo[kx]; j < jhi[kx]; j++) r[j] = from[2 * j];
            tap[k + kx] = r;
          }
        }
      for (int64_t o0 = 0; o0 < o; o0 += OB) {
        const int64_t ob = o - o0 < OB ? o - o0 : OB;
        const float* wb = wp + o0 * k9;
        for (int64_t x0 = 0; x0 < ow; x0 += L) {
          V acc[OB];
          for (int j = 0; j < OB; j++) acc[j] = VSET1(bp[o0 + j]);
          for (int64_t k = 0; k < k9; k++) {
            const V v = VLOAD(tap[k] + x0);
            for (int j = 0; j < OB; j++) acc[j] = VFMA(VSET1(wb[k * OB + j]), v, acc[j]);
          }
          for (int j = 0; j < ob; j++) {
            const V r = VMIN(VSET1(hi), VMAX(VSET1(lo), acc[j]));
            float* out = y + ((o0 + j) * R + g) * ow + x0;
            if (ow - x0 >= L) VSTORE(out, r);
            else VSTORE_PART(out, r, ow - x0);
          }
        }
      }
    }
  }
}
"""


def stem_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 stride: int = 1, activation: str | None = None) -> torch.Tensor:
    """``activation(F.conv2d(x, weight, bias, stride, padding=1))`` for ``x`` (N, C, H, W)
    and ``weight`` (O, C, 3, 3), activation None, ``"relu"`` or ``"relu6"``. The (N, O, OH,
    OW) result's memory is (O, N, OH, OW), as ``nn.SparseConv2d`` and ``depthwise3x3``
    write theirs (plain NCHW for N = 1). This module's kernel where it applies (see the
    module docstring), else torch (whose result is made the same layout).

    Example:
        >>> import torch
        >>> y = stem_conv3x3(torch.ones(2, 3, 4, 4), torch.ones(5, 3, 3, 3))
        >>> y.shape, y[0, 0, 0].tolist(), y.permute(1, 0, 2, 3).is_contiguous()
        (torch.Size([2, 5, 4, 4]), [12.0, 18.0, 18.0, 12.0], True)
    """
    refuse_ad_transforms("stem_conv3x3", (x, weight, bias))
    run = prepared_stem_conv3x3(x, weight, bias, stride, activation)
    if run is not None:
        return run(x)
    y = F.conv2d(x, weight, bias, stride, 1)
    act = _TORCH_ACTIVATION[activation]
    y = y if act is None else act(y)
    return y if x.shape[0] == 1 else y.transpose(0, 1).contiguous().transpose(0, 1)


def prepared_stem_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          stride: int = 1, activation: str | None = None):
    """``stem_conv3x3(·, weight, bias, stride, activation)`` for inputs like ``x`` (the
    same shape, strides, dtype and device) as a function of the input alone, every check
    and choice made now (bad operands raise as there); None where torch runs. For callers
    that repeat a call (``st.freeze``): the function trusts its input to be like ``x``, and
    ``weight`` and ``bias`` not to change (it holds them).

    Example:
        >>> import torch
        >>> run = prepared_stem_conv3x3(torch.ones(1, 3, 4, 4), torch.ones(2, 3, 3, 3), None)
        >>> run is None or run(torch.ones(1, 3, 4, 4))[0, 0, 1, 1].item() == 27.0
        True
    """
    n, c, h, w = check_image("stem_conv3x3", x)
    wshape = tuple(getattr(weight, "shape", ()))
    if not isinstance(weight, torch.Tensor) or len(wshape) != 4 or wshape[1:] != (c, 3, 3):
        raise ValueError(f"stem_conv3x3: weight must be (O, {c}, 3, 3) for x with {c} "
                         f"channels, got {wshape}")
    o = wshape[0]
    check_epilogue("stem_conv3x3", bias, o, stride, activation)
    fn = _kernel_for(x, weight, bias)
    if fn is None:
        return None
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    shape, strides = (n, o, oh, ow), (oh * ow, n * oh * ow, ow, 1)
    nt = runtime.num_threads() if n * o * oh * ow >= _PARALLEL_OUTPUTS else 1
    rw = -(-ow // 16) * 16
    wsize = -(-(-(-o // 8) * 8 * (9 * c + 1)) // 16) * 16   # (the kernel's)
    size = nt * ((9 * c + 1) * rw + wsize)
    head = (n, c, h, w, o, stride)
    middle = (weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
              ACTIVATIONS[activation])

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(shape, strides, dtype=torch.float32)
        fn(*head, x.data_ptr(), *middle, out.data_ptr(),
           _buffers.get(torch.float32, size).data_ptr(), rw, nt)
        return out
    run.kept = (weight, bias)   # (their memory stays while the function does)
    return run


def _kernel_for(x, weight, bias):
    """The kernel for these operands, or None where torch runs."""
    if _is_compiling() or x.dtype != torch.float32 or x.shape[1] > MAX_CHANNELS \
            or not x.is_cpu or not x.is_contiguous() or x.numel() == 0 \
            or not _plain(weight) or (bias is not None and not _plain(bias)) \
            or backend() != "c":
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    return _kernel()


def _plain(t) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


@lru_cache(maxsize=None)
def _kernel():
    """The kernel for this CPU's vectors (AVX2 or AVX-512); None without them or a C
    compiler."""
    from ..compiler.kernel import vector_isa

    isa = vector_isa()
    if isa is None:
        return None
    source = ("/* the stem convolution kernel (ops/stem.py) */\n#include <stdint.h>\n"
              "#include <string.h>\n#include <math.h>\n#include <immintrin.h>\n"
              "#include <omp.h>\n" + f"#define MAX_CHANNELS {MAX_CHANNELS}\n"
              + _ISA[isa] + _KERNEL)
    I, P = runtime.I64, runtime.PTR
    try:
        return runtime.load_entries(source, {"st_stem_conv3x3": [I] * 6 + [P] * 3
                                             + [I, P, P, I, I]})["st_stem_conv3x3"]
    except runtime.KernelBuildError:
        return None
