"""Memory a sparse tensor needs, against this machine's: refuse what cannot fit before
allocating it (a dense level over a huge dimension: a row pointer per row) with an error
that says so, instead of an allocator's error or the OOM killer.
"""
from __future__ import annotations

import functools
import os

from .format import Format
from .levels import Compressed, Dense


class ResultTooLarge(ValueError, MemoryError):
    """A result that cannot fit in memory: a ``ValueError`` (bad input for this machine)
    that ``except MemoryError`` also catches."""


@functools.lru_cache(maxsize=None)
def memory_bytes() -> int:
    """Physical memory of this machine (a generous limit: 2**62 where unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def stored_bytes(fmt: Format, shape, nnz: int, value_bytes: int) -> int:
    """Bytes of a ``fmt`` tensor of ``shape`` with ``nnz`` entries (int64 indices): dense
    levels multiply the positions, compressed ones add a pointer array (positions + 1)
    and a coordinate per stored position.

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> stored_bytes(as_format("csr", 2), (4, 5), 3, 4)   # 5 pointers, 3 columns, 3 values
        76
    """
    count, total = 1, 0
    for level, size in zip(fmt.levels, fmt.storage_dims(shape)):
        if isinstance(level, Dense):
            count *= size
            continue
        if isinstance(level, Compressed):
            total += (count + 1) * 8
        count = min(count * size, nnz)
        total += count * 8
    return total + count * value_bytes


def check_fits_memory(fmt: Format, shape, nnz: int, value_bytes: int, what: str = "") -> None:
    """Raise ``ResultTooLarge`` before building a ``fmt`` tensor that could not fit in this
    machine's memory (a row pointer per row of 2^40 rows: 8 TiB for 1 entry); ``what``
    starts the message.

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> check_fits_memory(as_format("coo", 2), (2 ** 40, 4), 1, 4)   # O(entries): fits
    """
    need, limit = stored_bytes(fmt, shape, nnz, value_bytes), memory_bytes()
    if need > limit:
        raise ResultTooLarge(
            f"{what + ': ' if what else ''}a {fmt.name} tensor of shape {tuple(shape)} with "
            f"{nnz:,} entries needs about {need / 2**30:,.1f} GiB, more than this machine's "
            f"{limit / 2**30:,.1f} GiB of memory; keep a format without dense levels over the "
            "large dimensions (coo, dcsr, dcsc)")
