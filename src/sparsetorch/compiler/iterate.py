"""Per-operand iteration state of lowering: where each operand's cursor is (``LoopState``)
and what a storage level answers about its loop (``LevelCode``: bounds, coordinate, the end
of a run of equal coordinates). Level kinds are told apart here, by their class, so the
lowering itself never branches on format names.
"""
from __future__ import annotations

from ..formats.levels import Compressed, Dense, Singleton
from .ir import Assign, Bin, Cond, Decl, If, Lit, Load, Sym, While, block


def arr(n, name):
    """The C name of operand ``n``'s array ``name`` (``pos1``, ``crd1``, ``vals``)."""
    return f"t{n}_{name}"


def dim(v):
    """The C name of index variable ``v``'s extent, as IR."""
    return Sym(f"n_{v}")


def horner(vars_):
    """Row-major linear index of coordinates ``vars_`` (each a variable name)."""
    node = Lit(0)
    for k, v in enumerate(vars_):
        node = Sym(v) if k == 0 else Bin("+", Bin("*", node, dim(v)), Sym(v))
    return node


class LoopState:
    def __init__(self, lowerer):
        self.pos = {n: Lit(0) for n in lowerer.accesses}
        self.lvl = {n: 0 for n in lowerer.accesses}
        self.seg = {}
        self.flag = {}
        self.acc = None
        self.hit = None
        self.tile = None          # (k0, length, tile array, lane var) inside a register tile
        self.marks_only = False   # a dense result row: cells marked, not listed
        self.unmarked = False     # a full result row: cells neither marked nor listed
        self.bits = False         # a result row's cells from row bitmaps (assemble.RowBits)
        self.outer = Lit(0)

    def copy(self, **changes):
        new = object.__new__(LoopState)
        new.__dict__ = {k: (dict(v) if isinstance(v, dict) else v)
                        for k, v in self.__dict__.items()}
        new.__dict__.update(changes)
        return new

    def enter(self, n, pos, seg, flag):
        self.pos[n] = pos
        self.seg[n] = seg
        self.lvl[n] += 1
        if flag is not None:
            self.flag[n] = flag


class LevelCode:
    """Loop-level questions answered by a level kind: bounds, coordinate, segment end."""

    def __init__(self, lowerer, n, k):
        fmt = lowerer.plan.formats[n]
        self.lowerer, self.n, self.k = lowerer, n, k
        self.level = fmt.levels[k]
        self.is_dense = isinstance(self.level, Dense)
        # A level segments its positions when the level below is a singleton (COO runs).
        self.segments = k + 1 < len(fmt.levels) and isinstance(fmt.levels[k + 1], Singleton)

    def bounds(self, st):
        n, k = self.n, self.k
        if isinstance(self.level, Compressed):
            p = st.pos[n]
            lo = Load(arr(n, f"pos{k}"), p)
            hi = Load(arr(n, f"pos{k}"), Bin("+", p, Lit(1)))
        else:  # singleton: iterate the parent's segment
            lo, hi = st.pos[n], st.seg[n]
        flag = st.flag.get(n)
        if flag is not None:  # absent parent: empty range
            lo, hi = Cond(flag, lo, Lit(0)), Cond(flag, hi, Lit(0))
        return lo, hi

    def entries(self):
        """How many positions this level stores (its coordinate array's length), as IR:
        ``t0_pos1[n_i]`` for CSR's columns."""
        fmt, vars_ = self.lowerer.plan.formats[self.n], self.lowerer.levels[self.n]
        count = None   # positions of the level above; None: the root's one
        for k in range(self.k + 1):
            level = fmt.levels[k]
            if isinstance(level, Dense):
                count = dim(vars_[k]) if count is None else Bin("*", count, dim(vars_[k]))
            elif isinstance(level, Compressed):
                count = Load(arr(self.n, f"pos{k}"), Lit(1) if count is None else count)
            # (a singleton level stores one coordinate per position of its parent)
        return count

    def coord(self, p):
        return Load(arr(self.n, f"crd{self.k}"), p)

    def segment_end(self, p, end, out, guard):
        """For segmenting levels, append code computing the end of the run of equal
        coordinates starting at ``p`` and return it; otherwise None."""
        if not self.segments:
            return None
        q = self.lowerer.fresh(f"q{self.n}_")
        out.append(Decl("idx", q, Bin("+", p, Lit(1))))
        scan = While(Bin("&&", Bin("<", Sym(q), end),
                         Bin("==", self.coord(Sym(q)), self.coord(p))),
                     block(Assign(Sym(q), Bin("+", Sym(q), Lit(1)))))
        out.append(scan if guard is None else If(guard, block(scan)))
        return Sym(q)
