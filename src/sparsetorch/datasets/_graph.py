"""``Graph``: what the graph loaders return, and the one adjacency builder they share."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..formats import SparseTensor


@dataclass(frozen=True, repr=False, eq=False)
class Graph:
    """A node-classification graph.

    ``adj`` is the symmetric adjacency (CSR, float32, entries 1, no self-loops, each
    undirected edge stored in both directions). ``features`` is a CSR float32 node-feature
    matrix, or ``None`` where the data are not shipped (PubMed). ``labels`` is int64.
    ``train_idx`` / ``val_idx`` / ``test_idx`` are the standard split's node indices (int64),
    or ``None`` when the dataset has no standard split; ``train_mask`` etc. are the same as
    boolean masks.

    Example:
        >>> import sparsetorch as st
        >>> g = st.datasets.planetoid("cora")          # doctest: +SKIP
        >>> g.num_nodes, g.num_edges, g.num_classes     # doctest: +SKIP
        (2708, 10556, 7)
    """

    name: str
    adj: SparseTensor
    features: SparseTensor | None
    labels: torch.Tensor
    num_classes: int
    num_features: int
    train_idx: torch.Tensor | None = None
    val_idx: torch.Tensor | None = None
    test_idx: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.adj.shape[0])

    @property
    def num_edges(self) -> int:
        """Stored adjacency entries (each undirected edge counts twice, as in PyG)."""
        return self.adj.nnz

    def _mask(self, idx):
        if idx is None:
            return None
        mask = torch.zeros(self.num_nodes, dtype=torch.bool)
        mask[idx] = True
        return mask

    @property
    def train_mask(self):
        return self._mask(self.train_idx)

    @property
    def val_mask(self):
        return self._mask(self.val_idx)

    @property
    def test_mask(self):
        return self._mask(self.test_idx)

    def __repr__(self) -> str:
        split = ("no standard split" if self.train_idx is None else
                 f"split {len(self.train_idx)}/{len(self.val_idx)}/{len(self.test_idx)}")
        feats = "features=None" if self.features is None else \
            f"features={tuple(self.features.shape)}"
        return (f"Graph({self.name!r}: {self.num_nodes} nodes, {self.num_edges} edge entries, "
                f"{feats}, {self.num_classes} classes, {split})")


def symmetric_adjacency(rows: np.ndarray, cols: np.ndarray, n: int, where: str) -> SparseTensor:
    """CSR float32 adjacency of the undirected graph with edges ``rows[i] -- cols[i]``:
    both directions, duplicates merged, self-loops dropped, every entry 1."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    bad = (rows < 0) | (rows >= n) | (cols < 0) | (cols >= n)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"{where}: edge {k} ({rows[k]}, {cols[k]}) names a node outside "
                         f"[0, {n}); the file is corrupt or not the shipped one")
    keep = rows != cols
    src = np.concatenate([rows[keep], cols[keep]])
    dst = np.concatenate([cols[keep], rows[keep]])
    key = np.sort(src * n + dst)                         # row-major order
    if key.size:
        key = key[np.concatenate([[True], key[1:] != key[:-1]])]   # merge duplicates
    src, dst = key // n, key % n
    pos = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=pos[1:])
    idx = torch.int32 if max(n, len(key)) < 2**31 else torch.int64
    arrays = {"pos1": torch.from_numpy(pos).to(idx), "crd1": torch.from_numpy(dst).to(idx)}
    return SparseTensor.from_levels((n, n), "csr", arrays, torch.ones(len(key)))


def csr_features(matrix, where: str) -> SparseTensor:
    """A scipy sparse feature matrix as a CSR float32 ``SparseTensor``."""
    from ..formats import tensor

    m = matrix.tocsr().astype(np.float32)
    m.sum_duplicates()
    m.sort_indices()
    try:
        return tensor(m, format="csr")
    except ValueError as e:
        raise ValueError(f"{where}: bad feature matrix ({e})") from None


# The shipped graphs' sizes: nodes, feature width, classes and (Planetoid) labelled training
# nodes. A file of another dataset under one's name loaded as that one (CiteSeer's
# test.index as Cora's: 3327 nodes; coauthor_cs.npz as amazon_photo.npz), a probe found.
SIZES = {"cora": (2708, 1433, 7, 140), "citeseer": (3327, 3703, 6, 120),
         "pubmed": (19717, 500, 3, 60), "amazon_cs": (13752, 767, 10, None),
         "amazon_photo": (7650, 745, 8, None), "coauthor_cs": (18333, 6805, 15, None)}


def check_known_sizes(name: str, where: str, files, nodes: int, features: int,
                      classes: int, train: int | None = None) -> None:
    """A ValueError naming ``files`` unless ``name``'s data have its known ``SIZES``.

    Example:
        >>> check_known_sizes("cora", "planetoid('cora')", "ind.cora.*", 2708, 1433, 7, 140)
        >>> check_known_sizes("cora", "planetoid('cora')", "ind.cora.*", 3327, 1433, 7, 140)
        Traceback (most recent call last):
        ValueError: planetoid('cora'): ind.cora.*: 3327 nodes, 1433 features, 7 classes, 140 training nodes, but cora has 2708 nodes, ...
    """
    want = SIZES[name]
    got = (nodes, features, classes, train if want[3] is not None else None)
    if got != want:
        names = ("nodes", "features", "classes", "training nodes")
        say = lambda sizes: ", ".join(f"{v} {k}" for v, k in zip(sizes, names)  # noqa: E731
                                      if v is not None)
        raise ValueError(f"{where}: {files}: {say(got)}, but {name} has {say(want)}: a file "
                         f"of another dataset, or a damaged one; restore the shipped files")
