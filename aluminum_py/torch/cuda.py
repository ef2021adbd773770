"""CUDA tensors on the backend and the DDP hooks: stream order as torch's NCCL process group
keeps it (docs/torch.md, "CUDA tensors").

* :class:`DeviceComms`: one communicator per CUDA device over a parent communicator, bound to
  a stream of its own (the device's *collective stream*), made at the first call on a tensor
  of that device (collective: every rank's first such call) and freed by :meth:`free`.
* :func:`enqueue`: one call on a device: the collective stream waits for the work queued so
  far on the tensor's device's current stream, the call is enqueued on the collective stream,
  and the returned :class:`Enqueued` ends with an event on that stream (its completion).
  Whoever consumes the result orders itself after that event: ``Enqueued.wait()`` makes the
  then-current stream wait on it, the Future is completed on the collective stream (torch's
  CUDA-aware Future: its ``wait()`` and callbacks are ordered after it), and
  ``Enqueued.query()`` asks the event.  The issuing stream itself does not wait, so its later
  kernels overlap the call.
* :class:`TorchCuda`: the CUDA pieces of torch this module calls (current stream, new
  streams, events, ``record_stream``, the CUDA-aware Future, the device communicator), in one
  object; :data:`pieces` is the one in use (the tests put a double there that records what
  waited on what).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ..communicator import Communicator
from .completion import failed_future

__all__ = ["TorchCuda", "DeviceComms", "Enqueued", "enqueue", "pieces"]


class TorchCuda:
    """torch's CUDA streams and events, as the backend uses them."""

    def device_of(self, t: torch.Tensor) -> int | None:
        """The CUDA device index of `t` (the tensor's own device, not the thread's current
        one), or None for a tensor not on a CUDA device."""
        return t.device.index if t.is_cuda else None

    def current_stream(self, device: int):
        return torch.cuda.current_stream(device)

    def new_stream(self, device: int):
        return torch.cuda.Stream(device=device)

    def event(self):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        """`stream` waits (on the device; the host does not block) for `event`."""
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.query()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """`tensor`'s memory is not reused before the work queued on `stream` so far has run
        (the caching allocator's rule for a tensor used on a stream it was not made on)."""
        tensor.record_stream(stream)

    def on(self, stream):
        """A context in which torch enqueues on `stream` (copies out of temporary buffers)."""
        return torch.cuda.stream(stream)

    def future(self, value, device: int, stream) -> torch.futures.Future:
        """A CUDA-aware Future holding `value`, completed on `stream`: its ``wait()`` makes the
        caller's current stream wait for the work queued on `stream` so far."""
        fut = torch.futures.Future(devices=[torch.device("cuda", device)])
        with torch.cuda.stream(stream):
            fut.set_result(value)
        return fut

    def communicator(self, parent: Communicator, device: int, stream) -> Communicator:
        """A communicator over `parent`'s ranks whose GPU calls run on `device`, bound to
        `stream` (collective over `parent`)."""
        with torch.cuda.device(device):
            return Communicator(parent, stream=stream)


pieces = TorchCuda()


class DeviceComms:
    """One communicator per CUDA device over `parent`, each bound to a collective stream of its
    own: the same communicator whatever stream is current when a call is made."""

    def __init__(self, parent: Communicator):
        self.parent = parent
        self._lock = threading.Lock()
        self._by_device: dict[int, tuple[Communicator, Any]] = {}

    def get(self, device: int, cuda: TorchCuda) -> tuple[Communicator, Any]:
        """(communicator, collective stream) of `device`, made at the first call (collective
        over the parent's ranks: each rank's first call on a CUDA tensor makes it)."""
        hit = self._by_device.get(device)
        if hit is None:
            with self._lock:
                hit = self._by_device.get(device)
                if hit is None:
                    stream = cuda.new_stream(device)
                    hit = (cuda.communicator(self.parent, device, stream), stream)
                    self._by_device[device] = hit
        return hit

    def free(self) -> None:
        """Free every device communicator (and its NCCL communicator)."""
        with self._lock:
            comms, self._by_device = list(self._by_device.values()), {}
        for comm, _ in comms:
            if not comm._state.freed:
                comm.bind_thread()
                comm.Free()


class Enqueued:
    """A call enqueued on a device's collective stream, completed (``settle``) once its
    nonblocking requests (point-to-point, flushed as one group at their first ``Wait``) were
    waited for on that stream: the copies out of temporary buffers (``finish() -> value``) then
    run on the stream, an event marks the end, and the Future holding the value (without a
    `finish`: `result`) is completed on it.

    A failure (at the start, or of a request) fails the Future and is ``error``."""

    __slots__ = ("cuda", "device", "stream", "requests", "finish", "result", "fail", "end",
                 "future", "error")

    def __init__(self, cuda: TorchCuda, device: int, stream, requests: list,
                 finish: Callable[[], Any] | None, result: list,
                 fail: Callable[[BaseException], BaseException]):
        self.cuda, self.device, self.stream = cuda, device, stream
        self.requests, self.finish, self.result, self.fail = requests, finish, result, fail
        self.end = self.future = self.error = None

    @classmethod
    def failed(cls, error: BaseException, result: list) -> "Enqueued":
        e = cls(pieces, -1, None, [], None, result, None)
        e._failed(error)
        return e

    def _failed(self, error: BaseException) -> None:
        self.error, self.requests, self.finish = error, [], None
        self.future = failed_future(error)

    def settle(self) -> None:
        if self.future is not None:
            return
        cuda, stream = self.cuda, self.stream
        try:
            for r in self.requests:
                r.Wait()                    # the collective stream waits for the request
            value = self.result
            if self.finish is not None:
                with cuda.on(stream):
                    value = self.finish()
            end = cuda.event()
            cuda.record(end, stream)
        except Exception as e:              # noqa: BLE001  (the Work and Future fail)
            self._failed(self.fail(e))
            return
        self.requests, self.finish, self.end = [], None, end
        self.future = cuda.future(value, self.device, stream)

    def Wait(self, timeout=None) -> None:
        """As a request (a part of a joined call): settled on the collective stream; raises a
        failure."""
        self.settle()
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        """The stream current now on the device waits for the call's end (raises a failure)."""
        self.settle()
        if self.error is not None:
            raise self.error
        self.cuda.wait(self.cuda.current_stream(self.device), self.end)

    def query(self) -> bool:
        """True once the call has run on the device (or failed)."""
        self.settle()
        return self.error is not None or self.cuda.query(self.end)


def enqueue(comms: DeviceComms, device: int, tensors, launch: Callable[[Communicator], list],
            finish: Callable[[], Any] | None, result: list,
            fail: Callable[[BaseException], BaseException]) -> Enqueued:
    """Run `launch(comm)` for `device`'s communicator, ordered after the work queued so far on
    the device's current stream; `launch` returns the requests of the nonblocking calls it made
    (blocking ones are enqueued on the collective stream already).  `tensors`: every CUDA
    tensor the call reads or writes (kept from reuse until the collective stream ran it).  A
    call that fails to start returns a failed :class:`Enqueued`."""
    cuda = pieces
    try:
        comm, stream = comms.get(device, cuda)
        start = cuda.event()
        cuda.record(start, cuda.current_stream(device))
        cuda.wait(stream, start)
        for t in tensors:
            cuda.record_stream(t, stream)
        comm.bind_thread()
        requests = launch(comm)
    except Exception as e:                  # noqa: BLE001
        if isinstance(e, (TypeError, ValueError)):
            raise                           # argument errors: raised by the call itself
        return Enqueued.failed(fail(e), result)
    done = Enqueued(cuda, device, stream, requests, finish, result, fail)
    if not requests:
        done.settle()
    return done
