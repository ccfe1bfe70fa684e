"""The pure-PyTorch backend (``SPARSETORCH_BACKEND=torch``): correct, dense, slow.

It evaluates the assignment on dense copies by broadcasting every access over the full
index space, then gives the result the format the compiler would have inferred, so code
behaves the same (types, formats, patterns of sampled results) with or without a C compiler.
Memory is the product of all index extents: use it for correctness, not for speed.
"""
from __future__ import annotations

import functools

import torch

from ..compiler.notation import UNARY, Access, Add, Epilogue, Mul, Result, Scale, Unary
from ..compiler.output import infer_output
from ..compiler.schedule import schedule
from ..formats.convert import _from_dense
from ..formats.pack import unpack
from ..formats.tensor import SparseTensor
from .custom_ops import from_dense, is_tracing


def evaluate_dense(assignment, dense_operands, extents) -> torch.Tensor:
    """Dense result of ``assignment`` (output index order) from dense operands."""
    all_vars = assignment.all_vars

    def broadcast(acc: Access):
        t = dense_operands[acc.operand]
        # Repeated indices take the diagonal, as einsum does.
        letters = "".join(chr(ord("a") + all_vars.index(v)) for v in acc.indices)
        unique = "".join(dict.fromkeys(letters))
        t = torch.einsum(f"{letters}->{unique}", t) if unique != letters else t
        order = [all_vars[ord(c) - ord("a")] for c in unique]
        perm = sorted(range(len(order)), key=lambda d: all_vars.index(order[d]))
        t = t.permute(perm)
        shape = [extents[v] if v in order else 1 for v in all_vars]
        return t.reshape(shape)

    def ev(e, result=None):
        if isinstance(e, Result):
            return result
        if isinstance(e, Access):
            return broadcast(e)
        if isinstance(e, Mul):
            return ev(e.a, result) * ev(e.b, result)
        if isinstance(e, Add):
            return ev(e.a, result) + ev(e.b, result)
        if isinstance(e, Scale):
            return ev(e.a, result) * e.factor
        if isinstance(e, Unary):
            return UNARY[e.fn][1](ev(e.a, result))
        raise TypeError(e)

    body, epilogue = (assignment.expr.body, assignment.expr.fn) \
        if isinstance(assignment.expr, Epilogue) else (assignment.expr, None)
    full = ev(body).expand([extents[v] for v in all_vars])
    red = [d for d, v in enumerate(all_vars) if v not in assignment.out_vars]
    # (in the operands' type, as the kernels: torch's sum would make integers int64, which
    # einsum asks for itself where torch's einsum does)
    out = full.sum(dim=red, keepdim=True, dtype=full.dtype) if red else full
    if epilogue is not None:   # its accesses use output variables only: broadcast over them
        out = ev(epilogue, out).expand(out.shape)
    out = out.sum(dim=red, dtype=out.dtype) if red else out   # drop the kept size-1 dims
    kept = [v for v in all_vars if v in assignment.out_vars]
    return out.permute([kept.index(v) for v in assignment.out_vars]).contiguous()


def run_dense(assignment, tensors, infos, extents, out_format):
    dense = [t.to_dense() if isinstance(t, SparseTensor) else t for t in tensors]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in dense))
    if dtype in (torch.float16, torch.bfloat16):
        # products summed in float32 and rounded once, as torch's einsum does: rounded to
        # half precision before their sum, they were off by up to 4x torch's error
        dense = [t.float() for t in dense]
    result = evaluate_dense(assignment, dense, extents).to(dtype)
    sched = schedule(assignment, infos)
    spec = infer_output(assignment, sched.order, sched.formats, out_format)
    if spec.kind == "dense":
        return result
    if spec.kind == "sampled":
        source = tensors[spec.sampled_operand]
        if sched.formats[spec.sampled_operand] != source.format:
            source = source.asformat(sched.formats[spec.sampled_operand])
        coords, _ = unpack(source.format, source.shape, source._level_arrays, source.values)
        # The sampled operand's modes, reordered to the output's.
        acc = next(a for a in assignment.expr.accesses() if a.operand == spec.sampled_operand)
        perm = [acc.indices.index(v) for v in assignment.out_vars]
        values = result[tuple(coords[perm])]
        return SparseTensor(result.shape, spec.format, source._level_arrays, values)
    if is_tracing([result]):   # nonzero's count is data-dependent: one op with a size rule
        return from_dense(result, spec.format)
    return _from_dense(result, spec.format, None, None, None)
