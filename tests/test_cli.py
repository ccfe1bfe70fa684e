"""The ``sparsetorch`` command line: demo output with real and missing data, help, module run."""
import subprocess
import sys
import time

import pytest

from sparsetorch.bench import find_data
from sparsetorch.cli import main

FORMATS = ["csr", "csc", "coo", "dcsr", "dcsc", "bsr 4x4"]


def _format_lines(out):
    return {line.split()[0] + (" " + line.split()[1] if line.startswith("bsr") else "")
            for line in out.splitlines() if line.split() and line.split()[0] in
            {"csr", "csc", "coo", "dcsr", "dcsc", "bsr"}}


@pytest.mark.slow   # ~3 s: the demo again, on a stand-in (the full suite runs it)
def test_demo_falls_back_to_generated_graph(tmp_path, capsys):
    (tmp_path / "mnist").mkdir()    # a data folder without planetoid/
    assert main(["demo", "--data", str(tmp_path), "--rounds", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "GENERATED" in out and "not from the real dataset" in out
    assert _format_lines(out) == set(FORMATS)
    for op in ("csr->csc", "csr->coo", "coo->csr", "dense->csr", "csr->dense"):
        assert op in out
    assert "int32" in out and "scipy" in out and "torch" in out


@pytest.mark.slow
@pytest.mark.skipif(find_data() is None or not (find_data() / "planetoid").is_dir(),
                    reason="shared data folder not present")
def test_demo_on_cora(capsys):
    assert main(["demo", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "2708 nodes, 10556 edge entries" in out
    assert "GENERATED" not in out
    assert _format_lines(out) == set(FORMATS)


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_version_and_bad_usage(capsys):
    assert main(["--version"]) == 0
    assert "sparsetorch" in capsys.readouterr().out
    assert main(["demo", "--graph", "nope"]) == 2


@pytest.mark.slow
def test_python_dash_m_demo_is_fast():
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sparsetorch", "demo", "--rounds", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "csr->csc" in proc.stdout and "Traceback" not in proc.stderr
    assert time.perf_counter() - t < 30
