"""Triton source from the loop IR: the scalar nest the C renderer prints, read block by block.

In: a lowered ``Function`` in its plain form (``compiler.kernel.lower_plain``: one loop per
index variable, no register tiles, unrolling or cache blocks; or ``compiler/attention.py``'s
fixed kernels, built plain). Out: a ``TritonKernel``, the text of a module defining one
``@triton.jit`` function ``kernel`` plus what its launcher needs (``ops/triton_run.py``);
``load`` turns a text into that function. Anything the mapping below does not cover raises
``Unsupported`` and the caller runs the fallback.

How the nest maps onto programs and blocks (Sputnik's techniques, Gale et al., SC 2020):

* the parallel row loop -> programs: program ``r`` takes ``ROWS`` rows from ``perm``, the
  rows sorted by length, longest first (row swizzle: long rows start first, rows running
  side by side have similar lengths; the launcher computes ``perm`` once per pattern);
* one dense loop over an output dimension that every store indexes (SpMM's ``k``) -> the
  grid's second axis: 1-D tiles of ``B_k`` columns; the programs' stores never overlap;
* every other loop -> a vector axis: a loop over a row's stored entries or over a dense
  extent steps ``B_v`` iterations at a time (one ``tl.arange`` lane each: vector loads, the
  residue lanes masked); a loop of constant extent (a block's rows or columns) is one step
  of its power-of-two width. Values are tensors of full rank (one dimension per axis, size
  1 where a value does not vary), so plain broadcasting lines them up;
* sums into a scalar across lanes become ``tl.sum`` (maximum updates ``tl.max``) over the
  lanes' axes, masked lanes contributing the identity; ``+=`` into an array element that an
  inner loop does not index is first given a register accumulator, stored once after the
  loop (scalar replacement); a sum over ``r`` of an ``(m, r)`` by ``(r, n)`` product of
  constant blocks of 16 and more becomes ``tl.dot`` when the launcher's ``USE_DOT`` says;
* loads widen to ``ACC`` (float32; float64 for float64 data), stores narrow to the array's
  type; a second nest over the same rows (an epilogue pass) runs in the same program, its
  loads of elements the program stored taken from registers.

What the renderer shares with ``c.py``: the IR and the notation's unary maps (``_UNARY``
spells ``notation.UNARY``'s C templates in Triton).
"""
from __future__ import annotations

import hashlib
import linecache
import os
from dataclasses import dataclass, replace

from ..compiler.ir import (Assign, Bin, Block, Call, Comment, Cond, Decl, For, Function, Helper,
                           If, Lit, Load, Sym, max_operand, names_read, statements, substitute)
from ..compiler.notation import UNARY
from .triton_nest import Fresh, pick_tile, replace_sums

# Triton spellings of the notation's unary maps, keyed by their C templates (a NaN passes
# relu and relu6, as through torch's: Triton's maximum drops it unless told).
_UNARY = {UNARY[name][0]: text for name, text in {
    "neg": "(-({x}))",
    "abs": "tl.abs({x})",
    "relu": "tl.maximum({x}, 0.0, propagate_nan=tl.PropagateNan.ALL)",
    "exp": "tl.exp({x})",
    "sqrt": "tl.sqrt({x})",
    "relu6": "tl.minimum(tl.maximum({x}, 0.0, propagate_nan=tl.PropagateNan.ALL), 6.0, "
             "propagate_nan=tl.PropagateNan.ALL)",
    "sigmoid": "tl.sigmoid({x})",
}.items()}
_OPS = {"&&": "&", "||": "|"}
_COMPARE = {"<", "<=", ">", ">=", "==", "!="}


class Unsupported(Exception):
    """The nest has a shape this renderer does not map (a merge of two sparse operands, a
    runtime helper, a store two programs could share): the caller runs the fallback."""


@dataclass(frozen=True)
class TritonKernel:
    """A rendered kernel and its launch recipe. ``args``: the IR parameters it takes, in
    order (then ``perm``, then the constants); ``rows``: the size parameter of the row loop;
    ``weights``: the position array whose row lengths order ``perm`` (None: rows in order);
    ``tile``: (variable, size parameter) of the grid's second axis, or None; ``blocks``:
    (variable, 'entries' | 'extent', bound parameter or None) of each stepped vector loop,
    whose width ``B_<variable>`` the launcher picks; ``zeroed``: arrays to zero-fill before
    the launch; ``dot``: the kernel takes ``USE_DOT`` and ``DOT_PREC``."""

    source: str
    args: tuple
    rows: str
    weights: str | None
    tile: tuple | None
    blocks: tuple
    zeroed: tuple
    dot: bool


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# -- rendering --------------------------------------------------------------------------------
class _Renderer:
    def __init__(self, fn: Function, static: dict):
        mapping = {Sym(f"n_{v}"): Lit(int(e)) for v, e in static.items()}
        body = substitute(fn.body, mapping) if mapping else fn.body
        self.params = [p for p in fn.params if p.name not in ("nt", "nc")]
        self.arrays = {p.name for p in self.params if p.ctype.endswith("*")}
        self.values = {p.name for p in self.params if p.ctype == "val*"}
        self.sizes = {p.name for p in self.params if not p.ctype.endswith("*")}
        self.zeroed, nests = [], []
        for s in body.stmts:
            if isinstance(s, Helper) and s.name == "zero_out":
                self.zeroed.append("out_vals")
            elif isinstance(s, For) and s.parallel is not None:
                nests.append(s)
            elif not isinstance(s, Comment):
                raise Unsupported(f"a top-level {type(s).__name__} statement")
        if not nests or any((n.var, n.start, n.end) != (nests[0].var, nests[0].start,
                                                         nests[0].end) for n in nests):
            raise Unsupported("nests over different rows")
        if nests[0].start != Lit(0) or not isinstance(nests[0].end, Sym):
            raise Unsupported("a row loop not from 0 to a size")
        self.row, self.rows = nests[0].var, nests[0].end.name
        par = nests[0].parallel
        self.weights = par.weights if par.schedule == "balanced" else None
        tile = pick_tile(nests, self.sizes)
        self.tile = tile.var if tile is not None else None
        self.tile_extent = tile.end.name if tile is not None else None
        self.fresh = Fresh()
        self.nests = [replace(n, body=replace_sums(n.body, self.tile, self.fresh))
                      for n in nests]
        every = [s for n in self.nests for s in statements(n.body)]
        self.blocked = any(isinstance(s, For) and isinstance(s.end, Lit) for s in every)
        self.carried = {s.target.name for s in every
                        if isinstance(s, Assign) and isinstance(s.target, Sym)}
        # vector axes, in the order of their positions in full-rank tensors
        self.axes = [self.tile] if self.tile else []
        self.blocks = []
        for s in every:
            if isinstance(s, For) and s.var != self.tile:
                kind = self._kind(s)
                if kind != "scalar" and s.var not in self.axes:
                    self.axes.append(s.var)
                if kind == "stepped" and s.var not in (b[0] for b in self.blocks):
                    extent = s.start == Lit(0) and isinstance(s.end, Sym) and \
                        s.end.name in self.sizes
                    self.blocks.append((s.var, "extent" if extent else "entries",
                                        s.end.name if extent else None))
        self.width = {}          # axis -> its width (a constant or a literal)
        self.shape = {}          # symbol -> frozenset of axes it varies along
        self.roots = {}          # symbol -> {'row', 'tile', 'gather'} it derives from
        self.kinds = {}          # symbol -> 'idx' | 'val'
        self.scope = []          # vector axes open here
        self.active = []         # vector conditions of enclosing Ifs
        self.depth = 0           # Python loops open inside the program
        self.known, self.pristine = {}, set(self.zeroed)
        self.dot = False
        self.lines = []

    # -- classification
    def _kind(self, f: For) -> str:
        if f.step != 1 or f.parallel is not None:
            raise Unsupported("a stepped or nested parallel loop")
        if isinstance(f.start, Lit) and isinstance(f.end, Lit):
            return "static"
        if self.blocked and not (f.start == Lit(0) and isinstance(f.end, Sym)):
            return "scalar"   # a blocked operand's stored blocks: the block is the vector
        return "stepped"

    def _full(self, axes) -> str:
        dims = [self.width[a] if a in axes else "1" for a in self.axes] or ["1"]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    def _lane(self, axis: str, base: str) -> str:
        if len(self.axes) == 1:
            return f"({base}).to(tl.int64)"
        index = ", ".join(":" if a == axis else "None" for a in self.axes)
        return f"({base}).to(tl.int64)[{index}]"

    def _mask(self, axes) -> str | None:
        parts = [f"m_{a}" for a in self.axes if a in axes] + self.active
        return " & ".join(parts) if parts else None

    # -- expressions: (text, axes, kind)
    def expr(self, e):
        if isinstance(e, Sym):
            name = e.name
            if name in self.sizes:
                return name, frozenset(), "idx"
            if name not in self.shape:
                raise Unsupported(f"symbol {name} read before it is bound")
            return name, self.shape[name], self.kinds[name]
        if isinstance(e, Lit):
            v = e.value
            if isinstance(v, float):
                return (repr(v) if v == v and abs(v) != float("inf")
                        else f'float("{v}")'), frozenset(), "val"
            return str(int(v)), frozenset(), "lit"
        if isinstance(e, Load):
            if e.array not in self.arrays:
                raise Unsupported(f"array {e.array} is not a parameter")
            index, axes, _ = self.expr(e.index)
            known = self.known.get((e.array, index)) if self.depth == 0 else None
            if known is not None:   # an element this program stored: still in a register
                return known, self.shape[known], "val"
            mask = self._mask(axes)
            load = f"tl.load({e.array} + ({index})" + \
                (f", mask={mask}, other=0)" if mask else ")")
            if e.array in self.values:
                return f"{load}.to(ACC)", axes, "val"
            return f"{load}.to(tl.int64)", axes, "idx"
        if isinstance(e, Bin):
            (a, sa, ka), (b, sb, kb) = self.expr(e.a), self.expr(e.b)
            kind = "val" if "val" in (ka, kb) else "lit" if ka == kb == "lit" else "idx"
            if e.op in ("min", "max"):
                return f"tl.{e.op}imum({a}, {b})", sa | sb, kind
            op = _OPS.get(e.op, e.op)
            if op == "/" and kind != "val":
                op = "//"
            return f"({a} {op} {b})", sa | sb, "idx" if e.op in _COMPARE else kind
        if isinstance(e, Cond):
            (c, sc, _), (a, sa, ka), (b, sb, kb) = (self.expr(e.cond), self.expr(e.a),
                                                    self.expr(e.b))
            return f"tl.where({c}, {a}, {b})", sc | sa | sb, \
                "val" if "val" in (ka, kb) else "idx"
        if isinstance(e, Call):
            if e.template not in _UNARY:
                raise Unsupported(f"no Triton spelling of {e.template}")
            x, axes, _ = self.expr(e.arg)
            return _UNARY[e.template].format(x=x), axes, "val"
        raise Unsupported(f"expression {type(e).__name__}")

    def _roots(self, e) -> set:
        out = set()
        if isinstance(e, Load):
            return self._roots(e.index) | {"gather"}
        for name in names_read(e):
            out |= self.roots.get(name, set())
        return out

    # -- statements
    def emit(self, text: str, indent: int):
        self.lines.append("    " * indent + text)

    def block(self, block: Block, indent: int):
        stmts = block.stmts
        for n, s in enumerate(stmts):
            self.stmt(s, indent)
            if isinstance(s, For) and self.depth == 0 and n + 1 < len(stmts) and any(
                    isinstance(t, Assign) and isinstance(t.target, Load)
                    for t in statements(s.body)):
                self.emit("tl.debug_barrier()", indent)   # later loads see these stores

    def stmt(self, s, indent: int):
        if isinstance(s, Comment):
            return
        if isinstance(s, Decl):
            return self.decl(s, indent)
        if isinstance(s, Assign):
            return self.store(s, indent) if isinstance(s.target, Load) \
                else self.assign(s, indent)
        if isinstance(s, For):
            return self.loop(s, indent)
        if isinstance(s, If):
            return self.branch(s, indent)
        raise Unsupported(f"statement {type(s).__name__}")

    def decl(self, s: Decl, indent: int):
        if s.ctype not in ("idx", "val"):
            raise Unsupported(f"a {s.ctype} declaration (register tiles, cursors)")
        self.kinds[s.name] = s.ctype
        self.roots[s.name] = self._roots(s.init) if s.init is not None else set()
        if s.name in self.carried:   # a loop-carried value: one shape for every iteration
            if s.ctype != "val":
                raise Unsupported("a loop-carried index")
            axes = frozenset(self.scope)
            text, init_axes, _ = self.expr(s.init if s.init is not None else Lit(0.0))
            if not init_axes <= axes:
                raise Unsupported(f"{s.name} starts wider than its scope")
            self.shape[s.name] = axes
            self.emit(f"{s.name} = tl.full({self._full(axes)}, {text}, ACC)"
                      if not init_axes else
                      f"{s.name} = ({text}) + tl.zeros({self._full(axes)}, ACC)", indent)
            return
        text, axes, _ = self.expr(s.init)
        self.shape[s.name] = axes
        self.emit(f"{s.name} = {text}", indent)

    def _reduce(self, value: str, axes, combine: str) -> str:
        identity = "0.0" if combine == "sum" else 'float("-inf")'
        out = f"tl.where({self._mask(axes)}, {value}, {identity})"
        for a in axes:
            out = f"tl.{combine}({out}, axis={self.axes.index(a)}, keep_dims=True)"
        return out

    def assign(self, s: Assign, indent: int):
        name = s.target.name
        if name not in self.shape:
            raise Unsupported(f"{name} assigned before it is declared")
        target = self.shape[name]
        best = max_operand(s, name)
        value = best if best is not None else s.value
        text, axes, _ = self.expr(value)
        extra = (axes | frozenset(self.scope)) - target
        if best is not None:
            self.emit(f"{name} = tl.maximum({name}, {self._reduce(text, extra, 'max')})"
                      if extra else f"{name} = tl.maximum({name}, {text})", indent)
        elif s.op == "+=":
            dot = self._dot(s.value, target, extra) if extra else None
            summed = self._reduce(text, extra, "sum") if extra else \
                (f"tl.where({' & '.join(self.active)}, {text}, 0.0)" if self.active else text)
            if dot is not None:
                self.emit("if USE_DOT:", indent)
                self.emit(f"{name} += {dot}", indent + 1)
                self.emit("else:", indent)
                self.emit(f"{name} += {summed}", indent + 1)
            else:
                self.emit(f"{name} += {summed}", indent)
        elif s.op == "=" and not extra:
            self.emit(f"{name} = ({text}) + tl.zeros({self._full(target)}, ACC)", indent)
        else:
            raise Unsupported(f"{name} {s.op} a value wider than it")

    def _dot(self, value, target, extra) -> str | None:
        """``tl.dot`` text of a sum over one constant axis ``r`` of an ``(m, r)`` by
        ``(r, n)`` product into ``target`` (m, n), blocks of 16 and more, else None."""
        if not isinstance(value, Bin) or value.op != "*" or len(extra) != 1 or \
                len(target) != 2:
            return None
        (r,) = extra
        (a, sa, _), (b, sb, _) = self.expr(value.a), self.expr(value.b)
        if r not in sa or r not in sb or len(sa) != 2 or len(sb) != 2 or \
                (sa - {r}) | (sb - {r}) != target or (sa - {r}) == (sb - {r}):
            return None
        (m,), (n,) = sa - {r}, sb - {r}
        if not all(self.width[x].isdigit() and int(self.width[x]) >= 16 for x in (m, r)):
            return None
        pos = self.axes.index

        def matrix(text, axes, rows, cols):
            first, second = sorted(axes, key=pos)
            t = f"tl.reshape(tl.where({self._mask(axes)}, {text}, 0.0), " \
                f"({self.width[first]}, {self.width[second]}))"
            return t if first == rows else f"tl.trans({t})"

        d = f"tl.dot({matrix(a, sa, m, r)}, {matrix(b, sb, r, n)}, input_precision=DOT_PREC)"
        if pos(m) > pos(n):
            d = f"tl.trans({d})"
        self.dot = True
        return f"tl.reshape({d}, {self._full(target)})"

    def store(self, s: Assign, indent: int):
        arr = s.target.array
        if arr not in self.arrays:
            raise Unsupported(f"array {arr} is not a parameter")
        roots = self._roots(s.target.index)
        if "gather" in roots or "row" not in roots or (self.tile and "tile" not in roots):
            raise Unsupported(f"a store to {arr} other programs may share")
        index, axes, _ = self.expr(s.target.index)
        text, vaxes, _ = self.expr(s.value)
        # every lane of an open loop the index does not follow adds into the same element
        extra = (vaxes | frozenset(self.scope) if s.op == "+=" else vaxes) - axes
        key = (arr, index)
        if extra:
            if s.op != "+=":
                raise Unsupported(f"a store to {arr} wider than its index")
            text = self._reduce(text, extra, "sum")
        zeros = f" + tl.zeros({self._full(frozenset())}, tl.int64)" if not axes else ""
        ptr, mask = f"{arr} + ({index}){zeros}", self._mask(axes)
        if s.op == "+=":
            if self.depth == 0 and key in self.known:
                text = f"{self.known[key]} + {text}"
            elif not (self.depth == 0 and arr in self.pristine):
                text = f"tl.load({ptr}{f', mask={mask}' if mask else ''}, other=0)" \
                    f".to(ACC) + {text}"
        elif s.op != "=":
            raise Unsupported(f"store operator {s.op}")
        self.pristine.discard(arr)
        self.known = {k: v for k, v in self.known.items() if k[0] != arr}
        if self.depth == 0:   # the program's own element: later loads read the register
            name = self.fresh("v")
            self.emit(f"{name} = {text}", indent)
            self.known[key], self.shape[name], self.kinds[name] = name, vaxes | axes, "val"
            text = name
        self.emit(f"tl.store({ptr}, ({text}).to({arr}.dtype.element_ty)"
                  + (f", mask={mask})" if mask else ")"), indent)

    def loop(self, f: For, indent: int):
        var = f.var
        if var == self.tile:           # hoisted to the grid: the body runs once per tile
            return self.block(f.body, indent)
        kind = self._kind(f)
        (lo, slo, _), (hi, shi, _) = self.expr(f.start), self.expr(f.end)
        if slo or shi:
            raise Unsupported(f"loop {var} with bounds that vary across lanes")
        bound_roots = (self._roots(f.start) | self._roots(f.end)) - {"gather"}
        self.kinds[var], self.roots[var] = "idx", bound_roots
        if kind == "scalar":
            self.emit(f"for {var} in range({lo}, {hi}):", indent)
            self.shape[var] = frozenset()
            self.depth += 1
            self.block(f.body, indent + 1)
            self.depth -= 1
            return
        self.shape[var] = frozenset({var})
        self.scope.append(var)
        if kind == "static":
            width = _pow2(int(f.end.value) - int(f.start.value))
            self.width[var] = str(width)
            self.emit(f"{var} = {self._lane(var, f'{lo} + tl.arange(0, {width})')}", indent)
            self.emit(f"m_{var} = {var} < {hi}", indent)
            self.block(f.body, indent)
        else:
            self.width[var] = f"B_{var}"
            self.emit(f"hi_{var} = {hi}", indent)
            self.emit(f"for s_{var} in range({lo}, hi_{var}, B_{var}):", indent)
            self.emit(f"{var} = {self._lane(var, f's_{var} + tl.arange(0, B_{var})')}",
                      indent + 1)
            self.emit(f"m_{var} = {var} < hi_{var}", indent + 1)
            self.depth += 1
            self.block(f.body, indent + 1)
            self.depth -= 1
        self.scope.pop()

    def branch(self, s: If, indent: int):
        cond, axes, _ = self.expr(s.cond)
        if not axes:
            self.emit(f"if {cond}:", indent)
            self.depth += 1
            self.block(s.then, indent + 1)
            if s.orelse is not None:
                self.emit("else:", indent)
                self.block(s.orelse, indent + 1)
            self.depth -= 1
            return
        for c, body in ((cond, s.then), (f"~({cond})", s.orelse)):
            if body is not None:
                self.active.append(f"({c})")
                self.depth += 1
                self.block(body, indent)
                self.depth -= 1
                self.active.pop()

    def render(self, title: str) -> TritonKernel:
        rows = self.row
        self.kinds[rows], self.roots[rows], self.shape[rows] = "idx", {"row"}, frozenset()
        head = []
        if self.tile:
            t = self.tile
            self.width[t] = f"B_{t}"
            self.kinds[t], self.roots[t], self.shape[t] = "idx", {"tile"}, frozenset({t})
            head = [f"{t} = {self._lane(t, f'tl.program_id(1) * B_{t} + tl.arange(0, B_{t})')}",
                    f"m_{t} = {t} < {self.tile_extent}"]
            self.scope.append(t)
        for n in self.nests:
            self.block(n.body, 3)
        body = self.lines
        consts = [f"B_{v}: tl.constexpr" for v, _, _ in self.blocks]
        if self.tile:
            consts.insert(0, f"B_{self.tile}: tl.constexpr")
        if self.dot:
            consts += ["USE_DOT: tl.constexpr", "DOT_PREC: tl.constexpr"]
        args = tuple(p.name for p in self.params)
        signature = ", ".join([*args, "perm", "ROWS: tl.constexpr", *consts,
                               "ACC: tl.constexpr"])
        traffic = "each stored entry's index and value once per dense tile, the dense " \
            "rows they select gathered once per entry, every result element written once"
        strategy = "one program per ROWS swizzled rows" + \
            (f" and B_{self.tile} columns of {self.tile}" if self.tile else "") + \
            "; loops stepped B_<var> lanes at a time, sums kept in registers"
        source = (
            "import triton\nimport triton.language as tl\n\n"
            f"# sparsetorch Triton kernel (from the loop IR of {title})\n"
            f"# memory traffic: {traffic}\n# parallel strategy: {strategy}\n\n"
            f"@triton.jit\ndef kernel({signature}):\n"
            + "".join(f"    {line}\n" for line in head)
            + "    for _r in tl.static_range(ROWS):\n"
            f"        _slot = tl.program_id(0) * ROWS + _r\n"
            f"        if _slot < {self.rows}:\n"
            f"            {rows} = tl.load(perm + _slot).to(tl.int64)\n"
            + "".join(f"{line}\n" for line in body))
        return TritonKernel(source, args, self.rows, self.weights,
                            (self.tile, self.tile_extent) if self.tile else None,
                            tuple(self.blocks), tuple(self.zeroed), self.dot)


def render(fn: Function, static: tuple = ()) -> TritonKernel:
    """The Triton kernel of plain nest ``fn``; ``static``: (variable, extent) pairs fixed
    at compile time (a block's rows and columns). Raises ``Unsupported`` where the mapping
    in this module's docstring does not apply.

    Example:
        >>> from sparsetorch.compiler.kernel import lower_plain
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.compiler.schedule import OperandInfo
        >>> from sparsetorch.formats.format import as_format
        >>> _, _, fn = lower_plain(parse_einsum("ij,jk->ik", [2, 2]),
        ...                        (OperandInfo(as_format("csr", 2), False),
        ...                         OperandInfo(as_format("dense", 2), True)))
        >>> k = render(fn)
        >>> k.tile, "tl.sum(" in k.source
        (('k', 'n_k'), True)
    """
    return _Renderer(fn, dict(static)).render(fn.name)


_MODULES: dict = {}


def load(source: str):
    """The ``kernel`` function of module text ``source``, built once per text (and per
    ``TRITON_INTERPRET``: Triton decides at decoration whether a kernel is interpreted). The
    text is registered with ``linecache`` under a name made from its hash, so Triton (which
    reads a kernel's source through ``inspect``) and tracebacks see it.

    Example:
        >>> kernel = load(source)   # doctest: +SKIP
    """
    key = (source, os.environ.get("TRITON_INTERPRET") == "1")
    found = _MODULES.get(key)
    if found is None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        filename = f"<sparsetorch-triton-{digest}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"__name__": f"sparsetorch_triton_{digest}"}
        exec(compile(source, filename, "exec"), namespace)
        found = _MODULES[key] = namespace["kernel"]
    return found
