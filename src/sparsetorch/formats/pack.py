"""Coordinates <-> level arrays: the one vectorised path every conversion goes through.

``pack`` takes logical coordinates (``[ndim, nnz]``) and values, maps them to storage
coordinates (mode order, blocking), sorts and sums duplicates, then lets each level kind
``build`` its arrays top-down. ``unpack`` does the reverse with each kind's ``expand``.
Both are a handful of torch kernels over all nonzeros at once: no Python loop over entries.
"""
from __future__ import annotations

import math

import torch

from .format import Format

INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def array_names(fmt: Format) -> tuple[str, ...]:
    """Names of the index arrays ``fmt`` stores, in level order (``pos1``, ``crd1``, ...)."""
    names = []
    for k, level in enumerate(fmt.levels):
        if level.has_pos:
            names.append(f"pos{k}")
        if level.has_crd:
            names.append(f"crd{k}")
    return tuple(names)


def level_arrays(arrays: dict, k: int) -> dict:
    """The arrays of level ``k`` under their short names (``pos``, ``crd``)."""
    return {short: arrays[f"{short}{k}"] for short in ("pos", "crd") if f"{short}{k}" in arrays}


def choose_index_dtype(dims, nnz: int, requested=None) -> torch.dtype:
    """int32 when every coordinate and position fits, else int64 (``requested`` overrides,
    but an int32 request that cannot hold the tensor is an error)."""
    biggest = max([nnz, *dims, 0])
    if requested is not None:
        if requested not in INDEX_DTYPES:
            raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {requested}")
        if requested == torch.int32 and biggest > _INT32_MAX:
            raise ValueError(f"index_dtype=torch.int32 cannot hold {biggest} (largest dimension "
                             "or entry count); use torch.int64")
        return requested
    return torch.int32 if biggest <= _INT32_MAX else torch.int64


def to_storage(fmt: Format, coords: torch.Tensor) -> torch.Tensor:
    """Logical coordinates ``[ndim, nnz]`` -> storage coordinates ``[levels, nnz]``."""
    rows = coords[list(fmt.mode_order)]
    if fmt.blocksize is None:
        return rows
    bs = torch.tensor([fmt.blocksize[m] for m in fmt.mode_order], device=coords.device)[:, None]
    return torch.cat([rows // bs, rows % bs])


def from_storage(fmt: Format, storage: torch.Tensor) -> torch.Tensor:
    """Storage coordinates ``[levels, nnz]`` -> logical coordinates ``[ndim, nnz]``."""
    n = fmt.ndim
    if fmt.blocksize is not None:
        bs = torch.tensor([fmt.blocksize[m] for m in fmt.mode_order],
                          device=storage.device)[:, None]
        storage = storage[:n] * bs + storage[n:]
    out = torch.empty_like(storage[:n])
    out[list(fmt.mode_order)] = storage
    return out


def sort_and_sum(keys: torch.Tensor, dims, values: torch.Tensor):
    """Sort the columns of ``keys`` (``[L, nnz]``) lexicographically and sum the values of
    duplicate columns. Returns ``(keys, values)``."""
    nnz = keys.shape[1]
    if nnz == 0:
        return keys, values
    if math.prod(dims) < 2**62:
        linear = torch.zeros(nnz, dtype=torch.int64, device=keys.device)
        for row, size in zip(keys, dims):
            linear = linear * size + row
        order = torch.argsort(linear)
        linear = linear[order]
        new = torch.ones(nnz, dtype=torch.bool, device=keys.device)
        new[1:] = linear[1:] != linear[:-1]
    else:  # too many cells to linearise: stable sorts from the last key to the first
        order = torch.arange(nnz, device=keys.device)
        for row in reversed(keys):
            order = order[torch.sort(row[order], stable=True).indices]
        sk = keys[:, order]
        new = torch.ones(nnz, dtype=torch.bool, device=keys.device)
        new[1:] = (sk[:, 1:] != sk[:, :-1]).any(0)
    keys, values = keys[:, order], values[order]
    if bool(new.all()):
        return keys, values
    group = torch.cumsum(new, 0) - 1
    summed = torch.zeros(int(group[-1]) + 1, dtype=values.dtype, device=values.device)
    summed.index_add_(0, group, values)
    return keys[:, new], summed


def pack(fmt: Format, shape, coords: torch.Tensor, values: torch.Tensor, index_dtype=None,
         sorted_unique: bool = False):
    """Build the level arrays of ``fmt`` from logical coordinates and values.

    ``coords`` is ``[ndim, nnz]`` int64 and in range (the caller validated it). Duplicates are
    summed. ``sorted_unique=True`` promises the storage coordinates are already sorted and
    unique (e.g. they came from ``unpack`` of a format with the same storage order).
    Returns ``(arrays, values)``.
    """
    dims = fmt.storage_dims(shape)
    keys = to_storage(fmt, coords.to(torch.int64))
    if not sorted_unique:
        keys, values = sort_and_sum(keys, dims, values)
    # The stored-entry count is only known after building; pick the dtype on an upper bound.
    bound = keys.shape[1] * max([1, *(b for b in (fmt.blocksize or ()))]) ** 2
    index_dtype = choose_index_dtype(dims, bound, index_dtype)
    parent_pos = torch.zeros(keys.shape[1], dtype=torch.int64, device=keys.device)
    parent_count = 1
    arrays = {}
    for k, level in enumerate(fmt.levels):
        parent_pos, parent_count, level_out = level.build(
            parent_pos, parent_count, keys[k], dims[k], index_dtype)
        arrays.update({f"{name}{k}": a for name, a in level_out.items()})
    stored = torch.zeros(parent_count, dtype=values.dtype, device=values.device)
    stored.index_put_((parent_pos,), values, accumulate=not sorted_unique)
    return arrays, stored


def unpack(fmt: Format, shape, arrays: dict, values: torch.Tensor):
    """Every stored entry's logical coordinates (``[ndim, nnz]`` int64) and value, in storage
    order (lexicographically sorted in storage coordinates when the levels are ordered)."""
    dims = fmt.storage_dims(shape)
    parent = torch.zeros(1, dtype=torch.int64, device=values.device)
    columns: list[torch.Tensor] = []
    for k, level in enumerate(fmt.levels):
        owner, parent, coord = level.expand(parent, dims[k], level_arrays(arrays, k))
        columns = [c[owner] for c in columns] + [coord]
    storage = torch.stack(columns) if columns else torch.zeros(0, 1, dtype=torch.int64)
    return from_storage(fmt, storage), values[parent]
