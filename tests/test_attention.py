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


# -- copies of one mask along a block diagonal -------------------------------------------------
def _block_reference(mask_dense, copies, scale, Q, K, V):
    """Each copy's rows attend to their own copy's keys, densely."""
    n, m = mask_dense.shape
    A = mask_dense.to(Q.dtype) * scale
    return torch.cat([reference(mask_dense, A, Q[c * n:(c + 1) * n], K[c * m:(c + 1) * m],
                                V[c * m:(c + 1) * m]) for c in range(copies)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,m,copies,density", [(7, 7, 3, 0.4), (5, 9, 2, 0.3), (1, 1, 1, 1.0),
                                                (4, 6, 2, 0.0)])
def test_block_diagonal_attention_matches_dense(dtype, index, n, m, copies, density):
    """Values and gradients (the op's own backward, written out) against dense attention
    per copy; rectangular masks (cross-attention), an empty row, no entries at all."""
    from sparsetorch.ops.attention import block_diagonal_attention
    mask, _, A, _, _, _ = operands(n, m, 1, 1, dtype, "csr", seed=n * copies,
                                   density=density, index=index)
    g = torch.Generator().manual_seed(copies)
    Q, K, V = (torch.randn(copies * s, w, generator=g, dtype=dtype, requires_grad=True)
               for s, w in ((n, 4), (m, 4), (m, 3)))
    out = block_diagonal_attention(A, copies, 0.7, Q, K, V)
    ref = _block_reference(mask, copies, 0.7, Q, K, V)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref, **tol)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (Q, K, V), dout),
                    torch.autograd.grad(ref, (Q, K, V), dout)):
        torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float64 and density:
        assert torch.autograd.gradcheck(
            lambda q, k, v: block_diagonal_attention(A, copies, 0.7, q, k, v), (Q, K, V))


def test_block_diagonal_attention_refuses_bad_input():
    from sparsetorch.ops.attention import block_diagonal_attention
    A, ones = st.tensor(torch.eye(3), format="csr"), torch.ones(6, 2)
    with pytest.raises(ValueError, match=r"Q needs 2 x 3 rows"):
        block_diagonal_attention(A, 2, 1.0, torch.ones(5, 2), ones, ones)
    with pytest.raises(TypeError, match="mask must be a 2-D SparseTensor"):
        block_diagonal_attention(torch.eye(3), 2, 1.0, ones, ones, ones)
    bad = torch.tensor([0, 1, 2, 7], dtype=torch.int32)      # a column outside [0, 3)
    with pytest.raises(ValueError, match="crd holds a column index outside"):
        torch.ops.sparsetorch.block_diagonal_attention(
            torch.tensor([0, 1, 2, 4], dtype=torch.int32), bad, 3, 2, 1.0, ones, ones, ones)


def test_block_diagonal_attention_op_registration():
    """torch's own checks of the custom op: fake kernel, autograd registration, schema."""
    mask, _, A, _, _, _ = operands(6, 5, 1, 1, torch.float32, "csr", seed=9)
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(2 * s, 4, generator=g, requires_grad=True) for s in (6, 5, 5))
    torch.library.opcheck(torch.ops.sparsetorch.block_diagonal_attention,
                          (A._pos1, A._crd1, 5, 2, 0.5, Q, K, V))
