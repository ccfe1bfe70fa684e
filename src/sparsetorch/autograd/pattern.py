"""Values of a gradient placed on a sparse operand's own pattern.

The gradient of a sparse operand is computed as an expression *sampled* on that operand's
pattern (multiplied by a ones-valued copy of it). The compiler writes such a result straight
into the operand's positions when it is the only sparse operand (SDDMM); with other sparse
operands (SpGEMM, sparse ``+``) it lists a subset of those positions, which are matched back
here by coordinate. Either way the result is one value per stored entry: memory grows with
nnz, never with the full shape.
"""
from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._modes import version
from ..formats.pack import unpack
from ..formats.tensor import SparseTensor
from ..ops.custom_ops import is_tracing


def ones_pattern(t: SparseTensor) -> SparseTensor:
    """``t``'s pattern (arrays shared) with every stored value 1: a sampling mask. Kept
    with ``t`` (it depends on the pattern only), so the SDDMM of every backward through
    ``t``, or of ``sampled_addmm`` on it, meets the same mask with its call signature known
    (a new mask each call cost ``sampled_addmm`` 3-5x ``st.einsum``'s SDDMM). The ones
    themselves are kept with the pattern's arrays, for every tensor on them: a softmax's
    output is a new tensor every step on the mask's arrays (at L = 4096, filling its 4.2M
    ones took ~1.5% of a training step).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> ones_pattern(A).values.tolist(), ones_pattern(A) is ones_pattern(A)
        ([1.0, 1.0], True)
        >>> ones_pattern(A.with_values(A.values * 2)).values is ones_pattern(A).values
        True
    """
    found = t.__dict__.get("_ones")   # (``with_values`` copies it: ``PATTERN_FACTS``)
    if found is None or version(found._values) != 0:
        if is_tracing((t,)):
            return t.with_values(torch.ones(t.nnz, dtype=t.dtype, device=t.device))
        found = t.with_values(_ones_of(t))
        t.__dict__["_ones"] = found
    return found


_ONES = WeakIdKeyDictionary()   # a pattern's first level array -> [ones kept for it]


def _ones_of(t: SparseTensor) -> torch.Tensor:
    """The ones kept with ``t``'s first level array (which fixes the entry count) in
    ``t``'s dtype and device, made once; made anew if someone wrote into them."""
    arrays = t._level_arrays
    anchor = next(iter(arrays.values()), None)
    kept = _ONES.get(anchor) if type(anchor) is torch.Tensor else None
    for ones in kept or ():
        if (ones.numel() == t.nnz and ones.dtype == t.dtype and ones.device == t.device
                and version(ones) == 0):
            return ones
    ones = torch.ones(t.nnz, dtype=t.dtype, device=t.device)
    if type(anchor) is torch.Tensor:
        _ONES.setdefault(anchor, []).append(ones)
        del _ONES[anchor][:-4]   # (a few dtypes or devices at most)
    return ones


def _same_storage(a: SparseTensor, b: SparseTensor) -> bool:
    if a.format != b.format:
        return False
    xa, xb = a._level_arrays, b._level_arrays
    if all(xa[k] is xb[k] for k in xa):   # shared arrays (also the only test while tracing:
        return True                       # fake arrays have no data, sizes may be symbolic)
    if is_tracing((a, b)) or a.nnz != b.nnz:
        return False
    return all(xa[k].data_ptr() == xb[k].data_ptr() and xa[k].numel() == xb[k].numel()
               for k in xa)


def _linear_keys(t: SparseTensor) -> torch.Tensor:
    """Row-major linear index of every stored entry (int64), in storage order."""
    if math.prod(t.shape) >= 2 ** 62:
        raise NotImplementedError(
            f"gradient of a sparse operand of shape {tuple(t.shape)}: its linear index does "
            "not fit in int64; split the tensor into smaller blocks")
    coords, _ = unpack(t.format, t.shape, t._level_arrays, t.values)
    key = torch.zeros(coords.shape[1], dtype=torch.int64, device=coords.device)
    for d, size in enumerate(t.shape):
        key = key * int(size) + coords[d]
    return key


def values_on_pattern(pattern: SparseTensor, result) -> torch.Tensor:
    """``result`` (a SparseTensor storing a subset of ``pattern``'s entries, or a dense tensor)
    as one value per entry of ``pattern``, in ``pattern``'s storage order; differentiable.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> values_on_pattern(A, torch.tensor([[9., 8.], [7., 6.]])).tolist()
        [8.0, 7.0]
    """
    if not isinstance(result, SparseTensor):
        coords, _ = unpack(pattern.format, pattern.shape, pattern._level_arrays, pattern.values)
        return result[tuple(coords)]
    if _same_storage(pattern, result):
        return result.values
    out = torch.zeros(pattern.nnz, dtype=result.dtype, device=result.device)
    # While tracing the result's entry count is symbolic and its entries are not known:
    # skip the shortcut and the check (both read data), the general path covers them.
    tracing = is_tracing((pattern, result))
    if not tracing and result.nnz == 0:
        return out
    keys = _linear_keys(pattern)
    wanted = _linear_keys(result)
    order = torch.argsort(keys)
    sorted_keys = keys[order]
    at = torch.searchsorted(sorted_keys, wanted).clamp_max(max(keys.numel() - 1, 0))
    if tracing:
        return out.index_add(0, order[at], result.values)
    if keys.numel() == 0 or not bool((sorted_keys[at] == wanted).all()):
        raise RuntimeError("sparsetorch internal error: a sampled gradient stores entries "
                           "outside its operand's pattern")
    return out.index_add(0, order[at], result.values)
