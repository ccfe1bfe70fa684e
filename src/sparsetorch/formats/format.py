"""``Format``: level kinds + mode order + optional blocking, and the named formats.

Storage dimensions. Without blocking, level ``k`` stores mode ``mode_order[k]``. With
``blocksize = (b_0, ..., b_{n-1})`` a tensor of shape ``(n_0, ..., n_{n-1})`` is stored as the
order-2n tensor of block coordinates followed by in-block coordinates: levels ``0..n-1`` hold
``n_m // b_m`` for ``m`` in ``mode_order``, levels ``n..2n-1`` hold ``b_m`` (also in mode order).
BSR is therefore ``(dense, compressed, dense, dense)`` over ``(M/r, N/c, r, c)``.
"""
from __future__ import annotations

import functools
import operator

from dataclasses import dataclass

from .levels import Compressed, Dense, LevelKind, Singleton

dense = Dense()
compressed = Compressed()
singleton = Singleton()


class _NameOnce:
    """``Format.name``: the conventional name if the format has one, else a description of
    its levels, found once and kept in the instance's ``__dict__`` (where later reads find
    it without calling this). functools.cached_property does the same but takes a lock in
    Python 3.11, which torch.compile cannot trace: a Format first named inside a compiled
    function stopped the graph."""

    def __get__(self, fmt, owner=None):
        if fmt is None:
            return self
        name = fmt.__dict__["name"] = fmt._find_name()
        return name


@dataclass(frozen=True)
class Format:
    """How a sparse tensor is laid out.

    Example:
        >>> import sparsetorch as st
        >>> f = st.Format((st.dense, st.compressed), mode_order=(1, 0))
        >>> f.name
        'csc'
    """

    levels: tuple[LevelKind, ...]
    mode_order: tuple[int, ...] | None = None
    blocksize: tuple[int, ...] | None = None

    def __post_init__(self):
        levels = tuple(self.levels)
        object.__setattr__(self, "levels", levels)
        for lv in levels:
            if not isinstance(lv, LevelKind):
                raise TypeError(f"Format levels must be level kinds (st.dense, st.compressed, "
                                f"st.singleton), got {lv!r}")
        order = self.ndim
        mode_order = tuple(range(order)) if self.mode_order is None else tuple(
            int(m) for m in self.mode_order)
        if sorted(mode_order) != list(range(order)):
            raise ValueError(f"Format mode_order {mode_order} is not a permutation of "
                             f"0..{order - 1}")
        object.__setattr__(self, "mode_order", mode_order)
        if self.blocksize is not None:
            bs = block_sizes(self.blocksize, order)
            if len(levels) % 2 or len(bs) != order or min(bs, default=1) < 1:
                raise ValueError(f"blocksize {self.blocksize} needs one positive size per mode "
                                 f"and twice as many levels as modes")
            if any(not isinstance(lv, Dense) for lv in levels[order:]):
                raise ValueError("blocked formats store each block densely: the in-block "
                                 "levels must all be st.dense")
            object.__setattr__(self, "blocksize", bs)
        for k, lv in enumerate(levels):
            if isinstance(lv, Singleton) and (k == 0 or levels[k - 1].unique):
                raise ValueError(f"level {k} is singleton but the level above it is unique; a "
                                 "singleton level must follow a non-unique level (as in COO)")
            if not lv.unique and any(not isinstance(x, Singleton) for x in levels[k + 1:]):
                raise ValueError(f"level {k} is non-unique, so every level below it must be "
                                 "singleton")

    @property
    def ndim(self) -> int:
        """Order of the tensors this format stores (levels / 2 when blocked)."""
        return len(self.levels) // 2 if self.blocksize is not None else len(self.levels)

    @property
    def is_dense(self) -> bool:
        return all(isinstance(lv, Dense) for lv in self.levels)

    def _find_name(self) -> str:
        for name, make in _NAMED.items():
            try:
                if make(self.ndim, self.blocksize) == self:
                    return name
            except ValueError:
                continue
        if all(isinstance(lv, Compressed) and lv.unique for lv in self.levels):
            return "csf"
        return "(" + ",".join(map(str, self.levels)) + f";order={self.mode_order})"

    name = _NameOnce()

    def storage_dims(self, shape) -> tuple[int, ...]:
        """Sizes of the storage dimensions (one per level) for a tensor of ``shape``."""
        shape = tuple(shape)
        if self.blocksize is None:
            return tuple(shape[m] for m in self.mode_order)
        outer = tuple(shape[m] // self.blocksize[m] for m in self.mode_order)
        return outer + tuple(self.blocksize[m] for m in self.mode_order)

    def __repr__(self) -> str:
        extra = f", blocksize={self.blocksize}" if self.blocksize else ""
        return f"Format({self.name!r}: levels=({', '.join(map(str, self.levels))}), " \
               f"mode_order={self.mode_order}{extra})"


def _csr(n, bs):
    _need(n, 2, "csr")
    return Format((dense, compressed))


def _csc(n, bs):
    _need(n, 2, "csc")
    return Format((dense, compressed), (1, 0))


def _dcsr(n, bs):
    _need(n, 2, "dcsr")
    return Format((compressed, compressed))


def _dcsc(n, bs):
    _need(n, 2, "dcsc")
    return Format((compressed, compressed), (1, 0))


def _coo(n, bs):
    if n == 1:
        return Format((compressed,))
    # TACO's COO: every level but the last repeats coordinates (one per entry below it)
    return Format((Compressed(unique=False),) + (Singleton(unique=False),) * (n - 2)
                  + (singleton,))


def _csf(n, bs):
    return Format((compressed,) * n)


def _dense(n, bs):
    return Format((dense,) * n)


def _bsr(n, bs):
    _need(n, 2, "bsr")
    if bs is None:
        raise ValueError("format 'bsr' needs blocksize=(rows, cols), e.g. blocksize=(4, 4)")
    return Format((dense, compressed, dense, dense), blocksize=bs)


def _need(n, want, name):
    if n != want:
        raise ValueError(f"format {name!r} is for {want}-D tensors; this tensor is {n}-D "
                         f"(use 'coo' or 'csf' for any order)")


_NAMED = {"csr": _csr, "csc": _csc, "dcsr": _dcsr, "dcsc": _dcsc, "coo": _coo,
          "csf": _csf, "bsr": _bsr, "dense": _dense}

FORMAT_NAMES = tuple(_NAMED)


def block_sizes(blocksize, ndim: int) -> tuple[int, ...]:
    """``blocksize`` as a tuple of ints, one per mode: an int is the same size for every
    mode; a float or anything else that is not an integer is a ``TypeError``.

    Example:
        >>> block_sizes(2, 2), block_sizes((2, 3), 2)
        ((2, 2), (2, 3))
    """
    try:
        if isinstance(blocksize, bool):
            raise TypeError
        if not hasattr(blocksize, "__iter__"):
            return (operator.index(blocksize),) * ndim
        sizes = tuple(blocksize)
        if any(isinstance(b, bool) for b in sizes):
            raise TypeError
        return tuple(operator.index(b) for b in sizes)
    except TypeError:
        raise TypeError(f"blocksize must be an int or a tuple of ints (one per mode), e.g. "
                        f"(2, 2); got {blocksize!r}") from None


def as_format(fmt, ndim: int, blocksize=None) -> Format:
    """Resolve a format name or ``Format`` for a tensor of order ``ndim``; ``blocksize``:
    see ``block_sizes``.

    Example:
        >>> as_format("csr", 2).levels
        (Dense(unique=True, ordered=True), Compressed(unique=True, ordered=True))
    """
    if blocksize is not None:
        blocksize = block_sizes(blocksize, ndim)
    if isinstance(fmt, Format):
        if fmt.ndim != ndim:
            raise ValueError(f"format {fmt.name!r} stores {fmt.ndim}-D tensors, but the "
                             f"tensor is {ndim}-D")
        if blocksize is not None and blocksize != fmt.blocksize:
            raise ValueError(f"blocksize={blocksize} conflicts with the format's "
                             f"blocksize {fmt.blocksize}")
        return fmt
    if isinstance(fmt, (list, tuple)):
        return as_format(Format(tuple(fmt), blocksize=blocksize), ndim)
    if not isinstance(fmt, str) or fmt.lower() not in _NAMED:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMAT_NAMES)} or a "
                         "st.Format / list of level kinds")
    name = fmt.lower()
    if blocksize is not None and name != "bsr":
        raise ValueError(f"blocksize is only meaningful for format 'bsr', not {name!r}")
    return _named_format(name, ndim, blocksize)


@functools.lru_cache(maxsize=256)
def _named_format(name: str, ndim: int, blocksize) -> Format:
    # one shared (immutable) Format per name, order and blocksize: building one validates its
    # levels and finds its name, ~13 us that every conversion and call paid again
    return _NAMED[name](ndim, blocksize)
