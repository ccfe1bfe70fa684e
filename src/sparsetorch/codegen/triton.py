"""Triton source for the block-shaped kernels of ``compiler/triton_plan.py``.

In: a ``TritonPlan`` (SpMM/SpMV/linear rows, BSR rows, SDDMM) or the fused masked
attention. Out: the text of a Python module defining one ``@triton.jit`` function
``kernel``; ``load`` turns a text into that function, memoised in memory by the text's hash
(Triton caches the compiled binaries itself, keyed by the same text).

The kernels render from the Triton schedule, not from the C loop IR: the IR's statements are
scalar (see ``triton_plan.py``), a Triton body is whole-tile loads and reductions. What the
renderer shares with the C one is the notation: epilogues (bias, activation, scales) print
from the same ``Expr`` trees through a rule table (``_UNARY``), as ``c.py`` prints them.

Sputnik's techniques (Gale et al., SC 2020), as every kernel here uses them:

* row swizzle: programs take rows in the order of a permutation that sorts rows by length,
  longest first (``ops/triton_run.py`` computes it once per pattern and keeps it), so the
  long rows start first and rows running side by side have similar lengths;
* 1-D tiles over the dense dimension: one program per (row block, dense tile);
* vector loads: each step loads ``BLOCK_NZ`` column indices and values and a
  ``BLOCK_NZ x BLOCK_K`` tile of the dense operand, contiguous along the tile (Triton
  specialises a unit stride and emits vector loads);
* residue handling: every load and store past a row's end or the dense extent is masked;
* accumulation in float32 (float64 for float64 inputs); float16 and bfloat16 inputs are
  widened as they are loaded and the result narrowed once as it is stored.
"""
from __future__ import annotations

import hashlib
import linecache
import os

from ..compiler.notation import Access, Add, Mul, Result, Scale, Unary
from ..compiler.triton_plan import TritonPlan

# Triton spellings of the notation's unary maps (``notation.UNARY`` holds the C ones).
_UNARY = {
    "neg": "(-({x}))",
    "abs": "tl.abs({x})",
    "relu": "tl.maximum({x}, 0.0)",
    "exp": "tl.exp({x})",
    "sqrt": "tl.sqrt({x})",
    "relu6": "tl.minimum(tl.maximum({x}, 0.0), 6.0)",
    "sigmoid": "tl.sigmoid({x})",
}

_PRELUDE = "import triton\nimport triton.language as tl\n\n"


def _header(title: str, traffic: str, strategy: str) -> str:
    return (f"# sparsetorch Triton kernel: {title}\n# memory traffic: {traffic}\n"
            f"# parallel strategy: {strategy}\n")


def epilogue_operands(p: TritonPlan) -> tuple[int, ...]:
    """The operands the epilogue of ``p`` reads (bias), in the kernel's parameter order."""
    if p.epilogue is None:
        return ()
    return tuple(dict.fromkeys(a.operand for a in p.epilogue.accesses()))


def _expr(e, row: str, col: str, mask: str) -> str:
    """Triton text of epilogue expression ``e`` on the tile ``acc``: operand ``n``'s element
    at (row, col) is read through pointer ``e{n}`` and strides ``e{n}_sr``/``e{n}_sk`` (zero
    for a dimension the operand lacks, so it broadcasts)."""
    if isinstance(e, Result):
        return "acc"
    if isinstance(e, Access):
        n = e.operand
        return (f"tl.load(e{n} + {row} * e{n}_sr + {col} * e{n}_sk, mask={mask}, "
                f"other=0).to(ACC)")
    if isinstance(e, Add):
        return f"({_expr(e.a, row, col, mask)} + {_expr(e.b, row, col, mask)})"
    if isinstance(e, Mul):
        return f"({_expr(e.a, row, col, mask)} * {_expr(e.b, row, col, mask)})"
    if isinstance(e, Scale):
        return f"({float(e.factor)!r} * {_expr(e.a, row, col, mask)})"
    if isinstance(e, Unary):
        return _UNARY[e.fn].format(x=_expr(e.a, row, col, mask))
    raise TypeError(f"no Triton rule for epilogue node {type(e).__name__}")


def _finish(p: TritonPlan, indent: str, row: str, col: str, mask: str) -> str:
    """Lines applying the scale and the epilogue to ``acc``."""
    lines = []
    if p.scale != 1.0:
        lines.append(f"acc = acc * {float(p.scale)!r}")
    if p.epilogue is not None:
        lines.append(f"acc = {_expr(p.epilogue, row, col, mask)}")
    return "".join(f"{indent}{line}\n" for line in lines)


def _epilogue_params(p: TritonPlan) -> tuple[str, str]:
    ops = epilogue_operands(p)
    return "".join(f"e{n}, " for n in ops), "".join(f"e{n}_sr, e{n}_sk, " for n in ops)


def render(p: TritonPlan, use_dot: bool = False, dot_dtype: str = "", precision: str = "ieee"
           ) -> str:
    """Module text for plan ``p``. BSR plans: ``use_dot`` multiplies blocks with ``tl.dot``
    (blocks of 16 and more), widening operands to ``dot_dtype`` first when given.

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.compiler.triton_plan import plan
        >>> from sparsetorch.formats.format import as_format
        >>> p = plan(parse_einsum("ij,jk->ik", [2, 2]),
        ...          (as_format("csr", 2), as_format("dense", 2)), "dense")
        >>> "def kernel(" in render(p) and "tl.sum(" in render(p)
        True
    """
    if p.kind == "sampled":
        return _sampled(p)
    return _bsr(p, use_dot, dot_dtype, precision) if p.blocked else _rows(p)


def _rows(p: TritonPlan) -> str:
    eptr, estride = _epilogue_params(p)
    what = "SpMM" if p.has_k else "SpMV"
    head = _header(
        f"{what} over CSR rows (out[r, k] = sum_c A[r, c] X[c, k])"
        + (", fused epilogue" if p.epilogue is not None else ""),
        "pos once, crd and values once per dense tile (nnz * ceil(K / BLOCK_K)), X's rows "
        "gathered once per stored entry (nnz * K), out written once (rows * K)",
        "one program per (ROWS swizzled rows, BLOCK_K dense columns); each row's entries in "
        "steps of BLOCK_NZ, a BLOCK_NZ x BLOCK_K tile of X per step, summed in registers")
    finish = _finish(p, " " * 12, "row", "ks", "kmask")
    return _PRELUDE + head + f"""
@triton.jit
def kernel(pos, crd, vals, perm, x, out, {eptr}n_rows, n_k, sx_c, sx_k, so_r, so_k, {estride}
           ROWS: tl.constexpr, BLOCK_NZ: tl.constexpr, BLOCK_K: tl.constexpr,
           ACC: tl.constexpr):
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < n_k
    for i in tl.static_range(ROWS):
        slot = tl.program_id(0) * ROWS + i
        if slot < n_rows:
            row = tl.load(perm + slot).to(tl.int64)
            start = tl.load(pos + row).to(tl.int64)
            end = tl.load(pos + row + 1).to(tl.int64)
            acc = tl.zeros([BLOCK_K], dtype=ACC)
            for p0 in range(start, end, BLOCK_NZ):
                ps = p0 + tl.arange(0, BLOCK_NZ)
                pm = ps < end
                cols = tl.load(crd + ps, mask=pm, other=0).to(tl.int64)
                a = tl.load(vals + ps, mask=pm, other=0).to(ACC)
                xt = tl.load(x + cols[:, None] * sx_c + ks[None, :] * sx_k,
                             mask=pm[:, None] & kmask[None, :], other=0).to(ACC)
                acc += tl.sum(a[:, None] * xt, axis=0)
{finish}            tl.store(out + row * so_r + ks * so_k, acc.to(out.dtype.element_ty),
                     mask=kmask)
"""


def _bsr(p: TritonPlan, use_dot: bool, dot_dtype: str, precision: str) -> str:
    eptr, estride = _epilogue_params(p)
    if use_dot:
        widen = f".to({dot_dtype})" if dot_dtype else ""
        step = f"acc = tl.dot(blk{widen}, xt{widen}, acc, input_precision=\"{precision}\")"
        how = f"tl.dot per block ({precision} inputs)"
    else:
        step = "acc += tl.sum(blk.to(ACC)[:, :, None] * xt.to(ACC)[None, :, :], axis=1)"
        how = "broadcast multiply and sum per block (blocks under 16)"
    head = _header(
        "BSR SpMM (out[r, k] = sum_c A[r, c] X[c, k], A in R x C blocks)"
        + (", fused epilogue" if p.epilogue is not None else ""),
        "pos once, each block's crd and R*C values once per dense tile, C rows of X per "
        "stored block (blocks * C * K), out written once (rows * K)",
        f"one program per (swizzled block row, BLOCK_K dense columns); {how}, an "
        "RP x BLOCK_K accumulator in registers")
    finish = _finish(p, "    ", "rows[:, None]", "ks[None, :]", "tile")
    return _PRELUDE + head + f"""
@triton.jit
def kernel(pos, crd, vals, perm, x, out, {eptr}n_brows, n_rows, n_k, sx_c, sx_k, so_r, so_k,
           {estride}R: tl.constexpr, C: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr,
           BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    brow = tl.load(perm + tl.program_id(0)).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < n_k
    rr = tl.arange(0, RP)
    cc = tl.arange(0, CP)
    rows = brow * R + rr
    rmask = (rr < R) & (rows < n_rows)
    cmask = cc < C
    start = tl.load(pos + brow).to(tl.int64)
    end = tl.load(pos + brow + 1).to(tl.int64)
    acc = tl.zeros([RP, BLOCK_K], dtype=ACC)
    for b in range(start, end):
        bcol = tl.load(crd + b).to(tl.int64)
        blk = tl.load(vals + b * (R * C) + rr[:, None] * C + cc[None, :],
                      mask=(rr[:, None] < R) & cmask[None, :], other=0)
        xcols = bcol * C + cc
        xt = tl.load(x + xcols[:, None] * sx_c + ks[None, :] * sx_k,
                     mask=cmask[:, None] & kmask[None, :], other=0)
        {step}
    tile = rmask[:, None] & kmask[None, :]
{finish}    tl.store(out + rows[:, None] * so_r + ks[None, :] * so_k,
             acc.to(out.dtype.element_ty), mask=tile)
"""


def _sampled(p: TritonPlan) -> str:
    scale = f" * {float(p.scale)!r}" if p.scale != 1.0 else ""
    head = _header(
        "SDDMM (out = A * sum_k X[r, k] Y[c, k] on A's pattern)",
        "pos once, crd and values once (nnz), X's row once per BLOCK_NZ entries of it, Y's "
        "rows gathered once per stored entry (nnz * K), nnz values written",
        "one program per ROWS swizzled rows; per BLOCK_NZ entries of a row, BLOCK_NZ inner "
        "products side by side over BLOCK_K-wide steps of k")
    return _PRELUDE + head + f"""
@triton.jit
def kernel(pos, crd, vals, perm, x, y, out, n_rows, n_k, sx_r, sx_k, sy_c, sy_k,
           ROWS: tl.constexpr, BLOCK_NZ: tl.constexpr, BLOCK_K: tl.constexpr,
           ACC: tl.constexpr):
    for i in tl.static_range(ROWS):
        slot = tl.program_id(0) * ROWS + i
        if slot < n_rows:
            row = tl.load(perm + slot).to(tl.int64)
            start = tl.load(pos + row).to(tl.int64)
            end = tl.load(pos + row + 1).to(tl.int64)
            for p0 in range(start, end, BLOCK_NZ):
                ps = p0 + tl.arange(0, BLOCK_NZ)
                pm = ps < end
                cols = tl.load(crd + ps, mask=pm, other=0).to(tl.int64)
                dots = tl.zeros([BLOCK_NZ], dtype=ACC)
                for k0 in range(0, n_k, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    km = ks < n_k
                    xv = tl.load(x + row * sx_r + ks * sx_k, mask=km, other=0).to(ACC)
                    yt = tl.load(y + cols[:, None] * sy_c + ks[None, :] * sy_k,
                                 mask=pm[:, None] & km[None, :], other=0).to(ACC)
                    dots += tl.sum(yt * xv[None, :], axis=1)
                a = tl.load(vals + ps, mask=pm, other=0).to(ACC)
                tl.store(out + ps, (a * dots{scale}).to(out.dtype.element_ty), mask=pm)
"""


def render_attention() -> str:
    """Module text of the fused masked attention (one text for every dtype: ``ACC`` and
    the block sizes are launch constants).

    Example:
        >>> "tl.exp(" in render_attention()
        True
    """
    head = _header(
        "masked attention (softmax over A's stored entries of A * (Q K^T), times V)",
        "pos once, crd and values once per E tile, Q's row once, K's and V's rows gathered "
        "once per stored entry (nnz * (d + e)), out written once (rows * e); scores never "
        "leave registers",
        "one program per (swizzled row, BLOCK_E output columns); an online softmax over "
        "BLOCK_NZ entries at a time (running maximum and sum, the accumulator rescaled)")
    return _PRELUDE + head + """
@triton.jit
def kernel(pos, crd, vals, perm, q, k, v, out, n_rows, d, e, sq_r, sq_d, sk_c, sk_d, sv_c,
           sv_e, so_r, so_e, BLOCK_NZ: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_E: tl.constexpr, ACC: tl.constexpr):
    row = tl.load(perm + tl.program_id(0)).to(tl.int64)
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = es < e
    ds = tl.arange(0, BLOCK_D)
    dmask = ds < d
    qv = tl.load(q + row * sq_r + ds * sq_d, mask=dmask, other=0).to(ACC)
    start = tl.load(pos + row).to(tl.int64)
    end = tl.load(pos + row + 1).to(tl.int64)
    m = tl.full([1], float("-inf"), ACC)
    total = tl.zeros([1], dtype=ACC)
    acc = tl.zeros([BLOCK_E], dtype=ACC)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        pm = ps < end
        cols = tl.load(crd + ps, mask=pm, other=0).to(tl.int64)
        a = tl.load(vals + ps, mask=pm, other=0).to(ACC)
        kt = tl.load(k + cols[:, None] * sk_c + ds[None, :] * sk_d,
                     mask=pm[:, None] & dmask[None, :], other=0).to(ACC)
        s = tl.where(pm, a * tl.sum(kt * qv[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.where(pm, tl.exp(s - m_new), 0.0)
        total = total * alpha + tl.sum(w, axis=0)
        vt = tl.load(v + cols[:, None] * sv_c + es[None, :] * sv_e,
                     mask=pm[:, None] & emask[None, :], other=0).to(ACC)
        acc = acc * alpha + tl.sum(w[:, None] * vt, axis=0)
        m = m_new
    acc = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out + row * so_r + es * so_e, acc.to(out.dtype.element_ty), mask=emask)
"""


def render_row_softmax(kind: str) -> str:
    """Module text of the softmax over each CSR row's stored values (``kind``
    ``"row_softmax"``: ``x`` in, ``y`` out) or its gradient (``"row_softmax_grad"``:
    ``y * (g - sum(g * y))`` from ``y`` and ``g``).

    Example:
        >>> "tl.max(" in render_row_softmax("row_softmax")
        True
    """
    if kind == "row_softmax":
        title, passes = "softmax over each row's stored entries", "three (maximum, sum, write)"
        body = """    m = tl.full([1], float("-inf"), ACC)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        v = tl.load(a + ps, mask=ps < end, other=float("-inf")).to(ACC)
        m = tl.maximum(m, tl.max(v, axis=0))
    total = tl.zeros([1], dtype=ACC)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        v = tl.load(a + ps, mask=ps < end, other=float("-inf")).to(ACC)
        total += tl.sum(tl.exp(v - m), axis=0)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        pm = ps < end
        v = tl.load(a + ps, mask=pm, other=float("-inf")).to(ACC)
        tl.store(out + ps, (tl.exp(v - m) / total).to(out.dtype.element_ty), mask=pm)
"""
    elif kind == "row_softmax_grad":
        title, passes = "gradient of the row softmax, y * (g - sum(g * y))", "two (sum, write)"
        body = """    s = tl.zeros([1], dtype=ACC)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        pm = ps < end
        s += tl.sum(tl.load(a + ps, mask=pm, other=0).to(ACC)
                    * tl.load(b + ps, mask=pm, other=0).to(ACC), axis=0)
    for p0 in range(start, end, BLOCK_NZ):
        ps = p0 + tl.arange(0, BLOCK_NZ)
        pm = ps < end
        y = tl.load(a + ps, mask=pm, other=0).to(ACC)
        g = tl.load(b + ps, mask=pm, other=0).to(ACC)
        tl.store(out + ps, (y * (g - s)).to(out.dtype.element_ty), mask=pm)
"""
    else:
        raise ValueError(f"no Triton row kernel {kind!r}")
    head = _header(title, f"the row's values read in {passes} passes of BLOCK_NZ (they stay "
                   "in L1/L2 between passes), nnz values written",
                   "one program per swizzled row")
    return _PRELUDE + head + f"""
@triton.jit
def kernel(pos, perm, a, b, out, BLOCK_NZ: tl.constexpr, ACC: tl.constexpr):
    row = tl.load(perm + tl.program_id(0)).to(tl.int64)
    start = tl.load(pos + row).to(tl.int64)
    end = tl.load(pos + row + 1).to(tl.int64)
{body}"""


_MODULES: dict = {}


def load(source: str):
    """The ``kernel`` function of module text ``source``, built once per text (and per
    ``TRITON_INTERPRET``: Triton decides at decoration whether a kernel is interpreted). The
    text is registered with ``linecache`` under a name made from its hash, so Triton (which reads a
    kernel's source through ``inspect``) and tracebacks see it.

    Example:
        >>> k = load(render_attention())   # doctest: +SKIP
    """
    key = (source, os.environ.get("TRITON_INTERPRET") == "1")
    found = _MODULES.get(key)
    if found is None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        filename = f"<sparsetorch-triton-{digest}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"__name__": f"sparsetorch_triton_{digest}"}
        exec(compile(source, filename, "exec"), namespace)
        found = _MODULES[key] = namespace["kernel"]
    return found
