"""The ConvNet layers' kernels as ``torch.library`` custom ops for traced inference:
``narrow.py``'s sparse 1x1 product (``SparseConv2d``) and ``depthwise.py``'s 3x3 depthwise
convolution (``ChannelsFirstDepthwise``).

Traced (``torch.compile``), both layers ran generic paths: the 1x1 products einsum's
traced kernels, the depthwise convolutions torch's, each kernel reading raw pointers that
fake tensors do not have. A compiled sparse MobileNet v1 (90%, batch 1, 2 threads)
evaluated at 0.46-0.49x its eager speed; with these ops, which record the eager kernels
instead, at 0.71-0.79x (``python benchmarks/nn_layers.py --only compiled``). Their real
implementations are the eager calls; the fake ones give the shapes and, for the depthwise
convolution, the memory layout its kernel writes. Forward only: where autograd
records, the layers keep their traced paths (these ops have no derivative).

Example:
    >>> import torch, sparsetorch as st
    >>> layer = st.nn.SparseConv2d.from_dense(torch.nn.Conv2d(8, 4, 1), sparsity=0.5)
    >>> f = torch.compile(layer, fullgraph=True, backend="aot_eager")
    >>> x = torch.randn(1, 8, 5, 5)
    >>> with torch.no_grad():
    ...     torch.allclose(f(x), layer(x), atol=1e-6)
    True
"""
from __future__ import annotations

import torch

from .._modes import constant_to_tracer
from ..compiler.kernel import vector_isa
from .custom_ops import csr_operand
from .depthwise import _plane_order, depthwise3x3
from .narrow import spmm_narrow
from .policy import backend


@constant_to_tracer   # (finding the vector ISA reads /proc/cpuinfo)
def _has_kernels() -> bool:
    # (whether a build then succeeds is the eager calls' business: they fall back to
    # einsum or torch, and these ops' results are theirs)
    return backend() == "c" and vector_isa() is not None


def _inference(*tensors) -> bool:
    """No gradient wanted of any of ``tensors`` (None allowed)."""
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors)


def narrow_applies(x: torch.Tensor, values: torch.Tensor, bias, activation) -> bool:
    """Whether ``spmm_narrow_op`` takes a 1x1 layer's product of its (C, P) columns ``x``
    (read while tracing: dtypes, devices, grad mode)."""
    return (x.dtype == values.dtype == torch.float32 and x.device.type == "cpu"
            and values.device.type == "cpu" and x.dim() == 2 and activation in
            (None, "relu", "relu6") and (bias is None or bias.dtype == torch.float32)
            and _inference(x, values, bias) and _has_kernels())


@torch.library.custom_op("sparsetorch::spmm_narrow", mutates_args=())
def spmm_narrow_op(pos: torch.Tensor, crd: torch.Tensor, values: torch.Tensor,
                   in_features: int, x: torch.Tensor, bias: torch.Tensor | None,
                   activation: str | None, band: int) -> torch.Tensor:
    """``spmm_narrow`` of the ``(m, in_features)`` CSR matrix of ``pos``, ``crd``,
    ``values`` and the columns ``x``.

    Example:
        >>> import torch
        >>> pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor(
        ...     [1, 0], dtype=torch.int32)
        >>> torch.ops.sparsetorch.spmm_narrow(pos, crd, torch.tensor([2., 3.]), 2,
        ...                                   torch.ones(2, 3), None, None, 0).tolist()
        [[2.0, 2.0, 2.0], [3.0, 3.0, 3.0]]
    """
    return spmm_narrow(csr_operand(pos, crd, values, in_features, "sparsetorch::spmm_narrow"),
                       x.contiguous(), bias, activation, band)


@spmm_narrow_op.register_fake
def _(pos, crd, values, in_features, x, bias, activation, band):
    return x.new_empty((pos.shape[0] - 1, x.shape[1]))


def depthwise_applies(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether ``depthwise_op`` takes this 3x3 depthwise convolution: a memory layout its
    kernel reads (NCHW or (C, N, H, W)), float32/float64 CPU tensors, no gradient wanted."""
    return (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64)
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and (bias is None or bias.dtype == x.dtype) and _plane_order(x, x.shape)
            is not None and _inference(x, weight, bias) and _has_kernels())


def _written_layout(x: torch.Tensor, stride: int) -> tuple:
    """``(shape, strides)`` of the depthwise kernel's result for ``x``: ``x``'s layout."""
    n, c, h, w = x.shape
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    if _plane_order(x, x.shape) == 1:
        return (n, c, oh, ow), (c * oh * ow, oh * ow, ow, 1)
    return (n, c, oh, ow), (oh * ow, n * oh * ow, ow, 1)


@torch.library.custom_op("sparsetorch::depthwise3x3", mutates_args=())
def depthwise_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 stride: int, activation: str | None) -> torch.Tensor:
    """``depthwise3x3``, its result in the layout the fake kernel promises (a copy only
    where torch ran instead of the kernel, for operands it does not take).

    Example:
        >>> import torch
        >>> y = torch.ops.sparsetorch.depthwise3x3(torch.ones(1, 2, 3, 3),
        ...                                        torch.ones(2, 1, 3, 3), None, 1, None)
        >>> y[0, 0].tolist()
        [[4.0, 6.0, 4.0], [6.0, 9.0, 6.0], [4.0, 6.0, 4.0]]
    """
    out = depthwise3x3(x, weight, bias, stride, activation)
    shape, strides = _written_layout(x, stride)
    if out.stride() != strides:
        out = torch.empty_strided(shape, strides, dtype=out.dtype).copy_(out)
    return out


@depthwise_op.register_fake
def _(x, weight, bias, stride, activation):
    shape, strides = _written_layout(x, stride)
    return x.new_empty_strided(shape, strides)
