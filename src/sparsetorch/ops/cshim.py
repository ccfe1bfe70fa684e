"""Guarded call shims in C: ``shim.py``'s guarded shim for a dense result, run by one C
function instead of Python bytecode.

A repeated small call (SpMV or SpMM on a few thousand stored entries) spends as much time
checking and marshalling its operands as in its kernel. On a tiny SpMM (4.1 us through the
guarded Python shim here) the guard takes 0.8 us and reading shapes and pointers about as
much, beside 1.4 us allocating the result and 0.5 us in the kernel; the torch getters the
checks call are cheap, the bytecode around them is not. ``dispatcher()`` builds one C
function, once per machine (cached like the kernels), that does the same steps from a
*plan*: a small integer table written per memoised call signature by ``make``, saying which
operand is sparse, where each index extent comes from, which extents must agree, how the
work estimate is formed, the result's dimensions and the kernel's address. Measured with
``benchmarks/kernels.py`` and ``benchmarks/compiler.py``, C against Python shims, two runs
each: SpMM (N = 128, 64 matrices) 2.16-2.20x torch.sparse (was 2.00-2.06x) and 2.65-2.75x
scipy (was 2.38-2.40x); SpMV median 0.93-0.95x torch.sparse (was 0.90x).

The C function is a guard plus the happy path, nothing else. It answers None (not this
signature) exactly where the Python guard would, for the operand tuple ``st.einsum``
passes (any other sequence: None, and ``st.einsum`` takes its slower path); anything it
does not handle itself (a non-contiguous dense operand, a SparseTensor whose pointers are
not cached yet, sizes that disagree, any error of a C-API call) is handed to the Python
shim, which handles or raises as before, so results and errors are the Python shim's in
every case.

Like ``runtime/entry.py`` it includes no Python header: it reaches the C API through
pointers bound once at load (``ctypes.pythonapi``), and answers None from ``make`` where
that is not possible.

Example:
    >>> import torch, sparsetorch as st
    >>> from sparsetorch.ops import execute
    >>> A = st.tensor(torch.eye(3), format="csr")
    >>> _ = st.einsum("ij,jk->ik", A, torch.ones(3, 2))
    >>> calls = execute.fast_calls("ij,jk->ik")   # (one per signature seen; others: None)
    >>> next(r for r in (c((A, torch.full((3, 2), 2.0))) for c in calls) if r is not None)
    tensor([[2., 2.],
            [2., 2.],
            [2., 2.]])
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

from .. import runtime
from ..formats.tensor import SparseTensor
from .balance import chunked_work, ranges_per_thread

_MAX_ARGS = 24   # kernel parameters the C side passes (MTTKRP on CSF: 14); more: Python
_MAX_OPERANDS = 8
_MAX_EXTENTS = 16

# The C API the dispatcher calls: (function, its name in the C source, its pointer type);
# ``st_fast_bind`` takes their addresses in this order.
_API = (("PyObject_GetAttr", "GetAttr", "O (*)(O, O)"),
        ("PyDict_GetItemWithError", "DictGet", "O (*)(O, O)"),   # borrowed; NULL: absent
        ("PyLong_AsLongLong", "AsI64", "long long (*)(O)"),
        ("PyLong_AsVoidPtr", "AsPtr", "void* (*)(O)"),
        ("PyLong_FromLongLong", "FromI64", "O (*)(long long)"),
        ("PyTuple_GetItem", "TupleItem", "O (*)(O, ptrdiff_t)"),     # borrowed
        ("PyTuple_Size", "TupleSize", "ptrdiff_t (*)(O)"),
        ("PyObject_CallNoArgs", "Call0", "O (*)(O)"),
        ("PyObject_Vectorcall", "Vectorcall", "O (*)(O, O const*, size_t, O)"),
        ("PyObject_VectorcallMethod", "VectorcallMethod", "O (*)(O, O const*, size_t, O)"),
        ("PyObject_Type", "TypeOf", "O (*)(O)"),
        ("Py_DecRef", "DecRef", "void (*)(O)"),
        ("Py_IncRef", "IncRef", "void (*)(O)"),
        ("PyErr_Occurred", "ErrOccurred", "O (*)(void)"),
        ("PyErr_Clear", "ErrClear", "void (*)(void)"),
        ("PyEval_SaveThread", "SaveThread", "void* (*)(void)"),
        ("PyEval_RestoreThread", "RestoreThread", "void (*)(void*)"))
# Attribute and key names the dispatcher reads, interned; ``s_<name>`` in the C source.
_NAMES = ("__dict__", "_call_key", "_raw", "_size", "_values", "layout", "dtype", "is_cpu",
          "shape", "requires_grad", "_wrapper_grad", "is_contiguous", "data_ptr",
          "new_empty", "numel")
# Plan header fields (int64 each; upper case in C), then the sections ``make`` writes.
_HEADER = ("n_ops", "n_ext", "n_agree", "n_out", "parallel_work", "balanced", "kernel",
           "lanes", "vector_index", "entry_work", "n_dense_only", "like", "chunked_work",
           "max_work")
# The items of the tuple each C shim is bound to (``self`` in C, ``P_<ITEM>``), in order.
_STATE = ("plan", "keep", "sparse", "tensor", "strided", "dtype", "grad", "threads", "ranges",
          "shim")


def _bindings() -> str:
    """C declarations of the API pointers and names, ``st_fast_bind`` that sets them, and
    the indices of the plan header and state tuple: all from the tables above."""
    names = ["s_" + n.strip("_") for n in _NAMES]
    return "\n".join([
        *(f"static {ctype.replace('(*)', f'(*{var})', 1)};" for _, var, ctype in _API),
        f"static O py_true, py_none, {', '.join(names)};",
        "void st_fast_bind(void* const* f, O const* names, O t, O none) {",
        *(f"  {var} = ({ctype})f[{i}];" for i, (_, var, ctype) in enumerate(_API)),
        *(f"  {var} = names[{i}];" for i, var in enumerate(names)),
        "  py_true = t; py_none = none;",
        "}",
        f"enum {{ {', '.join(h.upper() for h in _HEADER)}, HEADER }};",
        f"enum {{ {', '.join('P_' + x.upper() for x in _STATE)} }};"])


def _kernel_call_cases() -> str:
    """``case n:`` lines calling the kernel with its ``n`` arguments. Every parameter of a
    generated kernel is an ``int64_t`` or a pointer, which the C calling conventions of
    x86-64 and AArch64 pass alike, so ``int64_t`` stands in for both."""
    lines = []
    for n in range(1, _MAX_ARGS + 1):
        params = ", ".join(["int64_t"] * n)
        args = ", ".join(f"v[{i}]" for i in range(n))
        lines.append(f"    case {n}: ((void (*)({params}))fn)({args}); break;")
    return "\n".join(lines)


_SOURCE = """\
/* sparsetorch guarded call shims in C (ops/cshim.py). No Python header: the C API is
   reached through pointers that st_fast_bind receives once. */
#include <stddef.h>
#include <stdint.h>
typedef void* O;   /* PyObject* */
%(bindings)s

typedef struct { O refs[128]; int n; } Owned;   /* new references to drop */
static O own(Owned* o, O x) { if (x) o->refs[o->n++] = x; return x; }
static void release(Owned* o) { while (o->n) DecRef(o->refs[--o->n]); }
/* ``getattr(x, name) is want``, the new reference kept for release */
static int attr_is(Owned* o, O x, O name, O want) { return own(o, GetAttr(x, name)) == want; }
static O method0(Owned* o, O x, O name) { return own(o, VectorcallMethod(name, &x, 1, NULL)); }

static O answer_none(Owned* o) {
  release(o);
  if (ErrOccurred()) ErrClear();
  IncRef(py_none);
  return py_none;
}
/* Not a case for this function: the Python shim does the same call its own way. */
static O python_shim(Owned* o, O self, O ops) {
  release(o);
  if (ErrOccurred()) ErrClear();
  return Vectorcall(TupleItem(self, P_SHIM), &ops, 1, NULL);
}

static void call_kernel(void* fn, const int64_t* v, int64_t n) {
  switch (n) {
%(cases)s
  }
}

O st_fast_call(O self, O const* a, ptrdiff_t nargs) {
  Owned o; o.n = 0;
  if (nargs != 1) return answer_none(&o);
  O ops = a[0];
  const int64_t* plan = (const int64_t*)AsPtr(TupleItem(self, P_PLAN));
  const int64_t n_ops = plan[N_OPS];
  if (TupleSize(ops) != n_ops) return answer_none(&o);   /* also: not a tuple */
  const int64_t* op = plan + HEADER;          /* per operand: kind, key or rank, arrays */
  const int64_t* src = op + 3 * n_ops;        /* per extent: operand, dimension */
  const int64_t* agree = src + 2 * plan[N_EXT];          /* operand, dimension, extent */
  const int64_t* out_ext = agree + 3 * plan[N_AGREE];
  const int64_t* dense_only = out_ext + plan[N_OUT];
  const int64_t* work_vars = dense_only + plan[N_DENSE_ONLY];  /* per operand: n, vars */
  O t[%(max_ops)d], dict[%(max_ops)d], shape[%(max_ops)d];
  O sparse_type = TupleItem(self, P_SPARSE), tensor_type = TupleItem(self, P_TENSOR);
  /* The guard: the call signature this shim was made for (shim.py's ``_guard``). */
  for (int64_t n = 0; n < n_ops; n++) {
    t[n] = TupleItem(ops, n);
    O type = TypeOf(t[n]);
    DecRef(type);    /* the operand keeps its type alive */
    if (op[3 * n] == 1) {
      if (type != sparse_type) return answer_none(&o);
      dict[n] = own(&o, GetAttr(t[n], s_dict));
      O key = dict[n] ? DictGet(dict[n], s_call_key) : NULL;
      if (!key || AsI64(key) != op[3 * n + 1]) return answer_none(&o);
    } else {
      if (type != tensor_type || !attr_is(&o, t[n], s_layout, TupleItem(self, P_STRIDED)) ||
          !attr_is(&o, t[n], s_dtype, TupleItem(self, P_DTYPE)) ||
          !attr_is(&o, t[n], s_is_cpu, py_true)) return answer_none(&o);
      shape[n] = own(&o, GetAttr(t[n], s_shape));
      if (!shape[n] || TupleSize(shape[n]) != op[3 * n + 1]) return answer_none(&o);
    }
  }
  if (own(&o, Call0(TupleItem(self, P_GRAD))) == py_true) {   /* autograd records it */
    for (int64_t n = 0; n < n_ops; n++) {
      if (op[3 * n] == 1) {
        O values = DictGet(dict[n], s_values);
        if (!values || attr_is(&o, values, s_requires_grad, py_true)) return answer_none(&o);
        if (attr_is(&o, t[n], s_wrapper_grad, py_true) &&
            attr_is(&o, t[n], s_requires_grad, py_true)) return answer_none(&o);
      } else if (attr_is(&o, t[n], s_requires_grad, py_true)) {
        return answer_none(&o);
      }
    }
  }
  if (ErrOccurred()) return answer_none(&o);
  /* The call: shapes, extents, pointers; the Python shim takes anything unusual. */
  int64_t v[%(max_args)d], nv = 0, ext[%(max_ext)d], stored[%(max_ops)d];
  O raw[%(max_ops)d];
  for (int64_t n = 0; n < n_ops; n++) {
    if (op[3 * n] == 1) {
      raw[n] = DictGet(dict[n], s_raw);
      shape[n] = DictGet(dict[n], s_size);
      O values = DictGet(dict[n], s_values);
      if (!raw[n] || !shape[n] || !values) return python_shim(&o, self, ops);
      stored[n] = AsI64(TupleItem(raw[n], 0));
      /* values given other storage, or restrided in place (as_strided_), since ``raw``
         kept its pointers: Python reads them again, checked (shim.py) */
      if (AsI64(method0(&o, values, s_data_ptr)) != AsI64(TupleItem(raw[n], 2)) ||
          AsI64(method0(&o, values, s_numel)) != stored[n] ||
          method0(&o, values, s_is_contiguous) != py_true) return python_shim(&o, self, ops);
    } else if (method0(&o, t[n], s_is_contiguous) != py_true) {
      return python_shim(&o, self, ops);
    }
  }
  for (int64_t i = 0; i < plan[N_EXT]; i++)
    ext[i] = AsI64(TupleItem(shape[src[2 * i]], src[2 * i + 1]));
  for (int64_t i = 0; i < plan[N_AGREE]; i++)
    if (AsI64(TupleItem(shape[agree[3 * i]], agree[3 * i + 1])) != ext[agree[3 * i + 2]])
      return python_shim(&o, self, ops);    /* it raises the size error */
  if (ErrOccurred()) return python_shim(&o, self, ops);
  /* Work estimate, as ``_Prepared.work``: dense operands' sizes in vector steps, plus
     stored entries times the extents only dense operands index. */
  const int64_t lanes = plan[LANES];
  int64_t per_entry = plan[ENTRY_WORK], work = 0;
  for (int64_t i = 0; i < plan[N_DENSE_ONLY]; i++) {
    const int64_t e = ext[dense_only[i]];
    per_entry *= dense_only[i] == plan[VECTOR_INDEX] ? (e + lanes - 1) / lanes : e;
  }
  const int64_t* w = work_vars;
  for (int64_t n = 0; n < n_ops; n++) {
    int64_t size = 1;
    for (int64_t k = 1; k <= w[0]; k++) size *= ext[w[k]];
    work += op[3 * n] == 1 ? stored[n] * per_entry : size / lanes;
    w += 1 + w[0];
  }
  if (work >= plan[MAX_WORK]) return python_shim(&o, self, ops);   /* (not this kernel's) */
  int64_t nt = 1, nc = 1;
  if (work >= plan[PARALLEL_WORK]) {
    nt = AsI64(own(&o, Call0(TupleItem(self, P_THREADS))));
    if (plan[BALANCED] >= 0 && work >= plan[CHUNKED_WORK]) {   /* (below: one range) */
      O args[2] = {t[plan[BALANCED]], own(&o, FromI64(work))};
      nc = AsI64(own(&o, Vectorcall(TupleItem(self, P_RANGES), args, 2, NULL)));
    }
  }
  v[nv++] = nt;
  if (plan[BALANCED] >= 0) v[nv++] = nc;
  for (int64_t i = 0; i < plan[N_EXT]; i++) v[nv++] = ext[i];
  for (int64_t n = 0; n < n_ops; n++) {
    if (op[3 * n] == 1) {
      O ptrs = TupleItem(raw[n], 1);
      for (int64_t k = 0; k < op[3 * n + 2]; k++) v[nv++] = AsI64(TupleItem(ptrs, k));
    } else {
      v[nv++] = AsI64(method0(&o, t[n], s_data_ptr));
    }
  }
  /* The result: uninitialised values like the first sparse operand's (shim.py). */
  O args[1 + %(max_ext)d];
  args[0] = DictGet(dict[plan[LIKE]], s_values);
  for (int64_t i = 0; i < plan[N_OUT]; i++) args[1 + i] = own(&o, FromI64(ext[out_ext[i]]));
  O out = args[0] ? VectorcallMethod(s_new_empty, args, 1 + plan[N_OUT], NULL) : NULL;
  if (!out) return python_shim(&o, self, ops);
  v[nv++] = AsI64(method0(&o, out, s_data_ptr));
  if (ErrOccurred()) { DecRef(out); return python_shim(&o, self, ops); }
  void* gil = SaveThread();
  call_kernel((void*)plan[KERNEL], v, nv);
  RestoreThread(gil);
  release(&o);
  return out;
}
""" % {"bindings": _bindings(), "cases": _kernel_call_cases(), "max_ops": _MAX_OPERANDS,
       "max_args": _MAX_ARGS, "max_ext": _MAX_EXTENTS}


class _MethodDef(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("meth", ctypes.c_void_p),
                ("flags", ctypes.c_int), ("doc", ctypes.c_char_p)]


_METH_FASTCALL = 0x0080
_state: dict = {}     # "def" -> (method def, PyCFunction_NewEx), or "off" -> reason
_lock = threading.Lock()   # one build and one method def, which its functions point into


def _new_lock_in_child() -> None:
    global _lock   # (a forked child: a lock another thread held at the fork stays held)
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def prefetch() -> None:
    """Start building the dispatcher in the background while a kernel builds (a cold cache
    needs both for the first call; building one after the other doubled the wait)."""
    if not _state:
        runtime.prefetch(_SOURCE)


def dispatcher():
    """``(method def, PyCFunction_NewEx)`` of the built C dispatcher, or None where it
    cannot be had (no C API through ctypes, or no compiler: the Python shims serve)."""
    if "def" in _state or "off" in _state:
        return _state.get("def")
    with _lock:
        if "def" in _state or "off" in _state:
            return _state.get("def")
        return _build()


def _build():
    try:
        api = [ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
               for name, _, _ in _API]
        # its own function object: ``entry.py`` gives the shared one other argument types
        new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.py_object,
                                ctypes.c_void_p)(("PyCFunction_NewEx", ctypes.pythonapi))
        lib = runtime.load_library(_SOURCE)
    except (AttributeError, OSError, runtime.KernelBuildError) as e:
        _state["off"] = str(e)
        return None
    names = tuple(sys.intern(n) for n in _NAMES)
    table = (ctypes.c_void_p * len(api))(*api)
    name_ptrs = (ctypes.c_void_p * len(names))(*(id(n) for n in names))
    lib.st_fast_bind.argtypes = [ctypes.c_void_p] * 4
    lib.st_fast_bind.restype = None
    lib.st_fast_bind(ctypes.addressof(table), ctypes.addressof(name_ptrs), id(True), id(None))
    method = _MethodDef(b"guarded_call", ctypes.cast(lib.st_fast_call, ctypes.c_void_p).value,
                        _METH_FASTCALL, None)
    # the names, tables and method def must outlive every function made from them
    _state["keep"] = (lib, names, table, name_ptrs)
    _state["def"] = (method, new)
    return _state["def"]


def make(prepared, tensors, sparse: list, parallel_work: int, python_shim, max_work=None):
    """The C twin of ``python_shim`` (a guarded shim from ``shim.make_shim``) for a call
    with a dense result, or None where it does not apply (no sparse operand, a scalar
    result, a kernel without a raw address, too many operands) or cannot be built. Calls
    of ``max_work`` or more (None: no limit) are handed to ``python_shim``."""
    kernel = prepared.kernel
    address = runtime.kernel_address(prepared.fns[0])
    keys = {n: tensors[n].__dict__.get("_call_key") for n in sparse}
    n_ops, n_ext = len(tensors), len(prepared.sources)
    if (kernel.output.kind != "dense" or not sparse or not prepared.out_index
            or address is None or None in keys.values() or n_ops > _MAX_OPERANDS
            or n_ext > _MAX_EXTENTS or dispatcher() is None):
        return None
    first = {v: i for i, v in enumerate(prepared.var_order)}
    indices = {acc.operand: acc.indices for acc in kernel.assignment.expr.accesses()}
    arrays = {n: len(tensors[n]._array_names) + 1 for n in sparse}
    if (1 + (prepared.balanced is not None) + n_ext +
            sum(arrays.get(n, 1) for n in range(n_ops)) + 1) > _MAX_ARGS:
        return None
    header = {"n_ops": n_ops, "n_ext": n_ext, "n_agree": len(prepared.agree),
              "n_out": len(prepared.out_index), "parallel_work": parallel_work,
              "balanced": -1 if prepared.balanced is None else prepared.balanced,
              "kernel": address, "lanes": prepared.lanes,
              "vector_index": -1 if prepared.vector_index is None else prepared.vector_index,
              "entry_work": prepared.entry_work, "n_dense_only": len(prepared.dense_only),
              "like": sparse[0], "chunked_work": chunked_work(),
              "max_work": (1 << 62) if max_work is None else max_work}
    plan = [header[name] for name in _HEADER]
    for n, t in enumerate(tensors):   # kind, call key or rank, arrays passed
        plan += [1, keys[n], arrays[n]] if n in keys else [0, t.dim(), 1]
    for n, d in prepared.sources:
        plan += [n, d]
    for v, _, (n2, d2) in prepared.agree:
        plan += [n2, d2, first[v]]
    plan += list(prepared.out_index) + list(prepared.dense_only)
    for n in range(n_ops):   # the variables of a dense operand's size (unused for sparse)
        used = [first[v] for v in indices[n]] if n not in keys else []
        plan += [len(used), *used]
    buffer = (ctypes.c_int64 * len(plan))(*plan)
    method, new = _state["def"]
    state = {"plan": ctypes.addressof(buffer), "keep": buffer, "sparse": SparseTensor,
             "tensor": torch.Tensor, "strided": torch.strided, "dtype": prepared.dtype,
             "grad": torch.is_grad_enabled, "threads": torch.get_num_threads,
             "ranges": ranges_per_thread, "shim": python_shim}
    return new(ctypes.addressof(method), tuple(state[item] for item in _STATE), None)
