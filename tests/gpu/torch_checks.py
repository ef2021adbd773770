"""The torch.distributed backend "aluminum" on CUDA tensors, for a GPU machine: 2 ranks (each
its own NCCL_HOSTID when they share one GPU; tests/gpu/lent_machine.sh, step ``torch``). Written
against torch's public API only. Each check prints one line on rank 0: ``PASS <check>: ...``,
``FAIL <check>: ...``, or ``SKIP <check>: why`` (never PASS for a check that did not run):

* ``collectives``: every collective, blocking and ``async_op=True``: all_reduce (SUM, PRODUCT,
  MIN, MAX, AVG; float32, bfloat16, int64), broadcast, reduce, all_gather, all_gather_into_tensor
  (also in place), reduce_scatter, reduce_scatter_tensor, all_to_all_single, all_to_all, gather,
  scatter, barrier; against values computed on the host from every rank's inputs;
* ``uneven_all_to_all``: all_to_all_single with uneven input and output splits;
* ``batch_p2p``: batch_isend_irecv of 16 MiB each way, every rank sending to both neighbours
  first (one NCCL group: launched one call at a time it would deadlock);
* ``other_stream``: an async all_reduce issued on one stream, ``work.wait()`` called with
  another stream current, whose kernel then reads the result: it must see the reduced values;
* ``failing_call``: a call that fails to start (a receive from any source: NCCL cannot) fails
  through torch (the call or ``work.wait()`` raises, the Future completes with the error), and
  the group works after it;
* ``ddp``: DDP on ``cuda:0`` over "aluminum" against DDP over an NCCL group of the same job
  (gloo's where NCCL cannot run): equal parameters after the steps, both step times.

    mpiexec -n 1 -env NCCL_HOSTID a python3 tests/gpu/torch_checks.py [checks] : \\
            -n 1 -env NCCL_HOSTID b python3 tests/gpu/torch_checks.py [checks]

Every check is bounded (AL_TORCH_CHECK_LIMIT seconds, default 90): past it, every thread's
stack is printed and the process exits, and lent_machine.sh reports the checks with no line as
FAIL. Exit status 0 when no check failed.
"""
from __future__ import annotations

import copy
import faulthandler
import os
import sys
import time

from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
CHECKS = ("collectives", "uneven_all_to_all", "batch_p2p", "other_stream", "failing_call", "ddp")


def report(check: str, problems: list[str], detail: str = "", skip: str | None = None) -> bool:
    """One line on rank 0 for `check`: SKIP (with `skip`, the same on every rank), else PASS
    unless some rank has problems. Returns False on FAIL."""
    everyone = WORLD.gather(problems, root=0)
    ok = True
    if RANK == 0:
        bad = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
        ok = not bad
        if skip is not None and ok:
            print(f"SKIP {check}: {skip}", flush=True)
        else:
            print(f"{'PASS' if ok else 'FAIL'} {check}: {'; '.join(bad) if bad else detail}",
                  flush=True)
    return WORLD.bcast(ok, root=0)


def _torch():
    """(torch, dist) with a CUDA device and the "aluminum" group made, or the reason to skip."""
    try:
        import torch
        import torch.distributed as dist
        import aluminum_py.torch  # noqa: F401  (registers "aluminum" and mpi://)
    except ImportError as e:
        return None, f"cannot import torch or aluminum_py.torch: {e}"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("aluminum", init_method="mpi://")
    return (torch, dist), None


class Expect:
    """Collects mismatches: ``expect(what, got, want, tol)`` compares on the host."""

    def __init__(self):
        self.problems: list[str] = []

    def __call__(self, what, got, want, tol=0.0):
        import torch
        got = got.detach().double().cpu()
        want = torch.as_tensor(want).double()
        if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=0):
            self.problems.append(f"{what}: got {got.flatten().tolist()[:6]}, expected "
                                 f"{want.flatten().tolist()[:6]}")


def check_collectives(torch, dist) -> bool:
    n, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", 0)
    R = dist.ReduceOp
    expect = Expect()
    inputs = [[(k % 3) + 1 + j for k in range(6)] for j in range(n)]   # rank j's, exact
    stack = torch.tensor(inputs, dtype=torch.float64)
    sums = {R.SUM: stack.sum(0), R.PRODUCT: stack.prod(0), R.MIN: stack.min(0).values,
            R.MAX: stack.max(0).values, R.AVG: stack.mean(0)}
    for async_op in (False, True):
        mode = "async" if async_op else "blocking"

        def done(work):
            if async_op:
                work.wait()
        for op, want in sums.items():
            dtypes = [torch.float32] + ([torch.bfloat16] if op in (R.SUM, R.AVG) else []) + \
                     ([torch.int64] if op != R.AVG else [])
            for dt in dtypes:
                t = torch.tensor(inputs[r], dtype=dt, device=dev)
                done(dist.all_reduce(t, op=op, async_op=async_op))
                expect(f"{mode} all_reduce {op} {dt}", t, want, 0.05 if dt == torch.bfloat16 else 0)
        b = torch.full((5,), float(r), device=dev)
        done(dist.broadcast(b, src=n - 1, async_op=async_op))
        expect(f"{mode} broadcast", b, [float(n - 1)] * 5)
        t = torch.tensor(inputs[r], dtype=torch.float32, device=dev)
        done(dist.reduce(t, dst=n - 1, async_op=async_op))
        if r == n - 1:
            expect(f"{mode} reduce", t, sums[R.SUM])
        outs = [torch.empty(3, device=dev) for _ in range(n)]
        done(dist.all_gather(outs, torch.full((3,), float(r), device=dev), async_op=async_op))
        expect(f"{mode} all_gather", torch.stack(outs), [[float(j)] * 3 for j in range(n)])
        want = [float(j) for j in range(n) for _ in range(3)]
        out = torch.empty(3 * n, device=dev)
        done(dist.all_gather_into_tensor(out, torch.full((3,), float(r), device=dev),
                                         async_op=async_op))
        expect(f"{mode} all_gather_into_tensor", out, want)
        out = torch.zeros(3 * n, device=dev)
        out[3 * r:3 * r + 3] = r
        done(dist.all_gather_into_tensor(out, out[3 * r:3 * r + 3], async_op=async_op))
        expect(f"{mode} all_gather_into_tensor in place", out, want)
        rs = torch.empty(2, device=dev)
        done(dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n, device=dev) + r,
                                        async_op=async_op))
        expect(f"{mode} reduce_scatter_tensor", rs,
               [n * (2 * r + k) + n * (n - 1) / 2 for k in (0, 1)])
        rs = torch.empty(2, device=dev)
        done(dist.reduce_scatter(rs, [torch.full((2,), float(10 * j + r), device=dev)
                                      for j in range(n)], async_op=async_op))
        expect(f"{mode} reduce_scatter", rs, [10.0 * r * n + n * (n - 1) / 2] * 2)
        a2a = torch.empty(n, device=dev)
        done(dist.all_to_all_single(a2a, torch.arange(float(n), device=dev) + 10 * r,
                                    async_op=async_op))
        expect(f"{mode} all_to_all_single", a2a, [r + 10.0 * j for j in range(n)])
        outs = [torch.empty(2, device=dev) for _ in range(n)]
        done(dist.all_to_all(outs, [torch.full((2,), 100.0 * r + j, device=dev)
                                    for j in range(n)], async_op=async_op))
        expect(f"{mode} all_to_all", torch.stack(outs), [[100.0 * j + r] * 2 for j in range(n)])
        g = [torch.empty(2, device=dev) for _ in range(n)] if r == 0 else None
        done(dist.gather(torch.full((2,), float(r), device=dev), g, dst=0, async_op=async_op))
        if r == 0:
            expect(f"{mode} gather", torch.stack(g), [[float(j)] * 2 for j in range(n)])
        s = torch.empty(2, device=dev)
        parts = [torch.full((2,), 7.0 * j, device=dev) for j in range(n)] if r == 0 else None
        done(dist.scatter(s, parts, src=0, async_op=async_op))
        expect(f"{mode} scatter", s, [7.0 * r] * 2)
        done(dist.barrier(async_op=async_op))
    torch.cuda.synchronize()
    return report("collectives", expect.problems, "every collective, blocking and async_op")


def check_uneven_all_to_all(torch, dist) -> bool:
    n, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", 0)
    expect = Expect()

    def count(src, dst):            # elements rank src sends rank dst
        return (src + 2 * dst) % 3 + 1 + 1000 * (src == dst)
    ins = [count(r, j) for j in range(n)]
    outs = [count(j, r) for j in range(n)]
    send = torch.cat([torch.arange(float(c), device=dev) + 1000 * r + 100 * j
                      for j, c in enumerate(ins)])
    recv = torch.full((sum(outs),), -1.0, device=dev)
    for async_op in (False, True):
        recv.fill_(-1)
        w = dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins,
                                   async_op=async_op)
        if async_op:
            w.wait()
        want = torch.cat([torch.arange(float(c)) + 1000 * j + 100 * r for j, c in enumerate(outs)])
        expect(f"{'async' if async_op else 'blocking'} all_to_all_single uneven", recv, want)
    return report("uneven_all_to_all", expect.problems, f"splits in {ins}, out {outs}")


def check_batch_p2p(torch, dist) -> bool:
    n, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", 0)
    if n < 2:
        return report("batch_p2p", [], skip="needs 2 ranks")
    right, left = (r + 1) % n, (r - 1) % n
    count = (16 << 20) // 4
    base = torch.arange(count, device=dev, dtype=torch.float32)
    xs = [base + 1e6 * r, base + 1e6 * r + 0.5]
    ys = [torch.empty(count, device=dev) for _ in xs]
    ops = [dist.P2POp(dist.isend, xs[0], right), dist.P2POp(dist.isend, xs[1], left),
           dist.P2POp(dist.irecv, ys[0], left), dist.P2POp(dist.irecv, ys[1], right)]
    t0 = time.perf_counter()
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    expect = Expect()
    expect("from the left", ys[0][:4], (base[:4] + 1e6 * left).cpu())
    expect("from the right", ys[1][:4], (base[:4] + 1e6 * right + 0.5).cpu())
    expect("all of it", (ys[0] - base - 1e6 * left).abs().max(), 0.0)
    return report("batch_p2p", expect.problems, f"16 MiB each way to both neighbours in "
                  f"{took * 1e3:.1f} ms")


def check_other_stream(torch, dist) -> bool:
    n, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", 0)
    expect = Expect()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    count = (64 << 20) // 4
    for rep in range(3):
        with torch.cuda.stream(producer):
            t = torch.full((count,), float(r + 1 + rep), device=dev)
            work = dist.all_reduce(t, async_op=True)
        with torch.cuda.stream(consumer):
            work.wait()                     # the consumer stream waits for the all_reduce
            y = t * 2
            t.record_stream(consumer)
        consumer.synchronize()
        want = 2.0 * sum(j + 1 + rep for j in range(n))
        expect(f"rep {rep}: consumer's min", y.min(), want)
        expect(f"rep {rep}: consumer's max", y.max(), want)
    return report("other_stream", expect.problems, "64 MiB all_reduce, wait() on another stream")


def check_failing_call(torch, dist) -> bool:
    n, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", 0)
    problems = []
    t = torch.zeros(4, device=dev)
    raised = None
    try:
        work = dist.irecv(t)                # any source: NCCL cannot
    except Exception as e:
        raised, work = e, None
    if work is not None:
        fut = work.get_future()
        try:
            work.wait()
        except Exception as e:
            raised = e
        try:
            fut.wait()
            problems.append("the Future completed without an error")
        except Exception:
            pass
    if raised is None:
        problems.append("neither the call nor work.wait() raised")
    elif "ANY_SOURCE" not in str(raised) and "source" not in str(raised):
        problems.append(f"the error does not say why: {type(raised).__name__}: {raised}")
    t = torch.full((4,), float(r + 1), device=dev)
    dist.all_reduce(t)
    expect = Expect()
    expect("all_reduce after the failure", t, [n * (n + 1) / 2] * 4)
    problems += expect.problems
    return report("failing_call", problems, f"{type(raised).__name__}: {str(raised)[:120]}")


def train(torch, models: dict, steps: int) -> dict:
    """`steps` SGD steps of each DDP model on this rank's batches (the same for every model);
    the median step time in ms per model, the first step left out."""
    times = {}
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator(device="cuda").manual_seed(1000 + RANK)
        took = []
        for _ in range(steps):
            inp = torch.randn(64, 256, device="cuda", generator=gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(inp).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
            took.append(time.perf_counter() - t0)
        times[name] = sorted(took[1:])[len(took[1:]) // 2] * 1e3
    return times


def check_ddp(torch, dist, steps: int = 8) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP
    reference, why = "nccl", ""
    try:
        ref_group = dist.new_group(backend="nccl")
        probe = torch.ones(1, device="cuda")
        dist.all_reduce(probe, group=ref_group)
        torch.cuda.synchronize()
    except Exception as e:          # NCCL cannot run here: gloo is the reference
        reference, why = "gloo", f" (NCCL group failed: {type(e).__name__}: {str(e)[:100]})"
        ref_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10)).cuda()
    models = {reference: DDP(copy.deepcopy(base), device_ids=[0], process_group=ref_group),
              "aluminum": DDP(copy.deepcopy(base), device_ids=[0])}
    problems, summary = ddp_against(torch, reference, models, steps)
    return report("ddp", problems, f"against {reference} DDP{why}: {summary}")


def chosen_checks(checks: tuple) -> list | None:
    """The checks named on the command line (all of `checks` without names); None, after
    saying so, for a name that is not one of them."""
    chosen = [a for a in sys.argv[1:] if not a.startswith("-")] or list(checks)
    unknown = [c for c in chosen if c not in checks]
    if unknown:
        print(f"unknown checks {unknown}; choose from {checks}", file=sys.stderr)
        return None
    return chosen


def ddp_against(torch, reference: str, models: dict, steps: int) -> tuple[list, str]:
    """Train the two DDP `models` (the `reference` one and another) alike; the problems (the
    parameters differ) and a summary with both median step times."""
    times = train(torch, models, steps)
    other = next(name for name in models if name != reference)
    diff = max(float((a - b).abs().max()) for a, b in
               zip(models[reference].parameters(), models[other].parameters()))
    problems = [] if diff <= 1e-5 else [f"parameters differ from {reference} DDP's by {diff:g}"]
    return problems, (f"{steps} steps, max |{other} - {reference}| = {diff:.2g}; median step "
                      f"{reference} {times[reference]:.2f} ms, {other} {times[other]:.2f} ms")


def main() -> int:
    chosen = chosen_checks(CHECKS)
    if chosen is None:
        return 2
    limit = float(os.environ.get("AL_TORCH_CHECK_LIMIT", "90"))
    loaded, why = _torch()
    ok = True
    for name in chosen:
        if loaded is None:
            ok = report(name, [], skip=why) and ok
            continue
        faulthandler.dump_traceback_later(limit, exit=True)     # a hang: stacks, then exit
        try:
            ok = globals()[f"check_{name}"](*loaded) and ok
        except Exception as e:      # a check that raised: FAIL, the next ones still run
            ok = report(name, [f"raised {type(e).__name__}: {e}"]) and ok
        finally:
            faulthandler.cancel_dump_traceback_later()
        WORLD.Barrier()
    if loaded is not None:
        loaded[1].destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
