"""``compiler/triton_plan.py``: which Triton kernel class an assignment gets (pure: no
tensors, no Triton needed), and the source ``codegen/triton.py`` renders for it."""
from __future__ import annotations

import pytest

from sparsetorch.codegen.triton import render, render_attention, render_row_softmax
from sparsetorch.compiler.notation import parse_einsum
from sparsetorch.compiler.output import infer_output
from sparsetorch.compiler.schedule import OperandInfo, schedule
from sparsetorch.compiler.triton_plan import plan
from sparsetorch.formats.format import as_format


def planned(equation, *formats, shared=False):
    """The plan of ``equation`` over formats (names; "dense" for plain tensors) after the
    compiler's schedule and output inference, as ``ops/triton_run.py`` asks for it."""
    infos = tuple(OperandInfo(as_format(f, 2 if f != "vec" else 1) if f != "vec"
                              else as_format("dense", 1), f in ("dense", "vec"))
                  for f in formats)
    a = parse_einsum(equation, [i.format.ndim for i in infos])
    sched = schedule(a, infos)
    spec = infer_output(a, sched.order, sched.formats)
    return plan(a, sched.formats, spec.kind, spec.sampled_operand, lambda m, n: shared)


@pytest.mark.parametrize("equation,formats,kind,x_dims,out_dims", [
    ("ij,jk->ik", ("csr", "dense"), "rows", ("c", "k"), ("r", "k")),
    ("ij,j->i", ("csr", "vec"), "rows", ("c",), ("r",)),
    ("ij,kj->ki", ("csr", "dense"), "rows", ("k", "c"), ("k", "r")),       # sparse weight
    ("ij,jk->ik", ("csc", "dense"), "rows", ("c", "k"), ("r", "k")),       # re-laid as CSR
    ("ij,ik,jk->ij", ("csr", "dense", "dense"), "sampled", ("r", "k"), ("r", "c")),
    ("ij,ik,jk->ij", ("csc", "dense", "dense"), "sampled", ("r", "k"), ("c", "r")),
])
def test_kernel_classes(equation, formats, kind, x_dims, out_dims):
    p = planned(equation, *formats)
    assert (p.kind, p.x.dims, p.out_dims) == (kind, x_dims, out_dims)
    source = render(p)
    assert "@triton.jit" in source and "memory traffic:" in source
    compile(source, "<plan>", "exec")   # valid Python


@pytest.mark.parametrize("equation,formats", [
    ("ij,jk->ik", ("csr", "csr")),              # SpGEMM: a sparse result
    ("ij,ij->ij", ("csr", "csr")),              # two patterns (unless shared arrays)
    ("ij,jk,k->ik", ("csr", "dense", "vec")),   # two dense factors in SpMM
    ("ij->i", ("csr",)),                        # no dense operand
])
def test_uncovered_expressions_get_no_plan(equation, formats):
    assert planned(equation, *formats) is None


def test_one_pattern_in_two_operands_is_one_compressed_operand():
    p = planned("ij,ij,jk->ik", "csr", "csr", "dense", shared=True)
    assert p.kind == "rows" and p.shared == (1,)


def test_fixed_kernels_compile_as_python():
    for source in (render_attention(), render_row_softmax("row_softmax"),
                   render_row_softmax("row_softmax_grad")):
        compile(source, "<fixed>", "exec")
    with pytest.raises(ValueError, match="no Triton row kernel"):
        render_row_softmax("row_max")
