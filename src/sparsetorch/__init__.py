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
                      SparseTensor, compressed, dense, eye, random, singleton, tensor)
from .ops import Explanation, LazyExpr, abs, einsum, exp, explain, lazy, relu, sqrt
from . import bench, datasets, io, runtime
from .fusion import compile  # st.compile, named as torch.compile
from . import nn, models, train
from .nn import freeze, sparsify

__all__ = ["tensor", "eye", "random", "SparseTensor", "Format", "FORMAT_NAMES", "LevelKind",
           "Dense", "Compressed", "Singleton", "dense", "compressed", "singleton", "einsum",
           "explain", "Explanation", "lazy", "LazyExpr", "relu", "abs", "exp", "sqrt",
           "runtime", "io", "datasets", "bench", "compile", "nn", "models", "train",
           "sparsify", "freeze",
           "__version__"]
