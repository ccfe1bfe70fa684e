"""Ready-made models (see README.md here): sparse models built from ``sparsetorch.nn``
layers, and dense MobileNet v1/v2 (written here, no torchvision) for ``st.sparsify``.

In: node features and an adjacency (GCN, GAT), rows of features (SparseAutoencoder), token
ids (SparseTransformer) or images (MobileNets). Out: logits or reconstructions, dense; every
model trains with any torch optimizer. ``dense_reference``/``reference`` build torch-only
models of the same weights, for tests and benchmarks.

Example:
    >>> import torch, sparsetorch as st
    >>> net = st.models.mobilenet_v2(width_mult=0.25, num_classes=10).eval()
    >>> net(torch.randn(1, 3, 64, 64)).shape
    torch.Size([1, 10])
"""
from .autoencoder import SparseAutoencoder
from .graph import GAT, GCN
from .mobilenet import mobilenet_v1, mobilenet_v2
from .transformer import SparseTransformer, dense_reference, reference

__all__ = ["GCN", "GAT", "SparseAutoencoder", "SparseTransformer", "dense_reference",
           "reference", "mobilenet_v1", "mobilenet_v2"]
