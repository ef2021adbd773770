"""The 4 B back-to-back "shm" allreduce alone: per call, the median and the minimum over batches
(microseconds; rank 0 prints "median min").  For comparing two builds interleaved, run after
run (issue 28's budget: bench/results/issue28_shm_4b.txt):

    mpiexec -n 2 python bench/shm_call_4b.py CALLS BATCHES
"""
import statistics, sys, time
import numpy as np
from mpi4py import MPI
import aluminum_py as al
comm = al.Communicator()
x = np.ones(1, np.float32)
calls, batches = int(sys.argv[1]), int(sys.argv[2])
for _ in range(2000):
    comm.Allreduce(x, algorithm="shm")
ts = []
for b in range(batches):
    MPI.COMM_WORLD.Barrier()
    t = time.perf_counter()
    for _ in range(calls):
        comm.Allreduce(x, algorithm="shm")
    ts.append((time.perf_counter() - t) / calls * 1e6)
if comm.rank == 0:
    print(f"{statistics.median(ts):.4f} {min(ts):.4f}")
