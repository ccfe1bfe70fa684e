"""Runtime: compile, cache and load generated C kernels.

Every test points SPARSETORCH_CACHE at its own tmp dir and uses a source with a unique
tag, so nothing touches the user's cache and no test sees another's kernels.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
import warnings

from pathlib import Path

import pytest
import torch

import sparsetorch
from sparsetorch import runtime as rt
from sparsetorch.runtime import build as rt_build

SAXPY_ARGS = [rt.I64, rt.F64, rt.PTR, rt.PTR, rt.I64]


def saxpy_source(tag=None):
    tag = tag or uuid.uuid4().hex
    return textwrap.dedent(f"""\
        /* test kernel {tag} */
        #include <stdint.h>
        void saxpy(int64_t n, double a, const float *restrict x, float *restrict y,
                   int64_t nt) {{
            #pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t i = 0; i < n; i++) y[i] += (float)a * x[i];
        }}
        void scale(int64_t n, double a, float *restrict y) {{
            for (int64_t i = 0; i < n; i++) y[i] *= (float)a;
        }}
        """)


def run_saxpy(fn, n=10_000, a=2.5):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    expected = y + a * x
    fn(n, a, x.data_ptr(), y.data_ptr(), rt.num_threads())
    torch.testing.assert_close(y, expected)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPARSETORCH_CACHE", str(d))
    rt.clear_cache(disk=False)  # forget kernels other tests loaded from other dirs
    rt.reset_stats()
    yield d
    rt.clear_cache(disk=False)


# A child process: waits at a file barrier until its siblings have imported torch too
# (so they really race), loads the kernel, checks the result and prints its counters.
CHILD = textwrap.dedent("""\
    import json, os, sys, time, uuid
    import torch
    from sparsetorch import runtime as rt
    import sparsetorch.runtime.cache as rt_cache
    if os.environ.get("ST_TEST_NOLOCK"):
        rt_cache.fcntl = None  # exercise the lock-free path: both processes compile
    src = open(sys.argv[1]).read()
    barrier, n = os.environ.get("ST_TEST_BARRIER"), int(os.environ.get("ST_TEST_N", "0"))
    if barrier:
        open(os.path.join(barrier, uuid.uuid4().hex), "w").close()
        deadline = time.time() + 60
        while len(os.listdir(barrier)) < n and time.time() < deadline:
            time.sleep(0.0005)
    f = rt.load_kernel(src, "saxpy", [rt.I64, rt.F64, rt.PTR, rt.PTR, rt.I64])
    x, y = torch.ones(10000), torch.full((10000,), 2.0)
    f(10000, 3.0, x.data_ptr(), y.data_ptr(), rt.num_threads())
    assert torch.equal(y, torch.full((10000,), 5.0)), y
    print(json.dumps(rt.stats()))
    """)


def spawn(tmp_path, src, **env):
    script, srcfile = tmp_path / "child.py", tmp_path / f"src-{uuid.uuid4().hex}.c"
    script.write_text(CHILD)
    srcfile.write_text(src)
    return subprocess.Popen([sys.executable, str(script), str(srcfile)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def child_stats(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_saxpy_matches_torch_and_saves_source(cache):
    src = saxpy_source()
    f = rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    run_saxpy(f)
    s = rt.stats()
    assert s["builds"] == 1 and s["disk_hits"] == 0 and s["build_seconds"] > 0
    info = f.library
    assert info.origin == "build" and "-fopenmp" in info.flags and "-O3" in info.flags
    assert open(info.source_path).read() == src and os.path.exists(info.path)
    # Nothing half-written is left behind.
    assert not [p for p in os.listdir(cache) if p.startswith(".tmp-")]


def test_second_load_is_memo_hit_same_object(cache):
    src = saxpy_source()
    f = rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    assert rt.load_kernel(src, "saxpy", SAXPY_ARGS) is f
    # Another symbol of the same source reuses the loaded library too.
    g = rt.load_kernel(src, "scale", [rt.I64, rt.F64, rt.PTR])
    y = torch.ones(5)
    g(5, 4.0, y.data_ptr())
    assert y.tolist() == [4.0] * 5
    s = rt.stats()
    assert s["builds"] == 1 and s["memo_hits"] == 2 and s["disk_hits"] == 0


@pytest.mark.slow   # ~3 s: a fresh interpreter (the full suite runs it)
def test_fresh_process_finds_kernel_on_disk(cache, tmp_path):
    src = saxpy_source()
    rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    s = child_stats(spawn(tmp_path, src))
    assert s["builds"] == 0 and s["disk_hits"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("nolock", ["", "1"], ids=["flock", "no-lock"])
def test_two_processes_build_same_kernel_at_once(cache, tmp_path, nolock):
    src = saxpy_source()
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [spawn(tmp_path, src, ST_TEST_BARRIER=str(barrier), ST_TEST_N="2",
                   ST_TEST_NOLOCK=nolock) for _ in range(2)]
    stats = [child_stats(p) for p in procs]
    builds = sum(s["builds"] for s in stats)
    assert builds + sum(s["disk_hits"] for s in stats) == 2
    assert builds == 1 if not nolock else builds >= 1  # the lock makes one wait, not rebuild
    # Whatever won the race is a valid entry for a later load.
    rt.reset_stats()
    run_saxpy(rt.load_kernel(src, "saxpy", SAXPY_ARGS))
    assert rt.stats()["disk_hits"] == 1


def _entry_copy(cache, monkeypatch, tmp_path, damage):
    """Build a kernel, copy its cache entry to a fresh dir (a path this process has never
    dlopen'ed, so glibc cannot hand back the old mapping), damage it there."""
    src = saxpy_source()
    info = rt.load_kernel(src, "saxpy", SAXPY_ARGS).library
    d2 = tmp_path / "cache2"
    shutil.copytree(cache, d2)
    so = d2 / os.path.basename(info.path)
    damage(so)
    monkeypatch.setenv("SPARSETORCH_CACHE", str(d2))
    rt.clear_cache(disk=False)
    rt.reset_stats()
    return src


@pytest.mark.parametrize("how", ["truncated", "same-size-garbage", "no-marker"])
def test_corrupt_entry_is_rebuilt(cache, monkeypatch, tmp_path, how):
    def damage(so):
        data = so.read_bytes()
        if how == "truncated":
            so.write_bytes(data[: len(data) // 2])
        elif how == "same-size-garbage":
            so.write_bytes(b"\0" * len(data))
        else:  # a crash between installing the .so and writing its marker
            so.with_suffix(".json").unlink()
    src = _entry_copy(cache, monkeypatch, tmp_path, damage)
    f = rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    run_saxpy(f)
    s = rt.stats()
    assert s["builds"] == 1 and s["disk_hits"] == 0 and s["rebuilt_corrupt"] == 1


def test_entry_that_passes_marker_but_fails_dlopen_is_rebuilt(cache, monkeypatch, tmp_path):
    def damage(so):  # garbage with a marker forged to match it: only dlopen can tell
        so.write_bytes(b"not an ELF file")
        marker = so.with_suffix(".json")
        meta = json.loads(marker.read_text())
        meta.update(size=so.stat().st_size, sha256=hashlib.sha256(so.read_bytes()).hexdigest())
        marker.write_text(json.dumps(meta))
    src = _entry_copy(cache, monkeypatch, tmp_path, damage)
    run_saxpy(rt.load_kernel(src, "saxpy", SAXPY_ARGS))
    assert rt.stats()["builds"] == 1 and rt.stats()["rebuilt_corrupt"] == 1


def test_an_entry_copied_over_another_keys_is_rebuilt(cache, monkeypatch, tmp_path):
    """Every kernel exports the same symbols and the marker held only the library's size
    and hash: a relu kernel's entry copied over the plain one's (a backup restored, an
    rsync mix-up) loaded and ran, silently wrong."""
    other = saxpy_source().replace("y[i] +=", "y[i] -=")
    assert "y[i] -=" in other
    wrong = rt.load_kernel(other, "saxpy", SAXPY_ARGS).library

    def damage(so):
        so.write_bytes(open(wrong.path, "rb").read())
        so.with_suffix(".json").write_text(open(wrong.path[:-3] + ".json").read())
    src = _entry_copy(cache, monkeypatch, tmp_path, damage)
    run_saxpy(rt.load_kernel(src, "saxpy", SAXPY_ARGS))
    assert rt.stats()["builds"] == 1 and rt.stats()["disk_hits"] == 0


def test_a_marker_from_before_keys_is_taken_on_its_hash(cache, monkeypatch, tmp_path):
    def damage(so):   # (no "key": written by an earlier version; a read-only cache too)
        marker = so.with_suffix(".json")
        meta = json.loads(marker.read_text())
        del meta["key"]
        marker.write_text(json.dumps(meta))
    src = _entry_copy(cache, monkeypatch, tmp_path, damage)
    run_saxpy(rt.load_kernel(src, "saxpy", SAXPY_ARGS))
    assert rt.stats()["builds"] == 0 and rt.stats()["disk_hits"] == 1


def test_a_failing_build_is_not_taken_for_missing_openmp(cache, monkeypatch, tmp_path):
    """A compiler that fails everything (a full disk, missing headers) made the OpenMP
    probe fail too: the process built, and cached, every later kernel single-threaded."""
    real = rt_build.toolchain().argv[0]
    fake = tmp_path / "cc-broken"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exec {real} --version\n"
                    "echo 'No space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # (no "does not support -fopenmp")
        with pytest.raises(rt.KernelCompileError, match="point at this machine"):
            rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS)
    assert not rt_build.openmp_missing(rt_build.toolchain())


def test_a_cached_single_threaded_kernel_is_rebuilt_where_openmp_works(cache, monkeypatch,
                                                                          tmp_path):
    def damage(so):   # (the marker of a build without OpenMP, as a poisoned cache held)
        marker = so.with_suffix(".json")
        meta = json.loads(marker.read_text())
        meta["flags"] = [f for f in meta["flags"] if f != "-fopenmp"]
        marker.write_text(json.dumps(meta))
    src = _entry_copy(cache, monkeypatch, tmp_path, damage)
    f = rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    assert "-fopenmp" in f.library.flags and rt.stats()["builds"] == 1


def test_an_unbalanced_quote_in_cc_is_named(cache, monkeypatch):
    monkeypatch.setenv("CC", 'gcc "-O2')
    with pytest.raises(rt.CompilerNotFoundError, match="cannot read CC=.*No closing quotation"):
        rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS)


@pytest.mark.parametrize("cc,says", [("/nonexistent", "was not found"),
                                     ("false", "exited with")])
def test_no_compiler_error_names_cc_and_fallback(cache, monkeypatch, cc, says):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(rt.CompilerNotFoundError) as e:
        rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS)
    msg = str(e.value)
    assert f"CC={cc!r}" in msg and says in msg and "SPARSETORCH_BACKEND=torch" in msg
    assert isinstance(e.value, RuntimeError)


def test_compile_error_carries_stderr_and_source_path(cache):
    src = "/* %s */\nvoid broken(int x {\n" % uuid.uuid4().hex
    with pytest.raises(rt.KernelCompileError) as e:
        rt.load_kernel(src, "broken", [rt.I64])
    err = e.value
    assert "error" in err.stderr and err.stderr.strip() in str(err)
    assert err.source_path in str(err) and open(err.source_path).read() == src
    assert not [p for p in os.listdir(cache) if p.endswith(".so") or p.startswith(".tmp-")]
    assert rt.stats()["builds"] == 0


def test_error_inside_omp_pragma_is_not_mistaken_for_missing_openmp(cache):
    src = ("#include <stdint.h>\nvoid k(int64_t n, float *y) {\n"
           "#pragma omp parallel for num_threads(undeclared_nt)\n"
           "for (int64_t i = 0; i < n; i++) y[i] = 0; }\n")
    with pytest.raises(rt.KernelCompileError, match="undeclared_nt"):
        rt.load_kernel(src, "k", [rt.I64, rt.PTR])


def test_compiler_without_openmp_builds_serial_kernels(cache, monkeypatch, tmp_path):
    real = rt_build.toolchain().argv[0]
    fake = tmp_path / "cc-no-openmp"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do
          [ "$a" = -fopenmp ] && {{ echo "error: unsupported option '-fopenmp'" >&2; exit 1; }}
        done
        exec {real} "$@"
        """))
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="does not support -fopenmp"):
        f = rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS)
    assert "-fopenmp" not in f.library.flags and "-O3" in f.library.flags
    run_saxpy(f)
    # Genuine errors still surface with that compiler.
    with pytest.raises(rt.KernelCompileError):
        rt.load_kernel("void bad( {\n", "bad", [])


def test_missing_symbol_is_named(cache):
    with pytest.raises(rt.KernelBuildError, match="'nope'"):
        rt.load_kernel(saxpy_source(), "nope", [])


def test_cache_key_covers_package_version(cache, monkeypatch):
    src = saxpy_source()
    rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    rt.clear_cache(disk=False)
    monkeypatch.setattr(sparsetorch, "__version__", "999.0")
    f = rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    assert f.library.origin == "build" and rt.stats()["builds"] == 2


def test_clear_cache_removes_files_and_memo(cache):
    src = saxpy_source()
    rt.load_kernel(src, "saxpy", SAXPY_ARGS)
    assert rt.clear_cache() >= 3  # .c, .so, .json (+ .lock)
    assert not any(cache.iterdir())
    assert rt.load_kernel(src, "saxpy", SAXPY_ARGS).library.origin == "build"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARSETORCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rt.cache_dir() == tmp_path / "xdg" / "sparsetorch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert rt.cache_dir() == tmp_path / "home" / ".cache" / "sparsetorch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")   # (invalid per the XDG spec)
    assert rt.cache_dir() == tmp_path / "home" / ".cache" / "sparsetorch"
    monkeypatch.setenv("HOME", "")     # (expanduser gave "": the cache was /.cache/...)
    import pwd

    home = pwd.getpwuid(os.getuid()).pw_dir
    assert rt.cache_dir() == Path(home) / ".cache" / "sparsetorch"
    monkeypatch.setenv("SPARSETORCH_CACHE", str(tmp_path / "mine"))
    assert rt.cache_dir() == tmp_path / "mine"


def test_num_threads_follows_torch(monkeypatch):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert rt.num_threads() == 1
    finally:
        torch.set_num_threads(old)


def _gomp_libs():
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_kernels_share_torchs_openmp_runtime(cache):
    # Two OpenMP runtimes would mean two thread pools spinning against each other.
    before = _gomp_libs()
    if not before:
        pytest.skip("torch is not using GNU libgomp here")
    run_saxpy(rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS))
    assert _gomp_libs() == before


# -- Python entry points (runtime/entry.py) -----------------------------------------------

def axpy_source(tag=None):
    tag = tag or uuid.uuid4().hex
    return textwrap.dedent(f"""\
        /* test kernel {tag} */
        #include <stdint.h>
        void axpy(int64_t n, int64_t a, const float *restrict x, float *restrict y) {{
            for (int64_t i = 0; i < n; i++) y[i] += (float)a * x[i];
        }}
        void negate(int64_t n, float *restrict y) {{
            for (int64_t i = 0; i < n; i++) y[i] = -y[i];
        }}
        """)


AXPY_SIGNATURES = {"axpy": [rt.I64, rt.I64, rt.PTR, rt.PTR], "negate": [rt.I64, rt.PTR]}


def run_axpy(fns):
    x, y = torch.arange(5.0), torch.ones(5)
    assert fns["axpy"](5, 3, x.data_ptr(), y.data_ptr()) is None
    fns["negate"](5, y.data_ptr())
    torch.testing.assert_close(y, -(1 + 3 * torch.arange(5.0)))


def test_entries_are_builtins_from_one_library(cache):
    src = axpy_source()
    fns = rt.load_entries(src, AXPY_SIGNATURES)
    assert type(fns["axpy"]).__name__ == "builtin_function_or_method"
    run_axpy(fns)
    assert rt.stats()["builds"] == 1                   # both symbols, one library
    assert rt.load_entries(src, AXPY_SIGNATURES) is fns   # memo hit


def test_entries_reject_bad_arguments_without_calling(cache):
    fns = rt.load_entries(axpy_source(), AXPY_SIGNATURES)
    y = torch.ones(3)
    with pytest.raises(TypeError, match="takes 2 integer arguments"):
        fns["negate"](3)
    with pytest.raises(TypeError):
        fns["negate"](3, "not a pointer")
    with pytest.raises(TypeError, match="PTR and I64 only"):
        rt.load_entries(axpy_source(), {"axpy": [rt.I64, rt.F64, rt.PTR, rt.PTR]})
    assert y.tolist() == [1.0, 1.0, 1.0]


def test_entries_fall_back_to_ctypes_without_the_c_api(cache, monkeypatch):
    from sparsetorch.runtime import entry

    monkeypatch.setattr(entry, "_table", False)   # as if ctypes.pythonapi lacked a symbol
    fns = rt.load_entries(axpy_source(), AXPY_SIGNATURES)
    assert not type(fns["axpy"]).__name__.startswith("builtin")
    run_axpy(fns)


def test_entries_release_the_gil(cache):
    """A kernel spinning until another Python thread sets a flag sees it only if the GIL
    was released while it ran (it gives up after a few seconds, so a failure cannot hang)."""
    import threading

    src = textwrap.dedent(f"""\
        /* test kernel {uuid.uuid4().hex} */
        #include <stdint.h>
        void spin(int32_t *flag) {{
            volatile int32_t *f = flag;
            for (int64_t i = 0; i < 3000000000LL && !f[0]; i++) {{ }}
            f[1] = f[0];
        }}
        """)
    spin = rt.load_entries(src, {"spin": [rt.PTR]})["spin"]
    flag = torch.zeros(2, dtype=torch.int32)
    setter = threading.Timer(0.05, lambda: flag.fill_(1))
    setter.start()
    spin(flag.data_ptr())
    setter.join()
    assert flag.tolist() == [1, 1]


# -- the precompiled intrinsics header (runtime/pch.py) --------------------------------------
def intrinsics_source(tag=None):
    """A kernel that includes <immintrin.h> (and uses nothing of it, so it builds anywhere)."""
    return f"/* test kernel {tag or uuid.uuid4().hex} */\n#include <immintrin.h>\n" + \
        saxpy_source(tag).split("\n", 1)[1]


gcc_only = pytest.mark.skipif(not rt_build.pch._is_gcc(rt_build.toolchain().version),
                              reason="precompiled headers are used with GCC only")


@gcc_only
def test_intrinsic_kernels_share_one_precompiled_header(cache, monkeypatch):
    commands = []
    real_run = rt_build._run
    monkeypatch.setattr(rt_build, "_run",
                        lambda tc, flags, src, out, extra=(): commands.append(extra) or
                        real_run(tc, flags, src, out, extra))
    # the first kernel does not wait for the header, which builds beside it
    for _ in range(3):
        run_saxpy(rt.load_kernel(intrinsics_source(), "saxpy", SAXPY_ARGS))
        rt_build.pch.wait()
    run_saxpy(rt.load_kernel(saxpy_source(), "saxpy", SAXPY_ARGS))
    headers = sorted(cache.glob("*.h.gch"))
    assert len(headers) == 1 and headers[0].stat().st_size > 0
    assert commands == [()] + [("-include", str(headers[0])[:-len(".gch")])] * 2 + [()]
    assert rt.clear_cache() >= 7 and not list(cache.glob("*.h*"))


@gcc_only
@pytest.mark.parametrize("damage", ["garbage", "rejected"])
def test_a_bad_precompiled_header_never_fails_a_build(cache, monkeypatch, damage):
    """A .gch GCC cannot use is parsed around (garbage) or, where the build fails with it,
    dropped and the kernel built without it."""
    run_saxpy(rt.load_kernel(intrinsics_source(), "saxpy", SAXPY_ARGS))
    rt_build.pch.wait()
    (gch,) = cache.glob("*.h.gch")
    if damage == "garbage":
        gch.write_bytes(b"gpch" + os.urandom(4096))
    else:
        monkeypatch.setattr(rt_build.pch, "include_flags",
                            lambda *a: ("-include", str(cache / "missing.h")))
    run_saxpy(rt.load_kernel(intrinsics_source(), "saxpy", SAXPY_ARGS))
    assert rt.stats()["builds"] == 2


def test_precompiled_header_only_for_gcc_and_intrinsics():
    assert not rt_build.pch._is_gcc("clang version 17.0.6\nTarget: x86_64-pc-linux-gnu")
    assert rt_build.pch._is_gcc("gcc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free "
                                "Software Foundation, Inc.")
    tc = rt_build.toolchain()
    assert rt_build.pch.include_flags(tc, rt_build.FLAGS, saxpy_source(), "cpu") == ()
