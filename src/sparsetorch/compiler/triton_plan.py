"""The Triton schedule: which block-shaped kernel computes an assignment on a GPU.

In: an ``Assignment`` and its operands' formats after the compiler's own ``schedule`` (its
conversions already applied) and ``infer_output``. Out: a ``TritonPlan`` naming the kernel
class and each operand's role, or None where no Triton kernel applies (the caller then runs
the pure-torch fallback on the tensors' device).

Why a schedule of its own instead of the loop IR: the IR (``ir.py``) is scalar and C-shaped
(one statement per element, OpenMP loops, row workspaces, register tiles unrolled into
lanes). A Triton program is block-shaped: one program owns a row of the compressed operand
and a tile of the dense dimension, and a loop body is whole-vector loads and reductions.
The classes below are the IR's own classification (``schedule.py``'s storage order and
``output.py``'s dense/sampled result) read at that coarser grain; ``codegen/triton.py``
renders them.

Classes (one compressed operand ``A[r, c]`` stored row ``r`` outer, every other dense):

* ``rows``: a dense result ``out[r, k] = f(scale * sum_c A[r, c] X[c, k])``, or ``out[r]``
  without ``k`` (SpMM, SpMV, the sparse-input linear, with an optional epilogue ``f``: bias,
  activation). A blocked ``A`` (BSR) takes the same class with ``blocked=True``.
* ``sampled``: ``out = A * scale * sum_k X[r, k] Y[c, k]`` on A's pattern (SDDMM).
"""
from __future__ import annotations

from dataclasses import dataclass

from .notation import Access, Assignment, Epilogue, Expr, Mul, Scale


@dataclass(frozen=True)
class DenseRole:
    """A dense operand: its number and which of the plan's variables index its dimensions
    (``"r"``, ``"c"`` or ``"k"``), in its own dimension order."""

    operand: int
    dims: tuple[str, ...]


@dataclass(frozen=True)
class TritonPlan:
    kind: str                      # 'rows' | 'sampled'
    sparse: int                    # the compressed operand
    x: DenseRole | None            # rows: X[c, k] (None: not allowed); sampled: X[r, k]
    y: DenseRole | None            # sampled: Y[c, k]
    out_dims: tuple[str, ...]      # rows: the result's dimensions as roles ('r', 'k')
    has_k: bool                    # a dense-only index exists (SpMM, SDDMM; not SpMV)
    scale: float = 1.0
    epilogue: Expr | None = None   # over Result() and accesses named by out_vars
    roles: tuple = ()              # (variable, role) pairs: maps epilogue indices to roles
    blocked: bool = False
    # more sparse operands read at A's positions with A's indices and the same pattern
    # arrays (autograd's products such as G * A): their values multiply A's first
    shared: tuple[int, ...] = ()


def _factors(expr: Expr):
    """(accesses, scale) of a product of accesses and scalar scales, or None."""
    if isinstance(expr, Access):
        return [expr], 1.0
    if isinstance(expr, Scale):
        inner = _factors(expr.a)
        return None if inner is None else (inner[0], inner[1] * expr.factor)
    if isinstance(expr, Mul):
        a, b = _factors(expr.a), _factors(expr.b)
        if a is None or b is None:
            return None
        return a[0] + b[0], a[1] * b[1]
    return None


def plan(assignment: Assignment, formats, out_kind: str, sampled_operand=None,
         same_pattern=lambda a, b: False):
    """The ``TritonPlan`` of ``assignment`` over operand ``formats`` (after conversions)
    with result kind ``out_kind`` ('dense', 'sampled', 'emit'), or None.
    ``same_pattern(m, n)``: whether sparse operands ``m`` and ``n`` store one pattern in
    the same arrays (then a product of both reads one compressed operand).

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> p = plan(parse_einsum("ij,jk->ik", [2, 2]),
        ...          (as_format("csr", 2), as_format("dense", 2)), "dense")
        >>> p.kind, p.x.dims, p.out_dims
        ('rows', ('c', 'k'), ('r', 'k'))
    """
    expr, epilogue = (assignment.expr.body, assignment.expr.fn) \
        if isinstance(assignment.expr, Epilogue) else (assignment.expr, None)
    found = _factors(expr)
    if found is None:
        return None
    accesses, scale = found
    sparse = [a for a in accesses if not formats[a.operand].is_dense]
    if not sparse or len(sparse[0].indices) != 2:
        return None
    A = sparse[0]
    shared = tuple(a.operand for a in sparse[1:])
    if any(a.indices != A.indices or formats[a.operand] != formats[A.operand]
           or not same_pattern(A.operand, a.operand) for a in sparse[1:]):
        return None
    fmt = formats[A.operand]
    if len(set(A.indices)) != 2 or fmt.ndim != 2 or fmt.name not in ("csr", "csc", "bsr"):
        return None
    if fmt.blocksize is not None and fmt.mode_order != (0, 1):
        return None
    row, col = (A.indices[m] for m in fmt.mode_order)   # storage order: row outer
    dense = [a for a in accesses if formats[a.operand].is_dense]
    others = {v for a in dense for v in a.indices} - {row, col}
    if len(others) > 1 or any(len(set(a.indices)) != len(a.indices) for a in dense):
        return None
    k = next(iter(others), None)
    roles = {row: "r", col: "c"}
    if k is not None:
        roles[k] = "k"
    role_of = lambda a: DenseRole(a.operand, tuple(roles[v] for v in a.indices))  # noqa: E731
    out = tuple(roles[v] for v in assignment.out_vars)
    if out_kind == "dense" and len(dense) == 1 and set(out) == ({"r", "k"} if k else {"r"}) \
            and "c" in role_of(dense[0]).dims and set(role_of(dense[0]).dims) <= {"c", "k"}:
        if epilogue is not None and any(
                not set(a.indices) <= set(assignment.out_vars) or len(a.indices) > 2
                for a in epilogue.accesses()):
            return None
        return TritonPlan("rows", A.operand, role_of(dense[0]), None, out, k is not None,
                          scale, epilogue, tuple(roles.items()), fmt.blocksize is not None,
                          shared)
    if out_kind == "sampled" and sampled_operand in (A.operand, *shared) \
            and epilogue is None \
            and fmt.blocksize is None and k is not None and len(dense) == 2:
        x = [role_of(a) for a in dense if "r" in role_of(a).dims]
        y = [role_of(a) for a in dense if "c" in role_of(a).dims]
        if len(x) == 1 and len(y) == 1 and set(x[0].dims) == {"r", "k"} \
                and set(y[0].dims) == {"c", "k"}:
            return TritonPlan("sampled", A.operand, x[0], y[0], out, True, scale,
                              roles=tuple(roles.items()), shared=shared)
    return None
