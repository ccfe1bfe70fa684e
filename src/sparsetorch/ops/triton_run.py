"""The GPU backend: assignments and the fused attention run as generated Triton kernels.

``execute.run`` sends a call here when its tensors are on a CUDA device (or on the CPU under
``SPARSETORCH_BACKEND=triton`` with ``TRITON_INTERPRET=1``, which runs the same kernels in
Triton's interpreter: how the tests check them without a GPU). The compiler's schedule picks
conversions and the output kind; ``compiler/triton_plan.py`` names the kernel class;
``codegen/triton.py`` renders and loads it; this module marshals one launch (pointers,
strides, block sizes, the grid).

Expressions no Triton kernel covers (two sparse operands, elementwise trees, sparse results
other than a sampled one, integer values) run through ``fallback.run_dense``: dense torch
ops on the tensors' own device, never a copy to the CPU. ``stats`` counts both, per kernel
class, so a caller can see which path ran.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from ..compiler.notation import var_extents
from ..compiler.output import infer_output
from ..compiler.schedule import schedule
from ..compiler.triton_plan import plan as triton_plan
from ..formats.tensor import SparseTensor
from .relaid import relaid

# Value dtypes the kernels take (accumulating in float32, float64 in float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Calls per path: 'rows', 'bsr', 'sampled', 'attention', 'row_softmax',
# 'row_softmax_grad', or 'fallback'.
stats: Counter = Counter()

_BLOCK_NZ = 16        # stored entries per step (SpMM, SDDMM, attention)
_SPMV_BLOCK_NZ = 64   # SpMV: no dense tile, so a longer strip of the row per step
_SPMV_ROWS = 4        # SpMV: rows per program (one row is too little work for one)
_MAX_BLOCK_K = 64     # dense columns per program: a 16 x 64 tile of X per step


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
    if kept is not None and kept[0] == pos._version:
        return kept[1]
    order = torch.argsort(pos[1:] - pos[:-1], descending=True, stable=True).to(torch.int32)
    pos._sparsetorch_row_order = (pos._version, order)
    return order


def run_triton(assignment, tensors, infos, out_format):
    """The result of ``assignment`` on ``tensors`` (blocked ones kept) by a Triton kernel,
    or None when none applies (the caller falls back)."""
    dtype = tensors[0].dtype
    if dtype not in TRITON_DTYPES:
        return None
    check_device(tensors[0].device)
    blocked = any(info.format.blocksize is not None for info in infos)
    if blocked:
        if out_format not in (None, "dense"):
            return None
        p = triton_plan(assignment, tuple(i.format for i in infos), "dense")
        return None if p is None else _launch_bsr(p, tensors, assignment)
    sched = schedule(assignment, infos)
    spec = infer_output(assignment, sched.order, sched.formats, out_format)
    tensors = list(tensors)
    for n, fmt in sched.conversions:   # the pattern re-laid once and kept (relaid.py), so
        tensors[n] = relaid(tensors[n], fmt)   # operands of one pattern still share arrays
    p = triton_plan(assignment, sched.formats, spec.kind, spec.sampled_operand,
                    lambda m, n: _same_arrays(tensors[m], tensors[n]))
    if p is None:
        return None
    if p.shared:   # one compressed operand: the product of the shared pattern's values
        A = tensors[p.sparse]
        values = A.values
        for n in p.shared:
            values = values * tensors[n].values
        tensors[p.sparse] = A.with_values(values)
    if p.kind == "sampled":
        return _launch_sampled(p, tensors, assignment, spec)
    return _launch_rows(p, tensors, assignment)


def traced_kind(assignment, infos, out_format, dtype) -> str | None:
    """What ``run_triton`` computes for operands of these formats, known without their data:
    ``"dense"`` or ``"sampled"`` (values on the sparse operand's own pattern); None where it
    would convert an operand or multiply shared patterns first, or no kernel applies. A
    traced call (``triton_ops``) records a launch only where this is not None."""
    if dtype not in TRITON_DTYPES:
        return None
    formats = tuple(i.format for i in infos)
    if any(f.blocksize is not None for f in formats):
        return "dense" if out_format in (None, "dense") and \
            triton_plan(assignment, formats, "dense") is not None else None
    sched = schedule(assignment, infos)
    if sched.conversions:
        return None
    spec = infer_output(assignment, sched.order, sched.formats, out_format)
    p = triton_plan(assignment, sched.formats, spec.kind, spec.sampled_operand,
                    lambda m, n: False)
    if p is None or p.shared:
        return None
    return p.kind if p.kind == "sampled" else "dense"


def _same_arrays(a, b) -> bool:
    """Two SparseTensors of one format whose level arrays are the same tensors."""
    return isinstance(a, SparseTensor) and isinstance(b, SparseTensor) and \
        a.format == b.format and a.shape == b.shape and \
        all(a._level_arrays[k] is b._level_arrays[k] for k in a._level_arrays)


def _strides(t: torch.Tensor, dims, roles) -> list:
    """``t``'s stride for each role in ``roles`` (0 where ``t`` has no such dimension)."""
    return [t.stride(dims.index(r)) if r in dims else 0 for r in roles]


def _epilogue_args(p, tensors):
    """Pointers, then (row, k) stride pairs, of the epilogue's operands."""
    from ..codegen.triton import epilogue_operands

    roles = dict(p.roles)
    ops = epilogue_operands(p)
    dims = {a.operand: tuple(roles[v] for v in a.indices) for a in p.epilogue.accesses()} \
        if p.epilogue is not None else {}
    ptrs = [tensors[n] for n in ops]
    strides = [s for n in ops for s in _strides(tensors[n], dims[n], ("r", "k"))]
    return ptrs, strides


def _out_shape(assignment, tensors):
    ext = var_extents(assignment, [tuple(t.shape) for t in tensors])
    return ext, tuple(ext[v] for v in assignment.out_vars)


def _launch_rows(p, tensors, assignment):
    from ..codegen.triton import load, render

    triton, tl = _triton()
    A, X = tensors[p.sparse], tensors[p.x.operand]
    ext, out_shape = _out_shape(assignment, tensors)
    out = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    n_rows = A.shape[A.format.mode_order[0]]
    n_k = ext[next(v for v, r in p.roles if r == "k")] if p.has_k else 1
    stats["rows"] += 1
    if out.numel() == 0:
        return out
    perm = row_order(A._level_arrays["pos1"])
    eptrs, estrides = _epilogue_args(p, tensors)
    block_k = min(_pow2(n_k), _MAX_BLOCK_K) if p.has_k else 1
    rows = 1 if p.has_k else _SPMV_ROWS
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_k, block_k))
    load(render(p))[grid](
        A._level_arrays["pos1"], A._level_arrays["crd1"], A.values, perm, X, out, *eptrs, n_rows, n_k,
        *_strides(X, p.x.dims, ("c", "k")), *_strides(out, p.out_dims, ("r", "k")),
        *estrides, ROWS=rows, BLOCK_NZ=_BLOCK_NZ if p.has_k else _SPMV_BLOCK_NZ,
        BLOCK_K=block_k, ACC=_acc(tl, A.dtype))
    return out


def _dot_choice(dtype, device, r, c, block_k):
    """(use tl.dot, operand dtype to widen to, input precision) for R x C blocks: tensor
    cores from 16 x 16 blocks (not float64); float32 as torch's matmul is told to
    (``torch.backends.cuda.matmul.allow_tf32``); the interpreter multiplies in float32
    (its bfloat16 arithmetic is not exact)."""
    if min(r, c, block_k) < 16 or dtype == torch.float64:
        return False, "", "ieee"
    interpreted = device.type == "cpu"
    widen = "tl.float32" if interpreted and dtype != torch.float32 else ""
    tf32 = dtype == torch.float32 and not interpreted and torch.backends.cuda.matmul.allow_tf32
    return True, widen, "tf32" if tf32 else "ieee"


def _launch_bsr(p, tensors, assignment):
    from ..codegen.triton import load, render

    triton, tl = _triton()
    A, X = tensors[p.sparse], tensors[p.x.operand]
    ext, out_shape = _out_shape(assignment, tensors)
    out = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    r, c = A.format.blocksize
    n_rows = A.shape[0]
    n_k = ext[next(v for v, role in p.roles if role == "k")] if p.has_k else 1
    stats["bsr"] += 1
    if out.numel() == 0:
        return out
    n_brows = n_rows // r
    perm = row_order(A._level_arrays["pos1"])
    eptrs, estrides = _epilogue_args(p, tensors)
    block_k = min(_pow2(n_k), _MAX_BLOCK_K) if p.has_k else 1
    use_dot, widen, precision = _dot_choice(A.dtype, A.device, r, c, block_k)
    grid = (n_brows, triton.cdiv(n_k, block_k))
    load(render(p, use_dot, widen, precision))[grid](
        A._level_arrays["pos1"], A._level_arrays["crd1"], A.values, perm, X, out, *eptrs, n_brows, n_rows,
        n_k, *_strides(X, p.x.dims, ("c", "k")), *_strides(out, p.out_dims, ("r", "k")),
        *estrides, R=r, C=c, RP=_pow2(r), CP=_pow2(c), BLOCK_K=block_k,
        ACC=_acc(tl, A.dtype))
    return out


def _launch_sampled(p, tensors, assignment, spec):
    from ..codegen.triton import load, render

    triton, tl = _triton()
    A, X, Y = tensors[p.sparse], tensors[p.x.operand], tensors[p.y.operand]
    ext, out_shape = _out_shape(assignment, tensors)
    vals = torch.zeros(A.nnz, dtype=A.dtype, device=A.device)
    n_rows = A.shape[A.format.mode_order[0]]
    n_k = ext[next(v for v, r in p.roles if r == "k")]
    stats["sampled"] += 1
    if A.nnz and n_k:
        block_k = min(_pow2(n_k), _MAX_BLOCK_K)
        load(render(p))[(n_rows,)](
            A._level_arrays["pos1"], A._level_arrays["crd1"], A.values, row_order(A._level_arrays["pos1"]), X, Y,
            vals, n_rows, n_k, *_strides(X, p.x.dims, ("r", "k")),
            *_strides(Y, p.y.dims, ("c", "k")), ROWS=1, BLOCK_NZ=_BLOCK_NZ, BLOCK_K=block_k,
            ACC=_acc(tl, A.dtype))
    return SparseTensor(out_shape, spec.format, A._level_arrays, vals)


def attention(A: SparseTensor, Q, K, V) -> torch.Tensor:
    """The fused masked attention (``st.ops.masked_attention``'s kernel) on CSR ``A``."""
    from ..codegen.triton import load, render_attention

    triton, tl = _triton()
    check_device(A.device)
    (n, _), d, e = A.shape, Q.shape[1], V.shape[1]
    out = torch.empty((n, e), dtype=A.dtype, device=A.device)
    stats["attention"] += 1
    if out.numel() == 0:
        return out
    block_e = min(_pow2(e), _MAX_BLOCK_K)
    load(render_attention())[(n, triton.cdiv(e, block_e))](
        A._level_arrays["pos1"], A._level_arrays["crd1"], A.values, row_order(A._level_arrays["pos1"]), Q, K, V,
        out, n, d, e, *Q.stride(), *K.stride(), *V.stride(), *out.stride(),
        BLOCK_NZ=_BLOCK_NZ, BLOCK_D=_pow2(d), BLOCK_E=block_e, ACC=_acc(tl, A.dtype))
    return out


def row_softmax(kind: str, t: SparseTensor, *inputs: torch.Tensor) -> torch.Tensor:
    """The values row kernel ``kind`` (``codegen.triton.render_row_softmax``) computes from
    value arrays ``inputs`` (one or two) on the rows of CSR ``t``."""
    from ..codegen.triton import load, render_row_softmax

    triton, tl = _triton()
    check_device(t.device)
    inputs = [x.contiguous() for x in inputs]
    out = torch.empty_like(inputs[0])
    stats[kind] += 1
    n = t.shape[0]
    if n and out.numel():
        pos = t._level_arrays["pos1"]
        load(render_row_softmax(kind))[(n,)](
            pos, row_order(pos), inputs[0], inputs[-1], out, BLOCK_NZ=_SPMV_BLOCK_NZ,
            ACC=_acc(tl, out.dtype))
    return out
