"""Reliability under the conditions users hit (issue 16): Ctrl-C while a peer is late, fork,
threads, long runs.

The SIGINT tests send the signal from another thread (``os.kill``) once it has seen rank 0
waiting inside its call for a late rank 1 (state, not a clock: CommState.busy, or the main
thread's stack in Request.Wait / Waitall), and rank 1 joins only once rank 0 has been
interrupted and says so (a message on MPI.COMM_WORLD: a gate, not a sleep); they assert on
state (KeyboardInterrupt raised, op pending, results equal to numpy's) and bound the latency
only as a hang guard (BOUND): the measured figure is printed and recorded in
docs/semantics.md, never asserted tightly.
"""
import contextlib
import os
import signal
import statistics
import sys
import threading
import time

import numpy as np
import pytest

import aluminum_py as al

import conftest
from conftest import WORLD, all_ranks_ok, differences, every_rank, ramp, ramp_reference, wait_for

GATE = 4343         # tag of rank 0's message (on MPI.COMM_WORLD) that lets the late rank 1 join
BOUND = 30.0        # a hang guard on the SIGINT latency (the target is 100 ms)


@contextlib.contextmanager
def sigint_when(waiting, sent: list):
    """Send this process SIGINT (from another thread) once `waiting()` holds, recording when
    and whether it held in `sent` (after a 60 s hang guard the signal is sent all the same,
    recorded as not waiting). The default handler (KeyboardInterrupt) is installed for the
    duration: a launcher may start ranks with SIGINT ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()

    def fire():
        seen = wait_for(lambda: done.is_set() or waiting())
        if not done.is_set():
            sent.append((time.monotonic(), seen))
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=fire)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        signal.signal(signal.SIGINT, old)


def in_wait(thread: int) -> bool:
    """Whether thread `thread` (an ident) is inside Request.Wait or Waitall."""
    waits = (al.Request.Wait.__code__, al.Waitall.__code__)
    f = sys._current_frames().get(thread)
    while f is not None and f.f_code not in waits:
        f = f.f_back
    return f is not None


def interrupted(call, waiting, failures: list) -> float | None:
    """Run `call` with a SIGINT sent once `waiting()` holds (rank 0 waits inside the call);
    the seconds from the signal to the KeyboardInterrupt (None, and a failure, if it was not
    raised)."""
    sent = []
    try:
        with sigint_when(waiting, sent):
            call()
    except KeyboardInterrupt:
        raised = time.monotonic()
    else:
        failures.append(f"no KeyboardInterrupt: {call} returned")
        return None
    if not (sent and sent[0][1]):
        failures.append(f"{call} was not seen waiting inside the call (SIGINT after the guard)")
        return None
    return raised - sent[0][0]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "waitall"])
def test_sigint_while_peer_is_late(mode):
    """Rank 1 joins an Allreduce only once rank 0 has been interrupted; rank 0 gets SIGINT
    once it waits inside the call and raises KeyboardInterrupt within BOUND (today's target:
    100 ms). The op stays with the engine and completes when rank 1 arrives (result equal to
    numpy's). Blocking: the
    communicator refuses new ops, naming the interrupted one, until it completes, then works
    again. Nonblocking (Wait, Waitall): the Request stays valid; Wait again completes it."""
    if WORLD.size < 2:
        pytest.skip("needs a late peer")
    comm = al.Communicator()
    failures = []
    n = 50000
    x = ramp(n, 0, comm.rank)
    expected = ramp_reference(n, 0, comm.size)
    WORLD.Barrier()
    if comm.rank == 1:
        WORLD.recv(source=0, tag=GATE)                  # until rank 0 has been interrupted
    if comm.rank == 0:
        req = []

        def call():
            if mode == "blocking":
                comm.Allreduce(x, algorithm="ring")
            else:
                req.append(comm.Iallreduce(x, algorithm="ring"))
                if mode == "waitall":
                    al.Waitall(req)
                else:
                    req[0].Wait()

        main = threading.get_ident()
        latency = interrupted(call, (lambda: comm._state.busy) if mode == "blocking" else
                              (lambda: in_wait(main)), failures)
        if latency is not None:
            print(f"\nSIGINT latency ({mode}): {latency * 1e3:.1f} ms")
            if latency > BOUND:
                failures.append(f"KeyboardInterrupt {latency:.2f} s after SIGINT (bound {BOUND} s)")
        if mode == "blocking":
            try:
                comm.Allreduce(np.zeros(3, np.float32))     # rank 1 still waits: refused
                failures.append("a new op ran on the communicator of the interrupted call")
            except al.Error as e:
                if "interrupted" not in str(e) or "allreduce/ring" not in str(e):
                    failures.append(f"the error does not name the interrupted op: {e}")
            WORLD.send(None, dest=1, tag=GATE)
            if not wait_for(lambda: comm._state.pending == 0):
                failures.append("the interrupted op never completed")
        else:
            WORLD.send(None, dest=1, tag=GATE)
            if req:
                req[0].Wait(timeout=60)
    else:
        comm.Allreduce(x, algorithm="ring")
    failures += differences(f"{mode} interrupted allreduce", x, expected)
    y = ramp(1000, 1, comm.rank)
    comm.Allreduce(y)                                   # the communicator works again
    failures += differences("allreduce after", y, ramp_reference(1000, 1, comm.size))
    fresh = al.Communicator()
    z = ramp(100, 2, comm.rank)
    fresh.Allreduce(z)
    failures += differences("allreduce on a new communicator", z, ramp_reference(100, 2, comm.size))
    fresh.Free()
    comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_sigint_latency():
    """The SIGINT latency of a blocking call waiting in the caller and of Request.Wait, median
    of 5 each (printed; recorded in docs/semantics.md): each interrupted call completes when
    rank 1 joins; every result equals numpy's."""
    if WORLD.size < 2:
        pytest.skip("needs a late peer")
    failures, blocking, waits = [], [], []
    for k in range(5):
        comm = al.Communicator()             # a fresh one: the interrupted one is unusable
        x = ramp(1000, k, comm.rank)
        WORLD.Barrier()
        if comm.rank == 1:
            WORLD.recv(source=0, tag=GATE)   # until rank 0 has been interrupted
            comm.Allreduce(x)
        elif comm.rank == 0:
            lat = interrupted(lambda: comm.Allreduce(x), lambda: comm._state.busy, failures)
            if lat is not None:
                blocking.append(lat)
            WORLD.send(None, dest=1, tag=GATE)
            wait_for(lambda: comm._state.pending == 0)
        else:
            comm.Allreduce(x)
        failures += differences(f"blocking {k}", x, ramp_reference(1000, k, comm.size))
        WORLD.Barrier()
        y = ramp(1000, k + 10, comm.rank)
        if comm.rank == 1:
            WORLD.recv(source=0, tag=GATE)
        req = comm.Iallreduce(y)
        if comm.rank == 0:
            main = threading.get_ident()
            lat = interrupted(req.Wait, lambda: in_wait(main), failures)
            if lat is not None:
                waits.append(lat)
            WORLD.send(None, dest=1, tag=GATE)
        req.Wait(timeout=60)
        failures += differences(f"nonblocking {k}", y, ramp_reference(1000, k + 10, comm.size))
        comm.Free()
    if WORLD.rank == 0 and blocking and waits:
        print(f"\nSIGINT latency, median of {len(blocking)}: blocking call "
              f"{statistics.median(blocking) * 1e3:.1f} ms (max {max(blocking) * 1e3:.1f}), "
              f"Request.Wait {statistics.median(waits) * 1e3:.1f} ms "
              f"(max {max(waits) * 1e3:.1f})")
        if max(blocking + waits) > BOUND:
            failures.append(f"latencies above {BOUND} s: {blocking} {waits}")
    assert all_ranks_ok(not failures), every_rank(failures)


def refused(calls: dict, why: str) -> list:
    """Failure messages unless each of `calls` (name -> callable) raises aluminum_py.Error
    whose message contains `why`."""
    msgs = []
    for what, call in calls.items():
        try:
            call()
            msgs.append(f"{what}: no error")
        except al.Error as e:
            if why not in str(e):
                msgs.append(f"{what}: the error does not say {why!r}: {e}")
    return msgs


def in_child(body, seconds: float = 30.0) -> str:
    """Run `body()` in a child made by os.fork(); returns what it reported ("" on success, else
    a message). The child never returns into pytest or runs exit handlers (os._exit), and is
    killed if it outlives `seconds` (a hang)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child
        os.close(r)
        try:
            msg = body()
        except BaseException as e:                    # noqa: BLE001 (reported to the parent)
            msg = f"child raised {type(e).__name__}: {e}"
        os.write(w, (msg or "").encode()[:60000])
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + seconds
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return f"the child hung (killed after {seconds} s)"
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


def test_fork_child_gets_a_clear_error(comm):
    """After os.fork(), every use of the library in the child (a blocking and a nonblocking
    collective, point-to-point, Wait on a request of the parent, a new Communicator, Free)
    raises aluminum_py.Error naming fork, at once, instead of hanging; the parent goes on."""
    failures = []
    x = ramp(1000, 0, comm.rank)
    comm.Iallreduce(x).Wait()                         # the engine thread runs in the parent
    x = ramp(1000, 0, comm.rank)
    WORLD.Barrier()
    pending = comm.Irecv(np.zeros(4, np.float32), source=comm.rank, tag=77)   # never matched here

    def child():
        calls = {
            "Allreduce": lambda: comm.Allreduce(np.ones(4, np.float32)),
            "Allreduce mpi": lambda: comm.Allreduce(np.ones(4, np.float32), algorithm="mpi"),
            "Iallreduce": lambda: comm.Iallreduce(np.ones(4, np.float32)),
            "Barrier": comm.Barrier,
            "Send": lambda: comm.Send(np.ones(4, np.float32), dest=comm.rank, tag=5),
            "Wait": lambda: pending.Wait(timeout=5),
            "Communicator()": al.Communicator,
            "Free": comm.Free,
        }
        msgs = refused(calls, "fork")
        if not al._core.forked():
            msgs.append("_core.forked() is False in the child")
        return "; ".join(msgs)

    report = in_child(child)
    if report:
        failures.append(report)
    if al._core.forked():
        failures.append("_core.forked() is True in the parent")
    comm.Send(np.arange(4, dtype=np.float32), dest=comm.rank, tag=77)
    pending.Wait(timeout=60)
    comm.Allreduce(x)                                 # the parent's communicator still works
    failures += differences("allreduce in the parent after fork", x,
                            ramp_reference(1000, 0, comm.size))
    assert all_ranks_ok(not failures), every_rank(failures)


def run_threads(*bodies) -> list:
    """Run each body in its own thread; the exceptions they raised, as failure messages."""
    errors = []

    def wrap(body):
        try:
            body()
        except BaseException as e:                    # noqa: BLE001 (reported)
            errors.append(f"{body.__name__}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=wrap, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        if t.is_alive():
            errors.append("a thread hung")
    return errors


def test_two_threads_with_their_own_communicators():
    """Two threads, each with its own communicator, run mixed collectives at the same time
    (blocking and nonblocking, library algorithms and MPI's): every result equals numpy's."""
    comms = [al.Communicator(), al.Communicator()]
    failures = []

    def worker(t):
        comm = comms[t]
        algs = ["ring", "recursive_doubling", "rabenseifner", "mpi", "auto"]

        def body():
            comm.bind_thread()                        # the hand-over to this thread
            for k in range(60):
                n = (k * 7919 + t * 13) % 40000
                kk = 100 * t + k
                x = ramp(n, kk, comm.rank)
                alg = algs[k % len(algs)]
                if k % 3 == 0:
                    comm.Iallreduce(x, algorithm=alg).Wait(timeout=60)
                else:
                    comm.Allreduce(x, algorithm=alg)
                failures.extend(differences(f"thread {t} op {k} {alg} n={n}", x,
                                            ramp_reference(n, kk, comm.size)))
                b = np.arange(16, dtype=np.int64) + kk if comm.rank == 0 else np.zeros(16, np.int64)
                comm.Bcast(b, root=0)
                failures.extend(differences(f"thread {t} bcast {k}", b,
                                            np.arange(16, dtype=np.int64) + kk))
                g = np.empty(comm.size * 3, np.int32)
                comm.Allgather(np.full(3, comm.rank + kk, np.int32), g)
                failures.extend(differences(f"thread {t} allgather {k}", g,
                                            np.repeat(np.arange(comm.size, dtype=np.int32) + kk, 3)))

        body.__name__ = f"thread {t}"
        return body

    failures += run_threads(worker(0), worker(1))
    for c in comms:
        c.bind_thread()
        c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_hand_over_with_bind_thread():
    """A communicator is owned by the thread that made it until bind_thread(): another thread
    computes right after binding it; bind_thread while the owner is inside a blocking call
    (waiting for a late rank 1) raises aluminum_py.Error naming it, and the call completes
    right; the main thread takes the communicator back afterwards."""
    comm = al.Communicator()
    failures = []
    x = ramp(20000, 3, comm.rank)
    inside, go = threading.Event(), threading.Event()

    def owner():
        comm.bind_thread()
        y = ramp(100, 5, comm.rank)
        comm.Allreduce(y, algorithm="ring")
        failures.extend(differences("the second thread's allreduce", y,
                                    ramp_reference(100, 5, comm.size)))
        inside.set()
        if comm.rank != 0:
            go.wait(60)                               # the other ranks come late
        comm.Allreduce(x, algorithm="ring")

    t = threading.Thread(target=lambda: failures.extend(run_threads(owner)))
    t.start()
    if comm.rank == 0 and comm.size > 1:
        inside.wait(30)
        if not wait_for(lambda: comm._state.busy, 30):
            failures.append("the owner's call never started")
        failures += refused({"bind_thread": comm.bind_thread}, "is inside a call")
    inside.wait(30)
    WORLD.Barrier()
    go.set()                                          # now the other ranks join the call
    t.join(60)
    comm.bind_thread()
    failures += differences("the owner's allreduce", x, ramp_reference(20000, 3, comm.size))
    y = ramp(100, 4, comm.rank)
    comm.Allreduce(y)
    failures += differences("allreduce after the hand-back", y, ramp_reference(100, 4, comm.size))
    comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_call_from_a_thread_that_does_not_own_the_communicator():
    """Every rank calls from a thread that does not own the communicator: each call raises
    aluminum_py.Error at once naming the owner thread and the hand-over, before any
    communication; the communicator is then broken (every later call raises, naming the
    cause), and Free from the owner works."""
    comm = al.Communicator()
    failures = []
    calls = {"Allreduce": lambda: comm.Allreduce(np.ones(4, np.float32)),
             "Iallreduce": lambda: comm.Iallreduce(np.ones(4, np.float32)),
             "Barrier": comm.Barrier, "Send": lambda: comm.Send(np.ones(2), comm.rank)}
    for name, call in calls.items():
        t = threading.Thread(target=lambda: failures.extend(refused({name: call}, "owned by")))
        t.start()
        t.join(30)
    failures += refused({"Allreduce after": lambda: comm.Allreduce(np.ones(4, np.float32)),
                         "Barrier after": comm.Barrier}, "unusable")
    comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------------------- soak
KINDS = ["Allreduce", "Reduce", "Reduce_scatter", "Allgather", "Bcast", "Alltoall", "Gather",
         "Scatter", "Barrier"]
SOAK_ALGS = ["auto", "ring", "recursive_doubling", "rabenseifner", "mpi"]
SOAK_OPS = {"SUM": al.SUM, "AVG": al.AVG, "MAX": al.MAX}


def rss_bytes() -> int:
    """Resident memory, after returning the C heap's free memory to the system (malloc_trim):
    the figure then moves with what is held, not with how the heap is fragmented."""
    import ctypes
    import gc
    conftest._ramp_reference.cache_clear()           # the test's own cache of references
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):                 # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soak:
    """A stream of mixed operations, the same on every rank (one seeded generator): every
    collective, blocking and nonblocking (up to 8 outstanding), sizes 0 B to 4 MiB (mostly
    small), a random allreduce algorithm, SUM/AVG/MAX. One op in `every` is checked against
    numpy (ramp inputs, rebuilt from (n, k, rank))."""

    def __init__(self, comm, seed: int, every: int = 16):
        self.comm, self.every = comm, every
        self.rng = np.random.default_rng(seed)
        self.k = 0
        self.window = []                # (request, check or None)
        self.failures = []
        self.count = 0

    def size(self) -> int:
        """Elements (float32): 90% up to 4 KiB, 9% up to 256 KiB, 1% up to 4 MiB."""
        u = self.rng.random()
        top = 1 << 10 if u < 0.9 else (1 << 16 if u < 0.99 else 1 << 20)
        return int(self.rng.integers(0, top + 1))

    def step(self, kind=None, n=None, alg=None, blocking=None):
        comm, rng = self.comm, self.rng
        p, r = comm.size, comm.rank
        kind = kind or KINDS[int(rng.integers(len(KINDS)))]
        n = self.size() if n is None else n
        alg = alg or SOAK_ALGS[int(rng.integers(len(SOAK_ALGS)))]
        opname = list(SOAK_OPS)[int(rng.integers(3))]
        op = SOAK_OPS[opname]
        blocking = bool(rng.integers(2)) if blocking is None else blocking
        root = int(rng.integers(p))
        self.k += 1
        k = self.k % 1000
        check = self.k % self.every == 0
        m = max(n // p, 0)
        name = f"{'' if blocking else 'I'}{kind} #{self.k} n={n} {alg} {opname} root={root}"
        f32 = np.float32
        if kind == "Allreduce":
            x = ramp(n, k, r) if check else np.ones(n, f32)
            args, kw = (x,), dict(op=op, algorithm=alg)
            want = (lambda: (x, ramp_reference(n, k, p, f32, op)))
        elif kind == "Reduce":
            x = ramp(n, k, r) if check else np.ones(n, f32)
            y = np.zeros(n, f32)
            args, kw = (x, y), dict(op=op, root=root)
            want = (lambda: (y, ramp_reference(n, k, p, f32, op)) if r == root else None)
        elif kind == "Reduce_scatter":
            x = ramp(m * p, k, r) if check else np.ones(m * p, f32)
            y = np.zeros(m, f32)
            args, kw = (x, y), dict(op=op)
            want = (lambda: (y, ramp_reference(m * p, k, p, f32, op)[r * m:(r + 1) * m]))
        elif kind == "Allgather":
            y = np.zeros(m * p, f32)
            args, kw = (ramp(m, k, r), y), {}
            want = (lambda: (y, np.concatenate([ramp(m, k, j) for j in range(p)])))
        elif kind == "Bcast":
            x = ramp(n, k, root) if r == root else np.zeros(n, f32)
            args, kw = (x,), dict(root=root)
            want = (lambda: (x, ramp(n, k, root)))
        elif kind == "Alltoall":
            y = np.zeros(m * p, f32)
            args, kw = (ramp(m * p, k, r), y), {}
            want = (lambda: (y, np.concatenate([ramp(m * p, k, j)[r * m:(r + 1) * m]
                                                for j in range(p)])))
        elif kind == "Gather":
            y = np.zeros(m * p, f32) if r == root else None
            args, kw = (ramp(m, k, r), y), dict(root=root)
            want = (lambda: (y, np.concatenate([ramp(m, k, j) for j in range(p)]))
                    if r == root else None)
        elif kind == "Scatter":
            x = ramp(m * p, k, root) if r == root else None
            y = np.zeros(m, f32)
            args, kw = (x, y), dict(root=root)
            want = (lambda: (y, ramp(m * p, k, root)[r * m:(r + 1) * m]))
        else:
            args, kw, want = (), {}, (lambda: None)
        if not check:
            want = None
        if kind != "Allreduce":
            kw.pop("algorithm", None)
        if blocking:
            getattr(comm, kind)(*args, **kw)
            self.verify(name, want)
        else:
            iname = "I" + kind[0].lower() + kind[1:]
            self.window.append((getattr(comm, iname)(*args, **kw), name, want))
            if len(self.window) >= 8:
                self.drain()
        self.count += 1

    def drain(self):
        al.Waitall([w[0] for w in self.window], timeout=120)
        for _, name, want in self.window:
            self.verify(name, want)
        self.window.clear()

    def verify(self, name, want):
        if want is None:
            return
        pair = want()
        if pair is None:
            return
        got, expected = pair
        if "AVG" in name and got.size and np.allclose(got, expected, rtol=1e-6, atol=0):
            return
        self.failures += differences(name, got, expected)[:1]
        del self.failures[20:]


# The soak's leak check. Measured on the 2-core machine, 2 ranks, 20 s: idle (35400 ops), resident
# memory grew by 0.8-1.0 MiB, in steps and ever more slowly (the heap's high-water mark under
# random sizes; at 60 s, 178300 ops, by 3-5 B/op), over the last 8 of 12 windows 12-14 B/op; on
# a loaded machine (5800-6400 ops) 76-94 B/op. A leak's rate stays: AL_SOAK_LEAK_BYTES=200 (a
# bytearray kept per op) measured 317-357 B/op, =512 725-736 B/op (and failed). The limit is a
# rate, so that fewer ops do not hide a leak; the old check (5 MiB in total) allowed 150 B/op
# idle and 900 B/op loaded.
LEAK_WINDOWS = 12          # resident-memory samples after warm-up: LEAK_WINDOWS + 1 ...
LEAK_SETTLE = 4            # ... of which the first windows' growth is left out (the fill)
LEAK_LIMIT = 256           # bytes per op


def leak_rate(ops, rss) -> float:
    """Bytes per operation by which resident memory grows steadily, from samples (ops done,
    resident bytes) taken after each window of a run: the median over the windows of each
    window's growth per op. A leak of b bytes per op grows every window by b per op, so the
    median is b; heap noise (a one-off step when an arena or the allocator's cache grows, a
    sample taken just before a free) moves a few windows and not their median."""
    if len(ops) != len(rss) or len(ops) < 3:
        raise ValueError(f"leak_rate: need 3 or more (ops, rss) samples of equal length, "
                         f"got {len(ops)} and {len(rss)}")
    rates = [(r1 - r0) / max(o1 - o0, 1) for o0, o1, r0, r1 in zip(ops, ops[1:], rss, rss[1:])]
    return float(np.median(rates))


@pytest.mark.local
def test_leak_rate_sees_a_steady_leak_and_not_steps():
    ops = [i * 1000 for i in range(LEAK_WINDOWS + 1)]             # a loaded machine's few ops
    rng = np.random.default_rng(1)
    noise = list(200e6 + rng.normal(0, 16 << 10, len(ops)))      # 16 KiB jitter per sample
    for at, step in ((2, 5.3 * 2**20), (6, 3 * 2**20), (9, 1 << 20)):  # one-off heap steps
        noise[at:] = [r + step for r in noise[at:]]
    assert abs(leak_rate(ops, noise)) < LEAK_LIMIT / 2              # 9.3 MiB of steps: no leak
    leaking = [r + 2 * LEAK_LIMIT * o for r, o in zip(noise, ops)]
    assert leak_rate(ops, leaking) > LEAK_LIMIT
    with pytest.raises(ValueError, match="need 3 or more"):
        leak_rate(ops[:2], noise[:2])


@pytest.mark.soak
def test_soak():
    """AL_SOAK_SECONDS (unset: skipped; tests/test_reliability_launch.py runs it at 2 ranks
    for 20 s) of mixed operations (Soak). After a warm-up (every kind and algorithm at the
    largest size, then a quarter of the time, at least 2 s, of the mix), resident memory less
    the scratch cache's growth is sampled after each of LEAK_WINDOWS windows: its steady growth
    after the first LEAK_SETTLE windows (leak_rate) must stay under LEAK_LIMIT bytes per op, and open file
    descriptors may not grow at all; the scratch cache stays within its cap. AL_SOAK_LEAK_BYTES
    makes the test keep that many bytes per op (a deliberate leak, to see the check fail).
    Prints ops/s, the samples and the rate."""
    seconds = float(os.environ.get("AL_SOAK_SECONDS", "0"))
    if seconds <= 0:
        pytest.skip("set AL_SOAK_SECONDS to run the soak test")
    leak_bytes = int(os.environ.get("AL_SOAK_LEAK_BYTES", "0"))
    leaked = []
    comm = al.Communicator()
    soak = Soak(comm, seed=16)
    for kind in KINDS:
        for alg in SOAK_ALGS if kind == "Allreduce" else ["auto"]:
            for blocking in (True, False):
                soak.step(kind, 1 << 20, alg, blocking)
    soak.drain()
    t_end = time.monotonic() + max(2.0, seconds / 4)    # the bounded caches fill up
    while WORLD.bcast(time.monotonic() < t_end if WORLD.rank == 0 else None):
        for _ in range(100):
            soak.step()
    soak.drain()
    fds0, n0 = open_fds(), soak.count
    cached0 = al._core.scratch_stats()["cached"]
    t0 = time.monotonic()
    ops, rss = [0], [rss_bytes()]
    for w in range(1, LEAK_WINDOWS + 1):
        t_end = t0 + seconds * w / LEAK_WINDOWS
        while WORLD.bcast(time.monotonic() < t_end if WORLD.rank == 0 else None):
            for _ in range(100):
                soak.step()
                if leak_bytes:
                    leaked.append(bytearray(leak_bytes))
        soak.drain()
        # the scratch cache may fill up to its cap (checked below): not a leak
        cache_growth = max(al._core.scratch_stats()["cached"] - cached0, 0)
        ops.append(soak.count - n0)
        rss.append(rss_bytes() - cache_growth)
    elapsed = time.monotonic() - t0
    fds1 = open_fds()
    stats = al._core.scratch_stats()
    failures = list(soak.failures)
    rate = leak_rate(ops[LEAK_SETTLE:], rss[LEAK_SETTLE:])
    print(f"\nsoak rank {comm.rank}: {ops[-1]} ops in {elapsed:.1f} s = {ops[-1] / elapsed:.0f} "
          f"ops/s; RSS less the scratch cache's growth after each of {LEAK_WINDOWS} windows "
          f"(MiB): {' '.join(f'{r / 2**20:.2f}' for r in rss)}; steady growth after window "
          f"{LEAK_SETTLE} {rate:+.1f} B/op (limit {LEAK_LIMIT}); scratch cache {cached0 / 2**20:.1f} -> "
          f"{stats['cached'] / 2**20:.1f} MiB; fds {fds0} -> {fds1}; scratch {stats}")
    if rate >= LEAK_LIMIT:
        failures.append(f"resident memory grows steadily by {rate:.1f} B/op over windows "
                        f"{LEAK_SETTLE}-{LEAK_WINDOWS} (ops at each sample: {ops}; MiB: "
                        f"{' '.join(f'{r / 2**20:.2f}' for r in rss)})")
    if fds1 != fds0:
        failures.append(f"open fds {fds0} -> {fds1}")
    if stats["cached"] > 256 << 20:
        failures.append(f"scratch cache above its cap: {stats}")
    comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)
