"""Graph adjacencies for the graph layers: ``edge_index`` or SparseTensor in, a normalised
CSR SparseTensor out, computed once per adjacency and kept.

Convention (PyG's): messages flow source -> target. An ``edge_index`` is a ``(2, E)`` int
tensor with row 0 the sources and row 1 the targets; a SparseTensor adjacency ``A`` stores
``A[i, j]`` when ``j`` sends to ``i`` (it is PyG's ``adj_t``), so a layer computes
``A @ x``. Each stored entry is an edge, with its value as weight, a stored zero too,
except in a blocked format (BSR), whose blocks store the zeros around their edges: there
an edge is a nonzero. For an undirected graph (both directions stored) the two readings agree.
Duplicate edges add up (as PyG's scatter-sum of their messages does), except self loops
where a layer adds them: one per node, as PyG's ``add_remaining_self_loops`` keeps.

The normalisation runs as vectorised torch over the entries' coordinates (degrees by
``index_add_``, scaling by gathers), then one conversion into CSR: no loops over nodes.
"""
from __future__ import annotations

import weakref

import torch

from .._modes import outside_inference_mode, version
from ..formats import SparseTensor
from ..formats import tensor as st_tensor
from ._common import check_sizes

NORMALIZATIONS = ("sym", "mean", None)
DEGREES = ("weights", "edges")


def normalized_adjacency(adj, num_nodes: int, normalize="sym", self_loops: bool = True, *,
                         degree: str = "weights", dtype=torch.float32,
                         what: str = "normalized_adjacency") -> SparseTensor:
    """The propagation matrix of ``adj`` as a CSR SparseTensor of shape ``(n, n)``:

    - ``self_loops``: add an entry of 1 on the diagonal of every node that has none
      (existing self loops keep their weight, and a loop given twice counts once: PyG's
      ``add_remaining_self_loops``);
    - ``normalize="sym"``: ``D^-1/2 A D^-1/2`` with ``D`` the row sums (in-degrees), PyG's
      ``gcn_norm``; ``"mean"``: ``D^-1 A`` (each row averages its neighbours); ``None``: as is.
      Rows of degree 0 stay empty.
    - ``degree``: what ``D`` counts: ``"weights"``, the sum of a node's in-edge weights (PyG's
      ``gcn_norm``), or ``"edges"``, the number of its in-edges whatever their weights (PyG's
      mean aggregation: ``"mean"`` then averages the weighted messages ``w_ij x_j``). The two
      agree on an unweighted graph.

    Example:
        >>> import torch
        >>> A = normalized_adjacency(torch.tensor([[0, 1], [1, 0]]), 2)
        >>> A.to_dense()
        tensor([[0.5000, 0.5000],
                [0.5000, 0.5000]])
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"{what}: normalize must be 'sym', 'mean' or None, got {normalize!r}")
    if degree not in DEGREES:
        raise ValueError(f"{what}: degree must be one of {DEGREES}, got {degree!r}")
    check_sizes(what, least=0, num_nodes=num_nodes)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{what}: dtype must be a floating-point torch.dtype (the "
                        f"normalised weights are fractions), got {dtype!r}")
    rows, cols, vals = coordinates(adj, num_nodes, dtype, what)
    if self_loops:   # one loop per node: its stored weight (one of them, if repeated) or 1
        loop = rows == cols
        weight = torch.ones(num_nodes, dtype=dtype, device=vals.device)
        weight[rows[loop]] = vals[loop]
        nodes = torch.arange(num_nodes, device=rows.device)
        rows, cols = torch.cat([rows[~loop], nodes]), torch.cat([cols[~loop], nodes])
        vals = torch.cat([vals[~loop], weight])
    if normalize is not None:
        counted = vals if degree == "weights" else torch.ones_like(vals)
        deg = torch.zeros(num_nodes, dtype=dtype, device=vals.device).index_add_(0, rows,
                                                                                 counted)
        inv = deg.pow(-0.5 if normalize == "sym" else -1.0)
        inv.masked_fill_(torch.isinf(inv), 0)
        vals = inv[rows] * vals * (inv[cols] if normalize == "sym" else 1)
    return st_tensor((torch.stack([rows, cols]), vals), shape=(num_nodes, num_nodes),
                     format="csr")


def coordinates(adj, num_nodes: int, dtype, what: str):
    """``(targets, sources, weights)`` of every edge of ``adj`` (int64, int64, ``dtype``)."""
    if isinstance(adj, SparseTensor):
        if adj.dim() != 2 or tuple(adj.shape) != (num_nodes, num_nodes):
            raise ValueError(f"{what}: the adjacency has shape {tuple(adj.shape)} but x has "
                             f"{num_nodes} nodes; pass an ({num_nodes}, {num_nodes}) "
                             "SparseTensor or an edge_index")
        coo = adj.detach().asformat("coo")
        rows, cols, values = coo.arrays["crd0"].long(), coo.arrays["crd1"].long(), coo.values
        if adj.format.blocksize is not None:
            # (a block stores the zeros around its edges: those are no edges; an explicit
            # zero in a block cannot be told from them, so zeros are dropped)
            edge = values != 0
            rows, cols, values = rows[edge], cols[edge], values[edge]
        return rows, cols, values.to(dtype)
    if not isinstance(adj, torch.Tensor) or adj.layout != torch.strided:
        raise TypeError(f"{what}: adj must be an edge_index (a (2, E) integer tensor) or a "
                        f"SparseTensor adjacency, got {type(adj).__name__}"
                        + ("" if not isinstance(adj, torch.Tensor) else
                           f" with layout {adj.layout}; convert it with st.tensor(adj)"))
    if adj.dtype.is_floating_point or adj.dtype == torch.bool or adj.dim() != 2 or \
            adj.shape[0] != 2:
        raise ValueError(f"{what}: an edge_index must be a (2, E) integer tensor (row 0 the "
                         f"sources, row 1 the targets), got {adj.dtype} of shape "
                         f"{tuple(adj.shape)}")
    if adj.numel() and (int(adj.min()) < 0 or int(adj.max()) >= num_nodes):
        raise ValueError(f"{what}: edge_index holds node ids in [{int(adj.min())}, "
                         f"{int(adj.max())}] but x has {num_nodes} nodes")
    edges = adj.long()
    return edges[1], edges[0], torch.ones(edges.shape[1], dtype=dtype, device=adj.device)


class AdjacencyCache:
    """One layer's normalised adjacency, kept while the same adjacency comes back: keyed by
    the object (a weak reference, so a freed tensor is never mistaken for a new one at its
    address), its tensors' data pointers and versions (in-place edits invalidate), the node
    count, the dtype and the layer's settings that shape the matrix (``config``: a layer's
    ``normalize`` or ``add_self_loops`` set after a first call must not find the old one).

    Example:
        >>> import torch
        >>> cache, e = AdjacencyCache(), torch.tensor([[0, 1], [1, 0]])
        >>> build = lambda: normalized_adjacency(e, 2)
        >>> cache.get(e, 2, torch.float32, build) is cache.get(e, 2, torch.float32, build)
        True
    """

    def __init__(self):
        # (reference, key, matrix) in one attribute, written and read whole: a layer called
        # from several threads read a new reference and key beside the old matrix, another
        # graph's, when they were three (a probe's finding)
        self._kept = None

    def get(self, adj, num_nodes: int, dtype, build, config=()):
        value = self.lookup(adj, num_nodes, dtype, config)
        if value is None:
            value = outside_inference_mode(build)()
            self._kept = weakref.ref(adj), _key(adj, num_nodes, dtype, config), value
        return value

    def lookup(self, adj, num_nodes: int, dtype, config=()):
        """The kept matrix when ``adj`` is the adjacency it was built from, unchanged, for
        the same node count, dtype and ``config``; else None. (A layer's forward runs this on every
        call: a few attribute reads, ~1 us, where building the key as a tuple of tuples
        took 5.)"""
        kept = self._kept
        if kept is None or kept[0]() is not adj:
            return None
        return kept[2] if kept[1] == _key(adj, num_nodes, dtype, config) else None

    def clear(self) -> None:
        self._kept = None

    # A copy or a pickled layer starts empty: the kept matrix is derived data (and a weak
    # reference cannot be pickled).
    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.clear()


def _key(adj, num_nodes: int, dtype, config) -> tuple:
    # (a SparseTensor's level arrays never change -- ``.arrays`` gives copies -- so the
    # same object with the same values is the same matrix)
    t = adj.values if isinstance(adj, SparseTensor) else adj
    return t.data_ptr(), version(t), t.shape, num_nodes, dtype, config
