"""The GNN baselines in PyTorch Geometric (optional: ``pip install 'sparsetorch[bench]'``):
two ``GCNConv``, ``SAGEConv`` or ``GATConv`` layers loaded with the shared weights, run with
either adjacency PyG accepts on the CPU (``edge_index``, or a torch CSR ``adj_t``);
the report keeps whichever is faster and says which.

Example:
    >>> available() is None or "not installed" in available()
    True
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def available() -> str | None:
    """``None`` when PyG imports, else why not (the reason the report gives)."""
    try:
        import torch_geometric  # noqa: F401
    except ImportError as exc:
        return f"torch_geometric not installed ({exc}); pip install 'sparsetorch[bench]'"
    return None


class PygModel(nn.Module):
    """Two PyG layers (``kind`` gcn, sage or gat) with the shared weights (see
    ``gnn_torch``); ``forward()`` runs on the stored ``x`` and ``adj``."""

    def __init__(self, kind: str, weights: dict, x, adj, heads: int = 1):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, SAGEConv

        self.kind, self.x, self.adj = kind, x, adj
        if kind == "gcn":
            (i, h), c = weights["W1"].shape, weights["W2"].shape[1]
            self.conv1, self.conv2 = GCNConv(i, h, cached=True), GCNConv(h, c, cached=True)
            _set(self.conv1, {"lin.weight": weights["W1"].t(), "bias": weights["b1"]})
            _set(self.conv2, {"lin.weight": weights["W2"].t(), "bias": weights["b2"]})
            self._names = {"W1": ("conv1", "lin.weight", True), "b1": ("conv1", "bias", False),
                           "W2": ("conv2", "lin.weight", True), "b2": ("conv2", "bias", False)}
        elif kind == "sage":
            (i, h), c = weights["Wl1"].shape, weights["Wl2"].shape[1]
            self.conv1, self.conv2 = SAGEConv(i, h), SAGEConv(h, c)
            for k, conv in (("1", self.conv1), ("2", self.conv2)):
                _set(conv, {"lin_l.weight": weights["Wl" + k].t(), "lin_l.bias": weights["bl" + k],
                            "lin_r.weight": weights["Wr" + k].t()})
            self._names = {f"{a}{k}": (f"conv{k}", name, a.startswith("W"))
                           for k in "12" for a, name in (("Wl", "lin_l.weight"),
                                                         ("bl", "lin_l.bias"),
                                                         ("Wr", "lin_r.weight"))}
        elif kind == "gat":
            i, c = weights["W1"].shape[0], weights["W2"].shape[1]
            out1 = weights["as1"].shape[1]
            self.conv1 = GATConv(i, out1, heads=heads)
            self.conv2 = GATConv(heads * out1, c, heads=1, concat=False)
            self._names = {}
            for k, conv in (("1", self.conv1), ("2", self.conv2)):
                _set(conv, {"lin.weight": weights["W" + k].t(), "bias": weights["b" + k],
                            "att_src": weights["as" + k][None], "att_dst": weights["ad" + k][None]})
                self._names.update({f"W{k}": (f"conv{k}", "lin.weight", True),
                                    f"b{k}": (f"conv{k}", "bias", False),
                                    f"as{k}": (f"conv{k}", "att_src", "squeeze"),
                                    f"ad{k}": (f"conv{k}", "att_dst", "squeeze")})
        else:
            raise ValueError(f"PygModel: unknown kind {kind!r} (gcn, sage, gat)")

    def forward(self):
        act = F.elu if self.kind == "gat" else torch.relu
        return self.conv2(act(self.conv1(self.x, self.adj)), self.adj)

    def grads(self) -> dict:
        out = {}
        for key, (conv, name, how) in self._names.items():
            g = getattr(self, conv).get_parameter(name).grad
            out[key] = g.t() if how is True else g[0] if how == "squeeze" else g
        return out


def _set(conv: nn.Module, values: dict) -> None:
    with torch.no_grad():
        for name, v in values.items():
            p = conv.get_parameter(name)
            if tuple(p.shape) != tuple(v.shape):
                raise ValueError(f"PyG {type(conv).__name__}.{name} has shape "
                                 f"{tuple(p.shape)}, the shared weights {tuple(v.shape)}")
            p.copy_(v)
