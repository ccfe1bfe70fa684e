"""Sparse layers: ordinary ``torch.nn.Module``s whose weights or inputs are SparseTensors.

In: dense tensors, SparseTensors, graph adjacencies. Out: dense activations, computed by the
compiler's kernels and differentiable. See README.md in this folder.
"""
from .linear import SparseLinear

__all__ = ["SparseLinear"]
