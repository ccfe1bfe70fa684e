"""sparsetorch: fast, automatic sparse deep learning for PyTorch.

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.eye(3), format="csr")
    >>> A.format.name, A.nnz
    ('csr', 3)
"""
from .formats import (FORMAT_NAMES, Compressed, Dense, Format, LevelKind, Singleton,
                      SparseTensor, compressed, dense, singleton, tensor)

__version__ = "0.1.0"

__all__ = ["tensor", "SparseTensor", "Format", "FORMAT_NAMES", "LevelKind", "Dense",
           "Compressed", "Singleton", "dense", "compressed", "singleton", "__version__"]
