"""``ops/conv_ops.py``: a traced ConvNet's sparse 1x1 and 3x3 depthwise layers run their
eager kernels as custom ops in inference. Checked against the eager layers (themselves
checked against dense torch in ``test_nn_conv.py`` and ``test_depthwise.py``): compiled
with ``fullgraph=True`` at batch 1 and 2 (NCHW and (C, N, H, W) memory), the ops in the
traced graph; under autograd the traced paths instead, with eager's gradients; torch's
custom-op checks (``torch.library.opcheck``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsetorch as st
from dense_check import compiled_keeping_graphs, fresh_dynamo  # noqa: F401
from sparsetorch.compiler.kernel import vector_isa

needs_kernel = pytest.mark.skipif(vector_isa() is None, reason="the kernels need AVX2")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _net(seed=0):
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16), nn.ReLU6(),
                          nn.Conv2d(16, 8, 1))
    return st.sparsify(dense, sparsity=0.6).eval()


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_inference_runs_the_kernels_and_matches_eager(batch):
    net, graphs = _net(), []
    assert any(isinstance(m, st.nn.ChannelsFirstDepthwise) for m in net.modules())
    compiled = compiled_keeping_graphs(net, graphs)
    x = torch.randn(batch, 8, 9, 7, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = compiled(x), net(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
    text = "".join(str(gm.graph) for gm in graphs)
    assert "spmm_narrow" in text and "depthwise3x3" in text


@needs_kernel
def test_compiled_training_keeps_the_traced_paths():
    net, graphs = _net(), []
    compiled = compiled_keeping_graphs(net, graphs)
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    got, want = compiled(x), net(x)
    torch.testing.assert_close(got, want)
    assert "sparsetorch.spmm_narrow" not in "".join(str(gm.graph) for gm in graphs)
    params = [x, *net.parameters()]
    for a, b in zip(torch.autograd.grad(got.square().sum(), params),
                    torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(a, b)


@needs_kernel
def test_torch_custom_op_checks():
    net = _net()
    conv = net[0]
    cols = torch.randn(8, 30)
    torch.library.opcheck(torch.ops.sparsetorch.spmm_narrow,
                          (conv.pos1, conv.crd1, conv.values.detach(), 8, cols,
                           conv.bias.detach(), "relu", 0))
    dw = next(m for m in net.modules() if isinstance(m, st.nn.ChannelsFirstDepthwise))
    for x in (torch.randn(2, 16, 5, 6), torch.randn(16, 2, 5, 6).permute(1, 0, 2, 3)):
        torch.library.opcheck(torch.ops.sparsetorch.depthwise3x3,
                              (x, dw.weight.detach(), dw.bias.detach(), 2, "relu6"))
