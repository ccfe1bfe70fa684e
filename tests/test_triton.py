"""The Triton backend's kernels, run through Triton's interpreter in a fresh process.

The cases live in ``triton_cases.py``: Triton reads ``TRITON_INTERPRET`` when it is
imported, and torch imports Triton (``torch._dynamo``) before any test runs, so the
interpreter can only be switched on for a new process; setting it here would leak into
every other test module. Skips when triton is not installed.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dense_check import TESTS_DIR, private_kernel_cache  # noqa: F401

pytest.importorskip("triton", reason="triton is not installed (pip install 'sparsetorch[gpu]')")


@pytest.mark.slow   # ~15 s (a fresh process importing triton); .ci/run runs it after the default run
def test_triton_kernels_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("SPARSETORCH_BACKEND", None)   # each case sets it itself
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         os.path.join(TESTS_DIR, "triton_cases.py")],
        env=env, capture_output=True, text=True, timeout=900,
        cwd=os.path.dirname(TESTS_DIR))
    summary = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "passed" in summary[0] and "failed" not in summary[0], summary
