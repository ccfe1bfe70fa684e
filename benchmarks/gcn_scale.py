"""Scale on one machine (issue 32, item 6): one GCN propagation Â @ X (X 64 wide, float32)
with int64 offsets on a generated power-law graph of 10^8 edges, and its peak memory.

The graph is generated straight into CSR arrays, a slab of rows at a time, so no COO copy
or sort of 10^8 entries ever exists: row degrees follow a power law (w_r = (1 + r)^-0.6 over
shuffled rows, scaled to the edge count); a row of degree d draws one column in each of d
equal strata of [0, n), so its columns come out sorted and distinct without sorting
(strata bounded by integers, each at least one column wide).
Values are the symmetric GCN weights 1/sqrt(d_r d_c) (degrees counted by rows, so this is a
directed graph's Â).

Memory is measured on Linux from /proc/self/status: ``VmRSS`` before anything is allocated
(the interpreter, torch and sparsetorch: R0), then the generation runs, its temporaries are
freed, the kernel is compiled on a tiny graph of the same dtypes, the peak (``VmHWM``) is reset
to the current RSS (``echo 5 > /proc/self/clear_refs``), Â @ X runs, and the peak is read.
Reported: ``(peak - R0) / (bytes of Â's arrays + X + the output)`` (target <= 1.3), plus
``ru_maxrss`` for the whole process (which includes the generation's own peak).

    python benchmarks/gcn_scale.py                       # 10^8 edges, 5M nodes (~4 GiB)
    python benchmarks/gcn_scale.py --edges 1e6 --nodes 1e5   # seconds, for a smoke test
                                                             # (the target not judged)
"""
from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

import numpy as np
import torch

import sparsetorch as st
from sparsetorch.bench import machine_info, pinned_threads, write_json_atomic

WIDTH = 64
ROWS_PER_SLAB_ENTRIES = 1 << 23   # entries generated at once (temporaries ~ 8 x this x 8 B)
TARGET = 1.3
ISSUE_EDGES = 10 ** 8   # the size the target is set at


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def power_law_csr(n: int, edges: int, seed: int):
    """(indptr int64 [n+1], indices int64 [nnz], values float32 [nnz]) of a graph whose
    row degrees follow a power law, each row's columns sorted and distinct."""
    rng = np.random.default_rng(seed)
    w = (1.0 + rng.permutation(n)) ** -0.6
    deg = np.minimum(np.floor(w * (edges / w.sum())).astype(np.int64), n)
    short = edges - int(deg.sum())              # top up the floors to exactly `edges`
    if short > 0:
        room = np.flatnonzero(deg < n)
        deg[rng.choice(room, min(short, room.size), replace=False)] += 1
    del w
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(deg, out=indptr[1:])
    nnz = int(indptr[-1])
    indices = np.empty(nnz, np.int64)
    values = np.empty(nnz, np.float32)
    dinv = (1.0 / np.sqrt(np.maximum(deg, 1))).astype(np.float32)
    r0 = 0
    while r0 < n:
        # Rows up to about ROWS_PER_SLAB_ENTRIES entries (at least one row).
        r1 = int(np.searchsorted(indptr, indptr[r0] + ROWS_PER_SLAB_ENTRIES, side="right"))
        r1 = min(max(r1 - 1, r0 + 1), n)
        lo, hi = int(indptr[r0]), int(indptr[r1])
        if hi > lo:
            rows = np.repeat(np.arange(r0, r1), deg[r0:r1])
            j = np.arange(lo, hi) - indptr[rows]
            d = deg[rows]
            start = j * n // d                   # row's strata: [j n / d, (j + 1) n / d)
            width = (j + 1) * n // d - start     # >= 1 since d <= n: distinct columns
            cols = start + (rng.random(hi - lo) * width).astype(np.int64)
            del d, start, width
            indices[lo:hi] = cols
            values[lo:hi] = dinv[rows] * dinv[cols]
            del rows, j, cols
        r0 = r1
    return indptr, indices, values


def as_sparse(indptr, indices, values, n: int):
    arrays = {"pos1": torch.from_numpy(indptr), "crd1": torch.from_numpy(indices)}
    return st.SparseTensor.from_levels((n, n), "csr", arrays, torch.from_numpy(values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", type=float, default=1e8, help="stored entries (default 1e8)")
    p.add_argument("--nodes", type=float, default=5e6,
                   help="nodes (default 5e6: X and the output are 1.28 GB each)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/gcn_scale.json")
    args = p.parse_args(argv)
    n, edges = int(args.nodes), int(args.edges)
    r0 = status_kib("VmRSS")

    # The kernel (int64 offsets and columns, float32, 64 wide) is compiled first, on a tiny
    # graph, so compiling is not in the measured step.
    ip, ix, v = power_law_csr(64, 512, args.seed)
    st.einsum("ij,jk->ik", as_sparse(ip, ix, v, 64), torch.ones(64, WIDTH))

    t = time.perf_counter()
    indptr, indices, values = power_law_csr(n, edges, args.seed)
    A = as_sparse(indptr, indices, values, n)
    X = torch.randn(n, WIDTH)
    gen_s = time.perf_counter() - t
    gc.collect()
    if A.index_dtype != torch.int64:
        print(f"error: offsets are {A.index_dtype}, expected int64", file=sys.stderr)
        return 1
    input_bytes = (sum(a.numel() * a.element_size() for a in A.arrays.values())
                   + A.values.numel() * A.values.element_size() + X.numel() * X.element_size())
    output_bytes = n * WIDTH * 4
    before = status_kib("VmRSS")
    reset = reset_peak()
    with pinned_threads(args.threads) as threads:
        t = time.perf_counter()
        Y = st.einsum("ij,jk->ik", A, X)
        prop_s = time.perf_counter() - t
    peak = status_kib("VmHWM")
    # Spot check 1000 rows against a float64 gather of the same entries.
    rows = np.random.default_rng(1).choice(n, 1000, replace=False)
    worst = 0.0
    for r in rows:
        lo, hi = indptr[r], indptr[r + 1]
        ref = (torch.from_numpy(values[lo:hi]).double()[:, None] *
               X[torch.from_numpy(indices[lo:hi])].double()).sum(0)
        worst = max(worst, (Y[r].double() - ref).abs().max().item())
    used = (peak - r0) * 1024
    ratio = used / (input_bytes + output_bytes)
    res = {"nodes": n, "edges": int(A.nnz), "width": WIDTH, "index_dtype": str(A.index_dtype),
           "input_bytes": input_bytes, "output_bytes": output_bytes,
           "rss_baseline_bytes": r0 * 1024, "rss_before_bytes": before * 1024,
           "peak_rss_bytes": peak * 1024, "peak_reset": reset,
           "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_over_inputs_and_output": ratio, "target": TARGET,
           "generate_s": gen_s, "propagate_s": prop_s, "max_abs_error_1000_rows": worst,
           "threads": threads, "machine": machine_info(threads)}
    gib = 1 << 30
    # (the target is issue 32's at 10^8 edges; in a smaller run the process's fixed costs
    # weigh more, so a smoke test reports the ratio without judging it)
    judged = edges >= ISSUE_EDGES
    verdict = ('met' if ratio <= TARGET else 'MISSED') if judged else \
        f"judged at {ISSUE_EDGES:.0e} edges only"
    print(f"A_hat @ X: {n:,} nodes, {A.nnz:,} entries (offsets {A.index_dtype}), X {n:,} x "
          f"{WIDTH} float32; generated in {gen_s:.1f}s, propagated in {prop_s:.2f}s "
          f"({threads} threads)")
    print(f"inputs {input_bytes / gib:.2f} GiB + output {output_bytes / gib:.2f} GiB; "
          f"peak RSS above the bare process {used / gib:.2f} GiB = {ratio:.3f}x "
          f"(target <= {TARGET}x: {verdict})"
          + ("" if reset else "; peak could not be reset, so it includes the generation"))
    print(f"spot check of 1000 rows against float64: max abs error {worst:.2e}")
    print(f"JSON: {write_json_atomic(args.out, res)}")
    return 0 if worst < 1e-3 and (ratio <= TARGET or not judged) else 1


if __name__ == "__main__":
    sys.exit(main())
