#!/usr/bin/env python
"""RigL, SET and Static sparse training of LeNet-300-100 on MNIST against dense training
(Evci et al. 2020, section 4.3), as a table and a PNG of test accuracy against sparsity.

    python examples/rigl_mnist.py                          # full grid, paper-like budget (long)
    python examples/rigl_mnist.py --epochs 3 --seeds 0,1   # the reduced 2-core budget
    python examples/rigl_mnist.py --paper-point            # + fc1 99%, fc2 89%, fc3 dense
    python examples/rigl_mnist.py --sparsities "" --no-dense --paper-point --epochs 20
    torchrun --nproc_per_node 2 examples/rigl_mnist.py     # DDP (gloo), data split by rank

Each run (method x sparsity x distribution x seed) trains with SGD (momentum 0.9, lr 0.1,
cosine learning-rate decay, weight decay 1e-4, batch 100), mask updates every ``--delta-t``
steps over the first 3/4 of training (``t_end``; cosine drop fraction from alpha=0.3), and
is checkpointed atomically every epoch under ``--workdir``: rerunning the same command resumes
unfinished runs exactly and skips finished ones (results are kept in ``results.json``). The
paper trains for 200 epochs; ``--epochs`` scales the whole schedule down. Progress bars need
``tqdm``, the PNG ``matplotlib`` (both optional).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import sparsetorch as st


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="rigl,set,static")
    p.add_argument("--sparsities", default="0.9,0.98")
    p.add_argument("--distributions", default="erk,uniform")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--delta-t", type=int, default=100)
    p.add_argument("--paper-point", action="store_true",
                   help="also fc1 99%%, fc2 89%%, fc3 dense (the paper's 1.44-1.48%% error)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--workdir", default="rigl_mnist_runs")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def lenet_300_100():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 100),
                         nn.ReLU(), nn.Linear(100, 10))


class Dense:
    """The dense baseline behind the trainers' interface."""

    def __init__(self, model, optimizer):
        self.optimizer, self.step_count = optimizer, 0

    def step(self):
        self.optimizer.step()
        self.step_count += 1

    def state_dict(self):
        return {"step": self.step_count, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, s):
        self.step_count = s["step"]
        self.optimizer.load_state_dict(s["optimizer"])


def make_trainer(run, model, opt, total_steps, delta_t):
    if run["method"] == "dense":
        return Dense(model, opt)
    kw = dict(density=1 - run["sparsity"], distribution=run["distribution"], dense=[],
              seed=run["seed"])
    if run["method"] == "paper":   # Evci et al.: fc1 99%, fc2 89% sparse, output dense
        pre = "module." if isinstance(model, nn.parallel.DistributedDataParallel) else ""
        kw.update(dense=[pre + "5"], layer_density={pre + "1": 0.01, pre + "3": 0.11},
                  distribution="uniform")
    if run["method"] == "static":
        return st.train.Static(model, opt, **kw)
    cls = {"rigl": st.train.RigL, "set": st.train.SET, "paper": st.train.RigL}[run["method"]]
    return cls(model, opt, delta_t=delta_t, total_steps=total_steps, **kw)


def sparsity_of(model) -> float:
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return 1 - sum(int((w != 0).sum()) for w in weights) / sum(w.numel() for w in weights)


def train_one(run, args, data, rank, world, progress):
    (xtr, ytr), (xte, yte) = data
    steps_per_epoch = len(xtr) // (args.batch * world)
    total = steps_per_epoch * args.epochs
    torch.manual_seed(run["seed"])
    net = lenet_300_100()
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    # a mask-update iteration makes no optimizer step (as in the paper); when the first one
    # does not, torch takes the scheduler's step for a call-order mistake and warns
    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before",
                            UserWarning)
    trainer = make_trainer(run, model, opt, total, args.delta_t)
    ckpt = Path(args.workdir) / f"{run['key']}.pt"
    order = torch.Generator().manual_seed(1000 + run["seed"])
    epoch = 0
    if ckpt.is_file():
        extra = st.train.load_checkpoint(ckpt, model=model, trainer=trainer)
        epoch, _ = extra["epoch"], order.set_state(extra["order"])
        sched.load_state_dict(extra["sched"])
    bar = progress(total=total, initial=epoch * steps_per_epoch, desc=run["key"],
                   disable=rank != 0, leave=False, mininterval=5)
    while epoch < args.epochs:
        perm = torch.randperm(len(xtr), generator=order)
        model.train()
        for i in range(steps_per_epoch):
            idx = perm[(i * world + rank) * args.batch:(i * world + rank + 1) * args.batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            trainer.step()
            sched.step()
            bar.update(1)
        epoch += 1
        if rank == 0:
            st.train.save_checkpoint(ckpt, model=model, trainer=trainer, epoch=epoch,
                                     order=order.get_state(), sched=sched.state_dict())
        if world > 1:
            dist.barrier()
    bar.close()
    model.eval()
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    return {**run, "accuracy": acc, "measured_sparsity": sparsity_of(net), "steps": total}


def runs_of(args):
    seeds = [int(s) for s in args.seeds.split(",")]
    out = []
    if not args.no_dense:
        out += [{"method": "dense", "sparsity": 0.0, "distribution": "-", "seed": s}
                for s in seeds]
    # methods innermost: a partial run already compares them at the first settings
    for sp in (float(v) for v in args.sparsities.split(",") if v):   # "": no grid
        for distribution in args.distributions.split(","):
            for method in args.methods.split(","):
                out += [{"method": method, "sparsity": sp, "distribution": distribution,
                         "seed": s} for s in seeds]
    if args.paper_point:
        out += [{"method": "paper", "sparsity": 0.975, "distribution": "99-89-dense",
                 "seed": s} for s in seeds]
    for r in out:
        r["key"] = f"{r['method']}-{r['sparsity']}-{r['distribution']}-s{r['seed']}-e{args.epochs}"
    return out


def table(results) -> str:
    groups = {}
    for r in results:
        groups.setdefault((r["method"], r["sparsity"], r["distribution"]), []).append(r)
    lines = ["| method | sparsity | distribution | seeds | test accuracy (mean +- sd) | "
             "measured sparsity |", "|---|---|---|---|---|---|"]
    for (m, sp, d), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        accs = [100 * r["accuracy"] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"| {m} | {sp:.1%} | {d} | {len(rs)} | {statistics.mean(accs):.2f} +- "
                     f"{sd:.2f} | {statistics.mean(r['measured_sparsity'] for r in rs):.2%} |")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {}
    for r in results:
        series.setdefault((r["method"], r["distribution"]), {}).setdefault(
            r["sparsity"], []).append(100 * r["accuracy"])
    for (m, d), pts in sorted(series.items()):
        xs = sorted(pts)
        ys = [statistics.mean(pts[x]) for x in xs]
        if m == "dense":
            ax.axhline(ys[0], color="k", ls="--", label="dense")
        else:
            ax.plot([100 * x for x in xs], ys, marker="o", label=f"{m} ({d})")
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("LeNet-300-100 on MNIST")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"PNG: {path}")


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        from tqdm import tqdm as progress
    except ImportError:
        progress = _NoBar
    xtr, ytr = st.datasets.mnist(train=True, dtype=torch.float32)
    xte, yte = st.datasets.mnist(train=False, dtype=torch.float32)
    mean, std = xtr.mean(), xtr.std()
    data = (((xtr - mean) / std, ytr), ((xte - mean) / std, yte))
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    done = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for run in runs_of(args):
        if run["key"] in done:
            continue
        result = train_one(run, args, data, rank, world, progress)
        if rank == 0:
            done[run["key"]] = result
            print(f"{run['key']}: accuracy {100 * result['accuracy']:.2f}%, "
                  f"sparsity {result['measured_sparsity']:.2%}")
            st.bench.write_json_atomic(results_path, done)
    if rank == 0:
        wanted = {r["key"] for r in runs_of(args)}
        results = [r for k, r in done.items() if k in wanted]
        text = table(results)
        print(text)
        (work / "table.md").write_text(text + "\n")
        plot(results, work / "accuracy_vs_sparsity.png")
    if world > 1:
        dist.destroy_process_group()


class _NoBar:
    def __init__(self, *a, **k):
        pass

    def update(self, n):
        pass

    def close(self):
        pass


if __name__ == "__main__":
    main()
