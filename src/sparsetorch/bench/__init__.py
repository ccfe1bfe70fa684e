"""Benchmark harness shared by every sparsetorch benchmark.

In: named zero-argument callables (one per implementation) and a baseline name.
Out: interleaved medians and per-round ratios, as table rows and atomically written JSON.

Example:
    >>> from sparsetorch.bench import compare, geomean
    >>> res = compare({"a": lambda: None, "b": lambda: None}, baseline="a", rounds=3)
    >>> res["impls"]["a"]["speedup"]
    1.0
"""
from .harness import (Report, compare, find_data, format_table, format_time, geomean,
                      load_or_generate, machine_info, pinned_threads, speedup,
                      write_json_atomic)

__all__ = ["compare", "speedup", "geomean", "Report", "pinned_threads", "machine_info",
           "write_json_atomic", "format_table", "format_time", "find_data", "load_or_generate"]
