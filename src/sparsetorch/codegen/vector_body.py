"""The statements and expressions of one vector loop body (``Body``), rendered for
``vector.py``'s loops: each IR node becomes a lane-invariant scalar, a contiguous run of
indices, index lanes or a vector of values (``V``), and each assignment a vector store,
register update or accumulation.

A body is rendered once per loop shape; a register tile's copies differ only in the
placeholders below, which ``vector.py`` replaces per register.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..compiler.ir import Assign, Bin, Block, Call, Cond, Decl, Lit, Load, Sym, max_operand
from ..compiler.notation import UNARY
from .lanes import Lanes, NeedIndexLanes, Unsupported

_UNARY_BY_TEMPLATE = {template: name for name, (template, *_rest) in UNARY.items()}

# Placeholders in a register tile's body text (``tile_loop``, ``tile_sum``), replaced per
# register.
LANE0, REG, MASK, ACC = "ST_LANE0_", "ST_REG_", "ST_MASK_", "ST_ACC_"


@dataclass(frozen=True)
class V:
    """A rendered operand inside a vector loop: 's' a lane-invariant scalar C expression,
    'lin' an index equal to ``text`` + lane, 'at32'/'at64' (AVX2) the lanes' indices
    stored from ``text`` on (int32/int64; gathers only), 'vi' a vector of int64 indices,
    'vi32' int32 indices loaded as stored, one per lane (gathers only), 'vv' a vector of
    values."""

    kind: str
    text: str


class Body:
    """Statements and expressions of one vector loop body, for ``loops`` (a
    ``vector.VectorLoops``: fresh names, tile arrays, the scalar renderer)."""

    def __init__(self, loops, lanes: Lanes, mask, lane_var, env, acc=None, tile_reg=None,
                 i32=False, combine="+", first=False, shift="", tail=None):
        self.loops, self.lanes, self.mask, self.lane_var = loops, lanes, mask, lane_var
        self.env = dict(env)
        self.acc = acc or {}        # scalar accumulator -> its vector accumulator
        self.combine = combine      # how the accumulators take values: "+" or "max"
        self.tile_reg = tile_reg    # (tile array, register number)
        self.i32 = i32              # int32 indices may be gathered with as stored ('vi32')
        self.scalar = loops.scalar
        self.gathers = False        # set once a gather is rendered
        self.first = first          # sums' first step: accumulators start at its terms
        self.shift = shift          # added to contiguous runs' pointers (see ``tile_sum``)
        self.tail = tail            # a masked step's lane count (AVX2 tiles: ``tail_load``)

    # -- statements ------------------------------------------------------------------------
    def stmts(self, node, pad) -> list[str]:
        if isinstance(node, Block):
            return [line for s in node.stmts for line in self.stmts(s, pad)]
        if isinstance(node, Decl) and node.ctype in ("idx", "val"):
            v = self.expr(node.init)
            if v.kind == "s":
                ctype = "int64_t" if node.ctype == "idx" else "val_t"
                self.env[node.name] = V("s", node.name)
                return [f"{pad}const {ctype} {node.name} = {v.text};"]
            if v.kind in ("lin", "at32", "at64"):
                self.env[node.name] = v
                return []
            name = self.loops.fresh(node.name)
            self.env[node.name] = V(v.kind, name)
            vtype = self.lanes.vtype
            if v.kind in ("vi", "vi32"):
                vtype = self.lanes.index_vtype(v.kind)
            return [f"{pad}const {vtype} {name} = {v.text};"]
        if isinstance(node, Assign) and node.op in ("=", "+="):
            return [pad + line for line in self.assign(node)]
        raise Unsupported(f"statement {type(node).__name__}")

    def assign(self, s: Assign) -> list[str]:
        t, lanes = s.target, self.lanes
        if isinstance(t, Sym) and t.name in self.acc:
            vacc = self.acc[t.name]
            if self.combine == "max":
                value = max_operand(s, t.name)
                if value is None:
                    raise Unsupported("a maximum's update other than m = (v > m ? v : m)")
                new = lanes.op("max", vacc, self.vector(self.expr(value)))
                return [f"{vacc} = {self.in_step(vacc, new)};"]
            if s.op == "+=":
                return [f"{vacc} = {self.accumulate(vacc, s.value)};"]
        if not isinstance(t, Load):
            raise Unsupported("assignment to a scalar")
        if self.tile_reg is not None and t.array == self.tile_reg[0]:
            self.check_lane(t.index)
            reg = f"{t.array}_{self.tile_reg[1]}"
            value = self.accumulate(reg, s.value) if s.op == "+=" else \
                self.vector(self.expr(s.value))
            return [f"{reg} = {value};"]
        idx = self.expr(t.index)
        if idx.kind != "lin" or t.array in self.loops.tiles:
            raise Unsupported("scattered store")
        ptr = self.at(t.array, idx)
        value = self.vector(self.expr(s.value))
        if s.op == "+=":
            value = lanes.op("add", self.load(ptr), value)
        if self.mask is None:
            return [f"{lanes.op('storeu', ptr, value)};"]
        if self.tail is not None and lanes.isa == "avx2" and not self.shift:
            return [f"{lanes.tail_store(ptr, value, self.tail)};"]
        return [f"{lanes.masked_store(ptr, self.mask, value)};"]

    def accumulate(self, reg, value) -> str:
        """``reg + value`` with a fused multiply-add when ``value`` is a product (``value``
        alone in a sum's first step)."""
        if isinstance(value, Bin) and value.op == "*":
            a, b = self.vector(self.expr(value.a)), self.vector(self.expr(value.b))
            if self.first:
                return self.in_step(reg, self.lanes.op("mul", a, b))
            return self.in_step(reg, self.lanes.op("fmadd", a, b, reg))
        if self.first:
            return self.in_step(reg, self.vector(self.expr(value)))
        return self.in_step(reg, self.lanes.op("add", reg, self.vector(self.expr(value))))

    def in_step(self, reg, new) -> str:
        """``new`` for accumulator ``reg``: in a masked step only the step's lanes change (a
        masked-off lane's value is that of a zero loaded there, which is not always neutral:
        ``exp(0 - m)`` in a sum, ``0`` in a maximum of negatives)."""
        return new if self.mask is None else self.lanes.keep(self.mask, reg, new)

    def check_lane(self, index):
        if index != Sym(self.lane_var):
            raise Unsupported("tile indexed off its lane")

    # -- expressions -----------------------------------------------------------------------
    def expr(self, e) -> V:
        if isinstance(e, Sym):
            return self.env.get(e.name, V("s", e.name))
        if isinstance(e, Lit):
            return V("s", self.scalar.expr(e))
        if isinstance(e, Load):
            return self.load_expr(e)
        if isinstance(e, Bin):
            return self.binary(e)
        if isinstance(e, Cond):
            c, a, b = self.expr(e.cond), self.expr(e.a), self.expr(e.b)
            if c.kind != "s":
                raise Unsupported("per-lane condition")
            if a.kind == b.kind == "s":
                return V("s", f"({c.text} ? {a.text} : {b.text})")
            return V("vv", f"(({c.text}) ? {self.vector(a)} : {self.vector(b)})")
        if isinstance(e, Call):
            return self.call(e)
        raise Unsupported(f"expression {type(e).__name__}")

    def load_expr(self, e: Load) -> V:
        arr = e.array
        if self.tile_reg is not None and arr == self.tile_reg[0]:
            self.check_lane(e.index)
            return V("vv", f"{arr}_{self.tile_reg[1]}")
        idx = self.expr(e.index)
        index_type = self.scalar.array_ctype(arr)
        if idx.kind == "s":
            return V("s", f"{arr}[{idx.text}]")
        if idx.kind == "vv":
            raise Unsupported("value used as an index")
        if index_type is None:      # a value array
            if idx.kind == "lin":
                if self.tail is not None and self.lanes.isa == "avx2" and not self.shift:
                    return V("vv", self.lanes.tail_load(arr, idx.text, self.tail, self.mask))
                return V("vv", self.load(self.at(arr, idx)))
            self.gathers = True
            if idx.kind == "vi32":
                return V("vv", self.lanes.gather_i32(self.mask, idx.text, arr))
            if idx.kind in ("at32", "at64"):
                if self.mask is not None:   # (scalar loads past the mask could fault)
                    raise Unsupported("masked gather on AVX2")
                ctype = "int32_t" if idx.kind == "at32" else "int64_t"
                return V("vv", self.lanes.gather_at(arr, idx.text, ctype))
            self.need_index_lanes()
            return V("vv", self.lanes.gather(self.mask8(), idx.text, arr))
        if idx.kind == "lin" and self.lanes.isa == "avx2" and self.tile_reg is None:
            return V("at32" if index_type == "int32_t" else "at64", self.at(arr, idx))
        if idx.kind == "lin" and index_type == "int32_t" and self.i32 and \
                self.tile_reg is None:
            # int32 indices used as they are (x[crd[p]]): 16 float lanes per gather, twice
            # the lanes of int64 index vectors; arithmetic on them retries without.
            return V("vi32", self.lanes.load_i32(self.mask, self.at(arr, idx)))
        self.need_index_lanes()
        if idx.kind == "lin":
            ptr = self.at(arr, idx)
            if index_type == "int32_t":
                return V("vi", f"_mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32("
                                f"{self.mask8()}, {ptr}))")
            return V("vi", f"_mm512_maskz_loadu_epi64({self.mask8()}, {ptr})")
        if index_type == "int32_t":
            return V("vi", f"_mm512_cvtepi32_epi64(_mm512_mask_i64gather_epi32("
                            f"_mm256_setzero_si256(), {self.mask8()}, {idx.text}, {arr}, 4))")
        return V("vi", f"_mm512_mask_i64gather_epi64(_mm512_setzero_si512(), "
                        f"{self.mask8()}, {idx.text}, {arr}, 8)")

    def binary(self, e: Bin) -> V:
        a, b = self.expr(e.a), self.expr(e.b)
        op = e.op
        if a.kind == b.kind == "s":
            if op in ("min", "max"):
                return V("s", f"st_{op}({a.text}, {b.text})")
            return V("s", f"({a.text} {op} {b.text})")
        if op not in ("+", "-", "*"):
            raise Unsupported(f"vector {op}")
        if {"at32", "at64"} & {a.kind, b.kind}:
            raise Unsupported("arithmetic on gathered indices (AVX2)")
        if "vi32" in (a.kind, b.kind):
            raise NeedIndexLanes
        if "vv" in (a.kind, b.kind):
            name = {"+": "add", "-": "sub", "*": "mul"}[op]
            return V("vv", self.lanes.op(name, self.vector(a), self.vector(b)))
        # Index arithmetic: base + lane stays a contiguous run while only shifted.
        if op in ("+", "-") and {a.kind, b.kind} == {"lin", "s"} and \
                (a.kind == "lin" or op == "+"):
            lin, s = (a, b) if a.kind == "lin" else (b, a)
            return V("lin", f"({lin.text} {op} {s.text})")
        name = {"+": "add", "-": "sub", "*": "mullo"}[op]
        return V("vi", f"_mm512_{name}_epi64({self.index_vector(a)}, "
                        f"{self.index_vector(b)})")

    def call(self, e: Call) -> V:
        fn = _UNARY_BY_TEMPLATE.get(e.template)
        x = self.expr(e.arg)
        if x.kind == "s":
            return V("s", self.scalar.expr(Call(e.template, Sym(x.text))))
        x, lanes = self.vector(x), self.lanes
        if fn == "neg":
            return V("vv", lanes.op("sub", lanes.zero(), x))
        # (x86's max and min return their second operand where either is NaN: x goes
        # second, so a NaN passes through as through torch's relu)
        if fn == "relu":
            return V("vv", lanes.op("max", lanes.zero(), x))
        if fn == "abs":
            return V("vv", lanes.op("andnot", lanes.set1("-0.0"), x))
        if fn == "sqrt":
            return V("vv", lanes.op("sqrt", x))
        if fn == "relu6":
            return V("vv", lanes.op("min", lanes.set1("6"), lanes.op("max", lanes.zero(), x)))
        if fn in ("exp", "sigmoid"):   # (``intrinsics.py``: one exp per register type)
            exp = f"st_exp_{lanes.suf}{lanes.n * lanes.width * 8}"
            if fn == "exp":
                return V("vv", f"{exp}({x})")
            one = lanes.set1("1")   # 1 / (1 + e^-x): e^-x saturates to inf and 0, so 0 and 1
            return V("vv", lanes.op("div", one, lanes.op(
                "add", one, f"{exp}({lanes.op('sub', lanes.zero(), x)})")))
        raise Unsupported(f"vector {fn or e.template}")

    # -- conversions -----------------------------------------------------------------------
    def vector(self, v: V) -> str:
        if v.kind == "vv":
            return v.text
        if v.kind == "s":
            return self.lanes.set1(v.text)
        raise Unsupported("index used as a value")

    def index_vector(self, v: V) -> str:
        self.need_index_lanes()
        if v.kind == "vi32":
            raise NeedIndexLanes
        if v.kind == "vi":
            return v.text
        if v.kind == "s":
            return f"_mm512_set1_epi64({v.text})"
        if v.kind == "lin":
            return (f"_mm512_add_epi64(_mm512_set1_epi64({v.text}), "
                    "_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0))")
        raise Unsupported("value used as an index")

    def at(self, arr, idx: V) -> str:
        """The pointer to a contiguous run (``idx`` of kind 'lin') of ``arr``."""
        return f"({arr} + {idx.text}){self.shift}"

    def load(self, ptr) -> str:
        if self.mask is None:
            return self.lanes.op("loadu", ptr)
        return self.lanes.masked_load(self.mask, ptr)

    def need_index_lanes(self):
        if self.tile_reg is not None:
            raise Unsupported("gather inside a register tile")
        if self.lanes.isa != "avx512":    # int64 index lanes: AVX-512 only
            raise Unsupported("per-lane index arithmetic")
        if self.lanes.n != 8:
            raise NeedIndexLanes

    def mask8(self):
        return self.mask if self.mask is not None else "(__mmask8)0xFF"
