"""bench/torch_backend.py --quick at 2 ranks: every part runs on the "aluminum" default group
and the gloo group, every result it checks is right (exit status 0), and the JSON holds every
figure the docs quote."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from test_mpi_suite import launcher  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "torch_backend.py")


def test_quick_run_every_part(tmp_path):
    out = tmp_path / "run.json"
    cmd = launcher() + ["-n", "2", sys.executable, SCRIPT, "--quick", "--no-deepspeed",
                        "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())
    assert run["ranks"] == 2 and run["backend"] == "aluminum"
    assert run["date"].endswith("UTC") and "torch_backend.py --quick" in run["command"]
    rows = run["collectives"]
    assert {(r["collective"], r["bytes"]) for r in rows} == {
        (c, n) for c in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                         "all_to_all_single", "broadcast") for n in (4, 1024, 65536)}
    for r in rows:
        assert r["wrong"] == [] and r["aluminum"] > 0 and r["gloo"] > 0 and r["comm"] > 0
        assert r["ratio"] == pytest.approx(r["gloo"] / r["aluminum"])
    (ddp,) = run["ddp"]
    assert ddp["model"] == "mlp" and set(ddp["median_step_ms"]) == {"aluminum", "gloo",
                                                                     "gloo+hook", "aluminum+hook",
                                                                     "local"}
    # DDP at 2 ranks: the same sum of two gradients whatever the order, so bitwise equal
    assert ddp["max_param_diff_vs_gloo"] == {"aluminum": 0.0, "gloo": 0.0, "gloo+hook": 0.0,
                                              "aluminum+hook": 0.0}
    fsdp = run["fsdp"]
    assert set(fsdp["median_step_ms"]) == {"aluminum", "gloo", "local"}
    assert set(fsdp["max_param_diff_vs_reference"]) == {"aluminum", "gloo"}
    for name, diff in fsdp["max_param_diff_vs_reference"].items():
        assert diff < 1e-5, (name, diff)
    assert {(r["hidden"], r["batch"]) for r in run["tp"]} == {(256, 1), (256, 8), (1024, 1),
                                                                (1024, 8)}
    for r in run["tp"]:
        assert r["wrong"] == [] and set(r["block_ms"]) == {"aluminum", "direct", "gloo", "none"}
        assert set(r["allreduce_us"]) == {"aluminum", "direct", "gloo"} and min(r["block_ms"].values()) > 0
        ms = r["block_ms"]
        assert r["speedup"]["gloo"] == pytest.approx(ms["gloo"] / ms["aluminum"])
    assert run["skipped"] == {"deepspeed": "--no-deepspeed"}
    assert len(run["goals"]) == 8 and "against the goals" in proc.stdout
