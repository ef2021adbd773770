"""Behaviour that depends on how the process was set up, so each case runs in a fresh
subprocess (``sys.executable``; MPI as a singleton, or under mpiexec at 2 ranks):

* docs/api.md "Exceptions" and docs/semantics.md "Threads": with MPI initialised below
  MPI_THREAD_MULTIPLE (``mpi4py.rc.thread_level`` lowered), every nonblocking operation raises
  ``al.Error`` naming MPI_THREAD_MULTIPLE, before communicating and without touching its
  buffers; so does a blocking call that times out (AL_HANG_TIMEOUT); blocking calls on an idle
  communicator still work (checked against numpy at 2 ranks). At "multiple" (mpi4py's default)
  the same script's nonblocking calls work: the harness itself is sound.
* docs/api.md "Buffers and dtypes": ``aluminum_py.ops.supported_dtypes()`` lists bfloat16 only
  when ml_dtypes can be imported (here: made unimportable in the subprocess); ``import
  aluminum_py`` does not import ml_dtypes (most of a second of CPU in every process), and a
  bfloat16 array made after the import (ml_dtypes imported later) is reduced and gathered.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

TIMEOUT = 120        # seconds for each subprocess

# Runs under any thread level (argv[1]); rank 0 prints "RESULT <json list, one dict per rank>".
SCRIPT = r'''
import json, sys
import mpi4py
mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI
import numpy as np
import aluminum_py as al

world = MPI.COMM_WORLD
comm = al.Communicator()
p, r = comm.size, comm.rank
right, left = (r + 1) % p, (r - 1) % p
out = {"provided": MPI.Query_thread(), "multiple": MPI.THREAD_MULTIPLE, "size": p, "rank": r}

calls = {
    "Iallreduce": lambda x: comm.Iallreduce(x),
    "Iallreduce/ring": lambda x: comm.Iallreduce(x, np.zeros_like(x), op="max", algorithm="ring"),
    "Iallreduce/mpi": lambda x: comm.Iallreduce(x, algorithm="mpi"),
    "Ireduce": lambda x: comm.Ireduce(x, np.zeros_like(x), root=0),
    "Ireduce_scatter": lambda x: comm.Ireduce_scatter(x),
    "Iallgather": lambda x: comm.Iallgather(x),
    "Ibcast": lambda x: comm.Ibcast(x, root=p - 1),
    "Ialltoall": lambda x: comm.Ialltoall(x),
    "Igather": lambda x: comm.Igather(x if r == 0 else x[:4], root=0),
    "Iscatter": lambda x: comm.Iscatter(x, None if r == 0 else x[:4], root=0),
    "Ibarrier": lambda x: comm.Ibarrier(),
    "Irecv": lambda x: comm.Irecv(x, left, tag=5),
    "Isend": lambda x: comm.Isend(x, right, tag=5),
    "Isendrecv": lambda x: comm.Isendrecv(x.copy(), right, x, left, tag=6),
}
nonblocking, reqs = {}, []
for name, call in calls.items():
    x = np.arange(4 * p, dtype=np.float64) + 10 * r
    x0 = x.copy()
    try:
        reqs.append(call(x))
        res = ["request"]
    except al.Error as e:
        res = [type(e).__name__, str(e)]
    except Exception as e:
        res = ["other", type(e).__name__, str(e)]
    nonblocking[name] = {"result": res, "unchanged": bool(np.array_equal(x, x0))}
try:
    al.Waitall(reqs, timeout=30)     # only where a call returned a request
    out["waitall"] = "ok"
except Exception as e:
    out["waitall"] = f"{type(e).__name__}: {e}"
out["nonblocking"] = nonblocking
out["pending"] = comm._state.pending

# blocking calls on the idle communicator, against numpy over every rank's input
x = (np.arange(1001) % 7 - 3).astype(np.int64) * (r + 1)
stack = np.stack(world.allgather(x))
blocking = {}
for alg in al.algorithms("allreduce", "host"):
    o = np.zeros_like(x)
    comm.Allreduce(x, o, algorithm=alg)
    blocking["allreduce/" + alg] = bool(np.array_equal(o, stack.sum(axis=0)))
    y = x.copy()
    comm.Allreduce(y, op="max", algorithm=alg)
    blocking["allreduce max/" + alg] = bool(np.array_equal(y, stack.max(axis=0)))
o = np.zeros_like(x)
comm.Reduce(x, o, op=al.MIN, root=p - 1)
blocking["reduce"] = r != p - 1 or bool(np.array_equal(o, stack.min(axis=0)))
y = np.arange(5.0) * (r + 1)
comm.Bcast(y, root=p - 1)
blocking["bcast"] = bool(np.array_equal(y, np.arange(5.0) * p))
g = np.zeros(3 * p)
comm.Allgather(np.arange(3.0) + r, g)
blocking["allgather"] = bool(np.array_equal(g, np.concatenate([np.arange(3.0) + k for k in range(p)])))
s = np.zeros(3)
comm.Sendrecv(np.arange(3.0) + r, right, s, left, tag=7)
blocking["sendrecv"] = bool(np.array_equal(s, np.arange(3.0) + left))
comm.Barrier()
out["blocking"] = blocking
comm.Free()
everyone = world.gather(out, root=0)      # one line, from rank 0 (ranks' output interleaves)
if r == 0:
    print("RESULT " + json.dumps(everyone), flush=True)
'''

# A blocking call that times out (AL_HANG_TIMEOUT) at one rank: a Recv nobody sends to.
TIMEOUT_SCRIPT = r'''
import json, sys
import mpi4py
mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI
import numpy as np
import aluminum_py as al

comm = al.Communicator()
buf = np.zeros(3)
refs_before = sys.getrefcount(buf)
try:
    comm.Recv(buf, source=0, tag=4)
    res = ["returned"]
except Exception as e:
    res = [type(e).__name__, str(e), isinstance(e, al.TimeoutError)]
refs_after = sys.getrefcount(buf)
comm.Send(np.ones(3), dest=0, tag=4)      # the message that receive was waiting for
delivered = bool(np.all(buf == 1.0))
if not delivered:                         # the receive was cancelled: consume the message
    comm.Recv(np.zeros(3), source=0, tag=4)
comm.Free()
print("RESULT " + json.dumps([{"result": res, "refs_before": refs_before,
                               "refs_after": refs_after, "delivered": delivered}]), flush=True)
'''

DTYPES_SCRIPT = r'''
import json, sys
sys.modules["ml_dtypes"] = None          # import ml_dtypes now raises ImportError
import numpy as np
import aluminum_py as al
from aluminum_py import ops
try:
    np.dtype("bfloat16")
    numpy_knows = True
except TypeError:
    numpy_knows = False
comm = al.Communicator()
x = np.arange(6, dtype=np.float16)
comm.Allreduce(x, op="sum")
comm.Free()
print("RESULT " + json.dumps([{"dtypes": ops.supported_dtypes(), "numpy_knows": numpy_knows,
                               "allreduce": x.tolist()}]), flush=True)
'''

LATE_BFLOAT16_SCRIPT = r'''
import json, sys
import numpy as np
import aluminum_py as al
imported_at_import = "ml_dtypes" in sys.modules
import ml_dtypes
from mpi4py import MPI
comm = al.Communicator()
x = (np.arange(8) + comm.rank).astype(ml_dtypes.bfloat16)
res = {"rank": comm.rank, "imported_at_import": imported_at_import}
for algorithm in ("auto", "ring", "mpi"):
    y = x.copy()
    comm.Allreduce(y, algorithm=algorithm)
    res[algorithm] = y.astype(np.float32).tolist()
out = np.zeros(8 * comm.size, ml_dtypes.bfloat16)
comm.Allgather(x, out)
res["allgather"] = out.astype(np.float32).tolist()
comm.Free()
results = MPI.COMM_WORLD.gather(res)
if results is not None:
    print("RESULT " + json.dumps(results), flush=True)
'''

DOCUMENTED_DTYPES = ("int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 bfloat16 float32 "
                     "float64 complex64 complex128").split()


def clean_env(**extra):
    """The environment without a launcher's variables (each subprocess is its own singleton
    MPI job, even when this test runs inside one) and without AL_HANG_TIMEOUT."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCALRANKID",
                                "MPI_LOCALNRANKS", "OMPI_"))
           and k not in ("AL_HANG_TIMEOUT",)}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd, env):
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc, (json.loads(lines[0][len("RESULT "):]) if len(lines) == 1 else [])


def run_script(script, *args, nranks=None, **env):
    cmd = [sys.executable, "-c", script, *args]
    if nranks is not None:
        exe = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
               or shutil.which("mpiexec"))
        if exe is None:
            pytest.skip("mpiexec not found")
        cmd = [exe, "-n", str(nranks)] + cmd
    proc, results = run(cmd, clean_env(**env))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert len(results) == (nranks or 1), proc.stdout[-6000:]
    return sorted(results, key=lambda res: res.get("rank", 0))


def check_low_level(res):
    """Everything docs/semantics.md "Threads" promises below MPI_THREAD_MULTIPLE."""
    assert res["provided"] < res["multiple"], res
    for name, got in res["nonblocking"].items():
        kind, msg = got["result"][0], got["result"][-1]
        assert kind == "Error", f"{name}: {got['result']}"      # al.Error itself, no subclass
        assert "MPI_THREAD_MULTIPLE" in msg, f"{name}: {msg}"
        assert got["unchanged"], f"{name} wrote into its buffer"
    assert res["waitall"] == "ok"                 # (nothing to wait for)
    assert res["pending"] == 0
    bad = [k for k, ok in res["blocking"].items() if not ok]
    assert not bad, f"blocking calls gave wrong results: {bad}"


@pytest.mark.parametrize("level", ["single", "funneled", "serialized"])
def test_nonblocking_needs_thread_multiple(level):
    """One rank (singleton MPI): each I-call raises al.Error naming MPI_THREAD_MULTIPLE;
    blocking calls still work and Free() succeeds."""
    (res,) = run_script(SCRIPT, level)
    check_low_level(res)


def test_nonblocking_needs_thread_multiple_two_ranks():
    """At 2 ranks (mpiexec), "serialized": every rank raises for every I-call without starting
    any communication (the blocking collectives that follow match up and are right)."""
    for res in run_script(SCRIPT, "serialized", nranks=2):
        check_low_level(res)


def test_thread_multiple_control():
    """The same script at "multiple" (mpi4py's default): the I-calls return requests that
    complete, so the failures above come from the thread level and nothing else."""
    for res in run_script(SCRIPT, "multiple", nranks=2):
        assert res["provided"] == res["multiple"]
        assert all(got["result"] == ["request"] for got in res["nonblocking"].values()), \
            res["nonblocking"]
        assert res["waitall"] == "ok" and res["pending"] == 0
        assert all(res["blocking"].values()), res["blocking"]


def test_blocking_call_that_times_out_needs_thread_multiple():
    """docs/semantics.md "Threads": a blocking call that times out hands its operation to the
    engine, so below MPI_THREAD_MULTIPLE it raises al.Error (not al.TimeoutError)."""
    (res,) = run_script(TIMEOUT_SCRIPT, "serialized", AL_HANG_TIMEOUT="0.3")
    kind, msg, is_timeout = res["result"]
    assert kind == "Error" and not is_timeout, res
    assert "MPI_THREAD_MULTIPLE" in msg, res


def test_blocking_timeout_at_thread_multiple_control():
    """The same at "multiple": al.TimeoutError, and the adopted receive still gets the message
    later (docs/semantics.md "Timeouts")."""
    (res,) = run_script(TIMEOUT_SCRIPT, "multiple", AL_HANG_TIMEOUT="0.3")
    assert res["result"][0] == "TimeoutError" and res["result"][2] is True, res
    assert res["delivered"], res


def test_blocking_timeout_below_thread_multiple_keeps_or_cancels_the_buffer():
    """Below MPI_THREAD_MULTIPLE a blocking call that times out stays posted with no engine to
    finish it: the library must keep its buffer (docs/semantics.md "Threads"), or MPI would
    later write the matching message into memory the caller may have freed."""
    (res,) = run_script(TIMEOUT_SCRIPT, "serialized", AL_HANG_TIMEOUT="0.3")
    assert res["result"][0] == "Error", res
    # either the receive was cancelled (the message does not land later), or the library
    # still holds the buffer it may write into
    assert not res["delivered"] or res["refs_after"] > res["refs_before"], res


def test_supported_dtypes_without_ml_dtypes():
    """docs/api.md: bfloat16 is available only when ml_dtypes is installed. With ml_dtypes
    unimportable, supported_dtypes() is the documented list without bfloat16 (and the rest
    works)."""
    (res,) = run_script(DTYPES_SCRIPT)
    assert not res["numpy_knows"], "numpy knows bfloat16 without ml_dtypes: the case is void"
    got = res["dtypes"]
    assert len(got) == len(set(got))
    assert sorted(got) == sorted(d for d in DOCUMENTED_DTYPES if d != "bfloat16")
    assert res["allreduce"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_bfloat16_made_after_import():
    """ml_dtypes is not imported by ``import aluminum_py``; a bfloat16 array made once the
    program imports it later takes the native call path (Allreduce with three algorithms,
    Allgather) with results equal to numpy's over every rank's input."""
    pytest.importorskip("ml_dtypes")
    results = run_script(LATE_BFLOAT16_SCRIPT, nranks=2)
    inputs = [np.arange(8) + r for r in range(2)]
    for res in results:
        assert not res["imported_at_import"], res
        for algorithm in ("auto", "ring", "mpi"):
            assert res[algorithm] == np.sum(inputs, axis=0).tolist(), (algorithm, res)
        assert res["allgather"] == np.concatenate(inputs).tolist(), res
