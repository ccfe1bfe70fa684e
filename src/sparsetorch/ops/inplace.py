"""In-place updates of a SparseTensor's stored values: what ``load_state_dict`` and
optimizers do to a buffer or a parameter.

Each op keeps the pattern. Its tensor operands are SparseTensors of the same pattern (a
loaded copy, a gradient, a momentum buffer: same format, shape and level arrays, shared or
equal) and its numbers scale (``mul_``, ``div_``, ``lerp_``'s weight), so the op runs on the
values tensor in place and the SparseTensor is returned. Adding a number (``add_(eps)``, as
Adam does to its denominator) would make every implicit zero nonzero: it raises, naming
the fix (give the optimizer ``W.values``; any optimizer then works). Another pattern raises
too: ``load_state_dict(..., assign=True)`` takes the loaded tensor as it is.
"""
from __future__ import annotations

import numbers

import torch

from ..autograd.pattern import _same_storage
from ..formats.tensor import SparseTensor


def same_pattern(a: SparseTensor, b) -> bool:
    """Whether ``b`` is a SparseTensor storing exactly ``a``'s entries (format, shape and
    level arrays the same objects, or equal).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(3), "csr")
        >>> same_pattern(A, A.with_values(A.values * 2)), same_pattern(A, A.clone())
        (True, True)
        >>> same_pattern(A, st.tensor(torch.ones(3, 3), "csr"))
        False
    """
    if not isinstance(b, SparseTensor) or a._size != b._size:
        return False
    if _same_storage(a, b):   # shared arrays (a gradient, with_values)
        return True
    # equal ones (a clone, a loaded copy), of either index width: the values line up
    return a._format == b._format and all(
        x.shape == y.shape and torch.equal(x, y if y.dtype == x.dtype else y.to(x.dtype))
        for x, y in zip(a._level_arrays.values(), b._level_arrays.values()))


def _values(t: SparseTensor, x, op: str, scale: bool = False):
    """What ``x`` contributes to ``t.values``: the values of a same-pattern SparseTensor, or
    (``scale``) a number or 0-d tensor."""
    if isinstance(x, SparseTensor):
        if same_pattern(t, x):
            return x._values
        raise ValueError(
            f"SparseTensor.{op}: the other operand stores another pattern ({x.format.name}, "
            f"{x.nnz} entries, shape {tuple(x.shape)}) than this one ({t.format.name}, {t.nnz} "
            f"entries, shape {tuple(t.shape)}); an in-place update keeps the stored pattern: "
            f"use the out-of-place op, or give the tensor with_values of the new values")
    if scale and (isinstance(x, numbers.Number) or
                  (isinstance(x, torch.Tensor) and x.dim() == 0)):
        return x
    if isinstance(x, numbers.Number):
        raise NotImplementedError(
            f"SparseTensor.{op}({x!r}) would make every implicit zero nonzero, so it is not "
            f"done in place; W.values.{op}({x!r}) updates the stored entries only. For "
            "torch.optim, pass W.values (any optimizer works on it; Adam, for one, adds eps "
            "to its denominator in place)")
    shape = f" of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else ""
    raise TypeError(f"SparseTensor.{op}: the other operand must be a SparseTensor of the same "
                    f"pattern{' or a number' if scale else ''}, got {type(x).__name__}{shape}")


def copy_(t: SparseTensor, src, non_blocking: bool = False) -> SparseTensor:
    """``t.copy_(src)`` from a SparseTensor of the same pattern: what ``load_state_dict``
    does to a SparseTensor buffer or parameter.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(2), "csr")
        >>> A.copy_(A.clone() * 3).values
        tensor([3., 3.])
    """
    if isinstance(src, SparseTensor) and not same_pattern(t, src):
        raise ValueError(
            f"SparseTensor.copy_: the source stores another pattern ({src.format.name}, "
            f"{src.nnz} entries) than this tensor ({t.format.name}, {t.nnz} entries); to load "
            "a state dict whose patterns changed (pruning, RigL), call "
            "module.load_state_dict(state, assign=True) or assign the loaded SparseTensor")
    t._values.copy_(_values(t, src, "copy_"), non_blocking=non_blocking)
    return t


def add_(t, other, *, alpha=1):
    if _is_zero(other):   # (refused as if it filled the implicit zeros, a probe found)
        return t
    t._values.add_(_values(t, other, "add_"), alpha=alpha)
    return t


def sub_(t, other, *, alpha=1):
    if _is_zero(other):
        return t
    t._values.sub_(_values(t, other, "sub_"), alpha=alpha)
    return t


def _is_zero(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool) and x == 0


def mul_(t, other):
    t._values.mul_(_values(t, other, "mul_", scale=True))
    return t


def div_(t, other, *, rounding_mode=None):
    t._values.div_(_values(t, other, "div_", scale=True), rounding_mode=rounding_mode)
    return t


def addcmul_(t, tensor1, tensor2, *, value=1):
    t._values.addcmul_(_values(t, tensor1, "addcmul_"), _values(t, tensor2, "addcmul_"),
                       value=value)
    return t


def addcdiv_(t, tensor1, tensor2, *, value=1):
    t._values.addcdiv_(_values(t, tensor1, "addcdiv_"), _values(t, tensor2, "addcdiv_"),
                       value=value)
    return t


def lerp_(t, end, weight):
    t._values.lerp_(_values(t, end, "lerp_"), _values(t, weight, "lerp_", scale=True))
    return t


def zero_(t):
    t._values.zero_()
    return t


def zeros_like(t, *, dtype=None, layout=None, device=None, requires_grad=False,
               memory_format=None, pin_memory=None):
    """Zeros on ``t``'s pattern (the optimizers' state buffers); ``dtype``/``device`` as
    ``torch.zeros_like``."""
    if layout not in (None, torch.strided):
        raise NotImplementedError(f"zeros_like of a SparseTensor with layout={layout}")
    out = t.with_values(torch.zeros_like(t._values.detach(), dtype=dtype))
    out = out if device is None else out.to(device)   # (arrays and values move together)
    return out.requires_grad_() if requires_grad else out


def share_memory_(t: SparseTensor) -> SparseTensor:
    """Move ``t``'s level arrays and values to shared memory (``torch.multiprocessing``
    then passes them between processes without copies): torch's own method, on a wrapper
    that has no storage, crashed the interpreter."""
    for a in _parts(t):
        a.share_memory_()
    return t


def _parts(t: SparseTensor) -> list:
    return [*t._level_arrays.values(), t._values]


def _also_on_dense(op, handler):
    """``handler`` for a SparseTensor's own in-place op; on a dense tensor with a
    SparseTensor operand (``x.add_(A)``, ``x += A``), the dense op on ``A.to_dense()``, as
    torch computes it (it failed inside the handler, which took ``x`` for the sparse one)."""
    def run(t, *args, **kwargs):
        if type(t) is SparseTensor:
            return handler(t, *args, **kwargs)
        args = [a.to_dense() if isinstance(a, SparseTensor) else a for a in args]
        kwargs = {k: v.to_dense() if isinstance(v, SparseTensor) else v
                  for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            return op(t, *args, **kwargs)
    return run


TABLE = {op: _also_on_dense(op, handler) for op, handler in {
    torch.Tensor.copy_: copy_, torch.Tensor.add_: add_, torch.Tensor.sub_: sub_,
    torch.Tensor.mul_: mul_, torch.Tensor.div_: div_, torch.Tensor.addcmul_: addcmul_,
    torch.Tensor.addcdiv_: addcdiv_, torch.Tensor.lerp_: lerp_}.items()}
TABLE |= {
    torch.Tensor.zero_: zero_,
    torch.Tensor.share_memory_: share_memory_,
    torch.Tensor.is_shared: lambda t: all(a.is_shared() for a in _parts(t)),
    torch.zeros_like: zeros_like,
    # formats never hold duplicates: coalesced by construction
    torch.Tensor.coalesce: lambda t: t, torch.Tensor.is_coalesced: lambda t: True,
}
