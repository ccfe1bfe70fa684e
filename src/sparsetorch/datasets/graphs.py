"""Amazon-Computers, Amazon-Photo and Coauthor-CS (Shchur et al. 2018) from the shipped
``graphs/*.npz`` files, symmetrised as PyG does (``A + Aᵀ``, no self-loops, entries 1).
These datasets have no standard split: ``train_idx`` etc. are ``None``.
"""
from __future__ import annotations

import numpy as np
import torch

from ._graph import Graph, check_known_sizes, csr_features, symmetric_adjacency
from ._paths import dataset_dir, need_file
from ._pickle import CORRUPT_HINT, load_npz, numeric_array, sparse_matrix
from .planetoid import PLANETOID_NAMES, planetoid

NPZ_NAMES = ("amazon_cs", "amazon_photo", "coauthor_cs")
GRAPH_NAMES = PLANETOID_NAMES + NPZ_NAMES
_ALIASES = {"amazon_computers": "amazon_cs", "computers": "amazon_cs", "photo": "amazon_photo",
            "cs": "coauthor_cs"}


def graph(name: str, root=None) -> Graph:
    """Load any shipped graph by name as a ``Graph``.

    Names: ``cora``, ``citeseer``, ``pubmed`` (see ``planetoid``), ``amazon_cs`` (alias
    ``computers``), ``amazon_photo`` (``photo``), ``coauthor_cs`` (``cs``); case and
    ``-``/``_`` do not matter.

    Example:
        >>> import sparsetorch as st
        >>> g = st.datasets.graph("amazon_photo")       # doctest: +SKIP
        >>> g.num_nodes, g.num_edges, g.num_features, g.num_classes  # doctest: +SKIP
        (7650, 238162, 745, 8)
    """
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in PLANETOID_NAMES:
        return planetoid(key, root)
    if key not in NPZ_NAMES:
        raise ValueError(f"graph: unknown dataset {name!r}; use one of "
                         f"{', '.join(GRAPH_NAMES)}")
    where = f"graph({key!r})"
    path = need_file(dataset_dir("graphs", root) / f"{key}.npz", where)
    arrays = load_npz(path, ("adj_matrix", "node_attr", "node_label"))
    adj = sparse_matrix(_object(arrays["adj_matrix"]), f"{where}: {path} adj_matrix").tocoo()
    raw = numeric_array(arrays["node_label"], f"{where}: {path} node_label", 1)
    labels = raw.astype(np.int64)
    if raw.size and ((labels != raw).any() or labels.min() < 0):
        bad = raw[(labels != raw) | (labels < 0)][0]
        raise ValueError(f"{where}: {path} node_label holds {bad}; labels are class numbers "
                         f"0, 1, 2, ...; {CORRUPT_HINT}")
    n = adj.shape[0]
    if adj.shape != (n, n) or len(labels) != n:
        raise ValueError(f"{where}: {path} has a {adj.shape} adjacency and {len(labels)} "
                         "labels; expected a square adjacency with one label per node")
    features = csr_features(sparse_matrix(_object(arrays["node_attr"]),
                                          f"{where}: {path} node_attr"), where)
    if features.shape[0] != n:
        raise ValueError(f"{where}: {path} node_attr has {features.shape[0]} rows for {n} "
                         f"nodes; expected one feature row per node; {CORRUPT_HINT}")
    check_known_sizes(key, where, path, n, features.shape[1], int(labels.max()) + 1 if n else 0)
    return Graph(name=key, adj=symmetric_adjacency(adj.row, adj.col, n, where),
                 features=features, labels=torch.from_numpy(labels.copy()),
                 num_classes=int(labels.max()) + 1, num_features=int(features.shape[1]))


def _object(a):
    """The one object a 0-d object array from ``load_npz`` holds (anything else as is, for
    the checks to name)."""
    return a.item() if isinstance(a, np.ndarray) and a.dtype.hasobject and a.size == 1 else a


def amazon(name: str = "computers", root=None) -> Graph:
    """Amazon co-purchase graph: ``"computers"`` or ``"photo"``.

    Example:
        >>> import sparsetorch as st
        >>> st.datasets.amazon("computers").num_edges   # doctest: +SKIP
        491722
    """
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in ("amazon_cs", "amazon_photo"):
        raise ValueError(f"amazon: unknown dataset {name!r}; use 'computers' or 'photo'")
    return graph(key, root)


def coauthor(name: str = "cs", root=None) -> Graph:
    """Coauthor graph (only ``"cs"`` is shipped; Coauthor-Physics is not).

    Example:
        >>> import sparsetorch as st
        >>> st.datasets.coauthor("cs").num_edges        # doctest: +SKIP
        163788
    """
    if str(name).lower() not in ("cs", "coauthor_cs"):
        raise ValueError(f"coauthor: unknown dataset {name!r}; only 'cs' is shipped")
    return graph("coauthor_cs", root)
