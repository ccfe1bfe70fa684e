"""Matrix Market files (``.mtx`` and ``.mtx.gz``): read any real, integer or pattern matrix,
write real or integer ones.

Reading parses the whole body with one C-level call (``np.fromstring`` over the file's bytes),
never a Python loop per line; only a malformed file takes a slower pass that finds the first
bad line for the error message. Writing formats 64k entries per ``%`` call and replaces the
target atomically (temp file in the same folder, then ``os.replace``), so a reader never sees
half a file.
"""
from __future__ import annotations

import gzip
import itertools
import numbers
import os
import zlib
from typing import NamedTuple

import numpy as np
import torch

from .._files import atomic_write as _atomic_write
from ..formats import SparseTensor
from ..formats import tensor as _tensor
from ..formats.format import as_format
from ..formats.memory import stored_bytes
from ..formats.pack import choose_index_dtype
from ..formats.validate import VALUE_DTYPES

_GZIP_MAGIC = b"\x1f\x8b"
_FIELDS = ("real", "integer", "pattern")
_SYMMETRIES = ("general", "symmetric", "skew-symmetric")
_DEFAULT_DTYPE = {"real": torch.float64, "integer": torch.int64, "pattern": torch.float32}
_CHUNK = 1 << 16
_GZIP_STEP = 1 << 20
_INT64 = np.iinfo(np.int64)
MAX_BYTES = 4 << 30   # read_mtx's default memory limit (max_bytes)


class MtxHeader(NamedTuple):
    """What a Matrix Market file's banner and size line say (``st.io.read_mtx_header``)."""

    path: str
    layout: str            # 'coordinate' or 'array'
    field: str             # 'real', 'integer', 'pattern' or 'complex'
    symmetry: str          # 'general', 'symmetric', 'skew-symmetric' or 'hermitian'
    shape: tuple           # (rows, cols)
    entries: int           # stored entries (coordinate) or stored values (array)


# -- reading ---------------------------------------------------------------------------------
def read_bytes(path, who: str, max_bytes=None) -> bytes:
    """The file's bytes, gunzipped when it starts with the gzip magic (any extension).

    gzip is decompressed in 1 MiB steps, so a file that inflates past ``max_bytes`` (a
    "zip bomb") is refused once that much has been read, not after inflating it whole."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or
                                  not isinstance(max_bytes, numbers.Integral) or max_bytes < 0):
        raise TypeError(f"{who}: max_bytes must be an int >= 0 (a byte count) or None (no "
                        f"limit), got {max_bytes!r}")
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: no file at {path!r}; check the path (relative paths "
                                f"start from {os.getcwd()!r})") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{who}: {path!r} is a folder; pass the path of a file "
                                "inside it") from None
    with f:
        gz = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        if not gz:
            _check_size(os.fstat(f.fileno()).st_size, max_bytes, who, path, "is")
            return f.read()
        chunks, total = [], 0
        try:
            with gzip.GzipFile(fileobj=f, mode="rb") as z:
                while chunk := z.read(_GZIP_STEP):
                    total += len(chunk)
                    _check_size(total, max_bytes, who, path, "decompresses to over")
                    chunks.append(chunk)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{who}: {path!r} looks gzipped but cannot be decompressed "
                             f"({e}); the file is truncated or corrupt, fetch it again") from None
    return b"".join(chunks)


def _check_size(nbytes: int, max_bytes, who: str, path: str, verb: str) -> None:
    if max_bytes is not None and nbytes > max_bytes:
        raise ValueError(f"{who}: {path!r} {verb} {_gib(nbytes)}, more than max_bytes="
                         f"{max_bytes} ({_gib(max_bytes)}); if you trust the file and have the "
                         "memory, pass a larger max_bytes (or max_bytes=None for no limit)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def read_mtx_header(path) -> MtxHeader:
    """Read only the banner and size line of a Matrix Market file (cheap; no body parse).

    Complex and Hermitian files are reported, not rejected, so callers can skip them.

    Example:
        >>> import os, tempfile, torch, sparsetorch as st
        >>> path = os.path.join(tempfile.mkdtemp(), "a.mtx")
        >>> st.io.write_mtx(path, st.tensor(torch.eye(3)))
        >>> h = st.io.read_mtx_header(path)
        >>> h.layout, h.field, h.symmetry, h.shape, h.entries
        ('coordinate', 'real', 'general', (3, 3), 3)
    """
    header, _, _ = _parse_header(read_bytes(path, "read_mtx_header", MAX_BYTES),
                                 os.fspath(path))
    return header


def read_mtx(path, format="csr", dtype=None, index_dtype=None,
             max_bytes=MAX_BYTES, *, blocksize=None) -> SparseTensor:
    """Read a Matrix Market file (``.mtx`` or gzipped ``.mtx.gz``) into a ``SparseTensor``.

    Supported: ``coordinate`` files with field ``real``, ``integer`` or ``pattern`` (every
    listed entry becomes 1) and symmetry ``general``, ``symmetric`` (off-diagonal entries are
    mirrored) or ``skew-symmetric`` (mirrored with the sign flipped); dense ``array`` files
    (their zeros are dropped). Duplicate entries are summed, explicit zeros in coordinate files
    are kept, as ``scipy.io.mmread(path).tocsr()`` does. Complex and Hermitian files raise
    ``TypeError``.

    ``dtype`` defaults to the lossless choice: ``float64`` for real files, ``int64`` for
    integer files, ``float32`` for pattern files. ``format``, ``index_dtype`` and
    ``blocksize`` (BSR's) are as in ``st.tensor``.

    ``max_bytes`` (default 4 GiB; ``None``: no limit) bounds the memory reading may take: the
    file's (decompressed) text and the result its size line asks for, estimated before
    anything is allocated, so a small or tampered file cannot make it allocate gigabytes.
    Sizes are trusted only as far as the file holds entries to back them. Integers beyond
    int64 raise ``ValueError``.

    Example:
        >>> import os, tempfile, torch, sparsetorch as st
        >>> path = os.path.join(tempfile.mkdtemp(), "a.mtx")
        >>> with open(path, "w") as f:
        ...     _ = f.write("%%MatrixMarket matrix coordinate real symmetric\\n"
        ...                 "2 2 2\\n1 1 4.0\\n2 1 -1.5\\n")
        >>> st.io.read_mtx(path, dtype=torch.float32).to_dense()
        tensor([[ 4.0000, -1.5000],
                [-1.5000,  0.0000]])
    """
    spath = os.fspath(path)
    data = read_bytes(path, "read_mtx", max_bytes)
    header, body, first_line = _parse_header(data, spath)
    if header.field == "complex" or header.symmetry == "hermitian":
        raise TypeError(f"read_mtx: {spath!r} holds a {header.field} {header.symmetry} matrix; "
                        "sparsetorch values are real or integer. Read it with "
                        "scipy.io.mmread and pass the part you need, e.g. "
                        "st.tensor(scipy.io.mmread(path).tocsr().real)")
    target = _check_dtype(dtype, header, spath)
    _check_memory(header, len(body), format, target, max_bytes, blocksize)
    if header.layout == "array":
        return _read_array(header, body, first_line, target, format, index_dtype, blocksize)
    rows, cols, vals = _read_coordinate(header, body, first_line, spath)
    vals = _cast(vals, target, spath)
    fast = _sorted_csr(rows, cols, vals, header.shape, index_dtype)
    if fast is not None:
        return fast.asformat(format, index_dtype=index_dtype, blocksize=blocksize)
    coords = torch.from_numpy(np.stack([rows, cols]))
    return _tensor((coords, vals), format=format, shape=header.shape, index_dtype=index_dtype,
                   blocksize=blocksize)


def _sorted_csr(rows, cols, vals, shape, index_dtype):
    """CSR straight from entries already in row-major order without duplicates (what
    ``write_mtx`` writes), skipping the sort; ``None`` when they are not."""
    m, n = shape
    # (a row pointer far longer than the entries is left to formats that need one)
    if len(rows) == 0 or m * n >= 2**62 or m > 2 * len(rows) + _CHUNK:
        return None
    key = rows * n + cols
    if not bool((key[1:] > key[:-1]).all()):
        return None
    idx = choose_index_dtype((m, n), len(rows), index_dtype)
    pos = np.zeros(m + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=m), out=pos[1:])
    crd = torch.from_numpy(np.ascontiguousarray(cols)).to(idx)
    return SparseTensor.from_levels(shape, "csr", {"pos1": torch.from_numpy(pos).to(idx),
                                                   "crd1": crd}, vals.contiguous())


def _check_memory(header: MtxHeader, body_bytes: int, format, target, max_bytes,
                  blocksize=None) -> None:
    """Refuse, before allocating, a result whose estimated memory exceeds ``max_bytes``.

    The entry count is the size line's, capped by what the body can hold (each number takes
    at least two bytes with its separator), so a truncated file reaches the parser, which
    says so, rather than this limit."""
    if max_bytes is None:
        return
    per_value = 1 if header.layout == "array" else 2 if header.field == "pattern" else 3
    present = min(header.entries, body_bytes // (2 * per_value))
    nnz = present * (1 if header.symmetry == "general" or header.layout == "array" else 2)
    parsed = nnz * (per_value + 2) * 8            # parsed table, then index and value copies
    check_result_memory("read_mtx", header.path, header.shape, nnz, format, target,
                        blocksize, parsed, max_bytes)


def check_result_memory(who: str, path: str, shape, nnz: int, format, dtype: torch.dtype,
                        blocksize, parsed: int, max_bytes) -> None:
    """Refuse, before allocating, a reader's result of ``nnz`` entries in ``format`` (and
    ``parsed`` bytes of temporaries) that would need more than ``max_bytes`` (None: no
    limit): a small file can ask for a huge BSR block or row pointer.

    Example:
        >>> check_result_memory("read_x", "a.mtx", (4, 4), 2, "csr", torch.float32, None, 0,
        ...                     1 << 20)
    """
    if max_bytes is None:
        return
    need = parsed + _stored_bytes(format, shape, nnz, dtype.itemsize, blocksize)
    if need > max_bytes:
        m, n = shape
        raise ValueError(f"{who}: {path!r} ({m}x{n}, {nnz} entries, as {format!r}) "
                         f"would need about {_gib(need)}, more than max_bytes={max_bytes} "
                         f"({_gib(max_bytes)}); if you trust the file and have the memory, "
                         "pass a larger max_bytes (or max_bytes=None for no limit); for a "
                         "matrix with far more rows than entries, format='coo' needs no "
                         "row pointer")


def _stored_bytes(format, shape, nnz: int, value_bytes: int, blocksize=None) -> int:
    """``stored_bytes`` of ``format``; 0 for a format this cannot resolve (the constructor
    then names the problem)."""
    try:
        fmt = as_format(format, len(shape), blocksize)
        fmt.storage_dims(shape)
    except (TypeError, ValueError):
        return 0
    return stored_bytes(fmt, shape, nnz, value_bytes)


def _parse_header(data: bytes, path: str):
    """-> (MtxHeader, body bytes, line number of the body's first line). Loops over the
    banner and comment lines only."""
    end = data.find(b"\n")
    first = data[: end if end >= 0 else len(data)]
    tokens = first.split()
    example = "'%%MatrixMarket matrix coordinate real general'"
    if not tokens or tokens[0].lower() != b"%%matrixmarket":
        raise ValueError(f"read_mtx: {path!r} line 1 is {first[:60]!r}, not a Matrix Market "
                         f"banner like {example}; is this a Matrix Market file?")
    if len(tokens) != 5:
        raise ValueError(f"read_mtx: {path!r} banner {first.decode('latin1')!r} has "
                         f"{len(tokens) - 1} words after %%MatrixMarket, expected 4 as in "
                         f"{example}")
    obj, layout, field, symmetry = (t.decode("latin1").lower() for t in tokens[1:])
    field = "real" if field == "double" else field
    if obj != "matrix":
        raise ValueError(f"read_mtx: {path!r} stores a {obj!r} object; only 'matrix' files "
                         "are supported")
    if layout not in ("coordinate", "array"):
        raise ValueError(f"read_mtx: {path!r} has layout {layout!r}; expected 'coordinate' "
                         "or 'array'")
    if field not in (*_FIELDS, "complex"):
        raise ValueError(f"read_mtx: {path!r} has field {field!r}; expected one of "
                         f"{', '.join(_FIELDS)}")
    if symmetry not in (*_SYMMETRIES, "hermitian"):
        raise ValueError(f"read_mtx: {path!r} has symmetry {symmetry!r}; expected one of "
                         f"{', '.join(_SYMMETRIES)}")
    if field == "pattern" and (layout == "array" or symmetry == "skew-symmetric"):
        raise ValueError(f"read_mtx: {path!r} declares a {field} {layout} {symmetry} matrix, "
                         "which the Matrix Market format does not allow; fix the banner")
    pos, line_no, size = end + 1, 1, None
    while end >= 0 and pos <= len(data):
        end = data.find(b"\n", pos)
        line = data[pos: end if end >= 0 else len(data)].strip()
        pos, line_no = end + 1, line_no + 1
        if line and not line.startswith(b"%"):
            size = line
            break
    want = 3 if layout == "coordinate" else 2
    shape_words = "rows cols entries" if want == 3 else "rows cols"
    numbers = whole_numbers(size.split()) if size is not None else []
    if len(numbers) != want or min(numbers) < 0 or max(numbers) > _INT64.max:
        found = "nothing" if size is None else repr(size[:60])
        raise ValueError(f"read_mtx: {path!r} line {line_no}: expected the size line "
                         f"'{shape_words}' ({want} non-negative integers below 2**63), found "
                         f"{found}")
    shape = (numbers[0], numbers[1])
    if symmetry != "general" and shape[0] != shape[1]:
        raise ValueError(f"read_mtx: {path!r} is {symmetry} but not square ({shape[0]}x"
                         f"{shape[1]}); fix the banner or the size line")
    if layout == "coordinate":
        entries = numbers[2]
    else:
        n = shape[0]
        entries = {"general": shape[0] * shape[1], "symmetric": n * (n + 1) // 2,
                   "skew-symmetric": n * (n - 1) // 2, "hermitian": n * (n + 1) // 2}[symmetry]
    body = data[pos:] if end >= 0 else b""
    return MtxHeader(path, layout, field, symmetry, shape, entries), body, line_no + 1


def whole_numbers(words) -> list:
    """``words`` (bytes) as ints where each is digits (a leading ``+`` allowed), else
    ``[]``: Python's ``int`` would also take ``1_0``, `` 7`` and other spellings no
    format writes.

    Example:
        >>> whole_numbers([b"12", b"+3"]), whole_numbers([b"1_0"]), whole_numbers([b"-1"])
        ([12, 3], [], [])
    """
    digits = [w[1:] if w[:1] == b"+" else w for w in words]
    if not all(d.isdigit() and d.isascii() for d in digits):
        return []
    return [int(d) for d in digits]


_FORTRAN_EXPONENTS = bytes.maketrans(b"dD", b"ee")   # 1.0D+00 is 1.0e+00


def _numbers(body: bytes, np_dtype, per_line: int, count: int, path: str, first_line: int,
             lenient: bool = False):
    """All whitespace-separated numbers of ``body`` as a ``[count, per_line]`` table.

    ``lenient`` (pattern files): entry lines may carry a value column, which is read as
    float64 and returned as a third column for the caller to ignore, as scipy does (some
    SuiteSparse pattern files, e.g. Pajek/Ragusa16, list weights)."""
    given = body   # (error messages quote the lines as written)
    if np_dtype == np.float64 and (b"d" in body or b"D" in body):
        body = body.translate(_FORTRAN_EXPONENTS)
    if not body or body.isspace():
        out = np.empty(0, np_dtype)
    else:
        try:
            out = np.fromstring(body, dtype=np_dtype, sep=" ")
        except ValueError:
            out = None
            if lenient:  # the ignored value column may hold non-integers
                try:
                    out = np.fromstring(body, dtype=np.float64, sep=" ")
                except ValueError:
                    pass
    if out is not None and out.dtype == np.int64:
        _check_int64_range(out, body, path, first_line)
    for width in (per_line, per_line + 1) if lenient else (per_line,):
        if out is not None and out.size == width * count:
            # (the numbers are read as one stream: entry lines of 4 and 2 numbers also make
            # 3 a line, so every line's width is counted; where one is off, or the lines do
            # not count ``count``, the walk below names a bad line, and finds none when
            # blank-looking lines held only spaces)
            problem = None if per_line == 1 or (_lines(body) == count and
                                                _widths_are(body, width)) else \
                _locate_problem(given, np_dtype, per_line, count, path, first_line, lenient)
            if problem is not None:
                raise problem
            return out.reshape(count, width)
    problem = _locate_problem(given, np_dtype, per_line, count, path, first_line, lenient)
    if problem is None and lenient:   # (lines with and without the value column: each read)
        return np.array([line.split()[:per_line] for line in body.split(b"\n")
                         if line.split()], dtype=np.float64)
    raise problem or ValueError(f"read_mtx: {path!r}: cannot read the entries")


def _widths_are(body: bytes, width: int, chunk: int = 1 << 22) -> bool:
    """Whether every line of ``body`` that holds a word holds ``width`` of them, counted
    at C speed in pieces of whole lines of about ``chunk`` bytes (the temporaries are a few
    times a piece's size): the words starting before each line's end, differenced."""
    at = 0
    while at < len(body):
        cut = body.find(b"\n", min(at + chunk, len(body)) - 1)
        cut = len(body) if cut < 0 else cut + 1
        a = np.frombuffer(body, np.uint8, count=cut - at, offset=at)
        space = (a == 32) | (a == 9) | (a == 13) | (a == 10) | (a == 11) | (a == 12)
        start = ~space
        start[1:] &= space[:-1]
        ends = np.flatnonzero(a == 10)
        if a[-1] != 10:
            ends = np.append(ends, a.size)
        per_line = np.diff(np.searchsorted(np.flatnonzero(start), ends), prepend=0)
        if not (per_line[per_line > 0] == width).all():
            return False
        at = cut
    return True


def _lines(body: bytes) -> int:
    """Lines of ``body`` that are not empty, counted at C speed and without a copy (a line
    of spaces counts; so does one of a run of empty lines: ``count`` takes ``\\n\\n``
    without overlaps, so such a file takes the walk)."""
    if not body:
        return 0
    return (body.count(b"\n") + (not body.endswith(b"\n")) - body.count(b"\n\n")
            - body.startswith(b"\n"))


def _check_int64_range(out: np.ndarray, body: bytes, path: str, first_line: int) -> None:
    """numpy's text parser saturates integers beyond int64 to its limits: where a limit
    shows up, read those words exactly and refuse the first that does not fit."""
    if not ((out == _INT64.max) | (out == _INT64.min)).any():
        return
    for k, line in enumerate(body.split(b"\n")):
        for word in line.split():
            try:
                value = int(word)
            except ValueError:
                continue
            if not _INT64.min <= value <= _INT64.max:
                raise ValueError(f"read_mtx: {path!r} line {first_line + k}: the integer "
                                 f"{word[:40].decode('latin1')} does not fit in int64 (range "
                                 f"[{_INT64.min}, {_INT64.max}]); sparsetorch stores integers "
                                 "as int64 at most. Fix the value, or declare the field 'real' "
                                 "in the banner to read the values as float64")


def _locate_problem(body, np_dtype, per_line, count, path, first_line,
                    lenient=False) -> ValueError | None:
    """Error path only: walk the lines to name the first bad one (None: none is)."""
    kind = "integers" if np_dtype == np.int64 and not lenient else "numbers"
    seen = 0
    allowed = (per_line, per_line + 1) if lenient else (per_line,)
    fortran = np_dtype == np.float64   # (as ``_numbers`` reads them)
    for k, line in enumerate(body.split(b"\n")):
        words = (line.translate(_FORTRAN_EXPONENTS) if fortran else line).split()
        if not words:
            continue
        where = f"read_mtx: {path!r} line {first_line + k}"
        if per_line == 1:  # array files: values may share lines
            try:
                np.array(words).astype(np_dtype)
            except ValueError:
                return ValueError(f"{where}: cannot read {line[:60]!r} as {kind}; fix or "
                                  "remove that line")
            seen += len(words)
            continue
        if len(words) not in allowed:
            return ValueError(f"{where} has {len(words)} values ({line[:60]!r}); each entry "
                              f"line of this file needs {' or '.join(map(str, allowed))}")
        if lenient:
            np_dtype = np.float64
        try:
            np.array(words).astype(np_dtype)
        except ValueError:
            return ValueError(f"{where}: cannot read {line[:60]!r} as {per_line} {kind}; fix "
                              "or remove that line")
        seen += 1
    if seen == count:
        return None   # (every line well formed)
    what = "values" if per_line == 1 else "entry lines"
    return ValueError(f"read_mtx: {path!r} has {seen} {what} but its size line promises "
                      f"{count}; the file is truncated or the size line is wrong")


def _read_coordinate(header: MtxHeader, body, first_line, path):
    per_line = 2 if header.field == "pattern" else 3
    np_dtype = np.float64 if header.field == "real" else np.int64
    table = _numbers(body, np_dtype, per_line, header.entries, path, first_line,
                     lenient=header.field == "pattern")
    if table.dtype == np.float64:
        idx = table[:, :2]
        # (inf, NaN and whole numbers past int64 too: converted, they read as garbage)
        bad = ~(np.isfinite(idx) & (idx == np.trunc(idx)) & (np.abs(idx) < 2.0 ** 62)).all(1)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"read_mtx: {path!r} entry {k + 1} has indices {idx[k].tolist()}; "
                             "row and column indices must be whole numbers within the "
                             "matrix's size")
        idx = idx.astype(np.int64)
    else:
        idx = table[:, :2]
    rows, cols = idx[:, 0] - 1, idx[:, 1] - 1
    m, n = header.shape
    bad = (rows < 0) | (rows >= m) | (cols < 0) | (cols >= n)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"read_mtx: {path!r} entry {k + 1} has index ({rows[k] + 1}, "
                         f"{cols[k] + 1}) outside the {m}x{n} matrix; Matrix Market indices "
                         f"are 1-based and lie in [1, {m}] x [1, {n}]")
    vals = (np.ones(len(rows), np.float32) if header.field == "pattern"
            else np.ascontiguousarray(table[:, 2]))
    if header.symmetry != "general":
        off = rows != cols
        if header.symmetry == "skew-symmetric" and vals.dtype == np.int64 and \
                (vals[off] == _INT64.min).any():
            k = int(np.argmax(off & (vals == _INT64.min)))
            raise ValueError(f"read_mtx: {path!r} entry {k + 1} holds {_INT64.min}, whose "
                             f"mirror in this skew-symmetric file, {-int(_INT64.min)}, does "
                             "not fit in int64; declare the field 'real' in the banner to "
                             "read the values as float64")
        mirrored = vals[off] if header.symmetry == "symmetric" else -vals[off]
        rows, cols = np.concatenate([rows, cols[off]]), np.concatenate([cols, rows[off]])
        vals = np.concatenate([vals, mirrored])
    return rows, cols, vals


def _read_array(header: MtxHeader, body, first_line, target, format, index_dtype,
                blocksize):
    np_dtype = np.float64 if header.field == "real" else np.int64
    vals = _numbers(body, np_dtype, 1, header.entries, header.path, first_line).reshape(-1)
    m, n = header.shape
    if header.symmetry == "general":
        dense = vals.reshape(n, m).T           # column-major on disk
    else:  # lower triangle, column by column == upper triangle, row by row, transposed
        j, i = np.triu_indices(m, 0 if header.symmetry == "symmetric" else 1)
        dense = np.zeros((m, n), np_dtype)
        dense[j, i] = vals if header.symmetry == "symmetric" else -vals
        dense[i, j] = vals
    values = _cast(np.ascontiguousarray(dense), target, header.path)
    return _tensor(values, format=format, index_dtype=index_dtype, blocksize=blocksize)


def _check_dtype(dtype, header: MtxHeader, path) -> torch.dtype:
    if dtype is None:
        return _DEFAULT_DTYPE.get(header.field, torch.float64)
    if not isinstance(dtype, torch.dtype) or dtype not in VALUE_DTYPES:
        supported = ", ".join(str(d) for d in VALUE_DTYPES)
        raise TypeError(f"read_mtx({path!r}): dtype={dtype!r} is not supported; pass one of "
                        f"{supported}, or None for the file's own type")
    return dtype


def _cast(vals: np.ndarray, target: torch.dtype, path) -> torch.Tensor:
    if not target.is_floating_point and vals.dtype.kind == "f":
        if not np.array_equal(vals, np.trunc(vals)):
            raise ValueError(f"read_mtx: {path!r} has non-integer values but dtype={target}; "
                             "pass a floating dtype (or None)")
    if not target.is_floating_point and vals.size:
        # (a cast wraps or saturates what the type cannot hold: 3e9 read as int32 was -1.3e9)
        info = torch.iinfo(target)
        low, high = vals.min(), vals.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(f"read_mtx: {path!r} holds the value {bad}, beyond {target}'s "
                             f"range [{info.min}, {info.max}]; pass a wider dtype (or None)")
    return torch.from_numpy(vals).to(target)


# -- writing ---------------------------------------------------------------------------------
def write_mtx(path, tensor, comment=None) -> None:
    """Write a 2-D matrix as a ``coordinate general`` Matrix Market file, atomically.

    ``tensor`` is a ``SparseTensor`` or anything ``st.tensor`` accepts (dense tensor, numpy
    array, scipy.sparse matrix). Floating values are written as ``real`` (float64 with the
    shortest repr that reads back exactly, float32/16 with 9 significant digits), integer
    values as ``integer``. Entries go out in row-major order, 1-based; stored zeros are kept.
    A path ending in ``.gz`` is gzipped. The file is written to a temporary file in the same
    folder and moved into place with ``os.replace``, so readers never see a partial file.
    ``comment`` (a string, may span lines) is written as ``%`` lines after the banner.

    Example:
        >>> import os, tempfile, torch, sparsetorch as st
        >>> path = os.path.join(tempfile.mkdtemp(), "b.mtx.gz")
        >>> A = st.tensor(torch.tensor([[0., 1.5], [2., 0.]]))
        >>> st.io.write_mtx(path, A, comment="a 2x2 example")
        >>> torch.equal(st.io.read_mtx(path, dtype=torch.float32).to_dense(), A.to_dense())
        True
    """
    spath = os.fsdecode(os.fspath(path))   # (bytes too, as read_mtx takes them)
    t = tensor if isinstance(tensor, SparseTensor) else _tensor(tensor, format="coo")
    if t.dim() != 2:   # (after st.tensor: an (indices, values) pair's order shows there)
        raise ValueError(f"write_mtx({spath!r}): Matrix Market stores matrices; this tensor is "
                         f"{t.dim()}-D with shape {tuple(t.shape)}")
    if t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"write_mtx({spath!r}): values of dtype {t.dtype} are not supported; "
                        "convert to a float or integer dtype first")
    if t.device.type == "meta":
        raise ValueError(f"write_mtx({spath!r}): the tensor is on the meta device, which "
                         "holds shapes but no values; write a tensor that has its data")
    coo = t.asformat("coo")
    arrays = coo.arrays
    rows = arrays["crd0"].detach().cpu().to(torch.int64).numpy() + 1
    cols = arrays["crd1"].detach().cpu().to(torch.int64).numpy() + 1
    values = coo.values.detach().cpu()
    if values.dtype.is_floating_point:
        field = "real"
        spec = "%r" if values.dtype == torch.float64 else "%.9g"
        values = values.to(torch.float64)
    else:
        field, spec = "integer", "%d"
        values = values.to(torch.int64)
    vals = values.numpy()
    lines = [f"%%MatrixMarket matrix coordinate {field} general"]
    if comment:
        lines += ["%" + (" " + c if c else "") for c in str(comment).splitlines()]
    lines.append(f"{t.shape[0]} {t.shape[1]} {len(vals)}")

    def chunks():
        yield ("\n".join(lines) + "\n").encode()
        for s in range(0, len(vals), _CHUNK):
            r, c, v = rows[s:s + _CHUNK].tolist(), cols[s:s + _CHUNK].tolist(), \
                vals[s:s + _CHUNK].tolist()
            text = (f"%d %d {spec}\n" * len(r)) % tuple(itertools.chain.from_iterable(
                zip(r, c, v)))
            yield text.encode()

    atomic_write(spath, chunks(), gz=spath.lower().endswith(".gz"), who="write_mtx")


def atomic_write(path: str, chunks, gz: bool, who: str) -> None:
    """Write byte ``chunks`` (gzipped if ``gz``) to ``path`` whole or not at all
    (``sparsetorch._files``)."""
    def write(raw):
        out = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if gz else raw
        for chunk in chunks:
            out.write(chunk)
        if gz:
            out.close()

    _atomic_write(path, write, who=who)
