"""Pruning: which entries of a dense weight a sparse layer keeps, and in which blocks.

``prune_mask`` picks the kept entries (magnitude or random, exactly ``round(sparsity * N)``
zeroed, optionally whole blocks); ``choose_blocksize`` finds the output-channel block (4, 2
or none) a mask is made of, the blocks Fast Sparse ConvNets' kernels run fastest on. The
selection itself is ``_pattern``'s (shared with ``SparseLinear``).

Example:
    >>> import torch
    >>> w = torch.tensor([[1., -4.], [0.5, 3.]])
    >>> mask = prune_mask(w, sparsity=0.5)
    >>> mask, choose_blocksize(mask)     # the kept column is one block of 2 output channels
    (tensor([[False,  True],
            [False,  True]]), (2, 1))
"""
from __future__ import annotations

import torch

from . import _pattern

METHODS = ("magnitude", "random")
BLOCK_ROWS = (4, 2)   # output-channel blocks tried, largest first (Fast Sparse ConvNets' 1x4/1x2)


def kept_count(total: int, density=None, sparsity=None, what: str = "layer") -> int:
    """How many of ``total`` entries a layer keeps: ``total - round(sparsity * total)``
    (exact, as the issue asks), from exactly one of ``density`` and ``sparsity`` in [0, 1].

    Example:
        >>> kept_count(10, sparsity=0.9), kept_count(10, density=0.3)
        (1, 3)
    """
    if (density is None) == (sparsity is None):
        raise ValueError(f"{what}: give exactly one of density= and sparsity= "
                         f"(got density={density!r}, sparsity={sparsity!r})")
    s = 1.0 - float(density) if sparsity is None else float(sparsity)
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"{what}: sparsity must lie in [0, 1] (density in [0, 1]); got {s!r}")
    return total - round(s * total)


def prune_mask(weight: torch.Tensor, density=None, sparsity=None, method: str = "magnitude",
               blocksize=None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Boolean mask (same shape as the 2-D ``weight``) of the entries a pruned layer keeps.

    ``method="magnitude"`` zeroes the ``round(sparsity * N)`` smallest ``|w|`` (exactly that
    many, ties broken by ``torch.topk``); ``"random"`` keeps a uniformly random subset of the
    same size. With ``blocksize=(r, c)`` (e.g. ``(4, 1)``, four output channels) the unit is a
    block, scored by its summed ``|w|``, and ``N`` counts blocks.

    Example:
        >>> import torch
        >>> prune_mask(torch.arange(8.).view(4, 2), sparsity=0.5, blocksize=(2, 1)).int()
        tensor([[0, 0],
                [0, 0],
                [1, 1],
                [1, 1]], dtype=torch.int32)
    """
    if method not in METHODS:
        raise ValueError(f"prune_mask: method={method!r} is not one of {METHODS}")
    if weight.dim() != 2:
        raise ValueError(f"prune_mask: weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    bs = _pattern.blocks(blocksize, weight.shape, "prune_mask")
    density = exact_density(weight.shape, sparsity, bs, density)
    if method == "random":
        return _pattern.random_mask(tuple(weight.shape), density, bs, generator, "prune_mask")
    return _pattern.top_mask(weight.detach().abs(), density, bs, "prune_mask")


def exact_density(shape, sparsity=None, blocksize=None, density=None) -> float:
    """The density at which ``_pattern``'s selections (``round(density * N)`` kept) keep
    exactly ``kept_count(N, density, sparsity)`` of the ``N`` entries (or blocks) of a weight
    of ``shape``: ``round(k / N * N) == k`` in floating point.

    Example:
        >>> exact_density((4, 10), sparsity=0.9), exact_density((4, 10), 0.9, (2, 1))
        (0.1, 0.1)
    """
    cells = shape[0] * shape[1] // (1 if blocksize is None else blocksize[0] * blocksize[1])
    return kept_count(cells, density, sparsity, "prune_mask") / cells


def choose_blocksize(mask: torch.Tensor):
    """``(r, 1)`` for the largest ``r`` in (4, 2) such that ``mask`` is made of whole blocks of
    ``r`` consecutive output channels (rows) in one column, else ``None`` (CSR).

    Example:
        >>> import torch
        >>> choose_blocksize(torch.tensor([[1, 0], [1, 0]]).bool()), choose_blocksize(torch.eye(2).bool())
        ((2, 1), None)
    """
    rows, cols = mask.shape
    if not bool(mask.any()):
        return None
    for r in BLOCK_ROWS:
        if rows % r == 0:
            m = mask.reshape(rows // r, r, cols)
            if bool((m == m[:, :1]).all()):
                return (r, 1)
    return None
