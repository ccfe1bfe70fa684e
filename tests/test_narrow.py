"""``st.ops.spmm_narrow`` (CSR weight x at most 256 dense columns, bias and activation
fused) against dense torch: column counts around the vector width, empty rows and an empty
pattern, int32/int64 indices, two threads, and the einsum fallback (wide, float64,
gradients), through ``SparseConv2d`` on 7 x 7 inputs too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from dense_check import private_kernel_cache, split_by_rows  # noqa: F401
from sparsetorch.compiler.kernel import vector_isa
from sparsetorch.ops.narrow import _kernel_for

ACT = {None: lambda y: y, "relu": F.relu, "relu6": F.relu6}


def _weight(m, k, density, index_dtype=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(m, k, generator=gen, dtype=dtype) * 3
    dense *= torch.rand(m, k, generator=gen) < density
    dense[1] = 0   # an empty row
    return dense, st.tensor(dense, format="csr", index_dtype=index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_dense(index_dtype):
    dense, W = _weight(13, 40, 0.3, index_dtype)
    assert W.index_dtype == index_dtype
    if vector_isa() is not None:   # the kernel runs here (not einsum)
        assert _kernel_for(W, torch.randn(40, 49), None, 0) is not None
    for p in (1, 7, 8, 9, 17, 49, 64, 65, 196, 256, 784):   # one chunk of columns, several
        x = torch.randn(40, p)
        for act, bias in ((None, None), ("relu", torch.randn(13)), ("relu6", torch.randn(13))):
            ref = ACT[act](dense @ x + (0 if bias is None else bias[:, None]))
            torch.testing.assert_close(st.ops.spmm_narrow(W, x, bias, act), ref,
                                       rtol=1e-5, atol=1e-5)


def test_empty_pattern_two_threads_and_fallbacks():
    _, empty = _weight(5, 6, 0.0)
    b = torch.randn(5)
    torch.testing.assert_close(st.ops.spmm_narrow(empty, torch.randn(6, 49), b, None),
                               b[:, None].expand(5, 49))
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:   # enough work for both threads, an odd row count; rows copied to aligned strides
        # (on AVX2 the strip kernel: 51 terms a row in two chains, summed in another order)
        dense, W = _weight(301, 256, 0.2)
        for p in (49, 196, 64):
            x = torch.randn(256, p)
            torch.testing.assert_close(st.ops.spmm_narrow(W, x, None, "relu"),
                                       F.relu(dense @ x), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(old)
    # wider than max_columns() (256, or 1024 on AVX-512), float64: einsum, the same results
    dense, W = _weight(9, 20, 0.4)
    x = torch.randn(20, 1025)
    torch.testing.assert_close(st.ops.spmm_narrow(W, x), dense @ x, rtol=1e-5, atol=1e-5)
    dense64, W64 = _weight(9, 20, 0.4, dtype=torch.float64)
    x64 = torch.randn(20, 30, dtype=torch.float64)
    torch.testing.assert_close(st.ops.spmm_narrow(W64, x64, None, "relu6"),
                               F.relu6(dense64 @ x64))
    with pytest.raises(ValueError, match="activation must be one of"):
        st.ops.spmm_narrow(W, x, activation="tanh")


def test_column_bands_match_dense(split_by_rows):
    """``band``: each thread whole bands of columns, any width; bands that do not divide
    the columns (the last thread takes the rest), wider than the columns, of one column."""
    dense, W = _weight(13, 40, 0.3)
    bias = torch.randn(13)
    for p, band in ((3136, 56), (300, 7), (5, 9), (17, 1), (1, 1), (257, 16)):
        x = torch.randn(40, p)
        torch.testing.assert_close(st.ops.spmm_narrow(W, x, bias, "relu6", band=band),
                                   F.relu6(dense @ x + bias[:, None]), rtol=1e-5, atol=1e-5)
    for bad in (-1, 2.0, None):
        with pytest.raises(ValueError, match="band must be an int >= 0"):
            st.ops.spmm_narrow(W, x, band=bad)


def test_gradients_take_einsum():
    dense, W = _weight(6, 8, 0.5, dtype=torch.float64)
    values = W.values.clone().requires_grad_()
    x = torch.randn(8, 10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda v, x, b: st.ops.spmm_narrow(W.with_values(v), x, b, "relu"), (values, x, b))


def test_sparse_conv_on_seven_by_seven():
    torch.manual_seed(4)
    conv = torch.nn.Conv2d(32, 24, 1)
    layer = st.nn.SparseConv2d.from_dense(conv, sparsity=0.8, activation="relu6")
    w = layer.weight.to_dense()[:, :, None, None]
    for x in (torch.randn(1, 32, 7, 7), torch.randn(1, 32, 28, 28)):   # narrow / einsum
        with torch.no_grad():
            y = layer(x)
        torch.testing.assert_close(y, F.relu6(F.conv2d(x, w, conv.bias)), rtol=1e-5, atol=1e-5)


@pytest.fixture
def strips_everywhere(monkeypatch):
    """The strip kernel (AVX2-only CPUs) for every weight, however few its input channels
    or stored entries."""
    from sparsetorch.ops import narrow
    monkeypatch.setattr(narrow, "_STRIP_FROM", dict.fromkeys(narrow._STRIP_FROM, 0))


@pytest.mark.skipif(vector_isa() != "avx2", reason="the strip kernel runs on AVX2-only CPUs")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_strips_match_dense(strips_everywhere, split_by_rows, index_dtype):
    """Strips of 1-4 vectors and partial ones, fewer strips than the three threads (split
    by rows too, a thread's units spanning two strips), wider than the chunk kernel's
    limit, column bands; rows of 0, 1 and odd numbers of entries (the second chain)."""
    dense, W = _weight(13, 40, 0.3, index_dtype)
    assert _kernel_for(W, torch.randn(40, 49), None, 0)[1] is None   # (lanes None: strips)
    _, empty = _weight(5, 40, 0.0, index_dtype)   # no stored entry: the bias alone
    b = torch.randn(5)
    torch.testing.assert_close(st.ops.spmm_narrow(empty, torch.randn(40, 70), b, "relu6"),
                               F.relu6(b)[:, None].expand(5, 70))
    for p, band in ((1, 0), (7, 0), (8, 0), (9, 0), (17, 0), (31, 0), (32, 0), (33, 0),
                    (49, 0), (65, 0), (196, 0), (300, 0), (784, 28), (300, 7), (5, 9),
                    (17, 1)):
        x = torch.randn(40, p)
        for act, bias in ((None, None), ("relu", torch.randn(13)), ("relu6", torch.randn(13))):
            ref = ACT[act](dense @ x + (0 if bias is None else bias[:, None]))
            torch.testing.assert_close(st.ops.spmm_narrow(W, x, bias, act, band=band), ref,
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(vector_isa() != "avx2", reason="the strip kernel runs on AVX2-only CPUs")
def test_which_kernel_runs():
    """Strips from 384 input channels (or 256 read 40 times each); chunks below; past 256
    columns unsplit, strips where each channel is read 8 times, else einsum."""
    def lanes(m, k, p, density=0.1, band=0):
        _, W = _weight(m, k, density)
        found = _kernel_for(W, torch.randn(k, p), None, band)
        return "einsum" if found is None else found[1]
    assert lanes(64, 384, 196) is None and lanes(512, 256, 196, density=0.2) is None
    assert lanes(64, 256, 196) == 8 and lanes(64, 128, 3136, band=56) == 8
    assert lanes(256, 128, 784) is None and lanes(16, 128, 784) == "einsum"


def test_sparse_conv_of_many_channels():
    """A 1x1 convolution of 384 input channels (the strip kernel on AVX2 CPUs) matches
    conv2d at 7 x 7, 28 x 28 (past the chunk kernel's columns: strips, not einsum) and a
    batch of two, called as a module and frozen; with gradients recorded, einsum."""
    torch.manual_seed(5)
    conv = torch.nn.Conv2d(384, 96, 1)
    layer = st.nn.SparseConv2d.from_dense(conv, sparsity=0.9, activation="relu")
    w = layer.weight.to_dense()[:, :, None, None]
    if vector_isa() == "avx2":   # 9.6 entries per input channel: strips at 784 columns
        with torch.no_grad():
            assert _kernel_for(layer.weight, torch.randn(384, 784), None, 0)[1] is None
    for x in (torch.randn(1, 384, 7, 7), torch.randn(1, 384, 28, 28),
              torch.randn(2, 384, 14, 14)):
        ref = F.relu(F.conv2d(x, w, conv.bias))
        with torch.no_grad():
            torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)
            frozen = st.freeze(torch.nn.Sequential(layer))
            torch.testing.assert_close(frozen(x), ref, rtol=1e-4, atol=1e-4)
    x = torch.randn(1, 384, 7, 7, requires_grad=True)
    layer(x).sum().backward()
    xd = x.detach().clone().requires_grad_()
    F.relu(F.conv2d(xd, w, conv.bias)).sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-4)
