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

Every kind answers the same questions, vectorised over all positions of a level: ``build``
(sorted coordinates -> arrays), ``expand_all`` / ``expand`` (arrays -> coordinates) and
``validate`` (are user arrays consistent?). The compiler asks the same kinds for loop bounds
and locate (``compiler/`` keeps that half), so nothing downstream branches on format names.

Example (CSR rows 0 and 2 of a 3 x 4 matrix, built level by level as ``pack`` does):
    >>> import torch
    >>> rows, cols = torch.tensor([0, 0, 2]), torch.tensor([1, 3, 0])
    >>> pos_rows, count, _ = Dense().build(None, 1, rows, 3)
    >>> _, nnz, arrays = Compressed().build(pos_rows, count, cols, 4, distinct=True)
    >>> arrays["pos"].tolist(), arrays["crd"].tolist()
    ([0, 2, 2, 3], [1, 3, 0])
    >>> owner, crd = Compressed().expand_all(3, 4, arrays)
    >>> owner.tolist()
    [0, 0, 2]

Positions: a ``None`` position tensor means the obvious one and is never materialised:
for ``build`` under the root (``parent_count == 1``) every entry has parent 0, otherwise entry
``i`` has parent ``i``; ``expand_all`` returns ``owner=None`` when child ``c``'s parent is ``c``.
Positions are int32 when the level's count fits (half the memory traffic of int64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1


def index_dtype_for(bound: int) -> torch.dtype:
    """The smaller integer dtype that holds every value in ``[0, bound]``."""
    return torch.int32 if bound <= INT32_MAX else torch.int64


def _arange(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=index_dtype_for(n), device=device)


def _linear(outer, size: int, inner, bound: int):
    """``outer * size + inner`` in int32 when every result is below ``bound`` <= 2**31."""
    dtype = index_dtype_for(bound)
    return outer.to(dtype) * size + inner.to(dtype)


def _parents(parent_pos, parent_count: int, n: int, device) -> torch.Tensor:
    """Materialise an implicit (``None``) parent position tensor."""
    if parent_pos is not None:
        return parent_pos
    if parent_count == 1:
        return torch.zeros(n, dtype=torch.int32, device=device)
    if parent_count != n:
        raise ValueError(f"implicit parent positions need parent_count 1 or {n}, got "
                         f"{parent_count}")
    return _arange(n, device)


def positions_from_owners(owners, parent_count: int, n: int, device) -> torch.Tensor:
    """``pos`` (length ``parent_count + 1``) of a level whose ``n`` entries have the sorted
    parent positions ``owners`` (``None``: implicit, as in ``build``). O(n), no sort."""
    dtype = index_dtype_for(n)
    if owners is None and parent_count == 1:
        return torch.tensor([0, n], dtype=dtype, device=device)
    if owners is None:
        return _arange(n + 1, device).to(dtype)
    if n == 0:
        return torch.zeros(parent_count + 1, dtype=dtype, device=device)
    return torch._convert_indices_from_coo_to_csr(owners.contiguous(), parent_count,
                                                  out_int32=dtype == torch.int32)


def _owners(pos: torch.Tensor, crd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Parent ``p`` repeated ``pos[p+1] - pos[p]`` times (the row of each CSR entry), in
    ``dtype``: torch's CSR -> COO index conversion, one pass. ``repeat_interleave`` took
    36 ms for Cora's 10k entries on two threads here (this: 44 us; scipy's tocoo 160 us)."""
    n = crd.numel()
    if type(n) is not int:   # a traced, data-dependent entry count: torch's op has no rule
        counts = pos.diff().to(dtype)
        return torch.repeat_interleave(counts, output_size=n)
    if crd.dtype != pos.dtype:
        crd = crd.to(pos.dtype)
    return torch._convert_indices_from_csr_to_coo(pos, crd, out_int32=dtype == torch.int32)[0]


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
    def build(self, parent_pos, parent_count, coord, size, index_dtype=None, *,
              distinct: bool = False):
        """Place the entries (one per element of ``coord``, sorted lexicographically, with
        their non-decreasing positions ``parent_pos`` in the level above, ``None`` if implicit)
        in this level. ``distinct=True`` promises no two entries share (parent, coordinate).

        Returns ``(entry_pos, count, arrays)``: each entry's position here (``None`` when
        entry ``i`` is at position ``i``), the number of positions of this level, and the
        arrays this level stores (dict name -> tensor; coordinates keep ``coord``'s dtype,
        the caller casts to the final index dtype).
        """
        raise NotImplementedError

    # -- expansion to coordinates -----------------------------------------------------------
    def expand_all(self, parent_count: int, size: int, arrays: dict, device=None):
        """Every position of this level, in order, given that the level above has
        ``parent_count`` positions (``device``: where arrays that are made up go).

        Returns ``(owner, coord)``: each child's parent position (``None`` when child ``c``'s
        parent is ``c``) and its coordinate (``None`` when it equals the child's position).
        """
        raise NotImplementedError

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
        """Check what this kind promises beyond ``check_bounds`` (which every level of user
        data passes first, whatever its kind: kernels rely on it to stay in bounds), such as
        order and uniqueness; raise ``_Problem`` describing the first violation."""


@dataclass(frozen=True)
class Dense(LevelKind):
    name = "dense"

    def build(self, parent_pos, parent_count, coord, size, index_dtype=None, *,
              distinct=False):
        count = parent_count * size
        if parent_pos is None and parent_count == 1:
            return coord, count, {}
        parent_pos = _parents(parent_pos, parent_count, coord.numel(), coord.device)
        return _linear(parent_pos, size, coord, count), count, {}

    def expand_all(self, parent_count, size, arrays, device=None):
        if parent_count == 1:     # the coordinate is the position itself
            return torch.zeros(size, dtype=torch.int32, device=device), None
        owner = _arange(parent_count, device).repeat_interleave(size)
        return owner, _arange(size, device).repeat(parent_count)

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

    def build(self, parent_pos, parent_count, coord, size, index_dtype=None, *,
              distinct=False):
        device, n = coord.device, coord.numel()
        if parent_pos is None and parent_count > 1:
            distinct = True                 # entry i alone under parent i
        if self.unique and not distinct and n > 1:
            new = torch.empty(n, dtype=torch.bool, device=device)
            new[0] = True
            torch.ne(coord[1:], coord[:-1], out=new[1:])
            if parent_pos is not None and parent_count > 1:
                new[1:] |= parent_pos[1:] != parent_pos[:-1]
            distinct = bool(new.all())
        if not self.unique or distinct or n <= 1:
            entry_pos, crd, owners = None, coord, parent_pos
        else:
            first = torch.nonzero(new).reshape(-1)
            entry_pos = torch.cumsum(new, 0, dtype=index_dtype_for(n)) - 1
            crd = coord[first]
            owners = None if parent_pos is None else parent_pos[first]
        count = crd.numel()
        if owners is None and parent_count not in (1, count):
            owners = _parents(parent_pos, parent_count, n, device)
        pos = positions_from_owners(owners, parent_count, count, device)
        arrays = {"pos": pos, "crd": crd}
        if index_dtype is not None:
            arrays = {k: a.to(index_dtype) for k, a in arrays.items()}
        return entry_pos, count, arrays

    def expand_all(self, parent_count, size, arrays, device=None):
        pos, crd = arrays["pos"], arrays["crd"]
        n = crd.numel()
        if parent_count == 1:
            return torch.zeros(n, dtype=torch.int32, device=crd.device), crd
        return _owners(pos, crd, index_dtype_for(parent_count)), crd

    def expand(self, parent, size, arrays):
        pos = arrays["pos"].to(torch.int64)
        parent = parent.to(torch.int64)
        starts, counts = pos[parent], pos[parent + 1] - pos[parent]
        child = _segment_arange(starts, counts)
        owner = torch.repeat_interleave(
            torch.arange(parent.numel(), dtype=torch.int64, device=pos.device), counts,
            output_size=child.numel())
        return owner, child, arrays["crd"].to(torch.int64)[child]

    def count(self, parent_count, size, arrays):
        # numel() is already an int eagerly; int() would force a traced, data-dependent
        # size (an assembled result's entry count) to a constant and fail the trace
        return arrays["crd"].numel()

    def validate(self, parent_count, size, arrays):
        pos, crd = arrays["pos"], arrays["crd"]   # (in bounds: ``check_bounds``)
        if crd.numel() < 2:
            return
        if self.ordered:
            # step[j] = crd[j] - crd[j-1] for j in 1..n-1, and 1 at the ends and wherever a
            # segment starts (pos[1:-1]): one diff, one fill and one min over the entries
            # (the steps cannot overflow: coordinates are in [0, size))
            step = torch.diff(crd, prepend=crd[:1] - 1, append=crd[-1:] + 1)
            step.index_fill_(0, pos[1:-1].to(torch.int64), 1)
            if int(step.min()) > (0 if self.unique else -1):
                return
            bad = torch.nonzero(step <= 0 if self.unique else step < 0).reshape(-1)
            p = int(bad[0]) - 1
            a, b = int(crd[p]), int(crd[p + 1])
            what = "duplicate" if a == b else "unsorted"
            raise _Problem(f"{what} coordinates at positions {p} and {p + 1} ({a}, {b}) "
                           "under one parent; this level is ordered"
                           + (" and unique" if self.unique else "")
                           + ": sort and sum duplicates first (e.g. st.tensor on COO "
                           "input does this)")
        elif self.unique:
            _check_unordered_unique(pos, crd, size)


@dataclass(frozen=True)
class Singleton(LevelKind):
    name = "singleton"
    has_crd = True

    def build(self, parent_pos, parent_count, coord, size, index_dtype=None, *,
              distinct=False):
        if parent_pos is None and parent_count == coord.numel():
            crd = coord
        else:
            parent_pos = _parents(parent_pos, parent_count, coord.numel(), coord.device)
            crd = torch.zeros(parent_count, dtype=coord.dtype, device=coord.device)
            crd[parent_pos] = coord
        crd = crd if index_dtype is None else crd.to(index_dtype)
        return parent_pos, parent_count, {"crd": crd}

    def expand_all(self, parent_count, size, arrays, device=None):
        return None, arrays["crd"]

    def expand(self, parent, size, arrays):
        owner = torch.arange(parent.numel(), dtype=torch.int64, device=parent.device)
        child = parent.to(torch.int64)
        return owner, child, arrays["crd"].to(torch.int64)[child]

    def count(self, parent_count, size, arrays):
        return parent_count

    def validate(self, parent_count, size, arrays):
        pass   # one child per parent, in range: all ``check_bounds`` asks


def check_bounds(level: LevelKind, parent_count: int, size: int, arrays: dict) -> None:
    """What kernels rely on to stay in bounds, checked for a level of any kind (a custom
    kind's own ``validate`` cannot skip it): a ``pos`` array has one entry per parent
    position plus one, starts at 0, never decreases and ends at the level's entry count; a
    ``crd`` array holds that many coordinates (one per parent without ``pos``), each in
    ``[0, size)``; and the kind's ``count`` agrees. Vectorised, O(entries). Raises
    ``_Problem``.

    Example:
        >>> import torch
        >>> check_bounds(Compressed(), 2, 3, {"pos": torch.tensor([0, 1, 2]),
        ...                                   "crd": torch.tensor([0, 7])})
        Traceback (most recent call last):
        ...
        sparsetorch.formats.levels._Problem: coordinate 7 at position 1 is out of range [0, 3); every coordinate must be below the size of its dimension
    """
    count = parent_count
    if level.has_pos:
        pos = arrays["pos"]
        if pos.numel() != parent_count + 1:
            raise _Problem(f"pos has {pos.numel()} entries, expected {parent_count + 1} "
                           "(one per position of the level above, plus one)")
        if int(pos[0]) != 0:
            raise _Problem(f"pos[0] is {int(pos[0])}, expected 0")
        bad = torch.nonzero(pos[1:] < pos[:-1]).reshape(-1)
        if bad.numel():
            p = int(bad[0])
            raise _Problem(f"pos decreases at position {p + 1} ({int(pos[p])} -> "
                           f"{int(pos[p + 1])}); pos must be non-decreasing")
        count = int(pos[-1])
    if level.has_crd:
        crd = arrays["crd"]
        if crd.numel() != count:
            raise _Problem(f"pos[-1] is {count} but crd has {crd.numel()} entries; they must "
                           "match" if level.has_pos else f"crd has {crd.numel()} entries, "
                           f"expected {count} (one per position of the level above)")
        _check_range(crd, size)
    elif level.has_pos:
        raise _Problem("a level with pos must store crd (its children's coordinates)")
    if (level.has_pos or level.has_crd) and level.count(parent_count, size, arrays) != count:
        raise _Problem(f"its kind counts {level.count(parent_count, size, arrays)} entries "
                       f"but its arrays hold {count}")


def _check_range(crd: torch.Tensor, size: int) -> None:
    if crd.numel() == 0:
        return
    low, high = torch.aminmax(crd)
    if int(low) >= 0 and int(high) < size:
        return
    bad = torch.nonzero((crd < 0) | (crd >= size)).reshape(-1)
    p = int(bad[0])
    raise _Problem(f"coordinate {int(crd[p])} at position {p} is out of range [0, {size}); "
                   "every coordinate must be below the size of its dimension")


def _check_unordered_unique(pos: torch.Tensor, crd: torch.Tensor, size: int) -> None:
    """No coordinate twice under one parent, for a level that may list them in any order."""
    key = _owners(pos, crd, torch.int64) * max(size, 1) + crd.to(torch.int64)
    sorted_key, order = torch.sort(key, stable=True)
    dup = torch.nonzero(sorted_key[1:] == sorted_key[:-1]).reshape(-1)
    if dup.numel():
        p, q = sorted(int(order[int(dup[0]) + i]) for i in (0, 1))
        raise _Problem(f"duplicate coordinate {int(crd[p])} under one parent at positions {p} "
                       f"and {q}; this level is unique: sum duplicates first (st.tensor on COO "
                       "input does this)")
