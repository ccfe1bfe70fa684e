"""Sparse-result assembly, for the lowerer (``lower.py``): a sparse result is built in two
passes over the same loop nest. The count pass finds each slice's entry count (a slice is one
iteration of the outer loop: a row of a CSR result) and turns the counts into running totals
(``running_totals``); the fill pass writes every slice's entries from its offset on, with a
slot cursor per slice held in a register (``with_outer``).

Where later loops write coordinates that an outer reduction revisits (SpGEMM ``ik`` over a
reduction ``j``), entries meet in a row workspace first: a dense array over the workspace's
cells (values, a mark per cell holding the stamp of the last row that touched it, and a
list of touched cells) or, past ``MAX_WORKSPACE`` cells, a hash table. After the row, its
cells are ordered and emitted (``flush_workspace``); a fill row the count pass found at
least half full is emitted by scanning the marks instead, a full one without marks at all,
and a count row stops once every cell is marked (``dense_row_passes``). Where the products
of a row gather whole rows of one operand (SpGEMM's rows of B) that are long for their
width, both passes take a row's cells from bitmaps of those rows instead (``RowBits``).

Data per call (dense workspace): the count pass reads every product's coordinate and
writes one mark; the fill pass also adds one value per product, and writes one coordinate
and one value per emitted entry. With row bitmaps, each pass first reads the gathered
level once to build them (a word per 64 cells of each gathered row); the count pass then
reads one bitmap per gathered row instead of the products' coordinates, and the fill pass
writes no marks.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..formats.levels import Compressed, Dense
from .ir import (Assign, Bin, Decl, For, Helper, If, Lit, Load, Node, Sym, While,
                 WORKSPACE_NAMES, block)
from .iterate import arr, dim, horner

# Row bitmaps pay when a gathered row's entries (a mark each, ~2.5 cycles) outweigh a fixed
# cost of about ROW_BITS_FIXED entries plus one entry per ROW_BITS_WORDS_PER_ENTRY 64-bit
# words OR-ed: on average at least 4 + words / 5 entries a row. Whole-call A/B, SpGEMM A@A
# (compiler.py, 55 matrices): DLMC 90% 1.5-1.7x, 70% 1.1-1.2x, 98% 1.3x; bcsstk13 1.8x,
# G51 1.5x, dwt_992 1.4x; a rule of one entry per word missed G51, one of a half or a
# quarter also took short rows that lose (bcspwr05 0.72x, 494_bus, jagmesh7, olm500 0.89x).
# The table is kept to ROW_BITS_MAX_WORDS words per stored entry of the gathered level and
# to ROW_BITS_MAX_TABLE words (64 MiB) in all: a temporary no larger than the operand.
ROW_BITS_FIXED = 4
ROW_BITS_WORDS_PER_ENTRY = 5
ROW_BITS_MAX_WORDS = 2
ROW_BITS_MAX_TABLE = 1 << 23


@dataclass(frozen=True)
class RowBits:
    """Bitmaps of the rows the products of a result row gather (level ``level`` of operand
    ``operand``: SpGEMM's rows of B), one bit per workspace cell, built once per call.

    A result row's cells are the union of the gathered rows' coordinates, so the count pass
    ORs each gathered row's bitmap into the thread's ``ws_bits`` and counts its bits
    (``ws_words`` word operations per gathered row instead of a mark per entry), and the
    fill pass adds values without marks and lists the cells by walking the bits in order
    (no list to sort). The kernel builds the bitmaps only when the gathered rows are long
    enough for their width (``ROW_BITS_FIXED``, ``ROW_BITS_WORDS_PER_ENTRY``) and the table
    small enough (``ROW_BITS_MAX_WORDS``, ``ROW_BITS_MAX_TABLE``), and otherwise runs the
    marked passes.
    ``positions``: the level's parent position count (its bitmap rows)."""

    operand: int
    level: int
    positions: Node

    def build(self) -> Helper:
        """The call's bitmaps, before the row loop (``st_bits`` says whether built)."""
        pos, crd = arr(self.operand, f"pos{self.level}"), arr(self.operand, f"crd{self.level}")
        rule = (ROW_BITS_FIXED, ROW_BITS_WORDS_PER_ENTRY, ROW_BITS_MAX_WORDS,
                ROW_BITS_MAX_TABLE)
        return Helper("row_bits_alloc", (Sym(pos), Sym(crd), self.positions,
                                         *map(Lit, rule)),
                      ("ws_size", pos, crd), ("st_bits", "st_rowbits", "st_words"))


class Assembly:
    """The lowerer's emission of sparse results (a mixin of ``lower._Lowerer``, whose
    ``plan``, ``out_vars``, ``ws_*``, ``emitting`` and loop builders it uses)."""

    def workspace_store(self, value, st):
        """Add ``value`` into the row workspace's cell of the current point (count mode: only
        note the cell)."""
        counting = self.plan.mode == "count"
        at = Sym("ws_at")
        out = [Decl("idx", "ws_at", horner(self.ws_vars))]
        if self.ws_kind == "hash":
            return out + [Helper("hash_mark", (at,), ("ws",)) if counting else
                          Helper("hash_add", (at, value), ("ws",))]
        # Marks hold the stamp of the row that last touched a cell, so rows never reset
        # them. Branch-free ("new cell?" is a coin flip the branch predictor loses): the
        # cell is written to the list's next slot and the count advances on a new cell;
        # values are zero until touched (emission clears them).
        listed = [Assign(Sym("ws_n"), Bin("+", Sym("ws_n"), Bin(
                      "!=", Load("ws_mark", at), Sym("ws_stamp")))),
                  Assign(Load("ws_mark", at), Sym("ws_stamp"))]
        if counting:
            return out + listed
        if st.unmarked:     # a full row (``dense_row_passes``): all cells emitted, just add
            return out + [Assign(Load("ws_vals", at), value, "+=")]
        if st.marks_only:   # a dense row (``dense_row_passes``): mark and add, no list
            return out + [listed[1], Assign(Load("ws_vals", at), value, "+=")]
        return out + [Assign(Load("ws_list", Sym("ws_n")), at), *listed,
                      Assign(Load("ws_vals", at), value, "+=")]

    def emit(self, value, coords, st):
        """Append one output entry (count mode: just count it)."""
        t = st.outer
        if self.plan.mode == "count":
            return [Assign(Load("out_count", t), Lit(1), "+=")]
        # The next slot of this slice: a cursor per outer iteration (``with_outer``), else
        # one for the function.
        self.top_cursor = self.top_cursor or isinstance(t, Lit)
        slot = Sym("slot")
        out = [Decl("idx", "slot", Sym("out_n")), Assign(Sym("out_n"), Lit(1), "+=")]
        out += [Assign(Load(f"out_c{m}", slot), coords[v]) for m, v in enumerate(self.out_vars)
                if m in written_coords(self.plan)]
        out.append(Assign(Load("out_vals", slot), value))
        return out

    def flush_workspace(self, st, order=None):
        """After the reduction loop: emit the touched cells in order, then start a new row.
        ``order``: the helper that lists them in order (default: sort the touched list)."""
        names = WORKSPACE_NAMES[self.ws_kind]
        if self.ws_kind == "dense":
            next_row = [Assign(Sym("ws_n"), Lit(0)),
                        Assign(Sym("ws_stamp"), Bin("+", Sym("ws_stamp"), Lit(1)))]
            if self.plan.mode == "count":
                return [Assign(Load("out_count", st.outer), Sym("ws_n"), "+=")] + next_row
            value = Load("ws_vals", Sym("ws_at"))
        else:
            next_row = [Helper("hash_clear", (), names)]
            value = Load("ws_sorted", Sym("ws_q"))
        body = [Decl("idx", "ws_at", Load("ws_list", Sym("ws_q")))]
        if self.plan.mode == "count":
            body += self.emit(None, None, st)
        else:
            body += self.emit_cell(value, st)
        return [order or Helper(f"{self.ws_kind}_sort", (), names),
                For("ws_q", Lit(0), Sym("ws_n"), block(body))] + next_row

    def emit_cell(self, value, st):
        """Emit workspace cell ``ws_at`` holding ``value``; a dense workspace's cell is
        zeroed again for the next row's first touch."""
        coords = {v: Sym(v) for v in self.out_vars if v not in self.ws_vars}
        # Cell -> coordinates, innermost variable first; the outermost one is what is left
        # (no division for it: a 64-bit division per entry, for nothing).
        body = [Decl("idx", "ws_rest", Sym("ws_at"))]
        for v in reversed(self.ws_vars[1:]):
            body.append(Decl("idx", f"{v}_ws", Bin("%", Sym("ws_rest"), dim(v))))
            body.append(Assign(Sym("ws_rest"), Bin("/", Sym("ws_rest"), dim(v))))
            coords[v] = Sym(f"{v}_ws")
        coords[self.ws_vars[0]] = Sym("ws_rest")
        body += self.emit(value, coords, st)
        if self.ws_kind == "dense":
            body.append(Assign(value, Lit(0)))
        return body

    def dense_row_passes(self, depth, st, listed):
        """The passes over a dense row workspace. Fill: ``listed`` (cells listed, then
        ordered) for most rows, but a row the count pass found to fill at least half of the
        workspace only marks its cells and is emitted by scanning the marks in order, and a
        row that fills all of it neither marks nor lists: every cell is emitted. Count: a
        row stops taking products once every cell is marked (``_saturating``). SpGEMM A@A
        fill A/B: adder_dcop_05 (rows up to fully dense) 2.0x for the scan; bcsstk13, G51,
        rajat19, bayer10 and bcspwr10 unchanged (as a rule of 1/4 or 1/8 instead: G51
        0.83x, 0.49x). Full rows and the early stop, DLMC 512x512 A@A (kernels called
        directly): 70% sparse (every result row full) count 5.3 -> 0.9-1.2 ms, fill 11.1 ->
        5.6-6.0 ms; whole calls 1.76-1.94x, 90% sparse (98% full) 1.09-1.17x. Where the
        call built row bitmaps (``bits_row``), both passes take them instead, except for
        full fill rows."""
        if self.ws_kind != "dense" or depth == 0:
            return listed
        t = st.outer
        bits = self.bits_row(depth, st)   # (per workspace row: any slice)
        if self.plan.mode == "count":
            counted = _saturating(listed)
            return [If(Sym("st_bits"), block(*bits), block(*counted))] if bits else counted
        if self.plan.mode != "fill":
            return listed
        count = Bin("-", Load("out_offset", Bin("+", t, Lit(1))), Load("out_offset", t))
        at, cells = Sym("ws_at"), Sym("ws_size")
        scan = For("ws_at", Lit(0), cells, block(
            If(Bin("==", Load("ws_mark", at), Sym("ws_stamp")),
               block(*self.emit_cell(Load("ws_vals", at), st)))))
        dense = self.loops_at(depth, st.copy(marks_only=True)) + \
            [scan, Assign(Sym("ws_stamp"), Bin("+", Sym("ws_stamp"), Lit(1)))]
        by_count = If(Bin(">=", Bin("*", count, Lit(2)), cells), block(*dense), block(*listed))
        if bits:
            by_count = If(Sym("st_bits"), block(*bits), block(by_count))
        if isinstance(t, Lit) or depth != 1:
            return [by_count]   # a slice spans several rows: its count is no row's
        full = self.loops_at(depth, st.copy(unmarked=True)) + \
            [For("ws_at", Lit(0), cells, block(*self.emit_cell(Load("ws_vals", at), st)))]
        return [If(Bin("==", count, cells), block(*full), block(by_count))]

    def bits_row(self, depth, st):
        """A row's passes through the bitmaps of the rows it gathers (``RowBits``), or None
        when its products do not gather whole rows of one operand's innermost level: the
        row workspace is over the last loop's variable alone, which exactly one operand's
        last level iterates, compressed (not COO's singleton), below levels that are dense
        or compressed. Count: OR the bitmaps, count the bits. Fill:
        the same, adding values unmarked, then list the cells from the bits."""
        v = self.order[-1]
        if self.ws_vars != (v,):
            return None
        over = [n for n in self.sparse if v in self.levels[n]]
        if len(over) != 1:
            return None
        n = over[0]
        levels = self.plan.formats[n].levels
        k = self.levels[n].index(v)
        if k != len(levels) - 1 or not isinstance(levels[k], Compressed) or \
                not all(isinstance(x, (Dense, Compressed)) for x in levels[:k]):
            return None
        positions = Lit(1)
        for j, level in enumerate(levels[:k]):
            positions = Bin("*", positions, dim(self.levels[n][j])) if isinstance(level, Dense) \
                else Load(arr(n, f"pos{j}"), positions)
        found = RowBits(n, k, positions)
        if self.row_bits not in (None, found):
            return None
        counting = self.plan.mode == "count"
        try:
            loops = self.loops_at(depth, st.copy(bits=True, unmarked=not counting))
        except NoRowBits:
            return None
        self.row_bits = found
        names = ("ws_bits", "st_words", "ws_n")
        if counting:
            return loops + [Helper("count_row_bits", (), names)] + self.flush_workspace(st)
        return loops + self.flush_workspace(st, Helper("list_row_bits", (), (*names, "ws_list")))

    def gathered_row_bits(self, n, st) -> list:
        """In a bitmap row (``bits_row``), for the gathered level of operand ``n``: OR the
        bitmap of the row at the current position into the row's bits."""
        if st.flag.get(n) is not None:
            raise NoRowBits   # (a row present only in part of a union)
        return [Helper("or_row_bits", (st.pos[n],), ("st_rowbits", "st_words", "ws_bits"))]

    def with_outer(self, depth, t, st, body):
        """At the outermost loop, name the iteration number (emission counts per iteration);
        a fill pass starts the iteration's slot cursor at its slice's offset."""
        if depth != 0 or not self.emitting or isinstance(t, Lit):
            return body   # (a literal: one slice, the function's; ``st.outer`` stays 0)
        st.outer = Sym("t_outer")
        body = body + [Decl("idx", "t_outer", t)]
        # Entries are emitted inside this loop unless a workspace or accumulator spans it
        # (column sums of CSR: emitted after it, from slice 0 and the function's cursor).
        inside = all(d is None or d > 0 for d in (self.ws_depth, self.acc_depth))
        if self.plan.mode == "fill" and inside:
            body.append(Decl("idx", "out_n", Load("out_offset", st.outer)))
        return body


class NoRowBits(Exception):
    """A bitmap row (``Assembly.bits_row``) met a loop that is not a gathered row."""


def _saturating(stmts: list) -> list:
    """``stmts`` (a count pass's row: its product loops, then the row's flush) with the
    outermost product loop ended as soon as the row has marked every workspace cell: no
    later product can add a cell (a dense result row stops counting early)."""
    loop = stmts[0]
    if not isinstance(loop, For) or loop.parallel is not None or loop.step != 1:
        return stmts
    p = Sym(loop.var)
    go = Bin("&&", Bin("<", p, loop.end), Bin("<", Sym("ws_n"), Sym("ws_size")))
    return [Decl("idx", loop.var, loop.start),
            While(go, block(*loop.body.stmts, Assign(p, Bin("+", p, Lit(1))))), *stmts[1:]]


def written_coords(plan) -> tuple:
    """The output modes whose coordinates the fill pass writes (all, or the column alone)."""
    modes = range(len(plan.assignment.out_vars))
    if plan.row_emission is None:
        return tuple(modes)
    return tuple(m for m in modes if m != plan.output.format.mode_order[0])


def running_totals(lw) -> list:
    """After counting: the counts of the slices become their running totals, in place. The
    caller passes ``pos + 1`` as ``out_count`` over a zeroed ``pos``, so ``pos`` then holds
    every slice's offset and the total (one serial pass over the slices, in the kernel: a
    ``cumsum_`` call costs a small SpGEMM more than the adds)."""
    kind = lw.outer_extent
    if kind[0] == "dim":
        slices = dim(kind[1])
    elif kind[0] == "level":
        pos0 = arr(kind[1], "pos0")
        slices = Bin("-", Load(pos0, Lit(1)), Load(pos0, Lit(0)))
    else:
        return []
    t = Sym("t_sum")
    return [For("t_sum", Lit(1), slices,
                block(Assign(Load("out_count", t), Load("out_count", Bin("-", t, Lit(1))), "+=")))]
