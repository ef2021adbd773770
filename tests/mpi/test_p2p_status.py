"""Point to point beyond Send/Recv: al.Status with ANY_SOURCE / ANY_TAG (Recv, Irecv,
Sendrecv with sendtag / recvtag), Probe / Iprobe, truncation, and Waitany / Testany / Testall /
Waitsome over mixed requests; timeouts and bad arguments.  Payloads are functions of the
sender's rank and tag, so every receive is checked against what that rank sent."""
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from conftest import all_ranks_ok, every_rank

pytestmark = pytest.mark.mpi


def payload(rank: int, tag: int, n: int, dtype=np.int32) -> np.ndarray:
    return (np.arange(n) * 7 + 1000 * rank + tag).astype(dtype)


def envelope(st, source, tag, count):
    """[] if Status `st` says (source, tag, count), else a message."""
    got = (st.source, st.tag, st.count, st.Get_source(), st.Get_tag(), st.Get_count(), st.error)
    want = (source, tag, count, source, tag, count, 0)
    return [] if got == want else [f"status {got} expected {want}"]


def test_constants_are_mpi_values():
    assert (al.ANY_SOURCE, al.ANY_TAG, al.UNDEFINED) == (MPI.ANY_SOURCE, MPI.ANY_TAG,
                                                         MPI.UNDEFINED)
    st = al.Status()                     # MPI's empty status
    assert (st.source, st.tag, st.count, st.error) == (al.ANY_SOURCE, al.ANY_TAG, 0, 0)
    assert set(al.__all__) >= {"Status", "ANY_SOURCE", "ANY_TAG", "Waitany", "Testany",
                               "Testall", "Waitsome"}
    st._set(1, 5, 20, 4, 0)                # 20 bytes received into an int32 buffer
    assert (st.count, st.Get_count(np.int16), st.Get_count(MPI.BYTE), st.Get_elements(np.int8),
            st.Get_count(np.float64), st.Get_count(np.dtype("int32"))) == (5, 10, 20, 20,
                                                                            al.UNDEFINED, 5)


@pytest.mark.parametrize("form", ["Recv", "Recv-status", "Irecv-Wait", "Irecv-Test"])
def test_any_source_any_tag_status(comm, form):
    """Every rank sends rank 0 a message of r + 2 elements with tag 40 + r (rank 0 to itself,
    nonblocking); rank 0 receives them all with ANY_SOURCE / ANY_TAG into a longer buffer: the
    Status names each sender, its tag and its length, and the payload is the sender's."""
    p, r = comm.size, comm.rank
    failures = []
    send = comm.Isend(payload(r, 40 + r, r + 2), 0, tag=40 + r)
    if r == 0:
        seen = set()
        for _ in range(p):
            buf = np.full(p + 5, -1, np.int32)
            if form == "Recv":
                st = comm.Recv(buf, al.ANY_SOURCE, al.ANY_TAG)
            elif form == "Recv-status":
                st = al.Status()
                assert comm.Recv(buf, status=st) is st          # the defaults: wildcards
            elif form == "Irecv-Wait":
                st = al.Status()
                req = comm.Irecv(buf)
                assert req.status is None or req.done
                req.Wait(timeout=60, status=st)
                failures += [] if req.status == st else [f"request.status {req.status} != {st}"]
            else:
                st = al.Status()
                req = comm.Irecv(buf, tag=al.ANY_TAG)
                deadline = time.monotonic() + 60
                while not req.Test(status=st):
                    assert time.monotonic() < deadline
            src = st.source
            seen.add(src)
            failures += envelope(st, src, 40 + src, src + 2)
            if not np.array_equal(buf[:src + 2], payload(src, 40 + src, src + 2)):
                failures.append(f"from {src}: {buf}")
            if not (buf[src + 2:] == -1).all():
                failures.append(f"from {src}: tail written {buf}")
        if seen != set(range(p)):
            failures.append(f"senders {sorted(seen)}")
    send.Wait(timeout=60)
    assert send.status == al.Status()            # a send's status is the empty one
    assert all_ranks_ok(not failures), every_rank(failures)


def test_probe_then_receive_the_probed_count(comm):
    """Each rank sends rank 0 (float64, length 3 r + 1, tag 60 + r); rank 0 Probes with
    wildcards, allocates what the Status says (bytes, or Get_count(dtype) elements), and
    receives exactly that message from the probed source and tag."""
    p, r = comm.size, comm.rank
    failures = []
    send = comm.Isend(payload(r, 60 + r, 3 * r + 1, np.float64), 0, tag=60 + r)
    if r == 0:
        for _ in range(p):
            st = comm.Probe(timeout=60)
            src = st.source
            n = st.Get_count(np.float64)
            failures += [] if (st.tag, n, st.count, st.Get_count(MPI.DOUBLE)) == (
                60 + src, 3 * src + 1, 8 * n, n) else [f"probe {st}"]
            buf = np.empty(n)
            got = comm.Recv(buf, src, st.tag)
            failures += envelope(got, src, 60 + src, n)
            if not np.array_equal(buf, payload(src, 60 + src, n, np.float64)):
                failures.append(f"from {src}: {buf}")
    send.Wait(timeout=60)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_iprobe_before_and_after(comm):
    """Iprobe finds nothing before the peer sends (it sends after a Barrier rank 0 has not
    reached yet), then finds the message (polled), filling `status`; Probe's status= too."""
    p, r = comm.size, comm.rank
    src = p - 1
    failures = []
    if r == 0 and comm.Iprobe(src, 71) is not None:
        failures.append("Iprobe found a message not sent yet")
    comm.Barrier()
    send = comm.Isend(payload(r, 71, 5), 0, tag=71) if r == src else None
    if r == 0:
        st = al.Status()
        deadline = time.monotonic() + 60
        while comm.Iprobe(al.ANY_SOURCE, 71, status=st) is None:
            assert time.monotonic() < deadline
        failures += envelope(st, src, 71, 20)                   # bytes: no dtype yet
        st2 = al.Status()
        assert comm.Probe(src, 71, status=st2, timeout=60) is st2 and st2 == st
        buf = np.empty(5, np.int32)
        comm.Recv(buf, src, 71)
        if not np.array_equal(buf, payload(src, 71, 5)):
            failures.append(f"payload {buf}")
        if comm.Iprobe(src, 71) is not None:
            failures.append("Iprobe still finds the received message")
    if send is not None:
        send.Wait(timeout=60)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("blocking", [True, False])
def test_sendrecv_tags_and_status(comm, blocking):
    """Around the ring: send with sendtag 80 + rank, receive from the left with recvtag the
    left's tag, then ANY_TAG from ANY_SOURCE: the Status names the left rank and its tag."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    failures = []
    for source, recvtag in ((left, 80 + left), (al.ANY_SOURCE, al.ANY_TAG)):
        out = np.full(6, -1, np.int32)
        st = al.Status()
        if blocking:
            assert comm.Sendrecv(payload(r, 80 + r, 4), right, out, source, sendtag=80 + r,
                                 recvtag=recvtag, status=st) is None
        else:
            comm.Isendrecv(payload(r, 80 + r, 4), right, out, source, sendtag=80 + r,
                           recvtag=recvtag).Wait(timeout=60, status=st)
        failures += envelope(st, left, 80 + left, 4)
        if not np.array_equal(out[:4], payload(left, 80 + left, 4)):
            failures.append(f"source={source}: {out}")
    # tag= sets both (the old form)
    out = np.zeros(4, np.int32)
    comm.Sendrecv(payload(r, 9, 4), right, out, left, tag=9)
    if not np.array_equal(out, payload(left, 9, 4)):
        failures.append(f"tag=9: {out}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_truncation_names_buf_and_sizes(comm):
    """A message longer than the receive buffer: MPIError naming the buffer and its size
    (blocking and nonblocking, Recv and Sendrecv)."""
    r = comm.rank
    send = comm.Isend(np.arange(10, dtype=np.float32), r, tag=90)
    with pytest.raises(al.MPIError, match=r"recv: the message from rank \d+ \(tag 90.*longer "
                                          r"than buf \(4 elements, 16 bytes\)"):
        comm.Recv(np.zeros(4, np.float32), r, 90)
    send.Wait(timeout=60)
    req = comm.Irecv(np.zeros(3, np.float32), r, 91)
    comm.Send(np.arange(10, dtype=np.float32), r, tag=91)
    with pytest.raises(al.MPIError, match=r"longer than buf \(3 elements, 12 bytes\)"):
        req.Wait(timeout=60)
    with pytest.raises(al.MPIError, match=r"longer than recvbuf \(2 elements"):
        comm.Sendrecv(np.arange(5, dtype=np.float32), r, np.zeros(2, np.float32), r, tag=92)
    comm.Barrier()


def test_waitany_testany_testall_waitsome(comm):
    """Mixed requests (Irecvs from every rank, Isends, an Iallreduce, None entries):
    Waitany visits each active request once (in any order) and then says UNDEFINED; the
    statuses and results are right. Testany/Testall see a receive that cannot be complete
    yet (its message is sent after a Barrier) and then see it complete; Waitsome returns
    what is complete."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    failures = []
    bufs = [np.full(3, -1, np.int32) for _ in range(p)]
    x = np.full(4, r + 1.0)
    reqs = [None] + [comm.Irecv(bufs[s], s, 100 + s) for s in range(p)] + [None]
    reqs += [comm.Isend(payload(r, 100 + r, 3), d, tag=100 + r) for d in range(p)]
    reqs.append(comm.Iallreduce(x))
    order = []
    for _ in range(len(reqs)):
        st = al.Status()
        i = al.Waitany(reqs, timeout=60, status=st)
        if i == al.UNDEFINED:
            break
        order.append(i)
        if 1 <= i <= p:
            failures += envelope(st, i - 1, 99 + i, 3)
    if sorted(order) != [i for i, q in enumerate(reqs) if q is not None]:
        failures.append(f"Waitany visited {order}")
    if al.Waitany(reqs) != al.UNDEFINED or al.Testany(reqs) != al.UNDEFINED:
        failures.append("inactive requests not skipped")
    if al.Waitsome(reqs) != [] or not al.Testall(reqs):
        failures.append("Waitsome/Testall on inactive requests")
    al.Waitall(reqs)                              # skips them too
    for s in range(p):
        if not np.array_equal(bufs[s], payload(s, 100 + s, 3)):
            failures.append(f"from {s}: {bufs[s]}")
    if not np.array_equal(x, np.full(4, p * (p + 1) / 2)):
        failures.append(f"allreduce {x}")

    # a receive that cannot be complete before the Barrier
    late = np.zeros(2, np.int64)
    pending = [comm.Irecv(late, left, 120), None]
    if al.Testany(pending) is not None or al.Testall(pending):
        failures.append("Testany/Testall: incomplete receive reported complete")
    comm.Barrier()
    send = comm.Isend(np.array([r, 7]), right, tag=120)
    both = [pending[0], send]
    done = []
    while len(done) < 2:
        done += al.Waitsome(both, timeout=60)
    if sorted(done) != [0, 1] or not np.array_equal(late, [left, 7]):
        failures.append(f"Waitsome {done} {late}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_testall_then_wait(comm):
    """Testall polled until True; every request is then inactive; the data arrived."""
    p, r = comm.size, comm.rank
    out = np.zeros(3, np.int32)
    reqs = [comm.Irecv(out, (r - 1) % p, 130), comm.Isend(payload(r, 130, 3), (r + 1) % p,
                                                           tag=130)]
    deadline = time.monotonic() + 60
    while not al.Testall(reqs):
        assert time.monotonic() < deadline
    assert al.Testany(reqs) == al.UNDEFINED
    assert all_ranks_ok(np.array_equal(out, payload((r - 1) % p, 130, 3)))


def test_timeouts(comm):
    """Probe, Waitany and Waitsome time out (al.TimeoutError, a builtin TimeoutError too)
    and leave the requests pending; the receive then completes normally."""
    r = comm.rank
    with pytest.raises(al.TimeoutError, match=r"Probe: no message from rank \d+ with tag 140"):
        comm.Probe(r, 140, timeout=0.1)
    buf = np.zeros(2, np.int32)
    req = comm.Irecv(buf, r, 141)
    for wait in (al.Waitany, al.Waitsome):
        with pytest.raises(TimeoutError, match=f"{wait.__name__}: none of 1 requests complete"):
            wait([req, None], timeout=0.1)
    assert not req.done
    comm.Send(np.array([5, 6], np.int32), r, tag=141)
    assert al.Waitany([req], timeout=60) == 0 and list(buf) == [5, 6]
    comm.Barrier()


@pytest.mark.local
@pytest.mark.parametrize("case", ["recv-tag", "recvtag", "sendtag-any", "probe-tag",
                                  "probe-source", "iprobe-source-str", "status-type",
                                  "wait-status-type", "waitany-item", "get-count-type",
                                  "waitany-timeout-type", "waitsome-timeout-type"])
def test_bad_arguments(comm, case):
    """Refused before any communication, naming the argument; buffers untouched."""
    p, r = comm.size, comm.rank
    buf = np.full(4, 3, np.int32)
    calls = {
        "recv-tag": (ValueError, "tag: -5 is out of range", lambda: comm.Recv(buf, r, -5)),
        "recvtag": (ValueError, "recvtag: 40000 is out of range",
                    lambda: comm.Sendrecv(buf.copy(), r, buf, r, recvtag=40000)),
        "sendtag-any": (ValueError, "sendtag: .* out of range",
                        lambda: comm.Sendrecv(buf.copy(), r, buf, r, sendtag=al.ANY_TAG)),
        "probe-tag": (TypeError, "tag: expected an int", lambda: comm.Probe(r, "1")),
        "probe-source": (ValueError, f"source: rank {p} is out of range",
                         lambda: comm.Probe(p, 0)),
        "iprobe-source-str": (TypeError, "source: expected an int", lambda: comm.Iprobe("0")),
        "status-type": (TypeError, "status: expected an aluminum_py.Status",
                        lambda: comm.Recv(buf, r, 0, status=MPI.Status())),
        "wait-status-type": (TypeError, "status: expected an aluminum_py.Status",
                             lambda: al.Waitany([None], status={})),
        "waitany-item": (TypeError, r"Waitany: requests\[1\] is a int",
                         lambda: al.Waitany([None, 3])),
        "get-count-type": (TypeError, "datatype: expected a numpy dtype",
                           lambda: al.Status().Get_count(object())),
        "waitany-timeout-type": (TypeError, "Waitany: timeout: expected seconds",
                                 lambda: al.Waitany([None], al.Status())),
        "waitsome-timeout-type": (TypeError, "Waitsome: timeout: expected seconds",
                                  lambda: al.Waitsome([None], "1")),
    }
    exc, match, f = calls[case]
    with pytest.raises(exc, match=match):
        f()
    assert (buf == 3).all()


def test_probe_follows_the_threading_rule():
    """Probe from a thread that does not own the communicator is refused (and, as for every
    call, breaks the communicator on every rank): a communicator of its own here."""
    c = al.Communicator()
    errors = []

    def other():
        try:
            c.Iprobe()
        except al.Error as e:
            errors.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "owned by thread" in errors[0]
    c.Free()


def test_waitany_with_gpu_requests(comm):
    """GPU requests (GpuRequest, here of the GPU backend on the CPU device: streams are worker
    threads, "GPU buffers" numpy arrays behind __cuda_array_interface__) in one list with host
    requests and None: Waitany visits each once, Testall then holds, the results are right."""
    from aluminum_py import host_transfer as ht
    from aluminum_py.gpu import GpuRequest

    class DeviceArray:
        def __init__(self, a):
            self.a = a
            self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str,
                                             "data": (a.ctypes.data, False), "strides": None,
                                             "version": 3}

    device = ht.CpuDevice()
    gcomm = al.Communicator()
    stream = device.stream()
    ht.bind(gcomm, device, stream)
    try:
        p, r = comm.size, comm.rank
        g = [np.full(5, r + 1.0), np.full(3, 2.0 * r)]
        h = np.full(4, r + 1.0)
        reqs = [gcomm.Iallreduce(DeviceArray(g[0]), algorithm="ht_ring"), None,
                comm.Iallreduce(h),
                gcomm.Iallreduce(DeviceArray(g[1]), op=al.MAX, algorithm="ht_mpi")]
        assert isinstance(reqs[0], GpuRequest) and isinstance(reqs[2], al.Request)
        seen = sorted(al.Waitany(reqs, timeout=60) for _ in range(3))
        assert seen == [0, 2, 3] and al.Waitany(reqs) == al.UNDEFINED and al.Testall(reqs)
        assert stream.synchronize(timeout=60)
        failures = []
        for what, got, want in (("ht_ring SUM", g[0], np.full(5, p * (p + 1) / 2)),
                                ("ht_mpi MAX", g[1], np.full(3, 2.0 * (p - 1))),
                                ("host", h, np.full(4, p * (p + 1) / 2))):
            if not np.array_equal(got, want):
                failures.append(f"{what}: {got}")
        assert all_ranks_ok(not failures), every_rank(failures)
    finally:
        stream.destroy()
        gcomm.Free()


def test_truncated_sendrecv_keeps_its_send(comm):
    """Sendrecv whose receive is truncated while its (large, rendezvous) send is still
    pending: the error comes once the send is done, never with the send buffer released under
    MPI; the peer, which receives only later, gets the right data."""
    p, r = comm.size, comm.rank
    if p < 2:
        pytest.skip("needs a peer")
    n = 1 << 20                          # 8 MiB: MPI's rendezvous protocol
    failures = []
    if r == 0:
        big = np.arange(n, dtype=np.float64)
        with pytest.raises(al.MPIError, match=r"longer than recvbuf \(2 elements"):
            comm.Sendrecv(big, 1, np.zeros(2), 1, tag=150)
        del big
    elif r == 1:
        comm.Send(np.arange(5.0), 0, tag=150)        # too long for rank 0's recvbuf
        time.sleep(0.5)                              # rank 0's send is pending meanwhile
        got = np.zeros(n)
        comm.Recv(got, 0, 150)
        if not np.array_equal(got, np.arange(n, dtype=np.float64)):
            failures.append("rank 1 received the wrong data")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_signals_interrupt_probe_and_waitany(comm):
    """A signal handler's exception ends a blocking Probe and a Waitany (they return to Python
    every WAKE seconds to run the handlers); the communicator and the request stay usable."""
    import signal

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted
    r = comm.rank
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            comm.Probe(r, 160, timeout=60)
        buf = np.zeros(2, np.int32)
        req = comm.Irecv(buf, r, 161)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            al.Waitany([req], timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    comm.Send(np.array([1, 2], np.int32), r, tag=161)
    assert al.Waitany([req], timeout=60) == 0 and list(buf) == [1, 2]
    assert comm.Iprobe(r, 160) is None
    comm.Barrier()
