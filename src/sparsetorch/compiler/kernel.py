"""The compiler stage in one call: notation -> schedule -> output spec -> loop IR, plus the
machine facts (vector ISA, register and cache sizes) its choices follow.

``lower_kernel`` is pure (no tensors): its inputs are the assignment, the operand formats and
the value dtype. The C source is the next stage's: ``codegen.kernel.compile_kernel`` renders
a lowered kernel and memoises both on exactly those inputs, so a repeated call with
same-structured operands does no scheduling at all.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..formats.levels import Compressed, Dense
from . import hold
from .ir import Function, dump, verify
from .jam import jam_rows, jam_sums, jam_tiles, sum_widths
from .sblock import column_blocked, held_rows
from .lower import Plan, lower
from .notation import Assignment
from .output import OutputSpec, infer_output
from .schedule import OperandInfo, Schedule, level_vars, schedule


@dataclass(frozen=True)
class CompiledKernel:
    """A scheduled and lowered kernel; ``source``, its C, is set by the stage that renders
    it (``codegen.kernel.compile_kernel``). Not yet built: see ``ops``."""

    assignment: Assignment
    schedule: Schedule
    output: OutputSpec
    functions: tuple[Function, ...]   # one for dense/sampled; count + fill for emit
    outer_extent: tuple               # ('dim', v) | ('level', n) | ('one',): emit slices
    emit_sorted: bool                 # emitted entries already sorted and unique
    emit_rows: bool                   # ...and one row per outer iteration of a CSR-like
                                      # result: pos is the running count, no packing, and
                                      # the fill pass writes only the columns, typed as
                                      # operand ``emit_index``'s indices
    workspace_vars: tuple[str, ...]
    workspace_kind: str | None
    tile: tuple | None                # (variable, width) of the register tile, if any
    balanced: int | None = None       # operand whose rows the outer loop splits (``nc``)
    jammed: tuple = ()                # (variable, extent) unrolled into the register tile
    notes: tuple[str, ...] = field(default=())
    compile_seconds: float = 0.0
    fills_output: bool = False        # a sampled result's every value is stored: no zeroing
    block_cap: int | None = None      # set when the kernel may run cache-blocked (kblock.py)
    column_blocked: int | None = None  # the gathered operand of a column-blocked SDDMM
                                       # (sblock.py)
    held: hold.Held | None = None     # SDDMM's nest with the row's operand held in
                                      # registers (hold.py)
    emit_index: int | None = None     # with emit_rows: ``emitted_index_operand``
    source: str | None = None         # the rendered C (None until codegen renders it)

    def describe_loops(self) -> str:
        return "\n".join(dump(fn) for fn in self.functions)


def _emission(assignment, order, out: OutputSpec, lw) -> tuple[bool, bool]:
    """``(emit_sorted, emit_rows)`` of an assembled result whose loop nest ``lw`` (a
    lowerer) built: entries come out sorted and unique, and moreover one CSR row per outer
    iteration (see ``CompiledKernel``)."""
    storage = tuple(v for v in order if v in assignment.out_vars)
    want = tuple(assignment.out_vars[m] for m in out.format.mode_order)
    dup_free = lw.ws_depth is not None or not lw.later_free
    levels = out.format.levels
    emit_sorted = storage == want and dup_free and all(lv.ordered for lv in levels)
    emit_rows = (emit_sorted and len(levels) == 2 and isinstance(levels[0], Dense)
                 and isinstance(levels[1], Compressed) and levels[1].unique
                 and lw.outer_extent == ("dim", storage[0]))
    return emit_sorted, emit_rows


def emitted_index_operand(assignment: Assignment, formats, out_format) -> int:
    """The operand whose index type a CSR-like result's emitted columns take
    (``CompiledKernel.emit_rows``): the first sparse operand that stores the result's
    column variable, so its index type holds every column (SpGEMM's B: with A's, a column
    past 2^31 of an int64 B was truncated into an int32 array); else the first sparse one."""
    column = assignment.out_vars[out_format.mode_order[-1]]
    sparse = [acc.operand for acc in assignment.expr.accesses()
              if not formats[acc.operand].is_dense]
    storing = [acc.operand for acc in assignment.expr.accesses()
               if acc.operand in sparse and column in level_vars(formats[acc.operand],
                                                                  acc.indices)]
    return min(storing) if storing else min(sparse)


@lru_cache(maxsize=None)
def _cpuinfo(field: str) -> str:
    """The value of ``field`` in the first processor's block of /proc/cpuinfo ("" when
    absent or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def _cpu_flags() -> frozenset:
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; "" when
    unknown): per-CPU choices that differ by vendor ask it.

    Example:
        >>> isinstance(cpu_vendor(), str)
        True
    """
    return _cpuinfo("vendor_id")


def wide_gathers_from() -> int | None:
    """Terms past which a float32 sum through a gather (an SpMV row) loops over 512-bit
    steps instead of 256-bit ones (``codegen/vector.py``, ``GATHERED_LOOP_LANES``): 48 on
    AMD CPUs with AVX-512 (measured on Zen 5), None elsewhere (Intel Sapphire Rapids ran
    256-bit gathers faster per term on rows of 20 and of 100 entries)."""
    return 48 if vector_isa() == "avx512" and cpu_vendor() == "AuthenticAMD" else None


def simd_bytes() -> int:
    """Vector register width of generated kernels in bytes: their intrinsics ISA's (64
    AVX-512, 32 AVX2), else this CPU's widest (16 without AVX2)."""
    isa = vector_isa()
    if isa is not None:
        return ISA_BYTES[isa]
    flags = _cpu_flags()
    return 64 if "avx512f" in flags else 32 if "avx2" in flags else 16


@lru_cache(maxsize=None)
def _cache_bytes(level: int, default: int) -> int:
    """Per-core data (or unified) cache size of ``level`` from sysfs; ``default`` when it
    cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            with open(f"{base}/{index}/level") as f:
                if f.read().strip() != str(level):
                    continue
            with open(f"{base}/{index}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{base}/{index}/size") as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


def l2_bytes() -> int:
    """Per-core L2 cache size from sysfs (1 MiB when it cannot be read).

    Example:
        >>> l2_bytes() >= 64 * 1024
        True
    """
    return _cache_bytes(2, 1 << 20)


def sampled_block_bytes() -> int:
    """What a column block of SDDMM's blocked nest (``sblock.py``, measured there) may fill
    with the dense operand's rows: two thirds of the L1 data cache (32 KB with a 48 KB L1d;
    a 32 KB L1d assumed when sysfs does not say), the rest left to the row of X and the
    entries. On AMD Zen 5 (DLMC masks), against the L1d and a third with no floor in bytes
    nor evened blocks: 70%-sparse masks 1.03-1.04x at K = 64 and 1.08x at K = 256."""
    return _cache_bytes(1, 32 << 10) * 2 // 3


def block_cap(value_dtype: str, tile: int) -> int | None:
    """Most reduction coordinates per cache block (``kblock.py``): a block's slice of the
    dense operand, rows of the widest panel, fills at most a quarter of L2. None without
    intrinsics tiles (pragma tiles are one register: nothing to block for)."""
    if not vector_isa() or value_dtype not in ("float32", "float64"):
        return None
    panel_bytes = tile * panel_factors()[0] * _VALUE_BYTES[value_dtype]
    return max(16, l2_bytes() // 4 // panel_bytes)


# Bytes per vector register of each ISA generated kernels use intrinsics of.
ISA_BYTES = {"avx512": 64, "avx2": 32}
_ISA_FLAGS = {"avx512": {"avx512f", "avx512dq", "avx512vl"}, "avx2": {"avx2", "fma"}}


@lru_cache(maxsize=None)
def vector_isa() -> str | None:
    """The intrinsics generated kernels use (``codegen/vector.py``): 'avx512' (F, DQ and VL
    present), else 'avx2' (with FMA), else None and loops are vectorised by OpenMP pragmas
    only. ``SPARSETORCH_SIMD`` (read once per process) narrows the choice: 'pragma' for
    none, 'avx2' for AVX2 on an AVX-512 CPU; 'auto' or unset for the best. An unknown
    value, or an ISA this CPU lacks, is a ValueError.

    Example:
        >>> vector_isa() in ("avx512", "avx2", None)
        True
    """
    want = os.environ.get("SPARSETORCH_SIMD", "auto").lower() or "auto"
    if want not in ("auto", "pragma", *_ISA_FLAGS):
        raise ValueError(f"SPARSETORCH_SIMD={want!r} is not one of auto, avx512, avx2, "
                         "pragma; unset it to let sparsetorch pick")
    if want == "pragma":
        return None
    have = [isa for isa, flags in _ISA_FLAGS.items() if flags <= _cpu_flags()]
    if want != "auto" and want not in have:
        raise ValueError(f"SPARSETORCH_SIMD={want!r}: this CPU lacks "
                         f"{', '.join(sorted(_ISA_FLAGS[want] - _cpu_flags()))}; use "
                         f"{' or '.join(have + ['pragma'])}, or unset it")
    return want if want != "auto" else next(iter(have), None)


# Registers per register tile with intrinsics: four independent FMA chains per nonzero hide
# the FMA latency and reuse each loaded nonzero four times. (AVX2 A/B of 2/4/6/8 on SpMM:
# 8 was 1.01x on graphs and SuiteSparse but 0.95x on DLMC layers, 2 and 6 slower.)
_TILE_REGISTERS = 4


# Rows of a dense product computed side by side (``jam.jam_rows``), at most: as many as
# keep the tiles within ``max_tile_registers`` (AVX2: two rows of four registers).
JAMMED_ROWS = 4


def sum_copies() -> int:
    """Inner products computed side by side (``jam.jam_sums``; SDDMM's entries): eight
    with AVX2 or AVX-512 (two combined horizontal adds), four on other targets. Eight keep
    more rows of the dense operand in flight and halve the loops per row: on DLMC SDDMM,
    AVX2 (AMD Zen 3) 1.08x faster than four (K = 64, 256); AVX-512 (AMD Zen 5,
    ``benchmarks/variants.py --knob sum_copies=4,8 --kernel sddmm``, 24 masks) 1.038x at
    K = 64 (none slower) and 1.014x at K = 256."""
    return 8 if vector_isa() in ("avx2", "avx512") else 4


def held_slice(value_dtype: str) -> int | None:
    """Values of a row held in registers for SDDMM's inner products (``hold.py``):
    ``hold.SLICE_REGISTERS`` AVX-512 registers (256 float32, 128 float64); None elsewhere
    (not measured on AVX2, whose sixteen registers would leave none to accumulate in, nor
    for integer values, which have no fused multiply-add) or with no registers set."""
    if vector_isa() != "avx512" or not hold.SLICE_REGISTERS or \
            value_dtype not in ("float32", "float64"):
        return None
    return hold.SLICE_REGISTERS * vector_lanes(value_dtype)


def max_tile_registers() -> int:
    """Most accumulator registers of a kernel's tiles side by side (``jam.py``): half of the
    ISA's vector registers (32 with AVX-512, 16 with AVX2), so loads and the broadcast
    nonzero fit beside them without spills (pragma tiles: as many as AVX-512's)."""
    return 8 if vector_isa() == "avx2" else 16


def panel_factors() -> tuple:
    """Panel widths of SpMM's cache-blocked nest (``kblock.py``) in register tiles, widest
    first: up to ``max_tile_registers`` accumulators, halving down to one tile. AVX-512:
    (4, 2, 1), panels of 16, 8 and 4 registers; AVX2: (2, 1), since 16-register panels
    spill there (8-register panels measured 1.04x faster on DLMC SpMM, N=256)."""
    widest = max(1, max_tile_registers() // _TILE_REGISTERS)
    return tuple(widest >> s for s in range(widest.bit_length()))


_VALUE_BYTES = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}


def vector_lanes(value_dtype: str) -> int:
    """Values per SIMD register of this CPU (16 float32 with AVX-512).

    Example:
        >>> vector_lanes("float64") * 2 == vector_lanes("float32")
        True
    """
    return simd_bytes() // _VALUE_BYTES[value_dtype]


def tile_width(value_dtype: str, rows: int = 1) -> int:
    """Register tile width in values. With intrinsics: four registers (AVX-512: 64 float32,
    AVX2: 32), or fewer when ``rows`` tiles are unrolled side by side (``jam.py``: a block's
    rows), so all of them stay within ``max_tile_registers``. With pragmas only: one vector
    register, since gcc spills wider tile arrays (2-8 registers measured 2-5x slower on SpMM
    here: bayer10, bcsstk13, N=128)."""
    isa = vector_isa()
    if isa and value_dtype in ("float32", "float64"):
        regs = max(1, min(_TILE_REGISTERS, max_tile_registers() // rows))
        return regs * ISA_BYTES[isa] // _VALUE_BYTES[value_dtype]
    return vector_lanes(value_dtype)


def lower_kernel(assignment: Assignment, infos: tuple[OperandInfo, ...], value_dtype: str,
                 out_format=None, static: tuple = (), workspace: str = "dense",
                 allow_scatter: bool = False) -> CompiledKernel:
    """Schedule and lower ``assignment`` for operands described by ``infos`` (no source:
    ``codegen.kernel.compile_kernel`` renders it, and memoises both).
    ``static``: (variable, extent) pairs the operands fix (block sizes); loops over them
    around a register tile are unrolled into it (``jam.py``). ``workspace`` picks the row
    accumulator of sparse results: a 'dense' array per thread, or a 'hash' table for
    dimensions too large for that. ``allow_scatter``: keep an order that scatters into a
    dense result from one thread rather than re-lay an operand (the kernel for calls too
    small for threads; ``schedule.py`` rule 4).

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> k = lower_kernel(parse_einsum("ij,j->i", [2, 1]),
        ...                  (OperandInfo(as_format("csr", 2), False),
        ...                   OperandInfo(as_format("dense", 1), True)), "float32")
        >>> k.schedule.order, k.output.kind
        (('i', 'j'), 'dense')
    """
    t0 = time.perf_counter()
    sched = schedule(assignment, infos, allow_scatter)
    out = infer_output(assignment, sched.order, sched.formats, out_format)
    notes: list[str] = []
    modes = ("count", "fill") if out.kind == "emit" else (out.kind,)
    functions, lowerers, jammed = [], [], ()
    emit_sorted = emit_rows = False
    # Tiles side by side for the largest static output extent (a block's rows) when jammed.
    rows = max([e for v, e in static if v in assignment.out_vars], default=1)
    tile = tile_width(value_dtype, rows)
    for mode in modes:
        row_emission = None
        if mode == "fill":   # the loop nest the count pass got fixes how entries are written
            emit_sorted, emit_rows = _emission(assignment, sched.order, out, lowerers[0])
            # (rows emitted take a sparse operand's index type: none, none emitted)
            emit_rows = emit_rows and any(not f.is_dense for f in sched.formats)
            row_emission = emitted_index_operand(assignment, sched.formats, out.format) \
                if emit_rows else None
        cap = block_cap(value_dtype, tile) if any(i.long_rows for i in infos) else None
        plan = Plan(assignment, sched.order, sched.formats, out, mode, workspace,
                    tile, notes, row_emission, cap, panel_factors())
        fn, lw = lower(plan, f"kernel_{mode}")
        regs = tile // vector_lanes(value_dtype)   # (a register tile's registers)
        if static and mode == "dense" and lw.tile_var is not None:
            body, jammed = jam_tiles(fn.body, dict(static), regs, max_tile_registers())
            fn = replace(fn, body=body)
        elif mode == "dense" and lw.tile_var is not None and vector_isa() and \
                all(f.is_dense for f in sched.formats):
            rows = min(JAMMED_ROWS, max_tile_registers() // regs)
            body, blocked = jam_rows(fn.body, rows, regs, max_tile_registers())
            if blocked:
                fn = replace(fn, body=body)
                notes.append(f"blocks of {rows} rows side by side (register blocking)")
        if mode in ("dense", "sampled") and lw.acc_depth is not None:
            copies = sum_copies()
            body, summed = jam_sums(fn.body, copies)
            if summed:
                held = held_slice(value_dtype)
                if plan.block_cap is not None:   # long rows: Y's rows may outgrow L1
                    body = column_blocked(body, lw, copies, _VALUE_BYTES[value_dtype],
                                          l2_bytes(), sampled_block_bytes(), held)
                elif held is not None:
                    body = held_rows(body, lw, copies, held)
                fn = replace(fn, body=body)
                narrower = "".join(f"then {w}, " for w in sum_widths(copies)[1:])
                notes.append(f"inner products of {copies} stored entries side by side "
                             f"(one loop, combined horizontal adds; {narrower}then one at "
                             "a time for the rest of a row)")
        verify(fn)
        functions.append(fn)
        lowerers.append(lw)
    lw = lowerers[-1]
    return CompiledKernel(assignment, sched, out, tuple(functions), lw.outer_extent,
                          emit_sorted, emit_rows, lw.ws_vars, lw.ws_kind,
                          (lw.tile_var, lw.plan.tile) if lw.tile_var else None,
                          lw.balanced, jammed, tuple(dict.fromkeys(notes)),
                          time.perf_counter() - t0, lw.stores_every_entry,
                          lw.plan.block_cap if lw.k_blocked else None, lw.column_blocked,
                          lw.held, row_emission)


def lower_plain(assignment: Assignment, infos: tuple[OperandInfo, ...], out_format=None):
    """``(schedule, output spec, Function)``: the plain nest of ``assignment`` (one loop per
    index variable, no register tiles, unrolled sums or cache blocks), which the block-shaped
    renderer (``codegen/triton.py``) reads. Sparse results assembled in count and fill passes
    have no plain nest here (``Function`` None).

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> _, out, fn = lower_plain(parse_einsum("ij,j->i", [2, 1]),
        ...                          (OperandInfo(as_format("csr", 2), False),
        ...                           OperandInfo(as_format("dense", 1), True)))
        >>> out.kind, "sum into" in dump(fn)
        ('dense', True)
    """
    sched = schedule(assignment, infos)
    out = infer_output(assignment, sched.order, sched.formats, out_format)
    if out.kind == "emit":
        return sched, out, None
    fn, _ = lower(Plan(assignment, sched.order, sched.formats, out, out.kind), "kernel")
    verify(fn)
    return sched, out, fn
