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

from ._graph import Graph, check_known_sizes, csr_features, symmetric_adjacency
from ._paths import dataset_dir, need_file
from ._pickle import CORRUPT_HINT, load_pickle, numeric_array, sparse_matrix

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

    def part(k, check):
        path = need_file(folder / f"ind.{key}.{k}", where)
        return check(load_pickle(path), f"{where}: {path}")

    def labels_of(obj, what):
        y = numeric_array(obj, what, 2)
        # one-hot rows (all zero for the few unlabelled test nodes of CiteSeer): anything
        # else is a flipped byte, which argmax would turn into a plausible label
        if y.size and (((y != 0) & (y != 1)).any() or (y.sum(1) > 1).any()):
            raise ValueError(f"{what}: label rows must be one-hot (0/1, at most one 1); "
                             f"{CORRUPT_HINT}")
        return y

    y, ty, ally = (part(k, labels_of) for k in ("y", "ty", "ally"))
    x, tx = (part(k, sparse_matrix) for k in ("x", "tx"))
    graph = part("graph", _adjacency_lists)
    allx_path = folder / f"ind.{key}.allx"
    allx = part("allx", sparse_matrix) if key != "pubmed" or allx_path.is_file() else None
    test_path = need_file(folder / f"ind.{key}.test.index", where)
    try:
        test_idx = np.array(test_path.read_bytes().split(), dtype=np.int64)
    except (ValueError, OverflowError) as e:   # (a word that is no integer, or past int64)
        raise ValueError(f"{where}: {test_path} must hold node ids (integers), one per line: "
                         f"{e}; the file is corrupt") from e
    start = len(ally)
    classes, width = ally.shape[1], x.shape[1]
    if (not test_idx.size or test_idx.size != len(ty) or test_idx.min() < start
            or test_idx.max() >= start + 2 * len(ty) or len(np.unique(test_idx)) != len(ty)):
        span = f"from {test_idx.min()} to {test_idx.max()}" if test_idx.size else ""
        raise ValueError(f"{where}: {test_path} lists {test_idx.size} nodes {span}, but ty "
                         f"has {len(ty)} rows and ally {start}; expected {len(ty)} distinct "
                         f"nodes in [{start}, {start + 2 * len(ty)}) (test nodes follow the "
                         "labelled ones); the files do not belong together")
    shapes = {"y": y.shape, "ty": ty.shape, "ally": ally.shape, "x": x.shape, "tx": tx.shape,
              **({"allx": allx.shape} if allx is not None else {})}
    if (y.shape[1] != classes or ty.shape[1] != classes or len(y) > start
            or tx.shape != (len(ty), width) or allx is not None and allx.shape != (start, width)):
        raise ValueError(f"{where}: the parts' shapes {shapes} do not fit together (one "
                         f"label column per class, tx one row per ty row, allx one per ally "
                         f"row); {CORRUPT_HINT}")
    n = int(test_idx.max()) + 1
    check_known_sizes(key, where, folder / f"ind.{key}.*", n, width, classes, len(y))

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


_MAX_ID = 2 ** 62   # (larger ids overflowed numpy's int64 with an OverflowError)


def _adjacency_lists(obj, what: str) -> dict:
    """``obj`` if it maps node ids (ints) to lists of node ids, as ``ind.*.graph`` does."""
    if not isinstance(obj, dict) or not all(
            type(k) is int and 0 <= k < _MAX_ID and isinstance(v, (list, tuple))
            and all(type(u) is int and 0 <= u < _MAX_ID for u in v) for k, v in obj.items()):
        raise ValueError(f"{what} holds a {type(obj).__name__} that does not map node ids "
                         f"(ints from 0 to 2^62) to lists of node ids; {CORRUPT_HINT}")
    return obj
