"""Shared test helpers: random sparse data, an independent reference for what a format stores,
and ``check_against_dense`` that most format tests go through.

``SPARSETORCH_LONG_TESTS=1`` multiplies the number of hypothesis examples (``examples(n)``);
the default run (neither it nor ``SPARSETORCH_FULL_TESTS=1``) halves them.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import sparsetorch as st

LONG = os.environ.get("SPARSETORCH_LONG_TESTS", "") not in ("", "0")
FULL = LONG or os.environ.get("SPARSETORCH_FULL_TESTS", "") not in ("", "0")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: run single-threaded. On a loaded 2-core machine an OpenMP barrier in a
    microsecond op can wait milliseconds for a descheduled thread (10x slower tests)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def examples(n: int) -> int:
    """Hypothesis example budget: ``n`` in the full run, 40x that in long runs, half (at
    least 3) in the default run, which must stay within five minutes on two cores (each new
    random expression is a compiler run)."""
    return n * 40 if LONG else n if FULL else max(3, n // 2)


VALUE_DTYPES = (torch.float32, torch.float64, torch.int64)
INDEX_DTYPES = (torch.int32, torch.int64)


def random_dense(shape, density: float, dtype, seed: int) -> torch.Tensor:
    """Integer-valued random tensor (exact in every dtype), ``density`` of it non-zero."""
    g = torch.Generator().manual_seed(seed)
    sign = 2 * torch.randint(0, 2, shape, generator=g) - 1
    vals = torch.randint(1, 9, shape, generator=g) * sign
    keep = torch.rand(shape, generator=g) < density
    return (vals * keep).to(dtype)


def formats_for(ndim: int):
    """(label, format, blocksize) for every format worth round-tripping at this order."""
    out = [("coo", "coo", None), ("csf", "csf", None), ("dense", "dense", None)]
    if ndim == 2:
        out += [("csr", "csr", None), ("csc", "csc", None), ("dcsr", "dcsr", None),
                ("dcsc", "dcsc", None), ("bsr1x1", "bsr", (1, 1)), ("bsr2x1", "bsr", (2, 1)),
                ("bsr2x3", "bsr", (2, 3)),
                ("(compressed,dense)", [st.compressed, st.dense], None),
                ("(compressed,dense)^T", st.Format((st.compressed, st.dense), (1, 0)), None),
                ("dense^T", st.Format((st.dense, st.dense), (1, 0)), None),
                ("bsc2x2", st.Format((st.dense, st.compressed, st.dense, st.dense), (1, 0),
                                     blocksize=(2, 2)), None),
                ("dense blocked 2x1", st.Format((st.dense,) * 4, (1, 0), blocksize=(2, 1)),
                 None),
                ("coo^T", st.Format((st.Compressed(unique=False), st.singleton), (1, 0)), None),
                ("csr unordered", st.Format((st.dense, st.Compressed(ordered=False))), None)]
    if ndim == 3:
        out += [("csf(2,0,1)", st.Format((st.compressed,) * 3, (2, 0, 1)), None),
                ("(d,c,c)(1,2,0)", st.Format((st.dense, st.compressed, st.compressed),
                                             (1, 2, 0)), None),
                ("(d,d,c)", [st.dense, st.dense, st.compressed], None),
                ("(c,d,c)", [st.compressed, st.dense, st.compressed], None),
                ("coo(1,0,2)", st.Format((st.Compressed(unique=False), st.Singleton(unique=False),
                                          st.singleton), (1, 0, 2)), None),
                ("(d,c-nonunique,s)", [st.dense, st.Compressed(unique=False), st.singleton],
                 None),
                ("blocked csf 1x2x1", st.Format((st.compressed,) * 3 + (st.dense,) * 3,
                                                blocksize=(1, 2, 1)), None)]
    return out


def resolve(fmt, ndim, blocksize) -> st.Format:
    from sparsetorch.formats.format import as_format

    return as_format(fmt, ndim, blocksize)


def blocks_fit(shape, fmt: st.Format) -> bool:
    return fmt.blocksize is None or all(n % b == 0 for n, b in zip(shape, fmt.blocksize))


def stored_pattern(t: st.SparseTensor) -> torch.Tensor:
    """Boolean dense mask of the entries ``t`` stores (explicit zeros included)."""
    ones = torch.ones(t.nnz, dtype=torch.float64)
    return st.SparseTensor.from_levels(t.shape, t.format, t.arrays, ones, check=False
                                       ).to_dense() != 0


def expected_nnz(pattern: torch.Tensor, fmt: st.Format) -> int:
    """How many entries ``fmt`` stores for the entries ``pattern`` (a dense tensor; its
    non-zeros), computed independently (numpy): a dense level multiplies its parent's positions
    by its size, a compressed or singleton level has one position per distinct storage prefix
    (per entry when non-unique)."""
    shape = tuple(pattern.shape)
    nz = np.argwhere((pattern != 0).numpy())               # [nnz, ndim], row-major
    if fmt.blocksize is None:
        storage = nz[:, list(fmt.mode_order)]
    else:
        bs = np.array(fmt.blocksize)
        order = list(fmt.mode_order)
        storage = np.concatenate([(nz // bs)[:, order], (nz % bs)[:, order]], axis=1)
    dims = fmt.storage_dims(shape)
    count = 1
    for k, level in enumerate(fmt.levels):
        if isinstance(level, st.Dense):
            count *= dims[k]
        elif not level.unique or any(not lv.unique for lv in fmt.levels[:k]):
            count = len(nz)
        else:
            count = len({tuple(r) for r in storage[:, :k + 1].tolist()})
    return count if not fmt.is_dense else math.prod(shape)


def check_invariants(t: st.SparseTensor, pattern: torch.Tensor | None = None) -> None:
    """Every structural promise of a SparseTensor, re-checked by the validator, plus dtypes."""
    assert isinstance(t, st.SparseTensor)
    assert t.values.dim() == 1 and t.values.dtype == t.dtype
    assert t.values.device == t.device
    assert t.values.is_contiguous() and all(a.is_contiguous() for a in t.arrays.values())
    dtypes = {a.dtype for a in t.arrays.values()}
    assert len(dtypes) <= 1 and dtypes <= {torch.int32, torch.int64}, dtypes
    again = st.SparseTensor.from_levels(t.shape, t.format, t.arrays, t.values, check=True)
    assert again.nnz == t.nnz
    if pattern is not None:
        want = expected_nnz(pattern, t.format)
        assert t.nnz == want, (t.format, t.nnz, want)
        assert bool((stored_pattern(t) >= (pattern != 0)).all())


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.layout == torch.strided
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
    assert torch.equal(actual, expected)


def check_against_dense(t: st.SparseTensor, x: torch.Tensor, index_dtype=None,
                        pattern: torch.Tensor | None = None) -> None:
    """``t`` holds exactly ``x``, passes validation, and stores what its format says for the
    entries ``pattern`` (default: the non-zeros of ``x``; conversions keep explicit zeros)."""
    assert_same(t.to_dense(), x)
    check_invariants(t, x if pattern is None else pattern)
    if index_dtype is not None and t.arrays:
        assert t.index_dtype == index_dtype
