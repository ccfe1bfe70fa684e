"""C99 + OpenMP renderer: a printer over the loop IR (``compiler/ir.py``).

Expressions and statements are rendered by small rule tables; nothing here decides what to
compute. Loop variables and positions are ``int64_t`` (a 32-bit loop index mixed with 64-bit
sizes stops GCC's vectoriser); index arrays keep their stored width (int32 halves index
traffic) and are widened on load. Pointers are ``restrict``: operands never alias the output.
"""
from __future__ import annotations

from ..compiler.ir import (Assign, Bin, Block, Call, Comment, Cond, Decl, For, Function, If,
                           Helper, Lit, Load, Sym, While)
from .intrinsics import SORT_PRELUDE, SORT_PRELUDE_AVX2
from .intrinsics import prelude as vector_prelude
from .lanes import Unsupported, full_lanes
from .vector import VectorLoops

VALUE_CTYPES = {"float32": "float", "float64": "double", "int32": "int32_t",
                "int64": "int64_t"}
INDEX_CTYPES = {"int32": "int32_t", "int64": "int64_t"}

_PRELUDE = """\
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
typedef {val} val_t;
/* Maps that read their argument more than once (``notation.UNARY``), as functions: inline,
   nested maps would repeat the argument's text per level, doubling it (2^20 copies of a
   nested relu chain did not compile in a minute). */
static inline val_t st_relu(val_t v) {{ return v < 0 ? 0 : v; }}   /* (a NaN passes) */
static inline val_t st_relu6(val_t v) {{ return v < 0 ? 0 : (v > 6 ? 6 : v); }}

/* In-place sort of int64 keys: insertion sort on short runs, median-of-3 quicksort above
   (recursing into the smaller side), no comparator calls. */
static void st_sort_i64(int64_t* a, int64_t n) {{
  while (n > 24) {{
    int64_t m = a[n / 2], x = a[0], z = a[n - 1];
    int64_t piv = (x < m) ? ((m < z) ? m : (x < z ? z : x)) : ((x < z) ? x : (m < z ? z : m));
    int64_t i = 0, j = n - 1;
    while (i <= j) {{
      while (a[i] < piv) i++;
      while (a[j] > piv) j--;
      if (i <= j) {{ int64_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }}
    }}
    if (j + 1 < n - i) {{ st_sort_i64(a, j + 1); a += i; n -= i; }}
    else {{ st_sort_i64(a + i, n - i); n = j + 1; }}
  }}
  for (int64_t i = 1; i < n; i++) {{
    int64_t v = a[i], j = i - 1;
    while (j >= 0 && a[j] > v) {{ a[j + 1] = a[j]; j--; }}
    a[j + 1] = v;
  }}
}}
/* First row r with pos[r] - pos[0] + r >= t/T of pos[n] - pos[0] + n: range t of T holds
   rows [row(t), row(t+1)), an equal share of stored entries plus rows. */
#define ST_BALANCED_ROW(pos, n, t, T, out) do {{ \
    int64_t lo_ = 0, hi_ = (n); \
    const double goal_ = (double)((pos)[n] - (pos)[0] + (n)) * (double)(t) / (double)(T); \
    while (lo_ < hi_) {{ \
      const int64_t mid_ = lo_ + (hi_ - lo_) / 2; \
      if ((double)((pos)[mid_] - (pos)[0] + mid_) < goal_) lo_ = mid_ + 1; else hi_ = mid_; \
    }} \
    (out) = lo_; }} while (0)
/* The next range of a balanced loop: from the shared counter when the call asked for
   ``nc`` > 1 ranges per thread (taken dynamically), else this thread's one range ``first``
   and then none (``first`` = the range count). */
static inline int64_t st_next_range(int64_t* next, int64_t nc, int64_t first) {{
  return nc > 1 ? __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : first;
}}
static inline int64_t st_min(int64_t a, int64_t b) {{ return a < b ? a : b; }}
static inline int64_t st_max(int64_t a, int64_t b) {{ return a > b ? a : b; }}
"""

# Open-addressing hash workspace (linear probing, load <= 1/2, doubling): memory grows with
# the cells a row touches, not with the dimension. Sorting copies the keys out, sorts them,
# and looks each value up again (the sort moves keys only).
_HASH = """\
typedef struct {
  int64_t *keys, *used, *skeys; val_t *vals, *svals; int64_t cap, n, scap;
} st_hash;
static void st_hash_alloc(st_hash* h, int64_t cap) {
  h->cap = cap; h->n = 0;
  h->keys = (int64_t*)malloc(cap * sizeof(int64_t)); memset(h->keys, 0xff, cap * sizeof(int64_t));
  h->vals = (val_t*)calloc(cap, sizeof(val_t)); h->used = (int64_t*)malloc(cap * sizeof(int64_t));
}
static void st_hash_init(st_hash* h) { st_hash_alloc(h, 64); h->skeys = 0; h->svals = 0; h->scap = 0; }
static inline int64_t st_hash_slot(const st_hash* h, int64_t key) {
  uint64_t x = (uint64_t)key * 0x9E3779B97F4A7C15ull;
  return (int64_t)((x ^ (x >> 31)) & (uint64_t)(h->cap - 1));
}
static int64_t st_hash_find(st_hash* h, int64_t key);
static void st_hash_grow(st_hash* h) {
  st_hash old = *h;
  st_hash_alloc(h, old.cap * 2);
  for (int64_t q = 0; q < old.n; q++) {
    int64_t s = st_hash_find(h, old.keys[old.used[q]]);
    h->vals[s] = old.vals[old.used[q]];
  }
  free(old.keys); free(old.vals); free(old.used);
}
static int64_t st_hash_find(st_hash* h, int64_t key) {
  if (2 * (h->n + 1) > h->cap) st_hash_grow(h);
  int64_t s = st_hash_slot(h, key);
  while (h->keys[s] != -1 && h->keys[s] != key) s = (s + 1) & (h->cap - 1);
  if (h->keys[s] == -1) { h->keys[s] = key; h->used[h->n++] = s; }
  return s;
}
static void st_hash_sort(st_hash* h) {
  if (h->scap < h->n) {
    free(h->skeys); free(h->svals); h->scap = h->n;
    h->skeys = (int64_t*)malloc(h->scap * sizeof(int64_t));
    h->svals = (val_t*)malloc(h->scap * sizeof(val_t));
  }
  for (int64_t q = 0; q < h->n; q++) h->skeys[q] = h->keys[h->used[q]];
  st_sort_i64(h->skeys, h->n);
  for (int64_t q = 0; q < h->n; q++) {
    int64_t s = st_hash_slot(h, h->skeys[q]);
    while (h->keys[s] != h->skeys[q]) s = (s + 1) & (h->cap - 1);
    h->svals[q] = h->vals[s];
  }
}
static void st_hash_clear(st_hash* h) {
  for (int64_t q = 0; q < h->n; q++) { h->keys[h->used[q]] = -1; h->vals[h->used[q]] = 0; }
  h->n = 0;
}
static void st_hash_free(st_hash* h) {
  free(h->keys); free(h->vals); free(h->used); free(h->skeys); free(h->svals);
}
"""

def _dense_workspace(threads: str, thread: str) -> tuple[list, list, list]:
    """C lines that allocate, take this thread's slice of, and free the dense row workspaces
    of ``threads`` threads (``thread``: this one's number): values (zero between rows:
    emission reads a cell and clears it), the stamp of the row that last touched each cell,
    a bitmap of the row's touched cells and their list (one slot spare: the list is written
    before the new-cell test). One allocation serves the team, a slice per thread:
    allocating inside the parallel region measured 1.5x slower on small SpGEMMs
    (HB/bcspwr04: 59 -> 39 us for the count pass). Slices are padded to whole cache lines
    plus one, so two threads never write the same line (the bitmap of a narrow result fits
    in one: sharing it made two threads slower than one)."""
    alloc = ["const int64_t ws_cells = ws_size ? ws_size : 1;",
             "const int64_t ws_words = (ws_cells + 63) / 64;",
             "const int64_t ws_stride = (ws_cells + 15) / 16 * 16 + 16;",
             "const int64_t ws_wstride = (ws_words + 7) / 8 * 8 + 8;",
             f"val_t* ws_vals_all = (val_t*)calloc(ws_stride * {threads}, sizeof(val_t));",
             f"int64_t* ws_mark_all = (int64_t*)calloc(ws_stride * {threads}, sizeof(int64_t));",
             f"uint64_t* ws_bits_all = (uint64_t*)calloc(ws_wstride * {threads}, "
             "sizeof(uint64_t));",
             f"int64_t* ws_list_all = (int64_t*)malloc(ws_stride * {threads} * sizeof(int64_t));"]
    slice_ = [f"const int64_t ws_off = ws_stride * {thread};",
              "val_t* ws_vals = ws_vals_all + ws_off;",
              "int64_t* ws_mark = ws_mark_all + ws_off;",
              f"uint64_t* ws_bits = ws_bits_all + ws_wstride * {thread};",
              "int64_t* ws_list = ws_list_all + ws_off;",
              "int64_t ws_n = 0, ws_stamp = 1;"]
    free = ["free(ws_vals_all); free(ws_mark_all); free(ws_bits_all); free(ws_list_all);"]
    return alloc, slice_, free


_ONE_ALLOC, _ONE_SLICE, _FREE_DENSE = _dense_workspace("1", "0")
_TEAM_ALLOC, _TEAM_SLICE, _ = _dense_workspace("nt", "omp_get_thread_num()")


def _list_from_bits(words: str, cursor: str, pad: str = "") -> list:
    """Helper lines that walk the row bitmap ``ws_bits`` (``words`` words) and write its set
    cells in order into ``ws_list`` at ``cursor`` (advanced), clearing the bits."""
    return [f"{pad}for (int64_t w = 0; w < {words}; w++) {{{{",
            f"{pad}  uint64_t b = ws_bits[w];",
            f"{pad}  if (!b) continue;",
            f"{pad}  ws_bits[w] = 0;",
            f"{pad}  do {{{{ ws_list[{cursor}++] = w * 64 + __builtin_ctzll(b); b &= b - 1; }}}}",
            f"{pad}  while (b);",
            f"{pad}}}}}"]


# Runtime helper statements, by name (see ir.Helper); {0}, {1} are the rendered arguments.
_HELPERS = {
    # Dense workspace of a kernel without a parallel loop, and of a thread team (allocated
    # before the parallel region, sliced inside it).
    "alloc_dense": _ONE_ALLOC + _ONE_SLICE,
    "free_dense": _FREE_DENSE,
    "team_alloc_dense": _TEAM_ALLOC,
    "team_slice_dense": _TEAM_SLICE,
    "team_free_dense": _FREE_DENSE,
    # The row's touched cells in order, by whichever costs less: reading a bitmap of them
    # (set from the list, 64 columns per word, one count-trailing-zeros per cell; the scan
    # clears it) or sorting the list (insertion sort up to 24 cells, then quicksort). Scan
    # when the row has more cells than the bitmap has words, or, past insertion-sort
    # sizes, more than one cell per 8 words. Kernel A/B on SuiteSparse A@A: a per-column
    # scan of the stamps was most of Erdos971's fill pass; bayer10 (210 words, ~21 cells)
    # 1.1-1.3x faster with this rule than with one scan threshold, bcspwr10 (83 words, ~11
    # cells) 1.1x slower when it scans; setting bits here rather than per product (a
    # read-modify-write chain on one word in dense rows) 1.2-1.8x on the whole pass.
    "dense_sort": ["if (ws_words < ws_n * (ws_n > 24 ? 8 : 1)) {{",
                   "  for (int64_t q = 0; q < ws_n; q++)",
                   "    ws_bits[ws_list[q] >> 6] |= (uint64_t)1 << (ws_list[q] & 63);",
                   "  int64_t q = 0;",
                   *_list_from_bits("ws_words", "q", "  "),
                   "}} else st_sort_i64(ws_list, ws_n);"],
    # With AVX-512, rows of 6-64 cells take the sorting network (``intrinsics.SORT_PRELUDE``)
    # first. Fill-pass A/B on SuiteSparse A@A, 6-32 cells: bcspwr10 1.7x, nnc1374,
    # west0479 and 494_bus 1.1-1.2x, bayer10 1.15x, banded olm500/olm1000 unchanged (their
    # cells arrive sorted); 33-64 cells then: bayer10 1.28x, dwt_992 1.17x, zenios 1.09x.
    # These lines go before "dense_sort", whose first line follows their "else".
    "dense_sort_avx512": ["if (ws_n >= 6 && ws_n <= 32) {{",
                          "  if (!st_sorted32(ws_list, ws_n)) st_sort32(ws_list, ws_n);",
                          "}} else if (ws_n > 32 && ws_n <= 64) {{",
                          "  st_sort64(ws_list, ws_n);",
                          "}} else "],
    # With AVX2, rows of 6-64 cells that "dense_sort" would sort take its network instead
    # (``intrinsics.SORT_PRELUDE_AVX2``): these lines replace its last. AVX-512's network
    # goes before the bitmap test; AVX2's costs more, and there it slowed rows the bitmap
    # scan takes (whole-call A/B on SuiteSparse A@A: watt_2, dwt_992 0.87-0.92x). Rows out
    # of order at one place keep insertion sort (else olm500, reorientation_1, adder_dcop_05,
    # hangGlider_2 0.92-0.95x). Whole-call A/B, 49 matrices: 1.023x geomean; bcspwr06-10
    # 1.06-1.26x, rajat19 1.15x, west0497 1.14x; watt_2 0.93x.
    "dense_sort_avx2": ["}} else if (ws_n >= 6 && ws_n <= 64) st_sort_avx2(ws_list, ws_n);",
                        "else st_sort_i64(ws_list, ws_n);"],
    # Bitmaps of the rows a sparse result's rows gather (``assemble.RowBits``): level
    # arrays {0} (positions) and {1} (coordinates), {2} rows, built when the rows hold on
    # average at least {3} + words / {4} entries and the table at most {5} words an entry
    # and {6} words in all (else, or when the allocation fails, st_bits is 0 and the kernel
    # takes its marked passes). One pass over the level, before the threads start.
    "row_bits_alloc": ["const int64_t st_words = (ws_size + 63) / 64, st_rows = {2};",
                       "const int64_t st_entries = st_rows > 0 ? {0}[st_rows] - {0}[0] : 0;",
                       "uint64_t* st_rowbits = st_rows > 0 && st_words > 0 &&",
                       "    {4} * st_entries >= st_rows * ({4} * {3} + st_words) &&",
                       "    st_words * st_rows <= {5} * st_entries && st_words * st_rows <= {6} ?",
                       "    (uint64_t*)calloc((size_t)(st_rows * st_words), sizeof(uint64_t)) "
                       ": 0;",
                       "const int st_bits = st_rowbits != 0;",
                       "if (st_bits) {{",
                       "  for (int64_t r_ = 0; r_ < st_rows; r_++)",
                       "    for (int64_t q_ = {0}[r_]; q_ < {0}[r_ + 1]; q_++)",
                       "      st_rowbits[r_ * st_words + ({1}[q_] >> 6)] |= "
                       "(uint64_t)1 << ({1}[q_] & 63);",
                       "}}"],
    "free_row_bits": ["free(st_rowbits);"],
    # The row at position {0} joins the result row's cells (a loop GCC vectorises).
    "or_row_bits": ["{{",
                    "  const uint64_t* restrict r_ = st_rowbits + ({0}) * st_words;",
                    "  for (int64_t w_ = 0; w_ < st_words; w_++) ws_bits[w_] |= r_[w_];",
                    "}}"],
    # The result row's cell count; the bits are cleared for the next row.
    "count_row_bits": ["for (int64_t w_ = 0; w_ < st_words; w_++) {{",
                       "  ws_n += __builtin_popcountll(ws_bits[w_]);",
                       "  ws_bits[w_] = 0;",
                       "}}"],
    # The result row's cells in order into ws_list (ws_n of them); the bits are cleared.
    "list_row_bits": ["ws_n = 0;", *_list_from_bits("st_words", "ws_n")],
    # SpMM's cache-blocked nest (``kblock.py``): a buffer for a block's slice of the dense
    # operand, copied row after row (rows {0}, width {1}, from array {2} at row {3}, row
    # length {4}, column {5}) so the slice is contiguous. Without the buffer (allocation
    # failed) the nest reads the operand in place. Aligned to cache lines by hand (C99 has
    # no aligned_alloc): malloc's 16 bytes would split every other 32-byte load.
    "alloc_pack": ["void* xpack_raw = malloc(sizeof(val_t) * (size_t)({0}) + 64);",
                   "val_t* xpack = xpack_raw ? (val_t*)(((uintptr_t)xpack_raw + 63) & "
                   "~(uintptr_t)63) : 0;"],
    "pack_rows": ["if (xpack) {{",
                  "  for (int64_t r_ = 0; r_ < {0}; r_++)",
                  "    for (int64_t c_ = 0; c_ < {1}; c_++)",
                  "      xpack[r_ * {1} + c_] = {2}[({3} + r_) * {4} + {5} + c_];",
                  "}}"],
    "free_pack": ["free(xpack_raw);"],
    "alloc_hash": ["st_hash ws; st_hash_init(&ws);", "int64_t ws_n = 0;",
                   "int64_t* ws_list = 0; val_t* ws_sorted = 0;"],
    "free_hash": ["st_hash_free(&ws);"],
    "hash_mark": ["st_hash_find(&ws, {0});"],
    "hash_add": ["ws.vals[st_hash_find(&ws, {0})] += {1};"],
    "hash_sort": ["st_hash_sort(&ws); ws_n = ws.n; ws_list = ws.skeys; ws_sorted = ws.svals;"],
    "hash_clear": ["st_hash_clear(&ws); ws_n = 0;"],
    # The kernel zeroes its own dense output, so the caller allocates it uninitialised and
    # a small call pays no separate fill; large outputs are cleared by the thread team.
    # (a one-thread OpenMP team costs ~0.3 us even under if(0): plain memset then)
    "zero_out": ["if (nt > 1) {{",
                 "  #pragma omp parallel for schedule(static) num_threads(nt)",
                 "  for (int64_t z = 0; z < {0}; z += 8192)",
                 "    memset(out_vals + z, 0, sizeof(val_t) * (size_t)st_min(8192, {0} - z));",
                 "}} else {{",
                 "  memset(out_vals, 0, sizeof(val_t) * (size_t)({0}));",
                 "}}"],
}

_SIMD_MIN_TRIP = 16
_SIZES = {"float": 4, "double": 8, "int32_t": 4, "int64_t": 8}

_MATH = {"float": {"fabs": "fabsf", "exp": "expf", "sqrt": "sqrtf"},
         "double": {"fabs": "fabs", "exp": "exp", "sqrt": "sqrt"},
         "int32_t": {"fabs": "abs", "exp": "exp", "sqrt": "sqrt"},
         "int64_t": {"fabs": "llabs", "exp": "exp", "sqrt": "sqrt"}}


class _CRenderer:
    def __init__(self, val_ctype: str, index_ctypes: dict, isa: str | None = None,
                 wide_gathers_from: int | None = None):
        self.val = val_ctype
        self.wide_gathers_from = wide_gathers_from
        self.index = index_ctypes
        self.math = _MATH[val_ctype]
        self.isa = isa if full_lanes(val_ctype, isa) else None
        self.key_isa = isa             # sorting int64 keys does not depend on the value type
        self.used_sort = False
        self.vec = None            # the vector renderer of the function being rendered
        self.array_types = {}
        self.used_vector = False
        self.fn, self.outline, self.regions = None, set(), []   # see outlined_loop

    def array_ctype(self, name):
        """C element type of an index array parameter, None for a value array."""
        if name not in self.array_types:
            raise Unsupported(f"array {name} is not a parameter")
        ctype = self.array_types[name]
        return None if ctype == "val_t" else ctype

    def pointee(self, p) -> str:
        """The C element type a pointer parameter points to."""
        base = p.ctype[:-1]
        if base == "val":
            return "val_t"
        if base == "i64":
            return "int64_t"
        return self.index[int(base[3:])]   # idx{n}: operand n's index width

    # -- expressions -----------------------------------------------------------------------
    def expr(self, e) -> str:
        if isinstance(e, Sym):
            return e.name
        if isinstance(e, Lit):
            v = e.value
            if isinstance(v, float):
                text = repr(v) if v == v and abs(v) != float("inf") else \
                    "NAN" if v != v else ("INFINITY" if v > 0 else "-INFINITY")
                return f"((val_t){text})"
            # (-2^63 is no C literal: the constant 2^63 it would negate has no signed type)
            return "INT64_MIN" if v == -2 ** 63 else str(int(v))
        if isinstance(e, Load):
            return f"{e.array}[{self.expr(e.index)}]"
        if isinstance(e, Bin):
            if e.op in ("min", "max"):
                return f"st_{e.op}({self.expr(e.a)}, {self.expr(e.b)})"
            return f"({self.expr(e.a)} {e.op} {self.expr(e.b)})"
        if isinstance(e, Cond):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, Call):
            return e.template.format(x=self.expr(e.arg), **self.math)
        raise TypeError(f"cannot render expression {e!r}")

    # -- statements ------------------------------------------------------------------------
    def stmt(self, s, pad: str) -> list[str]:
        if isinstance(s, Block):
            return [line for x in s.stmts for line in self.stmt(x, pad)]
        if isinstance(s, Decl):
            if s.ctype == "val[]" and self.vec is not None:
                return self.vec.tile_decl(s, pad)
            if s.ctype == "val[]":
                return [f"{pad}val_t {s.name}[{self.expr(s.init)}] = {{0}};"]
            if s.ctype == "idx[]":
                return [f"{pad}int64_t {s.name}[{self.expr(s.init)}];"]
            if s.ctype == "val*":   # a local view of values, read like a value parameter
                self.array_types[s.name] = "val_t"
                return [f"{pad}const val_t* {s.name} = {self.expr(s.init)};"]
            ctype = {"idx": "int64_t", "val": "val_t"}[s.ctype]
            init = f" = {self.expr(s.init)}" if s.init is not None else ""
            return [f"{pad}{ctype} {s.name}{init};"]
        if isinstance(s, Assign):
            return [f"{pad}{self.expr(s.target)} {s.op} {self.expr(s.value)};"]
        if isinstance(s, For):
            return self.loop(s, pad)
        if isinstance(s, While):
            return [f"{pad}while ({self.expr(s.cond)}) {{", *self.stmt(s.body, pad + "  "),
                    f"{pad}}}"]
        if isinstance(s, If):
            out = [f"{pad}if ({self.expr(s.cond)}) {{", *self.stmt(s.then, pad + "  ")]
            if s.orelse is not None:
                out += [f"{pad}}} else {{", *self.stmt(s.orelse, pad + "  ")]
            return out + [f"{pad}}}"]
        if isinstance(s, Comment):
            return [f"{pad}/* {s.text} */"]
        if isinstance(s, Helper):
            args = [self.expr(a) for a in s.args]
            lines = _HELPERS[s.name]
            if s.name == "dense_sort" and self.key_isa == "avx512":
                *first, join = _HELPERS["dense_sort_avx512"]
                lines, self.used_sort = [*first, join + lines[0], *lines[1:]], True
            elif s.name == "dense_sort" and self.key_isa == "avx2":
                lines, self.used_sort = [*lines[:-1], *_HELPERS["dense_sort_avx2"]], True
            return [pad + line.format(*args) for line in lines]
        raise TypeError(f"cannot render statement {s!r}")

    def loop(self, s: For, pad: str) -> list[str]:
        if self.vec is not None and s.parallel is None:
            if s.simd:
                return self.vec.tile_loop(s, pad)
            if s.reduction:
                return self.vec.sum_loop(s, pad)
            try:
                return self.vec.paired_loop(s, pad)
            except Unsupported:
                pass
        if id(s) in self.outline:
            return self.outlined_loop(s, pad)
        step = f"{s.var}++" if s.step == 1 else f"{s.var} += {s.step}"
        head = (f"{pad}for (int64_t {s.var} = {self.expr(s.start)}; {s.var} < "
                f"{self.expr(s.end)}; {step}) {{")
        body = [*self.stmt(s.body, pad + "  "), f"{pad}}}"]
        ahead = self.vec.prefetches(s.body, s.entries, pad + "  ") \
            if self.vec and s.parallel is None else None
        if ahead is not None:   # a version that prefetches, taken for large operands
            large, lines = ahead
            return [f"{pad}if ({large}) {{", *("  " + line for line in [head, *lines, *body]),
                    f"{pad}}} else {{", *("  " + line for line in [head, *body]), f"{pad}}}"]
        if s.reduction and s.parallel is None:
            # A vectorised sum pays a horizontal add and masked tails per loop; short loops
            # (graph rows of a few nonzeros) run faster scalar, so version on trip count.
            # 256-bit lanes: the sums here gather (x[crd[p]]), and 512-bit gathers measured
            # 1.3-1.4x slower on long-row SpMV (bcsstk13, DLMC attention layers).
            trip = f"({self.expr(s.end)}) - ({self.expr(s.start)})"
            lanes = 32 // _SIZES[self.val]
            sums = ", ".join(s.reduction) if isinstance(s.reduction, tuple) else s.reduction
            return [f"{pad}if ({trip} >= {_SIMD_MIN_TRIP}) {{",
                    f"{pad}  #pragma omp simd reduction({s.combine}:{sums}) simdlen({lanes})",
                    *("  " + line for line in [head, *body]),
                    f"{pad}}} else {{", *("  " + line for line in [head, *body]), f"{pad}}}"]
        head = [f"{pad}#pragma omp simd", head] if s.simd else [head]
        par = s.parallel
        if par is None:
            return [*head, *body]
        sched = par.schedule + (f", {par.chunk}" if par.chunk else "")
        if par.workspace is None and par.weights is None:
            return _unless_one_thread(
                pad, [f"{pad}#pragma omp parallel for schedule({sched}) num_threads(nt)"],
                [*head, *body])
        # One parallel region; each thread owns its workspace for the whole loop.
        inner = pad + "  "
        before, alloc, free, after = [], [], [], []
        if par.workspace == "dense":
            before, alloc, after = (_HELPERS[f"team_{kind}_dense"]
                                    for kind in ("alloc", "slice", "free"))
        elif par.workspace:
            alloc, free = (_HELPERS[f"{kind}_{par.workspace}"] for kind in ("alloc", "free"))
        close = []
        if par.weights is None:
            split = [f"{inner}#pragma omp for schedule({sched})", *("  " + x for x in head)]
        else:
            split, close = self.balanced_split(s, inner)
            before = [*self.range_counter(), *before]
        region = [f"{pad}{{", *(inner + line for line in alloc), *split,
                  *(("  " + line) for line in body), *close,
                  *(inner + line for line in free), f"{pad}}}"]
        pragma = [f"{pad}#pragma omp parallel num_threads(nt)"]
        if par.workspace is not None:   # assembly kernels: one copy keeps the build short
            return [*(pad + line for line in before), *pragma, *region,
                    *(pad + line for line in after)]
        return [*(pad + line for line in before), *_unless_one_thread(pad, pragma, region)]

    def chunked(self) -> bool:
        """Whether this function's balanced loop takes ``nc`` ranges per thread."""
        return any(p.name == "nc" for p in self.fn.params)

    def range_counter(self) -> list[str]:
        """The shared counter a chunked balanced loop takes its ranges from (declared before
        the region, so every thread sees the one ``st_next``)."""
        if not self.chunked():
            return []
        return ["int64_t st_next_v = 0, *st_next = &st_next_v;"]

    def balanced_split(self, s: For, pad: str) -> tuple[list[str], list[str]]:
        """(opening lines, closing lines) around the body of ``s``: this thread's rows, an
        equal share of stored entries plus rows; with an ``nc`` parameter, its share of
        ``nc`` ranges per thread taken dynamically (``st_next_range``)."""
        if s.start != Lit(0):   # (the ranges split rows [0, end) by their weights)
            raise ValueError(f"a balanced loop over {s.var} must start at 0, not {s.start}")
        n, w = self.expr(s.end), s.parallel.weights
        # Without ``nc``: one range per thread (a constant 1 the C compiler folds away).
        nc, counter = ("nc", "st_next") if self.chunked() else ("1", "(int64_t*)0")
        step = f"{s.var}++" if s.step == 1 else f"{s.var} += {s.step}"
        return [f"{pad}const int64_t st_t = omp_get_thread_num(), "
                "st_T = omp_get_num_threads();",
                f"{pad}const int64_t st_C = st_T * ({nc} > 1 ? {nc} : 1);",
                f"{pad}for (int64_t st_c = st_next_range({counter}, {nc}, st_t); st_c < st_C; "
                f"st_c = st_next_range({counter}, {nc}, st_C)) {{",
                f"{pad}int64_t st_lo, st_hi;",
                f"{pad}ST_BALANCED_ROW({w}, {n}, st_c, st_C, st_lo);",
                f"{pad}ST_BALANCED_ROW({w}, {n}, st_c + 1, st_C, st_hi);",
                f"{pad}for (int64_t {s.var} = st_lo; {s.var} < st_hi; {step}) {{"], \
            [f"{pad}}}"]

    def outlined_loop(self, s: For, pad: str) -> list[str]:
        """A parallel loop as a function of its own, called inside an OpenMP region when
        ``nt > 1`` and directly otherwise: libgomp spends ~0.3 us setting up even a
        one-thread team (a tenth of a small SpMV call), and one copy of the loop keeps the
        build as short as before. Outside a region, thread queries answer 0 of 1 and an
        ``omp for`` runs every iteration."""
        fn, par = self.fn, s.parallel
        name = f"{fn.name}_loop{len(self.regions)}"
        params, args, close = [self.param(p) for p in fn.params], [p.name for p in fn.params], []
        counter = []
        if par.weights is not None:
            split, close = self.balanced_split(s, "  ")
            counter = self.range_counter()
            if counter:
                params.append("int64_t* st_next")
                args.append("st_next")
        else:
            sched = par.schedule + (f", {par.chunk}" if par.chunk else "")
            split = [f"  #pragma omp for schedule({sched})",
                     f"  for (int64_t {s.var} = {self.expr(s.start)}; {s.var} < "
                     f"{self.expr(s.end)}; {s.var}++) {{"]
        body = [*self.stmt(s.body, "    "), "  }", *close]
        params = ",\n    ".join(params)
        call = f"{name}({', '.join(args)});"
        narrow = self.vec.narrow_extent(s) if self.vec and par.weights is not None else None
        if narrow is None:
            self.regions.append("\n".join([
                f"static __attribute__((noinline)) void {name}(\n    {params}) {{",
                *split, *body, "}"]))
        else:
            # The loop inlined under each narrow range of its tiles' extent (see
            # narrow_extent), and as a function of its own for any other extent, compiled
            # as before (inlined there too, 128-column SpMM measured 1% slower).
            extent, ranges = narrow
            rows, alone = (f"{name}_{kind}({', '.join(args)});" for kind in ("rows", "any"))
            self.regions.append("\n".join([
                f"static inline __attribute__((always_inline)) void {name}_rows(\n"
                f"    {params}) {{", *split, *body, "}",
                f"static __attribute__((noinline)) void {name}_any(\n    {params}) {{",
                *split, *body, "}",
                f"static __attribute__((noinline)) void {name}(\n    {params}) {{",
                *(f"  {'else ' if k else ''}if ({extent} > {lo} && {extent} <= {hi}) {rows}"
                  for k, (lo, hi) in enumerate(ranges)), f"  else {alone}", "}"]))
        return [*(pad + line for line in counter),
                *_unless_one_thread(pad, [f"{pad}#pragma omp parallel num_threads(nt)"],
                                    [f"{pad}{call}"])]

    def param(self, p) -> str:
        if not p.ctype.endswith("*"):
            return f"int64_t {p.name}"
        const = "const " if p.const else ""
        return f"{const}{self.pointee(p)}* restrict {p.name}"

    def function(self, fn: Function) -> str:
        """Vector rendering where the ISA allows, else (or on any unsupported shape) the
        whole function with OpenMP pragmas only."""
        params = ",\n    ".join(self.param(p) for p in fn.params)
        self.array_types = {p.name: self.pointee(p) for p in fn.params
                            if p.ctype.endswith("*")}
        self.fn, self.outline = fn, _outlinable(fn)
        body = None
        if self.isa:
            self.vec = VectorLoops(self)
            self.regions = []
            try:
                body = self.stmt(fn.body, "  ")
                self.used_vector = self.used_vector or bool(self.vec.names or self.vec.tiles)
            except Unsupported:
                body = None
            finally:
                self.vec = None
        if body is None:
            self.regions = []
            body = self.stmt(fn.body, "  ")
        return "\n".join([*self.regions, f"void {fn.name}(\n    {params}) {{", *body, "}"])


def _outlinable(fn: Function) -> set:
    """ids of the parallel loops of ``fn`` (without team workspaces) that may become
    functions of their own: at the top level, or in a branch of a top-level ``If`` (or of an
    ``If`` in such a branch: the held, blocked and plain nests of SDDMM), with nothing
    declared before them, so they read parameters only. (Left inline, a nest measured 13%
    slower: GCC compiles the body of an inline parallel region differently.)"""
    found = set()

    def walk(stmts):
        for x in stmts:
            if isinstance(x, Decl) or (isinstance(x, Helper) and x.defines):
                return
            if isinstance(x, If):
                for b in (x.then, x.orelse):
                    if b is not None:
                        walk(b.stmts)
            elif isinstance(x, For) and x.parallel and x.parallel.workspace is None and \
                    (x.step == 1 or x.parallel.weights is not None):
                found.add(id(x))
    walk(fn.body.stmts)
    return found


def _unless_one_thread(pad: str, pragma: list, code: list) -> list:
    """``code`` under its OpenMP ``pragma`` when ``nt > 1``, else plainly (thread queries
    then answer 0 of 1): libgomp spends 0.3 us setting up even a one-thread team, a tenth
    of a small SpMV call. The code is compiled twice, which costs ~10% more build time."""
    return [f"{pad}if (nt > 1) {{", *("  " + line for line in (*pragma, *code)),
            f"{pad}}} else {{", *("  " + line for line in code), f"{pad}}}"]


def _uses_hash(node) -> bool:
    if isinstance(node, Helper):
        return node.name.startswith(("alloc_hash", "hash_"))
    if isinstance(node, For) and node.parallel and node.parallel.workspace == "hash":
        return True
    children = getattr(node, "stmts", None) or [getattr(node, a) for a in ("body", "then",
                                                                             "orelse")
                                                   if getattr(node, a, None) is not None]
    return any(_uses_hash(c) for c in children)


def render_c(functions, val_ctype: str, index_ctypes: dict, header: str = "",
             isa: str | None = None, wide_gathers_from: int | None = None) -> str:
    """C source for ``functions`` (IR ``Function``s sharing one value type).

    ``index_ctypes`` maps operand number to its index C type (``int32_t``/``int64_t``).
    ``isa``: the intrinsics of vector loops (None: pragmas); ``wide_gathers_from``: sums
    through a gather longer than this loop over full AVX-512 registers instead of halves
    (``vector.GATHERED_LOOP_LANES``; None: halves throughout).

    Example:
        >>> from sparsetorch.compiler.ir import Function, Param, block, Assign, Load, Lit
        >>> f = Function("k", (Param("out_vals", "val*", const=False),),
        ...              block(Assign(Load("out_vals", Lit(0)), Lit(1.0))))
        >>> "out_vals[0] = ((val_t)1.0);" in render_c([f], "float", {})
        True
    """
    r = _CRenderer(val_ctype, index_ctypes, isa, wide_gathers_from)
    bodies = [r.function(fn) for fn in functions]
    parts = [f"/* {line} */" for line in header.splitlines()] if header else []
    parts.append(_PRELUDE.format(val=val_ctype))
    if r.used_vector:
        parts.append(vector_prelude(r.isa))
    if r.used_sort:
        parts.append(SORT_PRELUDE if r.key_isa == "avx512" else SORT_PRELUDE_AVX2)
    if any(_uses_hash(fn.body) for fn in functions):
        parts.append(_HASH)
    return "\n".join(parts + bodies) + "\n"
