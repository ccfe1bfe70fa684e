"""Sparse layers: ordinary ``torch.nn.Module``s whose weights, inputs, graphs or attention
patterns are SparseTensors, and ``sparsify``, a sparse copy of any model.

In: dense tensors, SparseTensors, graph adjacencies (``edge_index`` or SparseTensor),
attention masks (``masks``), or a whole dense model to convert. Out: dense activations,
computed by the compiler's kernels and differentiable. See README.md.

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU())
    >>> sp = st.sparsify(net, sparsity=0.5)
    >>> type(sp[1]).__name__, sp[1].activation
    ('SparseConv2d', 'relu')
    >>> from sparsetorch.nn import SparseAttention, masks
    >>> attn = SparseAttention(8, 2, mask=masks.longformer(6, 1, global_tokens=1))
    >>> attn(torch.randn(1, 6, 8)).shape
    torch.Size([1, 6, 8])
"""
from . import masks
from .adjacency import normalized_adjacency
from .attention import SparseAttention
from .conv import SparseConv2d, channels_first
from .depthwise import ChannelsFirstDepthwise
from .fold import fold_batchnorm
from .freeze import Frozen, freeze
from .graph import GATConv, GCNConv, SAGEConv
from .linear import SparseLinear
from .pattern import choose_blocksize, prune_mask
from .sparsify import fold_batchnorms, sparsify
from .stem import ChannelsFirstStem

__all__ = ["SparseLinear", "SparseConv2d", "ChannelsFirstDepthwise", "ChannelsFirstStem",
           "GCNConv", "SAGEConv", "GATConv", "normalized_adjacency", "SparseAttention", "masks",
           "channels_first", "fold_batchnorm", "fold_batchnorms", "choose_blocksize",
           "prune_mask", "sparsify", "freeze", "Frozen"]
