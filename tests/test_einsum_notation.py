"""``st.einsum``'s notation beyond one product of distinct indices, against ``torch.einsum``
on dense copies: ellipses, sizes of 1 that broadcast (``ops/broadcast.py``), diagonals of
sparse operands (``ops/diagonal.py``); and random equations (hypothesis) over formats,
dtypes and index dtypes, with and without that notation. The fixed equation x format tables
are in ``test_einsum.py``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import sparsetorch as st
from dense_check import (LONG, check_against_dense, examples, fmt_label,  # noqa: F401
                         make_operand, private_kernel_cache, random_dense, seed_of)
from test_einsum import BSR, CD, CSF, CSF021, CSF120, CSF201, DENSE_T, F2, F3, F32, F64


@pytest.mark.parametrize("eq,shapes", [
    ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),     # batch dimensions in front
    ("...ij,jk", [(2, 3, 4), (4, 5)]),            # implicit output: the ellipsis leads
    ("...ij,jk->...ik", [(3, 4), (4, 5)]),        # an ellipsis of no dimensions
    ("i...j,jk->ik", [(2, 3, 4), (4, 5)]),        # left out of the output: summed
    ("...ij->ij", [(2, 3, 4)]),
    ("...->", [(2, 3, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)]),
    ("...j,...j->...", [(2, 3, 4), (3, 4)]),      # ellipses aligned from the right
    ("...ij,...ij->...ij", [(2, 3, 4), (2, 3, 4)]),
    ("b...,b...->b", [(2, 3, 4), (2, 3, 4)]),
    ("ij...,j->i...", [(3, 4, 2), (4,)]),
    ("...", [(2, 3, 4)]),
    (" ... i j , j k -> ... i k ", [(2, 3, 4), (4, 5)]),
])
@pytest.mark.parametrize("fmt", ["coo", CSF120, "dense"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_ellipsis_matches_torch(eq, shapes, fmt, dtype):
    """``...`` as torch.einsum reads it; the first operand sparse (its 2-D formats for 2-D
    shapes), the second sparse too for elementwise products, else dense."""
    gen = torch.Generator().manual_seed(seed_of(eq, fmt_label(fmt), str(dtype)))
    ops = []
    for n, shape in enumerate(shapes):
        x = random_dense(shape, 0.4 if n == 0 or "ij,...ij" in eq else 0.9, dtype, gen,
                         empty_slices=n == 0)
        f = fmt if len(shape) == 3 else {"coo": "coo", "dense": "dense"}.get(fmt, "csc")
        ops.append(make_operand(x, f) if n == 0 or "ij,...ij" in eq else x)
    check_against_dense(eq, ops)


@pytest.mark.parametrize("eq,shapes,full,sparse", [
    # (the sizes broadcast, the same equation without broadcasting, operands sparse up to)
    ("bij,bjk->bik", [(3, 2, 4), (1, 4, 5)], [(3, 2, 4), (3, 4, 5)], 0),   # one dense batch
    ("bij,bjk->bik", [(1, 2, 4), (3, 4, 5)], [(3, 2, 4), (3, 4, 5)], 0),   # one sparse batch
    ("ij,ij->ij", [(3, 4), (1, 4)], [(3, 4), (3, 4)], 0),               # a row scales each row
    ("ij,ij->ij", [(3, 4), (3, 1)], [(3, 4), (3, 4)], 0),
    ("ij,ij->ij", [(1, 4), (3, 4)], [(3, 4), (3, 4)], 1),               # two sparse operands
    ("ij,ij->ij", [(1, 1), (3, 4)], [(3, 4), (3, 4)], 0),               # nothing left to store
    ("ij,jk->ik", [(3, 1), (4, 5)], [(3, 4), (4, 5)], 0),               # a summed index
    ("...j,...j->...", [(2, 3, 4), (1, 3, 4)], [(2, 3, 4), (2, 3, 4)], 0),
    # the dense-only index of size 1 in one dense operand and 5 in another (found by the
    # fuzzer: the call ran as if it had size 1, keeping the first of five rows)
    ("j,ij,ij->i", [(3,), (1, 3), (5, 3)], [(3,), (5, 3), (5, 3)], 0),
    ("j,ij,ij->", [(3,), (1, 3), (5, 3)], [(3,), (5, 3), (5, 3)], 0),
    ("j,ij,ij->j", [(3,), (5, 3), (1, 3)], [(3,), (5, 3), (5, 3)], 0),
])
@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsc", CSF, "dense"])
def test_broadcast_sizes_of_one_match_torch(eq, shapes, full, sparse, fmt):
    """Sizes of 1 broadcast as in torch.einsum (``ops/broadcast.py``), on the first call and
    on the memoised one after a call of the same equation without broadcasting."""
    gen = torch.Generator().manual_seed(seed_of(eq, str(shapes), fmt_label(fmt)))
    for sizes in (full, shapes):
        ops = []
        for n, shape in enumerate(sizes):
            x = random_dense(shape, 0.5 if n <= sparse else 0.9, F64, gen)
            f = fmt if len(shape) == 2 or fmt in (CSF, "coo", "dense") else \
                CSF if len(shape) == 3 else "coo"
            ops.append(make_operand(x, f) if n <= sparse else x)
        check_against_dense(eq, ops)


def test_ellipsis_errors():
    A = st.tensor(torch.ones(2, 3, 4, dtype=F64), "csf")
    x = torch.ones(4, dtype=F64)
    for eq, match in [("....ij,j->i", "one ellipsis"), ("i.j,j->i", "one ellipsis"),
                      ("...ijkl,l->i", "names 4 besides"), ("...ij,j->....", "one ellipsis")]:
        with pytest.raises(ValueError, match=match):
            st.einsum(eq, A, x)
    with pytest.raises(ValueError, match="size 2 .* but 3"):   # ellipsis extents disagree
        st.einsum("...j,...j->...", A, torch.ones(3, 3, 4, dtype=F64))


def test_subscripts_are_ascii_letters():
    """As torch.einsum's: another script's letters (``str.isalpha`` takes them) or digits
    are refused, in operands and output alike; upper case is an index of its own."""
    A = st.tensor(torch.eye(3, dtype=F64), "csr")
    x = torch.ones(3, 2, dtype=F64)
    for eq, match in [("\u00efj,jk->\u00efk", "operand 0 subscript .* letters a-z, A-Z"),
                      ("ij,j\u0663->ik", "operand 1 subscript"),
                      ("ij,jk->i\u00e9", "output subscript .* letters a-z, A-Z")]:
        with pytest.raises(ValueError, match=match):
            st.einsum(eq, A, x)
    torch.testing.assert_close(st.einsum("Ij,jK->IK", A, x), x)


@pytest.mark.parametrize("eq", ["ii->i", "ii->", "ii,i->i", "ii,j->ij", "ij,ii->j",
                                "ii,ij->ij"])
@pytest.mark.parametrize("fmt", F2)
def test_diagonal_of_sparse_matrix_matches_torch(eq, fmt):
    """A repeated index within a sparse operand's subscript takes its diagonal
    (``ops/diagonal.py``): every 2-D format, with empty rows, nnz = 0 and a 1x1 matrix."""
    sizes = [(6, 0.5), (6, 0.0), (4, 1.0)] + ([(1, 1.0)] if fmt != BSR else [])
    for n, (size, density) in enumerate(sizes):
        gen = torch.Generator().manual_seed(seed_of(eq, fmt_label(fmt), n))
        ops = [make_operand(random_dense((size, size), density, F64, gen, empty_slices=True),
                            fmt)]
        if "," in eq:
            rhs = eq.split(",")[1].split("->")[0]
            x = random_dense((size,) * len(rhs), 0.6 if rhs == "ii" else 1.0, F64, gen)
            ops.append(make_operand(x, fmt) if rhs == "ii" else x)
        check_against_dense(eq, ops)


@pytest.mark.parametrize("eq", ["iij->ij", "iji,j->i", "iii->i", "iij,jk->ik", "jii->j"])
@pytest.mark.parametrize("fmt", F3)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_diagonal_of_sparse_3d_tensor_matches_torch(eq, fmt, dtype):
    gen = torch.Generator().manual_seed(seed_of(eq, fmt_label(fmt), str(dtype)))
    ops = [make_operand(random_dense((4, 4, 4), 0.4, dtype, gen, empty_slices=True), fmt)]
    if "," in eq:
        rhs = eq.split(",")[1].split("->")[0]
        ops.append(random_dense((4,) * len(rhs), 1.0, dtype, gen))
    check_against_dense(eq, ops)


def test_diagonal_sums_duplicates_and_keeps_index_dtype():
    """COO may store a coordinate twice: both copies are on the diagonal and add."""
    idx = torch.tensor([[0, 0, 1, 2, 2], [0, 0, 1, 0, 2]])
    A = st.tensor((idx, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)), "coo",
                  shape=(3, 3))
    d = st.einsum("ii->i", A)
    assert d.index_dtype == A.index_dtype
    torch.testing.assert_close(d.to_dense(), torch.tensor([3.0, 3.0, 5.0], dtype=F64))
    torch.testing.assert_close(st.einsum("ii->", A), torch.tensor(11.0, dtype=F64))


# -- random equations (hypothesis) -------------------------------------------------------------
FORMATS_BY_ORDER = {
    1: ["csf", "dense", None],
    2: ["csr", "csc", "coo", "dcsr", "dcsc", "dense", CD, DENSE_T, ("bsr", (1, 1)), None],
    3: [CSF, "coo", CSF021, CSF201, CSF120, "dense", None,
        st.Format((st.dense, st.dense, st.compressed), (1, 2, 0)),    # dense levels above a
        st.Format((st.compressed, st.dense, st.compressed), (2, 0, 1))],   # compressed one
}


SMALL_EXTENTS = (1, 2, 3, 5, 5, 0)
# Extents that reach what small shapes never do: 8-wide vector steps and their tails, sums
# side by side, register tiles, row bitmaps of several words, two threads (a cap on operand
# and result sizes keeps each case under a second).
MEDIUM_EXTENTS = (1, 4, 9, 17, 33, 64, 130)
MEDIUM_CAP = 200_000


@hst.composite
def random_einsums(draw, extents=SMALL_EXTENTS, densities=(0.0, 0.2, 0.5, 1.0), cap=None,
                   notation=False):
    """``notation``: subscripts may also repeat an index (diagonals), start with an
    ellipsis (written for the letter ``e``: one leading dimension), leave the output
    implicit and give an operand size 1 where the index has another size (broadcasting;
    written as the capital letter)."""
    alphabet = "ijkl"
    nops = draw(hst.integers(1, 3))
    ellipsis = notation and draw(hst.booleans())
    terms = []
    for _ in range(nops):
        lead = "e" if ellipsis and draw(hst.booleans()) else ""
        order = draw(hst.integers(1, 3 - len(lead)))
        term = lead + "".join(draw(hst.lists(hst.sampled_from(alphabet), min_size=order,
                                              max_size=order, unique=not notation)))
        if notation:   # (a diagonal's dimensions have one size: torch.einsum says so too)
            term = "".join(c.upper() if term.count(c) == 1 and draw(hst.integers(0, 5)) == 0
                           else c for c in term)
        terms.append(term)
    used = sorted(set("".join(terms).lower()) - {"e"})
    out = "".join(draw(hst.lists(hst.sampled_from(used), unique=True)))
    named = "".join(terms).lower()
    if "e" in named and draw(hst.booleans()):
        out = "e" + out               # the ellipsis kept (else summed)
    eq = (",".join(terms).lower() + "->" + out).replace("e", "...")
    if notation and draw(hst.integers(0, 3)) == 0:   # implicit: torch.einsum's own output
        eq = eq.split("->")[0]
        out = ("e" if "e" in named else "") + "".join(c for c in used if named.count(c) == 1)
    ext = {c: draw(hst.sampled_from(extents)) for c in set(named)}
    while cap is not None:      # shrink the largest extent of an oversized tensor
        big = [t for t in (*terms, out) if math.prod(ext[c] for c in t) > cap]
        if not big:
            break
        c = max(big[0], key=ext.get)
        ext[c] //= 4
    fmts = [draw(hst.sampled_from(FORMATS_BY_ORDER[len(t)])) for t in terms]
    density = draw(hst.sampled_from(densities))
    dtype = draw(hst.sampled_from([F64, F32]))
    index_dtype = draw(hst.sampled_from([torch.int32, torch.int64]))
    out_format = None
    if out and draw(hst.integers(0, 4)) == 0:
        out_format = draw(hst.sampled_from(["dense", "coo", "csf"]))
    seed = draw(hst.integers(0, 2**16))
    return eq, terms, ext, fmts, density, dtype, index_dtype, out_format, seed


def _check_random_einsum(spec):
    eq, terms, ext, fmts, density, dtype, index_dtype, out_format, seed = spec
    gen = torch.Generator().manual_seed(seed)
    ops = []
    for term, fmt in zip(terms, fmts):   # (a capital letter: size 1, broadcast)
        x = random_dense(tuple(ext.get(c, 1) for c in term),
                         density if fmt is not None else 0.8, dtype, gen)
        ops.append(make_operand(x, fmt, index_dtype if fmt is not None else None))
    note = f"{eq} formats={[fmt_label(f) for f in fmts]} ext={ext} out_format={out_format}"
    try:
        for _ in range(2):        # the second call takes the warm path: same answer
            check_against_dense(eq, ops, out_format=out_format)
    except AssertionError as e:
        raise AssertionError(f"{note}: {e}") from e


@pytest.mark.slow
@settings(max_examples=examples(30), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_einsums())
def test_random_einsum_matches_torch(spec):
    _check_random_einsum(spec)


@settings(max_examples=examples(6), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_einsums(MEDIUM_EXTENTS, (0.0, 0.02, 0.1, 0.5, 1.0), MEDIUM_CAP))
def test_random_einsum_of_medium_size_matches_torch(spec):
    """Random equations at sizes where kernels take their vector, side-by-side, tiled,
    bitmap and threaded paths, which the small extents above never reach."""
    _check_random_einsum(spec)


@settings(max_examples=examples(15), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_einsums(notation=True))
def test_random_einsum_notation_matches_torch(spec):
    """Random equations with diagonals of any operand, ellipses, implicit outputs and sizes
    of 1 that broadcast."""
    _check_random_einsum(spec)
