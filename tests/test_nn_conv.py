"""SparseConv2d, ChannelsFirstDepthwise and batch-norm folding, each checked against the
same dense convolution (the weight masked), forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache, split_by_rows  # noqa: F401
from sparsetorch.nn import ChannelsFirstDepthwise, SparseConv2d, fold_batchnorm

ACT = {None: lambda y: y, "relu": torch.relu, "relu6": F.relu6}


def _dense_ref(layer: SparseConv2d, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight.to_dense()[:, :, None, None]
    return ACT[layer.activation](F.conv2d(x, w, layer.bias, stride=layer.stride))


def _conv(cin, cout, stride=1, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=bias)


_CASES = [(1, 1, True, "relu"), (3, 1, False, None), (1, 2, True, "relu6"), (2, 2, True, "relu")]


# Every distinct kernel (format, block size, dtype) compiles once per run, seconds each: the
# default run keeps one CSR and one BSR case, the full grid is slow.
@pytest.mark.parametrize("blocksize,batch,stride,bias,act", [
    (None, 3, 1, False, None), ((4, 1), 2, 2, True, "relu6"),
    *(pytest.param(b, *case, marks=pytest.mark.slow)
      for b in (None, (2, 1), (4, 1)) for case in _CASES
      if (b, *case) not in ((None, 3, 1, False, None), ((4, 1), 2, 2, True, "relu6")))])
def test_matches_masked_dense_conv(blocksize, batch, stride, bias, act):
    conv = _conv(12, 8, stride, bias)
    layer = SparseConv2d.from_dense(conv, sparsity=0.5, blocksize=blocksize, activation=act)
    assert layer.blocksize == blocksize
    assert layer.weight.format.name == ("csr" if blocksize is None else "bsr")
    mask = layer.mask()
    # the kept entries are conv's own weights
    assert torch.equal(layer.weight.to_dense(), conv.weight.detach()[:, :, 0, 0] * mask)
    x = torch.randn(batch, 12, 7, 5) * 3
    ref = ACT[act](F.conv2d(x, conv.weight * mask[:, :, None, None], conv.bias, stride=stride))
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


def test_column_bands_past_the_narrow_width(split_by_rows):
    """Past 256 pixels, where depthwise walks split by rows, the layer's threads split its
    columns in bands of image rows (``spmm_narrow``'s ``band``): one image, a batch."""
    layer = SparseConv2d.from_dense(_conv(12, 8), sparsity=0.5, activation="relu6")
    for x in (torch.randn(1, 12, 20, 20), torch.randn(2, 12, 15, 11)):
        with torch.no_grad():
            torch.testing.assert_close(layer(x), _dense_ref(layer, x), rtol=1e-5, atol=1e-5)


def test_magnitude_counts_are_exact_and_keep_the_largest():
    conv = _conv(10, 7)
    w = conv.weight.detach().flatten(1)
    for s in (0.0, 0.33, 0.9, 1.0):
        layer = SparseConv2d.from_dense(conv, sparsity=s)
        assert layer.values.numel() == 70 - round(s * 70)
        kept = w.abs()[layer.mask()]
        dropped = w.abs()[~layer.mask()]
        if kept.numel() and dropped.numel():
            assert kept.min() >= dropped.max()
    rnd = SparseConv2d.from_dense(conv, density=0.2, method="random")
    assert rnd.values.numel() == 14


def test_blocks_are_chosen_when_the_pattern_fills_them():
    layer = SparseConv2d(16, 8, density=0.25)
    block4 = torch.zeros(8, 16, dtype=torch.bool)
    block4[4:, 3] = True
    layer.set_pattern(block4)
    assert layer.blocksize == (4, 1)
    block2 = block4.clone()
    block2[:2, 5] = True
    layer.set_pattern(block2)
    assert layer.blocksize == (2, 1)
    block2[0, 0] = True
    layer.set_pattern(block2)
    assert layer.blocksize is None


def test_batch_in_channels_first_memory_chains_without_copies():
    a = SparseConv2d.from_dense(_conv(6, 10, seed=1), sparsity=0.6, activation="relu")
    b = SparseConv2d.from_dense(_conv(10, 4, seed=2), sparsity=0.6)
    x = torch.randn(3, 6, 4, 4)
    h = a(x)
    assert h.shape == (3, 10, 4, 4) and h.permute(1, 0, 2, 3).is_contiguous()
    assert st.nn.channels_first(h).data_ptr() == h.data_ptr()      # a view, no copy
    torch.testing.assert_close(b(h), _dense_ref(b, _dense_ref(a, x)), rtol=1e-5, atol=1e-5)


def test_set_pattern_keeps_overlapping_values_and_checks_shapes():
    layer = SparseConv2d.from_dense(_conv(4, 4), density=0.5)
    before = layer.weight.to_dense()
    new = torch.ones(4, 4, dtype=torch.bool)
    layer.set_pattern(new)
    assert torch.equal(layer.weight.to_dense(), before)       # new entries start at 0
    assert layer.values.numel() == 16 and layer.values.requires_grad
    with pytest.raises(ValueError, match="mask has shape"):
        layer.set_pattern(torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="must have shape"):
        layer.set_pattern(new, torch.ones(3))


def test_empty_pattern_gives_bias_only():
    layer = SparseConv2d.from_dense(_conv(5, 3), sparsity=1.0, activation="relu")
    x = torch.randn(2, 5, 3, 3)
    torch.testing.assert_close(layer(x), torch.relu(layer.bias).view(1, 3, 1, 1).expand(2, 3, 3, 3))


@pytest.mark.parametrize("blocksize,act", [(None, None),
                                          pytest.param((2, 1), "relu", marks=pytest.mark.slow)])
def test_gradcheck(blocksize, act):
    conv = _conv(6, 4, bias=True).double()
    layer = SparseConv2d.from_dense(conv, sparsity=0.5, blocksize=blocksize, activation=act)
    x = torch.randn(2, 6, 3, 2, dtype=torch.float64, requires_grad=True)
    values, bias = layer.values, layer.bias

    def f(v, b, x):
        layer.values, layer.bias = v, b
        return layer(x)

    try:
        assert torch.autograd.gradcheck(f, (values, bias, x))
    finally:
        layer.values, layer.bias = values, bias


def test_weight_gradient_is_sampled_on_the_pattern():
    conv = _conv(8, 6)
    layer = SparseConv2d.from_dense(conv, sparsity=0.7)
    x = torch.randn(2, 8, 3, 3)
    layer(x).square().sum().backward()
    w = (conv.weight.detach()[:, :, 0, 0] * layer.mask()).requires_grad_()
    F.conv2d(x, w[:, :, None, None], conv.bias).square().sum().backward()
    torch.testing.assert_close(layer.values.grad, w.grad[layer.mask()], rtol=1e-4, atol=1e-5)


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="kernel_size"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 3), sparsity=0.5)
    with pytest.raises(ValueError, match="groups"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 1, groups=2), sparsity=0.5)
    with pytest.raises(TypeError, match="nn.Conv2d"):
        SparseConv2d.from_dense(nn.Linear(4, 4), sparsity=0.5)
    with pytest.raises(ValueError, match="exactly one of density= and sparsity="):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 1))
    with pytest.raises(ValueError, match="sparsity must lie in"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 1), sparsity=1.5)
    with pytest.raises(ValueError, match="divide"):
        SparseConv2d.from_dense(nn.Conv2d(4, 6, 1), sparsity=0.5, blocksize=(4, 1))
    with pytest.raises(ValueError, match="activation"):
        SparseConv2d(4, 4, activation="gelu")
    with pytest.raises(TypeError, match="SparseConv2d: dtype=torch.int32 is not a floating"):
        SparseConv2d(4, 4, density=0.5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input must be \(N, 4, H, W\)"):
        SparseConv2d(4, 4, density=1.0)(torch.randn(1, 3, 2, 2))
    with pytest.raises(TypeError, match="SparseConv2d: input must be a dense tensor"):
        SparseConv2d(4, 4, density=1.0)(torch.randn(1, 4, 2, 2).to_sparse())
    conv = nn.Conv2d(4, 4, 1)   # a mask of the convolution's own shape, as conv.weight != 0
    assert SparseConv2d(4, 4, mask=conv.weight.abs() > 0.2).values.numel() == \
        int((conv.weight.abs() > 0.2).sum())
    layer = SparseConv2d(4, 4, density=1.0)
    layer.stride = 3   # (set after construction: ran as stride 1)
    with pytest.raises(ValueError, match="SparseConv2d: stride must be 1 or 2, got 3"):
        layer(torch.randn(1, 4, 6, 6))


def test_input_of_another_dtype_is_a_clear_type_error():
    layer = SparseConv2d(4, 4, density=0.5)
    with pytest.raises(TypeError, match=r"SparseConv2d: input is torch.float64 but the weights "
                                        r"are torch.float32; cast .*\.to\(dtype\)"):
        layer(torch.randn(1, 4, 2, 2, dtype=torch.float64))


def test_from_dense_density_and_sparsity_are_keyword_only():
    # sparsify(model, 0.9) means sparsity: a bare 0.9 here must not silently mean density
    with pytest.raises(TypeError, match="positional"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 1), 0.9)


def test_sparse_tensor_mask_keeps_its_stored_entries():
    pattern = torch.zeros(8, 6)
    pattern[4:, 1] = 1.0
    pattern[1:4, 3] = 1.0
    mask = st.tensor(pattern, "csr")
    mask = mask.with_values(torch.arange(mask.nnz, dtype=torch.float32))  # a stored 0 counts
    layer = SparseConv2d(6, 8, mask=mask)
    assert torch.equal(layer.mask(), pattern != 0) and layer.blocksize is None
    column = torch.zeros(8, 6).index_fill_(1, torch.tensor([2]), 1.0)
    layer.set_pattern(st.tensor(column, "csr"))
    assert layer.blocksize == (4, 1) and torch.equal(layer.mask(), column != 0)  # blocks again
    with pytest.raises(ValueError, match=r"mask has shape \(6, 8\)"):
        layer.set_pattern(st.tensor(torch.ones(6, 8), "csr"))


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_keeps_layout_and_matches_conv2d(stride):
    torch.manual_seed(0)
    dw = nn.Conv2d(5, 5, 3, stride, 1, groups=5)
    layer = ChannelsFirstDepthwise.from_dense(dw, activation="relu6")
    for x in (torch.randn(1, 5, 6, 6), torch.randn(3, 5, 6, 6),
              torch.randn(5, 3, 6, 6).permute(1, 0, 2, 3)):
        with torch.no_grad():
            y = layer(x)
        torch.testing.assert_close(y, F.relu6(dw(x)), rtol=1e-5, atol=1e-6)
    assert y.permute(1, 0, 2, 3).is_contiguous()
    with pytest.raises(ValueError, match="depthwise"):
        ChannelsFirstDepthwise.from_dense(nn.Conv2d(4, 4, 3))


def test_fold_batchnorm_equals_conv_then_bn():
    torch.manual_seed(0)
    for conv in (nn.Conv2d(4, 6, 1, bias=False), nn.Conv2d(4, 4, 3, padding=1, groups=4)):
        bn = nn.BatchNorm2d(conv.out_channels).eval()
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
        x = torch.randn(2, 4, 5, 5)
        torch.testing.assert_close(fold_batchnorm(conv, bn)(x), bn(conv(x)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        fold_batchnorm(nn.Conv2d(4, 6, 1), nn.BatchNorm2d(5))


def test_state_dict_of_another_pattern_loads():
    a = SparseConv2d.from_dense(_conv(6, 5, seed=1), sparsity=0.3, activation="relu")
    b = SparseConv2d.from_dense(_conv(6, 5, seed=2), sparsity=0.8, activation="relu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 6, 3, 3)
    assert torch.equal(b.mask(), a.mask())
    torch.testing.assert_close(b(x), a(x))


def test_rigl_capture_gives_the_dense_weight_gradient_of_a_sparse_conv():
    """RigL's truly sparse mode scores growth with dY^T X captured by hooks on SparseLinear
    layers; a SparseConv2d is one, and its NCHW input and output must be read per pixel."""
    from sparsetorch.train.layers import SparseLayer

    conv = _conv(6, 4, stride=2)
    layer = SparseConv2d.from_dense(conv, sparsity=0.5)
    capture = SparseLayer("c", layer, reduce=lambda t: t, capturing=lambda: True, conv=True)
    x = torch.randn(2, 6, 5, 5)
    layer(x).square().sum().backward()
    w = (conv.weight.detach()[:, :, 0, 0] * layer.mask()).requires_grad_()
    F.conv2d(x, w[:, :, None, None], conv.bias, stride=2).square().sum().backward()
    torch.testing.assert_close(capture.grad_rows(0, 4), w.grad, rtol=1e-4, atol=1e-4)
    capture.close()


@pytest.mark.parametrize("pixels", [(4, 4), pytest.param((20, 20), marks=pytest.mark.slow)],
                         ids=["narrow", "einsum"])
def test_traced_by_torch_compile_without_graph_breaks(pixels):
    """Both kernel paths (few pixels: ``spmm_narrow``; more: ``st.einsum``) trace into one
    graph, with and without gradients (a graph break there once handed AOT autograd the
    weight SparseTensor as a subgraph output, which failed under ``no_grad``)."""
    torch.manual_seed(0)
    layer = SparseConv2d(8, 6, density=0.3, activation="relu")
    x = torch.randn(1, 8, *pixels)
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0
    compiled = torch.compile(layer, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    compiled(x).sum().backward()
    torch.testing.assert_close(layer.values.grad, torch.autograd.grad(
        _dense_ref(layer, x).sum(), layer.values)[0], rtol=1e-5, atol=1e-5)
