"""``ops/sparse_rows.py`` (``x W^T + b`` for very sparse CSR rows by their entries) against
dense torch: float32 and float64, every index dtype pairing, empty rows, an empty batch,
unused and empty columns, size-1 dims, two threads; gradients (gradcheck in float64, a
gradient of the gradient); the routing from ``st.ops.sparse_linear`` and ``SparseLinear``
by density, and the cases left to the other paths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from dense_check import LONG, examples, private_kernel_cache  # noqa: F401
from sparsetorch.ops import sparse_rows
from sparsetorch.ops.sparse_rows import sparse_rows_linear


def _operands(n, k, m, *, words=3, dtype=torch.float32, index=torch.int32,
              x_index=torch.int32, seed=0):
    """A batch of ``n`` rows of ``words`` entries (row 1 empty where n > 2) of width ``k``,
    a ``(m, k)`` weight of about 30% entries (row 0 and column 0 empty where wide enough,
    the last entry stored), a bias: dense and CSR."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, k, dtype=dtype)
    for r in range(n):
        cols = torch.randperm(k, generator=g)[:words]
        x[r, cols] = torch.randn(len(cols), generator=g, dtype=dtype)
    if n > 2:
        x[1] = 0
    w = torch.randn(m, k, generator=g, dtype=dtype) * (torch.rand(m, k, generator=g) < 0.3)
    if m > 1:
        w[0] = 0
    if k > 1:
        w[:, 0] = 0
    w[-1, -1] = 1.5   # (at least one entry: a weight of none goes to einsum)
    return (x, st.tensor(x, format="csr", index_dtype=x_index),
            st.tensor(w, format="csr", index_dtype=index), w,
            torch.randn(m, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index, x_index", [(torch.int32, torch.int32),
                                            (torch.int32, torch.int64),
                                            (torch.int64, torch.int32),
                                            (torch.int64, torch.int64)])
@pytest.mark.parametrize("n, k, m, words", [(5, 40, 7, 3), (1, 1, 1, 1), (3, 9, 1, 2),
                                            (4, 50, 6, 0), (1, 30, 12, 30)])
def test_matches_dense(dtype, index, x_index, n, k, m, words, monkeypatch):
    x, xs, W, w, b = _operands(n, k, m, words=words, dtype=dtype, index=index,
                               x_index=x_index)
    for gather_from, bias in ((0.0, b), (float("inf"), None), (float("inf"), b)):
        # (the values read through the permutation, and gathered first)
        monkeypatch.setattr(sparse_rows, "GATHER_FROM", gather_from)
        y = sparse_rows_linear(xs, W, W.values, bias)
        assert y is not None and y.shape == (n, m) and y.dtype == dtype
        want = x @ w.T + (0 if bias is None else bias)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=examples(10), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=hst.integers(1, 40), k=hst.integers(1, 60), m=hst.integers(1, 30),
       words=hst.integers(0, 4), int64=hst.booleans(), seed=hst.integers(0, 2**16))
def test_random_shapes_forward_and_backward(n, k, m, words, int64, seed):
    index = torch.int64 if int64 else torch.int32
    x, xs, W, w, b = _operands(n, k, m, words=words, index=index, x_index=index, seed=seed)
    values, bias = W.values.clone().requires_grad_(), b.clone().requires_grad_()
    y = sparse_rows_linear(xs, W, values, bias)
    dy = torch.randn(n, m, generator=torch.Generator().manual_seed(seed))
    y.backward(dy)
    dense, c = w.double().requires_grad_(), b.double().requires_grad_()
    want = x.double() @ dense.T + c
    want.backward(dy.double())
    torch.testing.assert_close(y.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(W.with_values(values.grad).to_dense().double(),
                               dense.grad * (w != 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad.double(), c.grad, rtol=1e-5, atol=1e-5)


def test_two_threads(monkeypatch):
    monkeypatch.setattr(sparse_rows, "_PARALLEL_WORK", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, xs, W, w, b = _operands(70, 300, 33, words=5)
        values = W.values.clone().requires_grad_()
        y = sparse_rows_linear(xs, W, values, b)
        torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-5)
        y.backward(torch.ones_like(y))
        dense = w.clone().requires_grad_()
        (x @ dense.T).sum().backward()
        torch.testing.assert_close(W.with_values(values.grad).to_dense(),
                                   dense.grad * (w != 0), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("n, k, m, words", [(6, 12, 5, 2), (1, 4, 1, 1), (3, 8, 4, 0)])
def test_gradcheck(n, k, m, words):
    x, xs, W, _, b = _operands(n, k, m, words=words, dtype=torch.float64,
                               index=torch.int64)
    values = W.values.clone().requires_grad_()
    bias = b.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v, c: sparse_rows_linear(xs, W, v, c),
                                    (values, bias))
    # a gradient of the gradient: einsum's recorded path, recomputed
    assert torch.autograd.gradgradcheck(lambda v, c: sparse_rows_linear(xs, W, v, c),
                                        (values, bias))


def test_only_the_wanted_gradient():
    x, xs, W, w, b = _operands(6, 20, 5)
    bias = b.clone().requires_grad_()
    y = sparse_rows_linear(xs, W, W.values, bias)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(bias.grad, torch.full((5,), 6.0))
    assert W.values.grad is None


def test_where_it_does_not_apply():
    x, xs, W, w, b = _operands(6, 20, 5)
    assert sparse_rows_linear(xs.with_values(xs.values.clone().requires_grad_()), W,
                              W.values, b) is None   # (x's gradient: einsum)
    assert sparse_rows_linear(xs, W, W.values, b.double()) is None   # (mixed dtypes)
    assert sparse_rows_linear(xs, W.asformat("coo"), W.values, b) is None
    assert sparse_rows_linear(xs, st.tensor(torch.zeros(5, 20), format="csr"),
                              torch.zeros(0), b) is None   # (no entries: no W^T pattern)
    half = st.tensor(x.half(), format="csr")
    assert sparse_rows_linear(half, W, W.values, b) is None


def _counting(monkeypatch) -> list:
    """A list that grows by one at each forward of this module's kernel."""
    calls, original = [], sparse_rows._forward
    monkeypatch.setattr(sparse_rows, "_forward", lambda *a: calls.append(1) or original(*a))
    return calls


def test_sparse_linear_routes_by_density(monkeypatch):
    """``st.ops.sparse_linear`` takes this path for CSR rows below ``SPARSE_ROWS_BELOW``
    density (the activation applied after), the row-block kernel above; both match dense,
    and the weight's gradient reaches its values through either."""
    calls = _counting(monkeypatch)
    for words, taken in ((2, [1]), (30, [1])):   # (2% and 30% of 100 columns)
        x, xs, W, w, b = _operands(40, 100, 9, words=words)
        values = W.values.clone().requires_grad_()
        y = st.ops.sparse_linear(xs, W.with_values(values), b, "relu")
        assert calls == taken
        torch.testing.assert_close(y, F.relu(x @ w.T + b), rtol=1e-5, atol=1e-5)
        y.sum().backward()
        dense = w.clone().requires_grad_()
        F.relu(x @ dense.T + b).sum().backward()
        torch.testing.assert_close(W.with_values(values.grad).to_dense(),
                                   dense.grad * (w != 0), rtol=1e-4, atol=1e-4)


def test_sparse_linear_layer_on_bag_of_words(monkeypatch):
    """``SparseLinear`` on very sparse CSR rows runs this kernel (counted), trains and
    matches the dense computation; ``x``'s values wanting a gradient go through einsum."""
    calls = _counting(monkeypatch)
    layer = st.nn.SparseLinear(200, 16, density=0.2, activation="relu",
                               generator=torch.Generator().manual_seed(0))
    x, xs, *_ = _operands(8, 200, 1, words=3)
    y = layer(xs)
    assert calls == [1]
    want = F.relu(x @ layer.weight.to_dense().detach().T + layer.bias.detach())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    before = layer.values.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    y.square().sum().backward()
    opt.step()
    assert not torch.equal(before, layer.values.detach())
    xg = xs.with_values(xs.values.clone().requires_grad_())
    layer(xg).sum().backward()
    assert calls == [1] and xg.values.grad is not None


def test_frozen_parameter_values_take_the_kernel(monkeypatch):
    """Values held as a frozen ``nn.Parameter`` (a tensor subclass, whose re-laid pattern is
    not kept) are read through a plain alias: the kernel runs, not einsum."""
    calls = _counting(monkeypatch)
    x, xs, W, w, b = _operands(6, 200, 5, words=2)
    frozen = W.with_values(torch.nn.Parameter(W.values.clone(), requires_grad=False))
    torch.testing.assert_close(st.ops.sparse_linear(xs, frozen, b), x @ w.T + b)
    assert calls == [1]
