"""DLMC ``.smtx`` sparsity patterns (plain or gzipped).

Layout (Gale et al., SC'20): line 1 ``M, K, nnz``; line 2 the ``M + 1`` CSR row offsets;
line 3 the ``nnz`` column indices (0-based). No values: ``read_smtx`` fills them by a rule
from a seeded generator. Each line is parsed by one C-level call; checks are vectorised.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..formats import SparseTensor
from ..formats.pack import choose_index_dtype
from ..formats.validate import VALUE_DTYPES
from .mtx import MAX_BYTES, check_result_memory, read_bytes, whole_numbers

VALUE_RULES = ("ones", "normal", "uniform")


def read_smtx(path, format="csr", values="ones", seed=0, dtype=torch.float32,
              index_dtype=None, max_bytes=MAX_BYTES, *, blocksize=None) -> SparseTensor:
    """Read a DLMC ``.smtx`` / ``.smtx.gz`` pattern into a ``SparseTensor`` (M x K).

    ``values`` fills the nonzeros: ``"ones"``; ``"normal"`` (standard normal) or
    ``"uniform"`` (uniform on [0, 1)), drawn in float32 from ``torch.Generator`` seeded with
    ``seed`` and cast to ``dtype``, so the same seed always gives the same values; or a
    callable ``values(nnz, generator)`` returning ``nnz`` values. Column indices within a row
    are sorted if the file does not sort them; duplicates are an error. ``format``,
    ``index_dtype`` and ``blocksize`` (BSR's) are as in ``st.tensor``; ``max_bytes`` as in
    ``read_mtx`` (default 4 GiB; None: no limit) bounds the (decompressed) text and the
    result, checked before either is allocated whole.

    Example:
        >>> import os, tempfile, torch, sparsetorch as st
        >>> path = os.path.join(tempfile.mkdtemp(), "w.smtx")
        >>> with open(path, "w") as f:
        ...     _ = f.write("2, 3, 3\\n0 2 3\\n0 2 1\\n")
        >>> st.io.read_smtx(path).to_dense()
        tensor([[1., 0., 1.],
                [0., 1., 0.]])
        >>> A = st.io.read_smtx(path, values="normal", seed=1)
        >>> torch.equal(A.values, st.io.read_smtx(path, values="normal", seed=1).values)
        True
    """
    spath = os.fspath(path)
    if not isinstance(dtype, torch.dtype) or dtype not in VALUE_DTYPES:
        raise TypeError(f"read_smtx({spath!r}): dtype={dtype!r} is not supported; use one of "
                        f"{', '.join(map(str, VALUE_DTYPES))}")
    data = read_bytes(path, "read_smtx", max_bytes)
    parts = data.split(b"\n", 3)
    parts += [b""] * (4 - len(parts))
    head, line2, line3, rest = parts
    m, k, nnz = _header(head, spath)
    if rest.strip():
        raise ValueError(f"read_smtx: {spath!r} has text after line 3 ({rest.strip()[:40]!r}); "
                         "a .smtx file has exactly three lines")
    offsets = _ints(line2, spath, 2, "row offsets")
    cols = _ints(line3, spath, 3, "column indices")
    _check(spath, m, k, nnz, offsets, cols)
    # (the parsed arrays and the row numbers, int64, then the CSR copies)
    check_result_memory("read_smtx", spath, (m, k), nnz, format, dtype, blocksize,
                        8 * (2 * nnz + m), max_bytes)
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(offsets))
    same_row = rows[1:] == rows[:-1]
    if (same_row & (np.diff(cols) < 0)).any():   # (sorted first: a repeat may lie apart)
        cols = cols[np.lexsort((cols, rows))]
    repeated = same_row & (np.diff(cols) == 0)
    if repeated.any():
        p = int(np.argmax(repeated))
        raise ValueError(f"read_smtx: {spath!r} row {rows[p]} lists column {cols[p]} twice; a "
                         "pattern has no duplicates")
    idx = choose_index_dtype((m, k), nnz, index_dtype)
    vals = _fill(values, nnz, seed, dtype, spath)
    arrays = {"pos1": torch.from_numpy(offsets).to(idx), "crd1": torch.from_numpy(cols).to(idx)}
    out = SparseTensor.from_levels((m, k), "csr", arrays, vals)
    return out.asformat(format, index_dtype=index_dtype, blocksize=blocksize)


def _header(line: bytes, path):
    numbers = whole_numbers(line.replace(b",", b" ").split())
    if len(numbers) != 3:
        raise ValueError(f"read_smtx: {path!r} line 1 is {line[:60]!r}; a DLMC .smtx file "
                         "starts with 'rows, cols, nnz' (three non-negative integers)")
    return numbers


def _ints(line: bytes, path, line_no, what) -> np.ndarray:
    if not line or line.isspace():
        return np.empty(0, np.int64)
    try:
        ints = np.fromstring(line, dtype=np.int64, sep=" ")
    except ValueError:
        bad = next((w for w in line.split() if not w.lstrip(b"-").isdigit()), line[:40])
        raise ValueError(f"read_smtx: {path!r} line {line_no} ({what}) contains {bad[:40]!r}, "
                         "which is not an integer; the file is corrupt") from None
    # numpy saturates a number past int64 at its limits (scipy raises): no offset or index
    # of a real matrix is that large, so a limit means the text held one too big
    limits = (ints == np.iinfo(np.int64).max) | (ints == np.iinfo(np.int64).min)
    if limits.any():
        p = int(np.argmax(limits))
        word = line.split()[p] if p < len(line.split()) else b"?"
        raise ValueError(f"read_smtx: {path!r} line {line_no} ({what}) holds {word[:40]!r} at "
                         f"position {p}, beyond the int64 range; the file is corrupt")
    return ints


def _check(path, m, k, nnz, offsets, cols) -> None:
    where = f"read_smtx: {path!r}"
    if offsets.size != m + 1:
        raise ValueError(f"{where} line 2 has {offsets.size} row offsets; the header "
                         f"({m} rows) needs {m + 1}")
    if cols.size != nnz:
        raise ValueError(f"{where} line 3 has {cols.size} column indices; the header says "
                         f"nnz={nnz}")
    if offsets[0] != 0 or offsets[-1] != nnz:
        raise ValueError(f"{where} row offsets run from {offsets[0]} to {offsets[-1]}; they "
                         f"must start at 0 and end at nnz={nnz}")
    drop = np.diff(offsets) < 0
    if drop.any():
        r = int(np.argmax(drop))
        raise ValueError(f"{where} row offsets decrease at row {r} ({offsets[r]} -> "
                         f"{offsets[r + 1]}); they must be non-decreasing")
    out = (cols < 0) | (cols >= k)
    if out.any():
        p = int(np.argmax(out))
        raise ValueError(f"{where} column index {cols[p]} at position {p} is outside "
                         f"[0, {k}) for a matrix with {k} columns")


def _fill(rule, nnz, seed, dtype, path) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(seed))
    if callable(rule):
        vals = torch.as_tensor(rule(nnz, gen))
        if vals.shape != (nnz,):
            raise ValueError(f"read_smtx({path!r}): values callable returned shape "
                             f"{tuple(vals.shape)}; it must return {nnz} values (one per "
                             "nonzero) as a 1-D tensor")
        return vals.to(dtype)
    if rule == "ones":
        return torch.ones(nnz, dtype=dtype)
    if rule in ("normal", "uniform"):
        if not dtype.is_floating_point:
            raise TypeError(f"read_smtx({path!r}): values={rule!r} needs a floating dtype, "
                            f"got {dtype}; use values='ones' for integers")
        draw = torch.randn if rule == "normal" else torch.rand
        return draw(nnz, generator=gen, dtype=torch.float32).to(dtype)
    raise ValueError(f"read_smtx({path!r}): values={rule!r} is not a rule; use one of "
                     f"{', '.join(map(repr, VALUE_RULES))} or a callable(nnz, generator)")
