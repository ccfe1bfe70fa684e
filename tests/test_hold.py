"""SDDMM with the row's operand held in registers (compiler/hold.py), checked against dense.

Kernels for long rows take the held nest when the inner dimension is a whole number of
slices (16 AVX-512 registers: 256 float32 or 128 float64 values). Most tests shrink a slice
to two registers (``kernel.held_slice``) so small shapes run one, two and three slices, in
column blocks (``sblock.py``, with the small caches of ``test_sblock.py``) and in one
block; the last ones run the real slice.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from sparsetorch.codegen.kernel import compile_kernel
from sparsetorch.compiler import hold, kernel, sblock
from sparsetorch.compiler.ir import Assign, Bin, Decl, For, Lit, Load, Sym, block
from sparsetorch.compiler.sblock import column_blocked

from dense_check import LONG, check_against_dense, check_sddmm_as_written, \
    check_sddmm_gradients, examples, forget_call_memo, long_rows

needs_avx512 = pytest.mark.skipif(kernel.vector_isa() != "avx512",
                                  reason="the held nest is built with AVX-512 only")
SDDMM = "ij,ik,jk->ij"
einsum_module = importlib.import_module("sparsetorch.ops.einsum")


def _forget():
    compile_kernel.cache_clear()
    forget_call_memo()


@pytest.fixture(params=[False, True], ids=["one block", "blocked"])
def two_register_slices(request, monkeypatch):
    """Slices of two registers (32 float32, 16 float64 values); with the 'blocked' param the
    caches of ``test_sblock.small_l2`` (blocks of a 2 KB budget), else blocks as large as
    the operand."""
    _forget()
    monkeypatch.setattr(kernel, "held_slice", lambda dtype: 2 * kernel.vector_lanes(dtype))
    near = 2048 if request.param else 1 << 30
    monkeypatch.setattr(sblock, "NEAR_BYTES", 0)
    monkeypatch.setattr(kernel, "column_blocked",
                        lambda body, lw, copies, size, l2, near_, held=None: column_blocked(
                            body, lw, copies, size, 4096, near, held))
    monkeypatch.setattr(einsum_module, "l2_bytes", lambda: 4096)
    monkeypatch.setattr(einsum_module, "sampled_block_bytes", lambda: near)
    yield request.param
    monkeypatch.undo()
    _forget()


def _notes(*operands) -> str:
    return " ".join(st.explain(SDDMM, *operands).notes)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slices", [1, 2, 3])
def test_held_sddmm_matches_dense(two_register_slices, dtype, slices):
    """Rows of 40% of 300 columns plus an empty row, a row in the last columns only (it
    skips every earlier block) and a full one; a group of rows cut at a thread range."""
    lanes = kernel.vector_lanes(str(dtype).split(".")[1])
    inner = slices * 2 * lanes
    d = long_rows(sblock.GROUP_ROWS + 21, 300, 0.4, dtype, seed=slices)
    g = torch.Generator().manual_seed(slices)
    x = torch.randn(d.shape[0], inner, generator=g, dtype=dtype)
    y = torch.randn(d.shape[1], inner, generator=g, dtype=dtype)
    for index_dtype in (torch.int32, torch.int64):
        A = st.tensor(d, format="csr", index_dtype=index_dtype)
        notes = _notes(A, x, y)
        s = "s" if slices > 1 else ""
        assert f"{slices} slice{s} of {2 * lanes} values of each row in registers" in notes
        assert ("this call: blocks of" in notes) == two_register_slices
        check_against_dense(SDDMM, (A, x, y))


@needs_avx512
def test_inner_dimensions_off_the_slices_take_the_side_by_side_sums(two_register_slices):
    d = long_rows(40, 300, 0.4, torch.float32, seed=7)
    A = st.tensor(d, format="csr")
    for inner in (31, 33, 47):
        x, y = torch.randn(40, inner), torch.randn(300, inner)
        assert "values of each row in registers" not in _notes(A, x, y)
        check_against_dense(SDDMM, (A, x, y))


@needs_avx512
def test_held_sddmm_on_one_thread_and_degenerate_shapes(two_register_slices):
    d = long_rows(30, 512, 0.5, torch.float32, seed=2)
    A = st.tensor(d, format="csr")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_against_dense(SDDMM, (A, torch.randn(30, 64), torch.randn(512, 64)))
    finally:
        torch.set_num_threads(old)
    for shape in ((5, 0), (0, 300), (70, 1)):
        A = st.tensor(torch.ones(shape), format="csr")
        check_against_dense(SDDMM, (A, torch.randn(shape[0], 32), torch.randn(shape[1], 32)))


@needs_avx512
@settings(max_examples=examples(12), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rows=hst.integers(1, sblock.GROUP_ROWS + 40), cols=hst.integers(1, 400),
       per_row=hst.sampled_from([0.5, 3, 40, 200]), slices=hst.integers(1, 3),
       double=hst.booleans(), int64=hst.booleans(), seed=hst.integers(0, 2**16))
def test_held_sddmm_random_masks(two_register_slices, rows, cols, per_row, slices, double,
                                 int64, seed):
    """Random masks from a few to hundreds of entries a row (the short-row kernel or the
    long-row one), built from shuffled COO coordinates with duplicates (summed), over one to
    three slices, float32/float64 and int32/int64 indices."""
    dtype = torch.float64 if double else torch.float32
    inner = slices * kernel.held_slice(str(dtype).split(".")[1])
    g = torch.Generator().manual_seed(seed)
    nnz = int(per_row * rows)
    idx = torch.stack([torch.randint(0, rows, (nnz,), generator=g),
                       torch.randint(0, cols, (nnz,), generator=g)])
    vals = torch.randint(-3, 4, (nnz,), generator=g).to(dtype)
    A = st.tensor((idx, vals), format="csr", shape=(rows, cols),
                  index_dtype=torch.int64 if int64 else None)
    x = torch.randn(rows, inner, generator=g, dtype=dtype)
    y = torch.randn(cols, inner, generator=g, dtype=dtype)
    assert "values of each row in registers" in _notes(A, x, y)
    check_against_dense(SDDMM, (A, x, y))


@needs_avx512
@pytest.mark.parametrize("equation, extra", [
    ("ij,ik,jk,j->ij", "w"),     # a factor per column, read by the entry
    ("ij,ik,jk,i->ij", "s"),     # a factor per row, outside the sum
    ("ij,ik,jk->ij", "bias")])   # a bias and ReLU: a dense result, where partial sums wait
def test_held_sddmm_with_other_factors_and_results(two_register_slices, equation, extra):
    d = long_rows(sblock.GROUP_ROWS + 5, 300, 0.4, torch.float32, seed=5)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(d.shape[0], 64, generator=g), torch.randn(d.shape[1], 64, generator=g)
    A = st.tensor(d, format="csr")
    ops = (A, x, y) + {"w": (torch.randn(d.shape[1], generator=g),),
                       "s": (torch.randn(d.shape[0], generator=g),)}.get(extra, ())
    kw = {"bias": torch.randn(d.shape[0], 1, generator=g), "activation": "relu"} \
        if extra == "bias" else {}
    notes = " ".join(st.explain(equation, *ops).notes)
    assert "2 slices of 32 values" in notes, notes
    got = st.einsum(equation, *ops, **kw)
    got = got.to_dense() if isinstance(got, st.SparseTensor) else got
    ref = torch.einsum(equation, d, *ops[1:])
    if extra == "bias":
        ref = torch.relu(ref + kw["bias"])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def test_integer_values_take_no_held_slice():
    """Integer SDDMM has no fused multiply-add to gain from; it keeps the side-by-side sums."""
    assert kernel.held_slice("int32") is None and kernel.held_slice("int64") is None


@needs_avx512
def test_held_sddmm_gradients(two_register_slices):
    """The gradient of the mask's values is an SDDMM itself (two slices of 16 doubles)."""
    check_sddmm_gradients(long_rows(6, 300, 0.6, torch.float64, seed=3), 32,
                          "2 slices of 16 values")


@needs_avx512
@pytest.mark.parametrize("dtype,inner,slices", [
    (torch.float32, 256, 1), (torch.float32, 512, 2),
    (torch.float64, 128, 1), (torch.float64, 256, 2)])
def test_the_real_slice(dtype, inner, slices):
    """Sixteen registers, DLMC-like rows (30% of 600 columns), as the kernels run them."""
    d = long_rows(150, 600, 0.3, dtype, seed=inner)
    g = torch.Generator().manual_seed(inner)
    x = torch.randn(150, inner, generator=g, dtype=dtype)
    y = torch.randn(600, inner, generator=g, dtype=dtype)
    A = st.tensor(d, format="csr")
    notes = _notes(A, x, y)
    s = "s" if slices > 1 else ""
    assert f"{slices} slice{s} of {inner // slices} values of each row in registers" in notes
    check_against_dense(SDDMM, (A, x, y))


# -- the split of the sum (hold.held_sum) ------------------------------------------------------
def _row_loop(product, stores=None):
    """``for p: j = crd[p]; acc = 0; for k: acc += product; stores``."""
    return For("p", Lit(0), Sym("n"), block(
        Decl("idx", "j", Load("crd", Sym("p"))), Decl("val", "acc", Lit(0)),
        For("k", Lit(0), Sym("n_k"), block(Assign(Sym("acc"), product, "+=")),
            reduction="acc"),
        *(stores or [Assign(Load("out", Sym("p")), Bin("*", Load("a", Sym("p")), Sym("acc")))])))


X = Load("x", Bin("+", Bin("*", Sym("i"), Sym("n_k")), Sym("k")))
Y = Load("y", Bin("+", Bin("*", Sym("j"), Sym("n_k")), Sym("k")))


def test_held_sum_splits_the_row_operand_from_the_gathered_one():
    parts = hold.held_sum(_row_loop(Bin("*", Bin("*", X, Load("s", Sym("i"))), Y)))
    assert parts is not None and parts.held == X and parts.acc == "acc"
    assert parts.other == Bin("*", Load("s", Sym("i")), Y)   # s[i] reads no k: stays out
    assert not hold.single_slice(parts)


@pytest.mark.parametrize("product", [
    Bin("*", Y, Y),                                  # nothing reads the row alone
    Bin("*", X, Load("s", Sym("i"))),                # nothing gathered by the entry
    Bin("+", X, Y),                                  # not a product
    Bin("*", Load("x", Bin("+", Bin("*", Sym("k"), Sym("n_i")), Sym("i"))), Y),   # strided
    Bin("*", X, Load("y", Bin("*", Bin("+", Sym("j"), Sym("k")), Lit(2))))])      # strided
def test_held_sum_declines_other_sums(product):
    assert hold.held_sum(_row_loop(product)) is None


def test_stores_that_cannot_hold_a_partial_sum_allow_one_slice():
    two = [Assign(Load("out", Sym("p")), Sym("acc")), Assign(Load("o2", Sym("p")), Sym("acc"))]
    into = [Assign(Load("out", Sym("p")), Sym("acc"), "+=")]
    # reading the stored array itself: it would read the partial sum of an earlier slice
    reads = [Assign(Load("out", Sym("p")), Bin("+", Load("out", Sym("p")), Sym("acc")))]
    for stores in (two, into, reads):
        parts = hold.held_sum(_row_loop(Bin("*", X, Y), stores))
        assert parts is not None and hold.single_slice(parts)


@needs_avx512
@pytest.mark.parametrize("equation, fmt", [
    ("ij,ik,jk->ji", "csr"),     # the result transposed (CSC of the mask's pattern)
    ("ij,jk,ik->ij", "csr"),     # Y before X
    ("ji,ik,jk->ji", "csc")])    # a CSC mask whose stored columns are the long rows
def test_held_sddmm_in_other_index_orders(two_register_slices, equation, fmt):
    check_sddmm_as_written(equation, fmt, 64, "2 slices of 32 values")


@needs_avx512
def test_a_strided_row_operand_takes_no_held_nest(two_register_slices):
    """X read by columns (as written, without ``st.einsum``'s relayout): a held slice would
    be gathered, which the vector renderer does not do (nor, for the side-by-side sums,
    anything but pragmas here), so the kernel has no held nest."""
    from unittest import mock

    d = long_rows(40, 300, 0.5, torch.float32, seed=4)
    x, y = torch.randn(64, 40), torch.randn(300, 64)
    A = st.tensor(d, format="csr")
    with mock.patch.object(einsum_module, "relayout", lambda *args: None):
        ex = st.explain("ij,ki,jk->ij", A, x, y)
        assert "values of each row in registers" not in " ".join(ex.notes)
        assert "entries taken in blocks of columns" in " ".join(ex.notes)
        check_against_dense("ij,ki,jk->ij", (A, x, y))


@needs_avx512
@pytest.mark.parametrize("inner,held", [(32, True), (96, True), (40, False)])
def test_short_rows_hold_the_row_in_one_block(two_register_slices, inner, held):
    """Graph-like rows (a few entries each; kernels without column blocks) take the held
    nest too, in one block of every column, when the inner dimension is a whole number of
    slices."""
    d = long_rows(300, 400, 0.01, torch.float32, seed=inner)
    A = st.tensor(d, format="csr")
    x, y = torch.randn(300, inner), torch.randn(400, inner)
    notes = _notes(A, x, y)
    assert "entries taken in blocks of columns" not in notes
    assert ("values of each row in registers" in notes) == held, notes
    check_against_dense(SDDMM, (A, x, y))
