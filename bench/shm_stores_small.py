"""shm's allreduce at 1-64 KiB against the MPI library's point-to-point algorithms, interleaved
in random order (barrier before each call, 600 iterations, median of the max over ranks, us),
with whatever AL_SHM_SLOT_STORES says: where the slot stores' measured choice should begin
(al_shm.h AL_SHM_STORE_MIN_LOG2; docs/performance.md, "Measured slot stores from 4 KiB").
One line: the placement probe's round trip at setup (above 200 ns the two ranks share no
cache), then per size shm's median / the fastest other's.  bench/shm_stores.py times waits
of 20-35 us at these sizes (its ranks sleep between rounds); this one stays in one loop.

    for i in $(seq 20); do for m in auto cached streamed; do echo -n "$m ";
      AL_SHM_SLOT_STORES=$m mpiexec -n 2 python bench/shm_stores_small.py; done; done
"""
import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench import timing

world = MPI.COMM_WORLD
comm = al.Communicator()
out = []
for n in [1024, 2048, 4096, 8192, 16384, 32768, 65536]:
    send = np.ones(n // 4, np.float32)
    calls = {}
    for a in ["shm", "rabenseifner", "ring", "recursive_doubling"]:
        r = np.empty_like(send)
        calls[a] = (lambda a=a, r=r: comm.Allreduce(send, r, algorithm=a))
    for _ in range(100):
        for f in calls.values():
            f()
    s = timing.time_interleaved(world, calls, 600, salt=n)
    out.append((n, np.median(s["shm"]) * 1e6, min(np.median(s[k]) for k in s if k != "shm") * 1e6))
if world.rank == 0:
    info = _core.shm_info(comm._state)
    print(f"rt {info.get('round_trip_ns', 0) if info else 0:.0f}: "
          + " ".join(f"{n >> 10}K {a:.1f}/{b:.1f}" for n, a, b in out))
