"""Cache blocking of SpMM's reduction (compiler/kblock.py), checked against dense.

Long rows take the blocked nest: panels of 16, 8 and 4 registers (AVX2: 8 and 4) plus a
masked remainder (so the dense widths below cross every panel boundary), row groups cut at
thread ranges, cursors that skip blocks a row has no entries in, and the epilogue at the
last block. A call blocks only when its dense operand fills L2 (``MIN_GATHERED_L2``); here it
blocks whatever that operand's size (``always_blocked``), but where a test says otherwise.
"""
from __future__ import annotations

import importlib
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from sparsetorch.compiler import kblock
from sparsetorch.compiler.kblock import GROUP_ROWS, block_coords, blocks_pay
from sparsetorch.codegen.kernel import compile_kernel
from sparsetorch.compiler.kernel import vector_isa

from dense_check import LONG, check_against_dense, examples, forget_call_memo, long_rows

needs_intrinsics = pytest.mark.skipif(vector_isa() is None, reason="no AVX-512 or AVX2 on this CPU")
# ``st.einsum`` runs these index orders as the natural one (``ops/relayout.py``); the kernels
# for them are still reached another way (``execute.run``, lazy expressions): test those.
as_written = mock.patch.object(importlib.import_module("sparsetorch.ops.einsum"), "relayout",
                               lambda *args: None)


def _forget_kernels():
    compile_kernel.cache_clear()
    forget_call_memo()


@pytest.fixture(autouse=True, scope="module")
def always_blocked():
    """Kernels built here block any call with long rows (small dense operands too, so the
    shapes below reach every path of the nest); forgotten before and after."""
    _forget_kernels()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kblock, "MIN_GATHERED_L2", 0.0)
        yield
    _forget_kernels()


@needs_intrinsics
@pytest.mark.parametrize("n_cols", [8, 700])   # X of 12 KB, of 1 MB
def test_a_call_blocks_only_when_its_dense_operand_fills_l2(monkeypatch, n_cols):
    from sparsetorch.compiler.kernel import l2_bytes

    d = long_rows(GROUP_ROWS + 5, 384, 0.4, torch.float32, seed=6)
    A, x = st.tensor(d, format="csr"), torch.randn(384, n_cols)
    _forget_kernels()
    monkeypatch.setattr(kblock, "MIN_GATHERED_L2", 1.0)
    try:
        floor = re.search(r"\((\d+) <= \(n_j \* n_k\)\)", st.explain("ij,jk->ik", A, x).source)
        assert floor and l2_bytes() // 2 < 4 * int(floor.group(1)) <= l2_bytes()   # float32
        check_against_dense("ij,jk->ik", (A, x))
    finally:
        monkeypatch.undo()
        _forget_kernels()


def test_block_rule_blocks_long_rows_only():
    # DLMC 70%-sparse 512x2048 (614 entries a row): blocks of 64 columns
    assert block_coords(314572, 512, 2048) == 64 and blocks_pay(64, 2048, 512)
    # a graph (5 entries a row): one block would cover everything
    kb = block_coords(5 * 10000, 10000, 10000)
    assert not blocks_pay(kb, 10000, 512)
    assert block_coords(0, 7, 0) == 16   # never 0 (the kernel divides by it)


@pytest.mark.slow
@needs_intrinsics
@pytest.mark.parametrize("n_cols", [1, 17, 64, 128, 200, 256, 300, 530])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocked_spmm_matches_dense(n_cols, dtype):
    d = long_rows(GROUP_ROWS + 37, 384, 0.4, dtype)
    x = torch.randn(384, n_cols, dtype=dtype)
    for index_dtype in (torch.int32, torch.int64):
        A = st.tensor(d, format="csr", index_dtype=index_dtype)
        assert "cache blocks of" in st.explain("ij,jk->ik", A, x).tiles
        check_against_dense("ij,jk->ik", (A, x))


@needs_intrinsics
@pytest.mark.parametrize("equation, x_shape", [
    ("ij,jk->ki", (384, 40)),    # the result transposed
    ("ni,oi->no", (40, 384)),    # F.linear's form: the dense operand first, out[n, o]
    ("ij,kj->ik", (40, 384)),    # the dense operand read by columns (not packed)
    ("ij,kj->ki", (40, 384))])
def test_blocked_nest_follows_the_index_order(equation, x_shape):
    # the partial sums between blocks go where the result's own index order puts them
    # (once hard-wired to out[i, k]: 'ni,oi->no' returned garbage for long rows)
    d = long_rows(GROUP_ROWS + 5, 384, 0.4, torch.float32, seed=3)
    A = st.tensor(d, format="csr")
    x = torch.randn(*x_shape)
    ops = (x, A) if equation.startswith("ni") else (A, x)
    with as_written:
        assert "cache blocks of" in st.explain(equation, *ops).tiles
        check_against_dense(equation, ops)


@pytest.mark.slow
@needs_intrinsics
@settings(max_examples=examples(10), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=hst.data())
def test_random_products_over_long_rows(data):
    """Products of a long-row CSR or CSC operand (stored rows i, long along j) and a dense
    one, each index order of the dense operand and the result, either operand first."""
    draw = data.draw
    ext = {"i": draw(hst.sampled_from([4, 70, GROUP_ROWS + 3])),
           "j": draw(hst.sampled_from([64, 200, 384])),
           "k": draw(hst.sampled_from([1, 8, 33, 96]))}
    fmt = draw(hst.sampled_from(["csr", "csc"]))
    dtype = draw(hst.sampled_from([torch.float32, torch.float64]))
    d = long_rows(ext["i"], ext["j"], draw(hst.sampled_from([0.4, 0.7])), dtype,
                  seed=draw(hst.integers(0, 99)))
    sparse_term = "ij" if fmt == "csr" else "ji"
    A = st.tensor(d if fmt == "csr" else d.T.contiguous(), format=fmt)
    dense_term = draw(hst.sampled_from(["jk", "kj"]))
    x = torch.randn(*(ext[c] for c in dense_term), dtype=dtype)
    out = draw(hst.sampled_from(["ik", "ki"]))
    terms, ops = [sparse_term, dense_term], [A, x]
    if draw(hst.booleans()):
        terms, ops = terms[::-1], ops[::-1]
    equation = f"{terms[0]},{terms[1]}->{out}"
    check_against_dense(equation, tuple(ops))
    with as_written:
        check_against_dense(equation, tuple(ops))


@needs_intrinsics
@pytest.mark.slow   # ~2 s (the full suite runs it)
def test_blocked_spmm_on_one_thread_and_with_epilogue(monkeypatch):
    d = long_rows(70, 256, 0.5, torch.float32, seed=1)
    A = st.tensor(d, format="csr")
    x = torch.randn(256, 96)
    bias = torch.randn(96)
    got = st.einsum("ij,jk->ik", A, x, bias=bias, activation="relu")
    torch.testing.assert_close(got, torch.relu(d @ x + bias), rtol=1e-4, atol=1e-4)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(st.einsum("ij,jk->ik", A, x), d @ x, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


@needs_intrinsics
def test_short_rows_get_the_plain_kernel():
    d = long_rows(50, 400, 0.02, torch.float32)
    A = st.tensor(d, format="csr")
    x = torch.randn(400, 64)
    e = st.explain("ij,jk->ik", A, x)
    assert "cache block" not in e.tiles and "blocked by coordinate" not in " ".join(e.notes)
    check_against_dense("ij,jk->ik", (A, x))
    # the same call with long rows gets its own kernel (and memo entry), blocked
    B = st.tensor(long_rows(50, 400, 0.5, torch.float32), format="csr")
    assert "cache blocks of" in st.explain("ij,jk->ik", B, x).tiles
    torch.testing.assert_close(st.einsum("ij,jk->ik", A, x), d @ x, rtol=1e-4, atol=1e-4)
    check_against_dense("ij,jk->ik", (B, x))


@needs_intrinsics
def test_unordered_rows_are_sorted_or_not_blocked():
    """Rows whose columns are stored out of order (a compressed level declared unordered,
    built with ``from_levels``): the blocked nest walks a row's columns up to a block's end
    (reading outside its packed panel on such rows), so kernels get them sorted
    (``execute.normalize_operands``) and the block rule itself declines them."""
    d = long_rows(GROUP_ROWS + 5, 384, 0.5, torch.float32, seed=8)
    A = st.tensor(d, format="csr")
    pos, crd, vals = A.arrays["pos1"], A.arrays["crd1"].clone(), A.values.clone()
    for i in range(d.shape[0]):                 # each row's entries reversed
        s, e = int(pos[i]), int(pos[i + 1])
        crd[s:e], vals[s:e] = crd[s:e].flip(0), vals[s:e].flip(0)
    fmt = st.Format((st.dense, st.Compressed(ordered=False)))
    U = st.SparseTensor.from_levels(d.shape, fmt, {"pos1": pos, "crd1": crd}, vals)
    assert kblock.long_rows(A.format, d.shape, A.nnz, 512)
    assert not kblock.long_rows(fmt, d.shape, A.nnz, 512)
    x = torch.randn(384, 256)
    torch.testing.assert_close(U @ x, d @ x, rtol=1e-4, atol=1e-4)
    y, z = torch.randn(d.shape[0], 64), torch.randn(384, 64)
    torch.testing.assert_close(st.einsum("ij,ik,jk->ij", U, y, z).to_dense(),
                               d * (y @ z.T), rtol=1e-4, atol=1e-4)


@needs_intrinsics
def test_blocked_spmm_gradients():
    d = long_rows(8, 128, 0.6, torch.float64, seed=2)
    A = st.tensor(d, format="csr")
    assert "cache blocks of" in st.explain("ij,jk->ik", A, torch.zeros(128, 3,
                                                                   dtype=torch.float64)).tiles
    vals = A.values.clone().requires_grad_()
    x = torch.randn(128, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v, x: st.einsum("ij,jk->ik", A.with_values(v), x),
                             (vals, x))


@needs_intrinsics
@pytest.mark.parametrize("shape", [(5, 0), (0, 40), (300, 1)])
def test_degenerate_shapes_run_unblocked(shape):
    A = st.tensor(torch.ones(shape), format="csr")
    check_against_dense("ij,jk->ik", (A, torch.randn(shape[1], 70)))


@needs_intrinsics
def test_traced_calls_match_the_blocked_eager_result():
    """Under torch.compile the entry count is symbolic, so the traced call runs the plain
    kernel; the blocked one sums each row in the same order, so results are identical."""
    d = long_rows(40, 256, 0.5, torch.float32, seed=3)
    A = st.tensor(d, format="csr")
    x = torch.randn(256, 20)
    eager = A @ x
    assert "cache blocks of" in st.explain("ij,jk->ik", A, x).tiles
    compiled = torch.compile(lambda a, b: a @ b, backend="aot_eager", fullgraph=True)(A, x)
    assert torch.equal(compiled, eager)


@needs_intrinsics
def test_blocked_spmm_reads_in_place_without_its_buffer(monkeypatch):
    """A block's slice of the dense operand is packed into a buffer allocated per row
    group; when that allocation fails the nest reads the operand in place, same results."""
    from sparsetorch.codegen import c

    def forget():
        compile_kernel.cache_clear()
        forget_call_memo()
    forget()
    monkeypatch.setitem(c._HELPERS, "alloc_pack", ["void* xpack_raw = 0;", "val_t* xpack = 0;"])
    try:
        d = long_rows(GROUP_ROWS + 5, 384, 0.4, torch.float64, seed=5)
        A = st.tensor(d, format="csr")
        x = torch.randn(384, 100, dtype=torch.float64)
        assert "val_t* xpack = 0;" in st.explain("ij,jk->ik", A, x).source
        check_against_dense("ij,jk->ik", (A, x))
    finally:
        monkeypatch.undo()
        forget()
