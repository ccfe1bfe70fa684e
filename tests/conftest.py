"""Test-run policy shared by every module: tests marked ``slow`` (long fuzzing, model
training, multi-process runs) are skipped unless ``SPARSETORCH_LONG_TESTS=1``, so the
default run stays within a new user's five minutes on two cores."""
import os

import pytest

LONG = os.environ.get("SPARSETORCH_LONG_TESTS", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    skip = pytest.mark.skip(reason="slow: run with SPARSETORCH_LONG_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
