"""Importing this registers every workload of ``sparsetorch bench`` (each module registers
its own at import).

Example:
    >>> from sparsetorch.bench import all_workloads
    >>> from sparsetorch.bench.workloads import REGISTRY
    >>> "gcn-cora" in REGISTRY
    True
"""
from . import gnn  # noqa: F401
from . import autoencoder  # noqa: F401
from . import transformer  # noqa: F401
from . import convnets  # noqa: F401
