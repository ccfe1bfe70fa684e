"""Issue 31 item 1: integer values and mixed dtypes follow torch's type promotion. Every
case runs the op on SparseTensors and the same op on dense torch tensors, and compares
dtype and values (``A * 0.5`` on int64 values returned zeros; ``A / 2``, ``st.sqrt`` and
``st.exp`` truncated; an int32 ``.sum()`` overflowed; float32 with float64 raised)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401 (fixture)
from helpers import examples, one_thread  # noqa: F401 (autouse fixture)

DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)
# each kind of pair once (a kernel per result dtype: cold builds dominate this file's time)
PAIRS = [(torch.int32, torch.int64), (torch.int64, torch.float32), (torch.float32, torch.float64),
         (torch.float64, torch.int32), (torch.int32, torch.int32)]
BASE = torch.tensor([[1, 0, 3, 0], [0, -5, 0, 2], [4, 0, 0, 7]])
OTHER = torch.tensor([[2, 1, 0, 0], [0, 3, 0, -1], [1, 0, 6, 7]])


def dense(t):
    return t.to_dense() if isinstance(t, st.SparseTensor) else t


def same(out, ref):
    """Same dtype and values as the dense torch result."""
    out = dense(out)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_issue31_1_scalars_and_maps_promote_as_torch(dtype):
    d = BASE.to(dtype)
    A = st.tensor(d, "csr")
    for op in (lambda x: x * 0.5, lambda x: 0.5 * x, lambda x: x / 2, lambda x: x * 2,
               lambda x: x * True, lambda x: -x, lambda x: x - x * 3, lambda x: x ** 2):
        same(op(A), op(d))
    for sparse_map, torch_map in ((st.sqrt, torch.sqrt), (st.exp, torch.exp),
                                  (st.relu, torch.relu), (st.abs, torch.abs)):
        a = st.tensor(d.abs(), "csr") if sparse_map is st.sqrt else A
        same(sparse_map(a), torch_map(d.abs() if sparse_map is st.sqrt else d))
    lazy = (st.lazy(A) * 3 + st.lazy(A) / 4).relu().eval()
    same(lazy, torch.relu(d * 3 + d / 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_issue31_1_integer_sums_are_int64(dtype):
    d = torch.full((3, 4), 2**30).to(dtype) if not dtype.is_floating_point else BASE.to(dtype)
    A = st.tensor(d, "coo")
    same(A.sum(), d.sum())
    same(A.sum(1), d.sum(1))
    same(torch.sparse.sum(A, 0).to_dense(), d.sum(0))
    # st.einsum as torch.einsum: one operand summed over an index sums in int64 (an int32
    # result wrapped around); products of two keep their type, and so do index moves
    for t in (A, d):
        for equation in ("ij->", "ij->i", "ij->j", "ij->ji"):
            same(st.einsum(equation, t), torch.einsum(equation, d))
        same(st.einsum("ij,kj->ik", t, d), torch.einsum("ij,kj->ik", d, d))


def test_issue31_1_the_torch_backend_gives_the_same_integer_types(monkeypatch):
    """``SPARSETORCH_BACKEND=torch`` as the kernels: an int32 product stays int32 (its
    dense sums made it int64), a summed single operand is int64."""
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    d = torch.full((3, 4), 2**30, dtype=torch.int32)
    for t in (st.tensor(d, "csr"), d):
        same(st.einsum("ij,kj->ik", t, d), torch.einsum("ij,kj->ik", d, d))
        same(st.einsum("ij->i", t), torch.einsum("ij->i", d))


def test_issue31_1_integer_einsums_sum_bools_and_narrow_integers_in_int64():
    """Dense operands of types the kernels do not take (SparseTensors refuse them) are
    summed as int64, as torch's; other einsums of them say the type is not supported."""
    for dtype in (torch.bool, torch.uint8, torch.int16):
        d = (BASE != 0).to(dtype)
        same(st.einsum("ij->i", d), torch.einsum("ij->i", d))
        with pytest.raises(TypeError, match=f"dtype {dtype}, which is not supported"):
            st.einsum("ij->ji", d)


@pytest.mark.slow
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS, ids=str)
def test_issue31_1_mixed_operands_promote_as_torch(a_dtype, b_dtype):
    da, db = BASE.to(a_dtype), OTHER.to(b_dtype)
    A, B = st.tensor(da, "csr"), st.tensor(db, "csr")
    same(A * B, da * db)
    same(A + B, da + db)
    same(A - B, da - db)
    same(A * db, da * db)            # sparse times dense: A's pattern
    same(A + db, da + db)            # dense result
    same(A * db[1], da * db[1])      # a broadcast row
    # torch's products refuse mixed dtypes; these promote to torch.result_type
    common = torch.result_type(da, db)
    ref = da.to(common) @ db.T.to(common)
    same(A @ db.T, ref)
    same(st.einsum("ij,kj->ik", A, B), ref)
    same(st.einsum("ij,kj->ik", A, db), ref)


@settings(max_examples=examples(8), deadline=None)
@given(dtype=hst.sampled_from(DTYPES),
       scalar=hst.one_of(hst.integers(-4, 4), hst.floats(-4, 4, allow_nan=False).filter(
           lambda x: abs(x) > 1e-3)))
def test_issue31_1_any_scalar_scales_as_torch(dtype, scalar):
    d = BASE.to(dtype)
    A = st.tensor(d, "csr")
    same(A * scalar, d * scalar)
    if scalar != 0:
        same(A / scalar, d / scalar)


@pytest.mark.parametrize("a_dtype,b_dtype,bias_dtype", [
    (torch.int64, torch.float32, torch.float32), (torch.int32, torch.int32, torch.float64),
    (torch.float32, torch.float64, torch.float32)], ids=str)
def test_issue31_1_fused_bias_and_activation_promote_as_torch(a_dtype, b_dtype, bias_dtype):
    """``st.einsum(..., bias=, activation=)`` (one fused kernel) gives torch's result type of
    ``activation(einsum(...) + bias)``: the bias takes part in the promotion."""
    A = st.tensor(BASE.to(a_dtype), "csr")
    x = torch.tensor([1, -2, 3, 1]).to(b_dtype)
    bias = torch.tensor([0.5, -40.0, 2.0]).to(bias_dtype)
    common = torch.promote_types(a_dtype, b_dtype)        # (torch's matmul does not promote)
    ref = BASE.to(common) @ x.to(common)
    same(st.einsum("ij,j->i", A, x, bias=bias, activation="relu"), torch.relu(ref + bias))
    same(st.einsum("ij,j->i", A, x, bias=bias), ref + bias)


@pytest.mark.parametrize("activation", ["sqrt", "exp", "sigmoid"])
def test_issue31_1_float_maps_of_an_integer_einsum_are_floats(activation):
    """exp, sqrt and sigmoid of an integer result are floats, as torch's (the kernel
    computed them in the integer type: sigmoid gave all zeros)."""
    fn = {"sqrt": torch.sqrt, "exp": torch.exp, "sigmoid": torch.sigmoid}[activation]
    d = BASE.abs().to(torch.int32)
    x = torch.tensor([1, 2, 0, 1], dtype=torch.int32)
    for A in (st.tensor(d, "csr"), d):
        for bias in (None, torch.tensor([1, 0, 2], dtype=torch.int32)):
            ref = d @ x + (0 if bias is None else bias)
            for _ in range(2):   # (the second call: the memoised fast path)
                same(st.einsum("ij,j->i", A, x, bias=bias, activation=activation), fn(ref))


@pytest.mark.slow   # a torch.compile trace (~5-10 s)
def test_issue31_1_traced_lazy_expressions_promote_as_torch():
    """Under torch.compile a lazy expression crosses into the graph as a string; whether a
    float scalar or map takes part crosses with it (``A * 0.5`` on int64 values gave 0)."""
    A = st.tensor(BASE, "csr")
    x = torch.rand(3, 4)

    def f(A, x):
        return (st.lazy(A) * 0.5).eval(), (st.lazy(A) * 0.5 + st.lazy(x)).eval()

    scaled, summed = torch.compile(f)(A, x)
    same(scaled, BASE * 0.5)
    same(summed, BASE * 0.5 + x)
