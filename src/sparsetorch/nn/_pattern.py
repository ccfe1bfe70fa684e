"""Weight patterns for sparse layers: built from a bool mask, a SparseTensor or a density,
and read back as dense positions.

A pattern is a 2-D SparseTensor in CSR (or BSR with a block size) whose values do not
matter; layers keep its level arrays as buffers and their weights as one value per stored
entry, in the pattern's storage order. Everything here runs once per pattern (construction,
``set_pattern``, loading), vectorised over the entries (no Python loops over them, and no
dense ``out x in`` index grid). ``kept_count`` is the one rule for how many entries a density
or a sparsity keeps.
"""
from __future__ import annotations

import torch

from ..formats import SparseTensor
from ..formats.convert import tensor as st_tensor
from ..formats.format import Format, as_format


def blocks(blocksize, shape, what: str):
    """``blocksize`` (None, an int or a pair) checked against ``shape``: None or ``(r, c)``.

    Example:
        >>> blocks(2, (4, 6), "SparseLinear")
        (2, 2)
    """
    if blocksize is None:
        return None
    bs = (blocksize, blocksize) if isinstance(blocksize, int) else \
        tuple(blocksize) if isinstance(blocksize, (tuple, list)) else ()
    if len(bs) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bs):
        raise ValueError(f"{what}: blocksize must be a positive int or a pair of them, got "
                         f"{blocksize!r}")
    if shape[0] % bs[0] or shape[1] % bs[1]:
        raise ValueError(f"{what}: blocksize {bs} does not divide the weight shape "
                         f"{tuple(shape)} (out_features, in_features); pick a block size "
                         "that divides both")
    return bs


def weight_format(blocksize) -> Format:
    """CSR, or BSR of ``blocksize``: the formats sparse layers store weights in."""
    return as_format("csr", 2) if blocksize is None else as_format("bsr", 2, blocksize)


def from_mask(mask, shape, blocksize, what: str) -> SparseTensor:
    """The pattern of ``mask`` (a bool ``shape`` tensor, or a 2-D SparseTensor whose stored
    entries count, whatever their values) in CSR, or in BSR where every block holding an
    entry of the mask is stored whole.

    Example:
        >>> import torch
        >>> from_mask(torch.tensor([[True, False], [False, False]]), (2, 2), None, "f").nnz
        1
    """
    if isinstance(mask, SparseTensor):
        if tuple(mask.shape) != tuple(shape):
            raise ValueError(f"{what}: mask has shape {tuple(mask.shape)} but the weight is "
                             f"{tuple(shape)} (out_features, in_features)")
        mask = mask.with_values(torch.ones(mask.nnz, dtype=torch.int64,
                                           device=mask.device)).to_dense() != 0
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = type(mask).__name__ if not isinstance(mask, torch.Tensor) else f"{mask.dtype} tensor"
        raise TypeError(f"{what}: mask must be a bool tensor of shape {tuple(shape)} or a "
                        f"SparseTensor pattern, got a {got}; pass e.g. `weight != 0`")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{what}: mask has shape {tuple(mask.shape)} but the weight is "
                         f"{tuple(shape)} (out_features, in_features)")
    # (float64 ones: st.tensor drops zeros, so the stored entries are the mask's)
    return st_tensor(mask.detach().to(torch.float64), "csr" if blocksize is None else "bsr",
                     blocksize=blocksize)


def kept_count(total: int, density=None, sparsity=None, what: str = "layer") -> int:
    """How many of ``total`` entries (or blocks) a sparse layer keeps, from exactly one of
    ``density`` and ``sparsity`` (``= 1 - density``) in [0, 1]: the one rule every entry
    point of ``st.nn`` counts by (``SparseLinear(density=)``, ``SparseLinear.from_dense``,
    ``prune_mask``, ``random_mask``, ``top_mask``).

    The rule is ``total - round(sparsity * total)``: magnitude pruning zeroes the
    ``round(sparsity * N)`` smallest entries and keeps the rest, so a density and its
    sparsity keep the same count (``round`` is Python's, halves to even: for ``N = 7`` at
    density 0.5, 3.5 zeroed rounds to 4, so 3 are kept).

    Example:
        >>> kept_count(10, sparsity=0.9), kept_count(10, density=0.3), kept_count(7, density=0.5)
        (1, 3, 3)
    """
    if (density is None) == (sparsity is None):
        raise ValueError(f"{what}: give exactly one of density= and sparsity= "
                         f"(got density={density!r}, sparsity={sparsity!r})")
    name, given = ("density", density) if sparsity is None else ("sparsity", sparsity)
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 <= given <= 1:
        raise ValueError(f"{what}: {name} must lie in [0, 1] (a number), got {given!r}")
    s = 1.0 - float(density) if sparsity is None else float(sparsity)
    return total - round(s * total)


def random_mask(shape, blocksize, generator, what: str, *, density=None,
                sparsity=None) -> torch.Tensor:
    """A bool mask with exactly ``kept_count(entries, density, sparsity)`` entries chosen
    uniformly
    (or that many whole blocks, counted in blocks, with a block size).

    Example:
        >>> int(random_mask((4, 5), None, torch.Generator().manual_seed(0), "f", density=0.5).sum())
        10
    """
    grid = shape if blocksize is None else (shape[0] // blocksize[0], shape[1] // blocksize[1])
    cells = grid[0] * grid[1]
    keep = torch.randperm(cells, generator=generator)[:kept_count(cells, density, sparsity, what)]
    return expand_blocks(_flat_mask(grid, keep), blocksize)


def top_mask(scores: torch.Tensor, blocksize, what: str, *, density=None,
             sparsity=None) -> torch.Tensor:
    """A bool mask of the ``kept_count(entries, density, sparsity)`` largest ``scores``
    (exactly that many; ties broken by ``torch.topk``); with a block size, of whole blocks by
    their summed score.

    Example:
        >>> top_mask(torch.tensor([[3., 1.], [2., 4.]]), None, "f", density=0.5)
        tensor([[ True, False],
                [False,  True]])
    """
    if blocksize is not None:
        r, c = blocksize
        scores = scores.reshape(scores.shape[0] // r, r, scores.shape[1] // c, c).sum((1, 3))
    count = kept_count(scores.numel(), density, sparsity, what)
    keep = torch.topk(scores.flatten(), count).indices
    return expand_blocks(_flat_mask(scores.shape, keep), blocksize)


def _flat_mask(grid, keep: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(grid[0] * grid[1], dtype=torch.bool, device=keep.device)
    mask[keep] = True
    return mask.reshape(grid)


def expand_blocks(mask: torch.Tensor, blocksize) -> torch.Tensor:
    """A mask of blocks repeated into a mask of entries (``blocksize`` None: unchanged)."""
    if blocksize is None:
        return mask
    return mask.repeat_interleave(blocksize[0], 0).repeat_interleave(blocksize[1], 1)


def positions(pattern: SparseTensor) -> torch.Tensor:
    """The flat dense position (``row * columns + column``) of each stored entry of
    ``pattern``, in storage order (int64, on the pattern's device).

    Example:
        >>> import torch, sparsetorch as st
        >>> positions(st.tensor(torch.tensor([[0., 1.], [1., 1.]]), "csr")).tolist()
        [1, 2, 3]
    """
    return entry_positions(pattern.arrays, pattern.format.blocksize, pattern.shape[1])


def entry_positions(arrays: dict, blocksize, columns: int) -> torch.Tensor:
    """``positions`` from a CSR or BSR pattern's level arrays (``pos1``, ``crd1``), its
    block size (None for CSR) and column count.

    Example:
        >>> entry_positions({"pos1": torch.tensor([0, 1, 1]), "crd1": torch.tensor([1])},
        ...                 None, 2).tolist()
        [1]
    """
    # In entries of memory: each stored block's row and column, then its r x c entries in
    # row-major order.
    pos, crd = arrays["pos1"].long(), arrays["crd1"].long()
    r, c = blocksize or (1, 1)
    rows = torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff())
    within_r = torch.arange(r, device=pos.device).view(1, r, 1)
    within_c = torch.arange(c, device=pos.device).view(1, 1, c)
    flat = (rows.view(-1, 1, 1) * r + within_r) * columns + crd.view(-1, 1, 1) * c + within_c
    return flat.reshape(-1)
