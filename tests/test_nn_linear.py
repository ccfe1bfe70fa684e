"""``st.nn.SparseLinear`` against ``nn.Linear`` with the masked dense weight: forward and
gradients (CSR and BSR, float32 and float64, 1-D to 3-D and sparse inputs, densities 0 and
1), gradcheck, state_dict round trips across patterns, from_dense, set_pattern, bad input."""
from __future__ import annotations

import copy
import io
import importlib

import pytest
import torch
import torch.nn.functional as F

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401

SparseLinear = st.nn.SparseLinear
linear_module = importlib.import_module("sparsetorch.nn.linear")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def dense_reference(layer):
    """An nn.Linear holding the layer's weight with zeros off the pattern."""
    ref = torch.nn.Linear(layer.in_features, layer.out_features, layer.bias is not None,
                          dtype=layer.values.dtype)
    with torch.no_grad():
        ref.weight.copy_(layer.weight.to_dense())
        if layer.bias is not None:
            ref.bias.copy_(layer.bias)
    return ref


@pytest.mark.parametrize("dtype,blocksize,xshape", [
    (torch.float32, None, (8,)), (torch.float32, None, (5, 8)), (torch.float32, None, (2, 3, 8)),
    (torch.float64, None, (5, 8)), (torch.float32, (2, 4), (5, 8)),
    (torch.float64, (2, 4), (2, 3, 8))])
def test_forward_and_gradients_match_masked_dense(dtype, blocksize, xshape):
    layer = SparseLinear(8, 6, density=0.4, blocksize=blocksize, dtype=dtype, generator=gen())
    ref = dense_reference(layer)
    x = torch.randn(xshape, dtype=dtype, generator=gen(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = layer(x1), ref(x2)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    g = torch.randn(y.shape, dtype=dtype, generator=gen(2))
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, **TOL[dtype])
    mask = layer.mask()
    got_w = layer.weight.detach().with_values(layer.values.grad).to_dense()
    torch.testing.assert_close(got_w, ref.weight.grad * mask, **TOL[dtype])
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL[dtype])


def test_pattern_counts_and_blocks():
    layer = SparseLinear(10, 7, density=0.3, generator=gen())
    assert layer.values.numel() == round(0.3 * 70) == int(layer.mask().sum())
    blocked = SparseLinear(8, 6, density=0.5, blocksize=2, generator=gen())
    assert blocked.weight.format.name == "bsr"
    assert blocked.values.numel() == round(0.5 * 12) * 4
    # whole blocks: the mask is constant on each 2 x 2 block
    m = blocked.mask().reshape(3, 2, 4, 2)
    assert bool((m == m[:, :1, :, :1]).all())


@pytest.mark.parametrize("density", [0.0, 1.0])
def test_density_extremes(density):
    layer = SparseLinear(5, 4, density=density, generator=gen())
    assert layer.values.numel() == round(density * 20)
    x = torch.randn(3, 5, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, dense_reference(layer)(x))
    y.sum().backward()
    assert layer.values.grad.shape == layer.values.shape
    if density == 0:
        torch.testing.assert_close(x.grad, torch.zeros_like(x))


def test_init_scale_follows_stored_fan_in():
    # a 90%-sparse row sums ~100 of 1000 inputs: bound 1/sqrt(100), not 1/sqrt(1000)
    layer = SparseLinear(1000, 50, density=0.1, generator=gen())
    bound = 1 / (layer.values.numel() / 50) ** 0.5
    assert layer.values.abs().max() <= bound
    assert layer.values.abs().max() > 0.9 * bound


@pytest.mark.parametrize("blocksize", [None, 2])
@pytest.mark.parametrize("densify_above", [0.0, 1.0])   # densified first / multiplied sparse
def test_sparse_input(blocksize, densify_above, monkeypatch):
    monkeypatch.setattr(linear_module, "DENSIFY_INPUT_ABOVE", densify_above)
    layer = SparseLinear(8, 6, density=0.5, blocksize=blocksize, generator=gen())
    xd = torch.randn(4, 8, generator=gen(1)) * (torch.rand(4, 8, generator=gen(2)) < 0.3)
    x = st.tensor(xd, "csr")
    y = layer(x)
    assert type(y) is torch.Tensor
    torch.testing.assert_close(y, dense_reference(layer)(xd))
    y.sum().backward()
    ref = dense_reference(layer)
    ref(xd).sum().backward()
    got = layer.weight.detach().with_values(layer.values.grad).to_dense()
    torch.testing.assert_close(got, ref.weight.grad * layer.mask())
    torch.testing.assert_close(layer(st.tensor(xd[0], "coo")), ref(xd[0]))


@pytest.mark.parametrize("activation", [None, "sigmoid"])
def test_sparse_input_densified_for_a_relaid_product(activation):
    """A sparse batch above the densify threshold is written (in, batch)-major and handed
    over as its transposed view; large enough that relayout runs the product with the batch
    index last (``MIN_PERMUTED_WORK``), on that view, and the gradient still reaches W."""
    layer = SparseLinear(128, 64, density=0.5, generator=gen(), activation=activation)
    xd = torch.randn(64, 128, generator=gen(1)) * (torch.rand(64, 128, generator=gen(2)) < 0.3)
    ref = dense_reference(layer)
    want = ref(xd) if activation is None else torch.sigmoid(ref(xd))
    got = layer(st.tensor(xd, "csr"))
    torch.testing.assert_close(got, want)
    assert got.is_contiguous()
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(layer.weight.detach().with_values(layer.values.grad).to_dense(),
                               ref.weight.grad * layer.mask())


@pytest.mark.parametrize("blocksize", [None, 2])
def test_gradcheck_float64(blocksize):
    layer = SparseLinear(4, 4, density=0.5, blocksize=blocksize, dtype=torch.float64,
                         generator=gen())
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    values, bias = layer.values, layer.bias

    def f(x, v, b):
        return F.linear(x, layer.weight.detach().with_values(v), b)

    assert torch.autograd.gradcheck(f, (x, values, bias))
    # and through the module itself (values read from the Parameter)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))


def test_state_dict_round_trip_across_patterns():
    a = SparseLinear(8, 6, density=0.5, generator=gen(0))
    b = SparseLinear(8, 6, density=0.2, generator=gen(1))
    state = a.state_dict()
    assert set(state) == {"values", "bias", "pos1", "crd1", "weight_shape"}
    b.load_state_dict(state)
    assert b.values.numel() == a.values.numel()
    assert torch.equal(b.mask(), a.mask())
    x = torch.randn(3, 8)
    torch.testing.assert_close(b(x), a(x))
    # a deep copy owns its weights (the kept weight wrapper is not shared)
    c = copy.deepcopy(a)
    with torch.no_grad():
        c.values.mul_(2)
    torch.testing.assert_close(a(x), b(x))
    torch.testing.assert_close(c(x) - c.bias, 2 * (a(x) - a.bias))
    # loading a bad pattern fails with a message naming the module
    bad = dict(state)
    bad["crd1"] = bad["crd1"] + 100
    with pytest.raises(RuntimeError, match="valid csr pattern"):
        SparseLinear(8, 6, density=0.5).load_state_dict(bad)
    # ... and leaves the layer as it was (found by the fuzzer: the bad arrays were copied in
    # before the check, and the layer then ran them), of the same pattern size or another
    for bad_crd in (state["crd1"].flip(0), state["crd1"][:-1]):
        bad = {**state, "crd1": bad_crd, "values": 2 * state["values"][:bad_crd.numel()]}
        d = SparseLinear(8, 6, density=0.5, generator=gen(2))
        kept, y = copy.deepcopy(d.state_dict()), d(x)
        with pytest.raises(RuntimeError, match="nothing of this layer was loaded"):
            d.load_state_dict(bad)
        assert all(torch.equal(v, kept[k]) for k, v in d.state_dict().items())
        torch.testing.assert_close(d(x), y)
    # a state of another storage: the message says so (a probe found it blamed the pattern)
    with pytest.raises(RuntimeError, match=r"stores blocks of \(2, 2\); a state saved by a "
                                           "layer of another blocksize does not fit"):
        SparseLinear(8, 6, density=0.5, blocksize=(2, 2)).load_state_dict(state)
    # a state of a layer of other sizes: refused, even where its pattern would fit (a
    # fuzzer's finding: 7 inputs loaded into 8), also after torch.save and torch.load
    narrow, buf = SparseLinear(7, 6, density=0.5, generator=gen(3)), io.BytesIO()
    torch.save(narrow.state_dict(), buf)
    for state in (narrow.state_dict(), torch.load(io.BytesIO(buf.getvalue()))):
        d = SparseLinear(8, 6, density=0.5, generator=gen(2))
        kept = copy.deepcopy(d.state_dict())
        with pytest.raises(RuntimeError, match="size mismatch.*6 x 7.*6 x 8"):
            d.load_state_dict(state)
        assert all(torch.equal(v, kept[k]) for k, v in d.state_dict().items())


def test_optimizer_steps_and_dtype_and_compile():
    layer = SparseLinear(8, 6, density=0.5, generator=gen())
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    x, target = torch.randn(16, 8, generator=gen(1)), torch.randn(16, 6, generator=gen(2))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    # the kept wrapper sees optimizer steps (no stale values)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense_reference(layer)(x))
    double = layer.to(torch.float64)
    assert double.values.dtype == double.weight.dtype == torch.float64
    torch.testing.assert_close(double(x.double()), dense_reference(double)(x.double()))
    compiled = torch.compile(double, fullgraph=True, backend="aot_eager")
    xd = x.double().requires_grad_()
    torch.testing.assert_close(compiled(xd), double(xd))
    compiled(xd).sum().backward()
    assert double.values.grad is not None
    xs = st.tensor(x.double() * (x > 1), "csr")   # a sparse input: densified when traced
    torch.testing.assert_close(compiled(xs), double(xs))


@pytest.mark.slow   # ~7 s: a compiled forward and backward (the full suite runs it)
def test_compiled_layer_whose_input_is_re_laid():
    """An input of a product large enough is copied batch-last for the kernel
    (``ops/relayout.py``, from 2**17 multiply-adds): under torch.compile its fake tensors
    reached that C copy, and compiling failed ("Cannot access data pointer of Tensor")."""
    layer = SparseLinear(512, 32, density=0.5, generator=gen())
    x = torch.randn(16, 512, generator=gen(1), requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))
    compiled(x).sum().backward()
    assert x.grad is not None and layer.values.grad is not None


def test_from_dense_magnitude_and_random():
    dense = torch.nn.Linear(10, 6)
    sparse = SparseLinear.from_dense(dense, sparsity=0.75)
    k = round(0.25 * 60)
    assert sparse.values.numel() == k
    mask = sparse.mask()
    kept, dropped = dense.weight.detach()[mask].abs(), dense.weight.detach()[~mask].abs()
    assert kept.min() >= dropped.max()
    torch.testing.assert_close(sparse.weight.to_dense(), dense.weight.detach() * mask)
    torch.testing.assert_close(sparse.bias, dense.bias)
    rand = SparseLinear.from_dense(dense, density=0.5, method="random", generator=gen())
    assert rand.values.numel() == 30
    torch.testing.assert_close(rand.weight.to_dense(), dense.weight.detach() * rand.mask())
    blocked = SparseLinear.from_dense(dense, density=0.5, blocksize=2)
    scores = dense.weight.detach().abs().reshape(3, 2, 5, 2).sum((1, 3))
    keep = blocked.mask()[::2, ::2]
    assert int(keep.sum()) == 7   # 15 - round(0.5 * 15): kept_count's rule
    assert scores[keep].min() >= scores[~keep].max()


def test_every_entry_point_keeps_the_same_count():
    # One rule (nn._pattern.kept_count: N - round(sparsity * N)) for every way to ask for a
    # density: N = 7 at 0.5 used to keep 4 in SparseLinear and 3 in prune_mask.
    from sparsetorch.nn import _pattern, pattern
    assert pattern.kept_count is _pattern.kept_count
    assert _pattern.kept_count(7, density=0.5) == _pattern.kept_count(7, sparsity=0.5) == 3
    for n in range(1, 21):
        w = torch.randn(1, n, generator=gen(n))
        dense = torch.nn.Linear(n, 1)
        for d in (0.5, 0.25, 0.1, 0.75):
            k = _pattern.kept_count(n, density=d)
            assert k == n - round((1 - d) * n), (n, d)
            counts = {
                "SparseLinear": SparseLinear(n, 1, density=d, generator=gen()).values.numel(),
                "from_dense(density)": SparseLinear.from_dense(dense, density=d).values.numel(),
                "from_dense(sparsity)": SparseLinear.from_dense(
                    dense, sparsity=1 - d, method="random", generator=gen()).values.numel(),
                "prune_mask": int(st.nn.prune_mask(w, density=d).sum()),
                "prune_mask(sparsity)": int(st.nn.prune_mask(w, sparsity=1 - d).sum()),
                "random_mask": int(_pattern.random_mask((1, n), None, gen(), "t",
                                                        density=d).sum()),
            }
            assert set(counts.values()) == {k}, (n, d, counts)


def test_density_and_sparsity_are_keyword_only():
    dense = torch.nn.Linear(4, 3)
    with pytest.raises(TypeError):
        SparseLinear.from_dense(dense, 0.9)
    with pytest.raises(TypeError):
        st.nn.prune_mask(dense.weight, 0.9)


def test_cached_weight_follows_the_pattern_buffers():
    """The kept weight wrapper holds validated copies of the pattern buffers: it is rebuilt
    when a buffer is replaced (set_pattern) and when one is written in place (a
    load_state_dict of another pattern with as many entries); before, an in-place write
    left the old pattern in use."""
    layer = SparseLinear(4, 3, density=0.5, generator=gen())
    with torch.no_grad():
        first = layer.weight
        assert layer.weight is first
        layer.crd1 = layer.crd1.clone()
        second = layer.weight
        assert second is not first and torch.equal(second.arrays["crd1"], layer.crd1)
        other = SparseLinear(4, 3, density=0.5, generator=gen(9))
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer.weight.to_dense(), other.weight.to_dense())


@pytest.mark.parametrize("blocksize", [None, (2, 3)])
def test_positions_match_the_dense_layout_without_a_dense_grid(blocksize, monkeypatch):
    from sparsetorch.nn import _pattern
    mask = torch.rand(6, 9, generator=gen(4)) < 0.4
    mask[1] = False   # an empty row (of blocks too)
    mask[:, 0] = True
    pattern = _pattern.from_mask(mask, (6, 9), blocksize, "t")
    numbered = pattern.with_values(torch.arange(1., pattern.nnz + 1, dtype=torch.float64))
    order = numbered.to_dense().flatten()
    want = torch.empty(pattern.nnz, dtype=torch.int64)
    want[(order[order != 0] - 1).long()] = (order != 0).nonzero().squeeze(1)
    # positions must not densify the pattern (128 MB of int64 for a 4096^2 weight)
    monkeypatch.setattr(type(pattern), "to_dense", lambda self: pytest.fail("densified"))
    assert torch.equal(_pattern.positions(pattern), want)
    assert _pattern.positions(_pattern.from_mask(torch.zeros(6, 9, dtype=torch.bool), (6, 9),
                                                 blocksize, "t")).numel() == 0


def test_set_pattern_keeps_old_values():
    layer = SparseLinear(5, 4, density=0.5, generator=gen())
    before = layer.weight.to_dense().detach()
    new_mask = torch.rand(4, 5, generator=gen(3)) < 0.5
    same = layer.values
    layer.set_pattern(new_mask)
    assert torch.equal(layer.mask(), new_mask)
    torch.testing.assert_close(layer.weight.to_dense(), before * new_mask)
    assert (layer.values is same) == (int(new_mask.sum()) == same.numel())
    layer.set_pattern(st.tensor(torch.eye(4, 5), "coo"), values=torch.full((4, 5), 2.0))
    torch.testing.assert_close(layer.weight.to_dense(), 2 * torch.eye(4, 5))


def test_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="exactly one of density"):
        SparseLinear(4, 3)
    with pytest.raises(ValueError, match="exactly one of density"):
        SparseLinear(4, 3, density=0.5, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask has shape \(4, 3\)"):
        SparseLinear(4, 3, mask=torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        SparseLinear(4, 3, mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="density must lie in"):
        SparseLinear(4, 3, density=1.5)
    with pytest.raises(ValueError, match="does not divide"):
        SparseLinear(4, 3, density=0.5, blocksize=2)
    for bs in (2.0, "2", True, (2, 2.0), (2, 2, 2)):
        with pytest.raises(ValueError, match="blocksize must be a positive int or a pair"):
            SparseLinear(4, 4, density=0.5, blocksize=bs)
    with pytest.raises(ValueError, match="device='meta' holds no data"):
        SparseLinear(4, 3, density=0.5, device="meta")
    for dtype in (torch.int64, torch.bool, "float32"):
        with pytest.raises(TypeError, match=f"SparseLinear: dtype={dtype} is not a floating"):
            SparseLinear(4, 3, density=0.5, dtype=dtype)
    layer = SparseLinear(4, 3, density=0.5)
    with pytest.raises(ValueError, match="in_features=4"):
        layer(torch.randn(2, 5))
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(2, 4, dtype=torch.float64))
    for x in (torch.randn(2, 4).to_sparse(), torch.randn(2, 4).to_sparse_csr()):
        with pytest.raises(TypeError, match=r"a torch.sparse tensor.*st.tensor\(x\)"):
            layer(x)
    with pytest.raises(ValueError, match="must have shape"):
        layer.set_pattern(torch.ones(3, 4, dtype=torch.bool), values=torch.ones(5))
    with pytest.raises(ValueError, match="sparsity"):
        SparseLinear.from_dense(torch.nn.Linear(4, 3), density=0.5, sparsity=0.5)
    with pytest.raises(ValueError, match="method"):
        SparseLinear.from_dense(torch.nn.Linear(4, 3), density=0.5, method="l2")


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_activation_runs_on_every_input_kind_and_carries_gradients(activation):
    """``activation`` is applied whatever the input (2-D dense: in the product's kernel;
    sparse, one row, 3-D, no bias: after it) and gradients flow through it."""
    g = torch.Generator().manual_seed(4)
    for bias in (True, False):
        layer = st.nn.SparseLinear(12, 6, bias=bias, density=0.4, generator=g,
                                   activation=activation)
        w = layer.weight.to_dense()
        fn = torch.relu if activation == "relu" else torch.sigmoid
        for x in (torch.randn(5, 12, generator=g), torch.randn(1, 12, generator=g),
                  torch.randn(2, 3, 12, generator=g)):
            want = fn(x @ w.T + (layer.bias if bias else 0))
            torch.testing.assert_close(layer(x), want)
        xs = torch.randn(5, 12, generator=g) * (torch.rand(5, 12, generator=g) < 0.02)
        torch.testing.assert_close(layer(st.tensor(xs, "csr")),
                                   fn(xs @ w.T + (layer.bias if bias else 0)))
        x = torch.randn(5, 12, generator=g)
        layer(x).sum().backward()
        ref = torch.nn.Linear(12, 6, bias=bias)
        with torch.no_grad():
            ref.weight.copy_(w)
            if bias:
                ref.bias.copy_(layer.bias)
        fn(ref(x)).sum().backward()
        dense_grad = layer.weight.with_values(layer.values.grad).to_dense()
        torch.testing.assert_close(dense_grad, ref.weight.grad * (w != 0))
    with pytest.raises(ValueError, match="activation must be None or one of"):
        st.nn.SparseLinear(4, 2, density=0.5, activation="gelu")


def test_bsr_weight_under_torch_compile_runs_eagerly_and_matches():
    """A BSR weight's product is a graph break under torch.compile (its block coordinates
    are unpacked by value): outputs and gradients as eager."""
    g = torch.Generator().manual_seed(5)
    layer = st.nn.SparseLinear(16, 8, density=0.5, blocksize=4, generator=g)
    x = torch.randn(3, 16, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))
    compiled(x).sum().backward()
    got = layer.values.grad.clone()
    layer.values.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(got, layer.values.grad)


def test_a_load_of_another_entry_count_keeps_the_parameter_an_optimizer_holds():
    """(A probe's finding: the load made a new values Parameter, and an optimizer built
    before it went on stepping the old one: the layer silently stopped training.)"""
    layer = SparseLinear(8, 6, density=0.2, generator=gen(0))
    values = layer.values
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.load_state_dict(SparseLinear(8, 6, density=0.5, generator=gen(1)).state_dict())
    assert layer.values is values and values.numel() == layer.mask().sum() > 12
    before = layer.weight.to_dense().detach().clone()
    layer(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    assert not torch.equal(layer.weight.to_dense(), before)


def test_set_pattern_of_another_count_keeps_the_parameter_users_hold():
    """(A probe: a new values Parameter left a list given to clip_grad_norm_, an optimizer
    and AveragedModel on an orphan.)"""
    layer = SparseLinear(8, 6, density=0.2, generator=gen(0))
    values, held = layer.values, list(layer.parameters())
    layer(torch.randn(2, 8)).sum().backward()
    layer.set_pattern(torch.ones(6, 8, dtype=torch.bool))
    assert layer.values is values and values.numel() == 48 and values.grad is None
    opt = torch.optim.SGD(held, lr=0.1)
    layer(torch.randn(3, 8)).square().sum().backward()
    assert torch.nn.utils.clip_grad_norm_(held, 1e9) > 0
    before = layer.weight.to_dense().detach().clone()
    opt.step()
    assert not torch.equal(layer.weight.to_dense(), before)


def test_pattern_buffers_written_in_place_are_checked():
    """AveragedModel(use_buffers=True) averages every buffer, integer ones too: the EMA
    copy's column indices dropped by one here and there (p * 0.9 + p * 0.1 truncated), and
    the layer ran the invalid pattern (duplicate columns) without a word."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    layer = SparseLinear(3000, 40, density=0.05, generator=gen(0))
    ema = AveragedModel(layer, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for _ in range(3):
        ema.update_parameters(layer)
    assert not torch.equal(ema.module.crd1, layer.crd1)   # (torch's doing)
    with pytest.raises(ValueError, match="pattern buffers .* not a valid csr pattern.*"
                                         "use_buffers=False"):
        ema(torch.randn(2, 3000))
    fine = AveragedModel(layer, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    fine.update_parameters(layer)
    x = torch.randn(2, 3000)
    torch.testing.assert_close(fine(x), layer(x))


def test_a_state_takes_every_index_array_at_its_dtype_and_keeps_its_shape_in_plain_dicts():
    """(A probe's findings: an int64 state of another count left int32 offsets beside int64
    columns, and the forward failed; a narrower layer's state copied into a plain dict, as
    when a DDP prefix is stripped, lost the metadata holding its shape and loaded.)"""
    source = SparseLinear(8, 6, density=0.5, generator=gen(0))
    state = {k: v.long() if k in ("pos1", "crd1") else v for k, v in
             source.state_dict().items()}
    layer = SparseLinear(8, 6, density=0.2, generator=gen(1))
    layer.load_state_dict(state)
    assert layer.pos1.dtype == layer.crd1.dtype == torch.int64
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), source(x))
    narrow = {k: v for k, v in SparseLinear(6, 6, density=0.5).state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch.*6 x 6.*6 x 8"):
        SparseLinear(8, 6, density=0.5).load_state_dict(narrow)
    # a state saved before the shape was kept still loads
    old = {k: v for k, v in source.state_dict().items() if k != "weight_shape"}
    SparseLinear(8, 6, density=0.2).load_state_dict(old)
