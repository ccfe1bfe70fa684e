"""``rows.py``'s row-block kernels (and, for very sparse CSR batches, ``sparse_rows.py``'s)
as ``torch.library`` custom ops, so a traced ``SparseLinear`` (``torch.compile``,
``torch.export``) runs them instead of einsum's generic product.

Traced, einsum's path computes ``x W^T`` through the compiler's custom op without the
re-laying and the row blocks its eager call and ``rows.py`` use: compiled, the MNIST-sized
autoencoder (784 -> 256 -> 784, 90%-sparse weights, batch 256, 2 threads) evaluated at
0.10-0.11x and trained at 0.18-0.21x its eager speed; through these ops at 0.70-0.83x and
0.74-0.82x (the rest is ``torch.compile``'s own wrappers and guards, ~0.3 ms a step;
``python benchmarks/nn_layers.py --only compiled``).

Here one op records the forward (``sparsetorch::rows_linear``) and one the backward
(``sparsetorch::rows_linear_backward``, the same C passes as ``rows.py``'s eager backward,
``rows.gradients``); their fake kernels give the shapes. A batch of CSR rows has its own
pair (``rows_linear_csr``: ``st.ops.sparse_linear``'s eager call, and the backward of the
path it takes; traced before, the batch was densified: a bag-of-words layer, 30000 -> 256,
evaluated at 0.006x and trained at 0.02x its eager speed, now 0.54x and 0.82x). The weight enters as its CSR level arrays and values,
so ``W^T``'s pattern is re-laid once and kept as in eager calls (``relaid.py`` keys it by
the arrays: the layer's own buffers, the same tensors each call).

Applies to float32 CPU inputs and a float32 CSR weight with the C backend on an AVX2 CPU
(``applies``, ``sparse_applies``, decided while tracing); a gradient of the gradient is
not available through them (``create_graph`` raises torch's error for an op without a
derivative).

Example:
    >>> import torch, sparsetorch as st
    >>> layer = st.nn.SparseLinear(8, 4, density=0.5)
    >>> f = torch.compile(layer, fullgraph=True, backend="aot_eager")
    >>> x = torch.randn(3, 8)
    >>> torch.allclose(f(x), layer(x), atol=1e-6)
    True
"""
from __future__ import annotations

import torch

from .._modes import constant_to_tracer
from ..formats import SparseTensor
from . import sparse_rows
from .custom_ops import csr_operand
from .policy import backend
from .rows import _ACTIVATIONS, _kernel, gradients, sparse_linear
from .sparse_rows import SPARSE_ROWS_BELOW


@constant_to_tracer   # (finding the kernels reads /proc/cpuinfo and may build them)
def _has_kernels(index: torch.dtype) -> bool:
    return backend() == "c" and _kernel(index, index) is not None


def applies(x: torch.Tensor, index: torch.dtype, values, bias, activation) -> bool:
    """Whether ``rows_linear`` takes the product of dense rows ``x`` and a CSR weight of
    index dtype ``index`` holding ``values`` (everything it reads is fixed while tracing:
    dtypes, devices, the activation; not the batch size)."""
    return (activation in _ACTIVATIONS
            and x.dtype == values.dtype == torch.float32 and x.device.type == "cpu"
            and values.device.type == "cpu" and x.dim() == 2
            and (bias is None or bias.dtype == torch.float32 and bias.dim() == 1)
            and _has_kernels(index))


@torch.library.custom_op("sparsetorch::rows_linear", mutates_args=())
def rows_linear(x: torch.Tensor, pos: torch.Tensor, crd: torch.Tensor, values: torch.Tensor,
                bias: torch.Tensor | None, activation: str | None,
                in_features: int) -> torch.Tensor:
    """``activation(x W^T + bias)`` by ``rows.py``'s kernel, ``W`` the ``(m, in_features)``
    CSR matrix of ``pos``, ``crd``, ``values``; ``x`` dense ``(n, in_features)``.

    Example:
        >>> import torch
        >>> pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor(
        ...     [1, 0], dtype=torch.int32)
        >>> y = torch.ops.sparsetorch.rows_linear(torch.ones(2, 2), pos, crd,
        ...                                       torch.tensor([2., 3.]), None, None, 2)
        >>> y.tolist()
        [[2.0, 3.0], [2.0, 3.0]]
    """
    return sparse_linear(x, csr_operand(pos, crd, values, in_features,
                                        "sparsetorch::rows_linear"), bias, activation)


@rows_linear.register_fake
def _(x, pos, crd, values, bias, activation, in_features):
    return x.new_empty((x.shape[0], pos.shape[0] - 1))


@torch.library.custom_op("sparsetorch::rows_linear_backward", mutates_args=())
def rows_linear_backward(dy: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
                         crd: torch.Tensor, values: torch.Tensor, y: torch.Tensor | None,
                         activation: str | None, in_features: int, need_x: bool,
                         need_values: bool, need_bias: bool) -> list[torch.Tensor]:
    """``[dx, dvalues, dbias]`` of ``rows_linear`` at ``dy`` (``rows.gradients``), each
    empty where not asked for (an op returns tensors, not None)."""
    what = "sparsetorch::rows_linear_backward"
    weight = csr_operand(pos, crd, values.detach(), in_features, what)
    n, m = x.shape[0], pos.shape[0] - 1
    _check_float32(what, dy=(dy, (n, m)), x=(x, (n, in_features)), y=(y, (n, m)))
    grads = gradients(dy, x, None, weight, values, None if y is None else y.contiguous(),
                      activation, (need_x, need_values, need_bias))
    return [x.new_empty(0) if g is None else g for g in grads]


def _check_float32(what: str, **tensors) -> None:
    """Each of ``tensors`` (name -> (tensor or None, shape)) float32 of its shape: a backward
    op's operands (x: the forward's input; dy, y: its output's gradient and value)."""
    for name, (t, shape) in tensors.items():
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32):
            raise ValueError(f"{what}: {name} must be float32 of shape {shape} (x: the "
                             f"forward's input, dy and y: its output's gradient and value), "
                             f"got {t.dtype} of shape {tuple(t.shape)}")


@rows_linear_backward.register_fake
def _(dy, x, pos, crd, values, y, activation, in_features, need_x, need_values, need_bias):
    return [x.new_empty(x.shape if need_x else (0,)),
            values.new_empty(values.shape if need_values else (0,)),
            dy.new_empty((dy.shape[1],) if need_bias else (0,))]


def _setup(ctx, inputs, output):
    x, pos, crd, values, bias, activation, in_features = inputs
    ctx.save_for_backward(x, pos, crd, values, None if activation is None else output)
    ctx.activation, ctx.in_features = activation, in_features


def _backward(ctx, dy):
    x, pos, crd, values, y = ctx.saved_tensors
    need_x, _, _, need_values, need_bias = ctx.needs_input_grad[:5]
    dx, dvalues, dbias = torch.ops.sparsetorch.rows_linear_backward(
        dy, x, pos, crd, values, y, ctx.activation, ctx.in_features, need_x, need_values,
        need_bias)
    return (dx if need_x else None, None, None, dvalues if need_values else None,
            dbias if need_bias else None, None, None)


rows_linear.register_autograd(_backward, setup_context=_setup)


# -- CSR rows ---------------------------------------------------------------------------------
# A batch of CSR rows (sparse activations) traced: without these ops it was densified, then
# multiplied as dense rows, losing ``sparse_rows.py``'s cost in proportion to its entries.

def sparse_applies(x: SparseTensor, index: torch.dtype, values, bias, activation) -> bool:
    """``applies`` for ``rows_linear_csr``: ``x`` a SparseTensor batch of CSR rows."""
    return (x.format.name == "csr" and not x.values.requires_grad
            and applies(x, index, values, bias, activation))


@torch.library.custom_op("sparsetorch::rows_linear_csr", mutates_args=())
def rows_linear_csr(xpos: torch.Tensor, xcrd: torch.Tensor, xvalues: torch.Tensor,
                    pos: torch.Tensor, crd: torch.Tensor, values: torch.Tensor,
                    bias: torch.Tensor | None, activation: str | None,
                    in_features: int) -> torch.Tensor:
    """``activation(x W^T + bias)`` for the CSR rows ``x`` of ``xpos``, ``xcrd``,
    ``xvalues``: ``st.ops.sparse_linear``'s eager call (very sparse rows by their entries,
    ``sparse_rows.py``; denser ones by the row-block kernel).

    Example:
        >>> import torch
        >>> i = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> torch.ops.sparsetorch.rows_linear_csr(i(0, 1), i(1), torch.tensor([2.]), i(0, 1),
        ...                                       i(1), torch.tensor([3.]), None, None, 2)
        tensor([[6.]])
    """
    what = "sparsetorch::rows_linear_csr"
    return sparse_linear(csr_operand(xpos, xcrd, xvalues, in_features, what),
                         csr_operand(pos, crd, values, in_features, what), bias, activation)


@rows_linear_csr.register_fake
def _(xpos, xcrd, xvalues, pos, crd, values, bias, activation, in_features):
    return xvalues.new_empty((xpos.shape[0] - 1, pos.shape[0] - 1))


def _through_activation(dy, y, activation):
    """The output gradient before ``activation`` (torch's derivatives, NaN cases too)."""
    if activation == "relu":
        return torch.where(y <= 0, 0, dy)
    if activation == "relu6":
        return torch.where((y > 0) & (y < 6), dy, 0)
    return dy * y * (1 - y) if activation == "sigmoid" else dy


@torch.library.custom_op("sparsetorch::rows_linear_csr_backward", mutates_args=())
def rows_linear_csr_backward(dy: torch.Tensor, xpos: torch.Tensor, xcrd: torch.Tensor,
                             xvalues: torch.Tensor, pos: torch.Tensor, crd: torch.Tensor,
                             values: torch.Tensor, bias: torch.Tensor | None,
                             y: torch.Tensor | None, activation: str | None,
                             in_features: int, need_values: bool,
                             need_bias: bool) -> list[torch.Tensor]:
    """``[dvalues, dbias]`` of ``rows_linear_csr`` at ``dy`` (empty where not asked for):
    very sparse rows by their entries (``sparse_rows.py``'s kernel), others by the
    row-block backward, as eager calls take them. (Not by autograd: nothing records inside
    a custom op.)"""
    # (plain values: a Parameter reaches a custom op as itself, and the pattern re-laid
    # for its transpose is kept only for a wrapper of a plain tensor, relaid.py)
    values = values.detach()
    what = "sparsetorch::rows_linear_csr_backward"
    x = csr_operand(xpos, xcrd, xvalues, in_features, what)
    weight = csr_operand(pos, crd, values, in_features, what)
    (n, k), m = x._size, weight._size[0]
    _check_float32(what, dy=(dy, (n, m)), y=(y, (n, m)))
    dy, y = dy.contiguous(), None if y is None else y.contiguous()
    plan = sparse_rows._plan(x, weight, values, bias) \
        if xcrd.numel() < SPARSE_ROWS_BELOW * n * k else None
    if plan is not None:
        grads = sparse_rows.entry_gradients(plan, x, weight, values,
                                            _through_activation(dy, y, activation),
                                            need_values, need_bias)
    else:
        grads = gradients(dy, None, x, weight, values, y, activation,
                          (False, need_values, need_bias))[1:]
    return [dy.new_empty(0) if g is None else g for g in grads]


@rows_linear_csr_backward.register_fake
def _(dy, xpos, xcrd, xvalues, pos, crd, values, bias, y, activation, in_features,
      need_values, need_bias):
    return [values.new_empty(values.shape if need_values else (0,)),
            dy.new_empty((dy.shape[1],) if need_bias else (0,))]


def _setup_csr(ctx, inputs, output):
    xpos, xcrd, xvalues, pos, crd, values, bias, activation, in_features = inputs
    ctx.save_for_backward(xpos, xcrd, xvalues, pos, crd, values, bias,
                          None if activation is None else output)
    ctx.activation, ctx.in_features = activation, in_features


def _backward_csr(ctx, dy):
    xpos, xcrd, xvalues, pos, crd, values, bias, y = ctx.saved_tensors
    need_values, need_bias = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    dvalues, dbias = torch.ops.sparsetorch.rows_linear_csr_backward(
        dy, xpos, xcrd, xvalues, pos, crd, values, bias, y, ctx.activation, ctx.in_features,
        need_values, need_bias)
    return (None,) * 5 + (dvalues if need_values else None,
                          dbias if need_bias else None, None, None)


rows_linear_csr.register_autograd(_backward_csr, setup_context=_setup_csr)
