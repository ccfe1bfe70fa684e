"""The workload registry behind ``sparsetorch bench``.

A ``Workload`` is a named model on a named dataset (``gcn-cora``, ``autoencoder-mnist``...).
Its ``prepare(ctx, mode)`` builds every implementation of that model for ``mode``
(``"infer"``: one forward; ``"train"``: one training step, forward + backward + optimizer
step), all from the same weights, and returns them as ``Impl``s: sparsetorch first, then
the baselines (torch.sparse CSR/COO, dense torch, PyTorch Geometric...). Baselines that
cannot run (package missing, too large for dense) are listed in ``Prepared.skipped`` with
the reason instead.

Each ``Impl`` carries two callables: ``run`` (what is timed) and ``check`` (the values
compared against sparsetorch's before any timing: the output for inference; the loss and
the gradients, in a layout common to every implementation, for training).

Example:
    >>> from sparsetorch.bench.workloads import Impl, Workload, select
    >>> toy = Workload("toy-a", "toy", lambda ctx, mode: None, quick=True)
    >>> [w.name for w in select([toy], only="toy", quick=False)]
    ['toy-a']
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

MODES = ("infer", "train")
OURS = "sparsetorch"


@dataclass(frozen=True)
class Impl:
    """One implementation of a workload in one mode.

    ``family`` groups configurations of one library (``"torch.sparse"`` holds CSR and COO):
    the report compares against the fastest member of each family and says which it was.
    """

    name: str
    family: str
    run: Callable[[], object]
    check: Callable[[], dict]
    config: str = ""


@dataclass
class Prepared:
    """What ``Workload.prepare`` returns: the implementations and what to say about them."""

    impls: list[Impl]
    source: str = "real"                      # or "generated stand-in (...)"
    size: str = ""                            # e.g. "2708 nodes, 10556 edges"
    skipped: dict[str, str] = field(default_factory=dict)   # family -> reason
    notes: list[str] = field(default_factory=list)
    rtol: float = 1e-4
    atol: float = 1e-5                        # relative to the largest reference value


@dataclass(frozen=True)
class Workload:
    """A named benchmark. ``prepare(ctx, mode) -> Prepared``; ``quick`` marks the ones
    ``--quick`` runs; ``modes`` the modes it has."""

    name: str
    group: str
    prepare: Callable[["Context", str], Prepared]
    quick: bool = False
    modes: tuple[str, ...] = MODES
    describe: str = ""


@dataclass
class Context:
    """Shared state for one bench run: where data lives, size limits, cached datasets."""

    data_root: Path | None = None
    quick: bool = False
    dense_limit_bytes: int = 1 << 29          # a dense operand larger than this is skipped
    seed: int = 0
    cache: dict = field(default_factory=dict)

    def cached(self, key, build: Callable[[], object]):
        """``build()`` once per run for ``key`` (datasets shared by GCN, GAT and SAGE)."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def dense_fits(self, *shape: int, dtype=torch.float32) -> bool:
        """Whether a dense tensor of ``shape`` stays under ``dense_limit_bytes``."""
        n = 1
        for s in shape:
            n *= int(s)
        return n * torch.empty((), dtype=dtype).element_size() <= self.dense_limit_bytes


REGISTRY: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    """Add ``workload`` to the registry (names are unique)."""
    if workload.name in REGISTRY:
        raise ValueError(f"bench: workload {workload.name!r} registered twice")
    REGISTRY[workload.name] = workload
    return workload


def select(workloads, only: str | None = None, quick: bool = False) -> list[Workload]:
    """The workloads to run. ``only`` is a comma-separated list of names, groups
    (``gcn`` selects every ``gcn-*``) or shell patterns (``*-cora``); it overrides ``quick``.
    Without it, ``quick`` keeps the workloads marked quick. Unknown names raise ValueError.

    Example:
        >>> ws = [Workload("gcn-cora", "gcn", None, quick=True), Workload("gat-cora", "gat", None)]
        >>> [w.name for w in select(ws, "gat")], [w.name for w in select(ws, quick=True)]
        (['gat-cora'], ['gcn-cora'])
    """
    workloads = list(workloads)
    if only is None:
        return [w for w in workloads if w.quick or not quick]
    chosen = []
    for pattern in (p.strip() for p in only.split(",")):
        if not pattern:
            continue
        hits = [w for w in workloads if w.name == pattern or w.group == pattern
                or fnmatch.fnmatchcase(w.name, pattern)]
        if not hits:
            names = ", ".join(sorted({w.group for w in workloads} | {w.name for w in workloads}))
            raise ValueError(f"bench --only: no workload matches {pattern!r}; choose from "
                             f"{names}")
        chosen += [w for w in hits if w not in chosen]
    if not chosen:
        raise ValueError(f"bench --only {only!r} names no workload; give names, groups or "
                         "patterns separated by commas (--list shows them)")
    return chosen
