"""Loading the legacy pickles of the shipped graph data, safely.

The Planetoid ``ind.*`` files and the graph ``.npz`` object arrays are Python-2 pickles that
name the removed ``scipy.sparse.csr`` module. ``_Compat`` maps such names to ``scipy.sparse``
and refuses every class outside a short allow-list (numpy arrays, scipy sparse matrices and
builtin containers), so a tampered file cannot run code.
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
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"sparsetorch data: cannot read {path} ({e}); the file is corrupt "
                         "or not the shipped one, restore it from shared/data") from None


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
        raise ValueError(f"sparsetorch data: cannot read {path} ({e}); the file is corrupt "
                         "or not the shipped one, restore it from shared/data") from None
    return out
