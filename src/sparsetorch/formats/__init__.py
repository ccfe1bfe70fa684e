"""Sparse formats: level kinds, ``Format``, ``SparseTensor`` and conversions.

In: dense/numpy/scipy/torch.sparse/COO data. Out: validated ``SparseTensor`` level arrays.
"""
from .convert import tensor
from .format import FORMAT_NAMES, Format, as_format, compressed, dense, singleton
from .levels import Compressed, Dense, LevelKind, Singleton
from .tensor import SparseTensor

__all__ = ["tensor", "Format", "as_format", "FORMAT_NAMES", "SparseTensor", "LevelKind",
           "Dense", "Compressed", "Singleton", "dense", "compressed", "singleton"]
