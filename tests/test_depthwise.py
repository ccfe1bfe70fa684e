"""``st.ops.depthwise3x3`` (the channel-first 3x3 depthwise kernel) against dense
``F.conv2d`` + activation: strides, odd and tiny sizes, both memory layouts, batches,
float32/float64, several threads, gradients (gradcheck), NaN, fallbacks and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache, split_by_rows  # noqa: F401
from sparsetorch.nn import ChannelsFirstDepthwise
from sparsetorch.ops.depthwise import _kernel, split_rows

ACT = {None: lambda y: y, "relu": F.relu, "relu6": F.relu6}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}
# (n, c, h, w): 1x1 and single rows/columns, odd sizes, a row longer than two vectors with a
# tail, planes held whole (h <= 16) and in the five-row ring (h > 16), odd output rows
SHAPES = [(1, 3, 1, 1), (2, 2, 1, 5), (1, 2, 4, 1), (1, 4, 5, 7), (3, 3, 6, 8), (2, 5, 7, 9),
          (1, 2, 20, 19), (2, 3, 17, 37), (1, 1, 33, 2)]


def _cnhw(x: torch.Tensor) -> torch.Tensor:
    """``x`` with (C, N, H, W) memory, what SparseConv2d returns."""
    return x.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)


def _reference(x, w, b, stride, act):
    return ACT[act](F.conv2d(x, w, b, stride, 1, 1, x.shape[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_conv2d(dtype):
    assert _kernel(dtype) is not None   # built here (a failed build would fall back to torch)
    gen = torch.Generator().manual_seed(0)
    combos = [(None, True), ("relu", False), ("relu6", True)]   # (activation, with bias)
    for i, (n, c, h, w) in enumerate(SHAPES):
        x = torch.randn(n, c, h, w, dtype=dtype, generator=gen) * 3
        wt = torch.randn(c, 1, 3, 3, dtype=dtype, generator=gen)
        b = torch.randn(c, dtype=dtype, generator=gen)
        for stride in (1, 2):
            act, with_bias = combos[(i + stride) % 3]
            bias = b if with_bias else None
            ref = _reference(x, wt, bias, stride, act)
            for xin in (x, _cnhw(x)):
                y = st.ops.depthwise3x3(xin, wt, bias, stride, act)
                torch.testing.assert_close(y, ref, **TOL[dtype])
                # the result keeps the input's memory layout
                assert y.permute(1, 0, 2, 3).is_contiguous() == \
                    (xin.permute(1, 0, 2, 3).is_contiguous() and n > 1 or n == 1)


def test_two_threads_split_planes_of_a_batch():
    # 3 images x 7 channels x 40 x 40: big enough for the parallel path; 21 planes split
    # over 2 threads start the second thread mid-channel in (C, N, H, W) order
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(1)
        x, wt, b = torch.randn(3, 7, 40, 40), torch.randn(7, 1, 3, 3), torch.randn(7)
        for stride in (1, 2):
            ref = _reference(x, wt, b, stride, "relu")
            for xin in (x, _cnhw(x)):
                torch.testing.assert_close(st.ops.depthwise3x3(xin, wt, b, stride, "relu"), ref,
                                           rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_by_rows_matches_conv2d(dtype, split_by_rows):
    """Each thread a band of every plane's rows (of the batch's rows, images in order, for
    (C, N, H, W) memory; NCHW batches keep the split by planes)."""
    assert split_rows(3, 1) == 1
    gen = torch.Generator().manual_seed(2)
    for n, c, h, w in SHAPES + [(2, 3, 5, 6), (3, 2, 40, 9)]:
        x = torch.randn(n, c, h, w, dtype=dtype, generator=gen)
        wt = torch.randn(c, 1, 3, 3, dtype=dtype, generator=gen)
        b = torch.randn(c, dtype=dtype, generator=gen)
        for stride in (1, 2):
            ref = _reference(x, wt, b, stride, "relu6")
            for xin in (x, _cnhw(x)):
                torch.testing.assert_close(st.ops.depthwise3x3(xin, wt, b, stride, "relu6"),
                                           ref, **TOL[dtype])


@pytest.mark.parametrize("stride,act", [(1, "relu6"), (2, None)])
def test_gradcheck(stride, act):
    torch.manual_seed(2)
    x = _cnhw(torch.randn(2, 2, 4, 5, dtype=torch.float64) * 2).requires_grad_()
    wt = torch.randn(2, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: st.ops.depthwise3x3(x, w, b, stride, act), (x, wt, b))
    # and the same gradients as torch's own convolution
    y = st.ops.depthwise3x3(x, wt, b, stride, act)
    grads = torch.autograd.grad(y.square().sum(), (x, wt, b))
    ref = torch.autograd.grad(_reference(x, wt, b, stride, act).square().sum(), (x, wt, b))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    if act is None:   # (the output is not needed: changed in place first, as F.conv2d's)
        y = st.ops.depthwise3x3(x, wt, b, stride, act)
        y += 1
        grads = torch.autograd.grad(y.square().sum(), (x, wt, b))
        ref = torch.autograd.grad((_reference(x, wt, b, stride, act) + 1).square().sum(),
                                  (x, wt, b))
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r)


def test_nan_passes_and_fallbacks():
    x = torch.randn(1, 2, 5, 5)
    x[0, 0, 2, 2] = float("nan")
    wt, b = torch.randn(2, 1, 3, 3), torch.randn(2)
    for act in ("relu", "relu6"):
        y, ref = st.ops.depthwise3x3(x, wt, b, 1, act), _reference(x, wt, b, 1, act)
        assert torch.equal(y.isnan(), ref.isnan()) and y.isnan().sum() == 9
    # layouts the kernel does not read (channels_last, a strided view) run torch's
    z = torch.randn(2, 3, 6, 6)
    w3, b3 = torch.randn(3, 1, 3, 3), torch.randn(3)
    for xin in (z.contiguous(memory_format=torch.channels_last), z[:, :, :, ::2]):
        torch.testing.assert_close(st.ops.depthwise3x3(xin, w3, b3, 2, "relu"),
                                   _reference(xin, w3, b3, 2, "relu"))


def test_torch_backend_matches(monkeypatch):
    x, wt = torch.randn(2, 3, 7, 7), torch.randn(3, 1, 3, 3)
    ref = st.ops.depthwise3x3(x, wt, None, 2, "relu6")
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    torch.testing.assert_close(st.ops.depthwise3x3(x, wt, None, 2, "relu6"), ref)


def test_bad_input_is_named():
    x, wt = torch.randn(1, 4, 5, 5), torch.randn(4, 1, 3, 3)
    with pytest.raises(ValueError, match=r"x must be a 4-D"):
        st.ops.depthwise3x3(x[0], wt)
    with pytest.raises(ValueError, match=r"weight must be \(4, 1, 3, 3\)"):
        st.ops.depthwise3x3(x, torch.randn(4, 1, 5, 5))
    with pytest.raises(ValueError, match=r"bias must be None or \(4,\)"):
        st.ops.depthwise3x3(x, wt, torch.randn(3))
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        st.ops.depthwise3x3(x, wt, stride=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        st.ops.depthwise3x3(x, wt, activation="gelu")
    for conv in (nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Conv2d(4, 4, 5, padding=2, groups=4)):
        layer = st.nn.ChannelsFirstDepthwise.from_dense(conv)   # the kernel's and torch's
        with pytest.raises(TypeError, match="ChannelsFirstDepthwise: input is torch.float64"):
            layer(x.double())
        with pytest.raises(ValueError, match=r"ChannelsFirstDepthwise: input must be a dense "
                                             r"\(N, 4, H, W\) tensor; got \(1, 3, 5, 5\)"):
            layer(x[:, :3])


def test_layer_constructors_check_their_parameters():
    """(Torch's errors came at the first call, or an AttributeError for a list.)"""
    with pytest.raises(ValueError, match=r"weight must be \(C, 1, kh, kw\).*got \(4, 2, 3, 3\)"):
        ChannelsFirstDepthwise(torch.ones(4, 2, 3, 3), None, 1, 1, 1)
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        ChannelsFirstDepthwise([1.0, 2.0], None, 1, 1, 1)
    with pytest.raises(TypeError, match="bias is torch.float64 but weight torch.float32"):
        ChannelsFirstDepthwise(torch.ones(4, 1, 3, 3), torch.ones(4).double(), 1, 1, 1)
    with pytest.raises(ValueError, match=r"bias must be \(4,\), got \(3,\)"):
        ChannelsFirstDepthwise(torch.ones(4, 1, 3, 3), torch.ones(3), 1, 1, 1)
    with pytest.raises(TypeError, match="ChannelsFirstStem: bias is torch.float64"):
        st.nn.ChannelsFirstStem(torch.ones(4, 3, 3, 3), torch.ones(4).double())
    layer = ChannelsFirstDepthwise(torch.ones(4, 1, 3, 3), None, 1, 1, 1)
    with pytest.raises(TypeError, match="input is a torch.sparse tensor"):
        layer(torch.ones(1, 4, 5, 5).to_sparse())


def test_layer_uses_the_kernel_for_3x3_and_torch_otherwise():
    torch.manual_seed(3)
    x = _cnhw(torch.randn(2, 4, 9, 9))
    for conv, fused in ((nn.Conv2d(4, 4, 3, 2, 1, groups=4), 2),
                        (nn.Conv2d(4, 4, 5, 1, 2, groups=4), None),
                        (nn.Conv2d(4, 4, 3, 1, 2, dilation=2, groups=4), None)):
        layer = ChannelsFirstDepthwise.from_dense(conv, activation="relu")
        assert layer._fused_stride() == fused
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.relu(conv(x)), rtol=1e-5, atol=1e-5)
    # attributes set after construction are honoured (the kernel's choice was kept from it)
    conv = nn.Conv2d(4, 4, 3, 1, 1, groups=4)
    layer = ChannelsFirstDepthwise.from_dense(conv)
    for attr, value in (("stride", (2, 2)), ("padding", (0, 0)), ("dilation", (2, 2))):
        setattr(layer, attr, value)
        setattr(conv, attr, value)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), conv(x), rtol=1e-5, atol=1e-5)
    # training: gradients reach the layer's parameters through the kernel's backward
    layer = ChannelsFirstDepthwise.from_dense(nn.Conv2d(4, 4, 3, 1, 1, groups=4), "relu6")
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None


@pytest.mark.slow   # (dynamo's first trace in a process: about a minute on 2 busy cores)
def test_traced_by_torch_compile():
    # dynamo's fake tensors have no memory: the ops take torch's path (and einsum's) there
    x, wt, b = torch.randn(1, 4, 7, 7), torch.randn(4, 1, 3, 3), torch.randn(4)
    fn = torch.compile(lambda x: st.ops.depthwise3x3(x, wt, b, 2, "relu6"), backend="eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(x), _reference(x, wt, b, 2, "relu6"))
