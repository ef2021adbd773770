"""Data-parallel training of a small numpy MLP with the GradientSynchronizer.

    mpiexec -n 2 python examples/mlp_numpy.py [--steps 30] [--policy adafusion]

Every rank builds the same synthetic classification dataset (fixed seed) and the same initial
parameters, and takes a disjoint, equal shard of the global batch. The gradients live in one
``gradient_arena``; backward computes the layers' gradients in reverse order straight into the
arena views and calls ``sync.grad_ready(i)`` as each one is final, so a bucket's allreduce runs
while the earlier layers' gradients are still being computed. ``sync.wait()`` leaves the average
over ranks in every gradient, then every rank takes the same SGD step.

The loss is the mean softmax cross-entropy over the batch. With equal shards the average over
ranks of the shard-mean gradients is, in exact arithmetic, the full-batch gradient, so the
data-parallel parameters must equal those of single-process full-batch training from the same
initialisation up to rounding. Rank 0 runs that single-process training too and the script
fails (exit 1) if the largest absolute parameter difference exceeds ``--tol``, or if the ranks'
parameters are not bitwise identical (they all apply the same reduced gradients).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# One BLAS thread per rank (override by setting the variables): with N ranks on N cores, BLAS
# worker threads oversubscribe the cores; at 2 ranks on a 2-core machine the default OpenBLAS
# threads made a step about 100x slower (39 ms instead of 0.3 ms).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import aluminum_py as al  # noqa: E402
from aluminum_py.overlap import GradientSynchronizer, gradient_arena  # noqa: E402
from _compare import verdict  # noqa: E402  (examples/_compare.py)

POLICIES = ("none", "fixed", "mgwfbp", "adafusion", "osf", "libra", "auto")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--policy", choices=POLICIES, default="adafusion")
    p.add_argument("--samples", type=int, default=360,
                   help="global batch = whole dataset; must be divisible by the number of ranks "
                        "(360 is divisible by 1..6, 8, 9, 10, 12)")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--threshold", type=int, default=8 << 10,
                   help="bucket bytes for --policy fixed (small, so a few buckets form)")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    return p


# ---------------------------------------------------------------------------- model
def make_data(args):
    """Inputs and labels from a random 'teacher' network; identical on every rank."""
    rng = np.random.default_rng(args.seed)
    X = rng.standard_normal((args.samples, args.features))
    teacher = rng.standard_normal((args.features, args.classes))
    y = np.argmax(np.tanh(X @ teacher) + 0.3 * rng.standard_normal((args.samples, args.classes)),
                  axis=1)
    return X, y


def layer_shapes(args):
    sizes = [args.features, args.hidden, args.hidden, args.classes]
    shapes = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        shapes += [(fan_in, fan_out), (fan_out,)]
    return shapes                         # model order: W1, b1, W2, b2, W3, b3


def init_params(args):
    rng = np.random.default_rng(args.seed + 1)
    params = []
    for shape in layer_shapes(args):
        scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.1
        params.append(rng.standard_normal(shape) * scale)
    return params


def forward(params, X):
    """Activations of every layer (input, hidden tanh outputs) and the softmax output."""
    acts = [X]
    nlayers = len(params) // 2
    for k in range(nlayers):
        W, b = params[2 * k], params[2 * k + 1]
        z = acts[-1] @ W + b
        if k < nlayers - 1:
            acts.append(np.tanh(z))
        else:
            z = z - z.max(axis=1, keepdims=True)
            e = np.exp(z)
            probs = e / e.sum(axis=1, keepdims=True)
    return acts, probs


def loss_of(probs, y):
    return float(-np.mean(np.log(probs[np.arange(len(y)), y])))


def backward(params, acts, probs, y, grads, ready):
    """Gradients of the mean cross-entropy over this batch, written into `grads` (model order)
    layer by layer from the last one; ready(i) is called as soon as grads[i] is final."""
    m = len(y)
    delta = probs.copy()
    delta[np.arange(m), y] -= 1.0
    delta /= m                                          # d loss / d logits (mean over the batch)
    for k in reversed(range(len(params) // 2)):
        iw, ib = 2 * k, 2 * k + 1
        np.matmul(acts[k].T, delta, out=grads[iw])
        np.sum(delta, axis=0, out=grads[ib])
        ready(ib)
        ready(iw)
        if k > 0:
            delta = (delta @ params[iw].T) * (1.0 - acts[k] ** 2)


def sgd(params, grads, lr):
    for p, g in zip(params, grads):
        p -= lr * g


def profile(args):
    """Backward seconds per gradient (model order) from FLOP counts: deterministic, so every
    rank plans the same buckets (a per-rank measured profile could make ranks disagree)."""
    m = args.samples
    flops_per_s = 1e9
    return [(2.0 * m * int(np.prod(s)) if len(s) == 2 else m * s[0]) / flops_per_s
            for s in layer_shapes(args)]


def sync_options(args):
    if args.policy == "fixed":
        return {"threshold": args.threshold}
    if args.policy in ("mgwfbp", "adafusion", "osf", "auto"):
        return {"compute_times": profile(args)}
    if args.policy == "libra":
        from aluminum_py.planning.libra import Plan
        n = len(layer_shapes(args))
        groups = [(k, k + 1) for k in range(0, n, 2)]   # backward order: (b, W) of each layer
        return {"plan": Plan(groups, [0] * len(groups), 0.0)}
    return {}


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    rank, size = comm.rank, comm.size
    if args.samples % size:
        if rank == 0:
            print(f"--samples {args.samples} is not divisible by {size} ranks: the shards must be "
                  f"equal for their mean gradient to be the full-batch gradient", file=sys.stderr)
        return 2

    X, y = make_data(args)
    shard = args.samples // size
    Xs, ys = X[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]

    params = init_params(args)
    arena, grads = gradient_arena([p.shape for p in params], np.float64)
    sync = GradientSynchronizer(comm, grads, policy=args.policy, **sync_options(args))
    if rank == 0:
        print(f"{size} ranks x {shard} samples, policy {args.policy}, "
              f"{arena.size} parameters, buckets (model indices, launch order): {sync.buckets}",
              flush=True)

    world.Barrier()                         # time the steps, not the ranks' start-up skew
    t0 = time.perf_counter()
    for step in range(args.steps):
        with al.timeline.region("forward"):      # marks compute in a timeline (AL_TIMELINE)
            acts, probs = forward(params, Xs)
        with al.timeline.region("backward"):
            backward(params, acts, probs, ys, grads, sync.grad_ready)
        with al.timeline.region("wait"):
            sync.wait(timeout=60)
        with al.timeline.region("optimizer"):
            sgd(params, grads, args.lr)
        if step % args.print_every == 0 or step == args.steps - 1:
            # loss of the shard before this step's update, averaged = full-batch loss
            loss = world.allreduce(loss_of(probs, ys)) / size
            if rank == 0:
                print(f"step {step:4d}  loss {loss:.6f}", flush=True)
    elapsed = time.perf_counter() - t0
    if sync.policy == "auto" and rank == 0:
        print(f"auto: {'chose ' + sync.chosen if sync.chosen else 'still tuning'}"
              f" after {sync.iteration} steps", flush=True)

    # every rank applied the same averaged gradients: parameters must be bitwise identical
    flat = np.concatenate([p.ravel() for p in params])
    mine = flat.copy()
    world.Bcast(flat, root=0)
    spread = world.allreduce(float(np.max(np.abs(mine - flat))), op=MPI.MAX)

    status = 0
    if rank == 0:
        ref = init_params(args)
        ref_grads = [np.zeros_like(p) for p in ref]
        for _ in range(args.steps):
            acts, probs = forward(ref, X)
            backward(ref, acts, probs, y, ref_grads, lambda i: None)
            sgd(ref, ref_grads, args.lr)
        acts, probs = forward(ref, X)
        diff = max(float(np.max(np.abs(p - r))) for p, r in zip(params, ref))
        status = verdict(args.steps, loss_of(probs, y), diff, spread, args.tol, elapsed)
    return int(world.bcast(status, root=0))


if __name__ == "__main__":
    sys.exit(main())
