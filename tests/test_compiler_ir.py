"""The compiler's inner stages on their own: index notation, loop ordering, format inference,
the immutable loop IR (verifier and printer) and the C renderer over it."""
from __future__ import annotations

import dataclasses
import re
import statistics
import time

import pytest
import torch

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from sparsetorch.codegen.c import render_c
from sparsetorch.codegen.kernel import compile_kernel
from sparsetorch.compiler import OperandInfo, parse_einsum
from sparsetorch.compiler.ir import (Assign, Bin, Block, Decl, For, Function, If, IRError, Lit,
                                     Load, Param, Sym, block, dump, statements, verify)
from sparsetorch.compiler.output import infer_output
from sparsetorch.compiler.schedule import schedule
from sparsetorch.formats.format import as_format

CSF201 = st.Format((st.compressed,) * 3, mode_order=(2, 0, 1))


def info(fmt, ndim=2, strided=False):
    return OperandInfo(fmt if isinstance(fmt, st.Format) else as_format(fmt, ndim), strided)


DENSE2 = info("dense", 2, True)
DENSE1 = info("dense", 1, True)


def _fn(body, params=(Param("n", "idx"), Param("x", "val*"),
                      Param("out_vals", "val*", const=False))):
    return Function("k", tuple(params), block(*body))


# -- the verifier ------------------------------------------------------------------------------
def test_verify_accepts_a_well_scoped_function():
    verify(_fn([Decl("val", "s", Lit(0.0)),
                For("i", Lit(0), Sym("n"), block(Assign(Sym("s"), Load("x", Sym("i")), "+="))),
                Assign(Load("out_vals", Lit(0)), Sym("s"))]))


def test_verify_rejects_an_undeclared_symbol():
    with pytest.raises(IRError, match="'s'"):
        verify(_fn([For("i", Lit(0), Sym("n"),
                        block(Assign(Sym("s"), Load("x", Sym("i")), "+=")))]))
    with pytest.raises(IRError, match="'m'"):
        verify(_fn([For("i", Lit(0), Sym("m"), block())]))             # in a loop bound
    with pytest.raises(IRError):
        verify(_fn([Assign(Load("out_vals", Sym("q")), Lit(1.0))]))     # in an index
    assert issubclass(IRError, AssertionError)


def test_verify_rejects_use_before_declaration_and_out_of_scope():
    with pytest.raises(IRError, match="'s'"):
        verify(_fn([Assign(Sym("s"), Lit(1.0)), Decl("val", "s", Lit(0.0))]))
    with pytest.raises(IRError, match="'i'"):        # a loop variable after its loop
        verify(_fn([For("i", Lit(0), Sym("n"), block()),
                    Assign(Load("out_vals", Sym("i")), Lit(0.0))]))
    with pytest.raises(IRError, match="'t'"):        # a declaration inside an if-branch
        verify(_fn([If(Bin("<", Lit(0), Sym("n")), block(Decl("idx", "t", Lit(1)))),
                    Assign(Load("out_vals", Sym("t")), Lit(0.0))]))


def test_verify_rejects_an_array_that_is_not_a_parameter():
    with pytest.raises(IRError, match="'y'"):
        verify(_fn([Assign(Load("out_vals", Lit(0)), Load("y", Lit(0)))]))


def test_ir_nodes_are_immutable():
    node = For("i", Lit(0), Sym("n"), block())
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.var = "j"
    assert hash(Bin("+", Sym("a"), Lit(1))) == hash(Bin("+", Sym("a"), Lit(1)))
    assert block([Decl("idx", "a"), None], Block((Decl("idx", "b"),))).stmts == (
        Decl("idx", "a"), Decl("idx", "b"))


def test_dump_prints_loops():
    fn = _fn([Decl("val", "s", Lit(0.0)),
              For("i", Lit(0), Sym("n"), block(Assign(Sym("s"), Load("x", Sym("i")), "+="))),
              Assign(Load("out_vals", Lit(0)), Sym("s"))])
    text = dump(fn)
    lines = text.splitlines()
    assert lines[0].strip().startswith("function k(")
    assert any(re.match(r"\s+for i in \[0, n\)", ln) for ln in lines)
    loop = next(k for k, ln in enumerate(lines) if "for i" in ln)
    body = lines[loop + 1]
    assert "s += x[i]" in body
    indent = len(body) - len(body.lstrip())
    assert indent > len(lines[loop]) - len(lines[loop].lstrip())   # nested one level deeper


@pytest.mark.parametrize("eq,fmts", [
    ("ij,j->i", ("csr", DENSE1)), ("ij,jk->ik", ("csr", "csr")), ("ij,jk->ik", ("csr", "csc")),
    ("ij,ik,jk->ij", ("csr", DENSE2, DENSE2)), ("ij->ji", ("coo",)),
    ("ikl,kj,lj->ij", (CSF201, DENSE2, DENSE2)), ("ij,ij->ij", ("csr", "dcsc"))])
def test_every_compiled_kernel_verifies_and_dumps(eq, fmts):
    terms = eq.split("->")[0].split(",")
    infos = tuple(f if isinstance(f, OperandInfo) else info(f, len(t))
                  for f, t in zip(fmts, terms))
    a = parse_einsum(eq, [len(t) for t in terms])
    k = compile_kernel(a, infos, "float64", ("int32",) * len(infos))
    assert k.functions
    for fn in k.functions:
        verify(fn)
    loops = k.describe_loops()
    assert loops.count("function ") == len(k.functions)
    assert "for " in loops or "while " in loops
    for v in k.schedule.order:                       # every index variable has its loop
        assert re.search(rf"\b{v}\b", loops)


# -- the renderer is a printer over the IR -----------------------------------------------------
def test_rendered_ir_compiles_and_runs(private_kernel_cache):
    """A hand-built function (sum of squares) renders to C that the runtime builds and runs."""
    fn = Function("sumsq", (Param("nt", "idx"), Param("n", "idx"), Param("x", "val*"),
                            Param("out_vals", "val*", const=False)),
                  block(Decl("val", "s", Lit(0.0)),
                        For("i", Lit(0), Sym("n"), block(
                            Decl("val", "v", Load("x", Sym("i"))),
                            Assign(Sym("s"), Bin("*", Sym("v"), Sym("v")), "+="))),
                        Assign(Load("out_vals", Lit(0)), Sym("s"))))
    verify(fn)
    src = render_c([fn], "double", {})
    assert "int64_t i = 0" in src and "restrict" in src
    f = st.runtime.load_kernel(src, "sumsq", [st.runtime.I64, st.runtime.I64, st.runtime.PTR,
                                              st.runtime.PTR])
    x = torch.arange(5, dtype=torch.float64)
    out = torch.zeros(1, dtype=torch.float64)
    f(1, 5, x.data_ptr(), out.data_ptr())
    assert out.item() == 30.0


def test_generated_c_uses_64_bit_loops_and_stored_index_width():
    a = parse_einsum("ij,jk->ik", [2, 2])
    k = compile_kernel(a, (info("csr"), DENSE2), "float32", ("int32", "int64"))
    src = k.source
    assert "typedef float val_t" in src
    assert "const int32_t* restrict t0_pos1" in src and "const int32_t* restrict t0_crd1" in src
    assert not re.search(r"for \(int32_t|for \(int ", src)    # GCC's vectoriser trap
    assert "#pragma omp parallel num_threads(nt)" in src    # rows split across threads


def _evaluate(e, arrays: dict, dims: dict) -> int:
    """An index expression of the IR on concrete arrays and extents."""
    if isinstance(e, Lit):
        return e.value
    if isinstance(e, Sym):
        return dims[e.name]
    if isinstance(e, Load):
        return int(arrays[e.array][_evaluate(e.index, arrays, dims)])
    a, b = _evaluate(e.a, arrays, dims), _evaluate(e.b, arrays, dims)
    return {"+": a + b, "-": a - b, "*": a * b}[e.op]


@pytest.mark.parametrize("fmt", [
    "csr", "csc", "dcsr", "coo", CSF201, st.Format((st.dense, st.compressed, st.compressed)),
    st.Format((st.dense, st.dense, st.compressed)),
    st.Format((st.compressed, st.dense, st.compressed), mode_order=(1, 0, 2))])
def test_loops_over_stored_entries_know_how_many_there_are(fmt):
    """Each loop over stored positions carries its level's entry count (the bound for reads
    ahead of the loop: prefetches); evaluated on a tensor, it is the coordinate array's
    length, for every level kind above it."""
    ndim = 3 if isinstance(fmt, st.Format) else 2
    g = torch.Generator().manual_seed(0)
    d = torch.rand((3, 4, 5)[:ndim], generator=g) * (torch.rand((3, 4, 5)[:ndim], generator=g)
                                                      < 0.3)
    d[-1, -1] = 1.0   # the last row of the last slice stores an entry
    eq = ("ijl,jk->ik" if ndim == 3 else "ij,jk->ik")
    a = parse_einsum(eq, [ndim, 2])
    k = compile_kernel(a, (info(fmt, ndim), DENSE2), "float32", ("int32", "int64"))
    A = st.tensor(d, format=k.schedule.formats[0])   # (as the kernel reads it)
    arrays = {f"t0_{name}": v for name, v in A.arrays.items()}
    dims = dict(zip("ijl" if ndim == 3 else "ij", A.shape), n_k=7)
    dims = {f"n_{v}": n for v, n in dims.items()} | dims
    seen = 0
    for fn in k.functions:
        for s in statements(fn.body):
            if isinstance(s, For) and s.entries is not None:
                first = s.body.stmts[0]
                assert isinstance(first, Decl) and first.init.array.startswith("t0_crd")
                assert _evaluate(s.entries, arrays, dims) == len(arrays[first.init.array])
                seen += 1
    assert seen


def test_wide_spmm_prefetches_rows_ahead_inside_the_coordinates():
    """SpMM over more columns than a paired loop holds, on a dense operand of at least
    ``PREFETCH_FROM_BYTES``, prefetches the row of the entry ``PREFETCH_AHEAD`` on, guarded by
    the column array's length; results stay exact up to the last entry (rows ending at the
    array's end, one entry, none), on both sides of the size threshold."""
    from sparsetorch.codegen.vector import PREFETCH_FROM_BYTES

    a = parse_einsum("ij,jk->ik", [2, 2])
    k = compile_kernel(a, (info("csr"), DENSE2), "float32", ("int32", "int64"))
    assert re.search(r"if \(ahead_v\d+ < t0_pos1\[n_i\]\)", k.source)
    assert f"* sizeof(val_t) >= {PREFETCH_FROM_BYTES}.0" in k.source
    assert "__builtin_prefetch(&t1_vals[" in k.source
    g = torch.Generator().manual_seed(1)
    n = 64
    for rows, cols, nnz in ((40, 20, 200), (3, 20, 1), (5, 20, 0), (2, 20, 40),
                            (30, PREFETCH_FROM_BYTES // (4 * n), 3000), (2, 2 ** 14, 1)):
        d = torch.zeros(rows, cols)
        flat = torch.randperm(rows * cols, generator=g)[:nnz]
        d.view(-1)[flat] = torch.rand(nnz, generator=g) + 0.5
        d[-1, -1] = 1.0 if nnz else 0.0    # the last entry stored: reads ahead hit the end
        for width in (33, n, 100):
            x = torch.randn(cols, width, generator=g)
            got = st.einsum("ij,jk->ik", st.tensor(d, format="csr"), x)
            torch.testing.assert_close(got, d @ x)


# -- notation ----------------------------------------------------------------------------------
def test_parse_einsum():
    a = parse_einsum("ij,jk->ik", [2, 2])
    assert a.out_vars == ("i", "k") and a.reduction_vars == ("j",)
    assert str(a) == "out[i,k] = sum_{j} T0[i,j] * T1[j,k]"
    assert parse_einsum("jk,ij", [2, 2]).out_vars == ("i", "k")   # implicit: alphabetical
    assert parse_einsum("ij,ij", [2, 2]).out_vars == ()
    assert parse_einsum("ii->i", [2]).all_vars == ("i",)
    assert parse_einsum(" i j , j -> i ", [2, 1]).out_vars == ("i",)


def test_all_vars_has_each_index_once():
    """Regression: a repeated index not in the output was listed twice ('ii->' gave
    ('i', 'i')), so kernels got duplicate n_i parameters."""
    assert parse_einsum("ii->", [2]).all_vars == ("i",)
    assert parse_einsum("iij,j->", [3, 1]).all_vars == ("i", "j")


# -- loop ordering -----------------------------------------------------------------------------
@pytest.mark.parametrize("eq,fmts,order", [
    ("ij,j->i", ("csr", DENSE1), ("i", "j")),                 # concordant
    ("ij,j->i", ("csc", DENSE1), ("j", "i")),                 # concordant with CSC
    ("ij,jk->ik", ("csr", DENSE2), ("i", "j", "k")),          # k innermost: it vectorises
    ("ij,jk->ik", ("csr", "csr"), ("i", "j", "k")),           # Gustavson
    ("ijk,k->ij", (info(CSF201, 3), DENSE1), ("k", "i", "j")),  # CSF in storage order
    ("ikl,kj,lj->ij", (info("csf", 3), DENSE2, DENSE2), ("i", "k", "l", "j")),
])
def test_schedule_orders(eq, fmts, order):
    terms = eq.split("->")[0].split(",")
    infos = tuple(f if isinstance(f, OperandInfo) else info(f, len(t))
                  for f, t in zip(fmts, terms))
    s = schedule(parse_einsum(eq, [len(t) for t in terms]), infos)
    assert s.order == order and s.conversions == ()


@pytest.mark.parametrize("eq,fmts", [("ij,ji->ij", ("csr", "csr")),   # no concordant order
                                     ("ij,jk->ik", ("csr", "csc"))])  # inner products: worse
def test_schedule_converts_rather_than_traverse_discordantly(eq, fmts):
    a = parse_einsum(eq, [2, 2])
    infos = tuple(info(f) for f in fmts)
    s = schedule(a, infos)
    assert len(s.conversions) == 1
    n, fmt = s.conversions[0]
    assert s.formats[n] == fmt and fmt.mode_order != infos[n].format.mode_order
    # after the conversion every sparse operand is traversed in storage order
    for acc, f in zip(a.expr.accesses(), s.formats):
        levels = [acc.indices[m] for m in f.mode_order]
        assert [v for v in s.order if v in levels] == levels


def test_scheduling_is_fast():
    """docs/design.md: 'Scheduling costs well under a millisecond' (asserted with slack:
    5 ms of this thread's CPU time, which a busy machine does not inflate as it does the
    wall clock: a loaded run measured 10 ms wall)."""
    a = parse_einsum("ikl,kj,lj->ij", [3, 2, 2])
    infos = (info(CSF201, 3), DENSE2, DENSE2)
    times = []
    for _ in range(30):
        t0 = time.thread_time()
        schedule(a, infos)
        times.append(time.thread_time() - t0)
    assert statistics.median(times) < 5e-3


def test_compile_kernel_is_memoised():
    a = parse_einsum("ij,j->i", [2, 1])
    infos = (info("dcsr"), DENSE1)
    k1 = compile_kernel(a, infos, "float64", ("int32", "int64"))
    k2 = compile_kernel(parse_einsum("ij,j->i", [2, 1]), (info("dcsr"), DENSE1), "float64",
                        ("int32", "int64"))
    assert k1 is k2
    k3 = compile_kernel(a, infos, "float32", ("int32", "int64"))
    assert k3 is not k1 and k3.source != k1.source


# -- format inference --------------------------------------------------------------------------
def _spec(eq, fmts, out_format=None):
    terms = eq.split("->")[0].split(",")
    infos = tuple(f if isinstance(f, OperandInfo) else info(f, len(t))
                  for f, t in zip(fmts, terms))
    a = parse_einsum(eq, [len(t) for t in terms])
    s = schedule(a, infos)
    return infer_output(a, s.order, s.formats, out_format)


def test_format_inference_rules():
    assert _spec("ij,jk->ik", ("csr", "csr")).format.name == "csr"
    assert _spec("ij,jk->ik", ("dcsr", "dcsr")).format.name == "dcsr"
    assert _spec("ij,jk->ik", ("csr", DENSE2)).kind == "dense"      # a dense inner level
    assert _spec("ij,j->i", ("csr", DENSE1)).kind == "dense"
    sd = _spec("ij,ik,jk->ij", ("csc", DENSE2, DENSE2))              # SDDMM: sampled
    assert sd.kind == "sampled" and sd.sampled_operand == 0 and sd.format.name == "csc"
    assert _spec("ijk,k->ij", (info("csf", 3), DENSE1)).format.name == "dcsr"
    assert _spec("ij->", ("csr",)).kind == "dense"
    o = _spec("ij,jk->ik", ("csr", "csr"), "coo")
    assert o.kind == "emit" and o.format.name == "coo"
    assert _spec("ij,jk->ik", ("csr", "csr"), "dense").kind == "dense"


def test_format_inference_for_expression_trees():
    A, B = (st.tensor(torch.eye(3, dtype=torch.float64), "csr") for _ in range(2))
    D = torch.ones(3, 3, dtype=torch.float64)
    assert st.explain(st.lazy(A) + B).output_format == "csr"
    assert st.explain(st.lazy(A) + D).output_kind == "dense"          # sparse + dense
    assert st.explain(st.lazy(A).exp()).output_kind == "dense"        # exp(0) = 1
    assert st.explain(st.lazy(A) * D).output_kind == "sampled"        # A's pattern
    assert st.explain(st.lazy(A).relu() * 2).output_format == "csr"
