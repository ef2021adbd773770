"""`bench cluster`: the plan (names, commands, wrapper, environment, teardown), the expected
bytes per NIC from the schedules, and (root only) one 2-rank allreduce across 2 emulated nodes."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from aluminum_py import schedules
from aluminum_py.__main__ import main as cli
from aluminum_py.bench import cluster
from aluminum_py.bench.cluster import Emulation, expected_nic_bytes, sent_bytes


def test_plan_names_are_unique_per_run_and_fit_interface_limits():
    a, b = Emulation(4, 2), Emulation(4, 2)
    assert a.run_id != b.run_id and a.hub != b.hub and a.rundir != b.rundir
    e = Emulation(8, 4, run_id="abcdef")
    for i in range(4):
        assert len(e.nic(i)) <= 15 and len(e.port(i)) <= 15 and e.run_id in e.ns(i)
    assert len(e.bridge) <= 15
    assert e.layout() == (0, 0, 1, 1, 2, 2, 3, 3)
    assert len({e.address(i) for i in range(4)}) == 4


@pytest.mark.parametrize("ranks,nodes", [(0, 1), (2, 3), (3, 2), (2, 0)])
def test_plan_refuses_bad_shapes(ranks, nodes):
    with pytest.raises(ValueError):
        Emulation(ranks, nodes)


def test_teardown_undoes_setup():
    e = Emulation(6, 3, rate="1gbit", run_id="1a2b3c")
    setup, teardown = e.setup_commands(), e.teardown_commands()
    made = {c[3] for c in setup if c[:3] == ["ip", "netns", "add"]}
    assert made == {e.hub} | {e.ns(i) for i in range(3)}
    assert made == {c[3] for c in teardown if c[:3] == ["ip", "netns", "del"]}
    uts = {c[1].split("=", 1)[1] for c in setup if c[0] == "unshare"}
    assert uts == {c[1] for c in teardown if c[0] == "umount"}
    assert teardown[-1] == ["rm", "-rf", e.rundir] and setup[0] == ["mkdir", "-p", e.rundir]
    shaped = [c for c in setup if "tbf" in c]
    assert len(shaped) == 6 and all("1gbit" in c for c in shaped)      # both ways per NIC
    devs = {c[c.index("dev") + 1] for c in shaped}
    assert devs == {e.nic(i) for i in range(3)} | {e.port(i) for i in range(3)}


def test_wrapper_env_and_mpiexec():
    e = Emulation(4, 2, run_id="abc")
    script = e.wrapper_script()
    assert "  0|1) NODE_NS=alabcn0;" in script and "  2|3) NODE_NS=alabcn1;" in script
    assert 'ip netns exec "$NODE_NS" "$@"' in script and "--uts=" in script
    assert e.rank_env()["MPIR_CVAR_NUM_CLIQUES"] == "2" and "MPIR_CVAR_NOLOCAL" not in e.rank_env()
    flat = Emulation(2, 2).rank_env()
    assert flat["MPIR_CVAR_NOLOCAL"] == "1" and "MPIR_CVAR_NUM_CLIQUES" not in flat
    assert flat["UCX_TLS"] == "tcp,self" and flat["UCX_RNDV_THRESH"] == "inf"
    assert e.mpiexec_command(["python", "x.py"], "/bin/mpiexec") == [
        "/bin/mpiexec", "-n", "4", e.wrapper_path, "python", "x.py"]
    ways = {(n, w) for n, w, _ in e.counter_commands()}
    assert ways == {(n, w) for n in range(2) for w in ("sent", "received")}


def test_sent_bytes_parses_tc():
    out = textwrap.dedent("""\
        qdisc tbf 8001: root refcnt 2 rate 2Gbit burst 64Kb lat 100ms
         Sent 19975027 bytes 13602 pkt (dropped 0, overlimits 2512 requeues 0)
         backlog 0b 0p requeues 0""")
    assert sent_bytes(out) == 19975027
    with pytest.raises(ValueError):
        sent_bytes("nothing")


def test_expected_nic_bytes():
    n, isz = 1000, 4
    # 2 ranks on 2 nodes: ring sends 2 half blocks each way, recursive doubling the vector
    assert expected_nic_bytes("ring", (0, 1), n, isz) == [(n * isz, n * isz)] * 2
    assert expected_nic_bytes("recursive_doubling", (0, 1), n, isz) == [(n * isz, n * isz)] * 2
    assert expected_nic_bytes("ring", (0, 0), n, isz) == [(0, 0)]          # one node: no NIC
    # 4 ranks as 2 x 2: ring crosses nodes on 2 of its 4 links, 2 (p-1) steps of n/4
    assert expected_nic_bytes("ring", (0, 0, 1, 1), n, isz) == [(6 * 250 * isz,) * 2] * 2
    # hierarchical: only the leaders cross, with the leaders' algorithm (2 leaders: n each way)
    for count in (100, schedules.HIER_RING_FROM):
        assert expected_nic_bytes("hierarchical", (0, 0, 1, 1), count, isz) == \
            [(count * isz, count * isz)] * 2
    # every byte sent by one node is received by another
    for alg in schedules.ALGORITHMS:
        per = expected_nic_bytes(alg, (0, 1, 1, 2, 0), 77, 8)
        assert sum(s for s, _ in per) == sum(r for _, r in per)


def test_non_root_gets_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli(["bench", "cluster", "--ranks", "2", "--nodes", "2"]) == 2
    assert "must run as root" in capsys.readouterr().err


def test_bad_shape_is_reported(capsys):
    assert cli(["bench", "cluster", "--ranks", "3", "--nodes", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def _can_emulate():
    return cluster.check_root() is None


SCRIPT = """
import sys, numpy as np
import aluminum_py as al
c = al.Communicator()
n, calls = int(sys.argv[1]), int(sys.argv[2])
x = (np.arange(n) % 1000 + 1000 * c.rank).astype(np.float32)
expected = sum((np.arange(n) % 1000 + 1000 * r).astype(np.float32) for r in range(c.size))
ok = True
for _ in range(calls):
    y = x.copy()
    c.Allreduce(y, algorithm="ring")
    ok = ok and np.array_equal(y, expected)
print(f"rank {c.rank}: {'OK' if ok else 'WRONG'}", flush=True)
"""


@pytest.mark.skipif(not _can_emulate(), reason="needs root and a working 'ip netns'")
def test_allreduce_across_two_emulated_nodes(tmp_path, capfd):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    n, calls = 1 << 18, 4
    emu = Emulation(2, 2, rate="2gbit")
    rc, measured = cluster.run(emu, [sys.executable, str(script), str(n), str(calls)],
                               cluster.default_mpiexec(), timeout=60)
    out = capfd.readouterr().out
    assert rc == 0 and out.count("OK") == 2, out
    expected = expected_nic_bytes("ring", emu.layout(), n, 4)
    for node, (s, r) in enumerate(expected):
        assert measured[(node, "sent")] >= calls * s > 0
        assert measured[(node, "received")] >= calls * r > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emu.tag not in listed and not os.path.exists(emu.rundir)      # torn down


@pytest.mark.skipif(not _can_emulate(), reason="needs root and a working 'ip netns'")
def test_torn_down_when_the_command_fails():
    emu = Emulation(2, 2)
    rc, _ = cluster.run(emu, ["false"], cluster.default_mpiexec(), timeout=60)
    assert rc != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emu.tag not in listed and not os.path.exists(emu.rundir)


@pytest.mark.skipif(not _can_emulate(), reason="needs root and a working 'ip netns'")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_torn_down_on_a_signal(sig):
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-m", "aluminum_py", "bench", "cluster", "--ranks",
                             "2", "--nodes", "2", "--", "sleep", "59.7"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = proc.stdout.readline().split("run id")[1].strip()
    tag = f"al{run_id}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:     # until the ranks run (the wrapper exists)
        if os.path.exists(f"/run/aluminum_py-cluster-{run_id}/rank"):
            break
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "torn down" in err, err
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in listed and not os.path.exists(f"/run/aluminum_py-cluster-{run_id}")
    assert "sleep 59.7" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                            text=True).stdout


@pytest.mark.skipif(not _can_emulate(), reason="needs root and a working 'ip netns'")
def test_timeout_stops_and_tears_down(capsys):
    assert cli(["bench", "cluster", "--ranks", "2", "--nodes", "2", "--timeout", "3", "--",
                "sleep", "58.3"]) == 124
    assert "--timeout" in capsys.readouterr().err
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(not line.startswith("al") for line in listed.splitlines())
    assert "sleep 58.3" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                              text=True).stdout
