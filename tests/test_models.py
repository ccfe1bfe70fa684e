"""``st.models``: GCN, GAT and SparseAutoencoder on small shapes: forward shapes, dense and
sparse inputs agree, gradients reach every parameter, and a few optimizer steps reduce the
loss. (Accuracy on Cora: examples/gcn_cora.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401


def toy_graph(n=12, seed=0):
    """Two communities (nodes < n/2 and the rest), edges mostly inside them, labels by
    community; features noisy one-hot community indicators (sparse-ish)."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) >= n // 2).long()
    src = torch.randint(0, n, (4 * n,), generator=g)
    dst = torch.randint(0, n, (4 * n,), generator=g)
    keep = (labels[src] == labels[dst]) | (torch.rand(4 * n, generator=g) < 0.1)
    edge_index = torch.stack([src[keep], dst[keep]])
    x = F.one_hot(labels, 4).float() + 0.3 * torch.randn(n, 4, generator=g)
    x = x * (torch.rand(n, 4, generator=g) < 0.7)
    return x, edge_index, labels


def train_steps(model, inputs, loss_of, steps=15, lr=0.05):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model(*inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", [lambda: st.models.GCN(4, 8, 2, dropout=0.0),
                                  lambda: st.models.GAT(4, hidden=4, num_classes=2, heads=2,
                                                        dropout=0.0)],
                         ids=["gcn", "gat"])
def test_graph_models_train(make):
    torch.manual_seed(0)
    model = make()
    x, edge_index, labels = toy_graph()
    out = model(x, edge_index)
    assert out.shape == (12, 2)
    # sparse features and a SparseTensor adjacency give the same logits
    adj = st.tensor((edge_index.flip(0), torch.ones(edge_index.shape[1])), shape=(12, 12))
    torch.testing.assert_close(model(st.tensor(x, "csr"), adj), out)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    losses = train_steps(model, (x, edge_index), lambda y: F.cross_entropy(y, labels))
    assert losses[-1] < 0.7 * losses[0]


def test_gcn_layers_share_one_adjacency_and_models_pickle():
    import io

    model = st.models.GCN(4, 8, 2)
    x, edge_index, _ = toy_graph()
    model(x, edge_index)
    assert model.conv1.adjacency(edge_index, x) is model.conv2.adjacency(edge_index, x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False).eval()
    torch.testing.assert_close(loaded(x, edge_index), model.eval()(x, edge_index))


def test_graph_models_dropout_only_in_training():
    torch.manual_seed(0)
    model = st.models.GCN(4, 8, 2)
    x, edge_index, _ = toy_graph()
    model.eval()
    torch.testing.assert_close(model(x, edge_index), model(x, edge_index))
    model.train()
    assert not torch.allclose(model(x, edge_index), model(x, edge_index))


@pytest.mark.slow   # ~2 s of model training (the full suite runs it)
def test_autoencoder_trains_on_dense_and_sparse_rows():
    g = torch.Generator().manual_seed(0)
    ae = st.models.SparseAutoencoder(16, 8, density=0.5, generator=g)
    x = torch.rand(32, 16, generator=g) * (torch.rand(32, 16, generator=g) < 0.3)
    out = ae(x)
    assert out.shape == (32, 16) and bool(((out > 0) & (out < 1)).all())
    torch.testing.assert_close(ae(st.tensor(x, "csr")), out)
    assert ae.encode(x).shape == (32, 8)
    losses = train_steps(ae, (st.tensor(x, "csr"),), lambda y: F.mse_loss(y, x), steps=30)
    assert losses[-1] < 0.5 * losses[0]


_EDGES = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])


@pytest.mark.parametrize("make, inputs", [
    (lambda: st.models.GCN(4, 8, 3), lambda: (torch.randn(5, 4), _EDGES)),
    (lambda: st.models.GAT(4, 2, 3, heads=2), lambda: (torch.randn(5, 4), _EDGES)),
    (lambda: st.nn.SparseLinear(4, 3, density=0.5), lambda: (torch.randn(5, 4),)),
    # (a frozen model calls its kernels itself, not through the layers' __call__)
    (lambda: st.freeze(st.sparsify(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                       torch.nn.Linear(8, 3)), 0.5)),
     lambda: (torch.randn(5, 4),)),
    (lambda: st.models.SparseTransformer(10, 2, embed_dim=8, num_heads=2, ff_dim=16,
                                         max_len=8, mask=st.nn.masks.longformer(6, 1, 1)),
     lambda: (torch.randint(0, 10, (2, 6)),)),
])
def test_torchscript_and_fx_are_refused_clearly(make, inputs):
    """torch.jit.trace recorded nothing of the kernels (its module returned the example
    outputs as constants when the check was turned off), torch.jit.script failed with an
    empty message, and fx.symbolic_trace said "got Proxy" (a probe)."""
    model = make().eval()
    with pytest.raises(TypeError, match="TorchScript .* cannot record sparsetorch's kernels"):
        torch.jit.trace(model, inputs(), check_trace=False)
    with pytest.raises(TypeError, match="TorchScript .* cannot record sparsetorch's kernels"):
        torch.jit.script(model)
    with pytest.raises(TypeError, match="symbolic_trace cannot trace into sparsetorch's"):
        torch.fx.symbolic_trace(model)
    model(*inputs())   # (and the model still runs)
