"""Public ops. In: dense tensors and SparseTensors. Out: results of compiled kernels.

Each op module has the same parts: reference (dense) semantics, shape rule, format rule.
This package also installs the arithmetic operators on ``SparseTensor``: ``formats/`` must
not depend on the compiler, so the operators are attached here, where both are known.
"""
from ..formats.tensor import SparseTensor
from .einsum import Explanation, einsum, explain
from .expr import LazyExpr, abs, exp, lazy, relu, sqrt


def _binary(make):
    def op(self, other):
        return make(lazy(self), other).eval()
    return op


SparseTensor.__add__ = _binary(lambda a, b: a + b)
SparseTensor.__radd__ = _binary(lambda a, b: b + a)
SparseTensor.__sub__ = _binary(lambda a, b: a - b)
SparseTensor.__rsub__ = _binary(lambda a, b: b - a)
SparseTensor.__mul__ = _binary(lambda a, b: a * b)
SparseTensor.__rmul__ = _binary(lambda a, b: b * a)
SparseTensor.__truediv__ = _binary(lambda a, b: a / b)
SparseTensor.__neg__ = lambda self: (-lazy(self)).eval()

__all__ = ["einsum", "explain", "Explanation", "lazy", "LazyExpr", "relu", "abs", "exp",
           "sqrt"]
