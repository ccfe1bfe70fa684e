"""How torch's own API reaches sparsetorch: the ``__torch_function__`` table of
``SparseTensor`` and its Python operators.

Every entry routes to an einsum, an expression or a free view, so the result is computed by
a compiled kernel and is differentiable. A torch function not listed falls through to
``__torch_dispatch__``, which raises ``NotImplementedError`` naming the op and the format:
nothing is silently densified.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..formats import views
from ..formats.tensor import _TORCH_FUNCTIONS, SparseTensor, map_arrays
from ..formats.wrapper_grad import wrapper_requires_grad
from . import elementwise as ew
from . import inplace
from . import matmul as mm_
from . import reduce as red
from .einsum import torch_einsum
from .softmax import softmax

Tensor = torch.Tensor


def _to(t: SparseTensor, *args, **kwargs) -> SparseTensor:
    """``.to(dtype)`` / ``.to(device)`` / ``.to(other)``: values converted differentiably,
    level arrays moved with them."""
    copy = kwargs.pop("copy", False)   # (torch's parser takes no copy=)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    from ..formats.validate import check_dtype_argument

    check_dtype_argument(dtype, f"SparseTensor.to (format {t.format.name})")
    if (dtype is None or dtype == t.dtype) and (device is None or device == t.device):
        return _clone(t) if copy else t
    return map_arrays(t, lambda a: a.to(device=device, non_blocking=non_blocking)
                      if device is not None else a,
                      lambda v: v.to(device=device, dtype=dtype, non_blocking=non_blocking))


def _clone(t, *, memory_format=None):
    return map_arrays(t, torch.clone, torch.clone)


def _detach(t):
    return map_arrays(t, lambda a: a, lambda v: v.detach())


def _permute(t, *dims):
    return views.permute(t, dims[0] if len(dims) == 1 and not isinstance(dims[0], int)
                         else dims)


def _sparse_softmax(input, dim, dtype=None):
    return softmax(input, dim, dtype)


def _dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` on the stored values (the pattern is kept; a dropped entry stores 0):
    Kipf's GCN drops its sparse input features this way."""
    if inplace:
        raise NotImplementedError("F.dropout(inplace=True) on a SparseTensor is not "
                                  "supported; use inplace=False (the pattern is kept)")
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    # (in evaluation the tensor itself, as torch returns a dense one: no new wrapper, and
    # what kernels learnt about its pattern stays with it)
    return input.with_values(F.dropout(input.values, p, training)) if training and p else input


_GRAD = inspect.signature(torch.autograd.grad)


def _autograd_grad(*args, **kwargs):
    """``torch.autograd.grad`` with SparseTensors among its tensors. A SparseTensor input is
    asked for through its values (what eager ops differentiate: the wrapper alone was "not
    used in the graph") and through the wrapper itself where it is a leaf that requires grad
    (what a ``torch.compile``d graph takes), the two summed; its gradient comes back as a
    SparseTensor on its pattern. SparseTensor outputs and output gradients are their
    values."""
    if torch.compiler.is_compiling():   # (AOTAutograd tracing a graph's backward: as is)
        with torch._C.DisableTorchFunctionSubclass():
            return torch.autograd.grad(*args, **kwargs)
    bound = _GRAD.bind(*args, **kwargs)
    arg = bound.arguments

    def seq(x):
        return (x,) if isinstance(x, torch.Tensor) else tuple(x)

    def values(t):
        return t._values if isinstance(t, SparseTensor) else t

    arg["outputs"] = [values(t) for t in seq(arg["outputs"])]
    if arg.get("grad_outputs") is not None:
        arg["grad_outputs"] = [values(t) for t in seq(arg["grad_outputs"])]
    inputs, asked, places = seq(arg["inputs"]), [], []
    for t in inputs:
        places.append(len(asked))
        asked.append(values(t))
        if isinstance(t, SparseTensor) and _leaf_wrapper(t):
            asked.append(t)
    allow_unused, materialize = arg.get("allow_unused"), arg.get("materialize_grads")
    arg["inputs"], arg["allow_unused"] = asked, True
    if materialize:   # (zeros made here: of the values' shape, not the wrapper's)
        arg["materialize_grads"] = False
    with torch._C.DisableTorchFunctionSubclass():   # (the wrappers: plain tensors to it)
        grads = torch.autograd.grad(*bound.args, **bound.kwargs)
    out = []
    for t, at in zip(inputs, places):
        g = grads[at]
        if isinstance(t, SparseTensor):
            if _leaf_wrapper(t) and grads[at + 1] is not None:
                w = values(grads[at + 1])
                g = w if g is None else g + w
        if g is None and materialize:
            g = torch.zeros_like(values(t))
        if g is None and not allow_unused:
            raise RuntimeError("One of the differentiated Tensors appears to not have been "
                               "used in the graph. Set allow_unused=True if this is the "
                               "desired behavior.")
        out.append(t.with_values(g) if isinstance(t, SparseTensor) and g is not None else g)
    return tuple(out)


def _leaf_wrapper(t: SparseTensor) -> bool:
    """Whether ``t``'s wrapper is itself a leaf autograd tracks (``requires_grad_`` flags
    one, for compiled graphs: ``formats/tensor.py``)."""
    return wrapper_requires_grad(t) and t.grad_fn is None


def _install():
    relu, abs_, exp, sqrt = (ew.unary(n) for n in ("relu", "abs", "exp", "sqrt"))
    table = {
        # products
        torch.matmul: mm_.matmul, Tensor.matmul: mm_.matmul, Tensor.__matmul__: mm_.matmul,
        Tensor.__rmatmul__: lambda a, b: mm_.matmul(b, a),
        torch.mm: mm_.mm, Tensor.mm: mm_.mm, torch.sparse.mm: mm_.mm,
        torch.bmm: mm_.bmm, Tensor.bmm: mm_.bmm, torch.einsum: torch_einsum,
        torch.mv: mm_.mv, Tensor.mv: mm_.mv, torch.addmm: mm_.addmm, Tensor.addmm: mm_.addmm,
        torch.sparse.addmm: mm_.addmm,
        torch.sparse.sampled_addmm: mm_.sampled_addmm, F.linear: mm_.linear,
        # elementwise
        torch.add: ew.add, Tensor.add: ew.add, Tensor.__add__: ew.add,
        Tensor.__radd__: lambda a, b: ew.add(b, a),
        torch.sub: ew.sub, Tensor.sub: ew.sub, Tensor.__sub__: ew.sub,
        Tensor.__rsub__: lambda a, b: ew.sub(b, a),
        torch.mul: ew.mul, Tensor.mul: ew.mul, Tensor.__mul__: ew.mul,
        Tensor.__rmul__: lambda a, b: ew.mul(b, a),
        torch.div: ew.div, Tensor.div: ew.div, Tensor.__truediv__: ew.div,
        torch.true_divide: ew.div, Tensor.__rtruediv__: lambda a, b: ew.div(b, a),
        torch.neg: ew.neg, Tensor.neg: ew.neg, Tensor.__neg__: ew.neg,
        torch.pow: ew.pow, Tensor.pow: ew.pow, Tensor.__pow__: ew.pow,
        torch.relu: relu, Tensor.relu: relu, F.relu: relu,
        torch.abs: abs_, Tensor.abs: abs_, Tensor.__abs__: abs_,
        torch.exp: exp, Tensor.exp: exp, torch.sqrt: sqrt, Tensor.sqrt: sqrt,
        # reductions
        torch.sum: red.sum, Tensor.sum: red.sum, torch.mean: red.mean, Tensor.mean: red.mean,
        torch._sparse_sum: red.sparse_sum,   # (what torch.sparse.sum calls)
        # softmax over stored entries
        torch.sparse.softmax: _sparse_softmax,
        torch.autograd.grad: _autograd_grad,
        F.dropout: _dropout,
        # free views
        torch.t: views.t, Tensor.t: views.t, torch.transpose: views.transpose,
        Tensor.transpose: views.transpose, torch.swapaxes: views.transpose,
        Tensor.swapaxes: views.transpose, torch.permute: _permute, Tensor.permute: _permute,
        Tensor.T.__get__: views.t, Tensor.mT.__get__: views.matrix_transpose,
        # structure (differentiable in the values)
        Tensor.to: _to, Tensor.clone: _clone, torch.clone: _clone, Tensor.detach: _detach,
        torch.detach: _detach,
        Tensor.double: lambda t, memory_format=None: _to(t, torch.float64),
        Tensor.float: lambda t, memory_format=None: _to(t, torch.float32),
    }
    _TORCH_FUNCTIONS.update(table)
    _TORCH_FUNCTIONS.update(inplace.TABLE)   # same-pattern value updates: optimizers, loading
    # Python operators find these before torch's (a subclass's methods win).
    SparseTensor.__add__ = lambda a, b: ew.add(a, b)
    SparseTensor.__radd__ = lambda a, b: ew.add(b, a)
    SparseTensor.__sub__ = lambda a, b: ew.sub(a, b)
    SparseTensor.__rsub__ = lambda a, b: ew.sub(b, a)
    SparseTensor.__mul__ = lambda a, b: ew.mul(a, b)
    SparseTensor.__rmul__ = lambda a, b: ew.mul(b, a)
    SparseTensor.__truediv__ = lambda a, b: ew.div(a, b)
    SparseTensor.__rtruediv__ = lambda a, b: ew.div(b, a)
    # In place as they say, or an error: torch's own turned the TypeError of a dense
    # operand into ``A = A + x`` (a new tensor; a parameter never updated).
    SparseTensor.__iadd__ = lambda a, b: a.add_(b)
    SparseTensor.__isub__ = lambda a, b: a.sub_(b)
    SparseTensor.__imul__ = lambda a, b: a.mul_(b)
    SparseTensor.__itruediv__ = lambda a, b: a.div_(b)
    SparseTensor.__neg__ = ew.neg
    SparseTensor.__pow__ = ew.pow
    SparseTensor.__abs__ = abs_
    SparseTensor.__matmul__ = mm_.matmul
    SparseTensor.__rmatmul__ = lambda a, b: mm_.matmul(b, a)
