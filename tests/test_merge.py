"""Sparse factors on one pattern multiplied into one operand before a kernel runs
(``ops/merge.py``): results against dense for products that qualify, and the cases that
must not merge (a sum of the factors, other patterns, other indices, gradients)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from sparsetorch.compiler.notation import Scale, parse_einsum
from sparsetorch.ops.merge import merged


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    dense *= torch.rand(7, 5, generator=gen) < 0.4
    dense[2] = 0   # an empty row
    a = st.tensor(dense, format="csr")
    b = a.with_values(torch.randn(a.nnz, generator=gen, dtype=torch.float64))
    return a, b


def test_products_on_one_pattern_match_dense():
    a, b = _pair()
    x = torch.randn(5, 3, dtype=torch.float64)
    da, db = a.to_dense(), b.to_dense()
    for eq, ops, ref in (("ij,ij,jk->ik", (a, b, x), (da * db) @ x),
                         ("ij,ij,ik->jk", (a, b, torch.randn(7, 3, dtype=torch.float64)), None),
                         ("ij,ij->i", (a, b), (da * db).sum(1)),
                         ("ij,ij->ij", (a, b), da * db)):
        out = st.einsum(eq, *ops)
        out = out.to_dense() if isinstance(out, st.SparseTensor) else out
        if ref is None:
            ref = torch.einsum(eq, *[t.to_dense() if isinstance(t, st.SparseTensor) else t
                                     for t in ops])
        torch.testing.assert_close(out, ref)
        assert merged(parse_einsum(eq, [t.dim() for t in ops]), ops) is not None


def test_what_does_not_merge():
    a, b = _pair()
    other = st.tensor(b.to_dense(), format="csr")   # the same entries, other arrays
    x = torch.randn(5, 3, dtype=torch.float64)
    assert merged(parse_einsum("ij,ij,jk->ik", [2, 2, 2]), (a, other, x)) is None
    assert merged(parse_einsum("ij,ji->i", [2, 2]), (a, st.tensor(torch.eye(5, 7,
                  dtype=torch.float64), format="csr"))) is None
    sq = st.tensor(torch.eye(5, dtype=torch.float64), format="csr")
    sq2 = sq.with_values(torch.full((5,), 2.0, dtype=torch.float64))
    assert merged(parse_einsum("ij,ji->i", [2, 2]), (sq, sq2)) is None   # other indices
    total = st.lazy(a) + st.lazy(b)   # a sum, not a product
    assert merged(total.assignment(), total.operands) is None
    torch.testing.assert_close(total.eval().to_dense(), a.to_dense() + b.to_dense())
    product = st.lazy(a) * st.lazy(b)
    assert merged(product.assignment(), product.operands) is not None
    torch.testing.assert_close(product.eval().to_dense(), a.to_dense() * b.to_dense())
    values = b.values.clone().requires_grad_()
    c = a.with_values(values)
    out = st.einsum("ij,ij,jk->ik", a, c, x)   # recorded: no merge, gradients correct
    out.sum().backward()
    # d/dc sum_ik (a * c)[i,j] x[j,k] = a[i,j] * sum_k x[j,k], on the pattern
    torch.testing.assert_close(c.with_values(values.grad).to_dense(),
                               a.to_dense() * x.sum(1)[None, :])


def _square(m: int, seed: int) -> st.SparseTensor:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(m, m, generator=gen) * (torch.rand(m, m, generator=gen) < 0.4)
    dense[1] = 0   # an empty row
    return st.tensor(dense, format="csr")


@pytest.mark.parametrize("value", [1.0, 0.125, -3.0])
def test_a_factor_of_one_value_becomes_a_scale(value):
    """A factor whose stored values are all one number is dropped for a scale (no product
    pass); its values are read on every call, also after they changed through ``.data``
    (which no version counter sees)."""
    m, k = 7, 3
    P = _square(m, 3)
    U = P.with_values(torch.full((P.nnz,), value))
    X = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    assignment = parse_einsum("ij,ij,jk->ik", [2, 2, 2])
    fewer, ops = merged(assignment, (P, U, X))
    assert len(ops) == 2 and ops[0] is P, ops
    assert isinstance(fewer.expr, Scale) == (value != 1.0), fewer
    for _ in range(2):
        dense = U.to_dense() * P.to_dense()
        torch.testing.assert_close(st.einsum("ij,ij,jk->ik", P, U, X), dense @ X)
        torch.testing.assert_close(st.einsum("ji,ji,jk->ik", U, P, X), dense.T @ X)
        U.values.data.mul_(2)
    U.values.data[0] = 5.0   # no longer one value: multiplied
    torch.testing.assert_close(st.einsum("ij,ij,jk->ik", P, U, X),
                               (U.to_dense() * P.to_dense()) @ X)
    fewer, ops = merged(assignment, (P, U, X))
    assert not isinstance(fewer.expr, Scale) and not torch.equal(ops[0].values, P.values)
    U.values.data.fill_(float("nan"))   # NaN is no value to scale by
    fewer, ops = merged(assignment, (P, U, X))
    assert torch.isnan(ops[0].values).all() and not isinstance(fewer.expr, Scale)


def test_backward_multiplies_a_shared_product_once():
    """The SDDMM's gradients for Q and K both read ``A * dS``: one backward computes it
    once, and the gradients match dense."""
    g = torch.Generator().manual_seed(5)
    m, d = 9, 4
    A = _square(m, 6).double()
    A = A.with_values(torch.rand(A.nnz, generator=g, dtype=torch.float64) + 0.5)
    Q = torch.randn(m, d, generator=g, dtype=torch.float64).requires_grad_()
    K = torch.randn(m, d, generator=g, dtype=torch.float64).requires_grad_()
    products = []
    real = torch.Tensor.__mul__

    def counting(a, b):
        products.append(tuple(a.shape))
        return real(a, b)

    with mock.patch.object(torch.Tensor, "__mul__", counting):
        st.einsum("ij,ik,jk->ij", A, Q, K).values.square().sum().backward()
    assert products.count((A.nnz,)) == 1, products
    dense = A.to_dense()
    Qd, Kd = Q.detach().requires_grad_(), K.detach().requires_grad_()
    (dense * (Qd @ Kd.T)).square().sum().backward()
    torch.testing.assert_close(Q.grad, Qd.grad)
    torch.testing.assert_close(K.grad, Kd.grad)
