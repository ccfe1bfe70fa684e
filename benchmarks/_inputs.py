"""Inputs for ``benchmarks/compiler.py``: which SuiteSparse and DLMC matrices to run, how
to load them as canonical float32 scipy CSR, and how to bring any library's result back to a
float64 host array for the correctness check.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sp
import torch

import sparsetorch as st

DLMC_DIRS = ["transformer/magnitude_pruning/0.7", "transformer/magnitude_pruning/0.9",
             "transformer/magnitude_pruning/0.98", "rn50/magnitude_pruning/0.8",
             "rn50/magnitude_pruning/0.98"]


def mtx_banner(path: Path):
    """(field, rows, cols, entries) from a Matrix Market banner and size line, no body parse."""
    with open(path) as f:
        banner = f.readline().lower().split()
        for line in f:
            if not line.startswith("%") and line.strip():
                r, c, *rest = (int(x) for x in line.split())
                return banner[3] if len(banner) > 3 else "real", r, c, (rest or [0])[0]
    return "unknown", 0, 0, 0


def load_mtx(path: Path) -> sp.csr_array:
    """A Matrix Market file as canonical float32 CSR (pattern -> ones), read by scipy."""
    m = sp.csr_array(scipy.io.mmread(str(path)))
    return canonical(m.indptr, m.indices, m.data.astype(np.float32), m.shape)


def load_smtx(path: Path, seed: int) -> sp.csr_array:
    """A DLMC ``.smtx.gz`` pattern as float32 CSR with standard-normal values."""
    with gzip.open(path, "rt") as f:
        m, k, nnz = (int(v) for v in f.readline().replace(",", " ").split())
        indptr = np.array(f.readline().split(), dtype=np.int64)
        indices = np.array(f.readline().split(), dtype=np.int64)
    vals = np.random.default_rng(seed).standard_normal(nnz).astype(np.float32)
    return canonical(indptr, indices, vals, (m, k))


def smtx_shape(path: Path):
    with gzip.open(path, "rt") as f:
        m, k, nnz = (int(v) for v in f.readline().replace(",", " ").split())
    return m, k, nnz


def canonical(indptr, indices, data, shape) -> sp.csr_array:
    """int32 indices, sorted, duplicates summed (explicit zeros kept)."""
    m = sp.csr_array((np.asarray(data, dtype=np.float32), indices.astype(np.int32),
                      indptr.astype(np.int32)), shape=shape)
    m.sum_duplicates()
    m.sort_indices()
    return m


def select_suitesparse(root: Path, quick: bool, skipped: list):
    """Every non-complex SuiteSparse file (evenly spread dozen with --quick), by nnz."""
    folder = root / "suitesparse" / "mtx"
    files = []
    for f in sorted(folder.glob("*.mtx")):
        field, r, c, nnz = mtx_banner(f)
        if field == "complex":
            skipped.append(f"suitesparse/{f.stem}: complex values, skipped")
            continue
        files.append((nnz, f))
    files.sort()
    if quick and len(files) > 12:
        idx = np.unique(np.linspace(0, len(files) - 1, 12).round().astype(int))
        files = [files[i] for i in idx]
    return [("suitesparse", f.stem, lambda f=f: load_mtx(f)) for _, f in files]


def select_dlmc(root: Path, per_dir: int):
    """``per_dir`` files from each DLMC folder, spread over the folder's distinct shapes: one
    file per shape at evenly spaced nnz when there are more shapes than slots, else
    round-robin over the shapes (files within a shape in name order)."""
    out = []
    for d in DLMC_DIRS:
        folder = root / "dlmc" / d
        if not folder.is_dir():
            continue
        by_shape: dict = {}
        for f in sorted(folder.glob("*.smtx.gz")):
            by_shape.setdefault(smtx_shape(f), []).append(f)
        shapes = sorted(by_shape, key=lambda s: (s[2], s[0], s[1]))
        if len(shapes) >= per_dir:
            idx = np.unique(np.linspace(0, len(shapes) - 1, per_dir).round().astype(int))
            picked = [by_shape[shapes[i]][0] for i in idx]
        else:
            picked, depth = [], 0
            while len(picked) < per_dir and any(len(v) > depth for v in by_shape.values()):
                for s in shapes:
                    if len(by_shape[s]) > depth and len(picked) < per_dir:
                        picked.append(by_shape[s][depth])
                depth += 1
        short = d.replace("magnitude_pruning/", "")
        for n, f in enumerate(picked):
            name = f"{short}/{f.name[:-len('.smtx.gz')]}"
            out.append(("dlmc", name, lambda f=f, n=n: load_smtx(f, seed=1000 + n)))
    return out


# == library objects ==========================================================================
_ABBREV = [("body_decoder_layer_", "dec"), ("body_encoder_layer_", "enc"),
           ("_multihead_attention", ""), ("_attention", "_attn"), ("_fully_connected", ""),
           ("bottleneck_projection_block_group_projection_", "proj_"),
           ("bottleneck_", "bn"), ("_block_group_projection_block_group", "_proj_g"),
           ("_block_group", "_g"), ("symbol_modality_", "embed_")]


def short_name(name: str) -> str:
    """A DLMC file name short enough for a table column (the JSON keeps the full one)."""
    for a, b in _ABBREV:
        name = name.replace(a, b)
    return name


def torch_csr(m: sp.csr_array, index_dtype) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(index_dtype)),
                                   torch.from_numpy(m.indices.astype(index_dtype)),
                                   torch.from_numpy(m.data.copy()), m.shape)


def torch_coo(m: sp.csr_array) -> torch.Tensor:
    c = m.tocoo()
    idx = torch.from_numpy(np.stack([c.row, c.col]).astype(np.int64))
    return torch.sparse_coo_tensor(idx, torch.from_numpy(c.data.copy()), m.shape).coalesce()


def to_host(x):
    """Any library's result as a float64 scipy CSR array or numpy array."""
    if isinstance(x, st.SparseTensor):
        return sp.csr_array(x.to_scipy()).astype(np.float64)
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided:
            return x.detach().numpy().astype(np.float64)
        if x.layout == torch.sparse_coo:
            x = x.coalesce()
            i = x.indices().numpy()
            return sp.csr_array(sp.coo_array((x.values().numpy(), (i[0], i[1])),
                                             shape=tuple(x.shape))).astype(np.float64)
        if x.layout == torch.sparse_csr:
            return sp.csr_array((x.values().numpy(), x.col_indices().numpy(),
                                 x.crow_indices().numpy()), shape=tuple(x.shape)
                                ).astype(np.float64)
        raise TypeError(f"unexpected torch layout {x.layout}")
    if sp.issparse(x):
        return sp.csr_array(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64)
