"""The benchmark harness: medians, per-round ratios, interleaving, thread pinning, atomic JSON.

Timing logic is tested with a fake clock that each callable advances by a scripted cost, so
the numbers are exact and the tests do not depend on how loaded the machine is.
"""
import gc
import importlib.util
import json
import os
import stat
import statistics
from pathlib import Path

import pytest
import torch

from sparsetorch.bench import (Report, compare, find_data, format_table, format_time, geomean,
                               load_or_generate, machine_info, pinned_threads, speedup,
                               write_json_atomic)


class FakeClock:
    """``timer`` for ``compare``; ``case(name, costs)`` makes a callable that advances the
    clock by the next cost in ``costs`` (the last one repeats) and logs its name."""

    def __init__(self):
        self.t = 0.0
        self.log = []

    def __call__(self):
        return self.t

    def case(self, name, costs):
        costs = list(costs)

        def fn():
            self.log.append(name)
            self.t += costs.pop(0) if len(costs) > 1 else costs[0]
        return fn


def test_medians_and_per_round_ratios():
    clock = FakeClock()
    # Ratio of medians would be 1/11; the median of per-round ratios (a/b) is 0.5.
    cases = {"a": clock.case("a", [1, 1, 10]), "b": clock.case("b", [2, 12, 11])}
    res = compare(cases, baseline="a", rounds=3, warmup=0, prime=False, timer=clock)
    a, b = res["impls"]["a"], res["impls"]["b"]
    assert a["times_s"] == [1, 1, 10] and b["times_s"] == [2, 12, 11]
    assert a["median_s"] == 1 and b["median_s"] == 11
    assert a["speedup"] == 1.0
    assert b["speedup"] == pytest.approx(statistics.median([1 / 2, 1 / 12, 10 / 11]))
    assert speedup(res, "a", over="b") == pytest.approx(2.0)
    assert res["baseline"] == "a" and res["rounds"] == 3


def test_rounds_interleave_in_rotating_order():
    clock = FakeClock()
    cases = {n: clock.case(n, [1]) for n in "abc"}
    compare(cases, rounds=4, warmup=1, timer=clock)
    warm, timed = clock.log[:3], clock.log[3:]
    assert warm == list("abc")
    # each timed call follows one untimed call of the same case (``prime``)
    assert timed[::2] == timed[1::2]
    timed = timed[::2]
    assert [timed[i:i + 3] for i in range(0, 12, 3)] == [list("abc"), list("bca"),
                                                         list("cab"), list("abc")]


def test_each_sample_is_primed_by_an_untimed_call_of_its_case():
    """A case whose first call after another case is slow (sleeping worker threads) is
    timed at its own steady pace; ``prime=False`` shows the cost it would otherwise pay."""
    clock = FakeClock()
    last = []

    def sensitive():
        clock.t += 1.0 if last and last[-1] != "s" else 0.001
        last.append("s")

    def single_threaded():
        clock.t += 0.01
        last.append("o")

    cases = {"s": sensitive, "other": single_threaded}
    primed = compare(cases, rounds=5, warmup=1, timer=clock)
    assert primed["impls"]["s"]["median_s"] == pytest.approx(0.001)
    cold = compare(cases, rounds=5, warmup=1, prime=False, timer=clock)
    assert cold["impls"]["s"]["median_s"] == pytest.approx(1.0)


def test_min_time_calibrates_number_of_calls_per_sample():
    clock = FakeClock()
    res = compare({"fast": clock.case("fast", [0.001]), "slow": clock.case("slow", [1.0])},
                  rounds=2, warmup=1, min_time=0.01, timer=clock)
    number = res["impls"]["fast"]["number"]
    assert number in (10, 11)   # 0.01 / 0.001, give or take the fake clock's float rounding
    assert res["impls"]["slow"]["number"] == 1
    assert res["impls"]["fast"]["median_s"] == pytest.approx(0.001)
    # warm-up, one calibration call, then per round one priming call and the sample
    assert clock.log.count("fast") == 2 + 2 * (1 + number)


def test_a_cold_first_call_does_not_size_the_batches():
    """The warm-up call is slow (cold caches, sleeping threads); the batch is sized from
    the faster calibration call, so samples are batches of warm calls."""
    clock = FakeClock()
    res = compare({"a": clock.case("a", [0.05, 0.001])}, rounds=2, warmup=1, min_time=0.01,
                  timer=clock)
    assert res["impls"]["a"]["number"] in (10, 11)


def test_max_time_stops_early_but_keeps_three_rounds():
    clock = FakeClock()
    cases = {"a": clock.case("a", [1]), "b": clock.case("b", [1])}
    assert compare(cases, rounds=10, warmup=0, max_time=0.5, timer=clock)["rounds"] == 3
    # a round is 4 calls: each case primed, then timed
    assert compare(cases, rounds=10, warmup=0, max_time=13, timer=clock)["rounds"] == 4


def test_failing_case_is_reported_not_raised():
    def boom():
        raise NotImplementedError("no such op")

    res = compare({"base": lambda: None, "bad": boom}, rounds=3)
    assert res["impls"]["bad"]["error"] == "NotImplementedError: no such op"
    assert res["impls"]["bad"]["speedup"] is None and res["impls"]["bad"]["times_s"] == []
    assert len(res["impls"]["base"]["times_s"]) == 3
    # Without a baseline there is no ratio for anyone.
    res = compare({"bad": boom, "ok": lambda: None}, baseline="bad", rounds=2)
    assert res["impls"]["ok"]["speedup"] is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="baseline"):
        compare({"a": lambda: None}, baseline="nope")
    with pytest.raises(ValueError, match="no cases"):
        compare({})


def test_threads_pinned_during_timing_and_restored():
    before = torch.get_num_threads()
    seen = []
    res = compare({"a": lambda: seen.append(torch.get_num_threads())}, rounds=2, threads=1)
    assert set(seen) == {1} and res["threads"] == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with pinned_threads(1):
            raise RuntimeError("body failed")
    assert torch.get_num_threads() == before


def test_gc_state_restored():
    assert gc.isenabled()
    compare({"a": lambda: None}, rounds=2)
    assert gc.isenabled()


def test_report_rows_table_and_json(tmp_path):
    clock = FakeClock()
    res = compare({"scipy": clock.case("s", [0.002]), "ours": clock.case("o", [0.001])},
                  baseline="scipy", rounds=3, warmup=0, timer=clock)
    rep = Report("toy", meta={"k": 1}, quiet=True)
    rows = rep.add("m1", res, op="csr->csc", nnz=5)
    assert [r["impl"] for r in rows] == ["scipy", "ours"]
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["op"] == "csr->csc"
    table = rep.table()
    assert "2.00x" in table and "1.00ms" in table and "csr->csc" in table
    path = rep.write_json(tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())
    assert data["rows"] == json.loads(json.dumps(rep.rows))
    assert data["meta"] == {"k": 1} and data["title"] == "toy"
    for key in ("cpu", "cores", "threads", "OMP_NUM_THREADS", "torch", "numpy", "scipy",
                "date", "git_commit", "loadavg_at_start"):
        assert key in data["machine"]
    assert os.listdir(path.parent) == ["r.json"]  # no temp file left behind


def test_json_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(TypeError):  # not serialisable: fails before touching the file
        write_json_atomic(path, {"x": object()})
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError):
        write_json_atomic(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["r.json"]


def test_atomic_writes_keep_permissions_and_links(tmp_path):
    """(Found by a probe: every file written came out 0600, and a link was replaced by a
    plain file.) The helper every writer uses: JSON here, checkpoints and .mtx files too."""
    from sparsetorch._files import atomic_write

    path = tmp_path / "r.json"
    write_json_atomic(path, {"a": 1})
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask   # as open() makes it
    path.chmod(0o640)
    write_json_atomic(path, {"a": 2})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and json.loads(path.read_text()) == {
        "a": 2}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert write_json_atomic(link, {"a": 3}) == path
    assert link.is_symlink() and json.loads(path.read_text()) == {"a": 3}
    with pytest.raises(FileNotFoundError, match="who: folder .* does not exist"):
        atomic_write(tmp_path / "no" / "x", lambda f: None, who="who")
    assert sorted(os.listdir(tmp_path)) == ["link.json", "r.json"]


def test_a_killed_writers_temp_file_goes_at_the_next_write(tmp_path):
    """A process SIGKILLed mid-save left its temp file (100 MB for a checkpoint) for good
    (a probe's finding): the next write to the path removes a temp file whose writer is
    gone, and keeps a live writer's and another destination's."""
    import subprocess
    import sys

    from sparsetorch._files import _host, atomic_write

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    names = {f".c.pt.{_host()}-{gone}.x1.tmp": False, f".c.pt.{_host()}-{os.getpid()}.x2.tmp":
             True, f".d.pt.{_host()}-{gone}.x3.tmp": True}   # name -> kept
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    atomic_write(tmp_path / "c.pt", lambda f: f.write(b"whole"), who="test")
    assert sorted(os.listdir(tmp_path)) == sorted(["c.pt", *(n for n, k in names.items() if k)])


def test_json_rejects_nan(tmp_path):
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "r.json", {"x": float("nan")})


def test_table_marks_errors_and_aligns():
    rows = [{"case": "a", "impl": "x", "median_s": 1.5, "speedup": 1.0},
            {"case": "bb", "impl": "y", "median_s": None, "speedup": None, "error": "E"}]
    lines = format_table(rows, ["case", "impl", "median_s", "speedup"]).splitlines()
    assert lines[0].split() == ["case", "impl", "median", "speedup"]
    assert "error" in lines[2] and "1.50s" in lines[1]
    assert len(lines[1]) == len(lines[0])  # right-aligned numbers end at the same column


def test_geomean_and_format_time():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([None, 3.0]) == pytest.approx(3.0)
    assert geomean([]) is None
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])
    assert [format_time(t) for t in (2.0, 0.0123, 4.5e-5, 3e-8)] == ["2.00s", "12.30ms",
                                                                       "45us", "30ns"]


def test_load_or_generate_records_stand_in(capsys):
    rep = Report("r", quiet=True)
    rep.notes.clear()  # drop a possible "machine busy" note
    assert load_or_generate("x", lambda: 1, lambda: 2, report=rep) == (1, "real")
    assert rep.notes == []

    def missing():
        raise FileNotFoundError("gone")
    assert load_or_generate("cora", missing, lambda: 2, report=rep) == (2, "generated")
    assert "cora" in rep.notes[0] and "gone" in rep.notes[0]
    load_or_generate("cora", missing, lambda: 2)
    assert "not from the real dataset" in capsys.readouterr().err


def test_a_corrupt_dataset_is_an_error_not_a_stand_in(tmp_path):
    """A truncated file (pickle data was truncated) was taken for missing data: the bench
    ran on a stand-in and exited 0; the row now fails with the loader's error."""
    import shutil

    from sparsetorch.bench import gnn, graph_data
    from sparsetorch.datasets import data_root
    from sparsetorch.bench import workloads as wl
    from sparsetorch.bench.runner import run_case

    real = tmp_path / "real"
    try:
        source = data_root() / "planetoid"
    except FileNotFoundError:
        pytest.skip("shipped data not found")
    shutil.copytree(source, real / "planetoid")
    part = real / "planetoid" / "ind.cora.graph"
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(ValueError, match="ind.cora.graph"):
        load_or_generate("cora", lambda: graph_data.load("cora", real), lambda: 2)
    work = wl.Workload("gcn-cora", "gcn", lambda ctx, mode: gnn.prepare("gcn", "cora", ctx, mode))
    row = run_case(work, "infer", wl.Context(data_root=real), rounds=1)
    assert row["check"] == "FAIL: could not prepare" and "ind.cora.graph" in row["error"]


def test_find_data(tmp_path, monkeypatch):
    (tmp_path / "mnist").mkdir()
    assert find_data(tmp_path) == tmp_path
    assert find_data(tmp_path / "missing") is None
    monkeypatch.setenv("SPARSETORCH_DATA", str(tmp_path))
    assert find_data() == tmp_path


def test_machine_info_names_threads():
    with pinned_threads(1):
        assert machine_info()["threads"] == 1


def _load_script(name):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_conversions_script():
    return _load_script("conversions")


@pytest.mark.slow   # ~4 s: a benchmark script's smoke run (the full suite runs it)
def test_conversions_benchmark_smoke(tmp_path, capsys):
    """The benchmark script runs end to end on stand-in data and writes valid JSON."""
    bench = _load_conversions_script()
    out = tmp_path / "conv.json"
    empty = tmp_path / "data"
    (empty / "mnist").mkdir(parents=True)   # (a data folder without suitesparse/)
    assert bench.main(["--quick", "--data", str(empty), "--only", "rajat01|generated",
                       "--big-nnz", "20000", "--rounds", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    ops = {r["op"] for r in data["rows"]}
    assert ops == {"csr->csc", "csr->coo", "coo->csr", "dense->csr", "csr->dense", "from_scipy"}
    assert {r["collection"] for r in data["rows"]} == {"suitesparse", "generated"}
    assert {r["impl"] for r in data["rows"]} == {"sparsetorch", "scipy", "torch"}
    assert any("stand-in" in n for n in data["notes"])
    assert not [r for r in data["rows"] if r.get("check")], "a library disagreed with scipy"
    assert "x_scipy" in capsys.readouterr().out


@pytest.mark.slow   # ~3 s: a benchmark script's smoke run (the full suite runs it)
def test_variants_benchmark_compares_settings_of_a_tuning_function(tmp_path, capsys):
    """``benchmarks/variants.py`` holds one kernel per setting side by side: both settings'
    rows are written, the tuning function (and a constant moved with it) is restored
    afterwards, and a bad knob, a single setting or knobs with unequal settings are refused.
    Needs the shared DLMC masks (skipped without them)."""
    from sparsetorch.compiler import kernel, sblock

    bench = _load_script("variants")
    for bad in (["--knob", "no_such_fn=1,2"], ["--knob", "sum_copies=4"],
                ["--knob", "sum_copies=four,8"], ["--knob", "sblock.no_such=1,2"],
                ["--knob", "nomodule.X=1,2"], ["--knob", "sblock.NEAR_ENTRIES=none,8"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*bad, "--kernel", "sddmm"])
    assert bench.parse_args(["--knob", "sblock.NEAR_ENTRIES=8,12", "--kernel",
                             "sddmm"]).settings == [(8,), (12,)]
    # knobs moved together: setting i takes each knob's i-th value, as many each
    assert bench.parse_args(["--knob", "sblock.NEAR_ENTRIES=8,12", "--knob", "sum_copies=4,8",
                             "--kernel", "sddmm"]).settings == [(8, 4), (12, 8)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--knob", "sblock.NEAR_ENTRIES=8,12", "--knob", "sum_copies=4,8,16",
                          "--kernel", "sddmm"])
    for bad in (["--kernel", "spmm", "--width", "0,16"], ["--kernel", "spmm", "--width", "x"],
                ["--kernel", "spmv", "--width", "16"], ["--kernel", "sddmm", "--graphs"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--knob", "sum_copies=4,8", *bad])
    root = find_data()
    if root is None or not (root / "dlmc").is_dir() or not (root / "planetoid").is_dir():
        pytest.skip("no shared DLMC and Planetoid data")
    # the graphs' propagations, one row per graph and width, the constant restored
    from sparsetorch.codegen import vector
    versions = vector.NARROW_VERSIONS
    out = tmp_path / "g.json"
    assert bench.main(["--knob", "vector.NARROW_VERSIONS=0,2", "--kernel", "spmm", "--graphs",
                       "--quick", "--width", "3,16", "--rounds", "1", "--min-time", "0",
                       "--out", str(out)]) == 0
    assert vector.NARROW_VERSIONS == versions
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["width"]) for r in rows} == {
        (f"{g} x{w}", w) for g in ("cora", "citeseer", "pubmed") for w in (3, 16)}
    before = kernel.sum_copies
    out = tmp_path / "v.json"
    near = sblock.NEAR_ENTRIES
    assert bench.main(["--knob", "sum_copies=4,8", "--knob", "sblock.NEAR_ENTRIES=8,16",
                       "--kernel", "sddmm", "--inner", "16", "--quick", "--rounds", "2",
                       "--min-time", "0", "--out", str(out)]) == 0
    assert kernel.sum_copies is before and sblock.NEAR_ENTRIES == near
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"sum_copies=4 sblock.NEAR_ENTRIES=8",
                                         "sum_copies=8 sblock.NEAR_ENTRIES=16"}
    assert all(r["speedup"] > 0 for r in rows)
    assert "geomean" in capsys.readouterr().out
    # a constant the code generator cannot take (no 4-lane shape): a clear stop, and the
    # constant restored
    if kernel.vector_isa() == "avx512":
        assert bench.main(["--knob", "vector.HALF_SUM=8,4", "--kernel", "spmv", "--quick",
                           "--rounds", "1", "--min-time", "0", "--out", str(out)]) == 2
        assert vector.HALF_SUM == 8 and "vector.HALF_SUM=4: the call failed" in \
            capsys.readouterr().err


@pytest.mark.slow   # ~3 s: the overhead metric's rounds (the full suite runs it)
def test_overhead_times_each_einsum_call_inside_the_forward():
    """Beside the recorded calls replayed alone, the overhead metric times each st.einsum
    call where it runs, inside the forwards it times: the layers' code is the rest."""
    from sparsetorch.bench.overhead import _medians, gcn_overhead, record
    from sparsetorch.bench.workloads import Context

    res = gcn_overhead(Context(data_root=None), rounds=1, threads=1)
    assert len(res["calls"]) == len(res["inside_calls"]) == 4   # two layers, two products
    assert all(t > 0 for t in res["inside_calls"])
    assert res["inside_s"] == sum(res["inside_calls"]) < res["forward_s"]
    assert "inside the forward the same calls took" in res["detail"]
    assert _medians([[1.0, 4.0], [3.0, 2.0], [2.0, 9.0]], 2) == [2.0, 4.0]
    assert _medians([[1.0, 4.0], [3.0]], 2) is None   # (forwards that made other calls)
    # a recorded call repeats itself with the arguments it was given
    a = torch.ones(3)
    calls = record(lambda: torch.mul(torch.relu(a), 2))
    assert [c.name for c in calls] == ["relu", "mul"]
    assert torch.equal(calls[1](), torch.full((3,), 2.0))
