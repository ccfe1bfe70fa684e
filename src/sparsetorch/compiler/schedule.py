"""Loop ordering without search, and the operand conversions it may ask for.

Rules (docs/design.md, Compiler 2):

1. Every sparse operand is traversed in its storage order (concordant): its level variables
   appear in the loop order in level order. That is a hard constraint.
2. Among the variables the constraints allow next, prefer ones that index a sparse operand
   (they filter the iteration space), then ones that are not the contiguous last mode of a
   dense operand (so that mode ends innermost, where it vectorises), then free variables before
   reductions, then output order.
3. The rule order is costed with a symbolic model (loop extents: N for a dense loop, d for a
   sparse one, N >> d) against the same rules with one or two sparse operands re-laid in a
   different mode order, charging that conversion N*d. A cycle in the constraints (no
   concordant order) or an asymptotically cheaper order (inner-product SpGEMM -> Gustavson)
   both show up as a conversion, which ``explain()`` reports.
4. Between orders of equal cost, one that scatters into a dense result from an outer
   reduction (``A.T @ X`` on CSR: one thread, rows updated in memory) loses to a conversion
   when the nest does more than touch every stored entry once (``_serial_scatter``); a
   conversion that would pad (dense levels under a sparse one) never wins that way.

The model looks only at formats, never at sizes, so one schedule serves every call with the
same structure and is memoised with the kernel.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ..formats.format import Format
from ..formats.levels import Dense
from .notation import Assignment


@dataclass(frozen=True)
class OperandInfo:
    """What scheduling needs to know of an operand: its storage format (plain dense tensors
    are all-dense row-major) and whether it is a plain strided tensor; ``long_rows``: a
    CSR-like operand whose rows are long enough for cache blocking (``kblock.long_rows``),
    so its kernels carry the blocked nest too (a larger build, paid only where it helps)."""

    format: Format
    strided: bool
    long_rows: bool = False

    @property
    def is_sparse(self) -> bool:
        return not self.format.is_dense


@dataclass(frozen=True)
class Schedule:
    order: tuple[str, ...]
    formats: tuple[Format, ...]          # operand formats after conversions
    conversions: tuple[tuple[int, Format], ...]
    cost: tuple[int, int]                # (power of N, power of d) of the dominant term
    # the conversions are there only to avoid a serial scatter (rule 4): a call too small
    # for threads runs the order as written (``schedule(..., allow_scatter=True)``)
    avoids_scatter: bool = False


def level_vars(fmt: Format, indices) -> tuple[str, ...]:
    """The index variable each storage level of an operand iterates."""
    outer = tuple(indices[m] for m in fmt.mode_order)
    return outer if fmt.blocksize is None else outer + outer


def _constraints(assignment: Assignment, formats, infos, skip=None):
    """Pairs (a, b): variable a must be iterated before b. A dense level below another one
    is located, not iterated (its position is parent * extent + coordinate), so its
    variable may also come earlier: BSR then runs each row of a block row across all its
    blocks, keeping the output row in registers. A compressed or singleton level is
    iterated from its parent's position, so every level above it, dense ones included,
    comes first (``(dense, dense, compressed)``: both dense variables before the last).
    Operand ``skip`` adds none."""
    pairs = set()
    for acc in assignment.expr.accesses():
        fmt = formats[acc.operand]
        if infos[acc.operand].strided or fmt.is_dense or acc.operand == skip:
            continue
        vs = level_vars(fmt, acc.indices)
        pairs.update((a, b) for k, b in enumerate(vs) if not isinstance(fmt.levels[k], Dense)
                     for a in vs[:k] if a != b)
    return pairs


def _rule_order(assignment: Assignment, formats, infos, skip=None):
    """Greedy topological order by the rules above; None if the constraints have a cycle.
    ``skip``: an operand whose storage order does not constrain the order."""
    pairs = _constraints(assignment, formats, infos, skip)
    remaining = list(assignment.all_vars)
    sparse_vars, last_dense = set(), {}
    for acc in assignment.expr.accesses():
        fmt = formats[acc.operand]
        if fmt.is_dense:
            last = acc.indices[-1] if acc.indices else None
            last_dense[last] = last_dense.get(last, 0) + 1
        else:
            sparse_vars.update(acc.indices)
    if assignment.out_vars:
        last_dense[assignment.out_vars[-1]] = last_dense.get(assignment.out_vars[-1], 0) + 1
    out_pos = {v: i for i, v in enumerate(assignment.out_vars)}
    order = []
    while remaining:
        ready = [v for v in remaining if not any(b == v and a in remaining for a, b in pairs)]
        if not ready:
            return None
        ready.sort(key=lambda v: (v not in sparse_vars, last_dense.get(v, 0),
                                  v not in out_pos, out_pos.get(v, 0),
                                  assignment.all_vars.index(v)))
        order.append(ready[0])
        remaining.remove(ready[0])
    return tuple(order)


def _cost(assignment: Assignment, order, formats, infos) -> tuple[int, int]:
    """Dominant term of the loop nest's trip count as (power of N, power of d)."""
    level_at = {}
    for acc in assignment.expr.accesses():
        if not formats[acc.operand].is_dense:
            for k, v in enumerate(level_vars(formats[acc.operand], acc.indices)):
                level_at.setdefault(v, []).append(formats[acc.operand].levels[k])
    n_pow = d_pow = 0
    worst = (0, 0)
    for v in order:
        kinds = level_at.get(v, [])
        if not kinds or all(isinstance(k, Dense) for k in kinds):
            n_pow += 1
        else:
            d_pow += 1
        worst = max(worst, (n_pow, d_pow))
    if all(not f.is_dense for f in formats):
        # The result is likely sparse: free variables after a reduction need a workspace,
        # allocated once with a dense extent per variable (rows reset only touched cells).
        out = assignment.out_vars
        first_red = next((d for d, v in enumerate(order) if v not in out), len(order))
        ws = [v for v in order[first_red:] if v in out]
        worst = max(worst, (len(ws), 0))
    return worst


def _serial_scatter(assignment: Assignment, order, formats, cost) -> bool:
    """Whether the nest scatters into a dense result from an outer reduction (``A.T @ X``
    on CSR: ``for j, for i in row j: out[i, :] += ...``). Its iterations write the same
    output rows, so ``lower.parallel`` keeps it on one thread, and its inner loop adds into
    rows scattered over the result instead of one row kept in registers: on a 4096 x 4096
    matrix of 168k entries with 64 columns it ran 5.5x slower than ``A @ X``. Where the nest
    does more than touch each stored entry once (cost above N*d), re-laying the operand
    (N*d, its pattern kept, ``ops/relaid.py``) costs less than that, so such an order
    loses a tie against a converted one; below, both touch every entry once and the nest is
    kept as written."""
    return (cost > (1, 1) and order[0] not in assignment.out_vars
            and any(f.is_dense for f in formats)
            and _output_kind(assignment, order, formats) == "dense")


def _output_kind(assignment: Assignment, order, formats) -> str:
    from .output import infer_output   # (output.py imports this module)

    return infer_output(assignment, order, formats).kind


def pads(fmt: Format) -> bool:
    """Whether ``fmt`` stores a dense level under a sparse one: a full extent per stored
    parent, entries its source did not have (``ops/relaid.py`` then converts in full)."""
    sparse_above = False
    for level in fmt.levels:
        if isinstance(level, Dense) and sparse_above:
            return True
        sparse_above = sparse_above or not isinstance(level, Dense)
    return False


def _relaid(fmt: Format, order) -> Format:
    return Format(fmt.levels, tuple(order), fmt.blocksize)


# Up to this order every other mode order of an operand is a candidate (23 at order 4);
# beyond it n! explodes (362880 at order 9, and each is costed), so only the orders the
# loop nest asks for are tried.
_EVERY_MODE_ORDER_UP_TO = 4


def _mode_order_options(assignment: Assignment, base, infos, n) -> list[tuple[int, ...]]:
    """Mode orders to try re-laying operand ``n`` in: all of them for small orders, else
    the order the rules pick when ``n`` constrains nothing, the assignment's variable order
    (output first) and plain row-major -- at most three, so scheduling stays linear in the
    tensor order."""
    fmt = base[n]
    if fmt.ndim <= _EVERY_MODE_ORDER_UP_TO:
        return [p for p in itertools.permutations(range(fmt.ndim)) if p != fmt.mode_order]
    found = {tuple(range(fmt.ndim)): None}
    for order in (_rule_order(assignment, base, infos, skip=n), assignment.all_vars):
        if order is None:
            continue
        position = {v: k for k, v in enumerate(order)}
        for acc in assignment.expr.accesses():
            if acc.operand == n:
                found[tuple(sorted(range(fmt.ndim),
                                   key=lambda m: position[acc.indices[m]]))] = None
    found.pop(fmt.mode_order, None)
    return list(found)


def schedule(assignment: Assignment, infos, allow_scatter: bool = False) -> Schedule:
    """Choose the loop order and any operand conversions; ``allow_scatter`` drops rule 4.

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> csr, dense = as_format("csr", 2), as_format("dense", 2)
        >>> s = schedule(parse_einsum("ij,jk->ik", [2, 2]),
        ...              [OperandInfo(csr, False), OperandInfo(dense, True)])
        >>> s.order
        ('i', 'j', 'k')
    """
    base = tuple(info.format for info in infos)
    candidates = [((), base)]
    sparse_ops = [n for n, info in enumerate(infos)
                  if info.is_sparse and info.format.ndim >= 2 and info.format.blocksize is None]
    options = {n: _mode_order_options(assignment, base, infos, n) for n in sparse_ops}
    for r in (1, 2):
        for ops in itertools.combinations(sparse_ops, r):
            for orders in itertools.product(*(options[n] for n in ops)):
                formats = list(base)
                for n, o in zip(ops, orders):
                    formats[n] = _relaid(base[n], o)
                candidates.append((tuple(zip(ops, (formats[n] for n in ops))), tuple(formats)))
        if len(candidates) > 256:
            break
    best, scatters = None, False   # (whether the order as written scatters: rule 4)
    for conversions, formats in candidates:
        order = _rule_order(assignment, formats, infos)
        if order is None:
            continue
        cost = _cost(assignment, order, formats, infos)
        if conversions:   # a conversion touches every nonzero once: N*d
            cost = max(cost, (1, 1))
        scatter = False
        if not conversions:
            scatters = scatter = not allow_scatter and _serial_scatter(assignment, order,
                                                                       formats, cost)
        elif scatters:   # a fix only if it scatters no more and pads nothing (dense
            scatter = _serial_scatter(assignment, order, formats, cost) or any(  # levels
                pads(fmt) for _, fmt in conversions)                 # under a sparse one)
        key = (cost, scatter, len(conversions))
        if best is None or key < best[0]:
            best = (key, Schedule(order, formats, conversions, cost))
    if best is None:
        raise NotImplementedError(f"no loop order found for {assignment}")
    found = best[1]
    if found.conversions and scatters:   # (else rule 4 decided nothing: no second pass)
        written = schedule(assignment, infos, True)
        if written.conversions != found.conversions:
            # small calls run ``written``: both must give the same kind of result
            if _output_kind(assignment, written.order, written.formats) != \
                    _output_kind(assignment, found.order, found.formats):
                return written
            found = replace(found, avoids_scatter=True)
    return found
