"""AVX-512 and AVX2 rendering of the loops the IR marks as vector work: register tiles and
sums.

Why explicit intrinsics instead of ``#pragma omp simd``: on the two loop shapes that carry
sparse-dense kernels GCC's vectoriser loses a factor of 2-3 here.

* A **position sum** (``For(..., reduction=acc)``: the j loop of SpMV, the k loop of SDDMM)
  over a row of 5-15 nonzeros runs scalar below the vectoriser's trip count, so every entry
  waits on the previous add (4 cycles) and every row mispredicts its exit. Rendered here, a
  row is ceil(len / L) masked vector steps (masked loads, a masked gather for ``x[crd[p]]``)
  and one horizontal add: no scalar tail, no trip-count branch. Measured 1.9-2.1x on the
  DLMC embedding SpMV (33288x512, 10 nnz/row). A maximum (``combine="max"``: the row
  softmax's shift) is the same loop with vector max from -inf and a horizontal max: as a
  scalar compare chain it took over half of the row softmax (2x on 65-entry rows).
* A **register tile** (``Decl val[] tile W`` + the ``simd`` loops over its lanes: the k of
  SpMM) of several vector registers: GCC keeps a multi-register tile array in memory, so
  wider tiles measured slower, and one register is latency-bound (one FMA chain). Here each
  register of the tile is a named ``__m512`` value, every nonzero issues R independent FMAs,
  and a partial tile is the same code under lane masks.

Memory traffic is unchanged by this rendering (the IR fixes it); only instruction selection
differs. Anything outside the supported shapes raises ``Unsupported`` and the caller renders
the whole function with pragmas instead, so correctness never depends on this file.

AVX-512: values are 16 float or 8 double per register. A float32 gather through int32
indices used as stored (``x[crd[p]]``) runs 16 lanes; any other per-lane index runs 8 lanes
with int64 index vectors, so index arithmetic never overflows.

AVX2 (with FMA; ``_Lanes.isa``): 8 float or 4 double per 256-bit register, masks are lane
vectors (``maskload``/``maskstore``). A gather ``x[crd[p]]`` is built from scalar loads
(``st_gather_*``, any value and index width), which beats AVX2's gather instructions on AMD
Zen 3; since loads past a row's end could fault, sums take whole vector steps and finish
with a scalar tail instead of a masked step. Per-lane index arithmetic is left to pragmas.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..compiler.ir import (Assign, Bin, Block, Call, Cond, Decl, For, Lit, Load, Sym,
                           max_operand)
from ..compiler.notation import UNARY
from .intrinsics import ISA_BYTES

SHORT_SUM = {"avx512": 4, "avx2": 8}
# Sums of at most this many float32 terms take one 8-lane (256-bit) step: a 256-bit gather
# and horizontal add cost half of 512-bit ones, which dominate rows of 4-8 entries (graph
# and FEM rows): 1.3-2x on SpMV of such matrices.
HALF_SUM = 8
# A float32 sum through a gather (``x[crd[p]]``: SpMV's rows) of 9-16 terms takes one
# masked 16-lane step, no loop; longer ones loop over 8-lane steps. On Intel Sapphire Rapids
# 512-bit gathers in a loop ran slower per term than 256-bit ones (hand-written C, one
# thread: rows of 20 entries 177 -> 152 us, of 100 44 -> 38 us), while one 512-bit step
# beat two 256-bit ones and a loop whose exit the row lengths make unpredictable (the DLMC
# embedding, rows of 4-70 entries: 228 -> 152 us for the step alone). The generated SpMV,
# ``benchmarks/compiler.py`` old and new interleaved twice (2 threads): DLMC median 0.90x ->
# 1.08-1.10x torch.sparse, all 108 matrices 0.96-0.98x -> 1.08-1.11x, the embedding 124-129
# -> 106-110 us. Sums without a gather (SDDMM's inner products) keep 16-lane loops.
GATHERED_LOOP_LANES = 8
# On AMD Zen 5 the loop over 16-lane steps (two accumulators) is the faster one for long
# rows: ``render_c(..., wide_gathers_from=n)`` keeps the 8-lane loop up to n terms and takes
# 16-lane steps beyond (``kernel.wide_gathers_from`` picks n per CPU). Generated SpMV on
# the 108 matrices of ``benchmarks/compiler.py`` (``benchmarks/variants.py --knob
# wide_gathers_from=none,48 --kernel spmv``, two runs): geomean 1.047-1.062x, none below
# 0.985x; rows of 150-900 entries 1.13-1.38x. 16-lane loops from 17 terms on were slower on
# rows of 17-48 (down to 0.89x).

# Accumulators of a sum over a register tile (``tile_sum``): four FMA chains keep two FMA
# units busy at a 4-cycle latency.
TILE_SUM_CHAINS = 4

_UNARY_BY_TEMPLATE = {template: name for name, (template, *_rest) in UNARY.items()}


class Unsupported(Exception):
    """This loop has a shape the vector renderer does not handle."""


class _NeedIndexLanes(Exception):
    """A per-lane index is needed: retry the loop with 8 lanes (int64 index vectors)."""


@dataclass(frozen=True)
class _Lanes:
    """Intrinsic spelling for one vector shape of the value type on one ISA. AVX-512 masks
    are mask registers (``__mmask16``); AVX2 has none, so its masks are vectors whose set
    lanes are all ones (``__m256i``), taken by ``maskload``/``maskstore``."""

    vtype: str     # __m512 / __m256 / __m512d / __m256d
    pre: str       # _mm512 / _mm256
    suf: str       # ps / pd
    n: int         # lanes
    width: int     # value bytes
    isa: str       # avx512 / avx2

    def op(self, name, *args):
        return f"{self.pre}_{name}_{self.suf}({', '.join(args)})"

    def zero(self):
        return self.op("setzero")

    def set1(self, x):
        return self.op("set1", f"(val_t)({x})")

    def hsum(self, v):
        if self.vtype in ("__m256", "__m256d"):
            return f"st_hsum256{'d' if self.suf == 'pd' else ''}({v})"
        return self.op("reduce_add", v)

    def hmax(self, v):
        if self.vtype in ("__m256", "__m256d"):
            return f"st_hmax256{'d' if self.suf == 'pd' else ''}({v})"
        return self.op("reduce_max", v)

    def hsum4(self) -> str | None:
        """The helper that adds up four float32 registers into one ``__m128``, if any."""
        return {"__m512": "st_hsum4", "__m256": "st_hsum4_256"}.get(self.vtype)

    # -- masks -----------------------------------------------------------------------------
    def mask_decl(self, name, remaining) -> str:
        """``name``: lanes [0, remaining) of a step set (all if remaining >= n)."""
        if self.isa == "avx2":
            return f"const __m256i {name} = st_vmask{self.n}({remaining});"
        return f"const __mmask{self.n} {name} = st_mask{self.n}({remaining});"

    def masked_load(self, mask, ptr):
        if self.isa == "avx2":
            return self.op("maskload", ptr, mask)
        return self.op("maskz_loadu", mask, ptr)

    def keep(self, mask, old, new):
        """``new`` in the lanes of ``mask``, ``old`` in the others."""
        if self.isa == "avx2":
            cast = "_mm256_castsi256_ps" if self.suf == "ps" else "_mm256_castsi256_pd"
            return self.op("blendv", old, new, f"{cast}({mask})")
        return self.op("mask_mov", old, mask, new)

    def masked_store(self, ptr, mask, value):
        if self.isa == "avx2":
            return self.op("maskstore", ptr, mask, value)
        return self.op("mask_storeu", ptr, mask, value)

    # -- gathers ---------------------------------------------------------------------------
    def index_vtype(self, kind) -> str:
        """Register type of AVX-512 index lanes: 'vi32' int32 as stored, 'vi' int64."""
        return "__m256i" if kind == "vi32" and self.n == 8 else "__m512i"

    def gather_at(self, base, ptr, index_ctype):
        """AVX2: ``base[ptr[0]], ..., base[ptr[n-1]]`` (``st_gather_*``, scalar loads)."""
        return f"st_gather_{self.suf}_{'i32' if index_ctype == 'int32_t' else 'i64'}({base}, {ptr})"

    def gather(self, mask, index, base):
        scale = self.width
        return (f"_mm512_mask_i64gather_{self.suf}({self.zero()}, {mask}, {index}, "
                f"{base}, {scale})")

    def load_i32(self, mask, ptr):
        """One int32 index per lane, as stored (``self.n`` of them); ``mask`` None: all."""
        reg = "_mm512" if self.n == 16 else "_mm256"
        mask = mask if mask is not None else f"(__mmask{self.n})-1"
        return f"{reg}_maskz_loadu_epi32({mask}, {ptr})"

    def gather_i32(self, mask, index, base):
        """Values at ``load_i32`` indices: 16 or 8 lanes of float, 8 of double."""
        name = "mmask_i32gather" if self.vtype == "__m256" else "mask_i32gather"
        mask = mask if mask is not None else f"(__mmask{self.n})-1"
        return f"{self.pre}_{name}_{self.suf}({self.zero()}, {mask}, {index}, {base}, {self.width})"


_SHAPES = {("avx512", "float", 16): _Lanes("__m512", "_mm512", "ps", 16, 4, "avx512"),
           ("avx512", "float", 8): _Lanes("__m256", "_mm256", "ps", 8, 4, "avx512"),
           ("avx512", "double", 8): _Lanes("__m512d", "_mm512", "pd", 8, 8, "avx512"),
           ("avx2", "float", 8): _Lanes("__m256", "_mm256", "ps", 8, 4, "avx2"),
           ("avx2", "double", 4): _Lanes("__m256d", "_mm256", "pd", 4, 8, "avx2")}


def full_lanes(val_ctype: str, isa: str | None) -> int | None:
    """Values per register of ``isa`` for this value type, or None if not vectorised."""
    if isa not in ISA_BYTES:
        return None
    return {"float": ISA_BYTES[isa] // 4, "double": ISA_BYTES[isa] // 8}.get(val_ctype)


@dataclass(frozen=True)
class _V:
    """A rendered operand inside a vector loop: 's' a lane-invariant scalar C expression,
    'lin' an index equal to ``text`` + lane, 'at32'/'at64' (AVX2) the lanes' indices
    stored from ``text`` on (int32/int64; gathers only), 'vi' a vector of int64 indices,
    'vi32' int32 indices loaded as stored, one per lane (gathers only), 'vv' a vector of
    values."""

    kind: str
    text: str


class VectorLoops:
    """Renders tile declarations and vector loops for ``_CRenderer`` (``scalar``)."""

    def __init__(self, scalar):
        self.scalar = scalar
        self.val, self.isa = scalar.val, scalar.isa
        self.wide_from = scalar.wide_gathers_from   # see GATHERED_LOOP_LANES
        if full_lanes(self.val, self.isa) is None:
            raise Unsupported(f"value type {self.val} on {self.isa}")
        self.tiles = {}          # tile array name -> number of registers
        self.names = 0

    def shape(self, n=None) -> _Lanes:
        """The vector shape of ``n`` lanes (default: a full register) of the value type."""
        return _SHAPES[(self.isa, self.val, n or full_lanes(self.val, self.isa))]

    def fresh(self, base):
        self.names += 1
        return f"{base}_v{self.names}"

    # -- tiles ---------------------------------------------------------------------------
    def tile_decl(self, s: Decl, pad: str) -> list[str]:
        lanes = self.shape()
        width = s.init.value if isinstance(s.init, Lit) else None
        if width is None or width % lanes.n:
            raise Unsupported("tile width is not a whole number of registers")
        regs = width // lanes.n
        self.tiles[s.name] = regs
        return [f"{pad}{lanes.vtype} " + ", ".join(f"{s.name}_{r} = {lanes.zero()}"
                                                  for r in range(regs)) + ";"]

    def tile_loop(self, s: For, pad: str) -> list[str]:
        """A ``simd`` loop over a tile's lanes: one copy of the body per register, masked
        when the trip count is not the full tile."""
        tile = _tile_of(s.body, self.tiles)
        if tile is None or s.start != Lit(0) or s.step != 1:
            raise Unsupported("simd loop outside a register tile")
        lanes = self.shape()
        regs = self.tiles[tile]
        full = isinstance(s.end, Lit) and s.end.value == regs * lanes.n
        out = [f"{pad}{{"]
        if not full:
            out.append(f"{pad}  const int64_t {s.var}_n = {self.scalar.expr(s.end)};")
        # Every register's code is the same text but for its first lane, register and mask:
        # render it once with placeholders (rendering 16-register tiles register by register
        # took most of SpMM's compile time); a copy that declares values gets its own block.
        body = _Body(self, lanes, None if full else _MASK, s.var, {s.var: _V("lin", _LANE0)},
                     tile_reg=(tile, _REG))
        text = body.stmts(s.body, pad + "  ")
        scoped = _declares(text)
        for r in range(regs):
            mask = None
            if not full:
                mask = self.fresh("m")
                out.append(f"{pad}  " + lanes.mask_decl(mask, f"{s.var}_n - {r * lanes.n}"))
            copy = [line.replace(_LANE0, str(r * lanes.n)).replace(_REG, str(r))
                    for line in text]
            if mask is not None:
                copy = [line.replace(_MASK, mask) for line in copy]
            if mask is not None and r > 0:
                # a register with no lane in the tile is skipped, not run under an empty
                # mask: a result of 1-8 columns (a vector as a matrix, a GCN's class scores)
                # costs one register per entry instead of the tile's four
                out += [f"{pad}  if ({s.var}_n > {r * lanes.n}) {{",
                        *("  " + line for line in copy), f"{pad}  }}"]
            else:
                out += [f"{pad}  {{", *("  " + line for line in copy), f"{pad}  }}"] \
                    if scoped else copy
        return out + [f"{pad}}}"]

    # -- sums ----------------------------------------------------------------------------
    def sum_loop(self, s: For, pad: str) -> list[str]:
        """``acc += f(p)`` over p in [start, end): masked vector steps (AVX2: whole steps
        and a scalar tail), one horizontal add; runs shorter than ``SHORT_SUM`` (graph rows
        of a few entries) stay scalar, where the fixed cost of a gather and a horizontal add
        would dominate, and float32 runs of at most ``HALF_SUM`` take one 256-bit step.
        Longer float32 runs through a gather take one 512-bit step up to 16 terms, then
        loop over 256-bit steps (``GATHERED_LOOP_LANES``), and over 512-bit steps past
        ``wide_gathers_from`` terms where the renderer sets it."""
        if isinstance(s.reduction, tuple):
            if s.combine != "+":
                raise Unsupported(f"side-by-side {s.combine} reductions")
            return self.side_by_side_sums(s, pad)
        tile = _tile_of(s.body, self.tiles)
        if tile is not None:
            return self.tile_sum(s, pad, tile)
        full = full_lanes(self.val, self.isa)
        eight = min(8, full)   # the lanes of int64 index vectors (AVX-512)
        attempts = list(dict.fromkeys([(full, True), (eight, True), (eight, False)]))
        vector, lanes, gathers = self._first_sum_loop(s, pad + "  ", attempts)
        scalar = self._scalar(For(s.var, s.start, s.end, s.body), pad + "  ")
        trip = f"({self.scalar.expr(s.end)}) - ({self.scalar.expr(s.start)})"
        out = [f"{pad}if ({trip} < {SHORT_SUM[self.isa]}) {{", *scalar]
        if lanes.n > HALF_SUM:
            narrow = [(HALF_SUM, True), (HALF_SUM, False)]
            step, _, _ = self._first_sum_loop(s, pad + "  ", narrow, single=True)
            out += [f"{pad}}} else if ({trip} <= {HALF_SUM}) {{", *step]
            if gathers:
                shot, _, _ = self._first_sum_loop(s, pad + "  ", [(lanes.n, True)],
                                                  single=True)
                out += [f"{pad}}} else if ({trip} <= {lanes.n}) {{", *shot]
                narrow = [(GATHERED_LOOP_LANES, True), (GATHERED_LOOP_LANES, False)]
                loop, _, _ = self._first_sum_loop(s, pad + "  ", narrow)
                if self.wide_from is None:
                    vector = loop   # (the full-width loop above only told that it gathers)
                else:
                    out += [f"{pad}}} else if ({trip} <= {self.wide_from}) {{", *loop]
        return out + [f"{pad}}} else {{", *vector, f"{pad}}}"]

    def tile_sum(self, s: For, pad: str, tile: str) -> list[str]:
        """A sum over every lane of a register tile (``compiler/hold.py``: an inner product
        against a row held in registers): the body once per register, straight-line, its
        products spread over ``TILE_SUM_CHAINS`` accumulators (independent FMA chains; the
        first product of each a multiply, not an FMA on zero), then one horizontal add."""
        lanes = self.shape()
        regs = self.tiles[tile]
        if s.start != Lit(0) or s.end != Lit(regs * lanes.n) or s.step != 1 or \
                s.combine != "+":
            raise Unsupported("sum over part of a register tile")
        adds = [a for a in s.body.stmts if isinstance(a, Assign) and a.op == "+=" and
                a.target == Sym(s.reduction)]
        if len(adds) != 1 or len(adds) != sum(isinstance(a, Assign) for a in s.body.stmts):
            # the first register's products are multiplies: a second update would overwrite
            raise Unsupported("a tile sum updates its accumulator once a step")
        chains = [self.fresh(s.reduction) for _ in range(min(TILE_SUM_CHAINS, regs))]
        texts = []
        for first in (True, False):
            # A register's lanes as an offset added to the pointer last, so the C compiler
            # folds it into the load (an offset inside the index became one more loop-
            # invariant register per register of the tile: spills, ~2 instructions a load).
            body = _Body(self, lanes, None, s.var, {s.var: _V("lin", "0")},
                         acc={s.reduction: _ACC}, tile_reg=(tile, _REG), first=first,
                         shift=f" + {_LANE0}")
            texts.append(body.stmts(s.body, pad + "  "))
        scoped = _declares(texts[1])
        out = [f"{pad}{{", f"{pad}  {lanes.vtype} {', '.join(chains)};"]
        for r in range(regs):
            text = texts[0] if r < len(chains) else texts[1]
            lines = [line.replace(_LANE0, str(r * lanes.n)).replace(_REG, str(r))
                     .replace(_ACC, chains[r % len(chains)]) for line in text]
            out += [f"{pad}  {{", *("  " + line for line in lines), f"{pad}  }}"] \
                if scoped else lines
        while len(chains) > 1:   # pairwise: a short dependency chain
            pairs = [lanes.op("add", a, b) for a, b in zip(chains[::2], chains[1::2])]
            chains = pairs + chains[len(pairs) * 2:]
        return out + [f"{pad}  {s.reduction} += {lanes.hsum(chains[0])};", f"{pad}}}"]

    def _scalar(self, loop: For, pad: str) -> list[str]:
        """``loop`` rendered without vector loops."""
        loops, self.scalar.vec = self.scalar.vec, None
        try:
            return self.scalar.stmt(loop, pad)
        finally:
            self.scalar.vec = loops

    def side_by_side_sums(self, s: For, pad: str) -> list[str]:
        """Several sums over one range (``jam_sums``: the inner products of neighbouring
        stored entries): one register per sum (independent FMA chains, so no unrolling),
        masked full-width steps, then the horizontal adds; four float32 sums share one
        (``st_hsum4``: 14 instructions for four results instead of ~28)."""
        lanes = self.shape()
        if s.step != 1:
            raise Unsupported("strided sum")
        var, n = s.var, lanes.n
        vaccs = {acc: self.fresh(acc) for acc in s.reduction}
        end, mask = self.fresh("end"), self.fresh("m")
        steps = []
        for m in (None, mask):   # whole registers unmasked, then one masked step
            body = _Body(self, lanes, m, var, {var: _V("lin", var)}, acc=vaccs, i32=True)
            try:
                steps.append(body.stmts(s.body, pad + "    "))
            except _NeedIndexLanes:
                raise Unsupported("per-lane index in side-by-side sums") from None
        out = [f"{pad}{{", f"{pad}  const int64_t {end} = {self.scalar.expr(s.end)};",
               f"{pad}  {lanes.vtype} " + ", ".join(f"{v} = {lanes.zero()}"
                                                    for v in vaccs.values()) + ";",
               f"{pad}  int64_t {var} = {self.scalar.expr(s.start)};",
               f"{pad}  for (; {var} + {n} <= {end}; {var} += {n}) {{", *steps[0], f"{pad}  }}",
               f"{pad}  if ({var} < {end}) {{",
               f"{pad}    " + lanes.mask_decl(mask, f"{end} - {var}"),
               *steps[1], f"{pad}  }}"]
        if lanes.hsum4() and len(vaccs) % 4 == 0:   # four sums per combined add
            sums = self.fresh("sums")
            out.append(f"{pad}  float {sums}[{len(vaccs)}];")
            regs = list(vaccs.values())
            out += [f"{pad}  _mm_storeu_ps({sums} + {g}, {lanes.hsum4()}"
                    f"({', '.join(regs[g:g + 4])}));" for g in range(0, len(regs), 4)]
            out += [f"{pad}  {acc} += {sums}[{u}];" for u, acc in enumerate(vaccs)]
        else:
            out += [f"{pad}  {acc} += {lanes.hsum(v)};" for acc, v in vaccs.items()]
        return out + [f"{pad}}}"]

    def _first_sum_loop(self, s: For, pad, attempts, single=False):
        """The first (lanes, int32 index lanes allowed) attempt that renders: its lines, its
        lanes and whether it gathers. Full-width loops run two accumulators (long DLMC
        rows: ~8% faster); ``single``: the trip count is known to fit one register, so one
        masked step, no loop."""
        full = full_lanes(self.val, self.isa)
        for n, i32 in attempts:
            lanes = self.shape(n)
            try:
                bodies = []
                unroll = 2 if n == full and not single else 1
                lines = self._sum_loop(s, pad, lanes, i32, unroll, single, bodies)
                return lines, lanes, any(b.gathers for b in bodies)
            except _NeedIndexLanes:
                continue
        raise Unsupported("index lanes")

    def _sum_loop(self, s: For, pad, lanes: _Lanes, i32: bool, unroll: int,
                  single: bool, bodies: list) -> list[str]:
        """Unmasked steps of ``unroll`` registers (one accumulator each: independent FMA
        chains), then masked steps for the rest, then one horizontal add (a maximum's:
        vector max from -inf, then a horizontal max); with ``single`` (at most one register
        of terms) one masked step and the add, nothing to branch on. AVX2 has no masked
        gathers: whole steps there, and the rest runs scalar after the horizontal add. The
        ``_Body`` of each step is appended to ``bodies``."""
        if s.step != 1:
            raise Unsupported("strided sum")
        acc, var, n = s.reduction, s.var, lanes.n
        vaccs = [self.fresh(acc) for _ in range(unroll)]
        end, mask = self.fresh("end"), self.fresh("m")
        # a sum starts at 0 and adds; a maximum starts at -inf and takes the larger
        maximum = s.combine == "max"
        start = lanes.set1("-INFINITY") if maximum else lanes.zero()
        join = "max" if maximum else "add"

        def fold(v):   # the scalar accumulator takes a register's lanes
            if maximum:
                return f"{{ const val_t h_ = {lanes.hmax(v)}; if (h_ > {acc}) {acc} = h_; }}"
            return f"{acc} += {lanes.hsum(v)};"
        out = [f"{pad}{{", f"{pad}  const int64_t {end} = {self.scalar.expr(s.end)};",
               f"{pad}  {lanes.vtype} {vaccs[0]} = {start};",
               f"{pad}  int64_t {var} = {self.scalar.expr(s.start)};"]
        if unroll > 1:
            # Behind a test of the trip count, so shorter sums (most rows of graphs and
            # pruned embeddings) carry no second accumulator: 10-15% on such SpMV.
            width = unroll * n
            out += [f"{pad}  if ({end} - {var} >= {width}) {{",
                    f"{pad}    {lanes.vtype} " + ", ".join(f"{v} = {start}"
                                                          for v in vaccs[1:]) + ";",
                    f"{pad}    for (; {var} + {width} <= {end}; {var} += {width}) {{"]
            for k, vacc in enumerate(vaccs):
                lane = _V("lin", f"({var} + {k * n})" if k else var)
                body = _Body(self, lanes, None, var, {var: lane}, acc={acc: vacc}, i32=i32,
                             combine=s.combine)
                bodies.append(body)
                out += [f"{pad}      {{", *body.stmts(s.body, pad + "        "),
                        f"{pad}      }}"]
            total = vaccs[0]
            for v in vaccs[1:]:
                total = lanes.op(join, total, v)
            out += [f"{pad}    }}", f"{pad}    {vaccs[0]} = {total};", f"{pad}  }}"]
        whole = lanes.isa == "avx2"
        body = _Body(self, lanes, None if whole else mask, var, {var: _V("lin", var)},
                     acc={acc: vaccs[0]}, i32=i32, combine=s.combine)
        bodies.append(body)
        step = body.stmts(s.body, pad + "    ")
        if whole:
            rest = self.fresh("rest")
            tail = self._scalar(For(var, Sym(rest), s.end, s.body), pad + "  ")
            return [*out, f"{pad}  for (; {var} + {n} <= {end}; {var} += {n}) {{", *step,
                    f"{pad}  }}", f"{pad}  {fold(vaccs[0])}",
                    f"{pad}  const int64_t {rest} = {var};", *tail, f"{pad}}}"]
        step.insert(0, f"{pad}    " + lanes.mask_decl(mask, f"{end} - {var}"))
        head = f"{pad}  {{" if single else f"{pad}  for (; {var} < {end}; {var} += {n}) {{"
        return [*out, head, *step, f"{pad}  }}", f"{pad}  {fold(vaccs[0])}", f"{pad}}}"]


# Placeholders in a register tile's body text (``tile_loop``, ``tile_sum``), replaced per
# register.
_LANE0, _REG, _MASK, _ACC = "ST_LANE0_", "ST_REG_", "ST_MASK_", "ST_ACC_"


def _tile_of(node, tiles):
    """The one tile array a loop body touches, or None."""
    found = set()

    def walk(n):
        if isinstance(n, Load) and n.array in tiles:
            found.add(n.array)
        for child in getattr(n, "__dict__", {}).values():
            for c in (child if isinstance(child, tuple) else (child,)):
                if hasattr(c, "__dataclass_fields__"):
                    walk(c)
    walk(node)
    return found.pop() if len(found) == 1 else None


class _Body:
    """Statements and expressions of one vector loop body."""

    def __init__(self, loops: VectorLoops, lanes: _Lanes, mask, lane_var, env, acc=None,
                 tile_reg=None, i32=False, combine="+", first=False, shift=""):
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

    # -- statements ------------------------------------------------------------------------
    def stmts(self, node, pad) -> list[str]:
        if isinstance(node, Block):
            return [line for s in node.stmts for line in self.stmts(s, pad)]
        if isinstance(node, Decl) and node.ctype in ("idx", "val"):
            v = self.expr(node.init)
            if v.kind == "s":
                ctype = "int64_t" if node.ctype == "idx" else "val_t"
                self.env[node.name] = _V("s", node.name)
                return [f"{pad}const {ctype} {node.name} = {v.text};"]
            if v.kind in ("lin", "at32", "at64"):
                self.env[node.name] = v
                return []
            name = self.loops.fresh(node.name)
            self.env[node.name] = _V(v.kind, name)
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
    def expr(self, e) -> _V:
        if isinstance(e, Sym):
            return self.env.get(e.name, _V("s", e.name))
        if isinstance(e, Lit):
            return _V("s", self.scalar.expr(e))
        if isinstance(e, Load):
            return self.load_expr(e)
        if isinstance(e, Bin):
            return self.binary(e)
        if isinstance(e, Cond):
            c, a, b = self.expr(e.cond), self.expr(e.a), self.expr(e.b)
            if c.kind != "s":
                raise Unsupported("per-lane condition")
            if a.kind == b.kind == "s":
                return _V("s", f"({c.text} ? {a.text} : {b.text})")
            return _V("vv", f"(({c.text}) ? {self.vector(a)} : {self.vector(b)})")
        if isinstance(e, Call):
            return self.call(e)
        raise Unsupported(f"expression {type(e).__name__}")

    def load_expr(self, e: Load) -> _V:
        arr = e.array
        if self.tile_reg is not None and arr == self.tile_reg[0]:
            self.check_lane(e.index)
            return _V("vv", f"{arr}_{self.tile_reg[1]}")
        idx = self.expr(e.index)
        index_type = self.scalar.array_ctype(arr)
        if idx.kind == "s":
            return _V("s", f"{arr}[{idx.text}]")
        if idx.kind == "vv":
            raise Unsupported("value used as an index")
        if index_type is None:      # a value array
            if idx.kind == "lin":
                return _V("vv", self.load(self.at(arr, idx)))
            self.gathers = True
            if idx.kind == "vi32":
                return _V("vv", self.lanes.gather_i32(self.mask, idx.text, arr))
            if idx.kind in ("at32", "at64"):
                if self.mask is not None:   # (scalar loads past the mask could fault)
                    raise Unsupported("masked gather on AVX2")
                ctype = "int32_t" if idx.kind == "at32" else "int64_t"
                return _V("vv", self.lanes.gather_at(arr, idx.text, ctype))
            self.need_index_lanes()
            return _V("vv", self.lanes.gather(self.mask8(), idx.text, arr))
        if idx.kind == "lin" and self.lanes.isa == "avx2" and self.tile_reg is None:
            return _V("at32" if index_type == "int32_t" else "at64", self.at(arr, idx))
        if idx.kind == "lin" and index_type == "int32_t" and self.i32 and \
                self.tile_reg is None:
            # int32 indices used as they are (x[crd[p]]): 16 float lanes per gather, twice
            # the lanes of int64 index vectors; arithmetic on them retries without.
            return _V("vi32", self.lanes.load_i32(self.mask, self.at(arr, idx)))
        self.need_index_lanes()
        if idx.kind == "lin":
            ptr = self.at(arr, idx)
            if index_type == "int32_t":
                return _V("vi", f"_mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32("
                                f"{self.mask8()}, {ptr}))")
            return _V("vi", f"_mm512_maskz_loadu_epi64({self.mask8()}, {ptr})")
        if index_type == "int32_t":
            return _V("vi", f"_mm512_cvtepi32_epi64(_mm512_mask_i64gather_epi32("
                            f"_mm256_setzero_si256(), {self.mask8()}, {idx.text}, {arr}, 4))")
        return _V("vi", f"_mm512_mask_i64gather_epi64(_mm512_setzero_si512(), "
                        f"{self.mask8()}, {idx.text}, {arr}, 8)")

    def binary(self, e: Bin) -> _V:
        a, b = self.expr(e.a), self.expr(e.b)
        op = e.op
        if a.kind == b.kind == "s":
            if op in ("min", "max"):
                return _V("s", f"st_{op}({a.text}, {b.text})")
            return _V("s", f"({a.text} {op} {b.text})")
        if op not in ("+", "-", "*"):
            raise Unsupported(f"vector {op}")
        if {"at32", "at64"} & {a.kind, b.kind}:
            raise Unsupported("arithmetic on gathered indices (AVX2)")
        if "vi32" in (a.kind, b.kind):
            raise _NeedIndexLanes
        if "vv" in (a.kind, b.kind):
            name = {"+": "add", "-": "sub", "*": "mul"}[op]
            return _V("vv", self.lanes.op(name, self.vector(a), self.vector(b)))
        # Index arithmetic: base + lane stays a contiguous run while only shifted.
        if op in ("+", "-") and {a.kind, b.kind} == {"lin", "s"} and \
                (a.kind == "lin" or op == "+"):
            lin, s = (a, b) if a.kind == "lin" else (b, a)
            return _V("lin", f"({lin.text} {op} {s.text})")
        name = {"+": "add", "-": "sub", "*": "mullo"}[op]
        return _V("vi", f"_mm512_{name}_epi64({self.index_vector(a)}, "
                        f"{self.index_vector(b)})")

    def call(self, e: Call) -> _V:
        fn = _UNARY_BY_TEMPLATE.get(e.template)
        x = self.expr(e.arg)
        if x.kind == "s":
            return _V("s", self.scalar.expr(Call(e.template, Sym(x.text))))
        x, lanes = self.vector(x), self.lanes
        if fn == "neg":
            return _V("vv", lanes.op("sub", lanes.zero(), x))
        if fn == "relu":
            return _V("vv", lanes.op("max", x, lanes.zero()))
        if fn == "abs":
            return _V("vv", lanes.op("andnot", lanes.set1("-0.0"), x))
        if fn == "sqrt":
            return _V("vv", lanes.op("sqrt", x))
        if fn == "relu6":
            return _V("vv", lanes.op("max", lanes.op("min", x, lanes.set1("6")), lanes.zero()))
        if fn == "exp":   # (``intrinsics.py``: one helper per register type)
            return _V("vv", f"st_exp_{lanes.suf}{lanes.n * lanes.width * 8}({x})")
        raise Unsupported(f"vector {fn or e.template}")

    # -- conversions -----------------------------------------------------------------------
    def vector(self, v: _V) -> str:
        if v.kind == "vv":
            return v.text
        if v.kind == "s":
            return self.lanes.set1(v.text)
        raise Unsupported("index used as a value")

    def index_vector(self, v: _V) -> str:
        self.need_index_lanes()
        if v.kind == "vi32":
            raise _NeedIndexLanes
        if v.kind == "vi":
            return v.text
        if v.kind == "s":
            return f"_mm512_set1_epi64({v.text})"
        if v.kind == "lin":
            return (f"_mm512_add_epi64(_mm512_set1_epi64({v.text}), "
                    "_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0))")
        raise Unsupported("value used as an index")

    def at(self, arr, idx: _V) -> str:
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
            raise _NeedIndexLanes

    def mask8(self):
        return self.mask if self.mask is not None else "(__mmask8)0xFF"



def _declares(text: list[str]) -> bool:
    """Whether rendered statements declare values (``const`` lines): a copy of them per
    register then needs its own block."""
    return any(line.lstrip().startswith("const ") for line in text)
