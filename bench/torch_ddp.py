"""PyTorch data-parallel training: DDP with gloo's allreduce vs DDP + ``allreduce_hook`` vs
``synchronize_gradients`` (no DDP), step time and final parameters.

    mpiexec -n 2 python bench/torch_ddp.py [--models cnn,mlp] [--rounds 5] [--steps 6]
        [--check-steps 20] [--json out.json] [--plot out.png]

Every rank joins a gloo process group (rendezvous: a file named by rank 0 over MPI; DDP needs a
group for its set-up even with a hook). Per model, three trainers start from the same initial
parameters and see the same data (per rank: its own random batch, a fixed seed):

* ``gloo``: ``DistributedDataParallel(model)``, its built-in allreduce on the gloo group;
* ``hook``: the same DDP with ``register_comm_hook(comm, aluminum_py.torch.allreduce_hook)``;
* ``sync``: no DDP: ``aluminum_py.torch.synchronize_gradients(model, comm, policy="auto")``,
  whose tuning steps run (untimed) before the measurement;
* with ``--local``, also ``local``: the model alone, no averaging (the compute's own time), and
  ``nocomm``: DDP with a hook that returns each bucket unchanged (DDP's own bucketing and
  copies, no communication: the bound for any comm hook).

Models: ``cnn``, five conv layers and two linear layers, 6.3 M float32 parameters (25 MB of
gradients), 32x32 RGB inputs; ``mlp``, 48 linear layers of 128x128 (97 gradients, 3.2 MB).
Timing: ``rounds`` rounds, each running ``steps`` steps of every trainer in turn (interleaved,
so a slow phase of the shared machine hits all three); a step's time is the maximum over ranks;
reported: the median over every measured step, and the speed-up over ``gloo``.  Then every
trainer restarts from the initial parameters and trains ``check-steps`` steps: the largest
parameter difference from ``gloo`` DDP, and whether they are bitwise equal.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import aluminum_py as al  # noqa: E402
import aluminum_py.torch as alt  # noqa: E402

import harness  # noqa: E402  (bench/: the run's stamp)

TRAINERS = ("gloo", "hook", "sync")
EXTRA = ("local", "nocomm")     # --local: the same step without any gradient averaging


def nocomm_hook(state, bucket):
    """A DDP comm hook that communicates nothing: DDP's cost without an allreduce."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def cnn():
    """6.3 M parameters (25 MB of float32 gradients), 32x32x3 inputs, 10 classes."""
    c = torch.nn
    return c.Sequential(
        c.Conv2d(3, 64, 3, padding=1), c.ReLU(),
        c.Conv2d(64, 128, 3, padding=1), c.ReLU(), c.MaxPool2d(2),        # 16x16
        c.Conv2d(128, 256, 3, padding=1), c.ReLU(), c.MaxPool2d(2),       # 8x8
        c.Conv2d(256, 256, 3, padding=1), c.ReLU(), c.MaxPool2d(2),       # 4x4
        c.Conv2d(256, 512, 3, padding=1), c.ReLU(),
        c.Flatten(), c.Linear(512 * 4 * 4, 512), c.ReLU(), c.Linear(512, 10))


def mlp(layers=48, width=128):
    """Many small layers: `layers` linear layers width x width (+ a 10-class head)."""
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))


MODELS = {"cnn": (cnn, lambda n, g: torch.randn(n, 3, 32, 32, generator=g), 8),
          "mlp": (mlp, lambda n, g: torch.randn(n, 128, generator=g), 64)}


_store_dir = None


def init_process_group(world):
    """A gloo group over a file store in rank 0's temporary directory (removed at exit)."""
    global _store_dir
    _store_dir = tempfile.TemporaryDirectory(prefix="al-bench-") if world.rank == 0 else None
    path = world.bcast(os.path.join(_store_dir.name, "store") if _store_dir else None, root=0)
    dist.init_process_group("gloo", init_method=f"file://{path}",
                            rank=world.rank, world_size=world.size)


class Trainer:
    """One way of training the model: forward, backward (with its gradient averaging), step."""

    def __init__(self, kind, initial, comm, batch, group=None):
        """`group`: the process group of the DDP kinds (None: the default group)."""
        self.kind = kind
        self.model = copy.deepcopy(initial)
        self.sync = None
        if kind == "sync":
            self.net = self.model
            self.sync = alt.synchronize_gradients(self.model, comm, policy="auto")
        elif kind == "local":
            self.net = self.model
        else:
            self.net = DDP(self.model, process_group=group)
            if kind == "hook":
                self.net.register_comm_hook(comm, alt.allreduce_hook)
            elif kind == "nocomm":
                self.net.register_comm_hook(None, nocomm_hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x, self.y = batch
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self):
        if self.sync is not None:
            self.sync.zero_grad()
        else:
            self.opt.zero_grad()
        self.loss(self.net(self.x), self.y).backward()
        if self.sync is not None:
            self.sync.wait(timeout=120)
        self.opt.step()

    def tuned(self):
        return self.sync is None or self.sync.synchronizer.chosen is not None

    def flat(self):
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in self.model.parameters()]).clone()


def bench_model(name, args, world, comm):
    build, inputs, per_rank = MODELS[name]
    torch.manual_seed(1234)
    initial = build()
    g = torch.Generator().manual_seed(100 + world.rank)
    batch = (inputs(per_rank, g), torch.randint(0, 10, (per_rank,), generator=g))
    nparams = sum(p.numel() for p in initial.parameters())
    kinds = TRAINERS + (EXTRA if args.local else ())
    trainers = {k: Trainer(k, initial, comm, batch) for k in kinds}
    say = world.rank == 0
    if say:
        print(f"# {name}: {nparams / 1e6:.2f} M parameters, {nparams * 4 / 1e6:.1f} MB of "
              f"gradients, {len(list(initial.parameters()))} tensors, batch {per_rank} per rank",
              flush=True)
    tune = 0
    while not trainers["sync"].tuned():          # auto's tuning steps, not measured
        trainers["sync"].step()
        tune += 1
    for t in trainers.values():                  # warm-up (DDP rebuilds its buckets)
        for _ in range(2):
            t.step()
    times = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k, t in trainers.items():
            mine = []
            for _ in range(args.steps):
                world.Barrier()
                t0 = time.perf_counter()
                t.step()
                mine.append(time.perf_counter() - t0)
            worst = np.array(mine)
            world.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
            times[k] += worst.tolist()
        if say:
            print(f"  round {r + 1}/{args.rounds}: " + "  ".join(
                f"{k} {np.median(times[k]) * 1e3:.1f} ms" for k in kinds), flush=True)
    chosen = trainers["sync"].sync.synchronizer.chosen
    # parameters after check-steps steps, from the same initial parameters
    fresh = {k: Trainer(k, initial, comm, batch) for k in TRAINERS}
    for _ in range(args.check_steps):
        for t in fresh.values():
            t.step()
    ref = fresh["gloo"].flat()
    diffs = {k: float((fresh[k].flat() - ref).abs().max()) for k in TRAINERS}
    diffs = {k: world.allreduce(v, op=MPI.MAX) for k, v in diffs.items()}
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {"model": name, "parameters": nparams, "gradient_bytes": nparams * 4,
              "median_step_s": med, "speedup_vs_gloo": {k: med["gloo"] / med[k] for k in med},
              "auto_chosen": chosen, "auto_tuning_steps": tune,
              "check_steps": args.check_steps, "max_param_diff_vs_gloo": diffs,
              "steps_measured": len(times["gloo"])}
    if say:
        print(f"  median step: " + "  ".join(
            f"{k} {med[k] * 1e3:.1f} ms ({med['gloo'] / med[k]:.2f}x)" for k in kinds) +
            f"; sync chose {chosen!r} after {tune} tuning steps", flush=True)
        print(f"  after {args.check_steps} steps, max |param - gloo DDP|: " + "  ".join(
            f"{k} {diffs[k]:.3g}{' (bitwise)' if diffs[k] == 0 else ''}"
            for k in TRAINERS if k != "gloo"), flush=True)
    for t in list(trainers.values()) + list(fresh.values()):
        if t.sync is not None:
            t.sync.remove()
    return result


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    w = 0.25
    for j, k in enumerate(TRAINERS):
        ax.bar([i + (j - 1) * w for i in range(len(results))],
               [r["median_step_s"][k] * 1e3 for r in results], w, label=k)
    ax.set_xticks(range(len(results)), [r["model"] for r in results])
    ax.set_ylabel("median step (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per trainer per round")
    ap.add_argument("--check-steps", type=int, default=20)
    ap.add_argument("--local", action="store_true",
                    help="also time the step without gradient averaging")
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--plot", help="write a PNG bar chart here (rank 0)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_process_group(world)
    comm = al.Communicator()
    stamp = harness.stamp(world)
    if world.rank == 0:
        print(f"# {stamp['command']}: {world.size} ranks, {stamp['date']}, load {stamp['load']} "
              f"on {stamp['cpus']} CPUs, torch {torch.__version__}, 1 thread per rank, "
              f"{args.rounds} rounds x {args.steps} steps per trainer", flush=True)
    results = [bench_model(m, args, world, comm) for m in args.models.split(",")]
    if world.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**stamp, "torch": torch.__version__, "results": results}, f,
                          indent=1)
        if args.plot:
            plot(results, args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
