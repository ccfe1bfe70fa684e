"""The overhead metric: a GCN forward on Cora against the sum of its kernels' times.

Written once the GCN layer exists: see ``gcn_overhead``.
"""
from __future__ import annotations


def gcn_overhead(ctx, rounds: int = 10, threads=None) -> dict | None:
    """``{"graph", "overhead", "detail", ...}`` or ``None`` when the GCN is not built."""
    import sparsetorch as st

    if not hasattr(getattr(st, "models", None), "GCN"):
        return {"graph": "cora", "overhead": None,
                "detail": "not measured: st.models.GCN is not in this build"}
    raise NotImplementedError
