"""The GPU backend: assignments and the fused attention run as generated Triton kernels.

``execute.run`` sends a call here when its tensors are on a CUDA device (or on the CPU under
``SPARSETORCH_BACKEND=triton`` with ``TRITON_INTERPRET=1``, which runs the same kernels in
Triton's interpreter: how the tests check them without a GPU). The compiler schedules the
call and lowers its plain loop nest (``compiler.kernel.lower_plain``, the same IR the C
backend tiles and prints); ``codegen/triton.py`` renders that nest block by block; this
module marshals one launch (arrays by their IR parameter names, block sizes, the grid).

Expressions the renderer does not map (a merge of two sparse operands, sparse results
other than a sampled one, integer values) run through ``fallback.run_dense``: dense torch
ops on the tensors' own device, never a copy to the CPU. ``stats`` counts the calls of
each path, so a caller can see which one ran.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from functools import lru_cache

import torch

from .._modes import version
from ..codegen.triton import Unsupported, load, render
from ..compiler.attention import (
    attention_function,
    row_softmax_function,
    row_softmax_grad_function,
)
from ..compiler.kernel import lower_plain
from ..compiler.notation import Access, Epilogue, Mul, Scale, var_extents
from ..compiler.schedule import OperandInfo
from ..formats.format import Format, as_format
from ..formats.tensor import SparseTensor
from .blocked import split_blocked
from .relaid import relaid

# Value dtypes the kernels take (accumulating in float32, float64 in float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Calls per path: 'dense', 'blocked', 'sampled', 'attention', 'row_softmax',
# 'row_softmax_grad', or 'fallback'.
stats: Counter = Counter()

_BLOCK_NZ = 16        # stored entries per step beside a dense tile (SpMM, SDDMM, attention)
_SPMV_BLOCK_NZ = 64   # entries per step with nothing beside them (SpMV, row softmax)
_SPMV_ROWS = 4        # rows per program then (one row is too little work for one)
_MAX_BLOCK_K = 64     # dense columns per step or program: a 16 x 64 tile of X per step


def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as err:
        raise ImportError("sparsetorch's GPU backend needs Triton: pip install "
                          "'sparsetorch[gpu]' (or pip install triton)") from err
    return triton, tl


def check_device(device: torch.device) -> None:
    """Triton runs CUDA tensors; CPU tensors only in Triton's interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("SPARSETORCH_BACKEND=triton on CPU tensors runs Triton's "
                           "interpreter: set TRITON_INTERPRET=1 before triton is imported, "
                           "or move the tensors to a CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton backend runs CUDA tensors, not {device.type} ones")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _acc(tl, dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def row_order(pos: torch.Tensor) -> torch.Tensor:
    """Rows by length, longest first (Sputnik's row swizzle), as int32: computed once per
    position array and kept on it (every wrapper of the same pattern shares it; an in-place
    change of the array recomputes it).

    Example:
        >>> row_order(torch.tensor([0, 1, 4, 4, 6])).tolist()
        [1, 3, 0, 2]
    """
    kept = getattr(pos, "_sparsetorch_row_order", None)
    if kept is not None and kept[0] == version(pos):
        return kept[1]
    order = torch.argsort(pos[1:] - pos[:-1], descending=True, stable=True).to(torch.int32)
    pos._sparsetorch_row_order = (version(pos), order)
    return order


def infos_of(tensors) -> tuple:
    """The ``OperandInfo`` of each operand, as the compiler schedules them.

    Example:
        >>> import torch, sparsetorch as st
        >>> [i.strided for i in infos_of([st.tensor(torch.eye(2), "csr"), torch.ones(2)])]
        [False, True]
    """
    return tuple(OperandInfo(t.format, False) if isinstance(t, SparseTensor)
                 else OperandInfo(as_format("dense", t.dim()), True) for t in tensors)


@lru_cache(maxsize=512)
def _compiled(assignment, infos, out_format, static=()):
    """(schedule, output spec, ``TritonKernel``) of a call, or None where the renderer does
    not map its nest. Memoised on the structure alone (Triton caches the binaries)."""
    sched, spec, fn = lower_plain(assignment, infos, out_format)
    if fn is None or spec.kind not in ("dense", "sampled"):
        return None
    try:
        return sched, spec, render(fn, static)
    except Unsupported:
        return None


def run_triton(assignment, tensors, infos, out_format):
    """The result of ``assignment`` on ``tensors`` (blocked ones kept) by a Triton kernel,
    or None when none applies (the caller falls back)."""
    dtype = tensors[0].dtype
    if dtype not in TRITON_DTYPES:
        return None
    check_device(tensors[0].device)
    if any(info.format.blocksize is not None for info in infos):
        return _run_blocked(assignment, tensors, out_format)
    merged = _one_pattern(assignment, tensors)
    if merged is not None:
        assignment, tensors = merged
        infos = infos_of(tensors)
    found = _compiled(assignment, infos, out_format)
    for order in ("rows", "columns"):   # (a nest that would scatter: another walk)
        if found is not None:
            break
        tensors = _relaid_in(tensors, order)
        infos = infos_of(tensors)
        found = _compiled(assignment, infos, out_format)
    if found is None:
        return None
    sched, spec, kernel = found
    tensors = list(tensors)
    for n, fmt in sched.conversions:   # the pattern re-laid once and kept (relaid.py), so
        tensors[n] = relaid(tensors[n], fmt)   # operands of one pattern still share arrays
    ext = var_extents(assignment, [tuple(t.shape) for t in tensors])
    out_shape = tuple(ext[v] for v in assignment.out_vars)
    device = tensors[0].device
    if spec.kind == "sampled":
        source = tensors[spec.sampled_operand]
        vals = torch.zeros(source.nnz, dtype=dtype, device=device)
        _launch(kernel, _arrays(tensors, vals), ext, dtype, "sampled")
        return SparseTensor(out_shape, spec.format, source._level_arrays, vals)
    make = torch.zeros if "out_vals" in kernel.zeroed else torch.empty
    out = make(out_shape, dtype=dtype, device=device)
    _launch(kernel, _arrays(tensors, out), ext, dtype, "dense")
    return out


def _relaid_in(tensors, order: str) -> list:
    """``tensors`` with each sparse matrix stored ``order`` first ("rows": CSR, "columns":
    CSC), re-laid where it is not (``relaid.py``: once per pattern, kept). The schedule
    may walk a sparse operand against the result's order and scatter into it (cheap on a
    CPU: an SpMV over CSC, the backward ``A^T g`` of one over CSR); the Triton kernels
    take no scatter, and the other walk needs none."""
    out = []
    for t in tensors:
        if isinstance(t, SparseTensor) and t.dim() == 2:
            want = (0, 1) if order == "rows" else (1, 0)
            if t.format.mode_order != want:
                t = relaid(t, Format(t.format.levels, want))
        out.append(t)
    return out


def _run_blocked(assignment, tensors, out_format):
    """A dense result of a blocked operand: its blocks split into block and in-block
    indices (``blocked.split_blocked``), the in-block extents constants of the kernel."""
    if out_format not in (None, "dense"):
        return None
    split = split_blocked(assignment, tensors)
    if split is None:
        return None
    new, new_tensors, finish, static = split
    found = _compiled(new, infos_of(new_tensors), None, static)
    if found is None or found[1].kind != "dense":
        return None
    kernel = found[2]
    ext = var_extents(new, [tuple(t.shape) for t in new_tensors])
    out = torch.zeros(tuple(ext[v] for v in new.out_vars), dtype=tensors[0].dtype,
                      device=tensors[0].device)
    _launch(kernel, _arrays(new_tensors, out), ext, out.dtype, "blocked")
    full = var_extents(assignment, [tuple(t.shape) for t in tensors])
    return finish(out, tuple(full[v] for v in assignment.out_vars), (None, None))


def traced_kind(assignment, infos, out_format, dtype) -> str | None:
    """What ``run_triton`` computes for operands of these formats, known without their data:
    ``"dense"`` or ``"sampled"`` (values on the sparse operand's own pattern); None where it
    would convert an operand first or no kernel applies. A traced call (``triton_ops``)
    records a launch only where this is not None (a blocked call whose kernel turns out not
    to exist runs the fallback inside the recorded node)."""
    if dtype not in TRITON_DTYPES:
        return None
    if any(i.format.blocksize is not None for i in infos):
        one = sum(not i.strided for i in infos) == 1
        return "dense" if one and out_format in (None, "dense") else None
    found = _compiled(assignment, infos, out_format)
    if found is None or found[0].conversions:
        return None
    return found[1].kind


def _one_pattern(assignment, tensors):
    """``(assignment, tensors)`` with a product of sparse operands that store one pattern in
    the same arrays (autograd's ``G * A``) folded into the first one's values, or None."""
    expr = assignment.expr
    body = expr.body if isinstance(expr, Epilogue) else expr
    sparse = [a for a in body.accesses() if isinstance(tensors[a.operand], SparseTensor)]
    if len(sparse) < 2:
        return None
    first = sparse[0]
    A = tensors[first.operand]
    if any(a.indices != first.indices or not _same_arrays(A, tensors[a.operand])
           for a in sparse[1:]):
        return None
    drop = {a.operand for a in sparse[1:]}

    # Only factors of a product fold: the kept operand's values become the product of all,
    # so neither it nor a dropped one may sit under anything else (relu(A) * B is not
    # relu(A * B); (A + D) * B is not A * B + D)
    def without(e):
        if isinstance(e, Mul):
            a, b = without(e.a), without(e.b)
            return b if a is None else a if b is None else Mul(a, b)
        if isinstance(e, Access):
            return None if e.operand in drop else e
        if isinstance(e, Scale):   # (linear: c A B is c (A B))
            inner = without(e.a)
            if inner is None:
                raise _NotProduct
            return Scale(e.factor, inner)
        if any(x.operand in drop or x.operand == first.operand for x in e.accesses()):
            raise _NotProduct
        return e

    try:
        new_body = without(body)
    except _NotProduct:
        return None
    values = A._checked_values()
    for n in sorted(drop):
        values = values * tensors[n]._checked_values()
    tensors = list(tensors)
    tensors[first.operand] = A.with_values(values)
    new = replace(expr, body=new_body) if isinstance(expr, Epilogue) else new_body
    return replace(assignment, expr=new), tensors


class _NotProduct(Exception):
    pass


def _same_arrays(a, b) -> bool:
    """Two SparseTensors of one format whose level arrays are the same tensors."""
    return isinstance(a, SparseTensor) and isinstance(b, SparseTensor) and \
        a.format == b.format and a.shape == b.shape and \
        all(a._level_arrays[k] is b._level_arrays[k] for k in a._level_arrays)


def _arrays(tensors, out) -> dict:
    """The IR's array parameters (``t<n>_<level array or vals>``, ``out_vals``) -> tensors."""
    named = {"out_vals": out.values if isinstance(out, SparseTensor) else out}
    for n, t in enumerate(tensors):
        if isinstance(t, SparseTensor):
            named.update({f"t{n}_{k}": v for k, v in t._level_arrays.items()})
            named[f"t{n}_vals"] = t._checked_values()   # (kernels trust their length)
        else:
            named[f"t{n}_vals"] = t.contiguous()
    return named


def _launch(kernel, arrays: dict, ext: dict, dtype, kind: str) -> None:
    """One launch of ``kernel``: ``arrays`` by IR name, ``ext`` the extent of each index
    variable (size parameters are ``n_<variable>``)."""
    triton, tl = _triton()
    stats[kind] += 1
    sizes = {f"n_{v}": int(e) for v, e in ext.items()}
    n_rows = sizes[kernel.rows]
    out = arrays["out_vals"]
    if n_rows == 0 or out.numel() == 0:
        return
    args = [arrays[name] if name in arrays else sizes[name] for name in kernel.args]
    weights = arrays[kernel.weights] if kernel.weights else None
    perm = row_order(weights) if weights is not None else \
        torch.arange(n_rows, dtype=torch.int32, device=out.device)
    consts, grid1 = {}, 1
    if kernel.tile is not None:
        var, extent = kernel.tile
        consts[f"B_{var}"] = min(_pow2(sizes[extent]), _MAX_BLOCK_K)
        grid1 = triton.cdiv(sizes[extent], consts[f"B_{var}"])
        if grid1 == 0:
            return
    alone = kernel.tile is None and len(kernel.blocks) == 1
    for var, what, bound in kernel.blocks:
        consts[f"B_{var}"] = (_SPMV_BLOCK_NZ if alone else _BLOCK_NZ) if what == "entries" \
            else max(1, min(_pow2(sizes[bound]), _MAX_BLOCK_K))
    if kernel.dot:
        width = consts.get(f"B_{kernel.tile[0]}", 0) if kernel.tile else 0
        consts["USE_DOT"] = width >= 16 and dtype != torch.float64
        tf32 = out.device.type == "cuda" and (dtype != torch.float32 or
                                              torch.backends.cuda.matmul.allow_tf32)
        consts["DOT_PREC"] = "tf32" if tf32 else "ieee"
    rows = _SPMV_ROWS if alone else 1
    load(kernel.source)[(triton.cdiv(n_rows, rows), grid1)](
        *args, perm, ROWS=rows, **consts, ACC=_acc(tl, dtype))


@lru_cache(maxsize=None)
def _fixed(name: str):
    """The rendered attention and row-softmax kernels (one text each: the dtype and block
    sizes are launch constants)."""
    build = {"attention": lambda: attention_function(None),
             "row_softmax": row_softmax_function,
             "row_softmax_grad": row_softmax_grad_function}[name]
    return render(build())


def attention(A: SparseTensor, Q, K, V) -> torch.Tensor:
    """The fused masked attention (``st.ops.masked_attention``'s kernel) on CSR ``A``; the
    scores of a row's entries pass through a scratch array of ``nnz`` values (float32 for
    half-precision inputs)."""
    check_device(A.device)
    (n, m), d, e = A.shape, Q.shape[1], V.shape[1]
    out = torch.empty((n, e), dtype=A.dtype, device=A.device)
    scratch = torch.empty(A.nnz, device=A.device,
                          dtype=torch.float64 if A.dtype == torch.float64 else torch.float32)
    arrays = {"t0_pos1": A._level_arrays["pos1"], "t0_crd1": A._level_arrays["crd1"],
              "t0_vals": A._checked_values(), "t1_vals": Q.contiguous(), "t2_vals": K.contiguous(),
              "t3_vals": V.contiguous(), "t4_vals": scratch, "out_vals": out}
    _launch(_fixed("attention"), arrays, {"i": n, "j": m, "k": d, "d": e}, A.dtype,
            "attention")
    return out


def row_softmax(kind: str, t: SparseTensor, *inputs: torch.Tensor) -> torch.Tensor:
    """The values row kernel ``kind`` (``"row_softmax"`` of ``inputs[0]``, or
    ``"row_softmax_grad"`` from the output ``y`` and its gradient ``g``) on the rows of
    CSR ``t``."""
    check_device(t.device)
    inputs = [x.contiguous() for x in inputs]
    out = torch.empty_like(inputs[0])
    arrays = {"t0_pos1": t._level_arrays["pos1"], "out_vals": out,
              **{f"t{n}_vals": x for n, x in enumerate(inputs)}}
    _launch(_fixed(kind), arrays, {"i": t.shape[0]}, out.dtype, kind)
    return out
