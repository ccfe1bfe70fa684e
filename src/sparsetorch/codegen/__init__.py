"""Renderers from loop IR to source code. In: ``compiler.ir.Function``s. Out: C99 + OpenMP.
``compile_kernel``: the compiler's lowering and this rendering in one memoised call."""
from .c import render_c
from .kernel import compile_kernel

__all__ = ["compile_kernel", "render_c"]
