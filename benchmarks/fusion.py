#!/usr/bin/env python
"""Fused kernels against the unfused sequences they replace, and per-call overhead
(issue 5, "Done when": overhead and fused vs unfused timings).

    python benchmarks/fusion.py                 # ~2-3 minutes on 2 cores
    python benchmarks/fusion.py --quick         # < 1 minute
    python benchmarks/fusion.py --threads 1 --out /tmp/fusion.json

Sections
  overhead   warm eager call of a tiny SpMM (8x8 CSR, 6 nnz, x 8x4): ``st.einsum``, ``A @ X``
             through ``__torch_function__``, against ``torch.sparse`` CSR ``@`` (int32/int64
             indices) and ``torch.sparse.mm``.
  epilogue   ``st.einsum("ij,jk->ik", A, X, bias=b, activation="relu")`` (one kernel; the
             bias add and ReLU happen when a register tile is written) against the unfused
             ``torch.relu(st.einsum(...) + b)`` and torch ``torch.relu(T @ X + b)``; graph
             adjacencies with X of 128 columns and DLMC transformer weights (0.9) with 256.
  attention  ``st.ops.masked_attention(A, Q, K, V)`` (SDDMM -> row softmax -> SpMM in one loop
             nest, scores never dense) against the unfused ``st.einsum`` SDDMM ->
             ``st.ops.softmax`` -> SpMM, and torch: dense masked softmax attention (when n^2
             fits) and ``torch.sparse.sampled_addmm`` -> COO ``torch.sparse.softmax`` -> ``@``.
             Masks: graph adjacencies (head dim 64) and a local-window mask.
  chain      ``(st.lazy(A) * 2 - st.lazy(B)).relu().eval()`` (one kernel) against the same
             chain of eager operators (one kernel each) and torch.sparse COO ops.
  softmax    ``st.ops.softmax(A, 1)`` of a CSR tensor (one kernel per row: maximum,
             exponentials and their sum, scaling) against the einsum calls and torch ops it
             replaces where no gradient is recorded (``ops/softmax.py``'s ``_by_einsum``)
             and ``torch.sparse.softmax`` on COO; the attention masks, random values.
  softmax_grad  the same three, forward and backward (the values' gradient of a weighted
             sum): the row kernel and its gradient kernel, the einsum calls differentiated
             by ``sparsetorch.autograd``, torch's COO softmax and its backward.

Each fused section but the softmax ones also times ``st.compile`` of the user function
written with ordinary ops (``torch.relu(A @ X + b)``;
``torch.sparse.softmax(st.einsum(...), 1) @ V``;
``torch.relu(A * 2 - B)``): dynamo's guards plus the rewritten graph calling the fused op
(each case compiles afresh, and is checked to have run fused). The overhead section times it
on the tiny SpMM too (nothing to fuse there: the cost of the guards and the graph call).

Every implementation is checked against the first one's result before timing. Timing:
``sparsetorch.bench.compare`` (interleaved rounds, medians; ``x_unfused`` etc. are median
per-round ratios their time / fused time, > 1 means the fused kernel is faster). Results:
tables and ``benchmarks/results/fusion.json``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer inputs and rounds")
    p.add_argument("--threads", type=int, default=2, help="threads for every library (2)")
    p.add_argument("--out", default=str(HERE / "results" / "fusion.json"), help="JSON path")
    p.add_argument("--data", default=None, help="shared data folder (default ../shared/data)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per case (9; 5 quick)")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # thread counts must be set before torch starts its pools
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402

import sparsetorch as st  # noqa: E402
from sparsetorch.bench import Report, compare, geomean  # noqa: E402
from sparsetorch.bench.harness import quiet_sparse_warnings  # noqa: E402


def check(results: dict, what: str, report: Report) -> bool:
    """All results equal the first one (dense comparison, float32 tolerance)."""
    ref = None
    for name, value in results.items():
        value = value.to_dense() if hasattr(value, "to_dense") else value
        if ref is None:
            ref = value.double()
            continue
        err = (value.double() - ref).abs().max().item() if ref.numel() else 0.0
        if err > 1e-3 * max(1.0, ref.abs().max().item()):
            report.note(f"{what}: {name} disagrees with the fused result (max error {err:.3g})")
            return False
    return True


def run_case(report, section, case, impls, rounds, **fields):
    outs = {name: fn() for name, fn in impls.items()}
    if not check(outs, f"{section}/{case}", report):
        report.note(f"{section}/{case}: not timed (results disagree)")
        return None
    res = compare(impls, baseline=next(iter(impls)), rounds=rounds, min_time=2e-3,
                  max_time=3.0)
    rows = report.add(case, res, section=section, **fields)
    first = rows[0]["median_s"]
    line = ", ".join(f"{r['impl']} {r['median_s'] * 1e6:.1f}us" for r in rows)
    ratios = ", ".join(f"x_{r['impl']} {1 / r['speedup']:.2f}" for r in rows[1:]
                       if r["speedup"])
    print(f"  {section:9s} {case:28s} {line}  ({ratios}; > 1: ours faster)", flush=True)
    return {r["impl"]: r["median_s"] / first for r in rows}


def compiled(fn, pattern, args, report, what):
    """``st.compile(fn)``, compiled afresh (dynamo's recompile limit would otherwise turn
    later cases eager) and checked to run ``pattern`` fused on ``args``."""
    torch._dynamo.reset()
    f = st.compile(fn)
    ran = f.explain(*args).fused
    if pattern is not None and pattern not in ran:
        report.note(f"{what}: st.compile did not fuse {pattern} (ran fused: {ran})")
        print(f"  warning: {what}: st.compile did not fuse {pattern}", flush=True)
    return f


def graphs(quick):
    names = ["cora", "pubmed"] if quick else ["cora", "citeseer", "pubmed", "amazon_photo",
                                              "coauthor_cs"]
    out = []
    for name in names:
        try:
            g = st.datasets.graph(name, root=ARGS.data) if ARGS.data else st.datasets.graph(name)
            A = g.adj.asformat("csr", index_dtype=torch.int32).to(torch.float32)
        except (FileNotFoundError, OSError) as e:
            n = {"cora": 2708, "citeseer": 3327, "pubmed": 19717}.get(name, 8000)
            print(f"note: {name}: {e}; using a random stand-in graph with {n} nodes")
            d = (torch.rand(n, n) < 5.0 / n).float()
            A = st.tensor(d, format="csr", index_dtype=torch.int32)
        out.append((name, A))
    return out


def section_overhead(report, rounds):
    g = torch.Generator().manual_seed(0)
    d = torch.zeros(8, 8)
    d[torch.randint(0, 8, (6,), generator=g), torch.randint(0, 8, (6,), generator=g)] = 1.0
    A, X = st.tensor(d, format="csr", index_dtype=torch.int32), torch.randn(8, 4, generator=g)
    T64 = d.to_sparse_csr()
    T32 = torch.sparse_csr_tensor(T64.crow_indices().int(), T64.col_indices().int(),
                                  T64.values(), d.shape)
    impls = {"st.einsum": lambda: st.einsum("ij,jk->ik", A, X), "A @ X": lambda: A @ X,
             "torch csr32 @": lambda: T32 @ X, "torch csr64 @": lambda: T64 @ X,
             "torch.sparse.mm": lambda: torch.sparse.mm(T64, X)}
    f = compiled(lambda A, X: A @ X, None, (A, X), report, "overhead")
    impls["st.compile(A @ X)"] = lambda: f(A, X)
    return run_case(report, "overhead", "tiny spmm 8x8", impls, rounds * 3)


def section_epilogue(report, rounds, quick):
    ratios = []
    cases = [(name, A, 128) for name, A in graphs(quick)]
    dlmc = Path(ARGS.data or HERE.parent.parent / "shared" / "data") / "dlmc" / \
        "transformer" / "magnitude_pruning" / "0.9"
    files = sorted(dlmc.glob("*ffn*.smtx*"))[: 1 if quick else 3] if dlmc.is_dir() else []
    for f in files:
        W = st.io.read_smtx(f).asformat("csr", index_dtype=torch.int32).to(torch.float32)
        W = W.with_values(torch.randn(W.nnz))
        cases.append((f"dlmc0.9/{f.name.split('.')[0][-22:]}", W, 256))
    for name, A, n in cases:
        X, b = torch.randn(A.shape[1], n), torch.randn(n)
        T = A.to_torch()
        f = compiled(lambda A, X, b: torch.relu(A @ X + b), "epilogue", (A, X, b), report,
                     f"epilogue/{name}")
        impls = {"fused": lambda: st.einsum("ij,jk->ik", A, X, bias=b, activation="relu"),
                 "st.compile": lambda: f(A, X, b),
                 "unfused": lambda: torch.relu(st.einsum("ij,jk->ik", A, X) + b),
                 "torch": lambda: torch.relu(T @ X + b)}
        r = run_case(report, "epilogue", name, impls, rounds, nnz=A.nnz, n=n)
        if r:
            ratios.append(r)
    return ratios


def attention_masks(quick):
    """(name, CSR mask): graph adjacencies and a local-window mask."""
    cases = graphs(quick)[: 2 if quick else 3]
    n, w = (2048, 16) if quick else (8192, 32)
    rows = torch.arange(n).repeat_interleave(2 * w + 1)
    cols = rows + torch.arange(-w, w + 1).repeat(n)
    # drop the window's overhang at the edges (clamping it repeated coordinates, which
    # torch.sparse keeps as separate entries of the softmax and st.tensor sums)
    keep = (cols >= 0) & (cols < n)
    rows, cols = rows[keep], cols[keep]
    local = st.tensor((torch.stack([rows, cols]), torch.ones(rows.numel())), shape=(n, n),
                      format="csr", index_dtype=torch.int32)
    return cases + [(f"local window n={n} w={w}", local)]


def section_attention(report, rounds, quick):
    ratios, d = [], 64   # head dimension
    for name, A in attention_masks(quick):
        m = A.shape[0]
        Q, K, V = (torch.randn(m, d) / d ** 0.25 for _ in range(3))
        P = A.to_torch()
        f = compiled(lambda A, Q, K, V: torch.sparse.softmax(
            st.einsum("ij,ik,jk->ij", A, Q, K), 1) @ V, "attention", (A, Q, K, V), report,
            f"attention/{name}")
        impls = {"fused": lambda: st.ops.masked_attention(A, Q, K, V),
                 "st.compile": lambda: f(A, Q, K, V),
                 "unfused": lambda: st.ops.softmax(st.einsum("ij,ik,jk->ij", A, Q, K), 1) @ V,
                 "torch sparse": lambda: torch.sparse.softmax(
                     torch.sparse.sampled_addmm(P, Q, K.T, beta=0.0).to_sparse_coo(), 1) @ V}
        if m * m <= 1 << 26:
            D = A.to_dense()
            mask = D != 0
            impls["torch dense"] = lambda: torch.softmax(
                (D * (Q @ K.T)).masked_fill(~mask, float("-inf")), 1).nan_to_num(0.0) @ V
        r = run_case(report, "attention", name, impls, rounds, nnz=A.nnz, n=d)
        if r:
            ratios.append(r)
    return ratios


def section_chain(report, rounds, quick):
    ratios = []
    for name, A in graphs(quick):
        B = A.with_values(torch.rand(A.nnz))
        TA, TB = A.to_torch().to_sparse_coo(), B.to_torch().to_sparse_coo()
        f = compiled(lambda A, B: torch.relu(A * 2 - B), "elementwise", (A, B), report,
                     f"chain/{name}")
        impls = {"fused": lambda: (st.lazy(A) * 2 - st.lazy(B)).relu().eval(),
                 "st.compile": lambda: f(A, B),
                 "unfused": lambda: st.relu(A * 2 - B),
                 "torch coo": lambda: torch.relu(TA * 2 - TB)}
        r = run_case(report, "chain", name, impls, rounds, nnz=A.nnz)
        if r:
            ratios.append(r)
    return ratios


def section_softmax(report, rounds, quick):
    # (``sparsetorch.ops.softmax`` is the function; its module holds the einsum path)
    by_einsum = importlib.import_module("sparsetorch.ops.softmax")._by_einsum
    ratios = []
    for name, mask in attention_masks(quick):
        A = mask.with_values(torch.randn(mask.nnz, generator=torch.Generator().manual_seed(7)))
        C = A.to_torch().to_sparse_coo()
        # values in row-major order, compared as such (the masks' dense form can be GBs)
        impls = {"fused": lambda: st.ops.softmax(A, 1).values,
                 "unfused": lambda: by_einsum(A, 1).values,
                 "torch coo": lambda: torch.sparse.softmax(C, 1).values()}
        r = run_case(report, "softmax", name, impls, rounds, nnz=A.nnz)
        if r:
            ratios.append(r)
    return ratios


def section_softmax_grad(report, rounds, quick):
    by_einsum = importlib.import_module("sparsetorch.ops.softmax")._by_einsum
    ratios = []
    for name, mask in attention_masks(quick):
        g = torch.Generator().manual_seed(8)
        A = mask.with_values(torch.randn(mask.nnz, generator=g))
        weights = torch.randn(mask.nnz, generator=g)
        C = A.to_torch().to_sparse_coo()   # coalesced: values in A's (row-major) order

        def gradient(softmax_values, start):
            """The values' gradient of ``(softmax_values(v) * weights).sum()`` at ``start``."""
            def run():
                v = start.detach().requires_grad_()
                (softmax_values(v) * weights).sum().backward()
                return v.grad
            return run
        impls = {
            "fused": gradient(lambda v: st.ops.softmax(A.with_values(v), 1).values, A.values),
            "unfused": gradient(lambda v: by_einsum(A.with_values(v), 1).values, A.values),
            "torch coo": gradient(lambda v: torch.sparse.softmax(torch.sparse_coo_tensor(
                C.indices(), v, C.shape, is_coalesced=True), 1).values(), C.values())}
        r = run_case(report, "softmax_grad", name, impls, rounds, nnz=A.nnz)
        if r:
            ratios.append(r)
    return ratios


def main():
    quiet_sparse_warnings()
    torch.set_num_threads(ARGS.threads)
    rounds = ARGS.rounds or (5 if ARGS.quick else 9)
    report = Report("fused kernels vs unfused sequences; per-call overhead",
                    meta={"argv": sys.argv[1:], "threads": ARGS.threads, "rounds": rounds})
    t0 = time.perf_counter()
    summary = {}
    print("== overhead ==")
    summary["overhead"] = section_overhead(report, rounds)
    for name, fn in (("epilogue", section_epilogue), ("attention", section_attention),
                     ("chain", section_chain), ("softmax", section_softmax),
                     ("softmax_grad", section_softmax_grad)):
        print(f"== {name} ==")
        ratios = fn(report, rounds, ARGS.quick)
        impls = sorted({k for r in ratios for k in r if k != "fused"})
        summary[name] = {f"geomean time {k} / fused": geomean(r.get(k) for r in ratios)
                         for k in impls}
        summary[name]["geomean time unfused / st.compile"] = geomean(
            r["unfused"] / r["st.compile"] for r in ratios
            if r.get("unfused") and r.get("st.compile"))
        for k, v in summary[name].items():
            print(f"  {name}: {k}: {v:.2f}x" if v else f"  {name}: {k}: n/a")
    report.meta["summary"] = summary
    report.meta["wall_s"] = round(time.perf_counter() - t0, 1)
    path = report.write_json(ARGS.out)
    print(f"wrote {path} ({report.meta['wall_s']}s)")


if __name__ == "__main__":
    main()
