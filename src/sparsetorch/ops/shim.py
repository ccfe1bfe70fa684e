"""Call shims: a small Python function generated per prepared kernel, so a repeated call
does only what this kernel needs.

The generic call path (``execute._Prepared.__call__``) loops over operands, extents and
arrays; at 10-20 us per call that loop costs more than a small SpMV itself. For kernels with
a dense, sampled or CSR-row result (SpGEMM: 49 -> 23 us on a 7x7 product) and no operand
conversion, ``make_shim`` writes the same steps out
straight-line, specialised on the operand kinds and array names (they are fixed by the call
signature the shim is memoised under), and ``exec``\\s it once, the way
``collections.namedtuple`` builds its classes. Example of what it writes for SpMV::

    def call(ops):
        t0, t1 = ops
        s1 = t1.shape; d0 = t0.__dict__
        t1 = t1 if t1.is_contiguous() else contiguous(t1)
        n0, p0, q0 = d0.get('_raw') or raw(t0); v0 = t0._values
        if v0.data_ptr() != q0 or v0.numel() != n0 or not v0.is_contiguous():
            n0, p0, q0 = raw(t0)
        s0 = t0._size
        e0 = s0[0]; e1 = s0[1]
        if s1[0] != e1: mismatch(ops)
        out = t0._values.new_empty(e0, )
        w = (e1) + n0
        if w >= 8192: nt = threads(); nc = ranges(t0, w)
        else: nt = nc = 1
        f0(nt, nc, e0, e1, *p0, t1.data_ptr(), out.data_ptr())
        return out
"""
from __future__ import annotations

import ctypes

import torch

from ..compiler.lower import MAX_WORKSPACE
from ..formats.tensor import SparseTensor, layout
from . import cshim
from .balance import chunked_work, ranges_per_thread
from .policy import _SCATTER_WORK
from .result_size import check_result_fits, dense_fits
from .transpose import contiguous


def raw(t) -> tuple:
    """``(entry count, data pointers of the level arrays and values, the values' pointer)``
    of SparseTensor ``t`` in the order kernels take them, kept with ``t``. Its level arrays
    never change (no user holds them: ``SparseTensor.arrays`` gives copies); its values
    tensor may be given other storage (``.data =``, ``set_``, ``resize_``) or strides
    (``as_strided_``), so callers compare the values' pointer, size and contiguity with
    the kept ones on every call (``pointers``) and read them again, checked, when they
    differ.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(2), format="csr")
        >>> n, ptrs, values = raw(A)
        >>> n, len(ptrs), ptrs[-1] == values == A.values.data_ptr()
        (2, 3, True)
    """
    values = t._checked_values()
    at = values.data_ptr()
    found = (values.numel(), tuple([getattr(t, "_" + a).data_ptr() for a in t._array_names]
                                   + [at]), at)
    t.__dict__["_raw"] = found
    return found


def pointers(t) -> tuple:
    """``raw(t)``, read again when the values' storage changed since it was kept."""
    found = t.__dict__.get("_raw")
    values = t._values
    if found is None or values.data_ptr() != found[2] or values.numel() != found[0] or \
            not values.is_contiguous():
        found = raw(t)
    return found


def make_shim(prepared, tensors, parallel_work: int):
    """A specialised ``call(ops)`` for ``prepared`` (an ``execute._Prepared``) on operands
    shaped like ``tensors``, or None when the generic path must run (sparse results other
    than CSR rows, conversions, hash workspaces).

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.ops import execute
        >>> A = st.tensor(torch.eye(3), format="csr")
        >>> _ = st.einsum("ij,j->i", A, torch.ones(3))
        >>> call = execute.lookup("ij,j->i", (A, torch.ones(3)), None)
        >>> call((A, torch.arange(3.)))
        tensor([0., 1., 2.])
    """
    schedule = prepared.kernel.schedule
    if schedule.conversions:
        if not schedule.avoids_scatter:
            return None
        # Conversions that only avoid a serial scatter: calls too small for threads run
        # the order as written here, larger ones the re-laid operand (``generic``). The
        # written kernel counts work in vector steps of its own width (often untiled: 1).
        written = prepared.written()
        return _make(written, tensors, parallel_work, prepared,
                     _SCATTER_WORK * prepared.lanes // written.lanes)
    return _make(prepared, tensors, parallel_work, prepared, None)


def _make(prepared, tensors, parallel_work: int, generic, max_work):
    """``make_shim`` for ``prepared``'s kernel without conversions; calls of ``max_work``
    or more (None: no limit) go to ``generic``."""
    kernel = prepared.kernel
    kind = kernel.output.kind
    rows_emitted = kind == "emit" and kernel.emit_rows and kernel.workspace_kind == "dense"
    if not ((kind in ("dense", "sampled") and not prepared.ws_index) or rows_emitted):
        return None
    n_ops = len(tensors)
    names = [f"t{n}" for n in range(n_ops)]
    unpack = f"    {', '.join(names)}, = ops"
    sparse = [n for n, t in enumerate(tensors) if isinstance(t, SparseTensor)]
    lines = [f"    t{n} = t{n} if t{n}.is_contiguous() else contiguous(t{n})"
             for n in range(n_ops) if n not in sparse]
    # A SparseTensor's entry count and raw pointers are read once (``raw``); only its values
    # can be given other storage since, which one pointer and size compare notices.
    for n in sparse:
        lines += [f"    n{n}, p{n}, q{n} = d{n}.get('_raw') or raw(t{n}); v{n} = t{n}._values",
                  f"    if v{n}.data_ptr() != q{n} or v{n}.numel() != n{n} or "
                  f"not v{n}.is_contiguous(): n{n}, p{n}, q{n} = raw(t{n})"]
    # Dense shapes are read by the caller of these lines: ``call`` below, or the guard,
    # which needs the rank anyway (``len(shape)`` is cheaper than ``dim()`` then ``shape``).
    if sparse:
        lines.append("    " + "; ".join(f"s{n} = t{n}._size" for n in sparse))
    lines.append("    " + "; ".join(f"e{i} = s{n}[{d}]"
                                    for i, (n, d) in enumerate(prepared.sources)))
    first = {v: i for i, v in enumerate(prepared.var_order)}
    for v, _, (n2, d2) in prepared.agree:
        lines.append(f"    if s{n2}[{d2}] != e{first[v]}: mismatch(ops)")
    lanes = prepared.lanes   # the same estimate as ``prepared.work``
    dense_only = "".join(f" * ((e{i} + {lanes - 1}) // {lanes})" if i == prepared.vector_index
                         else f" * e{i}" for i in prepared.dense_only)
    per = "" if lanes == 1 else f" // {lanes}"
    # A dense operand's size from the extents already read (``numel()`` is a call)
    indices = {acc.operand: acc.indices for acc in kernel.assignment.expr.accesses()}
    work = [f"({' * '.join(f'e{first[v]}' for v in indices[n]) or '1'}){per}"
            for n in range(n_ops) if n not in sparse]
    entry = f" * {prepared.entry_work}" if prepared.entry_work != 1 else ""
    work += [f"n{n}{dense_only}{entry}" for n in sparse]
    if prepared.all_dense:   # the products of a dense kernel
        work.append(f"1{dense_only}")
    work = " + ".join(work)
    if max_work is not None:
        lines.append(f"    if {work} >= {max_work}: return generic(ops)")
    dims, strides, step = [f"e{i}" for i in prepared.out_index], [], "1"
    shape = "".join(f"{x}, " for x in dims)
    # Uninitialised values: ``new_empty`` of a sparse operand's values (a plain CPU tensor of
    # the value dtype) parses its arguments faster than ``empty_strided(shape, strides,
    # dtype=)``: 1.06 vs 1.24 us here, a twentieth of a tiny call (SpMV A/B: 1.016x).
    like = f"t{sparse[0]}._values.new_empty" if sparse else None
    if kind == "sampled":   # values on the sampled operand's pattern, its arrays shared
        source = kernel.output.sampled_operand
        fill = (f"{like}(n{{0}})" if like else "empty_strided((n{0},), (1,), dtype=dtype)") \
            if kernel.fills_output else "zeros(n{0}, dtype=dtype)"
        lines.append("    out = " + fill.format(source))
    elif kind == "emit":    # the workspace kind follows this call's sizes
        cells = " * ".join(f"e{first[v]}" for v in kernel.workspace_vars)
        lines.append(f"    ws = {cells}")
        lines.append("    if ws > max_dense_ws: return generic(ops)")
    elif like and dims:
        lines.append(f"    out = {like}({shape})")
    else:
        # empty_strided parses its arguments faster than empty(shape, dtype=) (1.1 vs 1.8 us)
        for d in reversed(dims):
            strides.insert(0, step)
            step = d if step == "1" else f"{d} * {step}"
        strides = "".join(f"{x}, " for x in strides)
        lines.append(f"    out = empty_strided(({shape}), ({strides}), dtype=dtype)")
    args = ["nt", *(f"e{i}" for i in range(len(prepared.sources)))]
    if prepared.balanced is None:
        lines.append(f"    nt = threads() if {work} >= {parallel_work} else 1")
    else:   # a balanced outer loop also takes its ranges per thread (``ops/balance.py``)
        rows = f"t{prepared.balanced}"
        lines += [f"    w = {work}",
                  f"    if w >= {parallel_work}: nt = threads(); "
                  f"nc = ranges({rows}, w) if w >= {chunked_work()} else 1",
                  "    else: nt = nc = 1"]
        args.insert(1, "nc")
    for n, t in enumerate(tensors):
        if n in sparse:
            args.append(f"*p{n}")
        else:
            args.append(f"t{n}.data_ptr()")
    if kind == "emit":
        # (a result too large for memory is refused before its count pass walks it)
        lines.append(f"    if {' * '.join(dims) or '1'} > {dense_fits(prepared.dtype)}: "
                     f"fits(kernel, ops, ({shape}), dtype)")
        lines += _emit_rows(kernel, args, dims, first, tensors)
    else:
        args.append("out.data_ptr()")
        lines.append(f"    f0({', '.join(args)})")
    if kind == "sampled":
        arrays = "".join(f"t{source}.{a}, " for a in layout(kernel.output.format)[2])
        lines.append(f"    return from_parts(({shape}), parts, ({arrays}), out)")
    elif kind == "dense":
        lines.append("    return out")
    guard = _guard(tensors, sparse)
    reads = "; ".join([f"s{n} = t{n}.shape" for n in range(n_ops) if n not in sparse] +
                      [f"d{n} = t{n}.__dict__" for n in sparse])
    # (an operand list of another length fails the unpacking: not this shim's call)
    source = "\n".join(["def call(ops):", unpack, f"    {reads}", *lines,
                        *(["def guarded(ops):", "    try:", "    " + unpack,
                           "    except (TypeError, ValueError): return None",
                           *guard, *lines] if guard else [])])
    scope = {"contiguous": contiguous, "empty_strided": torch.empty_strided,
             "zeros": torch.zeros, "dtype": prepared.dtype,
             "from_parts": SparseTensor._from_parts,
             "parts": None if kind == "dense" else layout(kernel.output.format),
             "threads": torch.get_num_threads,   # what runtime.num_threads answers
             "ranges": ranges_per_thread, "raw": raw,
             "f0": prepared.fns[0], "f1": prepared.fns[-1], "generic": generic,
             "max_dense_ws": MAX_WORKSPACE, "int64": torch.int64, "int32": torch.int32,
             "i64_at": ctypes.c_int64.from_address,
             "mismatch": prepared.extents, "fits": check_result_fits, "kernel": kernel, "SparseTensor": SparseTensor,
             "Tensor": torch.Tensor, "strided": torch.strided, "grad": torch.is_grad_enabled}
    exec(compile(source, f"<sparsetorch call shim: {kernel.assignment}>", "exec"), scope)
    call = scope["call"]
    call.source = source
    call.guarded = scope.get("guarded")
    call.dense = kind == "dense"   # (also answers calls that ask for out_format="dense")
    # the same guard and call in C, where it applies (``cshim.py``)
    call.cguarded = cshim.make(prepared, tensors, sparse, parallel_work, call, max_work)
    return call


def _emit_rows(kernel, args, dims, first, tensors) -> list[str]:
    """Lines for a CSR-like result (``CompiledKernel.emit_rows``): count each row's entries
    into ``pos[1:]`` (the kernel leaves running totals there), read the total, fill the
    columns (in operand ``kernel.emit_index``'s index type) and values, wrap with the
    narrowest index type that holds them."""
    rows = f"e{first[kernel.outer_extent[1]]}"
    crd = "int32" if tensors[kernel.emit_index].index_dtype == torch.int32 else "int64"
    shape = "".join(f"{d}, " for d in dims)
    return [f"    m = {rows} or 1",
            "    pos = zeros(m + 1, dtype=int64); pp = pos.data_ptr()",
            f"    f0({', '.join(args)}, pp + 8, ws)",
            "    total = i64_at(pp + 8 * m).value",
            "    vals = empty_strided((total,), (1,), dtype=dtype)",
            f"    crd = empty_strided((total,), (1,), dtype={crd})",
            f"    f1({', '.join(args)}, pp, crd.data_ptr(), vals.data_ptr(), ws)",
            # narrowest index type; ``.int()``/``.long()`` and no slice unless the result has
            # no rows: ``pos[:n].to(dtype)`` costs 2-3x as much on a small product
            f"    narrow = max(total, {shape}0) < 2**31",
            f"    pos = pos if {rows} else pos[:1]",
            "    pos = pos.int() if narrow else pos",
            f"    crd = {'crd' if crd == 'int32' else 'crd.int()'} if narrow else "
            f"{'crd.long()' if crd == 'int32' else 'crd'}",
            f"    return from_parts(({shape}), parts, (pos, crd), vals)"]


def _guard(tensors, sparse) -> list[str]:
    """Lines that return None unless the unpacked operands ``t0, t1, ...`` have the call
    signature the shim is memoised under (``execute._signature``: exact types, SparseTensor
    structure keys, dense ranks, dtypes and devices, no gradients to record), so the shim can
    be found by the einsum string alone (``execute.fast_calls``) without building and
    hashing the key; [] when an operand has no structure key yet."""
    keys = {n: tensors[n].__dict__.get("_call_key") for n in sparse}
    if None in keys.values():
        return []
    lines, grads = [], []
    for n, t in enumerate(tensors):
        if n in keys:
            lines += [f"    if type(t{n}) is not SparseTensor: return None",
                      f"    d{n} = t{n}.__dict__",
                      f"    if d{n}.get('_call_key') != {keys[n]}: return None"]
            grads.append(f"t{n}._values.requires_grad or "
                         f"(t{n}._wrapper_grad and t{n}.requires_grad)")
        else:
            lines += [f"    if type(t{n}) is not Tensor or t{n}.layout is not strided or "
                      f"t{n}.dtype is not dtype or not t{n}.is_cpu: return None",
                      f"    s{n} = t{n}.shape",
                      f"    if len(s{n}) != {t.dim()}: return None"]
            grads.append(f"t{n}.requires_grad")
    lines.append(f"    if grad() and ({' or '.join(grads)}): return None")
    return lines
