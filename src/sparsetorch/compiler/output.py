"""Output format inference (DESIGN.md, Compiler 7) and the choice of how the output is written.

Three ways to write a result:

* ``dense``: a dense row-major array, accumulated in place (the result is a torch.Tensor);
* ``sampled``: the result has exactly one operand's pattern (SDDMM, ``A * dense``): the
  kernel writes values at that operand's positions and the level arrays are shared;
* ``emit``: any other sparse pattern (SpGEMM, sparse ``+``): the kernel lists the
  coordinates and values of the result in two passes (count, then fill) and ``pack`` builds
  the levels; no dense or quadratic temporary is ever made.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..formats.format import Format, as_format
from ..formats.levels import Compressed, Dense, Singleton
from .notation import Assignment, presence
from .schedule import level_vars


@dataclass(frozen=True)
class OutputSpec:
    kind: str                     # 'dense' | 'sampled' | 'emit'
    format: Format | None         # None for a dense result
    sampled_operand: int | None = None


def _requires(assignment, n) -> bool:
    """True when the expression is zero wherever operand ``n`` is absent."""
    return presence(assignment.expr, lambda acc: acc.operand != n) is False


def infer_output(assignment: Assignment, order, formats, out_format=None,
                 blocksize=None) -> OutputSpec:
    """Pick the output format and writing strategy.

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> csr = as_format("csr", 2)
        >>> infer_output(parse_einsum("ij,jk->ik", [2, 2]), ("i", "j", "k"),
        ...              [csr, csr]).format.name
        'csr'
    """
    out_vars = assignment.out_vars
    accesses = assignment.expr.accesses()
    sampled = None
    for acc in accesses:
        fmt = formats[acc.operand]
        if (not fmt.is_dense and fmt.blocksize is None and len(set(acc.indices)) == len(
                acc.indices) and sorted(acc.indices) == sorted(out_vars)
                and _requires(assignment, acc.operand)):
            modes = tuple(out_vars.index(acc.indices[m]) for m in fmt.mode_order)
            sampled = (acc.operand, Format(fmt.levels, modes))
            break
    if out_format is not None:
        if not out_vars:
            raise ValueError("out_format was given but the result is a scalar")
        fmt = as_format(out_format, len(out_vars), blocksize)
        if fmt.blocksize is not None:
            raise NotImplementedError("blocked output formats (bsr) are not generated yet; "
                                      "compute in 'csr' and call .asformat('bsr')")
    elif not out_vars:
        return OutputSpec("dense", None)
    elif sampled is not None:
        fmt = sampled[1]
    else:
        fmt = _infer_levels(assignment, order, formats)
    if fmt.is_dense:
        return OutputSpec("dense", None)
    if sampled is not None and fmt == sampled[1]:
        return OutputSpec("sampled", fmt, sampled[0])
    return OutputSpec("emit", fmt)


def _infer_levels(assignment, order, formats) -> Format:
    out_vars = assignment.out_vars
    storage = [v for v in order if v in out_vars]
    kinds_at = {}
    for acc in assignment.expr.accesses():
        fmt = formats[acc.operand]
        if fmt.is_dense:
            continue
        for k, v in enumerate(level_vars(fmt, acc.indices)):
            kinds_at.setdefault(v, []).append((acc.operand, fmt.levels[k]))
    levels = []
    for v in storage:
        entries = kinds_at.get(v, [])
        sparse_ops = {n for n, lv in entries if not isinstance(lv, Dense)}
        if not sparse_ops or _union_with_dense(assignment, sparse_ops):
            levels.append(Dense())
        elif any(isinstance(lv, Compressed) for _, lv in entries):
            levels.append(Compressed())
        elif any(isinstance(lv, Singleton) for _, lv in entries):
            levels.append(Singleton())
        else:
            levels.append(Dense())
    # A sparse level above a dense one becomes dense (nothing to gain from compressing it).
    last_dense = max((k for k, lv in enumerate(levels) if isinstance(lv, Dense)), default=-1)
    levels = [Dense() if k <= last_dense else lv for k, lv in enumerate(levels)]
    # A singleton level hangs below a non-unique one (COO-like results).
    for k in range(len(levels) - 1, 0, -1):
        if isinstance(levels[k], Singleton):
            levels[k - 1] = (Compressed(unique=False) if isinstance(levels[k - 1], Compressed)
                             else levels[k - 1])
    if isinstance(levels[0], Singleton):
        levels[0] = Compressed()
    levels = _repair_singletons(levels)
    return Format(tuple(levels), tuple(out_vars.index(v) for v in storage))


def _union_with_dense(assignment, sparse_ops) -> bool:
    """True when the expression can be nonzero where all of ``sparse_ops`` are absent."""
    return presence(assignment.expr, lambda acc: acc.operand not in sparse_ops) is not False


def _repair_singletons(levels):
    """Singletons are only valid below non-unique levels; anything else becomes compressed."""
    out = list(levels)
    for k, lv in enumerate(out):
        if isinstance(lv, Singleton) and (k == 0 or out[k - 1].unique):
            out[k] = Compressed()
        if not lv.unique and any(not isinstance(x, Singleton) for x in out[k + 1:]):
            out[k] = Compressed()
    return out
