"""Autograd derived from the notation: gradients of ``st.einsum`` and lazy expressions with
respect to every operand, checked by ``torch.autograd.gradcheck`` (float64) and against
torch autograd on dense copies; gradients of sparse operands keep the operand's pattern and
never allocate its full shape.
"""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from dense_check import private_kernel_cache, random_dense, stored_pattern  # noqa: F401

F64 = torch.float64
FORMATS = ["csr", "csc", "coo", "dcsr"]


def _sparse(shape, density, fmt, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = random_dense(shape, density, dtype, g, integer=False, empty_slices=True)
    return st.tensor(x, fmt)


def _dense(shape, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def gradcheck_mixed(fn, operands):
    """gradcheck ``fn(*operands)`` w.r.t. every dense operand and every sparse operand's
    values (through ``with_values``); a sparse result is compared by its values."""
    leaves = [(t.values if isinstance(t, st.SparseTensor) else t).detach().clone()
              .requires_grad_() for t in operands]

    def f(*xs):
        ops = [t.with_values(x) if isinstance(t, st.SparseTensor) else x
               for t, x in zip(operands, xs)]
        out = fn(*ops)
        return out.values if isinstance(out, st.SparseTensor) else out
    assert torch.autograd.gradcheck(f, leaves, atol=1e-7, rtol=1e-6)


def dense_grads(fn, operands, grad_out):
    """Gradients by torch autograd on dense copies (reference)."""
    xs = [(t.to_dense() if isinstance(t, st.SparseTensor) else t).detach().clone()
          .requires_grad_() for t in operands]
    out = fn(*xs)
    out = out.to_dense() if isinstance(out, st.SparseTensor) else out
    return torch.autograd.grad(out, xs, grad_out)


EINSUMS = {   # name: (equation, operand specs: (shape, format or None, density))
    "spmv": ("ij,j->i", [((6, 5), "S", 0.4), ((5,), None, 1)]),
    "spmm": ("ij,jk->ik", [((6, 5), "S", 0.4), ((5, 3), None, 1)]),
    "dense@sparse": ("ij,jk->ik", [((3, 6), None, 1), ((6, 5), "S", 0.4)]),
    "sddmm": ("ij,ik,jk->ij", [((6, 5), "S", 0.4), ((6, 3), None, 1), ((5, 3), None, 1)]),
    "spgemm": ("ij,jk->ik", [((6, 5), "S", 0.4), ((5, 4), "S", 0.5)]),
    "hadamard": ("ij,ij->ij", [((6, 5), "S", 0.5), ((6, 5), "S", 0.5)]),
    "sum": ("ij->", [((6, 5), "S", 0.4)]),
    "rowsum": ("ij->i", [((6, 5), "S", 0.4)]),
    "scale-by-0d": ("ij,->ij", [((6, 5), "S", 0.4), ((), None, 1)]),
    "size1": ("ij,jk->ik", [((1, 1), "S", 1.0), ((1, 2), None, 1)]),
    "nnz0": ("ij,jk->ik", [((4, 3), "S", 0.0), ((3, 2), None, 1)]),
    "ellipsis": ("...j,jk->...k", [((6, 5), "S", 0.4), ((5, 3), None, 1)]),
    "ellipsis-summed": ("i...->i", [((6, 5), "S", 0.4)]),
    "trace": ("ii->", [((5, 5), "S", 0.5)]),
    "broadcast-dense": ("ij,ij->ij", [((6, 5), "S", 0.4), ((1, 5), None, 1)]),
    "broadcast-sparse": ("ij,ij->ij", [((1, 5), "S", 0.6), ((6, 5), None, 1)]),
    "diagonal-times-dense": ("ii,ij->ij", [((5, 5), "S", 0.5), ((5, 3), None, 1)]),
}


def _operands(spec, fmt, seed):
    ops = []
    for n, (shape, kind, density) in enumerate(spec):
        ops.append(_sparse(shape, density, fmt, seed + n) if kind == "S"
                   else _dense(shape, seed + n))
    return ops


# Every format for the core products; the other equations rotate through the formats (each
# new kernel costs a compile, and the suite must stay fast).
_CORE = ("spmm", "sddmm", "spgemm")
EINSUM_CASES = [(n, f) for n in _CORE for f in FORMATS] + [
    (n, FORMATS[k % len(FORMATS)]) for k, n in enumerate(sorted(set(EINSUMS) - set(_CORE)))]


@pytest.mark.parametrize("name,fmt", EINSUM_CASES)
def test_einsum_gradcheck(name, fmt):
    eq, spec = EINSUMS[name]
    ops = _operands(spec, fmt, seed=len(name))
    gradcheck_mixed(lambda *xs: st.einsum(eq, *xs), ops)


@pytest.mark.parametrize("eq", ["ij->", "ij->i", "ij->j", "ij,k->k", "ii->", "ii->i",
                                "ij,kl->k"])
def test_dense_operand_with_indices_the_gradient_does_not_read(eq):
    """Regression: the gradient of a dense operand indexed by a variable that neither the
    output nor another operand reads (``ij->i``: G[i] is constant along j) raised KeyError;
    it is G broadcast along that variable (on the diagonal for ``ii->``)."""
    terms = eq.split("->")[0].split(",")
    ops = [_dense((4,) * len(terms[0]), 30)]
    if len(terms) > 1:   # a sparse operand besides, over indices of its own
        ops.append(_sparse((3,) * len(terms[1]), 0.7, "csr" if len(terms[1]) == 2 else "csf",
                           31))
    gradcheck_mixed(lambda *xs: st.einsum(eq, *xs), ops)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_grad_has_operand_pattern_and_matches_dense(fmt):
    A = _sparse((7, 6), 0.4, fmt, 1).requires_grad_()
    B = _dense((6, 3), 2).requires_grad_()
    G = _dense((7, 3), 3)
    st.einsum("ij,jk->ik", A, B).backward(G)
    assert isinstance(A.grad, st.SparseTensor)
    assert A.grad.nnz == A.nnz and A.grad.format == A.format
    assert all(A.grad._level_arrays[k] is A._level_arrays[k] for k in A._level_arrays)     # shared, not copied
    gA, gB = dense_grads(lambda a, b: a @ b, [A, B], G)
    mask = stored_pattern(A)
    torch.testing.assert_close(A.grad.to_dense(), gA * mask)          # sampled on A
    torch.testing.assert_close(B.grad, gB)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["coo"])
def test_repeated_operand_and_three_operands(fmt):
    A = _sparse((5, 4), 0.5, fmt, 4)
    gradcheck_mixed(lambda a: st.einsum("ij,kj->ik", a, a), [A])      # A A^T, one tensor
    X, Y = _dense((5, 2), 5), _dense((4, 2), 6)
    gradcheck_mixed(lambda a, x, y: st.einsum("ij,ik,jk,ij->ij", a, x, y, a), [A, X, Y])
    D = _dense((4, 4), 7)
    gradcheck_mixed(lambda d, a: st.einsum("ii,ji->j", d, a), [D, A])  # a dense diagonal


@pytest.mark.parametrize("fmt", FORMATS)
def test_spgemm_grad_scatters_into_pattern(fmt):
    A = _sparse((6, 5), 0.3, fmt, 8).requires_grad_()
    B = _sparse((5, 4), 0.3, fmt, 9).requires_grad_()
    C = st.einsum("ij,jk->ik", A, B)
    assert isinstance(C, st.SparseTensor)
    C.values.sum().backward()
    pat = stored_pattern(C).to(F64)
    gA, gB = dense_grads(lambda a, b: a @ b, [A, B], pat)
    assert A.grad.nnz == A.nnz and B.grad.nnz == B.nnz
    torch.testing.assert_close(A.grad.to_dense(), gA * stored_pattern(A))
    torch.testing.assert_close(B.grad.to_dense(), gB * stored_pattern(B))


LAZY = {
    "affine": lambda a, b, x: st.lazy(a) * 2 - st.lazy(b) + st.lazy(x) * st.lazy(a),
    "relu": lambda a, b, x: (st.lazy(a) + st.lazy(b)).relu() * st.lazy(x),
    "abs": lambda a, b, x: (st.lazy(a) - st.lazy(b) * 3).abs(),
    "exp": lambda a, b, x: (st.lazy(a) * st.lazy(x)).exp(),
    "sqrt": lambda a, b, x: (st.lazy(a) * st.lazy(a)).sqrt() + st.lazy(b),
    "neg": lambda a, b, x: -(st.lazy(a) * st.lazy(b)),
}


@pytest.mark.parametrize("name,fmt", [(n, FORMATS[(k + j) % len(FORMATS)])
                                      for k, n in enumerate(sorted(LAZY)) for j in (0, 2)])
def test_lazy_expression_gradcheck(name, fmt):
    A, B = _sparse((5, 4), 0.5, fmt, 10), _sparse((5, 4), 0.5, fmt, 11)
    X = _dense((5, 4), 12)
    gradcheck_mixed(lambda a, b, x: LAZY[name](a, b, x).eval(), [A, B, X])


def test_operators_record_gradients():
    A = _sparse((5, 4), 0.5, "csr", 13).requires_grad_()
    X = _dense((5, 4), 14).requires_grad_()
    out = ((A * X + A * 2) - A / 4).relu()
    assert isinstance(out, st.SparseTensor) and out.requires_grad
    out.values.sum().backward()
    gA, gX = dense_grads(lambda a, x: ((a * x + a * 2) - a / 4).relu(), [A, X],
                         stored_pattern(out).to(F64))
    torch.testing.assert_close(A.grad.to_dense(), gA * stored_pattern(A))
    torch.testing.assert_close(X.grad, gX * stored_pattern(A))


@pytest.mark.parametrize("fmt", FORMATS + ["bsr"])
def test_relu_gradient_masks_what_arrives_from_above(fmt):
    """As torch's relu backward: 0 where the input is not positive, even where the gradient
    from above is infinite (``sqrt(relu(A))`` at a stored negative or zero: a 0/1 factor
    gave inf x 0 = NaN), eager and lazy."""
    d = torch.tensor([[1.5, 0.0, -2.0, 0.0], [0.0, 3.0, 0.0, -1.0]], dtype=F64)
    A = st.tensor(d, fmt, **({"blocksize": (1, 2)} if fmt == "bsr" else {}))
    dd = d.clone().requires_grad_()
    torch.sqrt(torch.relu(dd)).backward(torch.ones_like(d))
    ref = dd.grad * stored_pattern(A)
    for f in (lambda a: torch.sqrt(torch.relu(a)), lambda a: st.lazy(a).relu().sqrt().eval()):
        a = A.detach().requires_grad_()
        f(a).values.sum().backward()
        torch.testing.assert_close(a.grad.to_dense(), ref)
    a = A.detach().requires_grad_()   # a finite gradient: the same values as before
    (torch.relu(a) * 3).values.sum().backward()
    torch.testing.assert_close(a.grad.to_dense(), (3.0 * (d > 0) * stored_pattern(A)).to(F64))


def test_relu_over_a_dense_intermediate_masks_what_arrives_from_above():
    """The same through a relu of a dense intermediate (sparse + dense, in a lazy tree):
    its 0/1 factor met ``sqrt``'s infinite derivative at 0 and gave NaN; torch gives 0. A
    finite gradient keeps the dense factor (the same values either way)."""
    d = torch.tensor([[1.5, 0.0, -2.0, 0.0], [0.0, 3.0, 0.0, -1.0]], dtype=F64)
    D = torch.tensor([[0.5, -1.0, 1.0, 0.0], [1.0, -3.0, 2.0, 1.0]], dtype=F64)
    A = st.tensor(d, "csr")
    for ours, theirs in ((lambda a, x: (st.lazy(a) + x).relu().sqrt().eval(),
                          lambda a, x: torch.sqrt(torch.relu(a + x))),
                         (lambda a, x: (st.lazy(x) - st.lazy(a)).relu().sqrt().eval(),
                          lambda a, x: torch.sqrt(torch.relu(x - a))),
                         (lambda a, x: (st.lazy(a) + x).relu().eval() * 3,
                          lambda a, x: torch.relu(a + x) * 3)):
        a, x = A.detach().requires_grad_(), D.clone().requires_grad_()
        ours(a, x).sum().backward()
        dd, xx = d.clone().requires_grad_(), D.clone().requires_grad_()
        theirs(dd, xx).sum().backward()
        torch.testing.assert_close(a.grad.to_dense(), dd.grad * stored_pattern(A))
        torch.testing.assert_close(x.grad, xx.grad)


def test_no_grad_path_records_nothing():
    A = _sparse((5, 4), 0.5, "csr", 15).requires_grad_()
    with torch.no_grad():
        out = st.einsum("ij,jk->ik", A, _dense((4, 2), 16))
    assert out.grad_fn is None and not out.requires_grad
    assert st.einsum("ij,jk->ik", A.detach(), _dense((4, 2), 16)).grad_fn is None


@pytest.mark.slow   # ~2 s of double backward (the full suite runs it)
def test_second_derivative():
    A = _sparse((4, 3), 0.6, "csr", 17)
    x = _dense((3,), 18).requires_grad_()
    v = A.values.detach().clone().requires_grad_()

    def f(v, x):
        return (st.einsum("ij,j->i", A.with_values(v), x) ** 2).sum()
    assert torch.autograd.gradgradcheck(f, (v, x))


def test_with_values_shares_arrays_and_checks_input():
    A = _sparse((5, 4), 0.5, "coo", 19)
    v = torch.arange(A.nnz, dtype=F64)
    B = A.with_values(v)
    assert all(B._level_arrays[k] is A._level_arrays[k] for k in A._level_arrays) and B.values is v
    with pytest.raises(ValueError, match="stores"):
        A.with_values(torch.ones(A.nnz + 1, dtype=F64))
    with pytest.raises(ValueError, match="shape"):
        A.with_values(torch.ones(1, A.nnz, dtype=F64))
    with pytest.raises(TypeError, match="dtype"):
        A.with_values(torch.ones(A.nnz, dtype=torch.complex64))
    with pytest.raises(TypeError, match="dense"):
        A.with_values(A)


def test_with_values_inherits_pattern_facts_of_the_same_dtype_only():
    """A wrapper rebuilt per call (autograd's saved values) keeps the call key and kernel
    facts of its pattern; values of another dtype work theirs out (a float32 key would
    hand float64 values to a float32 kernel)."""
    A = _sparse((6, 5), 0.5, "csr", 21).to(torch.float32)
    x = torch.rand(5)
    A @ x
    B = A.with_values(torch.rand(A.nnz))
    assert B.__dict__["_call_key"] == A.__dict__["_call_key"]
    torch.testing.assert_close(B @ x, B.to_dense() @ x)
    C = A.with_values(torch.rand(A.nnz, dtype=F64))
    assert "_call_key" not in C.__dict__
    x64 = x.to(F64)
    torch.testing.assert_close(C @ x64, C.to_dense() @ x64)


def test_large_sparse_gradient_stays_sparse(monkeypatch):
    """A 200000 x 200000 operand with 1e5 nonzeros: the gradient is one value per stored
    entry and nothing of the full shape (4e10 entries) is ever allocated."""
    n, nnz, k = 200_000, 100_000, 4
    g = torch.Generator().manual_seed(20)
    idx = torch.randint(0, n, (2, nnz), generator=g)
    A = st.tensor((idx, torch.rand(nnz, generator=g, dtype=F64)), "csr", shape=(n, n))
    X = torch.rand(n, k, generator=g, dtype=F64)
    A.requires_grad_()
    limit = 50 * n * k

    def guard(make):
        def wrapped(*size, **kw):
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            total = 1
            for s in shape:
                total *= int(s)
            assert total <= limit, f"allocation of {tuple(shape)} elements"
            return make(*size, **kw)
        return wrapped
    for name in ("zeros", "empty", "ones", "full"):
        monkeypatch.setattr(torch, name, guard(getattr(torch, name)))
    monkeypatch.setattr(st.SparseTensor, "to_dense", lambda *a, **k: pytest.fail("densified"))
    (A @ X).sum().backward()
    grad = A.grad
    assert isinstance(grad, st.SparseTensor) and grad.nnz == A.nnz
    assert grad.values.shape == (A.nnz,)
    monkeypatch.undo()
    # d sum(A @ X) / dA[i, j] = sum_k X[j, k], at the stored entries
    coords = st.formats.pack.unpack(A.format, A.shape, A.arrays, A.values)[0]
    torch.testing.assert_close(grad.values, X.sum(1)[coords[1]])


def test_requires_grad_errors_and_grad_setter():
    A = _sparse((3, 3), 0.6, "csr", 21).requires_grad_()
    st.einsum("ij->", A).backward()
    assert torch.equal(A.grad.values, torch.ones(A.nnz, dtype=F64))
    A.grad = None
    assert A.grad is None and A.values.grad is None
    st.einsum("ii->", A).backward()               # the trace: through the diagonal's gather
    coords = st.formats.pack.unpack(A.format, A.shape, A.arrays, A.values)[0]
    assert torch.equal(A.grad.values, (coords[0] == coords[1]).to(F64))
    I = st.tensor(torch.ones(3, 3, dtype=torch.int64), "csr")
    with pytest.raises(RuntimeError):
        I.requires_grad_()                        # integer values cannot require grad


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(3, 4), (0, 4)])
def test_an_empty_operand_stays_in_the_graph(fmt, shape):
    """Regression (found by the fuzzer): an empty SparseTensor that requires grad densified
    to a tensor outside the graph, so a loss built only through it could not backward; its
    gradient is an empty one on its (empty) pattern."""
    A = st.tensor(torch.zeros(shape, dtype=F64), fmt).requires_grad_()
    d = A.to_dense()
    assert d.requires_grad
    d.sum().backward()
    assert isinstance(A.grad, st.SparseTensor) and A.grad.nnz == 0
    B = st.tensor(torch.zeros(3, 7, dtype=F64), fmt).requires_grad_()
    x = torch.randn(7, dtype=F64, requires_grad=True)
    y = st.einsum("ij,j->i", B, x, activation="relu")
    assert y.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(7, dtype=F64)) and B.grad.nnz == 0


def test_a_zero_tensor_gradient_gives_zero_gradients():
    """``sgn``'s gradient (and ``abs``'s gradient of a gradient) is one of torch's
    efficient zero tensors, with a null data pointer: each backward that hands the output
    gradient to a kernel crashed the process (einsum's, so every layer on it; the
    SparseLinear kernels for dense and for very sparse rows; the row softmax). Now every
    gradient is zero, as the dense computation's is."""
    torch.manual_seed(0)
    w = torch.randn(8, 40) * (torch.rand(8, 40) < 0.3)
    W = st.tensor(w, format="csr")
    xd = torch.zeros(4, 40)
    xd[0, 3], xd[2, 7] = 1.0, 2.0
    calls = {
        "spmm": lambda v: st.einsum("ij,jk->ik", W.with_values(v), torch.randn(40, 3)),
        "rows": lambda v: st.ops.sparse_linear(torch.randn(20, 40), W.with_values(v)),
        "sparse rows": lambda v: st.ops.sparse_linear(st.tensor(xd, format="csr"),
                                                      W.with_values(v)),
        "softmax": lambda v: st.ops.softmax(W.with_values(v), 1).values,
        "relaid": lambda v: st.einsum("ni,oi->no", torch.randn(3, 40), W.with_values(v))}
    for name, call in calls.items():
        v = W.values.clone().requires_grad_()
        torch.sgn(call(v)).sum().backward()
        assert torch.equal(v.grad, torch.zeros_like(v)), name
    # a gradient penalty through abs: the second-order term meets the zero tensor
    v = W.values.clone().requires_grad_()
    x = st.tensor(xd, format="csr")
    g, = torch.autograd.grad(st.ops.sparse_linear(x, W.with_values(v), None, "abs").sum(), v,
                             create_graph=True)
    g.square().sum().backward()
    dense = w.clone().requires_grad_()
    gd, = torch.autograd.grad((xd @ dense.T).abs().sum(), dense, create_graph=True)
    gd.square().sum().backward()
    torch.testing.assert_close(W.with_values(v.grad).to_dense(), dense.grad * (w != 0))


def test_forward_mode_ad_is_refused_not_dropped():
    """The kernels compute the primal alone: a dual input's tangent came out as None (no
    tangent, as if the derivative were zero), silently. Every entry refuses it instead:
    st.einsum, torch's API on a SparseTensor, the SparseLinear kernels, the ops (the
    SparseLinear layer computes it: ``test_sparse_linear_under_torch_func``)."""
    import torch.autograd.forward_ad as fwAD
    W = st.tensor(torch.eye(4), format="csr")
    calls = [lambda x: st.einsum("ni,oi->no", x, W), lambda x: x @ W,
             lambda x: torch.nn.functional.linear(x, W), lambda x: st.ops.sparse_linear(x, W),
             lambda x: st.ops.softmax(W.with_values(x[0]), 1)]
    with fwAD.dual_level():
        for call in calls:
            x = fwAD.make_dual(torch.randn(20, 4), torch.randn(20, 4))
            with pytest.raises(TypeError, match="forward-mode AD .* is not supported"):
                call(x)
        y = st.einsum("ni,oi->no", torch.randn(2, 4), W)   # (no tangent: computed as ever)
        assert fwAD.unpack_dual(y).tangent is None and y.shape == (2, 4)


@pytest.mark.parametrize("blocksize", [None, (2, 2)])
def test_sparse_linear_under_torch_func(blocksize):
    """``torch.func`` transforms and forward-mode AD: the kernels read raw memory, which
    vmap's and grad's wrapped tensors have none of ("Cannot access data pointer of Tensor
    that doesn't have storage", or torch's note that the autograd.Function has no
    setup_context), and see no tangents; SparseLinear runs under them as a dense product:
    vmap, per-example gradients (vmap of grad) equal to one backward per example, jacrev,
    and jvp's tangent, each against the layer's own eager results."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad, jacrev, vmap
    torch.manual_seed(0)
    layer = st.nn.SparseLinear(12, 6, density=0.4, blocksize=blocksize, activation="relu")
    x = torch.randn(5, 12)
    torch.testing.assert_close(vmap(layer)(x), layer(x))
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def loss(p, row):
        return functional_call(layer, p, (row,)).square().sum()

    per_example = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        layer.zero_grad()
        layer(x[i]).square().sum().backward()
        torch.testing.assert_close(per_example["values"][i], layer.values.grad)
        torch.testing.assert_close(per_example["bias"][i], layer.bias.grad)
    dense = layer.weight.detach().to_dense()
    torch.testing.assert_close(jacrev(layer)(x[0]),
                               jacrev(lambda r: torch.relu(r @ dense.T + layer.bias))(x[0]))
    tangent = torch.randn(5, 12)
    with fwAD.dual_level():
        y = layer(fwAD.make_dual(x, tangent))
        out, dy = fwAD.unpack_dual(y)
    pre = x @ dense.T + layer.bias
    torch.testing.assert_close(out, layer(x).detach())
    torch.testing.assert_close(dy, (tangent @ dense.T) * (pre > 0))


def test_torch_func_is_refused_clearly_elsewhere():
    """The other entries under a torch.func transform: a TypeError naming it, where torch
    said "Cannot access data pointer of Tensor that doesn't have storage" (the graph layers
    and SparseAttention on their first call, building their adjacency or mask: a probe's
    finding; each layer is made fresh for each call)."""
    from torch.func import grad, vmap
    W = st.tensor(torch.eye(3), format="csr")
    edges = torch.tensor([[0, 1], [1, 2]])
    mask = st.nn.masks.sliding_window(3, 1)

    def on_graph(conv):
        return lambda x: conv(x.view(1, 3).expand(3, 3), edges)

    cases = [(lambda: lambda x: st.einsum("ij,j->i", W, x), (3,)),
             (lambda: lambda x: W @ x, (3,)),
             (lambda: lambda x: st.ops.sparse_linear(x.view(1, 3).expand(16, 3), W), (3,)),
             *[(lambda make=make: on_graph(make(3, 2)), (3,))
               for make in (st.nn.GCNConv, st.nn.SAGEConv, st.nn.GATConv)],
             (lambda: st.nn.SparseAttention(3, 1, mask=mask), (1, 3, 3)),
             (lambda: lambda x: st.ops.masked_attention(mask, x, x, x), (3, 3))]
    for make, shape in cases:
        for transform in (vmap, grad):
            call = make()   # (a fresh layer: its adjacency or mask not built yet)
            f = vmap(call) if transform is vmap else grad(lambda x: call(x).sum())
            with pytest.raises(TypeError, match="torch.func transforms .* are not supported"):
                f(torch.ones((2, *shape) if transform is vmap else shape))


def test_relu_passes_the_gradient_at_nan_as_torch_does():
    """torch's relu backward passes the gradient where the value is NaN (``not x <= 0``);
    the kernels' ordered compares gave 0 (the row-block kernel, the depthwise kernel, a
    lazy relu's derivative). (torch's relu6 passes it on a 1-D tensor, not on these rows:
    the kernels follow the latter.)"""
    nan = float("nan")
    x = torch.tensor([[nan, 1.0, -1.0, 7.0] * 3] * 20)   # (8 columns in vectors, 4 after)
    for act, ref in (("relu", torch.relu), ("relu6", torch.nn.functional.relu6)):
        xin, x0 = x.clone().requires_grad_(), x.clone().requires_grad_()
        st.ops.sparse_linear(xin, st.tensor(torch.eye(12), format="csr"), None, act) \
            .sum().backward()
        ref(x0).sum().backward()
        assert torch.equal(xin.grad, x0.grad), act
    A = st.tensor(torch.tensor([[nan, 2.0], [-1.0, 0.0]], dtype=torch.float64), format="csr")
    v = A.values.clone().requires_grad_()
    (st.lazy(A.with_values(v)).relu().eval().values.sum()).backward()
    assert v.grad.tolist() == [1.0, 1.0, 0.0]
    xd = torch.full((1, 2, 4, 4), nan, requires_grad=True)
    st.ops.depthwise3x3(xd, torch.ones(2, 1, 3, 3), None, 1, "relu").sum().backward()
    assert not torch.equal(xd.grad, torch.zeros_like(xd))


def test_hooks_and_autograd_grad_on_a_sparse_leaf():
    """Eager ops differentiate a SparseTensor's values, not its wrapper: hooks registered
    on the wrapper never ran (a gradient-scaling hook was ignored, silently) and
    ``torch.autograd.grad(y, A)`` said A was "not used in the graph". Both reach the values
    now, with the gradient as a SparseTensor on A's pattern."""
    w = torch.tensor([[0.0, 2.0], [3.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    A = st.tensor(w, format="csr").requires_grad_()
    seen = []
    A.register_hook(lambda g: seen.append(type(g).__name__) or g * 2)
    A.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.values.tolist()))
    st.einsum("ij,jk->ik", A, x).sum().backward()
    assert seen == ["SparseTensor", [14.0, 6.0]]   # (doubled: x's row sums 3, 7)
    B = st.tensor(w, format="csr").requires_grad_()
    gB, gx = torch.autograd.grad(st.einsum("ij,jk->ik", B, x).square().sum(), (B, x))
    wd, xd = w.clone().requires_grad_(), x.detach().clone().requires_grad_()
    rw, rx = torch.autograd.grad((wd @ xd).square().sum(), (wd, xd))
    assert isinstance(gB, st.SparseTensor)
    torch.testing.assert_close(gB.to_dense(), rw * (w != 0))
    torch.testing.assert_close(gx, rx)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(st.einsum("ij,jk->ik", B, x).sum(), A)
    assert torch.autograd.grad(st.einsum("ij,jk->ik", B, x).sum(), A,
                               allow_unused=True) == (None,)
    zeros, = torch.autograd.grad(st.einsum("ij,jk->ik", B, x).sum(), A,
                                 materialize_grads=True)
    assert isinstance(zeros, st.SparseTensor) and zeros.values.tolist() == [0.0, 0.0]


def test_a_batch_of_gradients_is_refused_clearly():
    """``is_grads_batched=True`` hands the backward a vmap batch, which has no memory: the
    kernels said "Cannot access data pointer of Tensor that doesn't have storage"."""
    W = st.tensor(torch.eye(3), format="csr")
    v = W.values.clone().requires_grad_()
    y = st.ops.sparse_linear(torch.randn(20, 3), W.with_values(v))
    with pytest.raises(TypeError, match="cannot take a batch of gradients"):
        torch.autograd.grad(y, v, torch.randn(2, 20, 3), is_grads_batched=True)
    y = st.einsum("ij,jk->ik", W.with_values(v), torch.randn(3, 2))
    with pytest.raises(TypeError, match="is_grads_batched=False"):
        torch.autograd.grad(y, v, torch.randn(2, 3, 2), is_grads_batched=True)
