"""Data-parallel PyTorch (CPU) training with the GradientSynchronizer fed from gradient hooks.

    mpiexec -n 2 python examples/torch_ddp_hooks.py [--steps 20] [--policy fixed] [--hook auto]

A small MLP (float64) is trained on a synthetic regression dataset (fixed seed) that every rank
builds; each rank takes a disjoint, equal shard of the global batch (MSE loss, mean reduction).

Gradients live in one ``gradient_arena``: before training every ``param.grad`` is set to
``torch.from_numpy(view)`` of its arena view, so autograd accumulates straight into the arena
and the synchronizer reduces the buckets in place (no copies, like DDP's
``gradient_as_bucket_view``). A ``register_post_accumulate_grad_hook`` on each parameter calls
``sync.grad_ready(i)`` once the parameter's gradient is final, so a bucket's allreduce starts
while autograd computes the earlier layers. Two rules keep the grads in the arena:

* zero the gradients in place (``arena.fill(0)`` or ``zero_grad(set_to_none=False)``):
  ``optimizer.zero_grad()`` defaults to ``set_to_none=True``, and the next backward would then
  allocate fresh ``.grad`` tensors that the synchronizer never sees;
* every parameter must take part in every backward (an unused parameter's hook never fires
  and ``sync.wait()`` raises).

``--hook tensor`` (used automatically on a PyTorch without post-accumulate hooks) instead
registers ``param.register_hook`` on the parameter tensors: the hook receives the gradient
before autograd accumulates it, copies it into the arena and reports it ready; ``.grad`` is
left to autograd during backward and pointed at the arena views for the optimizer step. (That
hook fires once per use of the parameter in the graph, so it suits models that use each
parameter once, as here.)

Rank 0 also trains the same initial model single-process on the full batch and the script exits
1 if the largest absolute parameter difference exceeds ``--tol`` or the ranks' parameters are not
bitwise identical. Without torch it prints a message and exits 0.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

# One BLAS/OpenMP thread per rank unless set (ranks usually fill the cores; see mlp_numpy.py).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

import aluminum_py as al  # noqa: E402
from aluminum_py.overlap import GradientSynchronizer, gradient_arena  # noqa: E402
from _compare import verdict  # noqa: E402  (examples/_compare.py)

POLICIES = ("none", "fixed", "mgwfbp", "adafusion", "libra")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--policy", choices=POLICIES, default="fixed")
    p.add_argument("--hook", choices=("auto", "post_accumulate", "tensor"), default="auto",
                   help="auto: post-accumulate-grad hooks when this PyTorch has them")
    p.add_argument("--samples", type=int, default=360,
                   help="global batch = whole dataset; divisible by the number of ranks")
    p.add_argument("--features", type=int, default=12)
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--outputs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--threshold", type=int, default=8 << 10, help="bucket bytes for --policy fixed")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=4321)
    return p


def make_data(args):
    g = torch.Generator().manual_seed(args.seed)
    X = torch.randn(args.samples, args.features, generator=g, dtype=torch.float64)
    A = torch.randn(args.features, args.outputs, generator=g, dtype=torch.float64)
    Y = torch.sin(X @ A) + 0.1 * torch.randn(args.samples, args.outputs, generator=g,
                                               dtype=torch.float64)
    return X, Y


def make_model(args):
    torch.manual_seed(args.seed + 1)
    return torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.outputs),
    ).double()


def sync_options(args, params, batch):
    if args.policy == "fixed":
        return {"threshold": args.threshold}
    if args.policy in ("mgwfbp", "adafusion"):
        # deterministic profile from FLOPs, so every rank plans the same buckets
        return {"compute_times": [2.0 * batch * p.numel() / 1e9 for p in params]}
    if args.policy == "libra":
        from aluminum_py.planning.libra import Plan
        groups = [(k, k + 1) for k in range(0, len(params), 2)]   # (bias, weight) per layer
        return {"plan": Plan(groups, [0] * len(groups), 0.0)}
    return {}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI
    if torch is None:
        if MPI.COMM_WORLD.rank == 0:
            print("torch is not installed: skipping the PyTorch example")
        return 0
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    rank, size = comm.rank, comm.size
    if args.samples % size:
        if rank == 0:
            print(f"--samples {args.samples} is not divisible by {size} ranks", file=sys.stderr)
        return 2
    hook = args.hook
    if hook == "auto":
        hook = ("post_accumulate" if hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
                else "tensor")

    X, Y = make_data(args)
    shard = args.samples // size
    Xs, Ys = X[rank * shard:(rank + 1) * shard], Y[rank * shard:(rank + 1) * shard]

    model = make_model(args)
    reference = copy.deepcopy(model) if rank == 0 else None
    params = list(model.parameters())                       # model (forward) order
    arena, grads = gradient_arena([tuple(p.shape) for p in params], np.float64)
    arena_grads = [torch.from_numpy(g) for g in grads]      # share memory with the arena
    sync = GradientSynchronizer(comm, grads, policy=args.policy,
                                **sync_options(args, params, shard))

    if hook == "post_accumulate":
        for p, t in zip(params, arena_grads):
            p.grad = t
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: sync.grad_ready(i))
    else:
        def tensor_hook(i):
            def fn(grad):
                grads[i][...] = grad.detach().numpy()
                sync.grad_ready(i)
            return fn
        for i, p in enumerate(params):
            p.register_hook(tensor_hook(i))

    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.MSELoss()
    if rank == 0:
        print(f"{size} ranks x {shard} samples, policy {args.policy}, hook {hook}, torch "
              f"{torch.__version__}, {arena.size} parameters, buckets: {sync.buckets}", flush=True)

    world.Barrier()                         # time the steps, not the ranks' start-up skew
    t0 = time.perf_counter()
    for step in range(args.steps):
        if hook == "post_accumulate":
            arena.fill(0.0)                 # in place: .grad stays the arena views
        else:
            for p in params:
                p.grad = None               # autograd's own .grad during backward
        loss = loss_fn(model(Xs), Ys)
        loss.backward()
        sync.wait(timeout=60)
        if hook == "post_accumulate":
            # autograd accumulated into the arena (it must not have replaced the tensors)
            assert all(p.grad.data_ptr() == t.data_ptr() for p, t in zip(params, arena_grads))
        else:
            for p, t in zip(params, arena_grads):
                p.grad = t
        opt.step()
        if step % args.print_every == 0 or step == args.steps - 1:
            total = world.allreduce(loss.item()) / size
            if rank == 0:
                print(f"step {step:4d}  loss {total:.6f}", flush=True)
    elapsed = time.perf_counter() - t0

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy()
    mine = flat.copy()
    world.Bcast(flat, root=0)
    spread = world.allreduce(float(np.max(np.abs(mine - flat))), op=MPI.MAX)

    status = 0
    if rank == 0:
        ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=args.momentum)
        for _ in range(args.steps):
            ref_opt.zero_grad()
            loss_fn(reference(X), Y).backward()
            ref_opt.step()
        with torch.no_grad():
            diff = max(float((p - r).abs().max()) for p, r in zip(params, reference.parameters()))
            final = float(loss_fn(reference(X), Y))
        status = verdict(args.steps, final, diff, spread, args.tol, elapsed)
    return int(world.bcast(status, root=0))


if __name__ == "__main__":
    sys.exit(main())
