"""Storage orders: which sort turns one format's entry order into another's.

Entries of a format with ordered levels come out of ``unpack`` sorted lexicographically by
its storage coordinates. Describe each storage coordinate as an *atom* ``(mode, part)``:
``part`` is ``"all"`` (the whole coordinate), ``"hi"`` (``coord // block``) or ``"lo"``
(``coord % block``). Sorting by a mode equals sorting by its ``(hi, lo)`` pair, so an unblocked
format can be described in a blocked format's atoms.

If entries sorted by atoms ``S`` are *stably* sorted by a prefix ``T[:p]`` of the target atoms,
ties keep their ``S`` order, which is ``S`` with the prefix atoms removed. So when that equals
``T[p:]`` one stable sort on the (linearised) prefix key is all a conversion needs: CSR -> CSC
sorts by column only, CSR -> BSR by (block row, block column), same order -> no sort at all.

Example:
    >>> import sparsetorch as st
    >>> from sparsetorch.formats.format import as_format
    >>> resort_prefix(as_format("csr", 2), as_format("csc", 2))
    [(1, 'all')]
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .format import Format
from .levels import INT32_MAX, index_dtype_for

_INT64_MAX = 2**63 - 1
_PACKED_SORT_MIN = 4096     # below this, torch.sort's fixed cost is smaller than the packing


def storage_atoms(fmt: Format, refine=None) -> list[tuple[int, str]]:
    """The atom of each storage level of ``fmt``; an unblocked format is described in the
    ``(hi, lo)`` atoms of blocksize ``refine`` when given."""
    order = fmt.mode_order
    if fmt.blocksize is not None:
        return [(m, "hi") for m in order] + [(m, "lo") for m in order]
    if refine is not None:
        return [(m, part) for m in order for part in ("hi", "lo")]
    return [(m, "all") for m in order]


def resort_prefix(source: Format, target: Format):
    """Atoms of ``target`` to stably sort by so entries sorted in ``source`` storage order
    end up sorted in ``target`` order (``[]``: already sorted), or ``None`` when the two
    blockings do not nest and only a full sort will do."""
    if source.blocksize and target.blocksize and source.blocksize != target.blocksize:
        return None
    refine = source.blocksize or target.blocksize
    s_atoms, t_atoms = storage_atoms(source, refine), storage_atoms(target, refine)
    for p in range(len(t_atoms) + 1):
        taken = set(t_atoms[:p])
        if [a for a in s_atoms if a not in taken] == t_atoms[p:]:
            return t_atoms[:p]
    return t_atoms  # unreachable: p = len(t_atoms) always matches


def atom_size(atom, shape, blocksize) -> int:
    mode, part = atom
    if part == "all":
        return int(shape[mode])
    b = blocksize[mode]
    return int(shape[mode]) // b if part == "hi" else b


def atom_value(coords, atom, blocksize) -> torch.Tensor:
    """The atom's value for every entry (``coords``: one tensor per mode)."""
    mode, part = atom
    c = coords[mode]
    if part == "all":
        return c
    b = blocksize[mode]
    return torch.div(c, b, rounding_mode="floor") if part == "hi" else torch.remainder(c, b)


def linear_key(values, sizes):
    """``((v0 * s1 + v1) * s2 + v2) ...`` in the smallest dtype that holds it, or ``None`` if
    it would not fit in int64. A single int32/int64 value tensor is returned as is."""
    total = math.prod(sizes)
    if total - 1 > _INT64_MAX:
        return None
    dtype = index_dtype_for(max(total - 1, 0))
    key = None
    for v, size in zip(values, sizes):
        v = v.to(dtype)
        key = v if key is None else key * size + v
    return key


def decode(key: torch.Tensor, sizes) -> list[torch.Tensor]:
    """Inverse of ``linear_key``: the value tensors back from the key."""
    out = []
    for size in reversed(sizes[1:]):
        high = torch.div(key, size, rounding_mode="floor")
        out.append(key - high * size)
        key = high
    out.append(key)
    return out[::-1]


def sort_key(key: torch.Tensor, total: int):
    """Stable sort of a non-negative integer ``key`` (every value below ``total``).

    Returns ``(sorted_key, perm)``, ``perm`` int32 when it fits. On the CPU, when key and
    position fit in 64 bits together, the pair is packed into one uint64 (key high, position
    low: all distinct, so any sort is stable) and sorted by value alone with numpy's SIMD sort,
    2-4x faster than ``torch.sort`` with indices; elsewhere ``torch.sort(stable=True)``.

    Example:
        >>> k, p = sort_key(torch.tensor([2, 0, 2, 1]), 3)
        >>> k.tolist(), p.tolist()
        ([0, 1, 2, 2], [1, 3, 0, 2])
    """
    n = key.numel()
    pos_bits, key_bits = max(n - 1, 0).bit_length(), max(total - 1, 0).bit_length()
    if key.device.type != "cpu" or n < _PACKED_SORT_MIN or key_bits + pos_bits > 64:
        sorted_key, perm = torch.sort(key, stable=True)
        return sorted_key, _narrow(perm)
    key_type = np.int32 if key.dtype == torch.int32 else np.int64
    perm_type = np.int32 if n - 1 <= INT32_MAX else np.int64
    if key_bits <= 32 and pos_bits <= 32 and sys.byteorder == "little":
        packed = np.empty(n, np.uint64)         # write and read the two 32-bit halves
        halves = packed.view(np.uint32).reshape(n, 2)
        halves[:, 0] = np.arange(n, dtype=np.uint32)
        halves[:, 1] = key.numpy()
        packed.sort()
        sorted_key, perm = halves[:, 1].astype(key_type), halves[:, 0].astype(perm_type)
    else:
        packed = key.numpy().astype(np.uint64)
        np.left_shift(packed, np.uint64(pos_bits), out=packed)
        np.bitwise_or(packed, np.arange(n, dtype=np.uint64), out=packed)
        packed.sort()
        if pos_bits <= 32 and sys.byteorder == "little":   # the low halves hold positions
            perm = np.bitwise_and(packed.view(np.uint32)[0::2],
                                  np.uint32((1 << pos_bits) - 1)).view(np.int32)
        else:
            perm = np.bitwise_and(packed, np.uint64((1 << pos_bits) - 1)).astype(perm_type)
        np.right_shift(packed, np.uint64(pos_bits), out=packed)
        sorted_key = packed.view(np.int64) if key_type is np.int64 else packed.astype(key_type)
    return torch.from_numpy(sorted_key), torch.from_numpy(perm)


def stable_sort(values, sizes):
    """Stable lexicographic order of the entries by ``values`` (a list of tensors with value
    ranges ``sizes``). Returns ``(perm, sorted_key)``; ``sorted_key`` is the sorted linear key
    (``None`` when the key would overflow int64 and successive stable sorts were used)."""
    key = linear_key(values, sizes)
    if key is not None:
        sorted_key, perm = sort_key(key, math.prod(sizes))
        return perm, sorted_key
    perm = None
    for v, size in zip(reversed(values), reversed(sizes)):   # least significant first
        v = v if perm is None else v.index_select(0, perm)
        step = sort_key(v, size)[1]
        perm = step if perm is None else perm.index_select(0, step)
    return _narrow(perm), None


def _narrow(perm: torch.Tensor) -> torch.Tensor:
    """int32 permutations gather faster (half the index traffic)."""
    return perm.to(torch.int32) if perm.numel() <= INT32_MAX else perm
