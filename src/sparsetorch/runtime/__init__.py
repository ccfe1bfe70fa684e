"""Runtime: turn generated C99 + OpenMP kernel source into callable functions.

``load_kernel(source, symbol, argtypes)`` compiles ``source`` with ``$CC`` (default
``cc``) once per machine, caches the shared library on disk and in memory, and returns
the raw ``ctypes`` function, so a warm call is one ctypes call and nothing else.

Calling convention the code generator follows:

* tensors go in as raw pointers: ``t.data_ptr()`` for a ``PTR`` argument (a C ``T*``);
  the caller keeps ``t`` alive and contiguous for the duration of the call;
* sizes and indices as ``I64`` (``int64_t``), scalars as ``F64`` (``double``);
  any other ctypes type works too;
* the thread count is an ``int64_t nt`` argument used as ``num_threads(nt)`` on each
  ``#pragma omp parallel``; pass :func:`num_threads` so kernels follow
  ``torch.set_num_threads``. Kernels share torch's OpenMP runtime when torch ships
  GNU libgomp (the Linux wheels), so there is one thread pool, not two;
* functions return ``void``; the ctypes call releases the GIL while the kernel runs.

Example:
    >>> import torch
    >>> from sparsetorch import runtime
    >>> src = '''#include <stdint.h>
    ... void scale(int64_t n, double a, float *x, int64_t nt) {
    ...     #pragma omp parallel for num_threads(nt)
    ...     for (int64_t i = 0; i < n; i++) x[i] *= (float)a;
    ... }'''
    >>> scale = runtime.load_kernel(src, "scale", [runtime.I64, runtime.F64, runtime.PTR,
    ...                                             runtime.I64])
    >>> x = torch.ones(4)
    >>> scale(x.numel(), 3.0, x.data_ptr(), runtime.num_threads())
    >>> x.tolist()
    [3.0, 3.0, 3.0, 3.0]
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from . import cache as _cache
from . import entry as _entry
from . import tool as _tool
from .build import (FLAGS, LIBS, OPENMP_FLAG, CompilerNotFoundError, CompileTimeoutError,
                    KernelBuildError, KernelCompileError, Toolchain, compile_library,
                    cpu_features, openmp_missing, toolchain)
from .cache import UnsafeCacheError, cache_dir

PTR = ctypes.c_void_p    # a tensor's data_ptr()
I64 = ctypes.c_int64     # sizes, strides, the thread count
F64 = ctypes.c_double    # scalars

__all__ = ["load_kernel", "load_entries", "load_library", "prefetch", "kernel_address",
           "num_threads",
           "cache_dir", "clear_cache", "stats", "reset_stats", "KernelLibrary", "PTR", "I64",
           "F64", "KernelBuildError", "CompilerNotFoundError", "KernelCompileError",
           "CompileTimeoutError", "UnsafeCacheError"]


@dataclass(frozen=True)
class KernelLibrary:
    """Where a loaded kernel came from; attached to each function as ``fn.library``."""

    key: str                   # cache key (sha256 hex)
    path: str                  # the loaded .so
    source_path: str           # the C source saved next to it, for debugging
    flags: tuple[str, ...]     # flags actually used (no -fopenmp if CC lacks OpenMP)
    compiler: str              # resolved compiler command
    origin: str                # "build" or "disk"
    build_seconds: float       # compile time (0.0 for a disk hit)


_funcs: dict[tuple, object] = {}                               # memo key -> ctypes function
# id of a function from load_entries -> (the function, its C function's address); keyed by
# id since ctypes functions do not hash, holding the function so the id is never reused
_addresses: dict[int, tuple] = {}
_libs: dict[str, tuple[ctypes.CDLL, KernelLibrary]] = {}       # cache key -> loaded library
_lock = threading.RLock()   # guards the tables; memo hits are a dict lookup
_inflight: dict[str, Future] = {}   # cache key -> the build one thread is running
NOTICE_SECONDS = 1.0   # builds slower than this say so on stderr
_STATS0 = {"memo_hits": 0, "disk_hits": 0, "builds": 0, "build_seconds": 0.0, "rebuilt_corrupt": 0}
_stats = dict(_STATS0)


def _forget_builds_in_child() -> None:
    # (a forked child: the parent's builds in flight run on threads it does not have, so
    # their futures would never complete; a lock one of them held, never be released)
    global _lock
    _lock = threading.RLock()
    _inflight.clear()


os.register_at_fork(after_in_child=_forget_builds_in_child)


def load_kernel(source: str, symbol: str, argtypes) -> ctypes._CFuncPtr:
    """Compile (or find cached) ``source`` and return its C function ``symbol``.

    ``argtypes`` is a sequence of ctypes types (``PTR``, ``I64``, ``F64``, ...), one per
    C parameter; the function's restype is ``None`` (C ``void``). The same
    (source, symbol, argtypes, ``CC``) returns the same function object without touching
    disk; a new source is looked up in :func:`cache_dir` and compiled only if missing or
    corrupt. Raises :class:`CompilerNotFoundError` when ``CC`` cannot run and
    :class:`KernelCompileError` (with the compiler's stderr and the saved source path)
    when it rejects the source.

    Example:
        >>> from sparsetorch import runtime
        >>> src = "#include <stdint.h>\\nvoid noop(int64_t n) { (void)n; }\\n"
        >>> f = runtime.load_kernel(src, "noop", [runtime.I64])
        >>> f(3) is None, runtime.load_kernel(src, "noop", [runtime.I64]) is f
        (True, True)
        >>> f.library.origin in ("build", "disk")
        True
    """
    mkey = (source, symbol, tuple(argtypes), os.environ.get("CC"))
    fn = _funcs.get(mkey)
    if fn is not None:
        _stats["memo_hits"] += 1
        return fn
    lib, info = _library(source)
    with _lock:
        fn = _funcs.get(mkey)
        if fn is not None:
            return fn
        try:
            fn = lib[symbol]  # a fresh function object: argtypes may differ per caller
        except AttributeError:
            raise KernelBuildError(
                f"kernel library {info.path} has no function {symbol!r} (source: "
                f"{info.source_path}); the symbol name passed to load_kernel must match "
                "a non-static function in the source") from None
        fn.argtypes = list(argtypes)
        fn.restype = None
        fn.library = info
        _funcs[mkey] = fn
        return fn


def load_entries(source: str, signatures: dict) -> dict:
    """Compile (or find cached) ``source`` and return ``{symbol: function}`` for each
    ``symbol -> argtypes`` in ``signatures`` (``PTR`` or ``I64`` only), as functions that
    cost a tenth of a ctypes call: ``METH_FASTCALL`` wrappers generated next to the kernels
    (``runtime/entry.py``). They take Python ints, release the GIL while the kernel runs and
    return None. Where the interpreter's C API cannot be bound they are plain ctypes
    functions instead, with the same behaviour. One library holds all the symbols.

    Example:
        >>> import torch
        >>> from sparsetorch import runtime
        >>> src = ("#include <stdint.h>\\n"
        ...        "void fill(int64_t n, float *x) { for (int64_t i = 0; i < n; i++) x[i] = 7; }")
        >>> fill = runtime.load_entries(src, {"fill": [runtime.I64, runtime.PTR]})["fill"]
        >>> x = torch.zeros(3)
        >>> fill(3, x.data_ptr())
        >>> x.tolist()
        [7.0, 7.0, 7.0]
    """
    kinds = _entry_kinds(signatures)
    mkey = (source, tuple((s, tuple(k)) for s, k in kinds.items()), os.environ.get("CC"))
    fns = _funcs.get(mkey)
    if fns is not None:
        _stats["memo_hits"] += 1
        return fns
    full = _with_entries(source, kinds)
    lib, _ = _library(full)
    with _lock:
        fns = _funcs.get(mkey)
        if fns is not None:
            return fns
        fns = _entry.entries(lib, kinds)
        if fns is None:
            fns = {s: load_kernel(full, s, signatures[s]) for s in kinds}
        for s, fn in fns.items():
            _addresses[id(fn)] = (fn, ctypes.cast(getattr(lib, s), ctypes.c_void_p).value)
        _funcs[mkey] = fns
        return fns


def _entry_kinds(signatures: dict) -> dict:
    """``{symbol: ["ptr" | "i64", ...]}`` of ``load_entries``' signatures (PTR/I64 only)."""
    kinds = {}
    for symbol, argtypes in signatures.items():
        if any(t not in (PTR, I64) for t in argtypes):
            raise TypeError(f"load_entries: {symbol} has argument types {list(argtypes)}; "
                            "entry points take PTR and I64 only (use load_kernel for others)")
        kinds[symbol] = ["ptr" if t is PTR else "i64" for t in argtypes]
    return kinds


def _with_entries(source: str, kinds: dict) -> str:
    """The library ``load_entries`` builds: ``source`` and its entry points' wrappers."""
    return "\n".join([source, _entry.PRELUDE,
                      *(_entry.wrapper(s, k) for s, k in kinds.items())]) + "\n"


def kernel_address(fn) -> int | None:
    """Address of the C function behind ``fn``, a function from :func:`load_entries`
    (None for any other), for C code that calls kernels without Python in between
    (``ops/cshim.py``).

    Example:
        >>> from sparsetorch import runtime
        >>> src = "#include <stdint.h>\\nvoid nop(int64_t n) { (void)n; }\\n"
        >>> nop = runtime.load_entries(src, {"nop": [runtime.I64]})["nop"]
        >>> runtime.kernel_address(nop) > 0, runtime.kernel_address(print)
        (True, None)
    """
    known = _addresses.get(id(fn))
    return known[1] if known is not None and known[0] is fn else None


def load_library(source: str) -> ctypes.CDLL:
    """Compile (or find cached) ``source`` and return the loaded library, for callers that
    bind its symbols themselves; cached and rebuilt like :func:`load_kernel`'s.

    Example:
        >>> from sparsetorch import runtime
        >>> lib = runtime.load_library("int seven(void) { return 7; }\\n")
        >>> lib.seven()
        7
    """
    return _library(source)[0]


def prefetch(source: str, signatures: dict | None = None) -> Future:
    """Start compiling (or loading) ``source`` in the background and return its future;
    a later :func:`load_kernel` or :func:`load_library` of the same source (or, given
    ``signatures``, :func:`load_entries` of the same source and signatures) waits for that
    build instead of starting another. For kernels a call is sure to need next: the
    compiler runs in a subprocess, so builds overlap each other and Python. A failed
    prefetch is retried (and its error raised) by the load that needs it.

    Example:
        >>> from sparsetorch import runtime
        >>> src = "int eight(void) { return 8; }\\n"
        >>> future = runtime.prefetch(src)
        >>> runtime.load_library(src).eight(), future.result()[0].eight()
        (8, 8)
    """
    if signatures is not None:
        source = _with_entries(source, _entry_kinds(signatures))
    return _tool.submit(_library, source)


def _library(source: str) -> tuple[ctypes.CDLL, KernelLibrary]:
    """The loaded library of ``source``: memo, else disk, else a build; one thread builds
    a key while others needing it wait, and different keys build at once."""
    tc = toolchain()
    # Key over everything that changes the bytes of the .so or whether it runs here.
    key = _cache.cache_key(source, tc.identity(), " ".join(FLAGS + LIBS), cpu_features(),
                           _version())
    with _lock:
        hit = _libs.get(key)
        if hit is not None:  # same source, another symbol or argtypes
            _stats["memo_hits"] += 1
            return hit
        pending = _inflight.get(key)
        if pending is None:
            mine = _inflight[key] = Future()
    if pending is not None:
        try:
            return pending.result()
        except Exception:   # (a failed prefetch: build it here, raising its error)
            return _library(source)
    try:
        loaded = _find_or_build(source, key, tc)
        with _lock:
            _libs[key] = loaded
        mine.set_result(loaded)
        return loaded
    except BaseException as e:
        mine.set_exception(e)
        raise
    finally:
        with _lock:
            _inflight.pop(key, None)


def _find_or_build(source: str, key: str, tc: Toolchain):
    d = _cache.ensure_dir()
    p = _cache.paths(d, key)
    loaded = _load_entry(p, key, tc)
    if loaded is None:
        # Another process may be building this key: wait for it, then look again.
        with _cache.locked(p):
            loaded = _load_entry(p, key, tc)
            if loaded is None:
                if p["so"].exists() or p["json"].exists():
                    _count("rebuilt_corrupt", 1)
                loaded = _build_entry(source, p, key, tc, d)
    if loaded[1].origin == "disk":
        _count("disk_hits", 1)
    return loaded


def _count(name: str, amount) -> None:
    with _lock:   # builds run on several threads
        _stats[name] += amount


def _load_entry(p, key: str, tc: Toolchain):
    meta = _cache.read_marker(p)
    # (the marker names its key: a library copied over another entry's, a restored backup,
    # loaded and ran another kernel, as every kernel exports the same symbols; a marker
    # written before markers named keys is taken on its hash, as then. An entry built
    # single-threaded, without OpenMP, is taken only where the compiler has none)
    if meta is None or meta.get("key", key) != key or (
            OPENMP_FLAG not in meta.get("flags", ()) and not openmp_missing(tc)):
        return None
    try:
        lib = ctypes.CDLL(str(p["so"]))
    except OSError:
        return None  # passed the hash check yet will not load: rebuild it
    return lib, KernelLibrary(key, str(p["so"]), str(p["c"]), tuple(meta.get("flags", ())),
                              " ".join(tc.argv), "disk", 0.0)


def _build_entry(source: str, p, key: str, tc: Toolchain, d: Path):
    # Compile from the final .c path, not a temp name: the file name is embedded in the
    # .so, and identical bytes from racing processes keep every marker valid.
    try:
        _cache.write_atomic(p["c"], source.encode())
        tmp = _cache.temp_path(d, ".so")
    except OSError as e:  # e.g. a read-only cache that holds prebuilt kernels, but not this one
        raise KernelBuildError(f"cannot write a new kernel into the cache directory {d}: {e}. "
                               "Set SPARSETORCH_CACHE to a writable directory.") from e
    try:
        t0 = time.perf_counter()
        flags = compile_library(tc, str(p["c"]), tmp)
        dt = time.perf_counter() - t0
        _cache.install(tmp, p["so"])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _cache.write_marker(p, {"key": key, "flags": list(flags), "compiler": " ".join(tc.argv),
                            "build_seconds": dt})
    _count("builds", 1)
    _count("build_seconds", dt)
    _notice(source, dt, p["so"])
    try:
        lib = ctypes.CDLL(str(p["so"]))
    except OSError as e:
        raise KernelBuildError(f"built kernel library {p['so']} but could not load it: {e}. "
                               f"Source: {p['c']}; compiler: {' '.join(tc.argv)}") from e
    return lib, KernelLibrary(key, str(p["so"]), str(p["c"]), tuple(flags),
                              " ".join(tc.argv), "build", dt)


def _notice(source: str, seconds: float, path: Path) -> None:
    """One line on stderr for a build slow enough to notice (``SPARSETORCH_QUIET=1``
    hides it), so a pause on a first call is explained."""
    if seconds < NOTICE_SECONDS or os.environ.get("SPARSETORCH_QUIET", "") not in ("", "0"):
        return
    # the source's first comment names it: "sparsetorch kernel: out[i] = ..." or a module's
    what = source.split("\n", 1)[0].strip().removeprefix("/*").removesuffix("*/").strip()
    what = what.split(". ")[0].replace("sparsetorch kernel: ", "kernel ")
    print(f"sparsetorch: compiled {what[:100]} in {seconds:.1f} s; cached in {path.parent}, "
          "so later runs load it (SPARSETORCH_QUIET=1 hides this)", file=sys.stderr)


def _version() -> str:
    # Looked up lazily: this module may be imported while sparsetorch/__init__ still runs.
    return getattr(sys.modules.get("sparsetorch"), "__version__", "unknown")


def num_threads() -> int:
    """Threads a kernel should use: torch's setting, so ``torch.set_num_threads`` governs
    both. Pass it as the kernel's ``nt`` argument.

    Example:
        >>> import torch
        >>> from sparsetorch import runtime
        >>> runtime.num_threads() == torch.get_num_threads()
        True
    """
    import torch  # already imported by sparsetorch; local so this module stays light
    return torch.get_num_threads()


def clear_cache(*, disk: bool = True) -> int:
    """Forget loaded kernels (loaded libraries stay mapped: unloading is unsafe while a
    function object may live) and, unless ``disk=False``, delete the cache's files.
    Builds in flight (prefetched ones) finish first, so none lands in the memo afterwards.
    Returns the number of files removed.

    Example:
        >>> from sparsetorch import runtime
        >>> runtime.clear_cache(disk=False)
        0
    """
    with _lock:
        pending = list(_inflight.values())
    for future in pending:
        try:
            future.result()
        except Exception:  # noqa: BLE001 - its error belongs to whoever loads that source
            pass
    with _lock:
        _funcs.clear()
        _libs.clear()
        return _cache.clear() if disk else 0


def stats() -> dict:
    """Counters since start (or :func:`reset_stats`): ``memo_hits`` (answered in memory),
    ``disk_hits`` (loaded from the cache dir), ``builds`` and ``build_seconds`` (compiler
    runs), ``rebuilt_corrupt`` (cache entries that failed validation and were rebuilt).

    Example:
        >>> from sparsetorch import runtime
        >>> sorted(runtime.stats())
        ['build_seconds', 'builds', 'disk_hits', 'memo_hits', 'rebuilt_corrupt']
    """
    return dict(_stats)


def reset_stats() -> None:
    """Zero the counters of :func:`stats`."""
    _stats.update(_STATS0)
