"""Loading the legacy pickles of the shipped graph data, safely.

The Planetoid ``ind.*`` files and the graph ``.npz`` object arrays are Python-2 pickles that
name the removed ``scipy.sparse.csr`` module. ``_Compat`` maps such names to ``scipy.sparse``
and refuses every class outside a short allow-list (numpy arrays, scipy sparse matrices and
builtin containers), so a tampered file cannot run code. Unpickling fills an object's
attributes without the constructor's checks, so a tampered matrix could still carry arrays
that crash scipy's C code: ``sparse_matrix`` and ``numeric_array`` check what came out
(types, shapes, dtypes, index ranges) before anything else touches it.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
from numpy.lib import format as npf

_ALLOWED = {
    ("collections", "defaultdict"), ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    *((b, n) for b in ("builtins", "__builtin__")
      for n in ("list", "dict", "set", "tuple", "frozenset", "int", "float", "str", "bytes",
                "object")),
}
_SPARSE = {"csr_matrix", "csc_matrix", "coo_matrix", "csr_array", "csc_array", "coo_array"}
CORRUPT_HINT = "the file is corrupt or not the shipped one, restore it from shared/data"


class _Compat(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("scipy.sparse"):
            if name not in _SPARSE:
                raise pickle.UnpicklingError(f"refusing to load scipy.sparse.{name}")
            module = "scipy.sparse"
        elif (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a numpy "
                                         "array, scipy sparse matrix or builtin container")
        return super().find_class(module, name)


def load_pickle(path: Path):
    """Unpickle one legacy (Python 2, latin-1) pickle file with the allow-list."""
    try:
        with open(path, "rb") as f:
            return _Compat(f, encoding="latin1").load()
    except OSError:
        raise
    except Exception as e:   # (a damaged pickle fails in any way: a TypeError calling an
        # int, an AttributeError on a set, a MemoryError from a huge length)
        raise ValueError(f"sparsetorch data: cannot read {path} ({type(e).__name__}: {e}); "
                         f"{CORRUPT_HINT}") from None


def load_npz(path: Path, keys) -> dict:
    """The arrays ``keys`` of an ``.npz`` whose object arrays are legacy pickles."""
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            for key in keys:
                if key + ".npy" not in names:
                    raise ValueError(f"it has no array {key!r} (has "
                                     f"{sorted(n[:-4] for n in names)})")
                with z.open(key + ".npy") as f:
                    major, _ = npf.read_magic(f)
                    read = npf.read_array_header_1_0 if major == 1 else npf.read_array_header_2_0
                    shape, fortran, dtype = read(f)
                    if dtype.hasobject:
                        out[key] = _Compat(f, encoding="latin1").load()
                    else:
                        out[key] = np.frombuffer(f.read(), dtype).reshape(
                            shape, order="F" if fortran else "C")
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"sparsetorch data: cannot read {path} ({e}); {CORRUPT_HINT}") from None
    return out


def numeric_array(obj, what: str, ndim: int) -> np.ndarray:
    """``obj`` if it is a plain numpy array of numbers (bool, integer or float) with ``ndim``
    dimensions, else ``ValueError`` naming ``what``.

    Example:
        >>> numeric_array(np.zeros((2, 3)), "ind.cora.y", 2).shape
        (2, 3)
    """
    if type(obj) is not np.ndarray:
        raise ValueError(f"{what} holds a {type(obj).__name__}, expected a numpy array; "
                         f"{CORRUPT_HINT}")
    if obj.dtype.kind not in "biuf" or obj.ndim != ndim:
        raise ValueError(f"{what} holds a {obj.ndim}-D {obj.dtype} array, expected a {ndim}-D "
                         f"array of numbers; {CORRUPT_HINT}")
    return obj


def sparse_matrix(obj, what: str):
    """A fresh ``scipy.sparse`` CSR matrix with ``obj``'s entries, after checking ``obj``'s
    raw attributes (never calling its methods): a csr/csc/coo matrix whose shape is two
    non-negative ints, with 1-D integer index arrays in range, a numeric data array of
    matching length, and a compressed pointer that starts at 0, never decreases and ends
    at the entry count.

    Example:
        >>> import scipy.sparse as sp
        >>> sparse_matrix(sp.csr_matrix(np.eye(2)), "ind.cora.x").nnz
        2
    """
    import scipy.sparse as sp

    kind = type(obj).__name__
    attrs = getattr(obj, "__dict__", {})
    shape = attrs.get("_shape")
    if (type(obj).__module__.split(".")[0] != "scipy" or kind not in _SPARSE
            or not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(s, (int, np.integer)) and 0 <= s < 2**62 for s in shape)):
        raise ValueError(f"{what} holds a {kind} of shape {shape!r}, expected a scipy "
                         f"csr/csc/coo matrix; {CORRUPT_HINT}")
    m, n = (int(s) for s in shape)
    names = ("row", "col", "data") if kind.startswith("coo") else ("indptr", "indices", "data")
    arrays = {}
    for name in names:
        a = attrs.get(name)
        kinds = "biuf" if name == "data" else "iu"
        if type(a) is not np.ndarray or a.ndim != 1 or a.dtype.kind not in kinds:
            got = f"a {a.ndim}-D {a.dtype} array" if type(a) is np.ndarray else type(a).__name__
            raise ValueError(f"{what}: the matrix's {name} is {got}, expected a 1-D "
                             f"{'numeric' if name == 'data' else 'integer'} array; {CORRUPT_HINT}")
        arrays[name] = a
    nnz = len(arrays["data"])
    if kind.startswith("coo"):
        row, col = arrays["row"], arrays["col"]
        _check_range(row, m, nnz, "row", what)
        _check_range(col, n, nnz, "col", what)
        return sp.csr_matrix(sp.coo_matrix((arrays["data"], (row, col)), shape=(m, n)))
    major, minor = (m, n) if kind.startswith("csr") else (n, m)
    ptr, idx = arrays["indptr"], arrays["indices"]
    if (len(ptr) != major + 1 or ptr[0] != 0 or ptr[-1] != nnz
            or bool((ptr[1:] < ptr[:-1]).any())):
        raise ValueError(f"{what}: the matrix's indptr (length {len(ptr)}, from "
                         f"{ptr[:1].tolist()} to {ptr[-1:].tolist()}) is not a pointer over "
                         f"{major} rows and {nnz} entries; {CORRUPT_HINT}")
    _check_range(idx, minor, nnz, "indices", what)
    make = sp.csr_matrix if kind.startswith("csr") else sp.csc_matrix
    return sp.csr_matrix(make((arrays["data"], idx, ptr), shape=(m, n)))


def _check_range(a: np.ndarray, size: int, nnz: int, name: str, what: str) -> None:
    if len(a) != nnz or (nnz and (int(a.min()) < 0 or int(a.max()) >= size)):
        raise ValueError(f"{what}: the matrix's {name} ({len(a)} values) are not {nnz} "
                         f"indices in [0, {size}); {CORRUPT_HINT}")
