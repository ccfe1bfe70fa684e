"""Ready-made sparse models built from ``sparsetorch.nn`` layers (see README.md here).

In: node features and an adjacency (GCN, GAT), rows of features (SparseAutoencoder) or
token ids (SparseTransformer). Out: logits or reconstructions, dense; every model trains
with any torch optimizer. ``dense_reference``/``reference`` build torch-only models of the
same weights, for tests and benchmarks.

Example:
    >>> from sparsetorch.models import SparseTransformer, dense_reference
    >>> SparseTransformer.__name__, dense_reference.__name__
    ('SparseTransformer', 'dense_reference')
"""
from .autoencoder import SparseAutoencoder
from .graph import GAT, GCN
from .transformer import SparseTransformer, dense_reference, reference

__all__ = ["GCN", "GAT", "SparseAutoencoder", "SparseTransformer", "dense_reference",
           "reference"]
