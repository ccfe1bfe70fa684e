#!/usr/bin/env python
"""The sparse tensor compiler, measured (issue 3, "Measure"): compile cost, cold C build,
warm call overhead, and SpMV / SpMM / SDDMM / SpGEMM on the shared SuiteSparse and DLMC data
against torch.sparse (CSR with int32 and int64 indices, the faster per case; COO), scipy.sparse
and dense torch.matmul.

    python benchmarks/compiler.py                  # full run, ~5-8 minutes on 2 cores
    python benchmarks/compiler.py --quick          # smoke run, < 2 minutes
    python benchmarks/compiler.py --threads 1 --out /tmp/compiler.json --data ../shared/data
    python benchmarks/compiler.py --skip-kernels   # compile cost / build / overhead only

Sections
  compile    ``codegen.kernel.compile_kernel`` (schedule + lower + render C) with its memo
             cleared, median over repeats, for SpMV, SpMM, SDDMM, SpGEMM, MTTKRP, A*B+C,
             relu(A-B) (goal: < 5 ms each). Also the memo-hit cost.
  build      cold first call in a fresh ``SPARSETORCH_CACHE`` with every in-process memo
             cleared: ``runtime.stats()['build_seconds']`` (the ``cc`` run; goal < 0.5 s) and
             first call minus warm call (compile + build + dlopen).
  overhead   warm call on a tiny SpMM (8x8 CSR, 6 nnz, times 8x4 dense): st.einsum vs
             torch.sparse.mm / ``@`` on CSR (goal: <= 20 us; torch ~9 us).
  kernels    every real/integer/pattern SuiteSparse matrix (complex ones skipped) and a spread
             of DLMC matrices (transformer 0.7/0.9/0.98, rn50 0.8/0.98; ~10 per folder, chosen
             to cover each folder's shapes). SpMV ``ij,j->i``; SpMM ``ij,jk->ik`` with a dense
             K x 128 operand; SDDMM ``ij,ik,jk->ij`` on the matrix's pattern (ones) with inner
             dimension 64 (SuiteSparse) / 128 (DLMC), against ``torch.sparse.sampled_addmm``;
             SpGEMM ``A @ A`` on square matrices (capped by multiply count). float32.

Every case is checked once before it is timed: each implementation's result is compared with
a float64 scipy reference under a rounding bound (|out - ref| <= (L+2) eps32 (|A| |B|), L the
reduction length), so the check is strict yet never trips on summation order. A wrong
sparsetorch result is reported as FAIL, is not timed, and makes the script exit with status 1
(after writing the JSON). A baseline that disagrees is dropped from that case with a note.

Timing: ``sparsetorch.bench.compare`` interleaves implementations round by round in one
process (rotating order), batching fast calls to >= --min-time per sample; ratios are medians
of per-round ratios. ``x_torch`` = torch.sparse CSR time / sparsetorch time (> 1: we are
faster), against whichever of the int32 / int64 torch CSR was faster for that case;
``x_scipy`` likewise (scipy is single-threaded). Cases where sparsetorch is more than 2x slower
than torch.sparse are flagged ``SLOW``. Threads are pinned (torch, MKL and the generated
kernels all follow ``torch.set_num_threads``; default 2). The machine's load average is
recorded at start and end: a run taken while something else loads the machine is void.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import sparsetorch as st
from sparsetorch.bench import Report, compare, find_data, format_table, geomean, speedup
from sparsetorch.bench.harness import quiet_sparse_warnings, write_json_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inputs import (canonical, select_dlmc, select_suitesparse, short_name,  # noqa: E402
                     to_host, torch_coo, torch_csr)

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = ("spmv", "spmm", "sddmm", "spgemm")
SPMM_N = 128
SDDMM_K = {"suitesparse": 64, "dlmc": 128}
OURS = "sparsetorch"
TORCH_CSR = ("torch_csr32", "torch_csr64")
EPS32 = float(np.finfo(np.float32).eps)
DENSE_LIMIT = 1 << 25          # largest rows*cols for the dense torch.matmul reference
GATHER_LIMIT = 1 << 24         # largest nnz*K for the gather-based SDDMM reference
SPGEMM_FLOP_CAP = 20_000_000   # largest multiply count of A @ A we time
COO_SPGEMM_NNZ_CAP = 100_000   # torch COO SpGEMM only up to this nnz ("where cheap")
SLOW = 0.5                     # x_torch below this: more than 2x slower than torch.sparse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few matrices and rounds (< 2 min)")
    p.add_argument("--threads", type=int, default=2, help="threads for every library (2)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/compiler.json)")
    p.add_argument("--data", default=None, help="shared data folder (default ../shared/data)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per case (7; 5 quick)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds per timed sample; faster calls are batched (2e-3)")
    p.add_argument("--max-time", type=float, default=None,
                   help="time budget per case in seconds, never fewer than 3 rounds "
                   "(1.2; 0.6 quick)")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--dlmc-per-dir", type=int, default=None,
                   help="DLMC matrices per folder (10; 2 quick)")
    p.add_argument("--wait-idle", type=float, default=0,
                   help="wait up to this many seconds for the machine to go idle (1-min load "
                   "average < 0.5 per core) before starting (default: do not wait)")
    p.add_argument("--skip-kernels", action="store_true",
                   help="only the compile / build / overhead sections")
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    bad = set(args.kernels) - set(KERNELS)
    if bad:
        p.error(f"unknown kernels {sorted(bad)}; choose from {KERNELS}")
    q = args.quick
    args.rounds = args.rounds or (5 if q else 7)
    args.min_time = args.min_time if args.min_time is not None else 2e-3
    args.max_time = args.max_time if args.max_time is not None else (0.6 if q else 1.2)
    args.dlmc_per_dir = args.dlmc_per_dir or (2 if q else 10)
    return args


# == correctness ==============================================================================
def violation(out, ref, bound, red_len: int) -> tuple[float, str]:
    """How far ``out`` is outside the rounding bound around ``ref`` (<= 0: correct), and a
    short description. The bound is (red_len + 2) * eps32 * ``bound`` elementwise, with
    ``bound`` the same product over absolute values: no summation order can exceed it."""
    tol = (red_len + 2) * EPS32
    if getattr(out, "shape", None) != ref.shape:
        return math.inf, f"shape {getattr(out, 'shape', None)} != {ref.shape}"
    if sp.issparse(ref):
        if not sp.issparse(out):
            out = sp.csr_array(out)
        err = abs(out - ref)
        excess = err - tol * bound
        worst = float(excess.max()) if excess.nnz else 0.0
        maxerr = float(err.max()) if err.nnz else 0.0
    else:
        if sp.issparse(out):
            out = out.toarray()
        err = np.abs(out - ref)
        excess = err - tol * bound
        worst = float(excess.max()) if excess.size else 0.0
        maxerr = float(err.max()) if err.size else 0.0
    if not math.isfinite(worst):
        return math.inf, "non-finite values"
    return worst, f"max |err| {maxerr:.3g}"


def check_case(impls: dict, ref, bound, red_len: int):
    """Run every implementation once; return (ours_problem, {baseline: problem})."""
    ours_problem, dropped = None, {}
    for name, fn in impls.items():
        try:
            out = to_host(fn())
            worst, what = violation(out, ref, bound, red_len)
            problem = None if worst <= 1e-30 else \
                f"wrong result ({what}, beyond the rounding bound by {worst:.3g})"
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            problem = f"raised {type(exc).__name__}: {exc}"
            if name == OURS:
                problem += "\n" + traceback.format_exc(limit=6)
        if problem:
            if name == OURS:
                ours_problem = problem
            else:
                dropped[name] = problem
    return ours_problem, dropped


# == cases ====================================================================================
def make_case(kernel: str, m: sp.csr_array, coll: str, seed: int):
    """(impls, ref, bound, reduction length, info) for one kernel on ``m``, or None when it
    does not apply (SpGEMM on a non-square matrix or one over the multiply cap)."""
    rng = torch.Generator().manual_seed(seed)
    M, K = m.shape
    m64 = sp.csr_array(m).astype(np.float64)
    a64 = abs(m64)
    row_len = int(np.diff(m.indptr).max()) if m.nnz else 0
    info = {}
    if kernel == "spgemm":
        if M != K:
            return None
        flops = int(np.diff(m.indptr)[m.indices].sum())
        info["flops"] = flops
        if flops > SPGEMM_FLOP_CAP:
            return "over cap"
    A = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    impls = {}
    if kernel in ("spmv", "spmm"):
        B = torch.randn((K,) if kernel == "spmv" else (K, SPMM_N), generator=rng)
        Bn = B.numpy()
        eq = "ij,j->i" if kernel == "spmv" else "ij,jk->ik"
        C = torch_coo(m)
        impls = {OURS: lambda: st.einsum(eq, A, B),
                 "torch_csr32": lambda: T32 @ B, "torch_csr64": lambda: T64 @ B,
                 "torch_coo": lambda: C @ B, "scipy": lambda: m @ Bn}
        if kernel == "spmm" and M * K <= DENSE_LIMIT:
            D = torch.from_numpy(m.toarray())
            impls["dense"] = lambda: torch.matmul(D, B)
        B64 = Bn.astype(np.float64)
        ref, bound = m64 @ B64, a64 @ np.abs(B64)
        return impls, ref, bound, row_len, info
    if kernel == "sddmm":
        kd = SDDMM_K[coll]
        pattern = canonical(m.indptr, m.indices, np.ones(m.nnz, np.float32), m.shape)
        mask = st.tensor(pattern, format="csr")
        P32, P64 = torch_csr(pattern, np.int32), torch_csr(pattern, np.int64)
        X = torch.randn(M, kd, generator=rng)
        Y = torch.randn(K, kd, generator=rng)
        Yt = Y.t()  # a (kd, K) view whose columns are Y's rows: what sampled_addmm wants
        impls = {OURS: lambda: st.einsum("ij,ik,jk->ij", mask, X, Y),
                 "torch_csr32": lambda: torch.sparse.sampled_addmm(P32, X, Yt, beta=0.0),
                 "torch_csr64": lambda: torch.sparse.sampled_addmm(P64, X, Yt, beta=0.0)}
        if m.nnz * kd <= GATHER_LIMIT:
            rows = torch.from_numpy(np.repeat(np.arange(M), np.diff(pattern.indptr)))
            cols = torch.from_numpy(pattern.indices.astype(np.int64))
            impls["torch_gather"] = lambda: torch.sparse_csr_tensor(
                P64.crow_indices(), P64.col_indices(), (X[rows] * Y[cols]).sum(1), (M, K))
        r = np.repeat(np.arange(M), np.diff(pattern.indptr))
        c = pattern.indices
        X64, Y64 = X.numpy().astype(np.float64), Y.numpy().astype(np.float64)
        vals = np.einsum("nk,nk->n", X64[r], Y64[c]) if m.nnz else np.zeros(0)
        absv = np.einsum("nk,nk->n", np.abs(X64[r]), np.abs(Y64[c])) if m.nnz else np.zeros(0)
        ref = sp.csr_array((vals, pattern.indices, pattern.indptr), shape=m.shape)
        bound = sp.csr_array((absv, pattern.indices, pattern.indptr), shape=m.shape)
        info["inner"] = kd
        return impls, ref, bound, kd, info
    if kernel == "spgemm":
        impls = {OURS: lambda: st.einsum("ij,jk->ik", A, A),
                 "torch_csr32": lambda: T32 @ T32, "torch_csr64": lambda: T64 @ T64,
                 "scipy": lambda: m @ m}
        if m.nnz <= COO_SPGEMM_NNZ_CAP:
            C = torch_coo(m)
            impls["torch_coo"] = lambda: C @ C
        return impls, sp.csr_array(m64 @ m64), sp.csr_array(a64 @ a64), row_len, info
    raise ValueError(kernel)


def best_torch(res: dict) -> str | None:
    """The faster of torch CSR int32 / int64 for this case (by median)."""
    ok = [(res["impls"][n]["median_s"], n) for n in TORCH_CSR
          if n in res["impls"] and res["impls"][n]["median_s"] is not None]
    return min(ok)[1] if ok else None


def run_kernels(args, report: Report, root: Path | None, failures: list, skipped: list):
    wide = []
    if root is None:
        report.note("no shared data folder found (pass --data or set SPARSETORCH_DATA); "
                    "kernel section skipped")
        return wide
    mats = select_suitesparse(root, args.quick, skipped) + select_dlmc(root, args.dlmc_per_dir)
    t_start = time.perf_counter()
    for i, (coll, name, load) in enumerate(mats, 1):
        t0 = time.perf_counter()
        m = load()
        shape = f"{m.shape[0]}x{m.shape[1]}"
        for kernel in args.kernels:
            seed = i * 10 + KERNELS.index(kernel)
            made = make_case(kernel, m, coll, seed)
            if made is None:
                continue
            if made == "over cap":
                skipped.append(f"{coll}/{name} spgemm: A@A multiply count over "
                               f"{SPGEMM_FLOP_CAP:,}, skipped")
                continue
            impls, ref, bound, red_len, info = made
            base = {"collection": coll, "matrix": name, "kernel": kernel, "shape": shape,
                    "nnz": int(m.nnz), **info}
            problem, dropped = check_case(impls, ref, bound, red_len)
            if problem:
                failures.append({**base, "problem": problem})
                print(f"!! FAIL {coll}/{name} {kernel}: sparsetorch {problem}", flush=True)
                wide.append({**base, "name": short_name(name), "check": "FAIL"})
                continue
            for n, why in dropped.items():
                report.note(f"{coll}/{name} {kernel}: baseline {n} dropped: {why}")
                impls.pop(n)
            res = compare(impls, baseline=OURS, rounds=args.rounds, warmup=1,
                          min_time=args.min_time, max_time=args.max_time, threads=args.threads)
            bt = best_torch(res)
            ratios = {"x_torch": speedup(res, OURS, over=bt) if bt else None}
            for other in ("scipy", "torch_coo", "dense", "torch_gather"):
                if other in res["impls"] and res["impls"][other]["median_s"] is not None:
                    ratios[f"x_{other}"] = speedup(res, OURS, over=other)
            report.add(name, res, **base, torch_best=bt, **ratios)
            w = {**base, "name": short_name(name), "torch_best": bt, **ratios}
            for n, r in res["impls"].items():
                w[f"{n}_s"] = r["median_s"]
            w["torch_s"] = res["impls"][bt]["median_s"] if bt else None
            w["torch_idx"] = {"torch_csr32": "i32", "torch_csr64": "i64"}.get(bt, "-")
            if ratios["x_torch"] is not None and ratios["x_torch"] < SLOW:
                w["flag"] = "SLOW"
            if res["impls"][OURS].get("error"):
                w["check"] = "ERROR"
                failures.append({**base, "problem": res["impls"][OURS]["error"]})
            wide.append(w)
        print(f"[{i}/{len(mats)}] {coll}/{name} {shape} nnz={m.nnz} "
              f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - t_start:.0f}s)",
              flush=True)
    return wide


def summarise(wide: list) -> list:
    """Per kernel (per collection and overall): median and geomean of x_torch / x_scipy,
    the number of cases > 2x slower than torch.sparse, and the worst case."""
    out = []
    groups: dict = {}
    for w in wide:
        if w.get("x_torch") is None:
            continue
        groups.setdefault((w["kernel"], w["collection"]), []).append(w)
        groups.setdefault((w["kernel"], "all"), []).append(w)
    for kernel in KERNELS:
        for coll in ("suitesparse", "dlmc", "all"):
            ws = groups.get((kernel, coll))
            if not ws:
                continue
            xt = [w["x_torch"] for w in ws]
            xs = [w["x_scipy"] for w in ws if w.get("x_scipy") is not None]
            worst = min(ws, key=lambda w: w["x_torch"])
            out.append({"kernel": kernel, "collection": coll, "cases": len(ws),
                        "median_x_torch": statistics.median(xt), "geomean_x_torch": geomean(xt),
                        "median_x_scipy": statistics.median(xs) if xs else None,
                        "geomean_x_scipy": geomean(xs) if xs else None,
                        "slow_2x": sum(x < SLOW for x in xt),
                        "faster": sum(x > 1 for x in xt),
                        "worst": f"{short_name(worst['matrix'])} ({worst['x_torch']:.3g}x)"})
    return out


# == compile cost, cold build, warm overhead ==================================================
def expressions():
    """name -> (thunk evaluating it, (assignment, operands)) on small operands."""
    from sparsetorch.compiler.notation import parse_einsum

    g = torch.Generator().manual_seed(0)

    def sparse(*shape, density=0.05, fmt="csr"):
        d = torch.rand(*shape, generator=g)
        d = torch.where(torch.rand(*shape, generator=g) < density, d, torch.zeros(()))
        return st.tensor(d, format=fmt)

    A, A2, A3 = sparse(64, 48), sparse(64, 48), sparse(64, 48)
    S = sparse(64, 64)
    T = sparse(16, 12, 10, density=0.1, fmt="csf")
    x, B = torch.randn(48, generator=g), torch.randn(48, 16, generator=g)
    X, Y = torch.randn(64, 8, generator=g), torch.randn(48, 8, generator=g)
    U, V = torch.randn(12, 8, generator=g), torch.randn(10, 8, generator=g)
    out = {}
    for name, eq, ops in [("spmv", "ij,j->i", (A, x)), ("spmm", "ij,jk->ik", (A, B)),
                          ("sddmm", "ij,ik,jk->ij", (A, X, Y)), ("spgemm", "ij,jk->ik", (S, S)),
                          ("mttkrp", "ikl,kj,lj->ij", (T, U, V))]:
        out[name] = (lambda eq=eq, ops=ops: st.einsum(eq, *ops),
                     (parse_einsum(eq, [t.dim() for t in ops]), ops))
    e1 = st.lazy(A) * st.lazy(A2) + st.lazy(A3)
    e2 = st.relu(st.lazy(A) - st.lazy(A2))
    out["A*B+C"] = (e1.eval, (e1.assignment(), e1.operands))
    out["relu(A-B)"] = (e2.eval, (e2.assignment(), e2.operands))
    return out


def compile_args(assignment, operands):
    """The arguments ``ops.execute.get_kernel`` passes to ``compile_kernel``."""
    from sparsetorch.ops.execute import _DTYPE_NAMES, normalize_operands

    tensors, infos, dtype, _ = normalize_operands(operands, "bench")
    index = tuple("int32" if isinstance(t, st.SparseTensor) and t.index_dtype == torch.int32
                  else "int64" for t in tensors)
    return assignment, infos, _DTYPE_NAMES[dtype], index, None


def forget_everything():
    """Drop every in-process memo so the next call schedules, builds and loads again."""
    from sparsetorch.codegen.kernel import compile_kernel
    from sparsetorch.ops import execute

    compile_kernel.cache_clear()
    prepared = getattr(execute, "_PREPARED", None)
    if prepared is not None:
        prepared.clear()
    st.runtime.clear_cache(disk=False)


def run_compile(args, exprs) -> list:
    from sparsetorch.codegen.kernel import compile_kernel

    reps = 10 if args.quick else 30
    rows = []
    for name, (_, (assignment, operands)) in exprs.items():
        row = {"expr": name, "assignment": str(assignment)}
        try:
            cargs = compile_args(assignment, operands)
            ts = []
            for _ in range(reps):
                compile_kernel.cache_clear()
                t0 = time.perf_counter()
                k = compile_kernel(*cargs)
                ts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(1000):
                compile_kernel(*cargs)
            row.update(compile_median_s=statistics.median(ts), compile_min_s=min(ts),
                       compile_max_s=max(ts), repeats=reps,
                       memo_hit_s=(time.perf_counter() - t0) / 1000,
                       loop_order=",".join(k.schedule.order), output=k.output.kind,
                       source_lines=k.source.count("\n"))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def run_build(args, exprs) -> tuple[list, dict]:
    """Cold first call per expression in fresh cache folders (median over repeats)."""
    reps = 1 if args.quick else 3
    rows = []
    old = os.environ.get("SPARSETORCH_CACHE")
    with tempfile.TemporaryDirectory(prefix="st-bench-cache-") as tmp:
        try:
            # The first build in a process also probes the toolchain (cc --version, OpenMP,
            # /proc/cpuinfo): report it apart so it does not inflate the first expression.
            os.environ["SPARSETORCH_CACHE"] = os.path.join(tmp, "probe")
            forget_everything()
            st.runtime.reset_stats()
            t0 = time.perf_counter()
            exprs["spmv"][0]()
            probe = {"first_call_in_process_s": time.perf_counter() - t0,
                     "build_seconds": st.runtime.stats()["build_seconds"]}
            for name, (thunk, _) in exprs.items():
                cold, build, warm, builds = [], [], [], []
                for r in range(reps):
                    os.environ["SPARSETORCH_CACHE"] = os.path.join(tmp, f"{name}-{r}")
                    forget_everything()
                    st.runtime.reset_stats()
                    t0 = time.perf_counter()
                    thunk()
                    t1 = time.perf_counter()
                    s = st.runtime.stats()
                    t2 = time.perf_counter()
                    for _ in range(10):
                        thunk()
                    t3 = time.perf_counter()
                    cold.append(t1 - t0)
                    warm.append((t3 - t2) / 10)
                    build.append(s["build_seconds"] / max(1, s["builds"]))
                    builds.append(s["builds"])
                rows.append({"expr": name, "cold_first_call_s": statistics.median(cold),
                             "warm_call_s": statistics.median(warm),
                             "cold_minus_warm_s": statistics.median(
                                 c - w for c, w in zip(cold, warm)),
                             "build_s": statistics.median(build),
                             "builds_per_call": max(builds), "repeats": reps})
        finally:
            if old is None:
                os.environ.pop("SPARSETORCH_CACHE", None)
            else:
                os.environ["SPARSETORCH_CACHE"] = old
            forget_everything()
    return rows, probe


def run_overhead(args, threads: int) -> dict:
    """Warm call on a tiny SpMM: 8x8 CSR with 6 nonzeros times an 8x4 dense matrix."""
    d = torch.zeros(8, 8)
    for (i, j), v in zip([(0, 1), (1, 5), (3, 3), (5, 0), (6, 2), (7, 7)], range(1, 7)):
        d[i, j] = float(v)
    A = st.tensor(d, format="csr")
    B = torch.randn(8, 4)
    T64 = d.to_sparse_csr()
    m = sp.csr_array(d.numpy())
    T32 = torch_csr(canonical(m.indptr, m.indices, m.data, m.shape), np.int32)
    impls = {OURS: lambda: st.einsum("ij,jk->ik", A, B),
             "torch.sparse.mm(csr64)": lambda: torch.sparse.mm(T64, B),
             "torch csr64 @": lambda: T64 @ B,
             "torch csr32 @": lambda: T32 @ B,
             "scipy": lambda: m @ B.numpy(),
             "dense torch.matmul": lambda: torch.matmul(d, B)}
    ref = d.double() @ B.double()
    for name, fn in impls.items():
        got = torch.as_tensor(fn()).double()
        if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"tiny SpMM: {name} gives a wrong result")
    res = compare(impls, baseline="torch.sparse.mm(csr64)", rounds=15 if not args.quick else 7,
                  warmup=2, min_time=0.02, threads=threads)
    return {n: {"median_s": r["median_s"], "q1_s": r["q1_s"], "q3_s": r["q3_s"],
                "x_vs_torch_sparse_mm": r["speedup"]} for n, r in res["impls"].items()}


# == main =====================================================================================
def goal_lines(comp_rows, build_rows, overhead, summary, threads) -> list:
    """The issue's goals next to what this run measured."""
    out = []

    def add(what, measured, goal, ok):
        out.append({"what": what, "measured": measured, "goal": goal,
                    "status": "n/a" if ok is None else ("ok" if ok else "MISS")})

    comp = [r["compile_median_s"] for r in comp_rows if r.get("compile_median_s") is not None]
    if comp:
        worst = max(comp_rows, key=lambda r: r.get("compile_median_s") or 0)
        add("compile (schedule+lower+render), slowest expression median",
            f"{worst['compile_median_s'] * 1e3:.2f} ms ({worst['expr']})", "< 5 ms",
            worst["compile_median_s"] < 5e-3)
    if build_rows:
        worst = max(build_rows, key=lambda r: r["build_s"])
        add("cold C build, slowest expression", f"{worst['build_s']:.3f} s ({worst['expr']})",
            "< 0.5 s", worst["build_s"] < 0.5)
    for key, res in overhead.items():
        ours, torch_mm = res[OURS]["median_s"], res["torch.sparse.mm(csr64)"]["median_s"]
        add(f"warm call, tiny SpMM, {key}",
            f"{ours * 1e6:.1f} us (torch.sparse.mm {torch_mm * 1e6:.1f} us)", "<= 20 us",
            ours <= 20e-6)
    for row in summary:
        if row["collection"] != "all":
            continue
        if row["kernel"] in ("spmv", "spmm"):
            add(f"{row['kernel']}: median x_torch over {row['cases']} cases",
                f"{row['median_x_torch']:.2f}x", ">= 1.0x", row["median_x_torch"] >= 1.0)
        add(f"{row['kernel']}: cases > 2x slower than torch.sparse",
            f"{row['slow_2x']} (worst {row['worst']})", "0",
            row["slow_2x"] == 0 if row["kernel"] in ("spmv", "spmm") else None)
    return out


def wait_idle(limit_s: float) -> None:
    cores = len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    while os.getloadavg()[0] > 0.5 * cores and time.perf_counter() - t0 < limit_s:
        print(f"waiting for an idle machine: load {os.getloadavg()[0]:.2f} on {cores} cores",
              flush=True)
        time.sleep(15)


def fmt_us(s):
    return "-" if s is None else f"{s * 1e6:.1f}us"


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_sparse_warnings()
    torch.set_num_threads(args.threads)
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    t_all = time.perf_counter()
    report = Report("sparse tensor compiler: compile cost, build, overhead, kernels",
                    meta={"argv": sys.argv[1:], "threads": args.threads, "rounds": args.rounds,
                          "min_time": args.min_time, "max_time": args.max_time,
                          "spmm_n": SPMM_N, "sddmm_k": SDDMM_K, "value_dtype": "float32",
                          "spgemm_flop_cap": SPGEMM_FLOP_CAP, "dense_limit": DENSE_LIMIT})
    report.threads = args.threads
    failures, skipped = [], []

    exprs = expressions()
    print("== compile cost (schedule + lower + render; memo cleared) ==", flush=True)
    build_rows, probe = run_build(args, exprs)   # first: the process has built nothing yet
    comp_rows = run_compile(args, exprs)
    by = {r["expr"]: r for r in build_rows}
    table = []
    for r in comp_rows:
        b = by.get(r["expr"], {})
        table.append({"expr": r["expr"], "compile_median_s": r.get("compile_median_s"),
                      "compile_max_s": r.get("compile_max_s"), "memo_hit_s": r.get("memo_hit_s"),
                      "build_s": b.get("build_s"), "cold_first_call_s": b.get("cold_first_call_s"),
                      "warm_call_s": b.get("warm_call_s"), "order": r.get("loop_order"),
                      "error": r.get("error", "")})
    print(format_table(table, ["expr", "order", "compile_median_s", "compile_max_s",
                               "memo_hit_s", "build_s", "cold_first_call_s", "warm_call_s",
                               "error"]))
    print(f"first call in process (toolchain probe + compile + build): "
          f"{probe['first_call_in_process_s']:.3f}s (cc: {probe['build_seconds']:.3f}s)")

    print("\n== warm call overhead, tiny SpMM (8x8 CSR, 6 nnz) x (8x4) ==", flush=True)
    overhead = {}
    for nt in sorted({1, args.threads}):
        overhead[f"threads={nt}"] = run_overhead(args, nt)
    names = list(next(iter(overhead.values())))
    print(format_table([{"impl": n, **{f"{k}_s": v[n]["median_s"] for k, v in overhead.items()},
                         **{f"x_{k}": v[n]["x_vs_torch_sparse_mm"] for k, v in overhead.items()}}
                        for n in names],
                       ["impl"] + [f"{k}_s" for k in overhead] + [f"x_{k}" for k in overhead]))
    print("(x_threads=N: torch.sparse.mm(csr64) time / this time; > 1 means faster)")

    wide = []
    if not args.skip_kernels:
        print("\n== kernels ==", flush=True)
        wide = run_kernels(args, report, find_data(args.data), failures, skipped)
    summary = summarise(wide)

    if wide:
        print(f"\n== kernels: {args.threads} threads; medians of interleaved rounds; x_* = "
              "their time / sparsetorch time (> 1: sparsetorch faster); torch = faster of "
              "CSR int32/int64 ==")
        for kernel in args.kernels:
            rows = [w for w in wide if w["kernel"] == kernel]
            if rows:
                print(f"\n-- {kernel} --")
                print(format_table(rows, ["name", "shape", "nnz", "flops", "sparsetorch_s",
                                          "torch_s", "torch_idx", "scipy_s", "torch_coo_s",
                                          "dense_s", "torch_gather_s", "x_torch", "x_scipy",
                                          "flag", "check"]))
        print("\n== summary per kernel (x_torch vs torch.sparse CSR best of int32/int64; "
              "x_scipy vs scipy.sparse) ==")
        print(format_table(summary, ["kernel", "collection", "cases", "median_x_torch",
                                     "geomean_x_torch", "median_x_scipy", "geomean_x_scipy",
                                     "faster", "slow_2x", "worst"]))
        slow = [w for w in wide if w.get("flag") == "SLOW"]
        if slow:
            print(f"\n{len(slow)} case(s) more than 2x slower than torch.sparse:")
            for w in sorted(slow, key=lambda w: w["x_torch"]):
                print(f"  {w['kernel']:7s} {w['collection']}/{w['name']} {w['shape']} "
                      f"nnz={w['nnz']}: x_torch {w['x_torch']:.2f}x "
                      f"(ours {fmt_us(w['sparsetorch_s'])}, torch {fmt_us(w['torch_s'])})")
    for s in skipped:
        report.notes.append(s)
    try:
        load_end = os.getloadavg()[0]
    except OSError:
        load_end = None
    # This run itself keeps up to --threads cores busy: only load beyond that is someone else.
    if load_end is not None and load_end > args.threads + 0.5 * len(os.sched_getaffinity(0)):
        report.notes.append(f"machine busy at end: 1-min load average {load_end:.2f} with this "
                            f"run using {args.threads} thread(s); other processes were likely "
                            "running, so treat the timings as suspect")
    print()
    for n in report.notes:
        if not n.endswith("skipped"):
            print(f"note: {n}")
    if skipped:
        print(f"note: {len(skipped)} case(s) skipped (complex values, non-square or over the "
              "SpGEMM cap): see 'skipped' in the JSON")
    if failures:
        print(f"\n!! {len(failures)} sparsetorch result(s) WRONG or raising:")
        for f in failures:
            print(f"  {f['kernel']} {f['collection']}/{short_name(f['matrix'])}: "
                  f"{f['problem'].splitlines()[0]}")

    goals = goal_lines(comp_rows, build_rows, overhead, summary, args.threads)
    print("\n== goals (issue 3) ==")
    for g in goals:
        print(f"  [{g['status']:4s}] {g['what']}: {g['measured']} (goal {g['goal']})")

    out = report.to_dict()
    out["machine"]["loadavg_at_end"] = load_end
    out["meta"]["wall_s"] = round(time.perf_counter() - t_all, 1)
    out.update({"compile": comp_rows, "build": build_rows, "first_call_in_process": probe,
                "overhead_tiny_spmm": overhead, "cases": wide, "summary": summary,
                "failures": failures, "skipped": skipped, "goals": goals,
                "sparsetorch_file": st.__file__})
    path = write_json_atomic(args.out or RESULTS / "compiler.json", out)
    print(f"\nwrote {path} ({out['meta']['wall_s']}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
