"""The kernel cache as einsum sees it: a repeated call builds and schedules nothing, processes
racing to build the same new kernel both get correct results, a truncated cached library is
rebuilt, and the per-call memo never answers a call with another structure's kernel.

Runtime-level cache behaviour (keys, markers, locks) is tested in test_runtime.py; these
tests go through ``st.einsum`` only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sparsetorch as st
from dense_check import (TESTS_DIR, check_against_dense, forget_call_memo,  # noqa: F401
                         private_kernel_cache, random_dense, run_isolated)

F64 = torch.float64


def _spmv_operands(seed=0, shape=(6, 5), fmt="dcsc"):
    gen = torch.Generator().manual_seed(seed)
    A = st.tensor(random_dense(shape, 0.5, F64, gen), fmt)
    return A, torch.randn(shape[1], dtype=F64, generator=gen)


def _kernel_libraries(cache) -> list:
    """The kernel libraries in ``cache``: every ``.so`` but the C call dispatcher's
    (``ops/cshim.py``), which a fresh cache builds next to them."""
    return [n for n in os.listdir(cache) if n.endswith(".so") and
            "st_fast_call" not in (cache / n).with_suffix(".c").read_text()]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and no kernel in memory: the next call must build."""
    d = tmp_path / "kernels"
    monkeypatch.setenv("SPARSETORCH_CACHE", str(d))
    st.runtime.clear_cache(disk=False)
    forget_call_memo()
    st.runtime.reset_stats()
    yield d
    st.runtime.clear_cache(disk=False)
    forget_call_memo()


def test_first_call_builds_into_the_configured_cache(fresh_cache):
    A, x = _spmv_operands()
    check_against_dense("ij,j->i", [A, x])
    s = st.runtime.stats()
    assert s["builds"] >= 1
    from sparsetorch.runtime import pch

    pch.wait()   # the precompiled header builds in the background, beside the first kernel
    names = os.listdir(fresh_cache)
    assert any(n.endswith(".so") for n in names) and any(n.endswith(".c") for n in names)
    assert not [n for n in names if n.startswith(".tmp-")]


@pytest.mark.parametrize("eq,fmts", [("ij,j->i", ("csr", None)),        # memoised per call
                                     ("ij,jk->ik", ("csr", "csr")),     # workspace kernel
                                     ("ij,ik,jk->ij", ("csr", None, None))])
def test_second_identical_call_compiles_nothing(fresh_cache, eq, fmts):
    gen = torch.Generator().manual_seed(1)
    ext = dict(i=5, j=4, k=3)
    terms = eq.split("->")[0].split(",")

    def operands(scale=1):
        return [st.tensor(random_dense(tuple(ext[c] * scale for c in t), 0.5, F64, gen), f)
                if f else torch.randn(tuple(ext[c] * scale for c in t), dtype=F64,
                                      generator=gen)
                for t, f in zip(terms, fmts)]

    ops = operands()
    check_against_dense(eq, ops)
    first = st.runtime.stats()
    assert first["builds"] >= 1
    check_against_dense(eq, ops)                      # identical call
    check_against_dense(eq, operands(scale=2))         # same structure, new sizes and values
    second = st.runtime.stats()
    assert second["builds"] == first["builds"]
    assert second["disk_hits"] == first["disk_hits"]
    assert second["build_seconds"] == first["build_seconds"]


@pytest.mark.slow
def test_repeated_call_does_no_scheduling(fresh_cache, monkeypatch):
    """docs/design.md: 'In-process memo tables skip scheduling ... on repeated calls'."""
    from sparsetorch.compiler import kernel as kernel_mod

    A, x = _spmv_operands(fmt="csr")
    st.einsum("ij,j->i", A, x)
    calls = []
    real = kernel_mod.schedule
    monkeypatch.setattr(kernel_mod, "schedule", lambda *a, **k: calls.append(a) or real(*a, **k))
    B, y = _spmv_operands(seed=2, shape=(9, 3), fmt="csr")
    check_against_dense("ij,j->i", [B, y])                     # repeat: no scheduling
    assert calls == []
    # letters no other test uses: a structure this process has never scheduled
    check_against_dense("uv,vw->uw", [A, torch.ones(5, 2, dtype=F64)])
    n = len(calls)
    assert n >= 1
    check_against_dense("uv,vw->uw", [B, torch.ones(3, 4, dtype=F64)])  # repeat: no
    assert len(calls) == n


def test_workspace_kernel_repeat_is_a_runtime_memo_hit(fresh_cache):
    gen = torch.Generator().manual_seed(3)
    A = st.tensor(random_dense((5, 6), 0.5, F64, gen), "csr")
    B = st.tensor(random_dense((6, 4), 0.5, F64, gen), "csr")
    st.einsum("ij,jk->ik", A, B)
    before = st.runtime.stats()
    check_against_dense("ij,jk->ik", [A, B], kind="sparse")
    after = st.runtime.stats()
    assert after["builds"] == before["builds"]
    assert after["memo_hits"] + after["disk_hits"] >= before["memo_hits"] + before["disk_hits"]


def test_clearing_the_cache_mid_process_is_safe(fresh_cache):
    A, x = _spmv_operands(seed=4, fmt="csr")
    check_against_dense("ij,j->i", [A, x])
    assert st.runtime.clear_cache() >= 3                # .c, .so, .json on disk
    check_against_dense("ij,j->i", [A, x])               # still correct
    forget_call_memo()
    st.runtime.reset_stats()
    check_against_dense("ij,j->i", [A, x])               # rebuilt from nothing
    assert st.runtime.stats()["builds"] >= 1


# -- several processes ---------------------------------------------------------------------------
CHILD = textwrap.dedent("""\
    import json, os, sys, time, uuid
    import torch, sparsetorch as st
    from dense_check import check_against_dense, random_dense
    barrier, n = os.environ["ST_TEST_BARRIER"], int(os.environ["ST_TEST_N"])
    gen = torch.Generator().manual_seed(int(os.environ["ST_TEST_SEED"]))
    A = st.tensor(random_dense((40, 30), 0.2, torch.float64, gen), "dcsr")
    B = st.tensor(random_dense((30, 20), 0.2, torch.float64, gen), "csc")
    x = torch.randn(30, dtype=torch.float64, generator=gen)
    open(os.path.join(barrier, uuid.uuid4().hex), "w").close()
    deadline = time.time() + 120
    while len(os.listdir(barrier)) < n and time.time() < deadline:
        time.sleep(0.001)
    check_against_dense("ij,jk->ik", [A, B], kind="sparse")
    check_against_dense("ij,j->i", [A, x])
    print(json.dumps(st.runtime.stats()))
    """)


def _spawn(cache, barrier, n, seed):
    env = dict(os.environ, SPARSETORCH_CACHE=str(cache), ST_TEST_BARRIER=str(barrier),
               ST_TEST_N=str(n), ST_TEST_SEED=str(seed))
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=TESTS_DIR,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_build_the_same_new_kernels_at_once(tmp_path):
    cache, barrier = tmp_path / "shared-cache", tmp_path / "barrier"
    barrier.mkdir()
    procs = [_spawn(cache, barrier, 2, seed) for seed in (10, 11)]
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{out}\n{err[-3000:]}"
        stats.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(s["builds"] for s in stats)
    assert total >= 2                     # two kernels (SpGEMM, SpMV) were new to the cache
    assert all(s["builds"] + s["disk_hits"] >= 2 for s in stats)
    names = os.listdir(cache)
    assert not [n for n in names if n.startswith(".tmp-")], names
    assert len(_kernel_libraries(cache)) == 2


@pytest.mark.slow
def test_truncated_cached_library_is_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    code = textwrap.dedent("""\
        import json, torch, sparsetorch as st
        from dense_check import check_against_dense, random_dense
        gen = torch.Generator().manual_seed(5)
        A = st.tensor(random_dense((7, 6), 0.4, torch.float64, gen), "csr")
        B = st.tensor(random_dense((6, 5), 0.4, torch.float64, gen), "dcsr")
        check_against_dense("ij,jk->ik", [A, B], kind="sparse")
        check_against_dense("ij,jk->ik", [A, torch.ones(6, 3, dtype=torch.float64)])
        print(json.dumps(st.runtime.stats()))
        """)

    def child():
        env = dict(os.environ, SPARSETORCH_CACHE=str(cache))
        env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + [p for p in env.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS_DIR,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = child()
    libs = [cache / n for n in os.listdir(cache) if n.endswith(".so")]
    libraries = len(libs)              # with the call dispatcher's (``ops/cshim.py``)
    assert len(_kernel_libraries(cache)) == 2 and first["builds"] == libraries
    for lib in libs:                                   # a crash mid-copy, a full disk...
        data = lib.read_bytes()
        lib.write_bytes(data[: len(data) // 3])
    second = child()
    assert second["rebuilt_corrupt"] == libraries and second["builds"] == libraries
    third = child()                                    # and the rebuilt entries are good
    assert third["builds"] == 0 and third["disk_hits"] >= 2


# -- the per-call memo must key on everything that shapes the kernel ------------------------------
@pytest.mark.slow
def test_csf_mode_orders_do_not_share_a_memo_entry():
    """Regression: the call memo keyed sparse operands by Format.name, 'csf' for every mode
    order, so another mode order reused the first kernel (wrong results, heap corruption,
    segfault). Isolated: a crash fails this test only."""
    run_isolated("""
        import torch, sparsetorch as st
        from dense_check import check_against_dense, random_dense
        gen = torch.Generator().manual_seed(6)
        t = random_dense((3, 4, 5), 0.4, torch.float64, gen)
        b, c = torch.randn(4, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        x = torch.randn(5, dtype=torch.float64)
        for order in [(0, 1, 2), (2, 0, 1), (1, 2, 0)]:
            T = st.tensor(t, st.Format((st.compressed,) * 3, mode_order=order))
            check_against_dense("ikl,kj,lj->ij", [T, b, c])
            check_against_dense("ijk,k->ij", [T, x])
        """)


@pytest.mark.slow
def test_repeated_call_with_bsr_operand():
    """Regression: a repeated call with a BSR operand hit the call memo, which skipped the
    BSR->CSR conversion and ran the CSR kernel on BSR arrays (segfault on the second call)."""
    run_isolated("""
        import torch, sparsetorch as st
        from dense_check import check_against_dense, random_dense
        gen = torch.Generator().manual_seed(7)
        A = st.tensor(random_dense((4, 6), 0.5, torch.float64, gen), "bsr", blocksize=(2, 3))
        x = torch.randn(6, dtype=torch.float64, generator=gen)
        check_against_dense("ij,j->i", [A, x])      # first call: correct
        check_against_dense("ij,j->i", [A, x])      # second call: memo hit
        check_against_dense(lambda a: a * 2, [A], kind="sparse")
        check_against_dense(lambda a: a * 2, [A], kind="sparse")
        """)


def test_memo_distinguishes_what_changes_the_kernel():
    """Calls that differ only in dtype, index dtype, format, out_format or dense-vs-sparse
    must each get their own kernel, in any order."""
    gen = torch.Generator().manual_seed(8)
    a = random_dense((6, 5), 0.5, F64, gen)
    x = torch.randn(5, dtype=F64, generator=gen)
    variants = [
        ([st.tensor(a, "csr"), x], None),
        ([st.tensor(a, "csr", index_dtype=torch.int64), x], None),
        ([st.tensor(a.float(), "csr"), x.float()], None),
        ([st.tensor(a, "csc"), x], None),
        ([st.tensor(a, st.Format((st.compressed, st.dense))), x], None),
        ([st.tensor(a, "dense"), x], None),
        ([a, x], None),
        ([st.tensor(a, "csr"), x], "coo"),
        ([st.tensor(a, "csr"), x], "dense"),
    ]
    for _ in range(2):
        for ops, out in variants + variants[::-1]:
            check_against_dense("ij,j->i", ops, out_format=out)


def test_memo_checks_extents_on_every_call():
    A, x = _spmv_operands(seed=9, fmt="csr")
    st.einsum("ij,j->i", A, x)
    with pytest.raises(ValueError):
        st.einsum("ij,j->i", A, torch.ones(4, dtype=F64))


def test_unique_equation_letters_do_not_collide():
    """Structurally identical equations with other letters produce correct results too."""
    A, x = _spmv_operands(seed=10, fmt="csr")
    for eq in ("ij,j->i", "ab,b->a", "ji,i->j", "zq,q->z"):
        check_against_dense(eq, [A, x])


def test_session_cache_is_private(private_kernel_cache):
    assert os.environ["SPARSETORCH_CACHE"] == private_kernel_cache
    assert str(st.runtime.cache_dir()) == private_kernel_cache


def test_fast_path_answers_only_its_own_signature(monkeypatch):
    """A repeated ``st.einsum`` call finds its shim by the equation string alone
    (``execute.fast_calls``); every operand that differs from the shim's signature in type,
    rank, dtype, device, layout or gradient needs must get what a cold call gets."""
    from sparsetorch.ops import execute

    forget_call_memo()
    A, x = _spmv_operands(seed=10, fmt="csr")
    dense = A.to_dense()
    check_against_dense("ij,j->i", [A, x])
    assert len(execute.fast_calls("ij,j->i")) == 1
    # Non-contiguous and Parameter operands: right answers (the slow path for Parameter).
    xs = torch.randn(10, dtype=F64)[::2]
    assert torch.allclose(st.einsum("ij,j->i", A, xs), dense @ xs)
    p = torch.nn.Parameter(x.clone())
    out = st.einsum("ij,j->i", A, p)
    assert out.requires_grad and torch.allclose(out, dense @ x)
    # Gradients to record: an autograd graph, not the shim's plain result.
    xg = x.clone().requires_grad_()
    st.einsum("ij,j->i", A, xg).sum().backward()
    assert torch.allclose(xg.grad, dense.sum(0))
    # Other dtype, rank or layout: the same errors and results as a cold call.
    mixed = st.einsum("ij,j->i", A, x.float())    # promoted as torch does (issue 31)
    assert mixed.dtype == F64 and torch.allclose(mixed, dense @ x.float().double())
    with pytest.raises(ValueError):
        st.einsum("ij,j->i", A, x[:, None])
    with pytest.raises(TypeError):   # a torch sparse layout is refused, with the fix
        st.einsum("ij,j->i", A, x.to_sparse())
    # Another structure of the same equation gets its own shim, and the first still works.
    other = torch.int64 if A.index_dtype == torch.int32 else torch.int32
    B = st.tensor(dense, "csr", index_dtype=other)
    assert torch.allclose(st.einsum("ij,j->i", B, x), dense @ x)
    assert len(execute.fast_calls("ij,j->i")) == 2
    assert torch.allclose(st.einsum("ij,j->i", A, 2 * x), 2 * (dense @ x))
    # Another backend: no shim answers.
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    assert execute.fast_calls("ij,j->i") == ()
    assert torch.allclose(st.einsum("ij,j->i", A, x), dense @ x)
    # (``st.einsum`` reads the shims itself: it too must leave them alone)

    def c_shim(ops):
        raise AssertionError("a C call shim ran under SPARSETORCH_BACKEND=torch")

    monkeypatch.setitem(execute._FAST, "ij,j->i", (c_shim,))
    assert torch.allclose(st.einsum("ij,j->i", A, x), dense @ x)
    monkeypatch.setenv("SPARSETORCH_BACKEND", "c")   # named explicitly: the shims again
    with pytest.raises(AssertionError, match="C call shim"):
        st.einsum("ij,j->i", A, x)


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_spgemm_shim_builds_csr_rows_and_falls_back_for_wide_results(monkeypatch, index):
    """A repeated SpGEMM with a CSR result runs its shim (count into running totals, fill
    of the columns alone); results equal the dense product with the narrowest index type; a
    call whose result is too wide for a dense workspace takes the generic (hash) path."""
    from sparsetorch.ops import execute

    forget_call_memo()
    g = torch.Generator().manual_seed(3)
    d = torch.randn(9, 7, generator=g, dtype=F64) * (torch.rand(9, 7, generator=g) < 0.4)
    d[4] = 0   # an empty row
    e = torch.randn(7, 11, generator=g, dtype=F64) * (torch.rand(7, 11, generator=g) < 0.4)
    A, B = st.tensor(d, "csr", index_dtype=index), st.tensor(e, "csr", index_dtype=index)
    check_against_dense("ij,jk->ik", [A, B])
    shims = execute.fast_calls("ij,jk->ik")
    assert len(shims) == 1 and "    f1(" in shims[0].__globals__["call"].source
    for _ in range(2):   # the shim's own answers, twice (no state left between calls)
        out = st.einsum("ij,jk->ik", A, B)
        assert out.format.name == "csr" and out.index_dtype == torch.int32
        assert torch.allclose(out.to_dense(), d @ e, rtol=1e-12, atol=0)
    monkeypatch.setattr("sparsetorch.ops.shim.MAX_WORKSPACE", 4)
    forget_call_memo()
    st.einsum("ij,jk->ik", A, B)
    monkeypatch.setattr(execute, "MAX_WORKSPACE", 4)   # both paths see a hash-sized result
    shim = execute.fast_calls("ij,jk->ik")[0]
    out = shim((A, B))
    assert "hash" in shim.__globals__["generic"].variants
    assert torch.allclose(out.to_dense(), d @ e, rtol=1e-12, atol=0)


def test_einsum_string_is_remembered_after_a_memo_hit_by_expression():
    """A call memoised by its parsed expression (autograd, ``st.expr``) and then made with
    ``st.einsum``: the string gets its own memo entry and fast path, no re-parse per call."""
    from sparsetorch.compiler.notation import parse_einsum
    from sparsetorch.ops import execute

    forget_call_memo()
    A, x = _spmv_operands(seed=4, fmt="csr")
    execute.run(parse_einsum("ij,j->i", [2, 1]), [A, x])
    assert execute.lookup("ij,j->i", (A, x), None) is None
    assert torch.allclose(st.einsum("ij,j->i", A, x), A.to_dense() @ x)
    assert execute.lookup("ij,j->i", (A, x), None) is not None
    assert len(execute.fast_calls("ij,j->i")) == 1
