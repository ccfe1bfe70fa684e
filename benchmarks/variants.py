#!/usr/bin/env python
"""A code-generation choice, measured: the same calls compiled under two or more settings of
one knob of the compiler (a tuning function or constant), or of several knobs moved together,
and timed side by side in one process.

    python benchmarks/variants.py --knob sum_copies=4,8 --kernel sddmm --inner 64
    python benchmarks/variants.py --knob wide_gathers_from=none,48 --kernel spmv
    python benchmarks/variants.py --knob sblock.NEAR_ENTRIES=8,12,16 --kernel sddmm --inner 256
    python benchmarks/variants.py --knob sum_copies=4,8 --kernel sddmm --quick --out /tmp/v.json
    python benchmarks/variants.py --knob vector.NARROW_VERSIONS=0,2 --kernel spmm --graphs \
        --width 7,16,32,64 --threads 1      # GCN propagations, as narrow as the layers'
    python benchmarks/variants.py --knob sampled_block_bytes=65536,32768 \
        --knob sblock.NEAR_BYTES=0,8192 --kernel sddmm     # setting i: each knob's i-th value

Why: the shared machines drift by 10-30% within minutes, so two runs of ``kernels.py`` or
``compiler.py`` taken minutes apart, one per setting, cannot resolve a 5% change. Here every
round calls each variant's kernel back to back on the same operands
(``sparsetorch.bench.compare``), so drift cancels out of the per-round ratios.

How: for each setting the knob is set (a function of no arguments in
``sparsetorch.compiler.kernel``, such as ``sum_copies`` or ``wide_gathers_from``, is replaced
by one returning the setting; ``MODULE.NAME``, an upper-case integer constant of a module of
``sparsetorch.compiler`` or ``sparsetorch.codegen`` read at compile time, such as
``sblock.NEAR_ENTRIES``, is replaced by the setting; a setting the code generator cannot
take stops the run with its error; with several ``--knob``s, setting i sets each knob to its
i-th value), the kernel memo and the ops layer's call memos are
cleared (``execute.forget_calls``), and one ``st.einsum`` call compiles the kernel and
memoises its call shim, which is kept. The knobs are restored afterwards. Before timing, every
variant's result is checked against the first's. Facts a SparseTensor caches about its
pattern (whether its rows are long enough for the blocked nests) are computed under the
first setting and kept for the others.

Inputs: ``spmv`` (``ij,j->i``) and ``spmm`` (``ij,jk->ik``, 128 columns, or each width of
``--width``) run the SuiteSparse and DLMC matrices of ``compiler.py``, or with ``--graphs``
the six shipped graphs' GCN propagation matrices (D^-1/2 (A + I) D^-1/2; ``--quick``: the
three Planetoid graphs); ``sddmm`` (``ij,ik,jk->ij``, inner dimension
``--inner``) runs the DLMC transformer 0.7 and 0.9 masks of ``kernels.py``. Float32.
Output: each case's ratio of the first setting's time to each setting's (> 1: faster than the
first), then per setting the geomean, median and smallest ratio; JSON with every row.
"""
from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sparsetorch as st  # noqa: E402
from sparsetorch.bench import Report, compare, find_data, geomean  # noqa: E402
from sparsetorch.bench.harness import quiet_sparse_warnings  # noqa: E402
from sparsetorch.codegen.kernel import compile_kernel  # noqa: E402
from sparsetorch.compiler import kernel as _kernel  # noqa: E402
from sparsetorch.ops import execute as _execute  # noqa: E402

from _inputs import select_dlmc, select_suitesparse  # noqa: E402

EQUATIONS = {"spmv": "ij,j->i", "spmm": "ij,jk->ik", "sddmm": "ij,ik,jk->ij"}
SPMM_N = 128
SDDMM_SETS = ("transformer/0.7/", "transformer/0.9/")
_PACKAGES = ("sparsetorch.compiler", "sparsetorch.codegen")   # where MODULE.CONSTANT knobs live


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knob", required=True, action="append",
                   help="NAME=V1,V2,...: a no-argument function of sparsetorch.compiler."
                   "kernel, or MODULE.CONSTANT of sparsetorch.compiler or .codegen, and the "
                   "settings to compare (integers or 'none'; the first is the baseline); "
                   "repeat it to move several knobs together (as many settings each)")
    p.add_argument("--kernel", choices=sorted(EQUATIONS), required=True)
    p.add_argument("--inner", type=int, default=64, help="SDDMM inner dimension (64)")
    p.add_argument("--width", default=str(SPMM_N),
                   help=f"SpMM columns, one or several: 16,64 ({SPMM_N})")
    p.add_argument("--graphs", action="store_true",
                   help="the shipped graphs' GCN propagations instead of the matrices")
    p.add_argument("--quick", action="store_true", help="a quarter of the matrices")
    p.add_argument("--threads", type=int, default=2, help="torch and kernel threads (2)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per case (30)")
    p.add_argument("--min-time", type=float, default=5e-3,
                   help="seconds per timed sample; faster calls are batched (5e-3)")
    p.add_argument("--data", default=None, help="shared data folder (default ../shared/data)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/variants.json)")
    args = p.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.width.split(",")]
    except ValueError:
        p.error(f"--width: integers separated by commas, got {args.width!r}")
    if min(args.widths) < 1 or (args.kernel != "spmm" and args.width != str(SPMM_N)):
        p.error("--width: positive column counts, for --kernel spmm")
    if args.graphs and args.kernel == "sddmm":
        p.error("--graphs: for spmv and spmm")
    args.names, args.targets, settings = [], [], []
    for knob in args.knob:
        name, _, values = knob.partition("=")
        try:
            target = _knob(name)
        except ValueError as e:
            p.error(f"--knob: {e}")
        try:
            values = [None if v.lower() == "none" else int(v) for v in values.split(",")]
        except ValueError:
            p.error(f"--knob: settings must be integers or 'none', got {values!r}")
        if len(values) < 2:
            p.error("--knob: give at least two settings, e.g. sum_copies=4,8")
        if None in values and not target[2]:
            p.error(f"--knob: {name} is a constant; 'none' is for functions")
        if settings and len(values) != len(settings[0]):
            p.error(f"--knob: {name} has {len(values)} settings, {args.names[0]} "
                    f"{len(settings[0])}; knobs moved together need as many each")
        args.names.append(name)
        args.targets.append(target)
        settings.append(values)
    args.settings = list(zip(*settings))   # setting i: each knob's i-th value
    return args


def matrices(kernel: str, root: Path, quick: bool, graphs: bool = False) -> list:
    """(name, loader) of the matrices ``kernel`` runs (see the module docstring)."""
    if graphs:
        from sparsetorch.bench.graph_data import GRAPHS, gcn_normalized, load

        names = list(GRAPHS)[:3] if quick else list(GRAPHS)
        return [(name, lambda name=name: gcn_normalized(load(name, root).adj))
                for name in names]
    if kernel == "sddmm":
        picked = [m for m in select_dlmc(root, 12) if m[1].startswith(SDDMM_SETS)]
    else:
        picked = select_suitesparse(root, False, []) + select_dlmc(root, 10)
    picked = [(name, load) for _, name, load in picked]
    return picked[::4] if quick else picked


def operands(kernel: str, m, inner: int, seed: int, width: int = SPMM_N) -> tuple:
    g = torch.Generator().manual_seed(seed)
    rows, cols = m.shape
    if kernel == "sddmm":
        mask = st.tensor(m.astype(np.float32), format="csr")
        return (mask, torch.randn(rows, inner, generator=g),
                torch.randn(cols, inner, generator=g))
    A = st.tensor(m, format="csr")
    if kernel == "spmv":
        return A, torch.randn(cols, generator=g)
    return A, torch.randn(cols, width, generator=g)


def _knob(name: str) -> tuple:
    """(module, attribute, whether it is a function) for a knob name (see the module
    docstring), or ValueError."""
    if "." not in name:
        if name.startswith("_") or not callable(getattr(_kernel, name, None)):
            raise ValueError(f"sparsetorch.compiler.kernel has no public function {name!r}")
        return _kernel, name, True
    module_name, _, attr = name.partition(".")
    for package in _PACKAGES:
        try:
            module = importlib.import_module(f"{package}.{module_name}")
            break
        except ImportError:
            continue
    else:
        raise ValueError(f"no module {module_name} in {' or '.join(_PACKAGES)}")
    if not attr.isupper() or not isinstance(getattr(module, attr, None), int):
        raise ValueError(f"{module.__name__} has no integer constant {attr!r}")
    return module, attr, False


def compiled_call(targets: list, values: tuple, equation: str, ops: tuple):
    """The memoised call shim of ``equation`` on ``ops`` compiled with each knob of
    ``targets`` (``_knob``'s answers) set to its value in ``values``."""
    originals = [getattr(module, attr) for module, attr, _ in targets]
    for (module, attr, is_function), value in zip(targets, values):
        setattr(module, attr, (lambda v=value: v) if is_function else value)
    try:
        _forget_kernels()
        st.einsum(equation, *ops)
        calls = _execute.fast_calls(equation)
    except Exception as e:   # a setting the code generator cannot take
        raise RuntimeError(f"the call failed ({type(e).__name__}: {e})") from e
    finally:
        for (module, attr, _), original in zip(targets, originals):
            setattr(module, attr, original)
        _forget_kernels()   # later calls in this process compile under the real knobs
    if not calls:
        raise RuntimeError(f"{equation}: no memoised call shim (this case takes the generic "
                           "path), so its variants cannot be held side by side")
    return calls[0]


def _forget_kernels() -> None:
    compile_kernel.cache_clear()
    _execute.forget_calls()


def _values(result):
    return result._values if isinstance(result, st.SparseTensor) else result


def time_case(args, labels: list, equation: str, case: str, ops: tuple):
    """``compare``'s result for the variants of one call, or an exit status (a setting
    failed to compile, or a variant's result disagrees with the first's)."""
    calls = []
    for lab, values in zip(labels, args.settings):
        try:
            calls.append(compiled_call(args.targets, values, equation, ops))
        except RuntimeError as e:
            print(f"!! {case}: {lab}: {e}", file=sys.stderr)
            return 2
    first = _values(calls[0](ops))
    for lab, call in zip(labels[1:], calls[1:]):
        if not torch.allclose(_values(call(ops)), first, rtol=1e-4, atol=1e-3):
            print(f"!! {case}: {lab} disagrees with {labels[0]}", file=sys.stderr)
            return 1
    return compare({lab: (lambda c=c: c(ops)) for lab, c in zip(labels, calls)},
                   baseline=labels[0], rounds=args.rounds, min_time=args.min_time)


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_sparse_warnings()
    torch.set_num_threads(args.threads)
    root = find_data(args.data)
    if root is None:
        print("variants.py needs the shared data folder (pass --data or set SPARSETORCH_DATA)",
              file=sys.stderr)
        return 2
    labels = [" ".join(f"{name}={v}" for name, v in zip(args.names, values))
              for values in args.settings]
    report = Report(f"{args.kernel}: {', '.join(labels)}",
                    meta={"argv": sys.argv[1:] if argv is None else list(argv),
                          "kernel": args.kernel, "knobs": args.names,
                          "settings": args.settings,
                          "inner": args.inner if args.kernel == "sddmm" else None,
                          "widths": args.widths if args.kernel == "spmm" else None,
                          "graphs": args.graphs,
                          "threads": args.threads, "rounds": args.rounds})
    equation, ratios, t0 = EQUATIONS[args.kernel], {lab: [] for lab in labels}, time.time()
    widths = args.widths if args.kernel == "spmm" else [None]
    for n, (name, load) in enumerate(matrices(args.kernel, root, args.quick, args.graphs)):
        m = load()
        for width in widths:
            case = name if widths == [SPMM_N] else f"{name} x{width}"
            ops = operands(args.kernel, m, args.inner, n, width or SPMM_N)
            res = time_case(args, labels, equation, case, ops)
            if isinstance(res, int):
                return res
            report.add(case, res, nnz=int(m.nnz), shape=f"{m.shape[0]}x{m.shape[1]}",
                       width=width)
            line = []
            for lab in labels:
                r = res["impls"][lab]["speedup"]
                ratios[lab].append(r)
                line.append(f"{r:.3f}x")
            print(f"{case[:48]:48s} {m.shape[0]:>6}x{m.shape[1]:<6} nnz {m.nnz:>8} "
                  f"{res['impls'][labels[0]]['median_s'] * 1e6:9.1f} us  {'  '.join(line)}",
                  flush=True)
    print(f"\n== {report.title}: time of {labels[0]} / time of each (> 1: faster) ==")
    for lab in labels:
        rs = [r for r in ratios[lab] if r is not None and math.isfinite(r)]
        print(f"  {lab:28s} geomean {geomean(rs):.3f}x  median {statistics.median(rs):.3f}x  "
              f"min {min(rs):.3f}x  over {len(rs)} cases")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / "variants.json")
    report.write_json(out)
    print(f"wrote {out} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
