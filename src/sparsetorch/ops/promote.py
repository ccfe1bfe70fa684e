"""Type promotion as torch does it, applied to operands before they reach a kernel.

Kernels compute in one value type, and generated C casts a scalar to it: ``A * 0.5`` on
int64 values multiplied by 0. So every op first finds torch's result type and casts the
operands that differ (the values of a SparseTensor, its pattern kept):

* tensors promote pairwise (``torch.promote_types``): float32 with float64 is float64, an
  integer with a float is the float;
* a Python float (a factor, or true division) makes an integer result the default float
  dtype (``torch.get_default_dtype()``), as ``int_tensor * 0.5`` does; a Python int keeps
  the tensors' type;
* ``sqrt`` and ``exp`` of integers are floats; sums of integers are int64.

Example:
    >>> import torch
    >>> result_dtype([torch.ones(2, dtype=torch.int64)], floats=True)
    torch.float32
    >>> result_dtype([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    torch.float64
"""
from __future__ import annotations

import functools

import torch

from ..formats.tensor import SparseTensor


# The maps whose values on integers are floats, as torch.exp, torch.sqrt and torch.sigmoid
# give them.
FLOAT_MAPS = ("exp", "sqrt", "sigmoid")


def result_dtype(operands, floats: bool = False):
    """torch's result dtype of an elementwise op over the tensors ``operands``; ``floats``:
    a Python float scalar takes part, or the op itself makes floats (true division,
    ``sqrt``, ``exp``). None without operands."""
    dtype = None
    for t in operands:
        dtype = t.dtype if dtype is None or t.dtype is dtype else \
            torch.promote_types(dtype, t.dtype)
    if any(t.dtype is not dtype for t in operands) and \
            any(type(t) is torch.Tensor and t.dim() == 0 for t in operands):
        dtype = _with_zero_dim(operands)
    if floats and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return dtype


def _with_zero_dim(operands) -> torch.dtype:
    """torch's rule where dense 0-d tensors take part: like Python numbers, they set the
    result type only when of a higher category (bool, integer, float, complex) than the
    tensors with dimensions (a float32 SparseTensor times a float64 0-d tensor is float32;
    it was float64, a probe found)."""
    zero = [t.dtype for t in operands if type(t) is torch.Tensor and t.dim() == 0]
    rest = [t.dtype for t in operands if not (type(t) is torch.Tensor and t.dim() == 0)]
    zero_dtype = functools.reduce(torch.promote_types, zero)
    if not rest:
        return zero_dtype
    rest_dtype = functools.reduce(torch.promote_types, rest)
    return zero_dtype if _category(zero_dtype) > _category(rest_dtype) else rest_dtype


def _category(dtype: torch.dtype) -> int:
    return 3 if dtype.is_complex else 2 if dtype.is_floating_point else \
        int(dtype != torch.bool)


def cast(t, dtype):
    """``t`` with values of ``dtype`` (a SparseTensor keeps its pattern; differentiable)."""
    if t.dtype == dtype:
        return t
    if isinstance(t, SparseTensor):
        return t.with_values(t.values.to(dtype))
    return t.to(dtype)


def promoted(operands, floats: bool = False) -> tuple:
    """``operands`` (tensors) cast to their ``result_dtype``; the same tuple when they
    already share it.

    Example:
        >>> import torch
        >>> [t.dtype for t in promoted((torch.ones(1), torch.ones(1, dtype=torch.int32)))]
        [torch.float32, torch.float32]
    """
    operands = tuple(operands)
    dtype = result_dtype(operands, floats)
    if all(t.dtype == dtype for t in operands):
        return operands
    if dtype is not None and dtype.is_complex:   # (a SparseTensor holds no complex values)
        n = next(i for i, t in enumerate(operands) if t.dtype.is_complex)
        raise TypeError(f"operand {n} is {operands[n].dtype}, which would make the result "
                        f"complex; sparse operands hold real values: pass real tensors "
                        f"(.real, .imag, or .to(torch.float32))")
    return tuple(cast(t, dtype) for t in operands)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``torch.sum`` gives a tensor of ``dtype``: integers (and bool) sum in int64."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.int64
