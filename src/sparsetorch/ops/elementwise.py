"""Elementwise arithmetic and maps on SparseTensors, as expressions (``st.lazy``) or
einsum products, so each is one kernel and differentiable through ``sparsetorch.autograd``.

Rules (zeros stay zeros, nothing is silently densified):

* ``A * B`` and ``A * dense`` intersect: the result is sparse. A dense operand may broadcast
  into the sparse shape (``A * row_vector``: an einsum sampled on ``A``).
* ``A + B`` unions patterns; ``A + dense`` is dense (it is, entry by entry).
* ``A * c`` and ``A / c`` scale the values; ``A + c`` with ``c != 0`` would fill every missing
  entry, so it raises TypeError (say ``A.to_dense() + c`` or ``A.with_values(A.values + c)``).
* ``A / dense`` multiplies by the reciprocal; dividing *by* a sparse tensor divides by its
  missing zeros and raises TypeError.
* ``relu``, ``abs``, ``sqrt``, ``neg`` and ``** p`` (``p > 0``) keep the pattern; ``exp``
  (exp(0) = 1) is dense.
"""
from __future__ import annotations

import numbers

import torch

from ..formats.pack import unpack
from ..formats.tensor import SparseTensor
from .einsum import einsum
from .expr import LazyExpr, lazy
from .promote import result_dtype

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _is_scalar(x) -> bool:
    # (a bool too: an int to torch's promotion; a symbolic number: torch.compile passes a
    # Python number that changed between calls as one)
    return isinstance(x, (numbers.Real, torch.SymInt, torch.SymFloat))


def _on_values(t: SparseTensor, fn) -> SparseTensor:
    """``t`` with ``fn`` applied to its stored values (the pattern kept, implicit zeros
    staying zero): a symbolic scalar cannot ride in a lazy tree's equation, and a division
    must divide (a lazy tree's scale multiplies by the reciprocal: 1 ulp off a third of the
    time, and 1e-300 / 1e-310 was inf). A dense format's result is a torch.Tensor, as a
    lazy tree's is."""
    out = t.with_values(fn(t.values))
    return out.to_dense() if t.format.is_dense else out


def _fmt(*xs) -> str:
    return ", ".join(sorted({x.format.name for x in xs if isinstance(x, SparseTensor)}))


def _scalar(x):
    """A Python int or float of real scalar ``x`` (numpy's too): ints keep an integer
    result integral, floats make it float (``ops/promote.py``)."""
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _check_operand(x, op: str):
    if not (isinstance(x, torch.Tensor) or _is_scalar(x)):
        raise TypeError(f"{op}: cannot combine a SparseTensor with a {type(x).__name__}; use "
                        "a real scalar, a torch.Tensor or a SparseTensor")


def _broadcast_dense(sparse: SparseTensor, dense: torch.Tensor, op: str):
    """``dense`` reshaped to the dimensions it really varies in, and their letters; raises if
    broadcasting would grow the sparse operand's shape."""
    n, m = sparse.dim(), dense.dim()
    shape = tuple(sparse.shape)
    if m > n or any(b != 1 and b != s for b, s in zip(dense.shape, shape[n - m:])):
        raise ValueError(f"{op}: a dense operand of shape {tuple(dense.shape)} does not "
                         f"broadcast to the sparse operand's shape {shape} (broadcasting "
                         "that grows a SparseTensor is not supported)")
    letters = _LETTERS[:n]
    keep = [d for d in range(m) if dense.shape[d] != 1 or shape[n - m + d] == 1]
    sub = "".join(letters[n - m + d] for d in keep)
    return dense.reshape([dense.shape[d] for d in keep]), letters, sub


def mul(a, b):
    """Elementwise product (sparse result when either side is sparse).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.]]), "csr")
        >>> mul(A, torch.tensor([10., 100.])).to_dense()
        tensor([[ 10.,   0.],
                [  0., 200.]])
    """
    _check_operand(a, "mul")
    _check_operand(b, "mul")
    if _is_scalar(a):
        a, b = b, a
    if isinstance(b, (torch.SymInt, torch.SymFloat)):
        return _on_values(a, lambda v: v * b)
    if _is_scalar(b):
        return (lazy(a) * _scalar(b)).eval()
    if a.shape == b.shape:
        return (lazy(a) * lazy(b)).eval()
    sparse, dense = (a, b) if isinstance(a, SparseTensor) else (b, a)
    if isinstance(dense, SparseTensor):
        raise ValueError(f"mul: sparse operands of shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)} differ; broadcasting between SparseTensors is "
                         "not supported")
    d, letters, sub = _broadcast_dense(sparse, dense, "mul")
    return einsum(f"{letters},{sub}->{letters}", sparse, d)


def add(a, b, *, alpha=1):
    """``a + alpha * b``: patterns union; a dense operand makes the result dense.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.]]), "csr")
        >>> add(A, A, alpha=2).to_dense()
        tensor([[3., 0.],
                [0., 6.]])
    """
    _check_operand(a, "add")
    _check_operand(b, "add")
    if not _is_scalar(alpha):
        raise TypeError(f"add: alpha must be a real number, got {alpha!r}")
    for x, y in ((a, b), (b, a)):
        if _is_scalar(y):
            if y != 0:
                raise TypeError(
                    f"add: adding the nonzero scalar {y} to a SparseTensor (format "
                    f"{_fmt(x)}) fills every missing entry (a dense result); write "
                    "A.to_dense() + c for that, or A.with_values(A.values + c) to change "
                    "only the stored entries")
    if _is_scalar(b):
        return _floated(_copy(a), b)
    if _is_scalar(a):
        return _floated(mul(b, alpha), a)
    rhs = lazy(b) if alpha == 1 else lazy(b) * _scalar(alpha)
    if a.shape != b.shape:
        sparse_a = isinstance(a, SparseTensor)
        dense = b if sparse_a else a
        if isinstance(dense, SparseTensor):
            raise ValueError(f"add: sparse operands of shapes {tuple(a.shape)} and "
                             f"{tuple(b.shape)} differ; broadcasting between SparseTensors "
                             "is not supported")
        sparse = a if sparse_a else b
        _broadcast_dense(sparse, dense, "add")   # the shape check only
        if dense.dim() == 0:   # (promotes as a number, as in torch, before it is expanded)
            dense = dense.to(result_dtype((sparse, dense)))
        dense = dense.expand(sparse.shape)        # the sum is dense: its size anyway
        if sparse_a:
            rhs = lazy(dense) if alpha == 1 else lazy(dense) * _scalar(alpha)
        else:
            a = dense
    return (lazy(a) + rhs).eval()


def _floated(t, zero):
    """``t + zero`` (a scalar 0): a float 0 makes floats of integers, as torch's add."""
    if isinstance(_scalar(zero), int) or t.dtype.is_floating_point:
        return t
    floats = torch.get_default_dtype()
    return t.with_values(t.values.to(floats)) if isinstance(t, SparseTensor) else t.to(floats)


def _copy(t):
    return t.with_values(t.values.clone()) if isinstance(t, SparseTensor) else t.clone()


def sub(a, b, *, alpha=1):
    """``a - alpha * b``.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.]]), "csr")
        >>> sub(A, A).to_dense().abs().sum().item()
        0.0
    """
    if not _is_scalar(alpha):
        raise TypeError(f"sub: alpha must be a real number, got {alpha!r}")
    if _is_scalar(b):
        return add(a, -b)
    if _is_scalar(a):
        return add(neg(b), a)
    return add(a, b, alpha=-alpha)


def div(a, b, *, rounding_mode=None):
    """``a / b`` for a sparse ``a`` and a scalar or dense ``b`` (true division).

    Example:
        >>> import torch, sparsetorch as st
        >>> div(st.tensor(torch.tensor([[2., 0.]]), "coo"), 2).to_dense()
        tensor([[1., 0.]])
    """
    _check_operand(a, "div")
    _check_operand(b, "div")
    if rounding_mode is not None:
        raise NotImplementedError(f"div(rounding_mode={rounding_mode!r}) is not supported "
                                  "for SparseTensor")
    if isinstance(b, SparseTensor) or _is_scalar(a):
        raise TypeError(
            f"div: dividing by a SparseTensor (format {_fmt(a, b)}) divides by its missing "
            "zeros; divide the values instead: B.with_values(x / B.values)")
    if _is_scalar(b) or isinstance(b, torch.Tensor) and b.dim() == 0:
        return _on_values(a, lambda v: v / b)   # (a 0-d b promotes as a number, as in torch)
    _broadcast_dense(a, b, "div")   # (the shape check)
    coords, _ = unpack(a.format, a.shape, a._level_arrays, a.values)
    return _on_values(a, lambda v: v / b.expand(a.shape)[tuple(coords)])


def pow(a, exponent):
    """``a ** exponent`` for a sparse ``a`` and a positive real exponent: the values raised,
    zeros left zero. Another exponent would fill the missing entries (``0 ** 0 = 1``,
    ``0 ** -1 = inf``) and raises TypeError.

    Example:
        >>> import torch, sparsetorch as st
        >>> pow(st.tensor(torch.tensor([[3., 0.]]), "csr"), 2).to_dense()
        tensor([[9., 0.]])
    """
    if not isinstance(a, SparseTensor) or not _is_scalar(exponent) or exponent <= 0:
        raise TypeError(f"pow: a SparseTensor raised to a positive real number keeps its zeros; "
                        f"got {type(a).__name__} ** {exponent!r} ({_fmt(a, exponent)}); "
                        "say A.to_dense() ** x, or A.with_values(A.values ** x) for the stored "
                        "entries only")
    return a.with_values(a.values ** exponent)


def neg(a):
    """``-a`` (same pattern).

    Example:
        >>> import torch, sparsetorch as st
        >>> neg(st.tensor(torch.tensor([1., 0.]), "coo")).to_dense()
        tensor([-1.,  0.])
    """
    return (-lazy(a)).eval()


def unary(name: str):
    """The eager map ``name`` (relu, abs, exp, sqrt) on a SparseTensor (or a node of a lazy
    expression).

    Example:
        >>> import torch, sparsetorch as st
        >>> unary("relu")(st.tensor(torch.tensor([-1., 2.]), "coo")).to_dense()
        tensor([0., 2.])
    """
    def fn(x, *, inplace=False):
        if inplace:
            raise NotImplementedError(f"{name}(inplace=True) is not supported on SparseTensor; "
                                      "use the out-of-place form")
        if isinstance(x, LazyExpr):
            return getattr(x, name)()
        return getattr(lazy(x), name)().eval()
    fn.__name__ = name
    return fn
