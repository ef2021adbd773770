"""aluminum_py.torch under DDP (gloo process group for DDP's own set-up, the library for the
gradients): training matches single-process training on the concatenated data, and gloo DDP
itself (bitwise at 2 ranks); failures reach backward() through the hook's Future."""
import os
import tempfile
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import aluminum_py as al  # noqa: E402
import aluminum_py.torch as alt  # noqa: E402
from aluminum_py.torch.completion import Completion  # noqa: E402

from conftest import WORLD, all_ranks_ok, gather_all  # noqa: E402

SAMPLES = 24                    # divisible by 1, 2, 3 and 4 ranks
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def group():
    """The gloo process group DDP needs (rendezvous through a file named by rank 0), for this
    module only."""
    path = None
    if WORLD.rank == 0:
        path = os.path.join(tempfile.mkdtemp(prefix="al-torch-"), "store")
    path = WORLD.bcast(path, root=0)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=WORLD.rank,
                            world_size=WORLD.size)
    yield dist.group.WORLD
    dist.destroy_process_group()


def data(dtype, features=6, outputs=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(SAMPLES, features, generator=g, dtype=dtype)
    Y = torch.randn(SAMPLES, outputs, generator=g, dtype=dtype)
    return X, Y


def model(dtype, features=6, hidden=10, outputs=3, seed=11):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, outputs)).to(dtype)


def shard(t):
    n = SAMPLES // WORLD.size
    return t[WORLD.rank * n:(WORLD.rank + 1) * n]


def train(net, X, Y, steps, before_step=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(X), Y).backward()
        if before_step is not None:
            before_step()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def ddp(net, hook=None, state=None):
    d = DDP(net, bucket_cap_mb=0.0005)           # several buckets even for this small model
    if hook is not None:
        d.register_comm_hook(state, hook)
    return d


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def same_on_all_ranks(params):
    flat = torch.cat([p.reshape(-1) for p in params]).numpy()
    stack = gather_all(flat)
    return bool((stack == stack[0]).all())


def test_allreduce_hook_matches_single_process(group, comm):
    X, Y = data(torch.float64)
    reference = train(model(torch.float64), X, Y, 4)
    got = train(ddp(model(torch.float64), alt.allreduce_hook, comm), shard(X), shard(Y), 4)
    assert all_ranks_ok(max_diff(got, reference) < 1e-12 and same_on_all_ranks(got))


def test_allreduce_hook_equals_gloo_ddp(group, comm):
    X, Y = data(torch.float32)
    gloo = train(ddp(model(torch.float32)), shard(X), shard(Y), 5)
    ours = train(ddp(model(torch.float32), alt.allreduce_hook, comm), shard(X), shard(Y), 5)
    diff = max_diff(ours, gloo)
    # gloo DDP divides each gradient by the size before summing; AVG sums, then divides: with
    # two ranks both are exact halvings of the same sum
    assert all_ranks_ok(diff == 0.0 if WORLD.size <= 2 else diff < 1e-6)


def test_default_communicator_state_none(group):
    X, Y = data(torch.float64)
    reference = train(model(torch.float64), X, Y, 2)
    got = train(ddp(model(torch.float64), alt.allreduce_hook, None), shard(X), shard(Y), 2)
    assert all_ranks_ok(max_diff(got, reference) < 1e-12)
    assert alt.default_communicator() is alt.default_communicator()


def test_one_waiter_thread(group, comm):
    X, Y = data(torch.float64)
    train(ddp(model(torch.float64), alt.allreduce_hook, comm), shard(X), shard(Y), 3)
    waiters = [t for t in threading.enumerate() if t.name == "aluminum_py.torch waiter"]
    assert all_ranks_ok(len(waiters) == 1)


@pytest.mark.parametrize("hook,dtype,tol", [
    ("fp16_compress_hook", np.float16, 2e-3),
    ("bf16_compress_hook", None, 1.6e-2),
])
def test_compress_hooks_average_the_gradients(group, comm, hook, dtype, tol):
    if hook == "bf16_compress_hook":
        pytest.importorskip("ml_dtypes")
    X, Y = data(torch.float32)
    net = ddp(model(torch.float32), getattr(alt, hook), comm)
    torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy()
    local = model(torch.float32)
    torch.nn.functional.mse_loss(local(shard(X)), shard(Y)).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()]).numpy()
    expect = gather_all(mine).astype(np.float64).mean(axis=0)
    scale = max(float(np.abs(expect).max()), 1e-30)
    ok = np.abs(got - expect).max() <= tol * scale and got.dtype == np.float32
    assert all_ranks_ok(ok)


def test_error_reaches_backward_through_the_future(group):
    freed = al.Communicator()
    freed.Free()
    X, Y = data(torch.float64)
    net = ddp(model(torch.float64), alt.allreduce_hook, freed)
    with pytest.raises(Exception, match="free"):
        torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()


def test_bad_state_reaches_backward(group):
    X, Y = data(torch.float64)
    net = ddp(model(torch.float64), alt.allreduce_hook, "not a communicator")
    with pytest.raises(Exception, match="Communicator"):
        torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()


class _FailingRequest:
    def Wait(self, timeout=None):
        raise al.TimeoutError("Iallreduce: not complete (test)")


@pytest.mark.local
def test_waiter_sets_exceptions_and_results():
    failed, done = torch.futures.Future(), torch.futures.Future()
    alt._waiter.submit(Completion([_FailingRequest()], failed, lambda: None))
    ok = type("Done", (), {"Wait": lambda self, timeout=None: None})()
    alt._waiter.submit(Completion([ok], done, lambda: torch.ones(2)))
    with pytest.raises(Exception, match="not complete"):
        failed.wait()
    assert torch.equal(done.wait(), torch.ones(2))


@pytest.mark.local
def test_drain_completes_every_pending_future_once():
    """The last bucket's hook completes the pending Futures in the training thread; each Future
    is completed exactly once whichever thread gets to it."""
    calls = []
    ok = type("Done", (), {"Wait": lambda self, timeout=None: None})()
    futs = [torch.futures.Future() for _ in range(20)]
    for k, f in enumerate(futs):
        alt._waiter.submit(Completion([ok], f, lambda k=k: calls.append(k) or torch.tensor([k])))
    alt._waiter.drain()
    assert [int(f.wait()) for f in futs] == list(range(20))
    assert sorted(calls) == list(range(20))


@pytest.mark.local
def test_as_buffer_shares_memory():
    t = torch.zeros(5, dtype=torch.float32)
    a = alt.as_buffer(t)
    a[2] = 3.0
    assert t[2].item() == 3.0 and a.dtype == np.float32
    with pytest.raises(ValueError, match="contiguous"):
        alt.as_buffer(torch.zeros(4, 4)[:, 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allreduce_hook_cuda(group, comm):
    X, Y = data(torch.float32)
    reference = train(model(torch.float32), X, Y, 3)
    net = ddp(model(torch.float32).cuda(), alt.allreduce_hook, comm)
    got = train(net, shard(X).cuda(), shard(Y).cuda(), 3)
    assert all_ranks_ok(max_diff([g.cpu() for g in got], reference) < 1e-5)


# --------------------------------------------------------------------- synchronize_gradients
@pytest.mark.parametrize("policy,zero,hook", [
    ("auto", "arena", "auto"),
    ("none", "set_to_none", "post_accumulate"),
    ("fixed", "set_to_false", "tensor"),
    ("osf", "arena", "auto"),                     # measures its profile, then plans
])
def test_synchronize_gradients_matches_single_process(comm, policy, zero, hook):
    X, Y = data(torch.float64)
    steps = {"auto": 14, "osf": 7}.get(policy, 4)   # auto tunes, osf measures first
    reference = train(model(torch.float64), X, Y, steps)
    net = model(torch.float64)
    sync = alt.synchronize_gradients(net, comm, policy=policy, hook=hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    in_arena = True
    for _ in range(steps):
        if zero == "arena":
            sync.zero_grad()
        else:
            opt.zero_grad(set_to_none=(zero == "set_to_none"))
        torch.nn.functional.mse_loss(net(shard(X)), shard(Y)).backward()
        sync.wait(timeout=60)
        in_arena &= all(p.grad.data_ptr() == torch.from_numpy(g).data_ptr()
                        for p, g in zip(net.parameters(), sync.grads))
        opt.step()
    got = [p.detach().clone() for p in net.parameters()]
    ok = max_diff(got, reference) < 1e-12 and same_on_all_ranks(got) and in_arena
    if policy == "auto":
        ok &= sync.synchronizer.chosen is not None
    if policy == "osf":
        ok &= sync.profile is not None and sync.profile.measured
    assert all_ranks_ok(ok)
    sync.remove()


def test_synchronize_gradients_mixed_dtypes_and_shared_parameter(comm):
    torch.manual_seed(3)
    a = torch.nn.Linear(4, 4).double()
    b = torch.nn.Linear(4, 2)                      # float32
    params = list(a.parameters()) + list(b.parameters()) + [a.weight]   # a.weight twice
    sync = alt.synchronize_gradients(params, comm, policy="fixed", threshold=64)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(WORLD.rank))
    sync.zero_grad()
    (a(x).sum() + b(a(x).float()).sum()).backward()
    sync.wait(timeout=60)
    mine = [p.grad.detach().numpy().copy() for p in sync.params]
    local = []
    for p in sync.params:                           # the local gradients, recomputed
        p.grad = None
    sync.remove()
    (a(x).sum() + b(a(x).float()).sum()).backward()
    local = [p.grad.detach().numpy() for p in sync.params]
    ok = len(sync.params) == 4 and set(sync.arenas) == {np.dtype("float64"), np.dtype("float32")}
    for m, loc in zip(mine, local):
        expect = gather_all(loc.reshape(-1)).mean(axis=0).astype(loc.dtype).reshape(loc.shape)
        ok &= np.allclose(m, expect, rtol=1e-6 if m.dtype == np.float32 else 1e-13, atol=0)
    assert all_ranks_ok(ok)


def test_synchronize_gradients_rejects(comm):
    with pytest.raises(ValueError, match="hook"):
        alt.synchronize_gradients(model(torch.float64), comm, hook="bogus")
    with pytest.raises(ValueError, match="no parameter"):
        alt.synchronize_gradients([torch.zeros(2)], comm)


def test_hooks_from_a_thread_that_did_not_make_the_communicator(group, comm):
    """The training loop runs in another thread than the one that made the communicator (torch
    runs hooks on the thread of ``backward()`` for CPU work, on its own threads for CUDA): the
    DDP hook and synchronize_gradients hand the communicator over to it (the threading rule)
    and the results equal the single-process ones; the main thread takes it back after."""
    X, Y = data(torch.float64)
    reference = train(model(torch.float64), X, Y, 3)
    got, errors = [], []

    def run():
        try:
            got.append(train(ddp(model(torch.float64), alt.allreduce_hook, comm), shard(X),
                             shard(Y), 3))
            net = model(torch.float64)
            sync = alt.synchronize_gradients(list(net.parameters()), comm, policy="fixed")
            got.append(train(net, shard(X), shard(Y), 3, before_step=lambda: sync.wait(60)))
            sync.remove()
        except Exception as e:          # noqa: BLE001 (reported below)
            errors.append(repr(e))

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    comm.bind_thread()
    ok = not errors and len(got) == 2 and all(max_diff(g, reference) < 1e-12 for g in got)
    assert all_ranks_ok(ok), errors
