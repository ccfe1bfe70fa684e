"""Sparsity patterns of pruned weights: which entries a layer keeps, and the stored layout.

``prune_mask`` picks the kept entries of a dense weight (magnitude or random, exact counts,
optionally whole output-channel blocks); ``choose_blocksize`` finds the output-channel block
(4, 2 or none) a mask is made of; ``SparsePattern`` holds the stored pattern of a weight as a
``SparseTensor`` plus each stored entry's flat position in the dense weight, so values move
between dense and storage order by one gather or scatter.

Example:
    >>> import torch
    >>> w = torch.tensor([[1., -4.], [0.5, 3.]])
    >>> prune_mask(w, sparsity=0.5)
    tensor([[False,  True],
            [False,  True]])
    >>> p = SparsePattern(prune_mask(w, sparsity=0.5))
    >>> p.gather(w), p.blocksize       # the kept column is one block of 2 output channels
    (tensor([-4.,  3.]), (2, 1))
"""
from __future__ import annotations

import torch

from ..formats import SparseTensor
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
    cells = weight.numel() // (1 if bs is None else bs[0] * bs[1])
    # the exact count as a density: round(keep / cells * cells) == keep in floating point
    density = kept_count(cells, density, sparsity, "prune_mask") / cells
    if method == "random":
        return _pattern.random_mask(tuple(weight.shape), density, bs, generator, "prune_mask")
    return _pattern.top_mask(weight.detach().abs(), density, bs, "prune_mask")


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


class SparsePattern:
    """The stored pattern of a 2-D weight: ``tensor`` (a SparseTensor of ones, CSR or
    output-channel-blocked BSR) and ``order`` (each stored entry's flat index into the dense
    weight, in storage order).

    Example:
        >>> import torch
        >>> p = SparsePattern(torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]).bool())
        >>> p.blocksize, p.nnz, p.order.tolist()
        ((2, 1), 4, [0, 2, 5, 7])
    """

    def __init__(self, mask: torch.Tensor, blocksize="auto"):
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"mask must be a 2-D (out, in) tensor; got "
                             f"{type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}")
        mask = mask.detach().to("cpu", torch.bool)
        self.shape = tuple(mask.shape)
        if blocksize == "auto":
            blocksize = choose_blocksize(mask)
        self.blocksize = _pattern.blocks(blocksize, self.shape, "SparsePattern")
        if self.blocksize is not None and not bool(
                (_pattern.expand_blocks(_block_any(mask, self.blocksize), self.blocksize) == mask).all()):
            raise ValueError(f"mask does not fill whole {self.blocksize} blocks; use "
                             f"blocksize=None (CSR) or a mask of whole blocks")
        self.tensor: SparseTensor = _pattern.from_mask(mask, self.shape, self.blocksize,
                                                       "SparsePattern")
        self.order = _pattern.positions(self.tensor)

    @property
    def nnz(self) -> int:
        return int(self.order.numel())

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """The entries of ``dense`` (shape ``self.shape``) at the stored positions, in storage
        order."""
        return dense.reshape(-1)[self.order]

    def mask(self) -> torch.Tensor:
        """Dense boolean mask of the stored positions."""
        flat = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.bool)
        flat[self.order] = True
        return flat.view(self.shape)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Dense (out, in) weight with ``values`` (storage order) at the stored positions."""
        flat = values.new_zeros(self.shape[0] * self.shape[1])
        return flat.index_put((self.order,), values).view(self.shape)


def _block_any(mask: torch.Tensor, blocksize) -> torch.Tensor:
    r, c = blocksize
    return mask.reshape(mask.shape[0] // r, r, mask.shape[1] // c, c).any(3).any(1)
