"""``st.models``: ready-made models built on ``st.nn`` layers, with torch-only references
of the same weights for tests and benchmarks.

Example:
    >>> from sparsetorch.models import SparseTransformer, dense_reference
    >>> SparseTransformer.__name__, dense_reference.__name__
    ('SparseTransformer', 'dense_reference')
"""
from .transformer import SparseTransformer, dense_reference, reference

__all__ = ["SparseTransformer", "dense_reference", "reference"]
