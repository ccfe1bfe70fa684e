"""ATen-level dispatch for SparseTensor: the few structural ops that act on every level
array alike, and the sum autograd uses to accumulate gradients on one pattern. Anything else
raises ``NotImplementedError`` naming the op and the format, so a sparse tensor is never
silently densified.
"""
from __future__ import annotations

import torch

from .tensor import UnsupportedOp, map_arrays

aten = torch.ops.aten


def _to_copy(t, dtype=None, device=None, **ignored):
    from .validate import check_dtype_argument

    check_dtype_argument(dtype, f"SparseTensor.to (format {t.format.name})")
    return map_arrays(t, lambda a: a.to(device=device) if device is not None else a.clone(),
                lambda v: aten._to_copy(v, dtype=dtype, device=device))


def _add_same_pattern(a, b, alpha=1):
    """``a + alpha * b`` for two SparseTensors sharing their level arrays: what autograd runs
    to sum the gradients of a SparseTensor used twice (each gradient is on its pattern)."""
    from .tensor import SparseTensor

    if (isinstance(a, SparseTensor) and isinstance(b, SparseTensor) and a.format == b.format
            and all(x is y for x, y in zip(a._level_arrays.values(), b._level_arrays.values()))):
        return a.with_values(aten.add(a._values, b._values, alpha=alpha))
    return None


_STRUCTURAL = {
    aten.detach.default: lambda t: map_arrays(t, lambda a: a, aten.detach),
    aten.alias.default: lambda t: map_arrays(t, lambda a: a, aten.alias),
    aten.clone.default: lambda t, **kw: map_arrays(t, torch.clone, torch.clone),
    aten._to_copy.default: _to_copy,
    aten.add.Tensor: _add_same_pattern,
}


def dispatch(func, args, kwargs):
    handler = _STRUCTURAL.get(func)
    if handler is not None:
        out = handler(*args, **kwargs)
        if out is not None:
            # autograd (above this level) records ATen ops on the wrapper itself, e.g. the
            # history torch.compile fakes onto an input that is not a leaf
            out._wrapper_grad = True
            return out
    from .tensor import SparseTensor

    # Operands may sit in lists (torch.cat) or keyword arguments.
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    fmts = sorted({a.format.name for a in leaves if isinstance(a, SparseTensor)})
    raise UnsupportedOp(func, fmts)

