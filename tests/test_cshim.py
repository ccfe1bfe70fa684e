"""The guarded call shims in C (``ops/cshim.py``) against their Python twins: the same
answers bit for bit, None exactly where the Python guard says None, the Python shim for
everything unusual, and no reference leaked on any path."""
import sys

import pytest
import torch

import sparsetorch as st
from dense_check import forget_call_memo, random_dense
from sparsetorch.ops import cshim, execute

F32, F64 = torch.float32, torch.float64

pytestmark = pytest.mark.skipif(cshim.dispatcher() is None,
                                reason="no C dispatcher here (no C API through ctypes)")


def _shims(equation, operands):
    """(C shim, Python guarded shim) memoised for ``equation`` on ``operands``."""
    forget_call_memo()
    st.einsum(equation, *operands)
    call = execute.lookup(equation, tuple(operands), None)
    assert call.cguarded is not None and execute.fast_calls(equation)[0] is call.cguarded
    return call.cguarded, call.guarded


def _operands(shapes_formats, dtype, index_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, fmt in shapes_formats:
        if fmt is None:
            out.append(torch.randn(shape, dtype=dtype, generator=g))
        else:
            d = random_dense(shape, 0.3, dtype, g)
            d[0] = 0   # an empty row (slice)
            out.append(st.tensor(d, fmt, index_dtype=index_dtype))
    return out


CASES = [   # equation, (shape, format or None for dense) per operand; calls with a shim
    ("ij,j->i", [((9, 7), "csr"), ((7,), None)]),
    ("ij,j->i", [((9, 1), "csr"), ((1,), None)]),
    ("ij,jk->ik", [((9, 7), "csc"), ((7, 4), None)]),
    ("ij,jk->ik", [((9, 7), "csr"), ((7, 19), None)]),
    ("ij,jk->ik", [((9, 7), "dcsr"), ((7, 5), None)]),
    ("ji,jk->ik", [((7, 9), "dcsr"), ((7, 3), None)]),   # (CSR: ops/transposed.py)
    ("ikl,kj,lj->ij", [((4, 5, 6), "csf"), ((5, 3), None), ((6, 3), None)]),
    ("ij,ij->i", [((9, 7), "csr"), ((9, 7), None)]),
    ("bij,bjk->bik", [((2, 5, 4), "csf"), ((2, 4, 3), None)]),
]


@pytest.mark.parametrize("equation,spec", CASES, ids=[c[0] + "-" + c[1][0][1] for c in CASES])
@pytest.mark.parametrize("dtype,index_dtype", [(F64, torch.int64), (F32, torch.int32)])
def test_c_shim_answers_as_the_python_shim(equation, spec, dtype, index_dtype):
    operands = _operands(spec, dtype, index_dtype, seed=1)
    c_shim, py_shim = _shims(equation, operands)
    # new dense values, same signature: the same kernel, so the same bits
    fresh = [t if isinstance(t, st.SparseTensor) else torch.randn_like(t) for t in operands]
    got, want = c_shim(tuple(fresh)), py_shim(tuple(fresh))
    assert got.dtype == dtype and torch.equal(got, want)
    dense = [t.to_dense() if isinstance(t, st.SparseTensor) else t for t in fresh]
    tol = 1e-10 if dtype == F64 else 1e-4
    assert torch.allclose(got, torch.einsum(equation, *dense), rtol=tol, atol=tol)
    assert torch.equal(st.einsum(equation, *fresh), want)     # through the public call


def test_c_shim_declines_exactly_where_the_python_guard_does():
    A, x = _operands([((9, 7), "csr"), ((7,), None)], F32, torch.int32, seed=2)
    c_shim, py_shim = _shims("ij,j->i", [A, x])
    B = st.tensor(A.to_dense(), "csr", index_dtype=torch.int64)   # another structure key
    st.einsum("ij,j->i", B, x)
    Ag = st.tensor(A.to_dense(), "csr", index_dtype=torch.int32)
    Ag.values.requires_grad_()
    with torch.no_grad():
        st.einsum("ij,j->i", Ag, x)      # (gives Ag its structure key)
    others = [
        (A, x.double()), (A, x[:, None]), (A, x.to_sparse()), (A, torch.nn.Parameter(x)),
        (A, x.clone().requires_grad_()), (B, x), (x, A), (A,), (A, x, x), (A, 2.0),
        (A.to_dense(), x), "ij", (Ag, x),
    ]
    for ops in others:
        assert c_shim(ops) is None and py_shim(ops) is None, ops
    # (operands come as the tuple ``st.einsum`` packs; a list is not its call)
    assert c_shim([A, x]) is None and torch.equal(py_shim([A, x]), py_shim((A, x)))
    with torch.no_grad():   # nothing to record: both answer
        xg = x.clone().requires_grad_()
        assert torch.equal(c_shim((A, xg)), py_shim((A, xg)))
        assert torch.equal(c_shim((Ag, x)), py_shim((Ag, x)))


def test_c_shim_hands_unusual_calls_to_the_python_shim():
    A, x = _operands([((9, 7), "csr"), ((7, 4), None)], F64, torch.int64, seed=3)
    c_shim, _ = _shims("ij,jk->ik", [A, x])
    dense = A.to_dense()
    xt = torch.randn(4, 7, dtype=F64).t()          # not contiguous
    assert torch.allclose(c_shim((A, xt)), dense @ xt)
    with pytest.raises(ValueError, match="size"):   # disagreeing sizes: the same error
        c_shim((A, torch.ones(6, 4, dtype=F64)))
    # the same structure key, its pointers not read yet (no ``_raw``): read, then used
    A2 = st.tensor(2 * dense, "csr", index_dtype=torch.int64)
    A2.__dict__["_call_key"] = A.__dict__["_call_key"]
    A2.__dict__.pop("_raw", None)
    assert torch.allclose(c_shim((A2, x)), 2 * dense @ x)
    assert "_raw" in A2.__dict__ and torch.allclose(c_shim((A2, x)), 2 * dense @ x)


def test_c_shim_runs_balanced_rows_on_several_threads():
    """Enough work for every thread: the thread count and per-thread row ranges are read
    as the Python shim reads them."""
    g = torch.Generator().manual_seed(4)
    d = random_dense((300, 250), 0.3, F32, g)
    d[::7] = 0
    A = st.tensor(d, "csr")
    for x in (torch.randn(250, generator=g), torch.randn(250, 64, generator=g)):
        eq = "ij,j->i" if x.dim() == 1 else "ij,jk->ik"
        c_shim, py_shim = _shims(eq, [A, x])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            got = c_shim((A, x))
            assert torch.equal(got, py_shim((A, x)))
            assert torch.allclose(got, d @ x, rtol=1e-4, atol=1e-4)
        finally:
            torch.set_num_threads(threads)


def test_c_shim_keeps_reference_counts():
    A, x = _operands([((9, 7), "csr"), ((7, 3), None)], F32, torch.int32, seed=5)
    c_shim, _ = _shims("ij,jk->ik", [A, x])
    xt = torch.randn(3, 7).t()
    bad = torch.ones(6, 3)
    c_shim((A, x))    # (reads A's pointers once: ``_raw``)
    watched = [A, x, xt, bad, A.values, A.__dict__["_raw"]]
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(200):
        out = c_shim((A, x))                       # the C path
        assert sys.getrefcount(out) == 2           # ours alone (and getrefcount's argument)
        c_shim((A, xt))                            # handed to the Python shim
        assert c_shim((A, x.double())) is None     # declined
        with pytest.raises(ValueError):
            c_shim((A, bad))                       # the Python shim raises
    del out
    assert [sys.getrefcount(o) for o in watched] == before
    # None, True, dtypes are everyone's: a reference lost or kept per call shows as thousands
    shared = [None, True, False, F32, torch.strided]
    before = [sys.getrefcount(o) for o in shared]
    x64 = x.double()
    for _ in range(5000):
        c_shim((A, x64))
        c_shim((A, x))
    drift = [sys.getrefcount(o) - b for o, b in zip(shared, before)]
    assert all(abs(d) < 100 for d in drift), drift


def test_python_shims_serve_without_the_dispatcher(monkeypatch):
    monkeypatch.setattr(cshim, "dispatcher", lambda: None)
    forget_call_memo()
    A, x = _operands([((9, 7), "csr"), ((7,), None)], F64, torch.int64, seed=6)
    st.einsum("ij,j->i", A, x)
    shim = execute.fast_calls("ij,j->i")[0]
    assert shim.__name__ == "guarded"
    assert torch.allclose(st.einsum("ij,j->i", A, x), A.to_dense() @ x)
    forget_call_memo()


def test_a_dispatcher_that_cannot_be_built_leaves_the_python_shims(monkeypatch):
    """A cache that cannot take a new library (read-only, prebuilt by an older version) or
    a compiler that fails: no C shims, the reason kept, every call answered in Python."""
    def refuse(source):
        raise st.runtime.KernelBuildError("cannot write a new kernel into the cache")

    monkeypatch.setattr(cshim, "_state", {})
    monkeypatch.setattr(st.runtime, "load_library", refuse)
    assert cshim.dispatcher() is None and "cannot write" in cshim._state["off"]
    forget_call_memo()
    A, x = _operands([((9, 7), "csr"), ((7, 2), None)], F64, torch.int64, seed=7)
    st.einsum("ij,jk->ik", A, x)
    assert execute.fast_calls("ij,jk->ik")[0].__name__ == "guarded"
    assert torch.allclose(st.einsum("ij,jk->ik", A, 3 * x), 3 * (A.to_dense() @ x))
    forget_call_memo()
