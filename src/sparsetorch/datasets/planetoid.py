"""Cora, CiteSeer and PubMed from the original Planetoid ``ind.*`` files, with the Kipf &
Welling (GCN) conventions: features ``vstack(allx, tx)`` with the test rows moved to their
``test.index`` nodes, CiteSeer's 15 isolated test-range nodes padded with zero features (and
label 0, as in ``gcn/utils.py`` and PyG), split = first ``len(y)`` nodes train, the next 500
validation, the 1000 ``test.index`` nodes test.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ._graph import Graph, csr_features, symmetric_adjacency
from ._paths import dataset_dir, need_file
from ._pickle import load_pickle

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")


def planetoid(name: str, root=None) -> Graph:
    """Load ``"cora"``, ``"citeseer"`` or ``"pubmed"`` as a ``Graph`` (Kipf GCN split).

    PubMed: the shipped data lack ``ind.pubmed.allx`` (too large to ship), so
    ``features`` is ``None`` (``num_features`` is still 500); use identity or random
    features, or restrict feature-based experiments to Cora and CiteSeer. Features are raw
    (not row-normalised). Raises ``FileNotFoundError`` if the data are missing.

    Example:
        >>> import sparsetorch as st
        >>> g = st.datasets.planetoid("cora")                    # doctest: +SKIP
        >>> g.num_nodes, g.num_edges, g.num_features, g.num_classes  # doctest: +SKIP
        (2708, 10556, 1433, 7)
        >>> int(g.train_mask.sum()), len(g.val_idx), len(g.test_idx)  # doctest: +SKIP
        (140, 500, 1000)
    """
    key = str(name).lower()
    if key not in PLANETOID_NAMES:
        raise ValueError(f"planetoid: unknown dataset {name!r}; use one of "
                         f"{', '.join(PLANETOID_NAMES)}")
    folder = dataset_dir("planetoid", root)
    where = f"planetoid({key!r})"

    def part(k):
        return load_pickle(need_file(folder / f"ind.{key}.{k}", where))

    y, ty, ally, graph, x, tx = (part(k) for k in ("y", "ty", "ally", "graph", "x", "tx"))
    allx_path = folder / f"ind.{key}.allx"
    allx = part("allx") if key != "pubmed" or allx_path.is_file() else None
    test_path = need_file(folder / f"ind.{key}.test.index", where)
    test_idx = np.fromstring(test_path.read_bytes(), dtype=np.int64, sep=" ")
    start = len(ally)
    if test_idx.size != len(ty) or test_idx.min() < start:
        raise ValueError(f"{where}: {test_path} lists {test_idx.size} nodes from "
                         f"{test_idx.min()}, but ty has {len(ty)} rows and ally {start}; the "
                         "files do not belong together")
    n = int(test_idx.max()) + 1

    onehot = np.zeros((n, ally.shape[1]), np.int64)
    onehot[:start] = ally
    onehot[test_idx] = ty                       # tx/ty row k belongs to node test_idx[k]
    labels = torch.from_numpy(onehot.argmax(1))

    features = None
    if allx is not None:
        import scipy.sparse as sp

        a, t = allx.tocoo(), tx.tocoo()
        rows = np.concatenate([a.row, test_idx[t.row]])
        cols = np.concatenate([a.col, t.col])
        vals = np.concatenate([a.data, t.data])
        features = csr_features(sp.coo_matrix((vals, (rows, cols)), shape=(n, a.shape[1])),
                                where)

    lens = np.fromiter(map(len, graph.values()), np.int64, count=len(graph))
    src = np.repeat(np.fromiter(graph.keys(), np.int64, count=len(graph)), lens)
    dst = np.fromiter(itertools.chain.from_iterable(graph.values()), np.int64,
                      count=int(lens.sum()))
    adj = symmetric_adjacency(src, dst, n, where)

    n_train = len(y)
    return Graph(name=key, adj=adj, features=features, labels=labels,
                 num_classes=int(ally.shape[1]), num_features=int(x.shape[1]),
                 train_idx=torch.arange(n_train), val_idx=torch.arange(n_train, n_train + 500),
                 test_idx=torch.from_numpy(np.sort(test_idx)))
