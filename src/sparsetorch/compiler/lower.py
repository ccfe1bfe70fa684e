"""Lowering: (assignment, loop order, formats, output spec) -> loop IR ``Function``.

One loop per index variable, outermost first. At each loop the operands whose next storage
level is indexed by that variable are its *iterators*. The merge lattice is evaluated
symbolically (``notation.presence``: ``*`` intersects, ``+`` unions) and picks the loop form:

* the iteration space is dense (no sparse iterator, or a union with a dense term): a counted
  loop over the extent; sparse iterators follow as cursors;
* exactly one sparse iterator that the expression requires: a loop over its positions, with
  every other operand located (dense levels) or constant at this level;
* several sparse iterators: a merge (two-pointer generalised to k) whose continuation test
  and body guard are the lattice formula over "iterator not exhausted" / "iterator here".

Level kinds supply bounds, coordinates, locate and segment advance through ``LevelCode``
(``iterate.py``); nothing here branches on format names. Register tiles come from
``tiles.py``, the count and fill passes of sparse results and their row workspaces from
``assemble.py``. Operands that may be absent inside a union carry a
``present`` flag so their loads and child ranges fold to zero.

Data per call: every stored entry of each sparse operand is read once per visit of its row
(more for dense operands broadcast across sparse loops); the output is written once per
emitted entry (sparse) or accumulated in place (dense).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..formats.levels import Compressed, Dense
from .assemble import Assembly, NoRowBits, running_totals, written_coords
from .ir import (Assign, Bin, Call, Comment, Cond, Decl, For, Function, If, Lit, Load,
                 Param, Parallel, Helper, Sym, While, WORKSPACE_NAMES, block)
from .iterate import LevelCode, LoopState, arr, dim, horner
from .kblock import k_blocked
from .notation import (UNARY, Access, Add, Assignment, Epilogue, Mul, Result, Scale, Unary,
                       factor_out, presence)
from .output import OutputSpec
from .schedule import level_vars
from .tiles import lane_loop, register_tiles

# A dense workspace of more cells than this (per thread) becomes a hash table that grows
# with the entries actually touched; see ``Plan.workspace``.
MAX_WORKSPACE = 1 << 24


class _B:
    """A symbolic boolean for presence formulas: wraps an IR condition, supports & and |."""

    def __init__(self, node):
        self.node = node

    def __and__(self, other):
        return _B(Bin("&&", self.node, other.node))

    def __or__(self, other):
        return _B(Bin("||", self.node, other.node))


def _cond(p):
    return Lit(1) if p is True else Lit(0) if p is False else p.node


@dataclass
class Plan:
    """Everything lowering needs; ``mode`` is 'dense', 'sampled', 'count' or 'fill';
    ``workspace`` is the kind of row accumulator ('dense' array or 'hash' table); ``tile`` is
    the register tile width in values (one SIMD register of the build target)."""

    assignment: Assignment
    order: tuple
    formats: tuple
    output: OutputSpec
    mode: str
    workspace: str = "dense"
    tile: int = 1
    notes: list = field(default_factory=list)
    # Fill mode of a CSR-like result (``CompiledKernel.emit_rows``): the row of an entry is
    # implied by its slot, so only the column is written, in operand ``row_emission``'s
    # index type (what the result keeps: no int64 copy to narrow afterwards).
    row_emission: int | None = None
    # Most coordinates of a reduction block whose slice of the dense operand fits a quarter
    # of L2 (``kblock.py``); None: no cache blocking (no register tiles of intrinsics).
    block_cap: int | None = None
    # Panel widths of the blocked nest in tiles, widest first (``kernel.panel_factors``).
    panels: tuple = (1,)


class _Lowerer(Assembly):
    def __init__(self, plan: Plan):
        self.plan = plan
        self.a = plan.assignment
        self.order = plan.order
        self.out_vars = plan.assignment.out_vars
        expr = plan.assignment.expr
        self.body, self.epilogue = (expr.body, expr.fn) if isinstance(expr, Epilogue) else \
            (expr, None)
        self.accesses = {acc.operand: acc for acc in expr.accesses()}
        self.levels = {n: level_vars(plan.formats[n], acc.indices)
                       for n, acc in self.accesses.items()}
        self.sparse = {n for n in self.accesses if not plan.formats[n].is_dense}
        red = [d for d, v in enumerate(self.order) if v not in self.out_vars]
        later_free = [d for d in red if any(v in self.out_vars for v in self.order[d:])]
        self.emitting = plan.mode in ("count", "fill")
        self.later_free = later_free
        self.outer_extent = ("one",)          # how many slices emission counts are kept in
        self.top_cursor = False   # fill: emits into slice 0 with the function's slot cursor
        self.balanced = None     # operand whose rows the outer loop splits by stored entries
        self.ws_depth = later_free[0] if (later_free and self.emitting) else None
        self.ws_kind = plan.workspace if self.ws_depth is not None else None
        self.ws_vars = tuple(v for v in self.order[self.ws_depth:] if v in self.out_vars) \
            if self.ws_depth is not None else ()
        # Accumulate in a scalar over the innermost run of reduction loops.
        suffix = len(self.order)
        while suffix > 0 and self.order[suffix - 1] not in self.out_vars:
            suffix -= 1
        self.acc_depth = suffix if (suffix < len(self.order) and self.ws_depth is None) \
            else None
        self.summand, self.factor = self._hoisted_factor()
        self.tile_depth, self.tile_var = self._tiling()
        placement = self._write_placement()
        # A dense output written exactly once per element needs no zeroing pass and no
        # read-modify-write (SpMM: the register tile is stored, not added).
        self.write_once = placement if plan.mode == "dense" and placement != "pass" else None
        self.epilogue_at = placement if self.epilogue is not None else None
        self.stores_every_entry = self._stores_every_entry()
        self.k_blocked = False   # set by ``kblock.k_blocked``
        self.column_blocked = None   # the gathered operand, set by ``sblock.column_blocked``
        self.held = None             # ``CompiledKernel.held``, set there too
        self.row_bits = None   # ``assemble.RowBits`` when a row's cells come from bitmaps
        self.names = 0

    def _write_placement(self):
        """Where each dense output element gets its final value: at its one write ('flush'
        of its accumulator or register tile, or 'store' when nothing is summed), or only
        after a final 'pass' when an element may be written several times or never (an
        output variable a sparse level iterates skips absent rows). The epilogue runs there."""
        for n in self.sparse:
            for level, v in zip(self.plan.formats[n].levels, self.levels[n]):
                if v in self.out_vars and not isinstance(level, Dense):
                    return "pass"
        red = [d for d, v in enumerate(self.order) if v not in self.out_vars]
        if not red:
            return "store"
        for depth in (self.tile_depth, self.acc_depth):
            if depth is not None and min(red) >= depth:
                return "flush"
        return "pass"

    def _stores_every_entry(self) -> bool:
        """Sampled output: whether each stored entry's sum is complete at one flush (every
        reduction loop below the accumulator, the sampled operand's position fixed above
        it), so the kernel stores, not adds (SDDMM with 64-wide rows: ~7% of the kernel).
        The sampled operand is the only sparse one and its levels are all traversed, so
        then every entry is stored exactly once and the caller need not zero the output."""
        if self.plan.mode != "sampled" or self.acc_depth is None:
            return False
        above = self.order[:self.acc_depth]
        n = self.plan.output.sampled_operand
        return all(v in above for v in self.levels[n]) and all(v in self.out_vars
                                                                  for v in above)

    def _hoisted_factor(self):
        """``(summand, factor)`` of the sum over the accumulator's loops (``factor`` None
        when nothing is fixed over them): SDDMM's mask value leaves the inner-product loop,
        whose vector step is then a single FMA."""
        if self.acc_depth is None or self.emitting:
            return self.body, None
        return factor_out(self.body, set(self.order[self.acc_depth:]))

    def _tiling(self):
        """Mixed sparse-dense tiling (docs/design.md, Compiler 5): when the innermost loop is a
        dense output variable that no sparse operand indexes (the k of SpMM, the j of
        MTTKRP) and reduction loops sit right above it, strip-mine it into register tiles
        of ``plan.tile`` values and move the tile loop above those reductions, so every
        nonzero is loaded once per tile and the output tile stays in registers."""
        order, n = self.order, len(self.order)
        if self.plan.mode != "dense" or self.plan.tile < 2 or n < 2:
            return None, None
        k = order[-1]
        if k not in self.out_vars or any(k in self.levels[m] for m in self.sparse):
            return None, None
        start = n - 1
        while start > 0 and order[start - 1] not in self.out_vars:
            start -= 1
        return (start, k) if start < n - 1 else (None, None)

    def fresh(self, base):
        self.names += 1
        return f"{base}{self.names}"

    # -- values ------------------------------------------------------------------------------
    def value(self, e, st, result=None):
        """IR for expression ``e`` at the current point; ``result`` stands for ``Result()``
        (the completed sum) inside an epilogue."""
        if isinstance(e, Result):
            return result
        if isinstance(e, Access):
            n = e.operand
            fmt = self.plan.formats[n]
            if fmt.is_dense:
                vs = self.levels[n]
                load = Load(arr(n, "vals"), horner(vs))
            else:
                load = Load(arr(n, "vals"), st.pos[n])
            flag = st.flag.get(n)
            return Cond(flag, load, Lit(0)) if flag is not None else load
        if isinstance(e, Mul):
            return Bin("*", self.value(e.a, st, result), self.value(e.b, st, result))
        if isinstance(e, Add):
            return Bin("+", self.value(e.a, st, result), self.value(e.b, st, result))
        if isinstance(e, Scale):
            return Bin("*", Lit(e.factor), self.value(e.a, st, result))
        if isinstance(e, Unary):
            return Call(UNARY[e.fn][0], self.value(e.a, st, result))
        raise TypeError(e)

    # -- output ------------------------------------------------------------------------------
    def store(self, value, st):
        """Statements that add ``value`` into the output at the current point."""
        kind = self.plan.mode
        counting = kind == "count"   # the count pass needs the pattern, never the values
        if st.acc is not None:
            hit = [Assign(Sym(st.hit), Lit(1))] if st.hit else []
            return hit if counting else [Assign(Sym(st.acc), value, "+=")] + hit
        if self.ws_depth is not None:
            return self.workspace_store(value, st)
        if st.tile is not None:
            return [Assign(Load(st.tile[2], Sym(st.tile[3])), value, "+=")]
        if kind == "dense":
            return [self.write_out(value, st, "store")]
        if kind == "sampled":
            return [Assign(Load("out_vals", st.pos[self.plan.output.sampled_operand]), value,
                           "+=")]
        return self.emit(value, {v: Sym(v) for v in self.out_vars}, st)

    def write_out(self, value, st, where):
        """Add ``value`` into the dense output; at the element's only write, store it (or
        ``epilogue(value)``) instead."""
        target = Load("out_vals", horner(self.out_vars))
        if self.epilogue_at == where:
            return Assign(target, self.value(self.epilogue, st, value))
        if self.write_once == where:
            return Assign(target, value)
        return Assign(target, value, "+=")

    def final_pass(self):
        """``out = epilogue(out)`` over every output element, after the loop nest."""
        target = Load("out_vals", horner(self.out_vars))
        body = block(Assign(target, self.value(self.epilogue, LoopState(self), target)))
        for d, v in reversed(list(enumerate(self.out_vars))):
            par = Parallel("static") if d == 0 else None
            body = block(For(v, Lit(0), dim(v), body, par))
        return list(body.stmts)

    def flush_accumulator(self, st):
        kind = self.plan.mode
        acc = Sym(st.acc)
        if self.factor is not None:
            factor = Lit(self.factor) if isinstance(self.factor, (int, float)) else \
                self.value(self.factor, st)
            acc = Bin("*", factor, acc)
        if kind == "dense":
            return [self.write_out(acc, st, "flush")]
        if kind == "sampled":
            n = self.plan.output.sampled_operand
            return [Assign(Load("out_vals", st.pos[n]), acc,
                           "=" if self.stores_every_entry else "+=")]
        return [If(Sym(st.hit), block(self.emit(acc, {v: Sym(v) for v in self.out_vars}, st)))]

    # -- loops -------------------------------------------------------------------------------
    def loops(self, depth, st):
        if depth == self.tile_depth and st.tile is None:
            return self.tiled(depth, st)
        if depth == self.acc_depth:
            st = st.copy(acc=self.fresh("acc"), hit=self.fresh("hit") if self.emitting
                         else None)
            inner = self.loops_at(depth, st)
            pre = [Decl("val", st.acc, Lit(0))] + ([Decl("idx", st.hit, Lit(0))]
                                                  if st.hit else [])
            return pre + inner + self.flush_accumulator(st)
        out = self.loops_at(depth, st)
        if depth == self.ws_depth:
            out = self.dense_row_passes(depth, st, out + self.flush_workspace(st))
        return out

    def tiled(self, depth, st):
        return register_tiles(
            self.tile_var, (self.plan.tile,), self.fresh,
            lambda tile: self.loops_at(depth, st.copy(tile=tile)),
            lambda tile: self.write_out(Load(tile[2], Sym(tile[3])), st, "flush"))

    def tile_loop(self, st):
        """The innermost loop over one tile: ``tile[kk] += value`` for every kk."""
        return [lane_loop(self.tile_var, st.tile, self.store(self.value(self.summand, st), st))]

    def loops_at(self, depth, st):
        if depth == len(self.order):
            return self.store(self.value(self.summand, st), st)
        v = self.order[depth]
        if st.tile is not None and v == self.tile_var:
            return self.tile_loop(st)
        iters = [n for n in sorted(self.sparse)
                 if st.lvl[n] < len(self.levels[n]) and self.levels[n][st.lvl[n]] == v]
        code = {n: LevelCode(self, n, st.lvl[n]) for n in iters}
        sparse_iters = [n for n in iters if not code[n].is_dense]

        def formula(test):
            return presence(self.body, lambda acc: _B(test(acc.operand))
                            if acc.operand in sparse_iters else True)

        # With placeholder tokens only constant folding matters: True means the expression
        # can be nonzero where every sparse iterator is absent, so the space is dense.
        dense_space = not sparse_iters or formula(lambda n: None) is True
        if st.bits and v in self.ws_vars and (dense_space or len(sparse_iters) != 1):
            raise NoRowBits
        if dense_space:
            return self.dense_loop(depth, v, iters, code, st)
        if len(sparse_iters) == 1:
            return self.sparse_loop(depth, v, iters, code, sparse_iters[0], st)
        return self.merge_loop(depth, v, iters, code, sparse_iters, formula, st)

    def bind_dense_levels(self, depth, iters, st):
        """Locate the dense levels of the operands that advanced here whose variables are
        bound: this loop's, and ones an outer loop already iterates (the schedule may put a
        dense level's variable before its compressed parent, e.g. BSR rows before blocks)."""
        out, bound = [], set(self.order[:depth + 1])
        for n in iters:
            kinds, vars_ = self.plan.formats[n].levels, self.levels[n]
            while st.lvl[n] < len(vars_) and isinstance(kinds[st.lvl[n]], Dense) and \
                    vars_[st.lvl[n]] in bound:
                v = vars_[st.lvl[n]]
                p = self.fresh(f"p{n}_")
                out.append(Decl("idx", p, Bin("+", Bin("*", st.pos[n], dim(v)), Sym(v))))
                st.pos[n] = Sym(p)
                st.lvl[n] += 1
        return out

    def dense_loop(self, depth, v, iters, code, st):
        pre, cursors = [], {}
        inner = st.copy()
        body = []
        for n in iters:
            if code[n].is_dense:
                continue
            c = code[n]
            p, end = self.fresh(f"p{n}_"), self.fresh(f"e{n}_")
            lo, hi = c.bounds(st)
            pre += [Decl("idx", p, lo), Decl("idx", end, hi)]
            flag = self.fresh(f"has{n}_")
            body.append(Decl("idx", flag, Bin("&&", Bin("<", Sym(p), Sym(end)),
                                              Bin("==", c.coord(Sym(p)), Sym(v)))))
            seg = c.segment_end(Sym(p), Sym(end), body, guard=Sym(flag))
            cursors[n] = (p, flag, seg)
            inner.enter(n, Sym(p), seg, Sym(flag))
        body += self.bind_dense_levels(depth, iters, inner)
        body = self.with_outer(depth, Sym(v), inner, body) + self.loops(depth + 1, inner)
        for n, (p, flag, seg) in cursors.items():
            nxt = seg if seg is not None else Bin("+", Sym(p), Lit(1))
            body.append(If(Sym(flag), block(Assign(Sym(p), nxt))))
        par = self.parallel(depth, v) if not cursors else None
        if depth == 0:
            self.outer_extent = ("dim", v)
        red = self.vector_sum(depth, st) if not cursors else None
        return pre + [For(v, Lit(0), dim(v), block(body), par, reduction=red)]

    def sparse_loop(self, depth, v, iters, code, n, st):
        c = code[n]
        # A bitmap row (``assemble.RowBits``) ORs the gathered row's bitmap; the count pass
        # needs nothing else of it.
        bits = self.gathered_row_bits(n, st) if st.bits and v in self.ws_vars else []
        if bits and self.plan.mode == "count":
            return bits
        lo, hi = c.bounds(st)
        inner = st.copy()
        p = self.fresh(f"p{n}_")
        if c.segments:
            start, end = self.fresh(f"b{n}_"), self.fresh(f"e{n}_")
            body = [Decl("idx", v, c.coord(Sym(p)))]
            seg = c.segment_end(Sym(p), Sym(end), body, guard=None)
            inner.enter(n, Sym(p), seg, None)
            body += self.bind_dense_levels(depth, iters, inner)
            body = self.with_outer(depth, Lit(0), inner, body) + self.loops(depth + 1, inner)
            body.append(Assign(Sym(p), seg))
            return [Decl("idx", start, lo), Decl("idx", end, hi), Decl("idx", p, Sym(start)),
                    While(Bin("<", Sym(p), Sym(end)), block(body))]
        body = [Decl("idx", v, c.coord(Sym(p)))]
        inner.enter(n, Sym(p), None, None)
        body += self.bind_dense_levels(depth, iters, inner)
        body = self.with_outer(depth, Bin("-", Sym(p), lo), inner, body) + \
            self.loops(depth + 1, inner)
        if depth == 0:
            self.outer_extent = ("level", n)
        return bits + [For(p, lo, hi, block(body), self.parallel(depth, v, sparse=True),
                           reduction=self.vector_sum(depth, st), entries=c.entries())]

    def vector_sum(self, depth, st):
        """The innermost loop of a scalar reduction may reassociate its sum (SIMD)."""
        if depth == len(self.order) - 1 and st.acc is not None and st.hit is None and \
                not st.flag and depth != 0:
            return st.acc
        return None

    def merge_loop(self, depth, v, iters, code, sparse_iters, formula, st):
        pre, body, state = [], [], {}
        for n in sparse_iters:
            c = code[n]
            lo, hi = c.bounds(st)
            p, end = self.fresh(f"p{n}_"), self.fresh(f"e{n}_")
            pre += [Decl("idx", p, lo), Decl("idx", end, hi)]
            state[n] = (p, end)
        coords = {}
        for n, (p, end) in state.items():
            cn = self.fresh(f"c{n}_")
            body.append(Decl("idx", cn, Cond(Bin("<", Sym(p), Sym(end)),
                                             code[n].coord(Sym(p)), dim(v))))
            coords[n] = cn
        first = None
        for n in sparse_iters:
            first = Sym(coords[n]) if first is None else Bin("min", first, Sym(coords[n]))
        body.append(Decl("idx", v, first))
        inner = st.copy()
        segs = {}
        flags = {}
        for n, (p, end) in state.items():
            flag = self.fresh(f"has{n}_")
            body.append(Decl("idx", flag, Bin("==", Sym(coords[n]), Sym(v))))
            segs[n] = code[n].segment_end(Sym(p), Sym(end), body, guard=Sym(flag))
            flags[n] = Sym(flag)
            # Under the guard an operand the formula requires is certainly here: no flag.
            required = presence(self.body, lambda acc, n=n: acc.operand != n) is False
            inner.enter(n, Sym(p), segs[n], None if required else Sym(flag))
        guard = _cond(formula(lambda n: Bin("==", Sym(coords[n]), Sym(v))))
        inner_body = self.bind_dense_levels(depth, iters, inner)
        inner_body = self.with_outer(depth, Lit(0), inner, inner_body) + \
            self.loops(depth + 1, inner)
        body.append(If(guard, block(inner_body)))
        for n, (p, end) in state.items():
            flag = flags[n]
            nxt = segs[n] if segs[n] is not None else Bin("+", Sym(p), Lit(1))
            body.append(If(flag, block(Assign(Sym(p), nxt))))
        cont = _cond(formula(lambda n: Bin("<", Sym(state[n][0]), Sym(state[n][1]))))
        return pre + [While(cont, block(body))]

    # -- parallelism and emission bookkeeping ------------------------------------------------
    def parallel(self, depth, v, sparse=False):
        """Parallelise the outermost loop when iterations write disjoint output: always for
        emission (each iteration owns a slice), for dense/sampled output when ``v`` is free."""
        if depth != 0 or self.ws_depth == 0:   # a workspace over everything is one region
            return None
        if not self.emitting and v not in self.out_vars:
            return None
        # Rows of sparse operands vary in cost. When a CSR-like operand's row array is at
        # hand, each thread takes one range of rows with an equal share of its entries
        # (graphs are skewed; one partition per thread, no scheduling traffic); otherwise
        # guided chunks balance them at low overhead.
        weights = self.row_weights(v) if not sparse else None
        if weights is not None:
            self.balanced = weights[0]
            return Parallel("balanced", None, self.ws_kind, weights[1])
        has_sparse_inner = len(self.order) > 1 and bool(self.sparse)
        return Parallel("guided" if (has_sparse_inner or sparse) else "static", None,
                        self.ws_kind)

    def row_weights(self, v):
        """``(operand, position array)`` whose entry ``v`` starts row ``v`` of a sparse
        operand (a root dense level over ``v`` above a compressed level), or None."""
        for n in sorted(self.sparse):
            levels = self.plan.formats[n].levels
            if self.levels[n][:1] == (v,) and len(levels) > 1 and \
                    isinstance(levels[0], Dense) and isinstance(levels[1], Compressed):
                return n, arr(n, "pos1")
        return None

def lower(plan: Plan, name: str = "kernel"):
    """Build the loop IR for ``plan``; returns the ``Function`` and the lowerer (which knows
    the workspace, accumulator and outer-loop decisions it made)."""
    lw = _Lowerer(plan)
    st = LoopState(lw)
    body = k_blocked(lw, lw.loops(0, st))
    if plan.mode == "count":
        body += running_totals(lw)
    elif lw.top_cursor:
        body = [Decl("idx", "out_n", Load("out_offset", Lit(0)))] + body
    if plan.mode == "dense" and lw.write_once is None:
        size = Lit(1)
        for v in plan.assignment.out_vars:
            size = Bin("*", size, dim(v))
        body = [Helper("zero_out", (size,), ("out_vals", "nt"))] + body
        if lw.epilogue_at == "pass":
            body = body + lw.final_pass()
    if lw.ws_depth is not None:
        if not any(isinstance(s, For) and s.parallel for s in body):
            names = WORKSPACE_NAMES[lw.ws_kind]
            body = [Helper(f"alloc_{lw.ws_kind}", (), ("ws_size",), names)] + body + \
                [Helper(f"free_{lw.ws_kind}", (), names)]
        body = [Comment(f"{lw.ws_kind} workspace over ({', '.join(lw.ws_vars)}): touched "
                        "cells are sorted before emission")] + body
    if lw.row_bits is not None:
        body = [lw.row_bits.build()] + body + [Helper("free_row_bits", (), ("st_rowbits",))]
        plan.notes.append(
            f"result rows from bitmaps of operand {lw.row_bits.operand}'s rows (one bit per "
            "cell) when those rows are long for their width; marked cells otherwise")
    return Function(name, tuple(_params(plan, lw)), block(body)), lw


def _params(plan: Plan, lw: _Lowerer):
    params = [Param("nt", "idx")]
    if lw.balanced is not None:   # chunks per thread of the balanced outer loop (see Parallel)
        params.append(Param("nc", "idx"))
    for v in plan.assignment.all_vars:
        params.append(Param(f"n_{v}", "idx"))
    for n in sorted(lw.accesses):
        fmt = plan.formats[n]
        for k, level in enumerate(fmt.levels):
            if level.has_pos:
                params.append(Param(arr(n, f"pos{k}"), f"idx{n}*"))
            if level.has_crd:
                params.append(Param(arr(n, f"crd{k}"), f"idx{n}*"))
        params.append(Param(arr(n, "vals"), "val*"))
    if plan.mode in ("dense", "sampled"):
        params.append(Param("out_vals", "val*", const=False))
    elif plan.mode == "count":
        params.append(Param("out_count", "i64*", const=False))
    else:
        params.append(Param("out_offset", "i64*"))
        crd = "i64*" if plan.row_emission is None else f"idx{plan.row_emission}*"
        params += [Param(f"out_c{m}", crd, const=False) for m in written_coords(plan)]
        params.append(Param("out_vals", "val*", const=False))
    if lw.ws_depth is not None:
        params.append(Param("ws_size", "idx"))
    return params
