"""st.train in truly sparse mode (st.nn.SparseLinear): the same trajectory as masked mode on
the same seed and data (float32 by default; float64, Adam and SparseConv2d variants are
slow: each new dtype/format compiles its kernels), values and optimizer state remapped with
the pattern, exact counts, and the dense gradient streamed only on update steps."""
import pytest
import torch
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from helpers import one_thread  # noqa: F401  (single-threaded: tiny tensors)

SIZES = [(10, 24), (24, 16), (16, 3)]


def masked_model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(*SIZES[0]), nn.ReLU(), nn.Linear(*SIZES[1]), nn.ReLU(),
                         nn.Linear(*SIZES[2])).to(dtype)


def sparse_copy(model, masks, dtype):
    layers = []
    for i, (n_in, n_out) in zip((0, 2, 4), SIZES):
        dense = model[i]
        mask = masks[f"{i}.weight"]
        sl = st.nn.SparseLinear(n_in, n_out, mask=mask, dtype=dtype)
        sl.set_pattern(mask, dense.weight.detach())
        with torch.no_grad():
            sl.bias.copy_(dense.bias)
        layers += [sl, nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batches(n, dtype):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 10, generator=g, dtype=dtype),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def run(model, opt, trainer, data):
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        trainer.step()


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)   # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)                # noqa: E731


@pytest.mark.parametrize("algo,make_opt,dtype", [
    ("RigL", SGD, torch.float32),
    pytest.param("RigL", ADAM, torch.float64, marks=pytest.mark.slow),
    pytest.param("SET", SGD, torch.float64, marks=pytest.mark.slow),
    ("SNFS", SGD, torch.float32)])   # its dense average formed from (X, dY) every step
def test_truly_sparse_follows_masked_mode(algo, make_opt, dtype):
    kw = dict(density=0.3, distribution="erk", delta_t=2, alpha=0.4, total_steps=16, seed=4)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5,
                                                                            atol=1e-6)
    dense = masked_model(dtype)
    opt_d = make_opt(dense.parameters())
    tr_d = getattr(st.train, algo)(dense, opt_d, **kw)
    sparse = sparse_copy(dense, tr_d.masks, dtype)
    opt_s = make_opt(sparse.parameters())
    tr_s = getattr(st.train, algo)(sparse, opt_s, **kw)
    for i in (0, 2, 4):   # the sparse trainer kept the layers' patterns (counts match)
        assert torch.equal(tr_s.masks[f"{i}.values"], tr_d.masks[f"{i}.weight"])
    data = batches(16, dtype)
    changed = 0
    for step in range(16):
        before = tr_d.masks
        run(dense, opt_d, tr_d, data[step:step + 1])
        run(sparse, opt_s, tr_s, data[step:step + 1])
        for i in (0, 2, 4):
            m = tr_d.masks[f"{i}.weight"]
            assert torch.equal(tr_s.masks[f"{i}.values"], m), (step, i)
            assert sparse[i].values.numel() == tr_d.counts[f"{i}.weight"]
            torch.testing.assert_close(sparse[i].weight.to_dense(), dense[i].weight, **tol)
            changed += int((m != before[f"{i}.weight"]).sum())
            # optimizer state moved with the entries: dense state read at the new pattern
            for key, t in opt_s.state[sparse[i].values].items():
                if isinstance(t, torch.Tensor) and t.dim() == 1:
                    torch.testing.assert_close(t, opt_d.state[dense[i].weight][key][m], **tol)
    assert changed > 0


def test_dense_gradient_is_captured_only_for_update_steps():
    torch.manual_seed(0)
    model = nn.Sequential(st.nn.SparseLinear(12, 8, density=0.25), nn.ReLU(),
                          st.nn.SparseLinear(8, 2, density=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.train.RigL(model, opt, density=0.3, delta_t=3, total_steps=12)
    layer = trainer.layers["0.values"]
    held = []
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(4, 12)).sum().backward()
        held.append(layer.has_grad())
        trainer.step()
        assert not layer.has_grad()        # released after the update
        assert model[0].values.numel() == trainer.counts["0.values"]
    assert held == [True, False, False, True, False, False, True]   # t = 0, 3, 6


def test_streamed_growth_matches_the_full_dense_gradient(monkeypatch):
    """Row blocks of one row each: the running top-k must pick what a top-k over the whole
    dense gradient picks."""
    from sparsetorch.train import update
    monkeypatch.setattr(update, "BLOCK_ENTRIES", 1)
    torch.manual_seed(0)
    layer = st.nn.SparseLinear(20, 9, density=0.2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    trainer = st.train.RigL(layer, opt, density=0.2, delta_t=1, alpha=0.5, total_steps=8)
    opt.zero_grad()
    layer(torch.randn(3, 20)).square().sum().backward()
    trainer.step()                                              # t=0: ordinary step
    x = torch.randn(5, 20)
    opt.zero_grad()
    out = layer(x)
    out.retain_grad()
    out.square().sum().backward()
    full = out.grad.t() @ x                                     # the dense gradient of W
    before = layer.mask()
    trainer.step()                                              # t=1: update
    grown = layer.mask() & ~before
    k = int(grown.sum())
    assert k > 0
    candidates = full.abs().masked_fill(before & layer.mask(), -1)
    assert full.abs()[grown].min() >= candidates[~layer.mask()].max()


def test_blocked_layers_are_refused_in_sparse_mode():
    blocked = st.nn.SparseLinear(8, 8, density=0.5, blocksize=2)
    with pytest.raises(ValueError, match="blocksize"):
        st.train.RigL(blocked, torch.optim.SGD(blocked.parameters(), lr=0.1), total_steps=10)


@pytest.mark.slow   # compiles the conv kernels (CSR and BSR)
def test_sparse_conv2d_follows_masked_conv_including_a_blocked_start():
    """SparseConv2d (1x1; stride 2 in the second layer) against masked nn.Conv2d; the first
    layer starts from a pattern of whole 4-channel blocks, which SparseConv2d stores as BSR,
    so the first update also moves values and Adam state from block order to CSR order."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1, stride=2)).double()
    opt_d = torch.optim.Adam(dense.parameters(), lr=1e-2)
    kw = dict(density=0.5, distribution="uniform", delta_t=2, alpha=0.4, total_steps=12,
              seed=2, dense=[])
    tr_d = st.train.RigL(dense, opt_d, **kw)
    blocky = torch.zeros(8, 8, dtype=torch.bool)
    blocky[:4, ::2] = blocky[4:, 1::2] = True            # 32 entries in (4, 1) blocks
    state = tr_d.state_dict()
    state["active"]["0.weight"] = blocky.flatten().nonzero().squeeze(1)
    tr_d.load_state_dict(state)
    layers = []
    for i, stride in ((0, 1), (2, 2)):
        conv, mask = dense[i], tr_d.masks[f"{i}.weight"].view(conv_shape(dense[i]))
        sc = st.nn.SparseConv2d(conv.in_channels, conv.out_channels, mask=mask, stride=stride,
                                dtype=torch.float64)
        sc.set_pattern(mask, conv.weight.detach().view(mask.shape))
        with torch.no_grad():
            sc.bias.copy_(conv.bias)
        layers.append(sc)
    assert layers[0].blocksize is not None                 # stored in blocks
    sparse = nn.Sequential(layers[0], nn.ReLU(), layers[1])
    opt_s = torch.optim.Adam(sparse.parameters(), lr=1e-2)
    tr_s = st.train.RigL(sparse, opt_s, **kw)
    g = torch.Generator().manual_seed(5)
    for step in range(12):
        x = torch.randn(3, 8, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (3,), generator=g)
        for model, opt, tr in ((dense, opt_d, tr_d), (sparse, opt_s, tr_s)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).mean((2, 3)), y).backward()
            tr.step()
        for i in (0, 2):
            m = tr_d.masks[f"{i}.weight"].view(conv_shape(dense[i]))
            assert torch.equal(tr_s.masks[f"{i}.values"], m), (step, i)
            torch.testing.assert_close(sparse[i].weight.to_dense(),
                                       dense[i].weight.view(m.shape), rtol=1e-10, atol=1e-12)
            stored = sparse[i].weight.detach()
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in opt_d.state[dense[i].weight]:   # no optimizer step yet (t=0)
                    assert key not in opt_s.state[sparse[i].values]
                    continue
                # the state in storage order is the dense state read at the stored entries
                t_dense = opt_d.state[dense[i].weight][key].view(m.shape)
                torch.testing.assert_close(
                    stored.with_values(opt_s.state[sparse[i].values][key]).to_dense(),
                    t_dense * m, rtol=1e-10, atol=1e-12)
    assert sparse[0].blocksize is None                     # the updates broke the blocks


def conv_shape(conv):
    return (conv.out_channels, conv.in_channels)


def test_a_pruned_sparse_linear_keeps_its_pattern_and_trained_values():
    """from_dense at 0.25 on 10x5 stores 12 entries; the trainer's count is 13 (official
    floor rule): the 12 keep their values and one zero is grown; at 0.2 (10) the two
    smallest are dropped. Nothing is re-initialised."""
    torch.manual_seed(0)
    lin = nn.Linear(10, 5)
    for density, count in ((0.25, 13), (0.2, 10)):
        sl = st.nn.SparseLinear.from_dense(lin, density=0.25)
        w0, m0 = sl.weight.to_dense().detach().clone(), sl.mask()
        assert int(m0.sum()) == 12
        opt = torch.optim.SGD(sl.parameters(), lr=0.1)
        tr = st.train.RigL(sl, opt, density=density, distribution="uniform", total_steps=8)
        m = tr.masks["values"]
        assert int(m.sum()) == count == sl.values.numel()
        assert any(p is sl.values for g in opt.param_groups for p in g["params"])
        w = sl.weight.to_dense().detach()
        assert torch.equal(w[m & m0], w0[m & m0])          # trained values kept
        assert bool((w[m & ~m0] == 0).all())                # grown entries start at zero
        if count < 12:                                      # the smallest |w| were dropped
            assert bool(m0[m].all())
            assert w0[m0 & ~m].abs().max() <= w0[m].abs().min()
        else:
            assert bool(m[m0].all())


def test_grow_scores_sum_micro_batches_and_repeated_calls():
    """Two accumulated micro-batches through a layer called twice per forward: the streamed
    gradient is the dense gradient of the weight (as masked mode sees it), not the last
    call's; a zero_grad() before them discards what an earlier backward left."""
    torch.manual_seed(0)
    sl = st.nn.SparseLinear(6, 6, density=0.5)
    opt = torch.optim.SGD(sl.parameters(), lr=0.1)
    tr = st.train.RigL(sl, opt, density=0.5, distribution="uniform", delta_t=2,
                       total_steps=8)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 6, generator=g) for _ in range(3)]
    while not tr.is_update_step():                          # the next step scores growth
        opt.zero_grad(); sl(xs[0]).sum().backward(); tr.step()
    w = sl.weight.to_dense().detach().clone().requires_grad_()
    sl(sl(xs[0]).tanh()).sum().backward()                   # stale: zero_grad drops it
    opt.zero_grad()
    for x in xs[1:]:
        sl(sl(x).tanh()).square().sum().backward()
        f = lambda z: nn.functional.linear(z, w, sl.bias.detach())
        f(f(x).tanh()).square().sum().backward()
    torch.testing.assert_close(tr.layers["values"].grad_rows(0, 6), w.grad,
                               rtol=1e-5, atol=1e-5)


def test_sparse_layer_mask_lives_on_the_parameter_device():
    """The mask of a truly sparse layer is built where its values live (as MaskedLayer's);
    a meta-device parameter stands in for an accelerator here."""
    from sparsetorch.train.layers import SparseLayer

    class OnMeta(SparseLayer):
        param = property(lambda self: torch.empty(0, device="meta"))

    sl = st.nn.SparseLinear(4, 3, density=0.5)
    layer = OnMeta("values", sl, lambda t: t, lambda: False, conv=False)
    assert layer.mask().device.type == "meta"
    assert SparseLayer("values", sl, lambda t: t, lambda: False, conv=False).mask().device \
        == sl.values.device


def test_pruning_sparse_linear_layers_under_torch_distributed_is_refused(monkeypatch):
    """Every prune stores a SparseLinear's fewer entries in a new Parameter, which DDP's
    reducer never sees: a probe saw two ranks' weights drift apart, then DDP fail. Refused
    before anything changes; masked layers and the other algorithms are unaffected."""
    from sparsetorch.train import distributed
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "same_seed", int)   # (no process group to ask)
    model = nn.Sequential(st.nn.SparseLinear(8, 6, density=0.5), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    values = model[0].values
    with pytest.raises(ValueError, match=r"SparseLinear layers \['0.values'\] store fewer "
                                         "entries at every prune"):
        st.train.MagnitudePruning(model, opt, density=0.2, total_steps=8)
    assert model[0].values is values and not model[0]._forward_hooks
    st.train.RigL(model, opt, density=0.2, total_steps=8).close()   # (counts never change)
    masked = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    st.train.MagnitudePruning(masked, torch.optim.SGD(masked.parameters(), lr=0.1),
                              density=0.2, total_steps=8).close()


def test_a_model_load_of_another_count_drops_the_optimizer_state_sized_for_the_old():
    """A load resizes a SparseLinear's values in place (same Parameter); Adam's moments,
    sized for the old count, are dropped at the next step instead of failing in Adam."""
    model = nn.Sequential(st.nn.SparseLinear(8, 6, density=0.5), nn.Linear(6, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = st.train.Static(model, opt, density=0.5, distribution="uniform")
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        trainer.step()
    model[0].load_state_dict(st.nn.SparseLinear(8, 6, density=0.25).state_dict())
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    trainer.step()
    assert opt.state[model[0].values]["exp_avg"].shape == model[0].values.shape == (12,)
    trainer.close()


@pytest.mark.parametrize("make_opt", [SGD, ADAM])
def test_truly_sparse_pruning_follows_masked_pruning(make_opt):
    """Each prune stores fewer entries; the kept weights' optimizer state must move with
    them, as in masked mode (it was dropped at every prune: momentum restarted, and the
    weights drifted 0.2 from masked mode's in 16 steps)."""
    dtype = torch.float64
    kw = dict(density=0.3, distribution="uniform", delta_t=2, total_steps=16)
    dense = masked_model(dtype)
    opt_d = make_opt(dense.parameters())
    tr_d = st.train.MagnitudePruning(dense, opt_d, **kw)
    sparse = sparse_copy(dense, tr_d.masks, dtype)
    opt_s = make_opt(sparse.parameters())
    tr_s = st.train.MagnitudePruning(sparse, opt_s, **kw)
    data = batches(16, dtype)
    for step in range(16):
        run(dense, opt_d, tr_d, data[step:step + 1])
        run(sparse, opt_s, tr_s, data[step:step + 1])
        for i in (0, 2, 4):
            torch.testing.assert_close(sparse[i].weight.to_dense(), dense[i].weight,
                                       rtol=1e-10, atol=1e-12)
    assert sparse[0].values.numel() < SIZES[0][0] * SIZES[0][1] // 2


def _captured_against_dense(layer, call, dense_call):
    """The gradient a RigL update would score (``grad_rows``) after ``call(layer)``'s
    backward, and the dense weight's gradient through ``dense_call(W)``."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    tr = st.train.RigL(layer, opt, density=layer.values.numel() / layer.weight.numel(),
                       distribution="uniform", delta_t=2, total_steps=8)
    assert tr.is_update_step()                            # t = 0: captures
    w = layer.weight.to_dense().detach().clone().requires_grad_()
    (call(layer) - 1).square().sum().backward()   # (nonzero where relu gives 0)
    (dense_call(w) - 1).square().sum().backward()
    return tr.layers["values"].grad_rows(0, w.shape[0]), w.grad


@pytest.mark.parametrize("activation", ["relu", "relu6", "sigmoid", "exp", "sqrt", "neg"])
def test_growth_scores_the_gradient_before_a_fused_activation(activation):
    """RigL's score is the weight's dense gradient; with the activation in the layer's
    kernel the output hook sees the gradient after it (relu: off by 8 where it is 19)."""
    torch.manual_seed(0)
    layer = st.nn.SparseLinear(6, 5, density=0.5, activation=activation).double()
    x = torch.randn(4, 6, dtype=torch.float64) * 4
    if activation == "sqrt":
        x = x.abs()
        with torch.no_grad():
            layer.values.abs_()
            layer.bias.abs_()
    act = {"relu": torch.relu, "relu6": nn.functional.relu6, "sigmoid": torch.sigmoid,
           "exp": torch.exp, "sqrt": torch.sqrt, "neg": torch.neg}[activation]
    got, want = _captured_against_dense(
        layer, lambda m: m(x), lambda w: act(nn.functional.linear(x, w, layer.bias.detach())))
    torch.testing.assert_close(got, want)


def test_a_fused_abs_is_refused_when_growth_needs_the_gradient():
    layer = st.nn.SparseLinear(6, 5, density=0.5, activation="abs")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    st.train.RigL(layer, opt, density=0.5, distribution="uniform", delta_t=2, total_steps=8)
    with pytest.raises(ValueError, match="activation=None"):
        layer(torch.randn(3, 6))


@pytest.mark.slow   # compiles the conv kernels
def test_growth_scores_a_sparse_conv_before_its_fused_relu6():
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, 1).double()
    layer = st.nn.SparseConv2d.from_dense(conv, sparsity=0.5, activation="relu6")
    x = torch.randn(2, 6, 3, 3, dtype=torch.float64) * 4
    got, want = _captured_against_dense(
        layer, lambda m: m(x),
        lambda w: nn.functional.relu6(nn.functional.conv2d(x, w[:, :, None, None],
                                                           layer.bias.detach())))
    torch.testing.assert_close(got, want)


def test_growth_scores_a_sparse_input_and_a_keyword_call():
    """A SparseTensor batch (kept sparse) and ``layer(x=...)``: the same dense gradient as
    a dense positional call; both crashed at the update step."""
    torch.manual_seed(0)
    layer = st.nn.SparseLinear(8, 4, density=0.5).double()
    x = torch.randn(5, 8, dtype=torch.float64) * (torch.rand(5, 8) < 0.3)
    xs = st.tensor(x, format="csr")
    dense = lambda w: nn.functional.linear(x, w, layer.bias.detach())   # noqa: E731
    got, want = _captured_against_dense(layer, lambda m: m(xs), dense)
    torch.testing.assert_close(got, want)
    layer = st.nn.SparseLinear(8, 4, density=0.5).double()
    got, want = _captured_against_dense(layer, lambda m: m(x=x), dense)
    torch.testing.assert_close(got, want)


def test_erk_gives_a_sparse_1x1_conv_the_density_of_the_same_masked_conv():
    """ERK counts a convolution's kernel sizes ((n_in + n_out + 1 + 1) / (n_in n_out) for
    1x1); SparseConv2d was counted as a Linear, so the two modes started apart."""
    torch.manual_seed(0)
    sizes = [(16, 16), (16, 32), (32, 8)]
    dense = nn.Sequential(*[nn.Conv2d(i, o, 1) for i, o in sizes])
    sparse = nn.Sequential(*[st.nn.SparseConv2d(i, o, density=0.5) for i, o in sizes])
    kw = dict(density=0.3, distribution="erk", dense=[])
    counts_d = st.train.Static(dense, torch.optim.SGD(dense.parameters(), lr=0.1), **kw).counts
    counts_s = st.train.Static(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1),
                               **kw).counts
    assert [counts_s[f"{i}.values"] for i in range(3)] == \
        [counts_d[f"{i}.weight"] for i in range(3)]


@pytest.mark.parametrize("algo,make_opt", [
    ("SNFS", SGD),
    ("Static", lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4))])
def test_a_closure_step_follows_masked_mode(algo, make_opt):
    """``step(closure)``: the optimizer runs the closure, so the gradient exists only then.
    SNFS's average took the previous step's gradient (none in sparse mode) and masked mode
    handed LBFGS the unmasked gradient: the two modes parted (LBFGS by 1.8)."""
    torch.manual_seed(1)
    lin = nn.Linear(6, 5).double()
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(5)) < 0.5
    w0 = lin.weight.detach() * mask
    sparse = st.nn.SparseLinear(6, 5, mask=mask, dtype=torch.float64)
    sparse.set_pattern(mask, w0)
    with torch.no_grad():
        sparse.bias.copy_(lin.bias)
    kw = dict(density=float(mask.sum()) / mask.numel(), distribution="uniform")
    if algo == "SNFS":
        kw.update(delta_t=4, total_steps=40)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 5, dtype=torch.float64)
    out = {}
    for name, model in (("masked", lin), ("sparse", sparse)):
        opt = make_opt(model.parameters())
        tr = getattr(st.train, algo)(model, opt, **kw)
        if name == "masked":   # (the mask above, and its weights)
            tr.layers["weight"].set_active(mask.flatten().nonzero().squeeze(1), opt)
            with torch.no_grad():
                lin.weight.copy_(w0)
        for s in range(6):
            def closure():
                opt.zero_grad()
                loss = (model(x * (1 + 0.1 * s)) - y).square().sum()
                loss.backward()
                return loss
            tr.step(closure)
        out[name] = (model.weight.to_dense() if name == "sparse" else model.weight).detach()
        if name == "masked":
            now = tr.masks["weight"]
            for t in opt.state[lin.weight].values():   # nothing outside the mask
                if isinstance(t, torch.Tensor) and t.shape == mask.shape:
                    assert not t[~now].any()
        if algo == "SNFS":
            out[name + " average"] = next(iter(tr.ema.values()))
    torch.testing.assert_close(out["masked"], out["sparse"], rtol=1e-10, atol=1e-12)
    if algo == "SNFS":
        torch.testing.assert_close(out["masked average"], out["sparse average"])


@pytest.mark.parametrize("truly_sparse", [True, False])
def test_grown_weights_start_with_a_new_parameters_optimizer_state(truly_sparse):
    """Rprop's step sizes start at the learning rate (at 0, Rprop clamped them to its
    minimum, 1e-6: a grown weight took ~50 steps to move as a new one does); Adam's moments
    at 0."""
    for make, key, fresh in ((lambda p: torch.optim.Rprop(p, lr=0.01), "step_size", 0.01),
                             (lambda p: torch.optim.Adam(p, lr=0.01), "exp_avg_sq", 0.0)):
        torch.manual_seed(0)
        model = st.nn.SparseLinear(20, 9, density=0.2) if truly_sparse else \
            nn.Sequential(nn.Linear(20, 9))
        opt = make(model.parameters())
        trainer = st.train.RigL(model, opt, density=0.2, delta_t=3, alpha=0.5, total_steps=8)
        layer = next(iter(trainer.layers.values()))
        x = torch.randn(5, 20)
        for _ in range(4):   # updates at t = 0 and 3, two optimizer steps between
            before = layer.mask().clone()
            opt.zero_grad()
            model(x).square().sum().backward()
            trainer.step()
        grown = layer.mask() & ~before
        assert grown.any()
        param = model.values if truly_sparse else model[0].weight
        state = opt.state[param][key]
        dense = model.weight.with_values(state).to_dense() if truly_sparse else state
        assert torch.all(dense[grown] == fresh)
        assert not torch.all(dense[before & layer.mask()] == fresh)   # (kept: their own)
        trainer.close()


def test_grown_state_of_a_channels_last_weight():
    """The grown entries' state was written through ``reshape(-1)``, a copy for a
    channels_last convolution's weight: their Rprop step sizes stayed at its minimum (a
    probe's finding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).to(
        memory_format=torch.channels_last)
    opt = torch.optim.Rprop(model.parameters(), lr=0.01)
    trainer = st.train.RigL(model, opt, density=0.3, distribution="uniform", dense=[],
                            delta_t=3, total_steps=20)
    for _ in range(10):   # updates at t = 0, 3, 6, 9
        before = trainer.masks["2.weight"].clone()
        opt.zero_grad()
        model(torch.randn(2, 4, 8, 8)).square().mean().backward()
        trainer.step()
    grown = trainer.masks["2.weight"] & ~before
    assert grown.any()
    assert torch.all(opt.state[model[2].weight]["step_size"][grown] == 0.01)
    assert not model[2].weight[~trainer.masks["2.weight"]].any()
    trainer.close()


def test_the_ddp_recipe_builds_the_trainers_count():
    """Under DDP a SparseLinear must store the trainer's count already: SparseLinear rounds
    a density's count where the trainer floors it, so building at the density
    layer_densities gives was one entry short about half the time (a probe's finding);
    ``density=kept_count(size, d) / size`` gives the count exactly."""
    shapes = {"0.values": (300, 784), "2.values": (100, 300), "4.values": (10, 100)}
    for name, d in st.train.layer_densities(shapes, 0.1, "erk").items():
        out_f, in_f = shapes[name]
        count = st.train.kept_count(out_f * in_f, d)
        layer = st.nn.SparseLinear(in_f, out_f, density=count / (out_f * in_f))
        assert layer.values.numel() == count
