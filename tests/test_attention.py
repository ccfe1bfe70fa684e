"""Fused masked attention (SDDMM -> row softmax -> SpMM) against dense, and its fallbacks."""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from dense_check import compiled_keeping_graphs, fresh_dynamo  # noqa: F401


def reference(mask_dense, A_dense, Q, K, V):
    scores = (A_dense * (Q @ K.T)).masked_fill(~mask_dense, float("-inf"))
    return torch.softmax(scores, 1).nan_to_num(0.0) @ V     # empty rows: zeros


def operands(n, m, d, e, dtype, fmt, seed, density=0.3, index=torch.int64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, m, generator=g) < density
    if n > 2:
        mask[n // 2] = False                                 # an empty row
    dense = mask * (torch.rand(n, m, generator=g, dtype=dtype) + 0.5)
    A = st.tensor(dense, format=fmt, index_dtype=index)
    Q, K = (torch.randn(s, d, generator=g, dtype=dtype) for s in (n, m))
    V = torch.randn(m, e, generator=g, dtype=dtype)
    return mask, dense, A, Q, K, V


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_matches_dense(fmt, dtype, index):
    for n, m, d, e in [(13, 11, 5, 3), (40, 31, 16, 64), (9, 70, 33, 65), (1, 1, 1, 1)]:
        mask, dense, A, Q, K, V = operands(n, m, d, e, dtype, fmt, seed=n + e, index=index)
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(st.ops.masked_attention(A, Q, K, V),
                                   reference(mask, dense, Q, K, V), rtol=tol, atol=tol)


def test_empty_mask_gives_zeros():
    A = st.tensor(torch.zeros(4, 5), format="csr")
    out = st.ops.masked_attention(A, torch.ones(4, 2), torch.ones(5, 2), torch.ones(5, 3))
    assert torch.equal(out, torch.zeros(4, 3))


@pytest.mark.slow
def test_fused_matches_unfused_and_gradients_flow():
    mask, dense, A, Q, K, V = operands(12, 10, 4, 6, torch.float64, "csr", seed=3)
    from sparsetorch.ops.attention import _unfused
    torch.testing.assert_close(st.ops.masked_attention(A, Q, K, V), _unfused(A, Q, K, V))
    Q.requires_grad_(), V.requires_grad_()
    values = A.values.clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda v, q, w: st.ops.masked_attention(A.with_values(v), q, K, w),
        (values, Q, V))


def test_bad_input():
    A = st.tensor(torch.eye(3), format="csr")
    with pytest.raises(TypeError, match="SparseTensor"):
        st.ops.masked_attention(torch.eye(3), torch.ones(3, 2), torch.ones(3, 2),
                                torch.ones(3, 2))
    with pytest.raises(ValueError, match="shapes do not agree"):
        st.ops.masked_attention(A, torch.ones(3, 2), torch.ones(3, 4), torch.ones(3, 2))
    with pytest.raises(TypeError, match="dtype"):
        st.ops.masked_attention(A, torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 2),
                                torch.ones(3, 2))
    ones = torch.ones(3, 2)
    with pytest.raises(TypeError, match="3-D SparseTensor"):
        st.ops.masked_attention(st.tensor(torch.ones(3, 3, 1), format="csf"), ones, ones, ones)
    with pytest.raises(TypeError, match=r"K must be a dense 2-D torch.Tensor, got shape \(3,\)"):
        st.ops.masked_attention(A, ones, torch.ones(3), ones)
    # a dense-format mask stores every entry: converting it for the kernel would drop zeros
    with pytest.raises(TypeError, match="dense format.*format='csr'"):
        st.ops.masked_attention(st.tensor(torch.eye(3), format="dense"), ones, ones, ones)
    with pytest.raises(TypeError, match="floating point"):
        st.ops.masked_attention(A.to(torch.int64), *(o.long() for o in (ones, ones, ones)))


@pytest.mark.slow   # ~3 s; test_nn_attention compiles the layer by default (the full suite runs it)
def test_compiles_with_torch_compile():
    mask, dense, A, Q, K, V = operands(10, 9, 4, 5, torch.float64, "csr", seed=4)
    f = torch.compile(lambda A, Q, K, V: st.ops.masked_attention(A, Q, K, V),
                      backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(A, Q, K, V), reference(mask, dense, Q, K, V))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("grad", [False, True])
def test_traced_inference_records_the_fused_kernel(grad):
    """Traced without a gradient wanted, the fused kernel is one custom op
    (``sparsetorch::masked_attention``); with one, the unfused differentiable ops."""
    mask, dense, A, Q, K, V = operands(12, 9, 4, 5, torch.float32, "csr", seed=5)
    Q.requires_grad_(grad)
    graphs = []
    f = compiled_keeping_graphs(lambda A, Q, K, V: st.ops.masked_attention(A, Q, K, V),
                                graphs)
    out = f(A, Q, K, V)
    torch.testing.assert_close(out, reference(mask, dense, Q, K, V))
    assert ("sparsetorch.masked_attention" in str(graphs[0].graph)) != grad
    if grad:
        want = torch.autograd.grad(reference(mask, dense, Q, K, V).sum(), Q)[0]
        torch.testing.assert_close(torch.autograd.grad(out.sum(), Q)[0], want)
    torch.library.opcheck(torch.ops.sparsetorch.masked_attention,
                          (A._pos1, A._crd1, A.values, 9, Q.detach(), K, V))
