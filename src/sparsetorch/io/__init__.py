"""File I/O: Matrix Market (``.mtx``, ``.mtx.gz``) and DLMC ``.smtx`` patterns.

In: paths to files. Out: validated ``SparseTensor``s (and ``.mtx`` files written atomically).

Example:
    >>> import os, tempfile, torch, sparsetorch as st
    >>> path = os.path.join(tempfile.mkdtemp(), "eye.mtx")
    >>> st.io.write_mtx(path, st.tensor(torch.eye(2)))
    >>> st.io.read_mtx(path).nnz
    2
"""
from .mtx import MtxHeader, read_mtx, read_mtx_header, write_mtx
from .smtx import read_smtx

__all__ = ["read_mtx", "write_mtx", "read_mtx_header", "MtxHeader", "read_smtx"]
