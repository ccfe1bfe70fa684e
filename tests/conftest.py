"""Test-run policy shared by every module, so the default run (the README's test command)
stays within a new user's five minutes on two cores while CI still runs everything:

- default: tests marked ``slow`` (long fuzzing, model training, multi-process runs, the
  slowest compile-cache tests) are skipped, and each parametrized test runs on
  ``MATRIX_CASES`` of its parameter sets, spread evenly over the list (formats x dtypes x
  shapes), the others deselected; hypothesis tests draw half their examples
  (``helpers.examples``);
- ``SPARSETORCH_FULL_TESTS=1``: every test and every parameter set;
- ``SPARSETORCH_LONG_TESTS=1``: the full run with hypothesis budgets multiplied as well.
"""
import os
import tempfile
from collections import defaultdict

import pytest

# torch.compile's on-disk graph cache outlives a test run, but each run builds its kernels
# into a private cache (dense_check.private_kernel_cache): a graph cached by an earlier run
# names kernels this run never registered. Each run gets its own inductor cache too.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparsetorch-inductor-")

LONG = os.environ.get("SPARSETORCH_LONG_TESTS", "") not in ("", "0")
FULL = LONG or os.environ.get("SPARSETORCH_FULL_TESTS", "") not in ("", "0")
MATRIX_CASES = 2


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow: run with SPARSETORCH_FULL_TESTS=1")
    groups = defaultdict(list)
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
        elif getattr(item, "callspec", None) is not None:
            groups[item.nodeid.split("[", 1)[0]].append(item)
    dropped = set()
    for cases in groups.values():
        n = len(cases)
        if n > MATRIX_CASES:
            keep = {round(i * (n - 1) / (MATRIX_CASES - 1)) for i in range(MATRIX_CASES)}
            dropped.update(id(c) for j, c in enumerate(cases) if j not in keep)
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]
