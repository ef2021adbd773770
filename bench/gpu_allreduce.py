"""GPU Allreduce: every GPU algorithm against CuPy's NCCL binding and the naive host path.

    mpiexec -n 2 python bench/gpu_allreduce.py [--quick] [--min-bytes 4] [--max-bytes 256MiB]
        [--budget S] [--json FILE]

Per-call time of ``Communicator.Allreduce`` (float32 SUM, out of place, CuPy arrays) for sizes
4 B .. 256 MiB (powers of 4), for ``nccl``, every ``ht_*`` algorithm and ``auto``; nonblocking
``Iallreduce`` + ``Wait`` (nccl); CuPy's own ``cupy.cuda.nccl.NcclCommunicator.allReduce`` (the
same NCCL, without this library); and the naive path a user writes without either
(``cp.asnumpy``, mpi4py ``Allreduce`` on the host, ``y.set`` back).

A call's time is the host wall time from the call until the stream has finished it: the stream
is idle and the ranks are at a barrier before each call, and after it the host polls the stream
until done. Variants are interleaved (round robin, the first one rotating each repetition),
warmed up, and repeated adaptively (a time budget per size and variant, at least 3 times). The
table shows, per variant, the median per rank and then the max over ranks (microseconds), and
the ratios nccl/cupy (want <= 1.05) and best ht_*/naive (want < 1 at <= 64 KiB); both targets
are printed as PASS or MISS.

The contention probe runs a GEMM (``cupy.matmul``, 8192 x 8192) on a second stream while 64 MiB
NCCL allreduces run on the communicator's stream, for ``max_ctas`` in {unset, 1, 2, 4, 8, 16,
32}: GEMM time alone and under contention (the slowdown) and the allreduce time, per setting.

``--quick`` (sizes up to 16 MiB, fewer repetitions, three max_ctas settings) is meant to finish
in under 3 minutes at 2 ranks sharing one GPU over NCCL's socket transport. Every wait is bounded: the stream is polled
with a deadline (``--call-timeout``), host-transfer requests are waited for with
``Wait(timeout=)``, and a watchdog ends the run after ``--time-limit`` seconds with every
thread's stack. Ranks sharing one GPU get their own ``NCCL_HOSTID`` (unless it is set), as in
tests/gpu/run_one_gpu.sh. Without CuPy, a CUDA device or NCCL it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import time

import numpy as np

HT = ["ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring"]
SHORT = {"nccl": "nccl", "ht_mpi": "ht_mpi", "ht_recursive_doubling": "ht_rd",
         "ht_rabenseifner": "ht_rab", "ht_ring": "ht_ring", "auto": "auto",
         "inccl": "I+Wait", "cupy": "cupy", "naive": "naive"}
KIB = 1 << 10
CTAS_FULL = [None, 1, 2, 4, 8, 16, 32]
CTAS_QUICK = [None, 2, 16]


def human(n: int) -> str:
    for unit, mul in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mul and n % mul == 0:
            return f"{n // mul} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    t = str(text).strip().lower()
    for suf, mul in (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("k", 1 << 10),
                     ("m", 1 << 20), ("g", 1 << 30), ("b", 1)):
        if t.endswith(suf):
            return int(float(t[: -len(suf)]) * mul)
    return int(t)


def sizes_pow4(lo: int, hi: int) -> list[int]:
    """Powers of 4 from lo to hi bytes (at least one float32)."""
    out, n = [], 4
    while n <= hi:
        if n >= lo:
            out.append(n)
        n *= 4
    return out


def unavailable(world) -> str | None:
    """Why this cannot run (None: it can), agreed over ranks: CuPy, a CUDA device, NCCL."""
    why = None
    try:
        import cupy
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:                      # no driver, no device
            count, why = 0, f"no CUDA device ({type(e).__name__}: {str(e).splitlines()[0]})"
        if count == 0 and why is None:
            why = "no CUDA device"
    except Exception as e:                          # ImportError, or a CuPy that cannot load
        why = f"CuPy is not available ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if why is None:
        from aluminum_py import gpu, nccl
        if gpu.cuda_device_count() == 0:
            why = "no CUDA device (the CUDA driver does not open)"
        elif not nccl.available():
            why = "NCCL is not available (libnccl.so.2 did not load)"
    whys = world.allgather(why)
    return next((w for w in whys if w), None)


def device_name(cp, index: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(index)["name"]
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


class Hang(Exception):
    pass


def wait_stream(stream, deadline: float, what: str) -> None:
    """Poll `stream` until its work is done; past `deadline` (perf_counter) raise Hang."""
    while not stream.done:
        if time.perf_counter() > deadline:
            raise Hang(f"{what}: the stream has not finished after the call timeout")


def setup_device(world):
    """Use device local_rank % count. Ranks sharing a device look like separate hosts to NCCL
    (their own NCCL_HOSTID, sockets on lo), unless NCCL_HOSTID is set. Returns (index,
    ranks per device, whether NCCL_HOSTID was set here)."""
    import cupy as cp
    from mpi4py import MPI
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    count = cp.cuda.runtime.getDeviceCount()
    index = local % count
    cp.cuda.Device(index).use()
    sharing = math.ceil(local_size / count)
    set_here = False
    if sharing > 1 and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"al-bench-{world.Get_rank()}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        set_here = True
    return index, sharing, set_here


def cupy_nccl(world):
    """CuPy's NcclCommunicator over the same ranks, or (None, reason)."""
    why = None
    try:
        from cupy.cuda import nccl as cn
        if not getattr(cn, "available", True):
            raise ImportError("CuPy was built without NCCL (cupy.cuda.nccl.available is False)")
        _ = cn.NCCL_FLOAT32, cn.NCCL_SUM, cn.NcclCommunicator
    except Exception as e:
        why = f"cupy.cuda.nccl is unavailable ({type(e).__name__}: {e})"
    whys = world.allgather(why)
    why = next((w for w in whys if w), None)
    if why:
        return None, why
    uid = None
    if world.Get_rank() == 0:
        try:
            uid = cn.get_unique_id()
        except Exception as e:
            uid = e
    uid = world.bcast(uid, root=0)
    if isinstance(uid, Exception):
        return None, f"cupy.cuda.nccl.get_unique_id failed ({uid})"
    try:
        comm = cn.NcclCommunicator(world.Get_size(), uid, world.Get_rank())
    except Exception as e:
        comm, why = None, f"cupy.cuda.nccl.NcclCommunicator failed ({type(e).__name__}: {e})"
    whys = world.allgather(why)
    why = next((w for w in whys if w), None)
    return (None, why) if why else (comm, None)


class Bench:
    def __init__(self, args, world, native, comm, stream, cupy_comm):
        import cupy as cp
        self.cp, self.args, self.world, self.native = cp, args, world, native
        self.comm, self.stream, self.cupy_comm = comm, stream, cupy_comm

    # -- the variants: each enqueues one allreduce of x into y on self.stream
    def variants(self, x, y) -> dict:
        from mpi4py import MPI
        cp, c, s, limit = self.cp, self.comm, self.stream, self.args.call_timeout
        out = {"nccl": lambda: c.Allreduce(x, y, algorithm="nccl")}
        for a in HT:
            out[a] = (lambda a: lambda: c.Allreduce(x, y, algorithm=a))(a)
        out["auto"] = lambda: c.Allreduce(x, y, algorithm="auto")

        def inccl():
            c.Iallreduce(x, y, algorithm="nccl").Wait(timeout=limit)
        out["inccl"] = inccl
        if self.cupy_comm is not None:
            from cupy.cuda import nccl as cn
            cc = self.cupy_comm
            out["cupy"] = lambda: cc.allReduce(x.data.ptr, y.data.ptr, x.size, cn.NCCL_FLOAT32,
                                               cn.NCCL_SUM, s.ptr)

        def naive():
            h = cp.asnumpy(x, stream=s)
            wait_stream(s, time.perf_counter() + limit, "naive: copy to the host")
            self.native.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
            y.set(h, stream=s)
        out["naive"] = naive
        return out

    def timed(self, name: str, fn, nbytes: int) -> float:
        """One call: stream idle, barrier, call, poll the stream until done. The call is made
        with the stream current in CuPy, as a user would write it (``with stream:``), so that
        CuPy's ``__dlpack__`` has no cross-stream event to record."""
        deadline = time.perf_counter() + self.args.call_timeout
        wait_stream(self.stream, deadline, f"before {name} at {nbytes} B")
        self.world.Barrier()
        t0 = time.perf_counter()
        with self.stream:
            fn()
        wait_stream(self.stream, time.perf_counter() + self.args.call_timeout,
                    f"{name} at {nbytes} B")
        return time.perf_counter() - t0

    def round(self, fns: dict, rep: int, nbytes: int, samples: dict | None) -> dict:
        names = list(fns)
        k = rep % len(names)
        t = {}
        for name in names[k:] + names[:k]:
            t[name] = self.timed(name, fns[name], nbytes)
            if samples is not None:
                samples[name].append(t[name])
        return t

    def verify(self, fns: dict, x, y, nbytes: int) -> list[str]:
        """Each variant once into a zeroed y: every element must be the rank count (inputs
        are ones). Returns the variants that were wrong on any rank."""
        cp, p = self.cp, self.world.Get_size()
        wrong = []
        for name, fn in fns.items():
            with self.stream:
                y.fill(0)
            self.timed(name, fn, nbytes)
            with self.stream:
                ok = bool(cp.all(y == p).get(stream=self.stream))
            if not all(self.world.allgather(ok)):
                wrong.append(name)
        return wrong

    def size(self, nbytes: int) -> dict:
        from mpi4py import MPI
        cp, args = self.cp, self.args
        n = nbytes // 4
        with self.stream:
            x = cp.ones(n, dtype=cp.float32)
            y = cp.zeros(n, dtype=cp.float32)
        fns = self.variants(x, y)
        for w in range(args.warmup):
            self.round(fns, w, nbytes, None)
        wrong = self.verify(fns, x, y, nbytes)
        samples = {name: [] for name in fns}
        first = self.round(fns, 0, nbytes, samples)
        per_round = self.world.allreduce(sum(first.values()), op=MPI.MAX)
        reps = int(min(args.max_reps, max(args.min_reps,
                                          math.ceil(args.budget * len(fns) / max(per_round, 1e-9)))))
        for rep in range(1, reps):
            self.round(fns, rep, nbytes, samples)
        med = {name: float(np.median(v)) for name, v in samples.items()}
        every = self.world.allgather(med)
        row = {"bytes": nbytes, "reps": reps, "wrong": wrong,
               "median_us_per_rank": {name: [r[name] * 1e6 for r in every] for name in fns},
               "us": {name: max(r[name] for r in every) * 1e6 for name in fns}}
        del x, y, fns
        cp.get_default_memory_pool().free_all_blocks()
        return row

    # -- contention probe
    def probe(self, settings: list) -> dict:
        from mpi4py import MPI
        cp, args, s, c, world = self.cp, self.args, self.stream, self.comm, self.world
        nbytes, gn = args.probe_bytes, args.gemm_n
        dt = cp.dtype(args.gemm_dtype)
        gs = cp.cuda.Stream(non_blocking=True)
        with gs:
            a = cp.random.standard_normal((gn, gn), dtype=cp.float32).astype(dt) / gn ** 0.5
            b = cp.random.standard_normal((gn, gn), dtype=cp.float32).astype(dt) / gn ** 0.5
            out = cp.empty((gn, gn), dtype=dt)
        with s:
            x = cp.ones(nbytes // 4, dtype=cp.float32)
            y = cp.zeros_like(x)
        gs.synchronize()
        s.synchronize()
        ev = [cp.cuda.Event() for _ in range(4)]
        limit = args.call_timeout

        def gemm():
            with gs:
                cp.matmul(a, b, out=out)

        def med_max(values):
            return world.allreduce(float(np.median(values)), op=MPI.MAX)

        def gemm_alone():
            world.Barrier()
            ev[0].record(gs)
            gemm()
            ev[1].record(gs)
            wait_stream(gs, time.perf_counter() + limit, "GEMM")
            return cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e-3

        def allreduce_alone(m):
            world.Barrier()
            ev[2].record(s)
            c.Allreduce(x, y, algorithm="nccl", max_ctas=m)
            ev[3].record(s)
            wait_stream(s, time.perf_counter() + limit, f"allreduce max_ctas={m}")
            return cp.cuda.get_elapsed_time(ev[2], ev[3]) * 1e-3

        def contended(m, k):
            world.Barrier()
            ev[2].record(s)
            for _ in range(k):
                c.Allreduce(x, y, algorithm="nccl", max_ctas=m)
            ev[3].record(s)
            ev[0].record(gs)
            gemm()
            ev[1].record(gs)
            wait_stream(gs, time.perf_counter() + limit, f"GEMM under max_ctas={m}")
            wait_stream(s, time.perf_counter() + limit, f"allreduces under max_ctas={m}")
            return (cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e-3,
                    cp.cuda.get_elapsed_time(ev[2], ev[3]) * 1e-3 / k)

        gemm_alone()                                            # warm-up (cuBLAS handle, ...)
        g0 = med_max([gemm_alone() for _ in range(args.probe_reps)])
        rows = []
        for m in settings:
            allreduce_alone(m)                                  # warm-up: the split comm
            ar = med_max([allreduce_alone(m) for _ in range(args.probe_reps)])
            # enough allreduces to cover the GEMM (the same count on every rank)
            k = int(min(16, max(1, math.ceil(g0 / max(ar, 1e-9)) + 1)))
            got = [contended(m, k) for _ in range(args.probe_reps)]
            g = med_max([t[0] for t in got])
            arc = med_max([t[1] for t in got])
            rows.append({"max_ctas": m, "allreduce_us": ar * 1e6, "allreduces": k,
                         "gemm_us": g * 1e6, "gemm_slowdown": g / g0,
                         "allreduce_contended_us": arc * 1e6})
            if world.Get_rank() == 0:
                r = rows[-1]
                print(f"{'unset' if m is None else m:>8} {r['allreduce_us']:>14.0f} "
                      f"{r['allreduce_contended_us']:>14.0f} {k:>4} {r['gemm_us']:>12.0f} "
                      f"{r['gemm_slowdown']:>9.2f}x", flush=True)
        return {"bytes": nbytes, "gemm_n": gn, "gemm_dtype": str(dt), "gemm_alone_us": g0 * 1e6,
                "reps": args.probe_reps, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="sizes up to 16 MiB, fewer repetitions, 3 max_ctas settings")
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default=None, help="default 256MiB (--quick: 16MiB)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds per size and variant (default 0.2; --quick 0.03)")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=None, help="default 200 (--quick 30)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2; --quick 1)")
    ap.add_argument("--probe-bytes", default="64MiB", help="allreduce size of the contention probe")
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--gemm-dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--probe-reps", type=int, default=None, help="default 5 (--quick 2)")
    ap.add_argument("--max-ctas", default=None,
                    help="comma-separated settings, 'unset' for none (default unset,1,2,4,8,16,32;"
                         " --quick unset,2,16)")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--call-timeout", type=float, default=120.0,
                    help="seconds one call may take before the run is aborted")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run (default 3600; --quick 600)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    q = args.quick
    args.max_bytes = parse_bytes(args.max_bytes or ("16MiB" if q else "256MiB"))
    args.min_bytes = parse_bytes(args.min_bytes)
    args.budget = args.budget if args.budget is not None else (0.03 if q else 0.2)
    args.max_reps = args.max_reps or (30 if q else 200)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    args.probe_reps = args.probe_reps or (2 if q else 5)
    args.probe_bytes = parse_bytes(args.probe_bytes)
    args.time_limit = args.time_limit or (600.0 if q else 3600.0)
    if args.max_ctas is None:
        settings = CTAS_QUICK if q else CTAS_FULL
    else:
        settings = [None if t.strip() == "unset" else int(t) for t in args.max_ctas.split(",") if t.strip()]

    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    why = unavailable(world)
    if why:
        if rank == 0:
            print(f"gpu_allreduce: skipped: {why}", flush=True)
        return 0
    faulthandler.dump_traceback_later(args.time_limit, exit=True)     # the hard bound

    import cupy as cp
    import aluminum_py as al
    index, sharing, set_here = setup_device(world)
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    native = world.Dup()
    cupy_comm, cupy_why = cupy_nccl(world)
    bench = Bench(args, world, native, comm, stream, cupy_comm)
    sizes = sizes_pow4(args.min_bytes, args.max_bytes)
    names = ["nccl"] + HT + ["auto", "inccl"] + (["cupy"] if cupy_comm is not None else []) + ["naive"]
    import harness          # bench/: the run's stamp (date, command, MPI library, load)
    info = {**harness.stamp(world), "ranks_per_gpu": sharing,
            "device": device_name(cp, index),
            "nccl": ".".join(map(str, al.nccl.get_version())), "cupy": cp.__version__,
            "nccl_hostid_set_here": set_here, "quick": q, "budget_s": args.budget}
    if cupy_comm is not None:
        from cupy.cuda import nccl as cn
        info["cupy_nccl"] = str(cn.get_version())
    if rank == 0:
        print(f"# GPU allreduce float32 SUM out of place, {info['ranks']} ranks on "
              f"{info['device']} ({sharing} rank(s) per GPU{', NCCL_HOSTID set per rank' if set_here else ''})")
        print(f"# {info['command']}; {info['date']}, load {info['load']} on {info['cpus']} CPUs")
        print(f"# NCCL {info['nccl']}, CuPy {info['cupy']}"
              f"{' (its NCCL ' + info['cupy_nccl'] + ')' if 'cupy_nccl' in info else ''}, {info['mpi']}")
        if cupy_why:
            print(f"# cupy row skipped: {cupy_why}")
        print("# per call: host time until the stream has finished; median per rank, max over "
              "ranks, microseconds")
        print("# I+Wait: Iallreduce + Wait (nccl); naive: cp.asnumpy + mpi4py Allreduce + y.set")
        head = f"{'bytes':>10}" + "".join(f" {SHORT[n]:>9}" for n in names)
        head += f" {'nccl/cupy':>9} {'ht/naive':>9}  best ht"
        print(head, flush=True)
    rows = []
    try:
        for nbytes in sizes:
            row = bench.size(nbytes)
            us = row["us"]
            best = min(HT, key=lambda a: us[a])
            row["best_ht"] = best
            row["nccl_over_cupy"] = us["nccl"] / us["cupy"] if "cupy" in us else None
            row["best_ht_over_naive"] = us[best] / us["naive"]
            rows.append(row)
            if rank == 0:
                line = f"{human(nbytes):>10}" + "".join(f" {us[n]:>9.1f}" for n in names)
                ratio = row["nccl_over_cupy"]
                line += f" {ratio:>8.3f}x" if ratio is not None else f" {'n/a':>9}"
                line += f" {row['best_ht_over_naive']:>8.3f}x  {SHORT[best]}"
                if row["wrong"]:
                    line += f"  WRONG RESULT: {', '.join(row['wrong'])}"
                print(line, flush=True)
        targets = {}
        if rank == 0:
            targets = report_targets(rows, cupy_comm is not None)
        probe = None
        if not args.no_probe:
            if rank == 0:
                print(f"# contention probe: {human(args.probe_bytes)} NCCL allreduces on the "
                      f"communicator's stream while a {args.gemm_n}x{args.gemm_n} {args.gemm_dtype} "
                      f"cupy.matmul runs on another stream; max over ranks of medians "
                      f"({args.probe_reps} reps)")
                if sharing > 1:
                    print(f"# note: {sharing} ranks share each GPU: without MPS their kernels "
                          f"time-slice, so the other rank's GEMM and allreduce contend too")
                print(f"{'max_ctas':>8} {'allreduce us':>14} {'contended us':>14} {'k':>4} "
                      f"{'GEMM us':>12} {'slowdown':>10}", flush=True)
            probe = bench.probe(settings)
            if rank == 0:
                print(f"# GEMM alone: {probe['gemm_alone_us']:.0f} us; k: allreduces queued "
                      f"per GEMM; slowdown: GEMM time under contention / alone", flush=True)
    except Hang as e:
        print(f"gpu_allreduce: rank {rank}: {e}; aborting", file=sys.stderr, flush=True)
        world.Abort(1)
        return 1
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "variants": names, "cupy_skipped": cupy_why, "rows": rows,
                       "targets": targets, "probe": probe}, f, indent=1)
    stream.synchronize()
    comm.Free()
    native.Free()
    faulthandler.cancel_dump_traceback_later()
    return 0


def report_targets(rows: list, have_cupy: bool) -> dict:
    """Print PASS/MISS for the two targets (rank 0); returns them for the JSON."""
    out = {}
    if have_cupy:
        worst = max(rows, key=lambda r: r["nccl_over_cupy"])
        ok = worst["nccl_over_cupy"] <= 1.05
        out["nccl_within_1.05x_cupy"] = {"pass": ok, "worst_ratio": worst["nccl_over_cupy"],
                                          "worst_bytes": worst["bytes"]}
        print(f"# target nccl <= 1.05x CuPy's binding at every size: {'PASS' if ok else 'MISS'} "
              f"(worst {worst['nccl_over_cupy']:.3f}x at {human(worst['bytes'])})")
    else:
        out["nccl_within_1.05x_cupy"] = None
        print("# target nccl <= 1.05x CuPy's binding at every size: n/a (no cupy row)")
    small = [r for r in rows if r["bytes"] <= 64 * KIB]
    if small:
        worst = max(small, key=lambda r: r["best_ht_over_naive"])
        ok = worst["best_ht_over_naive"] < 1.0
        out["ht_faster_than_naive_le_64KiB"] = {"pass": ok, "worst_ratio": worst["best_ht_over_naive"],
                                                "worst_bytes": worst["bytes"]}
        print(f"# target best ht_* < naive at <= 64 KiB: {'PASS' if ok else 'MISS'} (worst "
              f"{worst['best_ht_over_naive']:.3f}x, {SHORT[worst['best_ht']]}, at "
              f"{human(worst['bytes'])})", flush=True)
    else:
        out["ht_faster_than_naive_le_64KiB"] = None
        print("# target best ht_* < naive at <= 64 KiB: n/a (no size <= 64 KiB)", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
