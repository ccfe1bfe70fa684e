"""The autograd node for every compiled expression (einsum or lazy tree).

Its explicit inputs are the dense operands and the *values* of the sparse operands, so
autograd tracks exactly what can require grad; the level arrays ride along in a plan object.
Forward runs the compiled kernel as the no-grad path does; backward asks ``derive.py`` for one
gradient expression per operand and runs it through ``evaluate`` (itself differentiable, so
``create_graph=True`` gives second derivatives).
"""
from __future__ import annotations

import torch

from ..formats.tensor import SparseTensor
from ..ops.execute import run
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
        plan = ctx.plan
        operands = plan.rebuild(ctx.saved_tensors)
        g = grad_out if plan.out_pattern is None else plan.out_pattern.with_values(grad_out)
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
    if plan.out_pattern is not None:
        return plan.out_pattern.with_values(out)
    return out
