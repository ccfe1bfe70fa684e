"""``expand_depthwise3x3``: a sparse 1x1 expansion and the 3x3 depthwise convolution after
it (MobileNet v2's inverted residual block, up to its projection) in one kernel, so the
expanded activation is never written to memory.

An inverted residual block widens its input six times before the depthwise convolution:
at 224 x 224, batch 1, the expanded tensor of the first block is 96 x 112 x 112 floats
(4.8 MB), written by the 1x1 layer and read back by the depthwise one, and the early
blocks are bound by that traffic, not by their few multiply-adds (a 90%-sparse 16 -> 96
expansion does 1.6 of them per output value). Here the depthwise kernel of
``depthwise.py`` computes each input row it takes into its ring buffer instead of copying
it: row ``r`` of expanded channel ``c`` is ``expand_activation(expand_bias[c] + sum_k
W[c, k] x[k, r, :])`` over the stored entries of ``W``'s row ``c``.

Kernel: the depthwise walk (one (channel, image) plane per task, split statically across
threads, two output rows at a time from a per-thread ring of padded input rows); each
input row of a plane is computed once, into a per-thread row buffer (vector loops the C
compiler vectorises: the bias, one pass per stored entry, the clamp), then moved into the
ring as the plain kernel moves a row of ``x``. Memory traffic: ``x`` (the block's narrow
input) read once per stored entry of each expanded channel, mostly from cache; the
depthwise output written once; the expanded activation not at all.

Runs where ``depthwise3x3``'s kernel runs (float32/float64 CPU tensors, the C backend,
not while ``torch.compile`` traces), for a CSR ``expand_weight`` and no gradient
recorded; everything else is the two steps unfused (``st.einsum`` and ``depthwise3x3``),
which gradients then go through.

Example:
    >>> import torch, sparsetorch as st
    >>> import torch.nn.functional as F
    >>> x = torch.randn(1, 8, 9, 9)
    >>> W = st.tensor(torch.randn(16, 8) * (torch.rand(16, 8) < 0.3), format="csr")
    >>> wd, bd = torch.randn(16, 1, 3, 3), torch.randn(16)
    >>> y = expand_depthwise3x3(x, W, None, "relu6", wd, bd, stride=2, activation="relu6")
    >>> e = F.relu6(F.conv2d(x, W.to_dense()[:, :, None, None]))
    >>> torch.allclose(y, F.relu6(F.conv2d(e, wd, bd, 2, 1, 1, 16)), atol=1e-5)
    True
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import runtime
from .._modes import refuse_ad_transforms
from ..formats import SparseTensor
from . import depthwise as _dw
from .depthwise import ACTIVATIONS, depthwise3x3
from .einsum import einsum
from .policy import backend

_is_compiling = torch.compiler.is_compiling

# The rows: input channel k of image n is the (H, W) plane at x + k * sk + n * sn; the
# walk's planes are (expanded channel ch, image rep). The expanded rows are computed bt at
# a time (contiguous in x: one vector loop over bt * w pixels per stored entry, not one
# per row, whose fixed cost dominated 14- and 28-pixel rows) into each thread's xr rows
# past its ring (tmp), as the walk first asks for one of them.
_BATCH = r"""if (filled + 1 >= b1) {   /* the next bt expanded rows: bias, entries, clamp */
            b0 = filled + 1;
            b1 = b0 + bt < rows_end ? b0 + bt : rows_end;   /* (a band's rows) */
            const int64_t r = b0 * w, m = (b1 - b0) * w;$COMPUTE
          }
          const $T* src = tmp + (filled + 1 - b0) * w;"""
_EXPANDED_ROWS = {
    "PARAMS": (", int64_t sk, int64_t sn, const $I* restrict epos, const $I* restrict ecrd, "
               "const $T* restrict evals, const $T* restrict ebias, int64_t eact, "
               "int64_t xr, int64_t bt"),
    "EXTRA_ROWS": "xr",
    "THREAD": ("$T* tmp = ring + (nr + 2) * rw;\n"
               "    const $T elo = eact ? ($T)0 : -($T)INFINITY, "
               "ehi = eact == 2 ? ($T)6 : ($T)INFINITY;"),
    "PLANE": ("const $T* xn = x + rep * sn;\n"
              "      const $T eb = ebias ? ebias[ch] : ($T)0;\n"
              "      const int64_t q0 = epos[ch], q1 = epos[ch + 1];\n"
              "      int64_t b0 = 0, b1 = 0;   /* the rows in tmp: [b0, b1) */"),
    "SOURCE": (_BATCH.replace("$COMPUTE", r"""
            #pragma omp simd
            for (int64_t j = 0; j < m; j++) tmp[j] = eb;
            for (int64_t q = q0; q < q1; q++) {
              const $T v = evals[q];
              const $T* restrict xq = xn + (int64_t)ecrd[q] * sk + r;
              #pragma omp simd
              for (int64_t j = 0; j < m; j++) tmp[j] += v * xq[j];
            }
            #pragma omp simd
            for (int64_t j = 0; j < m; j++) {   /* (two selects: each one vector max or min) */
              const $T t = tmp[j] < elo ? elo : tmp[j];
              tmp[j] = t > ehi ? ehi : t;
            }"""), _BATCH.replace("$COMPUTE", r"""
            /* 32 pixels in four registers across all entries, stored once; then vectors
               of 8, the last under a mask (a whole vector is stored: tmp has the room) */
            const __m256 vb = _mm256_set1_ps(eb), vlo = _mm256_set1_ps(elo),
                         vhi = _mm256_set1_ps(ehi);
            int64_t j0 = 0;
            for (; j0 + 32 <= m; j0 += 32) {
              __m256 a0 = vb, a1 = vb, a2 = vb, a3 = vb;
              for (int64_t q = q0; q < q1; q++) {
                const __m256 v = _mm256_set1_ps(evals[q]);
                const float* xq = xn + (int64_t)ecrd[q] * sk + r + j0;
                a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(xq), a0);
                a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(xq + 8), a1);
                a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(xq + 16), a2);
                a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(xq + 24), a3);
              }
              _mm256_storeu_ps(tmp + j0, _mm256_min_ps(vhi, _mm256_max_ps(vlo, a0)));
              _mm256_storeu_ps(tmp + j0 + 8, _mm256_min_ps(vhi, _mm256_max_ps(vlo, a1)));
              _mm256_storeu_ps(tmp + j0 + 16, _mm256_min_ps(vhi, _mm256_max_ps(vlo, a2)));
              _mm256_storeu_ps(tmp + j0 + 24, _mm256_min_ps(vhi, _mm256_max_ps(vlo, a3)));
            }
            for (; j0 < m; j0 += 8) {
              const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m - j0)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
              __m256 a = vb;
              for (int64_t q = q0; q < q1; q++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(evals[q]), _mm256_maskload_ps(
                    xn + (int64_t)ecrd[q] * sk + r + j0, mk), a);
              _mm256_storeu_ps(tmp + j0, _mm256_min_ps(vhi, _mm256_max_ps(vlo, a)));
            }""")),
}
# Expanded pixels computed per batch of rows (at least one row): the vector loops' length.
BATCH_PIXELS = 256
_INDEX = {torch.int32: "int32_t", torch.int64: "int64_t"}


def expand_depthwise3x3(x: torch.Tensor, expand_weight: SparseTensor,
                        expand_bias: torch.Tensor | None, expand_activation: str | None,
                        weight: torch.Tensor, bias: torch.Tensor | None = None,
                        stride: int = 1, activation: str | None = None) -> torch.Tensor:
    """``depthwise3x3(e, weight, bias, stride, activation)`` of the expansion ``e =
    expand_activation(conv1x1(x, expand_weight) + expand_bias)``: ``x`` (N, C, H, W),
    ``expand_weight`` an (E, C) SparseTensor, ``expand_bias`` None or (E,), ``weight``
    (E, 1, 3, 3), ``bias`` None or (E,); activations None, ``"relu"`` or ``"relu6"``. The
    (N, E, OH, OW) result's memory is (E, N, OH, OW), as ``nn.SparseConv2d`` and
    ``depthwise3x3`` would leave it (plain NCHW for N = 1). One kernel where it applies
    (see the module docstring), else the two steps.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(4), format="csr")
        >>> y = expand_depthwise3x3(torch.ones(1, 4, 3, 3), W, None, None,
        ...                         torch.ones(4, 1, 3, 3))
        >>> y[0, 0].tolist()
        [[4.0, 6.0, 4.0], [6.0, 9.0, 6.0], [4.0, 6.0, 4.0]]
    """
    refuse_ad_transforms("expand_depthwise3x3", (x, expand_weight, expand_bias, weight, bias))
    run = prepared_expand_depthwise3x3(x, expand_weight, expand_bias, expand_activation,
                                       weight, bias, stride, activation)
    if run is None:
        return _unfused(x, expand_weight, expand_bias, expand_activation, weight, bias,
                        stride, activation)
    return run(x)


def prepared_expand_depthwise3x3(x: torch.Tensor, expand_weight: SparseTensor,
                                 expand_bias: torch.Tensor | None,
                                 expand_activation: str | None, weight: torch.Tensor,
                                 bias: torch.Tensor | None = None, stride: int = 1,
                                 activation: str | None = None):
    """``expand_depthwise3x3(·, expand_weight, ...)`` for inputs like ``x`` (the same shape,
    strides, dtype and device) as a function of the input alone, every check and choice
    made now (bad operands raise as there); None where the two steps run. For callers that
    repeat a call (``st.freeze``): the function trusts its input to be like ``x``, and the
    weights and biases not to change (it holds them).

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(4), format="csr")
        >>> run = prepared_expand_depthwise3x3(torch.ones(1, 4, 3, 3), W, None, None,
        ...                                    torch.ones(4, 1, 3, 3))
        >>> run is None or run(torch.ones(1, 4, 3, 3))[0, 0, 1, 1].item() == 9.0
        True
    """
    n, c, h, w = _dw.check_image("expand_depthwise3x3", x)
    if not isinstance(expand_weight, SparseTensor) or len(expand_weight._size) != 2 \
            or expand_weight._size[1] != c:
        raise ValueError(f"expand_depthwise3x3: expand_weight must be an (E, {c}) SparseTensor "
                         f"for x with {c} channels, got {type(expand_weight).__name__} "
                         f"{tuple(getattr(expand_weight, 'shape', ()))}")
    e = expand_weight._size[0]
    if expand_bias is not None and (not isinstance(expand_bias, torch.Tensor)
                                    or expand_bias.shape != (e,)):
        raise ValueError(f"expand_depthwise3x3: expand_bias must be None or ({e},), got "
                         f"{tuple(getattr(expand_bias, 'shape', ()))}")
    if expand_activation not in ACTIVATIONS:
        raise ValueError(f"expand_depthwise3x3: expand_activation must be one of "
                         f"{tuple(ACTIVATIONS)}, got {expand_activation!r}")
    fn = _kernel_for(x, expand_weight, expand_bias, weight, bias, stride, activation)
    if fn is None:
        return None
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    # (E, N, OH, OW) memory seen as (N, E, OH, OW): one call, not empty and permute
    out_shape, strides, dtype = (n, e, oh, ow), (oh * ow, n * oh * ow, ow, 1), x.dtype
    nt, rw, nr = _dw.walk_sizes(n * e * oh * ow, h, w)
    band = _dw.split_rows(nt, n * oh * ow)
    bt = min(h, max(1, BATCH_PIXELS // w))
    xr = (bt * w + 8 + rw - 1) // rw   # (+ 8: a vector stored whole past the rows)
    size = nt * (nr + 2 + xr) * rw
    head = (n * e, n, e, h, w, stride)
    middle = (weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
              ACTIVATIONS[activation])
    tail = (rw, nr, nt, band, x.stride(1), x.stride(0), expand_weight._pos1.data_ptr(),
            expand_weight._crd1.data_ptr(), expand_weight._values.data_ptr(),
            0 if expand_bias is None else expand_bias.data_ptr(),
            ACTIVATIONS[expand_activation], xr, bt)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(out_shape, strides, dtype=dtype)
        fn(*head, x.data_ptr(), *middle, out.data_ptr(),
           _dw._scratch.get(dtype, size).data_ptr(), *tail)
        return out
    run.kept = (expand_weight, expand_bias, weight, bias)   # (their memory stays with it)
    return run


def _unfused(x, expand_weight, expand_bias, expand_activation, weight, bias, stride,
             activation):
    n, c, h, w = x.shape
    cols = x.permute(1, 0, 2, 3).reshape(c, n * h * w)
    y = einsum("oc,cp->op", expand_weight, cols,
               bias=None if expand_bias is None else expand_bias.unsqueeze(1),
               activation=expand_activation)
    y = y.view(expand_weight.shape[0], n, h, w).permute(1, 0, 2, 3)   # (-1: none at n = 0)
    return depthwise3x3(y, weight, bias, stride, activation)


def _kernel_for(x, ew, eb, weight, bias, stride, activation):
    """The fused kernel for these operands, or None where the two steps run (they check
    and report every other bad operand). (Plain checks, no loops over the operands: a
    7 x 7 block's kernel takes tens of microseconds.)"""
    if _is_compiling() or type(ew) is not SparseTensor or ew._format.name != "csr":
        return None
    dtype, e = x.dtype, ew._size[0]
    n, c, h, w = x.shape
    if (not x.is_cpu or x.layout != torch.strided or n * c * h * w * e == 0
            or (x.stride(3) != 1 and w > 1) or (x.stride(2) != w and h > 1)
            or stride not in (1, 2) or activation not in ACTIVATIONS or backend() != "c"
            or not _plain(ew._values, dtype) or not _plain(weight, dtype)
            or weight.shape != (e, 1, 3, 3)
            or (eb is not None and not _plain(eb, dtype))
            or (bias is not None and (not _plain(bias, dtype) or bias.shape != (e,)))):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or ew._values.requires_grad
                                    or weight.requires_grad
                                    or (eb is not None and eb.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return None
    return _kernel(dtype, ew._crd1.dtype)


def _plain(t, dtype) -> bool:
    """A contiguous CPU tensor of ``dtype``."""
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous()


@lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype, index_dtype: torch.dtype):
    """The kernel for ``dtype`` (float32, float64) and int32/int64 indices; None where the
    two steps run: another dtype, or no C compiler."""
    from ..compiler.kernel import vector_isa

    avx2 = vector_isa() is not None
    name = f"st_expand_depthwise3x3_{_INDEX.get(index_dtype)}"
    symbol = {torch.float32: f"{name}_float_avx2" if avx2 else f"{name}_float",
              torch.float64: f"{name}_double"}.get(dtype)
    if symbol is None or index_dtype not in _INDEX:
        return None
    source = _dw.header(avx2) + _dw.walks(avx2, name, _EXPANDED_ROWS, _INDEX[index_dtype])
    I, P = runtime.I64, runtime.PTR
    try:
        return runtime.load_entries(source, {symbol: [I] * 6 + [P] * 3 + [I, P, P]
                                             + [I] * 4 + [I, I, P, P, P, P, I, I, I]})[symbol]
    except runtime.KernelBuildError:
        return None
