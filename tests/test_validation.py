"""Bad input: every case raises ValueError/TypeError whose message names what is wrong, where,
and the fix. Kernels trust what passes, so nothing here may slip through or crash."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from helpers import examples, one_thread  # noqa: F401 (one_thread: autouse fixture)

X = torch.tensor([[0., 1., 0.], [2., 0., 3.]])
CSR = {"pos1": torch.tensor([0, 1, 3]), "crd1": torch.tensor([1, 0, 2])}
VALS = torch.tensor([1., 2., 3.])


def from_levels(arrays, values=VALS, shape=(2, 3), fmt="csr", **kw):
    return st.SparseTensor.from_levels(shape, fmt, arrays, values, **kw)


def coo_pair(idx, val, shape=(2, 3), fmt="csr", **kw):
    return st.tensor((torch.as_tensor(idx), torch.as_tensor(val)), shape=shape, format=fmt, **kw)


def test_good_levels_pass():
    a = from_levels(CSR)
    assert torch.equal(a.to_dense(), X)


def test_strided_user_arrays_are_stored_contiguous():
    # kernels read data_ptr(): a strided view must not reach them as is
    pos = torch.tensor([0, 9, 1, 9, 3])[::2]
    crd = torch.tensor([[1, 0, 2], [7, 7, 7]])[0]
    vals = torch.tensor([1., 0., 2., 0., 3.])[::2]
    a = from_levels({"pos1": pos, "crd1": crd}, vals)
    assert not pos.is_contiguous() and not vals.is_contiguous()
    assert all(t.is_contiguous() for t in [a.values, *a.arrays.values()])
    assert torch.equal(a.to_dense(), X)
    b = st.tensor((torch.tensor([[0, 1, 1], [1, 0, 2]]).T.contiguous().T, vals), shape=(2, 3))
    assert torch.equal(b.to_dense(), X)


# -- shapes -----------------------------------------------------------------------------------
def test_values_length_vs_indices():
    with pytest.raises(ValueError, match=r"values has shape \[2\] but indices has 3 entries"):
        coo_pair([[0, 1, 1], [1, 0, 2]], [1., 2.])
    with pytest.raises(ValueError, match=r"values must be 1-D"):
        coo_pair([[0, 1, 1], [1, 0, 2]], [[1., 2., 3.]])


def test_indices_rows_vs_shape():
    with pytest.raises(ValueError, match=r"indices must have shape \[ndim=3, nnz\], got \[2, 3\]"):
        coo_pair([[0, 1, 1], [1, 0, 2]], [1., 2., 3.], shape=(2, 3, 4))


@pytest.mark.parametrize("data", [
    X, X.numpy(), sp.csr_array(X.numpy()), X.to_sparse(), X.to_sparse_csr(),
    st.tensor(X, format="coo")], ids=["dense", "numpy", "scipy", "torch_coo", "torch_csr",
                                      "SparseTensor"])
def test_shape_keyword_vs_data(data):
    with pytest.raises(ValueError, match=r"data has shape \(2, 3\) but shape=\(3, 2\)"):
        st.tensor(data, shape=(3, 2))
    assert tuple(st.tensor(data, shape=(2, 3)).shape) == (2, 3)


def test_negative_or_non_integer_shape():
    with pytest.raises(ValueError, match=r"shape \(-1, 3\).*non-negative"):
        coo_pair(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), shape=(-1, 3))
    with pytest.raises(ValueError, match=r"shape \(-2, 3\).*non-negative"):
        from_levels(CSR, shape=(-2, 3))
    with pytest.raises(TypeError, match=r"shape.*integers"):
        coo_pair([[0], [0]], [1.], shape=(2.5, 3))


@pytest.mark.parametrize("fmt", ["coo", "dcsr", "csr"])
def test_shape_past_torchs_element_count(fmt):
    """A SparseTensor is a torch.Tensor of its shape: more than 2^63 - 1 elements in all
    is a ValueError naming the limit, at construction (before any array is allocated) and
    for an einsum result (before the kernel runs); 2^31 x 2^31 works (hypersparse formats:
    CSR would hold 2^31 row pointers)."""
    n = 2 ** 32 + 1
    with pytest.raises(ValueError, match=r"shape \(4294967297, 4294967297\).*2\^63 - 1"):
        coo_pair([[0, n - 1], [0, n - 1]], [1., 2.], shape=(n, n), fmt=fmt)
    with pytest.raises(ValueError, match=r"2\^63 - 1"):
        st.random((n, n), density=0.0)
    if fmt == "csr":
        return
    m = 2 ** 31
    A = coo_pair([[0, m - 1], [0, m - 1]], [1., 2.], shape=(m, m), fmt=fmt)
    assert A.shape == (m, m) and A.nnz == 2
    with pytest.raises(ValueError, match=r"result's shape \(2147483648, 2147483648, "
                                         r"2147483648, 2147483648\).*2\^63 - 1"):
        st.einsum("ij,kl->ijkl", A, A)


def test_shape_required_without_entries():
    with pytest.raises(ValueError, match="shape= is required"):
        st.tensor((torch.zeros(2, 0, dtype=torch.long), torch.zeros(0)))


def test_zero_dim_data():
    with pytest.raises(ValueError, match="0-d tensor"):
        st.tensor(torch.tensor(1.))


def test_pos_and_values_lengths():
    with pytest.raises(ValueError, match=r"level 1 \(compressed\): pos has 2 entries, expected 3"):
        from_levels({"pos1": torch.tensor([0, 1]), "crd1": torch.tensor([1])}, VALS[:1])
    with pytest.raises(ValueError, match=r"pos\[-1\] is 3 but crd has 2 entries"):
        from_levels({"pos1": torch.tensor([0, 1, 3]), "crd1": torch.tensor([1, 0])}, VALS[:2])
    with pytest.raises(ValueError, match=r"values has 2 entries but the levels store 3"):
        from_levels(CSR, VALS[:2])
    with pytest.raises(ValueError, match=r"pos\[0\] is 1, expected 0"):
        from_levels({"pos1": torch.tensor([1, 1, 3]), "crd1": torch.tensor([1, 0])}, VALS[:2])
    with pytest.raises(ValueError, match=r"pos decreases at position 2 \(3 -> 2\)"):
        from_levels({"pos1": torch.tensor([0, 3, 2]), "crd1": torch.tensor([0, 1, 2])})
    with pytest.raises(ValueError, match=r"missing \['crd1'\], unexpected \['crd2'\]"):
        from_levels({"pos1": CSR["pos1"], "crd2": CSR["crd1"]})
    with pytest.raises(ValueError, match=r"level 1 \(singleton\): crd has 2 entries, expected 3"):
        from_levels({"pos0": torch.tensor([0, 3]), "crd0": torch.tensor([0, 1, 1]),
                     "crd1": torch.tensor([1, 0])}, fmt="coo")
    with pytest.raises(ValueError, match=r"pos1 must be 1-D"):
        from_levels({"pos1": CSR["pos1"][None], "crd1": CSR["crd1"]})


# -- coordinates ------------------------------------------------------------------------------
def test_out_of_range_and_negative_coordinates():
    with pytest.raises(ValueError, match=r"index 3 in dimension 1 at entry 2 is out of range "
                                         r"for shape \(2, 3\); indices must lie in \[0, 3\)"):
        coo_pair([[0, 1, 1], [1, 0, 3]], [1., 2., 3.])
    with pytest.raises(ValueError, match=r"index -1 in dimension 0 at entry 1 is negative"):
        coo_pair([[0, -1, 1], [1, 0, 2]], [1., 2., 3.])
    with pytest.raises(ValueError, match=r"level 1 \(compressed\): coordinate 3 at position 2 "
                                         r"is out of range \[0, 3\)"):
        from_levels({"pos1": CSR["pos1"], "crd1": torch.tensor([1, 0, 3])})
    with pytest.raises(ValueError, match=r"coordinate -1 at position 1 is out of range"):
        from_levels({"pos1": CSR["pos1"], "crd1": torch.tensor([1, -1, 2])})
    with pytest.raises(ValueError, match=r"level 0 \(compressed\(non-unique\)\): coordinate 2 "
                                         r"at position 0"):
        from_levels({"pos0": torch.tensor([0, 1]), "crd0": torch.tensor([2]),
                     "crd1": torch.tensor([0])}, VALS[:1], fmt="coo")
    with pytest.raises(ValueError, match=r"level 1 \(singleton\): coordinate 5 at position 0"):
        from_levels({"pos0": torch.tensor([0, 1]), "crd0": torch.tensor([1]),
                     "crd1": torch.tensor([5])}, VALS[:1], fmt="coo")


def test_pos_out_of_range_never_reads_out_of_bounds():
    # pos pointing past crd must be caught before anything indexes with it
    with pytest.raises(ValueError, match=r"pos\[-1\] is 9 but crd has 3 entries"):
        from_levels({"pos1": torch.tensor([0, 1, 9]), "crd1": torch.tensor([1, 0, 2])})
    with pytest.raises(ValueError, match=r"pos decreases at position 1 \(0 -> -1\)"):
        from_levels({"pos1": torch.tensor([0, -1, 3]), "crd1": torch.tensor([1, 0, 2])})


@pytest.mark.parametrize("kind", ["csr", "csc", "bsr"])
@pytest.mark.parametrize("damage", ["indptr", "indices"])
def test_scipy_matrix_edited_into_nonsense(kind, damage):
    """A scipy matrix whose arrays were edited in place past its own checks (found by the
    fuzzer: an indptr of [0, 5, 3] was read through scipy's tocoo into wrong rows)."""
    m = sp.random(4, 6, density=0.5, format="csr", random_state=1)
    m = m.asformat(kind) if kind != "bsr" else sp.bsr_matrix(m.toarray(), blocksize=(2, 2))
    if damage == "indptr":
        m.indptr[1] = m.indptr[-1] + 2
    else:
        m.indices[0] = 99
    m.has_canonical_format = False
    with pytest.raises(ValueError, match=damage):
        st.tensor(m)


def test_unsorted_where_level_is_ordered():
    with pytest.raises(ValueError, match=r"level 1 \(compressed\): unsorted coordinates at "
                                         r"positions 1 and 2 \(2, 0\).*sort"):
        from_levels({"pos1": torch.tensor([0, 1, 3]), "crd1": torch.tensor([1, 2, 0])})
    # COO: level 0 unsorted, and level 1 unsorted inside one row
    with pytest.raises(ValueError, match=r"level 0 \(compressed\(non-unique\)\): unsorted "
                                         r"coordinates at positions 0 and 1 \(1, 0\)"):
        from_levels({"pos0": torch.tensor([0, 2]), "crd0": torch.tensor([1, 0]),
                     "crd1": torch.tensor([0, 1])}, VALS[:2], fmt="coo")
    with pytest.raises(ValueError, match=r"unsorted entries at positions 0 and 1 "
                                         r"\(\[1, 2\], \[1, 1\]\).*st\.tensor"):
        from_levels({"pos0": torch.tensor([0, 2]), "crd0": torch.tensor([1, 1]),
                     "crd1": torch.tensor([2, 1])}, VALS[:2], fmt="coo")


def test_duplicates_where_level_is_unique():
    with pytest.raises(ValueError, match=r"level 1 \(compressed\): duplicate coordinates at "
                                         r"positions 1 and 2 \(0, 0\)"):
        from_levels({"pos1": torch.tensor([0, 1, 3]), "crd1": torch.tensor([1, 0, 0])})
    with pytest.raises(ValueError, match=r"level 0 \(compressed\): duplicate coordinates at "
                                         r"positions 0 and 1 \(1, 1\)"):
        from_levels({"pos0": torch.tensor([0, 2]), "crd0": torch.tensor([1, 1]),
                     "pos1": torch.tensor([0, 1, 2]), "crd1": torch.tensor([0, 2])},
                    VALS[:2], fmt="dcsr")
    with pytest.raises(ValueError, match=r"duplicate entries at positions 1 and 2 "
                                         r"\(\[1, 2\], \[1, 2\]\); format 'coo'"):
        from_levels({"pos0": torch.tensor([0, 3]), "crd0": torch.tensor([0, 1, 1]),
                     "crd1": torch.tensor([0, 2, 2])}, fmt="coo")


def test_duplicates_in_unordered_unique_level():
    fmt = st.Format((st.dense, st.Compressed(ordered=False)))
    ok = from_levels({"pos1": torch.tensor([0, 2, 3]), "crd1": torch.tensor([2, 0, 1])},
                     fmt=fmt)
    assert ok.to_dense()[0, 2] == 1.
    with pytest.raises(ValueError, match=r"level 1 \(compressed\(unordered\)\): duplicate "
                                         r"coordinate 2 under one parent at positions 0 and 2"):
        from_levels({"pos1": torch.tensor([0, 3, 3]), "crd1": torch.tensor([2, 0, 2])},
                    fmt=fmt)


# -- dtypes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [torch.float32, torch.float64])
def test_non_integer_indices(bad):
    with pytest.raises(TypeError, match=rf"indices has dtype {bad}; indices must be an integer"):
        coo_pair(torch.tensor([[0, 1], [1, 0]], dtype=bad), [1., 2.])
    with pytest.raises(TypeError, match=r"level array crd1 has dtype .*integer tensor"):
        from_levels({"pos1": CSR["pos1"], "crd1": CSR["crd1"].to(bad)})


def test_nan_indices():
    with pytest.raises(ValueError, match=r"indices contains NaN at entry 1; indices must be "
                                         r"integers"):
        coo_pair(torch.tensor([[0., float("nan")], [1., 0.]]), [1., 2.])
    with pytest.raises(ValueError, match=r"level array pos1 contains NaN"):
        from_levels({"pos1": torch.tensor([0., float("nan"), 3.]), "crd1": CSR["crd1"]})


def test_bool_indices():
    with pytest.raises(TypeError, match=r"indices has dtype torch.bool"):
        coo_pair(torch.tensor([[True, False], [False, True]]), [1., 2.])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.bool, torch.int8,
                                   torch.uint8])
def test_unsupported_value_dtypes(dtype):
    msg = rf"values of dtype {dtype} are not supported; use one of"
    with pytest.raises(TypeError, match=msg):
        st.tensor(X.to(dtype))
    with pytest.raises(TypeError, match=msg):
        coo_pair([[0, 1], [1, 0]], torch.ones(2, dtype=dtype))
    with pytest.raises(TypeError, match=msg):
        from_levels(CSR, VALS.to(dtype))
    with pytest.raises(TypeError, match=msg):
        st.tensor(X.to(dtype).to_sparse())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
def test_unsupported_dtype_keyword(dtype):
    with pytest.raises(TypeError, match=rf"dtype={dtype} is not supported"):
        st.tensor(X, dtype=dtype)


def test_unsupported_numpy_and_scipy_dtypes():
    with pytest.raises(TypeError, match=r"numpy arrays of dtype bool are not supported"):
        st.tensor(X.numpy() > 0)
    with pytest.raises(TypeError, match=r"values of dtype torch.complex128 are not supported"):
        st.tensor(sp.csr_array(X.numpy().astype(np.complex128)))


def test_mixed_index_dtypes():
    with pytest.raises(TypeError, match=r"level arrays have dtypes \['torch.int32', "
                                        r"'torch.int64'\]; use one index dtype"):
        from_levels({"pos1": CSR["pos1"].int(), "crd1": CSR["crd1"]})
    with pytest.raises(TypeError, match=r"level arrays have dtypes \['torch.int16'\]"):
        from_levels({"pos1": CSR["pos1"].short(), "crd1": CSR["crd1"].short()})


def test_index_dtype_argument():
    with pytest.raises(ValueError, match=r"index_dtype=torch.int32 cannot hold 2147483653.*"
                                         r"use torch.int64"):
        coo_pair([[0], [1]], [1.], shape=(2, 2**31 + 5), index_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"index_dtype must be torch.int32 or torch.int64"):
        st.tensor(X, index_dtype=torch.int16)
    big = coo_pair([[0], [1]], [1.], shape=(2, 2**31 + 5), fmt="coo")
    assert big.index_dtype == torch.int64
    with pytest.raises(ValueError, match=r"index_dtype=torch.int32 cannot hold"):
        big.asformat("coo", index_dtype=torch.int32)


# -- devices ----------------------------------------------------------------------------------
def test_values_and_indices_on_different_devices():
    with pytest.raises(ValueError, match=r"indices is on cpu but values are on meta; move them "
                                         r"to one device"):
        coo_pair([[0], [1]], torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"pos1 is on cpu but values are on meta"):
        from_levels(CSR, values=VALS.to("meta"))


# -- formats and blocks -----------------------------------------------------------------------
def test_shape_not_divisible_by_blocksize():
    msg = r"dimension 1 of size 3 is not divisible by the block size 2"
    with pytest.raises(ValueError, match=msg):
        st.tensor(X, format="bsr", blocksize=(2, 2))
    with pytest.raises(ValueError, match=msg):
        st.tensor(X, format="csr").asformat("bsr", blocksize=(1, 2))
    with pytest.raises(ValueError, match=msg):
        from_levels({"pos1": torch.tensor([0, 0]), "crd1": torch.tensor([], dtype=torch.long)},
                    torch.zeros(0), fmt="bsr", blocksize=(2, 2))


def test_blocksize_misuse():
    with pytest.raises(ValueError, match=r"format 'bsr' needs blocksize=\(rows, cols\)"):
        st.tensor(X, format="bsr")
    with pytest.raises(ValueError, match=r"blocksize is only meaningful for format 'bsr'"):
        st.tensor(X, format="csr", blocksize=(1, 1))
    with pytest.raises(ValueError, match=r"blocksize \(0, 1\) needs one positive size per mode"):
        st.tensor(X, format="bsr", blocksize=(0, 1))
    for bad in ((1.5, 2), (True, 1), "22", 2.0):
        with pytest.raises(TypeError, match=r"blocksize must be an int or a tuple of ints"):
            st.tensor(torch.ones(4, 4), format="bsr", blocksize=bad)
    # an int is the same block size along every mode (as the layers take it)
    assert st.tensor(torch.ones(4, 4), format="bsr", blocksize=2).format.blocksize == (2, 2)


@pytest.mark.parametrize("name", ["foo", "CSX", "", 3])
def test_unknown_format_names(name):
    with pytest.raises(ValueError, match=r"unknown format .*; use one of csr, csc"):
        st.tensor(X, format=name)


def test_format_order_mismatch():
    with pytest.raises(ValueError, match=r"format 'csr' is for 2-D tensors; this tensor is 3-D"):
        st.tensor(torch.ones(2, 2, 2), format="csr")
    with pytest.raises(ValueError, match=r"stores 3-D tensors, but the tensor is 2-D"):
        st.tensor(X, format=st.Format((st.compressed,) * 3))


def test_bad_format_definitions():
    with pytest.raises(ValueError, match=r"level 1 is singleton but the level above it is unique"):
        st.Format((st.compressed, st.singleton))
    with pytest.raises(ValueError, match=r"level 0 is non-unique, so every level below it must "
                                         r"be singleton"):
        st.Format((st.Compressed(unique=False), st.compressed))
    with pytest.raises(ValueError, match=r"not a permutation"):
        st.Format((st.dense, st.compressed), (0, 0))
    with pytest.raises(TypeError, match=r"Format levels must be level kinds"):
        st.Format(("dense", "compressed"))
    with pytest.raises(ValueError, match=r"in-block levels must all be st.dense"):
        st.Format((st.dense, st.compressed, st.dense, st.compressed), blocksize=(2, 2))


def test_unsupported_inputs():
    with pytest.raises(TypeError, match=r"cannot make a sparse tensor from list"):
        st.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"only 2-D, non-hybrid torch torch.sparse_csr"):
        st.tensor(torch.ones(2, 2, 2).to_sparse_csr(), format="csf")


def test_zero_dim_numpy_data_is_refused_like_a_zero_dim_tensor():
    with pytest.raises(ValueError, match=r"a 0-d tensor has no sparse structure"):
        st.tensor(np.array(5.0), format="coo")


def test_a_device_that_is_not_one_is_named():
    for bad in ("bogus", 3.5):
        with pytest.raises(ValueError, match=r"st.tensor: device=.* is not a device"):
            st.tensor(X, device=bad)


def test_meta_tensors_rejected():
    with pytest.raises(ValueError, match=r"data is a meta tensor, which has no values"):
        st.tensor(torch.empty(3, 3, device="meta"), format="csr")
    with warnings.catch_warnings():   # (torch warns that nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(3, 3)])
    with pytest.raises(TypeError, match=r"data is a nested tensor.*to_padded_tensor"):
        st.tensor(nested, format="csr")


@pytest.mark.parametrize("kind", ["dok", "lil", "dia"])
def test_scipy_formats_without_a_value_array_convert(kind):
    m = sp.random(5, 6, density=0.4, format="csr", random_state=1)
    got = st.tensor(m.asformat(kind), format="csr")
    assert torch.equal(got.to_dense(), torch.from_numpy(m.toarray()))


def test_linear_and_addmm_check_what_they_add():
    A = st.tensor(torch.rand(4, 4), format="csr")
    with pytest.raises(ValueError, match=r"linear: bias of shape \(3,\) does not broadcast to "
                                         r"the product's shape \(2, 4\)"):
        torch.nn.functional.linear(torch.rand(2, 4), A, torch.rand(3))
    with pytest.raises(ValueError, match=r"addmm: input of shape \(3,\) does not broadcast"):
        torch.addmm(torch.rand(3), A, torch.rand(4, 2))
    with pytest.raises(ValueError, match=r"addmm: input of shape \(2, 4, 2\)"):
        torch.addmm(torch.rand(2, 4, 2), A, torch.rand(4, 2))   # (would grow the result)
    x, b = torch.rand(2, 4), torch.rand(4)
    torch.testing.assert_close(torch.nn.functional.linear(x, A, b), x @ A.to_dense().T + b)
    c, y = torch.rand(4, 1), torch.rand(4, 2)     # (broadcasts: passes)
    torch.testing.assert_close(torch.addmm(c, A, y), c + A.to_dense() @ y)
    with pytest.raises(ValueError, match=r"addmm: input of shape \(3,\)"):   # beta=0 too
        torch.addmm(torch.rand(3), A, torch.rand(4, 2), beta=0)
    with pytest.raises(ValueError, match=r"linear: bias of shape \(3, 2, 4\) does not broadcast "
                                         r"to the product's shape \(2, 4\); pass one of shape "
                                         r"\(4,\) or \(2, 4\)$"):
        torch.nn.functional.linear(torch.rand(2, 4), A, torch.rand(3, 2, 4))   # (as torch)
    with pytest.raises(ValueError, match=r"linear: input is 0-d"):
        torch.nn.functional.linear(torch.tensor(1.0), A)
    # another dtype is refused, whatever beta (as torch does), not promoted or dropped
    for beta in (0, 1, 0.5):
        with pytest.raises(TypeError, match=r"addmm: input is torch.float64 but the product "
                                            r"is torch.float32; convert"):
            torch.addmm(torch.rand(4, 2, dtype=torch.float64), A, torch.rand(4, 2), beta=beta)
    with pytest.raises(TypeError, match=r"linear: bias is torch.int64 but the product"):
        torch.nn.functional.linear(x, A, torch.ones(4, dtype=torch.int64))


def test_hybrid_torch_coo_rejected():
    t = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 3), (2, 3),
                                check_invariants=True)
    with pytest.raises(ValueError, match=r"hybrid"):
        st.tensor(t)


# -- fuzz: random corruption of valid arrays is always caught or harmless ------------------------
@settings(max_examples=examples(60), deadline=None)
@given(seed=hst.integers(0, 2**16), which=hst.sampled_from(["pos1", "crd1"]),
       delta=hst.integers(-3, 3), fmt=hst.sampled_from(["csr", "csc"]))
def test_corrupted_arrays_never_pass_silently(seed, which, delta, fmt):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(5, 4, generator=g) < 0.5).float()
    a = st.tensor(x, format=fmt, index_dtype=torch.int64)
    arrays = {k: v.clone() for k, v in a.arrays.items()}
    if arrays[which].numel() == 0:
        return
    i = int(torch.randint(0, arrays[which].numel(), (1,), generator=g))
    arrays[which][i] += delta
    try:
        b = st.SparseTensor.from_levels(a.shape, a.format, arrays, a.values.clone())
    except ValueError as e:
        assert "level 1" in str(e) or "values has" in str(e)
        return
    b.to_dense()       # whatever passed must be a valid tensor


def test_inputs_that_are_no_tensors_or_hold_no_data_are_named():
    """(A probe: lists gave AttributeError 'list' has no 'dtype', meta tensors torch's
    "item() cannot be called on meta tensors", uint64 indices NotImplementedError
    "aminmax_cpu", an absent device an AssertionError, an integer st.random
    check_uniform_bounds.)"""
    pos, crd, vals = torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.ones(2)
    with pytest.raises(TypeError, match="level array pos1 is a list; pass a torch tensor"):
        st.SparseTensor.from_levels((2, 2), "csr", {"pos1": [0, 1, 2], "crd1": crd}, vals)
    with pytest.raises(TypeError, match="values is a list; pass a torch tensor"):
        st.SparseTensor.from_levels((2, 2), "csr", {"pos1": pos, "crd1": crd}, [1.0, 2.0])
    with pytest.raises(ValueError, match="on the meta device, which holds no data"):
        st.SparseTensor.from_levels((2, 2), "csr", {"pos1": pos.to("meta"),
                                                    "crd1": crd.to("meta")}, vals.to("meta"))
    with pytest.raises(ValueError, match="indices is on the meta device"):
        st.tensor((torch.zeros(2, 2, dtype=torch.long, device="meta"), vals.to("meta")),
                  shape=(2, 2))
    if hasattr(torch, "uint64"):
        with pytest.raises(TypeError, match=r"dtype torch.uint64; convert the indices"):
            st.tensor((np.array([[0, 1], [1, 0]], dtype=np.uint64), np.ones(2)), shape=(2, 2))
    with pytest.raises(TypeError, match="dtype must be a floating type"):
        st.random((3, 3), 0.5, dtype=torch.int64)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda:9' is not available here"):
            st.tensor(torch.eye(3), device="cuda:9")
    M = st.tensor(torch.eye(2)).to("meta")   # (meta SparseTensors still work)
    assert (M / 2).device.type == M.with_values(torch.empty(2, device="meta")).device.type \
        == "meta"


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "copy_", "iadd"])
def test_a_dense_tensors_in_place_op_with_a_sparse_operand_runs_as_torch_does(op):
    """x.add_(A), x += A, ... with a dense x: the SparseTensor handler took x for the sparse
    one and failed with AttributeError; now the dense op on A.to_dense()."""
    d = torch.tensor([[1., 0, 2], [0, 3, 0]])
    A = st.tensor(d, "csr")
    x, ref = torch.full((2, 3), 2.0), torch.full((2, 3), 2.0)
    if op == "iadd":
        y = x
        y += A
        ref += d
        assert y is x
    else:
        assert getattr(x, op)(A) is x
        getattr(ref, op)(d)
    torch.testing.assert_close(x, ref)
