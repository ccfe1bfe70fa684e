"""Dense operands and results laid out with the vectorised index last (ops/relayout.py):
which calls are rewritten, that their results, gradients and errors are those of the
equation as written, and that ``F.linear``, ``x @ W.T`` and ``X.T @ A.T`` take the path.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from sparsetorch.ops import execute, relayout as relayout_module, transpose
from sparsetorch.ops.relayout import Relayout, relayout

from dense_check import check_against_dense, long_rows, random_dense

F32, F64 = torch.float32, torch.float64


@pytest.fixture(autouse=True)
def always_permuted(monkeypatch):
    """Rewrite the small products of these tests too (``MIN_PERMUTED_WORK``)."""
    monkeypatch.setattr(relayout_module, "MIN_PERMUTED_WORK", 0)


def _csr(shape, dtype=F64, seed=0, fmt="csr"):
    g = torch.Generator().manual_seed(seed)
    d = random_dense(shape, 0.3, dtype, g)
    d[0] = 0   # an empty row
    return st.tensor(d, fmt)


# -- which calls are rewritten ----------------------------------------------------------------
def test_plans():
    W, x = _csr((5, 4)), torch.randn(3, 4, dtype=F64)
    assert relayout("ni,oi->no", (x, W), None, None) == \
        Relayout("in,oi->on", ((1, 0), None), (1, 0), "i,oi->o", (0, None), 0, 2)
    assert relayout("ij,kj->ik", (W, x), None, None) == \
        Relayout("ij,jk->ik", (None, (1, 0)), None, "ij,j->i", (None, 0), 1, 2)
    assert relayout("ij,jk->ki", (W, x.T), None, None) == \
        Relayout("ij,jk->ik", (None, None), (1, 0), "ij,j->i", (None, 1), 0, 2)
    # SDDMM reading X by columns: the reduction index moves; size 1: no reduction left
    assert relayout("ij,ki,jk->ij", (W, x.T, x), None, None) == \
        Relayout("ij,ik,jk->ij", (None, (1, 0), None), None, "ij,i,j->ij", (None, 0, 1), None,
                 2)
    # already in order, or nothing to move: as written
    for eq, ops in [("ij,jk->ik", (W, x.T)), ("ij,j->i", (W, x[0])), ("ij,ij->i", (W, W))]:
        assert relayout(eq, ops, None, None) is None
    # not a plain equation, two dense-only indices, a torch sparse layout: as written
    y = torch.randn(4, 3, 2, dtype=F64)
    for eq, ops in [("ni,oi", (x, W)), ("...i,oi->...o", (x, W)), ("nii,oi->no", (y, W)),
                    ("ij,jkl->lik", (W, y)), ("ni,oi->no", (x, W.to_dense().to_sparse()))]:
        assert relayout(eq, ops, None, None) is None, eq


def test_the_result_is_permuted_only_where_it_is_dense():
    x = torch.randn(3, 4, dtype=F64)
    A = _csr((5, 4), fmt="csc")   # stores rows o in its compressed level: o could be sparse
    assert relayout("ni,oi->no", (x, A), None, None).out_perm is None
    assert relayout("ni,oi->no", (x, A), "dense", None).out_perm == (1, 0)
    W = _csr((5, 4))
    assert relayout("ni,oi->no", (x, W), "coo", None).out_perm is None
    # a bias makes the result dense (an epilogue's): it moves too, the bias with it
    plan = relayout("ni,oi->no", (x, A), None, torch.zeros(5, dtype=F64))
    assert plan.out_perm == (1, 0) and plan.perms == ((1, 0), None)
    assert relayout("ni,oi->no", (x, A), None, None).squeezed is None   # o may be sparse


def test_a_moved_index_of_size_1_is_squeezed_out():
    W, x = _csr((5, 4), seed=7), torch.randn(1, 4, dtype=F64)
    execute._FAST_DENSE.pop("i,oi->o", None)
    for got in (F.linear(x, W), x @ W.T, st.einsum("ni,oi->no", x, W, out_format="dense")):
        torch.testing.assert_close(got, x @ W.to_dense().T)
        assert got.shape == (1, 5) and got.is_contiguous()
    assert execute.fast_calls("i,oi->o", "dense")   # SpMV ran, not a one-column SpMM


def test_small_products_run_as_written_and_leave_no_shim_behind(monkeypatch):
    """Below ``MIN_PERMUTED_WORK`` the call runs as written; its shim is not offered to the
    fast path, so a later large call of the same string is still rewritten."""
    monkeypatch.setattr(relayout_module, "MIN_PERMUTED_WORK", 2000)
    copies = []
    real = relayout_module.permuted
    monkeypatch.setattr(relayout_module, "permuted",
                        lambda t, p: copies.append(tuple(t.shape)) or real(t, p))
    execute._FAST.pop("ni,oi->no", None)
    W = _csr((60, 50), seed=3)   # 0.3 dense, an empty row: about 880 stored entries
    small, large = torch.randn(2, 50, dtype=F64), torch.randn(3, 50, dtype=F64)
    assert 2 * W.nnz < 2000 <= 3 * W.nnz
    for _ in range(2):
        check_against_dense("ni,oi->no", [small, W])
    assert copies == [] and not execute.fast_calls("ni,oi->no")
    assert not any("run as" in n for n in st.explain("ni,oi->no", small, W).notes)
    got = st.einsum("ni,oi->no", large, W)
    assert copies == [(3, 50), (60, 3)]   # x in, the result out
    torch.testing.assert_close(got, large @ W.to_dense().T, rtol=1e-10, atol=1e-12)


# -- results, as written ----------------------------------------------------------------------
CASES = [   # equation, operand specs: (shape, format) sparse or shape dense
    ("ni,oi->no", [(3, 7), ((5, 7), "csr")]),
    ("ni,oi->no", [(1, 7), ((5, 7), "coo")]),
    ("ij,kj->ik", [((6, 7), "csr"), (4, 7)]),
    ("ij,kj->ki", [((6, 7), "dcsr"), (4, 7)]),
    ("ij,jk->ki", [((6, 7), "csr"), (7, 9)]),
    ("ij,ki,jk->ij", [((6, 7), "csr"), (5, 6), (7, 5)]),   # SDDMM, X read by columns
    ("bij,bkj->bik", [((2, 6, 7), "csf"), (2, 3, 7)]),
    ("ni,oi->no", [(3, 1), ((5, 1), "csr")]),
    ("ni,oi->no", [(4, 7), ((1, 7), "csr")]),
]


def _operands(specs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ops = []
    for spec in specs:
        if isinstance(spec[0], tuple):
            d = random_dense(spec[0], 0.4, dtype, g)
            ops.append(st.tensor(d, spec[1]))
        else:
            ops.append(torch.randn(spec, dtype=dtype, generator=g))
    return ops


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("equation,specs", CASES, ids=[c[0] for c in CASES])
def test_rewritten_calls_match_dense(equation, specs, dtype):
    ops = _operands(specs, dtype)
    assert relayout(equation, ops, None, None) is not None
    for _ in range(2):   # the second call: memoised shims
        out = check_against_dense(equation, ops)
    if not isinstance(out, st.SparseTensor):
        assert out.is_contiguous()
    check_against_dense(equation, ops, out_format="dense")


def test_nnz_zero_and_a_dense_operand_already_in_order():
    W = st.tensor(torch.zeros(5, 7, dtype=F64), "csr")
    check_against_dense("ni,oi->no", [torch.randn(3, 7, dtype=F64), W])
    xt = torch.randn(7, 3, dtype=F64)   # x = xt.T: permuting it back is free
    check_against_dense("ni,oi->no", [xt.T, _csr((5, 7))])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csr", "csc"])
def test_long_rows_through_the_torch_api(fmt):
    d = long_rows(40, 300, 0.4, F32, seed=5)
    W = st.tensor(d, fmt)
    x, b = torch.randn(17, 300), torch.randn(40)
    tol = dict(rtol=1e-4, atol=1e-3)
    for got in (F.linear(x, W), F.linear(x, W, b) - b, x @ W.T, torch.matmul(x, W.T),
                (W @ x.T).T):
        torch.testing.assert_close(got, x @ d.T, **tol)
        assert got.is_contiguous() or got.stride() == (1, 17)
    X = torch.randn(300, 23)
    got = X.T @ W.T    # a dense view of the transposed X: no copy on the way in
    torch.testing.assert_close(got, X.T @ d.T, **tol)
    assert got.is_contiguous()
    # F.linear goes to the memoised natural call (``out_format="dense"`` from the torch API)
    assert execute.fast_calls("in,oi->on", "dense")


# -- gradients and errors ---------------------------------------------------------------------
def test_gradients_flow_through_the_permutations():
    W = _csr((5, 4), seed=2)
    vals = W.values.clone().requires_grad_()
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda v, x: st.einsum("ni,oi->no", x, W.with_values(v)),
                             (vals, x))
    b = torch.randn(5, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda v, x, b: F.linear(x, W.with_values(v), b), (vals, x, b))


def test_errors_are_those_of_the_equation_as_written(monkeypatch):
    W = _csr((5, 4))
    bad = [(ValueError, (torch.randn(3, 6, dtype=F64), W)),   # i: 6 against 4
           (TypeError, (torch.randn(3, 4, dtype=F64).to_sparse(), W))]   # torch sparse
    got = []
    for error, ops in bad:
        with pytest.raises(error) as e:
            st.einsum("ni,oi->no", *ops)
        got.append(str(e.value))
    monkeypatch.setattr(importlib.import_module("sparsetorch.ops.einsum"), "relayout",
                        lambda *args: None)
    for (error, ops), message in zip(bad, got):
        with pytest.raises(error) as e:
            st.einsum("ni,oi->no", *ops)
        assert str(e.value) == message


def test_explain_tells_the_rewrite():
    W, x = _csr((5, 4)), torch.randn(3, 4, dtype=F64)
    e = st.explain("ni,oi->no", x, W)
    assert e.loop_order == ("o", "i", "n")
    assert any("run as 'in,oi->on'" in n and "permuted back" in n for n in e.notes)
    e = st.explain("ni,oi->no", x[:1], W)   # one row: SpMV
    assert e.loop_order == ("o", "i") and any("run as 'i,oi->o'" in n for n in e.notes)


def test_under_torch_compile():
    W, x = _csr((5, 4)), torch.randn(3, 4, dtype=F64)
    for fn in (lambda x: st.einsum("ni,oi->no", x, W), lambda x: F.linear(x, W)):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), x @ W.to_dense().T)


# -- transposing copies (ops/transpose.py) ----------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64, torch.int32, torch.int64])
@pytest.mark.parametrize("shape,perm", [
    ((40, 33), (1, 0)), ((33, 40), (1, 0)), ((8, 8), (1, 0)), ((9, 300), (1, 0)),
    ((3, 17, 70), (0, 2, 1)), ((2, 5, 9, 30), (0, 3, 1, 2)), ((2, 5, 9, 30), (0, 2, 3, 1)),
    ((4, 300), (1, 0)),                     # fewer than 8 rows: torch's copy
    ((300, 300), (1, 0)),                   # 90k elements: two threads
    ((3, 17, 70), (1, 0, 2)), ((3, 17, 70), (2, 1, 0))])   # other permutations: torch's
def test_permuted_matches_torch(shape, perm, dtype):
    g = torch.Generator().manual_seed(len(shape) + perm[-1])
    x = (torch.randn(shape, generator=g) * 1000).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = transpose.permuted(x, perm)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got, x.permute(perm).contiguous()) and got.is_contiguous()
    assert got.data_ptr() != x.data_ptr()


def test_permuted_keeps_bits_and_falls_back_where_it_must():
    x = torch.randn(64, 48)
    x[3, 5], x[40, 47] = float("nan"), -0.0
    bits = transpose.permuted(x.view(torch.int32), (1, 0)).view(torch.float32)
    assert torch.equal(bits.view(torch.int32), x.T.contiguous().view(torch.int32))
    # a non-contiguous source and float16: torch's copy
    y = torch.randn(64, 48)
    for t in (y[:, ::2], y.half()):
        assert torch.equal(transpose.permuted(t, (1, 0)), t.T.contiguous())
    with torch.device("meta"):   # another default device: the copy stays on the CPU
        got = transpose.permuted(y, (1, 0))
    assert got.is_cpu and torch.equal(got, y.T.contiguous())


@pytest.mark.slow
def test_a_source_that_needs_a_gradient_is_copied_and_recorded(monkeypatch):
    w = torch.randn(64, 48, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: transpose.permuted(w, (1, 0)), (w,))
    out = transpose.permuted(w, (1, 0))
    assert type(out.grad_fn).__name__ == "_PermutedCopyBackward"
    copies = []
    real = transpose._kernel
    monkeypatch.setattr(transpose, "_kernel",
                        lambda n: lambda *a: copies.append(n) or real(n)(*a))
    grad = torch.randn(48, 64, dtype=F64)
    out = transpose.permuted(w, (1, 0))
    (got,) = torch.autograd.grad(out, w, grad)
    assert torch.equal(got, grad.T) and got.is_contiguous()
    assert len(copies) == 2                  # the copy and the gradient's copy back


@pytest.mark.parametrize("view", [
    lambda x: x.T, lambda x: x.reshape(4, 40, 30).permute(0, 2, 1),
    lambda x: x.reshape(4, 40, 30).permute(2, 0, 1),   # (torch's copy: not a block move)
    lambda x: x[:, ::2].T,                             # not a permuted contiguous tensor
    lambda x: x[:1].expand(5, 120).T, lambda x: x])
def test_contiguous_matches_torch(view):
    x = torch.randn(40, 120)
    t = view(x)
    got = transpose.contiguous(t)
    assert torch.equal(got, t.contiguous()) and got.is_contiguous()


def test_the_kernels_copy_a_transposed_dense_operand_by_block_transposes(monkeypatch):
    A = st.tensor(random_dense((30, 40), 0.2, F32, torch.Generator().manual_seed(0)), "csr")
    X = torch.randn(64, 40)
    want = A.to_dense() @ X.T
    copies = []
    real = transpose.permuted
    monkeypatch.setattr(transpose, "permuted", lambda *a: copies.append(1) or real(*a))
    for _ in range(3):   # the first call (generic path), then the call shims
        copies.clear()
        assert torch.allclose(st.einsum("ij,jk->ik", A, X.T), want, rtol=1e-5, atol=1e-5)
        assert copies, "a transposed dense operand was copied by torch"


@pytest.mark.parametrize("rows", [1, 40])          # squeezed (one row) and permuted
@pytest.mark.parametrize("bias_shape", [(30,), (1, 30), "rows", "rows1", ()])
@pytest.mark.parametrize("act", [None, "relu", "sigmoid"])
def test_a_bias_and_activation_follow_the_relaid_result(rows, bias_shape, act):
    """``F.linear``'s equation with a bias (and activation) is relaid like one without:
    the bias is permuted (or squeezed) with the result, whatever its broadcast shape."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(30, 80, generator=g) * (torch.rand(30, 80, generator=g) < 0.2)
    W, x = st.tensor(w, "csr"), torch.randn(rows, 80, generator=g)
    shape = {"rows": (rows, 30), "rows1": (rows, 1)}.get(bias_shape, bias_shape)
    b = torch.randn(shape, generator=g)
    assert relayout("ni,oi->no", (x, W), None, b) is not None
    ref = x @ w.T + b
    ref = {None: ref, "relu": ref.clamp_min(0), "sigmoid": ref.sigmoid()}[act]
    torch.testing.assert_close(st.einsum("ni,oi->no", x, W, bias=b, activation=act), ref)
