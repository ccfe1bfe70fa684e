"""Run an assignment on concrete operands: validate, convert, build, marshal, call.

This is the one path every public op takes (``einsum``, expression evaluation, operators on
``SparseTensor``). Per call it does: operand checks (cheap, no data scans: user data was
validated when its SparseTensor was built), a memo lookup of the compiled kernel, any
conversions the schedule asked for, and one or two ctypes calls.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch

from ..compiler.kblock import long_rows
from ..codegen.kernel import compile_kernel
from ..compiler.kernel import CompiledKernel, block_cap, tile_width, vector_lanes
from ..compiler.notation import Assignment, size_mismatch, var_extents
from ..compiler.output import infer_output
from ..compiler.schedule import OperandInfo, schedule
from ..compiler.lower import MAX_WORKSPACE
from ..formats.format import Format, as_format
from ..formats.pack import choose_index_dtype, pack
from ..formats.tensor import SparseTensor
from ..formats.validate import VALUE_DTYPES
from .balance import ranges_per_thread
from .merge import merged
from .relaid import relaid
from .transposed import prefetch_transposed, transposed_product
from .result_size import check_result_fits
from .blocked import BlockedCall, blocked_result_format, split_blocked
from . import cshim, custom_ops
from .custom_ops import is_tracing
from .policy import _SCATTER_WORK, asks_dense, backend, uses_triton
from .relayout import relayout
from .shim import make_shim, pointers
from .transpose import contiguous as _contiguous

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.int32: "int32",
                torch.int64: "int64"}
COMPILED_DTYPES = tuple(_DTYPE_NAMES)
# Below this much work a kernel runs on one thread: waking a team costs more (~1.2 us
# here, with the workers spinning). Work counts vector steps where a register tile covers
# the dense index: SpMM with 128 columns ran faster on two threads from ~8k steps (0.5-1k
# entries; below, one thread was 1.05-2.5x faster).
_PARALLEL_WORK = 1 << 13
# A stored entry with no dense-only index (SpMV, sampled elementwise products) is one
# multiply-add on a gathered value plus its share of a short row: 0.5-2.5 ns, about four
# vector steps of SpMM (0.7 ns). SpMV on two threads ran 1.1-1.6x faster from ~2k entries
# (SuiteSparse, DLMC) and 0.55-0.9x below; so did A * dense on A's pattern.
_GATHER_ENTRY_WORK = 4
# A result assembled through a row workspace costs more per stored operand entry: each one
# drives workspace updates and emission, not one multiply-add. SpGEMM A@A of 400-500-row
# SuiteSparse matrices (1.6-2k entries, 6-8k products) ran 1.3-1.7x faster on two threads
# (count + fill kernels), and 34-100-row ones (0.2-0.8k entries) no faster.
_ASSEMBLY_ENTRY_WORK = 8


def normalize_operands(operands, what: str, keep_blocked: bool = False):
    """Check dtypes/devices and return (tensors, infos). Dense inputs stay torch tensors;
    blocked sparse ones are converted to CSR-like unless ``keep_blocked``."""
    tensors, infos = [], []
    dtype = device = None
    for n, t in enumerate(operands):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: operand {n} is a {type(t).__name__}; pass torch tensors "
                            "or SparseTensors")
        if isinstance(t, SparseTensor):
            t._readable_values()   # (re-laying, below and in kernels' calls, reads by both)
            fmt = t.format
            if fmt.blocksize is not None and not keep_blocked:
                t = t.asformat("csr", index_dtype=t.index_dtype)
                fmt = t.format
            if not all(level.ordered for level in fmt.levels):
                # kernels walk and merge stored coordinates in order (a merge of two sparse
                # operands, a block's end): sort such an operand's entries first
                fmt = Format(tuple(replace(level, ordered=True) for level in fmt.levels),
                             fmt.mode_order, fmt.blocksize)
                t = t.asformat(fmt, index_dtype=t.index_dtype)
            infos.append(OperandInfo(fmt, False, _long_rows(t)))
        else:
            if t.layout != torch.strided:
                raise TypeError(f"{what}: operand {n} is a torch {t.layout} tensor; wrap it "
                                "with st.tensor(...) first")
            infos.append(OperandInfo(as_format("dense", t.dim()), True))
        if t.dtype not in VALUE_DTYPES:
            raise TypeError(f"{what}: operand {n} has dtype {t.dtype}, which is not supported")
        if dtype is None:
            dtype, device = t.dtype, t.device
        elif t.dtype != dtype:
            raise TypeError(f"{what}: operand {n} has dtype {t.dtype} but operand 0 has "
                            f"{dtype}; convert them to one dtype (e.g. .to(torch.float32))")
        elif t.device != device:
            raise ValueError(f"{what}: operand {n} is on {t.device} but operand 0 is on "
                             f"{device}; move them to one device")
        tensors.append(t)
    return tensors, tuple(infos), dtype, device


def _check_repeated(assignment: Assignment, infos, what):
    for acc in assignment.expr.accesses():
        if len(set(acc.indices)) != len(acc.indices) and not infos[acc.operand].strided:
            raise NotImplementedError(
                f"{what}: operand {acc.operand} repeats an index ({''.join(acc.indices)}); "
                "st.einsum takes diagonals of sparse operands (ops/diagonal.py), this path "
                "does not: pass the diagonal, or a dense operand")


def lookup(head, operands, out_format):
    """The memoised call recipe for this expression (an ``Assignment``, or an einsum string
    with which one was registered) and these operands, or None; None also while autograd
    must record the call (grad mode on and an operand requires grad)."""
    if backend() != "c":
        return None
    key = _signature(head, operands, out_format)
    return _PREPARED.get(key) if key is not None else None


def run(assignment: Assignment, operands, out_format=None, what="einsum", alias=None):
    """Evaluate ``assignment`` on ``operands``; dense results are torch tensors, sparse ones
    SparseTensors. ``alias`` (an einsum string) also keys the call memo, so a repeated
    ``st.einsum`` skips parsing and operand checks."""
    prepared = lookup(assignment, operands, out_format)
    if prepared is not None:
        if alias is not None:   # memoised by an earlier call through another name
            _remember(alias, operands, out_format, prepared)
        return prepared(operands)
    fewer = merged(assignment, operands)   # sparse factors on one pattern: one operand
    if fewer is not None:
        return run(*fewer, out_format, what)
    transposed = transposed_product(assignment, operands, out_format)   # CSRᵀ X
    if transposed is not None:
        key = _signature(assignment, operands, out_format)
        if key is not None:
            _PREPARED[key] = transposed
            if alias is not None:
                _remember(alias, operands, out_format, transposed)
        return transposed(operands)
    tensors, infos, dtype, device = normalize_operands(operands, what, keep_blocked=True)
    if uses_triton(device):
        return _run_triton(assignment, tensors, infos, out_format, what)
    blocked = any(info.format.blocksize is not None for info in infos)
    converted = blocked or any(t is not o for t, o in zip(tensors, operands))
    if blocked:
        result = _run_blocked(assignment, tensors, out_format, what, alias)
        if result is not None:
            return result
        tensors, infos, dtype, device = normalize_operands(tensors, what)
    _check_repeated(assignment, infos, what)
    extents = var_extents(assignment, [tuple(t.shape) for t in tensors])
    if backend() == "torch" or device.type != "cpu" or dtype not in COMPILED_DTYPES:
        from .fallback import run_dense

        return run_dense(assignment, tensors, infos, extents, out_format)
    kernel = get_kernel(assignment, tensors, infos, dtype, out_format, extents)
    prepared = _Prepared(kernel, dtype, _compile_args(assignment, tensors, infos, dtype,
                                                      out_format))
    if is_tracing(tensors):   # record a custom op instead of calling the kernel
        return custom_ops.call(prepared, tensors)
    # (an operand converted here, blocked to CSR or unordered sorted, is converted again on
    # every call: no memo)
    key = None if converted else _signature(assignment, operands, out_format)
    if key is not None:
        call = make_shim(prepared, tensors, _PARALLEL_WORK) or prepared
        _PREPARED[key] = call
        if alias is not None:
            _remember(alias, operands, out_format, call)
    return prepared(tensors)


def _run_triton(assignment, tensors, infos, out_format, what):
    """A Triton kernel (``triton_run.py``) where one covers the call, else the pure-torch
    fallback on the tensors' own device (blocked operands converted to CSR first), which
    ``triton_run.stats`` counts as ``"fallback"``."""
    from .fallback import run_dense
    from .triton_run import run_triton, stats

    _check_repeated(assignment, infos, what)
    if is_tracing(tensors):   # (torch.compile, export): one custom-op node per launch
        from .triton_ops import traced_call

        result = traced_call(assignment, tensors, infos, out_format)
    else:
        result = run_triton(assignment, tensors, infos, out_format)
    if result is not None:
        return result
    stats["fallback"] += 1
    tensors, infos, _, _ = normalize_operands(tensors, what)
    extents = var_extents(assignment, [tuple(t.shape) for t in tensors])
    return run_dense(assignment, tensors, infos, extents, out_format)


def _remember(alias: str, operands, out_format, call) -> None:
    """Key ``call`` by einsum string ``alias`` too, and offer its guarded shim to
    ``fast_calls``."""
    key = _signature(alias, operands, out_format)
    if key is None or _PREPARED.get(key) is call:   # (autograd's forward: every call)
        return
    _PREPARED[key] = call
    guarded = getattr(call, "cguarded", None) or getattr(call, "guarded", None)
    # An equation relayout rewrites runs as written only while small: its shim, offered,
    # would answer every later call of that string, large ones too, before relayout.
    if guarded is None or relayout(alias, operands, out_format, None) is not None:
        return
    if out_format is None:
        _offer(_FAST, alias, guarded)
    # a dense result is what ``out_format="dense"`` asks for (``@`` and ``torch.matmul``
    # ask for it: torch's products with a dense operand are dense)
    if (out_format is None and getattr(call, "dense", False)) or asks_dense(out_format):
        _offer(_FAST_DENSE, alias, guarded)


def _offer(table: dict, alias: str, guarded) -> None:
    known = table.get(alias, ())
    if guarded not in known:
        table[alias] = (guarded, *known[:_FAST_PER_EQUATION - 1])


def fast_calls(equation, out_format=None) -> tuple:
    """The guarded call shims recorded for einsum string ``equation`` and ``out_format``
    (None or ``"dense"``; any other: none), newest first: each returns the result, or None
    when the operands do not have its signature. Empty under another backend."""
    table = _FAST if out_format is None else _FAST_DENSE if asks_dense(out_format) else {}
    calls = table.get(equation, ()) if type(equation) is str else ()
    return calls if not calls or backend() == "c" else ()


def forget_calls() -> None:
    """Empty the per-signature call memos (``_PREPARED``, ``_BLOCKED`` and the guarded shims
    of ``fast_calls``), so each signature's next call takes the cold path (schedule, kernel
    lookup): for tests and tools that change how kernels are compiled in-process
    (``benchmarks/variants.py``).

    Example:
        >>> import torch, sparsetorch as st
        >>> _ = st.einsum("ij,j->i", st.tensor(torch.eye(2), format="csr"), torch.ones(2))
        >>> forget_calls()
        >>> fast_calls("ij,j->i")
        ()
    """
    for memo in (_PREPARED, _BLOCKED, _FAST, _FAST_DENSE, _FAST_EPILOGUE):
        memo.clear()


def kernel_for(assignment: Assignment, operands, out_format, what="explain"):
    """``(kernel, assignment run, split)``: the kernel ``run`` executes for these operands
    and the assignment it computes, which is the block/in-block split of ``assignment``
    (``split`` True) when blocked operands allow it (``ops/blocked.py``)."""
    tensors, infos, dtype, device = normalize_operands(operands, what, keep_blocked=True)
    if dtype not in COMPILED_DTYPES:   # (a KeyError below, a probe found)
        raise TypeError(f"{what}: {dtype} operands run through the pure-PyTorch fallback "
                        f"(densely, no generated kernel), so there is no plan to show; "
                        f"kernels are generated for {[str(d) for d in COMPILED_DTYPES]}")
    if any(info.format.blocksize is not None for info in infos):
        plan = _blocked_plan(assignment, tensors, out_format, what)
        if plan is not None:
            return plan[0], plan[1], True
        tensors, infos, dtype, device = normalize_operands(tensors, what)
    extents = var_extents(assignment, [tuple(t.shape) for t in tensors])
    return get_kernel(assignment, tensors, infos, dtype, out_format, extents), assignment, False


def prefetch(assignment: Assignment, operands, out_format=None) -> None:
    """Start building, in the background, the kernel ``run`` would build for these operands
    (a call a caller knows is coming: autograd's backward); returns once the compiler runs.
    Only the C backend on the CPU builds anything; the source is rendered here (Python), the
    compiler runs in its own process, so several prefetched builds overlap each other.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> prefetch(parse_einsum("ij,j->i", [2, 1]), [st.eye(3), torch.ones(3)])
    """
    from .. import runtime

    fewer = merged(assignment, operands, multiply=False)   # the kernel ``run`` would build
    if fewer is not None:
        assignment, operands = fewer
    if prefetch_transposed(assignment, operands, out_format):   # (run's CSRᵀ X)
        return
    tensors, infos, dtype, device = normalize_operands(operands, "prefetch", keep_blocked=True)
    if backend() != "c" or uses_triton(device) or device.type != "cpu" or \
            dtype not in COMPILED_DTYPES:
        return
    kernel, _, split = kernel_for(assignment, tensors, out_format, "prefetch")
    if not split:   # the variant ``run`` would pick for these sizes (nothing is loaded)
        tensors, infos, dtype, _ = normalize_operands(tensors, "prefetch")
        recipe = _Prepared(kernel, dtype, _compile_args(assignment, tensors, infos, dtype,
                                                        out_format))
        kernel = recipe.pick(tensors, recipe.extents(tensors)).kernel
    runtime.prefetch(kernel.source)


def _blocked_plan(assignment, tensors, out_format, what):
    """(kernel, split assignment, split operands, finish, (sampled operand, its blocked
    result format) or (None, None), infos) computing the
    result with blocked operands split into block and in-block indices, or None where that
    does not apply (the caller converts them instead)."""
    if out_format is not None or backend() != "c":
        return None
    split = split_blocked(assignment, tensors)
    if split is None:
        return None
    new, new_tensors, finish, static = split
    new_tensors, infos, dtype, device = normalize_operands(new_tensors, what)
    if device.type != "cpu" or dtype not in COMPILED_DTYPES:
        return None
    _check_repeated(new, infos, what)
    extents = var_extents(new, [tuple(t.shape) for t in new_tensors])
    kernel = get_kernel(new, new_tensors, infos, dtype, None, extents, static)
    out = kernel.output
    sampled = out.sampled_operand if out.kind == "sampled" else None
    if out.kind == "emit" or (out.kind == "dense" and
                              _unblocked_kind(assignment, tensors) != "dense"):
        return None
    result_format = None
    if sampled is not None:
        result_format = blocked_result_format(assignment, new, out.format,
                                              tensors[sampled].format)
        if result_format is None:
            return None
    return kernel, new, new_tensors, finish, (sampled, result_format), infos, static


def _unblocked_kind(assignment, tensors) -> str:
    """The output kind with blocked operands seen as CSR over blocks: a blocked operand
    gives the same kind of result as its unblocked format would (column sums of BSR stay
    sparse, as they are for CSR). Scheduling decides it; nothing is lowered or rendered."""
    infos = tuple(OperandInfo(Format(t.format.levels[: t.format.ndim], t.format.mode_order),
                              False) if isinstance(t, SparseTensor)
                  else OperandInfo(as_format("dense", t.dim()), True) for t in tensors)
    return _output_kind(assignment, infos)


@lru_cache(maxsize=1024)
def _output_kind(assignment, infos) -> str:
    """Memoised: blocked calls skip the call memo, and scheduling costs ~100 us a call."""
    sched = schedule(assignment, infos)
    return infer_output(assignment, sched.order, sched.formats, None).kind


def _run_blocked(assignment, tensors, out_format, what, alias=None):
    plan = _blocked_plan(assignment, tensors, out_format, what)
    if plan is None:
        return None
    kernel, new, new_tensors, finish, sampled, infos, static = plan
    dtype = new_tensors[0].dtype
    full = var_extents(assignment, [tuple(t.shape) for t in tensors])
    args = _compile_args(new, new_tensors, infos, dtype, None, static)
    prepared = _BLOCKED.get(args)
    if prepared is None:   # (for calls the memo cannot hold: autograd recording them)
        prepared = _BLOCKED[args] = _Prepared(kernel, dtype, args)
    if is_tracing(new_tensors):
        result = custom_ops.call(prepared, new_tensors)
    else:
        result = prepared(new_tensors)
        key = _signature(assignment, tensors, out_format)
        if key is not None:
            call = BlockedCall(assignment, static,
                               make_shim(prepared, new_tensors, _PARALLEL_WORK) or prepared,
                               sampled)
            _PREPARED[key] = call
            if alias is not None:
                _PREPARED[_signature(alias, tensors, out_format)] = call
    return finish(result, tuple(full[v] for v in assignment.out_vars), sampled)


# Memo of everything decided for one call signature (expression or einsum string, operand
# formats, dtypes, index widths, out_format): a repeated call skips checks, scheduling and
# kernel lookup. Operand ranks are part of the signature, so a string names one assignment.
_PREPARED: dict = {}
_BLOCKED: dict = {}    # compile arguments -> _Prepared, for blocked operands
# einsum string -> guarded shims of its memoised signatures (``fast_calls``): ``st.einsum``
# tries them before building a key, about 2 us of a 5-10 us call. A few per string, for
# code that alternates operand kinds (float32 and float64, CSR and COO).
_FAST: dict = {}
_FAST_DENSE: dict = {}   # the same for ``out_format="dense"``: shims with a dense result
# (einsum string, activation) -> guarded shims of fused bias/activation calls, taking the
# operands and then the bias (``einsum._offer_epilogue``)
_FAST_EPILOGUE: dict = {}
_FAST_PER_EQUATION = 4
_is_grad_enabled = torch.is_grad_enabled


# Structure descriptions of SparseTensors, interned as small ints: hashing the call key then
# costs nothing per sparse operand (a Format hashes field by field).
_STRUCTURES: dict = {}


def _signature(assignment, operands, out_format):
    grad = _is_grad_enabled()
    parts = [assignment, out_format if out_format is None else _fmt_key(out_format)]
    for t in operands:
        if type(t) is SparseTensor:
            # (the wrapper's own flag is read only where it may be set: it is not free)
            if grad and (t._values.requires_grad or (t._wrapper_grad and t.requires_grad)):
                return None
            # A SparseTensor's structure never changes: its part of the key is computed once.
            part = t.__dict__.get("_call_key")
            if part is None:
                if type(t._values) is not torch.Tensor and is_tracing((t,)):
                    return None   # fake or functional arrays: the custom-op path
                part = _STRUCTURES.setdefault((t._format, t.index_dtype, t.dtype,
                                               t.device.type, _long_rows(t)),
                                              len(_STRUCTURES))
                t.__dict__["_call_key"] = part
            parts.append(part)
        elif type(t) is torch.Tensor and t.layout == torch.strided:
            if grad and t.requires_grad:
                return None
            parts.append((t.dim(), t.dtype, t.is_cpu))
        else:
            return None
    try:
        return tuple(parts)
    except TypeError:
        return None


def _long_rows(t: SparseTensor) -> bool:
    """``kblock.long_rows`` of ``t``, kept with it (its pattern never changes)."""
    found = t.__dict__.get("_long_rows")
    if found is None:
        nnz = t._values.numel()
        if type(nnz) is not int or any(type(d) is not int for d in t._size):
            return False   # symbolic while tracing: the plain kernel (same results)
        found = _long_rows_of(t._format, t._size, nnz, t.dtype)
        t.__dict__["_long_rows"] = found
    return found


@lru_cache(maxsize=1024)
def _long_rows_of(fmt: Format, shape, nnz: int, dtype) -> bool:
    # (memoised: a wrapper made anew each call over a kept pattern, a softmax's output,
    # works it out again; ~28 us a time in a GAT training step)
    return dtype in _DTYPE_NAMES and long_rows(
        fmt, shape, nnz, block_cap(_DTYPE_NAMES[dtype], tile_width(_DTYPE_NAMES[dtype])))


def _fmt_key(out_format):
    if out_format is None or isinstance(out_format, (str, Format)):
        return out_format
    if not isinstance(out_format, (list, tuple)):
        raise TypeError(f"einsum: out_format must be a format name, a Format or a list of "
                        f"levels, got {type(out_format).__name__}")
    return tuple(out_format)


def _compile_args(assignment, tensors, infos, dtype, out_format, static=()) -> tuple:
    """``compile_kernel``'s arguments (its memo key); ``static``: (variable, extent) pairs
    fixed by the operands' formats (block sizes)."""
    index = tuple("int32" if isinstance(t, SparseTensor) and t.index_dtype == torch.int32
                  else "int64" for t in tensors)
    return assignment, infos, _DTYPE_NAMES[dtype], index, _fmt_key(out_format), static


def _workspace_kind(cells: int) -> str:
    """A dense row accumulator per thread, or a hash table when that would be too big."""
    return "hash" if cells > MAX_WORKSPACE else "dense"


def get_kernel(assignment, tensors, infos, dtype, out_format, extents,
               static=()) -> CompiledKernel:
    args = _compile_args(assignment, tensors, infos, dtype, out_format, static)
    kernel = compile_kernel(*args)
    if kernel.workspace_vars:
        kind = _workspace_kind(_prod(extents[v] for v in kernel.workspace_vars))
        if kind != kernel.workspace_kind:
            kernel = compile_kernel(*args, kind)
    return kernel


class _Prepared:
    """A built kernel plus the recipe to marshal one call: which operand dimension gives each
    index extent, which arrays to pass, how to allocate the output."""

    def __init__(self, kernel: CompiledKernel, dtype, compile_args: tuple,
                 allow_scatter: bool = False):
        from .. import runtime

        self.kernel, self.dtype, self.compile_args = kernel, dtype, compile_args
        self.allow_scatter = allow_scatter
        self.variants = {kernel.workspace_kind: self}   # same call, other workspace kind
        self.as_written = None   # ``written()``
        a = kernel.assignment
        # Where each index extent comes from, and which other uses must agree with it.
        uses = {}
        for acc in a.expr.accesses():
            for d, v in enumerate(acc.indices):
                uses.setdefault(v, []).append((acc.operand, d))
        self.var_order = a.all_vars
        self.sources = [uses[v][0] for v in a.all_vars]
        self.agree = [(v, first, other) for v in a.all_vars for first in uses[v][:1]
                      for other in uses[v][1:]]
        # Work estimate: stored entries of the sparse operands times the extents of the
        # variables only dense operands index (the k of SpMM and SDDMM), plus dense operands;
        # a register-tiled variable counts in vector steps of ``lanes`` values. With no
        # sparse operand, the whole iteration space (the multiply-adds of a dense product,
        # which its operands' sizes alone undercount: 2708 x 16 by 16 x 7 is 2.7k vector
        # steps of operands but 43k of products, 1.9x faster on two threads).
        sparse_vars = {v for acc in a.expr.accesses()
                       if not kernel.schedule.formats[acc.operand].is_dense
                       for v in acc.indices}
        self.dense_only = [a.all_vars.index(v) for v in a.all_vars if v not in sparse_vars]
        self.lanes = vector_lanes(_DTYPE_NAMES[dtype]) if kernel.tile else 1
        self.vector_index = a.all_vars.index(kernel.tile[0]) if kernel.tile else None
        self.out_index = [a.all_vars.index(v) for v in a.out_vars]
        self.ws_index = [a.all_vars.index(v) for v in kernel.workspace_vars]
        cshim.prefetch()
        self._fns = None      # loaded on first use (``fns``): a prefetch only needs the recipe
        self.num_threads = runtime.num_threads
        # The operand whose rows a balanced outer loop splits: the call passes ``nc``.
        self.balanced = kernel.balanced
        self.entry_work = _ASSEMBLY_ENTRY_WORK if kernel.workspace_vars else \
            1 if self.dense_only else _GATHER_ENTRY_WORK
        self.all_dense = not sparse_vars

    @property
    def fns(self) -> list:
        """The kernel's entry points, in ``kernel.functions`` order (built or loaded once)."""
        if self._fns is None:
            from .. import runtime

            fns = runtime.load_entries(self.kernel.source, {
                fn.name: kernel_argtypes(fn) for fn in self.kernel.functions})
            self._fns = [fns[fn.name] for fn in self.kernel.functions]
        return self._fns

    def extents(self, tensors) -> list:
        """Index extents in ``all_vars`` order, checking that every use agrees."""
        shapes = [t.shape for t in tensors]
        for v, (n, d), (n2, d2) in self.agree:
            if shapes[n2][d2] != shapes[n][d]:
                raise size_mismatch(v, shapes[n][d], shapes[n2][d2], f"in operand {n} but "
                                    f"{shapes[n2][d2]} in operand {n2} (dimension {d2})")
        return [shapes[n][d] for n, d in self.sources]

    def call_work(self, tensors, ext) -> int:
        """``work`` of a call on ``tensors``."""
        stored = sum(t._values.numel() for t in tensors if type(t) is SparseTensor)
        dense = sum(t.numel() for t in tensors if type(t) is not SparseTensor)
        return self.work(dense, stored, ext)

    def work(self, dense_numel: int, stored: int, ext) -> int:
        """Work of one call (see ``__init__``), compared with ``_PARALLEL_WORK``."""
        lanes = self.lanes
        per_entry = _prod([-(-ext[d] // lanes) if d == self.vector_index else ext[d]
                           for d in self.dense_only])
        if self.all_dense:
            return dense_numel // lanes + per_entry
        return dense_numel // lanes + stored * per_entry * self.entry_work

    def variant(self, workspace: str) -> "_Prepared":
        other = self.variants.get(workspace)
        if other is None:
            other = _Prepared(compile_kernel(*self.compile_args, workspace,
                                             allow_scatter=self.allow_scatter),
                              self.dtype, self.compile_args, self.allow_scatter)
            other.variants = self.variants
            self.variants[workspace] = other
        return other

    def written(self) -> "_Prepared":
        """For a kernel whose conversions only avoid a serial scatter (``schedule.py`` rule
        4): the kernel of the order as written, which calls below ``_SCATTER_WORK`` run
        (no values to gather, no wrapper to make)."""
        if self.as_written is None:
            self.as_written = _Prepared(
                compile_kernel(*self.compile_args, self.kernel.workspace_kind,
                               allow_scatter=True), self.dtype, self.compile_args, True)
        return self.as_written

    def pick(self, tensors, ext) -> "_Prepared":
        """The recipe a call on ``tensors`` runs: this one, or the variant for the call's
        workspace size, or (small calls) the order as written."""
        kernel = self.kernel
        if self.ws_index:   # the workspace kind follows this call's sizes
            kind = _workspace_kind(_prod([ext[d] for d in self.ws_index]))
            if kind != kernel.workspace_kind:
                return self.variant(kind).pick(tensors, ext)
        if kernel.schedule.conversions and kernel.schedule.avoids_scatter and \
                self.call_work(tensors, ext) < _SCATTER_WORK:
            return self.written()
        return self

    def __call__(self, tensors):
        ext = self.extents(tensors)
        chosen = self.pick(tensors, ext)
        if chosen is not self:
            return chosen(tensors)
        kernel = self.kernel
        if kernel.schedule.conversions:
            tensors = prepare_operands(kernel, tensors)
        args = [0, 0, *ext] if self.balanced is not None else [0, *ext]
        keep = []          # tensors whose pointers we pass must outlive the call
        sparse_work = dense_work = 0
        for t in tensors:
            if type(t) is SparseTensor:   # level arrays and values are always contiguous
                count, ptrs, _ = pointers(t)   # (values checked against the pattern)
                args += ptrs
                sparse_work += count
            else:
                vals = t if t.is_contiguous() else _contiguous(t)
                dense_work += vals.numel()
                keep.append(vals)
                args.append(vals.data_ptr())
        out_shape = tuple([ext[d] for d in self.out_index])
        kind = kernel.output.kind
        work = self.work(dense_work, sparse_work, ext)
        args[0] = self.num_threads() if work >= _PARALLEL_WORK else 1
        if self.balanced is not None:
            args[1] = ranges_per_thread(tensors[self.balanced], work) if args[0] > 1 else 1
        ws = [_prod([ext[d] for d in self.ws_index])] if self.ws_index else []
        if kind == "dense":  # the kernel zeroes it
            out = torch.empty(out_shape, dtype=self.dtype)
            self.fns[0](*args, out.data_ptr(), *ws)
            return out
        if kind == "sampled":
            source = tensors[kernel.output.sampled_operand]
            out_vals = (torch.empty if kernel.fills_output else torch.zeros)(
                source.nnz, dtype=self.dtype)
            self.fns[0](*args, out_vals.data_ptr(), *ws)
            return SparseTensor(out_shape, kernel.output.format, source._level_arrays, out_vals)
        return self.emit(tensors, args, ws, ext, out_shape)

    def emit(self, tensors, args, ws, ext, out_shape):
        """Two passes: count entries per outer iteration (straight into ``pos[1:]``, which
        the count kernel turns into running totals), fill. A few torch calls in all: this
        path's fixed cost is what a small SpGEMM pays."""
        kernel = self.kernel
        extents = dict(zip(self.var_order, ext))
        slices = _outer_extent(kernel, tensors, extents)
        check_result_fits(kernel, tensors, out_shape, self.dtype)
        pos = torch.zeros(slices + 1, dtype=torch.int64)
        self.fns[0](*args, pos.data_ptr() + 8, *ws)
        total = int(pos[slices])
        fmt = kernel.output.format
        vals = torch.empty(total, dtype=self.dtype)
        if kernel.emit_rows:  # CSR-like: the counts are the row lengths, columns in order
            crd = torch.empty(total, dtype=tensors[kernel.emit_index].index_dtype)
            self.fns[1](*args, pos.data_ptr(), crd.data_ptr(), vals.data_ptr(), *ws)
            index = choose_index_dtype(fmt.storage_dims(out_shape), total)
            rows = extents[kernel.outer_extent[1]]   # slices is at least 1
            return SparseTensor(out_shape, fmt, {"pos1": pos[: rows + 1].to(index),
                                                 "crd1": crd.to(index)}, vals)
        coords = torch.empty((len(out_shape), total), dtype=torch.int64)
        base = coords.data_ptr()
        self.fns[1](*args, pos.data_ptr(),
                    *(base + 8 * total * m for m in range(len(out_shape))), vals.data_ptr(),
                    *ws)
        arrays, stored = pack(fmt, out_shape, coords, vals, sorted_unique=kernel.emit_sorted)
        return SparseTensor(out_shape, fmt, arrays, stored)


def kernel_argtypes(fn) -> list:
    """The runtime argument types of a lowered ``Function``: arrays by pointer, the rest
    (sizes, the thread count) as int64."""
    from .. import runtime

    return [runtime.PTR if p.ctype.endswith("*") else runtime.I64 for p in fn.params]


def prepare_operands(kernel: CompiledKernel, tensors):
    """Apply the schedule's conversions (re-laying sparse operands in another mode order)."""
    out = list(tensors)
    for n, fmt in kernel.schedule.conversions:  # keep the index width the kernel was built for
        out[n] = relaid(tensors[n], fmt)
    return out


def _outer_extent(kernel, tensors, extents) -> int:
    kind = kernel.outer_extent
    if kind[0] == "dim":
        return max(1, extents[kind[1]])
    if kind[0] == "level":
        pos0 = tensors[kind[1]]._level_arrays["pos0"]
        return max(1, int(pos0[1]) - int(pos0[0]))
    return 1


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


custom_ops.set_preparer(_Prepared)
