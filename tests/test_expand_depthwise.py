"""``ops.expand_depthwise3x3`` (a sparse 1x1 expansion and a 3x3 depthwise convolution in one
kernel) and ``nn.fuse`` (``sparsify`` running MobileNet v2's expansion and depthwise layers
through it): every case against the same computation on dense tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache, split_by_rows  # noqa: F401
from sparsetorch.nn.fuse import ExpandDepthwiseSequential
from sparsetorch.ops.expand_depthwise import _kernel_for, expand_depthwise3x3

_ACT = {None: lambda t: t, "relu": F.relu, "relu6": F.relu6}


def _dense_ref(x, W, eb, ea, wd, bd, stride, act):
    e = _ACT[ea](F.conv2d(x.double(), W.to_dense().double()[:, :, None, None],
                          None if eb is None else eb.double()))
    return _ACT[act](F.conv2d(e, wd.double(), None if bd is None else bd.double(), stride, 1,
                              1, wd.shape[0]))


def _operands(n, c, e, h, w, dtype, index, density=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    Wd = (torch.randn(e, c, generator=g) * (torch.rand(e, c, generator=g) < density)).to(dtype)
    Wd[0] = 0   # an empty row: that channel is its bias alone
    W = st.tensor(Wd, format="csr", index_dtype=index)
    x = torch.randn(n, c, h, w, generator=g).to(dtype)
    return (x, W, torch.randn(e, generator=g).to(dtype),
            torch.randn(e, 1, 3, 3, generator=g).to(dtype), torch.randn(e, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 16, 96, 17, 13), (2, 8, 24, 5, 7), (1, 3, 5, 1, 1),
                                   (3, 4, 6, 20, 2), (1, 24, 40, 33, 33)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("stride", [1, 2])
def test_matches_dense(dtype, index, shape, stride):
    """Plane sizes around the kernel's whole-plane limit (16 rows) and vector widths,
    single rows and columns, batches, an empty weight row; every activation pairing."""
    x, W, eb, wd, bd = _operands(*shape, dtype, index)
    for ea, act, bias in ((None, None, False), ("relu6", "relu6", True), ("relu", None, True)):
        args = (x, W, eb if bias else None, ea, wd, bd if bias else None, stride, act)
        assert _kernel_for(x, W, args[2], wd, args[5], stride, act) is not None
        y = expand_depthwise3x3(*args)
        torch.testing.assert_close(y.double(), _dense_ref(*args), rtol=1e-4, atol=1e-4)
        assert y.permute(1, 0, 2, 3).is_contiguous()   # (E, N, OH, OW) memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_by_rows_matches_dense(dtype, split_by_rows):
    """Each thread a band of every plane's rows: its expanded rows computed from the band's
    first input row on, batches of rows cut at the band's end."""
    for shape in ((1, 6, 10, 17, 13), (3, 4, 6, 9, 5), (2, 5, 7, 1, 4), (1, 3, 4, 40, 9)):
        x, W, eb, wd, bd = _operands(*shape, dtype, torch.int32)
        for stride in (1, 2):
            args = (x, W, eb, "relu6", wd, bd, stride, "relu")
            torch.testing.assert_close(expand_depthwise3x3(*args).double(), _dense_ref(*args),
                                       rtol=1e-4, atol=1e-4)


def test_batch_in_channels_first_memory_and_no_entries():
    """A batch laid out as ``SparseConv2d`` leaves it ((C, N, H, W) memory), and a weight
    with no stored entry (every expanded channel its bias)."""
    x, W, eb, wd, bd = _operands(3, 6, 10, 9, 9, torch.float32, torch.int32)
    x = x.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    for weight in (W, st.tensor(torch.zeros(10, 6), format="csr")):
        args = (x, weight, eb, "relu6", wd, bd, 1, None)
        torch.testing.assert_close(expand_depthwise3x3(*args).double(), _dense_ref(*args),
                                   rtol=1e-4, atol=1e-4)


def test_gradients_go_through_the_two_steps():
    """While autograd records, the unfused steps run: gradients of every input, float64."""
    x, W, eb, wd, bd = _operands(2, 3, 4, 5, 5, torch.float64, torch.int32)
    def fn(x, values, eb, wd, bd):
        return expand_depthwise3x3(x, W.with_values(values), eb, "relu", wd, bd, 2, "relu6")
    inputs = [t.clone().requires_grad_() for t in (x, W.values, eb, wd, bd)]
    assert torch.autograd.gradcheck(fn, inputs)


def test_bad_operands_are_named():
    x, W, eb, wd, bd = _operands(1, 4, 8, 5, 5, torch.float32, torch.int32)
    with pytest.raises(ValueError, match="x must be a 4-D"):
        expand_depthwise3x3(x[0], W, eb, None, wd, bd)
    with pytest.raises(ValueError, match=r"expand_weight must be an \(E, 5\) SparseTensor"):
        expand_depthwise3x3(torch.randn(1, 5, 5, 5), W, eb, None, wd, bd)
    with pytest.raises(ValueError, match="expand_bias must be None or"):
        expand_depthwise3x3(x, W, eb[:3], None, wd, bd)
    with pytest.raises(ValueError, match="expand_activation must be one of"):
        expand_depthwise3x3(x, W, eb, "gelu", wd, bd)
    with pytest.raises(ValueError, match="weight must be"):
        expand_depthwise3x3(x, W, eb, None, wd[:4], bd)


# -- nn: sparsify's fusion ------------------------------------------------------------------
def _block(inp=8, hidden=48, stride=1):
    """MobileNet v2's inverted residual block, up to its projection, as torchvision has it."""
    def cba(i, o, k, s, g):
        return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, groups=g, bias=False),
                             nn.BatchNorm2d(o), nn.ReLU6())
    net = nn.Sequential(cba(inp, hidden, 1, 1, 1), cba(hidden, hidden, 3, stride, hidden),
                        nn.Conv2d(hidden, 16, 1, bias=False), nn.BatchNorm2d(16))
    for m in net.modules():   # batch norms that do something
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    return net.eval()


def _channels_a_hook_sees(model, module, x) -> list:
    """The channel counts a forward hook on ``module`` sees in one inference of ``model``."""
    seen = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen


def _unfused(sparse):
    for m in sparse.modules():
        if isinstance(m, ExpandDepthwiseSequential):
            m.pairs = {}
    return sparse


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_sparsify_fuses_expansion_and_depthwise(stride, batch):
    torch.manual_seed(0)
    dense = _block(stride=stride)
    sparse = st.sparsify(dense, sparsity=0.8)
    assert type(sparse) is ExpandDepthwiseSequential and sparse.pairs == {"0": "1"}
    keys = set(st.sparsify(dense, sparsity=0.8).state_dict())
    x = torch.randn(batch, 8, 12, 12)
    with torch.no_grad():
        fused = sparse(x)
        layers = _unfused(st.sparsify(dense, sparsity=0.8))(x)
    torch.testing.assert_close(fused, layers, rtol=1e-4, atol=1e-5)
    assert set(sparse.state_dict()) == keys and all("." in k for k in keys)
    # and against the masked dense model
    masked = st.nn.fold_batchnorms(dense)
    masked[0][0].weight.data *= sparse[0][0].mask()[:, :, None, None]
    masked[2].weight.data *= sparse[2].mask()[:, :, None, None]
    torch.testing.assert_close(fused, masked(x), rtol=1e-4, atol=1e-4)


def test_fusion_steps_aside_for_hooks_gradients_and_other_inputs():
    """A hook on either layer sees that layer's own output; training runs the layers (and
    their gradients); a wrong input gets the layer's own error."""
    torch.manual_seed(0)
    sparse = st.sparsify(_block(), sparsity=0.8)
    x = torch.randn(1, 8, 10, 10)
    assert _channels_a_hook_sees(sparse, sparse[0][0], x) == [48]
    sparse(x).square().sum().backward()   # the layers ran: their parameters have gradients
    assert sparse[0][0].values.grad is not None and sparse[1][0].weight.grad is not None
    with pytest.raises(TypeError, match="SparseConv2d: input is torch.float64"):
        with torch.no_grad():
            sparse(x.double())


def test_models_are_fused_where_a_block_expands():
    sp = st.sparsify(st.models.mobilenet_v2(width_mult=0.25).eval(), sparsity=0.9)
    fused = [m for m in sp.modules() if isinstance(m, ExpandDepthwiseSequential)]
    assert len(fused) == 16   # every block but the first, which does not expand
    assert not any(isinstance(m, ExpandDepthwiseSequential)
                   for m in st.sparsify(st.models.mobilenet_v1().eval(), 0.9).modules())


def test_a_module_inserted_inside_a_pair_runs():
    """Children moved after ``sparsify`` (``insert``, slicing) are looked at again: a layer
    put between the expansion and the depthwise one is not skipped."""
    torch.manual_seed(0)
    sparse = st.sparsify(_block(), sparsity=0.8)
    head = sparse[:2]
    assert type(head) is ExpandDepthwiseSequential and head.pairs == {"0": "1"}
    x = torch.randn(1, 8, 10, 10)
    sparse[0].insert(1, nn.Identity())   # inside the expansion's own Sequential: still fused
    sparse.insert(1, nn.Hardtanh(0.0, 1.0))
    with torch.no_grad():
        ref = sparse[2](F.hardtanh(sparse[0](x), 0.0, 1.0))
        torch.testing.assert_close(sparse[:3](x), ref)
        torch.testing.assert_close(sparse(x), sparse[3](ref))   # the original's stale pair


def test_a_hook_inside_a_pair_or_a_removed_child_turns_the_fusion_off():
    """A hook on a folded-away Identity inside the expansion's Sequential fires; a pair
    whose depthwise child was deleted (the Sequential renumbers its children) runs what is
    left, one by one."""
    torch.manual_seed(0)
    sparse = st.sparsify(_block(), sparsity=0.8)
    x = torch.randn(1, 8, 10, 10)
    assert _channels_a_hook_sees(sparse, sparse[0][1], x) == [48]
    del sparse[1]   # now: expansion, projection, Identity; the old pair {"0": "1"} is stale
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), sparse[1](sparse[0](x)))


def test_no_expanded_channels_is_not_the_fused_kernels():
    """E = 0 divided by zero in the fused kernel's walk (SIGFPE, found under
    AddressSanitizer): it goes to the two steps, whose convolution refuses it."""
    W = st.tensor(torch.zeros(0, 3), format="csr")
    assert _kernel_for(torch.randn(1, 3, 5, 5), W, None, torch.randn(0, 1, 3, 3), None, 1,
                       None) is None
