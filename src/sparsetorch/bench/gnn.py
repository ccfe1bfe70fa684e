"""GNN workloads: a two-layer GCN, GraphSAGE and GAT on each of the six graphs, against the
same models in torch.sparse (CSR and COO), dense torch (where the n x n adjacency fits) and
PyTorch Geometric (``edge_index`` and torch CSR adjacency), all from one set of weights.

Every implementation gets its best input: node features under 40% nonzero stay sparse where
it can multiply them (sparsetorch, torch.sparse), dense where it cannot (PyG's and dense
torch's ``Linear``). Sparsetorch and PyG get the raw adjacency and normalise it themselves,
once (cached); the torch baselines get it normalised.
Dropout is off so that outputs and gradients compare exactly; the loss is cross-entropy on
the training nodes.

Example:
    >>> from sparsetorch.bench.workloads import REGISTRY
    >>> import sparsetorch.bench.gnn
    >>> [n for n in REGISTRY if n.endswith("-cora")]
    ['gcn-cora', 'sage-cora', 'gat-cora']
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import gnn_convs
from .graph_data import GRAPHS, gcn_normalized, get, mean_normalized, with_self_loops
from .gnn_torch import TorchGAT, TorchGCN, TorchSAGE
from .steps import inference, training
from .workloads import OURS, Prepared, Workload, register

GAT_HEADS, GAT_HIDDEN = 8, 8   # Velickovic et al.'s Cora configuration
SPARSE_FEATURES_BELOW = 0.4    # feature density under which products take them sparse: PubMed
# (10%): a sparse x W forward and backward 2.5x the dense one (19717 x 500, W 500 x 16);
# Amazon's (35%): 1.5x (13752 x 767, W 767 x 64), the GCN step on Photo 1.73x -> 2.10x PyG
TORCH_DENSE_FEATURES_FROM = 0.05
QUICK_GRAPHS = ("cora",)


def weights(kind: str, g, seed: int) -> dict:
    """The shared starting weights (Glorot-uniform matrices, small random biases)."""
    gen = torch.Generator().manual_seed(seed)
    f, c = g.num_features, g.num_classes

    def mat(i, o):
        bound = math.sqrt(6.0 / (i + o))
        return (torch.rand(i, o, generator=gen) * 2 - 1) * bound

    def vec(*shape):
        return (torch.rand(*shape, generator=gen) - 0.5) * 0.2

    if kind == "gcn":
        h = g.hidden
        return {"W1": mat(f, h), "b1": vec(h), "W2": mat(h, c), "b2": vec(c)}
    if kind == "sage":
        h = g.hidden
        return {"Wl1": mat(f, h), "bl1": vec(h), "Wr1": mat(f, h),
                "Wl2": mat(h, c), "bl2": vec(c), "Wr2": mat(h, c)}
    hc = GAT_HEADS * GAT_HIDDEN
    return {"W1": mat(f, hc), "as1": vec(GAT_HEADS, GAT_HIDDEN) * 5,
            "ad1": vec(GAT_HEADS, GAT_HIDDEN) * 5, "b1": vec(hc),
            "W2": mat(hc, c), "as2": vec(1, c) * 5, "ad2": vec(1, c) * 5, "b2": vec(c)}


def _torch_sparse(m, layout: str) -> torch.Tensor:
    """A scipy CSR matrix as a torch CSR (int64 indices, torch's default) or coalesced COO."""
    t = torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype("int64")),
                                torch.from_numpy(m.indices.astype("int64")),
                                torch.from_numpy(m.data), m.shape)
    return t if layout == "csr" else t.to_sparse_coo().coalesce()


def prepare(kind: str, name: str, ctx, mode: str) -> Prepared:
    g = get(ctx, name)
    w = weights(kind, g, ctx.seed)
    prep = Prepared([], source=g.source, size=g.size, notes=list(g.notes))
    adj = {"gcn": gcn_normalized, "sage": mean_normalized, "gat": with_self_loops}[kind](g.adj)
    y, train = g.labels, g.train_idx

    def loss(out):
        return F.cross_entropy(out[train], y[train])

    def add(impl_name, family, model, config):
        if mode == "infer":   # eval: a dropout layer, even at p=0, must not run
            prep.impls.append(inference(impl_name, family, model.eval(), config))
        else:
            prep.impls.append(training(impl_name, family, model, model.parameters(), loss,
                                       model.grads, config))

    sparse_x = g.features.nnz < SPARSE_FEATURES_BELOW * g.n * g.num_features
    dense_x = g.dense_features() if ctx.dense_fits(g.n, g.num_features) else None
    try:
        import sparsetorch as st
        x = st.tensor(g.features, format="csr") if sparse_x else dense_x
        model = gnn_convs.ours(kind, w, x, st.tensor(g.adj, format="csr"), heads=GAT_HEADS)
        add(OURS, OURS, model, f"CSR adjacency, {'sparse' if sparse_x else 'dense'} features")
    except NotImplementedError as exc:
        prep.skipped[OURS] = str(exc)
        return prep

    # torch.sparse's product with sparse features loses to a dense one as they fill in
    # (PubMed, 10%: 3-4x slower, forward and backward; Cora, 1.3%: 25x faster): from
    # TORCH_DENSE_FEATURES_FROM both run where both fit, the faster kept
    # (GAT: one of them, dense from there: its step takes 20-27 s on Amazon-Photo either
    # way, and the full run times each several times)
    density = g.features.nnz / (g.n * g.num_features)
    both = dense_x is not None and density >= TORCH_DENSE_FEATURES_FROM
    feature_kinds = ([("sparse", None)] if sparse_x and not (both and kind == "gat") else []) \
        + ([("dense", dense_x)] if dense_x is not None and (not sparse_x or both) else [])
    for layout in ("csr", "coo"):
        if kind == "gat" and layout == "csr":
            prep.skipped.setdefault("torch.sparse", "CSR: torch.sparse.softmax has no CSR "
                                    "kernel (aten::_sparse_softmax is COO only); COO ran")
            continue
        a = _torch_sparse(adj, layout)
        for feats, x in feature_kinds:
            x = _torch_sparse(g.features, layout) if x is None else x
            model = (TorchGAT(w, adj, x, GAT_HEADS, "coo") if kind == "gat" else
                     {"gcn": TorchGCN, "sage": TorchSAGE}[kind](w, a, x))
            suffix = f", {feats} x" if len(feature_kinds) > 1 else ""
            add(f"torch.sparse {layout.upper()}{suffix}", "torch.sparse", model,
                f"{layout.upper()} adjacency, {feats} features")

    if kind == "gat":
        fits = ctx.dense_fits(GAT_HEADS, g.n, g.n)
        what = f"{GAT_HEADS} x {g.n} x {g.n} float32 scores"
    else:
        fits = ctx.dense_fits(g.n, g.n)
        what = f"{g.n} x {g.n} float32 adjacency"
    if fits and dense_x is not None:
        model = (TorchGAT(w, adj, dense_x, GAT_HEADS, "dense") if kind == "gat" else
                 {"gcn": TorchGCN, "sage": TorchSAGE}[kind](w, torch.from_numpy(adj.toarray()),
                                                           dense_x))
        add("dense", "dense", model, "dense adjacency and features")
    else:
        prep.skipped["dense"] = (f"{what} over the {ctx.dense_limit_bytes >> 20} MiB dense "
                                 "limit")

    why = gnn_convs.pyg_available() or (None if dense_x is not None else
                                  "dense node features over the dense limit")
    if why:
        prep.skipped["PyG"] = why
        return prep
    # PyG normalises (and adds self-loops) itself: it gets the raw adjacency.
    for config, a in (("edge_index", g.edge_index()), ("CSR adj_t", _torch_sparse(g.adj, "csr"))):
        model = gnn_convs.pyg(kind, w, dense_x, a, heads=GAT_HEADS)
        add(f"PyG {config}", "PyG", model, f"{config}, dense features")
    return prep


def _register():
    for kind, what in (("gcn", "2-layer GCN (Kipf & Welling)"),
                       ("sage", "2-layer GraphSAGE, mean aggregation"),
                       ("gat", f"2-layer GAT, {GAT_HEADS} heads x {GAT_HIDDEN}")):
        for name in GRAPHS:
            register(Workload(f"{kind}-{name}", kind,
                              lambda ctx, mode, kind=kind, name=name: prepare(kind, name, ctx, mode),
                              quick=name in QUICK_GRAPHS, describe=f"{what} on {name}"))


_register()
