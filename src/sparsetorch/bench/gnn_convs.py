"""Two-layer GNNs from convolution layers that use PyTorch Geometric's parameter names
(``lin.weight``, ``bias``, ``lin_l``/``lin_r``, ``att_src``/``att_dst``): sparsetorch's
``st.models.GCN``/``GAT`` and ``st.nn.SAGEConv``, and PyG's ``GCNConv``, ``SAGEConv`` and
``GATConv`` (optional: ``pip install 'sparsetorch[bench]'``). Both load the shared weights
(``W*`` as (in, out), see ``gnn_torch``) and report gradients in that layout.

Example:
    >>> NAMES["gcn"]["W1"]      # the shared W1 is conv1's lin.weight, transposed
    ('conv1', 'lin.weight', 't')
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# shared name -> (layer, parameter, how): how "t" transposes (Linear weights are (out, in)),
# "head" drops the leading 1 of PyG's (1, heads, out) attention vectors.
_GCN = {"W1": ("conv1", "lin.weight", "t"), "b1": ("conv1", "bias", ""),
        "W2": ("conv2", "lin.weight", "t"), "b2": ("conv2", "bias", "")}
_SAGE = {f"{a}{k}": (f"conv{k}", name, how) for k in "12" for a, name, how in
         (("Wl", "lin_l.weight", "t"), ("bl", "lin_l.bias", ""), ("Wr", "lin_r.weight", "t"))}
_GAT = {f"{a}{k}": (f"conv{k}", name, how) for k in "12" for a, name, how in
        (("W", "lin.weight", "t"), ("b", "bias", ""), ("as", "att_src", "head"),
         ("ad", "att_dst", "head"))}
NAMES = {"gcn": _GCN, "sage": _SAGE, "gat": _GAT}


def pyg_available() -> str | None:
    """``None`` when PyG imports, else why not (the reason the report gives)."""
    try:
        import torch_geometric  # noqa: F401
    except ImportError as exc:
        return f"torch_geometric not installed ({exc}); pip install 'sparsetorch[bench]'"
    return None


class Bound(nn.Module):
    """``model(x, adj)`` as a zero-argument ``forward()``, with ``grads()`` in the shared
    names; loading ``weights`` into ``model`` first."""

    def __init__(self, kind: str, model: nn.Module, weights: dict, x, adj):
        super().__init__()
        self.kind, self.model, self.x, self.adj = kind, model, x, adj
        with torch.no_grad():
            for key, v in weights.items():
                p = self._param(key)
                v = _to_layout(v, NAMES[kind][key][2], inverse=True)
                if tuple(p.shape) != tuple(v.shape):
                    raise ValueError(f"{type(model).__name__}.{NAMES[kind][key][:2]} has "
                                     f"shape {tuple(p.shape)}, the shared {key} {tuple(v.shape)}")
                p.copy_(v)

    def _param(self, key: str) -> nn.Parameter:
        layer, name, _ = NAMES[self.kind][key]
        return getattr(self.model, layer).get_parameter(name)

    def forward(self):
        return self.model(self.x, self.adj)

    def grads(self) -> dict:
        return {k: _to_layout(self._param(k).grad, NAMES[self.kind][k][2])
                for k in NAMES[self.kind]}


def _to_layout(t, how: str, inverse: bool = False):
    if how == "t":
        return t.t()
    if how == "head":
        return t[None] if inverse else t[0]
    return t


class _TwoConv(nn.Module):
    def __init__(self, conv1, conv2, act):
        super().__init__()
        self.conv1, self.conv2, self.act = conv1, conv2, act

    def forward(self, x, adj):
        return self.conv2(self.act(self.conv1(x, adj)), adj)


def _sizes(kind: str, w: dict):
    first, last = ("Wl1", "Wl2") if kind == "sage" else ("W1", "W2")
    return w[first].shape[0], w[first].shape[1], w[last].shape[1]


def pyg(kind: str, w: dict, x, adj, heads: int = 1) -> Bound:
    """PyG's two-layer model of ``kind`` on ``x`` and ``adj`` (``edge_index`` or a torch
    CSR ``adj_t``); GCN keeps its normalised adjacency (``cached=True``), as users do."""
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    i, h, c = _sizes(kind, w)
    if kind == "gcn":
        model = _TwoConv(GCNConv(i, h, cached=True), GCNConv(h, c, cached=True), torch.relu)
    elif kind == "sage":
        model = _TwoConv(SAGEConv(i, h), SAGEConv(h, c), torch.relu)
    else:
        out1 = w["as1"].shape[1]
        model = _TwoConv(GATConv(i, out1, heads=heads),
                         GATConv(heads * out1, c, heads=1, concat=False), F.elu)
    return Bound(kind, model, w, x, adj)


def ours(kind: str, w: dict, x, adj, heads: int = 1) -> Bound:
    """Sparsetorch's model of ``kind``: ``st.models.GCN``/``GAT`` (dropout off so outputs
    compare exactly) or two ``st.nn.SAGEConv``. Raises NotImplementedError naming the layer
    when this build lacks it."""
    import sparsetorch as st

    need = {"gcn": ("models", "GCN"), "gat": ("models", "GAT"), "sage": ("nn", "SAGEConv")}[kind]
    if not hasattr(getattr(st, need[0], None), need[1]):
        raise NotImplementedError(f"st.{need[0]}.{need[1]} is not in this build")
    i, h, c = _sizes(kind, w)
    if kind == "gcn":
        model = st.models.GCN(i, h, c, dropout=0.0)
    elif kind == "sage":
        model = _TwoConv(st.nn.SAGEConv(i, h), st.nn.SAGEConv(h, c), torch.relu)
    else:
        model = st.models.GAT(i, hidden=w["as1"].shape[1], num_classes=c, heads=heads,
                              dropout=0.0)
    return Bound(kind, model, w, x, adj)
