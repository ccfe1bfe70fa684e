"""The sparse tensor compiler: index notation -> loop order -> output format -> loop IR.

In: an ``Assignment`` (einsum or expression tree) and operand formats. Out: a
``CompiledKernel`` with verified loop IR (see ``kernel.py``), which ``codegen`` renders.
"""
from .kernel import CompiledKernel, lower_kernel
from .notation import Access, Add, Assignment, Expr, Mul, Scale, Unary, parse_einsum
from .schedule import OperandInfo

__all__ = ["lower_kernel", "CompiledKernel", "parse_einsum", "Assignment", "Expr", "Access",
           "Add", "Mul", "Scale", "Unary", "OperandInfo"]
