import sys, time, random, numpy as np, aluminum_py as al
from aluminum_py import _core
from mpi4py import MPI
w = MPI.COMM_WORLD
comm = al.Communicator()
variants = {"sleep2": 2, "sleep0": 0, "sleep16": 16, "yield": -1}
rng = random.Random(5)
print_rows = []
for nb in [4, 4096, 65536, 1 << 20, 8 << 20, 64 << 20]:
    x = np.ones(max(nb // 4, 1), np.float32); y = np.empty_like(x)
    iters = 40 if nb <= 1 << 20 else 12
    samples = {k: [] for k in list(variants) + ["mpi4py"]}
    for v, pol in variants.items():
        _core.set_shm_sleep_polls(pol); comm.Allreduce(x, y, algorithm="shm")
    for i in range(iters):
        order = list(samples); rng.shuffle(order)
        for k in order:
            if k == "mpi4py":
                w.Barrier(); t0 = time.perf_counter(); w.Allreduce(x, y); dt = time.perf_counter() - t0
            else:
                _core.set_shm_sleep_polls(variants[k])
                w.Barrier(); t0 = time.perf_counter(); comm.Allreduce(x, y, algorithm="shm"); dt = time.perf_counter() - t0
            samples[k].append(w.allreduce(dt, op=MPI.MAX))
    if w.rank == 0:
        print(f"{nb:>9}", " ".join(f"{k} {np.median(v)*1e6:8.1f}" for k, v in samples.items()), flush=True)
