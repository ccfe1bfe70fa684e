"""sparsetorch: fast, automatic sparse deep learning for PyTorch.

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.eye(3), format="csr")
    >>> A.format.name, A.nnz
    ('csr', 3)
    >>> st.einsum("ij,jk->ik", A, torch.ones(3, 2)).sum().item()
    6.0
"""
__version__ = "0.1.0"

from .formats import (FORMAT_NAMES, Compressed, Dense, Format, LevelKind, Singleton,
                      SparseTensor, compressed, dense, singleton, tensor)
from .ops import Explanation, LazyExpr, abs, einsum, exp, explain, lazy, relu, sqrt
from . import datasets, io, runtime
from . import models, nn  # layers and models on the ops above
from .fusion import compile  # st.compile, named as torch.compile

__all__ = ["tensor", "SparseTensor", "Format", "FORMAT_NAMES", "LevelKind", "Dense",
           "Compressed", "Singleton", "dense", "compressed", "singleton", "einsum", "explain",
           "Explanation", "lazy", "LazyExpr", "relu", "abs", "exp", "sqrt", "runtime", "io",
           "datasets", "compile", "nn", "models",
           "__version__"]
