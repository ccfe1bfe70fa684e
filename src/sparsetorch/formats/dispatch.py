"""ATen-level dispatch for SparseTensor: the few structural ops that act on every level
array alike. Anything else raises ``NotImplementedError`` naming the op and the format, so a
sparse tensor is never silently densified.
"""
from __future__ import annotations

import torch

from .tensor import map_arrays

aten = torch.ops.aten


def _to_copy(t, dtype=None, device=None, **ignored):
    from .validate import check_dtype_argument

    check_dtype_argument(dtype, f"SparseTensor.to (format {t.format.name})")
    return map_arrays(t, lambda a: a.to(device=device) if device is not None else a.clone(),
                lambda v: aten._to_copy(v, dtype=dtype, device=device))


_STRUCTURAL = {
    aten.detach.default: lambda t: map_arrays(t, lambda a: a, aten.detach),
    aten.alias.default: lambda t: map_arrays(t, lambda a: a, aten.alias),
    aten.clone.default: lambda t, **kw: map_arrays(t, torch.clone, torch.clone),
    aten._to_copy.default: _to_copy,
}


def dispatch(func, args, kwargs):
    handler = _STRUCTURAL.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    from .tensor import SparseTensor

    fmts = sorted({a.format.name for a in args if isinstance(a, SparseTensor)})
    raise NotImplementedError(
        f"sparsetorch: {func} is not supported on SparseTensor (format {', '.join(fmts)}); "
        "convert explicitly with .to_dense() if a dense result is what you want")
