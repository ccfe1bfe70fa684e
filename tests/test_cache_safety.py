"""The kernel cache under faults and attack: a hanging compiler is killed with everything it
started within SPARSETORCH_COMPILE_TIMEOUT and leaves no lock held or temp file behind, temp
files of dead builds are swept, the cache is private (0700, files 0600) and refused when
someone else could write to it, planted libraries and headers are never loaded or compiled
in, locks do not follow symlinks, and a cache path starting with '-' works."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from sparsetorch import runtime as rt
from sparsetorch.runtime import build as rt_build
from sparsetorch.runtime import cache as rt_cache

try:
    import fcntl
except ImportError:
    fcntl = None

ARGS = [rt.I64, rt.F64, rt.PTR, rt.PTR, rt.I64]
OTHER_UID = 54321


def source(extra=""):
    return textwrap.dedent(f"""\
        /* test kernel {uuid.uuid4().hex} */
        {extra}
        #include <stdint.h>
        void saxpy(int64_t n, double a, const float *x, float *y, int64_t nt) {{
            (void)nt;
            for (int64_t i = 0; i < n; i++) y[i] += (float)a * x[i];
        }}
        """)


def check_saxpy(fn):
    import torch
    x, y = torch.arange(5.0), torch.ones(5)
    fn(5, 2.0, x.data_ptr(), y.data_ptr(), 1)
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]


def key_of(src):
    tc = rt_build.toolchain()
    return rt_cache.cache_key(src, tc.identity(), " ".join(rt.FLAGS + rt.LIBS),
                              rt.cpu_features(), rt._version())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPARSETORCH_CACHE", str(d))
    rt.clear_cache(disk=False)
    rt.reset_stats()
    yield d
    rt.clear_cache(disk=False)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, not yet reaped by its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def hanging_cc(tmp_path):
    """A CC that answers --version, then starts a child and waits forever for it; it writes
    both pids to a file."""
    pids = tmp_path / "pids"
    cc = tmp_path / "hanging-cc"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "hang-cc 1.0"; exit 0; }}\n'
                  f'echo $$ >> {pids}\nsleep 300 &\necho $! >> {pids}\nwait\n')
    cc.chmod(0o755)
    return cc, pids


# -- item 9: timeouts, process groups, stale temporaries -------------------------------------
def test_hanging_compiler_is_killed_with_its_children(cache, tmp_path, monkeypatch):
    cc, pids = hanging_cc(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SPARSETORCH_COMPILE_TIMEOUT", "1")
    src = source()
    t0 = time.monotonic()
    with pytest.raises(rt.CompileTimeoutError, match=r"ran past 1 s.*"
                                                     r"SPARSETORCH_COMPILE_TIMEOUT=300"):
        rt.load_kernel(src, "saxpy", ARGS)
    assert time.monotonic() - t0 < 30
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 5
    while not all(map(_gone, started)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_gone, started)), started      # the shell and the sleep it started
    assert not [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    if fcntl is not None:                          # the entry's lock is free again
        fd = os.open(cache / f"{key_of(src)}.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_compile_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv("SPARSETORCH_COMPILE_TIMEOUT", value)
    from sparsetorch.runtime.tool import compile_timeout

    with pytest.raises(ValueError, match=f"SPARSETORCH_COMPILE_TIMEOUT='{value}'.*e.g. 120"):
        compile_timeout()


@pytest.mark.parametrize("value", ["inf", "1e400", "1e12"])
def test_a_compile_timeout_beyond_the_clock_means_no_limit(monkeypatch, value):
    """(inf raised OverflowError deep inside selectors, 1e12 "timestamp too large")"""
    monkeypatch.setenv("SPARSETORCH_COMPILE_TIMEOUT", value)
    from sparsetorch.runtime.tool import compile_timeout, run

    assert compile_timeout() is None
    assert run(["sh", "-c", "echo ok"]).stdout == "ok\n"


def test_build_threads_take_ascii_digits_only(monkeypatch):
    from sparsetorch.runtime.tool import build_threads

    monkeypatch.setenv("SPARSETORCH_BUILD_THREADS", "\u00b2")   # ("²".isdigit() is True)
    with pytest.raises(ValueError, match="SPARSETORCH_BUILD_THREADS=.*positive whole number"):
        build_threads()


@pytest.mark.slow   # ~3 s: a build killed in a subprocess (the full suite runs it)
def test_temp_files_of_a_killed_build_are_swept(cache, tmp_path, monkeypatch):
    """A process killed mid-build leaves its temp library; the next cache open removes it
    (its owner is dead), but not a live process's, another host's or a young unnamed one."""
    cc, pids = hanging_cc(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", "from sparsetorch import runtime as rt; "
         f"rt.load_kernel({source()!r}, 'saxpy', [rt.I64])"],
        env={**os.environ, "CC": str(cc), "SPARSETORCH_CACHE": str(cache)})
    deadline = time.monotonic() + 120
    while not (pids.exists() and len(pids.read_text().split()) == 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    child.wait()
    for pid in pids.read_text().split():           # the orphaned compiler
        os.kill(int(pid), 9)
    left = [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    assert len(left) == 1 and f"-{child.pid}-" in left[0]
    mine = cache / f".tmp-{rt_cache._HOST}-{os.getpid()}-live.so"
    foreign = cache / ".tmp-0badc0de-1-elsewhere.so"
    young, old = cache / ".tmp-young.so", cache / ".tmp-old.so"
    for f in (mine, foreign, young, old):
        f.write_bytes(b"")
    os.utime(old, (time.time() - 2 * rt_cache.STALE_SECONDS,) * 2)
    rt_cache._swept.discard(str(cache))
    rt_cache.ensure_dir()
    assert sorted(n for n in os.listdir(cache) if n.startswith(".tmp-")) == sorted(
        f.name for f in (mine, foreign, young))


# -- item 10: a private cache ----------------------------------------------------------------
def test_cache_is_created_private_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        fn = rt.load_kernel(source(), "saxpy", ARGS)
    finally:
        os.umask(old)
    check_saxpy(fn)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    files = list(cache.iterdir())
    assert {f.suffix for f in files} >= {".so", ".c", ".json", ".lock"}
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == \
        {f.name: "0o600" for f in files}


@pytest.mark.parametrize("mode, says", [(0o777, "0o777"), (0o770, "0o770"), (0o702, "0o702")])
def test_cache_others_may_write_is_refused(cache, mode, says):
    cache.mkdir(mode=0o700)
    cache.chmod(mode)
    with pytest.raises(rt.UnsafeCacheError, match=rf"will not use the kernel cache directory "
                                                  rf".*group or others may write to it "
                                                  rf"\(mode {says}\).*chmod 700.*"
                                                  "SPARSETORCH_CACHE"):
        rt.load_kernel(source(), "saxpy", ARGS)
    cache.chmod(0o755)                                # read-only for others: fine
    check_saxpy(rt.load_kernel(source(), "saxpy", ARGS))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_cache_owned_by_another_user_is_refused(cache):
    cache.mkdir(mode=0o700)
    os.chown(cache, OTHER_UID, -1)
    with pytest.raises(rt.UnsafeCacheError, match=rf"owned by uid {OTHER_UID}, not by you"):
        rt.load_kernel(source(), "saxpy", ARGS)
    link = cache.parent / "link"                       # nor reached through a symlink
    link.symlink_to(cache)
    os.environ["SPARSETORCH_CACHE"] = str(link)
    with pytest.raises(rt.UnsafeCacheError, match="owned by uid"):
        rt.load_kernel(source(), "saxpy", ARGS)


PLANTED = textwrap.dedent("""\
    #include <stdio.h>
    __attribute__((constructor)) static void planted(void) {
        FILE *f = fopen("%s", "w"); if (f) fclose(f);
    }
    """)


def _plant_library(so, proof):
    """Replace ``so`` with a library that proves it ran when loaded, marker recomputed."""
    evil = so.parent / "evil.c"
    evil.write_text(PLANTED % proof + source().split("\n", 1)[1])
    subprocess.run([*rt_build.toolchain().argv, "-shared", "-fPIC", str(evil), "-o", str(so)],
                   check=True)
    data = so.read_bytes()
    marker = so.with_suffix(".json")
    meta = json.loads(marker.read_text())
    meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    marker.write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["owned by another user", "group-writable", "symlink"])
def test_planted_library_is_never_loaded(cache, tmp_path, how):
    if how == "owned by another user" and os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    src = source()
    rt.load_kernel(src, "saxpy", ARGS)
    rt.clear_cache(disk=False)
    so, proof = cache / f"{key_of(src)}.so", tmp_path / "planted-ran"
    if how == "symlink":
        target = tmp_path / "elsewhere.so"
        so.rename(target)
        so.with_suffix(".json").rename(target.with_suffix(".json"))
        _plant_library(target, proof)
        target.with_suffix(".json").rename(so.with_suffix(".json"))
        so.symlink_to(target)
    else:
        _plant_library(so, proof)
        if how == "group-writable":
            so.chmod(0o620)
        else:
            os.chown(so, OTHER_UID, -1)
    fn = rt.load_kernel(src, "saxpy", ARGS)
    check_saxpy(fn)
    assert not proof.exists()
    assert fn.library.origin == "build" and rt.stats()["rebuilt_corrupt"] == 1
    assert not so.is_symlink() and so.stat().st_uid == os.geteuid()


gcc_only = pytest.mark.skipif(not rt_build.pch._is_gcc(rt_build.toolchain().version),
                              reason="precompiled headers are used with GCC only")


@gcc_only
@pytest.mark.slow   # ~2 s of compiling (the full suite runs it)
def test_planted_header_is_never_compiled_in(cache, tmp_path):
    """A header with planted code, a .gch GCC would reject (so it parses the text) and a
    marker recomputed to match that .gch."""
    intrinsics = "#include <immintrin.h>"
    rt.load_kernel(source(intrinsics), "saxpy", ARGS)
    rt_build.pch.wait()
    (gch,) = cache.glob("*.h.gch")
    header = gch.with_suffix("")
    proof = tmp_path / "planted-ran"
    header.write_text(rt_build.pch.TEXT + PLANTED % proof)
    gch.write_bytes(b"not a precompiled header")
    (cache / (header.name[:-2] + ".json")).write_text(json.dumps(
        {"size": gch.stat().st_size, "sha256": hashlib.sha256(gch.read_bytes()).hexdigest()}))
    rt_build.pch._headers.clear()                       # a fresh process
    rt.clear_cache(disk=False)
    check_saxpy(rt.load_kernel(source(intrinsics), "saxpy", ARGS))
    rt_build.pch.wait()
    check_saxpy(rt.load_kernel(source(intrinsics), "saxpy", ARGS))
    assert not proof.exists()
    assert header.read_text() == rt_build.pch.TEXT


def test_lock_symlink_is_not_followed(cache, tmp_path):
    src = source()
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    (cache / f"{key_of(src)}.lock").symlink_to(victim)
    check_saxpy(rt.load_kernel(src, "saxpy", ARGS))
    assert not victim.exists()


def test_cache_path_starting_with_a_dash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPARSETORCH_CACHE", "-cache")
    rt.clear_cache(disk=False)
    try:
        assert rt.cache_dir() == tmp_path / "-cache"
        src = source()
        check_saxpy(rt.load_kernel(src, "saxpy", ARGS))
        rt.clear_cache(disk=False)
        fn = rt.load_kernel(src, "saxpy", ARGS)          # the entry is whole: a disk hit
        assert fn.library.origin == "disk"
    finally:
        rt.clear_cache(disk=False)
