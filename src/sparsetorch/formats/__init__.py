"""Sparse formats: level kinds, ``Format``, ``SparseTensor`` and conversions.

In: dense/numpy/scipy/torch.sparse/COO data. Out: validated ``SparseTensor`` level arrays.
"""
from .construct import eye, random
from .convert import tensor
from .format import FORMAT_NAMES, Format, as_format, compressed, dense, singleton
from .levels import Compressed, Dense, LevelKind, Singleton
from .tensor import SparseTensor

# ``torch.load(..., weights_only=True)`` rebuilds only allow-listed classes; a loaded
# SparseTensor is validated like user data (``SparseTensor.__setstate__``), so these are safe.
# A custom LevelKind subclass must be allow-listed by its author the same way.
import torch as _torch

_torch.serialization.add_safe_globals([SparseTensor, Format, Dense, Compressed, Singleton])

__all__ = ["tensor", "eye", "random", "Format", "as_format", "FORMAT_NAMES", "SparseTensor", "LevelKind",
           "Dense", "Compressed", "Singleton", "dense", "compressed", "singleton"]
