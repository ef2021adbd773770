"""``mpiexec -n N python -m aluminum_py bench overlap --model resnet50 --policy all``: emulated
training iterations with real gradient buffers and the GradientSynchronizer doing real fused
nonblocking allreduces; measured iteration time per policy next to OSF's prediction.

One iteration: the forward pass (sleep for the model's forward time), then the backward pass
layer by layer in reverse (sleep for the layer's backward time, then ``grad_ready``), then
``wait()``. Layer compute times come from the model zoo's FLOPs at an assumed throughput, scaled
by ``--compute-scale``; gradient sizes are the model's parameter counts times ``--scale``.
Sleeping leaves the cores to the progress engine, as a GPU leaves them to the host; ``--compute
numpy`` does real numpy work instead (it then competes with the engine for the CPU).

The allreduce cost OSF uses (and adafusion plans with) is fitted to per-op times of bursts of
back-to-back ``Iallreduce`` calls measured at the start of the run, over the bucket sizes that
occur.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .timing import human

FIXED_THRESHOLDS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m aluminum_py bench overlap",
                                 description="Overlapped gradient allreduce per fusion policy.")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--policy", default="all",
                    help="comma-separated: none,fixed,mgwfbp,adafusion,libra,deft or all")
    ap.add_argument("--scale", type=float, default=0.25, help="gradient size scale (default 0.25)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--throughput", type=float, default=2e12,
                    help="assumed FLOP/s for the layer times (default 2e12)")
    ap.add_argument("--compute-scale", type=float, default=1.0)
    ap.add_argument("--compute", choices=("sleep", "numpy"), default="sleep")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layout", choices=("arena", "separate"), default="arena",
                    help="gradients as views of one array (buckets reduced in place, default) "
                         "or separate arrays (buckets packed into fusion buffers)")
    ap.add_argument("--json", default=None)
    return ap


def busy(seconds: float, scratch) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.multiply(scratch, 1.0001, out=scratch)


def measure_cost(comm, world, sizes, reps=5, burst=8):
    """Per-op time (max over ranks) of float32 allreduces of `sizes` bytes issued as the
    synchronizer issues them: a burst of `burst` Iallreduce calls back to back, then Wait on
    all; median over `reps` bursts. (An isolated Iallreduce + Wait underestimates the per-op
    cost inside a stream of bucket allreduces.)"""
    from mpi4py import MPI

    import aluminum_py as al
    times = []
    for n in sizes:
        xs = [np.ones(max(1, n // 4), dtype=np.float32) for _ in range(burst)]
        al.Waitall([comm.Iallreduce(x) for x in xs])
        ts = []
        for _ in range(reps):
            world.Barrier()
            t0 = time.perf_counter()
            al.Waitall([comm.Iallreduce(x) for x in xs])
            ts.append((time.perf_counter() - t0) / burst)
        times.append(world.allreduce(float(np.median(ts)), op=MPI.MAX))
    return times


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    import aluminum_py as al
    from ..overlap import GradientSynchronizer
    from ..planning import libra, osf
    from ..planning.contention import ContentionModel
    from ..planning.models import get_model
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    model = get_model(args.model)
    layers = model.layers                                   # forward order
    sizes = [max(1, int(l.params * args.scale)) for l in layers]
    from ..overlap import gradient_arena
    _arena, grads = gradient_arena([(n,) for n in sizes]) if args.layout == "arena" else \
        (None, [np.zeros(n, dtype=np.float32) for n in sizes])
    per_layer = np.array([l.flops for l in layers]) * args.batch / args.throughput
    t_f = list(per_layer * args.compute_scale)              # forward seconds (forward order)
    t_b = list(2.0 * per_layer * args.compute_scale)        # backward seconds (forward order)
    m = [g.nbytes for g in grads]
    probe = sorted({1 << k for k in range(8, 30) if (1 << k) <= 2 * sum(m)} | {sum(m)})
    cost = osf.AllreduceCost.fit(probe, measure_cost(comm, world, probe), kind="piecewise")
    policies = ["none", "fixed", "mgwfbp", "adafusion", "adafusion-ca", "libra"] \
        if args.policy == "all" else args.policy.split(",")
    runs = []
    for policy in policies:
        variants = [(f"fixed {human(t)}", {"threshold": t}) for t in FIXED_THRESHOLDS] \
            if policy == "fixed" else [(policy, {})]
        for label, extra in variants:
            opts = dict(extra)
            if policy == "adafusion-ca":          # OSF eq. 17, channel-aware variant
                policy, opts["channel_aware"] = "adafusion", True
            if policy in ("mgwfbp", "adafusion"):
                opts.update(compute_times=t_b, forward_times=t_f, cost=cost)
            if policy == "libra":
                cm = ContentionModel.example(comm.size)
                opts["plan"] = libra.optimize(m[::-1], t_b[::-1], cm, max_groups=10, chunks=100)
            try:
                sync = GradientSynchronizer(comm, grads, policy=policy, **opts)
            except (ImportError, AttributeError, NotImplementedError) as e:
                if comm.rank == 0:
                    print(f"# {label}: skipped ({e})")
                continue
            scratch = np.ones(1 << 14)
            measured = []
            for it in range(args.iters + 1):
                world.Barrier()
                t0 = time.perf_counter()
                for i in range(len(layers)):
                    (busy if args.compute == "numpy" else _sleep)(t_f[i], scratch)
                for i in reversed(range(len(layers))):
                    (busy if args.compute == "numpy" else _sleep)(t_b[i], scratch)
                    sync.grad_ready(i)
                sync.wait(timeout=120)
                dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if it:                      # the first iteration is a warm-up
                    measured.append(dt)
            groups = [(len(layers) - 1 - b[0], len(layers) - 1 - b[-1]) for b in sync.buckets]
            pred = osf.predict_iteration(t_f, t_b, m, cost, groups)
            runs.append({"policy": label, "measured": float(np.median(measured)),
                         "predicted": float(pred), "buckets": len(sync.buckets)})
    if comm.rank == 0:
        total_c = sum(t_f) + sum(t_b)
        print(f"# {args.model}: {len(layers)} layers, {sum(m) / 2**20:.1f} MiB of gradients "
              f"(scale {args.scale}), compute {total_c * 1e3:.1f} ms per iteration "
              f"({args.compute}), {comm.size} ranks, median of {args.iters} iterations")
        print(f"{'policy':<16} {'buckets':>7} {'measured ms':>12} {'OSF ms':>9} {'error':>7}")
        for r in runs:
            err = (r["predicted"] - r["measured"]) / r["measured"]
            r["error"] = err
            print(f"{r['policy']:<16} {r['buckets']:>7} {r['measured'] * 1e3:>12.2f} "
                  f"{r['predicted'] * 1e3:>9.2f} {err * 100:>6.1f}%")
        by = {r["policy"]: r["measured"] for r in runs}
        if "none" in by and "adafusion" in by:
            print(f"# adafusion vs none: {by['none'] / by['adafusion']:.2f}x faster")
        fixed = {k: v for k, v in by.items() if k.startswith("fixed")}
        if fixed and "adafusion" in by:
            best = min(fixed, key=fixed.get)
            print(f"# adafusion vs best fixed ({best}): {fixed[best] / by['adafusion']:.2f}x")
        errs = [abs(r["error"]) for r in runs]
        print(f"# OSF prediction error: median {np.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "ranks": comm.size, "scale": args.scale,
                           "runs": runs}, f, indent=1)
    comm.Free()
    return 0


def _sleep(seconds, _scratch):
    """Sleep precisely: time.sleep for all but the last 150 us (its wake-up overshoot), then
    poll the clock; the emulated layer takes its modelled time, not time.sleep's."""
    end = time.perf_counter() + seconds
    if seconds > 300e-6:
        time.sleep(seconds - 150e-6)
    while time.perf_counter() < end:
        pass


if __name__ == "__main__":
    sys.exit(main())
