"""Batch norm folded into the convolution before it (inference: running statistics).

``BN(conv(x)) = gamma * (W x + b - mean) / sqrt(var + eps) + beta`` is a convolution with
weight ``W * s`` and bias ``(b - mean) * s + beta``, ``s = gamma / sqrt(var + eps)`` per
output channel: one layer instead of two, and the bias then rides in the sparse kernel.

Example:
    >>> import torch
    >>> conv, bn = torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4).eval()
    >>> bn.running_mean.uniform_(); bn.running_var.uniform_(0.5, 2)  # doctest: +ELLIPSIS
    tensor(...)
    >>> x = torch.randn(2, 3, 5, 5)
    >>> torch.allclose(fold_batchnorm(conv, bn)(x), bn(conv(x)), atol=1e-5)
    True
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new ``nn.Conv2d`` equal to ``bn(conv(x))`` with ``bn`` in eval mode (its running
    statistics); neither input is modified."""
    if not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
        raise TypeError(f"fold_batchnorm: need an nn.Conv2d and an nn.BatchNorm2d, got "
                        f"{type(conv).__name__} and {type(bn).__name__}")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"fold_batchnorm: batch norm has {bn.num_features} features but the "
                         f"convolution {conv.out_channels} output channels")
    if bn.running_mean is None:
        raise ValueError("fold_batchnorm: batch norm without running statistics "
                         "(track_running_stats=False) cannot be folded; pass fold_bn=False")
    with torch.no_grad():
        scale = bn.running_var.add(bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight
        shift = -bn.running_mean * scale
        if bn.bias is not None:
            shift = shift + bn.bias
        folded = copy.deepcopy(conv)
        folded.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1).to(conv.weight.dtype))
        bias = shift if conv.bias is None else conv.bias * scale + shift
        folded.bias = nn.Parameter(bias.to(conv.weight.dtype))
    return folded
