"""`python -m aluminum_py bench crossover` and `bench map`, end to end under mpiexec."""
import csv
import json
import os
import subprocess
import sys

import pytest

from test_mpi_suite import mpiexec


def test_crossover_tune_json_csv_plot_and_map(tmp_path):
    env = dict(os.environ, AL_TUNING_FILE=str(tmp_path / "tuning.json"))
    runs = []
    for n in (2, 3):
        out = tmp_path / f"run{n}.json"
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "aluminum_py", "bench", "crossover",
               "--max-bytes", "64KiB", "--odd", "--iters", "3", "--tune", "--json", str(out),
               "--csv", str(tmp_path / f"run{n}.csv"), "--plot", str(tmp_path / f"run{n}.png")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "tuning table written" in proc.stdout and "fastest" in proc.stdout
        assert "keeps the model at" in proc.stdout         # where the table keeps the model
        run = json.loads(out.read_text())
        assert run["ranks"] == n and run["sizes"][0] == 4 and run["sizes"][-1] == 65536
        assert 12 in run["sizes"]                                   # --odd
        assert set(run["median"]) == {"mpi", "recursive_doubling", "rabenseifner", "ring", "hierarchical",
                                      "shm"}
        assert len(run["passes"]) == 3 and len(run["model"]) == len(run["sizes"])
        for i in range(len(run["sizes"])):
            assert run["fastest"][i] == min(run["median"], key=lambda a: run["median"][a][i])
            for a in run["median"]:
                assert run["min"][a][i] <= run["median"][a][i] <= run["max"][a][i]
        rows = list(csv.DictReader(open(tmp_path / f"run{n}.csv")))
        assert len(rows) == len(run["median"]) * len(run["sizes"])
        assert (tmp_path / f"run{n}.png").stat().st_size > 1000
        runs.append(str(out))
    table = json.loads((tmp_path / "tuning.json").read_text())
    assert {e["comm_size"] for e in table["entries"].values()} == {2, 3}    # merged
    proc = subprocess.run([sys.executable, "-m", "aluminum_py", "bench", "map", *runs,
                           "--plot", str(tmp_path / "map.png")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks" in proc.stdout and "3 ranks" in proc.stdout
    assert (tmp_path / "map.png").stat().st_size > 1000


def test_bad_algorithm_is_reported():
    proc = subprocess.run([mpiexec(), "-n", "1", sys.executable, "-m", "aluminum_py", "bench",
                           "crossover", "--algorithms", "ring,bogus"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "bogus" in proc.stderr


def test_cuda_buffers_without_a_gpu_are_reported():
    from aluminum_py.gpu import cuda_device_count
    if cuda_device_count():
        pytest.skip("a CUDA device is present: CUDA buffers work here")
    proc = subprocess.run([mpiexec(), "-n", "1", sys.executable, "-m", "aluminum_py", "bench",
                           "crossover", "--buffer", "cuda"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no CUDA device is available" in proc.stderr


def test_usage():
    proc = subprocess.run([sys.executable, "-m", "aluminum_py"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "bench crossover" in proc.stderr


def test_plan_libra_cli(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "aluminum_py", "plan", "libra", "--model",
                           "resnet50", "--nodes", "8", "--groups", "6", "--chunks", "60",
                           "--threads", "128,512,2048", "--scaling", "16..64",
                           "--plot", str(tmp_path / "s.png"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "max_ctas" in proc.stdout and "libra-m" in proc.stdout
    data = json.loads(out.read_text())
    plans = data["plans"]
    assert set(plans) == {"se", "horovod", "mgwfbp", "libra-m", "libra"}
    assert len(plans["libra"]["groups"]) <= 6
    assert all(t in (128, 512, 2048) for t in plans["libra"]["threads"])
    assert plans["libra"]["predicted_time"] <= plans["se"]["predicted_time"]
    assert data["scaling"]["nodes"] == [16, 32, 64]
    assert all(0 < v <= 1 for v in data["scaling"]["libra"])
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_bench_overlap_every_policy(tmp_path):
    """`bench overlap` runs every policy (deft included) on real ranks and reports the model's
    prediction next to each measurement.  The layer times (1e13 FLOP/s: 13 ms forward) leave
    DeFT room to hide a one-element allreduce even when a busy machine makes that take
    milliseconds (at 1e15 the 0.13 ms forward was too short, and deft was skipped)."""
    out = tmp_path / "overlap.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "aluminum_py", "bench", "overlap",
           "--model", "resnet50", "--scale", "0.002", "--throughput", "1e13", "--iters", "2",
           "--deft-threshold", "65536", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())
    rows = {r["policy"]: r for r in run["runs"]}
    assert set(rows) == {"compute only", "none", "fixed 1 MiB", "fixed 4 MiB", "fixed 16 MiB",
                         "fixed 64 MiB", "mgwfbp", "adafusion", "adafusion-ca", "osf", "libra",
                         "deft", "auto"}
    # "none": one bucket per trainable layer. ResNet-50: a stem conv, 3 convs in each of the
    # 3 + 4 + 6 + 3 bottleneck blocks and a projection conv in each of the 4 stages, each conv
    # with its batch norm, then fc. "fixed 64 MiB": its 25.6 M float32 gradients at --scale
    # 0.002 are 0.2 MB, one bucket.
    blocks = (3, 4, 6, 3)
    convs = 1 + 3 * sum(blocks) + len(blocks)
    assert rows["fixed 64 MiB"]["buckets"] == 1
    assert rows["none"]["buckets"] == 2 * convs + 1
    assert rows["deft"]["model"] == "DeFT sim" and rows["osf"]["model"] == "OSF"
    for r in rows.values():
        assert r["measured"] > 0 and r["predicted"] > 0
        assert abs(r["error"] - (r["predicted"] - r["measured"]) / r["measured"]) < 1e-9
    # OSF's optimum is predicted no slower than any other grouping under the same cost
    osf_rows = [r for r in rows.values() if r["model"] == "OSF"]
    assert rows["osf"]["predicted"] <= min(r["predicted"] for r in osf_rows) * (1 + 1e-9)
    assert "OSF prediction error over 11 policies" in proc.stdout
    assert "# auto: chose " in proc.stdout
    assert rows["auto"]["chosen"] in rows["auto"]["tuning_report"]
