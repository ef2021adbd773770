"""bench/peers_summary.py: the issue 31 figures of a peers.py run, from its JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_summary_of_a_run(tmp_path):
    rows = [{"bytes": 4, "auto": 2.0, "shm": 2.0, "rabenseifner": 5.0, "deepspeed_shm": 20.0,
             "auto_min": 1.0, "algorithm": "shm", "wrong": [], "learn_calls": 12, "learn_us": 9.0,
             # what peers.py records beside the contenders' times (not contenders)
             "learned": {"prior": "shm", "choice": "shm", "rounds": 20,
                         "medians_us": {"shm": 2.0}, "wins": {}},
             "page_offsets": {"send": 16, "auto": 16, "shm": 16, "rabenseifner": 16}},
            {"bytes": 1 << 20, "auto": 150.0, "shm": 100.0, "rabenseifner": 120.0,
             "deepspeed_shm": 80.0, "algorithm": "rabenseifner", "wrong": []}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": rows, "bound_us": 50.0}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers_summary.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    assert out.startswith("run.json: auto/fastest worst 1.88x at 1048576 B (deepspeed_shm), "
                          "<=1.10x at 1/2, <=1.25x at 1/2")
    assert "auto/its own algorithm worst 1.25x at 1048576 B (rabenseifner), >1.10x at 1/2" in out
    assert "shm vs DeepSpeed worst 0.80x at 1048576 B" in out
    assert "shm vs rabenseifner (1-64 MiB) worst 1.20x at 1048576 B" in out
    assert "1048576 B shm 100 us, bound 50 us (2.00x)" in out


def test_paired_figures_where_the_run_has_them(tmp_path):
    rows = [{"bytes": 4, "auto": 2.0, "shm": 2.1, "algorithm": "shm", "wrong": [],
             "auto_paired": {"shm": 0.98, "mpi4py": 0.5}},
            {"bytes": 64, "auto": 3.0, "shm": 2.6, "algorithm": "shm", "wrong": [],
             "auto_paired": {"shm": 1.12, "mpi4py": 0.6}},
            {"bytes": 128, "auto": 3.0, "shm": 2.9, "algorithm": "shm", "wrong": []}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": rows, "bound_us": 1.0}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers_summary.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    # the ratio of medians: 3.0 / 2.6 at 64 B; paired: the largest median ratio of each size
    assert "auto/fastest worst 1.15x at 64 B (shm), <=1.10x at 2/3" in out
    assert "paired worst 1.12x at 64 B (shm), <=1.10x at 1/2, <=1.25x at 2/2" in out
