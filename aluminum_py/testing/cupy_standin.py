"""A CuPy stand-in over the CUDA driver stand-in, so that GPU tests written for CuPy run on a
machine without a GPU: ``install()`` puts it in ``sys.modules["cupy"]``.

Arrays are numpy arrays (a subclass) whose memory plays device memory: they carry
``__cuda_array_interface__``, so aluminum_py sees GPU buffers and takes its GPU paths (NCCL and
host transfer) on the stand-ins' streams. Streams are the CUDA stand-in's streams. CuPy runs its
kernels on the current stream; here every array operation (creating or copying an array, a
ufunc such as ``x *= 2``, an item assignment, ``get``/``set``/``asnumpy``) first waits until the
current stream (or the one given) has run what was queued on it, then runs on the host: the
same order CuPy's kernels would see, by synchronizing.

Covers what aluminum_py's GPU suite uses: ``asarray``, ``asnumpy``, ``empty``, ``zeros``,
``ones``, ``full``, ``maximum``, the numpy dtypes, ``ndarray.get/set``, ``cuda.Stream``
(``with stream:``, ``ptr``, ``synchronize``, ``done``), ``cuda.Device`` (``id``, ``use``,
``synchronize``)
and ``cuda.get_current_stream``. Needs ``AL_CUDA_LIBRARY`` to name the CUDA stand-in (see
:mod:`aluminum_py.testing.cuda_standin`); pair it with ``AL_NCCL_LIBRARY`` for NCCL.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import types

import numpy as np

from . import cuda_standin as cs

__version__ = "0.0-standin"
_tls = threading.local()


def _stack() -> list:
    if not hasattr(_tls, "streams"):
        _tls.streams = []
    return _tls.streams


def _current_device() -> int:
    dev = ctypes.c_int()
    if cs.load().cuCtxGetDevice(ctypes.byref(dev)) != 0:
        cs.make_current(0)
        return 0
    return dev.value


class Stream:
    """A CUDA stand-in stream; ``with stream:`` makes it current on this thread."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None):
        _current_device()                          # a current context on this thread
        self._owned = ptr is None and not null
        self.ptr = 0 if null else (ptr if ptr is not None else cs.stream_create(1 if non_blocking else 0))

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()

    def synchronize(self) -> None:
        cs.stream_synchronize(self.ptr)

    @property
    def done(self) -> bool:
        return cs.load().cuStreamQuery(self.ptr) == 0

    def __del__(self):
        if getattr(self, "_owned", False) and self.ptr:
            try:
                cs.stream_destroy(self.ptr)        # released once its queued work has run
            except Exception:
                pass

    def __repr__(self):
        return f"<cupy_standin.Stream ptr={self.ptr:#x}>"


Stream.null = None                # the legacy default stream, made on first use (needs a context)


def get_current_stream() -> Stream:
    s = _stack()
    if s:
        return s[-1]
    if Stream.null is None:
        Stream.null = Stream(null=True)
    return Stream.null


class Device:
    def __init__(self, device: int | None = None):
        self.id = _current_device() if device is None else int(device)

    def use(self) -> None:
        cs.make_current(self.id)

    def synchronize(self) -> None:
        """Wait until every stream of the device is idle (cuCtxSynchronize)."""
        with self:
            rc = cs.load().cuCtxSynchronize()
        if rc != 0:
            raise cs.CudaStandinError("cuCtxSynchronize", rc)

    def __enter__(self):
        self._prev = _current_device()
        self.use()
        return self

    def __exit__(self, *exc):
        cs.make_current(self._prev)


def _sync(stream=None) -> None:
    (stream if stream is not None else get_current_stream()).synchronize()


def _host(a):
    return a.view(np.ndarray) if isinstance(a, ndarray) else a


class ndarray(np.ndarray):
    """A "device" array: host memory presented through ``__cuda_array_interface__``."""

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "shape": self.shape, "typestr": self.dtype.str,
                "data": (self.__array_interface__["data"][0], False),
                "strides": None if self.flags.c_contiguous else self.strides, "stream": None}

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _sync()
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*[_host(i) for i in inputs], **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if isinstance(result, np.ndarray):
            return result.view(ndarray)
        return result

    def __setitem__(self, key, value):
        _sync()
        np.ndarray.__setitem__(self, key, _host(value))

    def get(self, stream=None, out=None) -> np.ndarray:
        return asnumpy(self, stream=stream, out=out)

    def set(self, arr, stream=None) -> None:
        _sync(stream)
        np.copyto(self.view(np.ndarray), np.asarray(arr))


def _new(host: np.ndarray) -> ndarray:
    return np.ascontiguousarray(host).copy().view(ndarray)


def asarray(a, dtype=None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _sync()
    return _new(np.asarray(_host(a), dtype=dtype))


array = asarray


def asnumpy(a, stream=None, out=None) -> np.ndarray:
    _sync(stream)
    if out is not None:
        np.copyto(out, _host(a))
        return out
    return np.array(_host(a), copy=True)


def empty(shape, dtype=np.float64) -> ndarray:
    _sync()
    return np.empty(shape, dtype=dtype).view(ndarray)


def zeros(shape, dtype=np.float64) -> ndarray:
    _sync()
    return np.zeros(shape, dtype=dtype).view(ndarray)


def ones(shape, dtype=np.float64) -> ndarray:
    _sync()
    return np.ones(shape, dtype=dtype).view(ndarray)


def full(shape, fill_value, dtype=None) -> ndarray:
    _sync()
    return np.full(shape, fill_value, dtype=dtype).view(ndarray)


def maximum(a, b) -> ndarray:
    _sync()
    return np.maximum(_host(a), _host(b)).view(ndarray)


for _name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "bool_"):
    globals()[_name] = getattr(np, _name)
dtype = np.dtype

cuda = types.SimpleNamespace(Stream=Stream, Device=Device, get_current_stream=get_current_stream)


def install() -> types.ModuleType:
    """Make ``import cupy`` give this module (for the rest of the process). Returns it."""
    module = sys.modules[__name__]
    sys.modules["cupy"] = module
    return module
