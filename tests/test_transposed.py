"""``Aᵀ X`` for a sorted CSR ``A`` by threads that own output rows (``ops/transposed.py``):
against dense over dtypes, index dtypes, widths around the vector length, empty and
degenerate shapes and thread splits; taken by ``st.einsum``, ``A.T @ X`` and the backward
of ``A @ X`` without re-laying ``A``; its per-pattern table kept and rebuilt; what it
leaves to the general path."""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from sparsetorch.ops import execute as execute_module, transposed as transposed_module
from sparsetorch.ops.transposed import spmm_transposed

from dense_check import check_against_dense, private_kernel_cache, random_dense  # noqa: F401

F64 = torch.float64


def _csr(shape, dtype=F64, seed=0, density=0.3, index_dtype=None):
    x = random_dense(shape, density, dtype, torch.Generator().manual_seed(seed),
                     empty_slices=True)
    return st.tensor(x, "csr", index_dtype=index_dtype), x


@pytest.fixture
def parallel(monkeypatch):
    """Every call split across threads, however small."""
    monkeypatch.setattr(transposed_module, "_PARALLEL_WORK", 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("width", [1, 3, 8, 16, 17, 32, 33, 128])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_matches_dense(dtype, index_dtype, width, threads, parallel):
    A, a = _csr((9, 7), dtype, seed=width, index_dtype=index_dtype)
    X = torch.randn(9, width, dtype=dtype)
    torch.set_num_threads(threads)
    try:
        got = spmm_transposed(A, X, 0.5)
    finally:
        torch.set_num_threads(2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, 0.5 * a.T @ X, **tol)


@pytest.mark.parametrize("shape,width", [((0, 4), 3), ((4, 0), 3), ((5, 4), 0), ((1, 1), 5),
                                         ((3, 1), 2), ((1, 6), 2)])
def test_empty_and_size_one_shapes(shape, width, parallel):
    A, a = _csr(shape, seed=1, density=0.7)
    X = torch.randn(shape[0], width, dtype=F64)
    torch.testing.assert_close(spmm_transposed(A, X), a.T @ X)
    empty = st.tensor(torch.zeros(shape, dtype=F64), "csr")   # nnz = 0
    assert spmm_transposed(empty, X).eq(0).all()


def test_more_threads_than_columns_and_one_crowded_column(parallel):
    dense = torch.zeros(8, 3, dtype=F64)
    dense[:, 1] = torch.arange(1, 9, dtype=F64)   # every entry in one column
    dense[2, 0] = 5.0
    A, X = st.tensor(dense, "csr"), torch.randn(8, 4, dtype=F64)
    torch.set_num_threads(4)
    try:
        got = spmm_transposed(A, X)
    finally:
        torch.set_num_threads(2)
    torch.testing.assert_close(got, dense.T @ X)


def test_einsum_transposes_and_backward_take_it_without_relaying(monkeypatch, parallel):
    relays, calls = [], []
    real_relaid, real_spmm = execute_module.relaid, transposed_module.spmm_transposed
    monkeypatch.setattr(execute_module, "relaid", lambda *a: relays.append(1) or real_relaid(*a))
    monkeypatch.setattr(transposed_module, "spmm_transposed",
                        lambda *a: calls.append(1) or real_spmm(*a))
    A, a = _csr((12, 10), seed=3)
    X = torch.randn(12, 5, dtype=F64)
    check_against_dense("ji,jk->ik", [A, X])
    check_against_dense(lambda s, x: s.T @ x, [A, X])
    check_against_dense("ij,ik->kj", [A, X])   # (the result's transpose: another path)
    assert "ops/transposed.py" in str(st.explain("ji,jk->ik", A, X))
    assert "ops/transposed.py" not in str(st.explain("ij,jk->ik", A, X[:10]))
    W = A.with_values(A.values.clone().requires_grad_())
    Y = torch.randn(10, 4, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda v, y: st.einsum("ij,jk->ik", A.with_values(v), y),
                             (A.values.clone().requires_grad_(), Y))
    calls.clear()
    (W @ Y).square().sum().backward()   # dY = Aᵀ (2 A Y)
    assert calls and not relays
    torch.testing.assert_close(Y.grad, 2 * a.T @ (a @ Y.detach()))


def test_the_table_is_kept_with_the_pattern_and_rebuilt_when_it_changes(parallel):
    dense = torch.zeros(6, 4, dtype=F64)
    dense[0, 0], dense[1:, 2:] = 3.0, 1.0   # row 0 holds one entry: it can move, sorted
    A, X = st.tensor(dense, "csr"), torch.randn(6, 3, dtype=F64)
    spmm_transposed(A, X)
    kept = transposed_module._TABLES[A._pos1]
    first = next(iter(kept.values()))
    spmm_transposed(A.with_values(A.values * 2), X)   # new values, same pattern
    assert next(iter(kept.values())) is first
    A._crd1[0] = 3   # the pattern changed in place: the table is made anew
    dense[0, 0], dense[0, 3] = 0.0, 3.0
    torch.testing.assert_close(spmm_transposed(A, X), dense.T @ X)
    assert next(iter(kept.values())) is not first


def test_what_it_leaves_to_the_general_path():
    A, _ = _csr((6, 5), seed=5)
    X = torch.randn(6, 3, dtype=F64)
    from sparsetorch.compiler.notation import parse_einsum

    def offered(eq, ops, out_format=None):
        return transposed_module.transposed_product(
            parse_einsum(eq, [t.dim() for t in ops]), ops, out_format) is not None

    assert offered("ji,jk->ik", (A, X)) and offered("jk,ji->ik", (X, A))
    assert not offered("ij,jk->ik", (A, torch.randn(5, 3, dtype=F64)))   # as stored
    assert not offered("ji,jk->ik", (st.tensor(A.to_dense(), "csc"), X))
    assert not offered("ji,jk->ik", (st.tensor(A.to_dense(), "coo"), X))
    assert not offered("ji,jk->ik", (A, X.float()))                      # mixed dtypes
    assert not offered("ji,jk->ik", (A, X), "csr")                       # a sparse result
    assert not offered("ji,jk->ki", (A, X))                              # transposed out
    with pytest.raises(ValueError, match="rows"):
        spmm_transposed(A, torch.randn(4, 3, dtype=F64))
