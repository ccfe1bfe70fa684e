"""Graph neural networks from ``sparsetorch.nn``: Kipf & Welling's GCN and a GAT.

In: node features ``x`` (dense or SparseTensor) and an adjacency (``edge_index`` or
SparseTensor, see ``sparsetorch.nn.adjacency``). Out: per-node class logits.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..nn import GATConv, GCNConv
from ..nn._common import check_dropout


class GCN(nn.Module):
    """Two-layer GCN (Kipf & Welling 2017): dropout, ``GCNConv``, ReLU, dropout,
    ``GCNConv``; returns logits (train with ``F.cross_entropy``). Sparse features are
    dropped on their stored values. Each layer keeps its normalised adjacency (``cached``).
    ``normalize`` and ``self_loops`` are ``GCNConv``'s (self loops follow ``normalize``
    unless given).

    Example:
        >>> import torch, sparsetorch as st
        >>> model = st.models.GCN(4, 16, 3)
        >>> model(torch.randn(5, 4), torch.tensor([[0, 1, 2], [1, 2, 3]])).shape
        torch.Size([5, 3])
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float = 0.5,
                 normalize="sym", self_loops: bool | None = None, cached: bool = True):
        super().__init__()
        check_dropout("GCN", dropout)
        self.dropout = dropout
        self.conv1 = GCNConv(in_features, hidden, normalize=normalize, self_loops=self_loops,
                             cached=cached, activation="relu")   # (in the kernel)
        self.conv2 = GCNConv(hidden, num_classes, normalize=normalize, self_loops=self_loops,
                             cached=cached)
        self.conv2._cache = self.conv1._cache   # the same matrix: one kept copy, built once

    def forward(self, x, adj):
        # (the layers read from the module table: nn.Module's attribute fallback costs
        # ~2 us a name, ~2% of an evaluation forward on Cora)
        layers = self._modules
        x = _dropout(x, self.dropout, self.training)
        x = _dropout(layers["conv1"](x, adj), self.dropout, self.training)
        return layers["conv2"](x, adj)


class GAT(nn.Module):
    """Two-layer GAT (Velickovic et al. 2018; ``num_classes`` is required): dropout,
    ``GATConv`` with ``heads`` heads concatenated, ELU, dropout, ``GATConv`` with
    ``out_heads`` heads averaged; attention dropout ``dropout`` in both layers; returns
    logits.

    Example:
        >>> import torch, sparsetorch as st
        >>> model = st.models.GAT(4, num_classes=3, hidden=2, heads=2)
        >>> model(torch.randn(5, 4), torch.tensor([[0, 1, 2], [1, 2, 3]])).shape
        torch.Size([5, 3])
    """

    def __init__(self, in_features: int, hidden: int = 8, num_classes: int | None = None,
                 heads: int = 8, dropout: float = 0.6, out_heads: int = 1):
        super().__init__()
        if num_classes is None:
            raise ValueError("GAT: num_classes is required (GAT(in_features, hidden=8, "
                             "num_classes=C, ...))")
        check_dropout("GAT", dropout)
        self.dropout = dropout
        self.conv1 = GATConv(in_features, hidden, heads=heads, dropout=dropout)
        self.conv2 = GATConv(hidden * heads, num_classes, heads=out_heads, concat=False,
                             dropout=dropout)

    def forward(self, x, adj):
        x = _dropout(x, self.dropout, self.training)
        x = _dropout(F.elu(self.conv1(x, adj)), self.dropout, self.training)
        return self.conv2(x, adj)


def _dropout(x, p: float, training: bool):
    # (no call at all in evaluation: a small graph's forward is a few hundred us)
    return F.dropout(x, p, training) if training and p else x
