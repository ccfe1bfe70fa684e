"""Sparse layers: ``SparseConv2d`` (1x1 convolutions over CHW activations), the layout-keeping
depthwise convolution, batch-norm folding and ``sparsify`` (a sparse copy of any model).

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU())
    >>> sp = st.sparsify(net, sparsity=0.5)
    >>> type(sp[1]).__name__, sp[1].activation
    ('SparseConv2d', 'relu')
"""
from .conv import SparseConv2d, channels_first
from .depthwise import ChannelsFirstDepthwise
from .fold import fold_batchnorm
from .pattern import SparsePattern, choose_blocksize, prune_mask
from .sparsify import fold_batchnorms, sparsify

__all__ = ["SparseConv2d", "ChannelsFirstDepthwise", "channels_first", "fold_batchnorm", "fold_batchnorms",
           "SparsePattern", "choose_blocksize", "prune_mask", "sparsify"]
