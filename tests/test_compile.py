"""torch.compile over SparseTensors: every compiled function matches eager (values and
gradients, float64), compiles with ``fullgraph=True`` (no graph breaks), runs kernels as the
``sparsetorch::*`` custom ops whose fake kernels give the right shapes, while eager calls
keep calling ctypes directly."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import sparsetorch as st
from sparsetorch.ops import custom_ops, execute

from dense_check import check_same, run_isolated

F64 = torch.float64


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _matrix(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(rows, cols, generator=g, dtype=F64)
    d[d.abs() < 0.6] = 0
    return d


A = st.tensor(_matrix(6, 5, 0), "csr")
X = torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
U = torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
x6 = torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=F64)
SHAPE = tuple(A.shape)




FORWARD = {
    "relu_spmm": (lambda A, X: torch.relu(A @ X), (A, X)),
    "transposed_spmv_sum": (lambda A, x: (A.t() @ x).sum(), (A, x6)),
    "einsum_sddmm_sparse_result": (lambda A, U, X: st.einsum("ij,ik,jk->ij", A, U, X),
                                   (A, U, X)),
    "einsum_out_format": (lambda A, X: st.einsum("ij,jk->ik", A, X, out_format="csr"),
                          (A, X)),
    "torch_einsum": (lambda A, X: torch.einsum("ij,jk->ik", A, X), (A, X)),
    "from_levels": (lambda pos, crd, v, X: st.SparseTensor.from_levels(
        SHAPE, "csr", {"pos1": pos, "crd1": crd}, v, check=False) @ X,
        (A.arrays["pos1"], A.arrays["crd1"], A.values, X)),
    "with_values": (lambda A, v, X: A.with_values(v * 2) @ X, (A, A.values, X)),
    "softmax": (lambda A: torch.sparse.softmax(A, 1), (A,)),
    "spgemm": (lambda A: A @ A.t(), (A,)),
    "sparse_add_scale": (lambda A: (A + A.t().t()) * 2.0, (A,)),
    "linear_bias": (lambda A, X: torch.nn.functional.linear(X.t(), A, x6), (A, X)),
    "st_softmax": (lambda A, X: st.ops.softmax(A, 1) @ X, (A, X)),
    "spgemm_to_dense": (lambda A: (A @ A.t()).to_dense(), (A,)),
    "lazy_tree": (lambda A: (st.lazy(A) * 2 - st.lazy(A.t().t())).relu().eval(), (A,)),
    "lazy_map": (lambda A: (st.lazy(A) * -0.5).abs().eval(), (A,)),
    "lazy_out_format": (lambda A: (st.lazy(A) * -0.5).abs().eval(out_format="coo"), (A,)),
    "lazy_dense_operands": (lambda U: (st.lazy(U) * 2).exp().eval(), (U,)),
    # .values (and a sampled result's .nnz) of SparseTensors computed inside the function
    "spgemm_values": (lambda A: (A @ A.t()).values.sum(), (A,)),
    "spgemm_values_returned": (lambda A: (A @ A.t()).values, (A,)),
    "spgemm_values_count": (lambda A: (A @ A.t()).values.shape[0] * A.values, (A,)),
    "sddmm_values": (lambda A, U, X: (st.einsum("ij,ik,jk->ij", A, U, X) * 3).values.sum(),
                     (A, U, X)),
    "sddmm_nnz": (lambda A, U, X: st.einsum("ij,ik,jk->ij", A, U, X).nnz * X, (A, U, X)),
}


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_forward_matches_eager(name):
    fn, args = FORWARD[name]
    ref = fn(*args)
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    check_same(out, ref)
    again = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)  # cached graph
    check_same(again, ref)


@pytest.mark.parametrize("name", ["relu_spmm", "einsum_sddmm_sparse_result",
                                  "transposed_spmv_sum", "softmax", "st_softmax",
                                  "lazy_map", "sddmm_values"])
def test_no_graph_breaks(name):
    fn, args = FORWARD[name]
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_compiled_graph_calls_the_custom_ops():
    before = dict(custom_ops.CALLS)
    torch.compile(lambda A, X: A @ X, fullgraph=True, backend="aot_eager")(A, X)
    torch.compile(lambda A: A @ A.t(), fullgraph=True, backend="aot_eager")(A)
    torch.compile(lambda A, U, X: st.einsum("ij,ik,jk->ij", A, U, X), fullgraph=True,
                  backend="aot_eager")(A, U, X)
    for kind in ("dense", "emit", "sampled"):
        assert custom_ops.CALLS[kind] > before[kind], kind


# Gradients: w are the sparse operand's values (through with_values), Y a dense operand.
BACKWARD = {
    "spmm_relu": lambda w, Y: torch.relu(A.with_values(w) @ Y).sum(),
    "sddmm": lambda w, Y: (st.einsum("ij,ik,jk->ij", A.with_values(w), U, Y) * 3.0).sum(),
    "sddmm_sparse_output": lambda w, Y: st.einsum("ij,ik,jk->ij", A.with_values(w), U, Y),
    "softmax_spmm": lambda w, Y: (torch.sparse.softmax(A.with_values(w), 1) @ Y).pow(2)
    .sum(),
    "transposed": lambda w, Y: ((A.with_values(w).t() @ U) * Y).sum(),
    # regression: int() of the traced entry count of a product's gradient (levels.count)
    "spgemm": lambda w, Y: ((A.with_values(w) @ A.with_values(w).t()) @ (A @ Y)).pow(2).sum(),
    "lazy": lambda w, Y: ((st.lazy(A.with_values(w)) * 2).relu().eval() @ Y).pow(2).sum(),
    "spgemm_values": lambda w, Y: (A.with_values(w) @ A.t()).values.pow(2).sum(),
    "sddmm_values": lambda w, Y: (st.einsum("ij,ik,jk->ij", A.with_values(w), U, Y) * 3.0)
    .values.pow(2).sum(),
}


def _same(ref, got):
    """Every tensor of ``got`` (a loss and gradients) matches ``ref``."""
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r)


def _grads(fn, backend=None):
    w = A.values.detach().clone().requires_grad_()
    Y = X.detach().clone().requires_grad_()
    f = fn if backend is None else torch.compile(fn, fullgraph=True, backend=backend)
    out = f(w, Y)
    loss = out.to_dense().pow(2).sum() if isinstance(out, st.SparseTensor) else out
    loss.backward()
    return loss.detach(), w.grad, Y.grad


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_matches_eager(name):
    ref = _grads(BACKWARD[name])
    got = _grads(BACKWARD[name], "aot_eager")
    _same(ref, got)


# Gradients of a SparseTensor input whose own values require grad (``requires_grad_()``, or
# ``with_values`` of values that do): the compiled function differentiates it as a whole.
SPARSE_INPUT = {
    "spmm": lambda A, Y: (A @ Y).sum(),
    "softmax_spmm": lambda A, Y: (torch.sparse.softmax(A, 1) @ Y).pow(2).sum(),
    "spgemm_twice_used": lambda A, Y: ((A @ A.t()) @ (A @ Y)).pow(2).sum(),
    "sparse_result": lambda A, Y: st.einsum("ij,ik,jk->ij", A, U, Y) * 2.0,
    "spgemm_values": lambda A, Y: (A @ A.t()).values.pow(2).sum() + (A @ Y).sum(),
}


def _sparse_input_grads(fn, backend=None, leaf=True, calls=1):
    """(loss, A's values gradient, Y's gradient) after ``calls`` backward passes."""
    w = A.values.detach().clone()
    S = A.with_values(w).requires_grad_() if leaf else A.with_values(w.requires_grad_())
    Y = X.detach().clone().requires_grad_()
    f = fn if backend is None else torch.compile(fn, fullgraph=True, backend=backend)
    for _ in range(calls):
        out = f(S, Y)
        loss = out.to_dense().pow(2).sum() if isinstance(out, st.SparseTensor) else out
        loss.backward()
    if leaf:
        assert isinstance(S.grad, st.SparseTensor) and S.grad._level_arrays["crd1"] is A._level_arrays["crd1"]
    return loss.detach(), S.grad.values if leaf else w.grad, Y.grad


@pytest.mark.parametrize("name", sorted(SPARSE_INPUT))
def test_sparse_input_requiring_grad(name):
    ref = _sparse_input_grads(SPARSE_INPUT[name], calls=2)       # gradients accumulate
    got = _sparse_input_grads(SPARSE_INPUT[name], "aot_eager", calls=2)
    _same(ref, got)


def test_a_copied_or_loaded_leaf_keeps_its_gradient_under_compile():
    """requires_grad_ flags the wrapper and hooks it (a compiled function's gradient lands
    there); copies lost both and kept the old hook's handle, which also made
    torch.load(weights_only=True) refuse the file (a probe's findings)."""
    import copy
    import io
    import pickle

    def loaded(A, **kw):
        buf = io.BytesIO()
        torch.save(A, buf)
        return torch.load(io.BytesIO(buf.getvalue()), **kw)

    D, X = torch.tensor([[0., 2.], [3., 0.]]), torch.randn(2, 3)
    want = X.sum(1).expand(2, 2) * (D != 0)
    f = torch.compile(lambda A, Y: (A @ Y).sum(), backend="aot_eager", fullgraph=True)
    for copy_of in (copy.deepcopy, lambda A: pickle.loads(pickle.dumps(A)), loaded,
                    lambda A: loaded(A, weights_only=True)):
        B = copy_of(st.tensor(D).requires_grad_())
        f(B, X).backward()
        torch.testing.assert_close(B.grad.to_dense(), want)


@pytest.mark.slow   # ~4 s; aot_eager with sparse inputs stays in the default run above
def test_sparse_input_not_a_leaf():
    ref = _sparse_input_grads(SPARSE_INPUT["spgemm_twice_used"], leaf=False)
    got = _sparse_input_grads(SPARSE_INPUT["spgemm_twice_used"], "aot_eager", leaf=False)
    _same(ref, got)


@pytest.mark.slow   # ~10 s; inductor stays in the default run with the SpMM test below
def test_inductor_sparse_input_requiring_grad():
    ref = _sparse_input_grads(SPARSE_INPUT["spmm"])
    got = _sparse_input_grads(SPARSE_INPUT["spmm"], "inductor")
    _same(ref, got)


@pytest.mark.slow   # inductor compiles the graph and its backward: ~9 s (the full suite runs it)
def test_inductor_spmm_forward_and_backward():
    ref = _grads(BACKWARD["spmm_relu"])
    got = _grads(BACKWARD["spmm_relu"], "inductor")
    _same(ref, got)


@pytest.mark.slow   # ~3 s; inductor stays in the default run with the SpMM test above
def test_inductor_values_of_a_result():
    ref = _grads(BACKWARD["sddmm_values"])
    got = _grads(BACKWARD["sddmm_values"], "inductor")
    _same(ref, got)


# ``[.]``: dynamo's error quotes the failing source line, which must not match by itself
@pytest.mark.parametrize("fn, fix", [
    (lambda A: (A @ A.t()).arrays["crd1"] + 1, "return it and read [.]arrays outside"),
    (lambda A: (A @ A.t()).nnz, r"read C[.]values[.]shape\[0\] instead"),
    (lambda A: (A * 2.0).format.name == "csr", "decide on formats outside"),
])
def test_untraceable_attributes_of_a_result_name_the_fix(fn, fix):
    with pytest.raises(RuntimeError, match=fix):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(A)


def test_eager_values_are_the_stored_tensor():
    """Outside torch.compile ``.values`` hands out the stored tensor itself, never a copy."""
    w = A.values.detach().clone().requires_grad_()
    C = A @ A.t()
    assert A.values is A._values and C.values is C._values
    assert A.with_values(w).values is w


@pytest.mark.slow
def test_graph_cached_by_another_process_finds_its_kernels(tmp_path, monkeypatch):
    """Regression: inductor's on-disk graph cache replays a graph in a new process, whose
    kernel registry is empty; the kernel is rebuilt from the recipe in the kernel cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("SPARSETORCH_CACHE", str(tmp_path / "kernels"))
    code = """
        import torch, sparsetorch as st
        A = st.tensor(torch.eye(4) + torch.diag(torch.ones(3), 1), "csr")
        w = A.values.clone().requires_grad_()
        X = (torch.arange(8.).reshape(4, 2) - 3).requires_grad_()
        f = torch.compile(lambda w, X: torch.relu(A.with_values(w) @ X).sum(), fullgraph=True)
        f(w, X).backward()
        torch.testing.assert_close(X.grad, A.to_dense().T @ (A.to_dense() @ X > 0).float())
    """
    run_isolated(code)
    run_isolated(code)      # the second process hits inductor's cache


@pytest.mark.slow
def test_cache_key_of_a_sparse_input(tmp_path, monkeypatch):
    """``_stable_hash_for_caching`` (the AOT-autograd cache key): the same for tensors of one
    structure, whatever their values; different for another format, shape, value or index
    dtype, or gradient requirement; and torch no longer warns that it is missing."""
    def key(t):
        return t._stable_hash_for_caching()

    B = st.tensor(_matrix(6, 5, 0) * 3, "csr")
    assert key(A) == key(B) == key(A.with_values(A.values + 1))
    others = [A.asformat("coo"), A.asformat("csc"), st.tensor(_matrix(6, 4, 0), "csr"),
              A.to(torch.float32), st.tensor(_matrix(6, 5, 0), "csr", index_dtype=torch.int64),
              A.with_values(A.values.clone().requires_grad_())]
    keys = [key(t) for t in others]
    assert len(set(keys)) == len(keys) and key(A) not in keys
    # (a fresh process: torch warns once per process; an "error" filter would be swallowed
    # by the cache, which bypasses itself on any error. Its own graph cache: one another
    # process filled would hold kernels of another kernel cache.)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    run_isolated("""
        import warnings, torch, sparsetorch as st
        A = st.tensor(torch.eye(4) + torch.diag(torch.ones(3), 1), "csr")
        w = A.values.detach().clone().requires_grad_()
        X = torch.randn(4, 2, requires_grad=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            f = torch.compile(lambda w, X: torch.relu(A.with_values(w) @ X).sum(),
                              fullgraph=True)
            f(w, X).backward()
        assert not [w for w in seen if "_stable_hash_for_caching" in str(w.message)]
    """)


def test_inductor_sparse_result():
    fn, args = FORWARD["einsum_sddmm_sparse_result"]
    check_same(torch.compile(fn, fullgraph=True)(*args), fn(*args))


def test_a_graph_break_mode_compile_takes_an_assembled_result_in_the_backward():
    """Without ``fullgraph=True`` dynamo refused the emitted kernel's entry count (its
    ``capture_dynamic_output_shape_ops`` is off by default) and retried the frames below
    eagerly, failing inside the dispatch: ``A @ x`` with ``x`` requiring grad (its backward
    re-lays A) raised dynamo's AttributeError, so SparseLinear could not train at batch 1."""
    x = x6[:5].clone().requires_grad_()
    y = torch.compile(lambda a, v: a @ v, backend="aot_eager")(A, x)
    y.sum().backward()
    torch.testing.assert_close(y, A.to_dense() @ x.detach())
    torch.testing.assert_close(x.grad, A.to_dense().sum(0))


ASSEMBLED = ["spgemm", "sparse_add_scale", "lazy_tree", "lazy_out_format", "einsum_out_format",
             "spgemm_values", "spgemm_to_dense"]


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("name", ASSEMBLED)
def test_the_torch_backend_compiles_assembled_results(name, fullgraph, monkeypatch):
    """``SPARSETORCH_BACKEND=torch`` (and so the Triton backend's fallback) builds a new
    sparse result from a dense one with ``nonzero``, whose count dynamo could not guard on:
    SpGEMM, sparse + sparse and elementwise trees failed to compile. It is one custom op
    (``sparsetorch::sparse_from_dense``) with a data-dependent size rule now."""
    fn, args = FORWARD[name]
    ref = fn(*args)
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    check_same(torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")(*args), ref)


@pytest.mark.slow   # ~4 s: a compiled backward (the full suite runs it)
def test_the_torch_backend_compiles_the_gradient_of_an_assembled_result(monkeypatch):
    ref = _sparse_input_grads(SPARSE_INPUT["spgemm_twice_used"])
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    _same(ref, _sparse_input_grads(SPARSE_INPUT["spgemm_twice_used"], "aot_eager"))


def _prepared(equation, *operands):
    """The call recipe ``st.einsum`` builds for these operands (the registry's entry)."""
    from sparsetorch.compiler.notation import parse_einsum, var_extents

    assignment = parse_einsum(equation, [t.dim() for t in operands])
    tensors, infos, dtype, _ = execute.normalize_operands(operands, "test")
    extents = var_extents(assignment, [tuple(t.shape) for t in tensors])
    kernel = execute.get_kernel(assignment, tensors, infos, dtype, None, extents)
    return execute._Prepared(kernel, dtype, execute._compile_args(assignment, tensors, infos,
                                                                   dtype, None))


@pytest.mark.parametrize("equation, operands, op", [
    ("ij,jk->ik", (A, X), "dense_kernel"),
    ("ij,ik,jk->ij", (A, U, X), "sampled_kernel"),
    ("ij,jk->ik", (A, st.tensor(_matrix(5, 4, 5), "csr")), "emit_kernel"),
])
def test_opcheck(equation, operands, op):
    prepared = _prepared(equation, *operands)
    key = custom_ops.kernel_id(prepared)
    args = (key, custom_ops.flatten(operands), prepared.extents(operands))
    torch.library.opcheck(getattr(torch.ops.sparsetorch, op), args)


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsc", "bsr"])
def test_opcheck_sparse_from_dense(fmt):
    dense = _matrix(6, 4, 7)
    form = st.tensor(dense, fmt, blocksize=(2, 2) if fmt == "bsr" else None).format
    out = custom_ops.from_dense(dense, form)
    check_same(out, st.tensor(dense, form))
    torch.library.opcheck(torch.ops.sparsetorch.sparse_from_dense,
                          (custom_ops.format_key(form), dense))


def test_fake_kernels_shapes():
    B = st.tensor(_matrix(5, 4, 5), "csr")
    eager = st.einsum("ij,jk->ik", A, B)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode:
        fX, fU = mode.from_tensor(X), mode.from_tensor(U)
        dense = A @ fX
        sampled = st.einsum("ij,ik,jk->ij", A, fU, fX)
        emitted = st.einsum("ij,jk->ik", A, B.with_values(mode.from_tensor(B.values)))
    assert tuple(dense.shape) == (6, 3) and dense.dtype == F64
    assert sampled.format == A.format and sampled.values.shape == A.values.shape
    assert sampled._level_arrays["crd1"] is A._level_arrays["crd1"]        # the operand's own pattern
    assert emitted.format == eager.format and tuple(emitted.shape) == (6, 4)
    nnz = emitted.values.shape[0]
    assert isinstance(nnz, torch.SymInt)                       # data-dependent size
    assert emitted.arrays["crd1"].shape[0] == nnz
    assert tuple(emitted.arrays["pos1"].shape) == (7,)
    assert emitted.arrays["pos1"].dtype == eager.arrays["pos1"].dtype


def test_eager_calls_skip_the_custom_ops():
    """The eager path calls the ctypes kernels directly (the dispatcher costs several us)."""
    B = st.tensor(_matrix(5, 4, 5), "csr")
    before = dict(custom_ops.CALLS)
    x = torch.randn(5, dtype=F64)
    for _ in range(3):
        st.einsum("ij,j->i", A, x)                    # dense result, memoised shim
        A @ X
        st.einsum("ij,ik,jk->ij", A, U, X)            # sampled
        st.einsum("ij,jk->ik", A, B)                  # emitted
    w = A.values.detach().clone().requires_grad_()
    (A.with_values(w) @ X).sum().backward()           # grad mode: forward and backward
    assert custom_ops.CALLS == before
    assert not custom_ops.is_tracing([A, X])


def test_unknown_kernel_id_names_the_fix():
    with pytest.raises(RuntimeError, match="not registered in this process"):
        torch.ops.sparsetorch.dense_kernel("nope#0", [X], [1])
