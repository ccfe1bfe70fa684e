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
from ._pattern import kept_count  # noqa: F401  (the one counting rule, re-exported here)

METHODS = ("magnitude", "random")
BLOCK_ROWS = (4, 2)   # output-channel blocks tried, largest first (Fast Sparse ConvNets' 1x4/1x2)


def prune_mask(weight: torch.Tensor, *, density=None, sparsity=None,
               method: str = "magnitude", blocksize=None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Boolean mask (same shape as the 2-D ``weight``) of the entries a pruned layer keeps.

    Give ``density`` or ``sparsity`` by keyword (as ``st.sparsify``'s positional number is a
    sparsity, a positional one here would be ambiguous). ``method="magnitude"`` zeroes the
    ``round(sparsity * N)`` smallest ``|w|`` (``kept_count``; exactly that many, ties broken
    by ``torch.topk``); ``"random"`` keeps a uniformly random subset of the
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
    if method == "random":
        return _pattern.random_mask(tuple(weight.shape), bs, generator, "prune_mask",
                                    density=density, sparsity=sparsity)
    return _pattern.top_mask(weight.detach().abs(), bs, "prune_mask", density=density,
                             sparsity=sparsity)


def exact_density(shape, sparsity=None, blocksize=None, density=None) -> float:
    """The density ``k / N`` with ``k = kept_count(N, density, sparsity)`` of the ``N``
    entries (or blocks) of a weight of ``shape``: a density that keeps exactly ``k`` again
    under ``kept_count`` (``N - round((1 - k / N) * N) == k`` in floating point).

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
