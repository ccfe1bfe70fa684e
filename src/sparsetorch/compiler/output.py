"""Output format inference (docs/design.md, Compiler 7) and the choice of how the output is
written.

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


def _can_be_nonzero_without(assignment, operands) -> bool:
    """Whether the expression can be nonzero where all of ``operands`` are absent (every
    other operand present)."""
    return presence(assignment.expr, lambda acc: acc.operand not in operands) is not False


def infer_output(assignment: Assignment, order, formats, out_format=None) -> OutputSpec:
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
    sparse_ops = [acc.operand for acc in accesses if not formats[acc.operand].is_dense]
    for acc in accesses:
        fmt = formats[acc.operand]
        # Sampling keeps the operand's whole pattern, so it is exact only when every other
        # operand is dense (SDDMM, A * dense); two sparse operands intersect or union.
        if (sparse_ops == [acc.operand] and fmt.blocksize is None
                and len(set(acc.indices)) == len(acc.indices)
                and sorted(acc.indices) == sorted(out_vars)
                and not _can_be_nonzero_without(assignment, {acc.operand})):
            modes = tuple(out_vars.index(acc.indices[m]) for m in fmt.mode_order)
            sampled = (acc.operand, Format(fmt.levels, modes))
            break
    if out_format is not None and not out_vars:
        if out_format == "dense":   # (a scalar is the dense result)
            return OutputSpec("dense", None)
        raise ValueError(f"out_format={out_format!r} was given but the result is a scalar "
                         "(a dense 0-d tensor); leave it out or ask for 'dense'")
    if out_format is not None:
        fmt = as_format(out_format, len(out_vars))
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
        if not sparse_ops or _can_be_nonzero_without(assignment, sparse_ops):
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
    levels = _coordinate_runs(levels)
    return Format(tuple(levels), tuple(out_vars.index(v) for v in storage))


def _coordinate_runs(levels):
    """Make runs of singleton levels valid, COO-style: the level above a run becomes
    non-unique compressed and every singleton but the run's last is non-unique too. A run
    with nothing compressed above it, or not reaching the last level, is compressed."""
    out = list(levels)
    k = 0
    while k < len(out):
        if not isinstance(out[k], Singleton):
            k += 1
            continue
        end = k
        while end + 1 < len(out) and isinstance(out[end + 1], Singleton):
            end += 1
        if k > 0 and isinstance(out[k - 1], Compressed) and end == len(out) - 1:
            out[k - 1] = Compressed(unique=False)
            out[k:end] = [Singleton(unique=False)] * (end - k)
            out[end] = Singleton()
        else:
            out[k:end + 1] = [Compressed()] * (end + 1 - k)
        k = end + 1
    return out
