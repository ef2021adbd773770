"""The timeline (aluminum_py.timeline) in one process: file names, the Trace Event Format of what
it writes, one event per op, the bounded buffer, merge's clock arithmetic, the plot, the CLI and
AL_TIMELINE at exit.  The multi-rank checks (event counts at 1-4 ranks, the clock sync, merge
alignment) are in tests/mpi/test_timeline.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import timeline
from aluminum_py.__main__ import main as cli
from aluminum_py.overlap import GradientSynchronizer
from aluminum_py.testing.trace_format import problems
from aluminum_py.timeline.merge import merge
from aluminum_py.timeline.plot import parse_steps

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def comm():
    return al.Communicator()


@pytest.fixture(autouse=True)
def stopped():
    yield
    timeline.stop()            # a failed test must not leave the next one recording


def ops_of(trace):
    return [e for e in trace["traceEvents"] if e.get("cat") == "op"]


def test_rank_path():
    assert timeline.rank_path("run/t.json", 3) == "run/t.rank3.json"
    assert timeline.rank_path("run/t", 0) == "run/t.rank0.json"
    assert timeline.rank_path("run/{rank}/t.json", 2) == "run/2/t.json"


def test_every_op_is_one_complete_event(comm, tmp_path):
    path = timeline.start(tmp_path / "t.json")
    x = np.arange(10, dtype=np.float32)
    y = np.empty_like(x)
    for _ in range(3):
        comm.Allreduce(x, y)
    reqs = [comm.Iallreduce(np.ones(100, np.float64), algorithm=a)
            for a in ("ring", "mpi", "recursive_doubling")]
    al.Waitall(reqs)
    comm.Bcast(x)
    comm.Barrier()
    with timeline.region("backward"):
        comm.Allreduce(x, y, op=al.MAX)
    meta = timeline.stop()
    assert path == str(tmp_path / "t.rank0.json")
    with open(path) as f:
        trace = json.load(f)
    assert problems(trace) == []
    ops = ops_of(trace)
    assert sorted(e["name"] for e in ops) == sorted(
        ["allreduce/" + comm.explain(40).algorithm] * 4 + ["allreduce/ring", "allreduce/mpi",
         "allreduce/recursive_doubling", "bcast", "barrier"])
    assert meta["events"] == 9 + 1 and meta["dropped_events"] == 0
    assert trace["otherData"] == meta
    first = ops[0]["args"]
    assert (first["bytes"], first["count"], first["dtype"], first["op"]) == (40, 10, "float32",
                                                                              "sum")
    nb = [e for e in ops if e["args"]["engine"]]
    assert len(nb) == 3 and all(e["args"]["dtype"] == "float64" for e in nb)
    # nonblocking ops also ran on the engine's track, within their op event
    engine = [e for e in trace["traceEvents"] if e.get("cat") == "engine"]
    assert len(engine) == 3
    (region,) = [e for e in trace["traceEvents"] if e.get("cat") == "region"]
    inside = [e for e in ops if e["args"].get("op") == "max"]
    assert region["name"] == "backward" and len(inside) == 1
    assert region["ts"] <= inside[0]["ts"] and (inside[0]["ts"] + inside[0]["dur"]
                                                <= region["ts"] + region["dur"] + 1e-3)


def test_host_transfer_op_on_its_stream_track(comm, tmp_path):
    """A GPU (host-transfer) op, here on the CPU device: one op event on its stream's track with
    the four host-transfer phases nested, at the times phase_times reports."""
    from aluminum_py import host_transfer as ht
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.arange(1000, dtype=np.float64)
    path = timeline.start(tmp_path / "t.json")
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_ring")
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    timeline.stop()
    assert np.array_equal(x, np.arange(1000))          # one rank: the sum is the input
    with open(path) as f:
        trace = json.load(f)
    assert problems(trace) == []
    (op,) = ops_of(trace)
    assert op["name"] == "allreduce/ht_ring" and op["tid"] >= 1_000_000
    assert (op["args"]["bytes"], op["args"]["dtype"], op["args"]["op"]) == (8000, "float64",
                                                                            "sum")
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    assert names[op["tid"]] == f"stream 0 (0x{stream.handle:x})"
    phases = [e for e in trace["traceEvents"] if e.get("cat") == "phase" and e["tid"] == op["tid"]]
    ends = [e["ts"] + e["dur"] for e in phases if e["name"] != "queued"]
    assert [e["name"] for e in phases if e["name"] != "queued"] == [
        "device-to-host", "host algorithm", "release", "host-to-device"]
    assert ends == pytest.approx([t * 1e6 for t in ht.phase_times(req)], abs=1e-2)
    stream.destroy()


def test_full_buffer_drops_and_counts_without_blocking(comm, tmp_path, capsys):
    # the writer never runs before stop (interval): the ops fill the 5-item buffer
    path = timeline.start(tmp_path / "t.json", buffer=5, interval=3600)
    x = np.ones(4, np.float32)
    for _ in range(20):
        comm.Allreduce(x)
    assert np.all(x == 1.0)                  # one rank: the sum is the input; every op ran
    meta = timeline.stop()
    assert (meta["events"], meta["dropped_events"]) == (5, 15)
    assert "15 events dropped" in capsys.readouterr().err
    with open(path) as f:
        trace = json.load(f)
    assert len(ops_of(trace)) == 5 and trace["otherData"]["dropped_events"] == 15


def test_buckets_of_the_synchronizer(comm, tmp_path):
    grads = [np.full(n, float(k + 1), np.float32) for k, n in enumerate((300, 5, 2000, 7))]
    sync = GradientSynchronizer(comm, grads, policy="fixed", threshold=1200)
    path = timeline.start(tmp_path / "t.json")
    for step in range(3):
        for i in reversed(range(len(grads))):
            sync.grad_ready(i)
        info = sync.wait(timeout=60)
    timeline.stop()
    for k, g in enumerate(grads):            # one rank, average: the gradients are unchanged
        assert np.all(g == k + 1)
    with open(path) as f:
        trace = json.load(f)
    assert problems(trace) == []
    buckets = [e for e in trace["traceEvents"] if e.get("cat") == "bucket"]
    assert len(buckets) == 3 * len(info.buckets)
    assert sorted({e["args"]["step"] for e in buckets}) == [sync.iteration - 3 + s
                                                           for s in range(3)]
    last = [e for e in buckets if e["args"]["step"] == sync.iteration - 1]
    for e, members, (launched, started, completed) in zip(last, info.buckets, info.timings):
        assert e["args"]["gradients"] == members
        assert e["ts"] == pytest.approx(launched * 1e6, abs=1e-2)
        assert e["dur"] == pytest.approx((completed - launched) * 1e6, abs=1e-2)
    assert len(ops_of(trace)) == 3 * len(info.buckets)


def test_start_twice_and_bad_buffer(tmp_path):
    timeline.start(tmp_path / "a.json")
    with pytest.raises(al.Error, match="already recording"):
        timeline.start(tmp_path / "b.json")
    timeline.stop()
    with pytest.raises(ValueError, match="buffer"):
        timeline.start(tmp_path / "c.json", buffer=0)
    assert timeline.stop() is None


def rank_file(path, rank, events, clock):
    trace = {"traceEvents": events,
             "otherData": {"aluminum_py_timeline": 1, "rank": rank, "size": 3, "clock": clock,
                           "events": len(events), "dropped_events": 0, "unfinished_ops": 0}}
    with open(path, "w") as f:
        json.dump(trace, f)
    return str(path)


def x(name, pid, ts, dur, cat="op", **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": 1000, "ts": ts, "dur": dur,
            "args": args}


def test_merge_moves_ranks_onto_rank_0s_clock(tmp_path):
    # rank 1's clock is 5000 us behind rank 0's; rank 2 measured against rank 1 (+250)
    files = [rank_file(tmp_path / "r0.json", 0, [x("a", 0, 10_000.0, 5.0)],
                       {"offset_us": 0.0, "uncertainty_us": 0.0, "reference": 0, "rounds": 16}),
             rank_file(tmp_path / "r1.json", 1, [x("a", 1, 5_002.0, 5.0)],
                       {"offset_us": 5000.0, "uncertainty_us": 1.5, "reference": 0, "rounds": 16}),
             rank_file(tmp_path / "r2.json", 2, [x("a", 2, 4_760.0, 5.0)],
                       {"offset_us": 250.0, "uncertainty_us": 2.0, "reference": 1, "rounds": 16})]
    out = tmp_path / "all.json"
    merged, report = merge(files, str(out))
    assert problems(merged) == []
    ts = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert ts == {0: 0.0, 1: 2.0, 2: 10.0}
    assert merged["otherData"]["origin_us"] == 10_000.0
    assert merged["otherData"]["ranks"]["2"]["offset_us"] == 5250.0
    assert merged["otherData"]["ranks"]["2"]["uncertainty_us"] == 3.5
    assert report[1] == "rank 1: offset +5000.0 us +- 1.5 us, 1 events, 0 dropped"
    with open(out) as f:
        assert json.load(f) == merged


def test_merge_rejects_bad_input(tmp_path):
    a = rank_file(tmp_path / "a.json", 1, [], None)
    with pytest.raises(ValueError, match="appears twice"):
        merge([a, a])
    (tmp_path / "cut.json").write_text('{"traceEvents":[{"ph":"X"')
    with pytest.raises(ValueError, match="not a complete timeline file"):
        merge([str(tmp_path / "cut.json")])
    _, report = merge([a])                    # no sync reached rank 0
    assert "offset unknown" in report[0]


def test_plot_writes_a_png(tmp_path):
    events = []
    for r in range(2):
        for step in range(3):
            t = step * 1000.0 + 30 * r
            events += [x("forward", r, t, 200.0, cat="region"),
                       x("backward", r, t + 200, 500.0, cat="region")]
            for b in range(2):
                events.append(x(f"bucket {b}", r, t + 400 + 150 * b, 300.0, cat="bucket",
                                step=step, bucket=b, gradients=[b], queued_us=50.0,
                                run_us=250.0))
    trace = {"traceEvents": events}
    for steps in (None, "1", "0-2"):
        out = tmp_path / f"p{steps}.png"
        from aluminum_py.timeline.plot import plot
        plot(trace, str(out), steps)
        assert out.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="no bucket of steps 7-7"):
        plot(trace, str(tmp_path / "none.png"), "7")
    assert parse_steps("2-4") == (2, 4)
    with pytest.raises(ValueError, match="--steps"):
        parse_steps("4-2")


def plotted(monkeypatch, trace, steps=None):
    """The figure timeline plot saves for `trace`: (the facecolours drawn in the axes, the
    facecolours in the legend, the legend's labels, the texts on the bars)."""
    import matplotlib.figure
    from matplotlib.patches import Rectangle
    from aluminum_py.timeline.plot import plot
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot(trace, "unused.png", steps)
    ax = saved[0].axes[0]
    rgba = lambda cs: {tuple(np.round(c, 3)) for c in cs}        # noqa: E731
    drawn = rgba(c for coll in ax.collections for c in coll.get_facecolors())
    legend = ax.get_legend()
    named = rgba(p.get_facecolor() for p in legend.findobj(Rectangle))
    return (drawn, named, [t.get_text() for t in legend.get_texts()],
            [t.get_text() for t in ax.texts])


def test_plot_legend_names_every_colour_and_op_bars_are_labelled(monkeypatch):
    """Every colour drawn is in the legend: each bucket's queued and running shades, each op
    kind and algorithm; op bars (no synchronizer in the trace) carry their kind and algorithm."""
    events = []
    for r in range(2):
        for step in range(2):
            t = step * 1000.0
            events += [x("backward", r, t, 600.0, cat="region")]
            events += [x(f"bucket {b}", r, t + 100 + 150 * b, 300.0, cat="bucket", step=step,
                         bucket=b, gradients=[b], queued_us=50.0, run_us=250.0)
                       for b in range(3)]
    drawn, named, labels, _ = plotted(monkeypatch, {"traceEvents": events})
    assert len(drawn) == 1 + 3 * 2 and drawn <= named, (drawn - named)
    assert labels == ["backward", "b0: queued | running", "b1: queued | running",
                      "b2: queued | running"]
    ops = [x(name, r, 1000.0 * i + 10 * r, 800.0, algorithm=name.partition("/")[2] or None)
           for i, name in enumerate(["Allreduce/ring", "Bcast", "Allreduce/shm", "Allreduce/ring"])
           for r in range(2)]
    drawn, named, labels, texts = plotted(monkeypatch, {"traceEvents": ops})
    assert len(drawn) == 3 and drawn <= named, (drawn - named)
    assert labels == ["Allreduce ring", "Allreduce shm", "Bcast"]
    assert sorted(set(texts)) == labels and len(texts) == len(ops)


def test_cli_merge_and_plot(comm, tmp_path, capsys):
    path = timeline.start(tmp_path / "t.json")
    for _ in range(2):
        with timeline.region("compute"):
            comm.Allreduce(np.ones(8, np.float32))
    timeline.stop()
    out, png = str(tmp_path / "all.json"), str(tmp_path / "all.png")
    assert cli(["timeline", "merge", path, "-o", out]) == 0
    assert "rank 0: offset +0.0 us" in capsys.readouterr().out
    assert cli(["timeline", "plot", out, "-o", png]) == 0        # no buckets: the ops
    with open(png, "rb") as f:
        assert f.read(8) == PNG
    assert cli(["timeline", "merge", str(tmp_path / "missing.json"), "-o", out]) == 1
    assert "missing.json" in capsys.readouterr().err


def test_al_timeline_is_written_at_exit(tmp_path):
    """AL_TIMELINE starts at import; interpreter exit (the library's shutdown) completes the
    file, the nonblocking op left pending included."""
    code = ("import numpy as np, aluminum_py as al\n"
            "c = al.Communicator()\n"
            "c.Allreduce(np.ones(3))\n"
            "r = c.Iallreduce(np.ones(3))\n")
    env = dict(os.environ, AL_TIMELINE=str(tmp_path / "run_{rank}.json"))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    with open(tmp_path / "run_0.json") as f:
        trace = json.load(f)
    assert problems(trace) == []
    assert len(ops_of(trace)) == 2 and trace["otherData"]["unfinished_ops"] == 0


def test_the_format_checker_finds_what_is_wrong():
    ok = {"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0.0, "dur": 10.0}
    assert problems({"traceEvents": [ok, dict(ok, name="inner", ts=2.0, dur=3.0)]}) == []
    assert problems({"traceEvents": [{k: v for k, v in ok.items() if k != "tid"}]}) == [
        "event 0 ('a'): missing tid"]
    assert "dur >= 0" in problems([dict(ok, dur=-1)])[0]
    assert "without nesting" in problems([ok, dict(ok, ts=5.0, dur=10.0)])[0]
    assert problems([ok, dict(ok, ts=5.0, dur=10.0, tid=2)]) == []       # other thread
    assert "unknown metadata" in problems([{"ph": "M", "name": "x", "pid": 0, "tid": 0,
                                            "ts": 0, "args": {}}])[0]


def test_a_forked_child_leaves_the_file_alone(tmp_path):
    """A child made by os.fork() neither records nor writes into its parent's file: its copy of
    the file object is dropped at the fork (with nothing buffered, or its finaliser would write
    the parent's buffered header a second time).  The child leaves with os._exit: a forked
    child of an MPI process must not finalize MPI."""
    code = ("import os, sys, numpy as np, aluminum_py as al\n"
            "c = al.Communicator()\n"
            "c.Allreduce(np.ones(2))\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    import gc; gc.collect()\n"
            "    os._exit(0 if not al.timeline.recording() and al.timeline.stop() is None "
            "else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "c.Allreduce(np.ones(2))\n"
            "sys.exit(os.WEXITSTATUS(status))\n")
    env = dict(os.environ, AL_TIMELINE=str(tmp_path / "t.json"))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60,
                   capture_output=True)
    with open(tmp_path / "t.rank0.json") as f:
        trace = json.load(f)
    assert problems(trace) == [] and len(ops_of(trace)) == 2


def test_bad_buffer_variable(monkeypatch):
    from aluminum_py import config
    monkeypatch.setenv("AL_TIMELINE_BUFFER", "0")
    with pytest.raises(ValueError, match="AL_TIMELINE_BUFFER"):
        config.timeline_buffer()


def test_bench_overlap_timeline(tmp_path):
    """`bench overlap --timeline DIR`: per policy, every rank's file, the merged trace with 3
    steps of every bucket on both ranks, and its picture."""
    from test_mpi_suite import mpiexec
    d = tmp_path / "tl"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "aluminum_py", "bench", "overlap",
           "--model", "resnet50", "--scale", "0.002", "--throughput", "1e15", "--iters", "1",
           "--per-op", "0", "--policy", "none,mgwfbp", "--json", str(tmp_path / "o.json"),
           "--timeline", str(d)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["policy"]: r for r in json.loads((tmp_path / "o.json").read_text())["runs"]}
    for label in ("none", "mgwfbp"):
        name = label.replace(" ", "_")
        assert (d / f"{name}.png").read_bytes()[:8] == PNG
        assert {p.name for p in d.glob(f"{name}.rank*.json")} == {f"{name}.rank0.json",
                                                                  f"{name}.rank1.json"}
        merged = json.loads((d / f"{name}.json").read_text())
        assert problems(merged) == []
        for rank in (0, 1):
            buckets = [e for e in merged["traceEvents"]
                       if e.get("cat") == "bucket" and e["pid"] == rank]
            assert len(buckets) == 3 * rows[label]["buckets"]
            regions = [e["name"] for e in merged["traceEvents"]
                       if e.get("cat") == "region" and e["pid"] == rank]
            assert regions == ["forward", "backward", "wait"] * 3


GPU_SCRIPT = """
import json, sys
from aluminum_py.testing import cupy_standin
cupy_standin.install()
import cupy as cp
import aluminum_py as al
path = al.timeline.start(sys.argv[1])
stream = cp.cuda.Stream(non_blocking=True)
comm = al.Communicator(stream=stream)
x = cp.ones(100, dtype=cp.float32)
comm.Allreduce(x, algorithm="nccl")
comm.Iallreduce(x, algorithm="nccl").Wait()
comm.Allreduce(x, algorithm="ht_ring")
comm.Bcast(x)
stream.synchronize()
assert (cp.asnumpy(x) == 1).all()
comm.Free()
al.timeline.stop()
"""


def test_gpu_ops_on_their_streams(tmp_path):
    """On the CUDA and NCCL stand-ins: NCCL operations (their enqueue) and host-transfer
    operations (their phases) on the tracks of the streams they ran on."""
    from aluminum_py.testing import cuda_standin
    lib = cuda_standin.path()
    env = dict(os.environ, AL_CUDA_LIBRARY=lib, AL_NCCL_LIBRARY=lib)
    subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(tmp_path / "t.json")], env=env,
                   check=True, timeout=120, capture_output=True)
    with open(tmp_path / "t.rank0.json") as f:
        trace = json.load(f)
    assert problems(trace) == []
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    ops = [(e["name"], names[e["tid"]].split(" #")[0], e["args"]) for e in ops_of(trace)]
    assert [(n, a.get("enqueued_only", False)) for n, _, a in ops] == [
        ("allreduce/nccl", True), ("allreduce/nccl", True), ("allreduce/ht_ring", False),
        ("bcast", True)]
    streams = [s for _, s, _ in ops]
    # the bound stream, the internal stream of the nonblocking op, the bound stream again
    assert streams[0] == streams[2] == streams[3] != streams[1]
    assert all(s.startswith("stream ") for s in streams)
    for _, _, a in ops[:3]:
        assert (a["bytes"], a["dtype"], a["op"]) == (400, "float32", "sum")


def test_start_and_stop_while_another_thread_calls(comm, tmp_path):
    """Starting and stopping from one thread while another calls blocking and nonblocking
    operations: every operation completes with the right result, and every file is valid."""
    import threading
    errors, done = [], threading.Event()

    def calls():
        try:
            comm.bind_thread()                    # the hand-over (threading rule)
            x = np.ones(16, np.float32)
            for k in range(400):
                comm.Allreduce(x)
                comm.Iallreduce(x).Wait(timeout=60)
                if not np.all(x == 1.0):          # one rank: the sum is the input
                    errors.append(f"call {k}: {x[:2]}")
        except Exception as e:                    # noqa: BLE001 (reported below)
            errors.append(repr(e))
        done.set()

    t = threading.Thread(target=calls)
    t.start()
    paths = []
    while not done.is_set() and len(paths) < 200:
        paths.append(timeline.start(tmp_path / f"t{len(paths)}.json", interval=0.001))
        timeline.stop()
    t.join(60)
    comm.bind_thread()                            # and back
    assert not t.is_alive() and errors == []
    recorded = 0
    for p in paths:
        with open(p) as f:
            trace = json.load(f)
        assert problems(trace) == []
        recorded += len(ops_of(trace))
    assert recorded > 0                            # the two threads did interleave
