"""One helper drives the compiler tests: ``check_against_dense`` runs an op through sparsetorch
and the same computation through ``torch.einsum`` (or the dense expression) on dense copies,
and compares values, result type, shape, dtype and -- for sparse results -- the structure.

Also here: the fixture every compiler test module imports (a private kernel cache for the
session), random operand builders, and ``run_isolated`` for tests of bugs that crashed the
interpreter (a segfault must fail one test, not the whole run).

``SPARSETORCH_LONG_TESTS=1`` multiplies hypothesis budgets (``examples(n)``);
``SPARSETORCH_TEST_CACHE=/some/dir`` reuses a kernel cache across runs (default: a fresh
temporary directory, so tests never read or write the user's cache).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import sparsetorch as st
from sparsetorch.compiler import sblock

LONG = os.environ.get("SPARSETORCH_LONG_TESTS", "") not in ("", "0")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# float64: rtol 1e-10; float32: rtol 1e-4 (the spec). atol is the same relative
# tolerance times the scale of the terms summed (einsum of |operands|), so cancellation near
# zero does not fail a correct float32 kernel.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}

# The 3-D COO layout (compressed non-unique, singleton non-unique, singleton), spelled out.
COO3 = st.Format((st.Compressed(unique=False), st.Singleton(unique=False), st.singleton))


def examples(n: int) -> int:
    """Hypothesis example budget: ``n`` normally, 25x that for long runs."""
    return n * 25 if LONG else n


# -- fixtures (import them into each test module) ---------------------------------------------
_SESSION: dict = {}


@pytest.fixture(scope="session", autouse=True)
def private_kernel_cache(tmp_path_factory):
    """Point SPARSETORCH_CACHE at a private directory for the whole session and forget any
    kernel loaded from elsewhere. Idempotent: several modules import this fixture."""
    if "dir" not in _SESSION:
        _SESSION["old"] = os.environ.get("SPARSETORCH_CACHE")
        d = os.environ.get("SPARSETORCH_TEST_CACHE") or _run_cache_dir(tmp_path_factory)
        _SESSION["dir"] = d
        os.environ["SPARSETORCH_CACHE"] = d
        st.runtime.clear_cache(disk=False)
    os.environ["SPARSETORCH_CACHE"] = _SESSION["dir"]
    yield _SESSION["dir"]
    if _SESSION.get("old") is None:
        os.environ.pop("SPARSETORCH_CACHE", None)
    else:
        os.environ["SPARSETORCH_CACHE"] = _SESSION["old"]


def _run_cache_dir(tmp_path_factory) -> str:
    """A kernel cache for this run: under pytest-xdist one for all its workers (the
    folder above each worker's own), so a kernel is compiled once whichever worker needs
    it first (the cache's locks serialise two builds of one kernel)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        d = tmp_path_factory.getbasetemp().parent / "sparsetorch-kernel-cache"
        d.mkdir(exist_ok=True)
        return str(d)
    return str(tmp_path_factory.mktemp("sparsetorch-kernel-cache"))


@pytest.fixture
def split_by_rows(monkeypatch):
    """Three threads, with every depthwise walk split by output rows (and the stem
    convolution's rows split however few), every
    ``SparseConv2d`` over the narrow kernel's column bands however small the tensors
    (``ops.depthwise.ROW_SPLIT_PIXELS``): bands of one row or none, bands that start inside
    a plane, and batches whose bands span images."""
    from sparsetorch.ops import depthwise, narrow, stem
    monkeypatch.setattr(depthwise, "ROW_SPLIT_PIXELS", 1)
    monkeypatch.setattr(depthwise, "_PARALLEL_OUTPUTS", 1)
    monkeypatch.setattr(stem, "_PARALLEL_OUTPUTS", 1)
    monkeypatch.setattr(narrow, "_PARALLEL_WORK", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def fresh_dynamo():
    """``torch.compile``'s caches reset around the test: the tests of a module compile the
    same layers' ``forward`` anew, and dynamo's limit of 8 recompilations a code object was
    reached across them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_keeping_graphs(fn, graphs: list, **kwargs):
    """``torch.compile(fn, fullgraph=True)`` on aot_eager (dynamo and autograd tracing, no
    C++ build), appending each graph dynamo captures to ``graphs``: tests look in them for
    the custom ops a traced layer records."""
    def keep(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    return torch.compile(fn, fullgraph=True, backend=keep, **kwargs)


def forget_call_memo() -> None:
    """Empty the ops layer's per-signature call memos, for tests that need the next call to
    take the cold path (build, schedule). Other tests share the memos across the session on
    purpose: a long-lived process sees many structures."""
    from sparsetorch.ops import execute

    execute.forget_calls()


# -- operands ---------------------------------------------------------------------------------
def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def random_values(shape, dtype, gen, *, integer=True) -> torch.Tensor:
    """Integer-valued (exact in every dtype) or normal random values, no zeros."""
    if integer or not dtype.is_floating_point:
        v = torch.randint(1, 6, shape, generator=gen) * (
            2 * torch.randint(0, 2, shape, generator=gen) - 1)
        return v.to(dtype)
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    return (v + torch.sign(v) * 0.1).to(dtype)


def random_dense(shape, density, dtype, gen, *, integer=True, empty_slices=False):
    """Random tensor with about ``density`` of its entries nonzero. ``empty_slices`` also
    zeroes the first and last index of every mode (empty rows, columns, fibers)."""
    shape = tuple(shape)
    x = random_values(shape, dtype, gen, integer=integer)
    keep = torch.rand(shape, generator=gen) < density
    x = x * keep.to(x.dtype)
    if empty_slices:
        for d, n in enumerate(shape):
            if n >= 3:
                idx = [slice(None)] * len(shape)
                idx[d] = 0
                x[tuple(idx)] = 0
                idx[d] = n - 1
                x[tuple(idx)] = 0
    return x


def long_rows(rows, cols, density, dtype, seed=0) -> torch.Tensor:
    """A dense matrix of random rows of about ``density * cols`` entries (pruned weights:
    the rows the cache-blocked nests take), with an empty row, a row whose entries all sit
    in the last columns (it skips every earlier block) and a full row."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(-3, 4, (rows, cols), generator=g).to(dtype)
    d[torch.rand(rows, cols, generator=g) >= density] = 0
    d[1] = 0
    d[2, : cols - 5] = 0
    d[3] = 2.5
    return d


def check_sddmm_gradients(d: torch.Tensor, inner: int, note: str) -> None:
    """gradcheck of ``ij,ik,jk->ij`` (float64) on CSR ``d`` with random X and Y of ``inner``
    columns, with respect to the mask's values, X and Y, after checking that ``explain``
    names ``note`` (the nest under test)."""
    A = st.tensor(d, format="csr")
    g = torch.Generator().manual_seed(inner)
    x = torch.randn(d.shape[0], inner, generator=g, dtype=torch.float64)
    y = torch.randn(d.shape[1], inner, generator=g, dtype=torch.float64)
    assert note in " ".join(st.explain("ij,ik,jk->ij", A, x, y).notes)
    vals = A.values.clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda v, x, y: st.einsum("ij,ik,jk->ij", A.with_values(v), x, y).values,
        (vals, x.requires_grad_(), y.requires_grad_()))


def check_sddmm_as_written(equation: str, fmt: str, inner: int, note: str) -> None:
    """SDDMM ``equation`` over a mask of ``long_rows`` (CSR, or ``"csc"`` of its transpose)
    and X, Y of ``inner`` columns (``ki`` as X's transpose), run as written (``st.einsum``
    itself would relayout, e.g. 'ij,ki,jk->ij' as 'ij,ik,jk->ij'), after checking that
    ``explain`` names ``note``."""
    from unittest import mock

    d = long_rows(sblock.GROUP_ROWS + 5, 300, 0.5, torch.float32, seed=4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(d.shape[0], inner, generator=g)
    y = torch.randn(d.shape[1], inner, generator=g)
    A = st.tensor(d if fmt == "csr" else d.T.contiguous(), format=fmt)
    by_term = {"ij": A, "ji": A, "ik": x, "ki": x.T.contiguous(), "jk": y}
    ops = tuple(by_term[t] for t in equation.split("->")[0].split(","))
    with mock.patch.object(importlib.import_module("sparsetorch.ops.einsum"), "relayout",
                           lambda *args: None):
        assert note in " ".join(st.explain(equation, *ops).notes)
        check_against_dense(equation, ops)


def make_operand(x: torch.Tensor, fmt, index_dtype=None):
    """``x`` as a SparseTensor in ``fmt`` (``None``: ``x`` itself, a plain dense tensor;
    ``("bsr", (r, c))``: blocked)."""
    if fmt is None:
        return x
    if isinstance(fmt, tuple) and len(fmt) == 2 and fmt[0] == "bsr":
        return st.tensor(x, "bsr", blocksize=fmt[1], index_dtype=index_dtype)
    return st.tensor(x, fmt, index_dtype=index_dtype)


def fmt_label(fmt) -> str:
    if fmt is None:
        return "torch"
    if isinstance(fmt, tuple) and len(fmt) == 2 and fmt[0] == "bsr":
        return f"bsr{fmt[1][0]}x{fmt[1][1]}"
    if isinstance(fmt, st.Format):
        if fmt == COO3:
            return "coo3"
        kinds = "".join({"Dense": "d", "Compressed": "c", "Singleton": "s"}[type(lv).__name__]
                        for lv in fmt.levels)
        return f"{kinds}{''.join(map(str, fmt.mode_order))}"
    return str(fmt)


def to_dense(t) -> torch.Tensor:
    return t.to_dense() if isinstance(t, st.SparseTensor) else t


def check_same(out, ref) -> None:
    """``out`` is what eager ``ref`` is: same type, same format and shape when sparse, same
    values (float32 to 1e-5). For comparing a compiled or fused function with eager."""
    assert type(out) is type(ref)
    if isinstance(ref, st.SparseTensor):
        assert out.format == ref.format and out.shape == ref.shape
    tol = {} if ref.dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(to_dense(out), to_dense(ref), **tol)


def stored_pattern(t) -> torch.Tensor:
    """Boolean mask of the entries a tensor stores (a plain tensor stores everything)."""
    if not isinstance(t, st.SparseTensor):
        return torch.ones(t.shape, dtype=torch.bool)
    ones = torch.ones(t.nnz, dtype=torch.float64)
    return st.SparseTensor.from_levels(t.shape, t.format, t.arrays, ones, check=False
                                       ).to_dense() != 0


def is_sparse_operand(t) -> bool:
    return isinstance(t, st.SparseTensor) and not t.format.is_dense


# -- what docs/design.md says the result kind is ----------------------------------------------
def expected_kind(equation: str, operands, out_format=None, conversions=(),
                  loop_order=None) -> str:
    """'dense' or 'sparse' for a product einsum, by docs/design.md "Format inference": per output
    level compressed if an operand indexing that variable stores it sparsely, a sparse level
    above a dense one becomes dense (so the result is sparse iff its innermost level is);
    sampled products keep the sampling operand's pattern; an output variable no sparse
    operand indexes is a dense (innermost) level; a scalar is dense. ``conversions``
    ((operand, Format) pairs, as ``st.explain`` reports them) replace operand formats, and
    ``loop_order`` (ditto) orders the output levels: the rule applies to what the kernel
    iterates. Without a loop order, each variable's deepest level position stands in."""
    converted = dict(conversions)
    if "." in equation:   # ellipses: the letters the parser gives them (test_einsum_notation)
        a = st.compiler.parse_einsum(equation, [t.dim() for t in operands])
        terms = {acc.operand: "".join(acc.indices) for acc in a.expr.accesses()}
        equation = f"{','.join(terms[n] for n in sorted(terms))}->{''.join(a.out_vars)}"
    lhs, _, out = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if "->" not in equation:
        counts = {c: lhs.replace(",", "").count(c) for c in lhs.replace(",", "")}
        out = "".join(sorted(c for c, k in counts.items() if k == 1))
    if out_format is not None:
        if isinstance(out_format, str):
            return "dense" if out_format == "dense" else "sparse"
        fmt = out_format if isinstance(out_format, st.Format) else st.Format(tuple(out_format))
        return "dense" if fmt.is_dense else "sparse"
    if not out:
        return "dense"
    sparse = [(n, term, t) for n, (term, t) in enumerate(zip(terms, operands))
              if is_sparse_operand(t)]
    size = {}
    for term, t in zip(terms, operands):
        for c, m in zip(term, t.shape):
            size[c] = m if m != 1 else size.get(c, 1)   # (1 broadcasts, against 0 too)
    for k, (n, term, t) in enumerate(sparse):   # (README) a diagonal, and an operand whose
        kept = "".join(c for c, m in zip(term, t.shape) if m != 1 or size[c] == 1)
        if len(set(kept)) < len(term):          # sizes of 1 broadcast, are compressed levels
            converted.setdefault(n, st.Format((st.compressed,) * len(set(kept))) if kept
                                 else None)     # (nothing left: read as a dense number)
            sparse[k] = (n, "".join(dict.fromkeys(kept)), t)
    sparse = [(n, term, t) for n, term, t in sparse if converted.get(n, t.format) is not None]
    if not sparse:
        return "dense"
    if len(sparse) == 1:   # sampled: the one sparse operand, indexed by exactly the output
        _, term, t = sparse[0]
        if sorted(term) == sorted(out) and len(set(term)) == len(term):
            return "sparse"
    klass, depth = {}, {}
    for n, term, t in sparse:
        fmt = converted.get(n, t.format)
        if fmt.blocksize is not None:   # BSR is CSR over blocks
            fmt = st.Format(fmt.levels[: fmt.ndim], fmt.mode_order)
        for k, (lv, m) in enumerate(zip(fmt.levels, fmt.mode_order)):
            v = term[m]
            sparse_here = not isinstance(lv, st.Dense)
            klass[v] = "sparse" if (sparse_here or klass.get(v) == "sparse") else "dense-level"
            depth[v] = max(depth.get(v, -1), k)
    if any(v not in klass for v in out):
        return "dense"
    if loop_order is not None:
        inner = [v for v in loop_order if v in out][-1]
    else:
        inner = max(out, key=lambda v: depth[v])
    return "sparse" if klass[inner] == "sparse" else "dense"


# -- the check --------------------------------------------------------------------------------
def _plan(eq, operands, out_format):
    """(conversions, loop order) the compiler chose, from ``st.explain``."""
    try:
        e = st.explain(eq, *operands, out_format=out_format)
    except (KeyError, TypeError, ValueError, NotImplementedError):
        return (), None     # e.g. float16: no kernel to explain
    # A blocked operand's variable v runs as v_b (blocks) then v_e (in-block): order by blocks.
    return e.conversions, tuple(dict.fromkeys(v.split("_")[0] for v in e.loop_order))


def _reference_dtype(dtype):
    return torch.float64 if dtype.is_floating_point else torch.int64


def _as_ref(t, dtype):
    return to_dense(t).detach().clone().to(dtype)


def check_against_dense(equation_or_fn, operands, out_format=None, *, ref=None, kind=None,
                        fmt=None, same_pattern_as=None, structure=None, rtol=None, atol=None,
                        allow_explicit_outside=False):
    """Run ``equation_or_fn`` through sparsetorch and densely, compare, and return the result.

    ``equation_or_fn``: an einsum string (run as ``st.einsum(eq, *operands, out_format=...)``,
    reference ``torch.einsum``) or a callable of the operands returning a tensor, a
    SparseTensor or a ``LazyExpr`` (evaluated with ``out_format``); its reference is
    ``ref(*dense_copies)`` if given, else the callable itself on dense copies.

    The reference runs in float64 (int64 for integer dtypes) and is cast to the result dtype.
    Checks: values (float64 rtol 1e-10, float32 rtol 1e-4, atol scaled by the summed
    magnitudes; integers exactly); type (``kind``: 'dense' -> plain strided torch.Tensor,
    'sparse' -> SparseTensor; for einsum strings default from ``expected_kind``); shape;
    dtype (the operands'); sparse results re-validated with
    ``SparseTensor.from_levels(..., check=True)``, level arrays of one index dtype,
    ``fmt`` (a name or Format) if given; ``same_pattern_as`` an operand whose stored pattern
    the result must store exactly (sampled results); ``structure`` a boolean mask outside
    which nothing may be stored (for einsum strings: the structural product of the operands'
    stored patterns -- no wasted entries, no dense blow-up); operands unchanged.
    """
    operands = list(operands)
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    dtype = tensors[0].dtype
    before = [to_dense(t).clone() for t in tensors]
    ref_dtype = _reference_dtype(dtype)
    dense_ops = [_as_ref(t, ref_dtype) if isinstance(t, torch.Tensor) else t for t in operands]

    if isinstance(equation_or_fn, str):
        eq = equation_or_fn
        out = st.einsum(eq, *operands, out_format=out_format)
        expected = torch.einsum(eq, *dense_ops)
        scale = torch.einsum(eq, *[d.abs() for d in dense_ops])
        conversions, loop_order = _plan(eq, operands, out_format)
        if kind is None:
            kind = expected_kind(eq, operands, out_format, conversions, loop_order)
        if structure is None and kind == "sparse":
            # what each operand stores in the layout the kernel reads (a conversion into a
            # layout with a dense inner level stores explicit zeros, and may pass them on)
            laid = list(operands)
            for n, f in conversions:   # (a diagonal's conversion: the pattern it reads is
                if f.ndim == operands[n].dim():   # the operand's, on the diagonal)
                    laid[n] = operands[n].asformat(f)
            pats = [stored_pattern(t).to(torch.float64) for t in laid]
            structure = torch.einsum(eq, *pats) != 0
    else:
        fn = equation_or_fn
        out = fn(*operands)
        if isinstance(out, st.LazyExpr):
            out = out.eval(out_format=out_format)
        expected = (ref or fn)(*dense_ops)
        if isinstance(expected, st.LazyExpr):
            raise TypeError("the dense reference must not build a LazyExpr; pass ref=")
        expected = to_dense(expected)
        scale = expected.abs()

    # -- type, shape, dtype
    if kind == "dense":
        assert type(out) is torch.Tensor, f"expected a plain torch.Tensor, got {out!r}"
    elif kind == "sparse":
        assert isinstance(out, st.SparseTensor), f"expected a SparseTensor, got {type(out)}"
    else:
        assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == tuple(expected.shape), (tuple(out.shape), tuple(expected.shape))
    assert out.dtype == dtype, (out.dtype, dtype)

    # -- structure
    if isinstance(out, st.SparseTensor):
        check_sparse_structure(out, tensors)
        if fmt is not None:
            want = fmt if isinstance(fmt, st.Format) else None
            if isinstance(fmt, (list, tuple)):
                want = st.Format(tuple(fmt))
            if want is not None:
                assert out.format == want, (out.format, want)
            else:
                assert out.format.name == fmt, (out.format.name, fmt)
        if same_pattern_as is not None:
            assert out.nnz == same_pattern_as.nnz, (out.nnz, same_pattern_as.nnz)
            assert torch.equal(stored_pattern(out), stored_pattern(same_pattern_as))
        levels = list(out.format.levels)
        while levels and isinstance(levels[0], st.Dense):
            levels.pop(0)
        pads = any(isinstance(lv, st.Dense) for lv in levels)   # e.g. (compressed, dense)
        # a sampled result keeps its operand's pattern by design (README: "SDDMM -> A's
        # pattern, arrays shared"), even where an empty sum (an extent of 0) leaves zeros
        sampled = any(isinstance(t, st.SparseTensor) and t.format == out.format and
                      t.shape == out.shape and all(out._level_arrays[k] is t._level_arrays[k]
                                                   for k in out._level_arrays) for t in tensors)
        if structure is not None and not allow_explicit_outside and not pads and not sampled:
            outside = stored_pattern(out) & ~structure.to(torch.bool)
            assert not bool(outside.any()), (
                f"result stores {int(outside.sum())} entries outside the structural "
                f"pattern, e.g. at {torch.nonzero(outside)[0].tolist()}")
        got = out.to_dense()
    else:
        assert out.layout == torch.strided
        got = out

    # -- values
    assert_close(got, expected.to(dtype), scale, rtol=rtol, atol=atol)

    # -- operands untouched
    for t, b in zip(tensors, before):
        after = to_dense(t)
        same = after.shape == b.shape and bool(
            ((after == b) | (after.isnan() & b.isnan()) if b.is_floating_point()
             else after == b).all())
        assert same, "an operand was modified"
    return out


def assert_close(got, expected, scale=None, *, rtol=None, atol=None):
    dtype = got.dtype
    if not dtype.is_floating_point:
        assert torch.equal(got, expected), (got, expected)
        return
    r = RTOL[dtype] if rtol is None else rtol
    if atol is None:
        s = 1.0 if scale is None or scale.numel() == 0 else max(1.0, float(scale.abs().max()))
        atol = r * s
    torch.testing.assert_close(got, expected, rtol=r, atol=atol, equal_nan=True)


def check_sparse_structure(out: st.SparseTensor, operands=()) -> None:
    """A SparseTensor result keeps every structural promise: re-validated from its level
    arrays; one index dtype (int32 when every operand's indices were int32 and it fits)."""
    assert out.values.dim() == 1 and out.values.dtype == out.dtype
    dtypes = {a.dtype for a in out.arrays.values()}
    assert len(dtypes) <= 1 and dtypes <= {torch.int32, torch.int64}, dtypes
    again = st.SparseTensor.from_levels(out.shape, out.format, out.arrays, out.values,
                                        check=True)
    assert again.nnz == out.nnz
    wide = any(isinstance(t, st.SparseTensor) and t.arrays and t.index_dtype == torch.int64
               for t in operands)
    if out.arrays and not wide and out.nnz < 2**31 and max(out.shape, default=0) < 2**31:
        assert out.index_dtype == torch.int32, (
            f"indices fit in int32 (docs/design.md: 'Index arrays are int32 when every "
            f"coordinate and position fits') but the result uses {out.index_dtype}")


# -- crash isolation --------------------------------------------------------------------------
def run_isolated(code: str, timeout: float = 300) -> None:
    """Run ``code`` in a fresh interpreter (tests dir importable, same cache); fail with its
    output if it does not exit 0 -- including by a segfault or abort."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [TESTS_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=TESTS_DIR)
    if proc.returncode != 0:
        how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exit {proc.returncode}")
        pytest.fail(f"isolated run {how}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)
