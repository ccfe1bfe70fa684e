"""`sparsetorch bench`: the command line, workload selection, the --data check, a run end to
end (JSON keys, correctness flag) and a wrong implementation failing loudly."""
import json
import os
import subprocess
import sys

import pytest
import torch

import sparsetorch as st
from sparsetorch.bench import workloads as wl
from sparsetorch.bench.runner import mismatch, run_case
from sparsetorch.bench.steps import inference, training
from sparsetorch.cli import build_parser, main


def _toy_prepare(wrong: bool):
    """A real sparsetorch SpMM (and a training step through it) against dense torch;
    ``wrong`` makes the dense baseline off by 1%."""
    def prepare(ctx, mode):
        gen = torch.Generator().manual_seed(0)
        dense = torch.rand(40, 30, generator=gen) * (torch.rand(40, 30, generator=gen) < 0.2)
        A = st.tensor(dense, format="csr")
        x0 = torch.randn(30, 8, generator=gen)
        scale = 1.01 if wrong else 1.0
        x_ours, x_dense = (torch.nn.Parameter(x0.clone()) for _ in range(2))
        if mode == "infer":
            impls = [inference("sparsetorch", "sparsetorch", lambda: st.einsum("ij,jk->ik", A, x0)),
                     inference("dense", "dense", lambda: dense @ x0 * scale, "dense matmul")]
        else:
            def loss(out):
                return out.square().mean()
            impls = [training("sparsetorch", "sparsetorch", lambda: A @ x_ours, [x_ours], loss,
                              lambda: {"x": x_ours.grad}),
                     training("dense", "dense", lambda: dense @ x_dense * scale, [x_dense], loss,
                              lambda: {"x": x_dense.grad}, "dense matmul")]
        return wl.Prepared(impls, source="generated stand-in (toy)", size="40 x 30")
    return prepare


@pytest.fixture
def toy_workloads():
    added = [wl.register(wl.Workload("toy-right", "toy", _toy_prepare(False))),
             wl.register(wl.Workload("toy-wrong", "toywrong", _toy_prepare(True)))]
    yield added
    for w in added:
        del wl.REGISTRY[w.name]


def test_cli_parses_bench_arguments():
    args = build_parser().parse_args(["bench", "--quick", "--only", "gcn-cora,gat",
                                      "--json", "x.json", "--plot", "x.png", "--threads", "2"])
    assert (args.quick, args.only, args.json, args.plot, args.threads) == \
        (True, "gcn-cora,gat", "x.json", "x.png", 2)


def test_only_selects_names_groups_and_patterns():
    import sparsetorch.bench.all_workloads  # noqa: F401
    reg = wl.REGISTRY.values()
    assert [w.name for w in wl.select(reg, "gcn-cora")] == ["gcn-cora"]
    assert {w.name for w in wl.select(reg, "gcn")} >= {"gcn-cora", "gcn-pubmed", "gcn-coauthor_cs"}
    assert all(w.name.endswith("-cora") for w in wl.select(reg, "*-cora"))
    assert all(w.quick for w in wl.select(reg, quick=True))
    with pytest.raises(ValueError, match="no workload matches 'nope'"):
        wl.select(reg, "nope")


def test_unknown_workload_and_missing_data_are_errors(capsys, tmp_path):
    assert main(["bench", "--only", "nope"]) == 2
    assert "no workload matches" in capsys.readouterr().err
    assert main(["bench", "--only", "gcn-cora", "--data", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err
    assert "nonexistent' is not a folder" in err and "error" in err


@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "--threads must be between 1 and 1024"),
    (["--threads", "100000"], "--threads must be between 1 and 1024"),   # (torch crashed)
    (["--only", ","], "names no workload"),
    (["--only", ""], "names no workload"),      # (an unset "$W": it ran every workload)
    (["--json", "{tmp}/same.png", "--plot", "{tmp}/same"], "name the same file"),
    (["--json", "{tmp}"], "is a folder"),
    (["--json", "{tmp}/file/r.json"], "is not a folder this process can write into"),
    (["--plot", "{tmp}/r.xyz"], "the chart is a PNG"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys, tmp_path):
    """(Found by a probe: each of these failed with a traceback, some only after every
    workload had run.)"""
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "--quick", "--only", "gcn-cora", *argv]) == 2
    out, err = capsys.readouterr()
    assert message in err and "sparsetorch bench: error" in err and "workloads x" not in out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_no_file_can_be_created_in_is_refused_even_for_root(capsys):
    """(``os.access`` tells root that /proc is writable; the chart then failed after the
    run.)"""
    assert main(["bench", "--quick", "--only", "gcn-cora", "--plot", "/proc/r.png"]) == 2
    assert "/proc is not a folder this process can write into" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_destination_that_is_not_a_file_is_refused(capsys, tmp_path):
    """(A probe's finding: the JSON was renamed over a FIFO or, run as root, over a device
    such as /dev/null, putting a file in its place.)"""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["bench", "--quick", "--only", "gcn-cora", "--json", str(fifo)]) == 2
    assert "is a FIFO, not a file" in capsys.readouterr().err
    from sparsetorch._files import atomic_write
    with pytest.raises(ValueError, match="test: .*pipe is a FIFO, not a file"):
        atomic_write(fifo, lambda f: f.write(b"x"), who="test")
    assert fifo.is_fifo()


def test_a_data_folder_named_by_the_environment_must_exist(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPARSETORCH_DATA", str(tmp_path / "nonsense"))
    for command in (["bench", "--quick", "--only", "gcn-cora"], ["demo"]):
        assert main(command) == 2
        assert "SPARSETORCH_DATA=" in capsys.readouterr().err
    monkeypatch.delenv("SPARSETORCH_DATA")
    assert main(["demo", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_repeated_only_adds_up():
    args = build_parser().parse_args(["bench", "--only", "gcn-cora", "--only", "gat-cora"])
    assert args.only == "gcn-cora,gat-cora"   # (argparse kept the last one)


def test_a_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # (find_spec then says None)
    assert main(["bench", "--quick", "--only", "gcn-cora", "--plot", str(tmp_path / "c")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.slow   # ~6 s: two fresh processes (the full suite runs it)
def test_a_toolchain_that_cannot_build_kernels_is_one_error_line(tmp_path):
    """Without a compiler (or with a bad SPARSETORCH_* setting) every row failed, then the
    GCN overhead step raised: a traceback and no table."""
    for env in ({"CC": str(tmp_path / "no-cc")}, {"SPARSETORCH_BACKEND": "bogus"}):
        proc = subprocess.run(
            [sys.executable, "-m", "sparsetorch", "bench", "--quick", "--only", "gcn-cora"],
            env={**os.environ, "SPARSETORCH_CACHE": str(tmp_path / "cache"), **env},
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith("sparsetorch bench: error: sparsetorch cannot run its "
                                      "kernels here"), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "workloads x" not in proc.stdout


def test_a_failed_chart_write_keeps_the_old_chart(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from sparsetorch.bench.report import plot

    chart = tmp_path / "c.png"
    chart.write_bytes(b"old chart")
    row = {"workload": "w", "mode": "infer", "vs": {"dense": {"ratio": 2.0}}}
    assert plot([row], chart) == chart and chart.read_bytes().startswith(b"\x89PNG")
    chart.write_bytes(b"old chart")

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError):
        plot([row], chart)
    assert chart.read_bytes() == b"old chart" and os.listdir(tmp_path) == ["c.png"]


def test_an_interrupted_run_leaves_json_marked_incomplete(toy_workloads, monkeypatch, capsys,
                                                          tmp_path):
    from sparsetorch.bench import suite

    calls = []

    def run_then_interrupt(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return run_case(*args, **kwargs)
    monkeypatch.setattr(suite, "run_case", run_then_interrupt)
    out = tmp_path / "r.json"
    assert main(["bench", "--quick", "--only", "toy-right", "--json", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and len(doc["rows"]) == 1
    assert doc["planned"] == ["toy-right infer", "toy-right train"]
    assert doc["summary"] == ["incomplete: 1 of 2 cases ran"]
    err = capsys.readouterr().err
    assert "sparsetorch bench: interrupted" in err and "Traceback" not in err


def test_toy_workload_end_to_end_writes_json(toy_workloads, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "--quick", "--only", "toy", "--json", str(out), "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "toy-right" in text and "stand-in" in text
    doc = json.loads(out.read_text())
    assert {"machine", "rows", "summary", "quick", "overhead"} <= set(doc)
    assert doc["complete"] is True
    assert doc["machine"]["threads"] == 1
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == {"infer", "train"}
    for r in rows.values():
        assert r["check"] == "ok"
        assert r["ours_s"] > 0 and r["first_s"] > 0
        assert r["vs"]["dense"]["ratio"] > 0 and r["vs"]["dense"]["config"] == "dense matmul"
        assert r["source"].startswith("generated stand-in")


def test_wrong_implementation_fails_loudly_and_is_not_timed(toy_workloads, capsys, tmp_path):
    assert main(["bench", "--quick", "--only", "toywrong", "--json", str(tmp_path / "r.json")]) == 1
    captured = capsys.readouterr()
    assert "ERROR: toy-wrong infer: FAIL: dense: 'out' differs" in captured.err
    assert "ERROR: toy-wrong train: FAIL: dense: 'loss' differs" in captured.err
    row = run_case(wl.REGISTRY["toy-wrong"], "infer", None, rounds=3)
    assert row["check"].startswith("FAIL") and "dense" not in row["impls"]


def test_mismatch_reports_shape_and_key_differences():
    a = {"out": torch.ones(2, 3)}
    assert "shape (3, 2)" in mismatch(a, {"out": torch.ones(3, 2)}, 1e-4, 1e-5)
    assert "do not match" in mismatch(a, {"y": torch.ones(2, 3)}, 1e-4, 1e-5)
    assert mismatch(a, {"out": torch.ones(2, 3) + 1e-7}, 1e-4, 1e-5) is None


def test_gcn_workload_on_a_generated_stand_in(monkeypatch):
    """The real GCN workload (st.models.GCN against torch.sparse CSR/COO and dense) on a
    small generated graph: no data folder, so the row must say stand-in."""
    from sparsetorch.bench import gnn, gnn_convs, graph_data

    monkeypatch.setitem(graph_data.GRAPHS, "tiny", (60, 240, 50, 0.05, 3, 8))
    monkeypatch.setattr(gnn_convs, "pyg_available", lambda: "PyG left out of this test")
    work = wl.Workload("gcn-tiny", "gcn", lambda ctx, mode: gnn.prepare("gcn", "tiny", ctx, mode))
    row = run_case(work, "train", wl.Context(data_root=None), rounds=2)
    assert row["check"] == "ok", row
    assert row["source"].startswith("generated stand-in")
    assert {"torch.sparse", "dense"} <= set(row["vs"]) and row["skipped"]["PyG"]
    # (features 5% nonzero: torch.sparse runs with them sparse and dense, the faster kept)
    assert row["vs"]["torch.sparse"]["impl"] in [f"torch.sparse {layout}, {x} x" for layout
                                                 in ("CSR", "COO") for x in ("sparse", "dense")]
