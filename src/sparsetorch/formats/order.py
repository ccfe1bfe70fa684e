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

import torch

from .format import Format
from .levels import INT32_MAX, index_dtype_for

_INT64_MAX = 2**63 - 1


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


def stable_sort(values, sizes):
    """Stable lexicographic order of the entries by ``values`` (a list of tensors with value
    ranges ``sizes``). Returns ``(perm, sorted_key)``; ``sorted_key`` is the sorted linear key
    (``None`` when the key would overflow int64 and successive stable sorts were used)."""
    key = linear_key(values, sizes)
    if key is not None:
        sorted_key, perm = torch.sort(key, stable=True)
        return _narrow(perm), sorted_key
    perm = None
    for v in reversed(values):   # least significant first; each sort keeps earlier ties
        v = v if perm is None else v.index_select(0, perm)
        step = torch.sort(v, stable=True).indices
        perm = step if perm is None else perm.index_select(0, step)
    return _narrow(perm), None


def _narrow(perm: torch.Tensor) -> torch.Tensor:
    """int32 permutations gather faster (half the index traffic)."""
    return perm.to(torch.int32) if perm.numel() <= INT32_MAX else perm
