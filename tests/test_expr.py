"""Elementwise expressions against the same arithmetic on dense copies: eager operators on
SparseTensor (``A + B`` unions patterns, ``A * B`` intersects, ``A - B``, ``-A``, ``2 * A``,
``A / 2``), ``st.relu/abs/exp/sqrt``, and ``st.lazy`` trees compiled into one kernel, over
every pair of formats, dtypes, index dtypes and shapes (nnz = 0, empty rows, size-1/size-0
dims, disjoint and identical patterns).
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import sparsetorch as st
from dense_check import (COO3, check_against_dense, fmt_label,  # noqa: F401
                         make_operand, private_kernel_cache, random_dense,
                         seed_of, stored_pattern)

F64, F32, I64 = torch.float64, torch.float32, torch.int64
BSR = ("bsr", (2, 2))
EW = ["csr", "csc", "coo", "dcsr", "dcsc", "dense", None]      # None: a plain torch tensor

OPS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: a - b,
}

# Shape/pattern variants for 2-D operands. 'disjoint': no common entry (the intersection is
# empty, the union is everything stored); 'same': identical patterns.
VARIANTS = {
    "small": dict(shape=(5, 4), da=0.4, db=0.4),
    "size1": dict(shape=(1, 1), da=1.0, db=1.0),
    "one-row": dict(shape=(1, 6), da=0.5, db=0.5),
    "size0": dict(shape=(0, 4), da=0.5, db=0.5),
    "nnz0-left": dict(shape=(5, 4), da=0.0, db=0.5),
    "nnz0-both": dict(shape=(5, 4), da=0.0, db=0.0),
    "empty-slices": dict(shape=(6, 5), da=0.6, db=0.6, empty=True),
    "disjoint": dict(shape=(6, 6), da=1.0, db=1.0, disjoint=True),
    "same": dict(shape=(5, 5), da=0.5, db=0.5, same=True),
    "random-values": dict(shape=(7, 6), da=0.5, db=0.5, integer=False),
}
BSR_VARIANTS = {
    "small": dict(shape=(4, 6), da=0.4, db=0.4),
    "one-block": dict(shape=(2, 2), da=1.0, db=1.0),
    "nnz0-left": dict(shape=(4, 6), da=0.0, db=0.5),
    "disjoint": dict(shape=(6, 6), da=1.0, db=1.0, disjoint=True),
    "random-values": dict(shape=(6, 4), da=0.5, db=0.5, integer=False),
}


def operand_pair(fa, fb, variant, dtype=F64, index_dtype=None, tag=""):
    table = BSR_VARIANTS if BSR in (fa, fb) else VARIANTS
    v = table[variant]
    gen = torch.Generator().manual_seed(seed_of(fmt_label(fa), fmt_label(fb), variant, tag))
    integer = v.get("integer", True)
    a = random_dense(v["shape"], v["da"] if fa is not None else 0.9, dtype, gen,
                     integer=integer, empty_slices=v.get("empty", False))
    b = random_dense(v["shape"], v["db"] if fb is not None else 0.9, dtype, gen,
                     integer=integer, empty_slices=v.get("empty", False))
    if v.get("disjoint"):
        ii, jj = torch.meshgrid(torch.arange(v["shape"][0]), torch.arange(v["shape"][1]),
                                indexing="ij")
        even = ((ii + jj) % 2 == 0)
        a = a * even.to(dtype)
        b = b * (~even).to(dtype)
    if v.get("same"):
        b = random_dense(v["shape"], 1.0, dtype, gen) * (a != 0).to(dtype)
    ix = index_dtype
    return make_operand(a, fa, ix if fa is not None else None), \
        make_operand(b, fb, ix if fb is not None else None)


def _is_sparse(f):
    return f is not None and f != "dense"


def expected(op, fa, fb):
    """(kind, exact-pattern operand index or None) by docs/design.md: ``+``/``-`` with a dense
    operand is dense; ``*`` with one sparse operand takes that operand's pattern exactly."""
    sa, sb = _is_sparse(fa), _is_sparse(fb)
    if op in ("add", "sub"):
        return ("sparse" if sa and sb else "dense"), None
    if sa and sb:
        return "sparse", None
    if sa or sb:
        return "sparse", (0 if sa else 1)
    return "dense", None


def run_pair(op, fa, fb, dtype=F64, index_dtype=None, variants=None):
    table = BSR_VARIANTS if BSR in (fa, fb) else VARIANTS
    kind, exact = expected(op, fa, fb)
    for variant in variants or table:
        A, B = operand_pair(fa, fb, variant, dtype, index_dtype)
        structure = None
        if kind == "sparse" and exact is None:   # '+' unions, '*' intersects the patterns
            pa, pb = stored_pattern(A), stored_pattern(B)
            structure = pa & pb if op == "mul" else pa | pb
        try:
            check_against_dense(OPS[op], [A, B], kind=kind, structure=structure,
                                same_pattern_as=(A, B)[exact] if exact is not None else None)
        except AssertionError as e:
            raise AssertionError(f"{op}({fmt_label(fa)}, {fmt_label(fb)}) variant {variant!r} "
                                 f"{dtype}: {e}") from e


PAIRS = [(fa, fb) for fa in EW for fb in EW if (fa, fb) != (None, None)]


@pytest.mark.parametrize("fa,fb", PAIRS, ids=[f"{fmt_label(a)}-{fmt_label(b)}" for a, b in PAIRS])
@pytest.mark.parametrize("op", ["add", "mul"])
def test_binary_all_format_pairs(op, fa, fb):
    run_pair(op, fa, fb)


SUB_PAIRS = [(f, f) for f in EW if f is not None] + [("csr", "coo"), ("dcsc", "csr"),
                                                      ("csc", None), (None, "coo"),
                                                      ("dense", "dcsr")]


@pytest.mark.parametrize("fa,fb", SUB_PAIRS,
                         ids=[f"{fmt_label(a)}-{fmt_label(b)}" for a, b in SUB_PAIRS])
def test_subtract(fa, fb):
    run_pair("sub", fa, fb)


@pytest.mark.parametrize("op,fa,fb", [("add", BSR, "csr"), ("mul", BSR, BSR),
                                      ("mul", "csr", BSR), ("sub", BSR, None)],
                         ids=["bsr+csr", "bsr*bsr", "csr*bsr", "bsr-torch"])
def test_binary_bsr(op, fa, fb):
    run_pair(op, fa, fb)


@pytest.mark.parametrize("dtype", [F32, I64, torch.int32], ids=["float32", "int64", "int32"])
@pytest.mark.parametrize("op,fa,fb", [("add", "csr", "csr"), ("mul", "csr", "coo"),
                                      ("sub", "dcsc", "csr"), ("add", "coo", None),
                                      ("mul", "csc", None)])
def test_binary_dtypes(op, fa, fb, dtype):
    run_pair(op, fa, fb, dtype)


@pytest.mark.parametrize("op,fa,fb", [("add", "csr", "csr"), ("mul", "coo", "dcsr"),
                                      ("sub", "csc", "dcsc")])
def test_binary_int64_indices(op, fa, fb):
    run_pair(op, fa, fb, index_dtype=torch.int64)


def test_binary_mixed_index_dtypes():
    a = random_dense((5, 4), 0.5, F64, torch.Generator().manual_seed(1))
    b = random_dense((5, 4), 0.5, F64, torch.Generator().manual_seed(2))
    A = st.tensor(a, "csr", index_dtype=torch.int32)
    B = st.tensor(b, "csr", index_dtype=torch.int64)
    check_against_dense(OPS["add"], [A, B], kind="sparse")
    check_against_dense(OPS["mul"], [B, A], kind="sparse",
                        structure=stored_pattern(A) & stored_pattern(B))


@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("coo", "dcsc"), ("csf", "csf")])
def test_sparse_times_sparse_intersects(fa, fb):
    """Regression: A * B of two sparse operands was 'sampled' on A and stored A's whole
    pattern (explicit zeros where B is absent) instead of the intersection."""
    gen = torch.Generator().manual_seed(3)
    shape = (6, 5) if fa != "csf" else (3, 4, 5)
    A = st.tensor(random_dense(shape, 0.6, F64, gen), fa)
    B = st.tensor(random_dense(shape, 0.3, F64, gen), fb)
    check_against_dense(OPS["mul"], [A, B], kind="sparse",
                        structure=stored_pattern(A) & stored_pattern(B))


# -- expression trees and unary maps -----------------------------------------------------------
def _three(fmts, shape=(6, 5), dtype=F64, density=0.4, seed=0, integer=True):
    gen = torch.Generator().manual_seed(seed)
    return [make_operand(random_dense(shape, density if f is not None else 0.9, dtype, gen,
                                      integer=integer), f) for f in fmts]


L = st.lazy
TREES = {
    # name: (lazy builder, dense reference, expected kind)
    "A*B+C": (lambda a, b, c: L(a) * b + c, lambda a, b, c: a * b + c, "sparse"),
    "relu(A-B)": (lambda a, b, c: (L(a) - b).relu(), lambda a, b, c: (a - b).relu(), "sparse"),
    "st.relu(lazy A-B)": (lambda a, b, c: st.relu(L(a) - b), lambda a, b, c: (a - b).relu(),
                          "sparse"),
    "exp(A)": (lambda a, b, c: L(a).exp(), lambda a, b, c: a.exp(), "dense"),
    "sqrt(abs(A))": (lambda a, b, c: st.sqrt(st.abs(L(a))), lambda a, b, c: a.abs().sqrt(),
                     "sparse"),
    "abs(A)*2-B/4": (lambda a, b, c: L(a).abs() * 2 - L(b) / 4,
                     lambda a, b, c: a.abs() * 2 - b / 4, "sparse"),
    "-(A+B)*C": (lambda a, b, c: -(L(a) + b) * c, lambda a, b, c: -(a + b) * c, "sparse"),
    "A*B*C": (lambda a, b, c: L(a) * b * c, lambda a, b, c: a * b * c, "sparse"),
    "exp(A)*B": (lambda a, b, c: L(a).exp() * b, lambda a, b, c: a.exp() * b, "sparse"),
    "A+0": (lambda a, b, c: L(a) + 0, lambda a, b, c: a, "sparse"),
    "3*A-0.5*B+C": (lambda a, b, c: 3 * L(a) - 0.5 * L(b) + c,
                    lambda a, b, c: 3 * a - 0.5 * b + c, "sparse"),
}


@pytest.mark.parametrize("fmts", [("csr", "coo", "dcsc"), ("csc", "csr", "csr")],
                         ids=["csr-coo-dcsc", "csc-csr-csr"])
@pytest.mark.parametrize("name", list(TREES))
def test_lazy_trees(name, fmts):
    build, ref, kind = TREES[name]
    for seed, density in [(0, 0.4), (1, 0.0), (2, 1.0)]:
        ops = _three(fmts, seed=seed, density=density)
        check_against_dense(lambda a, b, c: build(a, b, c), ops, ref=ref, kind=kind,
                            structure=None)


@pytest.mark.parametrize("name,kind", [("A*B+C", "sparse"), ("relu(A-B)", "dense"),
                                       ("A*B*C", "sparse"), ("-(A+B)*C", "sparse"),
                                       ("exp(A)*B", "dense")])
def test_lazy_tree_with_a_dense_operand(name, kind):
    """B is a plain dense tensor: A*B is sampled on A, so A*B + C stays sparse; A - B and
    exp(A) * B can be nonzero anywhere, so they are dense."""
    build, ref, _ = TREES[name]
    ops = _three(("csr", None, "coo"), seed=4)
    check_against_dense(build, ops, ref=ref, kind=kind)


def test_mixed_sparse_dense_sum_is_dense_and_product_is_sampled():
    A, D = _three(("csr", None), seed=5)[:2]
    check_against_dense(lambda a, d: a + d, [A, D], kind="dense")
    check_against_dense(lambda a, d: d + a, [A, D], kind="dense")
    check_against_dense(lambda a, d: a - d, [A, D], kind="dense")
    check_against_dense(lambda a, d: d - a, [A, D], kind="dense")
    for fn, ref in [(lambda a, d: a * d, None), (lambda a, d: d * a, None),
                    (lambda a, d: (L(a) * d).relu(), lambda a, d: (a * d).relu()),
                    (lambda a, d: 0.5 * (L(d) * a), lambda a, d: 0.5 * (d * a))]:
        r = check_against_dense(fn, [A, D], ref=ref, kind="sparse", same_pattern_as=A)
        for name, arr in A.arrays.items():      # the very same pattern
            assert torch.equal(r.arrays[name], arr)


@pytest.mark.parametrize("f", ["csr", "csc", "coo", "dcsr", "dcsc", "csf-3d", "coo3", "csf-1d",
                               "dense"])
def test_unary_and_scaling(f):
    shape = {"csf-3d": (3, 4, 5), "coo3": (3, 4, 5), "csf-1d": (7,)}.get(f, (5, 4))
    fmt = {"csf-3d": "csf", "coo3": COO3, "csf-1d": "csf"}.get(f, f)
    gen = torch.Generator().manual_seed(seed_of(f))
    for density in (0.4, 0.0, 1.0):
        A = make_operand(random_dense(shape, density, F64, gen, integer=False), fmt)
        sparse = f != "dense"
        k = "sparse" if sparse else "dense"
        pat = A if sparse else None
        check_against_dense(lambda a: st.relu(a), [A], ref=lambda a: a.relu(), kind=k,
                            same_pattern_as=pat)
        check_against_dense(lambda a: st.abs(a), [A], ref=lambda a: a.abs(), kind=k,
                            same_pattern_as=pat)
        check_against_dense(lambda a: st.sqrt(st.abs(a)), [A], ref=lambda a: a.abs().sqrt(),
                            kind=k, same_pattern_as=pat)
        check_against_dense(lambda a: st.exp(a), [A], ref=lambda a: a.exp(), kind="dense")
        check_against_dense(lambda a: -a, [A], kind=k, same_pattern_as=pat)
        check_against_dense(lambda a: 2 * a, [A], kind=k, same_pattern_as=pat)
        check_against_dense(lambda a: a * 2.5, [A], kind=k, same_pattern_as=pat)
        check_against_dense(lambda a: a / 2, [A], kind=k, same_pattern_as=pat)


def test_division_by_zero_divides_the_stored_values_like_torch_sparse():
    """(ZeroDivisionError before; found by a fuzzer.) The pattern stays, as torch.sparse
    keeps it: stored values over zero, signed by the zero."""
    A = st.tensor(torch.tensor([[1.0, 0.0], [-2.0, 0.0]], dtype=F64), "csr")
    inf = float("inf")
    assert (A / 0).values.tolist() == [inf, -inf]
    assert (A / -0.0).values.tolist() == [-inf, inf]
    assert (st.lazy(A) / 0).eval().values.tolist() == [inf, -inf]
    assert (A / 0).values.tolist() == (A.to_torch().to_sparse_coo() / 0).coalesce().values().tolist()


def test_sqrt_of_negative_values_is_nan_like_torch():
    a = torch.tensor([[4.0, 0.0, -1.0], [0.0, 9.0, 0.0]], dtype=F64)
    A = st.tensor(a, "csr")
    check_against_dense(lambda x: st.sqrt(x), [A], ref=lambda x: x.sqrt(), kind="sparse")


@pytest.mark.parametrize("dtype", [F32, I64], ids=["float32", "int64"])
def test_unary_dtypes(dtype):
    gen = torch.Generator().manual_seed(7)
    A = st.tensor(random_dense((5, 4), 0.5, dtype, gen, integer=dtype != F32), "csr")
    check_against_dense(lambda a: st.relu(a), [A], ref=lambda a: a.relu(), kind="sparse")
    check_against_dense(lambda a: st.abs(a), [A], ref=lambda a: a.abs(), kind="sparse")
    check_against_dense(lambda a: -a, [A], kind="sparse")
    check_against_dense(lambda a: 3 * a, [A], kind="sparse")
    if dtype.is_floating_point:
        check_against_dense(lambda a: st.exp(a), [A], ref=lambda a: a.exp(), kind="dense")
        check_against_dense(lambda a: st.sqrt(st.abs(a)), [A], ref=lambda a: a.abs().sqrt(),
                            kind="sparse")
        check_against_dense(lambda a: a / 4, [A], kind="sparse")


@pytest.mark.parametrize("fa,fb", [("csf", "csf"), (COO3, "csf"),
                                   (st.Format((st.compressed,) * 3, (2, 0, 1)), "csf"),
                                   ("csf", None)],
                         ids=["csf-csf", "coo3-csf", "csf201-csf", "csf-torch"])
def test_three_dimensional(fa, fb):
    gen = torch.Generator().manual_seed(seed_of(fmt_label(fa), fmt_label(fb)))
    for density in (0.3, 0.0):
        A = make_operand(random_dense((3, 4, 5), density, F64, gen), fa)
        B = make_operand(random_dense((3, 4, 5), 0.3 if fb is not None else 0.9, F64, gen), fb)
        both = fb is not None
        check_against_dense(OPS["add"], [A, B], kind="sparse" if both else "dense")
        check_against_dense(OPS["mul"], [A, B], kind="sparse",
                            structure=stored_pattern(A) & stored_pattern(B),
                            same_pattern_as=None if both else A)
        check_against_dense(lambda a, b: (L(a) - b).relu(), [A, B],
                            ref=lambda a, b: (a - b).relu(), kind="sparse" if both else None)


def test_one_dimensional():
    gen = torch.Generator().manual_seed(8)
    x = st.tensor(random_dense((9,), 0.4, F64, gen), "csf")
    y = st.tensor(random_dense((9,), 0.4, F64, gen), "coo")
    check_against_dense(OPS["add"], [x, y], kind="sparse")
    check_against_dense(OPS["sub"], [x, y], kind="sparse")
    check_against_dense(OPS["mul"], [x, y], kind="sparse",
                        structure=stored_pattern(x) & stored_pattern(y))


# -- out_format on lazy trees --------------------------------------------------------------------
@pytest.mark.parametrize("out", ["csc", "coo", "dcsr", "dense", "csr",
                                 st.Format((st.compressed, st.dense))], ids=fmt_label)
def test_lazy_eval_out_format(out):
    A, B, C = _three(("csr", "coo", "dcsc"), seed=9)
    r = check_against_dense(lambda a, b, c: L(a) * b + c, [A, B, C], out_format=out,
                            ref=lambda a, b, c: a * b + c,
                            kind="dense" if out == "dense" else "sparse")
    if isinstance(out, st.Format):
        assert r.format == out
    elif out != "dense":
        assert r.format.name == out


def test_lazy_eval_bad_out_format():
    A, B = _three(("csr", "csr"), seed=10)[:2]
    with pytest.raises(ValueError):
        (L(A) + B).eval(out_format="nope")
    with pytest.raises(ValueError):
        (L(A) + B).eval(out_format=st.Format((st.compressed,) * 3))   # wrong order


# -- one kernel per tree, laziness, explain ------------------------------------------------------
def test_tree_is_one_kernel_and_warm_calls_build_nothing():
    A, B, C = _three(("dcsr", "csc", "coo"), seed=11)
    expr = (L(A) * B - C).abs()
    st.runtime.reset_stats()
    expr.eval()
    assert st.runtime.stats()["builds"] <= 1          # the whole tree: one library
    st.runtime.reset_stats()
    A2, B2, C2 = _three(("dcsr", "csc", "coo"), shape=(7, 3), seed=12)
    check_against_dense(lambda a, b, c: (L(a) * b - c).abs(), [A2, B2, C2],
                        ref=lambda a, b, c: (a * b - c).abs(), kind="sparse")
    assert st.runtime.stats()["builds"] == 0          # same structure, new shapes and values


def test_lazy_is_lazy_and_explainable():
    A, B = _three(("csr", "csr"), seed=13)[:2]
    st.runtime.reset_stats()
    expr = (L(A) + B).relu() * 2
    assert isinstance(expr, st.LazyExpr) and expr.shape == (6, 5)
    assert st.runtime.stats()["builds"] == 0           # nothing ran yet
    assert "relu" in repr(expr)
    e = st.explain(expr)
    assert e.output_kind == "emit" and "relu" in e.assignment
    assert "void kernel" in e.source
    assert isinstance(st.relu(L(A)), st.LazyExpr)     # st.relu on a lazy node stays lazy
    assert st.explain(expr, out_format="csc").output_format == "csc"


def test_operator_results_feed_further_operators():
    A, B, C = _three(("csr", "coo", "dcsc"), seed=14)
    check_against_dense(lambda a, b, c: ((a + b) * c - a) / 2, [A, B, C],
                        structure=None, kind="sparse")
    check_against_dense(lambda a, b, c: st.relu(a - b) + st.abs(c), [A, B, C],
                        ref=lambda a, b, c: (a - b).relu() + c.abs(), kind="sparse")


@pytest.mark.slow   # ~9 s of long loops (the full suite runs it)
def test_expressions_built_in_long_loops_stay_correct_and_quick():
    """A sum of hundreds of terms built in a loop, and hundreds of nested maps, evaluate
    (in parts: ``expr._MAX_DEPTH`` / ``_MAX_OPERANDS``) to the dense result, gradients
    included. A chain of 500 sums exceeded Python's recursion limit; 20 nested relus
    (each repeated its argument's C text) did not compile in a minute."""
    A, B = _three(("csr", "coo"), seed=15, integer=False)
    a, b = A.to_dense(), B.to_dense()
    total, ref = L(A), a
    for k in range(300):
        total, ref = total + L(B) * (k % 3), ref + b * (k % 3)
    torch.testing.assert_close(total.eval().to_dense(), ref)
    deep, ref = L(A), a
    start = time.perf_counter()
    for _ in range(150):
        deep, ref = (deep * -1.25).relu() - L(B).abs(), (ref * -1.25).relu() - b.abs()
    torch.testing.assert_close(deep.eval().to_dense(), ref)
    assert time.perf_counter() - start < 60
    x = torch.rand(4, 3, dtype=F64, requires_grad=True)
    chain = L(x)
    for _ in range(200):
        chain = chain - L(x) * 0.25
    chain.eval().sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 1 - 200 * 0.25))


def test_scalars_of_every_kind():
    """NumPy scalars scale like Python ones; adding a float 0 makes floats of integers (as
    torch); a Python int past float's range scales to +-inf instead of an OverflowError."""
    xi = st.tensor(torch.tensor([[1, 0], [0, 2]]))
    d = xi.to_dense()
    for got in (xi + 0.0, 0.0 + xi, xi - 0.0, (L(xi) - 0.0).eval(), (0.0 + L(xi)).eval()):
        assert got.dtype == (d + 0.0).dtype
        torch.testing.assert_close(got.to_dense(), d + 0.0)
    assert (xi + 0).dtype == (L(xi) + 0).eval().dtype == torch.int64
    torch.testing.assert_close((L(xi) * np.int64(3)).eval().to_dense(), d * 3)
    half = (L(xi) * np.float32(2.5)).eval()
    torch.testing.assert_close(half.to_dense(), d * 2.5)
    S = st.tensor(torch.tensor([[1.0, -2.0, 0.0]]))
    assert (S * 10 ** 400).to_dense().tolist() == [[math.inf, -math.inf, 0.0]]
    assert (L(S) / 10 ** 400).eval().to_dense().tolist() == [[0.0, -0.0, 0.0]]


@pytest.mark.parametrize("dtype, factor", [
    (torch.int64, 2 ** 53 + 1), (torch.int64, -(2 ** 62) - 3), (torch.int64, 2 ** 64 - 3),
    (torch.int32, 2 ** 31), (torch.int32, 3_000_000_001), (torch.int32, -(2 ** 63)),
    (torch.int32, 2 ** 63 + 12345), (torch.int32, np.int64(-(2 ** 40) - 1))])
def test_integer_scaling_is_exact_and_wraps_as_torch(dtype, factor):
    """An integer factor multiplies integers exactly (past 2^53, where a float factor
    loses the low bits) and an int32 product wraps as torch's does (a float factor
    saturated); so does a factor of a factored-out sum and one that crossed a traced
    graph as text. -2^63 and factors in [2^63, 2^64) too (modulo 2^64, as torch); past 64
    bits a ValueError (torch: OverflowError)."""
    d = torch.tensor([[3, 0, -7], [0, 1, 0]], dtype=dtype)
    xi = st.tensor(d, "csr")
    want = d * int(factor)
    for got in (xi * factor, factor * xi, (L(xi) * factor - L(xi)).eval() + xi,
                (L(xi).relu() * factor - (L(xi) * -1).relu() * factor).eval()):
        assert got.dtype == dtype
        assert torch.equal(got.to_dense(), want)
    ones = torch.ones(3, 2, dtype=dtype)
    assert torch.equal(st.einsum("ij,jk->ik", xi, ones) * int(factor),
                       (d @ ones) * int(factor))
    from sparsetorch.ops.expr import _parse, _render
    tree = (L(xi) * factor).tree
    assert _parse(iter(_render(tree).split()), ("i", "j")) == tree
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        xi * 2 ** 64


# -- errors ------------------------------------------------------------------------------------
def test_errors():
    A, B = _three(("csr", "csr"), seed=15)[:2]
    C = st.tensor(torch.ones(3, 5, dtype=F64), "csr")
    with pytest.raises(ValueError, match="shape"):
        A + C                                              # no broadcasting
    with pytest.raises(ValueError, match="shape"):
        L(A) * torch.ones(6, 1, dtype=F64)
    with pytest.raises(TypeError):
        A / B                                              # only division by a scalar
    with pytest.raises(TypeError):
        A + 1                                              # adding a nonzero scalar densifies
    with pytest.raises(TypeError):
        L(2.0)
    with pytest.raises(TypeError):
        L("A")
    # float64 with float32 promotes as torch does (issue 31 item 1)
    assert (A + st.tensor(torch.ones(6, 5), "csr")).dtype == F64
    assert (L(A) * torch.ones(6, 5)).eval().dtype == F64


# -- the pure-torch backend ----------------------------------------------------------------------
@pytest.mark.parametrize("op,fa,fb", [("add", "csr", "coo"), ("mul", "csr", "dcsc"),
                                      ("mul", "csc", None), ("sub", "dcsr", "dense"),
                                      ("add", None, "csr")])
def test_torch_backend(op, fa, fb, monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    builds = st.runtime.stats()["builds"]
    run_pair(op, fa, fb, variants=["small", "disjoint", "nnz0-left", "size1"])
    A, B, C = _three(("csr", "coo", "dcsc"), seed=16)
    check_against_dense(lambda a, b, c: (L(a) * b + c).relu(), [A, B, C],
                        ref=lambda a, b, c: (a * b + c).relu(), kind="sparse")
    check_against_dense(lambda a: st.exp(a), [A], ref=lambda a: a.exp(), kind="dense")
    assert st.runtime.stats()["builds"] == builds


# -- random expression trees (hypothesis) --------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from dense_check import LONG, examples  # noqa: E402

TREE_FORMATS = ["csr", "csc", "coo", "dcsr", "dcsc", "dense", None]


def _trees(n_leaves):
    leaf = hst.integers(0, n_leaves - 1).map(lambda k: ("leaf", k))

    def extend(children):
        return hst.one_of(
            hst.tuples(hst.sampled_from(["add", "sub", "mul"]), children, children),
            hst.tuples(hst.just("scale"), hst.sampled_from([-2.0, 0.5, 3.0]), children),
            hst.tuples(hst.sampled_from(["relu", "abs", "neg"]), children))
    return hst.recursive(leaf, extend, max_leaves=5)


def _build(tree, leaves, lazy):
    """The tree over ``leaves``: as LazyExpr nodes (lazy=True) or plain torch arithmetic."""
    kind = tree[0]
    if kind == "leaf":
        return L(leaves[tree[1]]) if lazy else leaves[tree[1]]
    if kind in ("add", "sub", "mul"):
        a, b = _build(tree[1], leaves, lazy), _build(tree[2], leaves, lazy)
        return a + b if kind == "add" else a - b if kind == "sub" else a * b
    if kind == "scale":
        return tree[1] * _build(tree[2], leaves, lazy)
    x = _build(tree[1], leaves, lazy)
    if kind == "neg":
        return -x
    return x.relu() if kind == "relu" else x.abs()


def _pattern(tree, leaves):
    """Where the tree can be nonzero: '+'/'-' union, '*' intersect, maps keep zeros."""
    kind = tree[0]
    if kind == "leaf":
        return stored_pattern(leaves[tree[1]])
    if kind in ("add", "sub", "mul"):
        a, b = _pattern(tree[1], leaves), _pattern(tree[2], leaves)
        return a & b if kind == "mul" else a | b
    return _pattern(tree[-1], leaves)


@settings(max_examples=examples(25), deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=_trees(3), fmts=hst.lists(hst.sampled_from(TREE_FORMATS), min_size=3, max_size=3),
       shape=hst.sampled_from([(4, 5), (1, 3), (0, 2), (6, 1)]),
       density=hst.sampled_from([0.0, 0.3, 1.0]), seed=hst.integers(0, 2**16))
def test_random_expression_trees(tree, fmts, shape, density, seed):
    gen = torch.Generator().manual_seed(seed)
    leaves = [make_operand(random_dense(shape, density if f is not None else 0.8, F64, gen), f)
              for f in fmts]
    if tree[0] == "leaf":
        tree = ("relu", tree)          # evaluating a bare leaf is not an expression
    check_against_dense(lambda *ls: _build(tree, ls, True), leaves,
                        ref=lambda *ls: _build(tree, ls, False),
                        structure=_pattern(tree, leaves))
