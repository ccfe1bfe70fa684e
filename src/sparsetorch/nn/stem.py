"""``ChannelsFirstStem``: a ConvNet's first convolution (3x3, padding 1, stride 1 or 2, an
image of at most four channels) kept dense, run by ``st.ops.stem_conv3x3`` with the bias and
ReLU/ReLU6 fused, its output written in the (C, N, H, W) memory the sparse and depthwise
layers after it read (plain NCHW for one image).

``st.sparsify`` makes such a convolution one (its batch norm folded in, the activation after
fused), as it makes the depthwise convolutions ``ChannelsFirstDepthwise``: the layer stays
dense, as in Fast Sparse ConvNets, but its kernel is this package's (1.5-1.7x PyTorch's NCHW
convolution and separate ReLU for MobileNet's 3 -> 32 stem at 224 x 224, 2 threads; PyTorch's
time also jumped to 1 ms in some runs).

Example:
    >>> import torch, sparsetorch as st
    >>> conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
    >>> stem = st.nn.ChannelsFirstStem.from_dense(conv, activation="relu")
    >>> x = torch.randn(2, 3, 9, 9)
    >>> torch.allclose(stem(x), torch.relu(conv(x)), atol=1e-5)
    True
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.depthwise import check_epilogue
from ..ops.stem import MAX_CHANNELS, prepared_stem_conv3x3, stem_conv3x3
from ._common import (NoTorchScript, as_asked, check_conv_parameters, check_image,
                      step_as_asked)



class ChannelsFirstStem(NoTorchScript, nn.Module):
    """``activation(conv2d(x, weight, bias, stride, padding=1))`` for ``weight`` (O, C, 3, 3)
    with ``C <= 4``; parameters ``weight`` and ``bias`` named as ``nn.Conv2d``'s (its
    ``state_dict`` loads). Input (N, C, H, W) in any memory layout; output (N, O, OH, OW) in
    (O, N, OH, OW) memory. Differentiable (torch's convolution while autograd records).

    Example:
        >>> import torch, sparsetorch as st
        >>> stem = st.nn.ChannelsFirstStem(torch.ones(4, 3, 3, 3), None, stride=2)
        >>> stem(torch.ones(1, 3, 6, 6)).shape
        torch.Size([1, 4, 3, 3])
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stride: int = 1,
                 activation: str | None = None):
        super().__init__()
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 4
                or tuple(weight.shape[2:]) != (3, 3) or not 1 <= weight.shape[1] <= MAX_CHANNELS):
            raise ValueError(f"ChannelsFirstStem: weight must be (O, C, 3, 3) with C <= "
                             f"{MAX_CHANNELS}, got {tuple(getattr(weight, 'shape', ()))}")
        check_epilogue("ChannelsFirstStem", bias, weight.shape[0], stride, activation)
        check_conv_parameters("ChannelsFirstStem", weight, bias, "(O, C, 3, 3)", True)
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.stride, self.activation = stride, activation

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, activation: str | None = None) -> "ChannelsFirstStem":
        """The same convolution as ``conv`` (not modified; ``is_stem(conv)`` must hold),
        then ``activation``."""
        if not is_stem(conv):
            raise ValueError(f"ChannelsFirstStem.from_dense: need an nn.Conv2d with a 3x3 "
                             f"kernel, padding 1, stride 1 or 2, one group, at most "
                             f"{MAX_CHANNELS} input channels and zero padding mode; got {conv}")
        return cls(conv.weight, conv.bias, conv.stride[0], activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_image(x, "ChannelsFirstStem", self.weight.shape[1], self.weight.dtype)
        if not x.is_contiguous():
            x = x.contiguous()
        return as_asked(self, stem_conv3x3(x, self.weight, self.bias, self.stride,
                                           self.activation))

    def _inference_step(self, x):
        """This layer's forward for inputs like ``x`` without autograd, every choice made
        now (``st.freeze``); None where ``forward`` should run."""
        if (type(x) is not torch.Tensor or x.dim() != 4 or x.shape[1] != self.weight.shape[1]
                or not x.is_contiguous() or torch.is_grad_enabled()):
            return None
        return step_as_asked(self, prepared_stem_conv3x3(x, self.weight, self.bias,
                                                          self.stride, self.activation))

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[1]}, {self.weight.shape[0]}, kernel_size=(3, 3), "
                f"stride={self.stride}, padding=1, activation={self.activation}")


def is_stem(conv) -> bool:
    """True for an ``nn.Conv2d`` that ``ChannelsFirstStem`` computes: 3x3 kernel, padding 1,
    stride 1 or 2 (both ways), no dilation, one group, zero padding mode and at most
    ``MAX_CHANNELS`` input channels.

    Example:
        >>> import torch
        >>> is_stem(torch.nn.Conv2d(3, 32, 3, 2, 1)), is_stem(torch.nn.Conv2d(3, 32, 3))
        (True, False)
    """
    return (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (3, 3)
            and not isinstance(conv.padding, str) and tuple(conv.padding) == (1, 1)
            and tuple(conv.stride) in ((1, 1), (2, 2)) and tuple(conv.dilation) == (1, 1)
            and conv.groups == 1 and conv.padding_mode == "zeros"
            and conv.in_channels <= MAX_CHANNELS)
