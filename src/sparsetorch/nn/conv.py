"""``SparseConv2d``: a 1x1 convolution with a sparse weight, as in Fast Sparse ConvNets.

A 1x1 convolution is a matrix product over channels: ``Y (Cout x P) = W (Cout x Cin) @ X (Cin x
P)`` with ``P`` the pixels. With the activations in CHW order (each channel's pixels
contiguous) and ``W`` sparse, that is the generated SpMM kernel: pixel strips in vector
registers, each stored weight loaded once per strip, the bias and ReLU/ReLU6 applied as the
registers are written (``st.einsum("oc,cp->op", W, X, bias=, activation=)``).

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

import math

import torch
from torch import nn

from ..formats import SparseTensor
from ..ops import einsum
from .pattern import SparsePattern, prune_mask

ACTIVATIONS = (None, "relu", "relu6")


class SparseConv2d(nn.Module):
    """1x1 convolution ``activation(W x + b)`` with ``W`` (out, in) stored sparse.

    Parameters: ``values`` (one per stored weight, in storage order; an ``nn.Parameter``) and
    ``bias`` (``None`` or ``(out,)``). ``weight`` is the SparseTensor ``W`` (CSR, or BSR with
    blocks of 4 or 2 output channels when the pattern is made of such blocks); its gradient
    is sampled on the pattern (``values.grad``). ``stride=2`` subsamples the input first
    (``x[:, :, ::2, ::2]``, what a 1x1 convolution with stride 2 reads). ``activation`` is
    ``None``, ``"relu"`` or ``"relu6"``, fused into the kernel. Any batch size; input NCHW.

    A new layer has a random pattern at ``density`` with ``nn.Conv2d``'s initialisation; use
    ``from_dense`` to prune a trained convolution and ``set_pattern`` to change the pattern.

    Example:
        >>> import torch, sparsetorch as st
        >>> layer = st.nn.SparseConv2d(16, 8, density=0.25, stride=2)
        >>> layer(torch.randn(3, 16, 9, 9)).shape, layer.values.numel(), layer.mask().sum().item()
        (torch.Size([3, 8, 5, 5]), 32, 32)
    """

    def __init__(self, in_channels: int, out_channels: int, *, density: float = 1.0,
                 stride: int = 1, bias: bool = True, activation: str | None = None,
                 blocksize=None, dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        if int(in_channels) < 1 or int(out_channels) < 1:
            raise ValueError(f"SparseConv2d: channel counts must be >= 1, got in_channels="
                             f"{in_channels}, out_channels={out_channels}")
        if stride not in (1, 2):
            raise ValueError(f"SparseConv2d: stride must be 1 or 2, got {stride!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"SparseConv2d: activation must be one of {ACTIVATIONS}, got "
                             f"{activation!r}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.stride, self.activation = stride, activation
        dtype = dtype or torch.get_default_dtype()
        # nn.Conv2d's initialisation (kaiming uniform, a = sqrt(5)), on the dense shape.
        bound = 1.0 / math.sqrt(self.in_channels)
        dense = (torch.rand(out_channels, in_channels, generator=generator, dtype=dtype) * 2 - 1) * bound
        mask = prune_mask(dense, density=density, method="random", blocksize=blocksize,
                          generator=generator)
        self.values = nn.Parameter(torch.empty(0, dtype=dtype))
        self.bias = (nn.Parameter((torch.rand(out_channels, generator=generator, dtype=dtype) * 2 - 1)
                                  * bound) if bias else None)
        self.set_pattern(mask, dense)

    # -- the pattern -------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, conv: nn.Conv2d, density=None, sparsity=None, method: str = "magnitude",
                   blocksize=None, activation: str | None = None,
                   generator: torch.Generator | None = None) -> "SparseConv2d":
        """A SparseConv2d computing ``conv`` with its weight pruned (``prune_mask``: the
        ``round(sparsity * N)`` smallest ``|w|`` zeroed, or a random subset) and ``activation``
        fused. ``conv`` must be a 1x1 ``nn.Conv2d`` with ``groups=1``, no padding or dilation,
        stride 1 or 2; it is not modified.

        Example:
            >>> import torch, sparsetorch as st
            >>> sp = st.nn.SparseConv2d.from_dense(torch.nn.Conv2d(8, 8, 1), sparsity=0.75,
            ...                                    blocksize=(4, 1))
            >>> sp.weight.format.name, sp.values.numel()
            ('bsr', 16)
        """
        _check_pointwise(conv)
        w = conv.weight.detach().reshape(conv.out_channels, conv.in_channels)
        return cls._from_mask(conv, prune_mask(w, density, sparsity, method, blocksize, generator),
                              activation)

    @classmethod
    def _from_mask(cls, conv: nn.Conv2d, mask: torch.Tensor, activation) -> "SparseConv2d":
        """``conv`` (1x1, checked by the caller) with the weights of ``mask`` kept."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"SparseConv2d: activation must be one of {ACTIVATIONS}, got "
                             f"{activation!r}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_channels, layer.out_channels = conv.in_channels, conv.out_channels
        layer.stride, layer.activation = conv.stride[0], activation
        w = conv.weight.detach().reshape(conv.out_channels, conv.in_channels)
        layer.values = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device))
        layer.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())
        layer.set_pattern(mask, w)
        return layer

    def set_pattern(self, mask: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Store the entries of boolean ``mask`` (out, in). ``values``: a dense (out, in)
        weight read at the new positions, or one value per kept entry in the new storage
        order; ``None`` keeps the current weight where the patterns overlap and starts new
        entries at 0. Replaces the ``values`` parameter (rebuild optimizers' parameter lists,
        or give ``values`` in the old storage order to an optimizer only after this call).

        Example:
            >>> import torch, sparsetorch as st
            >>> layer = st.nn.SparseConv2d(4, 4, density=0.5)
            >>> layer.set_pattern(torch.eye(4, dtype=torch.bool), torch.full((4,), 2.0))
            >>> layer.weight.to_dense().diagonal().tolist()
            [2.0, 2.0, 2.0, 2.0]
        """
        shape = (self.out_channels, self.in_channels)
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
            raise ValueError(f"SparseConv2d.set_pattern: mask must be a tensor of shape {shape} "
                             f"(out_channels, in_channels); got "
                             f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
        old = self.values
        pattern = SparsePattern(mask.bool())
        if values is None:
            dense = (self._pattern.scatter(old.detach()) if hasattr(self, "_pattern")
                     else torch.zeros(shape, dtype=old.dtype))
            new = pattern.gather(dense)
        elif tuple(values.shape) == shape:
            new = pattern.gather(values.detach())
        elif tuple(values.shape) == (pattern.nnz,):
            new = values.detach()
        else:
            raise ValueError(f"SparseConv2d.set_pattern: values must be a dense {shape} weight "
                             f"or ({pattern.nnz},) stored values; got shape {tuple(values.shape)}")
        self._pattern = pattern
        self._shell = pattern.tensor.with_values(new.to(old.dtype).detach())   # dtype kept
        self.values = nn.Parameter(new.to(dtype=old.dtype, device=old.device).clone(),
                                   requires_grad=old.requires_grad)

    def mask(self) -> torch.Tensor:
        """Dense boolean (out, in) mask of the stored weights."""
        return self._pattern.mask()

    @property
    def weight(self) -> SparseTensor:
        """The weight as a SparseTensor (out, in), differentiable in ``values``."""
        return self._shell.with_values(self.values)

    @property
    def blocksize(self):
        """``(r, 1)`` when the weight is stored as BSR with blocks of r output channels."""
        return self._pattern.blocksize

    # -- compute -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"SparseConv2d: input must be (N, {self.in_channels}, H, W); got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if self.stride == 2:
            x = x[:, :, ::2, ::2]
        n, _, h, w = x.shape
        bias = None if self.bias is None else self.bias[:, None]
        y = einsum("oc,cp->op", self.weight, channels_first(x), bias=bias,
                   activation=self.activation)
        return y.view(self.out_channels, n, h, w).permute(1, 0, 2, 3)

    def extra_repr(self) -> str:
        fmt = "csr" if self.blocksize is None else f"bsr{self.blocksize}"
        density = self._pattern.nnz / (self.in_channels * self.out_channels)
        return (f"{self.in_channels}, {self.out_channels}, stride={self.stride}, "
                f"density={density:.3f}, format={fmt}, bias={self.bias is not None}, "
                f"activation={self.activation}")


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


def _check_pointwise(conv) -> None:
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"SparseConv2d.from_dense: expected an nn.Conv2d, got {type(conv).__name__}")
    problems = []
    if tuple(conv.kernel_size) != (1, 1):
        problems.append(f"kernel_size={tuple(conv.kernel_size)} (need 1x1)")
    if conv.groups != 1:
        problems.append(f"groups={conv.groups} (need 1)")
    if conv.stride[0] != conv.stride[1] or conv.stride[0] not in (1, 2):
        problems.append(f"stride={tuple(conv.stride)} (need 1 or 2)")
    if tuple(conv.padding) != (0, 0) if not isinstance(conv.padding, str) else conv.padding != "valid":
        problems.append(f"padding={conv.padding} (need 0)")
    if tuple(conv.dilation) != (1, 1):
        problems.append(f"dilation={tuple(conv.dilation)} (need 1)")
    if problems:
        raise ValueError("SparseConv2d.from_dense: only 1x1 convolutions convert; this one has "
                         + ", ".join(problems) + ". Keep it dense (st.sparsify skips it).")
