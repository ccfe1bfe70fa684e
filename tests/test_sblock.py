"""Cache blocking of SDDMM by column ranges (compiler/sblock.py), checked against dense.

The blocked nest runs when the gathered dense operand exceeds a block's budget (two thirds
of L1); the tests tell it L2 holds 4 KB and a block 2 KB (and drop the floor in bytes of Y a
block gives a row, sized for real caches), so small shapes take it: row groups cut at thread
ranges, rows that skip blocks, empty and full rows, blocks ending inside a run of
side-by-side sums, blocks evened out over 700 columns, inner dimensions with masked tails
and under one vector.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import sparsetorch as st
from sparsetorch.codegen.kernel import compile_kernel
from sparsetorch.compiler import kernel, sblock
from sparsetorch.compiler.sblock import GROUP_ROWS, column_blocked
from sparsetorch.ops import execute

from dense_check import check_against_dense, check_sddmm_as_written, check_sddmm_gradients, \
    forget_call_memo, long_rows

needs_intrinsics = pytest.mark.skipif(kernel.vector_isa() is None,
                                      reason="no AVX-512 or AVX2 on this CPU")
SDDMM = "ij,ik,jk->ij"
NOTE = "entries taken in blocks of columns"
# (the package exports the function ``einsum`` under the module's name)
einsum_module = importlib.import_module("sparsetorch.ops.einsum")


@pytest.fixture
def small_l2(monkeypatch):
    """SDDMM kernels blocked as if L2 held 4 KB and a block's budget were 2 KB, so every
    long-row SDDMM here runs blocked (the long-row test itself is unchanged); kernels and
    memoised calls built under it are forgotten afterwards."""
    def forget():
        compile_kernel.cache_clear()
        forget_call_memo()
    forget()
    monkeypatch.setattr(sblock, "NEAR_BYTES", 0)
    monkeypatch.setattr(kernel, "column_blocked",
                        lambda body, lw, copies, size, l2, near, held=None: column_blocked(
                            body, lw, copies, size, 4096, 2048, held))
    monkeypatch.setattr(einsum_module, "l2_bytes", lambda: 4096)   # what explain tells
    monkeypatch.setattr(einsum_module, "sampled_block_bytes", lambda: 2048)
    yield
    monkeypatch.undo()
    forget()


@needs_intrinsics
@pytest.mark.parametrize("inner,dtype,columns", [   # (before evening out over 700 columns)
    (1, torch.float32, 175), (1, torch.float64, 175),   # ~64 entries of a row (192 columns)
    (5, torch.float32, 100), (5, torch.float64, 47),     # below: Y's rows of a block fill
    (8, torch.float32, 64), (8, torch.float64, 32),      # the 2 KB budget (96, 48, 64, 32),
    (13, torch.float32, 32), (13, torch.float64, 175),   # with at least 8 entries of a row
    (64, torch.float32, 175)])                           # (32), unless those outgrow L2/2
def test_blocked_sddmm_matches_dense(small_l2, inner, dtype, columns):
    d = long_rows(GROUP_ROWS + 37, 700, 0.4, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(d.shape[0], inner, generator=g, dtype=dtype)
    y = torch.randn(d.shape[1], inner, generator=g, dtype=dtype)
    for index_dtype in (torch.int32, torch.int64):
        A = st.tensor(d, format="csr", index_dtype=index_dtype)
        notes = " ".join(st.explain(SDDMM, A, x, y).notes)
        assert NOTE in notes and f"this call: blocks of {columns} columns" in notes
        check_against_dense(SDDMM, (A, x, y))


def test_blocks_fill_about_l1_with_the_gathered_rows(monkeypatch):
    """DLMC-like 512x2048 weights, a 1 MB L2 and a 32 KB block budget: at 70% sparsity (614
    entries a row) blocks hold the 32 KB of Y's rows that fit at K = 256 (32 columns, 10
    entries of a row) and at K = 64 (128 columns); at 90% (205 a row) blocks grow to hold 8
    entries at K = 256 (80 columns, evened out to 26 blocks of 79) and at K = 64 the 24
    entries of 6 KB of Y's rows (240 columns, evened: 9 blocks of 228); at K = 4096 even 8
    entries' rows (1.3 MB) outgrow half of L2, so blocks hold about 64 entries (640
    columns, evened: 3 of 683). Y of 32 KB or less is not blocked."""
    monkeypatch.setattr(einsum_module, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(einsum_module, "sampled_block_bytes", lambda: 32 << 10)
    g = torch.Generator().manual_seed(6)
    for per_row, cases in ((614, ((256, 32), (64, 128))),
                           (205, ((256, 79), (64, 228), (4096, 683), (4, None)))):
        keep = torch.rand(512, 2048, generator=g).argsort(1)[:, :per_row]
        A = st.tensor(torch.zeros(512, 2048).scatter_(1, keep, 1.0), format="csr")
        for inner, columns in cases:
            notes = " ".join(st.explain(SDDMM, A, torch.zeros(512, inner),
                                        torch.zeros(2048, inner)).notes)
            want = "this call: unblocked (operand of 32 KB, within 32 KB)" if columns is None \
                else f"this call: blocks of {columns} columns"
            assert want in notes, notes


@needs_intrinsics
def test_blocked_sddmm_on_one_thread(small_l2):
    d = long_rows(30, 512, 0.5, torch.float32, seed=2)
    A = st.tensor(d, format="csr")
    x, y = torch.randn(30, 24), torch.randn(512, 24)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_against_dense(SDDMM, (A, x, y))
    finally:
        torch.set_num_threads(old)


@needs_intrinsics
@pytest.mark.parametrize("equation, fmt", [
    ("ij,ki,jk->ij", "csr"),     # X read by columns
    ("ij,ik,jk->ji", "csr"),     # the result transposed (CSC of the mask's pattern)
    ("ik,ij,jk->ij", "csr"),     # the mask second
    ("ij,jk,ik->ij", "csr"),     # Y before X
    ("ji,ik,jk->ji", "csc")])    # a CSC mask whose stored columns are the long rows
def test_blocked_sddmm_in_other_index_orders(small_l2, equation, fmt):
    check_sddmm_as_written(equation, fmt, 12, NOTE)


@needs_intrinsics
@pytest.mark.slow   # ~5 s of gradchecks (the blocked forward runs by default)
def test_blocked_sddmm_gradients(small_l2):
    check_sddmm_gradients(long_rows(6, 300, 0.6, torch.float64, seed=3), 3, NOTE)


@needs_intrinsics
def test_short_rows_and_small_operands_run_unblocked(small_l2):
    # graph-like rows: kernels without the blocked nest
    d = long_rows(50, 400, 0.02, torch.float32)
    A = st.tensor(d, format="csr")
    x, y = torch.randn(50, 16), torch.randn(400, 16)
    assert NOTE not in " ".join(st.explain(SDDMM, A, x, y).notes)
    check_against_dense(SDDMM, (A, x, y))
    # rows long enough for the blocked nest, too short for two blocks of ENTRIES (Y of
    # 2.4 KB: its 2 KB budget, 256 rows, rounds to one block of the 300 columns): the
    # kernel's own test picks the plain nest
    d = long_rows(9, 300, 0.25, torch.float32)
    ops = (st.tensor(d, format="csr"), torch.randn(9, 2), torch.randn(300, 2))
    assert "would not make two" in " ".join(st.explain(SDDMM, *ops).notes)
    check_against_dense(SDDMM, ops)


@needs_intrinsics
@pytest.mark.parametrize("shape", [(5, 0), (0, 300), (70, 1)])
def test_degenerate_shapes(small_l2, shape):
    A = st.tensor(torch.ones(shape), format="csr")
    check_against_dense(SDDMM, (A, torch.randn(shape[0], 9), torch.randn(shape[1], 9)))


@needs_intrinsics
def test_blocked_sddmm_with_dynamic_ranges(small_l2, monkeypatch):
    """Skewed long rows on a large call take several ranges per thread from a shared
    counter (``ops/balance.py``); each range is swept in its own row groups."""
    from sparsetorch.ops import balance, shim
    taken = []

    def ranges(t, work):
        taken.append(balance.ranges_per_thread(t, work))
        return taken[-1]
    for module in (execute, shim):   # the first call's path and the memoised shim's
        monkeypatch.setattr(module, "ranges_per_thread", ranges)
    d = long_rows(300, 1200, 0.05, torch.float32, seed=4)
    d[::7] = torch.where(torch.rand(1200) < 0.9, 1.0, 0.0)     # every 7th row nearly full
    A = st.tensor(d, format="csr")
    x, y = torch.randn(300, 96), torch.randn(1200, 96)
    assert NOTE in " ".join(st.explain(SDDMM, A, x, y).notes)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)   # (ranges are shared between threads: one CPU gives torch one)
    try:
        check_against_dense(SDDMM, (A, x, y))
    finally:
        torch.set_num_threads(threads)
    assert taken and max(taken) > 1


@needs_intrinsics
@pytest.mark.parametrize("blocked", [False, True])
def test_every_remainder_of_the_side_by_side_sums(small_l2, monkeypatch, blocked):
    """Rows of 130-170 entries in a random order: every remainder of the eight side by side
    sums (then the loop of four, then 0-3 one at a time), in the plain nest and in the
    column-blocked one (two blocks: runs end inside blocks too)."""
    if not blocked:   # Y within a block's budget (1 MB here): the plain nest
        monkeypatch.undo()
        monkeypatch.setattr(kernel, "sampled_block_bytes", lambda: 1 << 20)
        monkeypatch.setattr(einsum_module, "sampled_block_bytes", lambda: 1 << 20)
        compile_kernel.cache_clear()
        forget_call_memo()
    g = torch.Generator().manual_seed(5)
    d = torch.zeros(41, 1000)
    for r, n in enumerate((130 + torch.randperm(41, generator=g)).tolist()):
        d[r, torch.randperm(1000, generator=g)[:n]] = torch.randn(n, generator=g)
    A = st.tensor(d, format="csr")
    for inner in (7, 32):
        x, y = torch.randn(41, inner, generator=g), torch.randn(1000, inner, generator=g)
        notes = " ".join(st.explain(SDDMM, A, x, y).notes)
        assert ("this call: blocks of" in notes) == blocked
        check_against_dense(SDDMM, (A, x, y))
