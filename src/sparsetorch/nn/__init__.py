"""Sparse layers: ordinary ``torch.nn.Module``s whose weights, inputs, graphs or attention
patterns are SparseTensors.

In: dense tensors, SparseTensors, graph adjacencies (``edge_index`` or SparseTensor),
attention masks (``masks``). Out: dense activations, computed by the compiler's kernels and
differentiable. See README.md.

Example:
    >>> import torch
    >>> from sparsetorch.nn import SparseAttention, masks
    >>> attn = SparseAttention(8, 2, mask=masks.longformer(6, 1, global_tokens=1))
    >>> attn(torch.randn(1, 6, 8)).shape
    torch.Size([1, 6, 8])
"""
from . import masks
from .adjacency import normalized_adjacency
from .attention import SparseAttention
from .graph import GATConv, GCNConv, SAGEConv
from .linear import SparseLinear

__all__ = ["SparseLinear", "GCNConv", "SAGEConv", "GATConv", "normalized_adjacency",
           "SparseAttention", "masks"]
