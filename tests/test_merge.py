"""Sparse factors on one pattern multiplied into one operand before a kernel runs
(``ops/merge.py``): results against dense for products that qualify, and the cases that
must not merge (a sum of the factors, other patterns, other indices, gradients)."""
from __future__ import annotations

import torch

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from sparsetorch.compiler.notation import parse_einsum
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
