"""The timeline at 1-4 ranks: one complete event per op on every rank and communicator, files
in the Trace Event Format, the clock sync, merge's alignment (no rank leaves a barrier before
every rank entered it, on the merged clock, to within the measured uncertainties) and the plot.
Results are checked against numpy from every rank's inputs."""
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import timeline
from aluminum_py.overlap import GradientSynchronizer
from aluminum_py.testing.trace_format import problems
from aluminum_py.timeline.merge import merge
from aluminum_py.timeline.plot import plot
from conftest import WORLD, all_ranks_ok, every_rank

pytestmark = pytest.mark.mpi

BARRIERS = 4


@pytest.fixture
def shared_dir():
    d = WORLD.bcast(tempfile.mkdtemp(prefix="al_timeline_") if WORLD.rank == 0 else None)
    yield d
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def test_every_op_of_every_communicator(comm, shared_dir):
    rank, size = comm.rank, comm.size
    path = timeline.start(os.path.join(shared_dir, "t.json"), comm)   # comm predates start
    try:
        half = al.Communicator(WORLD.Split(rank % 2, rank))   # constructed while recording
        xs = [np.arange(n, dtype=np.float64) * (rank + 1) for n in (1, 100, 5000)]
        for x in xs:
            comm.Allreduce(x)
        nbs = [np.full(300, rank + 1.0) for _ in range(3)]
        reqs = [comm.Iallreduce(b, algorithm=a)
                for b, a in zip(nbs, ("ring", "mpi", "recursive_doubling"))]
        al.Waitall(reqs, timeout=60)
        for _ in range(BARRIERS):
            comm.Barrier()
        y = np.full(7, rank, dtype=np.int32)
        half.Allreduce(y, op=al.MAX)
        comm.Bcast(y, root=0)
        grads = [np.full(n, float(rank + k), np.float32) for k, n in enumerate((64, 3, 900))]
        sync = GradientSynchronizer(comm, grads, policy="fixed", threshold=1024, average=False)
        for _ in range(2):
            with timeline.region("backward"):
                for i in reversed(range(len(grads))):
                    grads[i][...] = rank + i
                    sync.grad_ready(i)
            info = sync.wait(timeout=60)
        meta = timeline.stop()
    finally:
        timeline.stop()
    failures = []
    total = size * (size + 1) / 2
    for n, x in zip((1, 100, 5000), xs):
        if not np.array_equal(x, np.arange(n) * total):
            failures.append(f"Allreduce of {n}: wrong sum")
    for r, b in zip(reqs, nbs):
        if not np.all(b == total):
            failures.append(f"Iallreduce {r.algorithm}: wrong sum")
    # ranks of my half: rank % 2 == mine; MAX of theirs, then rank 0's (a member of half 0)
    if not np.all(y == max(range(0, size, 2))):
        failures.append(f"half Allreduce MAX then Bcast: {y}")
    for k, g in enumerate(grads):
        if not np.all(g == total - size + k * size):
            failures.append(f"gradient {k}: {g[:3]}")

    with open(path) as f:
        trace = json.load(f)
    failures += problems(trace)
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "op"]
    nbuckets = len(info.buckets)
    by_comm = {}
    for e in ops:
        by_comm.setdefault(e["args"]["communicator"], []).append(e["name"])
    # + 2: the synchronizer's constructor compares the ranks' buckets (two Allreduce)
    expect0 = 3 + 3 + BARRIERS + 1 + 2 + 2 * nbuckets
    if sorted(map(len, by_comm.values())) != sorted([expect0, 1]):
        failures.append(f"ops per communicator {sorted(map(len, by_comm.values()))}, expected "
                        f"{expect0} and 1: {by_comm}")
    if by_comm.get(1) != ["allreduce/" + half.explain(28, "int32").algorithm]:
        failures.append(f"the split communicator's ops: {by_comm.get(1)}")
    if sum(1 for e in ops if e["name"] == "barrier") != BARRIERS:
        failures.append("barrier count")
    buckets = [e for e in trace["traceEvents"] if e.get("cat") == "bucket"]
    if len(buckets) != 2 * nbuckets or meta["events"] != len(ops) + len(buckets) + 2:
        failures.append(f"{len(buckets)} bucket events, {meta['events']} events in all")
    if meta["dropped_events"] or meta["unfinished_ops"]:
        failures.append(f"dropped/unfinished: {meta}")
    clock = meta["clock"]
    same_host = WORLD.bcast(MPI.Get_processor_name()) == MPI.Get_processor_name()
    if size > 1 and (clock is None or clock["reference"] != 0):
        failures.append(f"no clock sync to rank 0: {clock}")
    elif size > 1 and same_host and abs(clock["offset_us"]) > clock["uncertainty_us"] + 0.01:
        # one host, one CLOCK_MONOTONIC: the true offset is 0
        failures.append(f"offset {clock['offset_us']} us beyond its uncertainty "
                        f"{clock['uncertainty_us']} us on one host")
    assert all_ranks_ok(not failures), every_rank(failures)

    WORLD.Barrier()                       # every file is complete
    failures = []
    if WORLD.rank == 0:
        files = [os.path.join(shared_dir, f"t.rank{r}.json") for r in range(size)]
        merged, report = merge(files, os.path.join(shared_dir, "all.json"))
        failures += problems(merged)
        ranks = merged["otherData"]["ranks"]
        if len(report) != size or any(ranks[str(r)]["offset_us"] is None for r in range(size)):
            failures.append(f"merge report {report}")
        barriers = {r: [e for e in merged["traceEvents"]
                        if e.get("cat") == "op" and e["name"] == "barrier" and e["pid"] == r]
                    for r in range(size)}
        for k in range(BARRIERS):
            enter = {r: barriers[r][k]["ts"] for r in range(size)}
            leave = {r: barriers[r][k]["ts"] + barriers[r][k]["dur"] for r in range(size)}
            last_in = max(enter, key=enter.get)
            first_out = min(leave, key=leave.get)
            slack = (ranks[str(last_in)]["uncertainty_us"]
                     + ranks[str(first_out)]["uncertainty_us"] + 0.01)
            if enter[last_in] > leave[first_out] + slack:
                failures.append(f"barrier {k}: rank {first_out} left at {leave[first_out]} "
                                f"before rank {last_in} entered at {enter[last_in]} "
                                f"(uncertainties {slack} us)")
        png = os.path.join(shared_dir, "step.png")
        plot(merged, png)
        with open(png, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                failures.append("plot: not a PNG")
    half.Free()
    assert all_ranks_ok(not failures), every_rank(failures)
