#!/usr/bin/env python
"""A cold first training step (issue 31, item 13) in a fresh process with an empty kernel
cache, with builds run one at a time (``SPARSETORCH_BUILD_THREADS=1``, how every build ran
before) against the default (the precompiled header and the C call dispatcher build beside
the first kernel, and each recorded call's backward kernels start building right after its
forward, side by side). The step (forward, cross-entropy, ``loss.backward()``, optimizer):

  example  the GCN of ``examples/gcn_cora.py``: ``st.models.GCN`` (16 hidden units, dropout
           0.5) on row-normalised sparse features, Adam
  einsum   a 2-layer GCN written with st.einsum (``A_hat @ (X @ W1)``, relu,
           ``A_hat @ (h @ W2)``), no optimizer

    python benchmarks/cold_start.py                   # Cora if the data is found, 3 rounds
    python benchmarks/cold_start.py --model einsum --rounds 5 --out /tmp/cold.json

Each sample is one child process; the time is the step only (``time.perf_counter`` around it
in the child), not interpreter start or imports. Cases alternate round by round
(``sparsetorch.bench.compare`` with a clock advanced by the children's step times). Each
child also reports how many kernels it built and their summed compiler time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from sparsetorch.bench import compare, find_data, format_table, machine_info, write_json_atomic

CHILD = r"""
import json, os, sys, time
import numpy as np, scipy.sparse as sp, torch, torch.nn.functional as F
import sparsetorch as st
from sparsetorch import runtime

torch.manual_seed(0)
try:
    g = st.datasets.planetoid("cora", root=sys.argv[1] or None)
    a, X, labels, train = g.adj.to_scipy(), g.features, g.labels, g.train_idx
    n, classes, source = g.num_nodes, g.num_classes, "cora"
except (FileNotFoundError, ValueError):     # no data: a Cora-sized random graph
    n, classes, rng = 2708, 7, np.random.default_rng(0)
    a = sp.random(n, n, density=4 / n, random_state=rng, format="csr", dtype=np.float32)
    a = ((a + a.T) != 0).astype(np.float32)
    X = st.tensor(sp.random(n, 1433, density=0.0127, random_state=rng, format="csr",
                            dtype=np.float32))
    labels, train, source = torch.randint(0, classes, (n,)), torch.arange(140), "generated"
a = a + sp.eye(n, dtype=np.float32)
d = np.asarray(a.sum(1)).ravel() ** -0.5
A = st.tensor(sp.csr_matrix(sp.diags(d) @ a @ sp.diags(d), dtype=np.float32))
if sys.argv[2] == "einsum":
    W1 = torch.randn(X.shape[1], 16, requires_grad=True)
    W2 = torch.randn(16, classes, requires_grad=True)
    t0 = time.perf_counter()
    h = torch.relu(st.einsum("ij,jk->ik", A, st.einsum("ij,jk->ik", X, W1)))
    out = st.einsum("ij,jk->ik", A, h @ W2)
    F.cross_entropy(out[train], labels[train]).backward()
else:                   # examples/gcn_cora.py's model, features and optimizer
    sums = st.einsum("ij->i", X)
    x = st.einsum("ij,i->ij", X, torch.where(sums > 0, 1 / sums, 0))
    adj = st.tensor(sp.csr_matrix(a - sp.eye(n, dtype=np.float32), dtype=np.float32))
    model = st.models.GCN(X.shape[1], 16, classes, dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    t0 = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x, adj)[train], labels[train]).backward()
    opt.step()
step = time.perf_counter() - t0
s = runtime.stats()
print(json.dumps({"step_s": step, "builds": s["builds"], "build_s": s["build_seconds"],
                  "graph": source}))
"""


def run_child(threads: str | None, data: str, model: str, log: list) -> float:
    env = dict(os.environ, SPARSETORCH_QUIET="1")
    env.pop("SPARSETORCH_BUILD_THREADS", None)
    if threads:
        env["SPARSETORCH_BUILD_THREADS"] = threads
    with tempfile.TemporaryDirectory(prefix="st-cold-") as cache:
        env["SPARSETORCH_CACHE"] = cache
        proc = subprocess.run([sys.executable, "-c", CHILD, data, model], env=env,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"child failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    log.append(result)
    return result["step_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=None, help="shared data folder (Cora); default: found")
    ap.add_argument("--model", choices=("example", "einsum"), default="example")
    ap.add_argument("--out", default="benchmarks/results/cold_start.json")
    args = ap.parse_args(argv)
    data = find_data(args.data)
    clock = [0.0]
    logs = {"serial": [], "parallel": []}

    def case(name, threads):
        def run():
            clock[0] += run_child(threads, str(data or ""), args.model, logs[name])
        return run

    res = compare({"serial": case("serial", "1"), "parallel": case("parallel", None)},
                  baseline="serial", rounds=args.rounds, warmup=0, prime=False,
                  timer=lambda: clock[0])
    rows = []
    for name, impl in res["impls"].items():
        runs = logs[name]
        rows.append({"builds": name, "step_s": round(impl["median_s"], 2),
                     "x_serial": round(impl["speedup"], 2),
                     "kernels_built": sorted({r["builds"] for r in runs}),
                     "compiler_s": round(sorted(r["build_s"] for r in runs)[len(runs) // 2], 2),
                     "graph": runs[0]["graph"], "model": args.model})
    print(format_table(rows, ["builds", "model", "graph", "step_s", "x_serial", "kernels_built",
                              "compiler_s"]))
    report = {"machine": machine_info(), "compare": res, "rows": rows, "children": logs}
    print("wrote", write_json_atomic(args.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
