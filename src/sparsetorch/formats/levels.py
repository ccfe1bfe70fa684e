"""Level kinds: the plugins a format is built from (after TACO's level formats).

A tensor of order n is stored as a stack of levels, one per storage dimension. Each level maps
a *parent position* (an index into the level above; the root has the single position 0) to a
set of *child positions*, each carrying one coordinate of its dimension:

* ``Dense(size)``: every coordinate 0..size-1 is present; child = parent * size + coord.
  Stores no arrays.
* ``Compressed``: children of parent p are positions ``pos[p]:pos[p+1]``; coordinates ``crd``.
  ``unique=False`` (COO's first level) repeats a coordinate once per entry below it.
* ``Singleton``: exactly one child per parent, at the same position; coordinates ``crd``.
  Only valid below a non-unique level (it is COO's second level).

Every kind answers the same three questions, vectorised over all positions of a level:
``build`` (coordinates -> arrays), ``expand`` (arrays -> coordinates) and ``validate``
(are user arrays consistent?). The compiler asks the same kinds for loop bounds and locate
(``compiler/`` keeps that half), so nothing downstream branches on format names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _segment_arange(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenate ``arange(s, s + c)`` for every (s, c) pair without a Python loop."""
    total = int(counts.sum()) if counts.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=counts.device)
    offsets = torch.cumsum(counts, 0) - counts
    rep_start = torch.repeat_interleave(starts - offsets, counts, output_size=total)
    return rep_start + torch.arange(total, dtype=torch.int64, device=counts.device)


class _Problem(ValueError):
    """Raised by level validation; the tensor-level caller adds the tensor's name."""


@dataclass(frozen=True)
class LevelKind:
    """Base of the level kinds. ``unique``: no repeated coordinate under one parent.
    ``ordered``: coordinates under one parent are increasing."""

    unique: bool = True
    ordered: bool = True

    has_pos = False
    has_crd = False
    name = "level"

    def __str__(self) -> str:
        flags = "" if (self.unique and self.ordered) else (
            "(" + ",".join(f for f, on in (("non-unique", not self.unique),
                                          ("unordered", not self.ordered)) if on) + ")")
        return self.name + flags

    # -- construction from sorted, unique coordinates --------------------------------------
    def build(self, parent_pos, parent_count, coord, size, index_dtype):
        """Place the entries (one per element of ``coord``, sorted lexicographically, with
        their positions ``parent_pos`` in the level above) in this level.

        Returns ``(entry_pos, count, arrays)``: each entry's position here, the number of
        positions of this level, and the arrays this level stores (dict name -> tensor).
        """
        raise NotImplementedError

    # -- expansion to coordinates -----------------------------------------------------------
    def expand(self, parent: torch.Tensor, size: int, arrays: dict):
        """For the positions ``parent`` of the level above, list all child positions.

        Returns ``(owner, child, coord)``: for each child, the index into ``parent`` it came
        from, its position in this level, and its coordinate.
        """
        raise NotImplementedError

    def count(self, parent_count: int, size: int, arrays: dict) -> int:
        """Number of positions of this level given the parent level's count."""
        raise NotImplementedError

    def validate(self, parent_count: int, size: int, arrays: dict) -> None:
        """Check user-supplied arrays; raise ``_Problem`` describing the first violation."""


@dataclass(frozen=True)
class Dense(LevelKind):
    name = "dense"

    def build(self, parent_pos, parent_count, coord, size, index_dtype):
        return parent_pos * size + coord, parent_count * size, {}

    def expand(self, parent, size, arrays):
        n = parent.numel()
        local = torch.arange(size, dtype=torch.int64, device=parent.device)
        owner = torch.arange(n, dtype=torch.int64, device=parent.device).repeat_interleave(size)
        child = (parent.to(torch.int64)[:, None] * size + local[None, :]).reshape(-1)
        return owner, child, local.repeat(n)

    def count(self, parent_count, size, arrays):
        return parent_count * size


@dataclass(frozen=True)
class Compressed(LevelKind):
    name = "compressed"
    has_pos = True
    has_crd = True

    def build(self, parent_pos, parent_count, coord, size, index_dtype):
        device = coord.device
        if self.unique:
            key = parent_pos * size + coord          # non-decreasing: input is sorted
            if key.numel():
                new_group = torch.ones_like(key, dtype=torch.bool)
                new_group[1:] = key[1:] != key[:-1]
                entry_pos = torch.cumsum(new_group, 0) - 1
                first = torch.nonzero(new_group).reshape(-1)
            else:
                entry_pos = torch.zeros(0, dtype=torch.int64, device=device)
                first = entry_pos
            crd, owners = coord[first], parent_pos[first]
        else:
            entry_pos = torch.arange(coord.numel(), dtype=torch.int64, device=device)
            crd, owners = coord, parent_pos
        per_parent = torch.bincount(owners, minlength=parent_count)
        pos = torch.zeros(parent_count + 1, dtype=torch.int64, device=device)
        torch.cumsum(per_parent, 0, out=pos[1:])
        return entry_pos, crd.numel(), {"pos": pos.to(index_dtype), "crd": crd.to(index_dtype)}

    def expand(self, parent, size, arrays):
        pos = arrays["pos"].to(torch.int64)
        parent = parent.to(torch.int64)
        if parent.numel() == pos.numel() - 1:
            # Every position of the parent level, in order: the children are all positions.
            counts = pos[1:] - pos[:-1]
            child = torch.arange(int(pos[-1]), dtype=torch.int64, device=pos.device)
        else:
            starts, counts = pos[parent], pos[parent + 1] - pos[parent]
            child = _segment_arange(starts, counts)
        owner = torch.repeat_interleave(
            torch.arange(parent.numel(), dtype=torch.int64, device=pos.device), counts,
            output_size=child.numel())
        return owner, child, arrays["crd"].to(torch.int64)[child]

    def count(self, parent_count, size, arrays):
        return int(arrays["crd"].numel())

    def validate(self, parent_count, size, arrays):
        pos, crd = arrays["pos"], arrays["crd"]
        if pos.dim() != 1 or pos.numel() != parent_count + 1:
            raise _Problem(f"pos has {pos.numel()} entries, expected {parent_count + 1} "
                           "(one per position of the level above, plus one)")
        if pos.numel() and int(pos[0]) != 0:
            raise _Problem(f"pos[0] is {int(pos[0])}, expected 0")
        step = pos[1:] - pos[:-1]
        bad = torch.nonzero(step < 0).reshape(-1)
        if bad.numel():
            p = int(bad[0])
            raise _Problem(f"pos decreases at position {p + 1} ({int(pos[p])} -> "
                           f"{int(pos[p + 1])}); pos must be non-decreasing")
        if crd.dim() != 1 or int(pos[-1]) != crd.numel():
            raise _Problem(f"pos[-1] is {int(pos[-1])} but crd has {crd.numel()} entries; "
                           "they must match")
        _check_range(crd, size)
        if self.ordered and crd.numel() > 1:
            # Within one parent's segment, coordinates increase (strictly when unique).
            same_segment = torch.ones(crd.numel() - 1, dtype=torch.bool, device=crd.device)
            boundaries = pos[1:-1].to(torch.int64) - 1
            boundaries = boundaries[(boundaries >= 0) & (boundaries < crd.numel() - 1)]
            same_segment[boundaries] = False
            diff = crd[1:].to(torch.int64) - crd[:-1].to(torch.int64)
            bad = torch.nonzero(same_segment & ((diff <= 0) if self.unique else (diff < 0)))
            if bad.numel():
                p = int(bad[0])
                what = "duplicate" if int(diff[p]) == 0 else "unsorted"
                raise _Problem(f"{what} coordinates at positions {p} and {p + 1} "
                               f"({int(crd[p])}, {int(crd[p + 1])}) under one parent; this "
                               "level is ordered" + (" and unique" if self.unique else "")
                               + ": sort and sum duplicates first (e.g. st.tensor on COO "
                               "input does this)")


@dataclass(frozen=True)
class Singleton(LevelKind):
    name = "singleton"
    has_crd = True

    def build(self, parent_pos, parent_count, coord, size, index_dtype):
        crd = torch.zeros(parent_count, dtype=torch.int64, device=coord.device)
        crd[parent_pos] = coord
        return parent_pos, parent_count, {"crd": crd.to(index_dtype)}

    def expand(self, parent, size, arrays):
        owner = torch.arange(parent.numel(), dtype=torch.int64, device=parent.device)
        child = parent.to(torch.int64)
        return owner, child, arrays["crd"].to(torch.int64)[child]

    def count(self, parent_count, size, arrays):
        return parent_count

    def validate(self, parent_count, size, arrays):
        crd = arrays["crd"]
        if crd.dim() != 1 or crd.numel() != parent_count:
            raise _Problem(f"crd has {crd.numel()} entries, expected {parent_count} "
                           "(one per position of the level above)")
        _check_range(crd, size)


def _check_range(crd: torch.Tensor, size: int) -> None:
    if crd.numel() == 0:
        return
    bad = torch.nonzero((crd < 0) | (crd >= size)).reshape(-1)
    if bad.numel():
        p = int(bad[0])
        raise _Problem(f"coordinate {int(crd[p])} at position {p} is out of range "
                       f"[0, {size})")


def is_ordered_sequence(levels) -> bool:
    """True when expanding these levels yields coordinates in lexicographic order."""
    return all(level.ordered for level in levels)
