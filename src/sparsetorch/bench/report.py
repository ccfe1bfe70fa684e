"""``sparsetorch bench``'s output: the results table, the target summary, the JSON document
and the PNG chart of the ratios.

Example:
    >>> row = {"workload": "gcn-cora", "mode": "train", "source": "real", "ours_s": 0.002,
    ...        "first_s": 0.5, "check": "ok", "skipped": {"dense": "too large"},
    ...        "vs": {"torch.sparse": {"ratio": 2.5, "impl": "torch.sparse CSR"}}}
    >>> print(results_table([row]))  # doctest: +NORMALIZE_WHITESPACE
    workload  mode   data  sparsetorch  first call  vs torch.sparse  vs dense  vs PyG  check
    gcn-cora  train  real       2.00ms    500.00ms       2.50x CSR   skipped       -  ok
"""
from __future__ import annotations

import io
from pathlib import Path

from .._files import atomic_write
from .harness import format_table, format_time, geomean

FAMILIES = ("torch.sparse", "dense", "PyG")

# (what, rows it covers, family, bound): the targets of issue 32, checked on every run.
TARGETS = [
    ("every workload vs torch.sparse >= 1.3x", lambda r: True, "torch.sparse", 1.3),
    ("GCN and GAT training steps vs PyG >= 2x",
     lambda r: r["group"] in ("gcn", "gat") and r["mode"] == "train", "PyG", 2.0),
    ("transformer L=4096 vs dense >= 3x",
     lambda r: r["workload"] == "transformer-4096", "dense", 3.0),
    ("autoencoder vs dense >= 3x", lambda r: r["group"] == "autoencoder", "dense", 3.0),
]
GEOMEAN_TARGET = 2.5
OVERHEAD_TARGET = 0.20


def ratio_cell(row: dict, family: str) -> str:
    """``2.31x CSR`` (ratio against the family's fastest implementation, and which),
    ``skipped`` when the family could not run, ``-`` when the workload has no such baseline."""
    vs = row.get("vs", {}).get(family)
    if vs and vs.get("ratio") is not None:
        tag = vs.get("impl", "").removeprefix(family).strip()   # "torch.sparse COO" -> "COO"
        return f"{vs['ratio']:.2f}x {tag}".rstrip()
    if family in row.get("skipped", {}):
        return "skipped"
    return "-"


def results_table(rows: list[dict]) -> str:
    """One line per workload and mode: sparsetorch's median time, its first call (kernel
    compiles included), the ratio against each baseline family (> 1: sparsetorch faster)
    and the correctness check."""
    table = []
    for r in rows:
        table.append({
            "workload": r["workload"], "mode": r["mode"],
            "data": _data_kind(r.get("source", "real")),
            "sparsetorch": format_time(r["ours_s"]) if r.get("ours_s") else "error",
            "first call": format_time(r["first_s"]) if r.get("first_s") else "-",
            **{f"vs {f}": ratio_cell(r, f) for f in FAMILIES},
            "check": r.get("check", ""),
        })
    return format_table(table, list(table[0])) if table else "(no workloads ran)"


def _data_kind(source: str) -> str:
    """``real``, ``synthetic`` (workloads without a dataset: random tokens or images) or
    ``stand-in`` (a dataset was missing and generated data of its size replaced it)."""
    return "real" if source == "real" else "synthetic" if source.startswith("generated (") \
        else "stand-in"


def summary(rows: list[dict], overhead: dict | None = None) -> list[str]:
    """Lines saying, for each target of issue 32, whether this run met it, and by how much
    it missed where it did not."""
    lines = []
    for what, covers, family, bound in TARGETS:
        got = [(r, r["vs"][family]["ratio"]) for r in rows
               if covers(r) and r.get("vs", {}).get(family, {}).get("ratio") is not None]
        if not got:
            lines.append(f"{what}: not measured in this run")
            continue
        missed = [f"{r['workload']} {r['mode']} {x:.2f}x" for r, x in got if x < bound]
        lines.append(f"{what}: " + ("met" if not missed else
                                     f"MISSED on {len(missed)} of {len(got)}: "
                                     + ", ".join(missed)))
    g = geomean(r["vs"]["torch.sparse"]["ratio"] for r in rows
                if r.get("vs", {}).get("torch.sparse", {}).get("ratio"))
    if g is not None:
        lines.append(f"geomean vs torch.sparse {g:.2f}x (target >= {GEOMEAN_TARGET}x): "
                     + ("met" if g >= GEOMEAN_TARGET else "MISSED"))
    if overhead and overhead.get("overhead") is not None:
        o = overhead["overhead"]
        lines.append(f"GCN forward overhead on {overhead['graph']} {100 * o:.0f}% over its "
                     f"kernels' sum (target <= {100 * OVERHEAD_TARGET:.0f}%): "
                     + ("met" if o <= OVERHEAD_TARGET else "MISSED"))
    return lines


def plot(rows: list[dict], path) -> Path:
    """Write a horizontal bar chart of the ratios (log scale, one bar per baseline family)
    to ``path`` (PNG), whole or not at all: a chart there before survives a failed write.
    Needs matplotlib (the ``bench`` extra); returns the path written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']} {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) * len(FAMILIES) / 2 + 1.5))
    height = 0.8 / len(FAMILIES)
    for k, fam in enumerate(FAMILIES):
        vals = [r.get("vs", {}).get(fam, {}).get("ratio") or float("nan") for r in rows]
        ys = [i + k * height for i in range(len(rows))]
        ax.barh(ys, vals, height=height, label=f"vs {fam}")
    ax.set_yticks([i + height * (len(FAMILIES) - 1) / 2 for i in range(len(rows))], labels,
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup of sparsetorch (baseline time / sparsetorch time; > 1 is faster)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("sparsetorch bench")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return atomic_write(path, lambda f: f.write(png.getvalue()), who="sparsetorch bench --plot")
