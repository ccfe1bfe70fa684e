"""Sparsetorch's side of the GNN workloads: ``st.models.GCN``, ``st.models.GAT`` and two
``st.nn.SAGEConv`` layers, loaded with the shared weights (see ``gnn_torch``), with their
gradients read back in the same layout.
"""
from __future__ import annotations


def ours_model(kind: str, weights: dict, g, heads: int):
    """``(model, config)``: a module whose ``forward()`` takes no arguments and whose
    ``grads()`` returns the shared weight names. Raises NotImplementedError when the layer
    is not in this build."""
    import sparsetorch as st

    need = {"gcn": ("models", "GCN"), "gat": ("models", "GAT"), "sage": ("nn", "SAGEConv")}[kind]
    if not hasattr(getattr(st, need[0], None), need[1]):
        raise NotImplementedError(f"st.{need[0]}.{need[1]} is not in this build yet")
    raise NotImplementedError(f"st.{need[0]}.{need[1]}: the bench adapter is not written yet")
