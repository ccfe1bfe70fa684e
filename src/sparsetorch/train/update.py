"""The drop/grow step every dynamic sparse algorithm shares, on one layer.

In: the layer's active set (flat row-major indices, sorted) with its weights, how many to
drop, and a grow score given row block by row block (so the dense score of a large layer is
never held whole). Out: a ``Change``: the new active set (sorted), and for each new entry the
position of its value in the old storage (-1 where the entry is new and starts at zero).

Drop: the ``k`` active weights of smallest ``|w|``, ties broken by ``noise_std`` Gaussian noise
from the seeded generator. Grow: the ``k`` entries of largest score that are not kept (a
weight dropped this step may be grown again and then keeps its value and optimizer state, as
in the official code's ``reinit_when_same=False``). Both modes (dense weights with masks,
truly sparse layers) call the same functions in the same order, so on the same seed and
scores they choose the same entries.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

# Row blocks of at most this many entries: a 4096 x 4096 layer's score is built 256 rows at a
# time (4 MiB of float32) while the running top-k holds only k entries.
BLOCK_ENTRIES = 1 << 20


class Change(NamedTuple):
    """A layer's new active set and where each entry's value comes from."""
    active: torch.Tensor   # int64 flat indices of the new active set, sorted
    source: torch.Tensor   # int64 position in the old storage, -1 for a newly grown entry
    n_dropped: int         # dropped and not grown again
    n_grown: int           # grown that were inactive before


def row_blocks(rows: int, cols: int):
    """Row ranges ``(r0, r1)`` covering ``rows`` with at most ``BLOCK_ENTRIES`` entries each.

    Example:
        >>> list(row_blocks(5, 1 << 19))
        [(0, 2), (2, 4), (4, 5)]
    """
    step = max(1, BLOCK_ENTRIES // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def drop_smallest(values: torch.Tensor, k: int, generator: torch.Generator,
                  noise_std: float) -> torch.Tensor:
    """Bool tensor over ``values`` (an active set's weights): True for the ``len - k`` kept,
    False for the ``k`` of smallest ``|value| + noise``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> drop_smallest(torch.tensor([0.5, -0.1, 2.0, 0.01]), 2, g, 1e-5).tolist()
        [True, False, True, False]
    """
    keep = torch.ones(values.numel(), dtype=torch.bool)
    noise = torch.randn(values.numel(), generator=generator, dtype=torch.float64)
    if k <= 0:
        return keep
    score = values.detach().abs().double().cpu() + noise_std * noise
    keep[torch.topk(score, k, largest=False, sorted=False).indices] = False
    return keep


def grow_largest(kept: torch.Tensor, k: int, shape2d: tuple[int, int],
                 score_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Flat indices (sorted) of the ``k`` entries outside ``kept`` (sorted flat indices) with
    the largest score; ``score_rows(r0, r1)`` gives the scores of rows ``r0:r1`` of the
    ``shape2d`` weight, block by block, merged into a running top-k.

    Example:
        >>> s = torch.tensor([[0., 5., 1.], [4., 3., 9.]])
        >>> grow_largest(torch.tensor([5]), 2, (2, 3), lambda a, b: s[a:b]).tolist()
        [1, 3]
    """
    rows, cols = shape2d
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    best_score = torch.empty(0, dtype=torch.float64)
    best_index = torch.empty(0, dtype=torch.int64)
    for r0, r1 in row_blocks(rows, cols):
        score = score_rows(r0, r1).detach().reshape(-1).to(torch.float64, copy=True).cpu()
        lo, hi = torch.searchsorted(kept, torch.tensor([r0 * cols, r1 * cols]))
        score[kept[lo:hi] - r0 * cols] = -torch.inf
        top = torch.topk(score, min(k, score.numel()), sorted=False)
        best_score = torch.cat([best_score, top.values])
        best_index = torch.cat([best_index, top.indices + r0 * cols])
        if best_score.numel() > k:
            top = torch.topk(best_score, k, sorted=False)
            best_score, best_index = top.values, best_index[top.indices]
    return torch.sort(best_index).values


def change(active: torch.Tensor, keep: torch.Tensor, grown: torch.Tensor) -> Change:
    """Combine an old active set, its kept flags and the grown indices into a ``Change``.

    Example:
        >>> c = change(torch.tensor([0, 2, 4]), torch.tensor([True, False, True]),
        ...            torch.tensor([2, 5]))
        >>> c.active.tolist(), c.source.tolist(), c.n_dropped, c.n_grown
        ([0, 2, 4, 5], [0, 1, 2, -1], 0, 1)
    """
    kept = active[keep]
    new = torch.sort(torch.cat([kept, grown])).values
    if active.numel():
        pos = torch.searchsorted(active, new).clamp_max(active.numel() - 1)
        was_active = active[pos] == new
    else:
        pos, was_active = torch.zeros_like(new), torch.zeros_like(new, dtype=torch.bool)
    source = torch.where(was_active, pos, torch.full_like(pos, -1))
    n_grown = int((~was_active).sum())
    return Change(new, source, int(active.numel() - new.numel() + n_grown), n_grown)


def drop_and_grow(active: torch.Tensor, values: torch.Tensor, k: int, shape2d: tuple[int, int],
                  score_rows: Callable[[int, int], torch.Tensor] | None,
                  generator: torch.Generator, noise_std: float) -> Change:
    """One layer's update: drop ``k`` smallest active weights, grow ``k`` by ``score_rows``
    (``None`` grows nothing: pruning only).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> s = torch.tensor([[0., 5., 1.], [4., 3., 9.]])
        >>> c = drop_and_grow(torch.tensor([0, 5]), torch.tensor([0.1, 2.0]), 1, (2, 3),
        ...                   lambda a, b: s[a:b], g, 1e-5)
        >>> c.active.tolist(), c.source.tolist()
        ([1, 5], [-1, 1])
    """
    keep = drop_smallest(values, k, generator, noise_std)
    grown = (grow_largest(active[keep], k, shape2d, score_rows) if score_rows is not None
             else torch.empty(0, dtype=torch.int64))
    return change(active, keep, grown)
