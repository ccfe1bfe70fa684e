"""Builds a user can see and that overlap (issue 31, item 13): a build over a second says so
on one stderr line (SPARSETORCH_QUIET=1 hides it); prefetched kernels build at once on
background threads, one build per kernel however many threads want it; the first st.einsum
call on a cold cache builds the C call dispatcher beside its kernel; and
SPARSETORCH_BUILD_THREADS=1 builds one at a time."""
from __future__ import annotations

import textwrap
import threading
import time
import uuid

import pytest
import torch

import sparsetorch as st
from dense_check import forget_call_memo
from sparsetorch import runtime as rt
from sparsetorch.runtime import build as rt_build
from sparsetorch.runtime import tool

ARGS = [rt.I64]
_KEPT_DISPATCHER_STATES: list = []


def source():
    return f"/* test kernel {uuid.uuid4().hex} */\n#include <stdint.h>\n" \
           "void k(int64_t n) { (void)n; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPARSETORCH_CACHE", str(d))
    monkeypatch.delenv("SPARSETORCH_QUIET", raising=False)
    rt.clear_cache(disk=False)
    rt.reset_stats()
    yield d
    rt.clear_cache(disk=False)


@pytest.fixture
def slow_cc(tmp_path, monkeypatch):
    """CC that takes 0.6 s longer per compile than the real one."""
    cc = tmp_path / "slow-cc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --version ] && exec {rt_build.toolchain().argv[0]} --version
        sleep 0.6
        exec {rt_build.toolchain().argv[0]} "$@"
        """))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    return cc


def test_slow_build_says_what_and_where_on_one_line(cache, monkeypatch, capfd):
    monkeypatch.setattr(rt, "NOTICE_SECONDS", 0.0)
    src = source()
    rt.load_kernel(src, "k", ARGS)
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("sparsetorch: compiled test kernel ") and \
        f"cached in {cache}, so later runs load it" in lines[0] and "SPARSETORCH_QUIET" in lines[0]
    rt.clear_cache(disk=False)
    rt.load_kernel(src, "k", ARGS)                 # from disk: nothing to say
    monkeypatch.setenv("SPARSETORCH_QUIET", "1")
    rt.load_kernel(source(), "k", ARGS)            # built, but quiet
    monkeypatch.setattr(rt, "NOTICE_SECONDS", 1e9)
    monkeypatch.delenv("SPARSETORCH_QUIET")
    rt.load_kernel(source(), "k", ARGS)            # built fast: nothing to say
    assert capfd.readouterr().err == ""


def test_prefetched_kernels_build_at_once(cache, slow_cc, monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BUILD_THREADS", "4")
    sources = [source() for _ in range(4)]
    t0 = time.perf_counter()
    futures = [rt.prefetch(s) for s in sources]
    fns = [rt.load_kernel(s, "k", ARGS) for s in sources]
    wall = time.perf_counter() - t0
    assert all(f.result()[1].path == fn.library.path for f, fn in zip(futures, fns))
    s = rt.stats()
    assert s["builds"] == 4
    assert wall < s["build_seconds"] * 0.75, (wall, s)   # serial would be the sum


def test_one_build_per_kernel_however_many_threads_want_it(cache, slow_cc):
    src, got = source(), []
    threads = [threading.Thread(target=lambda: got.append(rt.load_kernel(src, "k", ARGS)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and len({f.library.path for f in got}) == 1
    assert rt.stats()["builds"] == 1


def test_one_build_thread_builds_in_the_caller(cache, monkeypatch):
    monkeypatch.setenv("SPARSETORCH_BUILD_THREADS", "1")
    future = rt.prefetch(source())
    assert future.done() and future.result()[1].origin == "build"
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("SPARSETORCH_BUILD_THREADS", bad)
        with pytest.raises(ValueError, match=f"SPARSETORCH_BUILD_THREADS='{bad}'"):
            tool.build_threads()


def test_prefetched_entries_are_the_library_load_entries_builds(cache):
    """``prefetch(source, signatures)`` builds what ``load_entries`` of the same source and
    signatures loads (the source with its entry points): that load builds nothing more."""
    src = source()
    rt.prefetch(src, {"k": ARGS}).result()
    assert rt.stats()["builds"] == 1
    rt.load_entries(src, {"k": ARGS})["k"](3)
    assert rt.stats()["builds"] == 1


def test_first_call_builds_the_dispatcher_beside_its_kernel(cache, slow_cc, monkeypatch):
    spans, real = [], rt._build_entry

    def traced(src, *args):
        t0 = time.perf_counter()
        try:
            return real(src, *args)
        finally:
            spans.append((t0, time.perf_counter(), "st_fast_call" in src))
    monkeypatch.setattr(rt, "_build_entry", traced)
    monkeypatch.setenv("SPARSETORCH_BUILD_THREADS", "4")
    from sparsetorch.ops import cshim
    fresh = {}
    # the dispatcher's method def and tables must outlive every function made from them
    # (cshim keeps them in its state for the process's life): keep this one too
    _KEPT_DISPATCHER_STATES.append(fresh)
    monkeypatch.setattr(cshim, "_state", fresh)
    forget_call_memo()
    A = st.tensor(torch.tensor([[1.0, 0], [2, 3]]))
    y = st.einsum("ij,j->i", A, torch.ones(2))
    assert y.tolist() == [1.0, 5.0]
    dispatcher = [s for s in spans if s[2]]
    kernels = [s for s in spans if not s[2]]
    assert len(dispatcher) == 1 and kernels
    (d0, d1, _), (k0, k1, _) = dispatcher[0], kernels[0]
    assert d0 < k1 and k0 < d1, spans                  # the two builds overlapped
    forget_call_memo()


@pytest.mark.slow
@pytest.mark.parametrize("expr,sparse_out", [
    ("ij,jk->ik", False), ("ij,ik,jk->ij", True)])
def test_forward_prefetches_the_kernels_backward_loads(cache, monkeypatch, expr, sparse_out):
    """The first recorded call starts building its gradient kernels right after its forward
    (SpMM: dX = A^T G and dA = SDDMM; SDDMM: two SpMMs), so loss.backward() finds each one
    built or building: every kernel backward loads was prefetched, and gradients are right."""
    from sparsetorch.autograd import function

    monkeypatch.setattr(function, "_PREFETCHED", set())
    prefetched, loaded, real_prefetch, real_load = [], [], rt.prefetch, rt.load_entries
    monkeypatch.setattr(rt, "prefetch", lambda src, *signatures: prefetched.append(src) or
                        real_prefetch(src, *signatures))
    monkeypatch.setattr(rt, "load_entries",
                        lambda src, sigs: loaded.append(src) or real_load(src, sigs))
    forget_call_memo()
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(5, 4, generator=g, dtype=torch.float64) * (torch.rand(5, 4) < 0.5)
    A = st.tensor(dense).requires_grad_()
    if sparse_out:
        x = torch.rand(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
        y = torch.rand(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
        out = st.einsum(expr, A, x, y)
        want = ((dense != 0) * dense * (x @ y.T)).sum()
        got, inputs = out.values.sum(), (x, y)
    else:
        x = torch.rand(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
        got, want, inputs = (st.einsum(expr, A, x) ** 2).sum(), ((dense @ x) ** 2).sum(), (x,)
    assert len(prefetched) >= 2
    torch.testing.assert_close(got, want)
    loaded.clear()
    got.backward()
    backward = [s for s in loaded if "st_fast_call" not in s]
    assert backward and set(backward) <= set(prefetched), "backward built a kernel itself"
    dense_leaf = dense.clone().requires_grad_()
    x_leaf = [t.detach().clone().requires_grad_() for t in inputs]
    ((dense_leaf != 0) * dense_leaf * (x_leaf[0] @ x_leaf[1].T)).sum().backward() if sparse_out \
        else ((dense_leaf @ x_leaf[0]) ** 2).sum().backward()
    for t, ref in zip(inputs, x_leaf):
        torch.testing.assert_close(t.grad, ref.grad)
    torch.testing.assert_close(A.grad.to_dense(), dense_leaf.grad * (dense != 0))
    forget_call_memo()


def _in_forked_child(src, done):
    """A forked child's builds: the parent's build of ``src`` in flight at the fork has no
    thread here, so the child builds it itself; new work for the build threads runs."""
    try:
        rt.load_kernel(src, "k", ARGS)
        done.put(tool.submit(sum, [1, 2]).result(timeout=30))
    except BaseException as exc:   # (reported to the parent, which fails the test)
        done.put(repr(exc))


def test_a_forked_child_builds_what_was_in_flight_at_the_fork(cache, slow_cc):
    """DataLoader workers and DDP ranks are forked; a kernel the parent was building in the
    background (a prefetch) must not leave the child waiting forever on it."""
    import multiprocessing

    src = source()
    rt.prefetch(source()).result()   # (the pool has an idle thread to inherit)
    pending = rt.prefetch(src)
    deadline = time.monotonic() + 10
    while not rt._inflight and time.monotonic() < deadline:   # (the build under way)
        time.sleep(0.01)
    assert rt._inflight and not pending.done()
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(src, done))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung on a build the parent had in flight")
    assert child.exitcode == 0 and done.get(timeout=5) == 3
    pending.result()
