"""Ready-made sparse models built from ``sparsetorch.nn`` layers (see README.md here).

In: node features and an adjacency (GCN, GAT) or rows of features (SparseAutoencoder).
Out: logits or reconstructions, dense; every model trains with any torch optimizer.
"""
from .autoencoder import SparseAutoencoder
from .graph import GAT, GCN

__all__ = ["GCN", "GAT", "SparseAutoencoder"]
