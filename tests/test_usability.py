"""What a new user meets first (issue 31, "the first hour"): constructors, saving and loading,
the errors of unsupported ops, and explain's summary. Each test names what it guards."""
import io
import subprocess
import sys

import pytest
import torch

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401  (fixture)

FORMATS = [("csr", None), ("csc", None), ("coo", None), ("dcsr", None), ("bsr", (2, 2))]


# -- st.eye, st.random ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bs", FORMATS)
@pytest.mark.parametrize("n,m", [(4, None), (6, 4)])
def test_eye_matches_torch_eye(fmt, bs, n, m):
    if bs and (n % 2 or (m or n) % 2):
        pytest.skip("blocks must tile the shape")
    I = st.eye(n, m, format=fmt, blocksize=bs, dtype=torch.float64)
    ref = torch.eye(n, n if m is None else m, dtype=torch.float64)
    assert I.format.name == fmt and I.dtype == torch.float64
    assert torch.equal(I.to_dense(), ref)


@pytest.mark.parametrize("fmt,bs", FORMATS)
@pytest.mark.parametrize("shape,density", [((8, 6), 0.0), ((4, 4), 1.0), ((6, 4), 0.3),
                                           ((3, 4, 5), 0.2)])
def test_random_has_the_exact_count_of_distinct_entries(fmt, bs, shape, density):
    if bs and (len(shape) != 2 or shape[0] % 2 or shape[1] % 2):
        pytest.skip("blocks must tile a matrix")
    if fmt != "coo" and len(shape) != 2:
        pytest.skip("matrix format")
    gen = torch.Generator().manual_seed(3)
    A = st.random(shape, density, format=fmt, blocksize=bs, generator=gen)
    d = A.to_dense()
    count = round(density * d.numel())
    assert int((d != 0).sum()) == count            # values in (0, 1): none is a zero
    assert float(d.min()) >= 0 and float(d.max()) < 1
    again = st.random(shape, density, format=fmt, blocksize=bs,
                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.to_dense(), d)        # reproducible from the generator


def test_random_of_a_huge_shape_allocates_only_its_entries():
    A = st.random((10**7, 10**7), 1e-9, generator=torch.Generator().manual_seed(0))
    assert A.nnz == 100000 and A.format.name == "csr"
    rows = torch.repeat_interleave(torch.arange(A.shape[0]), A.arrays["pos1"].diff())
    flat = rows * A.shape[1] + A.arrays["crd1"].long()
    assert flat.unique().numel() == A.nnz


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True])
def test_random_rejects_a_bad_density(bad):
    with pytest.raises(ValueError, match="density"):
        st.random((3, 3), bad)


# -- saving and loading -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bs", FORMATS + [("dense", None)])
def test_torch_load_weights_only_restores_a_sparse_tensor(fmt, bs):
    """Regression: ``torch.load(weights_only=True)`` (torch's default) refused SparseTensor."""
    A = st.tensor(torch.tensor([[0., 2., 0., 1.], [3., 0., 0., 0.]]), format=fmt, blocksize=bs)
    buf = io.BytesIO()
    torch.save({"w": A}, buf)
    buf.seek(0)
    B = torch.load(buf, weights_only=True)["w"]
    assert B.format == A.format and torch.equal(B.to_dense(), A.to_dense())
    y = st.einsum("ij,j->i", B, torch.ones(4), out_format="dense")
    assert torch.equal(y, A.to_dense().sum(1))


@pytest.mark.parametrize("tamper,match", [
    (lambda A: A._level_arrays["crd1"].__setitem__(0, 9), "out of range"),
    (lambda A: A._level_arrays["pos1"].__setitem__(1, 5), "pos"),
])
def test_a_tampered_file_is_refused_not_run(tamper, match):
    """Regression: a loaded SparseTensor skipped validation, so an out-of-range coordinate in
    a file reached the kernels (which trust their arrays). The stored arrays are written
    here as a tampered file would hold them (``.arrays`` hands out copies)."""
    A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), format="csr")
    tamper(A)
    buf = io.BytesIO()
    torch.save(A, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match=match):
        torch.load(buf, weights_only=True)


# -- errors name what the user called ---------------------------------------------------------
@pytest.mark.parametrize("call,name", [
    (lambda A: torch.cat([A, A]), "torch.cat"),
    (lambda A: torch.sin(A), "torch.sin"),
    (lambda A: A.max(), "max"),
    (lambda A: A[0], "__getitem__"),
])
def test_unsupported_ops_are_named_as_called(call, name):
    """Regression: the error named ATen's op (``aten.empty_like``), and ``torch.cat``'s showed
    an empty format name (its operands sit in a list)."""
    A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), format="csr")
    with pytest.raises(NotImplementedError) as info:
        call(A)
    message = str(info.value)
    assert name in message and "(format csr)" in message and ".to_dense()" in message


# -- explain ----------------------------------------------------------------------------------
def test_explain_prints_a_summary_and_keeps_the_source():
    """Regression: ``print(st.explain(...))`` printed 273 lines (the C source) for a 2x2 SpMM."""
    A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), format="csr")
    e = st.explain("ij,jk->ik", A, torch.randn(2, 4))
    summary = str(e)
    assert len(summary.splitlines()) <= 15
    for part in ("loop order", "operands", "parallel", "tiles", ".full()"):
        assert part in summary
    assert "#include" in e.source and e.source in e.full() and e.loops in e.full()


@pytest.mark.slow   # ~3 s: a fresh interpreter (the full suite runs it)
def test_import_is_light_and_complete():
    """Regressions: ``st.bench`` raised AttributeError until ``import sparsetorch.bench``;
    a decorator in ``nn/attention.py`` imported ``torch._dynamo`` (and triton) on every
    ``import sparsetorch``, seconds of a user's start-up."""
    code = ("import sys, sparsetorch as st; print(callable(st.bench.compare), "
            "'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr
