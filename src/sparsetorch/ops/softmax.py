"""Sparse softmax: softmax along one dimension over the *stored* entries only (missing
entries count as -inf, so they stay missing). The result has the input's pattern.

As einsum calls: the row sums are a reduction of ``exp(values - rowmax)`` and the scaling is
a product sampled on the pattern, so the gradient comes from ``sparsetorch.autograd``. The
per-row maximum only shifts the exponent for stability (softmax does not depend on it), so it
is computed on detached values.

The rows of a CSR tensor with no gradient to record (inference, attention masks) take one
compiled kernel instead (``compiler/attention.py``'s ``row_softmax_function``: per row the
maximum, the exponentials and their sum, the scaling). Against the einsum path
(``_by_einsum``), whose torch calls (a ``scatter_reduce`` for the grouped maximum, the
unpacked coordinates) dominate it, ``benchmarks/fusion.py``'s softmax section (graph
adjacencies and a local-window mask, 9k-530k entries; AMD Zen 5, 2 threads, one run):
6.5-15.3x, and ``torch.sparse.softmax`` on COO took 10.8-23.8x as long. Rows of four
entries or more take their exponentials in vector steps (``codegen/intrinsics.py``'s
``st_exp_*``; with scalar ``expf`` calls the kernel was 3.2-5.4x the einsum path).
"""
from __future__ import annotations

import torch

from .. import runtime
from ..autograd.pattern import values_on_pattern
from ..formats.pack import unpack
from ..formats.tensor import SparseTensor, inherit_pattern_facts, layout
from .attention import row_kernel
from .einsum import einsum
from .execute import backend

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


# Up to this many slices, the maxima go to a table indexed by slice (static sizes, so it
# traces under torch.compile); more (hypersparse 3-D) go through torch.unique.
_DIRECT_SLICES = 1 << 24


def _group_max(t: SparseTensor, dim: int) -> torch.Tensor:
    """Max of the stored values in each slice along ``dim``, one per stored entry."""
    coords, vals = unpack(t.format, t.shape, t.arrays, t.values.detach())
    key = torch.zeros(t.nnz, dtype=torch.int64)
    slices = 1
    for d, size in enumerate(t.shape):
        if d != dim:
            key = key * int(size) + coords[d]
            slices *= int(size)
    if slices <= _DIRECT_SLICES:
        top = torch.full((slices,), -torch.inf, dtype=vals.dtype)
        return top.scatter_reduce(0, key, vals, "amax")[key]
    groups, inverse = torch.unique(key, return_inverse=True)
    top = torch.full((groups.numel(),), -torch.inf, dtype=vals.dtype)
    top = top.scatter_reduce(0, inverse, vals, "amax")
    return top[inverse]


def softmax(input: SparseTensor, dim: int, dtype=None) -> SparseTensor:
    """Softmax along ``dim`` over stored entries only; same pattern as ``input``.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0., 1.], [0., 5., 0.]]), "csr")
        >>> softmax(A, 1).to_dense()
        tensor([[0.5000, 0.0000, 0.5000],
                [0.0000, 1.0000, 0.0000]])
    """
    if not isinstance(input, SparseTensor):
        raise TypeError(f"sparse softmax: input must be a SparseTensor, got "
                        f"{type(input).__name__}; for a dense tensor use torch.softmax")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"sparse softmax: dim must be an int, got {dim!r}")
    n = input.dim()
    if not -n <= dim < n:
        raise IndexError(f"sparse softmax: dim {dim} is out of range for a {n}-D SparseTensor")
    dim %= n
    if _is_dynamo_compiling():
        # Record one torch.sparse.softmax node (dynamo would trace the Python below, whose
        # data-dependent steps break the graph); SparseTensor's __torch_function__ runs this
        # function on it while the graph is traced, below dynamo.
        return torch.sparse.softmax(input, dim, dtype=dtype)
    t = input if dtype is None else input.with_values(input.values.to(dtype))
    if not t.dtype.is_floating_point:
        raise TypeError(f"sparse softmax: values of dtype {t.dtype} are not floating point; "
                        "pass dtype=torch.float32")
    if t.nnz == 0:
        return t.with_values(t.values * 0)
    return _row_softmax(t) if _by_rows(t, dim) else _by_einsum(t, dim)


def _by_einsum(t: SparseTensor, dim: int) -> SparseTensor:
    """The softmax of floating ``t`` (nonempty) over ``dim`` as einsum calls and torch ops,
    differentiable (module docstring)."""
    n = t.dim()
    e = t.with_values(torch.exp(t.values - _group_max(t, dim)))
    letters = _LETTERS[:n]
    rest = letters[:dim] + letters[dim + 1:]
    sums = einsum(f"{letters}->{rest}", e, out_format="dense" if rest else None)
    inv = 1 / torch.where(sums > 0, sums, torch.ones_like(sums))   # empty slices: unused
    out = einsum(f"{letters},{rest}->{letters}", e, inv)
    return t.with_values(values_on_pattern(t, out))   # a no-op when sampled in place


# Entries from which the row kernel runs on all threads (each costs an exp and ~4 loads).
_PARALLEL_ENTRIES = 1 << 14
_ROW_DTYPES = (torch.float32, torch.float64)
_is_grad_enabled = torch.is_grad_enabled


def _by_rows(t: SparseTensor, dim: int) -> bool:
    """Whether ``t``'s softmax over ``dim`` runs as the compiled row kernel: the rows of a
    CSR tensor of float32 or float64 values in memory, on the C backend, with no gradient to
    record (the einsum path records one)."""
    values = t._values
    return (dim == 1 and len(t._size) == 2 and type(values) is torch.Tensor and values.is_cpu
            and values.dtype in _ROW_DTYPES and t._format.name == "csr"
            and not (_is_grad_enabled() and (values.requires_grad or
                                              (t._wrapper_grad and t.requires_grad)))
            and backend() == "c")


def _row_softmax(t: SparseTensor) -> SparseTensor:
    """``t`` (``_by_rows``) with its rows' softmax as values, its arrays shared."""
    values = t._values
    out = torch.empty_like(values)
    nt = runtime.num_threads() if values.numel() >= _PARALLEL_ENTRIES else 1
    row_kernel("row_softmax", t)(nt, t._size[0], t._pos1.data_ptr(), values.data_ptr(),
                                 out.data_ptr())
    result = SparseTensor._from_parts(t._size, layout(t._format),
                                      [getattr(t, "_" + n) for n in t._array_names], out)
    inherit_pattern_facts(t, result)
    return result
