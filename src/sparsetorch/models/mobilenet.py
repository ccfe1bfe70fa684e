"""MobileNet v1 (Howard et al. 2017) and v2 (Sandler et al. 2018), dense, written by hand
with torchvision's architecture and initialisation (v2 layer for layer as
``torchvision.models.mobilenet_v2``; v1 as the paper's Table 1): convolution, batch norm and
ReLU (v1) or ReLU6 (v2) as ``nn.Sequential`` blocks, so ``st.sparsify`` folds and fuses them.

Example:
    >>> import torch
    >>> net = mobilenet_v1(width_mult=0.25, num_classes=10).eval()
    >>> net(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import torch
from torch import nn

# MobileNet v1: (output channels, stride) of each depthwise-separable block after the stem.
_V1_BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1),
              (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]
# MobileNet v2: expansion t, output channels c, repeats n, first stride s (the paper's Table 2).
_V2_SETTING = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
               (6, 160, 3, 2), (6, 320, 1, 1)]


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor`` (torchvision's ``_make_divisible``:
    never below ``divisor``, never more than 10% below ``v``).

    Example:
        >>> make_divisible(32 * 0.35), make_divisible(1280 * 1.4)
        (16, 1792)
    """
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_bn(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1,
             activation: type[nn.Module] | None = nn.ReLU6) -> nn.Sequential:
    layers = [nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(out)]
    if activation is not None:
        layers.append(activation(inplace=True))
    return nn.Sequential(*layers)


class _Classifier(nn.Module):
    """Global average pool, dropout, linear: the head both MobileNets share."""

    def __init__(self, features: nn.Sequential, channels: int, num_classes: int, dropout: float):
        super().__init__()
        self.features = features
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(channels, num_classes))
        for m in self.modules():   # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class MobileNetV1(_Classifier):
    """MobileNet v1: a 3x3 stem of stride 2, then 13 depthwise-separable blocks (3x3
    depthwise + 1x1 pointwise, each with batch norm and ReLU), pool, classifier."""

    def __init__(self, width_mult: float = 1.0, num_classes: int = 1000, dropout: float = 0.001):
        _check_args(width_mult, num_classes, "mobilenet_v1")
        inp = make_divisible(32 * width_mult)
        layers = [_conv_bn(3, inp, stride=2, activation=nn.ReLU)]
        for out, stride in _V1_BLOCKS:
            out = make_divisible(out * width_mult)
            layers.append(nn.Sequential(
                _conv_bn(inp, inp, stride=stride, groups=inp, activation=nn.ReLU),
                _conv_bn(inp, out, kernel=1, activation=nn.ReLU)))
            inp = out
        super().__init__(nn.Sequential(*layers), inp, num_classes, dropout)


class InvertedResidual(nn.Module):
    """MobileNet v2 block: 1x1 expansion (unless t = 1), 3x3 depthwise, 1x1 linear
    projection, with a residual connection when the shape is kept."""

    def __init__(self, inp: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = int(round(inp * expand))
        self.use_residual = stride == 1 and inp == out
        layers = [] if expand == 1 else [_conv_bn(inp, hidden, kernel=1)]
        layers += [_conv_bn(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(_Classifier):
    """MobileNet v2 as torchvision's ``mobilenet_v2``."""

    def __init__(self, width_mult: float = 1.0, num_classes: int = 1000, dropout: float = 0.2):
        _check_args(width_mult, num_classes, "mobilenet_v2")
        inp = make_divisible(32 * width_mult)
        last = make_divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [_conv_bn(3, inp, stride=2)]
        for t, c, n, s in _V2_SETTING:
            out = make_divisible(c * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(inp, out, s if i == 0 else 1, t))
                inp = out
        layers.append(_conv_bn(inp, last, kernel=1))
        super().__init__(nn.Sequential(*layers), last, num_classes, dropout)


def mobilenet_v1(width_mult: float = 1.0, num_classes: int = 1000) -> MobileNetV1:
    """Dense MobileNet v1 for 224x224 ImageNet inputs (4.2M parameters at width 1.0).

    Example:
        >>> sum(p.numel() for p in mobilenet_v1().parameters())
        4231976
    """
    return MobileNetV1(width_mult, num_classes)


def mobilenet_v2(width_mult: float = 1.0, num_classes: int = 1000) -> MobileNetV2:
    """Dense MobileNet v2, as ``torchvision.models.mobilenet_v2(width_mult=...)`` (3.5M
    parameters at width 1.0).

    Example:
        >>> sum(p.numel() for p in mobilenet_v2().parameters())
        3504872
    """
    return MobileNetV2(width_mult, num_classes)


def _check_args(width_mult, num_classes, what: str) -> None:
    if not isinstance(width_mult, (int, float)) or isinstance(width_mult, bool) or \
            not 0 < width_mult < float("inf"):   # (NaN and inf failed inside int())
        raise ValueError(f"{what}: width_mult must be a positive number, got {width_mult!r}")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"{what}: num_classes must be a positive int, got {num_classes!r}")
