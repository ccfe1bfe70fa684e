"""st.train checkpoints: a run stopped and resumed from ``save_checkpoint`` follows the
uninterrupted run bit for bit on CPU (weights, masks, optimizer state, generators, the global
RNG that dropout draws from)."""
import pytest
import torch
from torch import nn

import sparsetorch as st
from helpers import one_thread  # noqa: F401  (single-threaded: tiny tensors)


def make(algo, init_seed):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = getattr(st.train, algo)(model, opt, density=0.3, delta_t=3, total_steps=24,
                                      seed=5)
    return model, opt, trainer


def run(model, opt, trainer, steps):
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 + trainer.step_count)   # data by step
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        trainer.step()


@pytest.mark.parametrize("algo", ["RigL"] + [pytest.param(a, marks=pytest.mark.slow)
                                             for a in ("SET", "SNFS", "MagnitudePruning")])
def test_resume_follows_the_same_trajectory_bit_for_bit(algo, tmp_path):
    model, opt, trainer = make(algo, 0)
    torch.manual_seed(123)
    run(model, opt, trainer, 24)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    ref_masks = trainer.masks

    model, opt, trainer = make(algo, 0)
    torch.manual_seed(123)
    run(model, opt, trainer, 10)
    path = st.train.save_checkpoint(tmp_path / "ckpt.pt", model=model, trainer=trainer, note=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]   # no temp file left
    torch.manual_seed(999)                       # the global RNG must come from the file
    model2, opt2, trainer2 = make(algo, 7)       # another init: everything must be loaded
    assert st.train.load_checkpoint(path, model=model2, trainer=trainer2) == {"note": 1}
    assert trainer2.step_count == 10
    run(model2, opt2, trainer2, 14)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k
    for n, m in trainer2.masks.items():
        assert torch.equal(m, ref_masks[n])


def test_load_checkpoint_errors(tmp_path):
    model, opt, trainer = make("RigL", 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        st.train.load_checkpoint(tmp_path / "missing.pt", model=model, trainer=trainer)
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not written"):
        st.train.load_checkpoint(tmp_path / "other.pt", model=model, trainer=trainer)
    torch.save(5, tmp_path / "five.pt")
    with pytest.raises(ValueError, match="not written"):
        st.train.load_checkpoint(tmp_path / "five.pt", model=model, trainer=trainer)
    run(model, opt, trainer, 4)
    good = st.train.save_checkpoint(tmp_path / "good.pt", model=model, trainer=trainer)
    for name, data in [("empty", b""), ("junk", b"garbage"), ("cut", good.read_bytes()[:200])]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match="not a readable checkpoint"):
            st.train.load_checkpoint(tmp_path / name, model=model, trainer=trainer)


def test_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    """All or nothing (found by a fuzzer: the trainer's step, masks and optimizer state were
    loaded, then the model's mismatched weights raised)."""
    model, opt, trainer = make("RigL", 0)
    run(model, opt, trainer, 4)
    path = st.train.save_checkpoint(tmp_path / "c.pt", model=model, trainer=trainer)
    torch.manual_seed(1)
    # the same parameters (the trainer's state fits and loads), a buffer the file lacks (the
    # model's fails)
    other = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 4))
    other.register_buffer("extra", torch.zeros(1))
    opt2 = torch.optim.Adam(other.parameters(), lr=1e-2)
    trainer2 = st.train.RigL(other, opt2, density=0.3, delta_t=3, total_steps=24, seed=5)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    masks = {n: m.clone() for n, m in trainer2.masks.items()}
    with pytest.raises(RuntimeError, match="Missing key"):
        st.train.load_checkpoint(path, model=other, trainer=trainer2)
    assert all(torch.equal(v, weights[k]) for k, v in other.state_dict().items())
    assert all(torch.equal(m, masks[n]) for n, m in trainer2.masks.items())
    assert trainer2.step_count == 0 and not opt2.state


@pytest.mark.parametrize("change", ["density", "optimizer", "width"])
def test_a_trainer_of_another_configuration_is_refused_before_anything_loads(tmp_path,
                                                                               change):
    """Other kept counts (another density, or a layer of another size) or another optimizer
    class: a clear ValueError, nothing loaded (an SGD given Adam's state failed on its next
    step with KeyError 'momentum'; other densities left the trainer's targets inconsistent
    with the loaded masks)."""
    model, opt, trainer = make("RigL", 0)
    run(model, opt, trainer, 4)
    path = st.train.save_checkpoint(tmp_path / "c.pt", model=model, trainer=trainer)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(24, 5 if change == "width" else 4))
    opt2 = torch.optim.SGD(other.parameters(), lr=1e-2, momentum=0.9) \
        if change == "optimizer" else torch.optim.Adam(other.parameters(), lr=1e-2)
    trainer2 = st.train.RigL(other, opt2, density=0.5 if change == "density" else 0.3,
                             delta_t=3, total_steps=24, seed=5)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    masks = {n: m.clone() for n, m in trainer2.masks.items()}
    match = "SGD" if change == "optimizer" else "other weight counts"
    with pytest.raises(ValueError, match=match):
        st.train.load_checkpoint(path, model=other, trainer=trainer2)
    assert all(torch.equal(v, weights[k]) for k, v in other.state_dict().items())
    assert all(torch.equal(m, masks[n]) for n, m in trainer2.masks.items())
    assert trainer2.step_count == 0 and not opt2.state
    with pytest.raises(TypeError, match="state must be the dict"):
        trainer2.load_state_dict(None)


def test_model_then_trainer_load_order_resumes_truly_sparse_bit_for_bit():
    """Pruning changes each SparseLinear's entry count, so model.load_state_dict into a fresh
    model replaces its values Parameter; loading the trainer afterwards must hand the
    optimizer the new ones (with their Adam state)."""
    import io

    def make_sparse(init_seed):
        torch.manual_seed(init_seed)
        model = nn.Sequential(st.nn.SparseLinear(10, 16, density=0.3), nn.ReLU(),
                              st.nn.SparseLinear(16, 4, density=0.3))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt, st.train.MagnitudePruning(model, opt, density=0.3, delta_t=3,
                                                     total_steps=16, seed=5)

    model, opt, trainer = make_sparse(0)
    run(model, opt, trainer, 16)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, trainer = make_sparse(0)
    run(model, opt, trainer, 7)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model2, opt2, trainer2 = make_sparse(7)
    model2.load_state_dict(saved["model"])
    trainer2.load_state_dict(saved["trainer"])
    assert model2[0].values.numel() < 160                  # pruned: a new Parameter
    run(model2, opt2, trainer2, 9)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k
    # the model alone (no trainer state): the optimizer trains the loaded values, afresh
    model3, opt3, trainer3 = make_sparse(7)
    model3.load_state_dict(saved["model"])
    run(model3, opt3, trainer3, 1)
    held = {id(p) for g in opt3.param_groups for p in g["params"]}
    assert id(model3[0].values) in held and id(model3[2].values) in held
    assert opt3.state[model3[0].values]["exp_avg"].shape == model3[0].values.shape
