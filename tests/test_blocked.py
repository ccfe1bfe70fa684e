"""Blocked operands (BSR) run through the compiler with block and in-block index variables
(``ops/blocked.py``), checked against dense, with no conversion of the blocked operand."""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from sparsetorch.formats.tensor import SparseTensor

from dense_check import check_against_dense

BLOCKS = [(1, 4), (4, 1), (2, 2), (4, 4), (8, 8), (16, 16)]


def block_sparse(rows, cols, block, density, dtype, seed):
    """A dense matrix of ``block``-shaped nonzero blocks (some all-zero rows of blocks)."""
    g = torch.Generator().manual_seed(seed)
    br, bc = rows // block[0], cols // block[1]
    keep = torch.rand(br, bc, generator=g) < density
    keep[: max(1, br // 4)] = False                     # empty block rows
    mask = keep.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return torch.randint(-3, 4, (rows, cols), generator=g).to(dtype) * mask


@pytest.fixture
def no_conversion(monkeypatch):
    """Fail if any SparseTensor is converted while the test body runs."""
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"blocked operand converted to {args or kwargs}")
    monkeypatch.setattr(SparseTensor, "asformat", refuse)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_bsr_products_match_dense(block, dtype, index, no_conversion):
    d = block_sparse(32, 48, block, 0.4, dtype, seed=block[0] * 7 + block[1])
    A = st.tensor(d, format="bsr", blocksize=block, index_dtype=index)
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 70):
        check_against_dense("ij,jk->ik", [A, torch.randn(48, n, generator=g, dtype=dtype)])
    check_against_dense("ij,j->i", [A, torch.randn(48, generator=g, dtype=dtype)])
    check_against_dense("ij,ik->jk", [A, torch.randn(32, 9, generator=g, dtype=dtype)])
    check_against_dense("ij,ik,jk->ij", [A, torch.randn(32, 8, generator=g, dtype=dtype),
                                         torch.randn(48, 8, generator=g, dtype=dtype)],
                        kind="sampled")


def test_sampled_result_keeps_the_blocked_pattern():
    d = block_sparse(16, 16, (4, 4), 0.5, torch.float64, seed=3)
    A = st.tensor(d, format="bsr", blocksize=(4, 4))
    S = st.einsum("ij,ik,jk->ij", A, torch.ones(16, 2, dtype=torch.float64),
                  torch.ones(16, 2, dtype=torch.float64))
    assert S.format == A.format and S._level_arrays["crd1"] is A._level_arrays["crd1"]
    torch.testing.assert_close(S.to_dense(), 2 * d)


def test_unsplittable_expressions_still_work():
    """BSR times a CSR operand over the same index, or a sparse result, converts instead."""
    d = block_sparse(16, 16, (4, 4), 0.5, torch.float64, seed=4)
    A = st.tensor(d, format="bsr", blocksize=(4, 4))
    B = st.tensor(d.T.contiguous(), format="csr")
    check_against_dense("ij,jk->ik", [A, B])
    check_against_dense("ij,jk->ik", [A, A])
    with pytest.raises(ValueError, match="size"):
        st.einsum("ij,jk->ik", A, torch.ones(12, 3, dtype=torch.float64))


@pytest.mark.parametrize("block,rows", [((4, 4), 4), ((8, 8), 8), ((4, 1), 4), ((2, 2), 2)])
def test_block_rows_share_a_register_block(block, rows):
    """Each stored block's rows accumulate in registers side by side (``compiler/jam.py``):
    the in-block row loop is gone from the kernel and results still match dense, on full
    and partial tiles, with a fused bias and ReLU (1x1 convolutions with output-channel
    blocks) and in float64."""
    for dtype in (torch.float32, torch.float64):
        d = block_sparse(48, 40, block, 0.4, dtype, seed=rows)
        A = st.tensor(d, format="bsr", blocksize=block)
        X = torch.randn(40, 150, dtype=dtype)
        e = st.explain("ij,jk->ik", A, X)
        assert f"i_e unrolled into {rows} of them" in e.tiles
        assert "for (int64_t i_e" not in e.source
        check_against_dense("ij,jk->ik", [A, X])
        bias = torch.randn(48, 1, dtype=dtype)
        got = st.einsum("ij,jk->ik", A, X, bias=bias, activation="relu")
        torch.testing.assert_close(got, torch.relu(d @ X + bias), rtol=1e-4, atol=1e-4)


def test_jam_keeps_per_copy_accumulators():
    """An accumulator declared inside the jammed loop stays one per copy, and declarations
    that depend on the unrolled variable are renamed per copy (IR level)."""
    from sparsetorch.compiler.ir import Assign, Block, Decl, For, Lit, Load, Sym, block
    from sparsetorch.compiler.jam import jam_tiles

    lane = For("kk", Lit(0), Lit(8), block(
        Assign(Load("tile", Sym("kk")), Load("x", Sym("q")), "+=")), simd=True)
    tile = For("k0", Lit(0), Sym("n_k"), block(
        Decl("val[]", "tile", Lit(8)), Decl("val", "acc", Lit(0)),
        Decl("idx", "q", Sym("i")), Assign(Sym("acc"), Lit(1), "+="), lane), step=8)
    body, done = jam_tiles(Block((For("i", Lit(0), Sym("n_i"), block(tile)),)), {"i": 3}, 1)
    assert done == (("i", 3),)
    (k0,) = body.stmts
    names = [s.name for s in k0.body.stmts if isinstance(s, Decl)]
    assert names == ["tile_j0", "tile_j1", "tile_j2", "acc_j0", "acc_j1", "acc_j2",
                     "q_j0", "q_j1", "q_j2"]
    adds = [s for s in k0.body.stmts if isinstance(s, Assign)]
    assert [a.target for a in adds] == [Sym("acc_j0"), Sym("acc_j1"), Sym("acc_j2")]


def test_repeated_blocked_calls_are_memoised():
    """A second call with the same kinds of operands skips scheduling and the split
    (``BlockedCall``); results stay right for new dense operands, in-place value changes and
    sampled results, shape errors are raised as on a first call, and an expression that
    converts the blocked operand is not memoised."""
    from sparsetorch.ops import execute
    from sparsetorch.ops.blocked import BlockedCall

    d = block_sparse(16, 12, (4, 2), 0.5, torch.float64, seed=3)
    A = st.tensor(d, format="bsr", blocksize=(4, 2))
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(12, 5, generator=g, dtype=torch.float64)
        torch.testing.assert_close(st.einsum("ij,jk->ik", A, x), d @ x)
    assert isinstance(execute.lookup("ij,jk->ik", (A, x), None), BlockedCall)
    A.values.mul_(-2)
    torch.testing.assert_close(st.einsum("ij,jk->ik", A, x), -2 * d @ x)
    u, v = (torch.randn(16, 3, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64))
    for _ in range(2):
        s = st.einsum("ij,ik,jk->ij", A, u, v)
        assert s.format.blocksize == (4, 2)
        torch.testing.assert_close(s.to_dense(), -2 * d * (u @ v.T))
    with pytest.raises(ValueError, match="index 'j' has size"):
        st.einsum("ij,jk->ik", A, torch.randn(8, 5, dtype=torch.float64))
    B = st.tensor(torch.eye(12, dtype=torch.float64), format="csr")
    for _ in range(2):   # BSR @ CSR converts the BSR operand: no memo entry for it
        torch.testing.assert_close(st.einsum("ij,jk->ik", A, B).to_dense(), -2 * d)
    assert execute.lookup("ij,jk->ik", (A, B), None) is None


def test_jam_leaves_loops_it_cannot_unroll():
    """A loop body with a while loop (co-iteration of segmented levels) is left as it is."""
    from sparsetorch.compiler.ir import Block, Decl, For, Lit, Sym, While, block
    from sparsetorch.compiler.jam import jam_tiles

    tile = For("k0", Lit(0), Sym("n_k"), block(
        Decl("val[]", "tile", Lit(8)), While(Lit(0), block())), step=8)
    body, done = jam_tiles(Block((For("i", Lit(0), Sym("n_i"), block(tile)),)), {"i": 2}, 1)
    assert done == ()   # the loop is kept (its static extent filled in)
    assert body.stmts == (For("i", Lit(0), Lit(2), block(tile)),)
