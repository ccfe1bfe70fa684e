"""The Triton backend's cases, run on CPU tensors through Triton's interpreter.

``test_triton.py`` runs this module in a fresh process with ``TRITON_INTERPRET=1`` (Triton
reads it when it is imported, and torch imports Triton with ``torch._dynamo``, so it
cannot be set later in a shared process); run by hand:
``TRITON_INTERPRET=1 python -m pytest tests/triton_cases.py``. Without that variable (the
main test run imports this file for its doctests) every case skips. Each case sets
``SPARSETORCH_BACKEND=triton`` for itself. Each kernel class
is checked against dense with ``check_against_dense`` and counted in ``triton_run.stats``,
so a test fails if its call silently took the fallback. The interpreter runs a program per
row in Python: shapes stay tiny.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from sparsetorch.compiler.notation import parse_einsum
from sparsetorch.ops.blocked import split_blocked
from hypothesis import given, settings, strategies as st_h
from dense_check import (LONG, check_against_dense, examples, private_kernel_cache,  # noqa: F401
                         random_dense)

pytest.importorskip("triton", reason="triton is not installed (pip install 'sparsetorch[gpu]')")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off: tests/test_triton.py runs these cases with "
                "TRITON_INTERPRET=1", allow_module_level=True)

from sparsetorch.codegen import triton as codegen  # noqa: E402
from sparsetorch.ops import triton_run  # noqa: E402

# The interpreter evaluates both sides of a tl.where with numpy, so an empty row's
# ``inv = z != 0 ? 1 / z : 0`` divides by zero there (on a GPU it is a select).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BACKEND", "triton")
    triton_run.stats.clear()


def matrix(rows, cols, dtype, seed, density=0.4):
    """Integer-valued (exact in every dtype) with empty first and last rows and columns."""
    g = torch.Generator().manual_seed(seed)
    return random_dense((rows, cols), density, dtype, g, empty_slices=True)


def dense(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def check(fn, operands, ref, kind, ran):
    """``fn`` against ``ref`` on dense copies, and the Triton kernel class ``ran`` ran."""
    dtype = next(t.dtype for t in operands if isinstance(t, torch.Tensor))
    out = check_against_dense(fn, operands, ref=ref, kind=kind, rtol=RTOL[dtype],
                              atol=RTOL[dtype])
    assert triton_run.stats[ran] >= 1 and not triton_run.stats["fallback"], triton_run.stats
    return out


# every value dtype, each index width twice (interpreted programs are slow: not the product)
DTYPE_INDEX = [(torch.float32, torch.int32), (torch.float16, torch.int64),
               (torch.bfloat16, torch.int32), (torch.float32, torch.int64)]


@pytest.mark.parametrize("dtype,index", DTYPE_INDEX)
def test_spmm(dtype, index):
    # 70 columns: two dense tiles of 64, the second a residue
    A = st.tensor(matrix(9, 7, dtype, 1), "csr", index_dtype=index)
    X = dense((7, 70), dtype, 2)
    check(lambda a, x: st.einsum("ij,jk->ik", a, x), (A, X),
          lambda a, x: a @ x, "dense", "dense")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spmv_and_matmul_operators(dtype):
    A = st.tensor(matrix(11, 6, dtype, 3), "csr")
    x = dense((6,), dtype, 4)
    check(lambda a, x: a @ x, (A, x), None, "dense", "dense")
    # a strided (transposed) dense operand is read through its strides, not copied
    X = dense((5, 6), dtype, 5)
    check(lambda a, x: a @ x.T, (A, X), None, "dense", "dense")


def test_csc_and_transposes_run_as_csr_rows():
    d = matrix(8, 5, torch.float32, 6)
    X = dense((5, 3), torch.float32, 7)
    check(lambda a, x: a @ x, (st.tensor(d, "csc"), X), lambda a, x: a @ x, "dense", "dense")
    Y = dense((8, 3), torch.float32, 8)
    check(lambda a, y: a.t() @ y, (st.tensor(d, "csr"), Y), lambda a, y: a.T @ y, "dense",
          "dense")
    # vectors too: their schedule walks the columns and scatters, so the operand is re-laid
    # (they ran the dense fallback, as did a CSR SpMV's backward, A^T g)
    x, y = dense((5,), torch.float32, 9), dense((8,), torch.float32, 10)
    check(lambda a, x: a @ x, (st.tensor(d, "csc"), x), lambda a, x: a @ x, "dense", "dense")
    check(lambda a, y: a.t() @ y, (st.tensor(d, "csr"), y), lambda a, y: a.T @ y, "dense",
          "dense")
    triton_run.stats.clear()
    xg = x.clone().requires_grad_()
    (st.tensor(d, "csr") @ xg).sum().backward()
    torch.testing.assert_close(xg.grad, d.sum(0))
    assert triton_run.stats["dense"] == 2 and not triton_run.stats["fallback"]


def test_linear_and_fused_epilogue():
    d = matrix(6, 5, torch.float32, 9)
    A, W, b = st.tensor(d, "csr"), dense((4, 5), torch.float32, 10), dense((4,), torch.float32, 11)
    check(lambda a, w, b: F.linear(a, w, b), (A, W, b), None, "dense", "dense")
    check(lambda x, a: F.linear(x, a), (dense((3, 5), torch.float32, 12), A), None, "dense",
          "dense")   # a sparse weight: the result's rows are A's columns (strided output)
    triton_run.stats.clear()
    for act, torch_fn in (("relu", torch.relu), ("relu6", F.relu6), ("abs", torch.abs)):
        out = check(lambda a, x, b: st.einsum("ij,jk->ik", a, x, bias=b, activation=act),
                    (A, W.T.contiguous(), b), lambda a, x, b: torch_fn(a @ x + b), "dense",
                    "dense")
        assert triton_run.stats["dense"] == 1   # one kernel: the epilogue is fused
        # a NaN passes the activation, as through torch's (Triton's maximum drops it unless
        # told to keep it)
        b_nan = b.clone()
        b_nan[1] = float("nan")
        out_nan = st.einsum("ij,jk->ik", A, W.T.contiguous(), bias=b_nan, activation=act)
        assert out_nan[:, 1].isnan().all() and not out_nan[:, 0].isnan().any()
        triton_run.stats.clear()
    assert out.shape == (6, 4)


@pytest.mark.parametrize("dtype,index", DTYPE_INDEX)
def test_sddmm(dtype, index):
    d = matrix(7, 9, dtype, 12)
    A = st.tensor(d, "csr", index_dtype=index)
    Xq, Yk = dense((7, 5), dtype, 13), dense((9, 5), dtype, 14)
    out = check(lambda a, x, y: st.einsum("ij,ik,jk->ij", a, x, y), (A, Xq, Yk),
                lambda a, x, y: a * (x @ y.T), "sparse", "sampled")
    assert out._level_arrays["crd1"] is A._level_arrays["crd1"]   # A's pattern, shared


def test_sddmm_transposed_operands_and_csc_mask():
    d = matrix(6, 8, torch.float32, 15)
    Xq, Yt = dense((6, 3), torch.float32, 16), dense((3, 8), torch.float32, 17)
    for fmt in ("csr", "csc"):
        check(lambda a, x, y: st.einsum("ij,ik,kj->ij", a, x, y), (st.tensor(d, fmt), Xq, Yt),
              lambda a, x, y: a * (x @ y), "sparse", "sampled")


@pytest.mark.parametrize("blocksize,dtype", [((2, 3), torch.float32), ((2, 2), torch.float16),
                                             ((16, 16), torch.float32),
                                             ((16, 16), torch.bfloat16)])
def test_bsr_spmm(blocksize, dtype):
    r, c = blocksize
    g = torch.Generator().manual_seed(r * c)
    blocks = torch.rand(3, 2, generator=g) < 0.5
    blocks[1] = False                                      # an empty block row
    d = torch.kron(blocks.to(dtype), torch.ones(r, c, dtype=dtype)) * dense((3 * r, 2 * c),
                                                                           dtype, 18)
    A = st.tensor(d, "bsr", blocksize=blocksize)
    X = dense((2 * c, 19), dtype, 19)
    check(lambda a, x: a @ x, (A, X), None, "dense", "blocked")
    if r >= 16:   # tensor cores: the dot path, with the fused epilogue on its tile
        new, tensors, _, static = split_blocked(parse_einsum("ij,jk->ik", [2, 2]), [A, X])
        kernel = triton_run._compiled(new, triton_run.infos_of(tensors), None, static)[2]
        assert "tl.dot(" in kernel.source and kernel.dot
        b = dense((19,), dtype, 20)
        check(lambda a, x, b: st.einsum("ij,jk->ik", a, x, bias=b, activation="relu"),
              (A, X, b), lambda a, x, b: torch.relu(a @ x + b), "dense", "blocked")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masked_attention(dtype):
    mask = matrix(7, 6, torch.float32, 21) != 0
    A = st.tensor(mask.to(dtype), "csr")
    g = torch.Generator().manual_seed(22)
    Q, K, V = (torch.randn(s, generator=g).to(dtype) for s in ((7, 3), (6, 3), (6, 5)))

    def ref(a, q, k, v):
        scores = (a * (q @ k.T)).masked_fill(a == 0, float("-inf"))
        return torch.softmax(scores, 1).nan_to_num(0.0) @ v   # empty rows: zeros

    check(st.ops.masked_attention, (A, Q, K, V), ref, "dense", "attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_softmax_and_its_gradient(dtype):
    d = matrix(6, 70, dtype, 33)   # rows over one BLOCK_NZ of 64 entries: several steps
    d[3, :] = 1
    A = st.tensor(d, "csr")

    def ref(a):
        return torch.softmax(a.masked_fill(a == 0, float("-inf")), 1).nan_to_num(0.0)

    check(lambda a: torch.sparse.softmax(a, 1), (A,), ref, "sparse", "row_softmax")
    vals = A.values.double().clone().requires_grad_()
    A64 = st.tensor(d.double(), "csr")
    torch.autograd.gradcheck(lambda v: torch.sparse.softmax(A64.with_values(v), 1).values,
                             (vals,), fast_mode=True)
    assert triton_run.stats["row_softmax_grad"] >= 1


def test_nothing_stored():
    A = st.tensor(torch.zeros(4, 3), "csr")
    X, Y = torch.ones(3, 2), torch.ones(4, 2)
    assert st.einsum("ij,jk->ik", A, X, bias=torch.ones(2)).equal(torch.ones(4, 2))
    assert st.einsum("ij,ik,jk->ij", A, Y, X).nnz == 0
    assert st.ops.masked_attention(A, Y, X, X).equal(torch.zeros(4, 2))
    B = st.tensor(torch.zeros(4, 4), "bsr", blocksize=(2, 2))
    assert (B @ torch.ones(4, 3)).equal(torch.zeros(4, 3))
    assert not triton_run.stats["fallback"]


def test_gradients_float64():
    d = matrix(4, 3, torch.float64, 23)
    A = st.tensor(d, "csr")
    vals = A.values.clone().requires_grad_()
    g = torch.Generator().manual_seed(24)
    X, Q, K = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((3, 2), (4, 2), (3, 2)))
    # (fast mode: one random direction, not one call per input element: interpreted
    # programs are slow)
    torch.autograd.gradcheck(lambda v, x: A.with_values(v) @ x, (vals, X), fast_mode=True)
    torch.autograd.gradcheck(lambda v, q, k: st.einsum("ij,ik,jk->ij", A.with_values(v), q,
                                                       k).values, (vals, Q, K), fast_mode=True)
    # every gradient is a Triton kernel too (dK reads G * A: one pattern, two value arrays)
    assert triton_run.stats["dense"] and triton_run.stats["sampled"]
    assert not triton_run.stats["fallback"]


def test_attention_gradient_float32_against_dense():
    mask = matrix(5, 4, torch.float32, 25) != 0
    A = st.tensor(mask.float(), "csr")
    g = torch.Generator().manual_seed(26)
    Q, K, V = (torch.randn(s, generator=g, requires_grad=True) for s in ((5, 3), (4, 3), (4, 2)))
    st.ops.masked_attention(A, Q, K, V).square().sum().backward()
    got = [t.grad.clone() for t in (Q, K, V)]
    for t in (Q, K, V):
        t.grad = None
    scores = (mask * (Q @ K.T)).masked_fill(~mask, float("-inf"))
    (torch.softmax(scores, 1).nan_to_num(0.0) @ V).square().sum().backward()
    for a, t in zip(got, (Q, K, V)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)
    assert triton_run.stats["row_softmax_grad"] and triton_run.stats["sampled"]
    assert not triton_run.stats["fallback"]


def test_sparse_linear_layer_forward_and_backward():
    layer = st.nn.SparseLinear(6, 4, density=0.5, generator=torch.Generator().manual_seed(34))
    x = dense((3, 6), torch.float32, 35).requires_grad_()
    layer(x).square().sum().backward()
    W = layer.weight.to_dense().detach().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach()
    F.linear(x.detach(), W, b).square().sum().backward()
    torch.testing.assert_close(layer.values.grad, W.grad[layer.weight.to_dense() != 0])
    assert triton_run.stats["dense"] and triton_run.stats["sampled"]
    assert not triton_run.stats["fallback"]


def test_uncovered_expressions_fall_back_on_the_device():
    d = matrix(5, 4, torch.float32, 27)
    A, B = st.tensor(d, "csr"), st.tensor(d * 2, "csr")
    out = (A + B).to_dense()
    assert out.equal(d * 3) and out.device == d.device
    assert triton_run.stats["fallback"] == 1


def test_a_product_of_one_pattern_under_a_map_is_not_folded():
    """Operands sharing one pattern fold into one operand's values only as factors of a
    product: relu(A) * B was computed as relu(A * B) (and relu(A) * A as A * A)."""
    d = torch.tensor([[1., 0., -2.], [0., -3., 0.]])
    A = st.tensor(d, "csr")
    B = A.with_values(torch.tensor([-1., 2., 1.]))
    for fn, ref in ((lambda a, b: (st.lazy(a).relu() * b).eval(),
                     lambda a, b: torch.relu(a) * b),
                    (lambda a, b: (st.lazy(a).abs() * b * 2).eval(),
                     lambda a, b: a.abs() * b * 2),
                    (lambda a, b: (st.lazy(a).relu() * a).eval(),
                     lambda a, b: torch.relu(a) * a)):
        got = fn(A, B).to_dense()
        torch.testing.assert_close(got, ref(d, B.to_dense()))
    triton_run.stats.clear()   # a plain product still folds and runs the kernel
    got = (st.lazy(A) * B * 3).eval().to_dense()
    torch.testing.assert_close(got, d * B.to_dense() * 3)
    assert not triton_run.stats["fallback"], triton_run.stats


def test_replaced_values_are_refused_as_on_the_c_backend():
    """The kernels read as many values as the pattern stores: a values tensor replaced by
    a shorter or strided one (``.data =``) is a ValueError, not a read past its end."""
    d = torch.tensor([[1., 0., 2.], [0., 3., 0.], [4., 0., 5.]])
    for replacement in (torch.ones(2), torch.ones(10)[::2]):
        A = st.tensor(d, "csr")
        A.values.data = replacement
        for call in (lambda: A @ torch.eye(3), lambda: torch.sparse.softmax(A, 1),
                     lambda: st.ops.masked_attention(A, torch.ones(3, 2), torch.ones(3, 2),
                                                     torch.ones(3, 2))):
            with pytest.raises(ValueError, match="values were replaced"):
                call()


def test_mixed_devices_name_both():
    A = st.tensor(matrix(3, 3, torch.float32, 28), "csr")
    with pytest.raises(ValueError, match="meta.*cpu|cpu.*meta"):
        st.einsum("ij,jk->ik", A, torch.ones(3, 2, device="meta"))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    A = st.tensor(torch.eye(2), "csr")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        st.einsum("ij,jk->ik", A, torch.ones(2, 2))


def test_row_swizzle_is_kept_per_pattern():
    A = st.tensor(matrix(6, 6, torch.float32, 29), "csr")
    pos = A._level_arrays["pos1"]      # the stored array (.arrays hands out copies)
    order = triton_run.row_order(pos)
    lengths = (pos[1:] - pos[:-1])[order.long()]
    assert bool((lengths[:-1] >= lengths[1:]).all())
    assert triton_run.row_order(pos) is order
    source = triton_run._fixed("attention").source
    assert codegen.load(source) is codegen.load(source)


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long run: set SPARSETORCH_LONG_TESTS=1")
def test_long_matrix():
    d = matrix(300, 200, torch.float32, 30, density=0.1)
    A, X = st.tensor(d, "csr"), dense((200, 80), torch.float32, 31)
    check(lambda a, x: a @ x, (A, X), None, "dense", "dense")
    Y = dense((300, 80), torch.float32, 32)
    check(lambda a, y, x: st.einsum("ij,ik,jk->ij", a, y, x), (A, Y, X),
          lambda a, y, x: a * (y @ x.T), "sparse", "sampled")


def test_torch_compile_records_triton_launches():
    """Under torch.compile a call becomes one ``sparsetorch::triton_call`` node that runs
    the Triton kernel (SpMM with a fused ReLU, and SDDMM), not the dense fallback."""
    from sparsetorch.ops import custom_ops, triton_ops  # noqa: F401 (registers the op)

    a = matrix(9, 7, torch.float32, 11)
    A = st.tensor(a, "csr")
    x, y = dense((7, 5), torch.float32, 12), dense((9, 5), torch.float32, 13)

    def f(A, x, y):   # one trace for both (each costs seconds)
        return (st.einsum("ij,jk->ik", A, x, activation="relu"),
                st.einsum("ij,ik,jk->ij", A, y, x))

    spmm, sddmm = torch.compile(f, backend="aot_eager", fullgraph=True)(A, x, y)
    torch.testing.assert_close(spmm, torch.relu(a @ x))
    torch.testing.assert_close(sddmm.to_dense(), a * (y @ x.T))
    assert triton_run.stats["dense"] >= 1 and triton_run.stats["sampled"] >= 1, triton_run.stats
    assert not triton_run.stats["fallback"], triton_run.stats
    assert custom_ops.CALLS == {"dense": 0, "sampled": 0, "emit": 0}   # no C kernel ran


def test_torch_compile_takes_an_assembled_result_from_the_fallback():
    """SpGEMM and sparse + sparse (no Triton kernel: the dense fallback) compile: the
    fallback's result is gathered by one ``sparsetorch::sparse_from_dense`` node, whose
    entry count is a data-dependent size (``nonzero`` stopped the graph)."""
    a, b = matrix(6, 6, torch.float32, 14), matrix(6, 6, torch.float32, 15)
    A, B = st.tensor(a, "csr"), st.tensor(b, "csr")
    product, total = torch.compile(lambda A, B: (A @ B, A + B), backend="aot_eager",
                                   fullgraph=True)(A, B)
    torch.testing.assert_close(product.to_dense(), a @ b)
    torch.testing.assert_close(total.to_dense(), a + b)
    assert product.format.name == total.format.name == "csr"
    assert triton_run.stats["fallback"] >= 2, triton_run.stats


@settings(max_examples=examples(12), deadline=None)
@given(data=st_h.data())
def test_random_expressions_against_dense(data):
    """Random einsum expressions over one CSR/CSC operand and up to two dense ones: each
    runs a Triton kernel rendered from its plain nest or the fallback, and equals dense."""
    fmt = data.draw(st_h.sampled_from(["csr", "csc"]))
    letters = "ijk"
    sizes = dict(zip(letters, data.draw(st_h.lists(st_h.integers(1, 5), min_size=3,
                                                   max_size=3))))
    dense_terms = data.draw(st_h.lists(
        st_h.lists(st_h.sampled_from(letters), min_size=1, max_size=2, unique=True),
        min_size=1, max_size=2))
    used = ["ij"] + ["".join(t) for t in dense_terms]
    seen = sorted(set("".join(used)))
    out = "".join(data.draw(st_h.lists(st_h.sampled_from(seen), max_size=2, unique=True)))
    equation = ",".join(used) + "->" + out
    seed = data.draw(st_h.integers(0, 1000))
    d = matrix(sizes["i"], sizes["j"], torch.float32, seed, density=0.5)
    operands = [st.tensor(d, fmt)] + [dense(tuple(sizes[c] for c in t), torch.float32,
                                            seed + n + 1) for n, t in enumerate(used[1:])]
    got = st.einsum(equation, *operands)
    got = got.to_dense() if isinstance(got, st.SparseTensor) else got
    ref = torch.einsum(equation, d, *operands[1:])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
