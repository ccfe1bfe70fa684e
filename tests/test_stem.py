"""``st.ops.stem_conv3x3`` and ``st.nn.ChannelsFirstStem`` (a dense 3x3 convolution of images
with at most four channels, bias and activation fused, (C, N, H, W) memory out) against
``F.conv2d``: strides, odd and tiny images, channel counts around the 8-channel blocks,
batches, rows split across threads, torch's path (float64, gradients, five channels), bad
arguments, and ``st.sparsify`` making a stem of a model's first convolution."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache, split_by_rows  # noqa: F401
from sparsetorch.nn.stem import is_stem
from sparsetorch.ops.stem import _kernel_for

ACT = {None: lambda y: y, "relu": F.relu, "relu6": F.relu6}
SHAPES = [(1, 3, 224, 224, 32), (1, 3, 11, 9, 8), (2, 3, 10, 13, 13), (3, 1, 5, 5, 5),
          (1, 4, 7, 8, 17), (2, 3, 1, 1, 3), (1, 2, 2, 3, 1)]


def _check(n, c, h, w, o, stride, act, bias=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(n * 1000 + c * 100 + h + w + o)
    x = torch.randn(n, c, h, w, generator=gen, dtype=dtype) * 3
    weight = torch.randn(o, c, 3, 3, generator=gen, dtype=dtype)
    b = torch.randn(o, generator=gen, dtype=dtype) if bias else None
    y = st.ops.stem_conv3x3(x, weight, b, stride, act)
    torch.testing.assert_close(y, ACT[act](F.conv2d(x, weight, b, stride, 1)),
                               rtol=1e-4, atol=1e-4)
    assert y.permute(1, 0, 2, 3).is_contiguous()   # (O, N, OH, OW) memory
    return x


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stride", [1, 2])
def test_matches_conv2d(shape, stride):
    for act, bias in ((None, False), ("relu", True), ("relu6", True)):
        x = _check(*shape, stride, act, bias)
    assert _kernel_for(x, torch.ones(1, x.shape[1], 3, 3), None) is not None or \
        st.ops.stem._kernel() is None   # the kernel ran where this CPU has one


def test_rows_split_across_threads(split_by_rows):
    for shape in SHAPES[1:]:
        _check(*shape, 2, "relu")
        _check(*shape, 1, None)


def test_torch_path_float64_gradients_wide_inputs():
    _check(2, 3, 6, 7, 9, 2, "relu6", dtype=torch.float64)
    _check(1, 5, 6, 6, 4, 1, "relu")   # five channels: torch's convolution
    stem = st.nn.ChannelsFirstStem(torch.randn(4, 3, 3, 3, dtype=torch.float64),
                                   torch.randn(4, dtype=torch.float64), stride=2,
                                   activation="relu6")
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w, b: st.ops.stem_conv3x3(x, w, b, 2, "relu6"),
                             (x, stem.weight, stem.bias))
    stem(x).sum().backward()
    assert stem.weight.grad is not None and x.grad is not None


def test_bad_arguments():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match="x must be a 4-D"):
        st.ops.stem_conv3x3(x[0], w)
    with pytest.raises(ValueError, match=r"weight must be \(O, 3, 3, 3\)"):
        st.ops.stem_conv3x3(x, torch.randn(4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"bias must be None or \(4,\)"):
        st.ops.stem_conv3x3(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        st.ops.stem_conv3x3(x, w, stride=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        st.ops.stem_conv3x3(x, w, activation="gelu")
    with pytest.raises(ValueError, match="need an nn.Conv2d with a 3x3 kernel"):
        st.nn.ChannelsFirstStem.from_dense(nn.Conv2d(3, 8, 3))   # no padding
    with pytest.raises(ValueError, match=r"input must be a dense \(N, 3, H, W\) tensor; got "
                                         r"\(1, 2, 8, 8\)"):
        st.nn.ChannelsFirstStem(w, None)(torch.randn(1, 2, 8, 8))
    with pytest.raises(TypeError, match="ChannelsFirstStem: input is torch.float64 but the "
                                        "weights are torch.float32"):
        st.nn.ChannelsFirstStem(w, None)(x.double())
    with pytest.raises(ValueError, match="C <= 4"):
        st.nn.ChannelsFirstStem(torch.randn(8, 16, 3, 3), None)


def test_layer_loads_conv_state_and_sparsify_makes_stems():
    conv = nn.Conv2d(3, 16, 3, 2, 1)
    stem = st.nn.ChannelsFirstStem(torch.zeros(16, 3, 3, 3), torch.zeros(16), stride=2)
    stem.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 12, 12)
    torch.testing.assert_close(stem(x.permute(0, 1, 3, 2).transpose(2, 3)), conv(x))
    assert is_stem(conv) and not is_stem(nn.Conv2d(8, 16, 3, 2, 1))
    net = nn.Sequential(conv, nn.BatchNorm2d(16), nn.ReLU6(), nn.Conv2d(16, 8, 1)).eval()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    sparse = st.sparsify(net, sparsity=0.5)
    assert [type(m).__name__ for m in sparse][:3] == ["ChannelsFirstStem", "Identity", "Identity"]
    assert sparse[0].activation == "relu6"
    dense_stem = F.relu6(net[1](conv(x)))
    with torch.no_grad():
        torch.testing.assert_close(sparse[0](x), dense_stem, rtol=1e-5, atol=1e-5)
