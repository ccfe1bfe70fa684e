"""Sparse layers: ordinary ``torch.nn.Module``s whose weights, inputs or graphs are
SparseTensors.

In: dense tensors, SparseTensors, graph adjacencies (``edge_index`` or SparseTensor). Out:
dense activations, computed by the compiler's kernels and differentiable. See README.md.
"""
from .adjacency import normalized_adjacency
from .graph import GATConv, GCNConv, SAGEConv
from .linear import SparseLinear

__all__ = ["SparseLinear", "GCNConv", "SAGEConv", "GATConv", "normalized_adjacency"]
