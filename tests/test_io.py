"""Matrix Market and DLMC .smtx I/O: round trips against dense, every shipped SuiteSparse
file against scipy.io.mmread, DLMC files against the README's reference parse, and every
bad-input path's message."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp
import torch

import sparsetorch as st
from sparsetorch.datasets import data_root
from sparsetorch.io import read_mtx, read_mtx_header, read_smtx, write_mtx
from sparsetorch.io.mtx import atomic_write


def _data_root() -> Path:
    try:
        return data_root()
    except FileNotFoundError:
        return Path("/nonexistent")


MTX_DIR = _data_root() / "suitesparse" / "mtx"
DLMC_DIR = _data_root() / "dlmc"
MTX_FILES = sorted(MTX_DIR.glob("*.mtx")) if MTX_DIR.is_dir() else []


def _write(tmp_path, text, name="a.mtx"):
    path = tmp_path / name
    data = text.encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


def _dense(path, **kw):
    return read_mtx(path, **kw).to_dense()


def _random_dense(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    x[torch.rand(shape, generator=g) < 0.6] = 0
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


# -- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
@pytest.mark.parametrize("shape", [(7, 5), (1, 9), (12, 1)])
def test_roundtrip_matches_dense(tmp_path, dtype, fmt, shape):
    x = _random_dense(shape, dtype)
    path = tmp_path / "m.mtx"
    write_mtx(path, st.tensor(x, format=fmt))
    back = read_mtx(path, format=fmt, dtype=dtype)
    assert back.format.name == fmt and back.dtype == dtype
    assert torch.equal(back.to_dense(), x)
    h = read_mtx_header(path)
    assert h.field == ("integer" if dtype == torch.int64 else "real")
    assert (h.layout, h.symmetry, h.shape, h.entries) == ("coordinate", "general", shape,
                                                          int((x != 0).sum()))


def test_default_dtype_is_lossless(tmp_path):
    x = torch.tensor([[0.1, 0.0], [1e-300, -np.pi]], dtype=torch.float64)
    write_mtx(tmp_path / "f.mtx", x)
    got = read_mtx(tmp_path / "f.mtx")
    assert got.dtype == torch.float64 and torch.equal(got.to_dense(), x)
    i = torch.tensor([[2**62, 0], [-7, 1]])
    write_mtx(tmp_path / "i.mtx", i)
    got = read_mtx(tmp_path / "i.mtx")
    assert got.dtype == torch.int64 and torch.equal(got.to_dense(), i)


def test_roundtrip_special_values_and_half(tmp_path):
    x = torch.tensor([[float("inf"), 0.0, float("-inf")], [0.0, 3.0e-38, -1.5]])
    write_mtx(tmp_path / "s.mtx", x)
    assert torch.equal(_dense(tmp_path / "s.mtx", dtype=torch.float32), x)
    nan = torch.tensor([[float("nan"), 1.0]])
    write_mtx(tmp_path / "n.mtx", nan)
    assert torch.isnan(_dense(tmp_path / "n.mtx")[0, 0])
    for dt in (torch.float16, torch.bfloat16):
        h = (torch.randn(4, 6, generator=torch.Generator().manual_seed(3)) * 10).to(dt)
        write_mtx(tmp_path / "h.mtx", h)
        assert torch.equal(_dense(tmp_path / "h.mtx", dtype=dt), h)


def test_roundtrip_gz_scipy_and_explicit_zeros(tmp_path):
    m = sp.random(30, 20, density=0.2, format="csr", random_state=1, dtype=np.float64)
    m.data[::5] = 0.0                           # stored zeros survive the trip
    path = tmp_path / "m.mtx.gz"
    write_mtx(path, m, comment="line one\nline two")
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    text = gzip.decompress(path.read_bytes()).decode()
    assert text.startswith("%%MatrixMarket matrix coordinate real general\n% line one\n"
                           "% line two\n30 20 ")
    back = read_mtx(path).to_scipy()
    assert back.nnz == m.nnz and np.array_equal(back.toarray(), m.toarray())
    ref = scipy.io.mmread(path)
    assert np.array_equal(ref.toarray(), m.toarray())


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
def test_empty_matrix(tmp_path, fmt):
    empty = st.tensor((torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0)), shape=(3, 4))
    write_mtx(tmp_path / "e.mtx", empty)
    got = read_mtx(tmp_path / "e.mtx", format=fmt)
    assert got.shape == (3, 4) and got.nnz == 0
    p = _write(tmp_path, "%%MatrixMarket matrix coordinate pattern symmetric\n5 5 0\n", "z.mtx")
    assert read_mtx(p, format=fmt).nnz == 0
    p = _write(tmp_path, "%%MatrixMarket matrix coordinate real general\n0 0 0", "zz.mtx")
    assert read_mtx(p, format=fmt).shape == (0, 0)


def test_format_and_index_dtype_pass_through(tmp_path):
    write_mtx(tmp_path / "a.mtx", torch.eye(4))
    a = read_mtx(tmp_path / "a.mtx", format="dcsr", index_dtype=torch.int64)
    assert a.format.name == "dcsr" and a.index_dtype == torch.int64
    assert read_mtx(tmp_path / "a.mtx").index_dtype == torch.int32
    # BSR takes its block size (its error named blocksize=, which read_mtx did not take);
    # unsorted entries and dense array files too
    dense = torch.arange(36.0).view(6, 6) * (torch.rand(6, 6) < 0.4)
    (tmp_path / "u.mtx").write_text("%%MatrixMarket matrix coordinate real general\n"
                                     "6 6 2\n5 6 1.5\n1 2 -2\n")
    write_mtx(tmp_path / "d.mtx", dense)
    for name, want in (("a", torch.eye(4)), ("u", None), ("d", dense)):
        b = read_mtx(tmp_path / f"{name}.mtx", format="bsr", blocksize=(2, 2),
                     dtype=torch.float32)
        assert b.format.name == "bsr" and b.format.blocksize == (2, 2)
        if want is not None:
            torch.testing.assert_close(b.to_dense(), want)
    write_mtx(tmp_path / "e.mtx", torch.eye(64))   # (its blocks store zeros: counted)
    read_mtx(tmp_path / "e.mtx", max_bytes=8000)
    with pytest.raises(ValueError, match="would need about"):
        read_mtx(tmp_path / "e.mtx", format="bsr", blocksize=(16, 16), max_bytes=8000)


# -- write_mtx atomicity -----------------------------------------------------------------------
def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "w.mtx"
    write_mtx(path, torch.eye(2))
    before = path.read_bytes()

    def failing():
        yield b"%%MatrixMarket matrix coordinate real general\n"
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(str(path), failing(), gz=False, who="test")
    assert path.read_bytes() == before                   # old file untouched
    assert sorted(os.listdir(tmp_path)) == ["w.mtx"]     # temp file removed
    write_mtx(path, 2 * torch.eye(3))                    # replacing works
    assert torch.equal(_dense(path, dtype=torch.float32), 2 * torch.eye(3))
    assert sorted(os.listdir(tmp_path)) == ["w.mtx"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_a_new_file_takes_the_umask_without_setting_it(tmp_path, monkeypatch):
    """The umask is read from /proc, not set and restored: setting it is process-wide, and
    a file another thread made in between would get 0o666."""
    old = os.umask(0o027)
    try:
        def refuse(_):
            raise AssertionError("os.umask called")
        monkeypatch.setattr(os, "umask", refuse)
        write_mtx(tmp_path / "u.mtx", torch.eye(2))
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert (tmp_path / "u.mtx").stat().st_mode & 0o777 == 0o640


def test_write_errors(tmp_path):
    with pytest.raises(ValueError, match=r"3-D"):
        write_mtx(tmp_path / "x.mtx", st.tensor(torch.ones(2, 2, 2), format="csf"))
    with pytest.raises(ValueError, match=r"1-D"):
        write_mtx(tmp_path / "x.mtx", torch.ones(3))
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        write_mtx(tmp_path / "missing" / "x.mtx", torch.eye(2))
    assert not (tmp_path / "x.mtx").exists()


# -- reading features ------------------------------------------------------------------------
BANNER = "%%MatrixMarket matrix coordinate"


def test_symmetric_skew_pattern_integer(tmp_path):
    sym = _write(tmp_path, f"{BANNER} real symmetric\n% c\n3 3 4\n1 1 2.0\n2 1 -1\n3 1 5e-1"
                           "\n3 3 7\n")
    assert torch.equal(_dense(sym), torch.tensor([[2., -1, .5], [-1, 0, 0], [.5, 0, 7]],
                                                 dtype=torch.float64))
    skew = _write(tmp_path, f"{BANNER} integer skew-symmetric\n3 3 2\n2 1 4\n3 2 -3\n", "k.mtx")
    got = _dense(skew)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.tensor([[0, -4, 0], [4, 0, 3], [0, -3, 0]]))
    pat = _write(tmp_path, f"{BANNER} pattern symmetric\n3 3 3\n1 1\n3 1\n3 2\n", "p.mtx")
    got = _dense(pat)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([[1., 0, 1], [0, 0, 1], [1, 1, 0]]))
    gen = _write(tmp_path, f"{BANNER} pattern general\n2 3 2\n1 3\n2 1\n", "g.mtx")
    assert torch.equal(_dense(gen, dtype=torch.int32),
                       torch.tensor([[0, 0, 1], [1, 0, 0]], dtype=torch.int32))


def test_lenient_inputs(tmp_path):
    # banner case, CRLF, tabs, blank lines, Fortran exponents, duplicates summed
    text = ("%%matrixmarket MATRIX Coordinate REAL General\r\n%comment\r\n\r\n2  2\t3\r\n"
            "1 1 1.5D+00\r\n\r\n2 2 -2d0\r\n1 1 0.5\r\n")
    got = _dense(_write(tmp_path, text))
    assert torch.equal(got, torch.tensor([[2.0, 0], [0, -2.0]], dtype=torch.float64))
    # pattern files listing weights (as SuiteSparse's Pajek/Ragusa16 does): weights ignored
    p = _write(tmp_path, f"{BANNER} pattern general\n2 2 2\n1 2 7\n2 1 0.5\n", "w.mtx")
    assert torch.equal(_dense(p), torch.tensor([[0., 1], [1, 0]]))
    gz = _write(tmp_path, f"{BANNER} integer general\n1 2 1\n1 2 9\n", "c.mtx.gz")
    assert torch.equal(_dense(gz), torch.tensor([[0, 9]]))


def test_array_layout(tmp_path):
    gen = _write(tmp_path, "%%MatrixMarket matrix array real general\n2 3\n1\n0\n2\n3\n0\n4\n")
    assert torch.equal(_dense(gen, dtype=torch.float32), torch.tensor([[1., 2, 0], [0, 3, 4]]))
    sym = _write(tmp_path, "%%MatrixMarket matrix array integer symmetric\n3 3\n1 2 3 4 5 6\n",
                 "s.mtx")
    assert torch.equal(_dense(sym), torch.tensor([[1, 2, 3], [2, 4, 5], [3, 5, 6]]))
    skew = _write(tmp_path, "%%MatrixMarket matrix array real skew-symmetric\n3 3\n1\n2\n3\n",
                  "k.mtx")
    assert torch.equal(_dense(skew, dtype=torch.float32),
                       torch.tensor([[0., -1, -2], [1, 0, -3], [2, 3, 0]]))
    assert read_mtx(gen).nnz == 4                      # zeros of dense files are dropped


def test_complex_is_a_type_error(tmp_path):
    p = _write(tmp_path, f"{BANNER} complex general\n1 1 1\n1 1 1.0 2.0\n")
    with pytest.raises(TypeError, match=r"a\.mtx.*complex.*scipy\.io\.mmread"):
        read_mtx(p)
    h = _write(tmp_path, f"{BANNER} complex hermitian\n1 1 1\n1 1 1.0 0.0\n", "h.mtx")
    with pytest.raises(TypeError, match="hermitian"):
        read_mtx(h)
    assert read_mtx_header(p).field == "complex"


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("hello\n1 1 1\n", r"line 1 is .*not a Matrix Market banner"),
    ("%%MatrixMarket matrix coordinate real\n1 1 0\n", "3 words after %%MatrixMarket"),
    ("%%MatrixMarket vector coordinate real general\n1 1 0\n", "'vector' object"),
    ("%%MatrixMarket matrix sparse real general\n1 1 0\n", "layout 'sparse'"),
    ("%%MatrixMarket matrix coordinate quaternion general\n1 1 0\n", "field 'quaternion'"),
    ("%%MatrixMarket matrix coordinate real diagonal\n1 1 0\n", "symmetry 'diagonal'"),
    ("%%MatrixMarket matrix array pattern general\n1 1\n", "does not allow"),
    ("%%MatrixMarket matrix coordinate real general\n% only comments\n", "line 3: expected the "
     "size line 'rows cols entries'"),
    ("%%MatrixMarket matrix coordinate real general\n2 2\n", "expected the size line"),
    ("%%MatrixMarket matrix coordinate real general\n2 -2 1\n", "non-negative"),
    ("%%MatrixMarket matrix coordinate real symmetric\n2 3 0\n", r"not square \(2x3\)"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 3\n1 1 1\n2 2 1\n",
     "has 2 entry lines but its size line promises 3"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 1\n1 1 1\n2 2 1\n",
     "has 2 entry lines but its size line promises 1"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1\n2 2\n",
     r"line 4 has 2 values .*needs 3"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1 2 2 1\n",   # two in one
     r"line 3 has 6 values .*needs 3"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1\n2 x 1\n",
     r"line 4: cannot read b'2 x 1' as 3 numbers"),
    # quoted as written, not as read (with Fortran exponents: 'd' -> 'e')
    ("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 5.0D+00\n% mid\n2 2 6\n",
     r"line 4 has 2 values \(b'% mid'\)"),
    ("%%MatrixMarket matrix coordinate integer general\n2 2 1\n1 1 1.5\n",
     r"line 3: cannot read b'1 1 1.5' as 3 integers"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 1\n0 1 1\n",
     r"entry 1 has index \(0, 1\) outside the 2x2 matrix; Matrix Market indices are 1-based"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1\n2 3 1\n",
     r"entry 2 has index \(2, 3\) outside"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 1\n1.5 1 1\n", "whole numbers"),
    # (past int64: numpy's cast warned, and the error quoted index -2^63)
    ("%%MatrixMarket matrix coordinate real general\n2 2 1\n1e300 1 1\n",
     r"entry 1 has indices \[1e\+300, 1.0\]; row and column indices must be whole"),
    ("%%MatrixMarket matrix coordinate real general\n2 2 1\n1 inf 1\n",
     r"entry 1 has indices \[1.0, inf\]"),
    # (int64's least, mirrored: -(-2^63) wrapped to -2^63 silently)
    ("%%MatrixMarket matrix coordinate integer skew-symmetric\n2 2 1\n"
     "2 1 -9223372036854775808\n", "mirror in this skew-symmetric file, "
     "9223372036854775808, does not fit in int64"),
    ("%%MatrixMarket matrix array real general\n2 2\n1 2 3\n",
     "has 3 values but its size line promises 4"),
    ("%%MatrixMarket matrix array integer general\n2 1\n1 2.5\n",
     r"line 3: cannot read b'1 2.5' as integers"),
])
def test_bad_files_name_file_and_problem(tmp_path, text, message):
    p = _write(tmp_path, text, "bad.mtx")
    with pytest.raises(ValueError, match=message) as e:
        read_mtx(p)
    assert "bad.mtx" in str(e.value)


def test_a_pattern_file_mixing_lines_with_and_without_values(tmp_path):
    """Pattern entry lines may carry a value column, as scipy reads them; lines with
    and without it in one file gave "cannot read the entries", naming no line (a probe's
    finding)."""
    p = _write(tmp_path, f"{BANNER} pattern general\n2 2 3\n1 1 0.5\n2 1\n"
                         "2 2 7\n")
    assert read_mtx(p).to_dense().tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_argument_and_device_errors_name_the_argument(tmp_path):
    p = _write(tmp_path, f"{BANNER} real general\n1 1 1\n1 1 2\n")
    for bad in ("1000000", -1, 1.5, True):   # (a str gave '>' not supported; -1 ran)
        with pytest.raises(TypeError, match="max_bytes must be an int >= 0"):
            read_mtx(p, max_bytes=bad)
    with pytest.raises(ValueError, match="on the meta device"):   # (torch's copy error)
        write_mtx(tmp_path / "m.mtx", st.tensor(torch.eye(2)).to("meta"))
    assert not (tmp_path / "m.mtx").exists()


def test_bad_paths_and_dtypes(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.mtx"):
        read_mtx(tmp_path / "nope.mtx")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        read_mtx(tmp_path)
    (tmp_path / "bad.mtx.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ValueError, match=r"bad\.mtx\.gz.*cannot be decompressed"):
        read_mtx(tmp_path / "bad.mtx.gz")
    p = _write(tmp_path, f"{BANNER} real general\n1 1 1\n1 1 0.5\n")
    with pytest.raises(TypeError, match=r"dtype=torch\.bool is not supported"):
        read_mtx(p, dtype=torch.bool)
    with pytest.raises(ValueError, match="non-integer values but dtype=torch.int64"):
        read_mtx(p, dtype=torch.int64)


# -- the shipped SuiteSparse matrices --------------------------------------------------------
def test_suitesparse_data_present_or_skip():
    if not MTX_FILES:
        pytest.skip(f"no SuiteSparse data at {MTX_DIR}")
    assert len(MTX_FILES) == 59


@pytest.mark.parametrize("path", MTX_FILES, ids=[p.stem for p in MTX_FILES])
def test_every_suitesparse_file_matches_scipy(path):
    ref = scipy.io.mmread(path)
    if np.iscomplexobj(ref.data if sp.issparse(ref) else ref):
        with pytest.raises(TypeError, match="complex"):
            read_mtx(path)
        return
    ref = sp.csr_array(ref)
    ref.sum_duplicates()
    got = read_mtx(path).to_scipy()
    assert got.shape == ref.shape
    assert np.array_equal(got.indptr, ref.indptr) and np.array_equal(got.indices, ref.indices)
    assert np.array_equal(got.data, ref.data)
    header = read_mtx_header(path)
    if header.field == "integer":
        assert got.dtype == np.int64


# -- DLMC .smtx ------------------------------------------------------------------------------
def _reference_smtx(path):
    """The README's parse, written independently of read_smtx."""
    with gzip.open(path, "rt") as f:
        m, k, nnz = (int(v) for v in f.readline().split(","))
        indptr = np.array(f.readline().split(), dtype=np.int64)
        indices = np.array(f.readline().split(), dtype=np.int64)
    return sp.csr_matrix((np.ones(nnz, np.float32), indices, indptr), shape=(m, k))


def _dlmc_sample():
    if not DLMC_DIR.is_dir():
        return []
    out = []
    for folder in sorted(p for p in DLMC_DIR.glob("*/*/*") if p.is_dir()):
        files = sorted(folder.glob("*.smtx.gz"), key=lambda p: p.stat().st_size)
        out += [files[0], files[-1]] if files else []
    return out


DLMC_SAMPLE = _dlmc_sample()


@pytest.mark.parametrize("path", DLMC_SAMPLE,
                         ids=[f"{p.parent.parent.parent.name}-{p.parent.name}-{p.stem[:30]}"
                              for p in DLMC_SAMPLE])
def test_dlmc_files_match_reference(path):
    ref = _reference_smtx(path)
    got = read_smtx(path)
    assert got.format.name == "csr" and got.dtype == torch.float32
    s = got.to_scipy()
    assert s.shape == ref.shape and np.array_equal(s.indptr, ref.indptr)
    assert np.array_equal(s.indices, ref.indices) and np.all(s.data == 1)


def test_dlmc_data_present_or_skip():
    if not DLMC_SAMPLE:
        pytest.skip(f"no DLMC data at {DLMC_DIR}")
    assert len(DLMC_SAMPLE) == 12


SMTX = "3, 4, 5\n0 2 2 5\n1 3 0 2 3\n"


def test_smtx_values_rules(tmp_path):
    p = _write(tmp_path, SMTX, "w.smtx")
    pattern = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    ones = read_smtx(p)
    assert torch.equal(ones.to_dense(), pattern.float())
    n1, n2 = read_smtx(p, values="normal", seed=7), read_smtx(p, values="normal", seed=7)
    assert torch.equal(n1.values, n2.values)
    assert not torch.equal(n1.values, read_smtx(p, values="normal", seed=8).values)
    assert torch.equal(n1.to_dense() != 0, pattern)
    u = read_smtx(p, values="uniform", seed=0, dtype=torch.float64)
    assert u.dtype == torch.float64 and bool(((u.values >= 0) & (u.values < 1)).all())
    half = read_smtx(p, values="normal", seed=7, dtype=torch.bfloat16)
    assert torch.equal(half.values, n1.values.to(torch.bfloat16))
    c = read_smtx(p, values=lambda n, g: torch.arange(n) + 1, dtype=torch.int32)
    assert c.dtype == torch.int32 and c.values.tolist() == [1, 2, 3, 4, 5]
    gz = _write(tmp_path, SMTX, "w.smtx.gz")
    coo = read_smtx(gz, format="coo", index_dtype=torch.int64)
    assert coo.format.name == "coo" and coo.index_dtype == torch.int64
    assert torch.equal(coo.to_dense(), ones.to_dense())


def test_smtx_unsorted_rows_are_sorted_and_empty_ok(tmp_path):
    p = _write(tmp_path, "2, 4, 4\n0 3 4\n3 0 2 1\n", "u.smtx")
    got = read_smtx(p)
    assert got.arrays["crd1"].tolist() == [0, 2, 3, 1]
    e = _write(tmp_path, "2, 3, 0\n0 0 0\n\n", "e.smtx")
    assert read_smtx(e).nnz == 0 and read_smtx(e).shape == (2, 3)
    e2 = _write(tmp_path, "2, 3, 0\n0 0 0\n", "e2.smtx")
    assert read_smtx(e2).nnz == 0


@pytest.mark.parametrize("text, message", [
    ("3 4\n0 0 0 0\n\n", r"line 1 is .*'rows, cols, nnz'"),
    ("a, b, c\n0\n\n", r"line 1 is .*three non-negative integers"),
    ("3, 4, 1\n0 1 1\n2\n", r"line 2 has 3 row offsets; the header \(3 rows\) needs 4"),
    ("2, 4, 2\n0 1 2\n2\n", "line 3 has 1 column indices; the header says nnz=2"),
    ("2, 4, 2\n1 1 2\n2 3\n", "must start at 0 and end at nnz=2"),
    ("2, 4, 2\n0 1 3\n2 3\n", "must start at 0 and end at nnz=2"),
    ("3, 4, 2\n0 2 1 2\n2 3\n", r"decrease at row 1 \(2 -> 1\)"),
    ("2, 4, 2\n0 1 2\n2 4\n", r"column index 4 at position 1 is outside \[0, 4\)"),
    ("2, 4, 2\n0 2 2\n3 3\n", "row 0 lists column 3 twice"),
    # (apart until sorted: the error was from_levels', naming no file)
    ("1, 4, 3\n0 3\n1 0 1\n", "row 0 lists column 1 twice"),
    ("2, 4, 2\n0 1 2\n2 x\n", r"line 3 \(column indices\) contains b'x'"),
    ("2, 4, 2\n0 1 2\n2 3\nextra\n", "text after line 3"),
])
def test_smtx_bad_files(tmp_path, text, message):
    p = _write(tmp_path, text, "bad.smtx")
    with pytest.raises(ValueError, match=message) as e:
        read_smtx(p)
    assert "bad.smtx" in str(e.value)


def test_smtx_integers_beyond_int64_are_refused(tmp_path):
    """numpy's parser saturates them (an offset 2^63 - 1 would pass the range checks on a
    header that agrees); read_smtx names the number, as read_mtx does."""
    for text, where in [("2, 4, 2\n0 1 2\n2 99999999999999999999\n", "line 3"),
                        ("2, 4, 2\n0 -99999999999999999999 2\n1 3\n", "line 2")]:
        p = _write(tmp_path, text, "big.smtx")
        with pytest.raises(ValueError, match=f"{where} .* holds b'-?9+' at position 1, "
                                             "beyond the int64 range"):
            read_smtx(p)


def test_smtx_bad_arguments(tmp_path):
    p = _write(tmp_path, SMTX, "w.smtx")
    with pytest.raises(ValueError, match="values='gauss' is not a rule"):
        read_smtx(p, values="gauss")
    with pytest.raises(TypeError, match="needs a floating dtype"):
        read_smtx(p, values="normal", dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype=torch.uint8 is not supported"):
        read_smtx(p, dtype=torch.uint8)
    with pytest.raises(ValueError, match="returned shape \\(2,\\); it must return 5 values"):
        read_smtx(p, values=lambda n, g: torch.ones(2))
    with pytest.raises(FileNotFoundError, match="no file at"):
        read_smtx(tmp_path / "none.smtx")


def test_smtx_memory_limit_and_blocks(tmp_path):
    """``max_bytes`` bounds the (decompressed) text, streamed, and the result (a huge BSR
    block asked of a tiny file); ``blocksize`` gives BSR."""
    p = _write(tmp_path, SMTX, "w.smtx")
    bsr = read_smtx(p, format="bsr", blocksize=(1, 2))
    assert bsr.format.name == "bsr" and torch.equal(bsr.to_dense(), read_smtx(p).to_dense())
    with pytest.raises(ValueError, match=r"w\.smtx.* more than max_bytes=10 "):
        read_smtx(p, max_bytes=10)
    huge = _write(tmp_path, "2, 1000000000, 1\n0 1 1\n5\n", "h.smtx")
    with pytest.raises(ValueError, match=r"h\.smtx.*as .bsr.* would need about 7\.45 GiB"):
        read_smtx(huge, format="bsr", blocksize=(2, 10**9))
    bomb = tmp_path / "bomb.smtx.gz"
    bomb.write_bytes(gzip.compress(b"1, 1, 0\n0 0\n" + b" " * (16 << 20), 9))
    peak = _peak_numpy_bytes(lambda: read_smtx(bomb, max_bytes=2 << 20),
                             raises=r"bomb\.smtx\.gz' decompresses to over")
    assert peak < 8 << 20


@pytest.mark.parametrize("reader, text", [
    ("mtx", "%%MatrixMarket matrix coordinate real general\n1_0 2 1\n1 1 1.0\n"),
    ("mtx", "%%MatrixMarket matrix coordinate real general\n2 \u0663 1\n1 1 1.0\n"),
    ("smtx", "2, 1_0, 1\n0 1 1\n0\n")])
def test_size_lines_take_plain_digits_only(tmp_path, reader, text):
    """Python's ``int`` reads ``1_0`` as 10 (and other digits than ASCII): no writer spells a
    size so; the size line is refused as malformed."""
    p = _write(tmp_path, text, "s." + reader)
    with pytest.raises(ValueError, match="line 1 is|line 2: expected the size line"):
        (read_mtx if reader == "mtx" else read_smtx)(p)


# -- integers beyond int64, sizes the file cannot back, and the memory limit -----------------
@pytest.mark.parametrize("value", ["99999999999999999999", "-9223372036854775809"])
def test_integers_beyond_int64_raise(tmp_path, value):
    p = _write(tmp_path, f"{BANNER} integer general\n2 2 2\n1 1 7\n2 2 {value}\n")
    with pytest.raises(ValueError, match=rf"a\.mtx.*line 4: the integer {value} does not fit "
                                         r"in int64.*'real'"):
        read_mtx(p)
    edge = _write(tmp_path, f"{BANNER} integer general\n1 2 2\n1 1 9223372036854775807\n"
                            "1 2 -9223372036854775808\n", "edge.mtx")
    assert read_mtx(edge).to_dense().tolist() == [[2**63 - 1, -2**63]]
    big = _write(tmp_path, f"{BANNER} real general\n99999999999999999999 1 0\n", "big.mtx")
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        read_mtx(big)


def _peak_numpy_bytes(fn, raises=None):
    """Peak bytes traced while ``fn`` runs (numpy reports its buffers to tracemalloc);
    with ``raises`` (a regex), ``fn`` must raise a ValueError matching it."""
    import tracemalloc
    tracemalloc.start()
    try:
        if raises is None:
            fn()
        else:
            with pytest.raises(ValueError, match=raises):
                fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_tiny_file_claiming_huge_sizes_allocates_little(tmp_path):
    p = _write(tmp_path, f"{BANNER} real general\n1000000000 1000000000 1\n5 7 2.5\n")
    assert p.stat().st_size < 80
    peak = _peak_numpy_bytes(lambda: read_mtx(p), raises=r"would need about 7\.45 GiB.*"
                             r"max_bytes=None.*format='coo'")
    assert peak < 1 << 20
    got = {}
    peak = _peak_numpy_bytes(lambda: got.setdefault("t", read_mtx(p, format="coo")))
    assert peak < 1 << 20
    t = got["t"]
    assert t.shape == (10**9, 10**9) and t.nnz == 1 and t.values.tolist() == [2.5]
    assert t.arrays["crd0"].tolist() == [4] and t.arrays["crd1"].tolist() == [6]
    # a size line promising more entries than the body holds: the parser says so
    short = _write(tmp_path, f"{BANNER} real general\n9 9 1000000000000\n1 1 1\n", "s.mtx")
    assert _peak_numpy_bytes(lambda: read_mtx(short), raises="promises 1000000000000") < 1 << 20
    arr = _write(tmp_path, "%%MatrixMarket matrix array real general\n100000 100000\n1\n",
                 "arr.mtx")
    assert _peak_numpy_bytes(lambda: read_mtx(arr), raises="promises 10000000000") < 1 << 20


def test_max_bytes_bounds_text_and_result(tmp_path):
    p = _write(tmp_path, f"{BANNER} real general\n300 300 2\n1 1 1\n300 300 2\n")
    with pytest.raises(ValueError, match=r"a\.mtx.*is .* more than max_bytes=10 .*max_bytes="
                                         "None"):
        read_mtx(p, max_bytes=10)
    with pytest.raises(ValueError, match="would need about"):
        read_mtx(p, max_bytes=100, format="dense")     # 300 x 300 float64 values
    assert read_mtx(p, max_bytes=None, format="dense").to_dense()[299, 299] == 2
    assert read_mtx(p, max_bytes=4000).nnz == 2


def test_gzip_is_streamed_and_a_bomb_is_refused(tmp_path):
    body = b"%%MatrixMarket matrix coordinate real general\n1 1 0\n" + b" " * (16 << 20)
    bomb = tmp_path / "bomb.mtx.gz"
    bomb.write_bytes(gzip.compress(body, 9))
    assert bomb.stat().st_size < 1 << 20
    # refused after ~2 MiB of text, not after inflating all 16
    peak = _peak_numpy_bytes(lambda: read_mtx(bomb, max_bytes=2 << 20),
                             raises=r"bomb\.mtx\.gz' decompresses to over \d+ MiB, more "
                             r"than max_bytes=2097152 \(2 MiB\)")
    assert peak < 8 << 20
    assert read_mtx(bomb).shape == (1, 1)


def test_entry_lines_of_mixed_widths_are_refused(tmp_path):
    """The numbers were read as one stream: lines of 4 and 2 numbers made two entries of 3
    (a wrong matrix, silently; scipy refuses the file)."""
    path = tmp_path / "w.mtx"
    path.write_text("%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1 1\n2 2\n")
    with pytest.raises(ValueError, match="line 3 has 4 values"):
        st.io.read_mtx(path)


def test_values_beyond_the_asked_dtype_are_refused(tmp_path):
    path = tmp_path / "i.mtx"
    path.write_text("%%MatrixMarket matrix coordinate integer general\n1 1 1\n1 1 3000000000\n")
    with pytest.raises(ValueError, match="3000000000, beyond torch.int32's range"):
        st.io.read_mtx(path, dtype=torch.int32)
    assert st.io.read_mtx(path, dtype=torch.int64).values.item() == 3000000000
    real = tmp_path / "r.mtx"
    real.write_text("%%MatrixMarket matrix coordinate real general\n1 1 1\n1 1 1e30\n")
    with pytest.raises(ValueError, match="beyond torch.int64's range"):
        st.io.read_mtx(real, dtype=torch.int64)


def test_write_mtx_checks_an_index_pair_and_takes_bytes_paths(tmp_path):
    with pytest.raises(ValueError, match="3-D with shape"):
        st.io.write_mtx(tmp_path / "a.mtx", (torch.tensor([[0, 0], [1, 1], [0, 1]]),
                                             torch.tensor([1., 2.])))
    A = st.tensor(torch.tensor([[0., 1.], [2., 0.]]))
    path = tmp_path / "b.MTX.GZ"
    st.io.write_mtx(os.fsencode(path), A)
    assert path.read_bytes()[:2] == b"\x1f\x8b"   # gzipped, whatever the suffix's case
    torch.testing.assert_close(st.io.read_mtx(path).to_dense().float(), A.to_dense())
