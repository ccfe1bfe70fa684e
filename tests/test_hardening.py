"""Regression tests of issue 31's core items: stale pointers after values are replaced (2),
unchecked levels reaching kernels (4), the factorial scheduler (6) and the SpGEMM that
counts for a minute before failing (7). Each names the item it guards; crash tests run in a
fresh interpreter (``run_isolated``)."""
from __future__ import annotations

import signal
import string
import time
from contextlib import contextmanager

import pytest
import torch

import sparsetorch as st
from dense_check import private_kernel_cache, run_isolated  # noqa: F401 (fixture)
from helpers import one_thread  # noqa: F401 (autouse fixture)
from sparsetorch.compiler.notation import parse_einsum
from sparsetorch.compiler.schedule import OperandInfo, schedule
from sparsetorch.formats.format import as_format


@contextmanager
def deadline(seconds: int):
    """Fail (rather than hang the run) when the block takes longer than ``seconds``."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- item 6: an op on a tensor of order >= 9 enumerated n! mode orders -----------------------
@pytest.mark.parametrize("order", [9, 12])
def test_issue31_6_high_order_schedules_in_milliseconds(order):
    modes = string.ascii_lowercase[:order]
    coo = OperandInfo(as_format("coo", order), False)
    shuffled = OperandInfo(st.Format(coo.format.levels, tuple(reversed(range(order)))), False)
    for eq, infos in [(f"{modes},{modes}->{modes}", (coo, coo)),
                      (f"{modes},{modes}->{modes}", (coo, shuffled)),
                      (f"{modes},{modes[::-1]}->{modes}", (coo, coo)),
                      (f"{modes}->{modes[0]}", (coo,))]:
        a = parse_einsum(eq, [order] * len(infos))
        with deadline(20):
            t0 = time.perf_counter()
            s = schedule(a, infos)
            took = time.perf_counter() - t0
        assert took < 0.05, (eq, took)
        assert sorted(s.order) == sorted(a.all_vars)


def test_issue31_6_nine_dimensional_coo_op_matches_dense():
    g = torch.Generator().manual_seed(6)
    d = torch.zeros([2] * 9, dtype=torch.float64)
    d.view(-1)[torch.randperm(d.numel(), generator=g)[:40]] = torch.arange(1., 41.,
                                                                           dtype=torch.float64)
    A = st.tensor(d, format="coo")
    with deadline(120):   # (a cold kernel build included)
        out = A * 3
    torch.testing.assert_close(out.to_dense(), d * 3)


# -- item 7: an SpGEMM too large for memory counted for a minute before failing -------------
def _column_times_row(n: int):
    i32 = torch.int32
    column = st.SparseTensor.from_levels(
        (n, 1), "csr", {"pos1": torch.arange(n + 1, dtype=i32), "crd1": torch.zeros(n, dtype=i32)},
        torch.ones(n))
    row = st.SparseTensor.from_levels(
        (1, n), "csr", {"pos1": torch.tensor([0, n], dtype=i32), "crd1": torch.arange(n, dtype=i32)},
        torch.ones(n))
    return column, row


def test_issue31_7_spgemm_too_large_is_refused_fast():
    from sparsetorch.ops.result_size import ResultTooLarge

    small = _column_times_row(3)
    torch.testing.assert_close((small[0] @ small[1]).to_dense(), torch.ones(3, 3))  # builds
    column, row = _column_times_row(200_000)
    for attempt in range(2):   # the generic call path, then the memoised shim
        t0 = time.perf_counter()
        with pytest.raises(MemoryError, match="at least 40,000,000,000 entries") as err:
            st.einsum("ij,jk->ik", column, row)
        assert time.perf_counter() - t0 < 1.0
        assert isinstance(err.value, ValueError) and isinstance(err.value, ResultTooLarge)
        assert "(200000, 200000)" in str(err.value) and "GiB" in str(err.value)


@pytest.mark.parametrize("equation,formats", [("ij,jk->ik", ("coo", "csc")),
                                              ("ji,jk->ik", ("csc", "coo")),
                                              ("ij,kj->ki", ("dcsr", "csr"))])
def test_issue31_7_too_large_is_refused_fast_in_any_format(equation, formats):
    """Operands stored otherwise than by the product's rows are converted for the bound."""
    column, row = _column_times_row(200_000)
    a = column if equation[0] == "i" else column.T.asformat("csr")     # (j, i) when "ji"
    b = row if equation[3:5] == "jk" else row.T.asformat("csr")        # (k, j) when "kj"
    a, b = a.asformat(formats[0]), b.asformat(formats[1])
    t0 = time.perf_counter()
    with pytest.raises(MemoryError, match="at least 40,000,000,000 entries"):
        st.einsum(equation, a, b)
    assert time.perf_counter() - t0 < 1.0


def test_issue31_7_entry_bounds_hold_on_random_products():
    from sparsetorch.ops.result_size import entry_bounds

    g = torch.Generator().manual_seed(7)
    for density in (0.05, 0.3, 0.9):
        a = (torch.rand(30, 20, generator=g) < density).double()
        b = (torch.rand(20, 25, generator=g) < density).double()
        a[3] = 0   # an empty row
        exact = int(((a @ b) != 0).sum())
        for fa, fb in (("csr", "csr"), ("coo", "csc"), ("dcsc", "coo")):
            lower, upper = entry_bounds(st.tensor(a, fa), st.tensor(b, fb))
            assert lower <= exact <= upper
            # the same product from transposed storage
            lower_t, upper_t = entry_bounds(st.tensor(a.T.contiguous(), fa),
                                            st.tensor(b.T.contiguous(), fb),
                                            a_transposed=True, b_transposed=True)
            assert (lower_t, upper_t) == (lower, upper)


def test_issue31_7_entry_bounds_of_empty_operands():
    from sparsetorch.ops.result_size import entry_bounds

    empty, some = st.tensor(torch.zeros(4, 3), "csr"), st.tensor(torch.ones(3, 5), "coo")
    assert entry_bounds(empty, some) == (0, 0)
    assert entry_bounds(st.tensor(torch.ones(4, 3), "dcsr"), st.tensor(torch.zeros(3, 5),
                                                                       "csr")) == (0, 0)


@pytest.mark.slow   # ~3 s (the full suite runs it)
def test_hypersparse_product_of_huge_dimensions_runs_in_its_entries_memory():
    """DCSR operands of 2^31 + 5 rows and columns and 3 entries: the result-size bound took
    a row pointer per row (16 GiB: killed for memory); now O(entries). Run under an 8 GiB
    address-space limit, so a regression fails instead of taking the machine."""
    run_isolated("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        import torch, sparsetorch as st
        n = 2 ** 31 + 5
        idx = torch.tensor([[0, 5, n - 1], [3, n - 2, 7]])
        A = st.tensor((idx, torch.tensor([1., 2., 3.])), shape=(n, n), format="dcsr")
        B = st.tensor((idx.flip(0), torch.tensor([4., 5., 6.])), shape=(n, n), format="dcsr")
        C = st.einsum("ij,jk->ik", A, B).asformat("coo")
        got = sorted(zip(C.arrays["crd0"].tolist(), C.arrays["crd1"].tolist(),
                         C.values.tolist()))
        assert got == [(0, 0, 4.0), (5, 5, 10.0), (n - 1, n - 1, 18.0)], got
    """)


WIDE = 2 ** 31 + 5   # columns past int32


@pytest.mark.parametrize("equation,formats,b_shape", [
    ("ij,jk->ik", ("csr", "csr"), (1, WIDE)), ("ij,jk->ik", ("csc", "csr"), (1, WIDE)),
    ("ij,kj->ik", ("csr", "csc"), (WIDE, 1)), ("ji,jk->ik", ("csr", "csr"), (1, WIDE)),
    ("ij,jk->ki", ("csr", "csr"), (1, WIDE))])
def test_product_columns_past_int32_keep_their_values(equation, formats, b_shape):
    """An int32 A times an int64 B whose columns pass 2^31: a CSR-like result's columns
    were written in A's index type (2^31 + 4 came back as -2^31 + 4)."""
    far = 2 ** 31 + 4
    A = st.tensor((torch.tensor([[0], [0]]), torch.tensor([1.])), shape=(1, 1),
                  format=formats[0])
    at = [[0], [far]] if b_shape[0] == 1 else [[far], [0]]
    B = st.tensor((torch.tensor(at), torch.tensor([2.])), shape=b_shape, format=formats[1])
    assert A.index_dtype == torch.int32 and B.index_dtype == torch.int64
    C = st.einsum(equation, A, B).asformat("coo")
    coords = sorted(zip(C.arrays["crd0"].tolist(), C.arrays["crd1"].tolist()))
    assert coords == ([(far, 0)] if equation.endswith("ki") else [(0, far)])
    assert C.values.tolist() == [2.0]


def test_products_of_int32_operands_keep_int32_results():
    A = st.tensor(torch.eye(3), "csr")
    assert (A @ A).index_dtype == torch.int32


def test_a_format_that_cannot_fit_is_refused_before_allocating():
    """One entry in a (2^40, 4) CSC, asked for as CSR (a row pointer per row: 8 TiB), by
    asformat or by a product's conversion: a ValueError that ``except MemoryError`` also
    catches, naming the size, instead of the allocator's RuntimeError."""
    from sparsetorch.ops.result_size import ResultTooLarge

    huge = 2 ** 40
    A = st.tensor((torch.tensor([[0], [huge - 1]]), torch.tensor([1.0])), shape=(3, huge),
                  format="csr")
    B = st.tensor((torch.tensor([[huge - 1], [3]]), torch.tensor([1.0])), shape=(huge, 4),
                  format="csc")
    with pytest.raises(ResultTooLarge, match=r"asformat: a csr tensor of shape "
                                             r"\(1099511627776, 4\) with 1 entries needs about "
                                             r"8,192.0 GiB"):
        B.asformat("csr")
    with pytest.raises(MemoryError, match=r"keep a format without dense levels"):
        st.einsum("ij,jk->ik", A, B)
    assert B.asformat("dcsr").nnz == 1                      # O(entries) formats still work


# -- item 4: unchecked levels reached kernels -------------------------------------------------
BAD_CSR = {"pos1": torch.tensor([0, 1, 2, 3]), "crd1": torch.tensor([0, 10**8, 1])}


def test_issue31_4_unchecked_from_levels_still_checks_bounds():
    for arrays, match in [(BAD_CSR, "coordinate 100000000 at position 1 is out of range"),
                          ({"pos1": torch.tensor([0, 2, 1, 3]), "crd1": torch.tensor([0, 1, 2])},
                           "pos decreases"),
                          ({"pos1": torch.tensor([0, 1, 2, 9]), "crd1": torch.tensor([0, 1, 2])},
                           "pos\\[-1\\] is 9 but crd has 3"),
                          ({"pos1": torch.tensor([0, 1, 2, 3])}, "missing \\['crd1'\\]")]:
        with pytest.raises(ValueError, match=match):
            st.SparseTensor.from_levels((3, 3), "csr", arrays, torch.ones(3), check=False)
    with pytest.raises(ValueError, match="values has 2 entries but the levels store 3"):
        st.SparseTensor.from_levels((3, 3), "csr", {"pos1": torch.tensor([0, 1, 2, 3]),
                                                    "crd1": torch.tensor([0, 2, 1])},
                                    torch.ones(2), check=False)
    # what check=False still skips: order within a row (sorted-by-construction callers)
    unsorted = {"pos1": torch.tensor([0, 2, 2, 3]), "crd1": torch.tensor([2, 0, 1])}
    with pytest.raises(ValueError, match="unsorted"):
        st.SparseTensor.from_levels((3, 3), "csr", unsorted, torch.ones(3))
    st.SparseTensor.from_levels((3, 3), "csr", unsorted, torch.ones(3), check=False)


def test_issue31_4_custom_level_kind_cannot_skip_bounds():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Lenient(st.Compressed):   # a custom kind whose own validator checks nothing
        name = "lenient"

        def validate(self, parent_count, size, arrays):
            pass

    fmt = st.Format((st.dense, Lenient()))
    with pytest.raises(ValueError, match="level 1 \\(lenient\\): coordinate 100000000"):
        st.SparseTensor.from_levels((3, 3), fmt, BAD_CSR, torch.ones(3))
    good = st.SparseTensor.from_levels((3, 3), fmt, {"pos1": torch.tensor([0, 1, 2, 3]),
                                                      "crd1": torch.tensor([0, 2, 1])},
                                       torch.ones(3))
    torch.testing.assert_close(good.to_dense(), torch.tensor([[1., 0, 0], [0, 0, 1], [0, 1, 0]]))


def test_issue31_4_bad_levels_never_reach_a_kernel():
    run_isolated("""
        import torch, pytest, sparsetorch as st
        bad = {"pos1": torch.tensor([0, 1, 2, 3]), "crd1": torch.tensor([0, 10**8, 1])}
        with pytest.raises(ValueError):
            A = st.SparseTensor.from_levels((3, 3), "csr", bad, torch.ones(3), check=False)
            A @ torch.ones(3, 4)
    """, timeout=240)


# -- item 2: kernels read freed memory after values were given other storage ------------------
def _spmm_operands():
    g = torch.Generator().manual_seed(2)
    d = torch.randn(30, 20, generator=g) * (torch.rand(30, 20, generator=g) < 0.3)
    A = st.tensor(d, "csr")   # values of torch's own (resizable) storage:
    A = st.SparseTensor.from_levels(A.shape, "csr", A.arrays, A.values.clone())
    return d, A, torch.randn(20, 5, generator=g)


def _warm(A, X):
    for _ in range(4):   # past the memo: the shims with the pointers they keep
        st.einsum("ij,jk->ik", A, X)
        A @ X


def test_issue31_2_values_given_new_storage_are_read_again():
    d, A, X = _spmm_operands()
    _warm(A, X)
    A.values.data = torch.randn(A.nnz, dtype=A.dtype)   # same size: the new values count
    ref = A.to_dense() @ X
    for _ in range(2):
        torch.testing.assert_close(st.einsum("ij,jk->ik", A, X), ref)
        torch.testing.assert_close(A @ X, ref)
    A.values.mul_(2)                                    # in place: still fine
    torch.testing.assert_close(A @ X, ref * 2)


@pytest.mark.parametrize("how", ["set_", "resize_", "data", "dtype"])
def test_issue31_2_values_that_no_longer_fit_are_refused(how):
    d, A, X = _spmm_operands()
    _warm(A, X)
    if how == "set_":
        A.values.set_(torch.randn(3))
    elif how == "resize_":
        A.values.resize_(A.nnz + 10**6)
    elif how == "data":
        A.values.data = torch.randn(A.nnz - 1)
    else:
        A.values.data = torch.randn(A.nnz, dtype=torch.float64)
    eye = st.tensor(torch.eye(20, dtype=A.dtype), "csr")
    for call in (lambda: st.einsum("ij,jk->ik", A, X), lambda: A @ X,
                 lambda: st.einsum("ij,jk->ik", A, eye), lambda: torch.sparse.softmax(A, 1)):
        with pytest.raises(ValueError, match="values were replaced"):
            call()


@pytest.mark.slow   # ~4 s: a fresh process (the full suite runs it)
def test_conversions_refuse_values_that_no_longer_fit():
    """Conversions sized their output by the values and wrote by the pattern: CSR -> CSC
    with a one-value tensor segfaulted, to_torch().to_dense() too, COO/DCSR conversions gave
    wrong tensors silently, and a larger values tensor left uninitialised indices in the
    result (a probe). In a process of its own: a regression crashes."""
    run_isolated("""
        import pytest, torch, sparsetorch as st
        d = torch.randn(40, 30) * (torch.rand(40, 30) < 0.3)
        for fmt in ("csr", "csc", "coo", "dcsr"):
            for extra in (-1, 500):
                A = st.tensor(d, fmt)
                A.values.set_(torch.ones(1 if extra < 0 else A.nnz + extra))
                other = "csc" if fmt != "csc" else "csr"
                for call in (lambda: A.asformat(other), lambda: st.tensor(A, "coo"),
                             A.to_dense, A.to_torch, A.to_scipy,
                             lambda: A.asformat("bsr", blocksize=(2, 2))):
                    with pytest.raises(ValueError, match="values were replaced"):
                        call()
    """)


def test_values_restrided_in_place_after_a_call_are_refused():
    """``as_strided_`` keeps the values' pointer and size: a repeated call's shim read them
    contiguously where they were strided (off by 10 in a probe); a first call refused."""
    d, A, X = _spmm_operands()
    _warm(A, X)
    A.values.as_strided_((A.nnz,), (0,))
    for call in (lambda: A @ X, lambda: st.einsum("ij,jk->ik", A, X)):
        with pytest.raises(ValueError, match="replaced by a strided tensor"):
            call()


def test_a_tensor_saves_after_its_transposed_view_was_re_laid():
    """A transposed view kept by A holds its re-laid pattern through weak references, and
    torch takes a tensor's state before clearing its caches: torch.save(A) and
    pickle.dumps(A) raised "cannot pickle weakref" after A.t() @ A."""
    import io
    import pickle

    d, A, X = _spmm_operands()
    A.t() @ A
    for save in (lambda: torch.save(A, io.BytesIO()), lambda: pickle.dumps(A)):
        save()
    buffer = io.BytesIO()
    torch.save(A, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=True).to_dense(), A.to_dense())


def test_issue31_2_level_arrays_cannot_be_written():
    d, A, X = _spmm_operands()
    _warm(A, X)
    A.arrays["crd1"][:] = 10**8          # copies: the pattern is untouched
    A.arrays["pos1"][1:] = 0
    torch.testing.assert_close(A @ X, d @ X)
    pos, crd = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    B = st.SparseTensor.from_levels((2, 2), "csr", {"pos1": pos, "crd1": crd}, torch.ones(2))
    _warm(B, X[:2])
    crd[:] = 10**8                        # the caller's own tensors: B keeps copies
    torch.testing.assert_close(B @ X[:2], torch.tensor([[0., 1], [1, 0]]) @ X[:2])


@pytest.mark.slow
def test_issue31_2_no_crash_after_values_storage_is_freed():
    run_isolated("""
        import torch, pytest, sparsetorch as st
        n = 2_000_000
        A = st.SparseTensor.from_levels((n, 4), "csr", {"pos1": torch.arange(n + 1),
                                        "crd1": torch.zeros(n, dtype=torch.int64)}, torch.ones(n))
        x = torch.ones(4)
        for _ in range(4):
            A @ x
        A.values.set_(torch.ones(10))       # the old 8 MB freed (unmapped)
        with pytest.raises(ValueError):
            A @ x
        A.values.data = torch.full((n,), 2.)
        assert float((A @ x).sum()) == 2 * n
    """, timeout=240)


def test_issue31_2_torch_sparse_export_does_not_alias_the_pattern():
    d, A, X = _spmm_operands()
    T = A.to_torch()
    T.col_indices()[:] = 10**8
    torch.testing.assert_close(A @ X, d @ X)
