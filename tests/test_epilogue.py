"""Epilogues (bias + activation fused into the output write), checked against dense.

Three placements are exercised: at the flush of a register tile or accumulator (CSR rows:
each output element is written once), at the store (no reduction), and as a final pass
(rows a sparse level iterates may be absent, or an element is summed into several times).
"""
from __future__ import annotations

import pytest
import torch

import sparsetorch as st
from sparsetorch.compiler.notation import (UNARY, Access, Add, Assignment, Epilogue, Mul,
                                           Result, Scale, Unary)
from sparsetorch.ops.execute import kernel_for, run

FORMATS = ["csr", "csc", "coo", "dcsr"]


def _operands(fmt, rows, cols, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(-3, 4, (rows, cols), generator=g).to(dtype)
    d *= torch.rand(rows, cols, generator=g) < 0.3
    d[rows // 2] = 0                                  # an empty row
    x = torch.randint(-2, 3, (cols, n), generator=g).to(dtype)
    return d, st.tensor(d, format=fmt), x


def _layer(act, bias_index):
    """out[i,k] = act(sum_j A[i,j] X[j,k] + b[bias_index])."""
    fn = Add(Result(), Access(2, (bias_index,)))
    fn = Unary(act, fn) if act else fn
    return Assignment(("i", "k"), Epilogue(Mul(Access(0, ("i", "j")), Access(1, ("j", "k"))),
                                           fn))


def run_cases():
    """Module-level so the pragma-only run in a subprocess executes the same checks."""
    for dtype in (torch.float32, torch.float64):
        for fmt in FORMATS:
            for n in (1, 16, 70):
                d, A, x = _operands(fmt, 21, 13, n, dtype, seed=n)
                for act in (None, "relu", "relu6", "abs"):
                    for bias_index, size in (("k", n), ("i", 21)):
                        b = torch.linspace(-4, 4, size, dtype=dtype)
                        got = run(_layer(act, bias_index), [A, x, b])
                        ref = d @ x + (b if bias_index == "k" else b[:, None])
                        ref = UNARY[act][1](ref) if act else ref
                        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_layer_epilogues_match_dense():
    run_cases()


def test_epilogue_placement():
    """CSR SpMM applies it where the register tile is flushed (no pass over the output);
    DCSR, whose absent rows are never visited, needs the final pass."""
    _, A, x = _operands("csr", 8, 8, 64, torch.float32, 0)
    b = torch.zeros(64)
    k, _, _ = kernel_for(_layer("relu", "k"), [A, x, b], None)
    assert "_max_ps(" in k.source or "> 0 ?" in k.source   # AVX-512, AVX2 or pragmas
    assert "for (int64_t i = 0; i < n_i; i++)" not in k.source   # no final pass
    _, D, _ = _operands("dcsr", 8, 8, 64, torch.float32, 0)
    k, _, _ = kernel_for(_layer("relu", "k"), [D, x, b], None)
    assert "for (int64_t i = 0; i < n_i; i++)" in k.source   # the final pass


def test_spmv_and_elementwise_epilogues():
    d, A, _ = _operands("csr", 9, 7, 1, torch.float64, 3)
    v = torch.arange(7, dtype=torch.float64)
    b = torch.full((9,), -2.0, dtype=torch.float64)
    spmv = Assignment(("i",), Epilogue(Mul(Access(0, ("i", "j")), Access(1, ("j",))),
                                       Unary("relu", Add(Result(), Access(2, ("i",))))))
    torch.testing.assert_close(run(spmv, [A, v, b]), (d @ v + b).clamp_min(0))
    # No reduction: the epilogue is applied where each element is stored (or, for absent
    # entries of the sparse operand, by the final pass: relu(0 + b) may be nonzero).
    e = Assignment(("i", "j"), Epilogue(Scale(2.0, Access(0, ("i", "j"))),
                                        Unary("relu6", Add(Result(), Access(1, ("j",))))))
    bj = torch.linspace(-1, 8, 7, dtype=torch.float64)
    torch.testing.assert_close(run(e, [A, bj]), (2 * d + bj).clamp(0, 6))


@pytest.mark.parametrize("block", [(2, 1), (4, 1), (4, 4)])
def test_blocked_weight_with_output_channel_bias(block):
    """The CHW 1x1-convolution form: W (Cout x Cin, output-channel blocks) times X
    (Cin x pixels), bias per output channel, ReLU."""
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(16 // block[0], 12 // block[1], generator=g) < 0.4
    w = torch.randn(16, 12, generator=g) * keep.repeat_interleave(block[0], 0) \
        .repeat_interleave(block[1], 1)
    W = st.tensor(w, format="bsr", blocksize=block)
    x = torch.randn(12, 37, generator=g)
    b = torch.randn(16, generator=g)
    a = Assignment(("o", "p"), Epilogue(Mul(Access(0, ("o", "c")), Access(1, ("c", "p"))),
                                        Unary("relu", Add(Result(), Access(2, ("o",))))))
    torch.testing.assert_close(run(a, [W, x, b]), (w @ x + b[:, None]).clamp_min(0),
                               rtol=1e-5, atol=1e-5)


# -- the public API: st.einsum(..., bias=, activation=) -----------------------------------
@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr", "bsr"])
@pytest.mark.parametrize("bias_shape", [(70,), (20, 1), (), (1, 70), None])
@pytest.mark.parametrize("act", [None, "relu", "relu6"])
def test_einsum_bias_activation_matches_torch(fmt, bias_shape, act):
    g = torch.Generator().manual_seed(7)
    d = torch.randn(20, 12, generator=g, dtype=torch.float64)
    d *= torch.rand(20, 12, generator=g) < 0.4
    A = st.tensor(d, format=fmt, **({"blocksize": (2, 2)} if fmt == "bsr" else {}))
    x = torch.randn(12, 70, generator=g, dtype=torch.float64)
    b = None if bias_shape is None else torch.randn(bias_shape, generator=g, dtype=x.dtype)
    got = st.einsum("ij,jk->ik", A, x, bias=b, activation=act)
    ref = d @ x + (b if b is not None else 0)
    ref = UNARY[act][1](ref) if act else ref
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, ref)


def test_einsum_epilogue_gradients():
    g = torch.Generator().manual_seed(8)
    d = torch.randn(6, 5, generator=g, dtype=torch.float64) * (torch.rand(6, 5, generator=g)
                                                              < 0.5)
    A = st.tensor(d, format="csr")
    x = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    v = A.values.clone().requires_grad_()
    torch.autograd.gradcheck(lambda v, x, b: st.einsum("ij,jk->ik", A.with_values(v), x,
                                                       bias=b, activation="relu6"), (v, x, b))


def test_einsum_epilogue_errors():
    A = st.tensor(torch.eye(3), format="csr")
    with pytest.raises(ValueError, match="activation='gelu'"):
        st.einsum("ij,jk->ik", A, torch.ones(3, 2), activation="gelu")
    with pytest.raises(ValueError, match="does not broadcast"):
        st.einsum("ij,jk->ik", A, torch.ones(3, 2), bias=torch.ones(5))
    with pytest.raises(ValueError, match="dense result"):
        st.einsum("ij,jk->ik", A, A, bias=torch.ones(3), out_format="csr")
    with pytest.raises(TypeError, match="bias must be a dense"):
        st.einsum("ij,jk->ik", A, torch.ones(3, 2), bias=A)
    # the same after calls that memoised the fused kernel (its fast path read the bias's
    # .shape / .detach() first: an AttributeError)
    for bias in (torch.ones(3, 1), torch.ones(2)):
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                st.einsum("ij,jk->ik", A, torch.ones(3, 2), bias=bias)
                with pytest.raises(TypeError, match="bias must be a dense"):
                    st.einsum("ij,jk->ik", A, torch.ones(3, 2), bias=[1.0, 2.0])


def test_repeated_fused_calls_take_the_fast_path_and_stay_correct():
    """A repeated ``st.einsum(..., bias=)`` runs its memoised shim (no Python epilogue
    path): new values in the same operands, a Parameter bias, a bias of another extent
    (refused as before) and autograd (recorded, not fused) all behave as the first call."""
    from sparsetorch.ops import execute

    g = torch.Generator().manual_seed(9)
    d = torch.randn(30, 20, generator=g) * (torch.rand(30, 20, generator=g) < 0.3)
    A = st.tensor(d, format="csr")
    for n in (7, 16):
        x = torch.randn(20, n, generator=g)
        b = torch.nn.Parameter(torch.randn(n, generator=g))
        with torch.no_grad():
            st.einsum("ij,jk->ik", A, x, bias=b, activation="relu")
            assert execute._FAST_EPILOGUE.get(("ij,jk->ik", "relu"))
            for _ in range(2):
                x.normal_(generator=g)
                b.normal_(generator=g)
                torch.testing.assert_close(st.einsum("ij,jk->ik", A, x, bias=b,
                                                     activation="relu"),
                                           (d @ x + b).clamp_min(0))
            with pytest.raises(ValueError, match="does not broadcast"):
                st.einsum("ij,jk->ik", A, x, bias=torch.ones(n + 1), activation="relu")
    out = st.einsum("ij,jk->ik", A, x, bias=b, activation="relu")
    out.sum().backward()
    torch.testing.assert_close(b.grad, ((d @ x + b) > 0).float().sum(0))


def test_a_column_bias_takes_the_fast_path_by_its_own_shape():
    """A (m, 1) bias (a conv layer's, viewed as the kernel's (m,)) is served by the fast
    path, and a (1, n) bias with n == m, which broadcasts along the other dimension, never
    by the shim offered for the column."""
    from sparsetorch.ops import execute

    g = torch.Generator().manual_seed(10)
    d = torch.randn(8, 5, generator=g) * (torch.rand(8, 5, generator=g) < 0.5)
    A, x = st.tensor(d, format="csr"), torch.randn(5, 8, generator=g)
    column, row = torch.randn(8, 1, generator=g), torch.randn(1, 8, generator=g)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(st.einsum("ij,jk->ik", A, x, bias=column,
                                                 activation="relu6"),
                                       (d @ x + column).clamp(0, 6))
        assert execute._FAST_EPILOGUE.get(("ij,jk->ik", "relu6"))
        for _ in range(2):
            torch.testing.assert_close(st.einsum("ij,jk->ik", A, x, bias=row,
                                                 activation="relu6"),
                                       (d @ x + row).clamp(0, 6))


@pytest.mark.slow   # ~4 s (the full suite runs it)
def test_relaid_linear_bias_takes_the_fast_path_and_keeps_its_broadcast():
    """``x W^T + b`` runs relaid as ``W x^T + b[:, None]``: the kernel takes the column bias
    as ``(out,)``, so its shim is offered behind a reshape. That reshape must answer only
    biases of the shape it was offered for: ``(1, n)``, the same size but broadcast along
    the other index, is another kernel."""
    from sparsetorch.ops import execute

    g = torch.Generator().manual_seed(4)
    d = torch.randn(64, 128, generator=g) * (torch.rand(64, 128, generator=g) < 0.5)
    W, x, b = st.tensor(d, format="csr"), torch.randn(64, 128, generator=g), torch.randn(64)
    for _ in range(2):
        torch.testing.assert_close(st.einsum("ni,oi->no", x, W, bias=b, activation="relu"),
                                   (x @ d.T + b).clamp_min(0))
    assert execute._FAST_EPILOGUE.get(("in,oi->on", "relu"))
    xt = x.T.contiguous()
    for bias in (b[:, None], b[None, :], b[:, None]):
        torch.testing.assert_close(st.einsum("in,oi->on", xt, W, bias=bias, activation="relu"),
                                   (d @ xt + bias).clamp_min(0))


@pytest.mark.parametrize("act", ["relu", "relu6"])
def test_a_nan_passes_every_fused_activation(act):
    """As through torch's relu and relu6: a NaN stays NaN (x86's max and min return their
    second operand when either is NaN, so the operand order decides). Each path that fuses
    an activation: the generated SpMM epilogue (scalar at 1 column, vector at 16 and 40),
    dense x dense, the eager map on stored values, SparseLinear's row-block kernel with and
    without autograd, and SparseConv2d."""
    fn = UNARY[act][1]
    nan = float("nan")
    g = torch.Generator().manual_seed(0)
    d = torch.randn(20, 7, generator=g) * (torch.rand(20, 7, generator=g) < 0.5)
    with torch.no_grad():
        for n in (1, 16, 40):
            x, b = torch.randn(7, n, generator=g), torch.randn(n, generator=g)
            b[0] = nan
            for A in (st.tensor(d, format="csr"), d):
                got = st.einsum("ij,jk->ik", A, x, bias=b, activation=act)
                torch.testing.assert_close(got, fn(d @ x + b), equal_nan=True)
                assert got[:, 0].isnan().all()
        S = st.tensor(torch.tensor([[nan, -2.0, 7.0]]), format="csr")
        for got in (st.relu(S) if act == "relu" else None, st.lazy(S).relu().eval()
                    if act == "relu" else None):
            if got is not None:
                torch.testing.assert_close(got.values, fn(S.values), equal_nan=True)
    layer = st.nn.SparseLinear(7, 5, density=0.5, activation=act)
    x = torch.randn(20, 7, generator=g)
    x[3, :] = nan
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = layer(x)
        assert got[3].isnan().all() and not got[:3].isnan().any(), (grad, got[:4])
    conv = st.nn.SparseConv2d(7, 5, density=0.5, activation=act)
    with torch.no_grad():
        got = conv(x.t().reshape(1, 7, 4, 5))
    assert got[0, :, 0, 3].isnan().all() and not got[0, :, 0, :3].isnan().any()
