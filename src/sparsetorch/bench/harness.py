"""Side-by-side timing for every sparsetorch benchmark.

The machines this runs on are shared and noisy (the same kernel has swung 3x between runs),
so nothing here times one implementation and then the next. ``compare`` interleaves them
round by round in one process, in a rotating order, and reports the median time of each and
the median of the *per-round* ratios against a named baseline: a burst of load hits every
implementation in the round it lands in, so it mostly cancels out of the ratio.

``Report`` collects rows, prints an aligned table and writes JSON (with machine info)
atomically. ``load_or_generate`` keeps a benchmark running when real data is missing, and
says so loudly, because numbers from a stand-in must never be mistaken for real ones.

Example:
    >>> from sparsetorch.bench import compare, Report
    >>> res = compare({"sum": lambda: sum(range(100)), "fast": lambda: 4950},
    ...               baseline="sum", rounds=3)
    >>> sorted(res["impls"])
    ['fast', 'sum']
    >>> rep = Report("demo")
    >>> rows = rep.add("toy", res)
    >>> [r["impl"] for r in rows]
    ['sum', 'fast']
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from .._files import atomic_write

_MIN_ROUNDS_BEFORE_BUDGET_STOP = 3  # fewer rounds than this give no usable median
_MAX_NUMBER = 1_000_000  # cap on calls per sample for near-free callables


# -- threads ---------------------------------------------------------------------------------
@contextlib.contextmanager
def pinned_threads(n: int | None):
    """Run the body with ``torch.set_num_threads(n)``; restore the old count afterwards,
    even on error. ``n=None`` leaves the count alone.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with pinned_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    old = torch.get_num_threads()
    if n is not None:
        if int(n) < 1:
            raise ValueError(f"thread count must be >= 1, got {n}")
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


# -- timing ----------------------------------------------------------------------------------
def compare(cases: Mapping[str, Callable[[], Any]], baseline: str | None = None, *,
            rounds: int = 10, warmup: int = 1, min_time: float = 0.0,
            max_time: float | None = None, threads: int | None = None, prime: bool = True,
            timer: Callable[[], float] = time.perf_counter) -> dict:
    """Time ``cases`` (name -> zero-argument callable) side by side.

    Each of ``warmup`` warm-up rounds and ``rounds`` timed rounds calls every case; round ``r``
    starts at case ``r mod len(cases)`` so no case always runs first (cold caches) or last.
    When ``min_time`` > 0, a case that is faster than that is called ``number`` times per
    sample (calibrated once after warm-up) and the sample is divided by ``number``.
    ``max_time`` (seconds) stops timing early once it is spent, but never before 3 rounds.
    With ``prime`` (the default), every timed sample follows one untimed call of the same
    case, so it starts with caches and OpenMP worker threads as that case's own calls leave
    them. Without it, a sample pays for the case before it: rotating a fixed order keeps each
    case behind the same neighbour, and a case behind a single-threaded one (scipy) woke
    sleeping worker threads at every sample: on this machine's VM a 2-thread SpMV of 300k
    entries took 290 us after scipy and 89 us back to back (torch's the same).
    A case that raises is reported with ``error`` set and left out of later rounds.

    Returns ``{"baseline", "threads", "rounds", "warmup", "min_time", "impls": {name: {...}}}``
    where each impl has ``median_s``, ``min_s``, ``q1_s``, ``q3_s``, ``number``, ``times_s``
    (one per round) and ``speedup``: the median over rounds of
    ``baseline time / this time``, so ``> 1`` means faster than the baseline.

    Example:
        >>> res = compare({"a": lambda: None, "b": lambda: None}, baseline="a", rounds=4)
        >>> res["rounds"], len(res["impls"]["b"]["times_s"]), res["impls"]["a"]["speedup"]
        (4, 4, 1.0)
    """
    names = list(cases)
    if not names:
        raise ValueError("compare: no cases given")
    if baseline is None:
        baseline = names[0]
    if baseline not in cases:
        raise ValueError(f"compare: baseline {baseline!r} is not one of the cases {names}")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"compare: need rounds >= 1 and warmup >= 0 (got {rounds}, {warmup})")

    errors: dict[str, str] = {}
    number = {n: 1 for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}

    def sample(name: str, reps: int) -> float | None:
        fn = cases[name]
        try:
            t0 = timer()
            for _ in range(reps):
                fn()
            return (timer() - t0) / reps
        except Exception as exc:  # a missing op in one library must not kill the benchmark
            errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    gc_was_enabled = gc.isenabled()
    with pinned_threads(threads) as used_threads:
        try:
            last: dict[str, float | None] = {}
            for r in range(warmup):
                for name in _rotate(names, r):
                    if name not in errors:
                        last[name] = sample(name, 1)
            if min_time > 0:
                # Calibrate from the faster of the last warm-up call and one more: a single
                # cold call (caches and OpenMP workers left cold by the other cases) can be
                # 10x slow, and a batch sized by it would time single cold calls throughout.
                for name in names:
                    ts = [t for t in (last.get(name), sample(name, 1)) if t is not None]
                    t = min(ts) if ts else None
                    if t is not None and name not in errors:
                        number[name] = min(_MAX_NUMBER, max(1, math.ceil(min_time / max(t, 1e-9))))
            # A collection landing inside one case's sample would be charged to that case.
            gc.collect()
            gc.disable()
            start = timer()
            done = 0
            for r in range(rounds):
                for name in _rotate(names, r):
                    if prime and name not in errors:
                        sample(name, 1)
                    if name not in errors:
                        t = sample(name, number[name])
                        if t is not None:
                            times[name].append(t)
                done += 1
                if (max_time is not None and done >= _MIN_ROUNDS_BEFORE_BUDGET_STOP
                        and timer() - start >= max_time):
                    break
        finally:
            if gc_was_enabled:
                gc.enable()

    impls = {}
    for name in names:
        ts = times[name] if name not in errors else []
        impls[name] = _summarise(ts, number[name], errors.get(name))
    base = times[baseline] if baseline not in errors else []
    for name in names:
        ts = impls[name]["times_s"]
        pairs = [(b, t) for b, t in zip(base, ts) if t > 0]
        # Per-round ratios only make sense when both ran in every round.
        ok = pairs and len(base) == len(ts)
        impls[name]["speedup"] = statistics.median(b / t for b, t in pairs) if ok else None
    return {"baseline": baseline, "threads": used_threads, "rounds": done, "warmup": warmup,
            "min_time": min_time, "impls": impls}


def _rotate(names: list, r: int) -> list:
    k = r % len(names)
    return names[k:] + names[:k]


def _summarise(ts: list[float], number: int, error: str | None) -> dict:
    if not ts:
        return {"median_s": None, "min_s": None, "q1_s": None, "q3_s": None, "number": number,
                "times_s": [], "error": error}
    q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else ts * 3
    return {"median_s": statistics.median(ts), "min_s": min(ts), "q1_s": q1, "q3_s": q3,
            "number": number, "times_s": list(ts), "error": error}


def speedup(result: dict, impl: str, over: str) -> float | None:
    """Median over rounds of ``time(over) / time(impl)`` from a ``compare`` result, for any
    pair (``compare`` itself only reports against its one baseline).

    Example:
        >>> res = {"impls": {"a": {"times_s": [2.0, 4.0, 6.0]}, "b": {"times_s": [1.0, 1.0, 2.0]}}}
        >>> speedup(res, "b", over="a")
        3.0
    """
    a, b = result["impls"][impl]["times_s"], result["impls"][over]["times_s"]
    if not a or len(a) != len(b):
        return None
    return statistics.median(y / x for x, y in zip(a, b) if x > 0)


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive numbers in ``values``; ``None`` entries (cases that
    failed) are skipped, and ``None`` is returned when nothing is left.

    Example:
        >>> geomean([1.0, 4.0, None])
        2.0
    """
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    if any(v <= 0 for v in vals):
        raise ValueError(f"geomean: values must be positive, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


# -- machine info ----------------------------------------------------------------------------
def machine_info(threads: int | None = None) -> dict:
    """What a reader needs to trust (or discount) a number: CPU, cores, thread count, library
    versions, date, git commit and the load average (a loaded machine voids a run).

    Example:
        >>> info = machine_info()
        >>> {"cpu", "torch", "threads", "git_commit"} <= set(info)
        True
    """
    import numpy
    try:
        import scipy
        scipy_version = scipy.__version__
    except ImportError:  # pragma: no cover - scipy is a dependency
        scipy_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        affinity = os.cpu_count()
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover
        load = None
    from .. import __version__
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "cores_usable": affinity,
        "threads": torch.get_num_threads() if threads is None else threads,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "scipy": scipy_version, "sparsetorch": __version__,
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(), "loadavg": load,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """HEAD of the checkout this package was imported from, with ``+dirty`` when the work
    tree has changes (so a number is never pinned to code that was not committed)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


# -- reporting -------------------------------------------------------------------------------
class Report:
    """Rows of benchmark results: ``add`` a ``compare`` result per case, then ``print`` and
    ``write_json``. ``note`` records (and prints) anything a reader must know, such as data
    that was generated because the real file was missing.

    Example:
        >>> rep = Report("toy")
        >>> _ = rep.add("case1", compare({"x": lambda: 1, "y": lambda: 2}, rounds=3), op="noop")
        >>> rep.rows[0]["case"], rep.rows[0]["op"], rep.rows[0]["impl"]
        ('case1', 'noop', 'x')
    """

    def __init__(self, title: str, *, meta: dict | None = None, quiet: bool = False):
        self.title = title
        self.meta = dict(meta or {})
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.quiet = quiet
        self.threads: int | None = None
        self.load_at_start = _busy_check(self)

    def add(self, case: str, result: dict, **fields) -> list[dict]:
        """Append one row per implementation of ``result`` (from ``compare``); ``fields``
        (e.g. ``op="csr->csc", nnz=...``) are copied into each row. Returns the new rows."""
        self.threads = result.get("threads", self.threads)
        new = []
        for impl, r in result["impls"].items():
            row = {"case": case, **fields, "impl": impl, "baseline": result["baseline"],
                   "median_s": r["median_s"], "q1_s": r["q1_s"], "q3_s": r["q3_s"],
                   "min_s": r["min_s"], "speedup": r["speedup"], "rounds": len(r["times_s"]),
                   "number": r["number"], "threads": result.get("threads")}
            if r.get("error"):
                row["error"] = r["error"]
            new.append(row)
        self.rows.extend(new)
        return new

    def note(self, message: str) -> None:
        """Record a caveat for the JSON and print it now (unless ``quiet``)."""
        self.notes.append(message)
        if not self.quiet:
            print(f"note: {message}", file=sys.stderr, flush=True)

    def table(self, columns: list[str] | None = None) -> str:
        """The rows as an aligned text table (times in s/ms/us, speedups as ``1.23x``)."""
        return format_table(self.rows, columns)

    def print(self, columns: list[str] | None = None, file=None) -> None:
        """Print the title, the table and the notes."""
        out = file or sys.stdout
        print(f"== {self.title} ==", file=out)
        print(self.table(columns), file=out)
        for n in self.notes:
            print(f"note: {n}", file=out)
        out.flush()

    def to_dict(self) -> dict:
        machine = machine_info(self.threads)
        machine["loadavg_at_start"] = self.load_at_start
        return {"title": self.title, "machine": machine, "meta": self.meta,
                "notes": self.notes, "rows": self.rows}

    def write_json(self, path: str | os.PathLike) -> Path:
        """Write ``to_dict()`` to ``path`` atomically (temp file + rename, so a reader never
        sees half a file and an old result survives a failed write). Returns the path."""
        return write_json_atomic(path, self.to_dict())


BUSY_LOAD_PER_CORE = 0.5  # 1-min load average per usable core above which a run is suspect


def _busy_check(report: "Report") -> float | None:
    """Note when the machine was already loaded as the report began: docs/design.md says a run
    taken while anything else loads the machine is void."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # pragma: no cover - not on Linux
        return None
    if load > BUSY_LOAD_PER_CORE * cores:
        report.note(f"machine busy at start: 1-min load average {load:.2f} on {cores} cores; "
                    "treat these timings as void and rerun on an idle machine")
    return load


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    """Serialise ``obj`` fully, then write it to ``path`` whole or not at all
    (``sparsetorch._files``: a temp file beside it, fsync, rename; a link's target replaced,
    the file's permissions kept).

    Example:
        >>> import tempfile, json, pathlib
        >>> p = write_json_atomic(pathlib.Path(tempfile.mkdtemp()) / "r.json", {"a": 1})
        >>> json.loads(p.read_text())
        {'a': 1}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=1, default=_json_default, allow_nan=False)
    return atomic_write(path, lambda f: f.write((text + "\n").encode()),
                        who="write_json_atomic")


def _json_default(x):
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"cannot write {type(x).__name__} to benchmark JSON")


_DEFAULT_COLUMNS = ["case", "op", "impl", "median_s", "spread", "speedup", "rounds"]


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as an aligned text table. ``spread`` is the interquartile range as a percentage
    of the median (large values mean a noisy measurement); columns absent from every row
    are dropped.

    Example:
        >>> print(format_table([{"case": "a", "median_s": 0.0012, "speedup": 2.0}]))
        case  median  speedup
        a     1.20ms    2.00x
    """
    columns = columns or _DEFAULT_COLUMNS
    columns = [c for c in columns if c == "spread" and any("q1_s" in r for r in rows)
               or any(c in r for r in rows)]
    header = [_HEADERS.get(c, c) for c in columns]
    body = [[_cell(r, c) for c in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    numeric = [c in _NUMERIC or all(_looks_numeric(row[i]) for row in body)
               for i, c in enumerate(columns)]

    def line(cells):
        out = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return "  ".join(out).rstrip()

    return "\n".join([line(header)] + [line(b) for b in body])


_HEADERS = {"median_s": "median", "speedup": "speedup", "spread": "spread"}
_NUMERIC = {"median_s", "min_s", "q1_s", "q3_s", "speedup", "spread", "rounds", "nnz"}


def quiet_sparse_warnings() -> None:
    """Silence torch's "sparse CSR/BSR is in beta" and "invariant checks are implicitly
    disabled" warnings, which fire on first use and are not actionable in a benchmark."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*[Ss]parse.*beta state", category=UserWarning)
    warnings.filterwarnings("ignore", message=r".*invariant checks are implicitly disabled",
                            category=UserWarning)


def _cell(row: dict, col: str) -> str:
    if col == "spread":
        q1, q3, med = row.get("q1_s"), row.get("q3_s"), row.get("median_s")
        return f"{100 * (q3 - q1) / med:.0f}%" if med else ""
    v = row.get(col)
    if v is None:
        if col == "median_s" and row.get("error"):
            return "error"
        return "-" if col in ("speedup", "median_s") else ""
    if col.endswith("_s"):
        return format_time(v)
    if col == "speedup" or col.startswith("x_"):
        return f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _looks_numeric(s: str) -> bool:
    try:  # "1.20ms", "2.00x", "15%", "95,284" all count as numbers (right-aligned)
        float(s.replace(",", "").rstrip("xs%mun"))
        return True
    except ValueError:
        return s in ("", "-")


def format_time(seconds: float) -> str:
    """A duration with a readable unit.

    Example:
        >>> format_time(0.000123), format_time(2.5)
        ('123us', '2.50s')
    """
    if seconds >= 1:
        return f"{seconds:.2f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.0f}us"
    return f"{seconds * 1e9:.0f}ns"


# -- data ------------------------------------------------------------------------------------
def find_data(path: str | os.PathLike | None = None) -> Path | None:
    """The shared data folder as ``st.datasets.data_root`` resolves it (``path``, else
    ``$SPARSETORCH_DATA``, else a ``shared/data`` folder next to the checkout or the working
    directory), or ``None`` when there is none (a fresh install): benchmarks then fall back
    to generated stand-ins instead of failing.

    Example:
        >>> find_data("/no/such/folder") is None
        True
    """
    from ..datasets import data_root

    try:
        return data_root(path)
    except FileNotFoundError:
        return None


def named_data(path: str | os.PathLike | None = None) -> Path | None:
    """``find_data`` for a command line: a folder that was named (``path``, or
    ``$SPARSETORCH_DATA``) but is not there raises ``FileNotFoundError`` (a typo must not
    silently run on stand-ins); none named and none found is ``None``.

    Example:
        >>> try:
        ...     named_data("/no/such/folder")
        ... except FileNotFoundError as e:
        ...     print(str(e).split(";")[0])
        sparsetorch data: root='/no/such/folder' is not a folder
    """
    from ..datasets import data_root

    if path is not None or os.environ.get("SPARSETORCH_DATA"):
        return data_root(path)
    return find_data(None)


# What "the real data is not there" raises; anything else from a loader (a truncated or
# corrupt file: ValueError, EOFError, ...) is raised, not replaced by a stand-in.
_MISSING = (FileNotFoundError, NotADirectoryError)


def load_or_generate(name: str, load: Callable[[], Any], generate: Callable[[], Any], *,
                     report: Report | None = None, stand_in: str = "generated stand-in"):
    """``(load(), "real")`` if the real data is there, else ``(generate(), "generated")``,
    printing (and recording in ``report``) what was missing. Data that is there but
    unreadable raises the loader's error: a stand-in must not hide it.

    Example:
        >>> def missing():
        ...     raise FileNotFoundError("cora not found")
        >>> obj, source = load_or_generate("cora", missing, lambda: "random graph")
        >>> obj, source
        ('random graph', 'generated')
    """
    try:
        return load(), "real"
    except _MISSING as exc:
        msg = (f"{name}: real data unavailable ({type(exc).__name__}: {exc}); using "
               f"{stand_in} - these numbers are not from the real dataset")
        if report is not None:
            report.note(msg)
        else:
            print(f"note: {msg}", file=sys.stderr, flush=True)
        return generate(), "generated"
