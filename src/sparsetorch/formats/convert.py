"""Conversions: ``st.tensor`` from anything, and SparseTensor to dense, scipy and torch.sparse.

Every route goes through coordinates (``pack``/``unpack_rows``), or wraps level arrays
directly where the layouts coincide (scipy/torch CSR, CSC, BSR need no sort, only validation);
2-D CSR/CSC/COO conversions on the CPU take scipy's C routines (``scipy_routes``).
Entries are preserved: converting keeps explicit zeros (BSR blocks, values that became 0),
except from a dense *format*, which stores every entry and converts like a dense tensor
(zeros dropped).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .format import Format, as_format, compressed, dense
from .memory import check_fits_memory
from .pack import choose_index_dtype, pack, unpack_rows
from .scipy_routes import (SCIPY_VALUES, as_scipy, compressed_to_coo, coo_tensor_to_compressed,
                           coo_to_compressed, plain_cpu, scipy_takes_arrays,
                           scipy_takes_values, swap_compressed)
from .tensor import SparseTensor, map_arrays
from .validate import (check_blocks, check_coords, check_dtype_argument, check_index_tensor,
                       check_levels, check_same_device, check_shape, check_value_dtype)

_TORCH_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices", (0, 1)),
                     torch.sparse_csc: ("ccol_indices", "row_indices", (1, 0)),
                     torch.sparse_bsr: ("crow_indices", "col_indices", (0, 1)),
                     torch.sparse_bsc: ("ccol_indices", "row_indices", (1, 0))}


def tensor(data, format="csr", *, shape=None, blocksize=None, index_dtype=None,
           dtype=None, device=None) -> SparseTensor:
    """Make a ``SparseTensor`` from dense or sparse data, validating it once.

    ``data`` may be a dense ``torch.Tensor`` or numpy array (zeros are dropped), a
    ``scipy.sparse`` matrix or array, a ``torch.sparse`` tensor (COO, CSR, CSC, BSR, BSC), a
    ``SparseTensor`` (converted), or a COO pair ``(indices [ndim, nnz], values [nnz])`` with
    ``shape=`` (duplicates are summed, order does not matter). ``blocksize`` defaults to the
    input's for ``format="bsr"`` from blocked input. The result never shares memory with
    ``data``.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor((torch.tensor([[0, 1, 0], [2, 0, 2]]), torch.tensor([1., 2., 3.])),
        ...               shape=(2, 3), format="csr")
        >>> A.to_dense()
        tensor([[0., 0., 4.],
                [2., 0., 0.]])
    """
    check_dtype_argument(dtype, "st.tensor")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"st.tensor: device={device!r} is not a device; use e.g. 'cpu' or "
                             "'cuda'") from None
        try:   # (torch's own answer for a device this build or machine lacks: an assert)
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"st.tensor: device={str(device)!r} is not available here ({e})"
                             "; torch.cuda.device_count() says how many GPUs there are") \
                from None
    if shape is not None:
        shape = check_shape(shape, "st.tensor")
    out = _from_any(data, format, shape, blocksize, index_dtype)
    if dtype is not None or device is not None:
        out = map_arrays(out, lambda a: a.to(device=device),
                           lambda v: v.to(device=device, dtype=dtype))
    return out


def _from_any(data, format, shape, blocksize, index_dtype) -> SparseTensor:
    if isinstance(data, tuple) and len(data) == 2:
        return _from_coo_pair(*data, format, shape, blocksize, index_dtype)
    if isinstance(data, SparseTensor):
        _check_shape_kw(data.shape, shape)
        out = convert(data, format, blocksize=blocksize, index_dtype=index_dtype)
        return _copy(out) if out is data else out
    if _is_scipy(data):
        _check_shape_kw(data.shape, shape)
        return _from_scipy(data, format, blocksize, index_dtype)
    if isinstance(data, np.ndarray):
        if data.dtype == np.bool_ or data.dtype.kind not in "fiu":
            raise TypeError(f"st.tensor: numpy arrays of dtype {data.dtype} are not supported; "
                            "pass a float or integer array")
        data = torch.from_numpy(np.require(data, requirements="C"))   # (0-d stays 0-d)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"st.tensor: cannot make a sparse tensor from {type(data).__name__}; "
                        "pass a torch.Tensor, numpy array, scipy.sparse matrix, torch.sparse "
                        "tensor or an (indices, values) pair")
    if data.is_nested:   # (before anything reads its shape: nested tensors have none)
        raise TypeError("st.tensor: data is a nested tensor, whose rows differ in shape; "
                        "convert each of its tensors (data.unbind()), or pad it first "
                        "(data.to_padded_tensor(0))")
    _check_shape_kw(data.shape, shape)
    if data.device.type == "meta":
        raise ValueError("st.tensor: data is a meta tensor, which has no values to store; "
                         "pass a tensor with data (build it on the cpu or a gpu)")
    data = data.detach()
    if data.layout == torch.sparse_coo:
        if data.dense_dim() or data._values().dim() != 1:
            raise ValueError(f"st.tensor: hybrid torch.sparse_coo tensors (values of shape "
                             f"{tuple(data._values().shape)}) are not supported; every entry "
                             "must be a scalar")
        return _from_coo_pair(data._indices(), data._values(), format, tuple(data.shape),
                              blocksize, index_dtype)
    if data.layout in _TORCH_COMPRESSED:
        return _from_torch_compressed(data, format, blocksize, index_dtype)
    return _from_dense(data, format, None, blocksize, index_dtype)


def _check_shape_kw(actual, shape) -> None:
    if shape is not None and tuple(shape) != tuple(actual):
        raise ValueError(f"st.tensor: data has shape {tuple(actual)} but shape={tuple(shape)}; "
                         "drop shape= or make them agree")


def _from_dense(x: torch.Tensor, format, shape=None, blocksize=None,
                index_dtype=None) -> SparseTensor:
    """``x`` (dense) in ``format``, zeros dropped (``shape``, if given, must match)."""
    if shape is not None:
        _check_shape_kw(x.shape, shape)
    check_value_dtype(x, "st.tensor(data)")
    if x.dim() == 0:
        raise ValueError("st.tensor: a 0-d tensor has no sparse structure; pass at least 1-D")
    fmt = as_format(format, x.dim(), blocksize)
    check_blocks(fmt, x.shape, "st.tensor(data)")
    if fmt.is_dense:
        return SparseTensor(x.shape, fmt, {}, _dense_layout(x, fmt))
    if fmt.name in ("csr", "csc") and x.dim() == 2 and x.dtype in SCIPY_VALUES and \
            type(x) is torch.Tensor and not x.requires_grad and plain_cpu(x):
        # scipy's scan (one C pass) instead of nonzero, mask and pack: 2x faster on Cora
        import scipy.sparse as sp

        m = (sp.csr_array if fmt.name == "csr" else sp.csc_array)(x.numpy())
        want = choose_index_dtype(fmt.storage_dims(x.shape), m.nnz, index_dtype)
        return SparseTensor(x.shape, fmt, {"pos1": torch.from_numpy(m.indptr).to(want),
                                           "crd1": torch.from_numpy(m.indices).to(want)},
                            torch.from_numpy(m.data))
    mask = x != 0
    coords = torch.nonzero(mask).T          # row-major: sorted and unique in logical order
    values = x[mask]
    rows = list(coords.to(choose_index_dtype(x.shape, 0)).unbind(0))
    identity = Format((dense,) * x.dim())
    return _pack(fmt, x.shape, rows, values, index_dtype, source=identity)


def _dense_layout(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The values of a dense format: ``x`` laid out in storage order (blocks, mode order)."""
    order = fmt.mode_order
    if fmt.blocksize is None:
        return x.permute(order).reshape(-1).clone()
    split = [s for n, b in zip(x.shape, fmt.blocksize) for s in (n // b, b)]
    perm = [2 * m for m in order] + [2 * m + 1 for m in order]
    return x.reshape(split).permute(perm).reshape(-1).clone()


def _from_dense_layout(values: torch.Tensor, fmt: Format, shape) -> torch.Tensor:
    storage = values.reshape(fmt.storage_dims(shape))
    n = len(shape)
    if fmt.blocksize is None:
        inverse = [fmt.mode_order.index(m) for m in range(n)]
        return storage.permute(inverse).contiguous()
    inverse = [k for m in range(n) for k in (fmt.mode_order.index(m),
                                             n + fmt.mode_order.index(m))]
    return storage.permute(inverse).reshape(tuple(shape)).contiguous()


def _from_coo_pair(indices, values, format, shape, blocksize, index_dtype) -> SparseTensor:
    """COO data: ``indices`` is ``[ndim, nnz]`` (or ``[nnz]`` for 1-D; internally also a list
    of ``ndim`` 1-D tensors), in any order, duplicates summed."""
    name = "st.tensor((indices, values))"
    rows = [torch.as_tensor(r) for r in indices] if isinstance(indices, list) else None
    values = torch.as_tensor(values)
    if rows is None:
        indices = torch.as_tensor(indices)
        check_index_tensor(indices, f"{name}: indices")
        if indices.dim() == 1:
            indices = indices[None]
        if indices.dim() != 2:
            want = "ndim" if shape is None else f"ndim={len(shape)}"
            raise ValueError(f"{name}: indices must have shape [{want}, nnz], got "
                             f"{list(indices.shape)}")
        rows = list(indices.unbind(0))
    for r in rows:
        check_index_tensor(r, f"{name}: indices")
    check_value_dtype(values, name)
    for r in rows[:1]:
        check_same_device(name, values, indices=r)
    if values.dim() != 1:
        raise ValueError(f"{name}: values must be 1-D (one value per entry), got shape "
                         f"{list(values.shape)}")
    nnz = rows[0].numel() if rows else 0
    if values.numel() != nnz:
        raise ValueError(f"{name}: values has shape {list(values.shape)} but indices has "
                         f"{nnz} entries; pass one value per column of indices")
    if shape is None:
        if nnz == 0:
            raise ValueError(f"{name}: shape= is required when there are no entries")
        shape = tuple(int(r.max()) + 1 for r in rows)
    shape = check_shape(shape, name)
    check_coords(rows, shape, name)
    fmt = as_format(format, len(shape), blocksize)
    check_blocks(fmt, shape, name)
    rows = [r if r.dtype in (torch.int32, torch.int64) else r.to(torch.int64) for r in rows]
    routed = coo_to_compressed(fmt, shape, rows, values, index_dtype)
    return routed if routed is not None else _pack(fmt, shape, rows, values, index_dtype)


def _from_torch_compressed(x, format, blocksize, index_dtype) -> SparseTensor:
    pos_name, crd_name, order = _TORCH_COMPRESSED[x.layout]
    vals = x.values()
    blocked = x.layout in (torch.sparse_bsr, torch.sparse_bsc)
    if x.dim() != 2 or vals.dim() != (3 if blocked else 1):
        raise ValueError(f"st.tensor: only 2-D, non-hybrid torch {x.layout} tensors are "
                         f"supported (got shape {tuple(x.shape)}, values "
                         f"{tuple(vals.shape)})")
    arrays = {"pos1": getattr(x, pos_name)(), "crd1": getattr(x, crd_name)()}
    if blocked:
        r, c = vals.shape[1:]
        if order == (1, 0):     # our in-block levels follow the mode order: blocks transposed
            vals = vals.transpose(1, 2)
        fmt = Format((dense, compressed, dense, dense), order, blocksize=(r, c))
        if blocksize is None and _is_bsr_name(format):
            blocksize = (r, c)
        vals = vals.reshape(-1)
    else:
        fmt = Format((dense, compressed), order)
    name = f"st.tensor(a {x.layout} tensor)"
    shape = check_shape(x.shape, name)
    try:
        check_levels(fmt, shape, arrays, vals, name)
    except ValueError:
        if blocked:
            raise
        # torch allows a row's (column's) coordinates in any order and repeated, as scipy
        # does: sorted and summed as scipy's are (after the bounds are shown valid)
        check_levels(fmt, shape, arrays, vals, name, full=False)
        pos, crd = (a.to(torch.int64) for a in arrays.values())
        outer = torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device),
                                        pos.diff())
        coords = [outer, crd] if order == (0, 1) else [crd, outer]
        return _from_coo_pair(coords, vals, format, shape, blocksize, index_dtype)
    return _convert_owned(SparseTensor(shape, fmt, arrays, vals), format, blocksize,
                          index_dtype)


def _from_scipy(m, format, blocksize, index_dtype) -> SparseTensor:
    name = "st.tensor(scipy matrix)"
    if m.format not in ("csr", "csc", "bsr", "coo"):   # dok, lil, dia: no flat value array
        m = m.tocoo()
    data = torch.from_numpy(np.ascontiguousarray(m.data))
    check_value_dtype(data, name)
    kind = m.format
    if kind in ("csr", "csc", "bsr") and m.ndim == 2 and m.has_canonical_format:
        arrays = {"pos1": torch.from_numpy(m.indptr), "crd1": torch.from_numpy(m.indices)}
        if arrays["pos1"].dtype != arrays["crd1"].dtype:
            arrays = {k: a.to(torch.int64) for k, a in arrays.items()}
        if kind == "bsr":
            fmt = as_format("bsr", 2, m.blocksize)
            if blocksize is None and _is_bsr_name(format):
                blocksize = m.blocksize
        else:
            fmt = as_format(kind, 2)
        source = SparseTensor(*SparseTensor._checked_levels(m.shape, fmt, arrays,
                                                            data.reshape(-1)))
        return _convert_owned(source, format, blocksize, index_dtype)
    if kind in ("csr", "csc", "bsr"):
        _check_scipy_compressed(m, name)   # (scipy's tocoo trusts them)
    if kind == "bsr" and blocksize is None and _is_bsr_name(format):
        blocksize = m.blocksize
    coo = m.tocoo() if kind != "coo" else m       # keeps duplicates; _from_coo_pair sums them
    coords = getattr(coo, "coords", None) or (coo.row, coo.col)
    indices = [torch.from_numpy(np.ascontiguousarray(c)) for c in coords]
    return _from_coo_pair(indices, torch.from_numpy(np.ascontiguousarray(coo.data)), format,
                          tuple(m.shape), blocksize, index_dtype)


def _check_scipy_compressed(m, name: str) -> None:
    """Raise unless a scipy CSR/CSC/BSR matrix's ``indptr`` and ``indices`` describe valid
    rows (columns, block rows) of its shape: what a matrix edited in place can break."""
    ptr, idx = np.asarray(m.indptr), np.asarray(m.indices)
    major, minor = m.shape if m.format != "csc" else m.shape[::-1]
    if m.format == "bsr":
        major, minor = major // m.blocksize[0], minor // m.blocksize[1]
    if ptr.ndim != 1 or ptr.size != major + 1:
        raise ValueError(f"{name}: indptr has {ptr.size} entries, a {m.format} matrix of shape "
                         f"{m.shape} needs {major + 1}; rebuild the matrix")
    if ptr[0] != 0 or (ptr.size > 1 and np.any(np.diff(ptr) < 0)) or ptr[-1] > idx.size:
        raise ValueError(f"{name}: indptr must start at 0, never decrease and end at most at "
                         f"len(indices)={idx.size}; got {ptr.tolist()[:10]}... Rebuild the "
                         "matrix (e.g. scipy.sparse.csr_array((data, indices, indptr)))")
    used = idx[:ptr[-1]]
    if used.size and (used.min() < 0 or used.max() >= minor):
        raise ValueError(f"{name}: indices hold {int(used.min())}..{int(used.max())}, outside "
                         f"[0, {minor}); rebuild the matrix")


def _is_bsr_name(format) -> bool:
    return isinstance(format, str) and format.lower() == "bsr"


def _convert_owned(source: SparseTensor, format, blocksize, index_dtype) -> SparseTensor:
    """``convert`` for a source that wraps user memory: the result must own its arrays, and
    gets the default (smallest) index dtype unless one is requested."""
    if index_dtype is None:
        index_dtype = choose_index_dtype(source.format.storage_dims(source.shape), source.nnz)
    out = convert(source, format, blocksize=blocksize, index_dtype=index_dtype)
    return _copy(out) if _shares_memory(out, source) else out


def _shares_memory(a: SparseTensor, b: SparseTensor) -> bool:
    ptrs = {t.untyped_storage().data_ptr() for t in [b.values, *b._level_arrays.values()] if t.numel()}
    return any(t.numel() and t.untyped_storage().data_ptr() in ptrs
               for t in [a.values, *a._level_arrays.values()])


def _is_scipy(x) -> bool:
    try:
        import scipy.sparse as sp
    except ImportError:  # pragma: no cover - scipy is a dependency
        return False
    return sp.issparse(x)


def _pack(fmt, shape, coords, values, index_dtype, source=None) -> SparseTensor:
    arrays, stored = pack(fmt, shape, coords, values, index_dtype, source=source)
    return SparseTensor(shape, fmt, arrays, stored)


def _copy(t: SparseTensor) -> SparseTensor:
    return map_arrays(t, torch.clone, torch.clone)


# -- SparseTensor -> other things ------------------------------------------------------------
def convert(t: SparseTensor, format, *, blocksize=None, index_dtype=None) -> SparseTensor:
    """``t`` in another format (and/or index dtype); returns ``t`` itself when nothing
    changes. ``format="bsr"`` without ``blocksize`` keeps ``t``'s blocksize;
    ``index_dtype=None`` keeps int64 indices int64 and otherwise picks int32 when it fits.

    Example:
        >>> import torch, sparsetorch as st
        >>> convert(st.tensor(torch.eye(2), format="csr"), "csc").format.name
        'csc'
    """
    t._readable_values()
    if blocksize is None and _is_bsr_name(format) and t.format.blocksize is not None:
        blocksize = t.format.blocksize
    fmt = as_format(format, t.dim(), blocksize)
    check_blocks(fmt, t.shape, "asformat")
    if fmt == t.format:
        if index_dtype is None or index_dtype == t.index_dtype or not t._level_arrays:
            return t
        choose_index_dtype(fmt.storage_dims(t.shape), t.nnz, index_dtype)
        return map_arrays(t, lambda a: a.to(index_dtype), lambda v: v)
    if index_dtype is None and t._level_arrays and t.index_dtype == torch.int64:
        index_dtype = torch.int64            # keep the caller's wider indices
    check_fits_memory(fmt, t.shape, t.nnz, t.values.element_size(), "asformat")
    if t.format.is_dense or fmt.is_dense:
        return _from_dense(to_dense(t), fmt, None, None, index_dtype)
    for route in (swap_compressed, compressed_to_coo, coo_tensor_to_compressed):
        routed = route(t, fmt, index_dtype)
        if routed is not None:
            return routed
    rows = unpack_rows(t.format, t.shape, t._level_arrays, t.device)
    ordered = all(lv.ordered for lv in t.format.levels)
    return _pack(fmt, t.shape, rows, t.values, index_dtype,
                 source=t.format if ordered else None)


def to_dense(t: SparseTensor) -> torch.Tensor:
    """The dense ``torch.Tensor`` ``t`` represents (entries are unique: no accumulation).
    CSR and CSC on the CPU are written by scipy's ``toarray`` (one pass over the entries
    into a fresh zeroed array: 1.4-6.7x the scatter below on 84k-470k entries, 0.8-0.9x
    scipy's own call) unless their values record a gradient."""
    t._readable_values()
    fmt = t.format
    if fmt.is_dense:
        return _from_dense_layout(t.values, fmt, t.shape)
    if scipy_takes_arrays(t) and scipy_takes_values(t.values):
        return torch.from_numpy(as_scipy(t, t.values.detach().numpy()).toarray())
    out = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    # a result assembled inside a compiled function has a symbolic entry count (not an int),
    # which the shortcut must not guard on; the general path handles zero entries too
    nnz = t.nnz
    if (out.numel() == 0 or (type(nnz) is int and nnz == 0)) and not (
            t.values.requires_grad and torch.is_grad_enabled()):
        return out   # (recording values: the empty scatter below keeps the graph)
    rows = unpack_rows(fmt, t.shape, t._level_arrays, t.device)
    linear = rows[0].to(torch.int64)
    for row, size in zip(rows[1:], t.shape[1:]):
        linear = linear * size + row
    # (scatter_ over unique positions: a quarter of index_put_'s time on CPU)
    out.view(-1).scatter_(0, linear, t.values)
    return out


def to_scipy(t: SparseTensor):
    """A ``scipy.sparse`` array owning copies of the data: csr, csc and bsr keep their
    format, everything else becomes COO (a dense format drops its zeros)."""
    import scipy.sparse as sp

    if t.dim() != 2:
        raise ValueError(f"to_scipy: scipy.sparse holds 2-D matrices; this tensor is {t.dim()}-D")
    t._readable_values()
    if t.device.type != "cpu":
        raise ValueError(f"to_scipy: tensor is on {t.device}; call .to('cpu') first")
    if t.dtype == torch.bfloat16:
        raise TypeError("to_scipy: numpy has no bfloat16; convert first with "
                        ".to(torch.float32)")
    vals = t.values.detach().numpy().copy()
    name, a = t.format.name, {k: v.numpy().copy() for k, v in t._level_arrays.items()}
    if name in ("csr", "csc"):
        cls = sp.csr_array if name == "csr" else sp.csc_array
        return cls((vals, a["crd1"], a["pos1"]), shape=t.shape)
    if name == "bsr":
        r, c = t.format.blocksize
        return sp.bsr_array((vals.reshape(-1, r, c), a["crd1"], a["pos1"]), shape=t.shape)
    if t.format.is_dense:
        return sp.coo_array(to_dense(t).numpy())
    rows = unpack_rows(t.format, t.shape, t._level_arrays, t.device)
    return sp.coo_array((vals, (rows[0].numpy(), rows[1].numpy())), shape=t.shape)


def to_torch(t: SparseTensor) -> torch.Tensor:
    """A ``torch.sparse`` tensor sharing ``t``'s values where layouts allow: csr, csc and bsr
    map to their layouts (with copies of the index arrays, which kernels trust and the
    caller could write through ``crow_indices()``), dense formats to a strided tensor,
    everything else to a coalesced ``sparse_coo`` tensor (int64 indices, as torch
    requires)."""
    name, vals = t.format.name, t._readable_values()
    if t.format.is_dense:
        return to_dense(t)
    with warnings.catch_warnings():  # "... support is in beta": nothing a user can act on
        warnings.filterwarnings("ignore", message=".*is in beta", category=UserWarning)
        a = t.arrays if name in ("csr", "csc", "bsr") else None   # (copies)
        if name in ("csr", "csc"):
            make = torch.sparse_csr_tensor if name == "csr" else torch.sparse_csc_tensor
            return make(a["pos1"], a["crd1"], vals, t.shape, check_invariants=False)
        if name == "bsr":
            r, c = t.format.blocksize
            return torch.sparse_bsr_tensor(a["pos1"], a["crd1"], vals.reshape(-1, r, c),
                                           t.shape, check_invariants=False)
    coo = t if t.format == as_format("coo", t.dim()) else convert(t, "coo")
    rows = unpack_rows(coo.format, coo.shape, coo._level_arrays, coo.device)
    indices = torch.stack([r.to(torch.int64) for r in rows])
    return torch.sparse_coo_tensor(indices, coo.values, t.shape, is_coalesced=True,
                                   check_invariants=False)
