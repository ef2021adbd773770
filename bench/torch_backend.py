"""torch.distributed on the "aluminum" backend against a gloo group of the same ranks, in one job,
interleaved: per-call collectives, DDP training steps, FSDP2 steps and a tensor-parallel
inference block.

    mpiexec -n 2 python bench/torch_backend.py [--parts collectives,ddp,fsdp,tp] [--quick]
        [--json FILE] [--backend aluminum] [--max-bytes 64MiB] [--budget 0.5] [--steps 20]
        [--no-deepspeed] [--no-comm]

The default group is ``init_process_group("aluminum", init_method="mpi://")`` (``--backend
gloo``: a gloo default group over a file store, to debug the script without our backend); the
peer is ``dist.new_group(backend="gloo")`` over the same ranks.  Parts (``--parts``):

* ``collectives``: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single
  and broadcast, float32, 4 B to ``--max-bytes`` in powers of 4 (``bytes``: the larger buffer of
  the call, the all-gather's output, the reduce-scatter's input, at least one element per rank),
  on both groups, and (unless ``--no-comm``) the same call on ``al.Communicator`` with numpy
  arrays (``comm``: the library's own cost, the floor for the backend).  Each contender's first
  call at each size is checked against numpy's result from every rank's input.
* ``ddp``: the CNN and the MLP of bench/torch_ddp.py: DDP on the default group, DDP on the gloo
  group, and DDP on the gloo group with ``aluminum_py.torch.allreduce_hook`` (state
  ``al.Communicator()``); parameters compared with gloo DDP's after the timed steps.
* ``fsdp``: FSDP2 ``fully_shard`` of a small transformer (TransformerEncoderLayers, each layer
  and the root sharded), forward + backward + SGD step, on a DeviceMesh over each group;
  parameters compared with a single-process model trained on every rank's batch.
* ``tp``: a Megatron-style tensor-parallel block (attention output projection, row-parallel;
  MLP 4x, column- then row-parallel), one all_reduce of the [batch x hidden] activation per
  layer, with the all_reduce on the default group, on gloo, on DeepSpeed's SHM
  ``inference_all_reduce`` (bench/deepspeed_peer.py; skipped with its reason if it cannot
  build) and on nothing (``none``: the compute alone); also each all_reduce alone.  Outputs
  checked against the block reduced in float64 by mpi4py.

Timing: ``aluminum_py.bench.timing.time_interleaved``: per repetition the contenders run in a
fresh random order, each call after a barrier; a sample is the max over ranks; medians are
quoted.  Progress and tables on rank 0; ``--json`` writes the stamp and every figure as JSON.  Exit status 1
if any result is wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import aluminum_py as al  # noqa: E402
from aluminum_py.bench.timing import human, iterations, parse_bytes, time_interleaved  # noqa: E402

import harness  # noqa: E402  (bench/: the stamp and the result check)

import torch_ddp  # noqa: E402  (bench/: its models and trainer)
from peers import check_input  # noqa: E402

# torch 2.13 prefers all_gather_single / reduce_scatter_single; the names users know are timed
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is "
                                          r"deprecated", category=FutureWarning)

PARTS = ("collectives", "ddp", "fsdp", "tp")
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast")
SHORT = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "alltoall",
         "broadcast": "broadcast"}
GOALS = "at 2 ranks: collectives >= 2x gloo up to 64 KiB and never slower; DDP >= gloo+hook; " \
        "FSDP2 >= 1.3x gloo; TP block >= 3x gloo and faster than DeepSpeed"


def say(world, *text):
    if world.rank == 0:
        print(*text, flush=True)


# ---------------------------------------------------------------------------------- set-up

def init_groups(world, backend: str):
    """The default group on `backend` (gloo: over a file store, bench/torch_ddp.py's) and a gloo
    group of the same ranks."""
    if backend == "aluminum":
        import aluminum_py.torch  # noqa: F401  (registers the backend and mpi://)
        if "aluminum" not in dist.Backend.backend_list:
            raise SystemExit("torch_backend.py: this aluminum_py.torch registers no 'aluminum' "
                             "backend; run with --backend gloo to debug the script")
        dist.init_process_group("aluminum", init_method="mpi://")
    else:
        torch_ddp.init_process_group(world)
    return dist.group.WORLD, dist.new_group(backend="gloo")


def machine_state(world) -> dict:
    return {**harness.stamp(world), "torch": torch.__version__}


def medians(samples: dict) -> dict:
    return {k: float(np.median(v)) for k, v in samples.items()}


# ---------------------------------------------------------------------------- collectives

def collective_case(name: str, count: int, p: int, rank: int):
    """(input, output or None for in place, expected result) of `name` on this rank; count is
    the element count of the larger buffer (a multiple of p)."""
    blk = count // p
    if name == "all_reduce":
        return check_input(count, rank), None, sum(check_input(count, r) for r in range(p))
    if name == "all_gather_into_tensor":
        return (check_input(blk, rank), np.empty(count, np.float32),
                np.concatenate([check_input(blk, r) for r in range(p)]))
    if name == "reduce_scatter_tensor":
        full = sum(check_input(count, r) for r in range(p))
        return check_input(count, rank), np.empty(blk, np.float32), full[rank * blk:][:blk]
    if name == "all_to_all_single":
        return (check_input(count, rank), np.empty(count, np.float32),
                np.concatenate([check_input(count, r)[rank * blk:][:blk] for r in range(p)]))
    return check_input(count, rank), None, check_input(count, 0)          # broadcast from 0


def torch_collective(name: str, group, inp: np.ndarray, out):
    """dist.<name> on `group` with tensors of copies of inp / out; call.result() its output."""
    i = torch.from_numpy(inp.copy())
    o = torch.from_numpy(out.copy()) if out is not None else i
    call = {"all_reduce": lambda: dist.all_reduce(i, group=group),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(o, i, group=group),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(o, i, group=group),
            "all_to_all_single": lambda: dist.all_to_all_single(o, i, group=group),
            "broadcast": lambda: dist.broadcast(i, src=0, group=group)}[name]
    call.result, call.buffer = o.numpy, i
    return call


def comm_collective(name: str, comm, inp: np.ndarray, out):
    """The same collective on al.Communicator with numpy arrays."""
    i = inp.copy()
    o = out.copy() if out is not None else i
    call = {"all_reduce": lambda: comm.Allreduce(i),
            "all_gather_into_tensor": lambda: comm.Allgather(i, o),
            "reduce_scatter_tensor": lambda: comm.Reduce_scatter(i, o),
            "all_to_all_single": lambda: comm.Alltoall(i, o),
            "broadcast": lambda: comm.Bcast(i, root=0)}[name]
    call.result, call.buffer = (lambda: o), i
    return call


def collective_sizes(hi: int, quick: bool) -> list[int]:
    sizes, n = [], 4
    while n <= hi:
        sizes.append(n)
        n *= 4
    return [s for s in sizes if s in (4, 1024, 65536)] if quick else sizes


def part_collectives(world, groups: dict, comm, args, skipped: dict) -> tuple[list, bool]:
    p, first = world.size, next(iter(groups))
    names = list(groups) + (["comm"] if comm is not None else [])
    say(world, f"\n## collectives: float32, median of max over ranks (us); ratio = gloo / {first}"
               + ("; comm = al.Communicator with numpy arrays" if comm is not None else ""))
    say(world, f"{'bytes':>9} {'collective':>15}" + "".join(f" {n:>10}" for n in names)
        + f" {'gloo/' + first:>14}")
    rows, wrong_any = [], False
    for nbytes in collective_sizes(parse_bytes(args.max_bytes), args.quick):
        count = max(p, -(-nbytes // 4 // p) * p)
        hi = 200 if nbytes <= (1 << 20) else 30
        for name in COLLECTIVES:
            inp, out, expected = collective_case(name, count, p, world.rank)
            calls = {k: torch_collective(name, g, inp, out) for k, g in groups.items()}
            if comm is not None:
                calls["comm"] = comm_collective(name, comm, inp, out)
            wrong, dropped = harness.check(world, calls, {k: expected for k in calls})
            for k, why in dropped.items():
                skipped[f"{name} {nbytes} B {k}"] = why
                say(world, f"# {name} {nbytes} B {k}: left out, {why}")
            wrong_any = wrong_any or bool(wrong)
            if name == "all_reduce":            # repeated in-place sums of zeros stay zero
                for c in calls.values():
                    c.buffer[...] = 0
            iters = iterations(world, calls, args.budget, lo=5, hi=hi)
            med = medians(time_interleaved(world, calls, iters))
            row = {"bytes": nbytes, "count": count, "collective": name, "iters": iters,
                   **{k: v * 1e6 for k, v in med.items()}, "wrong": wrong}
            if first in med and "gloo" in med and first != "gloo":
                row["ratio"] = med["gloo"] / med[first]
            rows.append(row)
            say(world, f"{nbytes:>9} {SHORT[name]:>15}" + "".join(
                f" {row[k]:>9.1f}{'!' if k in wrong else ' '}" if k in row else f" {'-':>10}"
                for k in names) + (f" {row['ratio']:>13.2f}x" if "ratio" in row else ""))
    if world.rank == 0 and "gloo" in groups and first != "gloo":
        print(f"\n### time per call (us), {first} / gloo (ratio gloo/{first})")
        print(f"{'bytes':>9}" + "".join(f" {SHORT[c]:>24}" for c in COLLECTIVES))
        for nbytes in sorted({r["bytes"] for r in rows}):
            cells = []
            for c in COLLECTIVES:
                r = next(r for r in rows if r["bytes"] == nbytes and r["collective"] == c)
                cells.append(f"{r.get(first, float('nan')):.1f}/{r.get('gloo', float('nan')):.1f}"
                             f" ({r.get('ratio', float('nan')):.2f}x)")
            print(f"{human(nbytes):>9}" + "".join(f" {c:>24}" for c in cells))
    return rows, wrong_any


# -------------------------------------------------------------------------------------- DDP

def part_ddp(world, groups: dict, comm, args) -> list:
    first = next(iter(groups))
    models = ["mlp"] if args.quick else ["cnn", "mlp"]
    say(world, f"\n## DDP training step (ms, median of max over ranks, {args.steps} steps per "
               f"trainer, interleaved); speed-up = gloo / trainer; local = no gradient averaging "
               f"(the bound)")
    results = []
    for name in models:
        build, inputs, per_rank = torch_ddp.MODELS[name]
        torch.manual_seed(1234)
        initial = build()
        g = torch.Generator().manual_seed(100 + world.rank)
        batch = (inputs(per_rank, g), torch.randint(0, 10, (per_rank,), generator=g))
        trainers = {first: torch_ddp.Trainer("gloo", initial, comm, batch, group=groups[first])}
        if "gloo" in groups and first != "gloo":
            trainers["gloo"] = torch_ddp.Trainer("gloo", initial, comm, batch,
                                                 group=groups["gloo"])
        trainers["gloo+hook"] = torch_ddp.Trainer("hook", initial, comm, batch,
                                                  group=groups["gloo"])
        if hasattr(groups[first], "comm"):      # DDP on aluminum + allreduce_hook on its comm
            trainers[f"{first}+hook"] = torch_ddp.Trainer("hook", initial, groups[first].comm,
                                                          batch, group=groups[first])
        trainers["local"] = torch_ddp.Trainer("local", initial, comm, batch)  # the bound
        for t in trainers.values():              # warm-up: DDP rebuilds its buckets
            for _ in range(2):
                t.step()
        med = medians(time_interleaved(world, {k: t.step for k, t in trainers.items()},
                                       args.steps))
        ref = trainers["gloo"].flat() if "gloo" in trainers else trainers[first].flat()
        diffs = {k: world.allreduce(float((t.flat() - ref).abs().max()), op=MPI.MAX)
                 for k, t in trainers.items() if k != "local"}
        base = med.get("gloo", med[first])
        say(world, f"{name:>4}: " + "  ".join(
            f"{k} {v * 1e3:.1f} ms ({base / v:.2f}x)" for k, v in med.items())
            + f"  [{sum(p.numel() for p in initial.parameters()) / 1e6:.2f} M parameters]")
        say(world, f"      after {args.steps + 2} steps, max |param - gloo DDP|: " + "  ".join(
            f"{k} {d:.3g}{' (bitwise)' if d == 0 else ''}" for k, d in diffs.items()))
        if args.profile:
            say(world, "\n## profile: " + profiled(world, trainers[first].step, 3,
                                                    f"DDP {name} step on {first}"))
        results.append({"model": name, "median_step_ms": {k: v * 1e3 for k, v in med.items()},
                        "steps": args.steps, "max_param_diff_vs_gloo": diffs})
    return results


# ------------------------------------------------------------------------------------ FSDP2

class Transformer(torch.nn.Module):
    """`layers` TransformerEncoderLayers (d_model d, 4d feed-forward, no dropout) and a linear
    head to one output per token."""

    def __init__(self, d: int, layers: int, heads: int):
        super().__init__()
        torch.manual_seed(4321)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.reshape(-1, x.shape[-1]))        # [tokens, 1], not a view


def fsdp_batch(rank: int, batch: int, seq: int, d: int):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(batch, seq, d, generator=g), torch.randn(batch * seq, 1, generator=g)


class FsdpTrainer:
    """SGD with momentum, not Adam: Adam's update does not change when every gradient is scaled,
    so it would hide a sum returned where the mean was due (pytorch#162338)."""

    def __init__(self, model, data):
        self.model, (self.x, self.y) = model, data
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(self):
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()


def part_fsdp(world, groups: dict, args) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    d, layers, batch, seq = (64, 2, 4, 16) if args.quick else args.fsdp
    heads = 8 if d % 8 == 0 else 1
    first = next(iter(groups))
    data = fsdp_batch(world.rank, batch, seq, d)
    trainers = {}
    for name, group in groups.items():
        model = Transformer(d, layers, heads)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trainers[name] = FsdpTrainer(model, data)
    trainers["local"] = FsdpTrainer(Transformer(d, layers, heads), data)   # no communication
    nparams = sum(p.numel() for p in Transformer(d, layers, heads).parameters())
    say(world, f"\n## FSDP2 step (forward + backward + SGD with momentum), {layers} x "
               f"TransformerEncoderLayer(d_model {d}, {heads} heads), {nparams / 1e6:.2f} M "
               f"parameters, batch {batch} x {seq} tokens per rank; ms, median of {args.steps}; "
               f"local = the unsharded model on this rank's batch, no communication (the bound)")
    for t in trainers.values():
        t.step()
    med = medians(time_interleaved(world, {k: t.step for k, t in trainers.items()}, args.steps))
    # the reference: one process, every rank's batch, the same number of steps
    ref = FsdpTrainer(Transformer(d, layers, heads),
                      [torch.cat(z) for z in zip(*(fsdp_batch(r, batch, seq, d)
                                                   for r in range(world.size)))])
    for _ in range(args.steps + 1):
        ref.step()
    diffs = {}
    with torch.no_grad():
        for name in groups:
            diff = max(float((p.full_tensor() - q).abs().max())
                       for p, q in zip(trainers[name].model.parameters(),
                                       ref.model.parameters()))
            diffs[name] = world.allreduce(diff, op=MPI.MAX)
    base = med.get("gloo", med[first])
    say(world, "  " + "  ".join(f"{k} {v * 1e3:.1f} ms ({base / v:.2f}x)"
                                for k, v in med.items()))
    say(world, f"  after {args.steps + 1} steps, max |param - single-process reference|: "
        + "  ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    if args.profile:
        say(world, "\n## profile: " + profiled(world, trainers[first].step, 3,
                                                f"FSDP2 step on {first}"))
    return {"d_model": d, "layers": layers, "parameters": nparams, "batch": batch, "seq": seq,
            "median_step_ms": {k: v * 1e3 for k, v in med.items()}, "steps": args.steps,
            "max_param_diff_vs_reference": diffs}


# --------------------------------------------------------------------- tensor-parallel block

class TPBlock:
    """One rank's shards of a transformer block's matrices, p ranks: the attention output
    projection (row-parallel: this rank's heads' context [b, h/p] times Wo [h/p, h]) and the
    MLP (column-parallel W1 [h, 4h/p], GELU, row-parallel W2 [4h/p, h]); each row-parallel
    product is a partial sum that one all_reduce completes.  The attention itself is not
    computed: this rank's slice of the input stands in for its heads' context."""

    def __init__(self, h: int, p: int, rank: int):
        if h % p:
            raise ValueError(f"hidden {h} is not divisible by {p} ranks")
        g = torch.Generator().manual_seed(1000 * h + rank)
        hp, fp = h // p, 4 * h // p
        self.lo, self.hi = rank * hp, (rank + 1) * hp
        self.wo = torch.randn(hp, h, generator=g) / h ** 0.5
        self.w1 = torch.randn(h, fp, generator=g) / h ** 0.5
        self.w2 = torch.randn(fp, h, generator=g) / (4 * h) ** 0.5

    def __call__(self, x, allreduce):
        part = x[:, self.lo:self.hi] @ self.wo
        allreduce(part)
        y = x + part
        part = torch.nn.functional.gelu(y @ self.w1) @ self.w2
        allreduce(part)
        return y + part


def reference_allreduce(world):
    """In place, summed in float64 by mpi4py: the check's all_reduce."""
    def allreduce(t):
        buf = t.numpy().astype(np.float64)
        world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t.copy_(torch.from_numpy(buf))
    return allreduce


def part_tp(world, groups: dict, ds_allreduce, args, skipped: dict) -> tuple[list, bool]:
    import aluminum_py.torch as alt
    first = next(iter(groups))
    reducers = {k: (lambda t, g=g: dist.all_reduce(t, group=g)) for k, g in groups.items()}
    if isinstance(groups[first], alt.ProcessGroupAluminum):
        # aluminum_py.torch.all_reduce: the same all_reduce without torch's dispatch (the call a
        # tensor-parallel layer makes, as DeepSpeed's inference_all_reduce)
        reducers = {first: reducers[first],
                    "direct": lambda t, g=groups[first]: alt.all_reduce(t, group=g),
                    **{k: v for k, v in reducers.items() if k != first}}
    if ds_allreduce is not None:
        reducers["deepspeed"] = ds_allreduce
    peers = [k for k in reducers if k != first]
    hiddens, batches = ((256, 1024), (1, 8)) if args.quick else ((1024, 4096, 8192), (1, 4, 8))
    say(world, f"\n## tensor-parallel block (attention projection + MLP 4x, 2 all_reduces of "
               f"[batch x hidden] float32): block ms, median of max over ranks; none = the block "
               f"without all_reduce (the compute alone); x = peer / {first}; bound = gloo / none "
               f"(the speed-up of an all_reduce that costs nothing); ar = one [batch x hidden] "
               f"all_reduce alone, us")
    cols = list(reducers) + ["none"]
    say(world, f"{'hidden':>6} {'batch':>5}" + "".join(f" {c[:9]:>10}" for c in cols)
        + "".join(f" {'x ' + p[:4]:>8}" for p in peers) + f" {'bound':>7}"
        + "".join(f" {'ar ' + k[:5]:>9}" for k in reducers)
        + "".join(f" {'ar x ' + p[:4]:>10}" for p in peers))
    rows, wrong_any, torch_ref = [], False, reference_allreduce(world)
    with torch.inference_mode():
        for h in hiddens:
            block = TPBlock(h, world.size, world.rank)
            for b in batches:
                x = torch.randn(b, h, generator=torch.Generator().manual_seed(b))
                expected = block(x, torch_ref)
                calls = {}
                for k, red in list(reducers.items()) + [("none", lambda t: None)]:
                    calls[k] = (lambda red=red, blk=block, x=x: blk(x, red))
                outputs = {}
                for k, c in calls.items():                 # first call: checked
                    world.Barrier()
                    outputs[k] = c()
                bad = [k for k in reducers if not torch.allclose(outputs[k], expected,
                                                                 rtol=1e-4, atol=1e-4)]
                bad = sorted({k for r in world.allgather(bad) for k in r})
                wrong_any = wrong_any or bool(bad)
                for k in reducers:                         # each all_reduce alone, [b x h]
                    t = torch.zeros(b, h)
                    calls[f"ar {k}"] = (lambda red=reducers[k], t=t: red(t))
                iters = iterations(world, calls, args.budget * 4, lo=3, hi=50)
                med = medians(time_interleaved(world, calls, iters))
                row = {"hidden": h, "batch": b, "iters": iters, "wrong": bad,
                       "block_ms": {k: med[k] * 1e3 for k in cols},
                       "allreduce_us": {k: med["ar " + k] * 1e6 for k in reducers},
                       "speedup": {p: med[p] / med[first] for p in peers},
                       "allreduce_speedup": {p: med["ar " + p] / med["ar " + first]
                                             for p in peers},
                       "bound": med["gloo"] / med["none"]}
                rows.append(row)
                say(world, f"{h:>6} {b:>5}" + "".join(
                    f" {row['block_ms'][c]:>9.3f}{'!' if c in bad else ' '}" for c in cols)
                    + "".join(f" {row['speedup'][p]:>7.2f}x" for p in peers)
                    + f" {row['bound']:>6.2f}x"
                    + "".join(f" {row['allreduce_us'][k]:>9.1f}" for k in reducers)
                    + "".join(f" {row['allreduce_speedup'][p]:>9.2f}x" for p in peers))
                if bad:
                    say(world, f"# hidden {h} batch {b}: WRONG output from {', '.join(bad)}")
            del block
    return rows, wrong_any


def deepspeed_allreduce(world, args, skipped: dict):
    """DeepSpeed's SHM inference_all_reduce (in place on a float32 tensor), or None with the
    reason in `skipped`."""
    if args.no_deepspeed:
        skipped["deepspeed"] = "--no-deepspeed"
        return None
    # the op names its segments after MASTER_ADDR / MASTER_PORT; mpi:// needs neither: one
    # name per job
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(world.bcast(os.getpid() if world.rank == 0
                                                         else None, root=0)))
    import deepspeed_peer
    factory, why = deepspeed_peer.shm_allreduce(world)
    if factory is None:
        skipped["deepspeed"] = why
        say(world, f"# deepspeed: skipped, {why}")
        return None
    return factory.all_reduce


# --------------------------------------------------------------------------------- profile

def profiled(world, call, times: int, what: str, top: int = 15) -> str:
    """cProfile of `times` calls of `call` (every rank calling, rank 0 profiled): the Python
    functions behind its cost, by own time, with the wall time per call under the profiler."""
    import cProfile
    import io
    import pstats
    world.Barrier()
    prof = cProfile.Profile() if world.rank == 0 else None
    t0 = MPI.Wtime()
    if prof:
        prof.enable()
    for _ in range(times):
        call()
    if prof:
        prof.disable()
    per_call = world.allreduce((MPI.Wtime() - t0) / times, op=MPI.MAX)
    if prof is None:
        return ""
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue().strip().splitlines()
    start = next(i for i, line in enumerate(body) if line.lstrip().startswith("ncalls"))
    return f"{times} x {what}, {per_call * 1e6:.1f} us per call under the profiler:\n" \
        + "\n".join(body[start:])


def profile_calls(world, group, name: str, calls: int) -> str:
    """:func:`profiled` 4-byte (one element per rank) `name` calls on `group`."""
    inp, out, _ = collective_case(name, world.size, world.size, world.rank)
    call = torch_collective(name, group, inp, out)
    for _ in range(20):
        call()
    return profiled(world, call, calls, f"{name} (4 B) on the default group")


def layers(world, group, gloo, comm, nbytes: int, iters: int) -> dict:
    """all_reduce of `nbytes` through each layer of the path, interleaved (median of max over
    ranks, us): `comm` (a Communicator of our own, numpy), `group.comm` (the group's
    Communicator, on the tensor's numpy view), `group.allreduce` (the ProcessGroup method from
    Python, then Work.wait: + buffers, options, Work and Future), `dist.all_reduce` (+ torch's
    Python wrapper and the C++ dispatch into our Python method) and gloo's."""
    count = max(1, nbytes // 4)
    t = {k: torch.zeros(count) for k in ("comm", "group.comm", "pg", "dist", "gloo")}
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    calls = {"comm": lambda: comm.Allreduce(t["comm"].numpy()),
             "group.comm": lambda: group.comm.Allreduce(t["group.comm"].numpy()),
             "group.allreduce": lambda: group.allreduce([t["pg"]], opts).wait(),
             "dist.all_reduce": lambda: dist.all_reduce(t["dist"], group=group),
             "gloo": lambda: dist.all_reduce(t["gloo"], group=gloo)}
    for c in calls.values():
        c()
    return {k: v * 1e6 for k, v in medians(time_interleaved(world, calls, iters)).items()}


# ------------------------------------------------------------------------------------ main

def goals(world, results: dict, first: str) -> list[str]:
    """One line per goal (GOALS): the measured figure and whether it is met."""
    lines = []
    coll = results.get("collectives")
    if coll and any("ratio" in r for r in coll):
        for c in COLLECTIVES:
            rs = [r for r in coll if r["collective"] == c and "ratio" in r]
            small = [r for r in rs if r["bytes"] <= 65536]
            w_small = min(small, key=lambda r: r["ratio"])
            w_all = min(rs, key=lambda r: r["ratio"])
            ok = w_small["ratio"] >= 2 and w_all["ratio"] >= 1
            lines.append(f"{SHORT[c]}: worst up to 64 KiB {w_small['ratio']:.2f}x at "
                         f"{w_small['bytes']} B, worst overall {w_all['ratio']:.2f}x at "
                         f"{w_all['bytes']} B: {'met' if ok else 'MISSED'}")
    for r in results.get("ddp", []):
        m = r["median_step_ms"]
        if "gloo+hook" in m and first != "gloo":
            ratio = m["gloo+hook"] / m[first]
            lines.append(f"DDP {r['model']}: {first} {m[first]:.1f} ms vs gloo+hook "
                         f"{m['gloo+hook']:.1f} ms ({ratio:.3f}x): "
                         f"{'met' if ratio >= 1 else 'MISSED'}")
    f = results.get("fsdp")
    if f and "gloo" in f["median_step_ms"] and first != "gloo":
        ratio = f["median_step_ms"]["gloo"] / f["median_step_ms"][first]
        lines.append(f"FSDP2: {ratio:.2f}x gloo: {'met' if ratio >= 1.3 else 'MISSED'}")
    for peer, goal in (("gloo", 3.0), ("deepspeed", 1.0)):
        tp = [r for r in results.get("tp", []) if peer in r["speedup"]]
        if not tp or first == "gloo":
            continue
        w = min(tp, key=lambda r: r["speedup"][peer])
        a = min(tp, key=lambda r: r["allreduce_speedup"][peer])
        ok = w["speedup"][peer] >= goal if peer == "gloo" else w["speedup"][peer] > goal
        lines.append(f"TP block vs {peer}: worst {w['speedup'][peer]:.2f}x (hidden {w['hidden']}, "
                     f"batch {w['batch']}; bound there {w['bound']:.2f}x); its all_reduce alone: "
                     f"worst {a['allreduce_speedup'][peer]:.2f}x (hidden {a['hidden']}, batch "
                     f"{a['batch']}): {'met' if ok else 'MISSED'}")
        direct = [r for r in tp if "direct" in r["speedup"]]
        if peer == "deepspeed" and direct:
            ratio = {(r["hidden"], r["batch"]): r["speedup"][peer] / r["speedup"]["direct"]
                     for r in direct}
            alone = {(r["hidden"], r["batch"]):
                     r["allreduce_speedup"][peer] / r["allreduce_speedup"]["direct"]
                     for r in direct}
            (wh, wb), (ah, ab) = min(ratio, key=ratio.get), min(alone, key=alone.get)
            lines.append(f"TP block with aluminum_py.torch.all_reduce vs deepspeed: worst "
                         f"{ratio[wh, wb]:.2f}x (hidden {wh}, batch {wb}); its all_reduce alone: "
                         f"worst {alone[ah, ab]:.2f}x (hidden {ah}, batch {ab}): "
                         f"{'met' if ratio[wh, wb] > 1 else 'MISSED'}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="a smoke run: few sizes, small models")
    ap.add_argument("--json", help="write the stamp and every figure here as JSON (rank 0)")
    ap.add_argument("--backend", default="aluminum", choices=("aluminum", "gloo"),
                    help="the default group's backend (gloo: debug the script without ours)")
    ap.add_argument("--max-bytes", default="64MiB", help="largest collective size")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="seconds per collective and size (4x per tensor-parallel shape)")
    ap.add_argument("--steps", type=int, default=20, help="timed DDP / FSDP2 steps per trainer")
    ap.add_argument("--fsdp", default="256,4,4,64", metavar="D,LAYERS,BATCH,SEQ",
                    help="the FSDP2 transformer: d_model, layers, batch and sequence per rank")
    ap.add_argument("--no-deepspeed", action="store_true", help="no DeepSpeed peer in tp")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile (rank 0's Python functions by own time) of 3 DDP and FSDP2 "
                         "steps and, at the end, of N 4-byte all_reduce and "
                         "all_gather_into_tensor calls on the default group; then all_reduce "
                         "through each layer of the path, N calls")
    ap.add_argument("--no-comm", action="store_true",
                    help="no al.Communicator column in collectives")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    try:
        args.fsdp = [int(v) for v in args.fsdp.split(",")]
        if len(args.fsdp) != 4 or min(args.fsdp) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--fsdp: four positive integers D,LAYERS,BATCH,SEQ (got {args.fsdp!r})")
    if args.quick:
        args.steps = min(args.steps, 3)
        args.budget = min(args.budget, 0.05)
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    default, gloo = init_groups(world, args.backend)
    first = args.backend if args.backend != "gloo" else "default"
    groups = {first: default, "gloo": gloo}
    comm = al.Communicator()
    state = machine_state(world)
    say(world, f"# {state['command']}: {world.size} ranks, default group '{args.backend}' vs a "
               f"gloo group, {state['date']}, load {state['load']} on {state['cpus']} CPUs, "
               f"torch {state['torch']}, {state['mpi']}, 1 torch thread per rank")
    say(world, f"# goals: {GOALS}")
    results, skipped, wrong = {"ranks": world.size, "backend": args.backend, **state,
                               "args": vars(args)}, {}, False
    if "collectives" in parts:
        results["collectives"], bad = part_collectives(
            world, groups, None if args.no_comm else comm, args, skipped)
        wrong = wrong or bad
    if "ddp" in parts:
        results["ddp"] = part_ddp(world, groups, comm, args)
    if "fsdp" in parts:
        results["fsdp"] = part_fsdp(world, groups, args)
    if "tp" in parts:
        ds = deepspeed_allreduce(world, args, skipped)
        results["tp"], bad = part_tp(world, groups, ds, args, skipped)
        wrong = wrong or bad
    if args.profile:
        for name in ("all_reduce", "all_gather_into_tensor"):
            say(world, "\n## profile: " + profile_calls(world, default, name, args.profile))
        if hasattr(default, "comm"):
            say(world, "\n## all_reduce through each layer (us, median of max over ranks, "
                       "interleaved; see layers() in the script)")
            results["layers"] = {}
            for nbytes in (4, 65536):
                row = layers(world, default, gloo, comm, nbytes, args.profile)
                results["layers"][nbytes] = row
                say(world, f"{nbytes:>7} B: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
    results["skipped"] = skipped
    results["goals"] = goals(world, results, first) if args.backend != "gloo" else [
        "none checked: the default group is gloo (--backend gloo)"]
    say(world, "\n## against the goals" + (" (2 ranks)" if world.size == 2 else
                                            f" (set for 2 ranks; here {world.size})"))
    for line in results["goals"]:
        say(world, "  " + line)
    if wrong:
        say(world, "# WRONG results (marked !): exit status 1")
    if world.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
