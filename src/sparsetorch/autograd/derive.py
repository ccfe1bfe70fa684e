"""Gradients from the notation: the derivative of an assignment with respect to one operand
is another assignment, run by the same compiler.

For ``out[o] = sum_r expr`` and an access ``T_n[idx]`` in ``expr``, the gradient is
``grad_n[idx] = sum_{other vars} G[o] * d expr / d T_n[idx]``: for a product that is ``G``
times the other factors (``dA = dC @ B^T`` for ``C = A @ B``), for a sum it is ``G``, a
constant factor carries over, and a unary map contributes its derivative, evaluated as a new
operand. A sparse operand's gradient is sampled on its own pattern (times a ones-valued copy
of it), so it stays sparse and costs memory proportional to nnz (``dA = SDDMM(A, dC, B)``).
"""
from __future__ import annotations

import torch

from ..compiler.notation import Access, Add, Assignment, Mul, Scale, Unary
from ..formats.convert import tensor as st_tensor
from ..formats.pack import unpack
from ..formats.tensor import SparseTensor
from ..ops.custom_ops import is_tracing
from .pattern import ones_pattern, values_on_pattern


def _vars_of(expr) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v for acc in expr.accesses() for v in acc.indices))


def _compact(expr, operands):
    """``expr`` renumbered to use only the operands it reads, and that operand list."""
    used = list(dict.fromkeys(acc.operand for acc in expr.accesses()))
    new = {old: k for k, old in enumerate(used)}

    def walk(e):
        if isinstance(e, Access):
            return Access(new[e.operand], e.indices)
        if isinstance(e, (Add, Mul)):
            return type(e)(walk(e.a), walk(e.b))
        if isinstance(e, Scale):
            return Scale(e.factor, walk(e.a))
        return Unary(e.fn, walk(e.a))
    return walk(expr), [operands[k] for k in used]


def _map_values(t, fn):
    """``fn`` on every stored value (a sparse ``t`` keeps its pattern: only maps with
    ``fn(0) == 0`` are used on sparse tensors)."""
    return t.with_values(fn(t.values)) if isinstance(t, SparseTensor) else fn(t)


# f'(u) from u, for maps whose derivative the notation cannot spell; f'(0) == 0 for relu and
# abs (the subgradient), and sqrt's is only read where u is stored.
_DERIVATIVES = {
    "relu": lambda v: (v <= 0).logical_not().to(v.dtype),   # (a NaN passes, as torch's)
    "abs": torch.sign,
    "sqrt": lambda v: 0.5 / torch.sqrt(v),
}


class _Builder:
    """Collects the operands of a gradient expression (the originals plus new leaves).
    ``select``: relu's derivative at a dense ``u`` is its positive entries as a sparse leaf
    (a product then skips the other entries) instead of a dense 0/1 factor;
    ``dense_relu`` records that a 0/1 factor was made."""

    def __init__(self, operands, evaluate, select: bool = False):
        self.operands, self.evaluate = list(operands), evaluate
        self.select, self.dense_relu = select, False

    def leaf(self, tensor, indices) -> Access:
        self.operands.append(tensor)
        return Access(len(self.operands) - 1, tuple(indices))

    def run(self, out_vars, expr):
        expr, ops = _compact(expr, self.operands)
        return self.evaluate(Assignment(tuple(out_vars), expr), ops)

    def unary_derivative(self, fn, inner) -> Access:
        vars_ = _vars_of(inner)
        if fn == "exp":   # exp' = exp: the notation spells it
            return self.leaf(self.run(vars_, Unary("exp", inner)), vars_)
        u = self.run(vars_, inner)
        if fn == "relu" and not is_tracing((u,)):
            if isinstance(u, SparseTensor) or self.select:
                return self.leaf(_positive_entries(u), vars_)
            self.dense_relu = True
        return self.leaf(_map_values(u, _DERIVATIVES[fn]), vars_)


def _positive_entries(u) -> SparseTensor:
    """relu's derivative at ``u`` (sparse or dense) as a mask that stores only ``u``'s
    positive (and NaN) entries (ones, COO): the gradient is then 0 elsewhere whatever
    arrives from above, as torch's relu backward masks (a 0/1 factor made an infinite
    gradient inf x 0 = NaN, e.g. through ``sqrt(relu(A))``); it passes at a NaN, as torch's
    does. Not while tracing: the entry count depends on values."""
    if isinstance(u, SparseTensor):
        coords, values = unpack(u.format, u.shape, u._level_arrays, u.values)
        kept = coords[:, (values <= 0).logical_not()]
    else:
        kept = (u <= 0).logical_not().nonzero().t()
    return st_tensor((kept, torch.ones(kept.shape[1], dtype=u.dtype, device=u.device)),
                     format="coo", shape=tuple(u.shape))


def _derivative(e, k, b: _Builder):
    """(constant factor, expression or None for 1) of ``d e / d (k-th access of e)``."""
    if isinstance(e, Access):
        return 1.0, None
    if isinstance(e, (Add, Mul)):
        na = len(e.a.accesses())
        left = k < na
        c, x = _derivative(e.a, k, b) if left else _derivative(e.b, k - na, b)
        if isinstance(e, Add):
            return c, x
        other = e.b if left else e.a
        return c, other if x is None else (Mul(x, other) if left else Mul(other, x))
    if isinstance(e, Scale):
        c, x = _derivative(e.a, k, b)
        return c * e.factor, x
    c, x = _derivative(e.a, k, b)
    if e.fn == "neg":
        return -c, x
    leaf = b.unary_derivative(e.fn, e.a)
    return c, leaf if x is None else Mul(leaf, x)


def operand_grad(assignment: Assignment, operands, n: int, grad_out, evaluate):
    """Gradient of ``assignment`` (over ``operands``) with respect to operand ``n``, given the
    output gradient ``grad_out`` (dense, or a SparseTensor with the output's pattern).
    Dense operand: a tensor of its shape. Sparse operand: one value per stored entry.
    ``evaluate(assignment, operands)`` runs an assignment (differentiably when needed).

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.ops.execute import run
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> a = parse_einsum("ij,jk->ik", [2, 2])
        >>> operand_grad(a, [A, torch.eye(2)], 0, torch.ones(2, 2), run).tolist()
        [1.0, 1.0]
    """
    target = operands[n]
    sparse = isinstance(target, SparseTensor)
    total = None
    for k, acc in enumerate(assignment.expr.accesses()):
        if acc.operand != n:
            continue
        result, dense_relu = _access_grad(assignment, operands, k, grad_out, target, evaluate)
        if dense_relu and _has_nan(result):
            # (a 0/1 relu factor met an infinite factor: again with the relu's positive
            # entries as a sparse leaf, 0 elsewhere as torch's relu backward gives; only
            # here, as the dense factor keeps a dense product's loops)
            result, _ = _access_grad(assignment, operands, k, grad_out, target, evaluate,
                                     select=True)
        if sparse:
            part = values_on_pattern(target, result)
        else:
            if isinstance(result, SparseTensor):
                result = result.to_dense()
            part = _embed_diagonal(result, acc.indices,
                                   tuple(dict.fromkeys(acc.indices)), target)
        total = part if total is None else total + part
    return total


def _access_grad(assignment, operands, k: int, grad_out, target, evaluate,
                 select: bool = False):
    """(the gradient at the ``k``-th access of ``assignment``, over that access's distinct
    indices; whether it took a dense 0/1 relu factor): ``select`` as ``_Builder``'s."""
    acc = assignment.expr.accesses()[k]
    b = _Builder(operands, evaluate, select)
    c, x = _derivative(assignment.expr, k, b)
    expr = b.leaf(grad_out, assignment.out_vars)
    if x is not None:
        expr = Mul(expr, x)
    out_vars = tuple(dict.fromkeys(acc.indices))
    if isinstance(target, SparseTensor) and \
            not _on_pattern(grad_out, target, acc.indices, assignment.out_vars):
        # sample on the operand's own pattern (unless the output gradient already is: a
        # sampled result shares its operand's arrays; then a second sparse operand would
        # only add an intersection, and a result of data-dependent size when traced)
        expr = Mul(expr, b.leaf(ones_pattern(target), acc.indices))
    present = _vars_of(expr)
    for v in out_vars:   # an index only the operand reads (``ij->i``): G is constant along it
        if v not in present:
            size = target.shape[acc.indices.index(v)]
            expr = Mul(expr, b.leaf(torch.ones(size, dtype=target.dtype,
                                               device=target.device), (v,)))
    if c != 1.0:
        expr = Scale(c, expr)
    return b.run(out_vars, expr), b.dense_relu


def _has_nan(t) -> bool:
    values = t.values if isinstance(t, SparseTensor) else t
    return not is_tracing((values,)) and values.is_floating_point() and \
        bool(torch.isnan(values).any())


def _on_pattern(grad_out, target, indices, out_vars) -> bool:
    """Whether ``grad_out`` is stored on exactly ``target``'s pattern, read the same way."""
    if not isinstance(grad_out, SparseTensor) or tuple(indices) != tuple(out_vars):
        return False
    if grad_out.format != target.format:
        return False
    mine, theirs = grad_out._level_arrays, target._level_arrays
    return all(mine[k] is theirs[k] for k in mine)


def _embed_diagonal(result, indices, out_vars, target):
    """A dense operand read on a diagonal (``"ii->"``) gets its gradient on that diagonal."""
    if len(out_vars) == len(indices):
        return result
    out = torch.zeros(target.shape, dtype=result.dtype, device=result.device)
    strides = [0] * len(out_vars)
    for d, v in enumerate(indices):
        strides[out_vars.index(v)] += out.stride(d)
    out.as_strided(result.shape, strides).copy_(result)
    return out
