"""The autograd node for every compiled expression (einsum or lazy tree).

Its explicit inputs are the dense operands and the *values* of the sparse operands, so
autograd tracks exactly what can require grad; the level arrays ride along in a plan object.
Forward runs the compiled kernel as the no-grad path does; backward asks ``derive.py`` for one
gradient expression per operand and runs it through ``evaluate`` (itself differentiable, so
``create_graph=True`` gives second derivatives). The first time a call is recorded, the
kernels its backward will need start building right after its forward (``_prefetch_backward``),
so a cold training step compiles them side by side with the rest of the forward pass instead
of one after another inside ``loss.backward()``.
"""
from __future__ import annotations

import torch

from .._modes import materialized
from ..formats.tensor import SparseTensor
from ..ops.execute import _signature, prefetch, run
from ..ops.merge import sharing_products
from .derive import operand_grad

_is_grad_enabled = torch.is_grad_enabled


def needs_grad(operands) -> bool:
    """Whether evaluating on ``operands`` must be recorded: grad mode is on and a dense
    operand, or a sparse operand's values, requires grad.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(2), "csr")
        >>> needs_grad([A, torch.ones(2)]), needs_grad([A.requires_grad_(), torch.ones(2)])
        (False, True)
    """
    if not _is_grad_enabled():
        return False
    for t in operands:
        if getattr(t, "requires_grad", False):
            return True
    return False


class _Plan:
    """What backward needs besides the saved inputs: the expression, each sparse operand's
    pattern, and (after forward) the output's pattern when the output is sparse."""

    def __init__(self, assignment, operands, out_format, what, alias):
        self.assignment, self.out_format, self.what, self.alias = (assignment, out_format,
                                                                   what, alias)
        self.operands = list(operands)
        self.out_pattern = None

    def rebuild(self, inputs):
        # a saved input unpacks to the operand's own values tensor (autograd has checked
        # its version): the operand itself, whose pointers and call key are known
        return [(t if v is t._values else t.with_values(v)) if isinstance(t, SparseTensor)
                else v for t, v in zip(self.operands, inputs)]


class _ExprFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, *inputs):
        out = run(plan.assignment, plan.operands, plan.out_format, what=plan.what,
                  alias=plan.alias)
        ctx.plan = plan
        ctx.save_for_backward(*inputs)
        if isinstance(out, SparseTensor):
            plan.out_pattern = out
            return out.values
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan, grad_out = ctx.plan, materialized(grad_out)
        operands = plan.rebuild(ctx.saved_tensors)
        g = grad_out if plan.out_pattern is None else plan.out_pattern.with_values(grad_out)
        with sharing_products():   # (the operands' gradients may share a product)
            grads = [operand_grad(plan.assignment, operands, n, g, evaluate)
                     if ctx.needs_input_grad[n + 1] else None for n in range(len(operands))]
        return (None, *grads)


def evaluate(assignment, operands, out_format=None, what="expression", alias=None):
    """Run ``assignment`` on ``operands``, recording it for autograd when
    ``needs_grad(operands)``; a sparse result's values carry the gradient.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr").requires_grad_()
        >>> evaluate(parse_einsum("ij,j->i", [2, 1]), [A, torch.ones(2)]).sum().backward()
        >>> A.grad.values.tolist()
        [1.0, 1.0]
    """
    if not needs_grad(operands):
        return run(assignment, operands, out_format, what=what, alias=alias)
    plan = _Plan(assignment, operands, out_format, what, alias)
    inputs = [t.values if isinstance(t, SparseTensor) else t for t in operands]
    out = _ExprFunction.apply(plan, *inputs)
    result = out if plan.out_pattern is None else plan.out_pattern.with_values(out)
    _prefetch_backward(plan, result)
    return result


_PREFETCHED: set = set()   # call signatures (grad mode off) whose backward was prefetched


class _Prefetched(Exception):
    """Stops a gradient derivation once its first kernel is prefetched."""


def _prefetch_evaluate(assignment, operands, out_format=None, what="", alias=None):
    prefetch(assignment, operands, out_format)
    # The derivation would go on with this result (a product's gradient: its only kernel;
    # a unary map's: an inner value first): stop here, backward builds anything later.
    raise _Prefetched


def _prefetch_backward(plan: _Plan, result) -> None:
    """Prefetch the gradient kernel of each operand that requires grad, the first time this
    call signature is recorded, with a stand-in of the output gradient (uninitialised, of the
    result's shape and pattern). Only a hint: a derivation that cannot run on the stand-in
    is left to backward, which builds (and reports errors) as it always does."""
    with torch.no_grad():
        key = _signature(plan.assignment, plan.operands, plan.out_format)
    if key is None or key in _PREFETCHED:
        return
    _PREFETCHED.add(key)
    if isinstance(result, SparseTensor):
        stand_in = result.with_values(torch.empty_like(result.values))
    else:
        stand_in = torch.empty_like(result)
    with torch.no_grad():
        for n, t in enumerate(plan.operands):
            if getattr(t, "requires_grad", False):
                try:
                    operand_grad(plan.assignment, plan.operands, n, stand_in,
                                 _prefetch_evaluate)
                except Exception:  # noqa: BLE001 - a hint only; backward builds and raises
                    pass
