"""Autograd for compiled expressions: the gradient with respect to each operand is another
expression run by the same compiler, sampled on a sparse operand's own pattern so sparse
gradients stay sparse.

In: an ``Assignment`` and operands whose (sparse) values may require grad. Out: the result,
recorded by one ``torch.autograd.Function`` node.
"""
from .derive import operand_grad
from .function import evaluate, needs_grad
from .pattern import ones_pattern, values_on_pattern

__all__ = ["evaluate", "needs_grad", "operand_grad", "ones_pattern", "values_on_pattern"]
