"""What a sparse trainer needs from ``torch.distributed``: every rank must choose the same
masks, so gradients used for scoring are averaged over ranks first, and every rank draws the
same random numbers (rank 0's seed is broadcast once).

Outside an initialised process group (or with one process) every helper is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def world_size() -> int:
    """Processes in the default group, 1 when ``torch.distributed`` is not initialised.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over all ranks (a new tensor; ``t`` itself when there is one rank).

    Example:
        >>> mean_over_ranks(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    if world_size() == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.div_(world_size())


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (``flag`` itself when there is one rank): ranks
    that must enter the same collectives decide together.

    Example:
        >>> any_rank(False), any_rank(True)
        (False, True)
    """
    if world_size() == 1:
        return bool(flag)
    box = torch.tensor([int(bool(flag))])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item())


def same_seed(seed: int) -> int:
    """Rank 0's ``seed`` on every rank (so per-rank seeds for data order cannot make ranks
    draw different masks).

    Example:
        >>> same_seed(7)
        7
    """
    if world_size() == 1:
        return int(seed)
    box = [int(seed)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def grads_already_averaged(model: torch.nn.Module) -> bool:
    """True when ``model`` is wrapped in DDP, whose backward already averages gradients (the
    dense gradient of a masked weight included), so scoring needs no second all-reduce.

    Example:
        >>> grads_already_averaged(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(model, DistributedDataParallel)
