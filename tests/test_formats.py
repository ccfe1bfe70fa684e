"""Round trips between every pair of formats, and to/from numpy, scipy.sparse and torch.sparse,
all checked against the dense tensor. Bad input lives in test_validation.py."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from helpers import one_thread  # noqa: F401 (autouse fixture)
from helpers import (INDEX_DTYPES, VALUE_DTYPES, assert_same, blocks_fit, check_against_dense,
                     check_invariants, examples, expected_nnz, formats_for, random_dense,
                     resolve, stored_pattern)

warnings.filterwarnings("ignore", message=".*is in beta state.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@hst.composite
def dense_tensors(draw, ndim):
    """Small random tensors: size-0 and size-1 dimensions, nnz=0, empty rows, full."""
    shape = tuple(draw(hst.lists(hst.sampled_from([0, 1, 2, 3, 4, 6]), min_size=ndim,
                                 max_size=ndim)))
    density = draw(hst.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0]))
    dtype = draw(hst.sampled_from(VALUE_DTYPES))
    seed = draw(hst.integers(0, 2**16))
    return random_dense(shape, density, dtype, seed)


def _make(x, fmt, blocksize, index_dtype):
    """``st.tensor`` or the divisibility error it must raise."""
    f = resolve(fmt, x.dim(), blocksize)
    if not blocks_fit(x.shape, f):
        with pytest.raises(ValueError, match="not divisible by the block size"):
            st.tensor(x, format=fmt, blocksize=blocksize, index_dtype=index_dtype)
        return None
    return st.tensor(x, format=fmt, blocksize=blocksize, index_dtype=index_dtype)


def _labels(ndim):
    return [(ndim, label) for label, _, _ in formats_for(ndim)]


@pytest.mark.parametrize("ndim,source", _labels(1) + _labels(2) + _labels(3),
                         ids=lambda v: str(v))
@settings(max_examples=examples(12), **SETTINGS)
@given(data=hst.data())
def test_roundtrip_every_pair(ndim, source, data):
    x = data.draw(dense_tensors(ndim), label="x")
    index_dtype = data.draw(hst.sampled_from(INDEX_DTYPES), label="index_dtype")
    table = {label: (fmt, bs) for label, fmt, bs in formats_for(ndim)}
    fmt, bs = table[source]
    a = _make(x, fmt, bs, index_dtype)
    if a is None:
        return
    check_against_dense(a, x, index_dtype)
    a_entries = (x != 0) if a.format.is_dense else stored_pattern(a)
    for label, (tfmt, tbs) in table.items():
        target = resolve(tfmt, ndim, tbs)
        if not blocks_fit(x.shape, target):
            with pytest.raises(ValueError, match="not divisible by the block size"):
                a.asformat(tfmt, blocksize=tbs, index_dtype=index_dtype)
            continue
        b = a.asformat(tfmt, blocksize=tbs, index_dtype=index_dtype)
        assert b.format == target, (label, b.format)
        check_against_dense(b, x, index_dtype, pattern=a_entries)
        back = b.asformat(a.format, index_dtype=index_dtype)
        b_entries = (x != 0) if b.format.is_dense else stored_pattern(b)
        check_against_dense(back, x, index_dtype, pattern=b_entries)
        if torch.equal(stored_pattern(back), stored_pattern(a)):
            for name, arr in a.arrays.items():   # canonical storage: identical arrays back
                assert torch.equal(back.arrays[name], arr), (label, name)
            assert torch.equal(back.values, a.values), label


@settings(max_examples=examples(25), **SETTINGS)
@given(x=dense_tensors(2), index_dtype=hst.sampled_from(INDEX_DTYPES + (None,)))
def test_index_dtype_default_and_change(x, index_dtype):
    a = st.tensor(x, format="csr", index_dtype=index_dtype)
    assert a.index_dtype == (index_dtype or torch.int32)   # int32 when everything fits
    other = torch.int64 if a.index_dtype == torch.int32 else torch.int32
    b = a.asformat("csr", index_dtype=other)
    assert b.index_dtype == other and b.format == a.format
    check_against_dense(b, x, other)
    assert a.asformat("csr") is a
    for fmt in ["csc", "coo", "dcsr", "bsr"]:     # a conversion keeps the index dtype
        assert a.asformat(fmt, blocksize=(1, 1) if fmt == "bsr" else None).index_dtype == \
            a.index_dtype
        assert b.asformat(fmt, blocksize=(1, 1) if fmt == "bsr" else None).index_dtype == other


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "dense", "bsr"])
def test_empty_and_degenerate_shapes(fmt):
    bs = (1, 1) if fmt == "bsr" else None
    for shape in [(0, 0), (0, 5), (5, 0), (1, 1), (1, 7), (7, 1)]:
        for x in (torch.zeros(shape), torch.ones(shape)):
            a = st.tensor(x, format=fmt, blocksize=bs)
            check_against_dense(a, x)
            assert a.nnz == expected_nnz(x, a.format)


def test_coo_pair_sums_duplicates_in_any_order():
    idx = torch.tensor([[2, 0, 2, 1, 0, 2], [1, 3, 1, 0, 3, 1]])
    val = torch.tensor([1., 2., 3., 4., 5., 6.])
    expected = torch.zeros(3, 4)
    expected[2, 1], expected[0, 3], expected[1, 0] = 10., 7., 4.
    for fmt in ["csr", "csc", "coo", "dcsr", "dcsc", "csf", "dense"]:
        a = st.tensor((idx, val), shape=(3, 4), format=fmt)
        check_against_dense(a, expected)
    b = st.tensor((idx, val), format="coo")               # shape inferred from the maximum
    assert tuple(b.shape) == (3, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_coo_pair_sums_duplicates_in_every_value_dtype(dtype):
    idx = torch.tensor([[1, 0, 1, 1], [2, 1, 2, 2]])
    a = st.tensor((idx, torch.tensor([1, 2, 3, 4]).to(dtype)), shape=(2, 3), format="csr")
    expected = torch.tensor([[0, 2, 0], [0, 0, 8]]).to(dtype)
    check_against_dense(a, expected)


def test_coo_pair_3d_and_1d():
    idx = torch.tensor([[1, 0, 1], [2, 2, 2], [0, 1, 0]])
    val = torch.tensor([1, 2, 3])
    x = torch.zeros(2, 3, 2, dtype=torch.int64)
    x[1, 2, 0], x[0, 2, 1] = 4, 2
    for fmt in ["coo", "csf", "dense"]:
        check_against_dense(st.tensor((idx, val), shape=(2, 3, 2), format=fmt), x)
    v = st.tensor((torch.tensor([3, 0, 3]), torch.tensor([1., 2., 3.])), shape=(5,), format="coo")
    assert_same(v.to_dense(), torch.tensor([2., 0., 0., 4., 0.]))


def test_coo_pair_does_not_alias_user_values():
    val = torch.tensor([1., 2.])
    a = st.tensor((torch.tensor([[0, 1], [0, 1]]), val), shape=(2, 2), format="coo")
    val[0] = 100.
    assert a.to_dense()[0, 0] == 1.


# -- numpy ------------------------------------------------------------------------------------
@settings(max_examples=examples(40), **SETTINGS)
@given(x=dense_tensors(2), fmt=hst.sampled_from(["csr", "csc", "coo", "dcsc", "dense"]))
def test_numpy_roundtrip(x, fmt):
    arr = x.numpy()
    a = st.tensor(arr, format=fmt)
    check_against_dense(a, x)
    out = a.numpy()
    assert isinstance(out, np.ndarray) and out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)


# -- scipy.sparse -----------------------------------------------------------------------------
SCIPY_FORMATS = ["csr", "csc", "coo", "bsr"]


@settings(max_examples=examples(40), **SETTINGS)
@given(x=dense_tensors(2), kind=hst.sampled_from(SCIPY_FORMATS),
       target=hst.sampled_from(["csr", "csc", "coo", "dcsr", "dcsc", "dense", "bsr"]))
def test_from_scipy(x, kind, target):
    arr = x.numpy()
    m = sp.coo_array(arr).asformat(kind)
    bs = (1, 1) if target == "bsr" and kind != "bsr" else None
    a = st.tensor(m, format=target, blocksize=bs)
    stored = m.copy()
    stored.data[:] = 1          # scipy BSR stores explicit zeros in blocks; they are kept
    check_against_dense(a, x, pattern=torch.from_numpy(stored.toarray()))


@settings(max_examples=examples(40), **SETTINGS)
@given(x=dense_tensors(2), fmt=hst.sampled_from(["csr", "csc", "coo", "dcsr", "dcsc", "csf",
                                                 "dense", "bsr"]))
def test_to_scipy(x, fmt):
    bs = (1, 1) if fmt == "bsr" else None
    a = st.tensor(x, format=fmt, blocksize=bs)
    m = a.to_scipy()
    assert sp.issparse(m)
    expected_kind = fmt if fmt in SCIPY_FORMATS else "coo"
    assert m.format == expected_kind
    np.testing.assert_array_equal(m.toarray(), x.numpy())
    back = st.tensor(m, format=fmt, blocksize=bs)
    check_against_dense(back, x)


def test_scipy_bsr_keeps_blocksize():
    arr = np.arange(24, dtype=np.float64).reshape(4, 6)
    a = st.tensor(sp.bsr_array(arr, blocksize=(2, 3)), format="bsr")
    assert a.format.blocksize == (2, 3)
    check_against_dense(a, torch.from_numpy(arr))
    m = a.to_scipy()
    assert m.format == "bsr" and m.blocksize == (2, 3)


@pytest.mark.parametrize("kind", ["csr", "csc", "coo"])
def test_scipy_non_canonical_input_is_summed(kind):
    # duplicates and unsorted indices in every kind of scipy input
    rows = np.array([2, 0, 2, 1, 0, 2, 2])
    cols = np.array([3, 1, 0, 1, 1, 3, 0])
    vals = np.array([1., 2., 3., 4., 5., 6., 7.])
    expected = np.zeros((3, 4))
    np.add.at(expected, (rows, cols), vals)
    if kind == "coo":
        m = sp.coo_matrix((vals, (rows, cols)), shape=(3, 4))
    elif kind == "csr":
        order = np.argsort(rows, kind="stable")
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=3))])
        m = sp.csr_matrix((vals[order], cols[order], indptr), shape=(3, 4))
    else:
        order = np.argsort(cols, kind="stable")
        indptr = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=4))])
        m = sp.csc_matrix((vals[order], rows[order], indptr), shape=(3, 4))
    assert not m.has_canonical_format
    for fmt in ["csr", "csc", "coo", "dcsr"]:
        a = st.tensor(m, format=fmt)
        check_against_dense(a, torch.from_numpy(expected))


@pytest.mark.skipif(not hasattr(sp.coo_array((2, 2)), "coords"), reason="scipy without n-D COO")
def test_scipy_nd_coo():
    x = random_dense((3, 4, 2), 0.5, torch.float64, 4)
    nz = np.nonzero(x.numpy())
    m = sp.coo_array((x.numpy()[nz], nz), shape=(3, 4, 2))
    for fmt in ["coo", "csf", "dense"]:
        check_against_dense(st.tensor(m, format=fmt), x)
    v = sp.coo_array((np.array([1., 2.]), (np.array([3, 0]),)), shape=(5,))
    check_against_dense(st.tensor(v, format="coo"), torch.tensor([2., 0., 0., 1., 0.],
                                                                 dtype=torch.float64))


def test_scipy_index_and_value_dtypes():
    m = sp.random(20, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)
    m.indptr, m.indices = m.indptr.astype(np.int64), m.indices.astype(np.int64)
    a = st.tensor(m, format="csr")
    assert a.index_dtype == torch.int32 and a.dtype == torch.float32
    a = st.tensor(m, format="csr", index_dtype=torch.int64)
    assert a.index_dtype == torch.int64
    np.testing.assert_array_equal(a.to_scipy().toarray(), m.toarray())


# -- torch.sparse -----------------------------------------------------------------------------
TORCH_LAYOUTS = ["coo", "csr", "csc", "bsr", "bsc"]


def _to_torch_layout(x, layout):
    if layout == "coo":
        return x.to_sparse_coo()
    if layout == "csr":
        return x.to_sparse_csr()
    if layout == "csc":
        return x.to_sparse_csc()
    return x.to_sparse_bsr((1, 1)) if layout == "bsr" else x.to_sparse_bsc((1, 1))


@settings(max_examples=examples(40), **SETTINGS)
@given(x=dense_tensors(2), layout=hst.sampled_from(TORCH_LAYOUTS),
       target=hst.sampled_from(["csr", "csc", "coo", "dcsr", "dcsc", "dense"]))
def test_from_torch_sparse(x, layout, target):
    t = _to_torch_layout(x, layout)
    a = st.tensor(t, format=target)
    check_against_dense(a, x)


@pytest.mark.parametrize("layout,blocksize", [("bsr", (2, 3)), ("bsc", (2, 3)), ("bsr", (1, 3))])
def test_from_torch_blocked_keeps_blocksize(layout, blocksize):
    x = random_dense((4, 6), 0.3, torch.float32, 1)
    t = x.to_sparse_bsr(blocksize) if layout == "bsr" else x.to_sparse_bsc(blocksize)
    a = st.tensor(t, format="bsr")
    assert a.format.blocksize == blocksize
    check_against_dense(a, x)



@pytest.mark.parametrize("layout", ["csr", "csc"])
def test_from_torch_compressed_unsorted_and_repeated_is_summed(layout):
    """torch builds CSR/CSC tensors whose rows (columns) hold coordinates out of order and
    repeated; st.tensor refused them, naming SparseTensor.from_levels. They are now sorted
    and summed as scipy input is (and as torch's to_dense reads them)."""
    make = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
    t = make(torch.tensor([0, 3, 3, 5]), torch.tensor([2, 0, 2, 1, 0]),
             torch.tensor([1., 2., 3., 4., 5.], dtype=torch.float64), (3, 3))
    for fmt in ["csr", "csc", "coo", "dcsr", "dense"]:
        check_against_dense(st.tensor(t, format=fmt), t.to_dense())
    bad = make(torch.tensor([0, 2, 2, 3]), torch.tensor([2, 7, 0]), torch.ones(3), (3, 3))
    with pytest.raises(ValueError, match=rf"st.tensor\(a torch.sparse_{layout} tensor\): "
                                         r"level 1 .*coordinate 7 .* out of range"):
        st.tensor(bad)
    bsr = torch.sparse_bsr_tensor(torch.tensor([0, 2]), torch.tensor([1, 0]),
                                  torch.ones(2, 1, 1), (1, 2))
    with pytest.raises(ValueError, match=r"sparse_bsr tensor\): .*unsorted coordinates"):
        st.tensor(bsr)

def test_from_torch_coo_uncoalesced_duplicates():
    idx = torch.tensor([[1, 0, 1, 1], [2, 1, 2, 0]])
    t = torch.sparse_coo_tensor(idx, torch.tensor([1., 2., 3., 4.]), (2, 3), check_invariants=True)
    assert not t.is_coalesced()
    expected = torch.tensor([[0., 2., 0.], [4., 0., 4.]])
    for fmt in ["csr", "csc", "coo", "dcsr", "csf", "dense"]:
        check_against_dense(st.tensor(t, format=fmt), expected)
    t3 = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1], [2, 2]]), torch.tensor([1, 2]),
                                 (1, 2, 3), check_invariants=True)
    x3 = torch.zeros(1, 2, 3, dtype=torch.int64)
    x3[0, 1, 2] = 3
    check_against_dense(st.tensor(t3, format="csf"), x3)


@settings(max_examples=examples(40), **SETTINGS)
@given(x=dense_tensors(2), fmt=hst.sampled_from(["csr", "csc", "coo", "dcsr", "dcsc", "dense",
                                                 "bsr"]),
       index_dtype=hst.sampled_from(INDEX_DTYPES))
def test_to_torch(x, fmt, index_dtype):
    bs = (1, 1) if fmt == "bsr" else None
    a = st.tensor(x, format=fmt, blocksize=bs, index_dtype=index_dtype)
    t = a.to_torch()
    layout = {"csr": torch.sparse_csr, "csc": torch.sparse_csc, "bsr": torch.sparse_bsr,
              "dense": torch.strided}.get(fmt, torch.sparse_coo)
    assert t.layout == layout
    if layout == torch.sparse_coo:
        assert t.is_coalesced()
    assert_same(t.to_dense(), x)
    back = st.tensor(t, format=fmt, blocksize=bs)
    check_against_dense(back, x)


@settings(max_examples=examples(10), **SETTINGS)
@given(x=dense_tensors(3), fmt=hst.sampled_from(["coo", "csf"]))
def test_to_torch_3d(x, fmt):
    t = st.tensor(x, format=fmt).to_torch()
    assert t.layout == torch.sparse_coo and t.is_coalesced()
    assert_same(t.to_dense(), x)
    t = st.tensor(x, format=st.Format((st.compressed,) * 3, (2, 0, 1))).to_torch()
    assert t.is_coalesced()
    assert_same(t.to_dense(), x)


# -- construction keywords, SparseTensor as input --------------------------------------------
def test_dtype_and_device_keywords():
    x = random_dense((3, 4), 0.5, torch.float32, 0)
    a = st.tensor(x, format="csr", dtype=torch.float64, device="cpu")
    assert a.dtype == torch.float64 and a.values.dtype == torch.float64
    check_against_dense(a, x.double())
    b = st.tensor(a, format="coo")
    check_against_dense(b, x.double())
    assert st.tensor(a, format="csr") is a or torch.equal(st.tensor(a).to_dense(), a.to_dense())


def test_float16_bfloat16_and_int32_values():
    for dtype in (torch.float16, torch.bfloat16, torch.int32):
        x = random_dense((5, 4), 0.5, dtype, 3)
        for fmt in ("csr", "csc", "coo", "dense"):
            check_against_dense(st.tensor(x, format=fmt), x)


# -- structural ops on SparseTensor ----------------------------------------------------------
def test_detach_clone_to():
    x = random_dense((4, 5), 0.4, torch.float32, 7)
    a = st.tensor(x, format="csr")
    d = a.detach()
    assert isinstance(d, st.SparseTensor) and d.format == a.format
    check_against_dense(d, x)
    c = a.clone()
    check_against_dense(c, x)
    assert c.values.data_ptr() != a.values.data_ptr()
    for name, arr in c.arrays.items():
        assert arr.data_ptr() != a._level_arrays[name].data_ptr()
    for dtype in (torch.float64, torch.int64, torch.float16):
        b = a.to(dtype)
        assert isinstance(b, st.SparseTensor) and b.dtype == dtype and b.values.dtype == dtype
        assert b.index_dtype == a.index_dtype
        check_against_dense(b, x.to(dtype))
    assert a.double().dtype == torch.float64
    same = a.to("cpu")
    check_against_dense(same, x)


def test_copy_pickle_and_meta():
    import copy
    import pickle

    x = random_dense((4, 5), 0.4, torch.float64, 8)
    a = st.tensor(x, format="coo")
    for b in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert b.format == a.format
        check_against_dense(b, x)
    m = a.to("meta")
    assert isinstance(m, st.SparseTensor) and m.device.type == "meta"
    assert all(t.device.type == "meta" for t in [m.values, *m.arrays.values()])
    with pytest.raises(TypeError, match=r"dtype=torch.complex64 is not supported"):
        a.to(torch.complex64)


def test_requires_grad_and_detach():
    a = st.tensor(random_dense((3, 3), 0.5, torch.float32, 2), format="coo")
    a.requires_grad_()
    assert a.requires_grad
    assert not a.detach().requires_grad


def test_repr_and_accessors():
    a = st.tensor(torch.eye(3), format="csc")
    assert "csc" in repr(a) and "nnz=3" in repr(a)
    assert a.format.name == "csc" and tuple(a.shape) == (3, 3) and a.nnz == 3
    assert set(a.arrays) == {"pos1", "crd1"}
    assert a.device == torch.device("cpu") and a.dtype == torch.float32


@pytest.mark.parametrize("call,opname", [
    (lambda a: torch.sin(a), "sin"),
    (lambda a: torch.cumsum(a, 0), "cumsum"),
    (lambda a: torch.flip(a, (0,)), "flip"),
    (lambda a: a.view(-1), "view"),
])
def test_unsupported_ops_raise_naming_the_op(call, opname):
    a = st.tensor(torch.eye(3), format="csr")
    with pytest.raises(NotImplementedError, match=rf"aten\.{opname}\b.*format csr"):
        call(a)


def test_format_names():
    assert st.Format((st.dense, st.compressed), (1, 0)).name == "csc"
    assert st.tensor(torch.eye(2), format="dcsc").format.name == "dcsc"
    assert st.tensor(torch.eye(4), format="bsr", blocksize=(2, 2)).format.name == "bsr"
    assert st.tensor(torch.ones(2, 2, 2), format="coo").format.name == "coo"
    assert st.tensor(torch.ones(2, 2, 2), format="csf").format.name == "csf"
    assert st.tensor(torch.ones(3), format="csf").format.name in ("csf", "coo")
    assert st.tensor(torch.eye(2), format="CSR").format.name == "csr"


def test_coo_3d_levels():
    a = st.tensor(torch.ones(2, 1, 2), format="coo")
    assert [type(lv).__name__ for lv in a.format.levels] == ["Compressed", "Singleton",
                                                              "Singleton"]
    assert [lv.unique for lv in a.format.levels] == [False, False, True]
    assert set(a.arrays) == {"pos0", "crd0", "crd1", "crd2"}
    check_invariants(a, torch.ones(2, 1, 2))


def test_dense_format_to_sparse_drops_zeros():
    x = torch.tensor([[0., 1.], [0., 0.]])
    a = st.tensor(x, format="dense")
    assert a.nnz == 4
    assert a.asformat("csr").nnz == 1


# -- sizes where the fast paths kick in (packed numpy sort from 4096 entries) ------------------
@pytest.mark.parametrize("n,total,dtype", [(5000, 100, torch.int32), (5000, 2**40, torch.int64),
                                           (70000, 2**33, torch.int64), (9000, 7, torch.int64),
                                           (9000, 1, torch.int32), (4096, 2**60, torch.int64)])
def test_sort_key_is_a_stable_sort(n, total, dtype):
    from sparsetorch.formats.order import sort_key

    key = torch.randint(0, total, (n,), dtype=dtype, generator=torch.Generator().manual_seed(n))
    got, perm = sort_key(key, total)
    want = torch.sort(key, stable=True)
    assert got.dtype == key.dtype
    assert torch.equal(got, want.values) and torch.equal(perm.long(), want.indices)


@pytest.mark.parametrize("shape,density", [((300, 200), 0.3), ((40, 30, 50), 0.2)])
def test_medium_roundtrip_every_pair(shape, density):
    x = random_dense(shape, density, torch.float64, 11)
    table = formats_for(len(shape))
    for _, fmt, bs in table:
        f = resolve(fmt, len(shape), bs)
        if not blocks_fit(shape, f):
            continue
        a = st.tensor(x, format=fmt, blocksize=bs)
        assert torch.equal(a.to_dense(), x)
        for _, tfmt, tbs in table:
            if blocks_fit(shape, resolve(tfmt, len(shape), tbs)):
                b = a.asformat(tfmt, blocksize=tbs)
                assert torch.equal(b.to_dense(), x), (f, tfmt)
                check_invariants(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16])
def test_csr_csc_swap_in_every_value_dtype(dtype):
    """CSR <-> CSC by scipy's counting sort (``scipy_routes.swap_compressed``): values scipy
    takes are moved by it, others (float16, bfloat16) and values recording a gradient are
    gathered by torch; indices keep their width; nothing aliases the source."""
    x = random_dense((37, 23), 0.3, torch.float64, 12).to(dtype)
    x[5] = 0                                       # an empty row
    x[:, 7] = 0                                    # an empty column
    for index_dtype in (torch.int32, torch.int64):
        a = st.tensor(x, format="csr", index_dtype=index_dtype)
        b = a.asformat("csc")
        assert b.format.name == "csc" and b.index_dtype == index_dtype
        assert torch.equal(b.to_dense(), x) and torch.equal(b.asformat("csr").to_dense(), x)
        check_invariants(b)
        ptrs = {t.untyped_storage().data_ptr() for t in [a.values, *a._level_arrays.values()]}
        assert not ptrs & {t.untyped_storage().data_ptr() for t in [b.values, *b._level_arrays.values()]}
    if dtype.is_floating_point:   # the gradient reaches each CSR entry from its CSC place
        w = a.values.detach().clone().requires_grad_()
        r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        (a.with_values(w).asformat("csc").to_dense() * r).sum().backward()
        assert torch.equal(w.grad, r[x != 0])
    empty = st.tensor(torch.zeros(3, 4, dtype=dtype), format="csr").asformat("csc")
    assert empty.nnz == 0 and empty.arrays["pos1"].tolist() == [0] * 5


def test_medium_coo_pair_with_duplicates_matches_scipy():
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 300, (2, 50000), generator=g)
    vals = torch.randint(-5, 5, (50000,), generator=g).double()
    m = sp.coo_array((vals.numpy(), (idx[0].numpy(), idx[1].numpy())), shape=(300, 300))
    for fmt in ["csr", "csc", "coo", "dcsc"]:
        a = st.tensor((idx, vals), shape=(300, 300), format=fmt)
        assert torch.equal(a.to_dense(), torch.from_numpy(m.toarray()))
        check_invariants(a)


def test_level_expand_matches_expand_all():
    # expand (positions of a subset of parents) and expand_all (every position) agree
    from sparsetorch.formats.pack import level_arrays

    x = random_dense((5, 4, 3), 0.4, torch.float32, 9)
    for fmt in ["csf", "coo", [st.dense, st.compressed, st.dense]]:
        a = st.tensor(x, format=fmt)
        dims = a.format.storage_dims(a.shape)
        count = 1
        for k, level in enumerate(a.format.levels):
            arrays = level_arrays(a.arrays, k)
            owner_all, coord_all = level.expand_all(count, dims[k], arrays)
            parents = torch.arange(count)
            owner, child, coord = level.expand(parents, dims[k], arrays)
            n = level.count(count, dims[k], arrays)
            assert torch.equal(child, torch.arange(n))
            want_owner = torch.arange(n) if owner_all is None else owner_all.long()
            want_coord = torch.arange(n) if coord_all is None else coord_all.long()
            assert torch.equal(owner, want_owner) and torch.equal(coord, want_coord)
            count = n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16])
def test_scipy_routes_match_the_general_path(dtype):
    """COO data -> CSR/CSC and CSR -> COO by scipy's routines (``formats/scipy_routes.py``)
    give exactly what the general ``pack`` path gives (dtypes scipy does not take, and values
    recording a gradient, take that path): shuffled input with duplicates, empty rows and
    columns, nnz = 0, both index widths; results share no memory with their inputs, but a
    CSR -> COO conversion shares its values (as torch's ``to_sparse_coo`` does)."""
    from sparsetorch.formats.pack import pack

    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 40, (2, 600), generator=g)
    idx[0][idx[0] == 7] = 8                            # an empty row
    idx[1][idx[1] == 11] = 12                          # an empty column
    vals = torch.randint(-4, 5, (600,), generator=g).to(dtype)
    for n in (600, 0):
        for fmt in ("csr", "csc"):
            for index_dtype in (None, torch.int64):
                a = st.tensor((idx[:, :n], vals[:n]), shape=(40, 41), format=fmt,
                              index_dtype=index_dtype)
                arrays, stored = pack(a.format, (40, 41), idx[:, :n], vals[:n], index_dtype)
                assert a.index_dtype == arrays["pos1"].dtype
                for k in arrays:
                    assert torch.equal(a._level_arrays[k], arrays[k]), (fmt, k)
                assert torch.equal(a.values, stored)
                check_invariants(a)
                ptrs = {t.untyped_storage().data_ptr() for t in (idx, vals)}
                assert not any(t.numel() and t.untyped_storage().data_ptr() in ptrs
                               for t in [a.values, *a._level_arrays.values()])
        csr = st.tensor((idx[:, :n], vals[:n]), shape=(40, 41), format="csr")
        coo = csr.asformat("coo")
        want = st.tensor((idx[:, :n], vals[:n]), shape=(40, 41), format="coo")
        for k in want._level_arrays:
            assert torch.equal(coo._level_arrays[k], want._level_arrays[k]), k
        assert torch.equal(coo.values, want.values)
        check_invariants(coo)
        assert not {t.untyped_storage().data_ptr() for t in coo._level_arrays.values()
                    if t.numel()} & {t.untyped_storage().data_ptr()
                                     for t in csr._level_arrays.values() if t.numel()}
        assert coo.values is csr.values        # shared, as torch's to_sparse_coo does
        for fmt in ("csr", "csc"):                     # a COO tensor back: a counting sort
            back, want = coo.asformat(fmt), csr.asformat(fmt, index_dtype=csr.index_dtype)
            for k in want._level_arrays:
                assert torch.equal(back._level_arrays[k], want._level_arrays[k]), (fmt, k)
            assert torch.equal(back.values, want.values)
    if dtype.is_floating_point:       # a gradient flows through the general path
        w = vals.clone().requires_grad_()
        st.tensor((idx, w), shape=(40, 41), format="csr").values.sum().backward()
        assert torch.equal(w.grad, torch.ones_like(w))


def test_ordered_level_validation_names_the_first_bad_pair():
    """The one-pass check of an ordered level (a step at most 0 inside a segment) reports
    the first unsorted or duplicate pair and accepts a segment that starts lower."""
    def csr(pos, crd):
        return st.SparseTensor.from_levels((3, 5), "csr", {"pos1": torch.tensor(pos),
                                                           "crd1": torch.tensor(crd)},
                                           torch.ones(len(crd)))
    assert csr([0, 2, 2, 4], [1, 4, 0, 3]).nnz == 4      # 4 -> 0 crosses a segment: fine
    with pytest.raises(ValueError, match=r"unsorted coordinates at positions 2 and 3 \(3, 0\)"):
        csr([0, 2, 4, 4], [1, 4, 3, 0])
    with pytest.raises(ValueError, match=r"duplicate coordinates at positions 0 and 1 \(2, 2\)"):
        csr([0, 2, 2, 3], [2, 2, 0])
    with pytest.raises(ValueError, match=r"duplicate coordinates at positions 2 and 3 \(2, 2\)"):
        csr([0, 0, 0, 5], [0, 1, 2, 2, 3])
