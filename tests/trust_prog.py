"""The programs of issue 28 (tests/test_trust.py launches them under mpiexec, with a wall-clock
limit): ordinary mistakes with threads, mismatched calls and Free must end in right values or
aluminum_py.Error on the ranks concerned, never a wrong value or an endless wait.

    python trust_prog.py threads ALG[,ALG...] COLL[,COLL...] REPEAT
    python trust_prog.py asymmetric ALG[,ALG...]
    python trust_prog.py mismatch ALG[,ALG...]
    python trust_prog.py free ALG[,ALG...]
    python trust_prog.py fork ALG[,ALG...] HOW[,HOW...]
    python trust_prog.py drop ALG COUNT
    python trust_prog.py exhaust ALG
    python trust_prog.py construct -
    python trust_prog.py late GATE_DIR

Each prints one line per finding ("WRONG ...", "HANG ...", "NOERROR ...") and "DONE rank r" at
the end; the test fails on any finding or a missing DONE.
"""
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
TOTAL = SIZE * (SIZE + 1) / 2          # the sum of every rank's (rank + 1)


def say(*words):
    """One line, in one write (the launcher merges the ranks' output)."""
    sys.stdout.write(" ".join([f"rank {RANK}:"] + [str(w) for w in words]) + "\n")
    sys.stdout.flush()


def one_call(c, coll, alg, i):
    """Call number i of the two-thread program; returns a finding (str) or None."""
    n = 1000 + i % 7
    if coll == "Allreduce":
        x = np.full(n, RANK + 1.0)
        if i % 2:
            c.Iallreduce(x, algorithm=alg).Wait(timeout=20)
        else:
            c.Allreduce(x, algorithm=alg)
        return None if np.all(x == TOTAL) else f"WRONG {coll} {alg} call {i}: {x[-3:]}"
    if coll == "Allgather":
        x, out = np.full(n, RANK + 1.0), np.zeros(n * SIZE)
        if i % 2:
            c.Iallgather(x, out, algorithm=alg).Wait(timeout=20)
        else:
            c.Allgather(x, out, algorithm=alg)
        want = np.repeat(np.arange(1.0, SIZE + 1), n)
        return None if np.array_equal(out, want) else f"WRONG {coll} {alg} call {i}"
    if coll == "Reduce_scatter":
        x, out = np.full(n * SIZE, RANK + 1.0), np.zeros(n)
        if i % 2:
            c.Ireduce_scatter(x, out, algorithm=alg).Wait(timeout=20)
        else:
            c.Reduce_scatter(x, out, algorithm=alg)
        return None if np.all(out == TOTAL) else f"WRONG {coll} {alg} call {i}: {out[-3:]}"
    if i % 2:
        c.Ibarrier(algorithm=alg).Wait(timeout=20)
    else:
        c.Barrier(algorithm=alg)
    return None


def threads(algs, colls, repeat, calls=200):
    """Two threads (the owner, the main thread, and a second one) loop over calls on one
    communicator: every call right or aluminum_py.Error, every thread ends."""
    findings = []
    for rep in range(repeat):
        for alg in algs:
            for coll in colls:
                if coll != "Allreduce" and alg not in ("shm", "mpi"):
                    continue
                c = al.Communicator()
                stats = {"ok": 0, "err": 0}

                started = threading.Event()
                head = (rep * 37 + RANK * 5) % 60     # owner calls before the second thread

                def loop(tag):
                    if tag != "owner":
                        started.wait(60)
                    for i in range(calls):
                        if i == head:
                            started.set()
                        try:
                            f = one_call(c, coll, alg, i)
                        except al.Error:
                            stats["err"] += 1
                            continue
                        stats["ok"] += 1
                        if f:
                            findings.append(f"{f} ({tag}, repetition {rep})")

                t = threading.Thread(target=loop, args=("second thread",), daemon=True)
                t.start()
                loop("owner")
                started.set()
                t.join(120)
                if t.is_alive():
                    findings.append(f"HANG {coll} {alg} repetition {rep}: the second thread")
                    break
                if stats["err"] == 0:
                    findings.append(f"NOERROR {coll} {alg}: no call was refused")
                if rep == 0:
                    say(f"{coll} {alg}: {stats['ok']} right, {stats['err']} raised")
    return findings


def asymmetric(alg):
    """Rank 0 calls from a second thread (not the owner), rank 1 from the owner: both raise."""
    c = al.Communicator()
    x = np.full(1000, RANK + 1.0)
    out = []

    def call():
        try:
            c.Allreduce(x, algorithm=alg)
            out.append(None)
        except al.Error as e:
            out.append(e)

    if RANK == 0:
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(60)
    else:
        call()
    if not out:
        return [f"HANG asymmetric {alg}"]
    if out[0] is None:
        return [f"NOERROR asymmetric {alg}: the call returned (x[0]={x[0]})"]
    say("raised:", out[0])
    try:
        c.Allreduce(np.ones(4), algorithm=alg)
        return [f"NOERROR asymmetric {alg}: a later call returned"]
    except al.Error as e:
        say("later call raised:", e)
    return []


def mismatch(alg):
    """Rank 0 allreduces 1000 floats, rank 1 1002; then the reversed order (rank 0 calls 1000
    then 1002 elements, rank 1 the reverse): al.Error on every rank, no wrong value."""
    findings = []
    for order in ("different", "reversed"):
        c = al.Communicator()
        if order == "different":
            counts = [1000 if RANK == 0 else 1002]
        else:
            counts = [1000, 1002] if RANK == 0 else [1002, 1000]
        raised = None
        for n in counts:
            x = np.full(n, RANK + 1.0, dtype=np.float32)
            try:
                c.Allreduce(x, algorithm=alg)
            except al.Error as e:
                raised = e
                break
            findings.append(f"WRONG mismatch {order} {alg}: count {n} returned x[-1]={x[-1]}")
        if raised is None:
            findings.append(f"NOERROR mismatch {order} {alg}")
        else:
            say(f"mismatch {order} {alg}:", raised)
            try:
                c.Allreduce(np.ones(4, np.float32), algorithm=alg)
                findings.append(f"NOERROR mismatch {order} {alg}: a later call returned")
            except al.Error:
                pass
        WORLD.Barrier()
    return findings


def free(alg):
    """Free() from the main thread while the owner (a second thread) is inside a blocking call
    waiting for a late rank 1: al.Error, no crash; the call completes once rank 1 joins."""
    c = al.Communicator()
    x = np.full(100000, RANK + 1.0)
    findings, got = [], []
    if RANK == 0:
        bound = threading.Event()

        def owner():
            getattr(c, "bind_thread", lambda: None)()      # (before issue 28: none)
            bound.set()
            try:
                c.Allreduce(x, algorithm=alg)
                got.append(None)
            except al.Error as e:
                got.append(e)

        t = threading.Thread(target=owner, daemon=True)
        t.start()
        bound.wait(30)
        deadline = time.monotonic() + 60        # a hang guard: the owner's call starts at once
        while not c._state.busy and time.monotonic() < deadline:
            time.sleep(0.002)                   # until the owner waits inside its call
        if not c._state.busy:
            findings.append(f"HANG free {alg}: the owner's call never started")
        try:
            c.Free()
            findings.append(f"NOERROR free {alg}: Free returned during the call")
        except al.Error as e:
            say("Free raised:", e)
        WORLD.Barrier()                         # rank 1 joins the call
        t.join(60)
        if t.is_alive():
            findings.append(f"HANG free {alg}: the owner's call")
        elif got and got[0] is None and not np.all(x == TOTAL):
            findings.append(f"WRONG free {alg}")
    else:
        WORLD.Barrier()
        c.Allreduce(x, algorithm=alg)
        if not np.all(x == TOTAL):
            findings.append(f"WRONG free {alg} (rank 1)")
    return findings


CHILD_STATUS = {"exit": 7, "finalize": 7, "raise": 1}


def reap(pid, what):
    """The exit status of the child `pid`, or a HANG finding (the child killed) after 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return f"HANG {what}: the child did not exit"


def child(how):
    """A child of os.fork() that leaves as a program ordinarily does: sys.exit, after calling
    MPI.Finalize itself, or an uncaught exception; never os._exit."""
    if how == "finalize":
        try:
            MPI.Finalize()
            say("child: MPI.Finalize returned")
        except Exception as e:           # noqa: BLE001 (mpi4py's MPI.Exception)
            say("child: MPI.Finalize raised", type(e).__name__)
    if how == "raise":
        sys.excepthook = lambda t, e, tb: say("child: uncaught", t.__name__, e)
        raise RuntimeError("the child's own failure")
    sys.exit(CHILD_STATUS[how])


def fork(alg, how):
    """The even ranks fork a child while their Iallreduce is pending (the peers' started
    before the fork, or after the child ended) and the child exits normally: the parent's
    results are right, the child's exit status its own, the communicator goes on working."""
    findings = []
    c = al.Communicator()
    for n in (4, 1 << 19):
        for order in ("after", "during"):
            what = f"fork {alg} {how} {n} {order}"
            x = np.full(n, RANK + 11.0)
            want = sum(r + 11.0 for r in range(SIZE))
            req = None
            if order == "during" or RANK % 2 == 0:
                req = c.Iallreduce(x, algorithm=alg)
            if order == "during":
                WORLD.Barrier()
            if RANK % 2 == 0:
                pid = os.fork()
                if pid == 0:
                    child(how)
                status = reap(pid, what)
                if status != CHILD_STATUS[how]:
                    findings.append(f"WRONG {what}: the child's exit status {status}")
            WORLD.Barrier()                      # the peers of "after" join once it ended
            if req is None:
                req = c.Iallreduce(x, algorithm=alg)
            try:
                req.Wait(timeout=30)
            except al.Error as e:
                findings.append(f"HANG {what}: {type(e).__name__}: {e}")
                return findings
            if not np.all(x == want):
                findings.append(f"WRONG {what}: {x[:4]} for {want}")
            y = np.full(n, RANK + 1.0)
            c.Allreduce(y, algorithm=alg)
            if not np.all(y == TOTAL):
                findings.append(f"WRONG {what}: the next Allreduce gave {y[:4]} for {TOTAL}")
    return findings


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def drop(alg, count):
    """`count` Communicators dropped without Free(), each after an Allreduce: rank 0 drops each
    at once, rank 1 keeps the last three, rank 2 leaves each in a reference cycle (collected
    when the collector runs), and every 50th is dropped with a nonblocking Allreduce pending
    that the peers join only later.  More than MPI's communicators (MPICH: 2048 context ids,
    4-5 per Communicator) must be made without an error, every result right, memory flat."""
    findings, kept, late = [], [], None
    start = None
    for i in range(count):
        if i == 100:
            start = rss_mib()
        c = al.Communicator()
        x = np.full(10, RANK + 1.0)
        c.Allreduce(x, algorithm=alg)
        if not np.all(x == TOTAL):
            findings.append(f"WRONG drop {alg} {i}: {x[:3]}")
        if late is not None:                # the peers join the pending op of the last one
            if RANK != 0:
                late.Iallreduce(np.ones(10), algorithm=alg).Wait(timeout=60)
            late = None
        if i % 50 == 25:
            if RANK == 0:
                c.Iallreduce(np.ones(10), algorithm=alg)   # the Request dropped: pending
            late = c
        if RANK == 1:
            kept = (kept + [c])[-3:]
        elif RANK == 2:
            c.cycle = c
        del c
    grew = rss_mib() - start
    say(f"drop {alg}: {count} Communicators, resident memory +{grew:.1f} MiB after the 100th")
    if grew > 16:
        findings.append(f"WRONG drop {alg}: resident memory grew {grew:.1f} MiB")
    return findings


def exhaust(alg):
    """Communicators kept until MPI has none left: aluminum_py.Error (not MPI's exception) on
    every rank in the same Communicator(); once they are freed, construction works again."""
    kept, findings = [], []
    while True:
        try:
            kept.append(al.Communicator())
        except al.Error as e:
            say(f"exhaust: Communicator() #{len(kept) + 1} raised {type(e).__name__}: {e}")
            break
        except Exception as e:           # noqa: BLE001
            findings.append(f"WRONG exhaust: {type(e).__name__}: {e}")
            break
        if len(kept) > 5000:
            return [f"NOERROR exhaust: {len(kept)} communicators"]
    counts = WORLD.allgather(len(kept))
    if len(set(counts)) > 1:
        findings.append(f"WRONG exhaust: the ranks failed at different calls: {counts}")
    for c in kept:
        c.Free()
    c = al.Communicator()
    x = np.full(10, RANK + 1.0)
    c.Allreduce(x, algorithm=alg)
    if not np.all(x == TOTAL):
        findings.append(f"WRONG exhaust: after freeing, {x[:3]}")
    return findings


def construct(_):
    """Communicator(): made (and right), or aluminum_py.Error; the test compares the ranks."""
    try:
        c = al.Communicator()
    except al.Error as e:
        say(f"construct: raised {type(e).__name__}: {e}")
        return []
    x = np.full(10, RANK + 1.0)
    c.Allreduce(x)
    say("construct: made")
    return [] if np.all(x == TOTAL) else [f"WRONG construct: {x[:3]}"]


def late(gate):
    """The last rank calls Communicator() only once every other rank's has raised (files in
    `gate`): the others raise aluminum_py.TimeoutError after AL_HANG_TIMEOUT, and so does the
    late one (it must not go on alone with a communicator its peers gave up)."""
    t0 = time.monotonic()
    if RANK == SIZE - 1:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(gate, f"raised.{r}"))
                      for r in range(SIZE - 1)):
            if time.monotonic() > deadline:
                return ["HANG late: the others never raised"]
            time.sleep(0.01)
        t0 = time.monotonic()
    try:
        al.Communicator()
        return [f"NOERROR late: Communicator() returned after {time.monotonic() - t0:.1f} s"]
    except al.TimeoutError as e:
        text = str(e).replace("AL_HANG_TIMEOUT", "the hang timeout")   # not a finding
        say(f"late: TimeoutError after {time.monotonic() - t0:.1f} s: {text}")
    finally:
        open(os.path.join(gate, f"raised.{RANK}"), "w").close()
    return []


def main():
    what = sys.argv[1]
    if what == "threads":
        findings = threads(sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4]))
    elif what == "drop":
        findings = drop(sys.argv[2], int(sys.argv[3]))
    elif what == "fork":
        findings = [f for alg in sys.argv[2].split(",") for how in sys.argv[3].split(",")
                    for f in fork(alg, how)]
    else:
        findings = [f for alg in sys.argv[2].split(",") for f in globals()[what](alg)]
    for f in findings:
        say(f)
    say("DONE")
    end = WORLD.Ibarrier()                 # every rank reports before any leaves
    deadline = time.monotonic() + 60
    while not end.Test() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
