"""The intrinsics rendering (codegen/vector.py, AVX-512 and AVX2): register tiles and
vector sums.

Every shape of interest is checked against dense: tile widths around the register and tile
boundaries (partial tiles run under lane masks), rows of every length around the vector
width (masked sums; AVX2: whole steps and a scalar tail), gathers through int32 and int64
indices, float32 and float64. The same cases also run with ``SPARSETORCH_SIMD=pragma`` in a
fresh interpreter, so the portable rendering stays correct, and on an AVX-512 CPU with
``SPARSETORCH_SIMD=avx2``, so the AVX2 rendering is checked there too.
"""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from sparsetorch.codegen.c import render_c
from sparsetorch.compiler.ir import Assign, Bin, Call, Cond, Decl, For, Function, Lit, Load, \
    Param, Sym, block
from sparsetorch.codegen.lanes import SHAPES
from sparsetorch.compiler.kernel import vector_isa
from sparsetorch.compiler.notation import UNARY

from dense_check import check_against_dense, forget_call_memo, run_isolated

needs_avx512 = pytest.mark.skipif(vector_isa() != "avx512", reason="no AVX-512 on this CPU")
needs_avx2 = pytest.mark.skipif(vector_isa() is None, reason="no AVX2 (or AVX-512) on this CPU")


def _rows_of_every_length(cols=40, dtype=torch.float64, seed=0):
    """A matrix whose row r has r % (cols + 1) nonzeros: every trip count of a masked sum
    (0, 1, ..., 8, 9, ..., 16, 17, ...) appears."""
    g = torch.Generator().manual_seed(seed)
    rows = cols + 3
    d = torch.zeros(rows, cols, dtype=dtype)
    for r in range(rows):
        n = r % (cols + 1)
        cols_r = torch.randperm(cols, generator=g)[:n]
        d[r, cols_r] = torch.randint(-4, 5, (n,), generator=g).to(dtype) + 0.5
    return d


def _dense(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def run_cases():
    """Module-level so the pragma-only run in a subprocess executes the same checks."""
    for dtype in (torch.float32, torch.float64):
        for index in (torch.int32, torch.int64):
            d = _rows_of_every_length(dtype=dtype)
            for fmt in ("csr", "coo", "dcsr"):
                A = st.tensor(d, format=fmt, index_dtype=index)
                check_against_dense("ij,j->i", [A, _dense((40,), dtype, 1)])
                # Register tiles: N around one register (16/8), the tile (64/32), beyond.
                for n in (1, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 130):
                    check_against_dense("ij,jk->ik", [A, _dense((40, n), dtype, n)])
                # SDDMM: a contiguous sum over k inside each stored entry.
                for k in (1, 9, 16, 70):
                    check_against_dense("ij,ik,jk->ij", [A, _dense((43, k), dtype, k),
                                                         _dense((40, k), dtype, k + 1)],
                                        kind="sampled")
            # Dense products: blocks of four rows side by side (``jam.jam_rows``), a last
            # partial block row by row, and their partial tiles in one version per register
            # count.
            for rows in (1, 4, 5, 11):
                for n in (1, 7, 16, 17, 33, 64, 65, 130):
                    check_against_dense("ij,jk->ik", [_dense((rows, 5), dtype, rows),
                                                      _dense((5, n), dtype, n)])
            # A factor fixed over the sum (d[i]) is multiplied once per row, after it.
            A = st.tensor(d, format=fmt, index_dtype=index)
            check_against_dense("i,ij,j->i", [_dense((43,), dtype, 5), A,
                                              _dense((40,), dtype, 6)])
            # Three factors in a tile: a scaled product (MTTKRP-like j loop over registers).
            A = st.tensor(d, format="csr", index_dtype=index)
            check_against_dense("ij,jk,jk->ik", [A, _dense((40, 70), dtype, 3),
                                                 _dense((40, 70), dtype, 4)])


@pytest.mark.slow
def test_vector_paths_match_dense():
    run_cases()


@pytest.mark.slow
def test_pragma_only_rendering_matches_dense():
    run_isolated("""
        import os
        os.environ["SPARSETORCH_SIMD"] = "pragma"
        import torch, sparsetorch as st
        from sparsetorch.compiler.kernel import vector_isa
        assert vector_isa() is None
        A = st.tensor(torch.eye(5), format="csr")
        assert "immintrin" not in st.explain("ij,jk->ik", A, torch.ones(5, 3)).source
        import test_vector_codegen as T, test_epilogue as E, test_attention as At
        T.run_cases()
        E.run_cases()
        for dtype in (torch.float32, torch.float64):
            At.test_matches_dense("csr", dtype, torch.int32)
    """)


@pytest.mark.slow
@needs_avx2
def test_avx2_rendering_matches_dense():
    """On an AVX2-only CPU this is ``test_vector_paths_match_dense`` again; on an AVX-512
    one it is the only run of the AVX2 code."""
    run_isolated("""
        import os
        os.environ["SPARSETORCH_SIMD"] = "avx2"
        import torch, sparsetorch as st
        from sparsetorch.compiler.kernel import vector_isa
        assert vector_isa() == "avx2"
        A = st.tensor(torch.eye(5), format="csr")
        assert "_mm256_fmadd_ps" in st.explain("ij,jk->ik", A, torch.ones(5, 3)).source
        import test_vector_codegen as T, test_epilogue as E
        T.run_cases()
        E.run_cases()
    """)


@needs_avx2
@pytest.mark.parametrize("n", [7, 16, 20])
def test_partial_tiles_run_whole_registers_unmasked(n):
    """A partial register tile (fewer columns than the tile) takes plain loads and stores
    for its registers that are wholly inside it and masks only the last one. The rows read
    include the dense operand's first (an AVX2 tail load there falls back to maskload)."""
    d = _rows_of_every_length(cols=12, dtype=torch.float32)
    A = st.tensor(d, format="csr")
    src = st.explain("ij,jk->ik", A, torch.ones(12, n)).source
    lanes = 16 if vector_isa() == "avx512" else 8
    assert f"_n >= {lanes}) {{" in src and f"_n > {lanes}) {{" in src, src
    # AVX2: the partial register's loads end at the run's end, shifted (no maskload)
    assert (vector_isa() == "avx2") == ("st_tail_load_ps256(t1_vals" in src)
    # ... and its stores are plain stores of 4, 2 and 1 lanes (no maskstore)
    assert (vector_isa() == "avx2") == ("st_tail_store_ps256(" in src)
    assert "_mm256_maskstore_ps" not in src
    check_against_dense("ij,jk->ik", [A, _dense((12, n), torch.float32, n)])


@needs_avx2
@pytest.mark.parametrize("n", [3, 16, 17, 33, 64])
def test_narrow_tiles_take_two_entries_a_trip(n):
    """A row's entries add into the tile two at a time, into two sets of registers, when
    at most two registers of the tile are in use (``PAIRED_REGISTERS``): rows of every
    length, odd ones ending on a lone entry, against dense; wider rows run unpaired."""
    d = _rows_of_every_length(cols=12, dtype=torch.float32)
    A = st.tensor(d, format="csr")
    src = st.explain("ij,jk->ik", A, torch.ones(12, n)).source
    lanes = 16 if vector_isa() == "avx512" else 8
    assert f"<= {2 * lanes}) {{" in src and "+ 1 < end_" in src, src   # the width's test
    check_against_dense("ij,jk->ik", [A, _dense((12, n), torch.float32, n)])
    # a tile of one register (a blocked operand's 16-entry block rows): one version only
    B = st.tensor(torch.block_diag(*[torch.ones(16, 16)] * 2), format="bsr", blocksize=(16, 16))
    check_against_dense("ij,ik->jk", [B, _dense((32, n), torch.float32, n + 1)])


@needs_avx2
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_narrow_spmm_takes_a_version_per_register_count(dtype, threads):
    """A balanced SpMM's row loop is compiled once more for the widths that fill 1, 2, 3
    registers of its tile (``vector.NARROW_VERSIONS``) and once for any other width: the
    dispatch in the source, and every width either side of each version's bounds against
    dense, on rows of every length (the first empty) and on a matrix with no entries,
    split over one thread and over three."""
    from sparsetorch.codegen import vector

    lanes = (16 if vector_isa() == "avx512" else 8) // (2 if dtype == torch.float64 else 1)
    d = _rows_of_every_length(cols=12, dtype=dtype)
    A = st.tensor(d, format="csr")
    src = st.explain("ij,jk->ik", A, torch.ones(12, 3, dtype=dtype)).source
    bounds = [(r * lanes, (r + 1) * lanes) for r in range(vector.NARROW_VERSIONS)]
    for lo, hi in bounds:
        assert f"if (n_k > {lo} && n_k <= {hi}) kernel_dense_loop0_rows(" in src, src
    assert "else kernel_dense_loop0_any(" in src and f"<= {bounds[-1][1] + lanes})" not in src
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in sorted({1, *(b + e for _, b in bounds for e in (-1, 0, 1)), 4 * lanes + 1}):
            check_against_dense("ij,jk->ik", [A, _dense((12, n), dtype, n)])
        check_against_dense("ij,jk->ik", [st.tensor(torch.zeros(5, 12, dtype=dtype),
                                                    format="csr"), _dense((12, 9), dtype, 9)])
    finally:
        torch.set_num_threads(old)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 6, 9])
@pytest.mark.parametrize("n", [1, 7, 17, 64, 70])
def test_dense_products_run_blocks_of_rows(rows, n, dtype):
    """A dense product computes four rows' register tiles side by side (two with AVX2's
    sixteen registers), each loaded segment of the right operand feeding every row; the
    rows past the last whole block run one at a time. Every row count around the block,
    every width around a register and the tile, against dense."""
    x, w = _dense((rows, 6), dtype, rows), _dense((6, n), dtype, n)
    e = st.explain("ij,jk->ik", x, w)
    block = 4 if vector_isa() == "avx512" else 2
    assert f"blocks of {block} rows side by side" in str(e), e
    assert f"tile2_j{block - 1}" in e.loops and f"tile2_j{block}" not in e.loops, e.loops
    check_against_dense("ij,jk->ik", [x, w])
    # bias and activation ride on the blocked rows' stores
    b = _dense((n,), dtype, 7)
    torch.testing.assert_close(st.einsum("ij,jk->ik", x, w, bias=b, activation="relu"),
                               torch.relu(x @ w + b))


@needs_avx512
def test_blocked_rows_take_one_version_per_register_count():
    """Four rows' partial tiles of 7 columns add into one register each in a loop
    versioned on the width (not four registers' lane tests at every step)."""
    src = st.explain("ij,jk->ik", torch.ones(9, 16), torch.ones(16, 7)).source
    assert "if ((n_k - k0_4) <= 16) {" in src and "<= 48) {" in src, src
    check_against_dense("ij,jk->ik", [_dense((9, 16), torch.float32, 1),
                                      _dense((16, 7), torch.float32, 2)])


@needs_avx2
def test_avx2_spmm_tiles_and_spmv_gathers_by_scalar_loads():
    from sparsetorch.codegen.c import render_c

    A = st.tensor(torch.eye(4), format="csr", index_dtype=torch.int32)
    spmm = st.explain("ij,jk->ik", A, torch.ones(4, 3))
    spmv = st.explain("ij,j->i", A, torch.ones(4))
    if vector_isa() == "avx2":
        assert "_mm256_fmadd_ps" in spmm.source and "32 values" in spmm.tiles
        assert "st_gather_ps_i32(t1_vals, (t0_crd1 + " in spmv.source
        assert "_i32gather_" not in spmv.source          # no hardware gathers
        assert "< 8) {" in spmv.source                   # rows under 8 entries stay scalar
    # Every value and index width gathers (the hardware-gather rendering took int32 floats
    # only): rendered as AVX2 whatever this CPU, so the text is checked on any machine.
    from sparsetorch.codegen.kernel import compile_kernel
    from sparsetorch.compiler.kernel import OperandInfo
    from sparsetorch.compiler.notation import parse_einsum
    from sparsetorch.formats.format import as_format

    infos = (OperandInfo(as_format("csr", 2), False), OperandInfo(as_format("dense", 1), True))
    for value, index in (("float", "int64"), ("double", "int32"), ("double", "int64")):
        k = compile_kernel(parse_einsum("ij,j->i", [2, 1]), infos,
                           "float32" if value == "float" else "float64", (index, "int64"))
        src = render_c(list(k.functions), value, {0: f"{index}_t", 1: "int64_t"}, isa="avx2")
        suffix = ("ps" if value == "float" else "pd") + ("_i32" if index == "int32" else "_i64")
        assert f"st_gather_{suffix}(t1_vals, (t0_crd1 + " in src, src


@pytest.mark.slow   # ~3 s: a fresh interpreter (the full suite runs it)
def test_simd_setting_is_checked():
    run_isolated("""
        import os
        os.environ["SPARSETORCH_SIMD"] = "sse9"
        from sparsetorch.compiler.kernel import vector_isa
        try:
            vector_isa()
        except ValueError as e:
            assert "SPARSETORCH_SIMD" in str(e) and "avx2" in str(e), e
        else:
            raise AssertionError("no error for an unknown SPARSETORCH_SIMD")
    """)


@needs_avx512
def test_spmm_uses_register_tiles_and_spmv_masked_gathers():
    A = st.tensor(torch.eye(4), format="csr", index_dtype=torch.int32)
    spmm = st.explain("ij,jk->ik", A, torch.ones(4, 3))
    assert "_mm512_fmadd_ps" in spmm.source and "tile" in spmm.tiles
    assert "64 values" in spmm.tiles      # four 512-bit registers of float32
    spmv = st.explain("ij,j->i", A, torch.ones(4)).source
    assert "_mm512_mask_i32gather_ps" in spmv    # int32 indices as stored: 16 lanes
    assert "< 4) {" in spmv                      # rows of 1-3 entries stay scalar
    assert "<= 8) {" in spmv and "_mm256_mmask_i32gather_ps" in spmv   # 4-8: 256-bit step
    assert "<= 16) {" in spmv     # 9-16: one 512-bit step, no loop
    assert "p0_3 += 8) {" in spmv   # longer: 256-bit steps (and 512-bit past 48 on AMD)
    # a sum without a gather (SDDMM's inner products over k) keeps 512-bit steps, two
    # accumulators from two registers on
    sddmm = st.explain("ij,ik,jk->ij", A, torch.ones(4, 70), torch.ones(4, 70)).source
    assert ">= 32) {" in sddmm and "<= 16) {" not in sddmm
    spmv = st.explain("ij,j->i", A.to(torch.float64), torch.ones(4, dtype=torch.float64))
    assert "_mm512_mask_i32gather_pd" in spmv.source   # 8 doubles through int32 indices
    A64 = st.tensor(torch.eye(4), format="csr", index_dtype=torch.int64)
    spmv = st.explain("ij,j->i", A64, torch.ones(4)).source
    assert "_mm512_mask_i64gather_ps" in spmv and "st_hsum256" in spmv


@needs_avx512
@pytest.mark.parametrize("wide_from", [None, 48])
def test_long_gathered_sums_take_full_registers_past_a_threshold(monkeypatch, wide_from):
    """``kernel.wide_gathers_from`` (48 on AMD, None elsewhere): SpMV rows of 17 to 48
    entries loop over 256-bit steps, longer ones over 512-bit steps with two accumulators;
    without it, 256-bit steps throughout. Both renderings, forced on this CPU, match dense
    on rows of every length up to 110 (float64 sums take 8-lane steps either way)."""
    from sparsetorch.codegen.kernel import compile_kernel
    from sparsetorch.compiler import kernel

    monkeypatch.setattr(kernel, "wide_gathers_from", lambda: wide_from)
    compile_kernel.cache_clear()
    forget_call_memo()
    try:
        d = _rows_of_every_length(cols=110, dtype=torch.float32)
        A = st.tensor(d, format="csr", index_dtype=torch.int32)
        spmv = st.explain("ij,j->i", A, torch.ones(110)).source
        assert "p0_3 += 8) {" in spmv
        assert ("<= 48) {" in spmv and ">= 32) {" in spmv) == (wide_from is not None)
        for dtype in (torch.float32, torch.float64):
            for index in (torch.int32, torch.int64):
                A = st.tensor(d.to(dtype), format="csr", index_dtype=index)
                check_against_dense("ij,j->i", [A, _dense((110,), dtype, 2)])
    finally:
        compile_kernel.cache_clear()
        forget_call_memo()


def test_sddmm_sums_entries_side_by_side():
    """Loop IR: the mask value leaves the k loop (multiplied once per entry), eight entries'
    inner products (four without AVX2 or AVX-512) share one k loop, remainder loops take the
    rest of a row; the horizontal adds are combined four sums at a time."""
    from sparsetorch.compiler.kernel import sum_copies

    copies = sum_copies()
    A = st.tensor(torch.eye(6), format="csr")
    ex = st.explain("ij,ik,jk->ij", A, torch.ones(6, 32), torch.ones(6, 32))
    loops = ex.loops
    sums = ", ".join(f"acc3_j{u}" for u in range(copies))
    assert f"[sum into {sums}]" in loops
    assert "out_vals[p0_2] = (t0_vals[p0_2] * acc3_j0)" in loops
    assert "acc3 += (t1_vals[((i * n_k) + k)] * t2_vals[((j * n_k) + k)])" in loops
    if vector_isa() is not None:     # st_hsum4 (AVX-512) or st_hsum4_256 (AVX2)
        assert ex.source.count("st_hsum4") >= copies // 4 + 1   # (its definition too)
    # Sums whose ranges differ per entry (a sparse inner level) are left one at a time.
    B = st.tensor(torch.ones(3, 4, 5), format="csf")
    ttv = st.explain("ijk,k->ij", B, torch.ones(5), out_format="dense").loops
    assert "[sum into acc3]" in ttv and "_j0" not in ttv


def _sum_function(body_value):
    """out[0] = sum_p f(x[p]) as raw IR: a reduction loop the renderer may vectorise."""
    return _reduction_function(Assign(Sym("acc"), body_value, "+="), Lit(0), "+")


def _reduction_function(update, init, combine):
    """out[0] = the reduction into ``acc`` (from ``init``) of ``update`` over p in [0, n)."""
    return Function("k", (Param("n", "idx"), Param("x_vals", "val*"),
                          Param("out_vals", "val*", const=False)),
                    block(Decl("val", "acc", init),
                          For("p", Lit(0), Sym("n"), block(update), reduction="acc",
                              combine=combine),
                          Assign(Load("out_vals", Lit(0)), Sym("acc"))))


def test_unsupported_shapes_fall_back_to_pragmas():
    x = Load("x_vals", Sym("p"))
    src = render_c([_sum_function(Cond(Bin(">", x, Lit(0)), x, Lit(0)))], "float", {},
                   isa="avx512")                 # a condition per lane
    assert "immintrin" not in src and "((x_vals[p] > 0) ? x_vals[p] : 0)" in src
    src = render_c([_sum_function(Load("x_vals", Sym("p")))], "float", {}, isa="avx512")
    assert "_mm512_maskz_loadu_ps" in src      # a contiguous sum: 16 lanes, no gather


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr", "csc"])
def test_sampled_results_store_every_entry(monkeypatch, fmt):
    """SDDMM's output values are allocated uninitialised (``fills_output``): with garbage
    (NaN) in fresh memory, every entry must still be written, on every row length."""
    def nan_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    real_empty, real_strided, real_like = torch.empty, torch.empty_strided, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *a, **k: real_strided(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch.Tensor, "new_empty",   # (call shims allocate through it)
                        lambda self, *a, **k: real_like(self, *a, **k).fill_(float("nan")))
    forget_call_memo()
    d = _rows_of_every_length(cols=21, dtype=torch.float32)
    A = st.tensor(d, format=fmt)
    for k in (1, 16, 37):
        X, Y = _dense((d.shape[0], k), torch.float32, k), _dense((21, k), torch.float32, 2)
        for _ in range(2):   # the generic path, then the call shim
            out = st.einsum("ij,ik,jk->ij", A, X, Y)
            assert not out.values.isnan().any()
            assert torch.allclose(out.to_dense(), d * (X @ Y.T), rtol=1e-5, atol=1e-4)


# (ISA, value type, lanes, load/store prefix, suffix): every register type the renderer uses
_EXP_SHAPES = [(isa, ctype, n, lanes.pre, lanes.suf)
               for (isa, ctype, n), lanes in SHAPES.items()]


@needs_avx2
@pytest.mark.parametrize("isa,ctype,lanes,pre,suf", _EXP_SHAPES)
def test_vector_exp_matches_torch(isa, ctype, lanes, pre, suf):
    """``st_exp_*`` (``codegen/intrinsics.py``) on every register type, against torch.exp in
    float64: ~1 ulp where e^x is normal, 0 and inf past the range, -inf to 0, NaN kept."""
    from sparsetorch import runtime
    from sparsetorch.codegen.intrinsics import prelude

    if isa == "avx512" and vector_isa() != "avx512":
        pytest.skip("no AVX-512 on this CPU")
    dtype = torch.float32 if ctype == "float" else torch.float64
    bits = lanes * (4 if ctype == "float" else 8) * 8
    src = (f"#include <stdint.h>\n{prelude(isa)}\n"
           f"void apply(int64_t n, const {ctype}* x, {ctype}* y) {{\n"
           f"  for (int64_t i = 0; i + {lanes} <= n; i += {lanes})\n"
           f"    {pre}_storeu_{suf}(y + i, st_exp_{suf}{bits}({pre}_loadu_{suf}(x + i)));\n}}\n")
    apply = runtime.load_entries(src, {"apply": [runtime.I64, runtime.PTR, runtime.PTR]})["apply"]
    top = 120.0 if ctype == "float" else 800.0
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30, 88.7,
               88.73, -87.3, -103.9, -745.1, 709.7, 709.8, -708.4, 0.5 * 0.6931471805599453]
    x = torch.cat([torch.linspace(-top, top, 20001, dtype=torch.float64),
                   torch.tensor(special, dtype=torch.float64),
                   torch.randn(4000, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64) * 5]).to(dtype)
    x = x[: x.numel() // lanes * lanes].contiguous()
    y = torch.empty_like(x)
    apply(x.numel(), x.data_ptr(), y.data_ptr())
    ref = torch.exp(x.double()).to(dtype)
    tiny = torch.finfo(dtype).tiny
    torch.testing.assert_close(y, ref, rtol=3e-7 if ctype == "float" else 4e-16,
                               atol=tiny, equal_nan=True)
    assert y[x == -float("inf")].eq(0).all() and y[x == float("inf")].isinf().all()


_MAX_CASES = [("avx512", "float"), ("avx512", "double"), ("avx2", "float"),
              ("avx2", "double"), (None, "float")]


@pytest.mark.parametrize("isa,ctype", _MAX_CASES)
def test_maximum_reductions_match_torch(isa, ctype):
    """A ``combine="max"`` loop (the row softmax's shift) in vector steps on each ISA (and
    by pragma with none): every length 0-70 around the register widths, all values negative
    (a lane left at zero by a masked step would win), a lone largest value at every
    position, against torch's max (-inf for no terms)."""
    from sparsetorch import runtime
    from sparsetorch.compiler.ir import max_update
    from sparsetorch.ops.execute import kernel_argtypes

    if isa == "avx512" and vector_isa() != "avx512" or isa == "avx2" and vector_isa() is None:
        pytest.skip(f"no {isa} on this CPU")
    fn = _reduction_function(max_update("acc", Load("x_vals", Sym("p"))),
                             Lit(float("-inf")), "max")
    src = render_c([fn], ctype, {}, isa=isa)
    assert (isa is None) == ("reduction(max:acc)" in src) and (isa is None) != ("max_p" in src)
    run = runtime.load_entries(src, {"k": kernel_argtypes(fn)})["k"]
    dtype = torch.float32 if ctype == "float" else torch.float64
    g = torch.Generator().manual_seed(3)
    out = torch.empty(1, dtype=dtype)
    for n in range(71):
        x = -1000 - torch.rand(n, generator=g, dtype=dtype)
        for top in range(n) if n < 40 else (0, n // 2, n - 1):
            y = x.clone()
            y[top] = -999.5
            run(n, y.data_ptr(), out.data_ptr())
            assert out.item() == y.max().item(), (n, top)
        run(n, x.data_ptr(), out.data_ptr())
        assert out.item() == (x.max().item() if n else -float("inf")), n


@needs_avx2
def test_exp_sums_take_vector_steps():
    """A sum of exponentials (the row softmax's) renders vector steps through st_exp."""
    src = render_c([_sum_function(Call(UNARY["exp"][0], Load("x_vals", Sym("p"))))],
                   "float", {}, isa=vector_isa())
    assert "st_exp_ps" in src and "expf(x_vals[p])" in src   # (the scalar short-row loop)


def _run_tile_sum(isa, ctype, width, step, seed=0):
    """Render and run ``acc = 0; for kk in [0, width): step; out[0] = acc`` with ``x`` held
    in a register tile ``hx`` of ``width`` values and ``y`` read by ``kk`` (``step``: the
    sum's statements). Returns (C source, x, y, out[0])."""
    from sparsetorch import runtime
    from sparsetorch.ops.execute import kernel_argtypes

    kk = Sym("kk")
    fn = Function("k", (Param("x_vals", "val*"), Param("y_vals", "val*"),
                        Param("out_vals", "val*", const=False)), block(
        Decl("val[]", "hx", Lit(width)),
        For("kk", Lit(0), Lit(width), block(Assign(Load("hx", kk), Load("x_vals", kk))),
            simd=True),
        Decl("val", "acc", Lit(0)),
        For("kk", Lit(0), Lit(width), block(*step), reduction="acc"),
        Assign(Load("out_vals", Lit(0)), Sym("acc"))))
    src = render_c([fn], ctype, {}, isa=isa)
    run = runtime.load_entries(src, {"k": kernel_argtypes(fn)})["k"]
    dtype = torch.float32 if ctype == "float" else torch.float64
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(width, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    out = torch.empty(1, dtype=dtype)
    run(x.data_ptr(), y.data_ptr(), out.data_ptr())
    return src, x.double(), y.double(), out.item()


@pytest.mark.parametrize("isa,ctype", _MAX_CASES)
@pytest.mark.parametrize("regs", [1, 3, 6])
def test_sums_over_a_register_tile_match_torch(isa, ctype, regs):
    """A sum over every lane of a register tile (``VectorLoops.tile_sum``: SDDMM's inner
    product against a row held in registers), its body declaring a value: one straight-line
    step per register over min(4, regs) accumulators (1, 3 and 6 registers: fewer chains than
    four, an odd pairwise add, chains reused), each copy's declaration in its own block;
    by pragma with no ISA."""
    if isa == "avx512" and vector_isa() != "avx512" or isa == "avx2" and vector_isa() is None:
        pytest.skip(f"no {isa} on this CPU")
    itemsize = 4 if ctype == "float" else 8
    width = regs * (64 if isa == "avx512" else 32) // itemsize   # lanes per register
    kk = Sym("kk")
    src, x, y, got = _run_tile_sum(isa, ctype, width, [
        Decl("val", "t", Bin("*", Load("y_vals", kk), Lit(2))),
        Assign(Sym("acc"), Bin("*", Load("hx", kk), Sym("t")), "+=")], seed=regs)
    assert (isa is None) == ("_mul_p" not in src)   # the first product of each chain
    assert got == pytest.approx((x * 2 * y).sum().item(), rel=1e-5 if ctype == "float" else 1e-12)


@pytest.mark.skipif(vector_isa() != "avx512", reason="register tiles of AVX-512")
def test_a_tile_sum_with_two_updates_a_step_stays_correct():
    """A tile sum's first register's products are multiplies, not FMAs on zero: a step
    updating the accumulator twice would overwrite its first product, so the renderer
    declines it (the loop is rendered another way) and the sum stays right."""
    kk = Sym("kk")
    product = Bin("*", Load("hx", kk), Load("y_vals", kk))
    _, x, y, got = _run_tile_sum("avx512", "float", 32, [Assign(Sym("acc"), product, "+="),
                                                         Assign(Sym("acc"), product, "+=")])
    assert got == pytest.approx(2 * (x * y).sum().item(), rel=1e-5)
