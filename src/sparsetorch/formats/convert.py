"""Conversions: ``st.tensor`` from anything, and SparseTensor to dense, scipy and torch.sparse.

Every route goes through coordinates (``pack``/``unpack``) or maps level arrays directly
where the layouts coincide (CSR <-> scipy/torch CSR needs no sort).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .format import Format, as_format
from .pack import choose_index_dtype, pack, unpack
from .tensor import SparseTensor
from .validate import (check_coords, check_index_tensor, check_same_device, check_value_dtype)

_TORCH_COMPRESSED = {torch.sparse_csr: ("csr", "crow_indices", "col_indices"),
                     torch.sparse_csc: ("csc", "ccol_indices", "row_indices"),
                     torch.sparse_bsr: ("bsr", "crow_indices", "col_indices"),
                     torch.sparse_bsc: ("bsc", "ccol_indices", "row_indices")}


def tensor(data, format="csr", *, shape=None, blocksize=None, index_dtype=None,
           dtype=None, device=None) -> SparseTensor:
    """Make a ``SparseTensor`` from dense or sparse data, validating it once.

    ``data`` may be a dense ``torch.Tensor`` or numpy array (zeros are dropped), a
    ``scipy.sparse`` matrix or array, a ``torch.sparse`` tensor (COO, CSR, CSC, BSR, BSC), a
    ``SparseTensor`` (converted), or a COO pair ``(indices [ndim, nnz], values [nnz])`` with
    ``shape=`` (duplicates are summed, order does not matter).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor((torch.tensor([[0, 1, 0], [2, 0, 2]]), torch.tensor([1., 2., 3.])),
        ...               shape=(2, 3), format="csr")
        >>> A.to_dense()
        tensor([[0., 0., 4.],
                [2., 0., 0.]])
    """
    out = _from_any(data, format, shape, blocksize, index_dtype)
    if dtype is not None or device is not None:
        out = _with_arrays(out, lambda a: a.to(device=device),
                           lambda v: v.to(device=device, dtype=dtype))
    return out


def _from_any(data, format, shape, blocksize, index_dtype) -> SparseTensor:
    if isinstance(data, SparseTensor):
        return convert(data, format, blocksize=blocksize, index_dtype=index_dtype)
    if isinstance(data, tuple) and len(data) == 2:
        return _from_coo_pair(*data, format, shape, blocksize, index_dtype)
    if _is_scipy(data):
        return _from_scipy(data, format, blocksize, index_dtype)
    if isinstance(data, np.ndarray):
        if data.dtype == np.bool_ or data.dtype.kind not in "fiu":
            raise TypeError(f"st.tensor: numpy arrays of dtype {data.dtype} are not supported; "
                            "pass a float or integer array")
        data = torch.from_numpy(np.ascontiguousarray(data))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"st.tensor: cannot make a sparse tensor from {type(data).__name__}; "
                        "pass a torch.Tensor, numpy array, scipy.sparse matrix, torch.sparse "
                        "tensor or an (indices, values) pair")
    if data.layout == torch.sparse_coo:
        data = data.detach()
        return _from_coo_pair(data._indices(), data._values(), format, tuple(data.shape),
                              blocksize, index_dtype)
    if data.layout in _TORCH_COMPRESSED:
        return _from_torch_compressed(data.detach(), format, blocksize, index_dtype)
    return _from_dense(data.detach(), format, shape, blocksize, index_dtype)


def _from_dense(x: torch.Tensor, format, shape, blocksize, index_dtype) -> SparseTensor:
    check_value_dtype(x, "st.tensor(data)")
    if shape is not None and tuple(shape) != tuple(x.shape):
        raise ValueError(f"st.tensor: data has shape {tuple(x.shape)} but shape={tuple(shape)}")
    if x.dim() == 0:
        raise ValueError("st.tensor: a 0-d tensor has no sparse structure; pass at least 1-D")
    fmt = as_format(format, x.dim(), blocksize)
    _check_blocks(fmt, x.shape, "st.tensor(data)")
    if fmt.is_dense:  # storage order is a permutation of the modes: no coordinates needed
        values = x.permute(fmt.mode_order).reshape(-1).clone()
        return SparseTensor(x.shape, fmt, {}, values)
    coords = torch.nonzero(x).T
    return _pack(fmt, x.shape, coords, x[tuple(coords)], index_dtype, False)


def _from_coo_pair(indices, values, format, shape, blocksize, index_dtype) -> SparseTensor:
    name = "st.tensor((indices, values))"
    indices = torch.as_tensor(indices)
    values = torch.as_tensor(values)
    check_index_tensor(indices, f"{name}: indices")
    check_value_dtype(values, name)
    check_same_device(name, values, indices=indices)
    if indices.dim() == 1:
        indices = indices[None]
    if values.dim() != 1 or values.numel() != indices.shape[-1]:
        raise ValueError(f"{name}: values has shape {list(values.shape)} but indices has "
                         f"{indices.shape[-1]} entries; pass one value per column of indices")
    if shape is None:
        if indices.numel() == 0:
            raise ValueError(f"{name}: shape= is required when there are no entries")
        shape = tuple(int(m) + 1 for m in indices.max(1).values)
    shape = tuple(int(s) for s in shape)
    check_coords(indices.to(torch.int64), shape, name)
    fmt = as_format(format, len(shape), blocksize)
    _check_blocks(fmt, shape, name)
    return _pack(fmt, shape, indices.to(torch.int64), values, index_dtype, False)


def _from_torch_compressed(x, format, blocksize, index_dtype) -> SparseTensor:
    kind, pos_name, crd_name = _TORCH_COMPRESSED[x.layout]
    if x.dim() != 2 or x.values().dim() not in (1, 3):
        raise ValueError(f"st.tensor: only 2-D, non-hybrid torch {x.layout} tensors are "
                         f"supported (got shape {tuple(x.shape)}, values "
                         f"{tuple(x.values().shape)})")
    pos, crd, vals = getattr(x, pos_name)(), getattr(x, crd_name)(), x.values()
    if kind in ("csr", "csc"):
        source = SparseTensor.from_levels(x.shape, kind, {"pos1": pos, "crd1": crd}, vals)
    else:
        r, c = vals.shape[1:]
        if kind == "bsc":  # blocks stored column-major over blocks: go through coordinates
            coo = x.to_sparse_coo().coalesce()
            return _from_coo_pair(coo.indices(), coo.values(), format, tuple(x.shape),
                                  blocksize, index_dtype)
        source = SparseTensor.from_levels(x.shape, "bsr", {"pos1": pos, "crd1": crd},
                                          vals.reshape(-1), blocksize=(r, c))
    return convert(source, format, blocksize=blocksize, index_dtype=index_dtype)


def _from_scipy(m, format, blocksize, index_dtype) -> SparseTensor:
    import scipy.sparse as sp

    name = "st.tensor(scipy matrix)"
    if m.ndim != 2:
        raise ValueError(f"{name}: only 2-D scipy sparse matrices are supported")
    data = torch.from_numpy(np.ascontiguousarray(m.data))
    check_value_dtype(data, name)
    if m.format in ("csr", "csc") and m.has_canonical_format:
        arrays = {"pos1": torch.from_numpy(m.indptr.copy()),
                  "crd1": torch.from_numpy(m.indices.copy())}
        source = SparseTensor.from_levels(m.shape, m.format, arrays, data.clone())
        return convert(source, format, blocksize=blocksize, index_dtype=index_dtype)
    coo = sp.coo_matrix(m)  # keeps duplicates; _from_coo_pair sums them
    indices = torch.from_numpy(np.stack([coo.row, coo.col]).astype(np.int64))
    return _from_coo_pair(indices, torch.from_numpy(coo.data.copy()), format, m.shape,
                          blocksize, index_dtype)


def _is_scipy(x) -> bool:
    try:
        import scipy.sparse as sp
    except ImportError:  # pragma: no cover - scipy is a dependency
        return False
    return sp.issparse(x)


def _check_blocks(fmt: Format, shape, name) -> None:
    if fmt.blocksize is None:
        return
    for m, (n, b) in enumerate(zip(shape, fmt.blocksize)):
        if n % b:
            raise ValueError(f"{name}: dimension {m} of size {n} is not divisible by the block "
                             f"size {b}; pad the tensor or pick a block size that divides it")


def _pack(fmt, shape, coords, values, index_dtype, sorted_unique) -> SparseTensor:
    arrays, stored = pack(fmt, shape, coords, values, index_dtype, sorted_unique)
    return SparseTensor(shape, fmt, arrays, stored)


def _with_arrays(t: SparseTensor, on_index, on_values) -> SparseTensor:
    arrays = {k: on_index(v) for k, v in t.arrays.items()}
    return SparseTensor(t.shape, t.format, arrays, on_values(t.values))


# -- SparseTensor -> other things ------------------------------------------------------------
def convert(t: SparseTensor, format, *, blocksize=None, index_dtype=None) -> SparseTensor:
    """``t`` in another format (and/or index dtype); returns ``t`` itself when nothing
    changes."""
    if blocksize is None and format == "bsr" and t.format.blocksize is not None:
        blocksize = t.format.blocksize
    fmt = as_format(format, t.dim(), blocksize)
    _check_blocks(fmt, t.shape, "asformat")
    if fmt == t.format:
        if index_dtype is None or index_dtype == t.index_dtype:
            return t
        choose_index_dtype(fmt.storage_dims(t.shape), t.nnz, index_dtype)
        return _with_arrays(t, lambda a: a.to(index_dtype), lambda v: v)
    if fmt.is_dense:
        return _from_dense(to_dense(t), fmt, None, None, None)
    coords, values = unpack(t.format, t.shape, t.arrays, t.values)
    same_order = (fmt.mode_order == t.format.mode_order and fmt.blocksize == t.format.blocksize
                  and all(lv.ordered for lv in t.format.levels))
    return _pack(fmt, t.shape, coords, values, index_dtype, same_order)


def to_dense(t: SparseTensor) -> torch.Tensor:
    fmt = t.format
    if fmt.is_dense:
        storage = t.values.reshape(fmt.storage_dims(t.shape))
        inverse = [fmt.mode_order.index(m) for m in range(t.dim())]
        return storage.permute(inverse).contiguous()
    out = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    coords, values = unpack(fmt, t.shape, t.arrays, t.values)
    out.index_put_(tuple(coords), values, accumulate=True)
    return out


def to_scipy(t: SparseTensor):
    import scipy.sparse as sp

    if t.dim() != 2:
        raise ValueError(f"to_scipy: scipy.sparse holds 2-D matrices; this tensor is {t.dim()}-D")
    if t.device.type != "cpu":
        raise ValueError(f"to_scipy: tensor is on {t.device}; call .to('cpu') first")
    vals = t.values.detach().numpy()
    name = t.format.name
    if name in ("csr", "csc"):
        cls = sp.csr_array if name == "csr" else sp.csc_array
        return cls((vals, t.arrays["crd1"].numpy(), t.arrays["pos1"].numpy()), shape=t.shape)
    if name == "bsr":
        r, c = t.format.blocksize
        return sp.bsr_array((vals.reshape(-1, r, c), t.arrays["crd1"].numpy(),
                             t.arrays["pos1"].numpy()), shape=t.shape)
    coords, values = unpack(t.format, t.shape, t.arrays, t.values.detach())
    return sp.coo_array((values.numpy(), (coords[0].numpy(), coords[1].numpy())),
                        shape=t.shape)


def to_torch(t: SparseTensor) -> torch.Tensor:
    name, a, vals = t.format.name, t.arrays, t.values
    if name == "dense":
        return to_dense(t)
    if name == "csr":
        return torch.sparse_csr_tensor(a["pos1"], a["crd1"], vals, t.shape,
                                       check_invariants=False)
    if name == "csc":
        return torch.sparse_csc_tensor(a["pos1"], a["crd1"], vals, t.shape,
                                       check_invariants=False)
    if name == "bsr":
        r, c = t.format.blocksize
        with warnings.catch_warnings():  # "BSR support is in beta": nothing a user can act on
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_bsr_tensor(a["pos1"], a["crd1"], vals.reshape(-1, r, c),
                                           t.shape, check_invariants=False)
    coords, values = unpack(t.format, t.shape, a, vals)
    order = list(range(t.dim()))
    if t.format.mode_order != tuple(order) or not all(lv.ordered for lv in t.format.levels):
        return torch.sparse_coo_tensor(coords, values, t.shape).coalesce()
    return torch.sparse_coo_tensor(coords, values, t.shape, is_coalesced=True)
