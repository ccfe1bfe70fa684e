"""st.train in masked mode: densities against the ERK/ER formula, exact counts, zeroed
optimizer state for grown weights, drop/grow disjointness, each algorithm's growth rule on a
hand-built case, and clear errors."""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import sparsetorch as st
from helpers import one_thread  # noqa: F401  (single-threaded: tiny tensors)
from sparsetorch.train import layer_densities, kept_count


def mlp():
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def convnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def shapes_of(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() > 1}


def raw_probability(shape, distribution):
    if distribution == "erk":
        return sum(shape) / math.prod(shape)
    return (shape[0] + shape[1]) / (shape[0] * shape[1])


@pytest.mark.parametrize("distribution", ["erk", "er"])
@pytest.mark.parametrize("shapes", [
    shapes_of(mlp()), shapes_of(convnet()),
    {"fc1": (300, 784), "fc2": (100, 300), "fc3": (10, 100)},   # LeNet-300-100
    {"a": (64, 64, 3, 3), "b": (128, 64, 1, 1), "c": (10, 128), "d": (4, 2)},
])
@pytest.mark.parametrize("density", [0.02, 0.1, 0.5])
def test_erdos_renyi_densities_follow_the_formula(shapes, distribution, density):
    d = layer_densities(shapes, density, distribution)
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    # the kept budget equals the uniform one (up to the per-layer floor of the official count)
    want = sum(kept_count(s, density) for s in sizes.values())
    got = sum(d[n] * sizes[n] for n in shapes)
    assert abs(got - want) < 1e-6 * want + 1e-9
    sparse = [n for n in shapes if d[n] < 1]
    dense = [n for n in shapes if d[n] == 1]
    # sparse layers: density = eps * raw probability, one eps for all
    eps = {d[n] / raw_probability(shapes[n], distribution) for n in sparse}
    assert max(eps) - min(eps) <= 1e-9 * max(eps)
    # a layer made dense has a raw probability at least every sparse layer's (it would
    # have exceeded 1 first), and every sparse layer's density is below 1
    for n in dense:
        assert all(raw_probability(shapes[n], distribution) >=
                   raw_probability(shapes[m], distribution) for m in sparse)
    assert all(0 < d[n] < 1 for n in sparse)


def test_uniform_and_custom_densities():
    shapes = {"a": (10, 10), "b": (20, 10), "c": (5, 5)}
    assert layer_densities(shapes, 0.3, "uniform") == {"a": 0.3, "b": 0.3, "c": 0.3}
    d = layer_densities(shapes, 0.3, "erk", custom={"c": 1.0})
    assert d["c"] == 1.0
    assert layer_densities({"a": (3, 4)}, 1.0, "erk") == {"a": 1.0}


@pytest.mark.parametrize("power", [0.0, 0.5, 3.0, 1000.0])
def test_erk_power_scale_keeps_the_budget(power):
    """Any finite power >= 0 spends the uniform budget (found by the fuzzer: from about
    100, every p_l ** power underflowed to 0 and every layer came out dense); 0 is
    uniform, and a larger power moves density towards the layers ERK favours."""
    shapes = {"fc1": (300, 784), "fc2": (100, 300), "fc3": (10, 100)}
    d = layer_densities(shapes, 0.1, "erk", erk_power_scale=power)
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    want = sum(kept_count(s, 0.1) for s in sizes.values())
    assert abs(sum(d[n] * sizes[n] for n in shapes) - want) < 1e-6 * want
    assert d["fc1"] <= d["fc2"] <= d["fc3"] <= 1
    if power == 0:
        assert all(abs(v - 0.1) < 1e-12 for v in d.values())


@pytest.mark.parametrize("bad,exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                     (-1.0, ValueError), ("1", TypeError)])
def test_bad_erk_power_scale_is_refused(bad, exc):
    """(NaN looped forever: no layer's raw probability ever equals a NaN maximum.)"""
    with pytest.raises(exc, match="erk_power_scale"):
        layer_densities({"a": (30, 20), "b": (10, 30)}, 0.1, erk_power_scale=bad)
    with pytest.raises(ValueError, match="no weights"):
        layer_densities({"a": (4, 0), "b": (3, 3)}, 0.5)


def train(model, trainer, opt, steps, seed=0, batch=6):
    g = torch.Generator().manual_seed(seed)
    n_in = next(model.parameters()).shape[1]
    for _ in range(steps):
        x = torch.randn(batch, n_in, generator=g)
        y = torch.randint(0, 3, (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        trainer.step()


@pytest.mark.parametrize("algo", ["RigL", "SET", "SNFS"])
@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.Adam(p, lr=1e-2)])
def test_exact_counts_and_zeros_after_many_steps(algo, make_opt):
    torch.manual_seed(0)
    model = mlp()
    opt = make_opt(model.parameters())
    trainer = getattr(st.train, algo)(model, opt, density=0.2, delta_t=3, total_steps=40)
    counts = dict(trainer.counts)
    changed = 0
    for _ in range(40):
        before = {n: m.clone() for n, m in trainer.masks.items()}
        train(model, trainer, opt, 1, seed=trainer.step_count)
        params = dict(model.named_parameters())
        for n, m in trainer.masks.items():
            assert int(m.sum()) == counts[n]
            assert bool((params[n][~m] == 0).all())
            for t in opt.state[params[n]].values():
                if isinstance(t, torch.Tensor) and t.shape == m.shape:
                    assert bool((t[~m] == 0).all())
            changed += int((m != before[n]).sum())
    assert changed > 0


def hand_built(algo, opt_kind="sgd", **kw):
    """A 4x4 layer at density 1/2 with known weights on a known mask (the trainer's mask
    after its begin-step update t=0, then weights set on it); t=1 is an ordinary step, t=2
    the next update."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_kind == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.1))
    trainer = getattr(st.train, algo)(model, opt, density=0.5, distribution="uniform",
                                      delta_t=2, total_steps=100, **kw)
    step_with_grad(model, trainer, torch.zeros(4, 4))   # t=0 updates (the official begin step)
    mask = trainer.masks["weight"]
    with torch.no_grad():
        model.weight.copy_(torch.arange(1.0, 17.0).view(4, 4) * mask)
    return model, opt, trainer, mask


def step_with_grad(model, trainer, grad):
    model.weight.grad = grad.clone()
    trainer.step()


def test_rigl_drops_smallest_grows_largest_gradient_and_zeroes_state():
    model, opt, trainer, mask = hand_built("RigL", alpha=0.5)
    # one ordinary step (t=1) builds momentum on the active weights
    step_with_grad(model, trainer, torch.ones(4, 4))
    w0 = model.weight.detach().clone()
    mom0 = opt.state[model.weight]["momentum_buffer"].clone()
    assert bool((mom0[mask] != 0).all())
    grad = torch.zeros(4, 4)
    inactive = (~mask).nonzero()
    big = [tuple(inactive[i].tolist()) for i in (1, 3)]
    for r, c in big:
        grad[r, c] = 100.0 + r
    k = int(8 * st.train.cosine_drop_fraction(2, 0.5, 75))
    assert k == 3   # int(8 * 0.4991...)
    grad[tuple(inactive[0].tolist())] = 50.0
    step_with_grad(model, trainer, grad)   # t=2: update step, no optimizer step
    new = trainer.masks["weight"]
    order = torch.argsort(w0[mask].abs())
    dropped = mask.nonzero()[order[:k]]
    for r, c in dropped.tolist():
        assert not new[r, c]
    for r, c in big + [tuple(inactive[0].tolist())]:
        assert new[r, c]
    assert int(new.sum()) == 8
    grown = new & ~mask
    kept = new & mask
    assert bool((model.weight[grown] == 0).all())
    assert bool((opt.state[model.weight]["momentum_buffer"][grown] == 0).all())
    # kept weights and state untouched (no optimizer step on an update iteration)
    assert torch.equal(model.weight[kept], w0[kept])
    assert torch.equal(opt.state[model.weight]["momentum_buffer"][kept], mom0[kept])
    assert trainer.last_update["weight"] == (3, 3)


def test_adam_moments_of_grown_weights_are_zero():
    model, opt, trainer, mask = hand_built("RigL", opt_kind="adam", alpha=0.5)
    step_with_grad(model, trainer, torch.full((4, 4), 0.3))
    grad = torch.rand(4, 4, generator=torch.Generator().manual_seed(1)) * ~mask
    step_with_grad(model, trainer, grad)
    grown = trainer.masks["weight"] & ~mask
    assert int(grown.sum()) == 3
    state = opt.state[model.weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert bool((state[key][grown] == 0).all())
        assert bool((state[key][mask & trainer.masks["weight"]] != 0).all())


def test_a_dropped_weight_grown_again_keeps_its_value_and_state():
    model, opt, trainer, mask = hand_built("RigL", alpha=0.5)
    step_with_grad(model, trainer, torch.ones(4, 4))
    w = model.weight.detach().clone()
    mom = opt.state[model.weight]["momentum_buffer"].clone()
    smallest = mask.nonzero()[torch.argmin(w[mask].abs())].tolist()
    grad = torch.zeros(4, 4)
    grad[tuple(smallest)] = 1e3          # dropped (smallest |w|) but the largest gradient
    step_with_grad(model, trainer, grad)
    r, c = smallest
    assert trainer.masks["weight"][r, c]
    assert model.weight[r, c] == w[r, c] and model.weight[r, c] != 0
    assert opt.state[model.weight]["momentum_buffer"][r, c] == mom[r, c]
    assert trainer.last_update["weight"] == (2, 2)


def test_drop_and_grow_sets_are_disjoint_over_many_updates():
    torch.manual_seed(1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.train.RigL(model, opt, density=0.3, delta_t=1, alpha=0.5, total_steps=30)
    for _ in range(12):
        before = trainer.masks
        train(model, trainer, opt, 1, seed=trainer.step_count)
        for n, m in trainer.masks.items():
            dropped, grown = before[n] & ~m, m & ~before[n]
            assert not bool((dropped & grown).any())
            assert int(dropped.sum()) == int(grown.sum())


def test_set_grows_at_random_among_inactive_and_by_seed():
    masks = []
    for seed in (0, 0, 1):
        model, opt, trainer, mask = hand_built("SET", alpha=0.5, seed=seed)
        step_with_grad(model, trainer, torch.zeros(4, 4))
        grad = torch.zeros(4, 4)
        grad[~mask] = torch.arange(8.0)   # SET must ignore gradients
        step_with_grad(model, trainer, grad)
        masks.append((mask, trainer.masks["weight"]))
    (m0, a), (_, b), (m1, c) = masks
    assert torch.equal(a, b)
    assert int(a.sum()) == 8 and int((a & ~m0).sum()) >= 1
    # growth does not follow the gradient ranking: many seeds give different grown sets
    grown_sets = set()
    for seed in range(6):
        model, opt, trainer, mask = hand_built("SET", alpha=0.5, seed=seed)
        step_with_grad(model, trainer, torch.zeros(4, 4))
        step_with_grad(model, trainer, torch.zeros(4, 4))
        grown_sets.add(tuple((trainer.masks["weight"] & ~mask).flatten().tolist()))
    assert len(grown_sets) > 1


def test_snfs_grows_by_gradient_momentum_not_the_last_gradient():
    model, opt, trainer, mask = hand_built("SNFS", alpha=0.5, momentum=0.9)
    inactive = [tuple(x) for x in (~mask).nonzero().tolist()]
    steady, burst = inactive[:3], inactive[3:6]
    g = torch.zeros(4, 4)
    for rc in steady:
        g[rc] = 1.0
    step_with_grad(model, trainer, g)       # t=1: the average learns `steady`
    g2 = torch.zeros(4, 4)
    for rc in burst:
        g2[rc] = 0.5                         # larger now than steady's 0, smaller on average
    step_with_grad(model, trainer, g2)      # t=2: update
    new = trainer.masks["weight"]
    assert all(new[rc] for rc in steady)
    assert not any(new[rc] for rc in burst)
    # RigL on the same gradients grows `burst` (the last gradient)
    model, opt, trainer, mask = hand_built("RigL", alpha=0.5)
    step_with_grad(model, trainer, g)
    step_with_grad(model, trainer, g2)
    assert all(trainer.masks["weight"][rc] for rc in burst)


def test_static_never_changes_and_pruning_follows_the_cubic_schedule():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static = st.train.Static(model, opt, density=0.3)
    m0 = static.masks
    train(model, static, opt, 5)
    assert all(torch.equal(m0[n], m) for n, m in static.masks.items())

    model = nn.Linear(10, 10, bias=False)
    original = torch.randperm(100, generator=torch.Generator().manual_seed(0)).view(10, 10) + 1.
    with torch.no_grad():
        model.weight.copy_(original)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gmp = st.train.MagnitudePruning(model, opt, density=0.1, distribution="uniform",
                                    delta_t=2, t_begin=2, t_end=10)
    for t in range(12):
        model.weight.grad = torch.zeros(10, 10)
        gmp.step()
        if gmp.is_update_step(t):
            s = st.train.cubic_sparsity(t, 0.9, 2, 10)
            assert gmp.nnz()["weight"] == kept_count(100, 1 - s)
        m = gmp.masks["weight"]
        assert torch.equal(model.weight, original * m)      # lr=0: pruning alone acts
        if (~m).any():                                       # it kept the largest weights
            assert original[m].min() > original[~m].max()
    assert gmp.nnz()["weight"] == 10


def test_first_conv_dense_by_default_and_overrides():
    model = convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = st.train.RigL(model, opt, density=0.1, total_steps=10)
    assert sorted(t.masks) == ["2.weight", "5.weight"]
    t = st.train.RigL(model, opt, density=0.1, total_steps=10, dense=[])
    assert sorted(t.masks) == ["0.weight", "2.weight", "5.weight"]
    t = st.train.RigL(model, opt, density=0.1, total_steps=10, dense=["5"],
                      layer_density={"0.weight": 0.5})
    assert sorted(t.masks) == ["0.weight", "2.weight"] and t.densities["0.weight"] == 0.5


def test_bad_arguments_give_clear_errors():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="total_steps"):
        st.train.RigL(model, opt)
    with pytest.raises(ValueError, match="density"):
        st.train.RigL(model, opt, density=0.0, total_steps=10)
    with pytest.raises(ValueError, match="distribution"):
        st.train.RigL(model, opt, distribution="erdos", total_steps=10)
    with pytest.raises(ValueError, match="grow_init"):
        st.train.RigL(model, opt, grow_init="random", total_steps=10)
    with pytest.raises(ValueError, match="dense="):
        st.train.RigL(model, opt, dense=["nope"], total_steps=10)
    with pytest.raises(ValueError, match="layer_density"):
        st.train.RigL(model, opt, layer_density={"x": 0.1}, total_steps=10)
    with pytest.raises(ValueError, match="delta_t"):
        st.train.RigL(model, opt, delta_t=0, total_steps=10)
    for kw, exc, said in (
            (dict(delta_t=1.5), TypeError, r"delta_t=1.5 must be an int"),
            (dict(delta_t="10"), TypeError, r"delta_t='10' must be an int"),
            (dict(t_end="x"), TypeError, r"t_end='x' must be an int"),
            (dict(total_steps=2.5), TypeError, r"total_steps=2.5 must be an int"),
            (dict(total_steps=0), ValueError, r"total_steps=0 must be an int >= 1"),
            (dict(seed="s"), TypeError, r"seed='s' must be an int"),
            (dict(alpha="a"), TypeError, r"alpha='a' must be a number \(the initial fraction"),
            (dict(alpha=1.5), ValueError, r"alpha=1.5 must be in \[0.0, 1.0\]"),
            (dict(noise_std=-1.0), ValueError, r"noise_std=-1.0 must be in"),
            (dict(noise_std=float("inf")), ValueError, r"noise_std=inf must be in"),
            (dict(seed=2 ** 64), ValueError, r"seed=18446744073709551616 must fit in 64 bits"),
            (dict(layer_density=[0.5]), TypeError, r"layer_density must be a dict")):
        with pytest.raises(exc, match=said):
            st.train.RigL(model, opt, **{"total_steps": 10, **kw})
    with pytest.raises(ValueError, match="optimizer does not hold"):
        st.train.RigL(model, torch.optim.SGD(mlp().parameters(), lr=0.1), total_steps=10)
    with pytest.raises(TypeError, match="optimizer"):
        st.train.RigL(model, None, total_steps=10)
    with pytest.raises(ValueError, match="no Linear"):
        st.train.RigL(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.ones(1))]), total_steps=9)
    with pytest.raises(ValueError, match="fixed mask"):
        st.train.Static(model, opt, delta_t=5)
    for begin, exc in ((float("nan"), TypeError), (1.7, TypeError), ("3", TypeError),
                       (-5, ValueError)):   # (int()ed: 1.7 ran as 1, NaN gave int()'s error)
        with pytest.raises(exc, match=f"MagnitudePruning: t_begin={begin!r} must be an int"):
            st.train.MagnitudePruning(model, opt, total_steps=10, t_begin=begin)
    t = st.train.Static(model, opt, density=0.5)
    with pytest.raises(ValueError, match="saved by"):
        t.load_state_dict(st.train.SET(model, opt, total_steps=5).state_dict())


def test_numpy_numbers_are_numbers():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.train.RigL(model, opt, density=np.float32(0.5), alpha=np.float64(0.3),
                            delta_t=np.int64(2), total_steps=10)
    assert trainer.densities
    trainer.close()


def test_snfs_momentum_must_be_a_number():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"SNFS: momentum='0.9' must be a number in \[0, 1\)"):
        st.train.SNFS(model, opt, total_steps=10, momentum="0.9")


def test_a_refused_trainer_leaves_no_hook_on_the_model():
    """Constructors that raise leave the user's SparseLinear as it was: its forward hook
    (which keeps inputs for growth scores) used to stay behind, holding tensors."""
    model = nn.Sequential(st.nn.SparseLinear(8, 6, density=0.5), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw in (dict(erk_power_scale=-1), dict(density=2.0), dict(layer_density={"x": 0.1}),
               dict(dense=["9"]), dict(dense=5)):
        with pytest.raises((ValueError, TypeError)):
            st.train.RigL(model, opt, **{"density": 0.3, "total_steps": 10, **kw})
        assert not model[0]._forward_hooks, kw
    trainer = st.train.RigL(model, opt, density=0.3, total_steps=10)
    assert len(model[0]._forward_hooks) == 1
    trainer.close()


@pytest.mark.parametrize("algo", ["RigL", "SET", "SNFS"])
def test_a_one_step_run_steps(algo):
    """total_steps=1 gives t_end = 0: the drop fraction divided by it (ZeroDivisionError)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = getattr(st.train, algo)(model, opt, density=0.5, total_steps=1)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    trainer.step()
    assert trainer.step_count == 1


def test_kept_count_is_exact_for_large_layers():
    # (1 - 0.33) * 1e8 is 66999999.99999999 in floats: an absolute 1e-9 misses it
    assert kept_count(10 ** 8, 0.33) == 33_000_000
    assert kept_count(10 ** 9, 0.458) == 458_000_000
    assert kept_count(50, 0.25) == 13                        # floor rule: 50 - floor(37.5)


def test_update_steps_include_the_begin_step_as_the_official_code():
    model = nn.Linear(6, 6)
    rigl = st.train.RigL(model, torch.optim.SGD(model.parameters(), lr=0.1), delta_t=10,
                         total_steps=40)
    assert [t for t in range(40) if rigl.is_update_step(t)] == [0, 10, 20, 30]
    gmp = st.train.MagnitudePruning(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    delta_t=10, t_begin=5, t_end=28)
    assert [t for t in range(40) if gmp.is_update_step(t)] == [5, 15, 25, 28]


def test_pruning_reaches_its_final_count_when_t_end_is_off_the_grid():
    """total_steps=100, delta_t=10: t_end=75 is not on the 10-step grid; the last prune at
    t_end still reaches exactly the final count."""
    model = nn.Linear(10, 10, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gmp = st.train.MagnitudePruning(model, opt, density=0.1, distribution="uniform",
                                    delta_t=10, total_steps=100)
    assert gmp.t_end == 75
    for _ in range(100):
        model.weight.grad = torch.zeros(10, 10)
        gmp.step()
    assert gmp.nnz()["weight"] == 10


def test_step_calls_the_closure_on_update_steps_too():
    torch.manual_seed(0)
    model = nn.Linear(6, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rigl = st.train.RigL(model, opt, density=0.5, distribution="uniform", delta_t=2,
                         total_steps=8)
    x, calls = torch.randn(4, 6), []

    def closure():
        calls.append(rigl.step_count)
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    for t in range(4):
        before = rigl.masks["weight"]
        loss = rigl.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad is True
        if rigl.is_update_step(t):                           # t=0, 2: grown by its gradient
            assert rigl.last_update["weight"][1] > 0
            assert not torch.equal(before, rigl.masks["weight"])
    assert calls == [0, 1, 2, 3]


def test_an_update_step_without_a_gradient_changes_nothing():
    """Every layer's gradient is checked before any mask or weight changes (found by the
    fuzzer: the first layer was already dropped and grown when the second raised, and the
    step count stayed, so a retry updated it twice)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = st.train.RigL(model, opt, density=0.3, delta_t=1, total_steps=10)
    model(torch.randn(4, 12)).sum().backward()
    model[2].weight.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    active = {n: a.clone() for n, a in trainer.state_dict()["active"].items()}
    with pytest.raises(RuntimeError, match="2.weight has no gradient"):
        trainer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(active[n], a) for n, a in trainer.state_dict()["active"].items())
    assert trainer.step_count == 0 and not opt.state


@pytest.mark.parametrize("algo", ["RigL", "SET", "Static", "MagnitudePruning"])
def test_a_weight_shared_by_two_modules_is_one_layer(algo):
    """(Found by a probe: each module got its own mask and the shared weight kept only their
    intersection, 71 of 256 entries where 128 were reported.)"""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.head(self.b(self.a(x)))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = {} if algo == "Static" else dict(delta_t=1, total_steps=8)
    trainer = getattr(st.train, algo)(model, opt, density=0.5, distribution="uniform",
                                      **schedule)
    assert sorted(trainer.masks) == ["a.weight", "head.weight"]
    for _ in range(8):
        opt.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        trainer.step()
    mask, weight = trainer.masks["a.weight"], model.a.weight
    assert trainer.nnz()["a.weight"] == 128 and not weight[~mask].any()
    if algo in ("Static", "MagnitudePruning"):   # (RigL and SET grow zeros)
        assert torch.equal(weight != 0, mask)
    # the other module's names name the same layer
    for name in ("b", "b.weight"):
        t = st.train.RigL(model, opt, total_steps=8, layer_density={name: 0.25},
                          distribution="uniform")
        assert t.densities["a.weight"] == 0.25
    t = st.train.RigL(model, opt, total_steps=8, dense=["b"])
    assert sorted(t.masks) == ["head.weight"]


@pytest.mark.parametrize("algo", ["RigL", "SET", "SNFS", "Static", "MagnitudePruning"])
def test_frozen_weights_are_left_alone(algo):
    """A weight with requires_grad=False is not trained, so it is not sparsified either (a
    probe found SET, Static and pruning masking a frozen pretrained layer, and RigL asking
    for a backward the user had run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8),
                          nn.ReLU(), nn.Linear(8, 3))
    model[3].weight.requires_grad_(False)
    frozen = model[3].weight.clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    schedule = {} if algo == "Static" else dict(delta_t=1, total_steps=6)
    trainer = getattr(st.train, algo)(model, opt, density=0.3, **schedule)
    # (the first conv stays dense by default, as before: the frozen layer takes nothing)
    assert sorted(trainer.masks) == ["5.weight"]
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(2, 3, 6, 6)).square().sum().backward()
        trainer.step()
    assert torch.equal(model[3].weight, frozen)
    st.train.RigL(model, opt, total_steps=6, dense=["3"]).close()   # (may be named)
    with pytest.raises(ValueError, match=r"frozen \(requires_grad=False\): \['3'\]"):
        st.train.RigL(model, opt, total_steps=6, dense=["0", "5"])
    with pytest.raises(ValueError, match="not a sparse layer"):
        st.train.RigL(model, opt, total_steps=6, layer_density={"3": 0.5})


def test_a_damaged_active_set_is_refused_before_anything_loads():
    """A saved active set of another count, out of range, unsorted or negative: loaded
    silently with the wrong count, or failed in torch (IndexError, bincount's
    RuntimeError), a probe's finding; now a ValueError naming the layer, the trainer as
    it was."""
    for model in (mlp(), nn.Sequential(st.nn.SparseLinear(8, 8, density=0.5))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = st.train.Static(model, opt, density=0.5)
        state = t.state_dict()
        before = {n: a.clone() for n, a in state["active"].items()}
        name, active = next(iter(state["active"].items()))
        for bad, said in ((active[:-1], "holds .* weights where this trainer keeps"),
                          (active.flip(0), "not increasing positions"),
                          (torch.cat([active[:-1], active.new_tensor([10 ** 6])]),
                           "not increasing positions"),
                          (torch.cat([active.new_tensor([-1]), active[1:]]),
                           "not increasing positions"),
                          (active.float(), "not a 1-D tensor of integer positions")):
            with pytest.raises(ValueError, match=f"active set of layer '{name}' (is )?" + said):
                t.load_state_dict({**state, "active": {**state["active"], name: bad}})
            assert all(torch.equal(t.state_dict()["active"][n], a) for n, a in before.items())


def test_another_optimizer_group_layout_is_refused_before_anything_loads():
    """Parameter groups of other sizes (biases apart from weight decay) failed in the
    optimizer's load after the masks were applied: trained weights zeroed, the step count
    replaced (a probe's finding)."""
    torch.manual_seed(0)
    model = mlp()
    saved = st.train.RigL(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          density=0.3, total_steps=20).state_dict()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD([{"params": weights}, {"params": biases, "weight_decay": 0.0}],
                          lr=0.1)
    t = st.train.RigL(model, opt, density=0.3, total_steps=20, seed=1)
    model(torch.randn(4, 12)).square().sum().backward()
    opt.step()
    before = copy.deepcopy((model.state_dict(), t.state_dict()["active"], t.step_count))
    with pytest.raises(ValueError, match=r"parameter groups of \[\d+\] parameters, this "
                                         r"trainer's of \[\d+, \d+\]"):
        t.load_state_dict(saved)
    after = (model.state_dict(), t.state_dict()["active"], t.step_count)
    assert all(torch.equal(before[0][k], v) for k, v in after[0].items())
    assert all(torch.equal(before[1][k], v) for k, v in after[1].items())
    assert before[2] == after[2]


def test_pruning_loads_an_active_set_between_dense_and_its_final_count():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = st.train.MagnitudePruning(model, opt, density=0.2, total_steps=40, delta_t=1)
    state = t.state_dict()   # (dense: nothing pruned yet)
    t.load_state_dict(state)
    assert t.nnz() == {n: layer.size for n, layer in t.layers.items()}


def test_a_nan_gradient_leaves_the_weights_outside_the_mask_zero():
    """Masks were applied by multiplying: NaN x 0 is NaN, so a NaN gradient made the
    weights outside the mask NaN, where they are documented to be exactly zero (a probe's
    finding)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    t = st.train.Static(lin, opt, density=0.5, distribution="uniform")
    x = torch.randn(2, 4)
    x[0] = float("nan")
    lin(x).sum().backward()
    t.step()
    outside = ~t.masks["weight"]
    assert torch.equal(lin.weight[outside], torch.zeros(int(outside.sum())))
    assert torch.isnan(lin.weight[~outside]).all()   # (inside: NaN, as in a dense layer)


def test_rigl_grows_a_sparse_linear_that_stores_no_entries():
    """A SparseLinear of an all-zero mask: an IndexError gathering its (empty) values for
    the weights grown to its count (a probe's finding)."""
    model = nn.Sequential(st.nn.SparseLinear(8, 6, mask=torch.zeros(6, 8, dtype=torch.bool)))
    t = st.train.RigL(model, torch.optim.SGD(model.parameters(), lr=0.1), density=0.3,
                      total_steps=8)
    assert t.nnz() == t.counts and model[0].values.count_nonzero() == 0


def test_a_parametrized_weight_is_refused_unless_kept_dense():
    """weight_norm's computed weight: the trainer said the optimizer did not hold it, when
    the optimizer was built from model.parameters() (a probe's finding)."""
    from torch.nn.utils.parametrizations import weight_norm
    model = nn.Sequential(weight_norm(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"layer '0' computes its weight .*\(dense=\['0'\]\)"):
        st.train.RigL(model, opt, density=0.3, total_steps=10)
    trainer = st.train.RigL(model, opt, density=0.3, total_steps=10, dense=["0"])
    assert list(trainer.layers) == ["2.weight"]
