"""``st.einsum`` as an API: its errors and ``st.explain``. The numerical coverage over
equations, formats, shapes and backends is in ``test_einsum.py``.
"""
from __future__ import annotations

import os

import pytest
import torch

import sparsetorch as st
from dense_check import (check_against_dense, forget_call_memo,  # noqa: F401
                         private_kernel_cache, random_dense, run_isolated)

F64, F32 = torch.float64, torch.float32
CSF201 = st.Format((st.compressed,) * 3, mode_order=(2, 0, 1))


def _pair(seed, shape_a=(5, 4), shape_b=(4, 6), da=0.4, db=0.4):
    gen = torch.Generator().manual_seed(seed)
    return random_dense(shape_a, da, F64, gen), random_dense(shape_b, db, F64, gen)


# -- errors ------------------------------------------------------------------------------------
def test_errors():
    a, b = _pair(14, (4, 4), (4, 4))
    A, B = st.tensor(a, "csr"), st.tensor(b, "csr")
    with pytest.raises(ValueError, match="size"):
        st.einsum("ij,j->i", A, torch.ones(3, dtype=F64))           # mismatched extents
    with pytest.raises(ValueError, match="size"):
        st.einsum("ij,jk->ik", A, st.tensor(torch.ones(3, 2, dtype=F64), "csr"))
    with pytest.raises(ValueError, match="operand"):
        st.einsum("ij,j->i", A)                                     # too few operands
    with pytest.raises(ValueError, match="operand"):
        st.einsum("ij->i", A, B)                                    # too many
    # float64 with float32 promotes as torch.result_type (issue 31 item 1), no error
    assert st.einsum("ij,j->i", A, torch.ones(4)).dtype == F64
    assert st.einsum("ij,jk->ik", A, st.tensor(b.float(), "csr")).dtype == F64
    with pytest.raises(ValueError, match="one size"):
        st.einsum("ii->i", st.tensor(torch.ones(2, 3, dtype=F64), "csr"))   # not square
    with pytest.raises(ValueError):
        st.einsum("ij,j->k", A, torch.ones(4, dtype=F64))           # output index unused
    with pytest.raises(ValueError):
        st.einsum("ij->ii", A)                                      # repeated output index
    with pytest.raises(ValueError):
        st.einsum("ijk,j->i", A, torch.ones(4, dtype=F64))          # order mismatch
    with pytest.raises(TypeError):
        st.einsum("ij,jk->ik", A, b.to_sparse())                    # raw torch.sparse
    # (found by a fuzzer: AttributeError, an unpacking error, 'int' is not iterable)
    for equation in (None, b"ij,jk->ik"):
        with pytest.raises(TypeError, match="must be a string"):
            st.einsum(equation, A, B)
    with pytest.raises(ValueError, match="more than one '->'"):
        st.einsum("ij,jk->ik->i", A, torch.ones(4, 2, dtype=F64))
    with pytest.raises(TypeError, match="out_format must be"):
        st.einsum("ij,jk->ik", A, B, out_format=5)
    # a scalar result is dense: out_format="dense" takes it, a sparse format is refused
    for t, d in ((A, a), (b, b)):
        torch.testing.assert_close(st.einsum("ij->", t, out_format="dense"), d.sum())
        with pytest.raises(ValueError, match="out_format='csr' was given but the result is "
                                             "a scalar"):
            st.einsum("ij->", t, out_format="csr")


def test_non_tensor_operand_is_a_type_error():
    """Regression: a list operand after the first gave ValueError 'operand 1 has -1
    dimensions' instead of a TypeError naming its type."""
    A = st.tensor(torch.eye(4, dtype=F64), "csr")
    with pytest.raises(TypeError, match="list"):
        st.einsum("ij,j->i", A, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match="ndarray"):
        st.einsum("ij,jk->ik", A, torch.ones(4, 4, dtype=F64).numpy())


def test_errors_are_raised_again_on_repeat():
    """An error must not be swallowed by a warm path (the second identical bad call)."""
    a, _ = _pair(15, (4, 4))
    A = st.tensor(a, "csr")
    good = torch.ones(4, dtype=F64)
    st.einsum("ij,j->i", A, good)
    for _ in range(2):
        with pytest.raises(ValueError):
            st.einsum("ij,j->i", A, torch.ones(5, dtype=F64))
        with pytest.raises(TypeError):
            st.einsum("ij,j->i", A, [1.0, 2.0, 3.0, 4.0])


def test_repeated_index_in_dense_operand_takes_the_diagonal():
    gen = torch.Generator().manual_seed(16)
    d = torch.randn(4, 4, dtype=F64, generator=gen)
    v = st.tensor(random_dense((4,), 0.5, F64, gen), "csf")
    check_against_dense("ii,i->i", [d, v])
    check_against_dense("ii->i", [d])
    check_against_dense("ij,ii->j", [d, d])


def test_trace_of_dense_operand():
    """Regression: a repeated index summed away ('ii->') was listed twice in
    Assignment.all_vars, so the generated C declared n_i twice and did not compile."""
    d = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(17))
    check_against_dense("ii->", [d])


def test_operands_as_a_list():
    a, _ = _pair(17)
    A, x = st.tensor(a, "csr"), torch.arange(4, dtype=F64)
    torch.testing.assert_close(st.einsum("ij,j->i", [A, x]), a @ x, rtol=1e-10, atol=0)


# -- explain -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_in_float32_and_explain_says_why_it_has_no_plan(dtype):
    """(A probe's findings: the fallback rounded each product to half precision before
    the sum, 4x torch.einsum's error; explain raised a bare KeyError.)"""
    g = torch.Generator().manual_seed(1)
    dense = ((torch.rand(4, 5, generator=g) < 0.5) * torch.randn(4, 5, generator=g) * 3)
    X = (torch.randn(5, 3, generator=g) * 3).to(dtype)
    A = st.tensor(dense.to(dtype), format="csr")
    exact = dense.to(dtype).double() @ X.double()
    ours = st.einsum("ij,jk->ik", A, X)
    assert ours.dtype == dtype   # (bfloat16 rounded before summing: 0.20 off, here 0.05)
    torch.testing.assert_close(ours, exact.to(dtype), rtol=0, atol=0)
    with pytest.raises(TypeError, match=f"explain: {dtype} operands run through the "
                                        "pure-PyTorch fallback"):
        st.explain("ij,jk->ik", A, X.to(dtype))


def test_explain_spmm():
    a, _ = _pair(20)
    A = st.tensor(a, "csr")
    e = st.explain("ij,jk->ik", A, torch.ones(4, 3, dtype=F64))
    assert e.loop_order == ("i", "j", "k")
    assert e.operand_formats == ("csr", "dense tensor")
    assert e.conversions == ()
    assert e.output_kind == "dense"
    assert "void kernel" in e.source and "#pragma omp" in e.source
    assert "for" in e.loops
    text = str(e)
    for word in ("loop order", "operands", "conversions", "output", "generated C", "loop IR"):
        assert word in text
    assert "C source:" in e.full() and e.source in e.full()


def test_explain_concordant_orders():
    a, _ = _pair(21, (4, 4))
    x = torch.ones(4, dtype=F64)
    assert st.explain("ij,j->i", st.tensor(a, "csr"), x).loop_order == ("i", "j")
    assert st.explain("ij,j->i", st.tensor(a, "csc"), x).loop_order == ("j", "i")
    t = st.tensor(random_dense((2, 3, 4), 0.5, F64, torch.Generator().manual_seed(0)), CSF201)
    e = st.explain("ijk,k->ij", t, x)
    assert e.loop_order == ("k", "i", "j") and e.conversions == ()


def test_explain_reports_conversion_for_discordant_product():
    """``ij,ji->ij`` with both CSR has no concordant order: one operand is converted."""
    a, b = _pair(22, (4, 4), (4, 4))
    A, B = st.tensor(a, "csr"), st.tensor(b, "csr")
    e = st.explain("ij,ji->ij", A, B)
    assert len(e.conversions) == 1
    n, fmt = e.conversions[0]
    assert n in (0, 1) and fmt.mode_order == (1, 0)
    assert "conversions:  operand" in str(e)
    check_against_dense("ij,ji->ij", [A, B])


def test_explain_csr_times_csc_converts_one_operand():
    a, b = _pair(23)
    e = st.explain("ij,jk->ik", st.tensor(a, "csr"), st.tensor(b, "csc"))
    assert len(e.conversions) == 1
    assert e.output_kind == "emit" and e.workspace     # Gustavson with a row workspace
    e2 = st.explain("ij,jk->ik", st.tensor(a, "csr"), st.tensor(b, "csr"))
    assert e2.conversions == () and e2.loop_order == ("i", "j", "k")
    assert e2.output_format == "csr"
    assert len(e2.workspace) == 1 and e2.workspace[0].split()[0] == "k"


def test_explain_sddmm_is_sampled():
    gen = torch.Generator().manual_seed(24)
    A = st.tensor(random_dense((5, 4), 0.5, F64, gen), "csr")
    e = st.explain("ij,ik,jk->ij", A, torch.ones(5, 3, dtype=F64), torch.ones(4, 3, dtype=F64))
    assert e.output_kind == "sampled" and e.output_format == "csr"


def test_explain_source_is_what_runs(private_kernel_cache):
    """The C source explain() shows is the one the runtime compiled and cached, followed
    there by its Python entry points (runtime/entry.py)."""
    a, _ = _pair(25)
    A = st.tensor(a, "dcsc")
    x = torch.ones(4, dtype=F64)
    e = st.explain("ij,j->i", A, x)
    st.einsum("ij,j->i", A, x)
    sources = [open(os.path.join(private_kernel_cache, f)).read()
               for f in os.listdir(private_kernel_cache) if f.endswith(".c")]
    assert any(s.startswith(e.source) and "st_py_bind" in s for s in sources)


def test_explain_reports_what_happens_to_a_bsr_operand():
    """Regression: explain() listed a BSR operand as 'csr', hiding its conversion."""
    a = random_dense((4, 6), 0.5, F64, torch.Generator().manual_seed(27))
    e = st.explain("ij,j->i", st.tensor(a, "bsr", blocksize=(2, 3)), torch.ones(6, dtype=F64))
    said = " ".join([e.operand_formats[0], *map(str, e.conversions), *e.notes]).lower()
    assert "bsr" in said or "block" in said


def test_explain_errors_like_einsum():
    a, _ = _pair(26)
    A = st.tensor(a, "csr")
    with pytest.raises(ValueError):
        st.explain("ij,j->i", A, torch.ones(3, dtype=F64))
    with pytest.raises(TypeError):
        st.explain("ij,j->i", A, torch.ones(4))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_compute_with_their_own_arrays(how):
    """Repeated calls read a SparseTensor's raw pointers once (``ops/shim.raw``); a copy made
    after such calls, by deepcopy or save and load, must use its own arrays, and in-place
    changes to values must be seen by the next call."""
    import copy
    import io

    A = st.tensor(torch.tensor([[1.0, 0, 2], [0, 3, 0]]), format="csr")
    x = torch.tensor([1.0, 1.0, 1.0])
    for _ in range(2):
        st.einsum("ij,j->i", A, x)
        st.einsum("ij,ik,jk->ij", A, torch.ones(2, 4), torch.ones(3, 4))
    if how == "deepcopy":
        B = copy.deepcopy(A)
    else:
        buf = io.BytesIO()
        torch.save(A, buf)
        buf.seek(0)
        B = torch.load(buf, weights_only=False)
    B.values.mul_(10)
    assert st.einsum("ij,j->i", B, x).tolist() == [30.0, 30.0]
    assert st.einsum("ij,ik,jk->ij", B, torch.ones(2, 4), torch.ones(3, 4)).values.tolist() \
        == [40.0, 80.0, 120.0]
    A.values.mul_(2)                      # in place: the same pointers, new numbers
    assert st.einsum("ij,j->i", A, x).tolist() == [6.0, 6.0]
    del A
    assert st.einsum("ij,j->i", B, x).tolist() == [30.0, 30.0]
