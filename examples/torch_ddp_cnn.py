"""A small CNN (no torchvision) trained with PyTorch DDP and ``aluminum_py.torch.allreduce_hook``.

    mpiexec -n 2 python examples/torch_ddp_cnn.py [--steps 10] [--hook allreduce|fp16|bf16]

Synthetic 1-channel 16x16 images of three classes (a horizontal bar, a vertical bar, a
diagonal, plus noise; fixed seed) that every rank builds; each rank takes a disjoint, equal
shard of the global batch (cross-entropy, mean reduction). DDP needs a process group for its
own set-up (parameter broadcast, bucket rebuilding): a gloo group whose rendezvous is a file
named by rank 0 over MPI. The gradients go through the hook:
``ddp.register_comm_hook(comm, allreduce_hook)`` averages each DDP bucket in place with the
library's nonblocking allreduce, overlapped with the rest of the backward pass.

Rank 0 also trains the same initial model single-process on the full batch (float64) and the
script exits 1 if the largest absolute parameter difference exceeds ``--tol`` or the ranks'
parameters differ. The default tolerance is 1e-10 with ``--hook allreduce`` (float64 sums in
another order), and with the compressing hooks (``fp16``, ``bf16``) the worst-case error
their rounding can cause in these steps (:class:`CompressionBound`). Without torch it prints a
message and exits 0.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


import aluminum_py as al  # noqa: E402
from _compare import print_loss, torch_verdict  # noqa: E402  (examples/_compare.py)

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import aluminum_py.torch as alt
except ImportError:
    torch = None


HOOKS = {"allreduce": None, "fp16": "float16", "bf16": "bfloat16"}   # hook -> wire dtype


class CompressionBound:
    """The largest parameter difference a compressing hook's rounding can cause, to first
    order, observed on rank 0's single-process training of the same model.

    Per step and gradient element, the hook casts each rank's shard gradient g_r to the wire
    dtype (error <= u|g_r| + a), and the reduction rounds each of its p - 1 partial sums and
    the average once more (each <= u * sum|g_r| + a; the float32 arithmetic in between is 2^13
    times finer than float16), so the averaged gradient is off by at most
    E = (p + 1) (u M + a) with M = max_r max|g_r|, u the dtype's unit roundoff (float16 2^-11,
    bfloat16 2^-8) and a half its smallest subnormal (float16 2^-25): the cast of a value
    below the normal range loses absolute, not relative, precision. SGD with momentum m and
    learning rate lr carries a gradient error into the parameters through v_t = m v_{t-1} + E_t,
    w_t -= lr v_t, so after the steps the parameters differ by at most sum_t lr V_t, V_t the
    same recurrence on the bounds E_t. First order: the change of the gradients along the
    slightly different trajectory is left out, which over a few steps is a small fraction of
    the bound (2x headroom covers it). Measured with the defaults (10 steps): fp16 differences
    of 1.4e-5 (2 ranks; tol 6.2e-4) and 1.0e-5 (3 ranks; tol 9.5e-4), bf16 7.0e-5 (tol 4.9e-3);
    30 steps fp16 1.3e-4 (tol 3.1e-3): rounding errors cancel, the bound assumes they never do."""

    HEADROOM = 2.0

    def __init__(self, wire_dtype, shards, loss_fn, momentum, lr):
        import torch
        info = torch.finfo(getattr(torch, wire_dtype))
        self.u, self.a = info.eps / 2, info.tiny * info.eps / 2
        self.shards, self.loss_fn, self.momentum, self.lr = shards, loss_fn, momentum, lr
        self.v = self.total = 0.0

    def observe(self, model) -> None:
        """One step of the reference training: M from the shard gradients at its parameters."""
        import torch
        params = [q for q in model.parameters() if q.requires_grad]
        M = 0.0
        for X, Y in self.shards:
            grads = torch.autograd.grad(self.loss_fn(model(X), Y), params)
            M = max(M, max(float(g.abs().max()) for g in grads))
        p = len(self.shards)
        self.v = self.momentum * self.v + (p + 1) * (self.u * M + self.a)
        self.total += self.lr * self.v

    def tol(self) -> float:
        return self.HEADROOM * self.total


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hook", choices=tuple(HOOKS), default="allreduce")
    p.add_argument("--samples", type=int, default=96,
                   help="global batch = whole dataset; divisible by the number of ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--bucket-mb", type=float, default=0.01, help="DDP bucket_cap_mb")
    p.add_argument("--tol", type=float, default=None,
                   help="largest parameter difference accepted (default: 1e-10 with --hook "
                        "allreduce, the rounding bound of CompressionBound with fp16/bf16)")
    p.add_argument("--print-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=2024)
    return p


def make_data(args, size=16):
    g = torch.Generator().manual_seed(args.seed)
    labels = torch.randint(0, 3, (args.samples,), generator=g)
    X = 0.3 * torch.randn(args.samples, 1, size, size, generator=g, dtype=torch.float64)
    pos = torch.randint(2, size - 2, (args.samples,), generator=g)
    idx = torch.arange(size)
    for n in range(args.samples):
        k, c = int(labels[n]), int(pos[n])
        if k == 0:
            X[n, 0, c, :] += 1.0
        elif k == 1:
            X[n, 0, :, c] += 1.0
        else:
            X[n, 0, idx, idx] += 1.0
    return X, labels


def make_model(args):
    torch.manual_seed(args.seed + 1)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),     # 8x8
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),    # 4x4
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 3),
    ).double()


_rendezvous = None


def init_process_group(world):
    """A gloo group over the MPI ranks (rendezvous: a file in rank 0's temporary directory,
    which is removed when the program ends)."""
    global _rendezvous
    _rendezvous = tempfile.TemporaryDirectory(prefix="al-ddp-") if world.rank == 0 else None
    path = world.bcast(_rendezvous and os.path.join(_rendezvous.name, "store"), root=0)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=world.rank,
                            world_size=world.size)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if torch is None:
        if world.rank == 0:
            print("torch is not installed: skipping the PyTorch example")
        return 0
    rank, size = world.rank, world.size
    if args.samples % size:
        if rank == 0:
            print(f"--samples {args.samples} is not divisible by {size} ranks", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    init_process_group(world)
    comm = al.Communicator()

    X, labels = make_data(args)
    shard = args.samples // size
    Xs, ls = X[rank * shard:(rank + 1) * shard], labels[rank * shard:(rank + 1) * shard]
    model = make_model(args)
    reference = copy.deepcopy(model) if rank == 0 else None
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    hook = {"allreduce": alt.allreduce_hook, "fp16": alt.fp16_compress_hook,
            "bf16": alt.bf16_compress_hook}[args.hook]
    bound = None
    if args.tol is None:
        if HOOKS[args.hook] is None:
            args.tol = 1e-10
        elif rank == 0:
            bound = CompressionBound(HOOKS[args.hook], [(X[r * shard:(r + 1) * shard],
                                                         labels[r * shard:(r + 1) * shard])
                                                        for r in range(size)],
                                     torch.nn.CrossEntropyLoss(), args.momentum, args.lr)
    ddp.register_comm_hook(comm, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    params = list(model.parameters())
    if rank == 0:
        print(f"{size} ranks x {shard} samples, DDP + {hook.__name__}, torch {torch.__version__}, "
              f"{sum(p.numel() for p in params)} parameters", flush=True)

    world.Barrier()
    t0 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_fn(ddp(Xs), ls)
        loss.backward()                     # the buckets' allreduces complete in here
        opt.step()
        print_loss(world, args, step, loss.item())
    elapsed = time.perf_counter() - t0

    status = torch_verdict(world, args, params, reference, X, labels, loss_fn, elapsed, bound)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
