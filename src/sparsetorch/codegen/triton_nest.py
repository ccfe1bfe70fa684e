"""The loop IR made ready for the block-shaped Triton renderer (``triton.py``): which loop
the grid's second axis takes over (``pick_tile``) and scalar replacement of sums into array
elements (``replace_sums``); plus the small IR queries both modules use.

Example:
    >>> from sparsetorch.compiler.ir import Lit, Load, Sym
    >>> sorted(names_read(Load("x", Sym("i"))))
    ['i']
"""
from __future__ import annotations

from dataclasses import replace

from ..compiler.ir import (Assign, Block, Decl, For, If, Lit, Load, Sym, arrays_read,
                           names_read, statements)


class Fresh:
    """Fresh variable names, ``_<base><n>`` (the IR's own names never start with ``_``)."""

    def __init__(self):
        self.n = 0

    def __call__(self, base: str) -> str:
        self.n += 1
        return f"_{base}{self.n}"


def pick_tile(nests, sizes) -> For | None:
    """The loop the grid's second axis takes over: from 0 to a size parameter (one of
    ``sizes``), summing into nothing, its variable in the index of every store and in no
    loop bound."""
    stmts = [s for n in nests for s in statements(n.body)]
    stores = [s for s in stmts if isinstance(s, Assign) and isinstance(s.target, Load)]
    bounds = set().union(*(names_read(s.start) | names_read(s.end) for s in stmts
                           if isinstance(s, For)))
    for s in stmts:
        if isinstance(s, For) and s.start == Lit(0) and isinstance(s.end, Sym) and \
                s.end.name in sizes and s.reduction is None and s.parallel is None and \
                s.var not in bounds and stores and \
                all(s.var in names_read(t.target.index) for t in stores):
            return s
    return None


def _bound_inside(loop: For, tile: str | None) -> set:
    names = {loop.var}
    for s in statements(loop.body):
        if isinstance(s, For) and s.var != tile:
            names.add(s.var)
        elif isinstance(s, Decl):
            names.add(s.name)
    return names


def replace_sums(block: Block, tile: str | None, fresh: Fresh) -> Block:
    """Scalar replacement: ``arr[idx] += v`` inside a loop that ``idx`` does not depend on
    becomes a register sum declared before the loop and added to ``arr[idx]`` once after it
    (innermost loops first, so a sum climbs as far out as its index allows)."""
    out = []
    for s in block.stmts:
        if isinstance(s, For):
            s = replace(s, body=replace_sums(s.body, tile, fresh))
            if s.var != tile:
                out.extend(_hoist_sums(s, tile, fresh))
                continue
        elif isinstance(s, If):
            s = replace(s, then=replace_sums(s.then, tile, fresh),
                        orelse=None if s.orelse is None else
                        replace_sums(s.orelse, tile, fresh))
        out.append(s)
    return Block(tuple(out))


def _hoist_sums(loop: For, tile: str | None, fresh: Fresh) -> list:
    bound = _bound_inside(loop, tile)
    stmts = list(statements(loop.body))
    touched = {}
    for s in stmts:
        for a in _arrays_touched(s):
            touched[a] = touched.get(a, 0) + 1
    # a store directly under For nests (not under an If) whose index the loop does not move
    movable = [s for s in _direct_stores(loop.body)
               if s.op == "+=" and not names_read(s.target.index) & bound
               and touched.get(s.target.array) == 1]
    if not movable:
        return [loop]
    names = {s: fresh("sum") for s in movable}

    def redirect(block: Block) -> Block:
        stmts = []
        for s in block.stmts:
            if s in names:
                s = Assign(Sym(names[s]), s.value, "+=")
            elif isinstance(s, For):
                s = replace(s, body=redirect(s.body))
            stmts.append(s)
        return Block(tuple(stmts))

    return [*(Decl("val", names[s], Lit(0)) for s in movable), replace(loop, body=redirect(
        loop.body)), *(Assign(s.target, Sym(names[s]), "+=") for s in movable)]


def _arrays_touched(s) -> set:
    """Arrays statement ``s`` itself (not its nested statements) reads or writes."""
    if isinstance(s, Assign):
        return arrays_read(s.value) | arrays_read(s.target)
    if isinstance(s, Decl):
        return arrays_read(s.init)
    if isinstance(s, For):
        return arrays_read(s.start) | arrays_read(s.end)
    if isinstance(s, If):
        return arrays_read(s.cond)
    return set()


def _direct_stores(block: Block):
    for s in block.stmts:
        if isinstance(s, Assign) and isinstance(s.target, Load):
            yield s
        elif isinstance(s, For):
            yield from _direct_stores(s.body)
