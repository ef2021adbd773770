"""Shared by the examples: report data-parallel vs single-process training and decide the exit
status (0 only if the parameters match within `tol` and are identical on every rank)."""
import sys


def verdict(steps, final_loss, diff, spread, tol, elapsed) -> int:
    print(f"after {steps} steps: final full-batch loss {final_loss:.6f}; "
          f"max |data-parallel - single-process| = {diff:.3e} (tol {tol:.3g}); "
          f"max difference between ranks = {spread:.3e}; "
          f"{elapsed / max(1, steps) * 1e3:.2f} ms/step", flush=True)
    if not diff <= tol:
        print("FAIL: data-parallel parameters differ from single-process training", file=sys.stderr)
        return 1
    if spread != 0.0:
        print("FAIL: parameters differ between ranks", file=sys.stderr)
        return 1
    print("OK", flush=True)
    return 0


def torch_verdict(world, args, params, reference, X, Y, loss_fn, elapsed, bound=None) -> int:
    """The PyTorch examples' end: the ranks' parameters compared with each other and, on rank 0,
    with `reference` (the same initial model) trained single-process on the full batch (X, Y)
    with the same SGD; the exit status, the same on every rank. The tolerance is ``args.tol``,
    or where that is None ``bound.tol()`` after ``bound.observe(reference)`` at every step of the
    reference training (a lossy hook's error bound, e.g. torch_ddp_cnn.py's CompressionBound)."""
    import numpy as np
    import torch
    from mpi4py import MPI

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy()
    mine = flat.copy()
    world.Bcast(flat, root=0)
    spread = world.allreduce(float(np.max(np.abs(mine - flat))), op=MPI.MAX)
    status = 0
    if world.rank == 0:
        opt = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=args.momentum)
        for _ in range(args.steps):
            opt.zero_grad()
            loss_fn(reference(X), Y).backward()
            if bound is not None:
                bound.observe(reference)
            opt.step()
        with torch.no_grad():
            diff = max(float((p - r).abs().max()) for p, r in zip(params, reference.parameters()))
            final = float(loss_fn(reference(X), Y))
        tol = args.tol if args.tol is not None else bound.tol()
        status = verdict(args.steps, final, diff, spread, tol, elapsed)
    return int(world.bcast(status, root=0))


def print_loss(world, args, step, loss) -> None:
    """Every ``args.print_every`` steps and at the last: rank 0 prints the mean loss over ranks
    (collective)."""
    if step % args.print_every == 0 or step == args.steps - 1:
        total = world.allreduce(loss) / world.size
        if world.rank == 0:
            print(f"step {step:4d}  loss {total:.6f}", flush=True)
