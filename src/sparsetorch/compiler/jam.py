"""Unroll-and-jam of small static output loops around register tiles: 2-D register tiles.

A blocked operand's in-block loops have extents fixed by its block size (BSR 4x4; output-
channel blocks of a 1x1 convolution). Lowered as usual, the loop over in-block rows ``i_e``
sits outside the register tile, so every stored block streams the dense operand's rows
once per in-block row::

    for i_e in [0, 4):                       for k0 (tile):
      for k0 (tile):                           tile_0..tile_3 = 0
        tile = 0                               for p in blocks of the row:
        for p in blocks of the row:              for j_e in [0, 4):
          for j_e in [0, 4):          -->          tile_0[kk] += A[p, 0, j_e] * X[j, kk]
            tile[kk] += A[p,i_e,j_e] * X[j,kk]     ...
        out[i_e] = tile                            tile_3[kk] += A[p, 3, j_e] * X[j, kk]
                                               out[0] = tile_0; ...; out[3] = tile_3

Here each dense row segment is loaded once per block and feeds four register tiles (C
compilers merge the four identical loads): a quarter of the loads per multiply-add, the
register blocking of a dense GEMM micro-kernel over a block's rows.

The transform is generic on the loop IR: the copies of the loop body for ``i_e = 0..R-1``
are walked side by side; loops with the same header are fused, pure declarations that agree
are kept once, anything else (stores, accumulations, ``simd`` lane loops) is repeated per
copy with the names it declares suffixed. It is legal because the copies write disjoint
outputs (``i_e`` indexes the output) and only read the operands.
"""
from __future__ import annotations

from dataclasses import fields, replace

from .ir import (Assign, Bin, Block, Decl, For, Helper, If, Lit, Load, Node, Sym, While,
                 rewrite, substitute)

# Sums computed side by side by ``jam_sums`` (``kernel.sum_copies`` picks per ISA).
SUM_COPIES = 4


def sum_widths(copies: int) -> tuple:
    """The loops ``jam_sums`` makes of a row's sums, widest first, before the one-at-a-time
    remainder: ``copies`` side by side, then (from eight) one of half as many.

    Example:
        >>> sum_widths(8), sum_widths(4)
        ((8, 4), (4,))
    """
    return (copies, copies // 2) if copies >= 8 else (copies,)


def jam_tiles(body: Block, static: dict, tile_registers: int,
              max_registers: int = 16) -> tuple[Block, tuple]:
    """``(body', jammed)``: ``body`` with every loop over a variable of static extent
    (``static``: variable -> extent) that directly encloses a register tile of
    ``tile_registers`` registers unrolled and jammed into it (while the copies hold at most
    ``max_registers`` accumulator registers: past that the C compiler spills them; a
    jammed loop multiplies the tile's registers by its extent), and every ``n_<var>`` of those
    variables replaced by its extent; ``jammed`` lists the (variable, extent) pairs unrolled.

    Example:
        >>> from sparsetorch.compiler.ir import block, dump
        >>> inner = For("kk", Lit(0), Lit(16), block(
        ...     Assign(Load("tile", Sym("kk")), Load("x", Sym("i")), "+=")), simd=True)
        >>> tile = For("k0", Lit(0), Sym("n_k"), block(Decl("val[]", "tile", Lit(16)), inner),
        ...            step=16)
        >>> loop = block(For("i", Lit(0), Sym("n_i"), block(tile)))
        >>> jammed, done = jam_tiles(loop, {"i": 2}, 1)
        >>> done
        (('i', 2),)
        >>> print(dump(jammed))
        for k0 in [0, n_k) by 16
          val[] tile_j0 = 16
          val[] tile_j1 = 16
          for kk in [0, 16)  [simd]
            tile_j0[kk] += x[0]
          for kk in [0, 16)  [simd]
            tile_j1[kk] += x[1]
    """
    sizes = {Sym(f"n_{v}"): Lit(e) for v, e in static.items()}
    jammed = []
    body = substitute(_jam_block(body, static, tile_registers, max_registers, jammed),
                       sizes)
    return body, tuple(dict.fromkeys(jammed))


def jam_rows(body: Block, rows: int, tile_registers: int,
             max_registers: int = 16) -> tuple[Block, bool]:
    """``(body', done)``: each parallel loop over dense output rows that encloses a register
    tile, run as blocks of ``rows`` rows whose tiles are computed side by side (the
    copies' loops over the reduction and the tile fused, as ``jam_tiles`` fuses a block's
    rows); a last partial block runs its rows one at a time. Only while the copies hold at
    most ``max_registers`` accumulators (``rows * tile_registers``).

    Dense products (loop order i, j, k; the tile over k) broadcast ``A[i, j]`` against a
    row segment of ``B``: one row gives each tile register one FMA chain per ``j``, which
    waits on its own latency when the tile is one register (``k`` of 16 or fewer: a
    classifier's few outputs), and loads ``B``'s segment once per row. ``rows`` rows share
    each load and run that many chains: the register blocking of a GEMM micro-kernel.
    Four rows against one at a time, AVX-512 (Zen 4), 2 threads, three alternating runs:
    2708 x 16 by 16 x 7 (a GCN's class scores) 25-34 -> 17-21 us, 2708 x 1433 by 1433 x 16
    1.8-2.8 -> 0.75-0.9 ms, 8192 rows of 256 by 256 x 256 1.45x, of 64 by 64 x 32 1.05x.
    Legal as ``jam_tiles`` is: the copies write different rows and only read the
    operands.

    Example:
        >>> from sparsetorch.compiler.ir import Parallel, block, dump
        >>> inner = For("kk", Lit(0), Lit(16), block(
        ...     Assign(Load("tile", Sym("kk")), Load("x", Sym("i")), "+=")), simd=True)
        >>> tile = For("k0", Lit(0), Sym("n_k"), block(Decl("val[]", "tile", Lit(16)), inner),
        ...            step=16)
        >>> loop = block(For("i", Lit(0), Sym("n_i"), block(tile), Parallel()))
        >>> print(dump(jam_rows(loop, 2, 1)[0]))
        for i_b in [0, ((n_i + 1) / 2))  [parallel static]
          if (((i_b * 2) + 2) <= n_i)
            for k0 in [0, n_k) by 16
              val[] tile_j0 = 16
              val[] tile_j1 = 16
              for kk in [0, 16)  [simd]
                tile_j0[kk] += x[((i_b * 2) + 0)]
              for kk in [0, 16)  [simd]
                tile_j1[kk] += x[((i_b * 2) + 1)]
          else
            for i in [(i_b * 2), n_i)
              for k0 in [0, n_k) by 16
                val[] tile = 16
                for kk in [0, 16)  [simd]
                  tile[kk] += x[i]
    """
    if rows < 2 or rows * tile_registers > max_registers:
        return body, False
    done = []

    def blocked(s):
        if not (isinstance(s, For) and s.parallel is not None and
                s.parallel.weights is None and s.parallel.workspace is None and
                s.step == 1 and s.start == Lit(0) and _encloses_tile(s.body)):
            return s
        block_var = f"{s.var}_b"
        first = Bin("*", Sym(block_var), Lit(rows))
        copies = [substitute(s.body, {Sym(s.var): Bin("+", first, Lit(r))}).stmts
                  for r in range(rows)]
        try:
            fused = _fuse(copies, [{} for _ in range(rows)])
        except _NotJammable:
            return s
        done.append(s.var)
        one_by_one = For(s.var, first, s.end, s.body)
        return replace(s, var=block_var, end=Bin("/", Bin("+", s.end, Lit(rows - 1)),
                                                 Lit(rows)),
                       body=Block((If(Bin("<=", Bin("+", first, Lit(rows)), s.end),
                                      Block(tuple(fused)), Block((one_by_one,))),)))

    out = Block(tuple(blocked(s) for s in body.stmts))
    return out, bool(done)


def _jam_block(node: Block, static, regs, most, jammed: list) -> Block:
    out = []
    for s in node.stmts:
        extent = static.get(s.var) if isinstance(s, For) else None
        if extent is not None and s.parallel is None and s.step == 1 and \
                s.start == Lit(0) and extent * regs <= most and \
                _encloses_tile(s.body):
            copies = [substitute(s.body, {Sym(s.var): Lit(r)}).stmts for r in range(extent)]
            try:
                out.extend(_fuse(copies, [{} for _ in range(extent)]))
            except _NotJammable:     # left as it is: correct, only slower
                out.append(s)
                continue
            if extent > 1:
                jammed.append((s.var, extent))
        else:
            out.append(_map_blocks(s, lambda b: _jam_block(b, static, regs, most, jammed)))
    return Block(tuple(out))


def jam_sums(body: Block, copies: int = SUM_COPIES) -> tuple[Block, bool]:
    """``(body', done)``: every position loop whose iterations each compute one sum (the
    p loop of SDDMM around its inner product over k) unrolled ``copies`` times and jammed,
    so one loop computes ``copies`` sums side by side, then a remainder loop (with eight
    copies, first a loop of four, which runs at most once: the one-at-a-time sums, whose
    single FMA chain waits on its own latency, then number 0-3 instead of 0-7 a row; DLMC
    SDDMM, 2 threads, AVX2: 1.038x geomean over the 48 cases, up to 1.20x)::

        for p in [lo, hi)                  for p in [lo, hi - 3) by 4
          j = crd[p]; acc = 0                j_j0 = crd[p]; ...; j_j3 = crd[p + 3]
          for k  [sum into acc]     -->      for k  [sum into acc_j0, ..., acc_j3]
            acc += x[i,k] * y[j,k]             acc_j0 += x[i,k] * y[j_j0,k]; ...
          out[p] = acc                       out[p] = acc_j0; ...; out[p + 3] = acc_j3
                                           for p in [lo + (hi - lo) / 4 * 4, hi)
                                             (the loop as it was)

    The shared operand (``x[i, k]``) is loaded once for four products, four independent
    sums hide the add latency, and the four horizontal adds become one (the renderer adds
    four registers together with shuffles, about half of the instructions). With the mask
    value hoisted out of the sum (``lower._hoisted_factor``), a 315k-entry DLMC SDDMM at
    K=64 went from 1135 to 604 us. Legal because the copies write different positions and
    only read the operands (``_one_flat_sum`` checks the shape).

    Example:
        >>> from sparsetorch.compiler.ir import Decl, Lit, Load, Sym, block, dump
        >>> row = For("p", Lit(0), Sym("n"), block(
        ...     Decl("val", "acc", Lit(0)),
        ...     For("k", Lit(0), Sym("n_k"), block(
        ...         Assign(Sym("acc"), Load("y", Sym("k")), "+=")), reduction="acc"),
        ...     Assign(Load("out", Sym("p")), Sym("acc"))))
        >>> jammed, done = jam_sums(block(row), 2)
        >>> print(dump(jammed))
        for p in [0, (n - 1)) by 2
          val acc_j0 = 0
          val acc_j1 = 0
          for k in [0, n_k)  [sum into acc_j0, acc_j1]
            acc_j0 += y[k]
            acc_j1 += y[k]
          out[p] = acc_j0
          out[(p + 1)] = acc_j1
        for p in [(0 + (((n - 0) / 2) * 2)), n)
          val acc = 0
          for k in [0, n_k)  [sum into acc]
            acc += y[k]
          out[p] = acc
    """
    done = []

    def jammed(node) -> tuple:
        """The loops replacing ``node``, or ``(node,)``."""
        if not (isinstance(node, For) and node.parallel is None and not node.simd and
                not node.reduction and node.step == 1 and _one_flat_sum(node.body)):
            return (_map_blocks(node, walk),)
        p = Sym(node.var)
        bodies = [substitute(node.body, {p: Bin("+", p, Lit(u))} if u else {}).stmts
                  for u in range(copies)]
        fuse = _Fuser(bodies)
        try:
            fused = fuse(bodies, [{} for _ in range(copies)])
        except _NotJammable:
            return (node,)
        if not any(isinstance(s, For) and isinstance(s.reduction, tuple) for s in fused):
            return (node,)
        done.append(node.var)
        loops, start = [], node.start
        for width in sum_widths(copies):
            stmts = fused if width == copies else fuse(bodies[:width],
                                                        [{} for _ in range(width)])
            loops.append(For(node.var, start, Bin("-", node.end, Lit(width - 1)),
                             Block(tuple(stmts)), step=width))
            start = Bin("+", start, Bin("*", Bin("/", Bin("-", node.end, start), Lit(width)),
                                        Lit(width)))
        return (*loops, replace(node, start=start))

    def walk(b: Block) -> Block:   # statements only: sums are loops, never in expressions
        return Block(tuple(x for s in b.stmts for x in jammed(s)))

    return walk(body), bool(done)


def _one_flat_sum(body: Block) -> bool:
    """The statements are declarations, one sum loop (declarations and accumulations
    inside) into a scalar declared among them, then stores to arrays: nothing an iteration
    writes is read by the next, so the copies' sums may run side by side. (A sum into a
    scalar declared outside, such as ``i,ij->``'s one total, carries from each iteration to
    the next.)"""
    stmts = body.stmts
    at = [k for k, s in enumerate(stmts) if isinstance(s, For)]
    if len(at) != 1 or not isinstance(stmts[at[0]].reduction, str):
        return False
    loop = stmts[at[0]]
    own = {s.name for s in stmts[:at[0]] if isinstance(s, Decl)}
    return loop.reduction in own and all(isinstance(s, Decl) for s in stmts[:at[0]]) and \
        all(isinstance(s, Assign) and isinstance(s.target, Load) for s in stmts[at[0] + 1:]) \
        and all(isinstance(s, (Decl, Assign)) for s in loop.body.stmts)


class _NotJammable(Exception):
    """The loop body holds a statement the jam does not handle (helpers, while loops)."""


def _encloses_tile(body: Block) -> bool:
    """A register-tile loop (``for k0: val[] tile; ...``) among the loop's statements or the
    then-branches of its remainder guards."""
    for s in body.stmts:
        if isinstance(s, If) and _encloses_tile(s.then):
            return True
        if isinstance(s, For) and any(isinstance(t, Decl) and t.ctype == "val[]"
                                      for t in s.body.stmts):
            return True
    return False


def _fuse(copies: list, renames: list) -> list:
    """One statement list doing the work of the statement lists ``copies`` (same shape,
    differing in the unrolled variable); ``renames[r]``: names copy ``r`` declared anew."""
    return _Fuser(copies)(copies, renames)


class _Fuser:
    """``_fuse`` over copies of one loop body (``bodies``), remembering each copy's renamed
    statements and which scalars the bodies assign, so fusing a prefix of the copies again
    (``jam_sums``' loop of four after its loop of eight) repeats none of that work."""

    def __init__(self, bodies: list):
        self.bodies, self.renamed, self.assigned = bodies, {}, None

    def rename(self, node, names: dict):
        key = (id(node), tuple(names.items()))
        found = self.renamed.get(key)
        if found is None:
            found = self.renamed[key] = _rename(node, names)
        return found

    def __call__(self, copies: list, renames: list) -> list:
        out = []
        for at in range(len(copies[0])):
            stmts = [self.rename(c[at], rn) for c, rn in zip(copies, renames)]
            first = stmts[0]
            same = all(s == first for s in stmts)
            if isinstance(first, For) and isinstance(first.reduction, str) and \
                    first.combine == "+" and \
                    all(isinstance(s, For) and isinstance(s.reduction, str) and
                        _header(s)[:-1] == _header(first)[:-1] for s in stmts):
                # sums over the same range: one loop summing into each copy's accumulator
                body = self([s.body.stmts for s in stmts], [dict(rn) for rn in renames])
                out.append(replace(first, body=Block(tuple(body)),
                                   reduction=tuple(s.reduction for s in stmts)))
            elif isinstance(first, For) and not first.simd and not first.reduction and \
                    all(_header(s) == _header(first) for s in stmts):
                body = self([s.body.stmts for s in stmts], [dict(rn) for rn in renames])
                out.append(replace(first, body=Block(tuple(body))))
            elif isinstance(first, If) and first.orelse is None and \
                    all(isinstance(s, If) and s.cond == first.cond and s.orelse is None
                        for s in stmts):
                then = self([s.then.stmts for s in stmts], [dict(rn) for rn in renames])
                out.append(replace(first, then=Block(tuple(then))))
            elif isinstance(first, Decl) and first.ctype != "val[]" and same and \
                    first.name not in self.assigned_names():
                out.append(first)   # the same value in every copy, never changed: once
            elif isinstance(first, Decl):
                for r, s in enumerate(stmts):
                    renames[r][s.name] = f"{s.name}_j{r}"
                    out.append(replace(s, name=renames[r][s.name]))
            elif isinstance(first, (Helper, While)):
                raise _NotJammable(type(first).__name__)
            else:
                out.extend(stmts)   # stores, accumulations, lane loops: once per copy
        return out

    def assigned_names(self) -> set:
        """The scalars any statement of the bodies assigns."""
        if self.assigned is None:
            found = set()

            def visit(n):
                if isinstance(n, Assign) and isinstance(n.target, Sym):
                    found.add(n.target.name)
                return n
            for stmts in self.bodies:
                for s in stmts:
                    rewrite(s, visit)
            self.assigned = found
        return self.assigned


def _header(s: For) -> tuple:
    """The loop's fields but its body, the reduction's name last."""
    return (s.var, s.start, s.end, s.step, s.parallel, s.simd, s.combine, s.reduction)


def _rename(node: Node, names: dict) -> Node:
    """``node`` with symbols and arrays in ``names`` renamed."""
    if not names:
        return node

    def visit(n):
        if isinstance(n, Sym) and n.name in names:
            return Sym(names[n.name])
        if isinstance(n, Load) and n.array in names:
            return replace(n, array=names[n.array])
        if isinstance(n, For) and n.reduction in names:
            return replace(n, reduction=names[n.reduction])
        return n
    return rewrite(node, visit)


def _map_blocks(node: Node, fn) -> Node:
    """``node`` with ``fn`` applied to its direct child blocks."""
    changes = {f.name: fn(getattr(node, f.name)) for f in fields(node)
               if isinstance(getattr(node, f.name), Block)}
    return replace(node, **changes) if changes else node
