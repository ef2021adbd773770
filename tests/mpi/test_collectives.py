"""Reduce, Reduce_scatter, Allgather, Bcast, Alltoall, Gather, Scatter, Barrier and point to
point (Send/Recv, Sendrecv), blocking and I-prefixed nonblocking, checked against numpy computed
from every rank's inputs: dtypes, ops, sizes 0, 1, 3, 7 and odd/large, every root, in place and
out of place.  Every check is collected per rank and asserted with `all_ranks_ok`, so all ranks
pass or fail a test together (a rank that left a test early would break the next collective)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from conftest import DTYPES, WORLD, all_ranks_ok, gather_all, make_input, ops_for, reference

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

SIZES = [0, 1, 3, 7, 1001]
# dtypes on which every valid op is checked (int, unsigned, half, float, complex)
ALL_OPS_DTYPES = [d for d in ("int32", "uint8", "float16", "float64",
                              "complex64") if d in DTYPES]
FILL = 7   # what outputs hold before a call; "untouched" means still FILL


def call(comm, name, blocking, *args, **kwargs):
    """comm.Name(...) or comm.Iname(...).Wait(timeout=60)."""
    if blocking:
        assert getattr(comm, name)(*args, **kwargs) is None
        return
    req = getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs)
    assert isinstance(req, al.Request)
    req.Wait(timeout=60)
    assert req.Test()


def filled(n, dtype):
    return np.full(n, FILL, dtype=dtype)


def check(failures, what, got, expected):
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        failures.append(f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}")
    elif not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)[:5]
        failures.append(f"{what}: at {bad} got {got[bad]} expected {expected[bad]}")


def reduce_ops(dtype):
    """Every valid op on a few dtypes; SUM and one more elsewhere (keeps the run short)."""
    ops = ops_for(dtype)
    return ops if dtype in ALL_OPS_DTYPES else (al.SUM, ops[-1])


# ---------------------------------------------------------------------------- Reduce
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce(comm, dtype):
    failures = []
    for op in reduce_ops(dtype):
        for count in SIZES:
            x = make_input(dtype, op, count, seed=count + 17 * op.code, rank=comm.rank)
            expected = reference(op, gather_all(x), comm.size)
            for root in range(comm.size):
                at_root = comm.rank == root
                for blocking in (True, False):
                    what = f"{op.name} n={count} root={root} blocking={blocking}"
                    # out of place (every rank passes an output; only root's is written)
                    src, out = x.copy(), filled(count, dtype)
                    call(comm, "Reduce", blocking, src, out, op=op, root=root)
                    check(failures, what + " input", src, x)
                    check(failures, what + " out", out, expected if at_root else filled(count, dtype))
                    # in place at root; non-roots pass recvbuf=None too and keep their input
                    buf = x.copy()
                    call(comm, "Reduce", blocking, buf, None, op=op, root=root)
                    check(failures, what + " in place", buf, expected if at_root else x)
    assert all_ranks_ok(not failures), failures[:10]


def test_reduce_longer_output_and_2d(comm):
    """recvbuf longer than sendbuf: only the first count elements are written; 2-D arrays."""
    failures = []
    x = make_input("int16", al.MAX, 12, seed=3, rank=comm.rank).reshape(3, 4)
    expected = reference(al.MAX, gather_all(x.ravel()), comm.size)
    for root in range(comm.size):
        out = filled(15, np.int16)
        comm.Reduce(x, out, op=al.MAX, root=root)
        want = np.concatenate([expected, filled(3, np.int16)]) if comm.rank == root else filled(15, np.int16)
        check(failures, f"root={root}", out, want)
    assert all_ranks_ok(not failures), failures


# ---------------------------------------------------------------------------- Reduce_scatter
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(comm, dtype):
    failures = []
    p, r = comm.size, comm.rank
    for op in reduce_ops(dtype):
        for count in SIZES:
            x = make_input(dtype, op, count * p, seed=count + 23 * op.code, rank=r)
            expected = reference(op, gather_all(x), p)[r * count:(r + 1) * count]
            for blocking in (True, False):
                what = f"{op.name} n={count} blocking={blocking}"
                src, out = x.copy(), filled(count + 2, dtype)
                call(comm, "Reduce_scatter", blocking, src, out, op=op)
                check(failures, what + " input", src, x)
                check(failures, what + " out", out[:count], expected)
                check(failures, what + " out tail", out[count:], filled(2, dtype))
                buf = x.copy()
                call(comm, "Reduce_scatter", blocking, buf, op=op)
                check(failures, what + " in place", buf[:count], expected)
    assert all_ranks_ok(not failures), failures[:10]


# ---------------------------------------------------------------------------- Allgather
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm, dtype):
    failures = []
    p, r = comm.size, comm.rank
    for count in SIZES:
        x = make_input(dtype, al.SUM, count, seed=count + 5, rank=r)
        expected = gather_all(x).reshape(-1)
        for blocking in (True, False):
            what = f"n={count} blocking={blocking}"
            src, out = x.copy(), filled(p * count + 1, dtype)
            call(comm, "Allgather", blocking, src, out)
            check(failures, what + " input", src, x)
            check(failures, what + " out", out[:-1], expected)
            check(failures, what + " out tail", out[-1:], filled(1, dtype))
            buf = filled(p * count, dtype)
            buf[r * count:(r + 1) * count] = x
            call(comm, "Allgather", blocking, buf)
            check(failures, what + " in place", buf, expected)
    assert all_ranks_ok(not failures), failures[:10]


# ---------------------------------------------------------------------------- Bcast
@pytest.mark.parametrize("dtype", ["int8", "uint64", "float16", "float64", "complex128"])
def test_bcast(comm, dtype):
    failures = []
    for count in SIZES:
        x = make_input(dtype, al.SUM, count, seed=count + 11, rank=comm.rank)
        stack = gather_all(x)
        for root in range(comm.size):
            for blocking in (True, False):
                buf = x.copy() if comm.rank == root else filled(count, dtype)
                call(comm, "Bcast", blocking, buf, root=root)
                check(failures, f"n={count} root={root} blocking={blocking}", buf, stack[root])
    assert all_ranks_ok(not failures), failures[:10]


def test_bcast_read_only_at_root(comm):
    """Root only reads `buf`: a read-only array is fine there."""
    failures = []
    for root in range(comm.size):
        if comm.rank == root:
            buf = np.arange(5, dtype=np.int32) + 100 * root
            buf.flags.writeable = False
        else:
            buf = filled(5, np.int32)
        comm.Bcast(buf, root=root)
        check(failures, f"root={root}", buf, np.arange(5, dtype=np.int32) + 100 * root)
    assert all_ranks_ok(not failures), failures


# ---------------------------------------------------------------------------- Alltoall
@pytest.mark.parametrize("dtype", ["int32", "uint8", "float16", "float64", "complex64"])
def test_alltoall(comm, dtype):
    failures = []
    p, r = comm.size, comm.rank
    for count in SIZES:
        x = make_input(dtype, al.SUM, count * p, seed=count + 13, rank=r)
        stack = gather_all(x)
        # block r of every rank's sendbuf, in rank order
        expected = stack[:, r * count:(r + 1) * count].reshape(-1)
        for blocking in (True, False):
            what = f"n={count} blocking={blocking}"
            src, out = x.copy(), filled(p * count + 1, dtype)
            call(comm, "Alltoall", blocking, src, out)
            check(failures, what + " input", src, x)
            check(failures, what + " out", out[:-1], expected)
            check(failures, what + " out tail", out[-1:], filled(1, dtype))
            buf = x.copy()
            call(comm, "Alltoall", blocking, buf)
            check(failures, what + " in place", buf, expected)
    assert all_ranks_ok(not failures), failures[:10]


# ---------------------------------------------------------------------------- Gather
@pytest.mark.parametrize("dtype", ["int64", "uint16", "float32", "complex128"])
def test_gather(comm, dtype):
    failures = []
    p, r = comm.size, comm.rank
    for count in SIZES:
        x = make_input(dtype, al.SUM, count, seed=count + 29, rank=r)
        expected = gather_all(x).reshape(-1)
        for root in range(p):
            at_root = r == root
            for blocking in (True, False):
                what = f"n={count} root={root} blocking={blocking}"
                # every rank passes an output; only root's is written
                src, out = x.copy(), filled(p * count, dtype)
                call(comm, "Gather", blocking, src, out, root=root)
                check(failures, what + " input", src, x)
                check(failures, what + " out", out, expected if at_root else filled(p * count, dtype))
                # root in place (its block at block `root`); the others pass recvbuf=None
                if at_root:
                    buf = filled(p * count, dtype)
                    buf[r * count:(r + 1) * count] = x
                    call(comm, "Gather", blocking, buf, None, root=root)
                    check(failures, what + " in place", buf, expected)
                else:
                    src = x.copy()
                    call(comm, "Gather", blocking, src, None, root=root)
                    check(failures, what + " non-root input", src, x)
    assert all_ranks_ok(not failures), failures[:10]


# ---------------------------------------------------------------------------- Scatter
@pytest.mark.parametrize("dtype", ["int8", "uint32", "float64", "complex64"])
def test_scatter(comm, dtype):
    failures = []
    p, r = comm.size, comm.rank
    for count in SIZES:
        x = make_input(dtype, al.SUM, count * p, seed=count + 31, rank=r)
        stack = gather_all(x)
        for root in range(p):
            at_root = r == root
            expected = stack[root, r * count:(r + 1) * count]
            for blocking in (True, False):
                what = f"n={count} root={root} blocking={blocking}"
                # out of place; non-roots pass their own (ignored) array as sendbuf
                src, out = x.copy(), filled(count, dtype)
                call(comm, "Scatter", blocking, src, out, root=root)
                check(failures, what + " input", src, x)
                check(failures, what + " out", out, expected)
                # root in place: its block stays in sendbuf, which is unchanged;
                # non-roots pass sendbuf=None
                if at_root:
                    buf = x.copy()
                    call(comm, "Scatter", blocking, buf, None, root=root)
                    check(failures, what + " in place", buf, x)
                else:
                    out = filled(count, dtype)
                    call(comm, "Scatter", blocking, None, out, root=root)
                    check(failures, what + " sendbuf=None", out, expected)
    assert all_ranks_ok(not failures), failures[:10]


# ---------------------------------------------------------------------------- large counts
def test_large_odd_counts(comm):
    """A larger odd count through every collective (count not divisible by 2, 3 or 4)."""
    failures = []
    p, r = comm.size, comm.rank
    n = (1 << 17) + 1
    dt = "float64"
    x = make_input(dt, al.SUM, n * p, seed=1, rank=r)
    stack = gather_all(x)
    total = reference(al.SUM, stack, p)
    root = p - 1
    out = filled(n * p, dt)
    comm.Reduce(x, out, root=root)
    if r == root:
        check(failures, "reduce", out, total)
    out = filled(n, dt)
    comm.Ireduce_scatter(x, out).Wait(timeout=60)
    check(failures, "reduce_scatter", out, total[r * n:(r + 1) * n])
    out = filled(n * p * p, dt)
    comm.Iallgather(x, out).Wait(timeout=60)
    check(failures, "allgather", out, stack.reshape(-1))
    out = filled(n * p, dt)
    comm.Alltoall(x, out)
    check(failures, "alltoall", out, stack[:, r * n:(r + 1) * n].reshape(-1))
    buf = x.copy()
    comm.Bcast(buf, root=root)
    check(failures, "bcast", buf, stack[root])
    out = filled(n, dt)
    comm.Scatter(x, out, root=root)
    check(failures, "scatter", out, stack[root, r * n:(r + 1) * n])
    assert all_ranks_ok(not failures), failures


# ---------------------------------------------------------------------------- Barrier
@pytest.mark.parametrize("blocking", [True, False])
def test_barrier_orders_ranks(comm, blocking):
    """No rank leaves the barrier before the last rank (rank 0, delayed) has entered it.
    time.monotonic is one clock for every process on a machine, so compare across ranks."""
    if comm.local_size != comm.size:
        WORLD.Barrier()
        pytest.skip("needs all ranks on one node (a shared monotonic clock)")
    WORLD.Barrier()
    if comm.rank == 0:
        time.sleep(0.2)
    entered = time.monotonic()
    call(comm, "Barrier", blocking)
    left = time.monotonic()
    entered0 = WORLD.bcast(entered, root=0)
    assert all_ranks_ok(left >= entered0), (left, entered0)


def test_barrier_many_nonblocking(comm):
    """20 Ibarriers in flight.  Rank 0 is held at a gate (a barrier on MPI.COMM_WORLD) and
    enters them only after the other ranks checked theirs: there no Ibarrier may complete
    (Test() False, all 20 pending) until rank 0 has entered; then all complete."""
    from conftest import every_rank, phase, wait_for
    failures = []
    gated = comm.size > 1 and comm.rank > 0
    wait_for(lambda: comm._state.pending == 0)      # ops an earlier test left (none expected)
    if comm.size > 1 and comm.rank == 0:
        WORLD.Barrier()                      # the gate
    reqs = [comm.Ibarrier() for _ in range(20)]
    if gated:
        # give the engine every chance to (wrongly) complete one: wait until it started all
        if not wait_for(lambda: all(phase(q) != "new" for q in reqs)):
            failures.append(f"Ibarriers not started: {[phase(q) for q in reqs]}")
        done = [i for i, q in enumerate(reqs) if q.Test()]
        if done or comm._state.pending != 20:
            failures.append(f"Ibarriers {done} complete and pending {comm._state.pending} "
                            f"before rank 0 entered")
        WORLD.Barrier()                      # open the gate
    al.Waitall(reqs, timeout=60)
    if not all(q.Test() for q in reqs) or comm._state.pending != 0:
        failures.append(f"after Waitall: Test {[q.Test() for q in reqs]}, pending "
                        f"{comm._state.pending}")
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------------------- point to point
P2P_SIZES = [0, 1, 7, 100003]


def need_peer(comm):
    if comm.size == 1:
        pytest.skip("needs at least 2 ranks")


@pytest.mark.parametrize("dtype", ["int16", "float32", "complex128"])
def test_send_recv_ring(comm, dtype):
    """Blocking Send/Recv around the ring (even ranks send first, odd ranks receive first;
    100003 elements force the rendezvous protocol), each message tagged with its count."""
    need_peer(comm)
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    failures = []
    for count in P2P_SIZES:
        x = make_input(dtype, al.SUM, count, seed=count + 41, rank=r)
        stack = gather_all(x)
        src, out = x.copy(), filled(count, dtype)
        tag = count % 32768
        if r % 2 == 0:
            comm.Send(src, right, tag=tag)
            comm.Recv(out, left, tag=tag)
        else:
            comm.Recv(out, left, tag=tag)
            comm.Send(src, right, tag=tag)
        check(failures, f"n={count} input", src, x)
        check(failures, f"n={count}", out, stack[left])
    assert all_ranks_ok(not failures), failures


@pytest.mark.parametrize("dtype", ["uint8", "float64"])
def test_isend_irecv_ring(comm, dtype):
    """Isend/Irecv around the ring, both directions at once; works at 1 rank (sends to self)."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    failures = []
    for count in P2P_SIZES:
        x = make_input(dtype, al.SUM, count, seed=count + 43, rank=r)
        stack = gather_all(x)
        from_left, from_right = filled(count, dtype), filled(count, dtype)
        src = x.copy()
        reqs = [comm.Irecv(from_left, left, tag=1), comm.Irecv(from_right, right, tag=2),
                comm.Isend(src, right, tag=1), comm.Isend(src, left, tag=2)]
        assert all(isinstance(q, al.Request) for q in reqs)
        al.Waitall(reqs, timeout=60)
        check(failures, f"n={count} from left", from_left, stack[left])
        check(failures, f"n={count} from right", from_right, stack[right])
        check(failures, f"n={count} input", src, x)
    assert all_ranks_ok(not failures), failures


def test_tags_select_messages(comm):
    """Two messages to the same peer with different tags, received in the opposite order."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    a = np.full(10, 1000 + r, dtype=np.int32)
    b = np.full(20, 2000 + r, dtype=np.int32)
    sa, sb = comm.Isend(a, right, tag=5), comm.Isend(b, right, tag=9)
    got_b, got_a = filled(20, np.int32), filled(10, np.int32)
    rb = comm.Irecv(got_b, left, tag=9)
    comm.Recv(got_a, left, tag=5)
    rb.Wait(timeout=60)
    al.Waitall([sa, sb], timeout=60)
    failures = []
    check(failures, "tag 5", got_a, np.full(10, 1000 + left, dtype=np.int32))
    check(failures, "tag 9", got_b, np.full(20, 2000 + left, dtype=np.int32))
    assert all_ranks_ok(not failures), failures


def test_same_tag_messages_do_not_overtake(comm):
    """Messages with one (source, tag) arrive in send order (engine keeps call order)."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    sends = [np.full(3 + 1000 * (i % 2), 10 * r + i, dtype=np.int64) for i in range(8)]
    outs = [filled(3 + 1000 * (i % 2), np.int64) for i in range(8)]
    reqs = [comm.Irecv(o, left, tag=3) for o in outs] + [comm.Isend(s, right, tag=3) for s in sends]
    al.Waitall(reqs, timeout=60)
    failures = []
    for i, o in enumerate(outs):
        check(failures, f"message {i}", o, np.full(o.size, 10 * left + i, dtype=np.int64))
    assert all_ranks_ok(not failures), failures


def test_recv_any_source_any_tag(comm):
    """Rank 0 receives one message from every other rank with MPI.ANY_SOURCE and MPI.ANY_TAG
    (Recv and Irecv alternately); the payload says who sent it."""
    need_peer(comm)
    p, r = comm.size, comm.rank
    ok = True
    if r == 0:
        got = []
        for i in range(p - 1):
            buf = filled(4, np.int32)
            if i % 2:
                comm.Recv(buf, MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            else:
                req = comm.Irecv(buf, MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
                req.Wait(timeout=60)
            got.append(buf)
        senders = sorted(int(b[0]) for b in got)
        ok = senders == list(range(1, p)) and all(np.array_equal(b, np.full(4, b[0])) for b in got)
    else:
        comm.Send(np.full(4, r, dtype=np.int32), 0, tag=100 + r)
    assert all_ranks_ok(ok)


def test_recv_any_source_with_tag(comm):
    """ANY_SOURCE with a specific tag only matches that tag."""
    need_peer(comm)
    p, r = comm.size, comm.rank
    failures = []
    if r == 0:
        tagged = filled(2, np.int64)
        comm.Recv(tagged, MPI.ANY_SOURCE, tag=77)
        check(failures, "tag 77", tagged, np.full(2, p - 1, dtype=np.int64))
        rest = filled(2, np.int64)
        for _ in range(p - 2):
            comm.Recv(rest, MPI.ANY_SOURCE, tag=1)
            if not (rest[0] == rest[1] and 1 <= rest[0] < p - 1):
                failures.append(f"tag 1: {rest}")
    else:
        # the last rank sends tag 77; the others send tag 1 first
        comm.Send(np.full(2, r, dtype=np.int64), 0, tag=77 if r == p - 1 else 1)
    assert all_ranks_ok(not failures), failures


@pytest.mark.parametrize("blocking", [True, False])
def test_sendrecv_ring(comm, blocking):
    """Sendrecv shifting around the ring (at 1 rank: to self); recvbuf longer than the
    message keeps its tail; the source may be ANY_SOURCE."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    failures = []
    for count in P2P_SIZES:
        x = make_input("int32", al.SUM, count, seed=count + 47, rank=r)
        stack = gather_all(x)
        for source in (left, MPI.ANY_SOURCE):
            src, out = x.copy(), filled(count + 3, np.int32)
            call(comm, "Sendrecv", blocking, src, right, out, source, tag=count % 100)
            what = f"n={count} source={source}"
            check(failures, what + " input", src, x)
            check(failures, what, out[:count], stack[left])   # only `left` sends to this rank
            check(failures, what + " tail", out[count:], filled(3, np.int32))
    assert all_ranks_ok(not failures), failures


def test_user_messages_never_match_collective_traffic(comm):
    """An Irecv(ANY_SOURCE, ANY_TAG) posted before many algorithm-driven Allreduces (their
    point-to-point traffic) and other collectives must match only the user's later Send."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    catch = filled(64, np.int64)
    req = comm.Irecv(catch, MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    tagged = filled(64, np.int64)
    req2 = comm.Irecv(tagged, left, tag=0)
    failures = []
    s = sum(range(p))
    for i, alg in enumerate(["ring", "ring", "rabenseifner", "recursive_doubling", "ring"] * 2):
        x = np.full(64 + 37 * i, r, dtype=np.int64)   # same element count as `catch` at i=0
        if i % 2:
            comm.Iallreduce(x, algorithm=alg).Wait(timeout=60)
        else:
            comm.Allreduce(x, algorithm=alg)
        check(failures, f"allreduce {alg} #{i}", x, np.full(x.size, s, dtype=np.int64))
    y = np.full(64, r, dtype=np.int64)
    comm.Bcast(y, root=p - 1)
    out = filled(64 * p, np.int64)
    comm.Allgather(np.full(64, r, dtype=np.int64), out)
    check(failures, "allgather", out, np.repeat(np.arange(p, dtype=np.int64), 64))
    comm.Barrier()   # every rank is done with its collectives: nothing user-sent yet
    if req.Test() or req2.Test():
        failures.append(f"a user Irecv matched library traffic: {catch[:4]} {tagged[:4]}")
    WORLD.Barrier()  # every rank has looked before anyone sends
    # now the user's messages to the right neighbour: tag 4 (only the ANY_TAG receive, posted
    # first, can take it), then tag 0 (left for the tag-0 receive)
    msg4 = np.arange(64, dtype=np.int64) + 1000 * r
    msg0 = msg4 + 500
    comm.Send(msg4, right, tag=4)
    comm.Send(msg0, right, tag=0)
    req.Wait(timeout=60)
    req2.Wait(timeout=60)
    check(failures, "any-source receive", catch, np.arange(64, dtype=np.int64) + 1000 * left)
    check(failures, "tag-0 receive", tagged, np.arange(64, dtype=np.int64) + 1000 * left + 500)
    assert all_ranks_ok(not failures), failures
