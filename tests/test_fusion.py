"""``st.compile``: each fusable chain written with ordinary ops IS fused (``explain``), the
compiled function equals the eager one (float64 and float32; csr, csc, coo; empty rows and
nnz = 0), gradients through it are right (gradcheck), run-time checks replay the original
ops, and functions with nothing to fuse still run."""
import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from sparsetorch.fusion import runtime
from sparsetorch.fusion.runtime import Replay, Site, _In, _Step

from dense_check import check_same

F64, F32 = torch.float64, torch.float32
FORMATS = ["csr", "csc", "coo"]


@pytest.fixture(autouse=True)
def _reset():
    # every case compiles afresh: dynamo's per-function recompile limit (8) would otherwise
    # make later cases run eagerly, unfused
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _matrix(rows, cols, seed, dtype, empty=False):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(rows, cols, generator=g, dtype=F64)
    d[d.abs() < 0.6] = 0
    d[1] = 0                           # an empty row
    if empty:
        d.zero_()                      # nnz = 0
    return d.to(dtype)


def _randn(*shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=F64).to(dtype)


def _inputs(fmt, dtype, empty):
    A = st.tensor(_matrix(7, 5, 0, dtype, empty), fmt)
    B = st.tensor(_matrix(7, 5, 1, dtype), fmt)
    return {"A": A, "B": B, "X": _randn(5, 3, seed=2, dtype=dtype),
            "b": _randn(3, seed=3, dtype=dtype), "b7": _randn(7, seed=4, dtype=dtype),
            "Q": _randn(7, 4, seed=5, dtype=dtype), "K": _randn(5, 4, seed=6, dtype=dtype),
            "V": _randn(5, 2, seed=7, dtype=dtype), "x": _randn(5, seed=8, dtype=dtype)}


# name -> (function, argument names, the patterns its call must run fused)
CASES = {
    "spmm_bias_relu": (lambda A, X, b: torch.relu(A @ X + b), "AXb", ("epilogue",)),
    "spmv_relu6": (lambda A, x: F.relu6(A @ x), "Ax", ("epilogue",)),
    "linear_bias_relu": (lambda X, A, b7: F.relu(F.linear(X.t(), A, b7)), "XAb7",
                         ("epilogue",)),
    "einsum_minus_bias_abs": (lambda A, X, b: (st.einsum("ij,jk->ik", A, X) - b).abs(),
                              "AXb", ("epilogue",)),
    "mm_plus_number": (lambda A, X: torch.mm(A, X) + 0.5, "AX", ("epilogue",)),
    "attention": (lambda A, Q, K, V: torch.sparse.softmax(
        st.einsum("ij,ik,jk->ij", A, Q, K), 1) @ V, "AQKV", ("attention",)),
    "attention_st_softmax_scaled": (lambda A, Q, K, V: st.ops.softmax(
        st.einsum("ij,ik,jk->ij", A, Q, K) / 2.0, -1) @ V, "AQKV", ("attention",)),
    "attention_sampled_addmm": (lambda A, Q, K, V: torch.sparse.softmax(
        torch.sparse.sampled_addmm(A, Q, K.t(), beta=0.0, alpha=0.5), -1) @ V, "AQKV",
        ("attention",)),
    "chain": (lambda A, B: torch.relu(A * 2 - B), "AB", ("elementwise",)),
    "chain_methods": (lambda A, B: (A * B + A).abs().neg() / 4, "AB", ("elementwise",)),
    "two_patterns": (lambda A, B, X, b: torch.relu((A * 2 - B) @ X + b), "ABXb",
                     ("elementwise", "epilogue")),
}


def _args(names, inputs):
    out, k = [], 0
    while k < len(names):
        name = names[k:k + 2] if names[k:k + 2] == "b7" else names[k]
        out.append(inputs[name])
        k += len(name)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_pattern_is_fused_and_matches_eager(name):
    fn, names, patterns = CASES[name]
    args = _args(names, _inputs("csr", F64, False))
    report = st.compile(fn).explain(*args)
    assert sorted(report.fused) == sorted(patterns), str(report)
    assert report.replayed == ()
    assert sorted(f.pattern for f in report.fusions) == sorted(patterns)
    check_same(report.result, fn(*args))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("empty", [False, True], ids=["empty_row", "nnz0"])
@pytest.mark.parametrize("name", ["spmm_bias_relu", "attention", "chain"])
def test_formats_dtypes_shapes(name, fmt, dtype, empty):
    fn, names, patterns = CASES[name]
    args = _args(names, _inputs(fmt, dtype, empty))
    compiled = st.compile(fn)
    report = compiled.explain(*args)
    assert report.fused == patterns, str(report)
    check_same(report.result, fn(*args))
    check_same(compiled(*args), fn(*args))          # the cached graph


def test_intermediate_used_elsewhere_is_not_fused():
    inputs = _inputs("csr", F64, False)
    A, X, b = inputs["A"], inputs["X"], inputs["b"]

    def fn(A, X, b):
        y = A @ X                  # returned too: the product must be materialised
        return torch.relu(y + b), y

    report = st.compile(fn).explain(A, X, b)
    assert report.fused == () and report.fusions == ()
    for out, ref in zip(report.result, fn(A, X, b)):
        check_same(out, ref)


def test_attention_scores_returned_are_not_fused():
    i = _inputs("csr", F64, False)

    def fn(A, Q, K, V):
        P = torch.sparse.softmax(st.einsum("ij,ik,jk->ij", A, Q, K), 1)
        return P @ V, P

    report = st.compile(fn).explain(i["A"], i["Q"], i["K"], i["V"])
    assert "attention" not in report.fused
    for out, ref in zip(report.result, fn(i["A"], i["Q"], i["K"], i["V"])):
        check_same(out, ref)


@pytest.mark.parametrize("fn", [
    lambda A, X: A @ X,                                   # one op: nothing to fuse
    lambda A, X: torch.relu(A @ X) + 1.0,                 # relu first: only relu fuses
    lambda A, B: A * B,                                   # a single elementwise op
    lambda A, X: torch.relu(X.t() @ X),                   # dense product: not ours
], ids=["spmm", "relu_then_add", "single_mul", "dense"])
def test_non_matching_functions_run_correctly(fn):
    i = _inputs("csr", F64, False)
    args = (i["A"], i["B"]) if fn.__code__.co_varnames[1] == "B" else (i["A"], i["X"])
    report = st.compile(fn).explain(*args)
    assert "attention" not in report.fused and "elementwise" not in report.fused
    check_same(report.result, fn(*args))


def test_graph_break_still_fuses_each_piece():
    i = _inputs("csr", F64, False)

    def fn(A, X, b):
        y = torch.relu(A @ X + b)
        print(end="")        # a graph break
        return torch.relu(A @ X + b) + y

    compiled = st.compile(fn)
    report = compiled.explain(i["A"], i["X"], i["b"])
    assert compiled.split is not None
    assert report.fused == ("epilogue", "epilogue")
    check_same(report.result, fn(i["A"], i["X"], i["b"]))


# -- gradients: the fused ops fall back to their differentiable forms; gradcheck checks it
A64 = st.tensor(_matrix(6, 5, 0, F64), "csr")
B64 = st.tensor(_matrix(6, 5, 1, F64), "csr")
GRAD = {
    "epilogue": (lambda w, X, b: torch.relu(A64.with_values(w) @ X + b),
                 (A64.values, _randn(5, 3, seed=2, dtype=F64), _randn(3, seed=3, dtype=F64))),
    "attention": (lambda w, Q, K, V: torch.sparse.softmax(
        st.einsum("ij,ik,jk->ij", A64.with_values(w), Q, K), 1) @ V,
        (A64.values, _randn(6, 4, seed=5, dtype=F64), _randn(5, 4, seed=6, dtype=F64),
         _randn(5, 2, seed=7, dtype=F64))),
    "elementwise": (lambda w, v: (A64.with_values(w) * 2 - B64.with_values(v)).abs()
                    @ torch.ones(5, 1, dtype=F64), (A64.values, B64.values)),
}


@pytest.mark.parametrize("name", sorted(GRAD))
def test_gradcheck_through_compile(name):
    fn, args = GRAD[name]
    args = [a.detach().clone().requires_grad_() for a in args]
    compiled = st.compile(fn)
    assert torch.autograd.gradcheck(compiled, args)
    assert name in [f.pattern for f in compiled.fusions]
    with torch.no_grad():                      # and without gradients it runs fused
        report = compiled.explain(*args)
    assert name in report.fused
    torch.testing.assert_close(report.result, fn(*args).detach())


# -- run-time checks ------------------------------------------------------------------------
def test_failed_runtime_check_replays_the_original_ops():
    A = st.tensor(_matrix(4, 3, 0, F64), "csr")
    X = _randn(3, 2, seed=1, dtype=F64)
    replay = Replay([("call_function", torch.matmul, (_In(0), _In(1)), {})])
    site = Site("epilogue", "test", replay, equation="ij,jk->ik", sparse=(True, False),
                bias=None, negate=False, activation="relu")
    before = dict(runtime.CALLS)
    with runtime.recording() as log:
        dense = runtime.epilogue(site, A.to_dense(), X)        # traced sparse, now dense
        fused = runtime.epilogue(site, A, X)
    assert log[0][:2] == ("epilogue", False) and "sparsity" in log[0][2]
    assert log[1] == ("epilogue", True, None)
    torch.testing.assert_close(dense, A.to_dense() @ X)      # the replay: no relu in it
    torch.testing.assert_close(fused, torch.relu(A.to_dense() @ X))
    assert runtime.CALLS["replayed"] == before["replayed"] + 1


def test_bias_that_would_grow_the_result_replays():
    A = st.tensor(_matrix(4, 3, 0, F64), "csr")
    X = _randn(3, 1, seed=1, dtype=F64)
    b = _randn(5, seed=2, dtype=F64)                          # (4, 1) + (5,) -> (4, 5)
    site = Site("epilogue", "test", Replay([
        ("call_function", torch.matmul, (_In(0), _In(1)), {}),
        ("call_function", torch.add, (_Step(0), _In(2)), {})]),
        equation="ij,jk->ik", sparse=(True, False), bias="input", negate=False,
        activation=None)
    with runtime.recording() as log:
        out = runtime.epilogue(site, A, X, b)
    assert log == [("epilogue", False,
                    "the bias would broadcast the result to a larger shape")]
    torch.testing.assert_close(out, A.to_dense() @ X + b)


# -- misuse ---------------------------------------------------------------------------------
def test_compile_rejects_a_non_callable_naming_the_fix():
    A = st.tensor(torch.eye(2), "csr")
    with pytest.raises(TypeError, match=r"not the result of calling it"):
        st.compile(A @ torch.ones(2))


def test_decorator_forms_and_idempotence():
    @st.compile(fullgraph=True)
    def f(A, X):
        return torch.relu(A @ X)

    assert isinstance(f, st.fusion.Compiled) and st.compile(f) is f
    A = st.tensor(torch.eye(2), "csr")
    assert f.explain(A, -torch.ones(2, 1)).result.abs().sum().item() == 0.0


def test_fullgraph_true_raises_on_a_graph_break():
    def f(A, X):
        print(end="")
        return A @ X

    with pytest.raises(Exception, match="(?i)graph break|print"):
        st.compile(f, fullgraph=True)(st.tensor(torch.eye(2), "csr"), torch.ones(2, 1))


# -- what dynamo cannot take: split, eager, or the user's own error (a probe's findings) ----
def test_data_dependent_control_flow_and_the_recompile_limit_split_the_graph():
    """``.item()`` in control flow raised dynamo's UserError, and a ninth shape its
    FailOnRecompileLimitHit, from st.compile's first, full-graph attempt."""
    f = st.compile(lambda A, B: torch.relu(A * 2 - B) if A.values.sum().item() > 0
                   else torch.relu(B - A))
    A = st.tensor(_matrix(6, 5, 1, torch.float64), "csr")
    B = st.tensor(_matrix(6, 5, 2, torch.float64), "csr")
    check_same(f(A, B), torch.relu(A * 2 - B) if A.values.sum().item() > 0
               else torch.relu(B - A))
    g = st.compile(lambda A, B: torch.relu(A * 2 - B))
    for n in range(2, 13):   # (more shapes than dynamo's recompile limit, 8)
        A = st.tensor(_matrix(n, 3, n, torch.float64), "csr")
        B = st.tensor(_matrix(n, 3, n + 50, torch.float64), "csr")
        check_same(g(A, B), torch.relu(A * 2 - B))


def test_an_error_of_the_function_itself_comes_back_unwrapped():
    f = st.compile(lambda A, B: torch.relu(A / B))     # (dividing by a SparseTensor)
    A = st.tensor(_matrix(4, 3, 1, torch.float64), "csr")
    with pytest.raises(TypeError, match="dividing by a SparseTensor"):
        f(A, A)
    assert f.fallback is None   # (still compiled: the error was the user's)


@pytest.mark.parametrize("compile_", ["st", "torch"])
def test_a_python_number_that_changes_between_calls(compile_):
    """dynamo passes a number that changed as a SymFloat/SymInt, which the elementwise ops
    refused ("cannot combine a SparseTensor with a SymFloat") on the second call."""
    fn = lambda A, B, c: torch.relu(A * c - B) / c   # noqa: E731
    f = st.compile(fn) if compile_ == "st" else torch.compile(fn, backend="aot_eager",
                                                              fullgraph=True)
    A = st.tensor(_matrix(6, 5, 1, torch.float64), "csr")
    B = st.tensor(_matrix(6, 5, 2, torch.float64), "csr")
    for c in (2.0, 3.0, 5, 0.5):
        check_same(f(A, B, c), fn(A, B, c))


def test_chains_reading_a_number_that_changes_stay_fused():
    """After the number changed, dynamo passed it as an input (a 0-d tensor's ``.item()``),
    which the patterns did not take: every later call ran unfused (a probe found)."""
    A = st.tensor(_matrix(6, 5, 1, torch.float64), "csr")
    B = st.tensor(_matrix(6, 5, 2, torch.float64), "csr")
    X = torch.randn(5, 3, dtype=torch.float64)
    cases = [(lambda A, X, c: torch.relu(A @ X + c), "epilogue", X),
             (lambda A, B, c: torch.relu(A * c - B), "elementwise", B),
             (lambda A, B, c: A / c + B, "elementwise", B)]
    for fn, pattern, other in cases:
        f = st.compile(fn)
        for c in (2.0, -3.0, 5, 0.5):
            report = f.explain(A, other, c)
            assert report.fused == (pattern,), (pattern, c, report.replayed)
            check_same(report.result, fn(A, other, c))
    report = f.explain(A, B, 0.0)   # (a divisor of 0 at this call: run as written)
    assert report.fused == () and report.replayed[0][1] == "a divisor given at this call is 0"
    torch.testing.assert_close(report.result.to_dense(), (A / 0.0 + B).to_dense(),
                               equal_nan=True)
    Q, V = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    K = torch.randn(5, 3, dtype=torch.float64)
    for fn in (lambda A, c: torch.sparse.softmax(st.einsum("ij,ik,jk->ij", A, Q, K) * c, 1) @ V,
               lambda A, c: torch.sparse.softmax(torch.sparse.sampled_addmm(
                   A, Q, K.t(), beta=0.0) / c, 1) @ V):
        f = st.compile(fn)
        for c in (0.5, 2.0, -1.5, 3):
            report = f.explain(A, c)
            assert report.fused == ("attention",), (c, report.replayed)
            torch.testing.assert_close(report.result, fn(A, c))


def test_softmax_of_an_assembled_result_compiles():
    """(``if t.nnz == 0`` guarded on the traced entry count: a UserError)"""
    fn = lambda A, B: torch.sparse.softmax(A - B, 1)   # noqa: E731
    A = st.tensor(_matrix(6, 5, 1, torch.float64), "csr")
    B = st.tensor(_matrix(6, 5, 2, torch.float64), "csr")
    check_same(torch.compile(fn, backend="aot_eager", fullgraph=True)(A, B), fn(A, B))


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr"])
def test_division_divides(fmt):
    """``A / c`` multiplied by 1/c: a third of the values 1 ulp off torch's, and
    1e-300 / 1e-310 infinite."""
    d = _matrix(8, 6, 3, torch.float64) * 1e-300
    A = st.tensor(d, fmt, blocksize=(2, 2) if fmt == "bsr" else None)
    for c in (7.0, 1e-310, torch.full((6,), 3.0, dtype=torch.float64)):
        torch.testing.assert_close((A / c).to_dense(), torch.where(d != 0, d / c, 0.0),
                                   rtol=0, atol=0)
