"""Sparse softmax: softmax along one dimension over the *stored* entries only (missing
entries count as -inf, so they stay missing). The result has the input's pattern.

As einsum calls: the row sums are a reduction of ``exp(values - rowmax)`` and the scaling is
a product sampled on the pattern, so the gradient comes from ``sparsetorch.autograd``. The
per-row maximum only shifts the exponent for stability (softmax does not depend on it), so it
is computed on detached values.

The rows of a CSR tensor take one compiled kernel instead (``compiler/attention.py``'s
``row_softmax_function``: per row the maximum, the exponentials and their sum, the
scaling), and a gradient recorded on its values another (``row_softmax_grad_function``: per
row ``y * (g - sum(g * y))``; torch ops where the gradient itself is differentiated). Only
a gradient recorded on the wrapper alone (an output of a ``torch.compile``d function) keeps
the einsum path. Against that path (``_by_einsum``), whose torch calls (a
``scatter_reduce`` for the grouped maximum, the unpacked coordinates) dominate it,
``benchmarks/fusion.py``'s softmax section (graph adjacencies and a local-window mask,
9k-530k entries; AMD Zen 5, 2 threads, one run): 5.2-23.8x, and ``torch.sparse.softmax``
on COO took 9.7-42.3x as long. The row maximum and, from four entries a row, the
exponentials run in vector steps (``codegen/vector.py``; ``st_exp_*``): with a scalar
maximum the kernel took 1.7-2x as long on PubMed and the local window, with scalar
``expf`` calls too it was 3.2-5.4x the einsum path. Forward and backward (the
softmax_grad section, same run): 5.1-13.6x the einsum path differentiated, and torch's COO
softmax with its backward 14-139x as long.
"""
from __future__ import annotations

import operator

import torch

from .. import runtime
from .._modes import materialized, refuse_ad_transforms
from ..autograd.pattern import values_on_pattern
from ..formats.pack import unpack, unpack_rows
from ..formats.tensor import SparseTensor, inherit_pattern_facts, layout
from .attention import row_kernel
from .einsum import einsum
from .policy import backend, uses_triton
from .triton_run import TRITON_DTYPES, row_softmax as triton_row_softmax

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


# Up to this many slices, the maxima go to a table indexed by slice (static sizes, so it
# traces under torch.compile); more (hypersparse 3-D) go through torch.unique.
_DIRECT_SLICES = 1 << 24


def _group_max(t: SparseTensor, dim: int) -> torch.Tensor:
    """Max of the stored values in each slice along ``dim``, one per stored entry."""
    coords, vals = unpack(t.format, t.shape, t._level_arrays, t.values.detach())
    key = torch.zeros(t.nnz, dtype=torch.int64, device=vals.device)
    slices = 1
    for d, size in enumerate(t.shape):
        if d != dim:
            key = key * int(size) + coords[d]
            slices *= int(size)
    if slices <= _DIRECT_SLICES:
        top = torch.full((slices,), -torch.inf, dtype=vals.dtype, device=vals.device)
        return top.scatter_reduce(0, key, vals, "amax")[key]
    groups, inverse = torch.unique(key, return_inverse=True)
    top = torch.full((groups.numel(),), -torch.inf, dtype=vals.dtype,
                     device=vals.device)
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
    refuse_ad_transforms("st.ops.softmax", (input,))
    if not isinstance(input, SparseTensor):
        raise TypeError(f"sparse softmax: input must be a SparseTensor, got "
                        f"{type(input).__name__}; for a dense tensor use torch.softmax")
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise TypeError(f"sparse softmax: dim must be an int, got {dim!r}")
    dim = operator.index(dim)   # (numpy integers too, as torch.sparse.softmax takes them)
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
        fix = "pass a floating dtype" if dtype is not None else "pass dtype=torch.float32"
        raise TypeError(f"sparse softmax: values of dtype {t.dtype} are not floating point; "
                        f"{fix}")
    count = t.values.shape[0]
    if type(count) is int and count == 0:   # (a traced count is symbolic: no guard on it)
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
    # empty slices: unused; NaN sums (a NaN or +inf in the slice) stay NaN, as in torch
    inv = 1 / torch.where(sums != 0, sums, torch.ones_like(sums))
    out = einsum(f"{letters},{rest}->{letters}", e, inv)
    return t.with_values(values_on_pattern(t, out))   # a no-op when sampled in place


# Entries from which the row kernel runs on all threads (each costs an exp and ~4 loads).
_PARALLEL_ENTRIES = 1 << 14
_ROW_DTYPES = (torch.float32, torch.float64)
_is_grad_enabled = torch.is_grad_enabled


def _by_rows(t: SparseTensor, dim: int) -> bool:
    """Whether ``t``'s softmax over ``dim`` runs as the compiled row kernels: the rows of a
    CSR tensor of float32 or float64 values in memory on the C backend (or of any float
    dtype on the Triton backend: ``triton_run.row_softmax``), with any gradient
    to record on the values (not only on the wrapper, as for an output of a
    ``torch.compile``d function: the einsum path records that one)."""
    values = t._values
    return (dim == 1 and len(t._size) == 2 and type(values) is torch.Tensor
            and t._format.name == "csr"
            and not (_is_grad_enabled() and not values.requires_grad and t._wrapper_grad
                     and t.requires_grad)
            and ((values.dtype in TRITON_DTYPES and uses_triton(values.device)) or
                 (values.is_cpu and values.dtype in _ROW_DTYPES and backend() == "c")))


def _row_softmax(t: SparseTensor) -> SparseTensor:
    """``t`` (``_by_rows``) with its rows' softmax as values, its arrays shared."""
    values = t._values
    if _is_grad_enabled() and values.requires_grad:
        # (the pattern alone goes in: a SparseTensor argument that requires grad would be an
        # input to differentiate)
        return t.with_values(_RowSoftmax.apply(values, _on_rows_of(t, values.detach()[:0])))
    return _on_rows_of(t, _run_rows("row_softmax", t, values))


def _on_rows_of(t: SparseTensor, values: torch.Tensor) -> SparseTensor:
    """A SparseTensor of ``t``'s pattern (its arrays shared) holding ``values``."""
    result = SparseTensor._from_parts(t._size, layout(t._format),
                                      [getattr(t, "_" + n) for n in t._array_names], values)
    inherit_pattern_facts(t, result)
    return result


def _run_rows(kind: str, t: SparseTensor, *inputs: torch.Tensor) -> torch.Tensor:
    """The values that row kernel ``kind`` computes from value arrays ``inputs`` on the rows
    of ``t``."""
    if t._values.numel():   # (an empty one: a pattern-only wrapper, ``_on_rows_of``)
        t._checked_values()
    count = t._stored_count()                   # (every input has one value per entry)
    if any(x.numel() != count for x in inputs):
        raise ValueError(f"{kind}: value arrays of {[x.numel() for x in inputs]} entries "
                         f"for a pattern of {count}")
    if uses_triton(t.device):
        return triton_row_softmax(kind, t, *inputs)
    inputs = [x.contiguous() for x in inputs]   # (held: the kernel reads their memory)
    out = torch.empty_like(inputs[0])
    nt = runtime.num_threads() if out.numel() >= _PARALLEL_ENTRIES else 1
    row_kernel(kind, t)(nt, t._size[0], t._pos1.data_ptr(),
                        *(x.data_ptr() for x in inputs), out.data_ptr())
    return out


class _RowSoftmax(torch.autograd.Function):
    """The row kernel's softmax of ``values`` on the rows of CSR ``rows`` (its pattern; its
    own values are not read), differentiable: the gradient is ``y * (g - rowsum(g * y))``
    for output ``y`` and its gradient ``g``, by the compiled ``row_softmax_grad`` kernel, or
    by torch ops when that gradient must itself be differentiable (``create_graph``)."""

    @staticmethod
    def forward(ctx, values, rows):
        y = _run_rows("row_softmax", rows, values.detach())
        ctx.rows = rows
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,), rows, g = ctx.saved_tensors, ctx.rows, materialized(g)
        if not _is_grad_enabled():
            return _run_rows("row_softmax_grad", rows, y, g.to(y.dtype)), None
        row_of = unpack_rows(rows.format, rows.shape, rows._level_arrays)[0]
        s = torch.zeros(rows.shape[0], dtype=y.dtype, device=y.device).index_add(
            0, row_of, g * y)
        return y * (g - s[row_of]), None
