"""The ``sparsetorch`` command line (also ``python -m sparsetorch``).

Subcommands register themselves with ``@command``; each is a function taking the parsed
arguments plus an ``add_arguments`` hook, so a new one (``bench --quick``) is one decorated
function and touches nothing else.

Example:
    >>> from sparsetorch.cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    sparsetorch ...
    0
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np
import torch

_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn(args) -> int`` as subcommand ``name``.

    Example:
        >>> @command("hello", "say hello", lambda p: p.add_argument("--who", default="x"))
        ... def _hello(args):
        ...     print("hello", args.who)
        ...     return 0
        >>> main(["hello", "--who", "you"])
        hello you
        0
        >>> del _COMMANDS["hello"]
    """
    def register(fn):
        _COMMANDS[name] = (help, add_arguments, fn)
        return fn
    return register


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="sparsetorch", description="sparsetorch: fast, automatic sparse deep learning "
        "for PyTorch.")
    parser.add_argument("--version", action="version", version=f"sparsetorch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, add_arguments, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=(fn.__doc__ or help_).strip())
        add_arguments(p)
        p.set_defaults(_run=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (``sys.exit(main())`` in scripts)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version / bad usage: return instead of exiting
        return int(exc.code or 0)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


# -- bench -----------------------------------------------------------------------------------
def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from .bench.suite import add_arguments

    add_arguments(p)


@command("bench", "the main job: every workload (GCN, GAT, SAGE, sparse autoencoder, sparse "
         "transformer), inference and one training step, against torch.sparse, dense torch "
         "and PyG", _bench_arguments)
def bench(args) -> int:
    """Time every workload for inference and for one training step, side by side with what
    users run today (torch.sparse CSR/COO, dense torch, PyTorch Geometric), after checking
    that every implementation computes the same outputs and gradients. Prints a table (time,
    ratio against each baseline, first call with kernel compiles, correctness) and the
    targets it meets; writes JSON (--json) and a PNG chart (--plot)."""
    from .bench.suite import main as run

    return run(args)


# -- demo ------------------------------------------------------------------------------------
_GRAPHS = {"cora": 2708, "citeseer": 3327, "pubmed": 19717}
_DEMO_FORMATS = ["csr", "csc", "coo", "dcsr", "dcsc", "bsr"]
_BSR_BLOCK = (4, 4)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", choices=sorted(_GRAPHS), default="cora",
                   help="Planetoid graph to load (default: cora)")
    p.add_argument("--data", default=None,
                   help="shared data folder (default: $SPARSETORCH_DATA or ../shared/data)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads while timing (default: torch's current setting)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per conversion")


@command("demo", "load a graph, show its storage in each format, time conversions",
         _demo_arguments)
def demo(args) -> int:
    """Load a graph (Cora by default; a random graph of the same size when the data folder is
    missing), store its adjacency matrix as CSR, CSC, COO, DCSR, DCSC and BSR, print each
    format's storage, and time conversions against scipy.sparse and torch.sparse."""
    from . import __version__
    from . import tensor
    from .bench import Report, compare, format_table, load_or_generate
    from .bench.harness import named_data, quiet_sparse_warnings
    from .bench.suite import MAX_THREADS

    quiet_sparse_warnings()
    try:
        if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
            raise ValueError(f"--threads must be between 1 and {MAX_THREADS}, got "
                             f"{args.threads}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
        root = named_data(args.data)
    except (ValueError, FileNotFoundError) as exc:
        print(f"sparsetorch demo: error: {exc}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    print(f"sparsetorch {__version__} demo | torch {torch.__version__} | "
          f"{args.threads or torch.get_num_threads()} torch threads for timing")
    report = Report(f"conversions on {args.graph}", quiet=True)
    adj, source = load_or_generate(
        args.graph, lambda: _load_planetoid_adjacency(root, args.graph),
        lambda: _random_graph(_GRAPHS[args.graph], avg_degree=4, seed=0),
        report=report, stand_in=f"a random graph with {_GRAPHS[args.graph]} nodes")
    where = f"from {root}" if source == "real" else "GENERATED (real data not found)"
    print(f"graph: {args.graph} adjacency, {adj.shape[0]} nodes, {adj.nnz} edge entries, "
          f"{where}")
    for n in report.notes:
        print(f"note: {n}")

    # Storage of each format. BSR needs the shape divisible by the block: pad when not.
    A = tensor(adj, format="csr")
    print()
    rows = []
    for name in _DEMO_FORMATS:
        kw = {"blocksize": _BSR_BLOCK} if name == "bsr" else {}
        src = A if name != "bsr" or _divisible(A.shape, _BSR_BLOCK) else tensor(
            _pad_to(adj, _BSR_BLOCK), format="csr")
        B = src.asformat(name, **kw)
        nbytes = sum(a.numel() * a.element_size() for a in B._level_arrays.values()) + \
            B.values.numel() * B.values.element_size()
        rows.append({"format": B.format.name + (f" {_BSR_BLOCK[0]}x{_BSR_BLOCK[1]}" if kw
                                                 else ""),
                     "levels": ",".join(map(str, B.format.levels)),
                     "mode_order": str(B.format.mode_order),
                     "shape": "x".join(map(str, B.shape)), "nnz": B.nnz,
                     "index": str(B.index_dtype).replace("torch.", ""),
                     "bytes": f"{nbytes:,}", "bytes/entry": f"{nbytes / max(adj.nnz, 1):.1f}"})
    print(format_table(rows, list(rows[0])))
    dense_bytes = adj.shape[0] * adj.shape[1] * 4
    print(f"(dense float32 would take {dense_bytes:,} bytes; 'nnz' counts stored entries, "
          "so BSR includes the zeros inside its blocks)")

    # Conversions, each library starting from its own native object.
    print()
    cases = _demo_cases(adj, A)
    for op, impls in cases.items():
        res = compare(impls, baseline="scipy", rounds=args.rounds, warmup=1, min_time=2e-3,
                      max_time=2.0, threads=args.threads)
        report.add(args.graph, res, op=op)
    print(f"conversions: median of {args.rounds} interleaved rounds, "
          f"{report.threads} threads; speedup = scipy time / this time (>1 is faster)")
    print(report.table(["op", "impl", "median_s", "spread", "speedup"]))
    print(f"\ndone in {time.perf_counter() - t_start:.1f}s")
    return 0


def _demo_cases(adj, A) -> dict:
    """op -> {impl: callable}; inputs are built once outside the timed calls."""
    from . import tensor

    coo = A.asformat("coo")
    t_csr = A.to_torch()
    t_coo = coo.to_torch()
    s_coo = adj.tocoo()
    dense = A.to_dense()
    dense_np = dense.numpy()
    return {
        "csr->csc": {"sparsetorch": lambda: A.asformat("csc"), "scipy": adj.tocsc,
                     "torch": t_csr.to_sparse_csc},
        "csr->coo": {"sparsetorch": lambda: A.asformat("coo"), "scipy": adj.tocoo,
                     "torch": t_csr.to_sparse_coo},
        "coo->csr": {"sparsetorch": lambda: coo.asformat("csr"), "scipy": s_coo.tocsr,
                     "torch": t_coo.to_sparse_csr},
        "dense->csr": {"sparsetorch": lambda: tensor(dense, format="csr"),
                       "scipy": lambda: type(adj)(dense_np), "torch": dense.to_sparse_csr},
        "csr->dense": {"sparsetorch": A.to_dense, "scipy": adj.toarray,
                       "torch": t_csr.to_dense},
    }


def _load_planetoid_adjacency(root, name: str):
    """The symmetrised, deduplicated, loop-free adjacency matrix (float32 scipy CSR) of a
    Planetoid graph, as PyG counts it (Cora: 2708 nodes, 10556 entries)."""
    from .datasets import planetoid

    if root is None:
        raise FileNotFoundError("no shared data folder (pass --data or set SPARSETORCH_DATA)")
    return planetoid(name, root=root).adj.to_scipy()


def _random_graph(n: int, avg_degree: int, seed: int):
    rng = np.random.default_rng(seed)
    m = n * avg_degree // 2
    return _symmetric_pattern(rng.integers(0, n, m), rng.integers(0, n, m), n)


def _symmetric_pattern(src, dst, n: int):
    import scipy.sparse as sp

    keep = src != dst
    r = np.concatenate([src[keep], dst[keep]])
    c = np.concatenate([dst[keep], src[keep]])
    adj = sp.csr_array((np.ones(r.size, np.float32), (r, c)), shape=(n, n))
    adj.sum_duplicates()
    adj.data[:] = 1.0
    return sp.csr_array((adj.data, adj.indices.astype(np.int32), adj.indptr.astype(np.int32)),
                        shape=adj.shape)


def _divisible(shape, block) -> bool:
    return all(s % b == 0 for s, b in zip(shape, block))


def _pad_to(adj, block):
    import scipy.sparse as sp

    shape = tuple(-(-s // b) * b for s, b in zip(adj.shape, block))
    out = sp.csr_array((adj.data, adj.indices, adj.indptr), shape=(adj.shape[0], shape[1]))
    return sp.vstack([out, sp.csr_array((shape[0] - adj.shape[0], shape[1]),
                                        dtype=adj.dtype)], format="csr")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
