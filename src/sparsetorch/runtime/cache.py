"""The on-disk kernel cache: one ``<key>.c`` / ``<key>.so`` / ``<key>.json`` triple per kernel.

Writes are temp-file + ``os.replace`` in the cache directory, so another process sees
either no library or a whole one, never half of one. The ``.json`` marker (size and
sha256 of the ``.so``) is written last; an entry without a matching marker is treated
as missing and rebuilt, which is how truncated or corrupt libraries are caught before
``dlopen`` can crash on them. A per-key ``flock`` makes concurrent processes wait for
one build instead of all compiling the same kernel; without ``fcntl`` they all build,
which is slower but still correct.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locking, concurrent builds just duplicate work
    fcntl = None

# ".op": recipes of kernels named by traced graphs (ops/custom_ops.py); ".h", ".gch": the
# precompiled intrinsics header (runtime/pch.py).
SUFFIXES = (".so", ".c", ".json", ".lock", ".op", ".h", ".gch")
TMP_PREFIX = ".tmp-"


def cache_dir() -> Path:
    """Where kernels are cached: ``$SPARSETORCH_CACHE``, else ``$XDG_CACHE_HOME/sparsetorch``,
    else ``~/.cache/sparsetorch``. Read on every call, so tests can monkeypatch the variable.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, SPARSETORCH_CACHE="/tmp/st-doc-cache"):
        ...     print(cache_dir())
        /tmp/st-doc-cache
    """
    env = os.environ.get("SPARSETORCH_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparsetorch"


def ensure_dir() -> Path:
    """Create the cache directory, with an error that names it and the fix."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"sparsetorch cannot create its kernel cache directory {d}: {e}. "
                      "Set SPARSETORCH_CACHE to a writable directory.") from e
    return d


def cache_key(*parts: str) -> str:
    """sha256 over the parts, length-prefixed so no two part lists collide.

    Example:
        >>> cache_key("a", "bc") != cache_key("ab", "c")
        True
    """
    h = hashlib.sha256()
    for p in parts:
        b = p.encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def paths(d: Path, key: str) -> dict[str, Path]:
    return {s[1:]: d / (key + s) for s in SUFFIXES}


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def temp_path(d: Path, suffix: str) -> str:
    """A fresh temp name in the cache dir (same filesystem, so os.replace is atomic)."""
    fd, tmp = tempfile.mkstemp(dir=d, prefix=TMP_PREFIX, suffix=suffix)
    os.close(fd)
    return tmp


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_marker(p: dict[str, Path]) -> dict | None:
    """The entry's marker if the ``.so`` next to it matches it in size and hash, else None.

    Kernel libraries are tens of KB, so hashing one costs microseconds and catches
    same-size corruption too, not just truncation.
    """
    try:
        meta = json.loads(p["json"].read_bytes())
        if p["so"].stat().st_size != meta["size"] or file_sha256(p["so"]) != meta["sha256"]:
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(p: dict[str, Path], meta: dict) -> dict:
    meta = dict(meta, size=p["so"].stat().st_size, sha256=file_sha256(p["so"]))
    write_atomic(p["json"], json.dumps(meta, indent=1).encode())
    return meta


@contextlib.contextmanager
def locked(p: dict[str, Path]):
    """Hold the entry's build lock (released by the OS if the holder dies)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # read-only or odd filesystem: build without the lock
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. some network filesystems; duplicate builds are still safe
        yield
    finally:
        os.close(fd)


def clear(d: Path | None = None) -> int:
    """Delete the cache's kernel files (only those, in case the directory is shared);
    return how many were removed.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "abc.so").write_bytes(b"")
        >>> clear(d)
        1
    """
    d = cache_dir() if d is None else d
    n = 0
    if not d.is_dir():
        return 0
    for f in d.iterdir():
        if f.is_file() and (f.suffix in SUFFIXES or f.name.startswith(TMP_PREFIX)):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                n += 1
    return n
