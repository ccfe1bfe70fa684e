"""Cache blocking of a sampled product (SDDMM) by column ranges.

SDDMM ``out[i,j] = A[i,j] * sum_k X[i,k] Y[j,k]`` computes, for every stored entry of A,
an inner product with the row of the dense ``Y`` at the entry's column. The rows of pruned
weights (hundreds of entries over a few thousand columns) each touch most of Y, so once Y
outgrows L2 every entry's row of Y comes from L3: here (AMD Zen 3, 512 KB L2) the DLMC
512x2048 layers at K = 256 (Y: 2 MB) took 11-14 ns per entry against 8-10 ns for the
2048x512 layers (Y: 512 KB) of the same sparsity.

Here the rows of a thread's range are taken in groups of ``GROUP_ROWS``, and each group
sweeps A's columns in blocks of ``jb``, so a block's slice of Y (``jb`` rows) comes from L3
once per group and from L2 for every other row of the group. A row keeps a cursor to its
first entry not yet computed (CSR columns are sorted); the inner products of ``jam_sums``
run unchanged: each of its loops (eight side by side, four, one at a time) continues while
the first of its entries lies in the block (``STRADDLE``; before, while the last did). No
partial sums: an entry is computed whole, in the block of its column or, the last few of a
run of side-by-side sums, in the block before (the reduction over ``k`` is inside). The
price is X's row, read once per block instead of once per row, and the loop overhead of
shorter runs of entries: ``jb`` is sized so a block holds about ``ENTRIES`` entries of a
row (with fewer, the remainders of the side-by-side loop dominate), but never more rows of
Y than fill half of L2 (``columns_per_block``): by entries alone the 90%-sparse 512x2048
layers took blocks of 656 columns, at K = 256 656 KB of Y, more than the L2 that should
hold them. Where the columns that fit would hold under ``MIN_ENTRIES`` entries of a row (K
in the thousands), the blocks stay at their size by entries.

Since then the blocks shrink further, to the rows of Y that fill about two thirds of the L1
data cache (``kernel.sampled_block_bytes``: 32 KB with a 48 KB L1d), so a block's rows are
read from L2 once per group and from L1 for the rest of it, as long as a block still holds
``NEAR_ENTRIES`` entries of a row and ``NEAR_BYTES`` of Y's rows for it to read (else it
holds that many; the half-L2 cap and its ``MIN_ENTRIES`` floor still bound the large-K
case), and the blocks are evened out over the columns (no runt block at the end). On AMD
Zen 5 (1 MB L2), against blocking past half of L2 (``benchmarks/variants.py --knob
sampled_block_bytes=524288,65536 --kernel sddmm``, 24 DLMC masks, two runs; blocks then
filled the L1d and a third, with at least 8 entries a row): 70%-sparse masks geomean
1.14-1.18x at K = 64 (cases 1.05-1.30x) and 1.12-1.29x at K = 256 (0.96-1.44x); 90%-sparse
ones 1.01-1.05x and 0.99x; all 24 1.07-1.12x (K = 64) and 1.06-1.13x (K = 256). Then two
thirds of L1d, the 6 KB floor and even blocks against that (``--knob
sampled_block_bytes=65536,32768 --knob sblock.NEAR_BYTES=0,6144`` with evening on and off,
two runs each): 70%-sparse masks 1.03-1.04x at K = 64 and 1.08x at K = 256, 90%-sparse
1.00-1.01x; all 24 1.02x and 1.04x, none below 0.98x. On random masks of other shapes
(777-3000 rows and columns, 10-30% dense, one run each) it ranged 0.94-1.20x (geomean
1.02x), evening alone 0.97-1.03x: at that noise, evening is kept for shapes whose last
block would hold a few columns, not for a measured gain.

The choice is made per call inside the kernel: blocked when Y is larger than a block's
budget and there are at least two blocks. Before both, with AVX-512, comes the nest of
``hold.py`` (a row's slice of X held in registers, each entry's inner product straight
through its row of Y) when K is a whole number of its slices: it sweeps the same blocks, or
one block of every column where blocking would not pay. Kernels get the blocked nest only
for operands with long rows (``kblock.long_rows``; graphs' short rows never pay for the
build); kernels for short rows get the held nest alone, in one block (``held_rows``).

Measured (whole calls, 2 threads, interleaved A/B in one process against the unblocked
kernel, the 48 DLMC transformer SDDMM cases of ``benchmarks/kernels.py``, 70% and 90%
sparse, K = 64 and 256; 512 KB L2): 512x2048 masks at K = 256 1.18-1.40x (70%) and
1.12-1.13x (90%), at K = 64 (Y: 512 KB) 1.00-1.19x; 512x512 and 2048x512 masks at K = 256
(Y: 512 KB, blocked) 0.95-1.13x; the rest (unblocked) 0.99-1.05x; 1.057x geomean. Finding
each block's end by binary search instead of the compares in the loops was 5-10% slower;
16-96 entries per block and groups of 32-128 rows were within a few percent of each other.
The half-L2 cap on a block's rows of Y (same cases, whole calls, two runs): 512x2048 masks
at K = 256 (90%) 1.04-1.09x, the 512x512 and 2048x512 ones it newly blocks at K = 256 (Y of
512 KB) 0.98-1.03x, the rest unchanged (their blocks fit already); in kernel-only C runs,
fixed blocks of 256-512 columns and caps of 192 or 256 KB were within 1% of each other. At
larger K (whole calls, one 512x2048 and one 512x512 layer at 90%, one 512x2048 at 70%, K =
256-2048): 0.97-1.14x against blocks by entries alone; the half-L2 cap without the
``MIN_ENTRIES`` floor lost up to 18% at K = 2048 (512x512: 16 blocks of 3 entries a row).

Data per call: A's entries once, Y's block once per group from L2 or L3, X's row once per
block.
"""
from __future__ import annotations

from dataclasses import replace

from .hold import Held, held_sum, held_sweep, single_slice
from .ir import RANGE_END, Assign, Bin, Block, Cond, Decl, For, If, Lit, Load, Sym, While, block
from .iterate import arr
from .jam import sum_widths
from .kblock import Formula, block_coords, call_sizes, gathered_operand, imax, imin

# Entries of a row per column block; rows per group sharing a block's slice of Y.
ENTRIES = 64
# Fewest entries of a row a block is cut to for L2's sake: one group of side-by-side sums
# (eight with AVX2); below that, blocking costs reads of X's row and saves no reads of Y.
MIN_ENTRIES = 8
# Fewest entries of a row a block holds when its rows of Y would fill more than the budget
# near L1 (``kernel.sampled_block_bytes``). On Zen 5 (then 64 KB) the 90%-sparse DLMC masks
# at K = 256 were the cases it decided; against 12, ``benchmarks/variants.py --knob
# sblock.NEAR_ENTRIES=12,8,16,20 --kernel sddmm --inner 256`` gave 0.99x (8), 1.00x (16),
# 1.00x (20; 0.95x on the 70%-sparse masks): flat, within the ~2% that a rebuilt but
# otherwise identical kernel moves. Since runs of sums may straddle blocks (``STRADDLE``),
# 8 with ``GROUP_ROWS`` 128, against 12 with 64 (``--knob sblock.GROUP_ROWS=64,128,128
# --knob sblock.NEAR_ENTRIES=12,12,8``, two runs): K = 256 1.030-1.032x (12 with 128:
# 1.014-1.020x), K = 64 (decided by ``NEAR_BYTES``) 1.021-1.023x, no case below 0.99x.
NEAR_ENTRIES = 8
# ... and fewest bytes of the gathered operand's rows a block gives a row to read, where that
# asks for more entries: 24 entries at K = 64 (256-byte rows), the 12 above from K = 128 on.
# With blocks budgeted at two thirds of L1d (32 KB: ``kernel.sampled_block_bytes``), the
# 90%-sparse DLMC masks at K = 64 need it (blocks of 128 columns, 13 entries a row: 0.86-0.89x
# against blocks of 256), and 6 KB kept them at 1.00x.
NEAR_BYTES = 6144
# Rows sharing a pass over the blocks (above; 64 before). Their rows of X, read once per
# block, fit L2 up to K = 1024 on Zen 5 (128 KB at K = 256); past that they come from L3.
GROUP_ROWS = 128
# A run of side-by-side sums may end past its block: the remainders (four, then one at a
# time) come once per row, not once per row and block, for the price of up to seven rows of
# the gathered operand read from the next block's columns. On AMD Zen 5 (``benchmarks/
# variants.py --knob sblock.STRADDLE=0,1 --kernel sddmm``, 24 DLMC masks, three runs each):
# K = 64 1.014-1.028x (70%-sparse masks 1.04-1.06x), K = 256 1.004-1.016x (70%: 1.01-1.03x),
# the 90%-sparse masks 0.98-1.02x.
STRADDLE = True


def column_blocked(body: Block, lw, copies: int, value_bytes: int, l2: int,
                   near: int, held: int | None = None) -> Block:
    """``body`` (a sampled kernel's nest after ``jam.jam_sums`` with ``copies`` sums side by
    side) behind a run-time choice between it and the column-blocked nest (see the module
    docstring), when its shape allows; else ``body`` itself. ``value_bytes``: the size of a
    value; ``l2``: the L2 cache size in bytes; ``near``: what a block's rows of the gathered
    operand should fill (``kernel.sampled_block_bytes``). ``held``: values per register-held
    slice of the row's operand (``hold.py``; None: none), for a nest taken before both when
    the inner dimension is a whole number of slices."""
    found = _sampled_rows(body, lw, copies)
    if found is None:
        return body
    loop, gathered = found
    _, j, k = lw.order
    n_j, n_k = Sym(f"n_{j}"), Sym(f"n_{k}")
    gathered_bytes = Bin("*", Bin("*", n_j, n_k), Lit(value_bytes))

    def worth(jb):   # blocking pays: the gathered rows outgrow ``near``, two blocks at least
        return Bin("&&", Bin(">", gathered_bytes, Lit(near)),
                   Bin("<=", Bin("*", Lit(2), jb), n_j))
    columns = _columns_ir(lw, value_bytes, l2, near)
    lw.column_blocked = gathered
    lw.plan.notes.append(
        f"entries taken in blocks of columns {j} (the block's rows of operand {gathered} "
        f"filling about {near >> 10} KB, {NEAR_ENTRIES}-{ENTRIES} entries of a row and at "
        f"least {NEAR_BYTES >> 10} KB of those rows; groups of {GROUP_ROWS} rows) when "
        f"operand {gathered}'s rows over {j} exceed {near >> 10} KB")
    nest = If(worth(columns), block(_blocked_nest(loop, lw, columns, _jammed_sweep(loop, lw))),
              body)
    return _with_held(block(nest), loop, lw, held, columns, worth)


def held_rows(body: Block, lw, copies: int, held: int) -> Block:
    """``body`` (as for ``column_blocked``, in a kernel for short rows: no column blocks)
    behind the nest of ``hold.py`` in one block of every column, when its shape allows."""
    found = _sampled_rows(body, lw, copies)
    if found is None:
        return body
    return _with_held(body, found[0], lw, held, Bin("max", Sym(f"n_{lw.order[1]}"), Lit(1)))


def _with_held(nest: Block, loop: For, lw, held: int | None, columns, worth=None) -> Block:
    """``nest`` behind the nest of ``hold.py`` (slices of ``held`` values; None: none) in
    blocks of ``columns`` (one block of every column where ``worth`` of the width fails),
    taken when the inner dimension is a whole number of slices; ``nest`` itself where the
    sum does not split (``hold.held_sum``)."""
    parts = held_sum(loop.body.stmts[-1]) if held else None
    if parts is None:
        return nest
    k = parts.k
    n_k = Sym(f"n_{k}")
    whole = Bin("&&", Bin(">", n_k, Lit(0)), Bin("==", Bin("%", n_k, Lit(held)), Lit(0)))
    most = 1 if single_slice(parts) else None
    if most:
        whole = Bin("&&", whole, Bin("<=", n_k, Lit(held)))
    lw.held = Held(held, most, gathered_operand(lw))
    lw.plan.notes.append(
        f"when n_{k} is a multiple of {held}: each row's {held} values of {k} at a time in "
        f"registers, its entries' inner products one after another over them" +
        (", in the same column blocks (or one block)" if worth is not None else ""))
    crd = arr(lw.balanced, "crd1")

    def sweep(p, e, j1, at):
        go = Bin("&&", Bin("<", p, Sym(e)), Bin("<", Load(crd, p), Sym(j1)))
        return [If(go, block(held_sweep(parts, p.name, go, held, lw.fresh))), Assign(at, p)]
    return block(If(whole, block(_blocked_nest(loop, lw, columns, sweep, worth)), nest))


def columns_per_block(nnz, rows, cols, depth, value_bytes: int, l2: int, near: int):
    """Columns of a block: as many as keep the block's rows of the gathered operand
    (``depth`` values each) within ``near`` bytes, but enough to hold ``NEAR_ENTRIES``
    entries of a row (and ``NEAR_BYTES`` of the gathered rows) and no more than hold about
    ``ENTRIES`` (``kblock.block_coords``); where even ``MIN_ENTRIES`` entries' rows would not
    fit in half of L2 (K in the thousands), about ``ENTRIES`` entries. Then evened out: the
    nearest number of blocks to that width, each ``ceil(cols / blocks)`` wide, so no runt
    block at the end costs a pass over every row for a few entries. At least 1. Ints, or
    ``kblock.Formula`` objects for the kernel's expression (one formula for both).

    Example:
        >>> l2, near = 1 << 20, 32 << 10   # a 1 MB L2 and a 48 KB L1d, float32
        >>> columns_per_block(314572, 512, 2048, 256, 4, l2, near)  # 70%: 32 KB of rows
        32
        >>> columns_per_block(104857, 512, 2048, 256, 4, l2, near)  # 90%: 8 entries a row
        79
        >>> # 80 columns for 8 entries, evened: 26 blocks of 79
        >>> columns_per_block(104857, 512, 2048, 64, 4, l2, near)   # 6 KB of 256 B rows:
        228
        >>> # 240 columns for 24 entries, evened: 9 blocks of 228, not 8 of 240 and one of 128
        >>> columns_per_block(104857, 512, 2048, 4096, 4, l2, near)  # 8 entries: 1.3 MB
        683
    """
    by_entries = block_coords(nnz, rows, cols, ENTRIES)
    row_bytes = imax(depth, 1) * value_bytes
    fewest = block_coords(nnz, rows, cols, imax(NEAR_BYTES // row_bytes, NEAR_ENTRIES))

    def rows_within(size):   # rows of the gathered operand in ``size`` bytes, by 16, >= 16
        return imax(size // row_bytes // 16 * 16, 16)
    fits = rows_within(near)
    too_few = rows_within(l2 // 2) < block_coords(nnz, rows, cols, MIN_ENTRIES)
    # ``by_entries if too_few else min(by_entries, max(fits, fewest))``, as arithmetic (a
    # comparison is 0 or 1) so the same line builds the kernel's expression
    jb = imin(by_entries, imax(imax(fits, fewest), too_few * by_entries))
    blocks = imax((cols + jb // 2) // jb, 1)
    return imax((cols + blocks + -1) // blocks, 1)


def _columns_ir(lw, value_bytes: int, l2: int, near: int):
    """IR of ``columns_per_block`` for this call."""
    depth = Formula(Sym(f"n_{lw.order[2]}"))
    return columns_per_block(*call_sizes(lw, lw.balanced), depth, value_bytes, l2, near).node


def describe(rows, gathered, l2: int, near: int) -> str:
    """Whether a call on CSR-like ``rows`` that gathers rows of dense ``gathered`` runs the
    blocked nest (the kernel's own test, for ``st.explain``).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.ones(4, 512), format="csr")
        >>> describe(A, torch.zeros(512, 256), 1 << 20, 64 << 10)
        'this call: blocks of 64 columns (operand of 512 KB, over 64 KB)'
    """
    n_i, n_j = rows.format.storage_dims(rows.shape)
    size = gathered.numel() * gathered.element_size()
    jb = columns_per_block(rows.nnz, n_i, n_j, gathered.shape[-1], gathered.element_size(),
                           l2, near)
    if size <= near:
        return f"this call: unblocked (operand of {size >> 10} KB, within {near >> 10} KB)"
    if 2 * jb > n_j:
        return f"this call: unblocked (blocks of {jb} columns would not make two)"
    return f"this call: blocks of {jb} columns (operand of {size >> 10} KB, over " \
           f"{near >> 10} KB)"


def _sampled_rows(body: Block, lw, copies: int):
    """``(row loop, gathered operand)`` when ``body`` is one balanced parallel loop over
    the rows of a CSR-like operand whose body is the jammed side-by-side loops (``copies``
    sums, then half as many where ``jam_sums`` adds that level) and their remainder, and a
    dense operand is read by rows ``[j, k]`` (loop order i, j, k)."""
    if len(lw.order) != 3 or lw.balanced is None or len(body.stmts) != 1:
        return None
    loop = body.stmts[0]
    if not isinstance(loop, For) or loop.parallel is None or loop.step != 1:
        return None
    stmts = loop.body.stmts
    if len(stmts) < 3 or not isinstance(stmts[0], Decl):
        return None
    row, *jammed, rest = stmts
    n = lw.balanced
    pos = arr(n, "pos1")
    end = Load(pos, Bin("+", Sym(row.name), Lit(1)))
    widths = sum_widths(copies)
    if not (isinstance(rest, For) and rest.step == 1 and rest.end == end and
            rest.parallel is None and len(jammed) == len(widths) and
            jammed[0].start == Load(pos, Sym(row.name)) and
            all(isinstance(m, For) and m.var == rest.var and m.step == w and
                m.end == Bin("-", end, Lit(w - 1)) and m.parallel is None
                for m, w in zip(jammed, widths))):
        return None
    gathered = gathered_operand(lw)
    return None if gathered is None else (loop, gathered)


def _jammed_sweep(loop: For, lw):
    """The per-row sweep of ``_blocked_nest`` by the jammed loop bodies of ``loop`` (the
    unblocked nest): each of its loops (widest first, then the one-at-a-time remainder)
    while its entries are in the row and the block (``STRADDLE``)."""
    _, *jammed, rest = loop.body.stmts
    crd = arr(lw.balanced, "crd1")

    def sweep(p, e, j1, at):
        out = []
        for m in (*jammed, rest):
            last = Bin("+", p, Lit(m.step - 1)) if m.step > 1 else p
            if STRADDLE:   # while its first entry is in the block and its last in the row
                go = Bin("&&", Bin("<", last, Sym(e)), Bin("<", Load(crd, p), Sym(j1)))
            else:          # while its last entry is in the block
                go = Bin("&&", Bin("<", last, Sym(e)), Bin("<", Load(crd, last), Sym(j1)))
            out.append(While(go, block(*m.body.stmts, Assign(p, Bin("+", p, Lit(m.step))))))
        return [*out, Assign(at, p)]
    return sweep


def _blocked_nest(loop: For, lw, columns, sweep, worth=None) -> For:
    """The row-group loop: cursors to each row's first entry, then per block of columns
    each row's entries in it, by ``sweep(p, e, j1, at)`` (statements for one row: ``p`` its
    cursor, declared at ``at``; ``e`` its end; ``j1`` the block's end; they leave ``at`` at
    the row's first entry past the block). ``columns``: the block width; with ``worth`` (a
    test of a width), one block of every column where it fails."""
    i, j, _ = lw.order
    row, main = loop.body.stmts[0], loop.body.stmts[1]
    n = lw.balanced
    i0, i_end, cur = lw.fresh("i0_"), lw.fresh("iend"), lw.fresh("cur")
    jb, blocks, b, j1, e = (lw.fresh(x) for x in ("jb", "nb", "b", "j1_", "e"))
    n_j = Sym(f"n_{j}")
    p = Sym(main.var)
    at = Load(cur, Bin("-", Sym(i), Sym(i0)))

    def rows(*stmts):
        return For(i, Sym(i0), Sym(i_end), block(row, *stmts))

    width = [Decl("idx", jb, columns)]
    if worth is not None:
        width.append(Assign(Sym(jb), Cond(worth(Sym(jb)), Sym(jb), Bin("max", n_j, Lit(1)))))
    body = block(Decl("idx", i_end, Bin("min", Bin("+", Sym(i0), Lit(GROUP_ROWS)),
                                        Sym(RANGE_END))),
                 *width,
                 Decl("idx", blocks, Bin("/", Bin("+", n_j, Bin("-", Sym(jb), Lit(1))),
                                         Sym(jb))),
                 Decl("idx[]", cur, Lit(GROUP_ROWS)),
                 rows(Assign(at, main.start)),
                 For(b, Lit(0), Sym(blocks), block(   # block b: columns [b jb, (b + 1) jb)
                     Decl("idx", j1, Bin("*", Bin("+", Sym(b), Lit(1)), Sym(jb))),
                     rows(Decl("idx", e, Load(arr(n, "pos1"), Bin("+", Sym(row.name), Lit(1)))),
                          Decl("idx", main.var, at),
                          *sweep(p, e, j1, at)))))
    return replace(loop, var=i0, body=body, step=GROUP_ROWS)
