"""Row splitting across threads (``ops/balance.py``): the rule that picks one range per
thread or dynamic ranges, and every kernel kind computing the same results either way."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import sparsetorch as st
from sparsetorch.compiler.kernel import vector_lanes
from sparsetorch.ops import balance, execute
from dense_check import check_against_dense, forget_call_memo, make_operand, random_dense, \
    seed_of

F64 = torch.float64


@pytest.fixture
def dynamic_ranges(monkeypatch):
    """Two threads, and every call large enough for dynamic ranges and threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(balance, "_CHUNKED_WORK", 0)
    monkeypatch.setattr(execute, "_PARALLEL_WORK", 0)
    forget_call_memo()   # shims bake the thresholds in
    yield
    forget_call_memo()
    torch.set_num_threads(old)


def skewed_dense(rows: int, cols: int, gen) -> torch.Tensor:
    """Mostly empty or one-entry rows, and two hub rows holding most entries."""
    x = random_dense((rows, cols), 0.03, F64, gen, integer=False, empty_slices=True)
    x[1] = torch.randn(cols, generator=gen, dtype=F64)
    x[rows - 2, : cols // 2] = torch.randn(cols // 2, generator=gen, dtype=F64)
    return x


def test_profile_and_rule():
    gen = torch.Generator().manual_seed(1)
    hubs = st.tensor(skewed_dense(60, 40, gen), format="csr")
    banded = st.tensor(torch.eye(60, dtype=F64) + torch.diag(torch.ones(59, dtype=F64), 1),
                       format="csr")
    p = balance.row_profile(hubs)
    assert p.rows == 60 and p.longest == 40 and p.skewed
    assert balance.row_profile(hubs) is p                      # kept with the tensor
    assert not balance.row_profile(banded).skewed
    big = balance._CHUNKED_WORK
    assert balance.ranges_per_thread(hubs, big - 1) == 1        # small calls: static
    assert balance.ranges_per_thread(hubs, big) == balance.CHUNKS_PER_THREAD
    assert balance.ranges_per_thread(banded, big * 100) == 1    # uniform rows: static
    empty = st.tensor(torch.zeros(3, 4), format="csr")
    assert balance.row_profile(empty).cv == 0.0 and balance.ranges_per_thread(empty, big) == 1
    assert "skewed" in st.explain("ij,j->i", hubs, torch.ones(40, dtype=F64)).parallel
    assert "uniform" in st.explain("ij,j->i", banded, torch.ones(60, dtype=F64)).parallel


def test_profile_kept_with_the_row_array(monkeypatch):
    """Wrappers made anew over a kept pattern (a softmax's output each call) find its
    profile without working it out: it took ~200 us of a GAT training step."""
    A = st.tensor(skewed_dense(30, 20, torch.Generator().manual_seed(2)), format="csr")
    first = balance.row_profile(A.with_values(A.values * 2))   # (A itself keeps none)
    assert "_row_profile" not in A.__dict__
    monkeypatch.setattr(balance, "_profile", None)   # (any second working-out fails)
    assert balance.row_profile(A.with_values(A.values * 3)) is first
    assert balance.row_profile(A) is first


def test_assembly_through_a_workspace_weighs_each_entry():
    """SpGEMM's per-entry work (workspace updates, emission) counts ``_ASSEMBLY_ENTRY_WORK``
    multiply-adds toward going parallel, in the call shim and the generic path alike."""
    forget_call_memo()
    A = st.tensor(torch.eye(5, dtype=F64), format="csr")
    st.einsum("ij,jk->ik", A, A)
    st.einsum("ij,jk->ik", A, torch.ones(5, 3, dtype=F64))
    spgemm = execute.lookup("ij,jk->ik", (A, A), None)
    spmm = execute.lookup("ij,jk->ik", (A, torch.ones(5, 3, dtype=F64)), None)
    weight = f"* {execute._ASSEMBLY_ENTRY_WORK}"
    assert weight in spgemm.source and weight not in spmm.source
    generic = spgemm.__globals__["generic"]   # the _Prepared the shim falls back to
    assert generic.work(0, 10, [5, 5, 5]) == 10 * execute._ASSEMBLY_ENTRY_WORK


def test_an_entry_without_a_dense_only_index_weighs_a_gathered_multiply_add():
    """SpMV and A * dense on A's pattern count ``_GATHER_ENTRY_WORK`` per stored entry (one
    multiply-add on a gathered value, four vector steps of SpMM), SpMM one per vector step."""
    forget_call_memo()
    A = st.tensor(torch.eye(5, dtype=F64), format="csr")
    x, X = torch.ones(5, dtype=F64), torch.ones(5, 3, dtype=F64)
    st.einsum("ij,j->i", A, x)
    st.einsum("ij,ij->ij", A, X[:, :1].expand(5, 5).contiguous())
    st.einsum("ij,jk->ik", A, X)
    spmv = execute.lookup("ij,j->i", (A, x), None)
    sampled = execute.lookup("ij,ij->ij", (A, torch.ones(5, 5, dtype=F64)), None)
    spmm = execute.lookup("ij,jk->ik", (A, X), None)
    weight = f"* {execute._GATHER_ENTRY_WORK}"
    assert weight in spmv.source and weight in sampled.source and weight not in spmm.source
    assert spmv.__globals__["generic"].work(5, 10, [5, 5]) == 5 + 10 * execute._GATHER_ENTRY_WORK
    generic = spmm.__globals__["generic"]   # 3 columns: one vector step of this CPU's width
    assert generic.lanes == vector_lanes("float64")
    assert generic.work(15, 10, [5, 3, 5]) == 15 // generic.lanes + 10


def test_a_dense_product_counts_its_multiply_adds():
    """With no sparse operand the work is the whole loop nest, not the operands' sizes: a
    tall narrow dense product (operands of ~2.7k vector steps, 43k of products) goes
    parallel, in the call shim and the generic path alike."""
    forget_call_memo()
    x, w = torch.ones(2708, 16), torch.ones(16, 7)
    st.einsum("ij,jk->ik", x, w)
    shim = execute.lookup("ij,jk->ik", (x, w), None)
    generic = shim.__globals__["generic"]
    ext = generic.extents((x, w))                       # i, k, j: 2708, 7, 16
    products = 2708 * 16 * -(-7 // generic.lanes)       # k in vector steps
    operands = (x.numel() + w.numel()) // generic.lanes
    assert generic.work(x.numel() + w.numel(), 0, ext) == operands + products
    assert operands < execute._PARALLEL_WORK <= operands + products
    lanes = generic.lanes                               # (the shim's own estimate)
    assert f"e0 * ((e1 + {lanes - 1}) // {lanes}) * e2 >= {execute._PARALLEL_WORK}" in \
        shim.source


@pytest.mark.parametrize("eq,fmts", [
    ("ij,jk->ik", ("csr", None)), ("ij,j->i", ("csr", None)), ("ij,ik,jk->ij", ("csr", None, None)),
    ("ij,jk->ik", ("csr", "csr")), ("ij,ij->ij", ("csr", "csr")), ("ij->i", ("csr",))])
def test_dynamic_ranges_match_dense(eq, fmts, dynamic_ranges):
    """Dense, sampled and assembled results, with ranges taken from the shared counter."""
    gen = torch.Generator().manual_seed(seed_of(eq, fmts))
    ext = dict(i=70, j=50, k=33)
    ops = []
    for t, f in zip(eq.split("->")[0].split(","), fmts):
        shape = tuple(ext[c] for c in t)
        x = skewed_dense(*shape, gen) if f else torch.randn(shape, generator=gen, dtype=F64)
        ops.append(make_operand(x, f))
    assert balance.ranges_per_thread(ops[0], 1) == balance.CHUNKS_PER_THREAD
    assert "st_next_range" in st.explain(eq, *ops).source
    check_against_dense(eq, ops)


def test_shims_ask_for_ranges_only_from_chunked_work(monkeypatch):
    """Below ``_CHUNKED_WORK`` a call runs one range per thread, and neither call shim (C
    or Python) spends a Python call asking; at or above it both ask."""
    from sparsetorch.ops import cshim, shim

    asked = []

    def counting(t, work):
        asked.append(work)
        return balance.ranges_per_thread(t, work)

    for module in (shim, cshim):
        monkeypatch.setattr(module, "ranges_per_thread", counting)
    monkeypatch.setattr(execute, "_PARALLEL_WORK", 0)
    gen = torch.Generator().manual_seed(5)
    A = st.tensor(skewed_dense(80, 60, gen), format="csr")
    x = torch.randn(60, dtype=F64, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for chunked in (1 << 30, 0):
            monkeypatch.setattr(balance, "_CHUNKED_WORK", chunked)
            forget_call_memo()   # shims read the threshold when made
            st.einsum("ij,j->i", A, x)
            shims = (execute.fast_calls("ij,j->i")[0], execute.lookup("ij,j->i", (A, x), None))
            shims[0]((A, x))   # (the C shim's first call caches A's pointers through Python)
            asked.clear()
            for fn in shims:
                torch.testing.assert_close(fn((A, x)), A.to_dense() @ x)
            assert len(asked) == (0 if chunked else 2), chunked
    finally:
        torch.set_num_threads(old)
        forget_call_memo()


def test_concurrent_dynamic_calls(dynamic_ranges):
    """Each call has its own range counter: concurrent calls do not share ranges."""
    gen = torch.Generator().manual_seed(7)
    A = st.tensor(skewed_dense(80, 60, gen), format="csr")
    xs = [torch.randn(60, 16, generator=gen, dtype=F64) for _ in range(12)]
    want = [A.to_dense() @ x for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: st.einsum("ij,jk->ik", A, x), xs * 4))
    for g, w in zip(got, want * 4):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
