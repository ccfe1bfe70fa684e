"""st.train under DistributedDataParallel: 2 processes (gloo, 127.0.0.1), different data and
different seeds per rank; after several mask updates every rank holds the same masks and
weights (dense gradients averaged before scoring, rank 0's seed for every random draw), in
masked mode and truly sparse (SparseLinear, whose dense gradient is built from each rank's
activations and all-reduced block by block). The ranks meet through a file store in the
test's tmp_path (no TCP port to race for)."""
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import sparsetorch as st


def _init(store_file, rank, world):
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)


def _worker(rank, world, algo, out_dir):
    torch.set_num_threads(1)
    _init(os.path.join(out_dir, "store"), rank, world)
    try:
        _train(rank, algo, out_dir)
        gc.collect()     # (what of the DDP wrapper only a reference cycle still holds)
        dist.barrier()   # (one rank tearing down while the other still talks can hang)
    finally:
        dist.destroy_process_group()


def _train(rank, algo, out_dir):
    """Trains and saves; returning drops the DDP wrapper, whose reducer holds the process
    group, before ``_worker`` destroys the group: freed after it, gloo's destructor hung
    joining its thread (pytorch/pytorch#75097's kind)."""
    torch.manual_seed(0)
    if algo == "RigL-sparse":   # truly sparse: the streamed dense gradient is all-reduced
        algo = "RigL"
        model = nn.Sequential(st.nn.SparseLinear(12, 32, density=0.25), nn.ReLU(),
                              st.nn.SparseLinear(32, 5, density=0.25))
    else:
        model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    trainer = getattr(st.train, algo)(ddp, opt, density=0.25, delta_t=2, alpha=0.5,
                                      total_steps=12, seed=rank,   # rank 0's seed wins
                                      distribution="uniform")     # the layers' counts
    g = torch.Generator().manual_seed(100 + rank)                  # each rank its data
    for _ in range(12):
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        trainer.step()
    torch.save({"masks": trainer.masks, "weights": model.state_dict(),
                "changed": trainer.last_update}, os.path.join(out_dir, f"{rank}.pt"))


def _run_ranks(worker, args, world=2, timeout=300.0):
    """``worker(rank, *args)`` in ``world`` forked processes; fails (the processes killed)
    after ``timeout`` seconds instead of hanging the test run."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False,
                             start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish within {timeout:.0f} s")


@pytest.mark.slow   # forks two processes
@pytest.mark.parametrize("algo", ["RigL", "SET", "RigL-sparse"])
def test_two_ranks_hold_identical_masks_and_weights(algo, tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    import torch._dynamo  # noqa: F401  (optimizers import it on first step; do it once here)
    # fork: the children inherit the imported torch and sparsetorch (spawning re-imports
    # them, ~25 s per process on a loaded 2-core machine); they run single-threaded
    _run_ranks(_worker, (2, algo, str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert r0["masks"].keys() == r1["masks"].keys()
    for n in r0["masks"]:
        assert torch.equal(r0["masks"][n], r1["masks"][n]), n
    for n in r0["weights"]:
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
    assert sum(d for d, _ in r0["changed"].values()) > 0   # the last update changed masks


def test_ddp_refuses_a_sparse_layer_whose_entry_count_would_change(tmp_path):
    """Resampling a SparseLinear to another entry count makes a new values Parameter that
    DDP's gradient hooks never see (ranks would hang or error): refused, with the fix. (In a
    forked process of its own: a process group made and destroyed in the test process left
    the ranks forked by later tests hanging.)"""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    _run_ranks(_refusing_worker, (str(tmp_path),), world=1, timeout=120.0)


def _refusing_worker(rank, out_dir):
    torch.set_num_threads(1)   # (a forked child's OpenMP region of 2+ threads hangs)
    _init(os.path.join(out_dir, "store"), 0, 1)
    try:
        model = nn.Sequential(st.nn.SparseLinear(12, 32, density=0.5), nn.ReLU(),
                              st.nn.SparseLinear(32, 5, density=0.5))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="before wrapping the model"):
            st.train.RigL(ddp, opt, density=0.1, total_steps=10)
        st.train.RigL(ddp, opt, density=0.5, distribution="uniform", total_steps=10)  # fits
    finally:
        dist.destroy_process_group()


class _Routed(nn.Module):
    """Layer ``b`` unused on a step a rank routes around it (data-dependent routing)."""

    def __init__(self):
        super().__init__()
        self.a = st.nn.SparseLinear(8, 8, density=0.5)
        self.b = st.nn.SparseLinear(8, 8, density=0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        return self.out(h + torch.relu(self.b(x)) if use_b else h)


def _routed_worker(rank, world, algo, out_dir):
    torch.set_num_threads(1)
    _init(os.path.join(out_dir, "store"), rank, world)
    try:
        _train_routed(rank, algo, out_dir)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_routed(rank, algo, out_dir):
    torch.manual_seed(0)
    model = _Routed()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    trainer = getattr(st.train, algo)(ddp, opt, density=0.5, distribution="uniform",
                                      delta_t=4, total_steps=40)
    g = torch.Generator().manual_seed(rank)
    for step in range(8):
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=g), rank == 0 or step != 4).square().sum().backward()
        trainer.step()
    torch.save({"masks": trainer.masks, "weights": model.state_dict()},
               os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.slow   # forks two processes
@pytest.mark.parametrize("algo", ["SNFS", "RigL"])
def test_a_truly_sparse_layer_unused_on_one_rank(algo, tmp_path):
    """Each rank decided alone whether a SparseLinear had a gradient: the one whose forward
    skipped it left the all-reduce of its dense gradient (SNFS: both ranks hung; RigL: one
    raised 'no gradient', the other waited), a probe's finding. Now ranks agree, and the
    one without a gradient adds zeros."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    import torch._dynamo  # noqa: F401  (as above)
    _run_ranks(_routed_worker, (2, algo, str(tmp_path)), timeout=120.0)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    for n in r0["masks"]:
        assert torch.equal(r0["masks"][n], r1["masks"][n]), n
    for n in r0["weights"]:
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
