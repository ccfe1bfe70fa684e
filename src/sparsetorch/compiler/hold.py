"""Inner products against a row held in registers: SDDMM's entries at large K.

SDDMM ``out[i,j] = A[i,j] * sum_k X[i,k] Y[j,k]`` computes an inner product per stored
entry. ``jam.jam_sums`` runs eight of a row's entries side by side: each vector of X's row
is loaded once for eight FMAs, but every step reads from eight rows of Y at once. At K = 256
(1 KB rows) that is what bounds the kernel on AMD Zen 5: in hand-written C the same loop
ran 2.7x faster with Y's rows in L1 (every entry reading one row), so it waits on L2, which
delivered ~30 bytes a cycle to those eight interleaved streams.

Here a row's slice of X, ``C`` values (``SLICE_REGISTERS`` vector registers: 256 float32 or
128 float64 with AVX-512), is loaded into a register tile once per row (and column block),
and each entry's inner product then runs straight through its row of Y: one load per FMA
and one sequential stream, over four accumulators (``codegen/vector.py``'s tile sum), then
one horizontal add::

    for p in entries of row i               for k0 in [0, n_k) by C
      j = crd[p]; acc = 0                     hx[0:C] = X[i, k0:k0+C]        (registers)
      for k in [0, n_k)           -->         for p in entries of row i (in the block)
        acc += X[i,k] * Y[j,k]                  j = crd[p]; acc = (k0 ? out[p] : 0)
      out[p] = A[p] * acc                       for kk in [0, C): acc += hx[kk] * Y[j, k0+kk]
                                                out[p] = k0 + C < n_k ? acc : A[p] * acc

With more than one slice (K a multiple of C above it) a sum's partial result waits in its
output slot between slices. The kernel takes this nest when ``n_k`` is a whole number of
slices, else the side-by-side loops: in hand-written C a partial slice ran 0.74-0.78x those
at K = 200-240 with masked steps, 1.04-1.09x jumping into straight-line code; narrower
slices did not pay either (K = 128 in eight registers 1.07x, K = 64 in four 0.75x). It is
built where both operands' slices are contiguous in k (a strided slice would be gathered,
which the vector renderer does not hold): into kernels for long rows in their column blocks
(``sblock.column_blocked``), into kernels for short rows in one block (``sblock.held_rows``;
their C build takes ~0.06 s longer: 0.16-0.17 -> 0.22-0.23 s for Cora's).

Measured (``benchmarks/variants.py --knob hold.SLICE_REGISTERS=0,16 --kernel sddmm --inner
256``, the 24 DLMC masks of ``benchmarks/kernels.py``, 2 threads, AMD Zen 5, two runs):
1.170-1.176x geomean, 90%-sparse masks 1.276-1.282x (each 1.25-1.31x), 70%-sparse
1.073-1.078x (1.05-1.11x); K = 512 (two slices, one run) 1.244x (1.15x at least); at K = 64
and 128 (not taken; the kernel carries the nest) 1.001x and 1.002x. Graph masks (rows of a
few entries; Planetoid, Amazon, Coauthor; whole calls, one run, same A/B): K = 256 1.225x
geomean (1.06-1.44x), K = 64 1.008x.

Data per call: A's entries once per slice, X's rows once per slice and column block, each
entry's slice of Y's row once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .ir import (Assign, Bin, Decl, For, If, Lit, Load, Node, Sym, While, arrays_read, block,
                 names_read, rewrite, substitute)


# Vector registers a slice of the row's operand takes (``kernel.held_slice``; 0: no held
# nest). Sixteen leave sixteen of AVX-512's 32 for the four accumulators and the loads.
SLICE_REGISTERS = 16


class Held(NamedTuple):
    """A kernel's held nest (``CompiledKernel.held``): values of a slice, the most slices
    a call may have (None: any), and the operand whose rows the entries gather (its last
    dimension is the call's inner dimension)."""

    values: int
    most: int | None
    gathered: int


@dataclass(frozen=True)
class HeldSum:
    """The one-at-a-time loop of a row's sums, split for ``held_sweep``: the declarations
    before the sum (``j = crd[p]``, ``acc = 0``), the sum's variable and accumulator, the
    factors that read only the row (``held``: X[i, k]) and the rest (``other``: Y[j, k]),
    and the stores after it."""

    decls: tuple
    k: str
    acc: str
    held: Node
    other: Node
    stores: tuple


def held_sum(rest: For) -> HeldSum | None:
    """``rest`` (``for p: decls; for k [sum into acc]: acc += product; stores``) split into
    a ``HeldSum`` when the product has factors that read neither ``p`` nor anything the
    loop body declares but do read ``k`` (the row's operand), and factors that do read
    what the body declares (the entry's operand); else None.

    Example:
        >>> x = Load("x", Bin("+", Bin("*", Sym("i"), Sym("n_k")), Sym("k")))
        >>> y = Load("y", Bin("+", Bin("*", Sym("j"), Sym("n_k")), Sym("k")))
        >>> rest = For("p", Lit(0), Sym("n"), block(
        ...     Decl("idx", "j", Load("crd", Sym("p"))), Decl("val", "acc", Lit(0)),
        ...     For("k", Lit(0), Sym("n_k"), block(Assign(Sym("acc"), Bin("*", x, y), "+=")),
        ...         reduction="acc"),
        ...     Assign(Load("out", Sym("p")), Sym("acc"))))
        >>> parts = held_sum(rest)
        >>> parts.held == x, parts.other == y, parts.acc
        (True, True, 'acc')
    """
    stmts = rest.body.stmts
    loops = [n for n, s in enumerate(stmts) if isinstance(s, For)]
    if len(loops) != 1:
        return None
    at = loops[0]
    loop = stmts[at]
    if not (isinstance(loop.reduction, str) and loop.combine == "+" and loop.step == 1 and
            loop.start == Lit(0) and loop.end == Sym(f"n_{loop.var}") and
            len(loop.body.stmts) == 1):
        return None
    update = loop.body.stmts[0]
    if not (isinstance(update, Assign) and update.op == "+=" and
            update.target == Sym(loop.reduction)):
        return None
    decls, stores = stmts[:at], stmts[at + 1:]
    if not all(isinstance(s, Decl) for s in decls) or \
            not all(isinstance(s, Assign) for s in stores):
        return None
    local = {rest.var, *(s.name for s in decls)}
    held, other = [], []
    for factor in _factors(update.value):
        names = names_read(factor)
        (held if loop.var in names and not names & local else other).append(factor)
    if not held or not any(names_read(f) & local for f in other):   # nothing per entry
        return None
    if not all(_contiguous(f, loop.var) for f in (*held, *other)):
        return None   # a strided slice would be gathered: vector code does not hold it
    return HeldSum(tuple(decls), loop.var, loop.reduction, _product(held), _product(other),
                   tuple(stores))


def held_sweep(parts: HeldSum, p: str, go: Node, slice_values: int, fresh) -> list:
    """Statements computing one row's entries from position ``p`` while ``go`` (the entry
    at ``p`` exists and is in the current block) holds: per slice of ``slice_values``
    values of the row's operand, the slice into a register tile, then every such entry's
    sum over it; ``p`` ends past those entries. ``fresh`` makes new names. A sum's partial
    result waits in its store's target between slices, so with more than one slice per
    call the stores must be one assignment to an array element.

    Example:
        >>> from sparsetorch.compiler.ir import dump
        >>> x = Load("x", Bin("+", Bin("*", Sym("i"), Sym("n_k")), Sym("k")))
        >>> y = Load("y", Bin("+", Bin("*", Sym("j"), Sym("n_k")), Sym("k")))
        >>> parts = HeldSum((Decl("idx", "j", Load("crd", Sym("p"))),
        ...                  Decl("val", "acc", Lit(0))), "k", "acc", x, y,
        ...                 (Assign(Load("out", Sym("p")), Sym("acc")),))
        >>> names = iter(range(9))
        >>> go = Bin("<", Sym("p"), Sym("e"))
        >>> out = held_sweep(parts, "p", go, 32, lambda b: f"{b}{next(names)}")
        >>> print(dump(block(out)))
        idx p00 = p
        for k01 in [0, n_k) by 32
          val[] hx2 = 32
          for kk3 in [0, 32)  [simd]
            hx2[kk3] = x[((i * n_k) + (k01 + kk3))]
          p = p00
          while (p < e)
            idx j = crd[p]
            val acc = 0
            if (k01 > 0)
              acc = out[p]
            for kk3 in [0, 32)  [sum into acc]
              acc += (hx2[kk3] * y[((j * n_k) + (k01 + kk3))])
            if ((k01 + 32) < n_k)
              out[p] = acc
            else
              out[p] = acc
            p = (p + 1)
    """
    first, k0, tile, kk = fresh("p0"), fresh("k0"), fresh("hx"), fresh("kk")
    at = {Sym(parts.k): Bin("+", Sym(k0), Sym(kk))}
    held = substitute(parts.held, at)
    other = substitute(parts.other, at)
    width = Lit(slice_values)
    n_k = Sym(f"n_{parts.k}")
    acc = Sym(parts.acc)
    entry = [*parts.decls]
    stores = list(parts.stores)
    partial = _partial_target(parts)
    if partial is not None:   # a later slice starts from the sum so far
        entry.append(If(Bin(">", Sym(k0), Lit(0)), block(Assign(acc, partial))))
    entry.append(For(kk, Lit(0), width, block(Assign(acc, Bin("*", Load(tile, Sym(kk)), other),
                                                     "+=")), reduction=parts.acc))
    if partial is not None:
        stores = [If(Bin("<", Bin("+", Sym(k0), width), n_k), block(Assign(partial, acc)),
                     block(*stores))]
    entry += [*stores, Assign(Sym(p), Bin("+", Sym(p), Lit(1)))]
    return [Decl("idx", first, Sym(p)),
            For(k0, Lit(0), n_k, block(
                Decl("val[]", tile, width),
                For(kk, Lit(0), width, block(Assign(Load(tile, Sym(kk)), held)), simd=True),
                Assign(Sym(p), Sym(first)),
                While(go, block(*entry))), step=slice_values)]


def describe(depth: int, held: Held) -> str:
    """Whether a call whose inner dimension is ``depth`` runs the held nest ``held`` (for
    ``st.explain``).

    Example:
        >>> describe(512, Held(256, None, 2)), describe(100, Held(256, None, 2))
        ('this call: 2 slices of 256 values of each row in registers', \
'this call: no values held in registers (100 is not a multiple of 256)')
    """
    size, most = held.values, held.most
    if depth == 0:
        return "this call: no values held in registers (an inner dimension of 0)"
    if depth % size:
        return f"this call: no values held in registers ({depth} is not a multiple of {size})"
    if most is not None and depth > size * most:
        return f"this call: no values held in registers ({depth} is over {size * most}, " \
               f"the most this kernel holds)"
    slices = depth // size
    return f"this call: {slices} slice{'s' if slices > 1 else ''} of {size} values of each " \
           "row in registers"


def single_slice(parts: HeldSum) -> bool:
    """Whether ``held_sweep``'s nest needs ``n_k`` within one slice (its stores are not one
    assignment to an array element that could hold a partial sum)."""
    return _partial_target(parts) is None


def _partial_target(parts: HeldSum):
    """The array element the stores write, where a partial sum can wait, or None (also
    where the entry's statements read that array: they would read the partial sum)."""
    if len(parts.stores) != 1 or not isinstance(parts.stores[0].target, Load) or \
            parts.stores[0].op != "=":
        return None
    store = parts.stores[0]
    target = store.target
    if parts.acc in names_read(target) or target.array in arrays_read(store.value) or \
            any(d.init is not None and target.array in arrays_read(d.init) for d in parts.decls):
        return None
    return target


def _contiguous(e: Node, k: str) -> bool:
    """Whether every array read in ``e`` that depends on ``k`` reads consecutive elements
    as ``k`` steps (its index is ``rest + k`` or ``k + rest``, ``rest`` free of ``k``)."""
    found = []

    def visit(n):
        if isinstance(n, Load) and k in names_read(n.index):
            x = n.index
            found.append(isinstance(x, Bin) and x.op == "+" and (
                (x.b == Sym(k) and k not in names_read(x.a)) or
                (x.a == Sym(k) and k not in names_read(x.b))))
        return n
    rewrite(e, visit)
    return all(found)


def _factors(e: Node) -> list:
    """The factors of a product tree (``e`` itself when it is not a product)."""
    if isinstance(e, Bin) and e.op == "*":
        return _factors(e.a) + _factors(e.b)
    return [e]


def _product(factors: list) -> Node:
    out = factors[0]
    for f in factors[1:]:
        out = Bin("*", out, f)
    return out
