"""The on-disk kernel cache: one ``<key>.c`` / ``<key>.so`` / ``<key>.json`` triple per kernel.

Writes are temp-file + ``os.replace`` in the cache directory, so another process sees
either no library or a whole one, never half of one. The ``.json`` marker (size and
sha256 of the ``.so``) is written last; an entry without a matching marker is treated
as missing and rebuilt, which is how truncated or corrupt libraries are caught before
``dlopen`` can crash on them. A per-key ``flock`` makes concurrent processes wait for
one build instead of all compiling the same kernel; without ``fcntl`` they all build,
which is slower but still correct.

The cache holds code this process loads and runs, so it must be private: the directory is
created 0700 and refused (``UnsafeCacheError``) when another user owns it or group or others
may write to it; files are written 0600 and read without following symlinks, and a file
that is not the user's own is treated as missing. A build killed mid-way leaves a
``.tmp-<host>-<pid>-*`` file, swept on the next cache open once that process is gone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locking, concurrent builds just duplicate work
    fcntl = None

# ".op": recipes of kernels named by traced graphs (ops/custom_ops.py); ".h", ".gch": the
# precompiled intrinsics header (runtime/pch.py).
SUFFIXES = (".so", ".c", ".json", ".lock", ".op", ".h", ".gch")
TMP_PREFIX = ".tmp-"
STALE_SECONDS = 24 * 3600   # a temp file this old is swept whoever made it
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_swept: set[str] = set()    # directories swept by this process


class UnsafeCacheError(PermissionError):
    """The cache directory or a file in it could be written by someone else, so the
    kernels in it cannot be trusted."""


def cache_dir() -> Path:
    """Where kernels are cached: ``$SPARSETORCH_CACHE``, else ``$XDG_CACHE_HOME/sparsetorch``
    (when absolute), else ``~/.cache/sparsetorch``. Read on every call, so tests can
    monkeypatch the variable.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, SPARSETORCH_CACHE="/tmp/st-doc-cache"):
        ...     print(cache_dir())
        /tmp/st-doc-cache
    """
    env = os.environ.get("SPARSETORCH_CACHE")
    if env:
        return Path(os.path.abspath(os.path.expanduser(env)))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):   # (the XDG spec: a relative path is invalid, ignore it)
        base = os.path.join(_home(), ".cache")
    return Path(os.path.abspath(base)) / "sparsetorch"


def _home() -> str:
    """The user's home folder: ``$HOME`` unless empty (``expanduser`` then gives "" and the
    cache landed in ``/.cache``), else the password database's."""
    home = os.environ.get("HOME")
    if home:
        return home
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return os.path.expanduser("~")


def ensure_dir() -> Path:
    """Create the cache directory (0700) and check it is private, with errors that name it
    and the fix; sweep temp files of dead builds once per process.

    Example:
        >>> import os, stat, tempfile
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, SPARSETORCH_CACHE=tempfile.mkdtemp() + "/k"):
        ...     oct(stat.S_IMODE(ensure_dir().stat().st_mode))
        '0o700'
    """
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(d)
    except OSError as e:
        raise OSError(f"sparsetorch cannot create its kernel cache directory {d}: {e}. "
                      "Set SPARSETORCH_CACHE to a writable directory.") from e
    problem = _not_private(st)
    if problem:
        raise UnsafeCacheError(
            f"sparsetorch will not use the kernel cache directory {d}: {problem}, so someone "
            f"else could plant code that sparsetorch would load and run. If the directory is "
            f"yours, make it private (chmod 700 {d}); otherwise set SPARSETORCH_CACHE to a "
            "directory of your own (it is created 0700).")
    if str(d) not in _swept:
        _swept.add(str(d))
        _sweep(d)
    return d


def _not_private(st: os.stat_result) -> str | None:
    """Why a file or directory with this status could hold someone else's code, or None."""
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return (f"group or others may write to it (mode "
                f"{oct(stat.S_IMODE(st.st_mode))})")
    return None


def read_private(path: Path) -> bytes:
    """The bytes of ``path``, a regular file of the user's own that only they may write;
    not followed if it is a symlink. ``UnsafeCacheError`` otherwise (an ``OSError``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        problem = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else \
            _not_private(st)
        if problem:
            raise UnsafeCacheError(f"sparsetorch will not read {path}: {problem}")
        return f.read()


def _sweep(d: Path) -> None:
    """Delete temp files left by builds that died: those of a process of this host that
    no longer runs, and any older than ``STALE_SECONDS``."""
    now = time.time()
    for f in d.iterdir():
        if not f.name.startswith(TMP_PREFIX):
            continue
        host, _, rest = f.name[len(TMP_PREFIX):].partition("-")
        pid = rest.partition("-")[0]
        try:
            dead = host == _HOST and pid.isdigit() and not _alive(int(pid))
            if dead or now - f.lstat().st_mtime > STALE_SECONDS:
                f.unlink()
        except OSError:
            pass   # gone already, or not ours to delete


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(), suffix=path.suffix)
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
    fd, tmp = tempfile.mkstemp(dir=d, prefix=_tmp_prefix(), suffix=suffix)
    os.close(fd)
    return tmp


def install(tmp: str, path: Path) -> None:
    """Move a compiler's output into place, private (the linker makes it 0755)."""
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _tmp_prefix() -> str:
    return f"{TMP_PREFIX}{_HOST}-{os.getpid()}-"


def read_marker(p: dict[str, Path], artifact: str = "so") -> dict | None:
    """The entry's marker if the file ``p[artifact]`` (the ``.so``, or the precompiled
    header) matches it in size and hash and both are private, else None.

    Kernel libraries are tens of KB, so hashing one costs microseconds and catches
    same-size corruption too, not just truncation.
    """
    try:
        meta = json.loads(read_private(p["json"]))
        data = read_private(p[artifact])
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(p: dict[str, Path], meta: dict, artifact: str = "so") -> dict:
    data = read_private(p[artifact])
    meta = dict(meta, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_atomic(p["json"], json.dumps(meta, indent=1).encode())
    return meta


_held: set[int] = set()   # the lock files this process has open, each holding its flock


def _release_inherited_locks() -> None:
    """A forked child shares the lock files of the parent's builds in flight, and with them
    their flocks (a flock belongs to the open file, not the process): left open, they would
    make the child wait forever for a lock it holds itself, and keep the entry locked after
    the parent's build ends. The child closes its copies; the parent's stay locked."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_release_inherited_locks)


@contextlib.contextmanager
def locked(p: dict[str, Path]):
    """Hold the entry's build lock (released by the OS if the holder dies)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        yield  # read-only or odd filesystem: build without the lock
        return
    _held.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. some network filesystems; duplicate builds are still safe
        yield
    finally:
        _held.discard(fd)
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
