"""Reliability under the conditions users hit (issue 16): Ctrl-C while a peer is late, fork,
threads, long runs.

The SIGINT tests send the signal from a timer thread (``os.kill``) while rank 0 waits for a
late rank 1; they assert on state (KeyboardInterrupt raised, op pending, results equal to
numpy's) and bound the latency only generously (2 s for a 100 ms target): the measured figure
is printed and recorded in docs/semantics.md, never asserted tightly.
"""
import contextlib
import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest

import aluminum_py as al

from conftest import WORLD, all_ranks_ok, differences, every_rank, ramp, ramp_reference, wait_for

LATE = 4.0          # seconds rank 1 is late: far above the latency bound below
SIGNAL_AT = 0.5     # rank 0 gets SIGINT this long after it started waiting
BOUND = 2.0         # generous bound on the SIGINT latency (the target is 100 ms)


@contextlib.contextmanager
def sigint_after(delay: float, sent: list):
    """Send this process SIGINT after `delay` seconds (from a timer thread), recording when in
    `sent`. The default handler (KeyboardInterrupt) is installed for the duration: a launcher
    may start ranks with SIGINT ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)

    def fire():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Timer(delay, fire)
    t.start()
    try:
        yield
    finally:
        t.cancel()
        t.join()
        signal.signal(signal.SIGINT, old)


def interrupted(call, failures: list) -> float | None:
    """Run `call` with a SIGINT sent SIGNAL_AT seconds later; the seconds from the signal to
    the KeyboardInterrupt (None, and a failure, if it was not raised)."""
    sent = []
    try:
        with sigint_after(SIGNAL_AT, sent):
            call()
    except KeyboardInterrupt:
        return time.monotonic() - sent[0]
    failures.append(f"no KeyboardInterrupt: {call} returned")
    return None


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_sigint_while_peer_is_late(mode):
    """Rank 1 is LATE seconds late to an Allreduce; rank 0 gets SIGINT after SIGNAL_AT seconds
    and raises KeyboardInterrupt within BOUND (today's target: 100 ms). The op stays with the
    engine and completes when rank 1 arrives (result equal to numpy's). Blocking: the
    communicator refuses new ops, naming the interrupted one, until it completes, then works
    again. Nonblocking: the Request stays valid; Wait again completes it."""
    if WORLD.size < 2:
        pytest.skip("needs a late peer")
    comm = al.Communicator()
    failures = []
    n = 50000
    x = ramp(n, 0, comm.rank)
    expected = ramp_reference(n, 0, comm.size)
    WORLD.Barrier()
    if comm.rank == 1:
        time.sleep(LATE)
    if comm.rank == 0:
        req = []

        def call():
            if mode == "blocking":
                comm.Allreduce(x, algorithm="ring")
            else:
                req.append(comm.Iallreduce(x, algorithm="ring"))
                req[0].Wait()

        latency = interrupted(call, failures)
        if latency is not None:
            print(f"\nSIGINT latency ({mode}): {latency * 1e3:.1f} ms")
            if latency > BOUND:
                failures.append(f"KeyboardInterrupt {latency:.2f} s after SIGINT (bound {BOUND} s)")
        if mode == "blocking":
            try:
                comm.Allreduce(np.zeros(3, np.float32))     # rank 1 still sleeps: refused
                failures.append("a new op ran on the communicator of the interrupted call")
            except al.Error as e:
                if "interrupted" not in str(e) or "allreduce/ring" not in str(e):
                    failures.append(f"the error does not name the interrupted op: {e}")
            if not wait_for(lambda: comm._state.pending == 0):
                failures.append("the interrupted op never completed")
        else:
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
    late = SIGNAL_AT + 0.7
    for k in range(5):
        comm = al.Communicator()             # a fresh one: the interrupted one is unusable
        x = ramp(1000, k, comm.rank)
        WORLD.Barrier()
        if comm.rank == 1:
            time.sleep(late)
            comm.Allreduce(x)
        elif comm.rank == 0:
            lat = interrupted(lambda: comm.Allreduce(x), failures)
            if lat is not None:
                blocking.append(lat)
            wait_for(lambda: comm._state.pending == 0)
        else:
            comm.Allreduce(x)
        failures += differences(f"blocking {k}", x, ramp_reference(1000, k, comm.size))
        WORLD.Barrier()
        y = ramp(1000, k + 10, comm.rank)
        if comm.rank == 1:
            time.sleep(late)
        req = comm.Iallreduce(y)
        if comm.rank == 0:
            lat = interrupted(req.Wait, failures)
            if lat is not None:
                waits.append(lat)
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
        c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_one_communicator_from_two_threads_is_an_error():
    """While one thread is inside a blocking call on a communicator (here: waiting for a late
    rank 1), another thread's call on it raises aluminum_py.Error at once (saying the
    communicator is in use by another thread), without taking part; the first call completes
    with the right result and the communicator works afterwards."""
    if WORLD.size < 2:
        pytest.skip("needs a late peer")
    comm = al.Communicator()
    failures = []
    x = ramp(20000, 3, comm.rank)
    if comm.rank == 0:
        first = threading.Thread(target=lambda: comm.Allreduce(x, algorithm="ring"))
        first.start()
        if not wait_for(lambda: comm._state.busy, 30):
            failures.append("the first thread's call never started")
        failures += refused({"Allreduce": lambda: comm.Allreduce(np.ones(4, np.float32)),
                             "Iallreduce": lambda: comm.Iallreduce(np.ones(4, np.float32)),
                             "Barrier": comm.Barrier}, "another thread")
        WORLD.Barrier()                               # now rank 1 joins the first call
        first.join(60)
    else:
        WORLD.Barrier()
        comm.Allreduce(x, algorithm="ring")
    failures += differences("the first thread's allreduce", x, ramp_reference(20000, 3, comm.size))
    y = ramp(100, 4, comm.rank)
    comm.Allreduce(y)
    failures += differences("allreduce afterwards", y, ramp_reference(100, 4, comm.size))
    comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)
