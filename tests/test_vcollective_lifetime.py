"""The arrays the argument parser makes of a v-collective's non-numpy buffers (a memoryview, a
bytearray) stay alive until the call has used them: they were freed at the parser's return and
read afterwards, and the process crashed within a few thousand calls.  A program of its own,
so that a crash fails this test rather than the whole session."""
import subprocess
import sys

from test_reliability_launch import clean_env, mpiexec

PROGRAM = r"""
import gc
import numpy as np
import aluminum_py as al
comm = al.Communicator()
p, r = comm.size, comm.rank
for it in range(3000):
    raw = bytearray(p)
    comm.Allgatherv(memoryview(np.full(1, r + 1, np.uint8)), [raw, [1] * p])
    got = bytearray(p)
    comm.Alltoallv([memoryview(np.full(p, r + 1, np.uint8)), [1] * p], [got, [1] * p])
    if it % 50 == 0:
        gc.collect()
assert bytes(raw) == bytes(range(1, p + 1)), raw
assert bytes(got) == bytes(range(1, p + 1)), got
comm.Free()
print("OK", r, flush=True)
"""


def test_parsed_buffers_live_through_the_call():
    for ranks in (1, 2):
        proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, "-c", PROGRAM],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=600)
        assert proc.returncode == 0 and proc.stdout.count("OK") == ranks, proc.stdout[-3000:]
