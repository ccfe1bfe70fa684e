"""Renderers from loop IR to source code. In: ``compiler.ir.Function``s. Out: C99 + OpenMP."""
from .c import render_c

__all__ = ["render_c"]
