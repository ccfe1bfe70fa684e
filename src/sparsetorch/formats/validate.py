"""Checks on user data, run once at construction. Kernels trust what passes.

Every failure is a ``ValueError`` or ``TypeError`` whose message names the tensor, the level
or position, and the fix.
"""
from __future__ import annotations

import torch

from .format import Format
from .levels import _Problem
from .pack import INDEX_DTYPES, level_arrays, unpack

VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                torch.int64)


def check_value_dtype(values: torch.Tensor, name: str) -> None:
    if values.dtype not in VALUE_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in VALUE_DTYPES)
        raise TypeError(f"{name}: values of dtype {values.dtype} are not supported; use one "
                        f"of {supported} (e.g. convert with .to(torch.float32))")


def check_index_tensor(idx: torch.Tensor, name: str) -> None:
    """Indices must be integers; a float index (NaN or not) is a user error, not a cast."""
    if idx.dtype.is_floating_point or idx.dtype.is_complex:
        if idx.dtype.is_floating_point and bool(torch.isnan(idx).any()):
            raise ValueError(f"{name} contains NaN; indices must be integers")
        raise TypeError(f"{name} has dtype {idx.dtype}; indices must be an integer tensor "
                        "(convert with .long() after checking they are whole numbers)")
    if idx.dtype == torch.bool:
        raise TypeError(f"{name} has dtype torch.bool; indices must be integers")


def check_same_device(name: str, values: torch.Tensor, **others: torch.Tensor) -> None:
    for other_name, t in others.items():
        if t.device != values.device:
            raise ValueError(f"{name}: {other_name} is on {t.device} but values are on "
                             f"{values.device}; move them to one device with .to(device)")


def check_coords(coords: torch.Tensor, shape, name: str) -> None:
    """``coords`` is ``[ndim, nnz]``; every coordinate must lie in ``[0, shape[d])``."""
    if coords.dim() != 2 or coords.shape[0] != len(shape):
        raise ValueError(f"{name}: indices must have shape [ndim={len(shape)}, nnz], got "
                         f"{list(coords.shape)}")
    if coords.numel() == 0:
        return
    limits = torch.tensor(list(shape), dtype=torch.int64, device=coords.device)[:, None]
    bad = (coords < 0) | (coords >= limits)
    if bool(bad.any()):
        dim, pos = (int(v) for v in torch.nonzero(bad)[0])
        value = int(coords[dim, pos])
        what = "negative" if value < 0 else "out of range"
        raise ValueError(f"{name}: index {value} in dimension {dim} at entry {pos} is {what} "
                         f"for shape {tuple(shape)}; indices must lie in [0, {shape[dim]})")


def check_levels(fmt: Format, shape, arrays: dict, values: torch.Tensor, name: str) -> None:
    """Full structural check of user-supplied level arrays against ``fmt`` and ``shape``."""
    check_value_dtype(values, name)
    if values.dim() != 1:
        raise ValueError(f"{name}: values must be 1-D, got shape {list(values.shape)}")
    dtypes = {a.dtype for a in arrays.values()}
    for key, a in arrays.items():
        check_index_tensor(a, f"{name}: level array {key}")
        check_same_device(name, values, **{key: a})
    if len(dtypes) > 1 or not dtypes <= set(INDEX_DTYPES):
        raise TypeError(f"{name}: level arrays have dtypes {sorted(map(str, dtypes))}; use one "
                        "index dtype, torch.int32 or torch.int64, for all of them")
    if fmt.blocksize is not None:
        for m, (n, b) in enumerate(zip(shape, fmt.blocksize)):
            if n % b:
                raise ValueError(f"{name}: dimension {m} of size {n} is not divisible by the "
                                 f"block size {b}")
    dims = fmt.storage_dims(shape)
    count = 1
    for k, level in enumerate(fmt.levels):
        try:
            level.validate(count, dims[k], level_arrays(arrays, k))
        except _Problem as e:
            raise ValueError(f"{name}: level {k} ({level}): {e}") from None
        count = level.count(count, dims[k], level_arrays(arrays, k))
    if values.numel() != count:
        raise ValueError(f"{name}: values has {values.numel()} entries but the levels store "
                         f"{count}; they must match")
    if any(not lv.unique for lv in fmt.levels):
        _check_entries_sorted_unique(fmt, shape, arrays, values, name)


def _check_entries_sorted_unique(fmt, shape, arrays, values, name) -> None:
    """Non-unique levels (COO) promise order and uniqueness only of whole entries."""
    coords, _ = unpack(fmt, shape, arrays, values)
    keys = coords[list(fmt.mode_order)]
    if keys.shape[1] < 2:
        return
    diff = keys[:, 1:] - keys[:, :-1]
    first = torch.argmax((diff != 0).to(torch.int8), 0)          # first differing level
    step = diff.gather(0, first[None]).squeeze(0)
    bad = torch.nonzero(step <= 0).reshape(-1)
    if bad.numel():
        p = int(bad[0])
        what = "duplicate" if int(step[p]) == 0 else "unsorted"
        raise ValueError(f"{name}: {what} entries at positions {p} and {p + 1} "
                         f"({coords[:, p].tolist()}, {coords[:, p + 1].tolist()}); format "
                         f"{fmt.name!r} needs sorted, unique coordinates: pass COO data through "
                         "st.tensor((indices, values), shape=...), which sorts and sums them")
