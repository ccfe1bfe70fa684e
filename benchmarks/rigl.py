#!/usr/bin/env python
"""RigL training of an MLP 4096-4096-4096-10 (batch 256, float32, Adam), truly sparse
(``st.nn.SparseLinear``) against dense masked (``nn.Linear`` + masks), side by side in one
process (issue 34, "Targets").

    python benchmarks/rigl.py                       # 90% and 98%, 2 threads, ~2-3 minutes
    python benchmarks/rigl.py --sparsities 0.9 --rounds 3 --threads 1 --out /tmp/r.json

Both models are trained by ``st.train.RigL`` (ERK over the three layers, delta_t=100), same
data. Measured, per sparsity:
  step       one ordinary training iteration (zero_grad, forward, cross-entropy, backward,
             ``trainer.step()``) of each model, interleaved by ``sparsetorch.bench.compare``.
  update     an update iteration: forward and backward (the truly sparse layers keep their
             input and output gradient), then ``trainer.step()``, which drops and grows (the
             truly sparse model streams its dense gradient in row blocks). Timed by hand,
             interleaved with the dense step, median over rounds. ``mask_update`` is the
             ``trainer.step()`` part alone, reported in dense masked steps.
  amortised  step + (update iteration - step) / delta_t, for each model; ``speedup`` is dense
             amortised over sparse amortised.
  memory     bytes of the storages actually allocated for weights (values and index arrays, or
             dense weights and masks), gradients and Adam state after a step: read from the
             live tensors (``untyped_storage().nbytes()``), each storage once.
Update iterations are produced by setting the trainer's step counter to a multiple of
delta_t (and an ordinary one to 1), so timing never drifts into the schedule. A profile of
one truly sparse step (torch.profiler, top ops by self CPU time) is printed at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sparsities", default="0.9,0.98")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--delta-t", type=int, default=100)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                   help="cpu: time.process_time (this process's CPU seconds, all threads "
                        "summed): with --threads 1 a stand-in for wall time that a loaded "
                        "machine does not inflate")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args()


ARGS = _args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import sparsetorch as st  # noqa: E402
from sparsetorch.bench import Report, compare, pinned_threads  # noqa: E402


def build(sparse: bool, density: float):
    torch.manual_seed(0)
    w = ARGS.width
    make = ((lambda i, o: st.nn.SparseLinear(i, o, density=density)) if sparse
            else nn.Linear)
    model = nn.Sequential(make(w, w), nn.ReLU(), make(w, w), nn.ReLU(), make(w, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = st.train.RigL(model, opt, density=density, distribution="erk",
                            delta_t=ARGS.delta_t, total_steps=10 ** 9, dense=[])
    return model, opt, trainer


def iteration(model, opt, trainer, x, y):
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(x), y).backward()
    trainer.step()


def ordinary(model, opt, trainer, x, y):
    trainer.step_count = 1
    iteration(model, opt, trainer, x, y)


TIMER = time.process_time if ARGS.timer == "cpu" else time.perf_counter


def update_parts(model, opt, trainer, x, y):
    """(seconds for forward+backward, seconds for the mask update) of one update iteration."""
    trainer.step_count = ARGS.delta_t
    t0 = TIMER()
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(x), y).backward()
    t1 = TIMER()
    trainer.step()
    return t1 - t0, TIMER() - t1


def allocated_bytes(model, opt, trainer) -> dict:
    seen, out = set(), {"weights": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        if t is None or not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return
        seen.add(s.data_ptr())
        out[kind] += s.nbytes()
    for p in model.parameters():
        add("weights", p)
        add("grads", p.grad)
        for v in opt.state.get(p, {}).values():
            add("optimizer", v)
    for b in model.buffers():
        add("weights", b)                     # a SparseLinear's index arrays
    for layer in trainer.layers.values():     # masked mode's masks
        if hasattr(layer, "_mask"):
            add("weights", layer._mask)
    out["total"] = sum(out.values())
    return out


def main():
    report = Report("RigL: truly sparse vs dense masked training, MLP "
                    f"{ARGS.width}-{ARGS.width}-{ARGS.width}-10, batch {ARGS.batch}")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ARGS.batch, ARGS.width, generator=g)
    y = torch.randint(0, 10, (ARGS.batch,), generator=g)
    summary = []
    with pinned_threads(ARGS.threads):
        for s in (float(v) for v in ARGS.sparsities.split(",")):
            d = round(1 - s, 6)
            dense = build(False, d)
            sparse = build(True, d)
            for m in (dense, sparse):               # Adam state, kernels, caches
                for _ in range(2):
                    ordinary(*m, x, y)
                update_parts(*m, x, y)
            mem_d, mem_s = allocated_bytes(*dense), allocated_bytes(*sparse)
            res = compare({"dense_masked": lambda: ordinary(*dense, x, y),
                           "truly_sparse": lambda: ordinary(*sparse, x, y)},
                          baseline="dense_masked", rounds=ARGS.rounds, warmup=0,
                          timer=TIMER)
            report.add(f"step {s:.0%}", res, sparsity=s)
            upd = {"dense_masked": [], "truly_sparse": []}
            for _ in range(max(3, ARGS.rounds // 2)):
                for name, m in (("dense_masked", dense), ("truly_sparse", sparse)):
                    upd[name].append(update_parts(*m, x, y))
            step_d = res["impls"]["dense_masked"]["median_s"]
            step_s = res["impls"]["truly_sparse"]["median_s"]
            fb_d, mu_d = (statistics.median(v) for v in zip(*upd["dense_masked"]))
            fb_s, mu_s = (statistics.median(v) for v in zip(*upd["truly_sparse"]))
            amort_d = step_d + (fb_d + mu_d - step_d) / ARGS.delta_t
            amort_s = step_s + (fb_s + mu_s - step_s) / ARGS.delta_t
            row = {"sparsity": s, "step_speedup": res["impls"]["truly_sparse"]["speedup"],
                   "amortised_speedup": amort_d / amort_s,
                   "dense_step_s": step_d, "sparse_step_s": step_s,
                   "dense_mask_update_s": mu_d, "sparse_mask_update_s": mu_s,
                   "sparse_mask_update_in_dense_steps": mu_s / step_d,
                   "memory_ratio": mem_s["total"] / mem_d["total"],
                   "memory_dense": mem_d, "memory_sparse": mem_s,
                   "densities": sparse[2].densities}
            summary.append(row)
            report.note(f"{s:.0%}: amortised speedup {row['amortised_speedup']:.2f}x (step "
                        f"{row['step_speedup']:.2f}x), sparse mask update "
                        f"{mu_s:.3f}s = {row['sparse_mask_update_in_dense_steps']:.2f} dense "
                        f"steps (dense masked update {mu_d:.3f}s), memory "
                        f"{mem_s['total'] / 2**20:.1f} MiB vs {mem_d['total'] / 2**20:.1f} MiB "
                        f"= {row['memory_ratio']:.1%}")
            del dense
        report.print()
        if not ARGS.no_profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ordinary(*sparse, x, y)
            print("\nProfile of one truly sparse step (last sparsity):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    report.meta["summary"] = summary
    report.meta["timer"] = ARGS.timer
    report.meta["targets"] = {"speedup_90": 2.5, "speedup_98": 6.0, "memory_ratio_90": 0.25,
                              "mask_update_in_dense_steps_90": 10}
    path = report.write_json(ARGS.out or os.path.join(os.path.dirname(__file__), "results",
                                                      "rigl.json"))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
