"""``ChannelsFirstDepthwise``: a dense depthwise convolution that keeps the (C, N, H, W)
memory layout ``SparseConv2d`` produces, so a batch flows between sparse 1x1 layers and
depthwise layers without a transpose at each.

A depthwise convolution treats each channel alone, so a batch in (C, N, H, W) memory is a
set of ``C*N`` (H, W) planes, channel ``c`` of image ``n`` at ``c*N + n``. The 3x3 ones
with padding 1 and stride 1 or 2 (every depthwise layer of MobileNet v1/v2) run
``st.ops.depthwise3x3``, a C kernel over those planes with the bias and activation fused
(1.3-2.9x PyTorch's NCHW depthwise kernel at every MobileNet shape measured, more at
112 x 112; batch 1, one thread; so it is always used: PyTorch's channels_last kernel would
need a transposing copy on each side). Others run PyTorch's own depthwise kernel on the
(1, C*N, H, W) view with each filter repeated ``N`` times (no copy), or, for other layouts
and every batch of one, an ordinary ``conv2d``.

Example:
    >>> import torch, sparsetorch as st
    >>> dw = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    >>> layer = st.nn.ChannelsFirstDepthwise.from_dense(dw, activation="relu6")
    >>> x = torch.randn(4, 2, 5, 5).permute(1, 0, 2, 3)      # (N, C, H, W) in CNHW memory
    >>> y = layer(x)
    >>> torch.allclose(y, torch.nn.functional.relu6(dw(x)), atol=1e-6), y.permute(1, 0, 2, 3).is_contiguous()
    (True, True)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import conv_ops, depthwise3x3
from ..ops.depthwise import prepared_depthwise3x3
from ._common import (NoTorchScript, as_asked, check_conv_parameters, check_image,
                      step_as_asked)

_ACTIVATIONS = {None: None, "relu": F.relu, "relu6": F.relu6}
_is_compiling = torch.compiler.is_compiling


class ChannelsFirstDepthwise(NoTorchScript, nn.Module):
    """Depthwise ``nn.Conv2d`` (``groups == in_channels == out_channels``) with an optional
    fused-in-place ReLU/ReLU6, keeping a (C, N, H, W) memory layout. Parameters ``weight``
    (C, 1, kh, kw) and ``bias`` as ``nn.Conv2d``'s.

    Example:
        >>> import torch, sparsetorch as st
        >>> layer = st.nn.ChannelsFirstDepthwise.from_dense(torch.nn.Conv2d(3, 3, 3, 2, 1, groups=3))
        >>> layer(torch.randn(1, 3, 8, 8)).shape
        torch.Size([1, 3, 4, 4])
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding,
                 dilation, activation: str | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ChannelsFirstDepthwise: activation must be one of "
                             f"{tuple(_ACTIVATIONS)}, got {activation!r}")
        check_conv_parameters("ChannelsFirstDepthwise", weight, bias,
                              "(C, 1, kh, kw): one filter per channel",
                              isinstance(weight, torch.Tensor) and weight.dim() == 4
                              and weight.shape[1] == 1 and weight.shape[0] > 0)
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"ChannelsFirstDepthwise: bias must be ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.activation = activation

    def _fused_stride(self):
        """The stride when ``depthwise3x3`` computes this layer (3x3, padding 1, stride 1 or
        2, no dilation), else None; read at each call, as the attributes may be set after
        construction (kept from it, a later ``layer.stride = 2`` went unseen)."""
        stride = _pair(self.stride)
        return stride[0] if (tuple(self.weight.shape[1:]) == (1, 3, 3)
                             and _pair(self.padding) == (1, 1) and stride in ((1, 1), (2, 2))
                             and _pair(self.dilation) == (1, 1)) else None

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, activation: str | None = None) -> "ChannelsFirstDepthwise":
        """The same convolution as the depthwise ``conv`` (not modified), then ``activation``."""
        if not is_depthwise(conv):
            raise ValueError(f"ChannelsFirstDepthwise.from_dense: need a depthwise nn.Conv2d "
                             f"(groups == in_channels == out_channels, zero padding mode); got {conv}")
        return cls(conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_image(x, "ChannelsFirstDepthwise", self.weight.shape[0], self.weight.dtype)
        return as_asked(self, self._written(x))

    def _written(self, x: torch.Tensor) -> torch.Tensor:
        stride = self._fused_stride()
        if stride is not None:
            if _is_compiling() and conv_ops.depthwise_applies(x, self.weight, self.bias):
                # traced inference: the same kernel as a custom op (ops/conv_ops.py)
                return torch.ops.sparsetorch.depthwise3x3(x, self.weight, self.bias, stride,
                                                          self.activation)
            return depthwise3x3(x, self.weight, self.bias, stride, self.activation)
        n, c = x.shape[:2]
        cnhw = x.permute(1, 0, 2, 3)
        if n > 1 and cnhw.is_contiguous():
            h, w = x.shape[2:]
            weight = self.weight.repeat_interleave(n, 0)
            bias = None if self.bias is None else self.bias.repeat_interleave(n)
            y = F.conv2d(cnhw.reshape(1, c * n, h, w), weight, bias, self.stride, self.padding,
                         self.dilation, c * n)
            y = y.view(c, n, *y.shape[2:]).permute(1, 0, 2, 3)
        else:
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, c)
        act = _ACTIVATIONS[self.activation]
        # In place when no gradient needs the pre-activation: saves a pass over memory.
        return act(y, inplace=not torch.is_grad_enabled()) if act is not None else y

    def _inference_step(self, x):
        """This layer's forward for inputs like ``x`` without autograd, every choice made
        now (``st.freeze``); None where ``forward`` should run."""
        stride = self._fused_stride()
        if stride is None or type(x) is not torch.Tensor or torch.is_grad_enabled():
            return None
        return step_as_asked(self, prepared_depthwise3x3(x, self.weight, self.bias, stride,
                                                          self.activation))

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, kernel_size={tuple(self.weight.shape[2:])}, "
                f"stride={self.stride}, padding={self.padding}, activation={self.activation}")


def is_depthwise(conv) -> bool:
    """True for an ``nn.Conv2d`` with ``groups == in_channels == out_channels > 1`` and zero
    padding mode."""
    return (isinstance(conv, nn.Conv2d) and conv.groups > 1
            and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding_mode == "zeros" and not isinstance(conv.padding, str))


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)
