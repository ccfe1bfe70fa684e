"""Writing a file whole or not at all, the one way every writer here does it (Matrix
Market files, training checkpoints, benchmark JSON).

The bytes go to a temp file beside the destination, are flushed to disk, and the temp file
is renamed over the destination (``os.replace``, atomic on POSIX): a crash or an exception
mid-write leaves the old file as it was. An exception removes the temp file; a process
killed outright (SIGKILL, power loss) cannot, and the next write to the same path from
the same machine removes it (the temp file's name holds the writer's host and process
id: one whose process is gone is stale). The new file keeps the
permissions of the one it replaces, or gets the umask's, as ``open`` would give
(``mkstemp`` makes 0600). A symbolic link at the destination is written through: its
target is replaced and the link kept. Anything but a regular file at the destination (a
device such as ``/dev/null``, a FIFO, a socket) is refused: a rename would put a file in
its place (root may write ``/dev``).
"""
from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *,
                 who: str) -> Path:
    """Call ``write(f)`` on a binary temp file beside ``path``, then put it in place;
    returns the path written (a link's target). ``who`` names the caller in errors.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> atomic_write(p, lambda f: f.write(b"hi"), who="example").read_bytes()
        b'hi'
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    check_replaceable(path, who)
    mine = f".{path.name}.{_host()}-"
    _remove_stale(path.parent, mine)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{mine}{os.getpid()}.",
                                   suffix=".tmp")
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: folder {str(path.parent)!r} does not exist; create "
                                f"it first (os.makedirs({str(path.parent)!r}, "
                                "exist_ok=True))") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def check_replaceable(path: str | os.PathLike, who: str) -> None:
    """A ValueError naming ``who`` unless ``path`` (a link's target) is missing or a
    regular file, which ``atomic_write`` may replace.

    Example:
        >>> check_replaceable("/dev/null", who="example")
        Traceback (most recent call last):
        ValueError: example: /dev/null is a character device, not a file; writing would replace it ...
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:   # (missing, or a file where a folder should be: the write says so)
        return
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a character device"
                if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ValueError(f"{who}: {path} is {kind}, not a file; writing would replace it "
                         "with one: give the path of a file")


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40]


def _remove_stale(folder: Path, prefix: str) -> None:
    """Delete this host's temp files of the destination (``prefix``) whose writer process
    is gone (killed mid-write); another live process's stay."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            name = entry.name
            if not (name.startswith(prefix) and name.endswith(".tmp")):
                continue
            pid = name[len(prefix):].split(".", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):   # (another user's: alive; or not a pid)
        return True
    return True


def _mode_for(path: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (setting it
    to read it back is process-wide: another thread's file made in between would get 0)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    umask = os.umask(0)
    os.umask(umask)
    return umask
