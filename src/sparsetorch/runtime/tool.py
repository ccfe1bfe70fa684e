"""Run the compiler with a time limit, in its own process group, killed whole on timeout;
and a few threads to run builds on at once (``submit``).

A compiler that hangs must not block a build (and the cache entry's lock) for long, and
killing only the direct child would leave the real worker (``cc1``, ``ld``, or whatever a
``CC`` wrapper starts) running. So each run starts a new session, and on timeout or
interrupt the whole group gets ``SIGKILL``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor

TIMEOUT_ENV = "SPARSETORCH_COMPILE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
THREADS_ENV = "SPARSETORCH_BUILD_THREADS"
_pool: tuple[int, ThreadPoolExecutor] | None = None   # (threads, the pool)
_pool_lock = threading.Lock()


def compile_timeout() -> float | None:
    """Seconds one compiler run may take: ``$SPARSETORCH_COMPILE_TIMEOUT``, default 60;
    ``inf`` or anything beyond a year means no limit (None): the clock's own limit is only
    a few centuries, and ``selectors`` overflowed past it.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, SPARSETORCH_COMPILE_TIMEOUT="120"):
        ...     compile_timeout()
        120.0
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; set it "
                         f"to e.g. 120 (inf: no limit), or unset it for the default "
                         f"{DEFAULT_TIMEOUT:g}")
    return None if value > _YEAR else value


_YEAR = 365 * 24 * 3600.0
_CONFIGURED = object()   # run()'s default timeout: compile_timeout()'s


def run(cmd, timeout=_CONFIGURED, text: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing its output; ``subprocess.TimeoutExpired`` after ``timeout``
    seconds (by default :func:`compile_timeout`'s; None: no limit), once its whole process
    group is killed.

    Example:
        >>> run(["sh", "-c", "echo hi"]).stdout
        'hi\\n'
        >>> run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        subprocess.TimeoutExpired: Command ... timed out after 0.2 seconds
    """
    timeout = compile_timeout() if timeout is _CONFIGURED else timeout
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:   # the timeout, or an interrupt: leave nothing running
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
    # not communicate(): a descendant that left the group could hold the pipes open forever
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()


def build_threads() -> int:
    """How many builds may run at once: ``$SPARSETORCH_BUILD_THREADS``, default the CPU
    count (2 to 8). 1 builds everything in the calling thread, one after another.

    Example:
        >>> build_threads() >= 1
        True
    """
    raw = os.environ.get(THREADS_ENV)
    if not raw:
        return max(2, min(8, os.cpu_count() or 2))
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:   # ("²".isdigit() is True)
        raise ValueError(f"{THREADS_ENV}={raw!r} is not a positive whole number; set it to "
                         "e.g. 4, or 1 to build one kernel at a time")
    return int(raw)


def submit(fn, *args) -> Future:
    """Run ``fn(*args)`` on the background build threads (each mostly waits for a compiler
    subprocess, with the GIL released), or right here when :func:`build_threads` is 1.

    Example:
        >>> submit(sum, [1, 2]).result()
        3
    """
    global _pool
    threads = build_threads()
    if threads == 1:
        done = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done
    with _pool_lock:
        if _pool is None or _pool[0] != threads:
            _pool = threads, ThreadPoolExecutor(max_workers=threads,
                                                thread_name_prefix="sparsetorch-build")
        pool = _pool[1]
    return pool.submit(fn, *args)


def _forget_pool_in_child() -> None:
    """A forked child inherits the pool's bookkeeping but none of its threads: work given
    to it would wait forever (an idle thread counted that is not there), and a lock held
    by another thread at the fork would never be released. The child starts afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)

