"""How a row-parallel kernel splits its rows across threads, chosen per call from the work
and the row-length distribution of the operand whose rows it splits.

Every such kernel (a ``Parallel('balanced')`` outer loop, ``compiler/ir.py``) splits rows
into ranges holding equal shares of stored entries plus rows. The kernel's ``nc`` argument
picks how many ranges per thread:

* ``nc = 1``: one range per thread, no scheduling traffic. Right for small calls (a range
  costs two binary searches and an atomic) and for uniform rows (pruned weights, FEM and
  banded matrices), whose cost per row follows their entry count.
* ``nc = CHUNKS_PER_THREAD``: that many ranges per thread, taken from a shared counter as
  threads finish: for large calls on skewed rows (graphs), whose cost per row varies
  beyond its entry count (hub rows, scattered columns that miss in cache), so equal entry
  counts do not give equal times, and a thread the OS delays hands its ranges to others.

Measured here (2 threads, kernel only, medians of 25, three runs): SpMM with 128 columns
on pubmed (cv 1.65, 1.3 ms) 9-16% faster with dynamic ranges, amazon_cs 0-5%, amazon_photo
and coauthor_cs within 2%; on bayer10 (cv 1.05, banded, the same work estimate as pubmed)
3-24% slower, and on calls under ~0.4 ms static ranges were as fast or up to 15% faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._modes import version

# Work (``execute._Prepared.work`` units: scalar multiply-adds or vector steps) from which
# a skewed operand's rows are taken in dynamic ranges.
_CHUNKED_WORK = 1 << 19
# Row lengths whose standard deviation exceeds their mean this many times are skewed:
# Planetoid and Amazon graphs measure 1.24-1.97; coauthor_cs 1.02, bayer10 1.05, DLMC
# weights 0.08-0.82 and the SuiteSparse FEM meshes < 0.6 are not.
_SKEWED_CV = 1.1
CHUNKS_PER_THREAD = 4


@dataclass(frozen=True)
class RowProfile:
    """Row lengths of a CSR-like SparseTensor: count, mean, longest, coefficient of
    variation (standard deviation over mean), and whether they count as skewed."""

    rows: int
    mean: float
    longest: int
    cv: float

    @property
    def skewed(self) -> bool:
        return self.cv > _SKEWED_CV

    def __str__(self) -> str:
        kind = "skewed" if self.skewed else "uniform"
        return (f"{self.rows} rows of {self.mean:.1f} entries on average, longest "
                f"{self.longest}, cv {self.cv:.2f}: {kind}")


def row_profile(t) -> RowProfile:
    """The row-length profile of ``t`` (a SparseTensor with a ``pos1`` row array), computed
    once per row array and kept with it and with ``t`` (a pattern's structure never
    changes).

    Example:
        >>> import torch, sparsetorch as st
        >>> rows = [[1., 1., 1., 1.], [0., 0., 0., 1.], [0.] * 4, [0.] * 4]
        >>> p = row_profile(st.tensor(torch.tensor(rows), format="csr"))
        >>> p.rows, p.longest, p.skewed
        (4, 4, True)
    """
    found = t.__dict__.get("_row_profile")
    if found is None:
        pos = t._pos1
        # Kept with the row array too: a wrapper made anew each call over a kept pattern
        # (a softmax's output, the ones of its backward's SDDMM) found none of its own, and
        # working it out took ~200 us of a GAT training step on Cora (8.5 ms).
        kept = _PROFILES.get(pos) if type(pos) is torch.Tensor else None
        if kept is not None and kept[0] == version(pos):
            found = kept[1]
        else:
            found = _profile(pos)
            if type(pos) is torch.Tensor:
                _PROFILES[pos] = version(pos), found
        t.__dict__["_row_profile"] = found
    return found


_PROFILES = WeakIdKeyDictionary()   # a row array -> (its version, its RowProfile)


def _profile(pos: torch.Tensor) -> RowProfile:
    lengths = torch.diff(pos.to(torch.float64))
    rows = lengths.numel()
    mean = float(lengths.mean()) if rows else 0.0
    std = float(lengths.std(correction=0)) if rows else 0.0
    return RowProfile(rows, mean, int(lengths.max()) if rows else 0,
                      std / mean if mean > 0 else 0.0)


def chunked_work() -> int:
    """The work from which ``ranges_per_thread`` may answer more than one range: call shims
    skip the call below it (``shim.py``, ``cshim.py``; read when a shim is made)."""
    return _CHUNKED_WORK


def ranges_per_thread(t, work: int) -> int:
    """The ``nc`` argument for a call of ``work`` that splits the rows of ``t`` (see the
    module docstring).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(4), format="csr")
        >>> ranges_per_thread(A, 10), ranges_per_thread(A, 1 << 30)   # uniform rows
        (1, 1)
    """
    if work < _CHUNKED_WORK:
        return 1
    return CHUNKS_PER_THREAD if row_profile(t).skewed else 1


def describe(t) -> str:
    """The split rule and this operand's profile, for ``st.explain``."""
    profile = row_profile(t)
    how = (f"{CHUNKS_PER_THREAD} ranges per thread, taken dynamically, on calls of "
           f"{_CHUNKED_WORK} or more multiply-adds (vector steps where tiled); one range "
           "per thread below that" if profile.skewed else "one range per thread")
    return f"rows split by stored entries: {how} (row lengths: {profile})"
