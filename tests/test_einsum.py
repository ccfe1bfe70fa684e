"""``st.einsum`` against ``torch.einsum`` on dense copies: equations x formats of every sparse
operand x dtypes x index dtypes x shapes (nnz = 0, empty rows, size-1 and size-0 dims), out_format
overrides and the pure-torch backend (errors and ``st.explain``: ``test_einsum_api.py``;
ellipses, broadcasting, diagonals and random equations: ``test_einsum_notation.py``;
sparse-result assembly, the ordering of a row's cells: ``test_assembly.py``).

Every case runs all its shape variants in one test: shapes do not change the generated
kernel, so the kernel is built once per (equation, formats, dtypes) and the variants exercise
the warm (memoised) call path too.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import sparsetorch as st
from dense_check import (COO3, check_against_dense, fmt_label,  # noqa: F401
                         forget_call_memo, make_operand,
                         private_kernel_cache, random_dense, run_isolated, seed_of,
                         to_dense)

F64, F32, I64 = torch.float64, torch.float32, torch.int64
CSF = "csf"
CSF021 = st.Format((st.compressed,) * 3, mode_order=(0, 2, 1))
CSF201 = st.Format((st.compressed,) * 3, mode_order=(2, 0, 1))
CSF120 = st.Format((st.compressed,) * 3, mode_order=(1, 2, 0))
CD = st.Format((st.compressed, st.dense))                   # compressed rows of dense rows
DENSE_T = st.Format((st.dense, st.dense), mode_order=(1, 0))
BSR = ("bsr", (2, 2))

F2 = ["csr", "csc", "coo", "dcsr", "dcsc", "dense", BSR]    # every 2-D format
F2_PLAIN = ["csr", "csc", "coo", "dcsr", "dcsc", "dense"]
F3 = ["coo", CSF, CSF021, CSF201, CSF120, "dense"]             # 3-D formats
F1 = ["csf", "dense"]                                          # 1-D ('coo' 1-D == csf)
SAME0 = "same-as-operand-0"                                    # the very same tensor again


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    eq: str
    fmts: tuple          # per operand: None (torch tensor), a format, BSR, or SAME0
    square: bool = False  # every index has the same extent (operands passed twice)
    kind: str | None = None   # expected result kind when the design rule alone does not say

    @property
    def id(self):
        return f"{self.name}[{','.join(fmt_label(f) if f != SAME0 else 'same' for f in self.fmts)}]"


def _cases():
    out = []
    add = out.append
    for f in F2:
        add(Case("spmv", "ij,j->i", (f, None)))
        add(Case("spmm-sparse-left", "ij,jk->ik", (f, None)))
        add(Case("spmm-sparse-right", "ij,jk->ik", (None, f)))
        add(Case("sddmm", "ij,ik,jk->ij", (f, None, None)))
        add(Case("transpose", "ij->ji", (f,)))
        add(Case("row-sums", "ij->i", (f,)))
        add(Case("col-sums", "ij->j", (f,)))
        add(Case("total-sum", "ij->", (f,)))
    # SpGEMM: every format on each side, against three partners each (18 of the 36 pairs).
    for n, fa in enumerate(F2_PLAIN):
        for shift in (0, 1, 3):
            fb = F2_PLAIN[(n + shift) % len(F2_PLAIN)]
            both = "dense" not in (fa, fb)   # two sparse operands: never a dense result
            add(Case("spgemm", "ij,jk->ik", (fa, fb), kind="sparse" if both else None))
    add(Case("spgemm", "ij,jk->ik", (BSR, BSR), kind="sparse"))
    add(Case("spgemm", "ij,jk->ik", ("csr", BSR), kind="sparse"))
    for f in F2_PLAIN:
        add(Case("inner", "ij,ij->", (f, f)))
        add(Case("times-transpose", "ij,ji->ij", (f, f), square=True))
    for f in F2_PLAIN:   # A o A^T: the same tensor, and one side must be converted
        add(Case("times-own-transpose", "ij,ji->ij", (f, SAME0), square=True))
    for f in ("csr", "coo", "dcsc"):
        add(Case("hadamard-same-tensor", "ij,ij->ij", (f, SAME0)))
        add(Case("square-same-tensor", "ij,jk->ik", (f, SAME0), square=True))
    add(Case("inner", "ij,ij->", ("csr", "csc")))
    add(Case("inner", "ij,ij->", ("coo", "dcsc")))
    add(Case("inner", "ij,ij->", ("csr", None)))
    add(Case("inner", "ij,ij->", (None, "dcsr")))
    for f in F3:
        add(Case("mttkrp", "ikl,kj,lj->ij", (f, None, None)))
        add(Case("ttv", "ijk,k->ij", (f, None)))
        add(Case("ttm", "ijk,kl->ijl", (f, None)))
        add(Case("batched-sparse-left", "bij,bjk->bik", (f, None)))
        add(Case("transpose-3d", "ijk->kij", (f,)))
    add(Case("batched-sparse-right", "bij,bjk->bik", (None, CSF)))
    add(Case("batched-both", "bij,bjk->bik", (CSF, CSF)))
    add(Case("batched-both", "bij,bjk->bik", ("coo", CSF)))
    add(Case("batched-both", "bij,bjk->bik", (CSF201, CSF)))
    for fa, fb in [("csf", "csf"), ("csf", None), (None, "csf"), ("csf", "dense"),
                   ("coo", "csf")]:
        add(Case("outer", "i,j->ij", (fa, fb)))
    add(Case("dot", "i,i->", ("csf", "csf")))
    add(Case("dot", "i,i->", ("csf", None)))
    add(Case("implicit-spmm", "ij,jk", ("csr", None)))
    add(Case("implicit-spgemm", "ij,jk", ("csr", "csr")))
    add(Case("implicit-spmv", "jk,k", ("dcsr", None)))
    add(Case("implicit-copy", "ij", ("csc",)))
    add(Case("implicit-inner", "ij,ij", ("csr", "csr")))
    add(Case("chain", "ij,jk,k->i", ("csr", "csr", None)))
    add(Case("chain", "ij,jk,kl->il", ("csr", None, "csc")))
    add(Case("three-way-hadamard", "ij,ij,ij->ij", ("csr", "coo", None)))
    add(Case("mixed-orders", "ijk,jk,i->j", (CSF, "csr", None)))
    add(Case("dense-format-transposed", "ij,jk->ik", (DENSE_T, "csr")))
    add(Case("compressed-dense", "ij,jk->ik", (CD, None)))
    add(Case("compressed-dense", "ij,j->i", (CD, None)))
    add(Case("compressed-dense", "ij->ji", (CD,)))
    return out


CASES = {c.id: c for c in _cases()}

# Shape variants: extents per index letter, density of sparse operands, extras.
_SMALL = dict(i=5, j=4, k=3, l=2, b=2)
VARIANTS = {
    "small": dict(ext=_SMALL, density=0.4),
    "size1": dict(ext=dict(i=1, j=1, k=1, l=1, b=1), density=1.0),
    "nnz0": dict(ext=_SMALL, density=0.0),
    "empty-slices": dict(ext=dict(i=6, j=5, k=4, l=3, b=3), density=0.6, empty=True),
    "one-row": dict(ext=dict(i=1, j=6, k=4, l=3, b=1), density=0.5),
    "size0": dict(ext=dict(i=0, j=4, k=3, l=2, b=2), density=0.5),
    "random-values": dict(ext=dict(i=7, j=6, k=5, l=3, b=2), density=0.5, integer=False),
}
# BSR needs extents divisible by its block size (2, 2).
BSR_VARIANTS = {
    "small": dict(ext=dict(i=4, j=6, k=2, l=2, b=2), density=0.4),
    "one-block": dict(ext=dict(i=2, j=2, k=2, l=2, b=2), density=1.0),
    "nnz0": dict(ext=dict(i=4, j=6, k=2, l=2, b=2), density=0.0),
    "empty-slices": dict(ext=dict(i=6, j=8, k=4, l=2, b=2), density=0.6, empty=True),
    "size0": dict(ext=dict(i=0, j=4, k=2, l=2, b=2), density=0.5),
    "random-values": dict(ext=dict(i=8, j=6, k=4, l=2, b=2), density=0.5, integer=False),
}


def build_operands(case: Case, variant: str, dtype, index_dtype):
    spec = (BSR_VARIANTS if BSR in case.fmts else VARIANTS)[variant]
    ext = dict(spec["ext"])
    if case.square:
        ext = {k: ext["i"] for k in ext}
    gen = torch.Generator().manual_seed(seed_of(case.id, variant, str(dtype)))
    lhs = case.eq.split("->")[0].split(",")
    ops = []
    for term, fmt in zip(lhs, case.fmts):
        if fmt == SAME0:
            ops.append(ops[0])
            continue
        shape = tuple(ext[c] for c in term)
        sparse = fmt is not None
        x = random_dense(shape, spec["density"] if sparse else 0.9, dtype, gen,
                         integer=spec.get("integer", True),
                         empty_slices=sparse and spec.get("empty", False))
        ops.append(make_operand(x, fmt, index_dtype if sparse else None))
    return ops


def run_case(case_id: str, dtype_name: str = "float64", index_name: str = "int32",
             variants=None):
    case = CASES[case_id]
    dtype, index_dtype = getattr(torch, dtype_name), getattr(torch, index_name)
    table = BSR_VARIANTS if BSR in case.fmts else VARIANTS
    for variant in variants or table:
        ops = build_operands(case, variant, dtype, index_dtype)
        try:
            check_against_dense(case.eq, ops, kind=case.kind)
        except AssertionError as e:
            raise AssertionError(f"{case.id} variant {variant!r} ({dtype_name}, "
                                 f"{index_name} indices): {e}") from e


# Known bugs, by case id: (reason, isolate). isolate=True: the bug crashes the interpreter,
# so the case runs in a subprocess and fails there instead of killing the test run.
# Key: case id, or (case id, dtype name, index dtype name). Empty: no known bug today.
KNOWN: dict = {}


def _params(ids, dtype_name="float64", index_name="int32"):
    out = []
    for cid in ids:
        marks = ()
        known = KNOWN.get((cid, dtype_name, index_name)) or KNOWN.get(cid)
        if known is not None:
            marks = (pytest.mark.xfail(strict=True, reason=known[0]),)
        out.append(pytest.param(cid, dtype_name, index_name, id=f"{cid}-{dtype_name}-"
                                f"{index_name}", marks=marks))
    return out


def _run_maybe_isolated(cid, dtype_name, index_name):
    known = KNOWN.get((cid, dtype_name, index_name)) or KNOWN.get(cid)
    if known is not None and known[1]:
        run_isolated(f"import test_einsum as T; T.run_case({cid!r}, {dtype_name!r}, "
                     f"{index_name!r})")
    else:
        run_case(cid, dtype_name, index_name)


@pytest.mark.parametrize("cid,dtype_name,index_name", _params(CASES))
def test_einsum_matches_torch(cid, dtype_name, index_name):
    _run_maybe_isolated(cid, dtype_name, index_name)


# float32 and int64 indices on a representative subset (each is another kernel to build).
_F32_IDS = [c.id for c in _cases() if (
    (c.name in ("spmv", "spmm-sparse-left", "spmm-sparse-right", "sddmm", "transpose",
                "total-sum") and c.fmts[0] in ("csr", "coo", "dcsc", None)
     and all(f in ("csr", "coo", "dcsc", None) for f in c.fmts))
    or (c.name == "spgemm" and c.fmts in (("csr", "csr"), ("csc", "dcsr"), ("coo", "coo")))
    or (c.name in ("mttkrp", "ttv", "batched-sparse-left") and c.fmts[0] in (CSF, "coo"))
    or c.name in ("outer", "inner") and c.fmts in (("csf", "csf"), ("csr", "csc"))
    or c.name in ("spmv", "sddmm") and c.fmts[0] == BSR)]
_I64_IDS = [c.id for c in _cases() if (
    (c.name in ("spmv", "spmm-sparse-left", "sddmm", "transpose") and c.fmts[0] in
     ("csr", "csc", "coo", "dcsr"))
    or (c.name == "spgemm" and c.fmts in (("csr", "csr"), ("csr", "csc"), ("dcsr", "coo")))
    or (c.name in ("mttkrp", "ttv") and c.fmts[0] in (CSF, "coo", CSF201))
    or (c.name == "spmv" and c.fmts[0] == BSR))]
# Integer values where einsum makes sense for them (no rounding: compared exactly).
_INT_IDS = [c.id for c in _cases() if (
    (c.name in ("spmv", "spmm-sparse-left", "spgemm", "total-sum", "row-sums")
     and c.fmts[0] in ("csr", "coo", "dcsc") and all(f in ("csr", "coo", "dcsc", None)
                                                      for f in c.fmts)
     and (c.name != "spgemm" or c.fmts[0] == c.fmts[1])))]


@pytest.mark.parametrize("cid,dtype_name,index_name", _params(_F32_IDS, "float32"))
def test_einsum_float32(cid, dtype_name, index_name):
    _run_maybe_isolated(cid, dtype_name, index_name)


@pytest.mark.parametrize("cid,dtype_name,index_name", _params(_I64_IDS, "float64", "int64"))
def test_einsum_int64_indices(cid, dtype_name, index_name):
    _run_maybe_isolated(cid, dtype_name, index_name)


@pytest.mark.parametrize("cid,dtype_name,index_name", _params(_INT_IDS, "int64"))
def test_einsum_int64_values(cid, dtype_name, index_name):
    _run_maybe_isolated(cid, dtype_name, index_name)


def test_case_tables_are_not_empty():
    assert len(_F32_IDS) >= 15 and len(_I64_IDS) >= 12 and len(_INT_IDS) >= 8


def test_mixed_index_dtypes():
    """One operand with int32 indices, the other with int64 (the kernel takes both)."""
    gen = torch.Generator().manual_seed(1)
    a = random_dense((5, 4), 0.5, F64, gen)
    b = random_dense((4, 6), 0.5, F64, gen)
    A = st.tensor(a, "csr", index_dtype=torch.int32)
    B = st.tensor(b, "csr", index_dtype=torch.int64)
    check_against_dense("ij,jk->ik", [A, B])
    check_against_dense("ij,ij->ij", [A, st.tensor(a, "coo", index_dtype=torch.int64)])


def test_dense_operand_views_and_float16_fallback():
    gen = torch.Generator().manual_seed(2)
    A = st.tensor(random_dense((5, 4), 0.5, F64, gen), "csr")
    wide = torch.randn(6, 8, dtype=F64, generator=gen)
    check_against_dense("ij,jk->ik", [A, wide[2:6, ::2]])      # strided, offset view
    check_against_dense("ij,jk->ik", [A, torch.randn(3, 4, dtype=F64).T])  # transposed
    # float16 values are not compiled; they run through the torch path and still match.
    h = random_dense((5, 4), 0.5, torch.float16, gen)
    check_against_dense("ij,j->i", [st.tensor(h, "csr"), torch.ones(4, dtype=torch.float16)])


def test_coo_3d_by_name():
    """The named 'coo' format of a 3-D tensor, what MTTKRP users write. Regression: it was
    rejected (a unique singleton in the middle of the COO chain)."""
    t = random_dense((3, 4, 5), 0.4, F64, torch.Generator().manual_seed(3))
    T = st.tensor(t, "coo")
    check_against_dense("ikl,kj,lj->ij", [T, torch.ones(4, 2, dtype=F64),
                                          torch.ones(5, 2, dtype=F64)])
    assert T.format == COO3
    check_against_dense("ijk,k->ij", [T, torch.ones(5, dtype=F64)], out_format="coo")


# -- out_format overrides ----------------------------------------------------------------------
def _pair(seed, shape_a=(5, 4), shape_b=(4, 6), da=0.4, db=0.4):
    gen = torch.Generator().manual_seed(seed)
    return random_dense(shape_a, da, F64, gen), random_dense(shape_b, db, F64, gen)


@pytest.mark.parametrize("out", ["csr", "csc", "coo", "dcsr", "dcsc", "dense", CD, DENSE_T,
                                 st.Format((st.compressed, st.compressed), (1, 0))],
                         ids=fmt_label)
@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("csc", "coo")])
def test_spgemm_out_format(fa, fb, out):
    a, b = _pair(10)
    r = check_against_dense("ij,jk->ik", [st.tensor(a, fa), st.tensor(b, fb)], out_format=out)
    if isinstance(out, st.Format):
        assert type(r) is torch.Tensor if out.is_dense else r.format == out
    elif out != "dense":
        assert r.format.name == out


@pytest.mark.parametrize("out", [None, "csr", "csc", "coo", "dense"])
def test_sddmm_out_format(out):
    gen = torch.Generator().manual_seed(11)
    a = random_dense((6, 5), 0.4, F64, gen)
    x, y = torch.randn(6, 3, dtype=F64, generator=gen), torch.randn(5, 3, dtype=F64,
                                                                    generator=gen)
    A = st.tensor(a, "csr")
    r = check_against_dense("ij,ik,jk->ij", [A, x, y], out_format=out,
                            same_pattern_as=A if out in (None, "csr", "csc", "coo") else None)
    if out is None:   # sampled: exactly A's pattern and format
        assert r.format.name == "csr"
        for name, arr in A.arrays.items():
            assert torch.equal(r.arrays[name], arr)


@pytest.mark.parametrize("eq,fmts,out", [
    ("ij,j->i", ("csr", None), "coo"),        # dense by inference, sparse on request
    ("ij,j->i", ("csc", None), "dense"),      # sparse by inference, dense on request
    ("ij,jk->ik", ("csr", None), "csr"),      # SpMM into a sparse result
    ("ij->ji", ("csr",), "csr"),              # transpose written in the other order
    ("ij->ji", ("csr",), "dense"),
    ("ijk,k->ij", (CSF, None), "csc"),
    ("ijk->kij", (CSF,), "coo"),
    ("i,j->ij", ("csf", "csf"), "csc"),
    # no sparse operand into CSR rows (raised StopIteration: the rows emitted took the
    # index type of a sparse operand there was none of)
    ("ij->ij", (None,), "csr"),
    ("ij,jk->ik", (None, None), "csr"),
    ("k,ik->ik", (st.Format((st.dense,)), None), "csr"),
])
def test_out_format_overrides(eq, fmts, out):
    gen = torch.Generator().manual_seed(seed_of(eq, fmts))
    lhs = eq.split("->")[0].split(",")
    ext = dict(i=5, j=4, k=3)
    ops = [make_operand(random_dense(tuple(ext[c] for c in term), 0.5, F64, gen), f)
           for term, f in zip(lhs, fmts)]
    r = check_against_dense(eq, ops, out_format=out)
    if isinstance(out, st.Format):
        assert r.format == out
    elif out != "dense":
        assert r.format.name == out


@pytest.mark.parametrize("out,exc", [
    ("nope", ValueError),                                   # unknown name
    (("bsr"), ValueError),                                  # bsr without a block size
    (st.Format((st.dense, st.compressed, st.dense, st.dense), blocksize=(2, 2)),
     NotImplementedError),                                  # blocked outputs: not yet
    (st.Format((st.compressed,) * 3), ValueError),          # wrong order
])
def test_bad_out_format(out, exc):
    a, b = _pair(12, (4, 4), (4, 4))
    with pytest.raises(exc):
        st.einsum("ij,jk->ik", st.tensor(a, "csr"), st.tensor(b, "csr"), out_format=out)


def test_out_format_on_scalar_result_is_an_error():
    a, _ = _pair(13)
    A = st.tensor(a, "csr")
    with pytest.raises(ValueError, match="scalar"):
        st.einsum("ij,ij->", A, A, out_format="csr")
    with pytest.raises(ValueError):
        st.einsum("ij,j->i", A, torch.ones(4, dtype=F64), out_format="csr")  # 2-D format, 1-D


# -- the pure-torch backend --------------------------------------------------------------------
FALLBACK_IDS = [c.id for c in _cases() if (
    (c.name in ("spmv", "sddmm", "transpose", "row-sums", "total-sum") and c.fmts[0] in
     ("csr", "csc", "coo", "dcsr"))
    or (c.name == "spgemm" and c.fmts in (("csr", "csr"), ("csr", "csc"), ("coo", "dcsc")))
    or (c.name in ("mttkrp", "ttv", "batched-sparse-left") and c.fmts[0] in (CSF, "coo", CSF201))
    or c.name in ("outer", "inner", "implicit-spgemm", "spmm-sparse-right")
    and "dense" not in c.fmts and BSR not in c.fmts)]


@pytest.mark.parametrize("cid", FALLBACK_IDS)
def test_torch_backend_matches_torch(cid, monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    builds = st.runtime.stats()["builds"]
    run_case(cid, "float64", "int32")
    assert st.runtime.stats()["builds"] == builds, "the torch backend must not compile"


@pytest.mark.parametrize("eq,fmts", [("ij,jk->ik", ("csr", "csr")), ("ij,jk->ik", ("csr", None)),
                                     ("ij,ik,jk->ij", ("csr", None, None)),
                                     ("ij,j->i", ("csc", None)), ("ij->ji", ("coo",)),
                                     ("ijk,k->ij", (CSF201, None))])
def test_torch_backend_gives_same_kinds_and_formats(eq, fmts, monkeypatch):
    gen = torch.Generator().manual_seed(seed_of(eq, fmts))
    ext = dict(i=5, j=4, k=3)
    ops = [make_operand(random_dense(tuple(ext[c] for c in term), 0.5, F64, gen), f)
           for term, f in zip(eq.split("->")[0].split(","), fmts)]
    r_c = st.einsum(eq, *ops)
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    r_t = st.einsum(eq, *ops)
    assert type(r_c) is type(r_t)
    if isinstance(r_c, st.SparseTensor):
        assert r_c.format == r_t.format
        torch.testing.assert_close(r_c.to_dense(), r_t.to_dense(), rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(r_c, r_t, rtol=1e-10, atol=1e-12)


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BACKEND", "fortran")
    with pytest.raises(ValueError, match="SPARSETORCH_BACKEND"):
        st.einsum("ij,j->i", st.tensor(torch.eye(3, dtype=F64), "csr"), torch.ones(3,
                                                                                   dtype=F64))


def test_missing_compiler_names_cc_and_torch_backend_still_works(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSETORCH_CACHE", str(tmp_path / "fresh-cache"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    st.runtime.clear_cache(disk=False)
    forget_call_memo()
    gen = torch.Generator().manual_seed(30)
    p = st.tensor(random_dense((4, 3), 0.5, F64, gen), "dcsr")
    q = torch.randn(3, 2, dtype=F64, generator=gen)
    try:
        with pytest.raises(RuntimeError, match="CC") as info:
            st.einsum("pq,qr->pr", p, q)       # letters no other test uses: a new kernel
        assert "SPARSETORCH_BACKEND" in str(info.value)      # and it names the fallback
        monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
        check_against_dense("pq,qr->pr", [p, q])
    finally:
        monkeypatch.delenv("CC")
        st.runtime.clear_cache(disk=False)
        forget_call_memo()


# -- regression tests, each naming the bug it guards ----------------------------------------------
@pytest.mark.parametrize("n,m", [(1, 1), (9, 17), (20, 3)])
@pytest.mark.parametrize("out", ["", "j"])
def test_sum_across_stored_entries_is_not_jammed(n, m, out):
    """Regression (long hypothesis run): ``i,ij->`` over a sparse vector and a column-major
    dense matrix sums every stored entry's inner loop into one scalar. The side-by-side sums
    (``jam.jam_sums``) took it for per-entry sums and wrote ``reduction(+:acc1, acc1, ...)``,
    which the C compiler rejects."""
    gen = torch.Generator().manual_seed(n * 100 + m)
    for density in (0.0, 0.6, 1.0):
        a = st.tensor(random_dense((n,), density, F64, gen), "csf")
        b = st.tensor(random_dense((n, m), 0.8, F64, gen), DENSE_T)
        check_against_dense(f"i,ij->{out}", [a, b])


@pytest.mark.parametrize("eq,fa,fb", [("ij,ij->ij", "csr", "coo"), ("ij,ij->ij", "dcsr", "csr"),
                                      ("ij,ji->ij", "csr", "csr")])
def test_sparse_product_stores_intersection(eq, fa, fb):
    """Regression: a product of two sparse operands indexed like the output was 'sampled' on
    the first operand and stored its whole pattern (explicit zeros), not the intersection."""
    gen = torch.Generator().manual_seed(40)
    a = random_dense((6, 6), 0.6, F64, gen)
    b = random_dense((6, 6), 0.3, F64, gen)
    check_against_dense(eq, [st.tensor(a, fa), st.tensor(b, fb)])


@pytest.mark.slow   # (a fresh process each, ~5 s)
@pytest.mark.parametrize("eq,fa,fb", [("ij,jk->ik", "csr", "csc"), ("ij,ji->ij", "csr", "csr")])
def test_conversion_keeps_int64_indices(eq, fa, fb):
    """Regression: an operand the schedule converted came back with int32 indices while the
    kernel was built for int64 (garbage reads, segfault). Isolated: a crash fails one test."""
    run_isolated(f"""
        import torch, sparsetorch as st
        from dense_check import check_against_dense, random_dense
        gen = torch.Generator().manual_seed(41)
        a = random_dense((5, 5), 0.5, torch.float64, gen)
        b = random_dense((5, 5), 0.5, torch.float64, gen)
        A = st.tensor(a, {fa!r}, index_dtype=torch.int64)
        B = st.tensor(b, {fb!r}, index_dtype=torch.int64)
        assert st.explain({eq!r}, A, B).conversions        # the schedule converts one
        check_against_dense({eq!r}, [A, B], kind="sparse")
        """)


# -- sizes that take the parallel and hashed-workspace paths -----------------------------------
@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("eq,fmts", [
    ("ij,jk->ik", ("csr", None)), ("ij,jk->ik", ("csr", "csr")), ("ij,jk->ik", ("coo", "dcsc")),
    ("ij,ik,jk->ij", ("csr", None, None)), ("ij,j->i", ("csc", None)), ("ij->j", ("csr",)),
    ("ijk,kl->ijl", (CSF, None)), ("ij,ij->", ("dcsr", "csr"))])
def test_large_operands_take_the_threaded_path(eq, fmts, two_threads):
    """Enough work that kernels run their OpenMP loops on several threads."""
    ext = dict(i=400, j=300, k=200, l=48) if "ijk" not in eq else dict(i=40, j=30, k=50, l=48)
    if eq == "ij,jk->ik" and fmts[1] is None:
        ext["k"] = 64
    gen = torch.Generator().manual_seed(seed_of(eq, fmts))
    ops = [make_operand(random_dense(tuple(ext[c] for c in t), 0.05 if f else 1.0, F64, gen,
                                     integer=False), f)
           for t, f in zip(eq.split("->")[0].split(","), fmts)]
    assert st.runtime.num_threads() == 2
    check_against_dense(eq, ops, kind="sparse" if fmts == ("csr", "csr") else None)


def test_concurrent_calls_from_threads():
    """Python threads calling einsum at once (kernels release the GIL) all get right answers,
    including while the first of them are still building kernels."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(50)
    jobs = []
    for n, (eq, fmts) in enumerate([("ab,bc->ac", ("csr", None)), ("ab,bc->ac", ("dcsr", "csr")),
                                    ("ab,b->a", ("coo", None)), ("ab->ba", ("csc",))] * 3):
        ext = dict(a=30, b=20, c=10)
        ops = [make_operand(random_dense(tuple(ext[c] for c in t), 0.3 if f else 1.0, F64,
                                         gen), f)
               for t, f in zip(eq.split("->")[0].split(","), fmts)]
        jobs.append((eq, ops))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: st.einsum(job[0], *job[1]), jobs))
    for (eq, ops), r in zip(jobs, results):
        want = torch.einsum(eq, *[to_dense(o) for o in ops])
        torch.testing.assert_close(to_dense(r), want, rtol=1e-10, atol=1e-10)


def _reversed_rows(d: torch.Tensor, fmt: str) -> st.SparseTensor:
    """``d`` in ``fmt`` (CSR or DCSR) with each row's entries stored last column first, its
    column level declared unordered (``from_levels``: the formats only such a call builds)."""
    A = st.tensor(d, format=fmt)
    pos, crd, vals = A.arrays["pos1"], A.arrays["crd1"].clone(), A.values.clone()
    for r in range(pos.numel() - 1):
        s, e = int(pos[r]), int(pos[r + 1])
        crd[s:e], vals[s:e] = crd[s:e].flip(0), vals[s:e].flip(0)
    levels = (*A.format.levels[:-1], dataclasses.replace(A.format.levels[-1], ordered=False))
    return st.SparseTensor.from_levels(d.shape, st.Format(levels), {**A.arrays, "crd1": crd},
                                       vals)


@pytest.mark.parametrize("fmt", ["csr", "dcsr"])
def test_operands_with_unordered_rows(fmt):
    """A compressed level declared unordered is sorted before any kernel walks it: merges
    of two sparse operands (their sum and product) read coordinates in order. Each call
    twice, after the same call on ordered operands: no memo or shim of those may take it."""
    g = torch.Generator().manual_seed(3)
    d, e = (torch.randn(9, 12, generator=g) * (torch.rand(9, 12, generator=g) < 0.5)
            for _ in range(2))
    d[4] = 0   # an empty row
    U, B, x = _reversed_rows(d, fmt), st.tensor(e, format="csr"), torch.randn(12, 3)
    assert not U.format.levels[-1].ordered and torch.equal(U.to_dense(), d)
    cases = [(lambda a, b: a + b, d + e), (lambda a, b: a * b, d * e),
             (lambda a, b: st.einsum("ij,ij->ij", b, a), d * e),
             (lambda a, b: a @ b.t(), d @ e.T), (lambda a, b: a @ x, d @ x),
             (lambda a, b: st.einsum("ij,ik,jk->ij", a, x.T[:, :9].T, x), d * (x[:9] @ x.T))]
    for f, want in cases:
        f(st.tensor(d, format=fmt), B)
        for _ in range(2):
            got = f(U, B)
            got = got.to_dense() if isinstance(got, st.SparseTensor) else got
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_less_common_but_valid_einsums():
    gen = torch.Generator().manual_seed(60)
    A = st.tensor(random_dense((5, 4), 0.5, F64, gen), "csr")
    B = st.tensor(random_dense((3, 2), 0.5, F64, gen), "coo")
    check_against_dense("ij,->ij", [A, torch.tensor(2.5, dtype=F64)])     # 0-d operand
    check_against_dense("IJ,J->I", [A, torch.ones(4, dtype=F64)])          # capital letters
    check_against_dense("ij,kl->ijkl", [A, B])                             # order-4 result
    check_against_dense("ij,kl->ljik", [A, B], out_format="coo")
    check_against_dense("ij,jk->ik", [A, st.tensor(random_dense((4, 3), 0.5, F64, gen), "csc")],
                        out_format=[st.dense, st.compressed])              # levels as a list
    T4 = st.tensor(random_dense((2, 3, 2, 3), 0.5, F64, gen), "csf")
    check_against_dense("ijkl->li", [T4])                                  # 4-D operand
    check_against_dense("ijkl,jl->ik", [T4, torch.randn(3, 3, dtype=F64)])
    check_against_dense("ij,ij,ij->ij", [A, A, A])                         # three times


def test_nan_in_stored_entries_propagates():
    nan = float("nan")
    A = st.tensor(torch.tensor([[nan, 1.0, 0.0], [0.0, 2.0, 0.0]], dtype=F64), "csr")
    check_against_dense("ij,j->i", [A, torch.ones(3, dtype=F64)])
    check_against_dense("ij,jk->ik", [A, torch.ones(3, 2, dtype=F64)])
    check_against_dense("ij->", [A])


def test_int32_values():
    gen = torch.Generator().manual_seed(61)
    A = st.tensor(random_dense((5, 4), 0.5, torch.int32, gen), "csr")
    check_against_dense("ij,j->i", [A, torch.arange(4, dtype=torch.int32)])
    check_against_dense("ij,jk->ik", [A, st.tensor(random_dense((4, 3), 0.5, torch.int32, gen),
                                                   "csr")], kind="sparse")


@pytest.mark.parametrize("fmt", ["dcsr", "coo"])
def test_dimensions_beyond_int32(fmt):
    """3e9 rows: coordinates need int64 indices end to end (no level is dense)."""
    n = 3_000_000_000
    idx = torch.tensor([[0, 5, n - 1, n - 1], [1, 0, 2, 3]])
    A = st.tensor((idx, torch.tensor([1.0, 2, 3, 4], dtype=F64)), shape=(n, 4), format=fmt)
    assert A.index_dtype == torch.int64
    x = torch.tensor([1.0, 10, 100, 1000], dtype=F64)
    cases = [("ij,j->i", [A, x], ([[0, 5, n - 1]], [10.0, 2.0, 4300.0])),
             ("ij->ji", [A], ([[0, 1, 2, 3], [5, 0, n - 1, n - 1]], [2.0, 1.0, 3.0, 4.0])),
             ("ij,ij->ij", [A, A], ([[0, 5, n - 1, n - 1], [1, 0, 2, 3]], [1.0, 4, 9, 16]))]
    for eq, ops, (coords, values) in cases:
        r = st.einsum(eq, *ops)
        assert isinstance(r, st.SparseTensor) and r.index_dtype == torch.int64
        st.SparseTensor.from_levels(r.shape, r.format, r.arrays, r.values, check=True)
        c = r.to_torch().to_sparse_coo().coalesce()
        assert c.indices().tolist() == coords and c.values().tolist() == values


def test_inferred_coo_like_output_is_valid():
    """Regression (found by the fuzzer): format inference built an invalid Format for a
    COO-like result with a run of singleton levels (a unique singleton mid-run, 'repaired'
    into a compressed level below a non-unique one): ValueError."""
    ones = lambda *s: torch.ones(s, dtype=F64)  # noqa: E731
    check_against_dense("ki,k,ijl->ijkl", [st.tensor(ones(2, 2), "csr"),
                                            st.tensor(ones(2), "csf"),
                                            st.tensor(ones(2, 2, 2), "coo")])


# Level lists with a dense level above a compressed one below the top: the compressed
# level is iterated from the position of every level above it.
_DENSE_ABOVE = [(st.dense, st.dense, st.compressed), (st.compressed, st.dense, st.compressed),
                (st.dense, st.dense, st.Compressed(unique=False), st.singleton)]


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (1, 2, 0), (2, 1, 0)])
@pytest.mark.parametrize("levels", _DENSE_ABOVE[:2], ids=["ddc", "cdc"])
def test_dense_levels_above_a_compressed_one(levels, order):
    """Regression (found by the fuzzer): the compressed level's parent position was taken
    before the dense levels above it were bound (``(dense, dense, compressed)``: a loop
    order with i after k), so reductions, permutations and even a copy read the wrong
    entries, and some wrote out of bounds."""
    fmt = st.Format(levels, mode_order=order)
    gen = torch.Generator().manual_seed(seed_of("dense-above", levels, order))
    for shape in [(2, 2, 2), (3, 4, 2), (4, 1, 5)]:
        W = st.tensor(random_dense(shape, 0.5, F64, gen, empty_slices=True), format=fmt)
        for eq in ["ijk->i", "ijk->j", "ijk->", "ijk->kji", "ijk->ijk"]:
            check_against_dense(eq, [W], out_format="dense" if eq == "ijk->ijk" else None)
        check_against_dense("ijk,k->ij", [W, torch.randn(shape[2], dtype=F64,
                                                           generator=gen)])


def test_dense_levels_above_a_coo_run():
    """The 4-D case: two dense levels above a non-unique compressed and a singleton level,
    reversed mode order (wrote out of bounds before the fix), and an outer product whose
    inferred format puts dense levels above a compressed one, reduced again."""
    fmt = st.Format(_DENSE_ABOVE[2], mode_order=(3, 2, 1, 0))
    gen = torch.Generator().manual_seed(4)
    W = st.tensor(random_dense((2, 3, 2, 3), 0.5, F64, gen), format=fmt)
    check_against_dense("ijkl->ijkl", [W], out_format="dense")
    check_against_dense("ijkl->li", [W])
    A = st.tensor(random_dense((4, 3), 0.5, F64, gen), format="csr")
    out = st.einsum("lk,j->jkl", A, st.tensor(torch.tensor([2., -1.], dtype=F64), "coo"))
    check_against_dense("jkl->j", [out])


@pytest.mark.slow
@pytest.mark.parametrize("order", [(0, 2, 1), (1, 2, 0)])
def test_gradient_through_dense_levels_above_a_compressed_one(order):
    """The sampled gradient of such an operand lands on its own pattern (it raised 'stores
    entries outside its operand's pattern' before the fix) and equals the dense gradient
    there."""
    gen = torch.Generator().manual_seed(seed_of("dense-above-grad", order))
    d = random_dense((2, 3, 2), 0.6, F64, gen)
    A = st.tensor(d, format=st.Format((st.dense, st.dense, st.compressed), mode_order=order))
    A.requires_grad_()
    x = torch.randn(2, dtype=F64, generator=gen, requires_grad=True)
    dd = d.clone().requires_grad_()
    (st.einsum("lji,i->lj", A, x) ** 2).sum().backward()   # (a sparse result)
    torch.einsum("lji,i->lj", dd, x.detach()).square().sum().backward()
    assert torch.allclose(A.grad.to_dense(), dd.grad * (d != 0), rtol=1e-10, atol=1e-12)
