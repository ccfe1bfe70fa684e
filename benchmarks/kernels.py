#!/usr/bin/env python
"""Sparse kernels against their baselines, side by side (issue 4, "Measure"): SpMM, SDDMM,
SpGEMM, BSR SpMM and a sparse 1x1 convolution, on real graphs, SuiteSparse and DLMC weights,
against torch.sparse, scipy.sparse and dense torch. float32, 2 threads by default.

    python benchmarks/kernels.py                   # full run, ~4-5 minutes on 2 cores (193 cases)
    python benchmarks/kernels.py --quick           # few matrices, < 3 minutes
    python benchmarks/kernels.py --kernels spmm,sddmm --threads 1 --out /tmp/k.json
    python benchmarks/kernels.py --data /path/to/shared/data --wait-idle 300

Kernels (``--kernels``; all by default)
  spmm    ``st.einsum("ij,jk->ik", A, B)``, B dense K x 128, A the Planetoid (cora, citeseer,
          pubmed), Amazon (computers, photo) and Coauthor-CS adjacencies and every non-complex
          SuiteSparse matrix. vs torch.sparse CSR (int32 and int64 indices; ``x_torch`` uses
          the faster per case) and scipy.sparse.
  spmm_t  ``A.T @ B`` on the same matrices (A stored as CSR, its transpose a free view; the
          compiler re-lays its pattern once and gathers the values per call), vs torch
          ``T.t() @ B`` and scipy ``m.T @ B``.
  spmm_grad  ``A @ X`` and dX by autograd (a training step's product; dX = A.T dY), same
          matrices, vs ``torch.sparse.mm`` with autograd and scipy's two products.
  dlmc    W @ X, W a DLMC transformer magnitude-pruning weight (0.9 and 0.7; M x K), X dense
          K x 256. vs dense ``torch.matmul``, torch CSR, scipy. ``frac_sgemm`` = our effective
          GFLOP/s (2 nnz N / time) over dense sgemm GFLOP/s (2 M K N / time, same run, same
          shape).
  linear  ``F.linear(x, W)`` with the same DLMC weights, x of 1 and 256 rows, vs dense
          ``F.linear`` and torch CSR ``(W @ x.T).T``: the pruned layer as users call it.
  sddmm   ``st.einsum("ij,ik,jk->ij", mask, X, Y)`` with the DLMC patterns as masks, inner
          dimension 64 and 256, vs ``torch.sparse.sampled_addmm(mask, X, Y.T, beta=0)``.
  spgemm  ``st.einsum("ij,jk->ik", A, A)`` on the square SuiteSparse matrices vs torch CSR@CSR
          and scipy; cases over SPGEMM_FLOP_CAP multiplies are skipped (listed in the output).
  bsr     random 4x4 blocks, 90% block sparsity (``st.tensor(D, format="bsr",
          blocksize=(4, 4))``) @ dense N=256, vs dense matmul, torch BSR, scipy bsr_array.
  conv    CHW 1x1 convolution as in Fast Sparse ConvNets: relu(W X + b), W (Cout x Cin, 90%
          sparse), X (Cin x H*W), MobileNet-like shapes; ours ``st.einsum("oc,cp->op", W, X,
          bias=b, activation="relu")`` (bias and ReLU fused into the kernel) vs dense
          ``conv2d`` 1x1, dense addmm and torch CSR, each followed by its bias and ReLU.

Every case is checked once before timing: each implementation's result against a float64
reference, |out - ref| <= 1e-3 * sum|a||b| + 1e-5 * max(sum|a||b|) elementwise. A wrong or
raising sparsetorch result is recorded as a failure in the JSON (``failures``), is not timed,
and makes the exit status 1; a baseline that disagrees is dropped from the case with a note.

Timing is ``sparsetorch.bench.compare``: implementations interleaved round by round in one
process, fast calls batched to >= --min-time per sample; ``x_<lib>`` is the median over rounds
of (their time / our time), so > 1 means sparsetorch is faster. Threads: ``--threads`` sets
``torch.set_num_threads`` and OMP/MKL/OpenBLAS_NUM_THREADS (before torch is imported) for every
library; scipy.sparse is single-threaded regardless. Results: a table per kernel, per-group
geomeans, the 5 worst cases per kernel, a goals section, and JSON in benchmarks/results/.
"""
from __future__ import annotations

import os
import sys


def _threads_from_argv(argv) -> int:
    """``--threads`` before argparse runs: the thread variables must be set before torch and
    numpy load their thread pools."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 2


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
if __name__ == "__main__":
    for _var in THREAD_VARS:
        os.environ[_var] = str(_threads_from_argv(sys.argv[1:]))

import argparse
import time
import traceback
from pathlib import Path

import torch

import sparsetorch as st
from sparsetorch.bench import Report, compare, find_data, format_table, geomean, speedup
from sparsetorch.bench.harness import quiet_sparse_warnings, write_json_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kernel_cases as kc
from _inputs import short_name
from compiler import wait_idle

RESULTS = Path(__file__).resolve().parent / "results"
OURS = kc.OURS
RATIOS = ("x_torch", "x_scipy", "x_dense", "x_conv2d", "x_torch_bsr", "x_scipy_bsr")
NOISY = 0.5   # IQR over rounds above this fraction of the median (ours or the primary baseline)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few matrices and rounds (< 3 min)")
    p.add_argument("--kernels", default=",".join(kc.KERNELS),
                   help=f"comma-separated subset of {','.join(kc.KERNELS)}")
    p.add_argument("--threads", type=int, default=2,
                   help="threads for torch, MKL, OpenMP and the generated kernels (2)")
    p.add_argument("--data", default=None,
                   help="shared data folder (default $SPARSETORCH_DATA or a shared/data folder "
                   "next to the checkout); missing data are replaced by generated stand-ins")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                   "kernels.json, kernels-quick.json with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per case (9; 5 quick)")
    p.add_argument("--min-time", type=float, default=2e-3,
                   help="seconds per timed sample; faster calls are batched (2e-3)")
    p.add_argument("--wait-idle", type=float, default=0,
                   help="wait up to this many seconds for the machine to go idle (1-min load "
                   "average < 0.5 per core) before starting (default: do not wait)")
    p.add_argument("--max-time", type=float, default=None,
                   help="timing budget per case in seconds, never fewer than 3 rounds "
                   "(1.5; 0.4 quick)")
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    bad = set(args.kernels) - set(kc.KERNELS)
    if bad:
        p.error(f"unknown kernels {sorted(bad)}; choose from {','.join(kc.KERNELS)}")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    args.rounds = args.rounds or (5 if args.quick else 9)
    args.max_time = args.max_time if args.max_time is not None else (0.4 if args.quick else 1.5)
    return args


# == which cases ==============================================================================
def case_builders(args, root, report: Report, skipped: list):
    """Yield (kernel, name, thunk building a ``kc.Case``) in run order. Matrices are loaded
    lazily and shared between the kernels that use them."""
    loaded: dict = {}

    def get(key, load):
        if key not in loaded:
            loaded[key] = load()
        return loaded[key]

    want = set(args.kernels)
    seed = 0
    if want & {"spmm", "spmm_t", "spmm_grad", "spgemm"}:
        ss = kc.suitesparse_inputs(root, args.quick, report, skipped)
    if want & {"spmm", "spmm_t", "spmm_grad"}:
        graphs = kc.graph_inputs(root, args.quick, report)
    for kernel, case in (("spmm", kc.spmm_case), ("spmm_t", kc.spmm_t_case),
                         ("spmm_grad", kc.spmm_grad_case)):
        for coll, name, m in graphs if kernel in want else ():
            seed += 1
            yield kernel, name, lambda f=case, c=coll, n=name, m=m, s=seed: f(c, n, m, s)
        for coll, name, load in ss if kernel in want else ():
            seed += 1
            yield kernel, name, lambda f=case, c=coll, n=name, ld=load, s=seed: f(
                c, n, get(("ss", n), ld), s)
    if want & {"dlmc", "linear", "sddmm"}:
        dl = kc.dlmc_inputs(root, args.quick, report)
    if "dlmc" in want:
        for dset, name, load in dl:
            seed += 1
            yield "dlmc", name, lambda d=dset, n=name, ld=load, s=seed: kc.dlmc_case(
                d, n, get(("dlmc", n), ld), s)
    for kernel, sizes, case in (("linear", kc.LINEAR_BATCH, kc.linear_case),   # batch
                                ("sddmm", kc.SDDMM_INNER, kc.sddmm_case)):     # inner dim
        for dset, name, load in dl if kernel in want else ():
            for size in sizes:
                seed += 1
                yield kernel, name, lambda c=case, d=dset, n=name, ld=load, z=size, s=seed: \
                    c(d, n, get(("dlmc", n), ld), z, s)
    if "spgemm" in want:
        for coll, name, load in ss:
            m = get(("ss", name), load)
            if m.shape[0] != m.shape[1]:
                skipped.append(f"spgemm {coll}/{name}: not square, skipped")
                continue
            flops = kc.spgemm_flops(m)
            if flops > kc.SPGEMM_FLOP_CAP:
                skipped.append(f"spgemm {coll}/{name}: A@A needs {flops:,} multiplies, over the "
                               f"cap of {kc.SPGEMM_FLOP_CAP:,}, skipped")
                continue
            yield "spgemm", name, lambda c=coll, n=name, m=m: kc.spgemm_case(c, n, m)
    if "bsr" in want:
        for i, (r, c) in enumerate(kc.bsr_sizes(args.quick)):
            yield "bsr", f"{r}x{c}", lambda r=r, c=c, s=100 + i: kc.bsr_case(r, c, s)
    if "conv" in want:
        shapes = kc.CONV_SHAPES[1::2] if args.quick else kc.CONV_SHAPES
        for i, (cin, cout, h, w) in enumerate(shapes):
            yield "conv", f"{cin}->{cout} {h}x{w}", \
                lambda a=cin, b=cout, h=h, w=w, s=200 + i: kc.conv_case(a, b, h, w, s)


# == one case =================================================================================
def check_impls(case: kc.Case) -> tuple[str | None, dict]:
    """Call every implementation once (also its warm-up / first build) and check it against
    the float64 reference. Returns (our problem or None, {baseline: problem})."""
    ours, dropped = None, {}
    for name, fn in case.impls.items():
        try:
            problem = kc.check(fn(), case.ref, case.bound)
        except Exception as exc:  # noqa: BLE001 - recorded, never fatal
            problem = f"raised {type(exc).__name__}: {exc}"
            if name == OURS:
                problem += "\n" + traceback.format_exc(limit=8)
        if problem and name == OURS:
            ours = problem
        elif problem:
            dropped[name] = problem
    return ours, dropped


def run_case(args, case: kc.Case, report: Report, failures: list) -> dict:
    """Check, time and summarise one case as a wide row."""
    base = {"kernel": case.kernel, "group": case.group, "matrix": case.name,
            "name": short_name(case.name), **case.info}
    problem, dropped = check_impls(case)
    if problem:
        failures.append({**base, "problem": problem})
        print(f"!! FAIL {case.kernel} {case.name}: sparsetorch {problem.splitlines()[0]}",
              flush=True)
        return {**base, "check": "FAIL"}
    impls = dict(case.impls)
    for name, why in dropped.items():
        report.note(f"{case.kernel} {case.name}: baseline {name} dropped: {why.splitlines()[0]}")
        impls.pop(name)
    res = compare(impls, baseline=OURS, rounds=args.rounds, warmup=1, min_time=args.min_time,
                  max_time=args.max_time, threads=args.threads)
    med = {n: r["median_s"] for n, r in res["impls"].items()}
    ok = [n for n in kc.TORCH_CSR if med.get(n) is not None]
    best = min(ok, key=med.get) if ok else None
    w = {**base, "torch_best": best, "torch_idx": {"torch_csr32": "i32",
                                                   "torch_csr64": "i64"}.get(best, "-")}
    for n, t in med.items():
        w[f"{n}_s"] = t
    w["torch_s"] = med[best] if best else None
    w["x_torch"] = speedup(res, OURS, over=best) if best else None
    for other in ("scipy", "dense", "conv2d", "torch_bsr", "scipy_bsr"):
        if med.get(other) is not None:
            w[f"x_{other}"] = speedup(res, OURS, over=other)
    if "flop_nnz" in case.info and med.get(OURS) and med.get("dense"):
        w["gflops"] = case.info["flop_nnz"] / med[OURS] / 1e9
        w["dense_gflops"] = case.info["flop_dense"] / med["dense"] / 1e9
        w["frac_sgemm"] = w["gflops"] / w["dense_gflops"]
    w["load1"] = os.getloadavg()[0]   # 1-min load average right after timing this case
    w["spread"] = _spread(res["impls"][OURS])
    primary = best if kc.PRIMARY[case.kernel] == "torch" else kc.PRIMARY[case.kernel]
    if primary in res["impls"]:
        w["base_spread"] = _spread(res["impls"][primary])
    if max(w["spread"] or 0, w.get("base_spread") or 0) > NOISY:
        w["flag"] = "NOISY"
    if res["impls"][OURS].get("error"):
        w["check"] = "ERROR"
        failures.append({**base, "problem": res["impls"][OURS]["error"]})
    report.add(case.name, res, **{k: v for k, v in base.items() if k != "name"},
               torch_best=best, **{k: w[k] for k in RATIOS if k in w})
    return w


def _spread(r: dict) -> float | None:
    """Interquartile range over rounds as a fraction of the median."""
    return (r["q3_s"] - r["q1_s"]) / r["median_s"] if r.get("median_s") else None


def run_all(args, root, report: Report, failures: list, skipped: list) -> list:
    wide = []
    t_start = time.perf_counter()
    builders = list(case_builders(args, root, report, skipped))
    for i, (kernel, name, build) in enumerate(builders, 1):
        t0 = time.perf_counter()
        try:
            case = build()
        except Exception as exc:  # noqa: BLE001 - an input we cannot build is a failure too
            failures.append({"kernel": kernel, "matrix": name,
                             "problem": f"case setup raised {type(exc).__name__}: {exc}\n"
                             + traceback.format_exc(limit=8)})
            print(f"!! FAIL {kernel} {name}: setup raised {type(exc).__name__}: {exc}",
                  flush=True)
            continue
        w = run_case(args, case, report, failures)
        wide.append(w)
        ratio = w.get(f"x_{kc.PRIMARY[kernel]}")
        print(f"[{i}/{len(builders)}] {kernel:6s} {case.group:22s} {w['name'][:40]:40s} "
              f"{w.get('shape', ''):>11s} x_{kc.PRIMARY[kernel]}="
              f"{'-' if ratio is None else f'{ratio:.2f}'} "
              f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - t_start:.0f}s)",
              flush=True)
    return wide


# == summaries and goals ======================================================================
def summarise(wide: list) -> list:
    """Per kernel and group (and per kernel overall): geomean of every ratio, the number of
    cases, and the worst case by the kernel's primary ratio."""
    groups: dict = {}
    for w in wide:
        if w.get("check") in ("FAIL", "ERROR"):
            continue
        groups.setdefault((w["kernel"], w["group"]), []).append(w)
        groups.setdefault((w["kernel"], "all"), []).append(w)
    out = []
    for kernel in kc.KERNELS:
        names = [g for k, g in groups if k == kernel and g != "all"]
        for group in names + (["all"] if len(names) > 1 else []):
            ws = groups.get((kernel, group))
            if not ws:
                continue
            row = {"kernel": kernel, "group": group, "cases": len(ws)}
            for x in RATIOS + ("frac_sgemm",):
                vals = [w[x] for w in ws if w.get(x) is not None]
                if vals:
                    row[f"geo_{x}"] = geomean(vals)
                    row[f"min_{x}"] = min(vals)
            px = f"x_{kc.PRIMARY[kernel]}"
            have = [w for w in ws if w.get(px) is not None]
            if have:
                worst = min(have, key=lambda w: w[px])
                row["worst"] = f"{worst['name'][:32]} ({worst[px]:.2f}x {kc.PRIMARY[kernel]})"
            out.append(row)
    return out


def goal_lines(summary: list, wide: list, skipped: list) -> list:
    """Issue 4's targets next to what this run measured."""
    by = {(r["kernel"], r["group"]): r for r in summary}
    single = {}
    for r in summary:  # a kernel with one group has no "all" row: that group is the total
        single.setdefault(r["kernel"], []).append(r)
    for k, rs in single.items():
        if (k, "all") not in by and len(rs) == 1:
            by[(k, "all")] = rs[0]
    out = []

    def add(what, row, key, goal, op=">="):
        v = row.get(key) if row else None
        ok = None if v is None else (v >= goal if op == ">=" else v <= goal)
        measured = "no cases" if v is None else (f"{v:.0%}" if "frac" in key else f"{v:.2f}x")
        if row and v is not None:
            measured += f" over {row['cases']} cases"
        out.append({"what": what, "measured": measured,
                    "goal": f"{op} {goal:.0%}" if "frac" in key else f"{op} {goal:g}x",
                    "status": "n/a" if ok is None else ("ok" if ok else "MISS")})

    sp_all = by.get(("spmm", "all"))
    add("SpMM N=128 graphs+SuiteSparse: geomean vs torch.sparse CSR", sp_all, "geo_x_torch", 2)
    add("SpMM N=128 graphs+SuiteSparse: geomean vs scipy.sparse", sp_all, "geo_x_scipy", 3)
    add("SpMM N=128: slowest matrix vs torch.sparse (none slower)", sp_all, "min_x_torch", 1)
    for kernel, what in (("spmm_t", "A.T @ B"), ("spmm_grad", "A @ X and dX by autograd")):
        row = by.get((kernel, "all"))
        for lib in ("torch", "scipy"):
            add(f"{what} N=128 graphs+SuiteSparse: geomean vs {lib} (no target; info)", row,
                f"geo_x_{lib}", 1)
            if row:
                out[-1]["status"] = "info"
    for s in ("0.9", "0.7"):
        key = f"transformer/{s} N={kc.DLMC_N}"
        row = by.get(("dlmc", key))
        if s == "0.9":
            add(f"DLMC {s} SpMM N=256: geomean vs dense matmul", row, "geo_x_dense", 3)
            add(f"DLMC {s} SpMM N=256: geomean vs torch.sparse CSR", row, "geo_x_torch", 2)
            add(f"DLMC {s} SpMM: effective GFLOP/s / dense sgemm GFLOP/s (geomean)", row,
                "geo_frac_sgemm", 0.30)
        else:
            add(f"DLMC {s} SpMM N=256: geomean vs dense matmul (no slower)", row,
                "geo_x_dense", 1)
            add(f"DLMC {s} SpMM N=256: slowest case vs dense (info; goal is on geomean)", row,
                "min_x_dense", 1)
    for row in (r for r in summary if r["kernel"] == "linear" and r["group"] != "all"):
        add(f"F.linear, DLMC {row['group']}: geomean vs dense F.linear (no target; info)",
            row, "geo_x_dense", 1)
        out[-1]["status"] = "info"
    for k in kc.SDDMM_INNER:
        rows = [r for r in summary if r["kernel"] == "sddmm" and r["group"].endswith(f"k={k}")]
        vals = [w["x_torch"] for w in wide if w["kernel"] == "sddmm" and w.get("inner") == k
                and w.get("x_torch") is not None]
        row = {"cases": len(vals), "geo": geomean(vals)} if rows else None
        add(f"SDDMM DLMC masks, inner {k}: geomean vs torch.sparse.sampled_addmm", row, "geo", 2)
    sg = by.get(("spgemm", "all"))
    capped = sum(1 for s in skipped if s.startswith("spgemm") and "cap" in s)
    add(f"SpGEMM A@A SuiteSparse ({capped} over the flop cap skipped): geomean vs torch CSR@CSR",
        sg, "geo_x_torch", 1.5)
    add("SpGEMM A@A SuiteSparse: geomean vs scipy (no slower)", sg, "geo_x_scipy", 1)
    add("BSR 4x4, 90% block-sparse, N=256: geomean vs dense matmul", by.get(("bsr", "all")),
        "geo_x_dense", 3)
    cv = by.get(("conv", "all"))
    add("1x1 conv CHW, 90% sparse: geomean vs dense conv2d (no target set; info)", cv,
        "geo_x_conv2d", 1)
    if out and cv:
        out[-1]["status"] = "info"
    return out


def worst_cases(wide: list, n: int = 5) -> dict:
    """Per kernel, the ``n`` cases with the lowest primary ratio."""
    out = {}
    for kernel in kc.KERNELS:
        px = f"x_{kc.PRIMARY[kernel]}"
        ws = [w for w in wide if w["kernel"] == kernel and w.get(px) is not None]
        out[kernel] = sorted(ws, key=lambda w: w[px])[:n]
    return out


# == main =====================================================================================
COLUMNS = ["group", "name", "shape", "nnz", "density", "inner", "batch", "flops",
           "sparsetorch_s", "torch_s", "torch_idx", "scipy_s", "dense_s", "conv2d_s", "torch_bsr_s",
           "scipy_bsr_s", "x_torch", "x_scipy", "x_dense", "x_conv2d", "x_torch_bsr",
           "x_scipy_bsr", "gflops", "dense_gflops", "frac_sgemm", "spread", "base_spread",
           "load1", "flag", "check"]


def print_results(args, wide, summary, worst):
    print(f"\n== kernels: {args.threads} threads, float32; medians of interleaved rounds; "
          "x_* = their time / sparsetorch time (> 1: sparsetorch faster); torch = faster of "
          "CSR int32/int64 ==")
    for kernel in args.kernels:
        rows = [w for w in wide if w["kernel"] == kernel]
        if rows:
            print(f"\n-- {kernel} --")
            print(format_table(rows, COLUMNS))
    print("\n== geomeans per kernel and group (min_* = slowest case) ==")
    cols = ["kernel", "group", "cases"] + [f"geo_{x}" for x in RATIOS + ("frac_sgemm",)] + \
        ["min_x_torch", "min_x_dense", "worst"]
    print(format_table(summary, cols))
    print("\n== 5 worst cases per kernel (by the kernel's primary ratio) ==")
    for kernel, ws in worst.items():
        if ws:
            print(f"-- {kernel} (by x_{kc.PRIMARY[kernel]}) --")
            print(format_table(ws, ["group", "name", "shape", "nnz", "inner", "sparsetorch_s",
                                    "torch_s", "scipy_s", "dense_s", "conv2d_s", "torch_bsr_s",
                                    "x_torch", "x_scipy", "x_dense", "x_conv2d",
                                    "x_torch_bsr", "flag"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_sparse_warnings()
    torch.set_num_threads(args.threads)
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    t_all = time.perf_counter()
    report = Report("sparse kernels vs torch.sparse, scipy.sparse and dense (issue 4)",
                    meta={"argv": sys.argv[1:] if argv is None else list(argv),
                          "quick": args.quick, "kernels": args.kernels,
                          "threads": args.threads, "rounds": args.rounds,
                          "min_time": args.min_time, "max_time": args.max_time,
                          "value_dtype": "float32", "spmm_n": kc.SPMM_N, "dlmc_n": kc.DLMC_N,
                          "sddmm_inner": kc.SDDMM_INNER, "spgemm_flop_cap": kc.SPGEMM_FLOP_CAP,
                          "bsr": {"block": kc.BSR_BLOCK, "block_sparsity":
                                  kc.BSR_BLOCK_SPARSITY, "n": kc.BSR_N},
                          "conv": {"sparsity": kc.CONV_SPARSITY, "shapes": kc.CONV_SHAPES,
                                   "timed": "relu(W X + b) on every side; ours fused"},
                          "check": {"rtol": kc.RTOL, "atol_rel": kc.ATOL_REL},
                          "thread_env": {v: os.environ.get(v) for v in THREAD_VARS}})
    report.threads = args.threads
    if os.environ.get("OMP_NUM_THREADS") != str(args.threads):
        report.note(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} while --threads is "
                    f"{args.threads} (run the script directly so it can set it before torch "
                    "loads)")
    root = find_data(args.data)
    if root is None:
        report.note(f"no shared data folder found ({args.data or 'pass --data or set '}"
                    f"{'' if args.data else 'SPARSETORCH_DATA'}); every input is a generated "
                    "stand-in - these numbers are not from the real datasets")
    failures, skipped = [], []
    wide = run_all(args, root, report, failures, skipped)
    summary = summarise(wide)
    worst = worst_cases(wide)
    print_results(args, wide, summary, worst)

    try:
        load_end = os.getloadavg()[0]
    except OSError:
        load_end = None
    if load_end is not None and load_end > args.threads + 0.5 * len(os.sched_getaffinity(0)):
        report.notes.append(f"machine busy at end: 1-min load average {load_end:.2f} with this "
                            f"run using {args.threads} thread(s); treat the timings as suspect")
    print()
    for n in report.notes:
        print(f"note: {n}")
    for s in skipped:
        print(f"skipped: {s}")
    if failures:
        print(f"\n!! {len(failures)} sparsetorch result(s) WRONG or raising:")
        for f in failures:
            print(f"  {f['kernel']} {f.get('matrix')}: {f['problem'].splitlines()[0]}")

    noisy = [w for w in wide if w.get("flag") == "NOISY"]
    if noisy:
        print(f"\n{len(noisy)} of {len(wide)} case(s) NOISY (IQR over rounds > {NOISY:.0%} of "
              "the median for sparsetorch or the primary baseline): their ratios are suspect")
    goals = goal_lines(summary, wide, skipped)
    print(f"\n== goals (issue 4; {args.threads} threads, float32) ==")
    for g in goals:
        print(f"  [{g['status']:4s}] {g['what']}: {g['measured']} (goal {g['goal']})")

    out = report.to_dict()
    out["machine"]["loadavg_at_end"] = load_end
    out["meta"]["data_root"] = str(root) if root else None
    out["meta"]["wall_s"] = round(time.perf_counter() - t_all, 1)
    out.update({"cases": wide, "summary": summary, "goals": goals, "failures": failures,
                "skipped": skipped,
                "worst": {k: [w["matrix"] for w in ws] for k, ws in worst.items()},
                "sparsetorch_file": st.__file__})
    default = RESULTS / ("kernels-quick.json" if args.quick else "kernels.json")
    path = write_json_atomic(args.out or default, out)
    print(f"\nwrote {path} ({out['meta']['wall_s']}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
