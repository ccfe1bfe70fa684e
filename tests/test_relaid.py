"""Operands re-laid in another mode order (``ops/relaid.py``): the scheduler converts a sparse
operand whose storage order would make the kernel scatter into a dense result from one
thread (``A.T @ X``, the backward of ``A @ X``), the pattern is converted once and kept, and
every call gathers the current values through the kept permutation."""
from __future__ import annotations

import gc

import pytest
import torch

import sparsetorch as st
from sparsetorch.ops import execute as execute_module, relaid as relaid_module
from sparsetorch.ops.relaid import _KEPT, gather, relaid

from dense_check import check_against_dense, private_kernel_cache, random_dense  # noqa: F401

F64 = torch.float64


def _sparse(shape, fmt="csr", dtype=F64, seed=0, density=0.3, index_dtype=None):
    x = random_dense(shape, density, dtype, torch.Generator().manual_seed(seed),
                     empty_slices=True)
    return st.tensor(x, fmt, index_dtype=index_dtype), x


def _relaid_format(t, order):
    return st.Format(t.format.levels, tuple(order))


@pytest.mark.parametrize("fmt,order", [("csr", (1, 0)), ("csc", (0, 1)), ("coo", (1, 0)),
                                       ("csf", (2, 0, 1)), ("csf", (1, 2, 0))])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.int64])
def test_relaid_matches_a_full_conversion(fmt, order, index_dtype, dtype):
    shape = (5, 7) if len(order) == 2 else (4, 3, 5)
    t, x = _sparse(shape, fmt, dtype, seed=len(order), index_dtype=index_dtype)
    target = _relaid_format(t, order)
    got = relaid(t, target)
    want = t.asformat(target, index_dtype=index_dtype)
    assert got.format == target and got.index_dtype == index_dtype
    for name, a in want.arrays.items():
        assert torch.equal(got.arrays[name], a), name
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.to_dense(), x)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (1, 1), (4, 4)])
def test_no_entries_and_degenerate_shapes(shape):
    t = st.tensor(torch.zeros(shape, dtype=F64), "csr")
    got = relaid(t, _relaid_format(t, (1, 0)))
    assert got.nnz == 0 and torch.equal(got.to_dense(), torch.zeros(shape, dtype=F64))


def test_the_pattern_is_converted_once_and_the_values_gathered_each_call(monkeypatch):
    t, x = _sparse((6, 8), seed=3)
    target = _relaid_format(t, (1, 0))
    first = relaid(t, target)
    calls = []
    monkeypatch.setattr(relaid_module, "_pattern",
                        lambda *a: calls.append(1) or pytest.fail("pattern converted again"))
    second = relaid(t.with_values(t.values * 2), target)   # same arrays, other values
    assert calls == [] and second._level_arrays["crd1"] is first._level_arrays["crd1"]
    assert torch.equal(second.to_dense(), 2 * x)
    # values changed behind autograd's back (``.data`` has its own version counter) are seen
    t.values.data.mul_(3)
    assert torch.equal(relaid(t, target).to_dense(), 3 * x)
    assert torch.equal(relaid(t.T.T, target).to_dense(), 3 * x)   # views share the pattern


def test_a_pattern_changed_in_place_is_converted_again():
    x = torch.tensor([[0., 5., 0., 0.], [0., 0., 0., 0.], [1., 0., 2., 0.]], dtype=F64)
    t = st.tensor(x, "csr")
    target = _relaid_format(t, (1, 0))
    relaid(t, target)
    t._level_arrays["crd1"][0] = 3           # row 0's entry moves to column 3 (a new version)
    moved = x.clone()
    moved[0, 1], moved[0, 3] = 0, 5
    assert torch.equal(relaid(t, target).to_dense(), moved)


def test_the_kept_pattern_dies_with_its_arrays():
    gc.collect()
    before = len(_KEPT)
    t, _ = _sparse((5, 5), seed=7)
    relaid(t, _relaid_format(t, (1, 0)))
    assert t._level_arrays["pos1"] in _KEPT and len(_KEPT) == before + 1
    del t
    gc.collect()
    assert len(_KEPT) == before


def test_relaid_values_are_differentiable():
    t, _ = _sparse((4, 5), seed=9, density=0.5)
    target = _relaid_format(t, (1, 0))
    values = t.values.clone().requires_grad_()

    def f(v):
        return relaid(t.with_values(v), target).values

    assert torch.autograd.gradcheck(f, (values,))


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.int32, torch.int64,
                                   torch.bfloat16])
@pytest.mark.parametrize("perm_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 5, (1 << 12) + 1, (1 << 16) + 3])   # (torch, C: 1, 2 threads)
def test_gather_matches_index_select(dtype, perm_dtype, n):
    g = torch.Generator().manual_seed(n)
    values = (torch.randn(n, generator=g) * 100).to(dtype)
    perm = torch.randperm(n, generator=g).to(perm_dtype)
    assert torch.equal(gather(values, perm), values.index_select(0, perm))
    strided = torch.stack([values, values], 1)[:, 0]                 # not contiguous
    assert torch.equal(gather(strided, perm), values.index_select(0, perm))


# -- the scheduler's use of it ---------------------------------------------------------------
def test_a_transposed_product_runs_parallel_on_a_relaid_operand():
    A, _ = _sparse((6, 5), seed=1)
    X = torch.randn(6, 3, dtype=F64)
    e = st.explain("ji,jk->ik", A, X)
    assert e.conversions and e.conversions[0][1].mode_order == (1, 0)
    assert e.loop_order[0] == "i" and "across threads" in str(e)
    check_against_dense("ji,jk->ik", [A, X])
    check_against_dense(lambda a, x: a.T @ x, [A, X])


@pytest.mark.parametrize("equation,specs", [
    ("ij->j", [(5, 6)]),                 # column sums: each entry touched once either way
    ("ji,j->i", [(6, 5), (6,)]),         # A.T @ v: the same
    ("ij,jk->ik", [(4, 6), (6, 4)]),     # X @ BSR(B): re-laying blocks would pad them
    ("ij,ijk->j", [(5, 6), (5, 6, 3)]),  # a sparse result: re-laid, it would be dense
])
def test_nests_that_touch_each_entry_once_or_would_pad_are_not_converted(equation, specs):
    ops = []
    for n, shape in enumerate(specs):
        if n == len(specs) - 1 and equation == "ij,jk->ik":
            x = torch.zeros(shape, dtype=F64)
            x[:2, 2:] = torch.randn(2, 2, dtype=F64)
            ops.append(st.tensor(x, "bsr", blocksize=(2, 2)))
        elif n == 0 and equation != "ij,jk->ik":
            ops.append(_sparse(shape, seed=n)[0])
        else:
            ops.append(torch.randn(shape, dtype=F64))
    assert st.explain(equation, *ops).conversions == ()
    check_against_dense(equation, ops)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_gradients_of_a_product_use_the_kept_pattern(fmt, monkeypatch):
    A, _ = _sparse((7, 6), fmt, seed=2)
    A.requires_grad_()
    X = torch.randn(6, 4, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda v, x: st.einsum("ij,jk->ik", A.with_values(v), x),
                             (A.values.detach().clone().requires_grad_(), X))
    (A @ X).sum().backward()                     # dX = A^T dY: the relaid A
    calls = []
    real = relaid_module._pattern
    monkeypatch.setattr(relaid_module, "_pattern", lambda *a: calls.append(1) or real(*a))
    grad = X.grad.clone()
    X.grad = None
    (A @ X).sum().backward()
    assert calls == [] and torch.allclose(X.grad, grad)
    assert torch.allclose(X.grad, A.to_dense().detach().T @ torch.ones(7, 4, dtype=F64))


def test_the_schedule_says_when_its_conversion_only_avoids_a_scatter():
    from sparsetorch.compiler.notation import parse_einsum
    from sparsetorch.compiler.schedule import OperandInfo, schedule

    csr, dense = st.Format((st.dense, st.compressed)), st.Format((st.dense, st.dense))
    transposed = schedule(parse_einsum("ji,jk->ik", [2, 2]),
                          [OperandInfo(csr, False), OperandInfo(dense, True)])
    assert transposed.conversions and transposed.avoids_scatter
    written = schedule(parse_einsum("ji,jk->ik", [2, 2]),
                       [OperandInfo(csr, False), OperandInfo(dense, True)], allow_scatter=True)
    assert written.conversions == () and written.order[0] == "j"
    csc = st.Format((st.dense, st.compressed), (1, 0))   # CSR @ CSC: re-laid to be cheaper
    spgemm = schedule(parse_einsum("ij,jk->ik", [2, 2]),
                      [OperandInfo(csr, False), OperandInfo(csc, False)])
    assert spgemm.conversions and not spgemm.avoids_scatter
    # (found by a random search) avoiding the scatter here would give a sparse result where
    # the order as written, which small calls run, gives a dense one: it is kept
    a = parse_einsum("ji,jl,kl->l", [2, 2, 2])
    infos = [OperandInfo(csc, False), OperandInfo(dense, True), OperandInfo(csc, False)]
    assert schedule(a, infos) == schedule(a, infos, allow_scatter=True)


def _count_relaid(monkeypatch):
    calls = []
    real = relaid_module.relaid
    monkeypatch.setattr(execute_module, "relaid", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("first", ["small", "large"])
def test_small_calls_scatter_as_written_and_large_ones_use_the_relaid_operand(
        first, monkeypatch):
    """Whichever size comes first (it makes the call shims), each call takes the path its
    own size asks for, through the C shim, the Python shim and the generic path alike."""
    calls = _count_relaid(monkeypatch)
    # (DCSR: a sorted CSR takes ``transposed.py``'s kernel, which re-lays nothing)
    small, xs = _sparse((6, 5), "dcsr", seed=11)
    large, xl = _sparse((300, 200), "dcsr", seed=12, density=0.2)
    assert large.nnz * 64 // 4 >= execute_module._SCATTER_WORK   # (float64: 4 lanes)
    Xs, Xl = torch.randn(6, 64, dtype=F64), torch.randn(300, 64, dtype=F64)
    order = [(small, xs, Xs, 0), (large, xl, Xl, 1)]
    for A, x, X, relays in order if first == "small" else order[::-1]:
        for call in (lambda: A.T @ X, lambda: st.einsum("ji,jk->ik", A, X),
                     lambda: execute_module.lookup("ji,jk->ik", (A, X), None)((A, X))):
            for _ in range(2):   # (the first call of an operand caches its pointers)
                calls.clear()
                got = call()
                assert torch.allclose(got, x.T @ X, rtol=1e-12, atol=1e-12)
                assert len(calls) == relays


def test_facts_about_the_pattern_carry_over_to_the_next_tensor():
    from sparsetorch.ops.balance import row_profile

    t, _ = _sparse((6, 8), seed=13)
    target = _relaid_format(t, (1, 0))
    first = relaid(t, target)
    assert "_row_profile" not in relaid(t, target).__dict__
    profile = row_profile(relaid(t, target))
    assert relaid(t, target).__dict__["_row_profile"] is profile
    assert relaid(t, target) is not first    # (new values each call)
