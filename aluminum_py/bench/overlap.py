"""``mpiexec -n N python -m aluminum_py bench overlap --model resnet50 --policy all``: emulated
training iterations with real gradient buffers and the GradientSynchronizer doing real fused
nonblocking allreduces; measured iteration time per policy next to OSF's prediction.

One iteration: the forward pass, then the backward pass layer by layer in reverse (the layer's
backward time, then ``grad_ready``), then ``wait()``. Layer compute times come from the model
zoo's FLOPs at an assumed throughput, scaled by ``--compute-scale``; gradient sizes are the
model's parameter counts times ``--scale``.  Layers end at absolute deadlines from the start of
the iteration (so sleep overshoot does not accumulate) and the caller sleeps until each one
(timer slack set to 1 ns): the cores stay free for the progress engine, as a GPU leaves the host
free.  ``--compute numpy`` does real numpy work until each deadline instead (it then competes
with the engine for the CPU, as CPU training does).

The allreduce cost OSF uses (and adafusion, osf and deft plan with) is measured at the start of
the run (:func:`measure_cost`): per-op times of bursts of back-to-back AVG ``Iallreduce`` calls,
as the synchronizer issues them, at sizes from 256 B to all the gradients, log-log
interpolated (``--cost``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ..overlap.autotune import DEFAULT_THRESHOLDS as FIXED_THRESHOLDS  # auto's fixed candidates
from .timing import human


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m aluminum_py bench overlap",
                                 description="Overlapped gradient allreduce per fusion policy.")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--policy", default="all",
                    help="comma-separated: none,fixed,mgwfbp,adafusion,adafusion-ca,osf,libra,deft,auto "
                         "or all")
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
    ap.add_argument("--deft-threshold", type=int, default=4 << 20,
                    help="bucket size for policy deft (bytes, default 4 MiB)")
    ap.add_argument("--cost", choices=("table", "piecewise", "alpha_beta"), default="table",
                    help="allreduce cost model fitted to the probe (default: the measured "
                         "points, log-log interpolated)")
    ap.add_argument("--per-op", default="calibrate",
                    help="per-op host cost added to the burst cost (seconds), 0, or "
                         "'calibrate' (default): fitted to measured WFBP iterations first")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="after the timed iterations, record 3 more per policy in a timeline: "
                         "DIR/POLICY.rankN.json, merged into DIR/POLICY.json and drawn in "
                         "DIR/POLICY.png (docs/timeline.md)")
    return ap


def measure_cost(comm, world, sizes, reps=5, burst=8, op=None, arena=None, max_ops=256):
    """Per-op time (max over ranks, median over `reps`) of float32 allreduces (`op`, default
    AVG as the synchronizer's) of `sizes` bytes, in bursts of `burst` Iallreduce calls back to
    back then Wait on all.  (A single Iallreduce + Wait overestimates the per-op cost of a
    stream of bucket allreduces, whose latencies overlap.)

    Without `arena`: one burst on fresh arrays.  With `arena` (the flat float32 array the
    gradients are views of): every consecutive slice of it, up to `max_ops`, in bursts -- the
    memory a step's buckets reduce, in their order, so the probe meets the caches as the
    training step does (a burst on 8 fresh arrays is colder: 1 MiB costs about twice as
    much)."""
    import aluminum_py as al
    from mpi4py import MPI
    op = al.AVG if op is None else op
    times = []
    for n in sizes:
        c = max(1, n // 4)
        if arena is not None and c <= arena.size:
            xs = [arena[k * c:(k + 1) * c] for k in range(min(max_ops, arena.size // c))]
        else:
            xs = [np.ones(c, dtype=np.float32) for _ in range(burst)]

        def run():
            for k in range(0, len(xs), burst):
                al.Waitall([comm.Iallreduce(x, op=op) for x in xs[k:k + burst]])

        run()
        ts = []
        for _ in range(reps):
            world.Barrier()
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) / len(xs))
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
    fine_timer_slack()
    comm = al.Communicator()
    model = get_model(args.model)
    layers = model.layers                                   # forward order
    sizes = [max(1, int(l.params * args.scale)) for l in layers]
    from ..overlap import gradient_arena
    arena, grads = gradient_arena([(n,) for n in sizes]) if args.layout == "arena" else \
        (None, [np.zeros(n, dtype=np.float32) for n in sizes])
    per_layer = np.array([l.flops for l in layers]) * args.batch / args.throughput
    t_f = list(per_layer * args.compute_scale)              # forward seconds (forward order)
    t_b = list(2.0 * per_layer * args.compute_scale)        # backward seconds (forward order)
    m = [g.nbytes for g in grads]
    probe = sorted({1 << k for k in range(8, 30, 2) if (1 << k) <= sum(m)} | {sum(m)})
    cost = osf.AllreduceCost.fit(probe, measure_cost(comm, world, probe, arena=arena),
                                 kind=args.cost)
    per_op = 0.0
    if args.per_op == "calibrate":     # fit the per-op host cost to WFBP's measured iterations
        cal = GradientSynchronizer(comm, grads, policy="none")
        t_cal = float(np.median([emulate_iteration(world, t_f, t_b, cal, args.compute)[0]
                                 for _ in range(args.iters + 1)][1:]))
        per_op = osf.calibrate_per_op(t_f, t_b, m, cost, [(k, k) for k in range(len(m))], t_cal)
    elif args.per_op != "0":
        per_op = float(args.per_op)
    cost = cost.plus(per_op)
    if comm.rank == 0:
        print(f"# allreduce cost ({args.cost} fit) per op in bursts: "
              + ", ".join(f"{human(n)} {cost.base(n) * 1e6:.0f} us" for n in probe)
              + f"; per-op host cost {per_op * 1e6:.1f} us ({args.per_op})")
    policies = ["none", "fixed", "mgwfbp", "adafusion", "adafusion-ca", "osf", "libra", "deft",
                "auto"] if args.policy == "all" else args.policy.split(",")
    runs = []                                 # label, synchronizer, prediction, predictor
    for policy in policies:
        variants = [(f"fixed {human(t)}", {"threshold": t}) for t in FIXED_THRESHOLDS] \
            if policy == "fixed" else [(policy, {})]
        for label, extra in variants:
            opts = dict(extra)
            if policy == "adafusion-ca":          # OSF eq. 17, channel-aware variant
                policy, opts["channel_aware"] = "adafusion", True
            if policy in ("mgwfbp", "adafusion", "osf", "deft", "auto"):
                opts.update(compute_times=t_b, forward_times=t_f, cost=cost)
            if policy == "deft":
                opts["threshold"] = args.deft_threshold
            if policy == "libra":
                cm = ContentionModel.example(comm.size)
                opts["plan"] = libra.optimize(m[::-1], t_b[::-1], cm, max_groups=10, chunks=100)
            try:
                sync = GradientSynchronizer(comm, grads, policy=policy, **opts)
            except (ImportError, ValueError) as e:
                if comm.rank == 0:
                    print(f"# {label}: skipped ({e})")
                continue
            if policy == "auto":   # tune first, on consecutive steps (they time each other)
                while sync.chosen is None:
                    emulate_iteration(world, t_f, t_b, sync, args.compute)
                if comm.rank == 0:
                    print(f"# auto: chose {sync.chosen} after {sync.iteration} steps; median "
                          "step ms: " + ", ".join(f"{k} {v * 1e3:.2f}"
                                                  for k, v in sync.tuning_report.items()))
            extra = {"chosen": sync.chosen, "tuning_report": sync.tuning_report} \
                if policy == "auto" else {}
            runs.append({"policy": label, "sync": sync, **predict(sync, t_f, t_b, m, cost),
                         **extra})
    # Iterations round-robin over the policies (and a compute-only row), so that slow drifts
    # of the machine affect every policy alike; the first round is a warm-up.
    rows = [{"policy": "compute only", "sync": None, "predicted": sum(t_f) + sum(t_b),
             "model": "-"}] + runs
    times = {id(r): [] for r in rows}
    updates = {id(r): 0 for r in rows}
    for rnd in range(args.iters + 1):
        for r in rows:
            dt, info = emulate_iteration(world, t_f, t_b, r["sync"], args.compute)
            if rnd:
                times[id(r)].append(dt)
                updates[id(r)] += bool(info is None or info.update)
    if args.timeline:
        for r in runs:
            record_timeline(args.timeline, r["policy"], comm, world, t_f, t_b, r["sync"],
                            args.compute)
    for r in rows:
        sync = r.pop("sync")
        if sync is not None:
            sync.flush(timeout=120)            # deft: the held gradients' allreduces
        r["measured"] = float(np.median(times[id(r)]))
        r["buckets"] = len(sync.buckets) if sync is not None else 0
        r["updates_per_iteration"] = updates[id(r)] / args.iters
        r["error"] = (r["predicted"] - r["measured"]) / r["measured"]
    if comm.rank == 0:
        report(args, rows, comm.size, len(layers), sum(m), sum(t_f) + sum(t_b))
    comm.Free()
    return 0


def predict(sync, t_f, t_b, m, cost):
    """The model's iteration time for a synchronizer: OSF's timeline of its buckets
    (osf.predict_iteration), or for policy "deft" the DeFT simulator on its pieces (steady
    state)."""
    if sync.policy == "deft":
        from ..planning import deft
        d = sync._deft
        comm_t, f, b, scale = d._sched_args
        res = deft.simulate(list(zip(f, b, comm_t)), "deft", partition_time=None,
                            capacity_scale=scale, iterations=24, warmup=4)
        return {"predicted": res.iteration_time, "model": "DeFT sim",
                "predicted_updates": res.updates_per_iteration}
    from ..planning import osf
    n = len(m)
    groups = [(n - 1 - b[0], n - 1 - b[-1]) for b in sync.buckets]
    return {"predicted": osf.predict_iteration(t_f, t_b, m, cost, groups), "model": "OSF"}


def speedups(by: dict, names) -> list[str]:
    """'# name: Xx vs none, Yx vs best fixed (threshold)' for each policy of `names` measured
    in `by` (policy label -> seconds)."""
    fixed = {k: v for k, v in by.items() if k.startswith("fixed")}
    best = min(fixed, key=fixed.get) if fixed else None
    return [f"# {name}: {by['none'] / by[name]:.2f}x vs none"
            + (f", {fixed[best] / by[name]:.2f}x vs best fixed ({best})" if best else "")
            for name in names if name in by and "none" in by]


def report(args, rows, size, nlayers, nbytes, t_comp):
    print(f"# {args.model}: {nlayers} layers, {nbytes / 2**20:.1f} MiB of gradients "
          f"(scale {args.scale}), compute {t_comp * 1e3:.2f} ms per iteration "
          f"({args.compute}), {size} ranks, median of {args.iters} iterations")
    print(f"{'policy':<16} {'buckets':>7} {'measured ms':>12} {'model ms':>9} {'error':>7}  model")
    for r in rows:
        extra = (f": {r['updates_per_iteration']:.2f} updates/iteration "
                 f"(simulated {r['predicted_updates']:.2f})" if "predicted_updates" in r else "")
        print(f"{r['policy']:<16} {r['buckets']:>7} {r['measured'] * 1e3:>12.2f} "
              f"{r['predicted'] * 1e3:>9.2f} {r['error'] * 100:>6.1f}%  {r['model']}{extra}")
    for line in speedups({r["policy"]: r["measured"] for r in rows},
                         ("adafusion", "osf", "auto")):
        print(line)
    errs = [abs(r["error"]) for r in rows if r["model"] == "OSF"]
    if errs:
        print(f"# OSF prediction error over {len(errs)} policies: median "
              f"{np.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "ranks": size, "scale": args.scale,
                       "throughput": args.throughput, "compute": args.compute,
                       "runs": rows}, f, indent=1)


def record_timeline(directory: str, label: str, comm, world, t_f, t_b, sync, compute,
                    iters: int = 3) -> None:
    """`iters` iterations of policy `label` in a timeline (every rank), merged and drawn by rank
    0 into DIR/LABEL.json and DIR/LABEL.png."""
    import os

    from .. import timeline
    from ..timeline.merge import merge
    from ..timeline.plot import plot
    name = label.replace(" ", "_")
    timeline.start(os.path.join(directory, name + ".json"), comm)
    try:
        for _ in range(iters):
            emulate_iteration(world, t_f, t_b, sync, compute)
    finally:
        timeline.stop()
    world.Barrier()                       # every rank's file is complete
    if comm.rank == 0:
        files = [os.path.join(directory, f"{name}.rank{r}.json") for r in range(world.size)]
        merge(files, os.path.join(directory, name + ".json"))
        plot(os.path.join(directory, name + ".json"), os.path.join(directory, name + ".png"),
             title=f"bench overlap: {label}, {world.size} ranks")
        print(f"# timeline of {label}: {os.path.join(directory, name + '.png')}")


def fine_timer_slack() -> None:
    """Linux: timer slack 1 ns for this thread (prctl PR_SET_TIMERSLACK), so a sleep wakes
    within the scheduler's latency instead of up to 50 us late; elsewhere nothing."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def until(deadline: float, compute: str = "sleep", scratch=None) -> None:
    """Emulated compute up to `deadline` (perf_counter seconds): sleep, or numpy work."""
    if compute == "numpy":
        while time.perf_counter() < deadline:
            np.multiply(scratch, 1.0001, out=scratch)
        return
    rest = deadline - time.perf_counter()
    if rest > 0:
        time.sleep(rest)


_SCRATCH = np.ones(1 << 12)


def emulate_iteration(world, t_f, t_b, sync=None, compute="sleep"):
    """One emulated training iteration (forward, backward with grad_ready, wait); returns its
    time (the maximum over ranks) and wait()'s SyncInfo.  Layer i's forward/backward ends at a deadline from the
    start (cumulative modelled times)."""
    from mpi4py import MPI
    from .. import timeline
    world.Barrier()
    t0 = deadline = time.perf_counter()
    with timeline.region("forward"):
        for i in range(len(t_f)):
            deadline += t_f[i]
            until(deadline, compute, _SCRATCH)
    with timeline.region("backward"):
        for i in reversed(range(len(t_b))):
            deadline += t_b[i]
            until(deadline, compute, _SCRATCH)
            if sync is not None:
                sync.grad_ready(i)
    with timeline.region("wait"):
        info = sync.wait(timeout=120) if sync is not None else None
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX), info


if __name__ == "__main__":
    sys.exit(main())
