"""``SparseConv2d``: a 1x1 convolution with a sparse weight, as in Fast Sparse ConvNets.

A 1x1 convolution is a matrix product over channels: ``Y (Cout x P) = W (Cout x Cin) @ X (Cin x
P)`` with ``P`` the pixels. With the activations in CHW order (each channel's pixels
contiguous) and ``W`` sparse, that is the generated SpMM kernel: pixel strips in vector
registers, each stored weight loaded once per strip, the bias and ReLU/ReLU6 applied as the
registers are written (``st.einsum("oc,cp->op", W, X, bias=, activation=)``). In inference
``st.ops.spmm_narrow`` runs instead where one of its kernels pays (it falls back to einsum
elsewhere): inputs of at most 256 pixels (MobileNet's 14 x 14 and 7 x 7 layers at batch 1;
on AVX-512 CPUs 1024, 28 x 28 too: ``ops.narrow.max_columns()``), whose output rows it
holds 64 columns at a time in registers (2.2x the generated kernel at 49 pixels, 1.1-1.3x
at 196); inputs split in bands of image rows (below); and, on AVX2 CPUs without AVX-512,
weights of many input channels at any width (strips of 32 pixels, each packed into a
thread's scratch as whole cache lines first).

Layout: a batch of ``N`` images is folded into the pixels, ``X = (Cin, N*H*W)``. The result
is returned as an ordinary ``(N, Cout, H, W)`` tensor whose memory is ``(Cout, N, H, W)``
(a permuted view): for ``N = 1`` that is plain contiguous NCHW; for ``N > 1`` the next
``SparseConv2d`` (or ``ChannelsFirstDepthwise``, and every elementwise op in between, which
keep their input's strides) reads it without a copy, so a network of such layers transposes
its activations once, at the first sparse layer, and not between every pair of layers.

Example:
    >>> import torch, sparsetorch as st
    >>> conv = torch.nn.Conv2d(8, 4, 1)
    >>> sp = st.nn.SparseConv2d.from_dense(conv, sparsity=0.5, activation="relu")
    >>> x = torch.randn(2, 8, 5, 5)
    >>> ref = torch.relu(torch.nn.functional.conv2d(x, sp.weight.to_dense()[:, :, None, None], conv.bias))
    >>> torch.allclose(sp(x), ref, atol=1e-5), sp.values.numel()
    (True, 16)
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import SparseTensor
from ..formats.pack import array_names
from ..ops import conv_ops, spmm_narrow
from ..ops.narrow import band_of_rows, max_columns, prepared_spmm_narrow
from . import _pattern
from ._common import as_asked, autocast_input, input_type_error
from ._common import check_pointwise as _check_pointwise, keep_facts as _keep_facts
from .linear import SparseLinear
from .pattern import BLOCK_ROWS, choose_blocksize, prune_mask

_is_compiling = torch.compiler.is_compiling

ACTIVATIONS = (None, "relu", "relu6")


class SparseConv2d(SparseLinear):
    """1x1 convolution ``activation(W x + b)`` with ``W`` (out, in) stored sparse.

    The parameter interface is ``SparseLinear``'s (this class extends it): ``values`` (one per
    stored weight, in storage order; an ``nn.Parameter``), ``bias`` (``None`` or ``(out,)``),
    ``weight`` (the SparseTensor ``W``, differentiable in ``values``: its gradient is sampled
    on the pattern), ``mask()``, ``set_pattern(mask, values=None)``, ``state_dict`` across
    patterns. Give exactly one of ``density`` (a random pattern) and ``mask``. The weight is
    CSR, or BSR with blocks of 4 or 2 output channels when the pattern is made of such blocks
    (chosen again by ``set_pattern``), or of an explicit ``blocksize``.

    ``stride=2`` subsamples the input first (``x[:, :, ::2, ::2]``, what a 1x1 convolution
    with stride 2 reads). ``activation`` (``None``, ``"relu"``, ``"relu6"``) and the bias are
    fused into the kernel. Any batch size; input NCHW (any memory layout); output NCHW in
    (C, N, H, W) memory (see the module docstring).

    Example:
        >>> import torch, sparsetorch as st
        >>> layer = st.nn.SparseConv2d(16, 8, density=0.25, stride=2)
        >>> layer(torch.randn(3, 16, 9, 9)).shape, layer.values.numel(), layer.mask().sum().item()
        (torch.Size([3, 8, 5, 5]), 32, 32)
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True, *,
                 density=None, mask=None, blocksize=None, stride: int = 1,
                 activation: str | None = None, dtype=None, device=None, generator=None):
        if stride not in (1, 2):
            raise ValueError(f"SparseConv2d: stride must be 1 or 2, got {stride!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"SparseConv2d: activation must be one of {ACTIVATIONS}, got "
                             f"{activation!r}")
        mask = _dense_mask(mask, (out_channels, in_channels))
        if blocksize is None and isinstance(mask, torch.Tensor):
            blocksize = choose_blocksize(mask.bool())
        super().__init__(in_channels, out_channels, bias, density=density, mask=mask,
                         blocksize=blocksize, dtype=dtype, device=device, generator=generator)
        self.stride, self.activation = stride, activation

    @property
    def in_channels(self) -> int:
        return self.in_features

    @property
    def out_channels(self) -> int:
        return self.out_features

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, *, density=None, sparsity=None,
                   method: str = "magnitude", blocksize=None, activation: str | None = None,
                   generator=None) -> "SparseConv2d":
        """A SparseConv2d computing ``conv`` with its weight pruned (``prune_mask``: exactly
        the ``round(sparsity * N)`` smallest ``|w|`` zeroed, or a random subset) and
        ``activation`` fused. ``conv`` must be a 1x1 ``nn.Conv2d`` with ``groups=1``, no
        padding or dilation, stride 1 or 2; it is not modified. ``density`` and ``sparsity``
        are keyword-only: a bare 0.9 would read as density here but as sparsity in
        ``st.sparsify(model, 0.9)``.

        Example:
            >>> import torch, sparsetorch as st
            >>> sp = st.nn.SparseConv2d.from_dense(torch.nn.Conv2d(8, 8, 1), sparsity=0.75,
            ...                                    blocksize=(4, 1))
            >>> sp.weight.format.name, sp.values.numel()
            ('bsr', 16)
        """
        _check_pointwise(conv)
        w = conv.weight.detach().reshape(conv.out_channels, conv.in_channels)
        mask = prune_mask(w, density=density, sparsity=sparsity, method=method,
                          blocksize=blocksize, generator=generator)
        return cls._from_mask(conv, mask, activation)

    @classmethod
    def _from_mask(cls, conv: nn.Conv2d, mask: torch.Tensor, activation) -> "SparseConv2d":
        """``conv`` (1x1, checked by the caller) with the weights of ``mask`` kept."""
        w = conv.weight.detach().reshape(conv.out_channels, conv.in_channels)
        layer = cls(conv.in_channels, conv.out_channels, conv.bias is not None, mask=mask,
                    stride=conv.stride[0], activation=activation, dtype=w.dtype,
                    device=w.device)
        layer.set_pattern(mask, w)
        if conv.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(conv.bias)
        return layer

    def set_pattern(self, mask, values=None) -> None:
        """``SparseLinear.set_pattern``; a ``mask`` (bool, or a SparseTensor whose stored
        entries are kept) given with ``values`` None or dense (out, in) chooses the format
        again: BSR with blocks of 4 or 2 output channels when the mask is made of them, else
        CSR. (1-D values are in the current format's order.)

        Example:
            >>> import torch, sparsetorch as st
            >>> layer = st.nn.SparseConv2d(4, 4, density=0.5)
            >>> layer.set_pattern(torch.ones(4, 4, dtype=torch.bool).tril(), torch.full((4, 4), 2.0))
            >>> layer.blocksize, layer.weight.to_dense().diagonal().tolist()
            (None, [2.0, 2.0, 2.0, 2.0])
        """
        # Blocks are chosen afresh only with values absent or dense: values in storage order
        # mean the current format.
        shape = (self.out_features, self.in_features)
        mask = _dense_mask(mask, shape)
        if (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == shape
                and (values is None or isinstance(values, torch.Tensor) and values.dim() == 2)):
            blocksize = choose_blocksize(mask)
            if blocksize != self.blocksize:
                if values is None:   # the old weights, read before the format changes
                    values = self.weight.detach().to_dense()
                self._store_in(blocksize)
        super().set_pattern(mask, values)

    def _store_in(self, blocksize) -> None:
        self.blocksize = blocksize
        self._format = _pattern.weight_format(blocksize)
        self._array_names = array_names(self._format)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # The layer picks CSR or BSR from its pattern (set_pattern), so a state of another
        # pattern may be stored the other way: its row pointers tell which (one per row or
        # per block of BLOCK_ROWS rows): that format is taken, and given back if the load fails.
        pos, before = state_dict.get(prefix + "pos1"), self.blocksize
        if isinstance(pos, torch.Tensor) and pos.dim() == 1 and pos.numel() > 1:
            rows = pos.numel() - 1
            stored = next(((r, 1) for r in BLOCK_ROWS if rows * r == self.out_features
                           and rows != self.out_features), None)
            if stored != before and (stored is not None or rows == self.out_features):
                self._store_in(stored)
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if len(error_msgs) > errors and self.blocksize != before:
            self._store_in(before)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (few tensor ops: at batch 1 the late layers' kernels take tens of microseconds,
        # and each view or index of a tensor costs a few here)
        shape = getattr(x, "shape", None)
        if not isinstance(x, torch.Tensor):
            raise input_type_error("SparseConv2d", f"input must be (N, {self.in_features}, H, "
                                   "W)", x)
        if len(shape) != 4 or shape[1] != self.in_features:
            raise ValueError(f"SparseConv2d: input must be (N, {self.in_features}, H, W); got "
                             f"{tuple(shape)}")
        if x.layout != torch.strided or isinstance(x, SparseTensor):
            raise TypeError(f"SparseConv2d: input must be a dense tensor, got a sparse one "
                            f"({type(x).__name__}, {x.layout}); pass x.to_dense()")
        weight, bias = self.weight, self.bias
        x = autocast_input(x, weight.dtype)
        if x.dtype != weight.dtype:
            raise TypeError(f"SparseConv2d: input is {x.dtype} but the weights are "
                            f"{weight.dtype}; cast the input or the layer (.to(dtype))")
        x, single, cols = self._columns(x)
        n, _, h, w = x.shape
        if _is_compiling() and self.blocksize is None and \
                conv_ops.narrow_applies(cols, self.values, bias, self.activation):
            # traced inference: the same kernel as a custom op (ops/conv_ops.py)
            y = torch.ops.sparsetorch.spmm_narrow(
                self._buffers["pos1"], self._buffers["crd1"], self.values, self.in_features,
                cols, bias, self.activation, _band(n, h, w))
            return self._image(y, n, h, w, single)
        # (spmm_narrow runs einsum where its kernels do not pay)
        y = spmm_narrow(weight, cols, bias, self.activation, _band(n, h, w))
        _keep_facts(weight, self)
        return self._image(y, n, h, w, single)

    def _columns(self, x):
        """``(x subsampled for stride 2, whether it is one NCHW image, its (C, N*H*W)
        matrix)``: for one image in NCHW memory the matrix and the result are plain views."""
        if self.stride == 2:
            x = x[:, :, ::2, ::2]
        elif self.stride != 1:   # (an attribute: it may be set after construction)
            raise ValueError(f"SparseConv2d: stride must be 1 or 2, got {self.stride!r}")
        n, c, h, w = x.shape
        single = n == 1 and x.is_contiguous()
        return x, single, x.view(c, h * w) if single else channels_first(x)

    def _image(self, y, n, h, w, single):
        """The (Cout, N*H*W) result as (N, Cout, H, W) over the same memory (copied into
        NCHW memory where ``nchw_output`` asks: ``_common.as_asked``)."""
        if single:
            return y.view(1, self.out_features, h, w)
        return as_asked(self, y.view(self.out_features, n, h, w).permute(1, 0, 2, 3))

    def _inference_step(self, x):
        """This layer's forward for inputs like ``x`` (same shape, strides, dtype, device)
        without autograd, as a function of the input with every choice made now; None
        where ``forward`` should run (``st.freeze``)."""
        if (type(x) is not torch.Tensor or x.dim() != 4 or x.shape[1] != self.in_features
                or x.dtype != self.values.dtype or torch.is_grad_enabled()):
            return None
        xs, single, cols = self._columns(x)
        n, _, h, w = xs.shape
        run = prepared_spmm_narrow(self.weight, cols, self.bias, self.activation,
                                   _band(n, h, w))
        if run is None:
            return None
        columns, image = self._columns, self._image

        def step(x):
            return image(run(columns(x)[2]), n, h, w, single)
        return step

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}"   # (activation: SparseLinear's)


def _band(n: int, h: int, w: int) -> int:
    """``spmm_narrow``'s ``band`` for (C, N*H*W) activations: columns split in image rows
    where the depthwise convolution before splits its output so (each thread then reads
    the pixels it wrote); 0 up to ``max_columns()``, which the kernels take unsplit."""
    pixels = n * h * w
    return 0 if pixels <= max_columns() else band_of_rows(pixels, w)


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """``x`` (N, C, H, W) as the (C, N*H*W) matrix a CHW kernel reads: a view when its memory
    is already (C, N, H, W) (any N = 1 contiguous tensor, or what ``SparseConv2d`` returns),
    else one transposing copy.

    Example:
        >>> import torch
        >>> x = torch.arange(8.).view(2, 2, 1, 2)
        >>> channels_first(x)
        tensor([[0., 1., 4., 5.],
                [2., 3., 6., 7.]])
    """
    n, c, h, w = x.shape
    return x.permute(1, 0, 2, 3).reshape(c, n * h * w)


def _dense_mask(mask, shape):
    """A SparseTensor ``mask`` as the bool ``shape`` tensor of its stored entries (whatever
    their values), so the blocks can be chosen from it; a dense ``(out, in, 1, 1)`` one as
    ``shape``; anything else unchanged (checked by ``SparseLinear``)."""
    if isinstance(mask, torch.Tensor) and not isinstance(mask, SparseTensor) and \
            tuple(mask.shape) == (*shape, 1, 1):
        return mask.reshape(shape)   # (a 1x1 convolution's own shape: conv.weight != 0)
    if not isinstance(mask, SparseTensor):
        return mask
    return _pattern.from_mask(mask, shape, None, "SparseConv2d").to_dense() != 0

