"""Checks on user data, run once at construction. Kernels trust what passes.

Every failure is a ``ValueError`` or ``TypeError`` whose message names the tensor, the level
or position, and the fix. The checks are vectorised reductions (min/max/any) over the arrays;
the offending position is only searched for once something is known to be wrong.

Example:
    >>> import torch
    >>> check_coords([torch.tensor([0, 2])], (2,), "x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: x: index 2 in dimension 0 at entry 1 is out of range for shape (2,); ...
"""
from __future__ import annotations

import math
import operator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .format import Format
from .levels import _Problem, check_bounds
from .pack import INDEX_DTYPES, array_names, level_arrays, unpack_rows

_TRACED = (FakeTensor, FunctionalTensor)

VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                torch.int64)


def _supported() -> str:
    return ", ".join(str(d).replace("torch.", "") for d in VALUE_DTYPES)


def check_value_dtype(values: torch.Tensor, name: str) -> None:
    """Values must be a tensor with one of ``VALUE_DTYPES`` (complex, bool and 8-bit types
    are not). (On any device: a meta SparseTensor's ``with_values`` takes meta values.)"""
    _check_tensor(values, f"{name}: values")
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(f"{name}: values of dtype {values.dtype} are not supported; use one "
                        f"of {_supported()} (e.g. convert with .to(torch.float32))")


def check_dtype_argument(dtype, name: str) -> None:
    """A ``dtype=`` keyword must name a supported value dtype."""
    if dtype is not None and dtype not in VALUE_DTYPES:
        raise TypeError(f"{name}: dtype={dtype} is not supported; use one of {_supported()}")


def check_shape(shape, name: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative Python ints."""
    try:
        dims = tuple(shape)
        out = tuple(operator.index(s) for s in dims)
    except TypeError:
        raise TypeError(f"{name}: shape {shape!r} must be a sequence of integers") from None
    if any(s < 0 for s in out):
        raise ValueError(f"{name}: shape {out} has a negative size; sizes must be non-negative")
    if math.prod(out) >= 2 ** 63:   # (a SparseTensor is a torch.Tensor of this shape)
        raise ValueError(f"{name}: shape {out} holds {math.prod(out)} elements in all, past "
                         "torch's limit for a tensor's element count (2^63 - 1); use smaller "
                         "dimensions")
    return out


def check_index_tensor(idx: torch.Tensor, name: str) -> None:
    """Indices must be integers holding data (they are checked against the shape); a float
    index (NaN or not) is a user error, not a cast."""
    _check_tensor(idx, name)
    if idx.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no data to check; build "
                         "the tensor on a real device (a meta SparseTensor: A.to('meta') of a "
                         "real one)")
    if idx.dtype in _UNSIGNED_WIDE:   # (torch's reductions, which the checks use, lack them)
        raise TypeError(f"{name} has dtype {idx.dtype}; convert the indices with "
                        ".to(torch.int64)")
    if idx.dtype.is_floating_point or idx.dtype.is_complex:
        if idx.dtype.is_floating_point:
            nan = torch.isnan(idx).reshape(-1)
            if bool(nan.any()):
                p = int(torch.nonzero(nan)[0]) % max(idx.shape[-1], 1) if idx.dim() else 0
                raise ValueError(f"{name} contains NaN at entry {p}; indices must be integers")
        raise TypeError(f"{name} has dtype {idx.dtype}; indices must be an integer tensor "
                        "(convert with .long() after checking they are whole numbers)")
    if idx.dtype == torch.bool:
        raise TypeError(f"{name} has dtype torch.bool; indices must be integers (for a mask, "
                        "pass the masked dense tensor instead)")


_UNSIGNED_WIDE = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64")
                       if hasattr(torch, n))


def _check_tensor(t, name: str) -> None:
    """``t`` is a tensor: a list or a NumPy array is named."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}; pass a torch tensor "
                        "(torch.as_tensor(...))")


def check_same_device(name: str, values: torch.Tensor, **others: torch.Tensor) -> None:
    for other_name, t in others.items():
        if t.device != values.device:
            raise ValueError(f"{name}: {other_name} is on {t.device} but values are on "
                             f"{values.device}; move them to one device with .to(device)")


def check_coords(coords, shape, name: str) -> None:
    """``coords`` is ``[ndim, nnz]`` (or a list of ndim 1-D tensors); every coordinate must lie
    in ``[0, shape[d])``."""
    rows = list(coords.unbind(0)) if isinstance(coords, torch.Tensor) and coords.dim() == 2 \
        else coords
    if isinstance(rows, torch.Tensor) or len(rows) != len(shape) or any(
            r.dim() != 1 or r.numel() != rows[0].numel() for r in rows):
        got = list(coords.shape) if isinstance(coords, torch.Tensor) else \
            [len(coords), *sorted({r.numel() for r in coords})]
        raise ValueError(f"{name}: indices must have shape [ndim={len(shape)}, nnz], got {got}")
    for dim, (row, size) in enumerate(zip(rows, shape)):
        if row.numel() == 0:
            continue
        low, high = torch.aminmax(row)
        if int(low) >= 0 and int(high) < size:
            continue
        pos = int(torch.nonzero((row < 0) | (row >= size))[0])
        value = int(row[pos])
        what = "negative" if value < 0 else "out of range"
        raise ValueError(f"{name}: index {value} in dimension {dim} at entry {pos} is {what} "
                         f"for shape {tuple(shape)}; indices must lie in [0, {size})")


def check_blocks(fmt: Format, shape, name: str) -> None:
    """Blocked formats need every dimension divisible by its block size."""
    if fmt.blocksize is None:
        return
    for m, (n, b) in enumerate(zip(shape, fmt.blocksize)):
        if n % b:
            raise ValueError(f"{name}: dimension {m} of size {n} is not divisible by the block "
                             f"size {b}; pad the tensor or pick a block size that divides it")


def check_levels(fmt: Format, shape, arrays: dict, values: torch.Tensor, name: str,
                 full: bool = True) -> None:
    """Structural check of user-supplied level arrays against ``fmt`` and ``shape``: always
    dtypes, shapes and bounds (``levels.check_bounds``: what keeps kernels in bounds); with
    ``full`` also what each level kind promises (order, uniqueness). Arrays being traced
    (fake or functional tensors) have no data to check: only their metadata is."""
    check_value_dtype(values, name)
    if values.dim() != 1:
        raise ValueError(f"{name}: values must be 1-D, got shape {list(values.shape)}")
    for key, a in arrays.items():
        check_index_tensor(a, f"{name}: level array {key}")
        check_same_device(name, values, **{key: a})
        if a.dim() != 1:
            raise ValueError(f"{name}: {key} must be 1-D, got shape {list(a.shape)}")
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) > 1 or not dtypes <= set(INDEX_DTYPES):
        raise TypeError(f"{name}: level arrays have dtypes {sorted(map(str, dtypes))}; use one "
                        "index dtype, torch.int32 or torch.int64, for all of them")
    check_blocks(fmt, shape, name)
    dims = fmt.storage_dims(shape)
    count = 1
    if torch.compiler.is_compiling() or any(isinstance(t, _TRACED)
                                            for t in (values, *arrays.values())):
        return   # traced: no data here (torch.compile), only the metadata checked above
    from .scipy_routes import compressed_is_valid
    if compressed_is_valid(fmt, dims, arrays, values):
        return   # CSR/CSC on the CPU shown valid in one C pass: nothing left to check
    for k, level in enumerate(fmt.levels):
        try:
            check_bounds(level, count, dims[k], level_arrays(arrays, k))
            if full:
                level.validate(count, dims[k], level_arrays(arrays, k))
        except _Problem as e:
            raise ValueError(f"{name}: level {k} ({level}): {e}") from None
        count = level.count(count, dims[k], level_arrays(arrays, k))
    if values.numel() != count:
        raise ValueError(f"{name}: values has {values.numel()} entries but the levels store "
                         f"{count}; they must match")
    if full and any(not lv.unique for lv in fmt.levels):
        _check_entries_sorted_unique(fmt, shape, arrays, values, name)


def _check_entries_sorted_unique(fmt, shape, arrays, values, name) -> None:
    """Non-unique levels (COO) promise order and uniqueness only of whole entries: check the
    entries are strictly increasing in storage order (when ordered) and distinct."""
    rows = unpack_rows(fmt, shape, arrays, values.device)
    if values.numel() < 2:
        return
    keys = [rows[m].to(torch.int64) for m in fmt.mode_order]
    diff = torch.stack([k[1:] - k[:-1] for k in keys])
    first = torch.argmax((diff != 0).to(torch.int8), 0)          # first differing level
    step = diff.gather(0, first[None]).squeeze(0)
    ordered = all(lv.ordered for lv in fmt.levels)
    bad = torch.nonzero((step <= 0) if ordered else (step == 0)).reshape(-1)
    if not ordered and not bad.numel():
        sorted_rows = torch.stack(keys).T.unique(dim=0)
        if sorted_rows.shape[0] == values.numel():
            return
        raise ValueError(f"{name}: duplicate entries; format {fmt.name!r} needs unique "
                         "coordinates: pass COO data through st.tensor((indices, values), "
                         "shape=...), which sums them")
    if bad.numel():
        p = int(bad[0])
        what = "duplicate" if int(step[p]) == 0 else "unsorted"
        entry = [[int(r[i]) for r in rows] for i in (p, p + 1)]
        raise ValueError(f"{name}: {what} entries at positions {p} and {p + 1} "
                         f"({entry[0]}, {entry[1]}); format {fmt.name!r} needs sorted, unique "
                         "coordinates: pass COO data through st.tensor((indices, values), "
                         "shape=...), which sorts and sums them")


def check_restored_state(state, wrapper) -> tuple:
    """``(format, shape, arrays, values)`` from the attribute dict a pickled SparseTensor
    carries, after checking its kinds and that it agrees with the wrapper torch rebuilt
    (dtype, shape, device); ``check_levels`` then checks the arrays themselves."""
    what = "torch.load of a SparseTensor"
    if isinstance(state, tuple) and state and isinstance(state[0], dict):
        state = state[0]      # (dict, slots), as torch's own tensors pickle their state
    if not isinstance(state, dict):
        raise ValueError(f"{what}: the saved state is a {type(state).__name__}, not the "
                         "attribute dict sparsetorch writes; the file is damaged or was not "
                         "written by torch.save of a SparseTensor")
    fmt, values = state.get("_format"), state.get("_values")
    if not isinstance(fmt, Format) or not isinstance(values, torch.Tensor):
        raise ValueError(f"{what}: the saved state lacks a Format or a values tensor; the "
                         "file is damaged or was not written by torch.save of a SparseTensor")
    # A Format restored from a file skipped its own checks (mode order, blocking): redo them.
    fmt = Format(tuple(fmt.levels), fmt.mode_order, fmt.blocksize)
    shape = check_shape(state.get("_size", ()), what)
    if len(shape) != fmt.ndim:
        raise ValueError(f"{what}: a tensor of order {len(shape)} saved with the "
                         f"order-{fmt.ndim} format {fmt.name!r}; the file is damaged")
    with torch._C.DisableTorchFunctionSubclass():   # the wrapper's own metadata
        saved = (torch.Tensor.dtype.__get__(wrapper), torch.Tensor.device.__get__(wrapper),
                 tuple(torch.Tensor.size(wrapper)))
    if (values.dtype, values.device, shape) != saved:
        raise ValueError(f"{what}: the values ({values.dtype}, {values.device}) or the shape "
                         f"{shape} disagree with the saved wrapper; the file is damaged")
    arrays = {n: state.get("_" + n) for n in array_names(fmt)}
    bad = sorted(n for n, a in arrays.items() if not isinstance(a, torch.Tensor))
    if bad:
        raise ValueError(f"{what}: format {fmt.name!r} stores arrays {list(arrays)}; {bad} "
                         "missing or not tensors; the file is damaged")
    return fmt, shape, arrays, values
