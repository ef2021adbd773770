"""Does a nonblocking allreduce progress while the caller computes, and what does it cost the
caller?  Ours (the progress engine thread) against mpi4py's ``Iallreduce`` (the peer), one run,
interleaved.

    mpiexec -n 2 python bench/progress_overlap.py [--sizes 16MiB] [--algorithm auto]
        [--iters N | --budget S] [--json F] [--csv F]

``t_op`` is the median time of our blocking Allreduce of the message.  Then, per mode, each
contender starts its Iallreduce, the caller works for 3 t_op (``sleep``: ``time.sleep``, the GIL
released; ``spin``: a pure-Python loop holding the GIL) and Waits; a sample is the slowest
rank's time from the start to the end of the Wait.  With a perfect overlap it is 3 t_op; with
none (MPI's progress only inside its calls), 4 t_op.  ``left_pct`` is each contender's median
time left to Wait after the work, in percent of t_op.  The last line gives the pure-Python
work done while our op is in flight, in percent of the same loop with no op in flight (the
cost of the engine thread to a GIL-holding caller).
"""
from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al

import harness


def spin(seconds: float) -> int:
    """A pure-Python busy loop (holds the GIL); returns the iterations done."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            n += 1
    return n


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="16MiB", budget=2.0)
    ap.add_argument("--algorithm", default="auto")
    args = harness.parse(ap, argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    report = harness.Report(world, args, f"Iallreduce float32 SUM, algorithm={args.algorithm}, "
                            "then 3 t_op of work, then Wait", keys=["bytes", "mode"],
                            ours=["aluminum_py"], peers=["mpi4py"])
    for nbytes in harness.sizes(args.sizes, 4):
        x = np.ones(nbytes // 4, dtype=np.float32)
        ys = {k: np.empty_like(x) for k in ("aluminum_py", "mpi4py")}
        t = harness.measure(world, {"t_op": lambda: comm.Allreduce(x, ys["aluminum_py"],
                                                                    algorithm=args.algorithm)},
                            args.iters, args.budget, salt=nbytes)["t_op"]
        t_op = float(np.median(t))
        for mode in ("sleep", "spin"):
            work = (lambda: time.sleep(3 * t_op)) if mode == "sleep" else (lambda: spin(3 * t_op))
            left = {k: [] for k in ys}

            def overlapped(name):
                def call():
                    if name == "aluminum_py":
                        req = comm.Iallreduce(x, ys[name], algorithm=args.algorithm)
                    else:
                        req = native.Iallreduce(x, ys[name], op=MPI.SUM)
                    work()
                    t1 = time.perf_counter()
                    req.Wait()
                    left[name].append(time.perf_counter() - t1)
                return call
            samples = harness.measure(world, {k: overlapped(k) for k in ys}, args.iters,
                                      args.budget, salt=nbytes)
            left_pct = {k: world.allreduce(float(np.median(v)), op=MPI.MAX) / t_op * 100
                        for k, v in left.items()}
            report.row({"bytes": nbytes, "mode": mode}, harness.medians_us(samples),
                       t_op_us=t_op * 1e6, left_pct=left_pct)
            report.say(f"{nbytes} B, {mode}: t_op {t_op * 1e6:.0f} us; left to Wait after the "
                       "work: " + ", ".join(f"{k} {v:.0f}%" for k, v in left_pct.items()))
        idle, busy = [], []
        for _ in range(5):
            world.Barrier()
            idle.append(spin(max(3 * t_op, 0.05)))
            world.Barrier()
            req = comm.Iallreduce(x, ys["aluminum_py"], algorithm=args.algorithm)
            t0, n = time.perf_counter(), 0
            while not req.done:
                n += spin(0.001)
            busy.append(n / (time.perf_counter() - t0) * max(3 * t_op, 0.05))
            req.Wait(timeout=60)
        report.say(f"{nbytes} B: Python loop throughput while our op is in flight: "
                   f"{np.median(busy) / np.median(idle) * 100:.0f}% of idle")
    rc = report.finish()
    native.Free()
    comm.Free()
    return rc


if __name__ == "__main__":
    sys.exit(main())
