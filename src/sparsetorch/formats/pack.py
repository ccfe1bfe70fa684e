"""Coordinates <-> level arrays: the one vectorised path every conversion goes through.

``pack`` takes logical coordinates (one row per mode) and values, sorts them into the target's
storage order (summing duplicates), then lets each level kind ``build`` its arrays top-down.
``unpack`` does the reverse with each kind's ``expand_all``. Both are a handful of torch
kernels over all entries at once: no Python loop over entries, no branching on format names.

Cost model (n entries): when the entries come from a format with ordered levels, ``pack`` does
at most one stable sort, on the smallest key that fixes the order (see ``order.py``), plus one
gather per stored array; unknown input costs one sort of the full linear key. Coordinates stay
int32 whenever they fit.

Example:
    >>> import torch
    >>> from sparsetorch.formats.format import as_format
    >>> arrays, vals = pack(as_format("csr", 2), (2, 3), torch.tensor([[1, 0, 1], [2, 1, 2]]),
    ...                     torch.tensor([1., 2., 3.]))
    >>> arrays["pos1"].tolist(), arrays["crd1"].tolist(), vals.tolist()
    ([0, 1, 2], [1, 2], [2.0, 4.0])
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from .format import Format
from .levels import INT32_MAX, index_dtype_for
from .memory import check_fits_memory
from .order import (atom_size, atom_value, decode, linear_key, resort_prefix, sort_key,
                    stable_sort, storage_atoms)

INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = INT32_MAX


@lru_cache(maxsize=None)
def array_names(fmt: Format) -> tuple[str, ...]:
    """Names of the index arrays ``fmt`` stores, in level order (``pos1``, ``crd1``, ...).

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> array_names(as_format("coo", 2))
        ('pos0', 'crd0', 'crd1')
    """
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
    but an int32 request that cannot hold the tensor is an error).

    Example:
        >>> choose_index_dtype((10, 2**31 + 1), 5)
        torch.int64
    """
    biggest = max([nnz, *dims, 0])
    if requested is not None:
        if requested not in INDEX_DTYPES:
            raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {requested}")
        if requested == torch.int32 and biggest > _INT32_MAX:
            raise ValueError(f"index_dtype=torch.int32 cannot hold {biggest} (largest dimension "
                             "or entry count); use torch.int64")
        return requested
    return torch.int32 if biggest <= _INT32_MAX else torch.int64


def _rows(coords) -> list[torch.Tensor]:
    return list(coords.unbind(0)) if isinstance(coords, torch.Tensor) else list(coords)


def to_storage(fmt: Format, coords) -> torch.Tensor:
    """Logical coordinates ``[ndim, nnz]`` -> storage coordinates ``[levels, nnz]``."""
    rows = _rows(coords)
    atoms = storage_atoms(fmt)
    if not atoms:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.stack([atom_value(rows, a, fmt.blocksize).to(torch.int64) for a in atoms])


def from_storage(fmt: Format, storage) -> torch.Tensor:
    """Storage coordinates ``[levels, nnz]`` -> logical coordinates ``[ndim, nnz]``."""
    rows = _logical_rows(fmt, _rows(storage))
    return torch.stack([r.to(torch.int64) for r in rows]) if rows else torch.zeros(
        0, 0, dtype=torch.int64)


def _logical_rows(fmt: Format, storage: list) -> list[torch.Tensor]:
    n = fmt.ndim
    out: list = [None] * n
    for k, m in enumerate(fmt.mode_order):
        if fmt.blocksize is None:
            out[m] = storage[k]
        else:
            hi, lo = storage[k], storage[n + k]
            out[m] = _wide(hi, lo, fmt.blocksize[m]) * fmt.blocksize[m] + lo
    return out


def _wide(hi, lo, b):
    """``hi`` in a dtype where ``hi * b + lo`` cannot overflow."""
    top = (int(hi.max()) + 1) * b if hi.numel() else 0
    return hi.to(index_dtype_for(top)) if top > _INT32_MAX or hi.dtype != lo.dtype else hi


def sort_and_sum(keys: torch.Tensor, dims, values: torch.Tensor):
    """Sort the columns of ``keys`` (``[L, nnz]``) lexicographically and sum the values of
    duplicate columns. Returns ``(keys, values)``.

    Example:
        >>> k, v = sort_and_sum(torch.tensor([[1, 0, 1]]), (2,), torch.tensor([1., 2., 3.]))
        >>> k.tolist(), v.tolist()
        ([[0, 1]], [2.0, 4.0])
    """
    rows, values = _sort_sum_rows(_rows(keys), list(dims), values)
    return (torch.stack(rows) if rows else keys), values


def _sort_sum_rows(rows: list, sizes: list, values: torch.Tensor):
    """Sort entries by ``rows`` (lexicographic), sum duplicates. Skips the sort when the
    entries are already in order; duplicates (usually few) cost O(n) streaming passes."""
    n = values.numel()
    if n <= 1 or not rows:
        return rows, values
    key = linear_key(rows, sizes)
    if key is not None:
        if not bool((key[1:] >= key[:-1]).all()):
            key, perm = sort_key(key, math.prod(sizes))
            values = values.index_select(0, perm)
            rows = decode(key, sizes)
        new = torch.ones(n, dtype=torch.bool, device=key.device)
        torch.ne(key[1:], key[:-1], out=new[1:])
    else:
        perm, _ = stable_sort(rows, sizes)
        rows = [r.index_select(0, perm) for r in rows]
        values = values.index_select(0, perm)
        new = torch.ones(n, dtype=torch.bool, device=values.device)
        for r in rows:
            new[1:] |= r[1:] != r[:-1]
    repeat = torch.nonzero(~new).reshape(-1)     # entries equal to the one before them
    if repeat.numel() == 0:
        return rows, values
    # entry i's group is i minus the number of repeats up to and including it
    group = repeat - torch.arange(1, repeat.numel() + 1, device=repeat.device)
    first = torch.nonzero(new).reshape(-1)      # sorted: the gathers below stream
    summed = values.index_select(0, first).index_add_(0, group, values.index_select(0, repeat))
    return [r.index_select(0, first) for r in rows], summed


def pack(fmt: Format, shape, coords, values: torch.Tensor, index_dtype=None,
         sorted_unique: bool = False, *, source: Format | None = None):
    """Build the level arrays of ``fmt`` from logical coordinates and values.

    ``coords`` is ``[ndim, nnz]`` (or a list of ``ndim`` 1-D tensors), any integer dtype, in
    range (the caller validated it). Duplicates are summed. ``source`` promises the entries
    are unique and sorted in that format's storage order (e.g. they came from ``unpack`` of a
    format with ordered levels), so at most a partial stable sort is needed;
    ``sorted_unique=True`` promises they are already in ``fmt``'s order. Returns
    ``(arrays, values)``; the result never shares memory with ``coords`` or ``values``.
    """
    check_fits_memory(fmt, shape, values.numel(), values.element_size())
    rows = _rows(coords)
    inputs = {_storage_ptr(t) for t in rows + [values]}
    dims = fmt.storage_dims(shape)
    atoms = storage_atoms(fmt)
    prefix = [] if sorted_unique else (resort_prefix(source, fmt) if source is not None
                                       else None)
    if prefix is None:                      # unknown order: full sort, sum duplicates
        keys = [atom_value(rows, a, fmt.blocksize) for a in atoms]
        keys, values = _sort_sum_rows(keys, list(dims), values)
    elif prefix:                            # one stable sort on the prefix atoms
        refine = fmt.blocksize or source.blocksize
        sizes = [atom_size(a, shape, refine) for a in prefix]
        perm, sorted_key = stable_sort([atom_value(rows, a, refine) for a in prefix], sizes)
        values = values.index_select(0, perm)
        keys = _permuted_keys(fmt, dims, atoms, rows, perm, prefix, sorted_key,
                              None if fmt.blocksize else refine)
    else:
        keys = [atom_value(rows, a, fmt.blocksize) for a in atoms]
    arrays, stored, biggest = _build(fmt, dims, keys, values)
    want = choose_index_dtype(dims, biggest, index_dtype)
    arrays = {k: _fresh(a.to(want), inputs) for k, a in arrays.items()}
    return arrays, _fresh(stored, inputs)


def _permuted_keys(fmt, dims, atoms, rows, perm, prefix, sorted_key, refine):
    """Target storage keys of the permuted entries: the leading levels decoded from the sorted
    prefix key when the prefix is exactly those levels, the rest gathered once per mode."""
    keys: list = [None] * len(atoms)
    q = _levels_covered(fmt, prefix, refine) if sorted_key is not None else 0
    if q:
        keys[:q] = decode(sorted_key, list(dims[:q]))
    gathered: dict = {}
    for k, (mode, part) in enumerate(atoms):
        if keys[k] is None:
            if mode not in gathered:
                gathered[mode] = rows[mode].index_select(0, perm)
            keys[k] = atom_value({mode: gathered[mode]}, (mode, part), fmt.blocksize)
    return keys


def _levels_covered(fmt, prefix, refine) -> int:
    """``q`` if the prefix atoms are exactly those of storage levels ``0..q-1``, else 0."""
    groups = ([[a] for a in storage_atoms(fmt)] if fmt.blocksize is not None or refine is None
              else [[(m, "hi"), (m, "lo")] for m in fmt.mode_order])
    flat: list = []
    for q, group in enumerate(groups, 1):
        flat += group
        if flat == prefix:
            return q
        if len(flat) >= len(prefix):
            return 0
    return 0


def _build(fmt, dims, keys, values):
    """Level arrays from sorted, unique storage keys. Returns ``(arrays, stored values,
    largest count)``."""
    parent_pos, parent_count, biggest = None, 1, values.numel()
    arrays = {}
    last = len(fmt.levels) - 1
    for k, level in enumerate(fmt.levels):
        parent_pos, parent_count, level_out = level.build(
            parent_pos, parent_count, keys[k], dims[k], distinct=(k == last))
        biggest = max(biggest, parent_count)
        arrays.update({f"{name}{k}": a for name, a in level_out.items()})
    if parent_pos is None and parent_count == values.numel():
        return arrays, values, biggest
    stored = torch.zeros(parent_count, dtype=values.dtype, device=values.device)
    if parent_pos is None:
        parent_pos = torch.zeros(values.numel(), dtype=torch.int64, device=values.device)
    stored[parent_pos] = values
    return arrays, stored, biggest


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


def _fresh(t: torch.Tensor, inputs: set) -> torch.Tensor:
    """``t``, copied if it shares memory with an input (results must not alias user data)."""
    return t.clone() if t.numel() and _storage_ptr(t) in inputs else t


def unpack_rows(fmt: Format, shape, arrays: dict, device=None) -> list[torch.Tensor]:
    """Every stored entry's logical coordinates, one tensor per mode (int32 or int64, as
    stored), in storage order (sorted lexicographically in storage coordinates when the levels
    are ordered). Entry ``i`` holds ``values[i]``: a full traversal visits every position."""
    dims = fmt.storage_dims(shape)
    columns: list = []                      # a tensor, or None while it equals the position
    count = 1
    for k, level in enumerate(fmt.levels):
        owner, coord = level.expand_all(count, dims[k], level_arrays(arrays, k), device)
        if owner is not None:
            columns = [owner if c is None else c.index_select(0, owner) for c in columns]
        columns.append(coord)
        count = level.count(count, dims[k], level_arrays(arrays, k))
    columns = [torch.arange(count, dtype=index_dtype_for(count), device=device) if c is None
               else c for c in columns]
    return _logical_rows(fmt, columns)


def unpack(fmt: Format, shape, arrays: dict, values: torch.Tensor):
    """Every stored entry's logical coordinates (``[ndim, nnz]`` int64) and value, in storage
    order (lexicographically sorted in storage coordinates when the levels are ordered).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), format="csc")
        >>> coords, vals = unpack(A.format, A.shape, A.arrays, A.values)
        >>> coords.tolist(), vals.tolist()
        ([[1, 0], [0, 1]], [3.0, 2.0])
    """
    rows = unpack_rows(fmt, shape, arrays, values.device)
    if not rows:
        return torch.zeros(0, values.numel(), dtype=torch.int64, device=values.device), values
    return torch.stack([r.to(torch.int64) for r in rows]), values
