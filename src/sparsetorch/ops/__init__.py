"""Public ops. In: dense tensors and SparseTensors. Out: results of compiled kernels.

Each op module has the same parts: reference (dense) semantics, shape rule, format rule.
Importing this package also connects ``SparseTensor`` to torch's API (``torch_api.py``):
operators, ``torch.matmul``, ``F.linear``, reductions, views. ``formats/`` must not depend on
the compiler, so that wiring happens here, where both are known.
"""
from .einsum import Explanation, einsum, explain
from .expr import LazyExpr, abs, exp, lazy, relu, sqrt
from .attention import masked_attention
from .softmax import softmax
from .depthwise import depthwise3x3
from .expand_depthwise import expand_depthwise3x3
from .narrow import spmm_narrow
from .rows import sparse_linear
from .stem import stem_conv3x3
from .torch_api import _install

_install()

__all__ = ["einsum", "explain", "Explanation", "lazy", "LazyExpr", "relu", "abs", "exp",
           "sqrt", "softmax", "masked_attention", "depthwise3x3",
           "expand_depthwise3x3", "spmm_narrow", "sparse_linear", "stem_conv3x3"]
