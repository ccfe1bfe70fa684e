"""The GNN baselines written in plain torch: the same two-layer GCN, GraphSAGE and GAT as
sparsetorch's, with the adjacency (and the node features) as torch.sparse CSR, COO or dense
tensors. Each is built from one dict of weights in a layout every implementation shares:
``W*`` are (in, out) matrices, ``b*`` biases, GAT's ``as*``/``ad*`` (heads, out) attention
vectors for a source and a target node.

Example:
    >>> import torch
    >>> A = torch.eye(3).to_sparse_csr()
    >>> w = {"W1": torch.ones(2, 4), "b1": torch.zeros(4), "W2": torch.ones(4, 1),
    ...      "b2": torch.zeros(1)}
    >>> TorchGCN(w, A, torch.ones(3, 2))().flatten().tolist()
    [8.0, 8.0, 8.0]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NEGATIVE_SLOPE = 0.2  # GAT's LeakyReLU, as Velickovic et al. and PyG


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a dense, COO or CSR ``a`` (torch.sparse.mm for the sparse ones)."""
    return a @ b if a.layout == torch.strided else torch.sparse.mm(a, b)


class _FromWeights(nn.Module):
    """Parameters named as the shared weight dict, copied; ``grads()`` in the same names."""

    def __init__(self, weights: dict):
        super().__init__()
        self.w = nn.ParameterDict({k: nn.Parameter(v.detach().clone()) for k, v in
                                   weights.items()})

    def grads(self) -> dict:
        return {k: p.grad for k, p in self.w.items()}


class TorchGCN(_FromWeights):
    """relu(Â X W1 + b1) -> Â H W2 + b2 with ``adj`` = Â (already normalised)."""

    def __init__(self, weights, adj, x):
        super().__init__(weights)
        self.adj, self.x = adj, x

    def forward(self):
        w = self.w
        h = torch.relu(mm(self.adj, mm(self.x, w["W1"])) + w["b1"])
        return mm(self.adj, h @ w["W2"]) + w["b2"]


class TorchSAGE(_FromWeights):
    """Mean aggregation: relu(M X Wl1 + bl1 + X Wr1) -> M H Wl2 + bl2 + H Wr2, ``adj`` = M =
    D^-1 A (PyG's ``SAGEConv(aggr="mean")``, projecting before aggregating: same sums)."""

    def __init__(self, weights, adj, x):
        super().__init__(weights)
        self.adj, self.x = adj, x

    def forward(self):
        w = self.w
        h = torch.relu(mm(self.adj, mm(self.x, w["Wl1"])) + w["bl1"] + mm(self.x, w["Wr1"]))
        return mm(self.adj, h @ w["Wl2"]) + w["bl2"] + h @ w["Wr2"]


class TorchGAT(_FromWeights):
    """Two GAT layers (Velickovic et al.): ``heads`` concatenated heads, ELU, then one head.
    ``pattern`` is A + I (CSR, scipy). ``layout="coo"``: every head's scores in one
    block-diagonal COO matrix, torch.sparse.softmax, one torch.sparse.mm (torch.sparse has no
    CSR softmax). ``layout="dense"``: heads x n x n masked scores, softmax, bmm."""

    def __init__(self, weights, pattern, x, heads: int, layout: str):
        super().__init__(weights)
        self.x, self.heads, self.layout = x, heads, layout
        n = pattern.shape[0]
        coo = pattern.tocoo()
        self.n = n
        self.rows = torch.from_numpy(coo.row.astype("int64"))
        self.cols = torch.from_numpy(coo.col.astype("int64"))
        if layout == "dense":
            self.mask = torch.zeros(n, n, dtype=torch.bool)
            self.mask[self.rows, self.cols] = True
        self._blocks = {}

    def _block_indices(self, h: int) -> torch.Tensor:
        # Head-major blocks, each in the pattern's row-major order: already coalesced.
        if h not in self._blocks:
            off = torch.arange(h).repeat_interleave(self.rows.numel()) * self.n
            self._blocks[h] = torch.stack([self.rows.repeat(h) + off, self.cols.repeat(h) + off])
        return self._blocks[h]

    def _layer(self, x, W, a_src, a_dst, b):
        heads, out = a_src.shape
        n = self.n
        h = mm(x, W).view(n, heads, out)
        es, ed = (h * a_src).sum(-1), (h * a_dst).sum(-1)          # n x heads
        if self.layout == "dense":
            s = F.leaky_relu(ed.t()[:, :, None] + es.t()[:, None, :], NEGATIVE_SLOPE)
            p = torch.softmax(s.masked_fill(~self.mask, float("-inf")), -1)
            y = torch.bmm(p, h.permute(1, 0, 2))                        # heads x n x out
        else:
            e = F.leaky_relu(es[self.cols] + ed[self.rows], NEGATIVE_SLOPE)   # nnz x heads
            s = torch.sparse_coo_tensor(self._block_indices(heads), e.t().reshape(-1),
                                        (heads * n, heads * n), is_coalesced=True)
            p = torch.sparse.softmax(s, 1)
            y = torch.sparse.mm(p, h.permute(1, 0, 2).reshape(heads * n, out)).view(heads, n, out)
        return y.permute(1, 0, 2).reshape(n, heads * out) + b

    def forward(self):
        w = self.w
        h = F.elu(self._layer(self.x, w["W1"], w["as1"], w["ad1"], w["b1"]))
        return self._layer(h, w["W2"], w["as2"], w["ad2"], w["b2"])
