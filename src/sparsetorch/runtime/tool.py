"""Run the compiler with a time limit, in its own process group, killed whole on timeout.

A compiler that hangs must not block a build (and the cache entry's lock) for long, and
killing only the direct child would leave the real worker (``cc1``, ``ld``, or whatever a
``CC`` wrapper starts) running. So each run starts a new session, and on timeout or
interrupt the whole group gets ``SIGKILL``.
"""
from __future__ import annotations

import os
import signal
import subprocess

TIMEOUT_ENV = "SPARSETORCH_COMPILE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


def compile_timeout() -> float:
    """Seconds one compiler run may take: ``$SPARSETORCH_COMPILE_TIMEOUT``, default 60.

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
                         f"to e.g. 120, or unset it for the default {DEFAULT_TIMEOUT:g}")
    return value


def run(cmd, timeout: float | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing its output; ``subprocess.TimeoutExpired`` after ``timeout``
    seconds (default :func:`compile_timeout`), once its whole process group is killed.

    Example:
        >>> run(["sh", "-c", "echo hi"]).stdout
        'hi\\n'
        >>> run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.2)
        Traceback (most recent call last):
        ...
        subprocess.TimeoutExpired: Command '['sh', '-c', 'sleep 30 & sleep 30']' timed out after 0.2 seconds
    """
    timeout = compile_timeout() if timeout is None else timeout
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
