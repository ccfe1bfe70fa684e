"""The layers under torch's execution modes: a call under ``torch.inference_mode`` leaves
nothing behind that a later training call trips on (every cache builds normal tensors, and
an inference tensor's missing version counter is never taken for "unchanged"), and
``torch.autocast`` hands a sparse layer the half-precision output of the dense layer before
it, which the layer takes in its own dtype."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from helpers import one_thread  # noqa: F401

EDGES = torch.tensor([[0, 1, 1, 2, 3, 4, 5, 5], [1, 0, 2, 1, 4, 3, 0, 4]])


def _layer(name):
    """(layer, its inputs): each kind of layer whose calls keep something between them."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    return {
        "SparseLinear": (st.nn.SparseLinear(8, 4, density=0.5), (torch.randn(20, 8),)),
        "SparseLinear, one row": (st.nn.SparseLinear(8, 4, density=0.5), (torch.randn(8),)),
        "GCNConv": (st.nn.GCNConv(8, 4), (x, EDGES)),
        "SAGEConv": (st.nn.SAGEConv(8, 4), (x, EDGES)),
        "GATConv": (st.nn.GATConv(8, 4, heads=2), (x, EDGES)),
        "SparseAttention": (st.nn.SparseAttention(
            8, 2, mask=lambda n: st.nn.masks.longformer(n, window=1, global_tokens=1)),
            (torch.randn(2, 5, 8),)),
        "SparseConv2d": (st.nn.SparseConv2d(8, 4, density=0.5), (torch.randn(2, 8, 3, 3),)),
        "SparseAutoencoder": (st.models.SparseAutoencoder(8, 4, density=0.5),
                              (torch.rand(20, 8),)),
    }[name]


NAMES = ["SparseLinear", "SparseLinear, one row", "GCNConv", "SAGEConv", "GATConv",
         "SparseAttention", "SparseConv2d", "SparseAutoencoder"]


@pytest.mark.parametrize("name", NAMES)
def test_a_first_call_under_inference_mode_leaves_training_working(name):
    """The first call built the layer's caches as inference tensors: every later call with
    autograd failed ("Inference tensors cannot be saved for backward", or "do not track
    version counter")."""
    layer, args = _layer(name)
    with torch.inference_mode():
        expected = layer(*args)
    out = layer(*args)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected.clone())


@pytest.mark.parametrize("change", ["set_pattern", "load_state_dict"])
def test_a_rebuilt_cache_under_inference_mode_leaves_training_working(change):
    layer = st.nn.SparseLinear(8, 4, density=0.5)
    x = torch.randn(20, 8)
    layer(x).sum().backward()
    if change == "set_pattern":
        layer.set_pattern(torch.rand(4, 8, generator=torch.Generator().manual_seed(1)) < 0.5)
    else:
        layer.load_state_dict(st.nn.SparseLinear(8, 4, density=0.25).state_dict())
    with torch.inference_mode():
        expected = layer(x)
    out = layer(x)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected.clone())


def test_a_sparse_tensor_made_under_inference_mode_is_read_and_written_there():
    """Its arrays have no version counter: a transposed product's kept split read it."""
    d = torch.tensor([[1., 0., 2.], [0., 3., 0.]])
    with torch.inference_mode():
        A = st.tensor(d, "csr")
        x = torch.randn(2, 4)
        torch.testing.assert_close(A.t() @ x, d.t() @ x)
        A.values.mul_(2)                      # (written in place: nothing kept is stale)
        torch.testing.assert_close(A.t() @ x, 2 * d.t() @ x)
    torch.testing.assert_close(A.t() @ x, 2 * d.t() @ x)


def _dense_then(sparse):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), sparse)


@pytest.mark.parametrize("name", ["SparseLinear", "SparseAttention", "GCNConv"])
def test_a_sparse_layer_after_a_dense_one_runs_under_autocast(name):
    """Autocast's Linear hands a bfloat16 output to the sparse layer; it raised TypeError
    ("input is bfloat16 but the weights are float32"). SparseAttention failed even on its
    own: its mask was made in the input's dtype, its projections came out in bfloat16."""
    layer, args = _layer(name)
    dense = nn.Linear(args[0].shape[-1], args[0].shape[-1])
    with torch.no_grad():
        want = layer(dense(args[0]).bfloat16().float(), *args[1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(dense(args[0]), *args[1:])
        got.float().sum().backward()
    assert got.dtype == (torch.bfloat16 if name == "SparseAttention" else torch.float32)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_a_sparsified_convnet_runs_under_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1),
                          nn.ReLU())
    sparse = st.sparsify(model, sparsity=0.5)
    x = torch.randn(1, 3, 4, 4)
    with torch.no_grad():
        want = sparse(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = sparse(x)
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_outside_autocast_another_dtype_is_still_refused():
    with pytest.raises(TypeError, match="bfloat16"):
        st.nn.SparseLinear(8, 4, density=0.5)(torch.randn(3, 8, dtype=torch.bfloat16))
