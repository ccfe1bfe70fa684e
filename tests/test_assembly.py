"""Sparse-result assembly, checked against torch: the row workspace of SpGEMM-like products
(a dense row accumulator, or a hashed one for dimensions too large for it) and the ways a
row's cells come out in order: the sorting networks (AVX-512 and AVX2), insertion sort, and
the bitmap scan of rows found at least half full. (Split from ``test_einsum.py``.)
"""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from dense_check import check_against_dense, forget_call_memo, private_kernel_cache  # noqa: F401
from sparsetorch.codegen.kernel import compile_kernel
from sparsetorch.compiler import assemble

F64 = torch.float64
CSF = "csf"


@pytest.fixture(params=["bitmaps", "marks"])
def row_cells(request, monkeypatch):
    """Result rows' cells from bitmaps of the gathered rows wherever the loop nest allows
    them, however few entries those rows hold ('bitmaps'), or never ('marks': the marked
    passes), so a test runs both whatever its densities; kernels and memoised calls built
    under either are forgotten afterwards."""
    def forget():
        compile_kernel.cache_clear()
        forget_call_memo()
    forget()
    always = request.param == "bitmaps"
    monkeypatch.setattr(assemble, "ROW_BITS_FIXED", -(1 << 20) if always else 1 << 20)
    monkeypatch.setattr(assemble, "ROW_BITS_MAX_WORDS", 1 << 20)
    yield request.param
    monkeypatch.undo()
    forget()


def _same_as_torch_product(r, A, B):
    """``r`` is a valid SparseTensor holding exactly the entries of ``A @ B`` (torch COO)."""
    st.SparseTensor.from_levels(r.shape, r.format, r.arrays, r.values, check=True)
    want = (A.to_torch().to_sparse_coo() @ B.to_torch().to_sparse_coo()).coalesce()
    got = r.to_torch().to_sparse_coo().coalesce()
    assert torch.equal(got.indices(), want.indices())
    torch.testing.assert_close(got.values(), want.values(), rtol=1e-10, atol=0)


@pytest.mark.slow   # ~2 s (the full suite runs it)
def test_huge_dimension_uses_a_hashed_workspace():
    """A 2**25-column SpGEMM: a dense row workspace would be 256 MiB per thread."""
    n = 2 ** 25
    idx = torch.tensor([[0, 1, 2, 3, 3], [5, n - 1, 12345678, 5, n - 2]])
    B = st.tensor((idx, torch.tensor([1.0, 2, 3, 4, 5], dtype=F64)), shape=(4, n), format="csr")
    A = st.tensor(torch.tensor([[1.0, 0, 2, 0], [0, 3, 0, 4], [0, 0, 0, 0]], dtype=F64), "csr")
    e = st.explain("ij,jk->ik", A, B)
    assert e.workspace and "dense" not in e.workspace[0]
    r = st.einsum("ij,jk->ik", A, B)
    assert isinstance(r, st.SparseTensor) and r.shape == (3, n)
    _same_as_torch_product(r, A, B)


@pytest.mark.slow
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("arrival", ["scrambled", "in order", "one pair swapped",
                                     "with repeats"])
@pytest.mark.parametrize("width", [3000, 33000])
def test_spgemm_rows_of_every_cell_count_are_sorted(arrival, width, dtype, index_dtype):
    """Row r of A @ B touches r + 1 cells (1-80: the sorting networks' 6-32 and 33-64 (AVX2:
    6-64), the insertion sort and the bitmap scan around them; the wider B leaves rows of
    up to 64 cells to the sorts, the narrower scans from 25), arriving scrambled, in order,
    in order but for one pair (AVX2: insertion sort for rows out of order at one place), or
    each twice; the result has sorted unique columns and the dense product's values."""
    gen = torch.Generator().manual_seed(7)
    rows = 80
    cols = torch.randperm(width, generator=gen)[:rows] if arrival in ("scrambled",
                                                                      "with repeats") else \
        torch.arange(rows) * 37
    if arrival == "one pair swapped":
        cols[[10, 40]] = cols[[40, 10]]
    b_idx = torch.stack([torch.arange(rows), cols])      # B row k: one entry, column cols[k]
    if arrival == "with repeats":                        # and the previous row's column
        b_idx = torch.cat([b_idx, torch.stack([torch.arange(1, rows), cols[:-1]])], 1)
    B = st.tensor((b_idx, torch.rand(b_idx.shape[1], generator=gen, dtype=dtype) + 0.5),
                  shape=(rows, width), format="csr", index_dtype=index_dtype)
    A = st.tensor(torch.tril(torch.rand(rows, rows, generator=gen, dtype=dtype) + 0.5),
                  format="csr", index_dtype=index_dtype)   # row r: columns 0..r
    r = st.einsum("ij,jk->ik", A, B)
    st.SparseTensor.from_levels(r.shape, r.format, r.arrays, r.values, check=True)
    assert torch.equal(r.arrays["pos1"].diff(), torch.arange(1, rows + 1).to(r.index_dtype))
    torch.testing.assert_close(r.to_dense(), A.to_dense() @ B.to_dense(),
                               rtol=1e-10 if dtype == F64 else 1e-5, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_spgemm_many_random_rows_of_6_to_64_cells_are_sorted(seed):
    """Hundreds of result rows of 6-64 cells in random order, over a width that leaves them
    all to the sorts (not the bitmap scan): the networks must order every one of them. A
    missorted row would hold the network's padding and fail the validation."""
    gen = torch.Generator().manual_seed(seed)
    rows, inner, width = 400, 1000, 40000
    a_rows = torch.arange(rows).repeat_interleave(torch.arange(rows) % 11 + 1)
    a = torch.stack([a_rows, torch.randint(inner, a_rows.shape, generator=gen)])
    b_rows = torch.arange(inner).repeat_interleave(torch.randint(1, 7, (inner,), generator=gen))
    b = torch.stack([b_rows, torch.randint(width, b_rows.shape, generator=gen)])
    A = st.tensor((a, torch.rand(a.shape[1], generator=gen, dtype=F64)), shape=(rows, inner),
                  format="csr")
    B = st.tensor((b, torch.rand(b.shape[1], generator=gen, dtype=F64)), shape=(inner, width),
                  format="csr")
    r = st.einsum("ij,jk->ik", A, B)
    cells = r.arrays["pos1"].diff()
    assert ((cells >= 6) & (cells <= 64)).sum() > rows // 2
    _same_as_torch_product(r, A, B)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("eq,fmts", [("ij,jk->ik", ("csr", "csr")), ("ij,jk->ik", ("csr", "dcsr")),
                                     ("ij,jk->ik", ("dcsr", "csr")), ("ikj,jl->ikl", (CSF, "csr"))])
def test_spgemm_rows_half_full_or_more_are_scanned(eq, fmts, index_dtype, row_cells):
    """Result rows the count pass finds at least half full skip the cell list: their cells
    are marked and the workspace scanned in order. Full, half-full, sparse and empty rows,
    under a dense or a compressed outer loop."""
    gen = torch.Generator().manual_seed(11)
    shapes = {"ij,jk->ik": ((40, 30), (30, 24)), "ikj,jl->ikl": ((12, 3, 30), (30, 8))}[eq]
    a = (torch.rand(*shapes[0], generator=gen) < 0.08).double() * torch.rand(*shapes[0],
                                                                             generator=gen)
    a[0] = 1.0                    # a full row of A: its result row is as full as B allows
    a[1] = 0.0                    # an empty one
    b = (torch.rand(*shapes[1], generator=gen) < 0.5).double() * torch.rand(*shapes[1],
                                                                            generator=gen)
    ops = [st.tensor(a, format=fmts[0], index_dtype=index_dtype),
           st.tensor(b, format=fmts[1], index_dtype=index_dtype)]
    assert "ws_at < ws_size" in st.explain(eq, *ops).source
    check_against_dense(eq, ops, kind="sparse")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fmt", ["csr", "dcsr", "coo"])
def test_spgemm_full_rows_skip_the_marks(dtype, index_dtype, fmt, row_cells):
    """Result rows that fill every workspace cell: the count pass stops taking a row's
    products once all cells are marked, and the fill pass adds without marks and emits
    every cell. Rows full early, full only at their last product, nearly full, empty. A
    COO operand's rows are not slices of their own (one count for all): no full-row fill."""
    gen = torch.Generator().manual_seed(12)
    a = (torch.rand(9, 20, generator=gen) < 0.7).to(dtype) * torch.rand(9, 20, generator=gen,
                                                                         dtype=dtype)
    b = (torch.rand(20, 16, generator=gen) < 0.6).to(dtype) * torch.rand(20, 16, generator=gen,
                                                                         dtype=dtype)
    b[19] = 0.0
    b[19, 15] = 2.0               # the only product reaching column 15
    b[:19, 15] = 0.0
    a[1] = 0.0
    a[1, 19] = 1.0                # row 1: only that product, a single cell
    a[2, 19] = 0.0                # row 2: every cell but column 15
    a[3] = 0.0                    # row 3: empty
    a[4, 19] = 1.0                # row 4 (dense A row): full once its last product lands
    ops = [st.tensor(a, format=fmt, index_dtype=index_dtype),
           st.tensor(b, format="csr", index_dtype=index_dtype)]
    src = st.explain("ij,jk->ik", *ops).source
    assert "ws_n < ws_size" in src and (") == ws_size))" in src) == (fmt != "coo")
    r = st.einsum("ij,jk->ik", *ops)
    assert r.to_dense()[4].count_nonzero() == 16 and r.to_dense()[2, 15] == 0
    _same_as_torch_product(r, *ops)


@pytest.mark.parametrize("fmt", ["coo", CSF])
def test_spgemm_slice_of_several_rows_is_not_a_full_row(fmt, row_cells):
    """A slice holding several workspace rows (COO's one slice; CSF's rows per i) whose
    total count equals the workspace size is not a full row: only its marked cells are
    emitted (emitting every cell of every row would overrun the result)."""
    if fmt == "coo":
        a = torch.eye(2, dtype=F64)
        b = torch.tensor([[1., 2., 0., 0.], [0., 0., 3., 4.]], dtype=F64)   # 4 entries, 4 cells
        eq = "ij,jk->ik"
    else:
        a = torch.zeros(1, 2, 2, dtype=F64)
        a[0, 0, 0] = a[0, 1, 1] = 1.0          # slice i = 0 holds rows (0, 0) and (0, 1)
        b = torch.tensor([[1., 2., 0., 0.], [0., 0., 3., 4.]], dtype=F64)
        eq = "ikj,jl->ikl"
    ops = [st.tensor(a, format=fmt), st.tensor(b, format="csr")]
    check_against_dense(eq, ops, kind="sparse")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("eq,fmts,width", [
    ("ij,jk->ik", ("csr", "csr"), 1), ("ij,jk->ik", ("csr", "csr"), 64),
    ("ij,jk->ik", ("csr", "csr"), 70), ("ij,jk->ik", ("dcsr", "dcsr"), 130),
    ("ij,jk->ik", ("coo", "csr"), 70), ("ikj,jl->ikl", (CSF, "csr"), 70),
    ("bij,bjk->bik", (CSF, CSF), 70)])
def test_spgemm_rows_from_row_bitmaps(eq, fmts, width, dtype, index_dtype, row_cells):
    """Both passes through bitmaps of the gathered rows of B and through marks give the
    product: rows empty, of one cell, sparse, dense and full; B rows empty (DCSR stores
    none for them) and full; widths of one word, exactly one, and not whole words."""
    gen = torch.Generator().manual_seed(width)
    shape_a, shape_b = {"ij,jk->ik": ((9, 12), (12, width)),
                        "ikj,jl->ikl": ((4, 3, 12), (12, width)),
                        "bij,bjk->bik": ((2, 9, 12), (2, 12, width))}[eq]
    a = (torch.rand(*shape_a, generator=gen) < 0.4).to(dtype) * torch.rand(*shape_a,
                                                                           generator=gen,
                                                                           dtype=dtype)
    b = (torch.rand(*shape_b, generator=gen) < 0.3).to(dtype) * torch.rand(*shape_b,
                                                                           generator=gen,
                                                                           dtype=dtype)
    a[..., 0, :] = 0.0            # an empty result row
    a[..., 1, :] = 0.0
    a[..., 1, 11] = 1.0           # a row gathering only B's row 11: one cell
    b[..., 11, :] = 0.0
    b[..., 11, width - 1] = 3.0
    a[..., 2, :] = 1.0            # a row gathering every row of B, one of them full
    b[..., 5, :] = 2.0
    b[..., 7, :] = 0.0            # an empty row of B
    ops = [st.tensor(a, format=fmts[0], index_dtype=index_dtype),
           st.tensor(b, format=fmts[1], index_dtype=index_dtype)]
    assert "st_rowbits" in st.explain(eq, *ops).source
    check_against_dense(eq, ops, kind="sparse")


@pytest.mark.parametrize("threads", [1, 2])
def test_row_bitmaps_per_thread(threads, row_cells):
    """A product large enough for the thread team: each thread ORs, counts and lists in its
    own slice of the row bits (several words a row), with bitmaps and with marks."""
    gen = torch.Generator().manual_seed(5)
    a = (torch.rand(300, 200, generator=gen) < 0.1).double() * torch.rand(300, 200,
                                                                          generator=gen)
    b = (torch.rand(200, 260, generator=gen) < 0.2).double() * torch.rand(200, 260,
                                                                          generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        r = st.einsum("ij,jk->ik", st.tensor(a, "csr"), st.tensor(b, "csr"))
    finally:
        torch.set_num_threads(before)
    _same_as_torch_product(r, st.tensor(a, "csr"), st.tensor(b, "csr"))


def test_row_bitmaps_only_for_whole_gathered_rows():
    """Bitmaps stand for whole gathered rows: not where two operands meet at the innermost
    level (A @ (B * C): a cell needs both B and C there), nor with a hashed workspace."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = (st.tensor((torch.rand(*s, generator=gen) < 0.5).double(), "csr")
               for s in ((6, 5), (5, 7), (5, 7)))
    assert "st_rowbits" in st.explain("ij,jk->ik", a, b).source
    assert "st_rowbits" not in st.explain("ij,jk,jk->ik", a, b, c).source
    check_against_dense("ij,jk,jk->ik", [a, b, c], kind="sparse")
    n = 2 ** 25
    huge = st.tensor((torch.tensor([[0, 1], [5, n - 1]]), torch.ones(2, dtype=F64)),
                     shape=(2, n), format="csr")
    assert "st_rowbits" not in st.explain("ij,jk->ik", st.tensor(torch.eye(2, dtype=F64),
                                                                  "csr"), huge).source
