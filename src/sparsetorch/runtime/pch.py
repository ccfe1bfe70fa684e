"""A precompiled ``<immintrin.h>`` for kernels that use intrinsics (AVX-512, AVX2; GCC only).

Parsing the intrinsics header is about a third of such a kernel's build here (an SpMM
kernel: 0.30 s, 0.21 s with the header precompiled). GCC can load a header precompiled
instead (a ``.gch`` file next to it), so ``include_flags`` answers ``-include <header>`` for
a source that includes ``<immintrin.h>``: a header of the standard includes the kernels start
with plus the intrinsics, precompiled once per compiler, flags and CPU and kept in the
kernel cache (``<key>.h`` and ``<key>.h.gch``, written atomically like the kernels, and
checked like them before use: the header's text, the ``.gch``'s size and hash against its
``<key>.json`` marker, both private files of the user).

GCC checks a ``.gch`` against each compilation and parses the header as text when it does
not fit, so a stale one costs only time; a build that fails with these flags is retried
without them and the header is dropped (``discard``). Other compilers (clang reads another
format) and kernels without intrinsics get no flags: loading the 26 MB ``.gch`` costs an
elementwise kernel more (0.17 s against 0.12 s) than the few headers it parses.

The header is built in the background (``tool.submit``): building it costs more than the one
kernel waiting for it would save, so kernels built meanwhile parse the headers themselves.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from concurrent.futures import Future, wait as _wait_all

from . import cache as _cache
from . import tool

TRIGGER = "#include <immintrin.h>"
TEXT = "".join(f"#include <{h}>\n" for h in
               ("stdint.h", "stdlib.h", "string.h", "math.h", "omp.h", "immintrin.h"))

# (cache dir, compiler identity, flags, cpu) -> the header's path, None where it could not
# be built or was discarded, or the Future of its build in the background
_headers: dict[tuple, str | None | Future] = {}
_memo_lock = threading.Lock()


def _forget_builds_in_child() -> None:
    # (a forked child: a header building in the parent's background never completes here;
    # it is looked for again, and the lock taken afresh)
    global _memo_lock
    _memo_lock = threading.Lock()
    for memo in [m for m, header in _headers.items() if isinstance(header, Future)]:
        del _headers[memo]


os.register_at_fork(after_in_child=_forget_builds_in_child)


def include_flags(tc, flags, source: str, cpu: str) -> tuple[str, ...]:
    """Extra compiler arguments that make ``source`` use the precompiled header, or ().

    Example:
        >>> from sparsetorch.runtime.build import FLAGS, cpu_features, toolchain
        >>> include_flags(toolchain(), FLAGS, "void k(void) {}", cpu_features())
        ()
    """
    if TRIGGER not in source or not _is_gcc(tc.version):
        return ()
    memo = _memo_key(tc, flags, cpu)
    with _memo_lock:
        header = _headers.get(memo, "")
        if isinstance(header, Future):
            if not header.done():
                return ()
            header = _headers[memo] = None if header.exception() else header.result()
        # (built again where the cache was cleared since)
        if header == "" or (header is not None and not os.path.exists(header + ".gch")):
            header = _headers[memo] = _intact(tc, flags, cpu)
            if header is None:
                # Building it takes longer than the one kernel it would speed up: that
                # kernel parses the headers itself while it builds for the ones after.
                pending = tool.submit(_build, tc, flags, cpu)
                if not pending.done():
                    _headers[memo] = pending
                    return ()
                header = _headers[memo] = None if pending.exception() else pending.result()
    return () if header is None else ("-include", header)


def wait() -> None:
    """Wait for precompiled headers being built in the background.

    Example:
        >>> wait()
    """
    with _memo_lock:
        pending = [h for h in _headers.values() if isinstance(h, Future)]
    _wait_all(pending)


def discard(tc, flags, cpu: str) -> None:
    """Stop using this precompiled header in this process (a kernel failed to build with
    it) and delete it, so that later processes build a fresh one."""
    memo = _memo_key(tc, flags, cpu)
    with _memo_lock:
        header, _headers[memo] = _headers.get(memo), None
    if isinstance(header, str):
        with contextlib.suppress(OSError):
            os.unlink(header + ".gch")


def _memo_key(tc, flags, cpu: str) -> tuple:
    return str(_cache.cache_dir()), tc.identity(), tuple(flags), cpu


def _is_gcc(version: str) -> bool:
    """GCC's ``--version`` names the Free Software Foundation; clang's names clang."""
    return "Free Software Foundation" in version and "clang" not in version.lower()


def _header_intact(path) -> bool:
    """Whether ``path`` is the user's own private file holding exactly ``TEXT`` (anything
    else there would be compiled into every kernel)."""
    try:
        return _cache.read_private(path) == TEXT.encode()
    except OSError:
        return False


def _paths(tc, flags, cpu: str) -> dict | None:
    try:
        d = _cache.ensure_dir()
    except OSError:
        return None
    key = _cache.cache_key(TEXT, tc.identity(), " ".join(flags), cpu, "pch")
    # GCC finds the .gch as the header's name + ".gch"; the marker holds its size and hash
    return {"h": d / f"{key}.h", "gch": d / f"{key}.h.gch", "json": d / f"{key}.json"}


def _intact(tc, flags, cpu: str) -> str | None:
    """The header's path if it and its ``.gch`` are in the cache and pass the checks."""
    p = _paths(tc, flags, cpu)
    if p is not None and _header_intact(p["h"]) and _cache.read_marker(p, "gch") is not None:
        return str(p["h"])
    return None


def _build(tc, flags, cpu: str) -> str | None:
    """The header's path once it and its ``.gch`` are in the cache, or None."""
    p = _paths(tc, flags, cpu)
    if p is None:
        return None
    d = p["h"].parent
    # The precompiled unit is compiled like a kernel, minus linking (-shared).
    cflags = [f for f in flags if f != "-shared"]
    try:
        _cache.write_atomic(p["h"], TEXT.encode())
        tmp = _cache.temp_path(d, ".gch")
    except OSError:
        return None
    try:
        proc = tool.run([*tc.argv, *cflags, "-x", "c-header", str(p["h"]), "-o", tmp],
                        text=False)
        if proc.returncode != 0:
            return None
        _cache.install(tmp, p["gch"])
        _cache.write_marker(p, {"compiler": " ".join(tc.argv)}, "gch")
        return str(p["h"])
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
