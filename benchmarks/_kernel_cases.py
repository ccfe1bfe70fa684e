"""Inputs and cases for ``benchmarks/kernels.py`` (issue 4): which matrices each kernel runs
on (real data through ``sparsetorch.datasets`` / ``_inputs.py``, or same-sized generated
stand-ins when the data are missing), the implementations timed side by side for each case,
a float64 reference, and the correctness check applied to sparsetorch's result.

A case is built outside any timed call: every library gets its native operands up front, so
the callables time only the multiplication. Our side always goes through public API
(``st.tensor``, ``st.einsum``, ``F.linear`` on a SparseTensor).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from _inputs import canonical, select_dlmc, select_suitesparse, torch_csr

import sparsetorch as st
from sparsetorch.bench import load_or_generate

OURS = "sparsetorch"
TORCH_CSR = ("torch_csr32", "torch_csr64")
KERNELS = ("spmm", "spmm_t", "spmm_grad", "dlmc", "linear", "sddmm", "spgemm", "bsr", "conv")
PRIMARY = {"spmm": "torch", "spmm_t": "torch", "spmm_grad": "torch", "dlmc": "dense",
           "linear": "dense", "sddmm": "torch", "spgemm": "torch", "bsr": "dense",
           "conv": "conv2d"}   # what "worst" sorts by

SPMM_N = 128                   # dense columns, graphs + SuiteSparse
DLMC_N = 256                   # dense columns, DLMC weights (X is K x 256)
LINEAR_BATCH = (1, 256)        # rows of x in F.linear(x, W), W a DLMC weight
SDDMM_INNER = (64, 256)
SPGEMM_FLOP_CAP = 20_000_000   # largest multiply count of A @ A we time
BSR_BLOCK = (4, 4)
BSR_BLOCK_SPARSITY = 0.9
BSR_N = 256
CONV_SPARSITY = 0.9
CONV_SHAPES = [(32, 64, 56, 56), (128, 128, 28, 28), (512, 512, 14, 14), (1024, 1024, 7, 7)]
RTOL = 1e-3                    # float32 result vs float64 reference, relative to sum |a||b|
ATOL_REL = 1e-5                # absolute slack, as a fraction of the largest |a||b| entry

PLANETOID = ("cora", "citeseer", "pubmed")
NPZ_GRAPHS = ("amazon_cs", "amazon_photo", "coauthor_cs")
# Published sizes (nodes, stored adjacency entries), for stand-ins when the data are missing.
GRAPH_SIZES = {"cora": (2708, 10556), "citeseer": (3327, 9104), "pubmed": (19717, 88648),
               "amazon_cs": (13752, 491722), "amazon_photo": (7650, 238162),
               "coauthor_cs": (18333, 163788)}
DLMC_SETS = ("transformer/0.9", "transformer/0.7")    # prefixes of select_dlmc's names
DLMC_SHAPES = ((512, 512), (512, 2048), (2048, 512))  # the shipped transformer shapes
# SuiteSparse stand-ins (rows = cols, nnz) spanning the shipped range (7x7 .. 13k x 13k).
SUITESPARSE_STAND_INS = ((500, 3_000), (2_000, 20_000), (5_000, 40_000), (13_000, 95_000))


@dataclass
class Case:
    """One kernel on one input: ``impls`` (name -> zero-argument callable; ``OURS`` first),
    a float64 ``ref`` and elementwise ``bound`` (the same product over absolute values) for
    the check, and ``info`` (shape, nnz, flops, ...) copied into the result rows."""
    kernel: str
    group: str             # summary bucket: collection, sparsity, inner dimension
    name: str
    impls: dict[str, Callable]
    ref: object
    bound: object
    info: dict = field(default_factory=dict)


# == inputs ===================================================================================
def _random_csr(rows: int, cols: int, nnz: int, seed: int, *, symmetric=False,
                ones=False) -> sp.csr_array:
    rng = np.random.default_rng(seed)
    k = nnz // 2 if symmetric else nnz
    r, c = rng.integers(0, rows, k), rng.integers(0, cols, k)
    if symmetric:
        keep = r != c
        r, c = np.concatenate([r[keep], c[keep]]), np.concatenate([c[keep], r[keep]])
    vals = np.ones(len(r), np.float32) if ones else rng.standard_normal(len(r)).astype(np.float32)
    m = sp.csr_array((vals, (r, c)), shape=(rows, cols))
    if ones:
        m.data[:] = 1.0   # duplicates were summed; an adjacency stays 0/1
    return canonical(m.indptr, m.indices, m.data, m.shape)


def graph_inputs(root, quick: bool, report) -> list:
    """(collection, name, scipy CSR) for the Planetoid and Amazon/Coauthor adjacencies."""
    names = ("cora", "pubmed", "amazon_photo") if quick else PLANETOID + NPZ_GRAPHS
    out = []
    for name in names:
        n, e = GRAPH_SIZES[name]

        def load(name=name):
            if root is None:
                raise FileNotFoundError("no shared data folder")
            m = st.datasets.graph(name, root).adj.to_scipy()
            return canonical(m.indptr, m.indices, m.data, m.shape)

        m, _ = load_or_generate(name, load, lambda n=n, e=e: _random_csr(
            n, n, e, seed=n, symmetric=True, ones=True), report=report,
            stand_in=f"a random symmetric {n}-node graph with ~{e} entries")
        coll = "planetoid" if name in PLANETOID else "amazon/coauthor"
        out.append((coll, name, m))
    return out


def suitesparse_inputs(root, quick: bool, report, skipped: list) -> list:
    """(collection, name, loader) for the SuiteSparse matrices (``_inputs`` picks them: every
    non-complex file; with ``quick`` every other one of its evenly spread dozen)."""
    folder = None if root is None else Path(root) / "suitesparse" / "mtx"
    mats = select_suitesparse(Path(root), quick, skipped) if folder and folder.is_dir() else []
    if quick:
        mats = mats[::2]
    if mats:
        return mats
    report.note(f"SuiteSparse matrices not found ({folder or 'no data folder'}); using "
                f"{len(SUITESPARSE_STAND_INS)} random square stand-ins - these numbers are not "
                "from the real collection")
    sizes = SUITESPARSE_STAND_INS[::2] if quick else SUITESPARSE_STAND_INS
    return [("suitesparse", f"generated_{n}x{n}_{nnz}",
             lambda n=n, nnz=nnz: _random_csr(n, n, nnz, seed=nnz)) for n, nnz in sizes]


def dlmc_inputs(root, quick: bool, report) -> list:
    """(set, name, loader) for DLMC transformer magnitude-pruning weights at 0.9 and 0.7:
    ``_inputs.select_dlmc`` spreads its picks over each folder's shapes (one per shape with
    ``quick``, four per shape otherwise)."""
    per_dir = 3 if quick else 12
    picked = select_dlmc(Path(root), per_dir) if root is not None else []
    out = []
    for prefix in DLMC_SETS:
        mine = [(prefix, name, load) for _, name, load in picked
                if name.startswith(prefix + "/")]
        if not mine:
            sparsity = float(prefix.rsplit("/", 1)[1])
            where = Path(root) / "dlmc" if root is not None else "no data folder"
            report.note(f"DLMC {prefix} not found ({where}); using random {sparsity:.0%}-"
                        "sparse stand-ins of the transformer shapes - these numbers are not "
                        "from the real patterns")
            mine = [(prefix, f"{prefix}/generated_{r}x{c}",
                     lambda r=r, c=c, s=sparsity: _random_csr(
                         r, c, round(r * c * (1 - s)), seed=r * 7 + c))
                    for r, c in DLMC_SHAPES]
        out.extend(mine)
    return out


# == correctness ==============================================================================
def to_float64(x):
    """A result (SparseTensor, torch tensor of any layout, scipy, numpy) as float64 scipy CSR
    (sparse results) or numpy (dense)."""
    if isinstance(x, st.SparseTensor):
        return sp.csr_array(x.to_scipy()).astype(np.float64)
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided:
            return x.detach().numpy().astype(np.float64)
        x = x.to_sparse_coo().coalesce()
        i = x.indices().numpy()
        return sp.csr_array(sp.coo_array((x.values().numpy().astype(np.float64), (i[0], i[1])),
                                         shape=tuple(x.shape)))
    if sp.issparse(x):
        return sp.csr_array(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def check(out, ref, bound) -> str | None:
    """None when ``out`` matches ``ref`` within RTOL of the elementwise ``bound`` (sum of
    |a||b|) plus an absolute slack of ATOL_REL * max(bound); else what is wrong."""
    out = to_float64(out)
    if isinstance(out, np.ndarray) and out.ndim == 4 and out.size == math.prod(ref.shape):
        out = out.reshape(ref.shape)   # conv2d's (1, Cout, H, W) is the (Cout, H*W) product
    shape = tuple(getattr(out, "shape", ()))
    if shape != tuple(ref.shape):
        return f"shape {shape} != {tuple(ref.shape)}"
    scale = float(bound.max()) if (bound.nnz if sp.issparse(bound) else bound.size) else 0.0
    atol = ATOL_REL * scale
    if sp.issparse(ref):
        out = out if sp.issparse(out) else sp.csr_array(out)
        err = abs(out - ref)
        excess = err - RTOL * bound
        worst = max(float(excess.max()), 0.0) if excess.nnz else 0.0
        maxerr = float(err.max()) if err.nnz else 0.0
    else:
        out = out.toarray() if sp.issparse(out) else out
        err = np.abs(out - ref)
        worst = float((err - RTOL * bound).max()) if err.size else 0.0
        maxerr = float(err.max()) if err.size else 0.0
    if not math.isfinite(worst) or not math.isfinite(maxerr):
        return "non-finite values"
    if worst > atol:
        return (f"max |err| {maxerr:.3g} exceeds rtol {RTOL:g} * sum|a||b| + atol {atol:.3g} "
                f"(by {worst - atol:.3g})")
    return None


def _spmm_ref(m: sp.csr_array, B: np.ndarray):
    m64, B64 = m.astype(np.float64), B.astype(np.float64)
    return m64 @ B64, abs(m64) @ np.abs(B64)


# == cases ====================================================================================
def spmm_case(coll: str, name: str, m: sp.csr_array, seed: int) -> Case:
    """``ij,jk->ik`` with a dense K x 128 operand vs torch CSR (int32, int64) and scipy."""
    g = torch.Generator().manual_seed(seed)
    A = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    B = torch.randn(m.shape[1], SPMM_N, generator=g)
    Bn = B.numpy()
    impls = {OURS: lambda: st.einsum("ij,jk->ik", A, B),
             "torch_csr32": lambda: T32 @ B, "torch_csr64": lambda: T64 @ B,
             "scipy": lambda: m @ Bn}
    ref, bound = _spmm_ref(m, Bn)
    return Case("spmm", coll, name, impls, ref, bound, _info(m, n=SPMM_N))


def spmm_t_case(coll: str, name: str, m: sp.csr_array, seed: int) -> Case:
    """``A.T @ B``, A stored as CSR (its transpose is a free CSC view), B dense with 128
    columns, vs torch (``T.t() @ B``, a CSC operand) and scipy (``m.T @ B``)."""
    g = torch.Generator().manual_seed(seed)
    A = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    B = torch.randn(m.shape[0], SPMM_N, generator=g)
    Bn = B.numpy()
    impls = {OURS: lambda: A.T @ B, "torch_csr32": lambda: T32.t() @ B,
             "torch_csr64": lambda: T64.t() @ B, "scipy": lambda: m.T @ Bn}
    ref, bound = _spmm_ref(m.T.tocsr(), Bn)
    return Case("spmm_t", coll, name, impls, ref, bound, _info(m, n=SPMM_N))


def spmm_grad_case(coll: str, name: str, m: sp.csr_array, seed: int) -> Case:
    """A training step's product: ``A @ X`` and its gradient with respect to X (``A.T @
    dY``) through autograd, X dense with 128 columns, vs ``torch.sparse.mm`` of torch CSR
    (which supports it) and scipy doing the same two products by hand. The check is on dX."""
    g = torch.Generator().manual_seed(seed)
    A = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    X = torch.randn(m.shape[1], SPMM_N, generator=g).requires_grad_()
    dY = torch.randn(m.shape[0], SPMM_N, generator=g)
    Xn, dYn = X.detach().numpy(), dY.numpy()

    def step(product):
        return torch.autograd.grad(product(), X, dY)[0]

    impls = {OURS: lambda: step(lambda: A @ X),
             "torch_csr32": lambda: step(lambda: torch.sparse.mm(T32, X)),
             "torch_csr64": lambda: step(lambda: torch.sparse.mm(T64, X)),
             "scipy": lambda: (m @ Xn, m.T @ dYn)[1]}
    ref, bound = _spmm_ref(m.T.tocsr(), dYn)
    return Case("spmm_grad", coll, name, impls, ref, bound, _info(m, n=SPMM_N))


def _weight(m: sp.csr_array, seed: int) -> tuple:
    """A generator for the dense operand, and the weight as ours, torch CSR (int32,
    int64) and dense."""
    return (torch.Generator().manual_seed(seed), st.tensor(m, format="csr"),
            torch_csr(m, np.int32), torch_csr(m, np.int64), torch.from_numpy(m.toarray()))


def dlmc_case(dset: str, name: str, m: sp.csr_array, seed: int) -> Case:
    """W (M x K sparse weight) @ X (K x 256) vs dense torch.matmul, torch CSR and scipy;
    ``flop_nnz`` (2 nnz N) and ``flop_dense`` (2 M K N) give effective GFLOP/s."""
    g, W, T32, T64, Wd = _weight(m, seed)
    M, K = m.shape
    X = torch.randn(K, DLMC_N, generator=g)
    Xn = X.numpy()
    impls = {OURS: lambda: st.einsum("ij,jk->ik", W, X),
             "dense": lambda: torch.matmul(Wd, X),
             "torch_csr32": lambda: T32 @ X, "torch_csr64": lambda: T64 @ X,
             "scipy": lambda: m @ Xn}
    ref, bound = _spmm_ref(m, Xn)
    info = _info(m, n=DLMC_N, flop_nnz=2 * m.nnz * DLMC_N, flop_dense=2 * M * K * DLMC_N)
    return Case("dlmc", f"{dset} N={DLMC_N}", name, impls, ref, bound, info)


def linear_case(dset: str, name: str, m: sp.csr_array, batch: int, seed: int) -> Case:
    """``F.linear(x, W)`` as a pruned layer is called, W a DLMC weight (out x in), x a
    batch of rows, vs dense ``F.linear`` and torch CSR (``(W @ x.T).T``)."""
    g, W, T32, T64, Wd = _weight(m, seed)
    M, K = m.shape
    x = torch.randn(batch, K, generator=g)
    impls = {OURS: lambda: F.linear(x, W), "dense": lambda: F.linear(x, Wd),
             "torch_csr32": lambda: (T32 @ x.T).T, "torch_csr64": lambda: (T64 @ x.T).T}
    ref, bound = _spmm_ref(m, x.numpy().T)
    info = _info(m, batch=batch, flop_nnz=2 * m.nnz * batch, flop_dense=2 * M * K * batch)
    return Case("linear", f"{dset} B={batch}", name, impls, ref.T, bound.T, info)


def sddmm_case(dset: str, name: str, m: sp.csr_array, inner: int, seed: int) -> Case:
    """``ij,ik,jk->ij`` on the weight's pattern (ones) vs ``torch.sparse.sampled_addmm``."""
    g = torch.Generator().manual_seed(seed)
    M, K = m.shape
    pattern = canonical(m.indptr, m.indices, np.ones(m.nnz, np.float32), m.shape)
    mask = st.tensor(pattern, format="csr")
    P32, P64 = torch_csr(pattern, np.int32), torch_csr(pattern, np.int64)
    X = torch.randn(M, inner, generator=g)
    Y = torch.randn(K, inner, generator=g)
    Yt = Y.t()
    impls = {OURS: lambda: st.einsum("ij,ik,jk->ij", mask, X, Y),
             "torch_csr32": lambda: torch.sparse.sampled_addmm(P32, X, Yt, beta=0.0),
             "torch_csr64": lambda: torch.sparse.sampled_addmm(P64, X, Yt, beta=0.0)}
    rows = np.repeat(np.arange(M), np.diff(pattern.indptr))
    X64, Y64 = X.numpy().astype(np.float64), Y.numpy().astype(np.float64)
    vals = np.einsum("nk,nk->n", X64[rows], Y64[pattern.indices])
    absv = np.einsum("nk,nk->n", np.abs(X64[rows]), np.abs(Y64[pattern.indices]))
    ref = sp.csr_array((vals, pattern.indices, pattern.indptr), shape=m.shape)
    bound = sp.csr_array((absv, pattern.indices, pattern.indptr), shape=m.shape)
    return Case("sddmm", f"{dset} k={inner}", name, impls, ref, bound,
                _info(m, inner=inner))


def spgemm_flops(m: sp.csr_array) -> int:
    """Multiply count of A @ A."""
    return int(np.diff(m.indptr)[m.indices].sum()) if m.nnz else 0


def spgemm_case(coll: str, name: str, m: sp.csr_array) -> Case:
    """``ij,jk->ik`` with both operands the same sparse CSR matrix vs torch CSR@CSR, scipy."""
    A = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    impls = {OURS: lambda: st.einsum("ij,jk->ik", A, A),
             "torch_csr32": lambda: T32 @ T32, "torch_csr64": lambda: T64 @ T64,
             "scipy": lambda: m @ m}
    m64 = m.astype(np.float64)
    return Case("spgemm", coll, name, impls, sp.csr_array(m64 @ m64),
                sp.csr_array(abs(m64) @ abs(m64)), _info(m, flops=spgemm_flops(m)))


def bsr_sizes(quick: bool) -> list:
    return [(4096, 4096)] if quick else [(1024, 1024), (2048, 2048), (4096, 4096), (4096, 1024)]


def bsr_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Dense float32 array of random 4x4 blocks, 90% of the blocks zero."""
    rng = np.random.default_rng(seed)
    br, bc = BSR_BLOCK
    keep = rng.random((rows // br, cols // bc)) >= BSR_BLOCK_SPARSITY
    vals = rng.standard_normal((rows, cols)).astype(np.float32)
    return vals * np.kron(keep, np.ones(BSR_BLOCK, dtype=bool)).astype(np.float32)


def bsr_case(rows: int, cols: int, seed: int) -> Case:
    """4x4-block BSR @ dense (cols x 256): ours (``format="bsr"``) vs dense torch.matmul,
    torch BSR (``to_sparse_bsr``), scipy bsr_array."""
    g = torch.Generator().manual_seed(seed)
    D = torch.from_numpy(bsr_matrix(rows, cols, seed))
    A = st.tensor(D, format="bsr", blocksize=BSR_BLOCK)
    TB = D.to_sparse_bsr(BSR_BLOCK)
    SB = sp.bsr_array(D.numpy(), blocksize=BSR_BLOCK)
    X = torch.randn(cols, BSR_N, generator=g)
    Xn = X.numpy()
    impls = {OURS: lambda: st.einsum("ij,jk->ik", A, X),
             "dense": lambda: torch.matmul(D, X),
             "torch_bsr": lambda: TB @ X, "scipy_bsr": lambda: SB @ Xn}
    ref, bound = _spmm_ref(sp.csr_array(SB), Xn)
    info = {"shape": f"{rows}x{cols}", "nnz": int(SB.nnz), "density": SB.nnz / (rows * cols),
            "n": BSR_N, "blocksize": "x".join(map(str, BSR_BLOCK))}
    return Case("bsr", "generated", f"bsr{BSR_BLOCK[0]}x{BSR_BLOCK[1]}_{rows}x{cols}", impls,
                ref, bound, info)


def conv_case(cin: int, cout: int, h: int, w: int, seed: int) -> Case:
    """Fast-Sparse-ConvNets 1x1 convolution in CHW layout with its bias and ReLU:
    relu(W (Cout x Cin, 90% sparse, unstructured) @ X (Cin x H*W) + b), ours with the bias
    and ReLU fused into the kernel (``st.einsum(..., bias=, activation="relu")``), vs dense
    conv2d 1x1 (+ bias, ReLU), dense addmm + ReLU and torch CSR @ + bias + ReLU."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    Wd = rng.standard_normal((cout, cin)).astype(np.float32)
    Wd *= rng.random((cout, cin)) >= CONV_SPARSITY
    m = canonical(*_csr_arrays(Wd))
    W = st.tensor(m, format="csr")
    T32, T64 = torch_csr(m, np.int32), torch_csr(m, np.int64)
    Wt = torch.from_numpy(Wd)
    W4 = Wt.reshape(cout, cin, 1, 1).contiguous()
    X4 = torch.randn(1, cin, h, w, generator=g)
    X = X4.view(cin, h * w)
    b = torch.randn(cout, generator=g)
    bc = b[:, None]
    impls = {OURS: lambda: st.einsum("oc,cp->op", W, X, bias=bc, activation="relu"),
             "conv2d": lambda: torch.relu(torch.nn.functional.conv2d(X4, W4, b)),
             "dense": lambda: torch.relu(torch.addmm(bc, Wt, X)),
             "torch_csr32": lambda: torch.relu(T32 @ X + bc),
             "torch_csr64": lambda: torch.relu(T64 @ X + bc)}
    ref, bound = _spmm_ref(m, X.numpy())
    ref = np.maximum(ref + b.numpy().astype(np.float64)[:, None], 0)   # relu is 1-Lipschitz
    info = _info(m, n=h * w, cin=cin, cout=cout, hw=h * w)
    return Case("conv", "generated", f"conv1x1_{cin}to{cout}_{h}x{w}", impls, ref, bound, info)


def _csr_arrays(d: np.ndarray):
    c = sp.csr_array(d)
    return c.indptr, c.indices, c.data, c.shape


def _info(m: sp.csr_array, **extra) -> dict:
    rows, cols = m.shape
    return {"shape": f"{rows}x{cols}", "nnz": int(m.nnz),
            "density": m.nnz / (rows * cols) if rows * cols else 0.0, **extra}
