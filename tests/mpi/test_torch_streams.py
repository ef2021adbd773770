"""Stream order of the torch backend and the DDP hook on CUDA tensors, without a GPU: a test
double of the CUDA pieces torch provides (streams, events, the current stream of each device,
``record_stream``, CUDA-aware Futures) records what waited on what, and the calls run on the
host (the double's device communicators are host communicators), so their values are checked
against numpy too.

torch's contract for a CUDA collective (ProcessGroupNCCL's): it runs after the work queued on
the current stream of the tensor's device when it is called; ``work.wait()`` makes the stream
current *then* wait for its end; ``is_completed()`` asks the end's event; the Future completes
on the op's stream; the issuing stream does not wait (its later kernels overlap the call).
"""
import contextlib

import numpy as np
import pytest

import aluminum_py as al
from conftest import WORLD, all_ranks_ok, gather_all

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch._C import _distributed_c10d as _c10d  # noqa: E402

import aluminum_py.torch as alt  # noqa: E402
from aluminum_py.torch import backend, cuda  # noqa: E402

pytestmark = pytest.mark.mpi
RANK, SIZE = WORLD.rank, WORLD.size


class Stream:
    def __init__(self, name: str, device: int):
        self.name, self.device = name, device

    def __repr__(self):
        return self.name


class Event:
    def __init__(self, n: int):
        self.name, self.stream, self.done = f"e{n}", None, False

    def __repr__(self):
        return self.name


class CudaDouble(cuda.TorchCuda):
    """torch's CUDA pieces, recorded in `log` as tuples; tensors are "on" a device once
    :meth:`put` says so; each device's current stream is `current[device]` (every device's
    default stream is a distinct object, as every device's default stream is handle 0)."""

    def __init__(self):
        self.log, self.made, self._devices, self._n = [], [], {}, 0
        self.current = {d: Stream(f"default{d}", d) for d in (0, 1)}

    def put(self, t: torch.Tensor, device: int) -> torch.Tensor:
        self._devices[t.data_ptr()] = device
        return t

    def device_of(self, t):
        return self._devices.get(t.data_ptr()) if t.numel() else None

    def current_stream(self, device):
        return self.current[device]

    def new_stream(self, device):
        s = Stream(f"coll{device}.{len(self.made)}", device)
        self.log.append(("new_stream", device, s))
        return s

    def event(self):
        self._n += 1
        return Event(self._n)

    def record(self, event, stream):
        event.stream = stream
        self.log.append(("record", event, stream))

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def query(self, event):
        self.log.append(("query", event))
        return event.done

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream))

    @contextlib.contextmanager
    def on(self, stream):
        self.log.append(("on", stream))
        yield

    def future(self, value, device, stream):
        self.log.append(("future", stream))
        fut = torch.futures.Future()
        fut.set_result(value)
        return fut

    def communicator(self, parent, device, stream):
        comm = Logged(parent)
        comm.log = self.log
        self.made.append((device, stream, comm))
        return comm

    def calls(self):
        """The log without record_stream entries."""
        return [e for e in self.log if e[0] != "record_stream"]


class Logged(al.Communicator):
    """A host communicator whose calls go into the double's log (the op "on the stream")."""
    log: list

    def Allreduce(self, *args, **kwargs):      # the hook calls it by name
        self.log.append(("Allreduce",))
        return super().Allreduce(*args, **kwargs)


def logged(name: str, fn):
    def call(comm, *args, **kwargs):
        if isinstance(comm, Logged):
            comm.log.append((name,))
        return fn(comm, *args, **kwargs)
    return call


@pytest.fixture
def double(monkeypatch):
    """The double in place of torch's CUDA pieces; the backend's methods log their calls on
    a device communicator."""
    d = CudaDouble()
    monkeypatch.setattr(cuda, "pieces", d)
    for name in ("ALLREDUCE", "ALLGATHER", "SEND", "RECV"):
        m = getattr(backend, name)
        blocking = m.run.__name__
        monkeypatch.setattr(backend, name, backend.Method(
            logged(blocking, m.run), logged("I" + blocking[0].lower() + blocking[1:], m.start)))
    return d


@pytest.fixture
def group(double):
    pg = alt.ProcessGroupAluminum(al.Communicator(), 60.0)
    yield pg
    pg.shutdown()


def options(async_op: bool = True, cls=dist.AllreduceOptions):
    o = cls()
    o.asyncOp = async_op
    return o


def values(seed: int, n: int = 5) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + 10 * RANK + seed


def test_collective_ordered_after_the_current_stream_of_the_tensors_device(double, group):
    """The collective stream of the tensor's device (device 1, whatever device is current)
    waits for an event recorded on device 1's current stream, then the op runs, then its end
    is recorded and the Future completed on the collective stream; the issuing stream waits
    for nothing (async_op: its later kernels overlap the call)."""
    x = values(1)
    t = double.put(torch.from_numpy(x.copy()), 1)
    work = group.allreduce([t], options())
    log = double.calls()
    (_, dev, coll), (_, start, s1), (_, waiter, ev), op, (_, end, s2), (_, s3) = log
    ok = (log[0][0] == "new_stream" and dev == 1 and s1 is double.current[1]
          and waiter is coll and ev is start and op == ("Allreduce",)
          and s2 is coll and s3 is coll and log[-1][0] == "future" and end.stream is coll
          and not any(e[0] == "wait" and e[1] is double.current[1] for e in log)
          and ("record_stream", coll) in double.log)
    ok = ok and np.array_equal(t.numpy(), gather_all(x).sum(axis=0))
    assert all_ranks_ok(ok), log


def test_profiler_records_the_enqueue_of_a_cuda_collective(double, group):
    """Under torch's profiler a collective on a CUDA tensor is the event
    ``aluminum:all_reduce`` with the input shapes, spanning its enqueue on the collective
    stream (as ProcessGroupNCCL's): the op is in the double's log when the event has ended."""
    t = double.put(torch.from_numpy(values(7, 6).reshape(2, 3)), 0)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        group.allreduce([t], options()).wait()
    ar = [e for e in prof.function_events if e.name == "aluminum:all_reduce"]
    ok = (len(ar) == 1 and str(ar[0].input_shapes) == "[[2, 3]]"
          and ("Allreduce",) in double.calls())
    assert all_ranks_ok(ok), [(e.name, e.input_shapes) for e in prof.function_events]


def test_wait_orders_the_then_current_stream(double, group):
    """work.wait() (and synchronize()) make the stream current at the time of the wait wait
    for the op's end event, not the stream that issued the call."""
    t = double.put(torch.from_numpy(values(2)), 0)
    work = group.allreduce([t], options())
    end = [e for e in double.calls() if e[0] == "record"][-1][1]
    other = Stream("consumer", 0)
    double.current[0] = other
    del double.log[:]
    work.wait()
    waited = double.calls()
    double.current[0] = Stream("third", 0)
    work.synchronize()
    ok = (waited == [("wait", other, end)]
          and double.calls()[-1] == ("wait", double.current[0], end))
    assert all_ranks_ok(ok), double.calls()


def test_is_completed_asks_the_end_event(double, group):
    t = double.put(torch.from_numpy(values(3)), 0)
    work = group.allreduce([t], options())
    end = [e for e in double.calls() if e[0] == "record"][-1][1]
    before = work.is_completed()
    end.done = True
    after = work.is_completed()
    assert all_ranks_ok(before is False and after is True
                        and double.calls()[-2:] == [("query", end), ("query", end)])


def test_future_holds_the_outputs_and_copies_run_on_the_collective_stream(double, group):
    """all_gather into a list: the copies out of the gathered buffer run on the collective
    stream after the op and before its end event; the Future (completed on that stream) holds
    the output list."""
    x = values(4, 3)
    inp = double.put(torch.from_numpy(x.copy()), 0)
    outs = [torch.zeros(3) for _ in range(SIZE)]
    work = group.allgather([outs], [inp], options(cls=_c10d.AllgatherOptions))
    log = double.calls()
    coll = double.made[0][1]
    i = log.index(("Allgather",))
    got = work.get_future().wait()
    ok = (log[i + 1] == ("on", coll) and log[i + 2][0] == "record" and log[i + 2][2] is coll
          and log[i + 3] == ("future", coll) and got[0] is outs
          and np.array_equal(torch.stack(outs).numpy(), gather_all(x)))
    assert all_ranks_ok(ok), log


def test_one_communicator_per_device_whatever_the_stream(double, group):
    """Calls from several streams of a device use one communicator (each rank from its own
    stream: made collectively once, no hang); a device's default stream and another device's
    are different devices, so two communicators in all."""
    for i in range(3):
        double.current[0] = Stream(f"s{RANK}.{i}", 0)
        group.allreduce([double.put(torch.from_numpy(values(i)), 0)], options()).wait()
    x = values(9)
    t = double.put(torch.from_numpy(x.copy()), 1)
    group.allreduce([t], options()).wait()
    devices = [d for d, _, _ in double.made]
    ok = devices == [0, 1] and np.array_equal(t.numpy(), gather_all(x).sum(axis=0))
    assert all_ranks_ok(ok), devices


def test_shutdown_frees_the_device_communicators(double):
    pg = alt.ProcessGroupAluminum(al.Communicator(), 60.0)
    pg.allreduce([double.put(torch.from_numpy(values(5)), 0)], options()).wait()
    comm = double.made[0][2]
    before = comm._state.freed
    pg.shutdown()
    assert all_ranks_ok(before is False and comm._state.freed)


def test_a_call_that_fails_to_start_fails_its_work_and_future(double, group):
    """The device communicator freed under the group: the call returns a failed Work (no
    al.Error into torch's caller); wait() raises DistBackendError, the Future fails."""
    group.allreduce([double.put(torch.from_numpy(values(6)), 0)], options()).wait()
    double.made[0][2].Free()
    work = group.allreduce([double.put(torch.from_numpy(values(7)), 0)], options())
    with pytest.raises(dist.DistBackendError, match="all_reduce failed"):
        work.wait()
    with pytest.raises(RuntimeError, match="all_reduce failed"):
        work.get_future().wait()
    assert work.is_completed() and not work.is_success()


def test_coalesced_point_to_point_settles_together(double, group):
    """A coalesced batch of isend/irecv (each rank sends to the next, receives from the
    previous): the nonblocking calls start at once, their requests are waited for when the
    batch's Work is first waited for, and its end is recorded after them on the collective
    stream."""
    nxt, prev = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    x = values(8)
    send = double.put(torch.from_numpy(x.copy()), 0)
    recv = double.put(torch.zeros(5), 0)
    group._start_coalescing(torch.device("cpu"))
    group.send([send], nxt, 0)
    group.recv([recv], prev, 0)
    work = group._end_coalescing(torch.device("cpu"))
    started = [e for e in double.calls() if e[0] in ("Isend", "Irecv", "record")]
    work.wait()
    coll = double.made[0][1]
    ends = [e for e in double.calls() if e[0] == "record" and e[2] is coll]
    ok = ([e[0] for e in started] == ["record", "Isend", "record", "Irecv"]
          and len(ends) == 3 and double.calls()[-1][0] == "wait"
          and double.calls()[-1][2] is ends[-1][1]
          and np.array_equal(recv.numpy(), gather_all(x)[prev]))
    assert all_ranks_ok(ok), double.calls()


def test_allreduce_hook_is_stream_ordered(double):
    """The DDP hook on a CUDA bucket: enqueued on the state's device communicator after the
    current stream's work, averaged, its Future completed on the collective stream."""
    comm = al.Communicator()
    x = values(10)
    t = double.put(torch.from_numpy(x.copy()), 1)

    class Bucket:
        def buffer(self):
            return t

        def is_last(self):
            return True
    fut = alt.allreduce_hook(comm, Bucket())
    log = double.calls()
    coll = double.made[0][1]
    ok = (fut.wait() is t and log[1][2] is double.current[1] and log[2][1] is coll
          and log[3] == ("Allreduce",) and log[-1] == ("future", coll)
          and np.allclose(t.numpy(), gather_all(x).mean(axis=0)))
    assert all_ranks_ok(ok), log
