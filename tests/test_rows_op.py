"""``ops/rows_op.py``: a traced ``SparseLinear`` runs its eager kernels as custom ops
(``sparsetorch::rows_linear`` for dense rows, ``rows_linear_csr`` for CSR batches, by their
entries or by the row-block kernel). Checked against the eager layer (itself checked
against dense torch in ``test_rows.py`` and ``test_sparse_rows.py``): outputs and every
gradient under ``torch.compile`` with ``fullgraph=True`` (activations, bias or none,
inputs of more dimensions, batches that change without a recompile), the ops in the
traced graph, which backward ran, and torch's own custom-op checks
(``torch.library.opcheck``: schema, fake kernel, autograd registration)."""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from dense_check import compiled_keeping_graphs, fresh_dynamo  # noqa: F401
from sparsetorch.compiler.kernel import vector_isa
from sparsetorch.ops import sparse_rows

needs_kernel = pytest.mark.skipif(vector_isa() is None, reason="the kernel needs AVX2")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _layer(k=20, m=12, activation="relu", bias=True, seed=0):
    layer = st.nn.SparseLinear(k, m, density=0.3, bias=bias, activation=activation,
                               generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        if bias:
            layer.bias.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return layer


def _grads(layer, x, out):
    params = [p for p in (layer.values, layer.bias, x) if p is not None and p.requires_grad]
    return torch.autograd.grad(out, params, torch.ones_like(out) * torch.linspace(
        -1, 1, out.numel()).view(out.shape))


@needs_kernel
@pytest.mark.parametrize("activation", [None, "relu", "sigmoid"])
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_layer_runs_the_op_and_matches_eager(activation, bias):
    layer, graphs = _layer(activation=activation, bias=bias), []
    compiled = compiled_keeping_graphs(layer, graphs)
    x = torch.randn(37, 20, generator=torch.Generator().manual_seed(2), requires_grad=True)
    got, want = compiled(x), layer(x)
    torch.testing.assert_close(got, want)
    assert any("rows_linear" in str(gm.graph) for gm in graphs)
    for g, w in zip(_grads(layer, x, got), _grads(layer, x, want)):
        torch.testing.assert_close(g, w)


@needs_kernel
def test_compiled_inputs_of_more_dimensions_sparse_inputs_and_new_batches():
    layer, graphs = _layer(), []
    compiled = compiled_keeping_graphs(layer, graphs, dynamic=True)
    gen = torch.Generator().manual_seed(3)
    x3 = torch.randn(2, 9, 20, generator=gen)
    torch.testing.assert_close(compiled(x3), layer(x3))
    for n in (16, 41):   # (a symbolic batch: no recompile per size)
        x = torch.randn(n, 20, generator=gen)
        torch.testing.assert_close(compiled(x), layer(x))
    before = len(graphs)
    x = torch.randn(70, 20, generator=gen)
    torch.testing.assert_close(compiled(x), layer(x))
    assert len(graphs) == before
    xs = st.tensor(x * (x > 1), "csr")   # (a CSR batch: its own op, below)
    torch.testing.assert_close(compiled(xs), layer(xs))


@needs_kernel
def test_compiled_training_steps_follow_eager_ones():
    torch.manual_seed(0)
    eager, graphs = _layer(), []
    traced = _layer()
    traced.load_state_dict(eager.state_dict())
    compiled = compiled_keeping_graphs(traced, graphs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, traced)]
    x, target = torch.randn(24, 20), torch.randn(24, 12)
    for _ in range(3):
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), target).backward()
            opt.step()
    torch.testing.assert_close(traced.values, eager.values)
    torch.testing.assert_close(traced.bias, eager.bias)


@needs_kernel
@pytest.mark.parametrize("activation", [None, "sigmoid"])
def test_torch_custom_op_checks(activation):
    layer = _layer(activation=activation)
    x = torch.randn(17, 20, requires_grad=True)
    args = (x, layer.pos1, layer.crd1, layer.values, layer.bias, activation, 20)
    torch.library.opcheck(torch.ops.sparsetorch.rows_linear, args)
    xs = st.tensor(x.detach() * (x.detach() > 1), "csr")
    torch.library.opcheck(torch.ops.sparsetorch.rows_linear_csr,
                          (xs._pos1, xs._crd1, xs.values, *args[1:]))


def _batch(n, k, density, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, k, generator=gen) * (torch.rand(n, k, generator=gen) < density)
    if n > 3:
        x[3] = 0   # (an empty row)
    return st.tensor(x, "csr")


@needs_kernel
@pytest.mark.parametrize("density", [0.004, 0.2])   # (by entries; by the row-block kernel)
@pytest.mark.parametrize("activation", [None, "relu", "relu6", "sigmoid"])
@pytest.mark.parametrize("n", [5, 40])
def test_compiled_csr_batches_run_their_op_and_match_eager(density, activation, n,
                                                          monkeypatch):
    layer, graphs = _layer(k=600, m=24, activation=activation), []
    x = _batch(n, 600, density, seed=4)
    compiled = compiled_keeping_graphs(layer, graphs)
    got, want = compiled(x), layer(x)
    torch.testing.assert_close(got, want)
    assert any("rows_linear_csr" in str(gm.graph) for gm in graphs)
    by_entries = []   # (the backward of very sparse rows goes by their entries, as eager:
    # a Parameter's values reached the op as themselves and missed the kept transposed
    # pattern, and the whole-batch row-block backward ran instead, 6x slower)
    entry_gradients = sparse_rows.entry_gradients
    monkeypatch.setattr(sparse_rows, "entry_gradients",
                        lambda *a: by_entries.append(1) or entry_gradients(*a))
    grads = _grads(layer, x, got)
    assert bool(by_entries) == (density < 0.03)
    monkeypatch.undo()
    for g, w in zip(grads, _grads(layer, x, want)):
        torch.testing.assert_close(g, w)


def test_float64_layers_keep_einsums_traced_path():
    """The kernels are float32: a float64 layer traces einsum's product, with eager's
    results. (BSR weights run eagerly: ``test_nn_linear.py``.)"""
    layer, graphs = _layer().double(), []
    x = torch.randn(16, 20, dtype=torch.float64)
    torch.testing.assert_close(compiled_keeping_graphs(layer, graphs)(x), layer(x))
    assert not any("rows_linear" in str(gm.graph) for gm in graphs)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, every other element of a twice-as-long tensor of garbage."""
    big = torch.full((2 * t.numel(),), 10**8, dtype=t.dtype)
    big[::2] = t
    return big[::2]


@needs_kernel
def test_the_ops_called_directly_check_their_operands():
    """The ops are public (``torch.ops.sparsetorch``) and their kernels read what the arrays
    say: strided index arrays crashed them (SIGSEGV) or gave garbage, an out-of-range
    column read past the input, int64 ``pos`` beside int32 ``crd`` was read as int32, a
    transposed saved output gave a wrong ``dx`` (a probe's findings). Now strided operands
    are made contiguous and bad ones are refused naming the op."""
    ops = torch.ops.sparsetorch
    g = torch.Generator().manual_seed(0)
    D = torch.randn(12, 20, generator=g) * (torch.rand(12, 20, generator=g) < 0.4)
    W = st.tensor(D, format="csr")
    pos, crd, v = W._pos1, W._crd1, W.values
    x, dy = torch.randn(40, 20, generator=g), torch.randn(40, 12, generator=g)
    ref = x @ D.T
    torch.testing.assert_close(ops.rows_linear(x, _strided(pos), _strided(crd), _strided(v),
                                               None, None, 20), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.spmm_narrow(_strided(pos), crd, v, 20, x.T.contiguous(),
                                               None, None, 0), ref.T, rtol=1e-5, atol=1e-5)
    y = ops.rows_linear(x, pos, crd, v, None, "relu", 20)
    dx, _, _ = ops.rows_linear_backward(dy, x, pos, crd, v, y.T.contiguous().T, "relu", 20,
                                        True, False, False)
    torch.testing.assert_close(dx, (dy * (y > 0)) @ D, rtol=1e-5, atol=1e-5)
    bad = crd.clone()
    bad[0] = 20
    for call, error, match in (
            (lambda: ops.rows_linear(x, pos, bad, v, None, None, 20), ValueError,
             "rows_linear: crd holds a column index outside"),
            (lambda: ops.rows_linear(x, pos.long(), crd, v, None, None, 20), TypeError,
             "one index dtype"),
            (lambda: ops.rows_linear(x, pos.flip(0), crd, v, None, None, 20), ValueError,
             "pos must rise from 0"),
            (lambda: ops.rows_linear(x, pos, crd, v[1:], None, None, 20), ValueError,
             "one floating value per entry"),
            (lambda: ops.spmm_narrow(pos, bad, v, 20, x.T.contiguous(), None, None, 0),
             ValueError, "spmm_narrow: crd holds"),
            (lambda: ops.rows_linear_backward(dy[:, :5], x, pos, crd, v, None, None, 20,
                                              True, True, True), ValueError,
             r"dy must be float32 of shape \(40, 12\)"),
            (lambda: ops.rows_linear_csr(pos, bad, v, pos, crd, v, None, None, 20),
             ValueError, "rows_linear_csr: crd holds")):
        with pytest.raises(error, match=match):
            call()


@needs_kernel
@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_the_batch_dynamic(strict):
    """``torch.export`` (non-strict by default: the layers' Python runs on FakeTensors) of
    a SparseAutoencoder with a dynamic batch: the product compared the batch with 16 and
    fell to einsum's traced path, which specialised it (a constraint violation for
    ``Dim("batch")``). Now the graph holds the custom ops and runs any batch as eager."""
    from torch.export import Dim, export
    model = st.models.SparseAutoencoder(40, 12, density=0.3,
                                        generator=torch.Generator().manual_seed(0))
    program = export(model, (torch.rand(32, 40),), strict=strict,
                     dynamic_shapes={"x": {0: Dim("batch", min=2, max=1024)}})
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.sparsetorch.rows_linear.default) == 2
    for n in (3, 40):
        x = torch.rand(n, 40)
        torch.testing.assert_close(program.module()(x), model(x).detach())
