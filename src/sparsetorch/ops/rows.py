"""``sparse_linear``: ``activation(x @ W^T + bias)`` (``F.linear``'s rows) for a CSR weight
``W`` and a batch ``x`` of dense rows or of CSR rows, the product of a ``SparseLinear`` layer
on a batch (an autoencoder's 256 MNIST digits).

The kernels (``rows_kernels.py``) transpose the batch in cache, ``ROWS`` (32) rows at a
time, and sum each output's stored weights over the block's 32 lanes; the backward goes by
the same blocks (``_Recorded``, ``gradients``). The MNIST autoencoder's training step: 3.4 ->
2.7-3.2 ms (the transposing copies of the compiler's path gone), then on a Zen 4 1.50 ->
1.21 ms (one pass for the activation's gradient and its transpose, no re-laid wrapper or
transposed copy of ``g`` for ``dx``, a CSR batch transposed through a tile).

Used for float32 CPU operands on AVX2 (or AVX-512) CPUs with the C backend, while
``torch.compile`` is not tracing, for at least ``MIN_ROWS`` rows (a block's unused rows
are computed too; where autograd records, for any number: einsum's recorded path cost
more, a training step of a 784 -> 256 layer at batch 1-15 1.5-1.9x as long) and no
gradient wanted for CSR rows; everything else runs ``st.einsum``, which this matches up
to rounding. CSR rows under ``SPARSE_ROWS_BELOW`` (3%) full go by their entries instead
(``sparse_rows.py``: bag-of-words batches, float32 or float64, any number of rows).

Example:
    >>> import torch, sparsetorch as st
    >>> W = st.tensor(torch.randn(8, 20) * (torch.rand(8, 20) < 0.3), format="csr")
    >>> x, b = torch.randn(40, 20), torch.randn(8)
    >>> y = sparse_linear(x, W, b, "relu")
    >>> torch.allclose(y, torch.relu(x @ W.to_dense().T + b), atol=1e-5)
    True
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from .. import runtime
from .._modes import materialized, refuse_ad_transforms
from ..compiler.kernel import vector_isa
from ..formats import SparseTensor
from .depthwise import _Scratch, _scratch as _buffers   # (each Python thread's buffers)
from .einsum import einsum
from .epilogue import ACTIVATIONS as _EINSUM_ACTIVATIONS, unfused
from .policy import backend
from .relaid import gather, relaid, relaid_pattern, transposed_format
from .rows_kernels import ACTIVATION_CODES as _ACTIVATIONS, ROWS, source
from .sparse_rows import (SPARSE_ROWS_BELOW, batch_arrays, recomputed_grads,
                          sparse_rows_linear)

MIN_ROWS = 16   # (below it, most of a block's rows would be padding)
_INDEX = {torch.int32: "int32_t", torch.int64: "int64_t"}
_PARALLEL_WORK = 1 << 16   # stored entries of W x rows below which one thread is as fast
_PARALLEL_ELEMENTS = 1 << 15   # elementwise: below, one thread is as fast
_is_compiling = torch.compiler.is_compiling


def sparse_linear(x, weight: SparseTensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, fallback: bool = True):
    """``activation(x @ weight^T + bias)``: ``x`` (n, k) a dense tensor or a CSR
    SparseTensor of rows, ``weight`` (m, k) a SparseTensor, ``bias`` None or (m,),
    ``activation`` None or one of ``st.einsum``'s ("relu", "relu6", "sigmoid", ...); the
    dense (n, m) result. This module's kernels where they apply (see the module
    docstring), differentiable in ``weight.values``, a dense ``x`` and ``bias``; else
    ``st.einsum`` (``fallback=False``: None instead, for a caller with its own).

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> sparse_linear(torch.full((2, 3), -1.0), W, torch.ones(3), "relu").tolist()
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    refuse_ad_transforms("sparse_linear", (x, weight, bias))
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise TypeError(f"sparse_linear: {name} must be a 2-D tensor or SparseTensor, got "
                            f"{type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
    if type(weight) is not SparseTensor:
        raise TypeError(f"sparse_linear: weight must be a SparseTensor, got a dense "
                        f"{type(weight).__name__}; wrap it with st.tensor(weight, "
                        "format='csr'), or call F.linear for a dense weight")
    if x.shape[1] != weight.shape[1]:   # (einsum would broadcast a size of 1)
        raise ValueError(f"sparse_linear: x has {x.shape[1]} columns but weight "
                         f"{tuple(weight.shape)} takes {weight.shape[1]}; they must be equal")
    if activation is not None and activation not in _EINSUM_ACTIVATIONS:
        raise ValueError(f"sparse_linear: activation must be None or one of "
                         f"{_EINSUM_ACTIVATIONS}, got {activation!r}")
    # (the kernels take the values apart from a wrapper holding a plain tensor without
    # grad: a Parameter, even a frozen one, is a subclass, whose re-laid pattern is not kept)
    values = weight._values
    kept = weight if type(values) is torch.Tensor and not values.requires_grad else \
        weight.with_values(values.detach())
    out = _very_sparse_rows(x, kept, values, bias, activation)
    if out is not None:
        return out
    fn = _kernel_for(x, kept, bias, activation, values)
    if fn is None:
        if not fallback:
            return None
        if isinstance(x, SparseTensor):   # (a sparse x sparse product: dense, then the rest)
            return unfused(einsum("ni,oi->no", x, weight, out_format="dense"), bias,
                           activation)
        return einsum("ni,oi->no", x, weight, bias=bias, activation=activation)
    return _run(fn, x, kept, values, bias, activation)


def linear_rows(x, weight: SparseTensor, values: torch.Tensor, bias, activation):
    """``sparse_linear`` by this module's kernels for ``weight``'s pattern with ``values``
    (a Parameter, say) in place of its own, which alias them without a gradient (a layer's
    kept wrapper): no wrapper is made per call; None where the kernels do not apply.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> values = W.values.clone().requires_grad_()
        >>> kept = W.with_values(values.detach())
        >>> y = linear_rows(torch.ones(16, 3), kept, values, None, None)
        >>> y is None or torch.equal(y, torch.ones(16, 3))   # (None: no AVX2 or no compiler)
        True
    """
    refuse_ad_transforms("SparseLinear", (x, values, bias))
    out = _very_sparse_rows(x, weight, values, bias, activation)
    if out is not None:
        return out
    fn = _kernel_for(x, weight, bias, activation, values)
    return None if fn is None else _run(fn, x, weight, values, bias, activation)


def _very_sparse_rows(x, weight, values, bias, activation):
    """``sparse_rows.py``'s product for a batch of CSR rows holding less than
    ``SPARSE_ROWS_BELOW`` of their entries (the activation then applied by torch), or
    None."""
    if type(x) is not SparseTensor or len(x._size) != 2 or \
            x._crd1.numel() >= SPARSE_ROWS_BELOW * x._size[0] * x._size[1]:
        return None
    out = sparse_rows_linear(x, weight, values, bias)
    return None if out is None else unfused(out, None, activation)


def _run(fn, x, weight, values, bias, activation):
    """The kernel's forward, recorded for autograd where a gradient is wanted; ``weight``
    holds ``values`` without a gradient."""
    sparse = type(x) is SparseTensor
    if _records(x, values, bias):
        return _Recorded.apply(fn, None if sparse else x, values, bias, weight,
                               x if sparse else None, activation)
    return _forward(fn, x, weight, bias, activation)


def _forward(fn, x, weight, bias, activation) -> torch.Tensor:
    (m, k), n = weight._size, x.shape[0]
    return _launch(fn, x, weight._pos1, weight._crd1, weight._values, n, k, m, bias,
                   activation)


def _launch(fn, x, pos, crd, values, n, k, m, bias, activation, *,
            ldt: int = 0) -> torch.Tensor:
    """The kernel on ``x``'s n rows by the (m, k) CSR arrays ``pos``, ``crd``, ``values``;
    ``ldt``: ``x`` holds them transposed, k rows ``ldt`` apart (the backward's ``gt``)."""
    out = torch.empty((n, m), dtype=torch.float32)
    nt = runtime.num_threads()
    scratch = _buffers.get(torch.float32, nt * ROWS * (k + m))
    nt = nt if crd.numel() * n >= _PARALLEL_WORK else 1
    sparse = type(x) is SparseTensor
    fn(n, k, m, pos.data_ptr(), crd.data_ptr(), values.data_ptr(),
       0 if sparse else x.data_ptr(), x._pos1.data_ptr() if sparse else 0,
       x._crd1.data_ptr() if sparse else 0, x._values.data_ptr() if sparse else 0,
       ldt, 0 if bias is None else bias.data_ptr(),
       _ACTIVATIONS[activation], out.data_ptr(), scratch.data_ptr(), nt)
    return out


class _Recorded(torch.autograd.Function):
    """The kernel's forward; backward by the same row blocks: the output gradient through
    the activation (from the saved output) and transposed, ``gt``; ``dx`` as ``g W`` (the
    row-block kernel on ``gt`` and ``W^T``'s CSR arrays: the pattern re-laid once and
    kept, ``relaid.py``); ``dvalues`` as dots of ``gt``'s and ``x``'s columns at the
    stored entries (``x`` transposed once); ``dbias`` as ``gt``'s row sums. A gradient of
    the gradient (``create_graph``) is taken through einsum's differentiable path,
    recomputed."""

    @staticmethod
    def forward(ctx, fn, x, values, bias, weight, x_sparse, activation):
        y = _forward(fn, x_sparse if x is None else x, weight, bias, activation)
        # (the output only for its activation's derivative: without one, a residual
        # ``y += skip`` before backward is fine, as after nn.Linear)
        ctx.save_for_backward(x, values, bias, None if activation is None else y,
                              *batch_arrays(x_sparse))
        ctx.weight, ctx.x_sparse, ctx.activation = weight, x_sparse, activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, values, bias, y, *_ = ctx.saved_tensors
        dy = materialized(dy)
        weight, x_sparse, activation = ctx.weight, ctx.x_sparse, ctx.activation
        if torch.is_grad_enabled():   # create_graph: a differentiable backward
            return (None, *recomputed_grads(x_sparse if x is None else x, weight, values,
                                            bias, activation, dy), None, None, None)
        return (None, *gradients(dy, x, x_sparse, weight, values, y, activation,
                                 ctx.needs_input_grad[1:4]), None, None, None)


def gradients(dy, x, x_sparse, weight: SparseTensor, values, y, activation, needs) -> tuple:
    """``(dx, dvalues, dbias)`` of ``activation(x W^T + bias)`` at the output gradient
    ``dy`` (``_Recorded``'s backward, and the traced op's, ``rows_op.py``): ``x`` dense or
    None with ``x_sparse`` its CSR rows, ``weight`` ``W``'s pattern over ``values``, ``y``
    the output (None without an activation); ``needs`` says which of the three to compute
    (None for the others)."""
    need_x, need_values, need_bias = needs
    (m, k), n = weight._size, dy.shape[0]
    fns, nt = _library(vector_isa()), runtime.num_threads()
    ld = _leading(n)
    gt = _scratch(_GT, m * ld)   # (the output gradient through the activation)
    dy = dy.contiguous()   # (held: a temporary's memory is freed before the call)
    # (no activation: the kernel reads no output, dy stands in for it; the sparse dots of
    # _grad_values skip a CSR batch's zeros, so they run only where nothing of gt is inf or
    # NaN, which those zeros would turn into NaN, as they do in the dense dots)
    nonfinite = ctypes.c_int64(0)
    fns["st_activation_grad_t"](n, m, dy.data_ptr(), (dy if y is None else y).data_ptr(),
                                _ACTIVATIONS[activation], gt.data_ptr(), ld,
                                ctypes.addressof(nonfinite),
                                nt if dy.numel() >= _PARALLEL_ELEMENTS else 1)
    dx = _grad_x(weight, gt, n, ld) if need_x else None
    dvalues = dbias = None
    if need_values:   # (dbias summed in the same pass)
        dbias = torch.empty(m, dtype=torch.float32) if need_bias else None
        nt = nt if values.numel() * n >= _PARALLEL_WORK else 1
        xt = _scratch(_XT, k * ld)
        if x is not None:
            x = x.contiguous()
            fns["st_rows_dense_transposed"](n, k, x.data_ptr(), xt.data_ptr(), ld, nt)
        else:
            tiles = _buffers.get(torch.float32, nt * 16 * k)
            fns["st_rows_transposed_" + _INDEX[x_sparse._crd1.dtype]](
                n, k, x_sparse._pos1.data_ptr(), x_sparse._crd1.data_ptr(),
                x_sparse._values.data_ptr(), xt.data_ptr(), ld, tiles.data_ptr(), nt)
        dvalues = torch.empty_like(values)
        _grad_values(fns, weight, gt, xt, n, ld, dvalues, dbias, nt,
                     x is None and not nonfinite.value)
    elif need_bias:
        dbias = gt[:m * ld].view(m, ld)[:, :n].sum(1)
    return dx, dvalues, dbias


def _grad_values(fns, weight: SparseTensor, gt, xt, n: int, ld: int, dvalues, dbias,
                 nt: int, sparse_x: bool) -> None:
    """``dvalues`` (and ``dbias``, unless None): the dots of ``gt``'s and ``xt``'s rows at
    ``weight``'s stored entries, walking whichever of ``W``'s and ``W^T``'s patterns reads
    the operand with fewer rows out of order (``W^T``'s is ``_grad_x``'s, kept); with
    ``sparse_x`` (``xt`` from a CSR batch), ``xt``'s rows held by ``W^T``'s walk are
    dotted at their nonzeros where they have few."""
    (m, k), index = weight._size, _INDEX[weight._crd1.dtype]
    # (not for a pattern of no entries: the empty permutation's pointer is null, which the
    # kernel reads as W's own pattern, with W^T's k rows: dbias written past its m)
    found = relaid_pattern(weight, transposed_format(weight._format)) \
        if k > m and weight._crd1.numel() else None
    if found is not None and found[1].dtype == weight._crd1.dtype:
        (arrays, perm), rows, a, b, skip = found, k, xt, gt, sparse_x
        pos, crd, perm = arrays["pos1"], arrays["crd1"], perm.data_ptr()
    else:
        rows, a, b, pos, crd, perm, skip = m, gt, xt, weight._pos1, weight._crd1, 0, False
    fns["st_linear_grad_values_" + index](
        rows, n, pos.data_ptr(), crd.data_ptr(), perm, a.data_ptr(), b.data_ptr(), ld,
        dvalues.data_ptr(), 0 if dbias is None else dbias.data_ptr(), m, int(skip), nt)


def _leading(n: int) -> int:
    """The row length the backward's transposed temporaries (rows of ``n`` batch values)
    are stored at: whole blocks of ``ROWS``, so the forward kernel copies a last partial
    block's columns as it copies the others (the lanes past ``n`` zeroed), plus 16 lanes,
    so that rows are an odd number of cache lines apart: the line-per-row copies into the
    transposed input then spread over the cache's sets (MNIST's 256 x 784 batch: 29 ->
    21 us; at 1 KB apart they all fell into 1/16 of them)."""
    return -(-n // ROWS) * ROWS + 16


def _grad_x(weight: SparseTensor, gt: torch.Tensor, n: int, ld: int) -> torch.Tensor:
    """``dx = g W`` (n x k) from the transposed output gradient ``gt`` (m rows ``ld``
    apart), by the forward kernel on ``W^T``'s CSR pattern (kept, ``relaid.py``) and
    ``W``'s values gathered into its order (read through the permutation instead, once
    per block of rows, the scattered reads cost more than the gather: 146 against 96 us
    for the MNIST decoder)."""
    (m, k), fmt = weight._size, transposed_format(weight._format)
    found = relaid_pattern(weight, fmt)
    if found is None:   # (arrays or values of a tensor subclass: converted whole)
        t = relaid(weight, fmt)
        pos, crd, values = t._pos1, t._crd1, t._values
    else:
        arrays, perm = found
        pos, crd, values = arrays["pos1"], arrays["crd1"], gather(weight._values, perm)
    return _launch(_kernel(crd.dtype, crd.dtype), gt, pos, crd, values, n, m, k, None, None,
                   ldt=ld)


# The backward's temporaries (the output gradient through the activation and transposed,
# the input transposed), each kept per Python thread up to _KEEP_ELEMENTS: a fresh 800 KB
# buffer per step came back from the allocator as new pages, ~190 page faults in the MNIST
# autoencoder's step (0.1-0.2 ms).
_GT, _XT = _Scratch(), _Scratch()
_KEEP_ELEMENTS = 1 << 22


def _scratch(kept, size: int) -> torch.Tensor:
    """A float32 buffer of at least ``size`` elements (flat: the kernels take pointers)."""
    if size > _KEEP_ELEMENTS:
        return torch.empty(size, dtype=torch.float32)
    return kept.get(torch.float32, size)


def _records(x, values, bias) -> bool:
    """Whether autograd records the product (a gradient wanted for ``values``, ``bias`` or a
    dense ``x``)."""
    return torch.is_grad_enabled() and (
        values.requires_grad or (bias is not None and bias.requires_grad)
        or type(x) is not SparseTensor and x.requires_grad)


def _kernel_for(x, weight, bias, activation, values):
    """The kernel for these operands (``values`` in place of ``weight``'s), or None where
    einsum runs (and checks and reports every bad operand)."""
    if (_is_compiling() or type(weight) is not SparseTensor or weight._format.name != "csr"
            or activation not in _ACTIVATIONS or backend() != "c"):
        return None
    m, k = weight._size
    if k == 0 or m == 0:   # (a dense x's null pointer would read as "x is CSR rows")
        return None
    if type(x) is SparseTensor:
        if (x._format.name != "csr" or len(x._size) != 2 or not _plain(x._values)
                or x._values.requires_grad or x._values.numel() != x._crd1.numel()):
            return None   # (values replaced by another count: einsum says so)
        rows, x_index = x._size, x._crd1.dtype
    elif type(x) is torch.Tensor and x.dim() == 2 and _plain(x):
        rows, x_index = x.shape, weight._crd1.dtype
    else:
        return None
    least = 1 if _records(x, values, bias) else MIN_ROWS
    if rows[0] < least or rows[1] != k or not _plain(weight._values):
        return None
    if bias is not None and (not isinstance(bias, torch.Tensor) or not _plain(bias)
                             or bias.shape != (m,)):
        return None
    return _kernel(weight._crd1.dtype, x_index)


def _plain(t) -> bool:
    """A contiguous float32 CPU tensor."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


@lru_cache(maxsize=None)
def _kernel(index_dtype: torch.dtype, x_index_dtype: torch.dtype):
    """The forward kernel for these index dtypes (W's, x's) on this CPU's vector ISA; None
    without AVX2 or a C compiler."""
    fns = _library(vector_isa())
    if fns is None or index_dtype not in _INDEX or x_index_dtype not in _INDEX:
        return None
    return fns[f"st_sparse_linear_{_INDEX[index_dtype]}_{_INDEX[x_index_dtype]}"]


@lru_cache(maxsize=None)
def _library(isa):
    """Every entry of ``_source(isa)`` by name; None for no ISA or no C compiler."""
    if isa is None:
        return None
    I, P = runtime.I64, runtime.PTR
    entries = {"st_activation_grad_t": [I, I, P, P, I, P, I, P, I],
               "st_rows_dense_transposed": [I, I, P, P, I, I]}
    for w in _INDEX.values():
        entries[f"st_linear_grad_values_{w}"] = [I, I, P, P, P, P, P, I, P, P, I, I, I]
        entries[f"st_rows_transposed_{w}"] = [I, I, P, P, P, P, I, P, I]
        for xw in _INDEX.values():
            entries[f"st_sparse_linear_{w}_{xw}"] = [I, I, I] + [P] * 7 + [I, P, I, P, P, I]
    try:
        return runtime.load_entries(source(isa), entries)
    except runtime.KernelBuildError:
        return None
