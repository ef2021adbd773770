"""DDP communication hooks over the library's nonblocking allreduce (docs/torch.md).

* :func:`allreduce_hook` -- ``ddp.register_comm_hook(comm, allreduce_hook)``: each bucket is
  averaged in place with ``Iallreduce(op=AVG, algorithm="auto")``; the returned
  ``torch.futures.Future`` is completed by one shared waiter thread when the allreduce completes
  (at the backward pass's last bucket, by the training thread, which DDP then blocks anyway);
  errors are set on the Future, so DDP raises them from ``backward()``.
* :func:`fp16_compress_hook`, :func:`bf16_compress_hook` -- the same on a float16 / bfloat16 copy
  of the bucket, cast back when done (as torch's own compression hooks).
"""
import threading
import weakref
from typing import Any, Callable

import torch

from .. import AVG, Communicator
from . import completion, cuda

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "default_communicator"]

_lock = threading.Lock()
_default: Communicator | None = None
# a hook state's communicators for CUDA tensors, one per device (made at the first bucket)
_devices: "weakref.WeakKeyDictionary[Communicator, cuda.DeviceComms]" = weakref.WeakKeyDictionary()


def default_communicator() -> Communicator:
    """The communicator hooks use when their state is None: one ``al.Communicator()`` over
    ``MPI.COMM_WORLD``, created on first use (collective: every rank's first hook call creates
    it, at the same bucket)."""
    global _default
    with _lock:
        if _default is None:
            _default = Communicator()
        return _default


def _communicator(state) -> Communicator:
    """The hook's state (or the default communicator)."""
    if state is None:
        return default_communicator()
    if isinstance(state, Communicator):
        return state
    raise TypeError(f"state: expected an aluminum_py.Communicator or None, "
                    f"got {type(state).__name__}")


def _device_comms(comm: Communicator) -> "cuda.DeviceComms":
    with _lock:
        comms = _devices.get(comm)
        if comms is None:
            comms = _devices[comm] = cuda.DeviceComms(comm)
        return comms


_NUMPY_TYPES = {torch.float32, torch.float64, torch.float16, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
                torch.complex64, torch.complex128}


def buffer(t: torch.Tensor, reduce: bool = False):
    """The one way a tensor becomes a buffer the Communicator reads and writes in place,
    sharing `t`'s memory (no copy): CUDA tensors as they are, CPU tensors as numpy views; bool
    as bytes (the backend maps a reduction's op to a logical one).  With `reduce`, bfloat16
    goes through ``ml_dtypes`` (TypeError naming it if it is missing) and other types numpy
    lacks (float8) raise TypeError; without, they move as bytes.  Raises ValueError for a
    tensor that is not contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"aluminum: tensors must be contiguous (got strides {t.stride()} for "
                         f"shape {tuple(t.shape)}); call .contiguous() first")
    dt = t.dtype
    if t.is_cuda:
        return t.view(torch.uint8) if dt == torch.bool else t
    if dt in _NUMPY_TYPES:
        return t.numpy() if not t.requires_grad else t.detach().numpy()
    if dt == torch.bool:
        return t.detach().view(torch.uint8).numpy()
    if not reduce:
        return t.detach().reshape(-1).view(torch.uint8).numpy()
    if dt == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError as e:
            raise TypeError("bfloat16 host tensors need ml_dtypes (pip install ml_dtypes)") from e
        return t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    raise TypeError(f"aluminum: {dt} tensors cannot be reduced (no such numpy type); they can "
                    f"be moved (gather, broadcast, all-to-all, send)")


def as_buffer(tensor: torch.Tensor):
    """What a hook reduces in place: ``buffer(tensor, reduce=True)``."""
    return buffer(tensor, reduce=True)


_waiter = completion.waiter


def _failed(exc: BaseException) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_exception(exc)
    return fut


def _average(state, tensor, finish: Callable[[], Any], last: bool = False
             ) -> torch.futures.Future:
    """Start averaging `tensor` in place over the ranks; the Future gets ``finish()`` once the
    allreduce completed.

    Host tensors: the shared waiter thread completes the Future, except at the `last` bucket
    of the backward pass, where this thread completes every pending one (``Waiter.drain``).
    The communicator is handed over to the thread torch runs the hook on
    (``Communicator.bind_thread``: torch runs hooks on the thread that called ``backward()``
    for CPU work, on a device thread for CUDA); the waiter thread only waits (``Wait`` is
    allowed from any thread).  CUDA tensors: the allreduce is enqueued on the device's
    collective stream after the work queued so far on the current stream (:mod:`.cuda`), and
    the Future is completed on the collective stream, as torch's NCCL work Futures are: DDP's
    use of the result is ordered after the allreduce.
    """
    try:
        comm = _communicator(state)
        device = cuda.pieces.device_of(tensor)
        if device is not None:
            def launch(c: Communicator) -> list:
                c.Allreduce(as_buffer(tensor), op=AVG, algorithm="auto")
                return []
            return cuda.enqueue(_device_comms(comm), device, [tensor], launch, finish, None,
                                lambda e: e).future
        comm.bind_thread()              # torch's autograd thread (the threading rule, below)
        request = comm.Iallreduce(as_buffer(tensor), op=AVG, algorithm="auto")
        fut = torch.futures.Future()
        _waiter.submit(completion.Completion([request], fut, finish))
        if last:
            _waiter.drain()
        return fut
    except Exception as e:              # noqa: BLE001  (DDP raises it from the Future)
        return _failed(e)


def allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket.buffer()`` in place over the ranks.

    Args:
        state: an ``aluminum_py.Communicator`` over the DDP ranks (same rank order as the
            process group), or None for :func:`default_communicator`.
        bucket: the ``torch.distributed.GradBucket`` DDP passes.
    Returns:
        A ``torch.futures.Future`` holding the bucket's tensor, completed when the allreduce
        completes; a failure is set on it, and DDP raises it from ``backward()``.

    Example (``mpiexec -n 2 python train.py``)::

        import aluminum_py as al, aluminum_py.torch as alt
        ddp = torch.nn.parallel.DistributedDataParallel(model)   # gloo group, same ranks
        ddp.register_comm_hook(al.Communicator(), alt.allreduce_hook)
    """
    tensor = bucket.buffer()
    return _average(state, tensor, lambda: tensor, bucket.is_last())


def _compress_hook(state, bucket, dtype) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).contiguous()

    def finish():
        buffer.copy_(compressed)
        return buffer
    return _average(state, compressed, finish, bucket.is_last())


def fp16_compress_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """As :func:`allreduce_hook` on a float16 copy of the bucket, written back into the bucket
    when done (torch's ``default_hooks.fp16_compress_hook``): half the bytes on the wire, float16
    precision; each pairwise sum is computed in float32 and rounded once."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """As :func:`fp16_compress_hook` with bfloat16 (float32's range, 8 bits of precision);
    host tensors need ``ml_dtypes``."""
    return _compress_hook(state, bucket, torch.bfloat16)


# DDP refuses a hook *named* bf16_compress_hook without CUDA and NCCL (it checks torch's own
# hook by name); ours reduces host tensors too
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "al_bf16_compress_hook"
