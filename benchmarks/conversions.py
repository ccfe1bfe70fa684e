#!/usr/bin/env python
"""Format conversions: sparsetorch vs scipy.sparse vs torch.sparse, side by side.

Ops (each library starts from its own native object, built outside the timed call):
  csr->csc, csr->coo    A.asformat(...)       | m.tocsc()/tocoo()   | T.to_sparse_csc()/coo()
  coo->csr              st.tensor((idx, v))   | coo_array(...).tocsr() | sparse_coo_tensor(...).to_sparse_csr()
                        from raw COO arrays, shuffled, with ~10% duplicate entries (summed)
  dense->csr, csr->dense  only when rows*cols <= --dense-limit (dense copies must stay moderate)
  from_scipy            st.tensor(m)          | m.copy() (memcpy reference) | torch.sparse_csr_tensor
                        over the scipy arrays (zero-copy, no validation: a lower bound)

Matrices: SuiteSparse (largest by nnz), DLMC (largest of each pruning level) and a generated
uniform random matrix with 10M nonzeros (1M with --quick). Outputs are checked against scipy
once per case (that call doubles as warm-up) before anything is timed.

    python benchmarks/conversions.py            # default run, ~2-3 minutes
    python benchmarks/conversions.py --quick    # ~30 s smoke run
    python benchmarks/conversions.py --all --threads 1 --out /tmp/conv.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sp
import torch

import sparsetorch as st
from sparsetorch.bench import (Report, compare, find_data, format_table, geomean,
                               load_or_generate, speedup)
from sparsetorch.bench.harness import quiet_sparse_warnings

OPS = ["csr->csc", "csr->coo", "coo->csr", "dense->csr", "csr->dense", "from_scipy"]
IMPLS = ["sparsetorch", "scipy", "torch"]
RESULTS = Path(__file__).resolve().parent / "results"
DLMC_DIRS = ["transformer/magnitude_pruning/0.7", "transformer/magnitude_pruning/0.9",
             "transformer/magnitude_pruning/0.98", "rn50/magnitude_pruning/0.8",
             "rn50/magnitude_pruning/0.9", "rn50/magnitude_pruning/0.98"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few matrices, 1M-nnz generated one")
    p.add_argument("--all", action="store_true", help="every SuiteSparse and DLMC file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's current setting, e.g. OMP_NUM_THREADS)")
    p.add_argument("--data", default=None, help="shared data folder (default: ../shared/data)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/"
                   "conversions-<UTC time>.json)")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run only matrices whose 'collection/name' matches, e.g. 'bayer|generated'")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per case")
    p.add_argument("--big-nnz", type=int, default=None,
                   help="nonzeros of the generated matrix (default 10M, 1M with --quick)")
    p.add_argument("--dense-limit", type=int, default=1 << 24,
                   help="largest rows*cols for the dense ops (default 16M elements, 64 MiB)")
    return p.parse_args(argv)


# -- data ------------------------------------------------------------------------------------
def load_mtx(path: Path) -> sp.csr_array:
    """A Matrix Market file as float32 CSR (pattern -> ones; complex -> real part)."""
    try:
        m = st.io.read_mtx(path, dtype=torch.float32).to_scipy()
    except TypeError:  # complex: st.io rejects it by design; benchmark the real part
        m = sp.csr_array(scipy.io.mmread(str(path)).real.astype(np.float32))
    return _canonical(m.indptr, m.indices, m.data, m.shape)


def load_smtx(path: Path, seed: int = 0) -> sp.csr_array:
    """A DLMC ``.smtx.gz`` pattern as float32 CSR with standard-normal values."""
    m = st.io.read_smtx(path, values="normal", seed=seed).to_scipy()
    return _canonical(m.indptr, m.indices, m.data, m.shape)


def random_csr(rows: int, cols: int, nnz: int, seed: int = 0) -> sp.csr_array:
    """Uniform random float32 CSR with about ``nnz`` entries (duplicates merged)."""
    rng = np.random.default_rng(seed)
    r = rng.integers(0, rows, nnz, dtype=np.int64)
    c = rng.integers(0, cols, nnz, dtype=np.int64)
    m = sp.csr_array((rng.standard_normal(nnz).astype(np.float32), (r, c)), shape=(rows, cols))
    m.sum_duplicates()
    return _canonical(m.indptr, m.indices, m.data, m.shape)


def _canonical(indptr, indices, data, shape) -> sp.csr_array:
    # int32 indices, sorted, no duplicates: the form scipy itself produces for these sizes.
    m = sp.csr_array((data, indices.astype(np.int32), indptr.astype(np.int32)), shape=shape)
    m.sum_duplicates()
    m.sort_indices()
    return m


def select_matrices(root: Path | None, args):
    """Yield ``(collection, name, load, generate)``; ``generate`` makes a same-sized random
    stand-in when the file is missing."""
    n_ss, per_dlmc = (3, 1) if args.quick else (8, 1)
    ss_dir = root / "suitesparse" / "mtx" if root else None
    files = sorted(ss_dir.glob("*.mtx")) if ss_dir and ss_dir.is_dir() else []
    files.sort(key=lambda f: -st.io.read_mtx_header(f).entries)  # largest first
    if not args.all:
        files = files[:n_ss]
    if not files:  # no data: stand-ins sized like the largest real ones
        for name, (n, nnz) in {"Grund__bayer10": (13436, 94926),
                               "HB__bcsstk13": (2003, 83883),
                               "Rajat__rajat01": (6833, 43250)}.items():
            yield ("suitesparse", name, _missing(ss_dir, name),
                   lambda n=n, nnz=nnz: random_csr(n, n, nnz, 1))
    for f in files:
        yield "suitesparse", f.stem, lambda f=f: load_mtx(f), None
    dl_root = root / "dlmc" if root else None
    dirs = DLMC_DIRS[::3] if args.quick else DLMC_DIRS
    for d in dirs:
        folder = dl_root / d if dl_root else None
        found = sorted(folder.glob("*.smtx.gz"), key=lambda f: (-f.stat().st_size, f.name)) \
            if folder and folder.is_dir() else []
        if not args.all:
            found = found[:per_dlmc]
        if not found:
            sparsity = float(d.rsplit("/", 1)[1])
            yield ("dlmc", f"{d}/(missing)", _missing(folder, d),
                   lambda s=sparsity: random_csr(512, 2048, int(512 * 2048 * (1 - s)), 2))
        for f in found:
            short = d.replace("magnitude_pruning/", "")  # every shipped DLMC file is magnitude
            yield "dlmc", f"{short}/{f.name[:-len('.smtx.gz')]}", lambda f=f: load_smtx(f), None


def _missing(folder, name):
    def load():
        raise FileNotFoundError(f"{name} not found under {folder or 'any data folder'}")
    return load


# -- cases -----------------------------------------------------------------------------------
def make_cases(m: sp.csr_array, ops, dense_limit: int, seed: int = 0) -> dict:
    """op -> {impl: callable}. Every input is prepared here, outside the timed calls."""
    A = st.tensor(m, format="csr")
    T = torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                torch.from_numpy(m.indices.astype(np.int64)),
                                torch.from_numpy(m.data), m.shape)
    cases = {}
    if "csr->csc" in ops:
        cases["csr->csc"] = {"sparsetorch": lambda: A.asformat("csc"), "scipy": m.tocsc,
                             "torch": T.to_sparse_csc}
    if "csr->coo" in ops:
        cases["csr->coo"] = {"sparsetorch": lambda: A.asformat("coo"), "scipy": m.tocoo,
                             "torch": T.to_sparse_coo}
    if "coo->csr" in ops:
        r, c, v = _shuffled_coo_with_duplicates(m, seed)
        idx_t = torch.from_numpy(np.stack([r, c]).astype(np.int64))
        v_t = torch.from_numpy(v)
        r32, c32 = r.astype(np.int32), c.astype(np.int32)
        shape = m.shape
        cases["coo->csr"] = {
            "sparsetorch": lambda: st.tensor((idx_t, v_t), shape=shape, format="csr"),
            "scipy": lambda: sp.coo_array((v, (r32, c32)), shape=shape).tocsr(),
            "torch": lambda: torch.sparse_coo_tensor(idx_t, v_t, shape).to_sparse_csr()}
    small = m.shape[0] * m.shape[1] <= dense_limit
    if small and "dense->csr" in ops:
        D = torch.from_numpy(m.toarray())
        Dn = D.numpy()
        cases["dense->csr"] = {"sparsetorch": lambda: st.tensor(D, format="csr"),
                               "scipy": lambda: sp.csr_array(Dn), "torch": D.to_sparse_csr}
    if small and "csr->dense" in ops:
        cases["csr->dense"] = {"sparsetorch": A.to_dense, "scipy": m.toarray,
                               "torch": T.to_dense}
    if "from_scipy" in ops:
        cases["from_scipy"] = {
            "sparsetorch": lambda: st.tensor(m, format="csr"), "scipy": m.copy,
            "torch": lambda: torch.sparse_csr_tensor(
                torch.from_numpy(m.indptr), torch.from_numpy(m.indices),
                torch.from_numpy(m.data), m.shape)}
    return cases


def _shuffled_coo_with_duplicates(m, seed):
    """m's entries plus a copy of ~10% of them, value split so the sum is unchanged, in a
    random order: the unsorted, duplicated COO that real data pipelines hand over."""
    rng = np.random.default_rng(seed)
    coo = m.tocoo()
    r, c, v = coo.row.astype(np.int64), coo.col.astype(np.int64), coo.data.copy()
    dup = rng.random(v.size) < 0.1
    v[dup] *= 0.5
    r, c, v = np.concatenate([r, r[dup]]), np.concatenate([c, c[dup]]), np.concatenate(
        [v, v[dup]])
    perm = rng.permutation(v.size)
    return r[perm], c[perm], v[perm]


# -- checking --------------------------------------------------------------------------------
def check_case(op: str, impls: dict) -> str | None:
    """Run each impl once and compare it with scipy's result. Returns a problem or None."""
    outs = {}
    for name, fn in impls.items():
        try:
            outs[name] = as_scipy(fn())
        except Exception as exc:  # compare() will report the error too
            return f"{name} failed: {type(exc).__name__}: {exc}"
    ref = _canonical_or_dense(outs["scipy"])
    for name, out in outs.items():
        out = _canonical_or_dense(out)
        if out.shape != ref.shape:
            return f"{name}: shape {out.shape} != {ref.shape}"
        if sp.issparse(ref) != sp.issparse(out):
            return f"{name}: returned {'sparse' if sp.issparse(out) else 'dense'} output"
        if sp.issparse(ref):
            # Same pattern (cheap array compares, fine at 10M nnz), then close values.
            if not (np.array_equal(out.indptr, ref.indptr) and
                    np.array_equal(out.indices, ref.indices)):
                return f"{name}: sparsity pattern differs from scipy's ({op})"
            a, b = out.data, ref.data
        else:
            a, b = np.asarray(out), np.asarray(ref)
        if a.size and not np.allclose(a, b, rtol=1e-5, atol=1e-6):
            return f"{name}: values differ from scipy's by up to {np.abs(a - b).max():.3g} ({op})"
    return None


def _canonical_or_dense(x):
    if not sp.issparse(x):
        return x
    x = sp.csr_array(x)  # CSC/COO -> CSR with sorted, summed entries, like scipy's own
    x.sum_duplicates()
    x.sort_indices()
    return x


def as_scipy(x):
    """Any library's result as a scipy sparse array or a numpy array (for comparison)."""
    if isinstance(x, st.SparseTensor):
        return x.to_scipy() if x.format.name != "dense" else x.to_dense().numpy()
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided:
            return x.numpy()
        if x.layout == torch.sparse_coo:
            x = x.coalesce()
            i = x.indices().numpy()
            return sp.coo_array((x.values().numpy(), (i[0], i[1])), shape=tuple(x.shape))
        if x.layout == torch.sparse_csr:
            return sp.csr_array((x.values().numpy(), x.col_indices().numpy(),
                                 x.crow_indices().numpy()), shape=tuple(x.shape))
        if x.layout == torch.sparse_csc:
            return sp.csc_array((x.values().numpy(), x.row_indices().numpy(),
                                 x.ccol_indices().numpy()), shape=tuple(x.shape))
        raise TypeError(f"unexpected torch layout {x.layout}")
    return x


# -- main ------------------------------------------------------------------------------------
def run(args) -> Report:
    quiet_sparse_warnings()
    t0 = time.perf_counter()
    big_nnz = args.big_nnz or (1_000_000 if args.quick else 10_000_000)
    rounds = args.rounds or (5 if args.quick else 7)
    report = Report("conversions: sparsetorch vs scipy.sparse vs torch.sparse",
                    meta={"argv": sys.argv[1:], "rounds": rounds, "big_nnz": big_nnz,
                          "dense_limit": args.dense_limit, "value_dtype": "float32",
                          "torch_index_dtype": "int64", "scipy_index_dtype": "int32"})
    root = find_data(args.data)
    if root is None:
        report.note("no shared data folder found (pass --data or set SPARSETORCH_DATA); every "
                    "real matrix below is replaced by a random stand-in of the same size")
    mats = list(select_matrices(root, args))
    side = max(big_nnz // 10, 1)  # 10 nonzeros per row, like a sparse graph or a pruned layer
    mats.append(("generated", f"uniform_{side}x{side}_{big_nnz:.0e}".replace("+0", ""),
                 lambda: random_csr(side, side, big_nnz, 3), None))
    if args.only:
        mats = [m for m in mats if re.search(args.only, f"{m[0]}/{m[1]}")]
    for i, (coll, name, load, gen) in enumerate(mats, 1):
        t = time.perf_counter()
        if gen is None:
            m, source = load(), "real" if coll != "generated" else "generated"
        else:
            m, source = load_or_generate(f"{coll}/{name}", load, gen, report=report)
        big = m.nnz >= 1_000_000
        cases = make_cases(m, OPS, args.dense_limit)
        for op, impls in cases.items():
            problem = check_case(op, impls)
            if problem:
                report.note(f"{coll}/{name} {op}: {problem}")
            # Large cases: the check call was the warm-up, each sample is long enough to time
            # alone, and 3 rounds (the fewest with a median) keep the run within minutes.
            res = compare(impls, baseline="scipy", rounds=3 if big else rounds,
                          warmup=0 if big else 1, min_time=0 if big else 5e-3,
                          max_time=None if big else 1.0, threads=args.threads)
            report.add(name, res, collection=coll, op=op, source=source,
                       shape=f"{m.shape[0]}x{m.shape[1]}", nnz=int(m.nnz),
                       x_scipy=speedup(res, "sparsetorch", over="scipy"),
                       x_torch=speedup(res, "sparsetorch", over="torch"),
                       **({"check": problem} if problem else {}))
        took = time.perf_counter() - t
        report.meta.setdefault("wall_s_per_matrix", {})[f"{coll}/{name}"] = round(took, 1)
        print(f"[{i}/{len(mats)}] {coll}/{name} {m.shape[0]}x{m.shape[1]} nnz={m.nnz} "
              f"({source}, {took:.1f}s)", flush=True)
    report.meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def wide_rows(report: Report) -> list[dict]:
    """One row per (matrix, op): each library's median and sparsetorch's per-round ratios."""
    out, index = [], {}
    for r in report.rows:
        key = (r["collection"], r["case"], r["op"])
        if key not in index:
            index[key] = {"matrix": r["case"], "nnz": r["nnz"], "op": r["op"],
                          "x_scipy": r["x_scipy"], "x_torch": r["x_torch"]}
            out.append(index[key])
        index[key][r["impl"]] = r["median_s"]
        if r["median_s"]:  # worst interquartile spread among the libraries, in % of median
            spread = 100 * (r["q3_s"] - r["q1_s"]) / r["median_s"]
            index[key]["noise"] = max(index[key].get("noise", 0), round(spread))
        if r.get("check"):
            index[key]["check"] = "MISMATCH"
    return out


def summary_rows(report: Report) -> list[dict]:
    """Geometric-mean ratios of sparsetorch per (collection, op)."""
    groups: dict = {}
    for r in report.rows:
        if r["impl"] == "sparsetorch":
            groups.setdefault((r["collection"], r["op"]), []).append(r)
    return [{"collection": c, "op": op, "matrices": len(rs),
             "x_scipy": geomean(r["x_scipy"] for r in rs),
             "x_torch": geomean(r["x_torch"] for r in rs)} for (c, op), rs in groups.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    wide = wide_rows(report)
    for w in wide:  # times as seconds -> the table formats them via the *_s naming
        for impl in IMPLS:
            w[f"{impl}_s"] = w.pop(impl, None)
    print(f"\n== {report.title} ==")
    print(f"{report.threads} torch threads; median of interleaved rounds; x_scipy / x_torch = "
          "median over rounds of (their time / sparsetorch time): > 1 means sparsetorch is "
          "faster; noise = worst interquartile range over rounds, % of median")
    print(format_table(wide, ["matrix", "nnz", "op", "sparsetorch_s", "scipy_s", "torch_s",
                              "x_scipy", "x_torch", "noise", "check"]))
    print("\ngeometric means (sparsetorch speedup; < 1 means slower):")
    print(format_table(summary_rows(report), ["collection", "op", "matrices", "x_scipy",
                                              "x_torch"]))
    for n in report.notes:
        print(f"note: {n}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = report.write_json(args.out or RESULTS / f"conversions-{stamp}.json")
    print(f"\nwrote {path} ({report.meta['wall_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
