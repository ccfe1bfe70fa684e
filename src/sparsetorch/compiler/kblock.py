"""Cache blocking of a sparse reduction by coordinate ranges (the K-blocking of SpMM).

A register-tiled SpMM ``out[i,k] = sum_j A[i,j] X[j,k]`` (loop order i, j, k; A CSR-like)
reads, for every stored entry, one row of the dense ``X`` per tile. When the rows of A are
long (pruned weights: hundreds of entries), consecutive rows touch most of X, which then
streams from L2/L3 for every row: at 70% sparsity and 256 columns the kernel is bound by
that traffic (each FMA waits on a 64-byte line from L2), not by arithmetic.

Here the reduction variable ``j`` is split into blocks of ``kb`` coordinates, and the rows
of a group are swept once per block, so the block's slice of X (``kb`` rows of a panel of
up to half the vector registers) stays in cache while every row of the group uses it. Each
row keeps a cursor to its next stored entry (CSR columns are sorted), so finding a row's
entries in a block costs one compare per entry. Partial sums go to the output between
blocks (one load and one store of a panel per row and block, small next to the
~``ENTRIES`` entries of a row in a block); the epilogue runs at the last block.

The block's slice of X is first copied, panel by panel, into a buffer of the row group
(``_packed``): in place, its rows are a row of X apart (1 KB at N = 256), so the few dozen
row segments of a block share a handful of L1 sets and evict each other before the next
row of the group reads them again; packed, they are contiguous. The copy is one read of
the slice per group, block and panel. A failed allocation leaves the nest reading X in
place. Interleaved A/B on the 24 DLMC layers of ``benchmarks/kernels.py`` (AMD Zen 3,
AVX2, N=256): 1.27x geomean, every layer 1.18-1.40x; the same offsets computed per load
instead of a pointer to the entry's row segment: 0.87x (GCC kept the arithmetic in the
loop), a 16-byte-aligned buffer 1.00x (half the 32-byte loads split a cache line).

Sizes, from the cache and the data, at run time (the kernel computes ``kb`` from ``nnz``,
rows and columns; no rebuild): a block holds about ``ENTRIES`` entries per row (fewer make
the output traffic and loop overhead dominate), and its X slice is at most a quarter of L2.
Blocking is skipped when a block would cover over half of ``j`` (short rows: graphs, most
SuiteSparse matrices), and the kernel runs the unblocked nest. The same rule, applied once
per tensor (``long_rows``, part of the call key), decides which operands get kernels with
the blocked nest at all: it doubles the C build (0.3-0.4 s -> 0.55-0.65 s for SpMM here),
so operands with short rows keep the plain kernel.

Measured (``benchmarks/kernels.py --kernels dlmc``, N=256, 2 threads, in one run against
dense ``torch.matmul``): DLMC 70%-sparse transformer weights went from 0.94x to 1.31x dense
(geomean of 12; 512x2048 layers from 0.7-0.8x to 1.2-1.3x), 90%-sparse from 3.1x to 3.4x.
Short rows are never blocked, and their kernels run the unchanged nest (graph SpMM A/B,
old kernel vs new: 0.98-1.00x). Group size and entries per block were picked from kernel
A/Bs of 64-256 rows and 16-32 entries.

Data per call: A's entries and indices once per panel, X's block once per group of rows and
panel (read once more to pack it), each row's panel of the output twice per block.
"""
from __future__ import annotations

from ..formats.levels import Compressed, Dense
from .ir import (RANGE_END, Assign, Bin, Cond, Decl, For, Helper, If, Lit, Load, Sym, While,
                 block, rewrite)
from .iterate import LoopState, arr, horner
from .notation import presence
from .tiles import lane_loop, register_tiles

# Entries per row that a block should hold; rows per group sharing a block's slice of X.
ENTRIES = 16
GROUP_ROWS = 256
# The size of X, in L2s, from which blocking pays: a smaller X stays in L2 unblocked, and the
# blocked nest's passes per block only cost. Blocked against unblocked here (2 threads, AMD
# Zen 3, 512 KB L2; DLMC 70%/90% 512x2048 and 2048x512 layers, a random 80%-sparse
# 4096x1024): N = 8-32 1.2-4.8x slower, N = 64 0.83-1.8x, N = 128 0.81-1.34x, N = 256
# 0.59-0.94x; an X of 512 KB or more was blocked to advantage (0.59-1.0x) but for one case.
MIN_GATHERED_L2 = 1.0


def blockable(lw) -> int | None:
    """The operand whose reduction can be blocked (see the module docstring), or None."""
    plan = lw.plan
    if plan.block_cap is None or plan.mode != "dense" or lw.tile_var is None or \
            lw.tile_depth != 1 or len(lw.order) != 3 or lw.write_once != "flush" or \
            lw.balanced is None or len(lw.sparse) != 1:
        return None
    n = lw.balanced
    i, j, k = lw.order
    if lw.levels[n] != (i, j) or not _rows_of_columns(plan.formats[n]) or j in lw.out_vars:
        return None
    # Every term needs A (a product, not a union with a dense term).
    return n if presence(lw.body, lambda acc: acc.operand != n) is False else None


def block_coords(nnz, rows, cols, entries=ENTRIES):
    """Coordinates of ``j`` per block, a multiple of 16, for a matrix of ``rows`` x ``cols``
    with ``nnz`` entries: about ``entries`` entries per row and block. Works on ints and,
    through ``Formula``, builds the kernel's expression for it (one formula for both).

    Example:
        >>> block_coords(314572, 512, 2048)   # DLMC 70%-sparse 512x2048: 614 per row
        64
    """
    per_row = imax(nnz // imax(rows, 1), 1)
    return imax((entries * cols // per_row + 15) // 16 * 16, 16)   # never 0 (no columns)


def blocks_pay(kb, cols, cap):
    """Whether to block: at least two blocks, each block's slice of X within ``cap`` rows."""
    return (kb * 2 <= cols) & (kb <= cap)


def long_rows(format, shape, nnz: int, cap: int | None) -> bool:
    """Whether a CSR-like operand (``format`` of two levels, dense then compressed) of
    ``shape`` with ``nnz`` entries has rows long enough for cache blocking, given the block
    cap (``kernel.block_cap``; None: no blocking on this machine).

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> long_rows(as_format("csr", 2), (512, 2048), 314572, 512)
        True
        >>> long_rows(as_format("csr", 2), (10000, 10000), 50000, 512)   # a graph
        False
    """
    if cap is None or not _rows_of_columns(format) or format.blocksize is not None:
        return False
    rows, cols = format.storage_dims(shape)
    return bool(blocks_pay(block_coords(nnz, rows, cols), cols, cap))


def _rows_of_columns(format) -> bool:
    """Two levels, dense rows over compressed columns in order (CSR-like, any mode order):
    the blocked nests (here and ``sblock.py``) find a row's entries of a block by walking its
    columns up to the block's end, which in an unordered row would skip or misplace some."""
    levels = format.levels
    return len(levels) == 2 and isinstance(levels[0], Dense) and \
        isinstance(levels[1], Compressed) and levels[1].ordered


class Formula:
    """An IR expression the integer formulas here (and ``sblock``'s) take in place of an
    int: run on ints they give a number (``st.explain``), on Formulas the kernel's
    expression for the same number."""

    def __init__(self, node):
        self.node = node

    def _bin(self, op, other, swap=False):
        other = other.node if isinstance(other, Formula) else Lit(other)
        return Formula(Bin(op, other, self.node) if swap else Bin(op, self.node, other))

    def __add__(self, o): return self._bin("+", o)
    def __mul__(self, o): return self._bin("*", o)
    def __rmul__(self, o): return self._bin("*", o, swap=True)
    def __floordiv__(self, o): return self._bin("/", o)
    def __rfloordiv__(self, o): return self._bin("/", o, swap=True)
    def __le__(self, o): return self._bin("<=", o)
    def __lt__(self, o): return self._bin("<", o)
    def __and__(self, o): return self._bin("&&", o)


def imax(a, b):
    """``max`` of ints or Formulas."""
    return _extreme("max", a, b)


def imin(a, b):
    """``min`` of ints or Formulas."""
    return _extreme("min", a, b)


def _extreme(op, a, b):
    if isinstance(a, Formula) or isinstance(b, Formula):
        return Formula(a.node if isinstance(a, Formula) else Lit(a))._bin(op, b)
    return max(a, b) if op == "max" else min(a, b)


def call_sizes(lw, n) -> tuple:
    """``(stored entries, rows, columns)`` of this call's CSR-like operand ``n``, as
    Formulas (loop order i, j, ...)."""
    i, j = lw.order[:2]
    pos = arr(n, "pos1")
    return (Formula(Bin("-", Load(pos, Sym(f"n_{i}")), Load(pos, Lit(0)))),
            Formula(Sym(f"n_{i}")), Formula(Sym(f"n_{j}")))


def block_size(lw, n, entries=ENTRIES):
    """IR for ``kb`` of this call's operand ``n`` (``block_coords``)."""
    return block_coords(*call_sizes(lw, n), entries).node


def worth_blocking(lw, n):
    """IR condition for this call: ``blocks_pay``, and X (``n_j`` x ``n_k`` values) at
    least ``MIN_GATHERED_L2`` of L2 (a block cap is a quarter of L2 in rows of the widest
    panel)."""
    _, j, k = lw.order
    kb, cols = Formula(block_size(lw, n)), Formula(Sym(f"n_{j}"))
    plan = lw.plan
    floor = int(MIN_GATHERED_L2 * 4 * plan.block_cap * plan.tile * plan.panels[0])
    return (blocks_pay(kb, cols, plan.block_cap) &
            (Formula(Lit(floor)) <= cols * Formula(Sym(f"n_{k}")))).node


def k_blocked(lw, body: list) -> list:
    """``body`` (the lowered loop nest) behind a run-time choice between it and the blocked
    nest, when ``lw``'s kernel can be blocked; else ``body`` itself."""
    n = blockable(lw)
    if n is None:
        return body
    loop = body[-1]
    assert len(body) == 1 and isinstance(loop, For) and loop.parallel is not None
    lw.k_blocked = True
    lw.plan.notes.append(
        f"reduction {lw.order[1]} blocked by coordinate when rows are long: about {ENTRIES} "
        f"entries per row and block, groups of {GROUP_ROWS} rows, panels of "
        f"{'/'.join(str(lw.plan.tile * f) for f in lw.plan.panels)} values, a block's slice "
        f"of the dense operand at most {lw.plan.block_cap} rows (a quarter of L2)"
        f"{', packed per row group' if _gathered(lw) is not None else ''}")
    # (the nest computes ``kb`` again: an outlined parallel loop reads parameters only)
    return [If(worth_blocking(lw, n), block(blocked_nest(lw, n, loop.parallel)), block(body))]


def blocked_nest(lw, n, parallel) -> For:
    """The row-group loop of the blocked kernel (``parallel``: the unblocked row loop's)."""
    i, j, k = lw.order
    pos, crd = arr(n, "pos1"), arr(n, "crd1")
    i0, i_end, cur = lw.fresh("i0_"), lw.fresh("iend"), lw.fresh("cur")
    kb, blocks = lw.fresh("kb"), lw.fresh("nb")
    b, j1 = lw.fresh("b"), lw.fresh("j1_")
    p, e = lw.fresh(f"p{n}_"), lw.fresh(f"e{n}_")
    out_at = Load("out_vals", horner(lw.out_vars))   # (i, k) in either order
    rel = Bin("-", Sym(i), Sym(i0))

    def rows(body):
        return For(i, Sym(i0), Sym(i_end), block(body))

    def panel(tile):
        st = LoopState(lw).copy(tile=tile)
        st.pos[n] = Sym(p)
        acc = Load(tile[2], Sym(tile[3]))
        # The epilogue (bias, activation) applies once the last block is summed.
        final = lane_loop(k, tile, [lw.write_out(acc, st, "flush")])
        partial = lane_loop(k, tile, [Assign(out_at, acc)])
        flush = partial if final == partial else If(
            Bin(">=", Sym(j1), Sym(f"n_{j}")), block(final), block(partial))
        entry = [Decl("idx", j, Load(crd, Sym(p))),
                 lane_loop(k, tile, lw.store(lw.value(lw.summand, st), st)),
                 Assign(Sym(p), Bin("+", Sym(p), Lit(1)))]
        packing = []
        if gathered is not None:   # the block's slice of the dense operand, packed
            packing, entry = _packed(lw, gathered, tile, Bin("*", Sym(b), Sym(kb)), Sym(j1),
                                     entry)
        row = [Decl("val[]", tile[2], Lit(tile[1].value if isinstance(tile[1], Lit) else
                                          lw.plan.tile)),   # (a partial tile: masked lanes)
               If(Bin(">", Sym(b), Lit(0)), block(lane_loop(k, tile, [Assign(acc, out_at)]))),
               Decl("idx", p, Load(cur, rel)),
               Decl("idx", e, Load(pos, Bin("+", Sym(i), Lit(1)))),
               While(Bin("&&", Bin("<", Sym(p), Sym(e)),
                         Bin("<", Load(crd, Sym(p)), Sym(j1))), block(entry)),
               Assign(Load(cur, rel), Sym(p)), flush]
        return [rows([Assign(Load(cur, rel), Load(pos, Sym(i)))]),
                For(b, Lit(0), Sym(blocks), block(   # block b: j in [b kb, (b + 1) kb)
                    Decl("idx", j1, Bin("*", Bin("+", Sym(b), Lit(1)), Sym(kb))),
                    *packing, rows(row)))]

    gathered = _gathered(lw)
    widths = tuple(lw.plan.tile * f for f in lw.plan.panels)
    tiles = register_tiles(k, widths, lw.fresh, panel, None, declare=False)
    pack = ([Helper("alloc_pack", (Bin("*", Sym(kb), Lit(widths[0])),),
                    defines=("xpack", "xpack_raw"))] if gathered is not None else [])
    body = block(Decl("idx", i_end, Bin("min", Bin("+", Sym(i0), Lit(GROUP_ROWS)),
                                        Sym(RANGE_END))),
                 Decl("idx", kb, block_size(lw, n)),
                 Decl("idx", blocks, Bin("/", Bin("+", Sym(f"n_{j}"), Bin("-", Sym(kb), Lit(1))),
                                         Sym(kb))),
                 Decl("idx[]", cur, Lit(GROUP_ROWS)), *pack, tiles,
                 *([Helper("free_pack", uses=("xpack_raw",))] if pack else []))
    return For(i0, Lit(0), Sym(f"n_{i}"), body, parallel, step=GROUP_ROWS)


def gathered_operand(lw) -> int | None:
    """The dense operand whose rows the stored entries select (``X[j, k]`` of loop order
    i, j, k: SpMM's X, SDDMM's Y), or None."""
    _, j, k = lw.order
    found = [acc.operand for acc in lw.plan.assignment.expr.accesses()
             if acc.indices == (j, k) and lw.plan.formats[acc.operand].is_dense]
    return found[0] if found else None


def _gathered(lw) -> str | None:
    """The values array of ``gathered_operand``, or None."""
    n = gathered_operand(lw)
    return None if n is None else arr(n, "vals")


def _packed(lw, x, tile, j0, j1, entry):
    """``(statements, entry')``: copy the block's rows ``[j0, j1)`` of ``x`` in the tile's
    columns into the group's buffer, row after row (the operand's rows are ``n_k`` apart:
    at 1 KB, a block's slice of a few dozen rows falls into a few L1 sets and evicts
    itself), and ``entry`` reading the buffer instead (or ``x`` itself, when the buffer
    could not be allocated) through a pointer to the entry's row segment."""
    _, j, k = lw.order
    k0, width = Sym(tile[0]), tile[1]
    n_j, n_k = Sym(f"n_{j}"), Sym(f"n_{k}")
    base, stride, first, col = (lw.fresh(v) for v in ("xb", "xs", "xj", "xk"))
    packed = Sym("xpack")
    stmts = [Helper("pack_rows", (Bin("-", Bin("min", j1, n_j), j0), width, Sym(x), j0, n_k,
                                  k0), uses=("xpack",)),
             # packed: row j at xpack + (j - j0) width; in place: x + j n_k + k0
             Decl("val*", base, Cond(packed, packed, Sym(x))),
             Decl("idx", stride, Cond(packed, width, n_k)),
             Decl("idx", first, Cond(packed, j0, Lit(0))),
             Decl("idx", col, Cond(packed, Lit(0), k0))]
    row = lw.fresh("xrow")
    at_row = Decl("val*", row, Bin("+", Sym(base), Bin(
        "+", Bin("*", Bin("-", Sym(j), Sym(first)), Sym(stride)), Sym(col))))

    def visit(node):   # x[k + j n_k] -> row[k - k0]
        if isinstance(node, Load) and node.array == x:
            return Load(row, Bin("-", Sym(k), k0))
        return node
    decl_j, *rest = entry   # (the entry's first statement declares j)
    return stmts, [decl_j, at_row, *(rewrite(s, visit) for s in rest)]
