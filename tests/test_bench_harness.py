"""bench/harness.py, which every benchmark in bench/ shares: sizes, the result check, the rows'
ratios (peer time / ours) and the files with the run's stamp; then bench/peers.py at 2 ranks."""
import csv
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from test_mpi_suite import launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import harness  # noqa: E402


def test_sizes_range_and_list():
    assert harness.sizes("4:64") == [4, 8, 16, 32, 64]
    assert harness.sizes("2:16", itemsize=4) == [4, 8, 16]
    assert harness.sizes("4,1KiB,16MiB") == [4, 1024, 16 << 20]


def test_common_options_refuse_negative_counts(capsys):
    ap = harness.options(__doc__)
    assert harness.parse(ap, ["--iters", "3"]).iters == 3
    with pytest.raises(SystemExit):
        harness.parse(ap, ["--iters", "-1"])
    with pytest.raises(SystemExit):
        harness.parse(harness.options(__doc__, batches=(10, 3)), ["--calls", "0"])
    assert "--calls must be positive" in capsys.readouterr().err


def call(value, fail=False):
    out = np.array(value)

    def f():
        if fail:
            raise ValueError("no such thing")
    f.result = lambda: out
    return f


def test_check_marks_wrong_results_and_drops_calls_that_raise():
    calls = {"right": call([1.0, 2.0]), "wrong": call([1.0, 3.0]),
             "raises": call([1.0, 2.0], fail=True)}
    wrong, dropped = harness.check(MPI.COMM_WORLD, calls, dict.fromkeys(calls, np.array([1.0, 2.0])))
    assert wrong == ["wrong"] and list(calls) == ["right", "wrong"]
    assert dropped == {"raises": "raised on rank 0: ValueError: no such thing"}
    near = {"near": call([1.0, 2.0 + 1e-7])}
    assert harness.check(MPI.COMM_WORLD, near, {"near": np.array([1.0, 2.0])})[0] == ["near"]
    assert harness.check(MPI.COMM_WORLD, near, {"near": np.array([1.0, 2.0])}, exact=False)[0] == []


def test_rows_ratios_and_files(tmp_path, capsys):
    args = SimpleNamespace(json=str(tmp_path / "r.json"), csv=str(tmp_path / "r.csv"))
    report = harness.Report(MPI.COMM_WORLD, args, "a title", keys=["bytes"], ours=["a", "b"],
                            peers=["p"])
    report.row({"bytes": 4}, {"p": 10.0, "a": 5.0, "b": 20.0})
    report.row({"bytes": 8}, {"p": 10.0, "a": 2.5, "b": 10.0}, wrong=["b"])
    assert report.finish() == 1                         # a wrong result: exit status 1
    out = capsys.readouterr().out
    assert "a vs p: geometric mean 2.83x over 2 rows, worst 2.00x at bytes 4" in out
    assert "b vs p: geometric mean 0.71x over 2 rows, worst 0.50x at bytes 4" in out
    assert "# WRONG result from b (marked !)" in out
    run = json.loads((tmp_path / "r.json").read_text())
    assert run["title"] == "a title" and run["date"].endswith("UTC") and run["command"]
    assert [r["a_vs_p"] for r in run["rows"]] == [2.0, 4.0]
    assert run["rows"][1]["wrong"] == ["b"]
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [float(r["b_vs_p"]) for r in rows] == [0.5, 1.0] and "wrong" not in rows[0]


def test_peers_at_two_ranks(tmp_path):
    out = tmp_path / "peers.json"
    cmd = launcher() + ["-n", "2", sys.executable, os.path.join(REPO, "bench", "peers.py"),
                        "--sizes", "4:64", "--iters", "3", "--no-torch",
                        "--algorithms", "auto,ring,no_such", "--json", str(out),
                        "--csv", str(tmp_path / "peers.csv")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())
    assert run["ranks"] == 2 and run["peers"] == ["mpi4py"] and run["ours"] == ["auto", "ring"]
    assert "no_such" in run["skipped"]
    assert [r["bytes"] for r in run["rows"]] == [4, 8, 16, 32, 64]
    for r in run["rows"]:
        assert r["wrong"] == [] and r["auto_vs_mpi4py"] == pytest.approx(r["mpi4py"] / r["auto"])
    assert "auto vs mpi4py: geometric mean" in proc.stdout
    assert len((tmp_path / "peers.csv").read_text().splitlines()) == 6


def test_runs_combined_into_median_and_range(tmp_path, capsys):
    def run(n, auto):
        return {"date": f"2026-01-0{n} 10:00 UTC", "ranks": 2, "load": 0.5, "command": "python x",
                "ours": ["auto"], "peers": ["mpi4py"],
                "rows": [{"bytes": 4, "mpi4py": 10.0, "auto": auto, "auto_vs_mpi4py": 10.0 / auto,
                          "wrong": [], "auto_picks": "shm"}]}
    paths = []
    for n, auto in enumerate((5.0, 2.0, 4.0), 1):
        paths.append(tmp_path / f"r{n}.json")
        paths[-1].write_text(json.dumps(run(n, auto)))
    (row,) = harness.combine([json.loads(p.read_text()) for p in paths])
    assert row["bytes"] == 4 and row["auto"] == 4.0 and row["auto_vs_mpi4py"] == 2.5
    assert row["auto_vs_mpi4py_range"] == (2.0, 5.0) and "wrong" not in row
    assert harness.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "median over 3 runs" in out and "2.50x [2.00, 5.00]" in out
