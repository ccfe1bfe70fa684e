"""``codegen/triton.py``: the Triton source rendered from the plain loop IR (pure: no
tensors, no Triton needed). ``triton_cases.py`` runs the kernels themselves in Triton's
interpreter against dense."""
from __future__ import annotations

import pytest

from sparsetorch.codegen.triton import Unsupported, render
from sparsetorch.compiler.attention import (attention_function, row_softmax_function,
                                            row_softmax_grad_function)
from sparsetorch.compiler.ir import (Assign, Bin, Block, Decl, For, Function, Load, Lit,
                                     Param, Parallel, Sym)
from sparsetorch.compiler.kernel import lower_plain
from sparsetorch.compiler.notation import (Access, Add, Assignment, Epilogue, Result, Unary,
                                           parse_einsum)
from sparsetorch.compiler.schedule import OperandInfo
from sparsetorch.formats.format import as_format


def plain(equation, *formats, epilogue=None):
    """The plain nest of ``equation`` over formats ("vec": a dense vector)."""
    infos = tuple(OperandInfo(as_format("dense", 1) if f == "vec" else as_format(f, 2),
                              f in ("dense", "vec")) for f in formats)
    a = parse_einsum(equation, [i.format.ndim for i in infos][:equation.count(",") + 1])
    if epilogue is not None:
        a = Assignment(a.out_vars, Epilogue(a.expr, epilogue))
    return lower_plain(a, infos)


def rendered(equation, *formats, **kw):
    sched, spec, fn = plain(equation, *formats, **kw)
    kernel = render(fn)
    compile(kernel.source, "<kernel>", "exec")   # valid Python
    assert "memory traffic:" in kernel.source and "parallel strategy:" in kernel.source
    return spec, kernel


def test_spmm_tiles_the_dense_dimension_and_sums_entries_in_registers():
    spec, k = rendered("ij,jk->ik", "csr", "dense")
    assert spec.kind == "dense" and k.tile == ("k", "n_k") and k.weights == "t0_pos1"
    assert [kind for _, kind, _ in k.blocks] == ["entries"]
    # one register sum over the row's entries, stored once (the zeroed output not re-read)
    assert k.source.count("tl.sum(") == 1 and "tl.load(out_vals" not in k.source
    assert k.source.count("tl.store(") == 1


def test_spmv_and_sparse_weight_linear():
    _, spmv = rendered("ij,j->i", "csr", "vec")
    assert spmv.tile is None and len(spmv.blocks) == 1
    _, linear = rendered("ij,kj->ki", "csr", "dense")   # x W^T with W sparse
    assert linear.tile is not None


def test_sddmm_writes_on_the_pattern():
    spec, k = rendered("ij,ik,jk->ij", "csr", "dense", "dense")
    assert spec.kind == "sampled" and k.tile is None
    assert {kind for _, kind, _ in k.blocks} == {"entries", "extent"}
    assert "tl.store(out_vals + (p" in k.source


def test_epilogue_pass_runs_in_the_same_program_from_registers():
    relu_bias = Unary("relu", Add(Result(), Access(2, ("k",))))
    _, k = rendered("ij,jk->ik", "csr", "dense", "vec", epilogue=relu_bias)
    assert "tl.maximum(" in k.source and "tl.load(out_vals" not in k.source
    assert k.source.count("tl.program_id(0)") == 1


def test_csc_is_re_laid_first():
    sched, _, fn = plain("ij,jk->ik", "csc", "dense")
    assert sched.conversions and render(fn).tile is not None


@pytest.mark.parametrize("equation,formats", [
    ("ij,jk->ik", ("csr", "csr")),          # SpGEMM: an assembled result, no plain nest
    ("ij,ij->ij", ("csr", "csr")),          # a merge of two patterns
])
def test_uncovered_expressions(equation, formats):
    _, _, fn = plain(equation, *formats)
    if fn is not None:
        with pytest.raises(Unsupported):
            render(fn)


def test_a_store_other_programs_may_share_is_refused():
    """A scatter (``out[crd[p]] += ...``) would race between programs: never rendered."""
    p, j = Sym("p"), Sym("j")
    body = Block((For("i", Lit(0), Sym("n_i"), Block((
        For("p", Load("t0_pos1", Sym("i")), Load("t0_pos1", Bin("+", Sym("i"), Lit(1))),
            Block((Decl("idx", "j", Load("t0_crd1", p)),
                   Assign(Load("out_vals", j), Load("t0_vals", p), "+=")))),)),
        Parallel("balanced", weights="t0_pos1")),))
    fn = Function("scatter", (Param("n_i", "idx"), Param("t0_pos1", "idx0*"),
                              Param("t0_crd1", "idx0*"), Param("t0_vals", "val*"),
                              Param("out_vals", "val*", const=False)), body)
    with pytest.raises(Unsupported, match="other programs may share"):
        render(fn)


def test_blocks_of_16_multiply_with_dot():
    import torch

    import sparsetorch as st
    from sparsetorch.ops.blocked import split_blocked
    from sparsetorch.ops.triton_run import infos_of

    A = st.tensor(torch.ones(32, 32), "bsr", blocksize=(16, 16))
    new, tensors, _, static = split_blocked(parse_einsum("ij,jk->ik", [2, 2]),
                                            [A, torch.ones(32, 8)])
    _, spec, fn = lower_plain(new, infos_of(tensors))
    k = render(fn, static)
    assert spec.kind == "dense" and k.dot and "tl.dot(" in k.source
    assert k.tile == ("k", "n_k")


def test_fixed_kernels_render_from_their_plain_nests():
    for fn in (attention_function(None), row_softmax_function(), row_softmax_grad_function()):
        k = render(fn)
        compile(k.source, "<fixed>", "exec")
        assert k.tile is None and k.weights == "t0_pos1"
    assert "tl.max(" in render(row_softmax_function()).source
