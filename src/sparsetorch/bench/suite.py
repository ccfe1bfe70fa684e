"""``sparsetorch bench``: every registered workload, inference and one training step, timed
side by side with torch.sparse, dense torch and PyTorch Geometric; a table, the targets of
issue 32, JSON and a PNG chart.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> p.parse_args(["--quick", "--only", "gcn-cora"]).only
    'gcn-cora'
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

from .._files import check_replaceable
from .harness import (BUSY_LOAD_PER_CORE, machine_info, named_data, pinned_threads,
                      quiet_sparse_warnings, write_json_atomic)
from .report import plot, results_table, summary
from .runner import run_case
from .workloads import REGISTRY, Context, select

QUICK = {"rounds": 5, "max_time": 1.5}
FULL = {"rounds": 15, "max_time": 6.0}
# --quick skips dense baselines over 128 MiB: the dense GAT on Cora (8 heads of 2708 x 2708
# scores, 235 MB) took 3.5 of --quick's 6.5 minutes (one loaded core) at ~200x our time
QUICK_DENSE_LIMIT = 1 << 27


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command line of ``sparsetorch bench``."""
    p.add_argument("--quick", action="store_true",
                   help="fewer workloads and rounds: at most ~3 minutes on 2 cores")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]", action=_Joined,
                   help="workloads to run: names (gcn-cora), groups (gcn, gat, sage, "
                        "autoencoder, transformer, convnets) or patterns (*-cora); with "
                        "--quick, these workloads with fewer rounds; may be repeated")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG chart of the ratios (needs matplotlib)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="shared data folder (default: $SPARSETORCH_DATA or shared/data next "
                        "to the checkout); datasets missing there run on generated stand-ins")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch and kernel threads while timing (default: torch's setting)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")


class _Joined(argparse.Action):
    """``--only a --only b`` means ``--only a,b`` (argparse would keep the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not any(p.strip() for p in values.split(",")):   # (e.g. an unset "$W")
            raise argparse.ArgumentError(self, f"{values!r} names no workload; give names, "
                                         "groups or patterns separated by commas")
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def main(args) -> int:
    """Run the selected workloads; 0 when every correctness check passed, 1 when one
    failed or the JSON or chart could not be written, 2 on bad arguments (an unknown
    workload, a ``--data`` folder that is missing) or when kernels cannot be built here,
    130 when interrupted (the JSON then holds the cases that finished, ``complete: false``)."""
    from . import all_workloads  # noqa: F401  (registers the workloads)

    quiet_sparse_warnings()
    try:
        workloads = select(REGISTRY.values(), args.only, args.quick)
        if args.list:
            for w in workloads:
                print(f"{w.name:24s} {'quick ' if w.quick else '      '}{w.describe}")
            return 0
        _check_arguments(args)
        # (a named --data or $SPARSETORCH_DATA must exist: a typo must not silently
        # run on stand-ins)
        ctx = Context(data_root=named_data(args.data), quick=args.quick)
        if args.quick:
            ctx.dense_limit_bytes = QUICK_DENSE_LIMIT
        _check_kernels()
    except (ValueError, FileNotFoundError) as exc:
        print(f"sparsetorch bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, workloads, ctx)
    except KeyboardInterrupt:
        print("\nsparsetorch bench: interrupted"
              + (f"; {args.json} holds the cases that finished, marked incomplete"
                 if args.json else ""), file=sys.stderr)
        return 130


def _run(args, workloads, ctx) -> int:
    from .overhead import gcn_overhead

    budget = QUICK if args.quick else FULL
    start = time.perf_counter()
    busy = _busy()
    if busy:
        print(f"note: {busy}", file=sys.stderr)
    print(f"sparsetorch bench: {len(workloads)} workloads x (inference, training step); "
          f"data {ctx.data_root or 'NOT FOUND: generated stand-ins'}")
    rows = []
    steps = [(w, m) for w in workloads for m in w.modes]
    planned = [f"{w.name} {mode}" for w, mode in steps]
    with pinned_threads(args.threads) as threads:
        for w, mode in _progress(steps):
            rows.append(run_case(w, mode, ctx, threads=threads, **budget))
            if args.json:   # rows so far, so a long run interrupted still leaves its numbers
                try:
                    write_json_atomic(args.json, _document(args, ctx, threads, rows, None,
                                                           planned, complete=False))
                except OSError:   # (a full disk must not end the run: the last write says)
                    pass
        overhead = None
        if any(w.group == "gcn" for w in workloads):
            try:
                overhead = gcn_overhead(ctx, rounds=budget["rounds"], threads=threads)
            except Exception as exc:   # (reported, and the run fails: the rows are kept)
                overhead = {"graph": "cora", "overhead": None, "failed": True,
                            "detail": f"not measured: {type(exc).__name__}: {exc}"}
    print()
    print(results_table(rows))
    for line in _row_notes(rows):
        print(f"note: {line}")
    print()
    for line in summary(rows, overhead):
        print(line)
    if overhead:
        print(f"overhead: {overhead['detail']}")
    if busy:
        print(f"note: {busy}")
    print(f"\n{threads} threads; ratios are medians of per-round time(baseline) / "
          f"time(sparsetorch), > 1 means sparsetorch is faster; done in "
          f"{time.perf_counter() - start:.0f}s")
    written = True
    if args.json:
        try:
            doc = _document(args, ctx, threads, rows, overhead, planned, complete=True)
            print(f"JSON: {write_json_atomic(args.json, doc)}")
        except OSError as exc:
            written = False
            print(f"ERROR: JSON not written to {args.json}: {exc}", file=sys.stderr)
    if args.plot:
        chart = _chart_path(args.plot)
        try:
            chart.parent.mkdir(parents=True, exist_ok=True)   # (as --json's)
            print(f"chart: {plot(rows, chart)}")
        except OSError as exc:
            written = False
            print(f"ERROR: chart not written to {chart}: {exc}", file=sys.stderr)
    failed = [r for r in rows if str(r.get("check", "")).startswith("FAIL")]
    for r in failed:
        print(f"ERROR: {r['workload']} {r['mode']}: {r['check']}"
              + (f" ({r['error']})" if r.get("error") else ""), file=sys.stderr)
    if overhead and overhead.get("failed"):
        print(f"ERROR: GCN overhead {overhead['detail']}", file=sys.stderr)
    return 1 if failed or not written or (overhead and overhead.get("failed")) else 0


def _chart_path(path) -> Path:
    chart = Path(path)
    return chart if chart.suffix else chart.with_suffix(".png")   # (as savefig names it)


def _check_kernels() -> None:
    """Build and run one kernel, so a missing compiler, an unwritable kernel cache or a
    bad ``SPARSETORCH_*`` setting is one error line before anything runs, not a failure in
    every row."""
    import torch

    from .. import einsum, tensor
    from ..runtime import KernelBuildError, UnsafeCacheError

    try:   # (bad settings are ValueErrors; the rest, a traceback: a bug)
        einsum("ij,j->i", tensor(torch.eye(2), format="csr"), torch.ones(2))
    except (ValueError, OSError, KernelBuildError, UnsafeCacheError) as exc:
        raise ValueError(f"sparsetorch cannot run its kernels here: {exc}") from None


MAX_THREADS = 1024   # (torch itself crashes at 100000)


def _check_arguments(args) -> None:
    """Refuse, before anything runs, what would fail only once the workloads had run: a
    thread count out of range, a ``--json`` or ``--plot`` path that cannot be written."""
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise ValueError(f"--threads must be between 1 and {MAX_THREADS}, got {args.threads}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a folder; give a file path in it")
        check_replaceable(path, flag)
        folder = next((p for p in path.parents if p.exists()), Path("."))
        if not _can_create_in(folder):
            raise ValueError(f"{flag} {path}: {folder} is not a folder this process can "
                             "write into")
    if args.plot is not None:
        if Path(args.plot).suffix.lower() not in ("", ".png"):
            raise ValueError(f"--plot {args.plot}: the chart is a PNG; give a .png path")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib, which is not installed: pip install "
                             "'sparsetorch[bench]' (or matplotlib), or leave --plot out")
        if args.json is not None and \
                _chart_path(args.plot).resolve() == Path(args.json).resolve():
            raise ValueError(f"--json and --plot name the same file {args.json}; give two "
                             "paths")


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder``, tried (an unnamed temporary file, gone
    when closed): ``os.access`` says yes to root for folders no one can write, e.g.
    ``/proc``."""
    if not folder.is_dir():
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _busy() -> str | None:
    """Why this run's timings are void (the machine was loaded as it began), or None."""
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if load > BUSY_LOAD_PER_CORE * cores:
        return (f"machine busy at start: 1-min load average {load:.1f} on {cores} cores; "
                "treat these timings as void and rerun on an idle machine")
    return None


def _document(args, ctx, threads, rows, overhead, planned, *, complete: bool) -> dict:
    """The JSON document; ``complete`` is false (``planned`` lists every case) while the
    run is going on, so a run interrupted leaves numbers that say they are partial."""
    return {"machine": machine_info(threads), "quick": args.quick, "only": args.only,
            "complete": complete, "planned": planned, "rows": rows, "overhead": overhead,
            "summary": summary(rows, overhead) if complete else
            [f"incomplete: {len(rows)} of {len(planned)} cases ran"],
            "data_root": str(ctx.data_root) if ctx.data_root else None}


def _progress(steps):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(steps, unit="case", file=sys.stderr, dynamic_ncols=True)
        for w, mode in bar:
            bar.set_description(f"{w.name} {mode}")
            yield w, mode
        return
    for i, (w, mode) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {w.name} {mode}", file=sys.stderr, flush=True)
        yield w, mode


def _row_notes(rows):
    """Where data came from, what was skipped and why (per workload), and each
    implementation's configurations (once)."""
    seen, configs = [], {}
    for r in rows:
        if r.get("source", "real") != "real":
            seen.append(f"{r['workload']}: {r['source']}")
        for n in r.get("notes", []):
            seen.append(f"{r['workload']}: {n}")
        for fam, why in r.get("skipped", {}).items():
            seen.append(f"{r['workload']}: {fam} skipped: {why}")
        for name, i in r.get("impls", {}).items():
            if i.get("config"):
                configs.setdefault(name, []).append(i["config"])
        if r.get("error"):
            seen.append(f"{r['workload']} {r['mode']}: {r['error']}")
    seen += [f"{name} ran as: {'; '.join(dict.fromkeys(c))}" for name, c in configs.items()]
    return list(dict.fromkeys(seen))
