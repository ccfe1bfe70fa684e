"""Sparse layers: ordinary ``torch.nn.Module``s whose weights, inputs or graphs are
SparseTensors, and ``sparsify``, a sparse copy of any model.

In: dense tensors, SparseTensors, graph adjacencies (``edge_index`` or SparseTensor). Out:
dense activations, computed by the compiler's kernels and differentiable. See README.md.

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU())
    >>> sp = st.sparsify(net, sparsity=0.5)
    >>> type(sp[1]).__name__, sp[1].activation
    ('SparseConv2d', 'relu')
"""
from .adjacency import normalized_adjacency
from .conv import SparseConv2d, channels_first
from .depthwise import ChannelsFirstDepthwise
from .fold import fold_batchnorm
from .graph import GATConv, GCNConv, SAGEConv
from .linear import SparseLinear
from .pattern import choose_blocksize, prune_mask
from .sparsify import fold_batchnorms, sparsify

__all__ = ["SparseLinear", "SparseConv2d", "ChannelsFirstDepthwise", "GCNConv", "SAGEConv",
           "GATConv", "normalized_adjacency", "channels_first", "fold_batchnorm",
           "fold_batchnorms", "choose_blocksize", "prune_mask", "sparsify"]
