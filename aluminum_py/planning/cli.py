"""``python -m aluminum_py plan libra``: a LIBRA plan for a model of the zoo, the predicted
backward time of every baseline, and the scaling simulation (paper Fig. 9)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import libra
from .contention import ContentionModel
from .models import MODELS, get_model

# per-GPU batch sizes of the paper's Table I (others: 32)
BATCH = {"xception": 32, "resnet152": 32, "vgg16": 128, "bert-base": 32}
DEFAULT_THROUGHPUT = 12e12    # sustained FP32 FLOP/s assumed for a V100 (~75% of its 15.7 TF peak)


def parse_ints(text: str) -> list[int]:
    """'128,256' or '16..2048' (powers of two) -> list."""
    if ".." in text:
        lo, hi = (int(x) for x in text.split(".."))
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    return [int(x) for x in text.split(",") if x]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m aluminum_py plan libra",
                                 description="LIBRA thread allocation and tensor fusion plan.")
    ap.add_argument("--model", required=True, choices=MODELS)
    ap.add_argument("--nodes", type=int, default=8, help="ranks (one GPU each), default 8")
    ap.add_argument("--threads", default="128..4096", help="allowed thread counts (default 128..4096)")
    ap.add_argument("--groups", type=int, default=10, help="max tensor groups K (default 10)")
    ap.add_argument("--chunks", type=int, default=150, help="computation chunks Z (default 150)")
    ap.add_argument("--batch", type=int, default=None, help="per-GPU batch (default: paper Table I)")
    ap.add_argument("--throughput", type=float, default=DEFAULT_THROUGHPUT,
                    help=f"sustained FLOP/s of one GPU (default {DEFAULT_THROUGHPUT:g})")
    ap.add_argument("--profile", default=None, help="measured per-layer profile (JSON/CSV, see "
                    "aluminum_py.planning.models.Model.from_profile) instead of FLOPs")
    ap.add_argument("--json", default=None, help="write the plans")
    ap.add_argument("--scaling", default=None, help="node counts to simulate, e.g. 16..2048")
    ap.add_argument("--plot", default=None, help="PNG of the scaling simulation")
    return ap


def workload(args):
    batch = args.batch or BATCH.get(args.model, 32)
    if args.profile:
        from .models import Model
        model = Model.from_profile(args.profile, batch=batch)
        compute = model.compute_times(batch=batch)
        forward = sum(compute) / 2.0
    else:
        model = get_model(args.model)
        compute = model.compute_times(args.throughput, batch=batch)
        forward = model.total_flops * batch / args.throughput
    return model, model.comm_bytes(4), compute, forward, batch


def scaling(comm, compute, forward, model0, nodes, threads, K, Z) -> dict:
    """Per-node throughput normalised to one node (no communication) for every method."""
    one = forward + sum(compute)
    out = {}
    for n in nodes:
        res = libra.baselines(comm, compute, model0.with_nranks(n), threads, K, Z)
        for name, plan in res.items():
            out.setdefault(name, []).append(one / (forward + plan.predicted_time))
    return out


def plot_scaling(nodes, curves: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in curves.items():
        ax.plot(nodes, ys, marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("per-node throughput / single node")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    threads = parse_ints(args.threads)
    model, comm, compute, forward, batch = workload(args)
    cm = ContentionModel.example(args.nodes)
    t0 = time.perf_counter()
    res = libra.baselines(comm, compute, cm, threads, args.groups, args.chunks)
    elapsed = time.perf_counter() - t0
    plan = res["libra"]
    names = [l.name for l in model.backward_order()]
    print(f"# {args.model}: {len(comm)} layers, {sum(comm) / 1e6:.1f} MB of fp32 gradients, "
          f"batch {batch}, backward compute {sum(compute) * 1e3:.1f} ms alone, {args.nodes} nodes "
          f"(ContentionModel.example), K={args.groups}, Z={args.chunks}, threads {threads}")
    print(f"# planned in {elapsed:.2f} s (all five methods)")
    print(f"{'group':>5} {'layers (backward order)':<52} {'MB':>8} {'threads':>8} {'max_ctas':>8}")
    for k, ((f, l), t, ctas) in enumerate(zip(plan.groups, plan.threads, plan.max_ctas())):
        span = f"{f}-{l} ({names[f]} .. {names[l]})"
        print(f"{k:>5} {span[:52]:<52} {sum(comm[f:l + 1]) / 1e6:>8.1f} {t:>8} {ctas:>8}")
    base = res["se"].predicted_time
    print(f"{'method':>8} {'backward (ms)':>14} {'groups':>7} {'vs SE':>7}")
    for name, p in res.items():
        print(f"{name:>8} {p.predicted_time * 1e3:>14.2f} {len(p.groups):>7} {base / p.predicted_time:>6.2f}x")
    out = {"model": args.model, "nodes": args.nodes, "batch": batch,
           "plans": {k: v.as_dict() for k, v in res.items()}}
    if args.scaling:
        nodes = parse_ints(args.scaling)
        curves = scaling(comm, compute, forward, cm, nodes, threads, args.groups, args.chunks)
        out["scaling"] = {"nodes": nodes, **curves}
        print(f"{'nodes':>6}" + "".join(f"{k:>9}" for k in curves))
        for i, n in enumerate(nodes):
            print(f"{n:>6}" + "".join(f"{curves[k][i]:>9.3f}" for k in curves))
        if args.plot:
            plot_scaling(nodes, curves, f"{args.model}, batch {batch}: simulated scaling "
                         f"(ContentionModel.example)", args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
