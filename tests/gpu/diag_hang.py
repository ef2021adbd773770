"""The test pattern (blocking + nonblocking host-transfer allreduce, then an immediate pageable
copy on the blocked stream) with a watchdog that prints the ops' phases and every thread's
kernel wait channel when the stream does not drain."""
import os
import sys
import threading
import time

import cupy as cp
import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core

rank = MPI.COMM_WORLD.rank
alg, variant, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
stream = cp.cuda.Stream(non_blocking=True)
c = al.Communicator(stream=stream)
live = []
stop = threading.Event()


def threads():
    out = []
    for tid in sorted(os.listdir("/proc/self/task")):
        def rd(f):
            try:
                return open(f"/proc/self/task/{tid}/{f}").read().strip()
            except OSError as e:
                return f"?{e.errno}"
        out.append(f"{tid}:{rd('comm')}:{rd('wchan')}:{rd('syscall').split(' ')[0]}")
    return " ".join(out)


def watchdog(tag, t0):
    while not stop.wait(0.5):
        if time.time() - t0 > 8:
            now = time.monotonic()
            st = [(r._op.name, ["%.3f" % (x - now) if x else "-" for x in _core.ht_times(r._op)])
                  for r in live]
            print(f"[{rank}] STUCK {tag}: ops={st}\n[{rank}] threads: {threads()}", flush=True)
            return


if variant == "nccl-first":
    x = cp.ones(1, dtype=cp.float32)
    c.Allreduce(x, algorithm="nccl")
    stream.synchronize()
for i in range(reps):
    host = np.arange(1, dtype=np.float32) % 17 + rank
    with stream:
        x = cp.asarray(host)
        c.Allreduce(x, algorithm=alg)
        live = list(c._gpu._unreported)
        y = cp.asarray(host)
        req = c.Iallreduce(y, algorithm=alg)
        live.append(req._host)
        req.Wait()
        stop.clear()
        t0 = time.time()
        wd = threading.Thread(target=watchdog, args=(f"{alg} {variant} rep {i}", t0), daemon=True)
        wd.start()
        if variant == "sync-first":
            stream.synchronize()
        out_x, out_y = cp.asnumpy(x, stream=stream), cp.asnumpy(y, stream=stream)
    stream.synchronize()
    stop.set()
    wd.join()
    exp = MPI.COMM_WORLD.allreduce(host[0])
    assert out_x[0] == exp and out_y[0] == exp, (out_x, out_y, exp)
print(f"[{rank}] {alg} {variant}: {reps} reps OK", flush=True)
c.Free()
