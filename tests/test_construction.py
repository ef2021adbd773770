"""Communicator() under hostile conditions, each program in its own mpiexec launch under a
wall-clock limit (tests/trust_prog.py): construction is bounded by AL_HANG_TIMEOUT (a late
rank), an AL_TIMELINE that one rank cannot record to, or that only some ranks set, fails
construction on every rank with aluminum_py.Error (and never the import), and Communicators
dropped without Free() are reclaimed (more of them than MPI has communicators), MPI running
out of communicators being aluminum_py.Error on every rank.
"""
import os
import subprocess
import sys

import pytest

from test_reliability_launch import mpiexec, run
from test_trust import PROG, launch


def lines(out: str, ranks: int, what: str) -> list[str]:
    """Each rank's line starting with `what` (a missing one fails the test)."""
    found = []
    for r in range(ranks):
        mine = [ln for ln in out.splitlines() if ln.startswith(f"rank {r}: {what}")]
        assert mine, out[-6000:]
        found.append(mine[0])
    return found


@pytest.mark.parametrize("ranks", [2, 3])
def test_construction_is_bounded_by_the_hang_timeout(ranks, tmp_path):
    """The last rank calls Communicator() only once the others' calls have raised (a gate of
    files, no sleep): every other rank raises aluminum_py.TimeoutError after AL_HANG_TIMEOUT
    (1.5 s; without it they would wait in MPI_Comm_dup for the late rank), and the late rank
    raises it too instead of going on alone (its duplicates may complete against the others'
    abandoned ones; the barrier over the new communicator cannot)."""
    for _ in range(2):
        gate = tmp_path / f"gate{_}"
        gate.mkdir()
        out = launch(ranks, "late", str(gate), timeout=150, AL_HANG_TIMEOUT="1.5")
        for ln in lines(out, ranks, "late: TimeoutError after"):
            took = float(ln.split("after ")[1].split(" s")[0])
            assert took >= 1.4, ln                  # never before its timeout (printed rounded)
            assert "came within the hang timeout=1.5 s" in ln, ln


def bad_timeline(tmp_path, how: str, bad: int) -> str:
    """AL_TIMELINE's pattern, which rank `bad` cannot record to (`how`)."""
    d = tmp_path / f"r{bad}"
    if how == "file":                   # a file where a folder is expected
        d.write_text("")
    elif how == "symlink":              # a planted link where the rank's file goes
        d.mkdir()
        (tmp_path / "victim").write_text("keep")
        os.symlink(tmp_path / "victim", d / "tl.json")
    elif os.geteuid() != 0:             # no permission
        d.mkdir(mode=0o500)
    else:                               # root: a folder no file can be created in
        os.symlink("/proc/self", d)
    return str(tmp_path / "r{rank}" / "tl.json")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("how", ["file", "symlink", "permission"])
def test_a_timeline_one_rank_cannot_open(ranks, how, tmp_path):
    """AL_TIMELINE set on every rank, and the last rank cannot open its file: the import works
    on every rank (it raised PermissionError/OSError on that rank, and the others waited for it
    in Communicator() for ever), and Communicator() raises aluminum_py.Error on every rank,
    naming AL_TIMELINE and the rank; a planted link is never followed."""
    pattern = bad_timeline(tmp_path, how, ranks - 1)
    out = launch(ranks, "construct", "-", timeout=120, AL_TIMELINE=pattern)
    for ln in lines(out, ranks, "construct:"):
        assert "raised Error: environment variable AL_TIMELINE=" in ln, ln
        assert f"(rank {ranks - 1})" in ln, ln
    if how == "symlink":
        assert (tmp_path / "victim").read_text() == "keep"


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_timeline_on_some_ranks_only(ranks, tmp_path):
    """AL_TIMELINE set on rank 0 only (launched MPMD): Communicator() raises aluminum_py.Error
    on every rank, naming the ranks that record (before: a hang, or with AL_HANG_TIMEOUT rank
    0 timed out in the clock sync while the others went on and timed out at every call)."""
    pattern = str(tmp_path / "tl_{rank}.json")
    cmd = [mpiexec(), "-n", "1", "-env", "AL_TIMELINE", pattern, sys.executable, PROG,
           "construct", "-", ":", "-n", str(ranks - 1), sys.executable, PROG, "construct", "-"]
    try:
        proc, _ = run(cmd, 120, AL_EXIT_GRACE="0.5")
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end: {e}")
    out = proc.stdout
    assert "Traceback" not in out, out[-6000:]
    for ln in lines(out, ranks, "construct:"):
        assert "raised Error: timeline: ranks [0] record a timeline" in ln, ln
    assert proc.returncode == 0, out[-6000:]


@pytest.mark.parametrize("ranks", [2, 3])
def test_dropped_communicators_are_reclaimed(ranks):
    """560 Communicators dropped without Free() (MPICH has 2048 context ids, 4 per
    Communicator: before, the 511th raised mpi4py's "Too many communicators"), dropped at
    different times on different ranks (at once, the last three kept, in a reference cycle),
    some with a nonblocking Allreduce pending: every result right, memory flat."""
    out = launch(ranks, "drop", "mpi", "560", timeout=400, AL_HANG_TIMEOUT="60")
    assert "resident memory" in out, out[-4000:]


def test_running_out_of_communicators_is_an_error():
    """Communicators kept until MPI has none left: aluminum_py.Error naming it on every rank,
    in the same Communicator() call; after Free() construction works again."""
    out = launch(2, "exhaust", "mpi", timeout=400, AL_HANG_TIMEOUT="60", AL_CHECK="1")
    for ln in lines(out, 2, "exhaust:"):
        # MPI runs out in the duplicates or in the node split after them
        assert ("raised Error: Communicator(): MPI could not duplicate" in ln
                or "raised Error: Communicator(): MPI failed during construction" in ln), ln
