"""``st.ops.sparse_linear`` (``F.linear`` of a batch of dense or CSR rows by a CSR weight,
32 rows at a time transposed in cache) against dense torch: row counts around the least
(16) and the block of 32, widths around the 8 x 8 transposes, empty rows and patterns,
every index dtype pairing, activations (sigmoid at its extremes), both vector ISAs,
gradients (the row-block backward; a gradient of the gradient), the einsum fallbacks and
``SparseLinear`` on top."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from dense_check import LONG, examples, private_kernel_cache  # noqa: F401
from sparsetorch.compiler.kernel import vector_isa
from sparsetorch.ops import rows

ACT = {None: lambda y: y, "relu": F.relu, "relu6": F.relu6, "sigmoid": torch.sigmoid}
needs_kernel = pytest.mark.skipif(vector_isa() is None, reason="the kernel needs AVX2")


def _operands(n, k, m, density=0.3, seed=0, index=torch.int32, x_index=torch.int32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) < density)
    if m > 1:
        w[1] = 0   # an empty row: its outputs are the bias alone
    x = torch.randn(n, k, generator=g) * 4 * (torch.rand(n, k, generator=g) < 0.4)
    if n > 1:
        x[min(3, n - 1)] = 0   # an empty input row (not the only one)
    return (x, st.tensor(x, format="csr", index_dtype=x_index),
            st.tensor(w, format="csr", index_dtype=index), w, torch.randn(m, generator=g))


def _reference(x, w, bias, act):
    y = x.double() @ w.double().T + (0 if bias is None else bias.double())
    return ACT[act](y)


def _check(n, k, m, act, with_bias, **kw):
    x, xs, W, w, b = _operands(n, k, m, **kw)
    bias = b if with_bias else None
    for operand in (x, xs):
        assert rows._kernel_for(operand, W, bias, act, W.values) is not None
        y = st.ops.sparse_linear(operand, W, bias, act)
        assert y.shape == (n, m) and y.dtype == torch.float32 and y.is_contiguous()
        torch.testing.assert_close(y.double(), _reference(x, w, bias, act), rtol=1e-5,
                                   atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("n, k, m", [(16, 8, 8), (17, 9, 5), (33, 20, 13), (47, 1, 1),
                                     (64, 31, 40)])
@pytest.mark.parametrize("act", [None, "relu", "relu6", "sigmoid"])
def test_matches_dense(n, k, m, act):
    _check(n, k, m, act, with_bias=act != "relu")


@needs_kernel
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("x_index", [torch.int32, torch.int64])
def test_index_dtypes_two_threads_and_no_entries(index, x_index):
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:   # enough work for both threads: blocks split between them
        _check(100, 64, 48, "relu", True, index=index, x_index=x_index)
        _check(40, 12, 7, None, True, density=0.0, index=index, x_index=x_index)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_the_avx2_variant_on_an_avx512_cpu(monkeypatch):
    if vector_isa() != "avx512":
        pytest.skip("the default run is the AVX2 variant already")
    monkeypatch.setattr(rows, "vector_isa", lambda: "avx2")
    rows._kernel.cache_clear()
    try:
        for act in (None, "relu6", "sigmoid"):
            _check(37, 19, 11, act, with_bias=True)
    finally:
        rows._kernel.cache_clear()


@needs_kernel
def test_sigmoid_at_its_extremes():
    """Saturation to 0 and 1 (e^-x past float's range on both sides), NaN passes."""
    v = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 100.0, 1e4, float("inf"),
                      -float("inf"), float("nan"), 0.5, -0.5, 3.0, -3.0, 1e-3])
    x = v.repeat(16, 1)
    y = st.ops.sparse_linear(x, st.tensor(torch.eye(16), format="csr"), None, "sigmoid")
    torch.testing.assert_close(y, torch.sigmoid(x), rtol=1e-6, atol=1e-30, equal_nan=True)


def _check_gradients(n, k, m, act, sparse_x, wanted=("x", "values", "bias"), operands=None,
                     **kw):
    """Recorded (float32): the output, then the wanted ones of dvalues on the pattern, dx
    (dense x), dbias, each against the float64 dense computation; the backward is the
    row-block one. (ReLU's kink is taken where our output puts it: float32 rounding may
    put an output a float64 one has just above 0 at 0.) ``operands``: ``_operands``'
    five, else made by it from ``kw``."""
    x, xs, W, w, b = operands or _operands(n, k, m, **kw)
    values = W.values.clone().requires_grad_("values" in wanted)
    bias = b.clone().requires_grad_("bias" in wanted)
    xin = xs if sparse_x else x.clone().requires_grad_("x" in wanted)
    y = st.ops.sparse_linear(xin, W.with_values(values), bias, act)
    assert type(y.grad_fn).__name__ == "_RecordedBackward"
    dy = torch.randn(n, m)
    y.backward(dy)
    v64, b64 = W.values.double().requires_grad_(), b.double().requires_grad_()
    x64 = x.double().requires_grad_()
    dense = torch.zeros(m, k, dtype=torch.float64).index_put(
        tuple(W.to_dense().nonzero().t()), v64)
    pre = x64 @ dense.T + b64
    torch.testing.assert_close(y.detach().double(), ACT[act](pre).detach(), rtol=1e-5,
                               atol=1e-5)
    g = dy.double()
    if act == "sigmoid":
        s = torch.sigmoid(pre.detach())
        g = g * s * (1 - s)
    elif act in ("relu", "relu6"):
        g = g * ((y > 0) & (y < (6 if act == "relu6" else float("inf"))))
    pre.backward(g)
    pairs = {"values": (values, v64), "bias": (bias, b64), "x": (xin, x64)}
    for name in wanted:
        if name == "x" and sparse_x:
            continue
        got, want = pairs[name][0].grad, pairs[name][1].grad
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    for name in set(pairs) - set(wanted) - ({"x"} if sparse_x else set()):
        assert pairs[name][0].grad is None


@needs_kernel
@pytest.mark.parametrize("act", [None, "relu", "relu6", "sigmoid"])
@pytest.mark.parametrize("sparse_x", [False, True])
def test_gradients_match_dense(act, sparse_x):
    _check_gradients(37, 21, 11, act, sparse_x, index=torch.int64)


@needs_kernel
@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("k, m", [(21, 11), (11, 21)])
def test_a_weight_of_no_entries_gives_the_bias_its_gradient(n, k, m):
    """A pattern of no entries (density 0): wider inputs than outputs walked W^T's pattern,
    whose empty permutation came to the kernel as a null pointer, read as "W's own": the
    bias gradient was garbage and k - m values were written past it (heap corruption)."""
    _check_gradients(n, k, m, "relu", False, density=0.0)
    _check_gradients(n, k, m, None, True, density=0.0)


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 15])
@pytest.mark.parametrize("sparse_x", [False, True])
def test_fewer_rows_than_a_block_record_through_the_kernel(n, sparse_x):
    """Where autograd records, a batch of any size takes the row-block kernel (one partial
    block; einsum's recorded path cost more); without a gradient, under 16 rows, einsum."""
    _check_gradients(n, 21, 11, "relu", sparse_x)
    _check_gradients(n, 11, 21, "sigmoid", sparse_x, wanted=("values",))
    x, xs, W, _, b = _operands(n, 21, 11)
    assert rows._kernel_for(xs if sparse_x else x, W, b, None, W.values) is None


@needs_kernel
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [16, 64, 101])
def test_gradients_on_two_threads_whole_and_partial_blocks(index, n, monkeypatch):
    """dx reads whole blocks of the transposed gradient in place and copies a last partial
    one; both threads take blocks (of every pass: no size threshold); W^T's pattern of
    either index dtype."""
    monkeypatch.setattr(rows, "_PARALLEL_WORK", 1)
    monkeypatch.setattr(rows, "_PARALLEL_ELEMENTS", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_gradients(n, 70, 45, "relu", False, index=index)
        _check_gradients(n, 45, 70, "sigmoid", False, index=index, density=0.0)
    finally:
        torch.set_num_threads(old)


@needs_kernel
@settings(max_examples=examples(10), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(n=hst.integers(16, 90), k=hst.integers(1, 60), m=hst.integers(1, 60),
       density=hst.sampled_from([0.0, 0.05, 0.3, 1.0]),
       act=hst.sampled_from([None, "relu", "relu6", "sigmoid"]), sparse_x=hst.booleans(),
       int64=hst.booleans(), seed=hst.integers(0, 2**16))
def test_random_shapes_forward_and_backward(n, k, m, density, act, sparse_x, int64, seed):
    """Any batch of 16+ rows, widths not multiples of the 8 x 8 blocks or 32-row blocks,
    empty to full weights: forward and every gradient against float64 dense."""
    index = torch.int64 if int64 else torch.int32
    _check_gradients(n, k, m, act, sparse_x, density=density, seed=seed, index=index,
                     x_index=index)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("n", [37, 70, 256])
def test_the_weight_gradient_of_a_batch_with_rare_columns(isa, n, monkeypatch):
    """A CSR batch wider than the weight's outputs (the backward walks W^T's pattern,
    holding the batch's columns): columns empty in the whole batch, stored in at most
    n / 16 rows (dotted at their entries alone), or in many (dotted whole), one holding an
    explicitly stored zero; the pixels of binarised digits are like this. Every gradient
    against float64 dense, on both vector ISAs."""
    if isa == "avx2":
        if vector_isa() != "avx512":
            pytest.skip("the native run is the AVX2 variant already")
        monkeypatch.setattr(rows, "vector_isa", lambda: "avx2")
        rows._kernel.cache_clear()
    k, m, most = 48, 9, n // 16
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, k, generator=g)
    for c in range(k):
        kept = [0, 1, most, most + 1, n][c % 5]   # (entries of column c)
        x[torch.randperm(n, generator=g)[kept:], c] = 0
    w = torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) < 0.5)
    xs = st.tensor(x, format="csr")
    xs.values[0] = 0.0   # (an explicitly stored zero)
    x = xs.to_dense()
    try:
        for act in (None, "relu", "sigmoid"):
            _check_gradients(n, k, m, act, True, operands=(
                x, xs, st.tensor(w, format="csr"), w, torch.randn(m, generator=g)))
    finally:
        rows._kernel.cache_clear()


@needs_kernel
def test_a_non_finite_output_gradient_meets_every_columns_zeros():
    """Where the output gradient holds an inf, the weight gradient is NaN at every stored
    weight whose input column is 0 in that row, as in dense torch: the columns dotted at
    their few entries skipped those zeros (1.0 where a fuller column gave NaN; a probe's
    finding)."""
    n, k, m = 64, 32, 4
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, k, generator=g) < 0.2).float()
    x[:, :2] = 0
    x[0, 0] = 1.0        # (column 0: one entry, dotted at it alone)
    x[20:31, 1] = 1.0    # (column 1: eleven, dotted whole)
    x[5, :2] = 0
    W = st.tensor(torch.ones(m, k), format="csr")
    v = W.values.clone().requires_grad_()
    dy = torch.ones(n, m)
    dy[5, 0] = float("inf")
    st.ops.sparse_linear(st.tensor(x, format="csr"), W.with_values(v)).backward(dy)
    w64 = torch.ones(m, k, dtype=torch.float64, requires_grad=True)
    (x.double() @ w64.T).backward(dy.double())
    torch.testing.assert_close(W.with_values(v.grad).to_dense().double(), w64.grad,
                               equal_nan=True)


@pytest.mark.parametrize("density", [0.3, 0.01])
def test_a_batch_written_in_place_before_backward_is_refused(density):
    """A CSR batch's buffer reused (written in place) between the forward and backward:
    torch's in-place error, as einsum and torch.sparse give it, where the row-block and the
    very-sparse-rows kernels computed the weight gradient from the new contents (zeros),
    silently (a probe's finding)."""
    g = torch.Generator().manual_seed(0)
    W = st.tensor(torch.randn(8, 30, generator=g), format="csr")
    x = torch.rand(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < density)
    xs = st.tensor(x, format="csr")
    v = W.values.clone().requires_grad_()
    y = st.ops.sparse_linear(xs, W.with_values(v))
    xs.values.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@needs_kernel
def test_dx_for_a_weight_whose_values_are_a_parameter():
    """Values held as a frozen ``nn.Parameter`` (a tensor subclass: its transposed pattern
    is not kept, the weight is converted whole) give the same dx."""
    x, _, W, w, b = _operands(40, 19, 13)
    frozen = W.with_values(torch.nn.Parameter(W.values.clone(), requires_grad=False))
    xin = x.clone().requires_grad_()
    dy = torch.randn(40, 13)
    st.ops.sparse_linear(xin, frozen, b, "relu").backward(dy)
    x64 = x.double().requires_grad_()
    F.relu(x64 @ w.double().T + b.double()).backward(dy.double())
    torch.testing.assert_close(xin.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("wanted", [("x",), ("bias",), ("x", "bias"), ("values",)])
def test_only_the_wanted_gradients(wanted):
    _check_gradients(40, 19, 13, "relu6", False, wanted)


@needs_kernel
def test_a_gradient_of_the_gradient_goes_through_einsum():
    x, _, W, _, b = _operands(20, 9, 6)
    values = W.values.clone().requires_grad_()
    xin = x.clone().requires_grad_()

    def grads(f):
        y = f(xin, W.with_values(values), b, "sigmoid")
        gx, gv = torch.autograd.grad(y.square().sum(), (xin, values), create_graph=True)
        return torch.autograd.grad(gx.sum() + gv.square().sum(), (xin, values))

    ours = grads(st.ops.sparse_linear)
    reference = grads(lambda x, w, b, a: torch.sigmoid(x @ w.to_dense().T + b))
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fallbacks_give_the_same_results():
    """Under 16 rows without a gradient, float64, an activation the kernel lacks, a blocked
    weight, gradients of gradients: einsum runs (``fallback=False``: None instead)."""
    x, xs, W, w, b = _operands(5, 6, 4)
    assert rows._kernel_for(x, W, b, None, W.values) is None
    assert st.ops.sparse_linear(x, W, b, fallback=False) is None
    torch.testing.assert_close(st.ops.sparse_linear(x, W, b), x @ w.T + b)
    torch.testing.assert_close(st.ops.sparse_linear(xs, W, b, "relu"), F.relu(x @ w.T + b))
    x, xs, W, w, b = _operands(20, 6, 4)
    torch.testing.assert_close(st.ops.sparse_linear(x, W, b, "exp"), torch.exp(x @ w.T + b))
    blocked = st.tensor(w, format="bsr", blocksize=(2, 2))
    assert rows._kernel_for(x, blocked, b, None, blocked.values) is None
    torch.testing.assert_close(st.ops.sparse_linear(x, blocked, b), x @ w.T + b)
    x64, W64 = x.double(), st.tensor(w.double(), format="csr")
    assert rows._kernel_for(x64, W64, None, None, W64.values) is None
    values = W64.values.clone().requires_grad_()
    xg = x64.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v, x: st.ops.sparse_linear(x, W64.with_values(v), None, "sigmoid"),
        (values, xg))


def test_bad_input_is_named():
    x, _, W, _, b = _operands(20, 6, 4)
    with pytest.raises(ValueError, match="activation must be None or one of"):
        st.ops.sparse_linear(x, W, b, "tanh")
    with pytest.raises(ValueError):
        st.ops.sparse_linear(torch.randn(20, 7), W, b)
    with pytest.raises(ValueError):
        st.ops.sparse_linear(x, W, torch.randn(5))
    with pytest.raises(TypeError, match="weight must be a SparseTensor"):   # (was an
        st.ops.sparse_linear(x, W.to_dense(), b)                         # AttributeError)


@needs_kernel
def test_sparse_linear_layer_takes_the_kernel():
    """``SparseLinear`` on batches of 16+ rows (2-D, 3-D, CSR rows dense enough) runs the
    row-block kernel and equals the masked dense layer, and so does a training batch of
    any size; with gradients, the row-block backward."""
    torch.manual_seed(3)
    layer = st.nn.SparseLinear(24, 10, density=0.3, activation="sigmoid")
    w, b = layer.weight.to_dense(), layer.bias.detach()
    x = torch.randn(2, 20, 24)
    xs = st.tensor(torch.randn(32, 24) * (torch.rand(32, 24) < 0.2), format="csr")
    with torch.no_grad():
        assert rows._kernel_for(x.view(-1, 24), layer.weight, layer.bias, "sigmoid",
                                layer.values) is not None
        torch.testing.assert_close(layer(x), torch.sigmoid(x @ w.T + b), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer(xs), torch.sigmoid(xs.to_dense() @ w.T + b),
                                   rtol=1e-5, atol=1e-6)
    out = layer(x)   # training: the row-block backward, equal to the masked dense one
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "_RecordedBackward"   # (a view)
    out.sum().backward()
    wd = w.detach().clone().requires_grad_()
    torch.sigmoid(x @ wd.T + b).sum().backward()
    grad = layer.weight.with_values(layer.values.grad).to_dense()
    torch.testing.assert_close(grad, wd.grad * (w != 0), rtol=1e-4, atol=1e-5)
    layer.zero_grad()
    out = layer(x[0, :3])   # a batch of three rows, in training
    assert type(out.grad_fn).__name__ == "_RecordedBackward"
    out.sum().backward()
    wd.grad = None
    torch.sigmoid(x[0, :3] @ wd.T + b).sum().backward()
    grad = layer.weight.with_values(layer.values.grad).to_dense()
    torch.testing.assert_close(grad, wd.grad * (w != 0), rtol=1e-4, atol=1e-5)


def test_a_weight_of_no_columns_or_rows_is_einsums():
    """An empty dense x has a null data pointer, which the kernel reads as "x is CSR rows"
    (a segfault, found under AddressSanitizer): such weights go to einsum."""
    bias = torch.randn(4)
    y = st.ops.sparse_linear(torch.randn(16, 0), st.tensor(torch.zeros(4, 0), "csr"), bias)
    torch.testing.assert_close(y, bias.expand(16, 4))
    y = st.ops.sparse_linear(torch.randn(16, 3), st.tensor(torch.zeros(0, 3), "csr"))
    assert y.shape == (16, 0)


@needs_kernel
def test_an_output_changed_in_place_before_backward():
    """Without an activation the backward does not need the output: a residual ``y += 1``
    (or ``relu_``) before backward works, as after ``nn.Linear`` (it raised "modified by an
    inplace operation")."""
    x, _, W, w, b = _operands(40, 21, 11)
    values, xin = W.values.clone().requires_grad_(), x.clone().requires_grad_()
    y = st.ops.sparse_linear(xin, W.with_values(values), b)
    y += 1
    y.relu_().sum().backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    F.relu(x64 @ w64.T + b.double() + 1).sum().backward()
    torch.testing.assert_close(xin.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W.with_values(values.grad).to_dense().double(),
                               w64.grad * (w != 0), rtol=1e-4, atol=1e-4)
