"""Python entry points for kernels: a C wrapper per kernel that Python calls directly.

A ``ctypes`` call converts every argument through its ``argtypes`` objects: about 1.5 us
for an 8-argument kernel here, a third of what a small SpMV costs in all. A wrapper written
against CPython's ``METH_FASTCALL`` convention takes the Python ints as they are (about
0.15 us), releases the GIL like ctypes does, runs the kernel and returns None.

The wrappers do not include ``Python.h`` (no headers needed, nothing added to the build
time): they reach the few C-API functions they use through pointers that ``bind`` hands
each library once, when it is loaded, taken from ``ctypes.pythonapi``. Where that is not
possible (an interpreter that does not export its C API), ``entries`` answers None and the
caller uses plain ctypes functions; results are the same either way.

Example:
    >>> from sparsetorch.runtime import entry
    >>> print(entry.wrapper("scale", ["i64", "ptr"]).splitlines()[0])
    void* st_py_scale(void* self, void* const* a, ptrdiff_t n) {
"""
from __future__ import annotations

import ctypes

# The C side: pointers into the C API, set by st_py_bind from the table ``_api_table``
# builds (same order).
PRELUDE = """\
/* Python entry points (runtime/entry.py): METH_FASTCALL wrappers, C API bound at load. */
#include <stddef.h>
static long long (*st_py_as_i64)(void*);
static void* (*st_py_as_ptr)(void*);
static void* (*st_py_err_occurred)(void);
static void (*st_py_err_set)(void*, const char*);
static void* (*st_py_save_thread)(void);
static void (*st_py_restore_thread)(void*);
static void (*st_py_incref)(void*);
static void* st_py_none;
static void* st_py_type_error;
void st_py_bind(void* const* api) {
  st_py_as_i64 = (long long (*)(void*))api[0];
  st_py_as_ptr = (void* (*)(void*))api[1];
  st_py_err_occurred = (void* (*)(void))api[2];
  st_py_err_set = (void (*)(void*, const char*))api[3];
  st_py_save_thread = (void* (*)(void))api[4];
  st_py_restore_thread = (void (*)(void*))api[5];
  st_py_incref = (void (*)(void*))api[6];
  st_py_none = api[7];
  st_py_type_error = api[8];
}
"""

_API = ("PyLong_AsLongLong", "PyLong_AsVoidPtr", "PyErr_Occurred", "PyErr_SetString",
        "PyEval_SaveThread", "PyEval_RestoreThread", "Py_IncRef")
_METH_FASTCALL = 0x0080


def wrapper(symbol: str, kinds) -> str:
    """C source of ``st_py_<symbol>``: converts each Python int argument (``kinds``: 'i64'
    or 'ptr' per C parameter of ``symbol``), releases the GIL around the call.

    Example:
        >>> "scale(a0, a1);" in wrapper("scale", ["i64", "ptr"])
        True
    """
    n = len(kinds)
    convert = [f"  {'int64_t' if k == 'i64' else 'void*'} a{i} = "
               f"{'st_py_as_i64' if k == 'i64' else 'st_py_as_ptr'}(a[{i}]);"
               for i, k in enumerate(kinds)]
    args = ", ".join(f"a{i}" for i in range(n))
    return "\n".join([
        f"void* st_py_{symbol}(void* self, void* const* a, ptrdiff_t n) {{",
        "  (void)self;",
        f"  if (n != {n}) {{",
        f'    st_py_err_set(st_py_type_error, "{symbol}() takes {n} integer arguments");',
        "    return NULL;",
        "  }",
        *convert,
        "  if (st_py_err_occurred()) return NULL;",
        "  void* gil = st_py_save_thread();",
        f"  {symbol}({args});",
        "  st_py_restore_thread(gil);",
        "  st_py_incref(st_py_none);",
        "  return st_py_none;",
        "}"])


class _MethodDef(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("meth", ctypes.c_void_p),
                ("flags", ctypes.c_int), ("doc", ctypes.c_char_p)]


_table = None
_defs: list = []     # PyMethodDefs must outlive the functions made from them


def _api_table():
    """The pointer table ``st_py_bind`` takes, or None where the C API is not reachable."""
    global _table
    if _table is None:
        try:
            addrs = [ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
                     for name in _API]
            new = ctypes.pythonapi.PyCFunction_NewEx
        except (AttributeError, OSError):
            _table = False
            return None
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p] * 3
        table = (ctypes.c_void_p * 9)(*addrs, id(None), id(TypeError))
        _table = (table, new)
    return _table or None


def entries(lib: ctypes.CDLL, symbols) -> dict | None:
    """``{symbol: builtin function}`` for a library whose source had ``PRELUDE`` and a
    ``wrapper`` per symbol, or None when the C API cannot be bound here."""
    api = _api_table()
    if api is None:
        return None
    table, new = api
    lib.st_py_bind.argtypes, lib.st_py_bind.restype = [ctypes.c_void_p], None
    lib.st_py_bind(ctypes.addressof(table))
    out = {}
    for symbol in symbols:
        wrapped = ctypes.cast(getattr(lib, f"st_py_{symbol}"), ctypes.c_void_p).value
        d = _MethodDef(symbol.encode(), wrapped, _METH_FASTCALL, None)
        _defs.append(d)
        out[symbol] = new(ctypes.addressof(d), None, None)
    return out
