"""Completing ``torch.futures.Future`` objects when the library's requests complete: one
mechanism for the DDP hooks' Futures and the backend's Works (docs/torch.md).

* :class:`Completion`: started requests, the Future to complete once every one has, and what
  to do then (``finish()``: copies out of temporary buffers; its value is the Future's).
  Whichever thread runs it first settles it, exactly once: the thread that waits for it
  (``Work.wait``, the hook at the last bucket) or the waiter thread.
* :class:`Waiter`: one daemon thread that runs the Completions submitted to it in submission
  order (DDP's buckets are launched in order on one communicator, so waiting in that order
  delays no Future behind one that completes later); :meth:`Waiter.drain` runs the pending
  ones in the calling thread instead.
"""
from __future__ import annotations

import atexit
import collections
import queue
import threading
from typing import Any, Callable

import torch

__all__ = ["Completion", "Waiter", "waiter", "failed_future", "value"]


def value(future: torch.futures.Future):
    """`future`'s value; raises its failure (so a Future chained with ``then(value)`` fails with
    it as an error, as C++ reads it: ``Future.set_exception`` alone stores the exception as the
    value, which DDP's reducer would parse as tensors)."""
    return future.value()


def failed_future(error: BaseException) -> torch.futures.Future:
    """A Future failed with `error` (as an error, see :func:`value`)."""
    fut = torch.futures.Future()
    fut.set_exception(error)
    return fut.then(value)


class Completion:
    """Requests (anything with ``Wait(timeout)``), the Future, and ``finish() -> value``.

    Args:
        requests: the started requests; empty: settled at once (a blocking call that ran).
        future: the ``torch.futures.Future`` to complete.
        finish: called once every request completed; its return value is the Future's
            result (an exception it raises is the Future's).
        timeout: seconds the waiter thread waits (None: ``Request.Wait``'s default,
            AL_HANG_TIMEOUT).
        error: maps a failure (and the timeout it happened under) to the exception set on
            the Future (None: the failure itself).
    """

    __slots__ = ("requests", "future", "finish", "timeout", "error", "_lock", "_claimed")

    def __init__(self, requests: list, future: torch.futures.Future,
                 finish: Callable[[], Any], timeout: float | None = None,
                 error: Callable[[BaseException, float | None], BaseException] | None = None):
        self.requests, self.future, self.finish = requests, future, finish
        self.timeout, self.error = timeout, error
        self._lock = threading.Lock()
        self._claimed = False
        if not requests:
            self.settle()

    def run(self, timeout: float | None = None) -> None:
        """Wait for the requests in this thread (``timeout`` seconds each; None: this
        Completion's), then settle: the Future gets finish()'s value, or the failure."""
        requests = self.requests
        if requests is None:                # settled by another thread
            return
        limit = self.timeout if timeout is None else timeout
        try:
            for r in requests:
                r.Wait(limit)               # releases the GIL; the limit bounds it
        except BaseException as e:          # noqa: BLE001  (delivered through the Future)
            self.settle(e if self.error is None else self.error(e, limit))
        else:
            self.settle()

    def settle(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        finish = self.finish
        self.requests = self.finish = None  # drop the buffers
        with _torch_calls:
            if _exiting:                    # the interpreter is finalizing: torch is off limits
                return
            if error is None:
                try:
                    value = finish()
                except BaseException as e:  # noqa: BLE001
                    error = e if self.error is None else self.error(e, None)
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)

    def ready(self) -> bool:
        """True once settled; settles it here when every request has completed."""
        requests = self.requests
        if not self.future.done() and requests is not None and all(r.done for r in requests):
            self.run()
        return self.future.done()


class Waiter:
    """One daemon thread (``"aluminum_py.torch waiter"``, started on first use) that runs the
    submitted Completions in order; :meth:`drain` runs the pending ones in the caller."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque = collections.deque()     # not yet run, in order
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, completion: Completion) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="aluminum_py.torch waiter")
                self._thread.start()
            self._pending.append(completion)
        self._queue.put(completion)

    def drain(self) -> None:
        """Run every pending Completion in the calling thread, in order (the DDP hook at the
        backward pass's last bucket, where DDP's next step is to block on every Future: this
        saves the waiter thread's wake-up on the step's critical path)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                completion = self._pending.popleft()
            completion.run()

    def _loop(self):
        while not _exiting:
            completion = self._queue.get()
            if completion is None:          # stop(): wake up and end
                return
            completion.run()
            with self._lock:
                try:
                    self._pending.remove(completion)
                except ValueError:
                    pass                    # drained
            del completion                  # drop the buffers before blocking again


    def stop(self) -> None:
        """At interpreter exit, before the library's own exit handler: from now on no
        Completion touches torch (a Future completed while the interpreter finalizes aborts
        the process: "terminate called without an active exception"); the progress engine
        stops (pending ops get AL_EXIT_GRACE seconds, then are cancelled, so the thread's wait
        returns) and the thread is joined."""
        global _exiting
        with _torch_calls:                  # a settle in progress in the thread ends first
            _exiting = True
        with self._lock:
            thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._queue.put(None)
        from .. import _core, config
        with config.deferred():
            grace = config.exit_grace()
        _core.shutdown_engine(grace)        # the library's exit handler then finds it stopped
        thread.join(grace + 5.0)            # bounded: a wait the engine does not end


# held while a Completion calls into torch; _exiting is set under it at interpreter exit
_torch_calls = threading.RLock()
_exiting = False

waiter = Waiter()
# registered after the library's own exit handler (imported first), so it runs before it
atexit.register(waiter.stop)
