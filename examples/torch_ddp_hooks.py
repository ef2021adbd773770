"""Data-parallel PyTorch (CPU) training without DDP: ``aluminum_py.torch.synchronize_gradients``.

    mpiexec -n 2 python examples/torch_ddp_hooks.py [--steps 20] [--policy fixed] [--hook auto]

A small MLP (float64) is trained on a synthetic regression dataset (fixed seed) that every rank
builds; each rank takes a disjoint, equal shard of the global batch (MSE loss, mean reduction).

``sync = synchronize_gradients(model, comm, policy=...)`` points every ``param.grad`` at its
view of one gradient arena (autograd accumulates straight into it, buckets are reduced in place,
like DDP's ``gradient_as_bucket_view``) and registers a post-accumulate-grad hook per parameter
that starts its bucket's allreduce as soon as the gradient is final. Each step:
``sync.zero_grad()``, forward, ``backward()``, ``sync.wait()``, ``optimizer.step()``.

* Zero the gradients in place (``sync.zero_grad()`` or ``zero_grad(set_to_none=False)``):
  ``optimizer.zero_grad()`` defaults to ``set_to_none=True``; the hooks then copy autograd's new
  ``.grad`` tensors back into the arena (correct, one extra copy per gradient);
* every parameter must take part in every backward (an unused parameter's hook never fires
  and ``sync.wait()`` raises).

``--hook tensor`` (used automatically on a PyTorch without post-accumulate hooks) registers
``param.register_hook`` instead: the hook copies the gradient into the arena before autograd
accumulates it, and ``wait()`` points ``.grad`` back at the arena views for the optimizer step
(that hook fires once per use of the parameter in the graph, so it suits models that use each
parameter once, as here).

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


import aluminum_py as al  # noqa: E402

try:
    import torch

    import aluminum_py.torch as alt
except ImportError:
    torch = alt = None
from _compare import print_loss, torch_verdict  # noqa: E402  (examples/_compare.py)

POLICIES = ("none", "fixed", "mgwfbp", "adafusion", "libra", "auto")


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
    X, Y = make_data(args)
    shard = args.samples // size
    Xs, Ys = X[rank * shard:(rank + 1) * shard], Y[rank * shard:(rank + 1) * shard]

    model = make_model(args)
    reference = copy.deepcopy(model) if rank == 0 else None
    params = list(model.parameters())                       # model (forward) order
    sync = alt.synchronize_gradients(model, comm, policy=args.policy, hook=args.hook,
                                     **sync_options(args, params, shard))

    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.MSELoss()
    if rank == 0:
        print(f"{size} ranks x {shard} samples, policy {args.policy}, hook {sync.hook}, torch "
              f"{torch.__version__}, {sum(g.size for g in sync.grads)} parameters, buckets: "
              f"{sync.synchronizer.buckets}", flush=True)

    world.Barrier()                         # time the steps, not the ranks' start-up skew
    t0 = time.perf_counter()
    for step in range(args.steps):
        sync.zero_grad()                    # in place: .grad stays the arena views
        loss = loss_fn(model(Xs), Ys)
        loss.backward()
        sync.wait(timeout=60)
        # autograd accumulated into the arena (it must not have replaced the tensors)
        assert all(p.grad.data_ptr() == g.ctypes.data for p, g in zip(params, sync.grads))
        opt.step()
        print_loss(world, args, step, loss.item())
    elapsed = time.perf_counter() - t0

    return torch_verdict(world, args, params, reference, X, Y, loss_fn, elapsed)

if __name__ == "__main__":
    sys.exit(main())
