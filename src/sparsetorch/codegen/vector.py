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

AVX2 (with FMA; ``lanes.Lanes.isa``): 8 float or 4 double per 256-bit register, masks are lane
vectors (``maskload``/``maskstore``). A gather ``x[crd[p]]`` is built from scalar loads
(``st_gather_*``, any value and index width), which beats AVX2's gather instructions on AMD
Zen 3; since loads past a row's end could fault, sums take whole vector steps and finish
with a scalar tail instead of a masked step. Per-lane index arithmetic is left to pragmas.

The intrinsics' spelling per ISA is in ``lanes.py``, the rendering of a loop body's
statements and expressions in ``vector_body.py``; this file shapes the loops around them.
"""
from __future__ import annotations

from ..compiler.ir import (Assign, Bin, Decl, For, Lit, Load, Sym, arrays_read,
                           loads, names_read, rewrite, statements, substitute)
from .lanes import SHAPES, Lanes, NeedIndexLanes, Unsupported, full_lanes
from .vector_body import ACC, LANE0, MASK, REG, Body, V

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
# A loop over stored entries that adds into at most this many registers of a tile takes
# two entries a trip, into two sets of registers (``paired_loop``): one register is
# otherwise one FMA chain, each entry waiting 4 cycles on the last. Measured on Intel
# Sapphire Rapids, 2 threads, a 2048 x 2048 CSR of 10% times 8 / 16 / 32 columns: 1.75x /
# 1.55x / 1.07x; with four registers (64 columns) it ran 15% slower, so those stay alone.
PAIRED_REGISTERS = 2
# A loop over stored entries that adds rows of a dense operand into a register tile wider
# than ``PAIRED_REGISTERS`` registers (SpMM with over 32 float32 columns) prefetches the row
# of the entry this many positions on (``prefetches``): the rows are random reads, one per
# entry, and a graph row's few entries give the hardware prefetcher no stride to follow. It
# does so in a version of the loop taken where the dense operand spans at least
# ``PREFETCH_FROM_BYTES``: rows that stay in cache need no prefetch, and its instructions
# then cost 3-11% (SuiteSparse matrices of up to 8k rows at 128 columns). Generated SpMM with
# and without, one process, alternating (AMD Zen 4, 2 threads, three runs): PubMed (20k
# nodes, 89k edges) 1.05-1.13x at 64 columns, 1.00-1.10x at 128, 0.90-1.00x at 256; a random
# 200k-node graph of 2M edges 0.98-1.06x, 1.06-1.15x, 1.02-1.08x; the 27 matrices of
# ``benchmarks/variants.py --knob vector.PREFETCH_AHEAD=0,16 --kernel spmm`` (operands under
# the threshold: the plain version) geomean 0.996x. Paired loops (up to 32 columns: an FMA or
# two per entry) do without: there the prefetch cost 10-20% on Cora and PubMed whatever
# their size. 8 positions gained less on the large graph than 16; 32 was no better.
# ``PREFETCH_AHEAD = 0`` turns prefetching off.
PREFETCH_AHEAD = 16
PREFETCH_FROM_BYTES = 4 << 20
# A parallel loop whose register tiles strip-mine a run-time extent over more than one
# register is compiled once more for each of the extents that fit in 1, ..., this many
# registers (``narrow_extent``, taken by ``c.py``'s outlined loops): there the compiler
# knows the full-tile loops run no trip and which partial-tile version runs, and a row
# costs only its own work. A graph row holds a few entries, so that per-row code was most
# of a narrow SpMM. Cora's propagation (2708 rows, 13264 entries), 1 thread, AVX-512 (Zen
# 4), the generic loop against two versions: 7 columns 21.9 -> 15.0 us, 16 columns 20.7 ->
# 12.7 us, 24 columns 27.8 -> 19.9 us; 64 columns unchanged. AVX2 (Zen, 2 threads; the six
# graphs, ``benchmarks/variants.py --knob vector.NARROW_VERSIONS=0,3 --kernel spmm --graphs
# --width 7,16,24,32,64``): 16 columns 1.12-1.33x, 24 columns (the third version) 1.29-1.52x,
# 7 columns 0.92-1.04x, 32 and 64 0.96-1.02x; 128-column SpMM of the SuiteSparse and DLMC
# matrices 0.998x geomean.
NARROW_VERSIONS = 3


class VectorLoops:
    """Renders tile declarations and vector loops for ``_CRenderer`` (``scalar``)."""

    def __init__(self, scalar):
        self.scalar = scalar
        self.val, self.isa = scalar.val, scalar.isa
        self.wide_from = scalar.wide_gathers_from   # see GATHERED_LOOP_LANES
        if full_lanes(self.val, self.isa) is None:
            raise Unsupported(f"value type {self.val} on {self.isa}")
        self.tiles = {}          # tile array name -> number of registers
        self.unpaired = False    # set while paired_loop renders a loop's unpaired version
        self.names = 0

    def shape(self, n=None) -> Lanes:
        """The vector shape of ``n`` lanes (default: a full register) of the value type."""
        return SHAPES[(self.isa, self.val, n or full_lanes(self.val, self.isa))]

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
        texts = [Body(self, lanes, mask, s.var, {s.var: V("lin", LANE0)}, tile_reg=(tile, REG),
                      tail=mask and f"({s.var}_n - {LANE0})").stmts(s.body, pad + "  ")
                 for mask in ((None,) if full else (None, MASK))]
        scoped = _declares(texts[0])

        def copy(text, r):
            return [line.replace(LANE0, str(r * lanes.n)).replace(REG, str(r))
                    for line in text]

        for r in range(regs):
            if full:
                lines = copy(texts[0], r)
                out += [f"{pad}  {{", *("  " + line for line in lines), f"{pad}  }}"] \
                    if scoped else lines
                continue
            # A partial tile's registers that lie wholly inside it run unmasked: AVX2's
            # maskload, blendv and maskstore cost several times a plain load, FMA and store
            # on AMD Zen (an SpMM with 16 columns, half a 32-wide tile: 189 -> 100 us on
            # Cora). A register with no lane in the tile is skipped, not run under an empty
            # mask: a result of 1-8 columns (a vector as a matrix, a GCN's class scores)
            # costs one register per entry instead of the tile's four.
            mask = self.fresh("m")
            masked = [line.replace(MASK, mask) for line in copy(texts[1], r)]
            out += [f"{pad}  if ({s.var}_n >= {(r + 1) * lanes.n}) {{",
                    *("  " + line for line in copy(texts[0], r)),
                    f"{pad}  }} else if ({s.var}_n > {r * lanes.n}) {{",
                    f"{pad}    " + lanes.mask_decl(mask, f"{s.var}_n - {r * lanes.n}"),
                    *("  " + line for line in masked), f"{pad}  }}"]
        return out + [f"{pad}}}"]

    def paired_loop(self, s: For, pad: str) -> list[str]:
        """A loop over stored entries whose body only adds into one register tile
        (SpMM's ``for p: tile[k] += A[p] * B[crd[p], k]``) of which at most
        ``PAIRED_REGISTERS`` registers are in use, two entries a trip: the second into a
        zeroed twin of the tile's registers (independent FMA chains, twice the FMAs in
        flight), added to the tile after the loop; an odd last entry runs alone. A partial
        tile (its width known at run time) is paired only when that width needs at most
        ``PAIRED_REGISTERS`` registers, in a version per register count that touches only
        those (a 16-column row in a 64-column tile otherwise tested all four registers'
        lanes at every entry); the loop as it stands runs past that. A body adding into
        several tiles of one width (jammed rows) goes to ``narrowed_loop``. Anything else
        raises ``Unsupported``, and the caller renders the loop as it stands."""
        if self.unpaired or s.step != 1 or s.simd or s.reduction or s.parallel is not None:
            raise Unsupported("not a plain loop")
        tiles, widths = set(), set()
        for st in s.body.stmts:
            if isinstance(st, Decl) and st.ctype == "idx":
                continue
            tile = _tile_of(st, self.tiles) if isinstance(st, For) and st.simd else None
            if tile is None or not all(
                    isinstance(a, Decl) and a.ctype == "idx" or
                    isinstance(a, Assign) and a.op == "+=" and isinstance(a.target, Load)
                    and a.target.array == tile and tile not in arrays_read(a.value)
                    for a in st.body.stmts):
                raise Unsupported("a loop body that does more than add into a tile")
            tiles.add(tile)
            widths.add(st.end)
        if len(widths) != 1 or len({self.tiles[t] for t in tiles}) != 1:
            raise Unsupported("not register tiles of one width")
        width = widths.pop()
        if not isinstance(width, Lit) and \
                names_read(width) & ({s.var} | {d.name for d in statements(s.body)
                                                if isinstance(d, Decl)}):
            raise Unsupported("a tile width that changes along the loop")
        test = None if isinstance(width, Lit) else self.scalar.expr(width)
        if len(tiles) > 1:
            return self.narrowed_loop(s, pad, tiles, test)
        tile = tiles.pop()
        regs, lanes = self.tiles[tile], self.shape()
        if isinstance(width, Lit) and width.value > PAIRED_REGISTERS * lanes.n:
            raise Unsupported("a tile wide enough to fill the FMA units")
        twin = self.fresh(tile)
        var, end = s.var, self.fresh("end")
        second = rewrite(s.body, lambda n: Bin("+", n, Lit(1)) if n == Sym(var) else
                         Load(twin, n.index) if isinstance(n, Load) and n.array == tile else n)
        inner = pad + "    "

        def copy(body):
            return [f"{pad}    {{", *self.scalar.stmt(body, inner + "  "), f"{pad}    }}"]

        def paired(used):
            """The loop with the tile's first ``used`` registers (the rest stay zero)."""
            self.tiles[tile] = self.tiles[twin] = used
            try:
                return [
                    f"{pad}  {lanes.vtype} " + ", ".join(f"{twin}_{r} = {lanes.zero()}"
                                                        for r in range(used)) + ";",
                    f"{pad}  const int64_t {end} = {self.scalar.expr(s.end)};",
                    f"{pad}  int64_t {var} = {self.scalar.expr(s.start)};",
                    f"{pad}  for (; {var} + 1 < {end}; {var} += 2) {{",
                    *copy(s.body), *copy(second), f"{pad}  }}",
                    f"{pad}  if ({var} < {end}) {{", *self.scalar.stmt(s.body, inner),
                    f"{pad}  }}",
                    *(f"{pad}  {tile}_{r} = {lanes.op('add', f'{tile}_{r}', f'{twin}_{r}')};"
                      for r in range(used))]
            finally:
                self.tiles[tile] = regs
        if test is None:
            return [f"{pad}{{", *paired(regs), f"{pad}}}"]
        return self.versions(s, pad, test, min(PAIRED_REGISTERS, regs), paired)

    def narrowed_loop(self, s: For, pad: str, tiles: set, test) -> list[str]:
        """A loop adding into several register tiles of one width (the rows of a block,
        ``jam.jam_rows``), whose copies already run independent FMA chains: not paired, but
        for a partial width, one version per number of registers it needs, each touching
        only those (a dense product with 7 columns then adds into one register a row
        instead of testing four registers' lanes at every step)."""
        regs = self.tiles[next(iter(tiles))]
        if test is None or regs == 1:
            raise Unsupported("full tiles, or of one register: the loop as it stands")

        def narrowed(used):
            for t in tiles:
                self.tiles[t] = used
            self.unpaired = True
            try:
                return self.scalar.stmt(s, pad + "  ")
            finally:
                self.unpaired = False
                for t in tiles:
                    self.tiles[t] = regs
        return self.versions(s, pad, test, regs - 1, narrowed)

    def versions(self, s: For, pad: str, test: str, most: int, render) -> list[str]:
        """``s`` for a partial tile of ``test`` values: ``render(used)`` where they fill
        ``used`` registers, for ``used`` up to ``most`` (each adds into those only: no
        per-step tests of the others), the loop as it stands past that."""
        lanes, out = self.shape(), []
        for used in range(1, most + 1):
            out += [f"{pad}{'} else ' if out else ''}if ({test} <= {used * lanes.n}) {{",
                    *render(used)]
        self.unpaired = True
        try:
            alone = self.scalar.stmt(s, pad + "  ")
        finally:
            self.unpaired = False
        return [*out, f"{pad}}} else {{", *alone, f"{pad}}}"]

    def prefetches(self, body, entries, pad: str):
        """For a loop body over stored entries that starts ``j = crd[p]`` and adds a dense
        operand's row at ``j`` into a register tile: (when, lines), C that prefetches that
        row's first lane for the entry ``PREFETCH_AHEAD`` positions on, if that position is
        below ``entries`` (the coordinate array's length, from ``For.entries``), and the
        condition under which the loop should (the operand spans ``PREFETCH_FROM_BYTES``).
        None for any other body, or without ``entries``. The read of ``crd`` ahead never
        leaves the array; the prefetch itself cannot fault."""
        first = body.stmts[0] if body.stmts else None
        if entries is None or PREFETCH_AHEAD < 1 or not (
                isinstance(first, Decl) and first.ctype == "idx" and isinstance(first.init, Load)):
            return None
        coord, ahead = first.name, self.fresh("ahead")
        extent = f"n_{coord}"   # the dense operand's rows (the coordinate's extent)
        if extent not in {p.name for p in self.scalar.fn.params}:
            return None
        inside = {d.name for d in statements(body) if isinstance(d, Decl)} | \
            {f.var for f in statements(body) if isinstance(f, For)}
        rows, strides = set(), set()
        for loop in body.stmts[1:]:
            if not (isinstance(loop, For) and loop.simd):
                continue
            lane = {Sym(loop.var): Lit(0)}   # (and the lane's indices, in its terms)
            for d in loop.body.stmts:
                if isinstance(d, Decl) and d.ctype == "idx" and d.init is not None:
                    lane[Sym(d.name)] = substitute(d.init, lane)
            for load in loads(loop.body):
                index = substitute(load.index, lane)
                reads = names_read(index)
                if coord in reads and not reads & (inside - {coord}) and \
                        load.array not in self.tiles:
                    rows.add(Load(load.array, substitute(
                        index, {Sym(coord): Load(first.init.array, Sym(ahead))})))
                    strides.add(Bin("-", substitute(index, {Sym(coord): Lit(1)}),
                                    substitute(index, {Sym(coord): Lit(0)})))
        if not rows:
            return None
        large = " || ".join(f"(double){extent} * (double){self.scalar.expr(stride)} * "
                            f"sizeof(val_t) >= {PREFETCH_FROM_BYTES}.0"
                            for stride in sorted(strides, key=repr))
        at = self.scalar.expr(Bin("+", first.init.index, Lit(PREFETCH_AHEAD)))
        return large, [f"{pad}{{ const int64_t {ahead} = {at};",
                       f"{pad}  if ({ahead} < {self.scalar.expr(entries)}) {{",
                       *(f"{pad}    __builtin_prefetch(&{self.scalar.expr(row)});"
                         for row in sorted(rows, key=repr)),
                       f"{pad}  }}", f"{pad}}}"]

    def narrow_extent(self, s: For):
        """``(extent, ranges)`` for a loop ``s`` whose register tiles strip-mine the
        run-time extent ``extent`` (a parameter) in tiles of several registers: the ranges
        ``(lo, hi]`` of the extents that fill 1, 2, ... registers, up to ``NARROW_VERSIONS``
        and fewer than the tile's; None for any other loop (one register or constant
        widths: nothing to specialise)."""
        params = {p.name for p in self.scalar.fn.params}
        lanes, found = self.shape().n, set()
        for x in statements(s.body):
            end = x.end if isinstance(x, For) else None
            # the full tiles' loop of ``register_tiles``: up to n - n % width by width
            if isinstance(end, Bin) and end.op == "-" and isinstance(end.a, Sym) and \
                    end.a.name in params and end.b == Bin("%", end.a, Lit(x.step)) and \
                    x.step > lanes:
                found.add((end.a.name, x.step // lanes))
        names = {name for name, _ in found}
        versions = min(NARROW_VERSIONS, max((r for _, r in found), default=1) - 1)
        if len(names) != 1 or versions < 1:
            return None
        return names.pop(), [((used - 1) * lanes, used * lanes)
                             for used in range(1, versions + 1)]

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
            body = Body(self, lanes, None, s.var, {s.var: V("lin", "0")},
                         acc={s.reduction: ACC}, tile_reg=(tile, REG), first=first,
                         shift=f" + {LANE0}")
            texts.append(body.stmts(s.body, pad + "  "))
        scoped = _declares(texts[1])
        out = [f"{pad}{{", f"{pad}  {lanes.vtype} {', '.join(chains)};"]
        for r in range(regs):
            text = texts[0] if r < len(chains) else texts[1]
            lines = [line.replace(LANE0, str(r * lanes.n)).replace(REG, str(r))
                     .replace(ACC, chains[r % len(chains)]) for line in text]
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
            body = Body(self, lanes, m, var, {var: V("lin", var)}, acc=vaccs, i32=True)
            try:
                steps.append(body.stmts(s.body, pad + "    "))
            except NeedIndexLanes:
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
            except NeedIndexLanes:
                continue
        raise Unsupported("index lanes")

    def _sum_loop(self, s: For, pad, lanes: Lanes, i32: bool, unroll: int,
                  single: bool, bodies: list) -> list[str]:
        """Unmasked steps of ``unroll`` registers (one accumulator each: independent FMA
        chains), then masked steps for the rest, then one horizontal add (a maximum's:
        vector max from -inf, then a horizontal max); with ``single`` (at most one register
        of terms) one masked step and the add, nothing to branch on. AVX2 has no masked
        gathers: whole steps there, and the rest runs scalar after the horizontal add. The
        ``Body`` of each step is appended to ``bodies``."""
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
                lane = V("lin", f"({var} + {k * n})" if k else var)
                body = Body(self, lanes, None, var, {var: lane}, acc={acc: vacc}, i32=i32,
                             combine=s.combine)
                bodies.append(body)
                out += [f"{pad}      {{", *body.stmts(s.body, pad + "        "),
                        f"{pad}      }}"]
            total = vaccs[0]
            for v in vaccs[1:]:
                total = lanes.op(join, total, v)
            out += [f"{pad}    }}", f"{pad}    {vaccs[0]} = {total};", f"{pad}  }}"]
        whole = lanes.isa == "avx2"
        body = Body(self, lanes, None if whole else mask, var, {var: V("lin", var)},
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


def _declares(text: list[str]) -> bool:
    """Whether rendered statements declare values (``const`` lines): a copy of them per
    register then needs its own block."""
    return any(line.lstrip().startswith("const ") for line in text)
