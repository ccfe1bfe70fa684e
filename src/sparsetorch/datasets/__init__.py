"""Loaders for the small real datasets shipped in ``shared/data`` (read-only; nothing is
downloaded or written there).

In: a data root (``root=``, ``$SPARSETORCH_DATA``, or ``shared/data`` found next to the repo).
Out: ``Graph``s (adjacency and features as CSR ``SparseTensor``s), MNIST tensors, SuiteSparse
matrices and DLMC ``.smtx`` paths. Missing data raise ``FileNotFoundError`` saying where
they looked and how to fix it.

Example:
    >>> import sparsetorch as st
    >>> st.datasets.graph("cora").num_edges        # doctest: +SKIP
    10556
"""
from ._graph import Graph
from ._paths import data_root
from .graphs import GRAPH_NAMES, amazon, coauthor, graph
from .matrices import dlmc, suitesparse
from .mnist import MNIST, mnist
from .planetoid import PLANETOID_NAMES, planetoid

__all__ = ["data_root", "Graph", "graph", "planetoid", "amazon", "coauthor", "GRAPH_NAMES",
           "PLANETOID_NAMES", "mnist", "MNIST", "suitesparse", "dlmc"]
