"""The CUDA driver and NCCL stand-ins: build them, load them, and drive them from tests.

``cuda_standin.c`` (next to this file) is a small C library that exports the CUDA driver API
entry points aluminum_py uses, with CUDA's semantics, where "device memory" is host memory:
streams are worker threads, pinned alloc/free synchronize implicitly, contexts are per thread,
misuse gets CUDA's error codes. aluminum_py loads it instead of libcuda.so.1 when
``AL_CUDA_LIBRARY`` names it::

    AL_CUDA_LIBRARY=$(python -m aluminum_py.testing.cuda_standin) python prog.py

``nccl_standin.c`` is built into the same library: it exports the NCCL API the binding uses and
runs the collectives over MPI on the stand-in's streams (``AL_NCCL_LIBRARY`` = the same path
selects it). The library is built with ``MPICC``, else ``mpicc`` on PATH, else ``CC`` with the
``mpi.h`` and ``libmpi`` of the prefix the ``mpich`` wheel installs into.

Environment: ``AL_CUDA_STANDIN_DIR`` (where the .so is built; default ``~/.cache/aluminum_py``),
``CC`` (the compiler; default ``cc``/``gcc``), and, read by the library itself,
``AL_STANDIN_DEVICES`` (device count, default 1), ``AL_STANDIN_SYNC_WARN`` (seconds an
implicit synchronization waits before it reports the stream it waits for on stderr; default 5)
and ``AL_STANDIN_DRIVER_LOCK`` (1: model CUDA's driver lock and report device calls made with
the GIL held while another thread waits in the driver; see :func:`driver_lock`).

In a process, :func:`load` gives the same library (same dlopen handle, same globals) that
aluminum_py loads through ``AL_CUDA_LIBRARY``, as both open :func:`path`.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from ctypes import POINTER, c_char_p, c_int, c_long, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

import numpy as np

from .. import config

__all__ = ["path", "load", "error_name", "CudaStandinError", "make_current", "stream_create",
           "stream_synchronize", "stream_destroy", "primary_ctx_refcount", "current_ctx",
           "live_streams", "calls", "pinned_live", "sync_waits", "blocked_streams",
           "reset_counters", "HostBackedArray", "nccl_launches", "reset_nccl_launches",
           "nccl_stall", "NcclLaunch", "driver_lock", "driver_lock_held", "driver_lock_violations",
           "no_driver_lock_violations", "driver_lock_waits", "stream_hold", "main"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, "cuda_standin.c"), os.path.join(_HERE, "nccl_standin.c")]
_CFLAGS = ["-shared", "-fPIC", "-O2", "-pthread"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_PP = POINTER(c_void_p)
# argtypes of the exported entry points (all return a CUresult, an int)
_SIGNATURES = {
    "cuInit": [c_uint], "cuDriverGetVersion": [POINTER(c_int)],
    "cuDeviceGetCount": [POINTER(c_int)], "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDevicePrimaryCtxRetain": [_PP, c_int], "cuDevicePrimaryCtxRelease": [c_int],
    "cuDevicePrimaryCtxRelease_v2": [c_int],
    "cuCtxGetCurrent": [_PP], "cuCtxSetCurrent": [c_void_p],
    "cuCtxPushCurrent": [c_void_p], "cuCtxPushCurrent_v2": [c_void_p],
    "cuCtxPopCurrent": [_PP], "cuCtxPopCurrent_v2": [_PP],
    "cuCtxGetDevice": [POINTER(c_int)], "cuCtxGetDevice_v2": [POINTER(c_int), c_void_p],
    "cuCtxSynchronize": [],
    "cuStreamCreate": [_PP, c_uint], "cuStreamDestroy": [c_void_p],
    "cuStreamDestroy_v2": [c_void_p], "cuStreamSynchronize": [c_void_p],
    "cuStreamQuery": [c_void_p], "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "cuStreamWaitValue32": [c_void_p, c_uint64, c_uint32, c_uint],
    "cuStreamWaitValue32_v2": [c_void_p, c_uint64, c_uint32, c_uint],
    "cuStreamWriteValue32": [c_void_p, c_uint64, c_uint32, c_uint],
    "cuStreamWriteValue32_v2": [c_void_p, c_uint64, c_uint32, c_uint],
    "cuEventCreate": [_PP, c_uint], "cuEventRecord": [c_void_p, c_void_p],
    "cuEventRecord_v2": [c_void_p, c_void_p], "cuEventQuery": [c_void_p],
    "cuEventSynchronize": [c_void_p], "cuEventDestroy": [c_void_p],
    "cuEventDestroy_v2": [c_void_p],
    "cuMemcpyAsync": [c_uint64, c_uint64, c_size_t, c_void_p],
    "cuMemcpy": [c_uint64, c_uint64, c_size_t],
    "cuMemHostAlloc": [_PP, c_size_t, c_uint], "cuMemAllocHost_v2": [_PP, c_size_t],
    "cuMemFreeHost": [c_void_p],
    "cuMemAllocAsync": [POINTER(c_uint64), c_size_t, c_void_p],
    "cuMemFreeAsync": [c_uint64, c_void_p],
    "cuGetErrorName": [c_int, POINTER(c_char_p)], "cuGetErrorString": [c_int, POINTER(c_char_p)],
}
# (restype, argtypes) of the introspection functions
_INTROSPECTION = {
    "standin_primary_ctx_refcount": (c_int, [c_int]),
    "standin_current_ctx": (c_void_p, []),
    "standin_live_streams": (c_int, []),
    "standin_calls": (c_long, [c_char_p]),
    "standin_pinned_live": (c_long, []),
    "standin_device_live": (c_long, []),
    "standin_sync_waits": (c_long, []),
    "standin_blocked_streams": (c_int, []),
    "standin_reset_counters": (None, []),
    "standin_nccl_launch_count": (c_long, []),
    "standin_nccl_launch_get": (c_int, [c_long, c_char_p, POINTER(c_long)]),
    "standin_nccl_reset": (None, []),
    "standin_nccl_stall": (None, [c_int]),
    "standin_driver_lock": (None, [c_int]),
    "standin_driver_lock_mode": (c_int, []),
    "standin_driver_lock_held": (c_int, []),
    "standin_driver_lock_violations": (c_long, []),
    "standin_driver_lock_report": (None, [c_char_p, c_size_t]),
    "standin_driver_lock_waits": (c_long, []),
    "standin_stream_hold": (c_int, [c_void_p, c_long, ctypes.c_double]),
}


class CudaStandinError(RuntimeError):
    """A stand-in call failed; ``.code`` is the CUresult."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed: {error_name(code)} (CUresult {code})")
        self.code = code


# ------------------------------------------------------------------ build and load
def _cache_dir() -> str:
    d = config.cuda_standin_dir()
    if d:
        return os.path.abspath(d)
    d = os.path.join(os.path.expanduser("~"), ".cache", "aluminum_py")
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    # no writable home: a per-user directory in the temp dir (the same for every rank)
    return os.path.join(tempfile.gettempdir(), f"aluminum_py-{os.getuid()}")


def _compiler() -> list[str]:
    """The MPI compiler wrapper (the NCCL stand-in calls MPI), else CC with the mpi.h and libmpi
    of a prefix on sys.path (the layout of the `mpich` wheel)."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if mpicc:
        return shlex.split(mpicc)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("cannot build the CUDA stand-in: no C compiler (set CC, or install cc/gcc)")
    prefixes = [sys.prefix] + [os.path.abspath(os.path.join(p, "..", "..", "..")) for p in sys.path]
    for prefix in prefixes:
        if os.path.exists(os.path.join(prefix, "include", "mpi.h")):
            lib = os.path.join(prefix, "lib")
            return shlex.split(cc) + [f"-I{prefix}/include", f"-L{lib}", f"-Wl,-rpath,{lib}", "-lmpi"]
    raise RuntimeError("cannot build the CUDA/NCCL stand-in: no mpicc and no mpi.h found "
                       "(install the mpich wheel, or set MPICC)")


def path() -> str:
    """The path of the built stand-in library, building it first if needed.

    The file name carries a hash of the C source (and flags), so an edited source is rebuilt.
    The build goes to a private temporary name and is moved into place with os.replace, so
    concurrent callers (several MPI ranks) each see either no file or a complete one."""
    source = b""
    for src in _SOURCES:
        with open(src, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    d = _cache_dir()
    out = os.path.join(d, f"libcuda_standin-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(d, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.{threading.get_ident()}.tmp"
    compiler = _compiler()
    cmd = compiler[:1] + _CFLAGS + ["-o", tmp] + _SOURCES + compiler[1:]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise RuntimeError(f"cannot build the CUDA stand-in: {shlex.join(cmd)}: {e}") from e
    if proc.returncode != 0 or not os.path.exists(tmp):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise RuntimeError(f"building the CUDA stand-in failed (exit {proc.returncode}): "
                           f"{shlex.join(cmd)}\n{proc.stderr}{proc.stdout}")
    os.replace(tmp, out)
    return out


def load() -> ctypes.CDLL:
    """The stand-in library (built if needed), with argtypes/restypes set; one per process."""
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(path())
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = c_int, argtypes
            for name, (restype, argtypes) in _INTROSPECTION.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = lib
        return _lib


# ------------------------------------------------------------------ helpers for tests
def error_name(code: int) -> str:
    name = c_char_p()
    if load().cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return "unknown CUresult"
    return name.value.decode()


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CudaStandinError(what, code)


def make_current(ordinal: int = 0) -> int:
    """cuInit, retain device `ordinal`'s primary context and make it current on the calling
    thread (cuCtxSetCurrent). Returns the context handle. Each call retains once more."""
    lib = load()
    _check(lib.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value


def stream_create(flags: int = 1) -> int:
    """A new stream of the calling thread's current context (flags 1: CU_STREAM_NON_BLOCKING)."""
    h = c_void_p()
    _check(load().cuStreamCreate(ctypes.byref(h), flags), "cuStreamCreate")
    return h.value


def stream_synchronize(h: int) -> None:
    _check(load().cuStreamSynchronize(h), "cuStreamSynchronize")


def stream_destroy(h: int) -> None:
    _check(load().cuStreamDestroy_v2(h), "cuStreamDestroy_v2")


def primary_ctx_refcount(ordinal: int = 0) -> int:
    return load().standin_primary_ctx_refcount(ordinal)


def current_ctx() -> int:
    """The calling thread's current context handle, 0 if none."""
    return load().standin_current_ctx() or 0


def live_streams() -> int:
    return load().standin_live_streams()


def calls(name: str) -> int:
    """How many times entry point `name` was called since load (or reset_counters); -1 if the
    stand-in has no such entry point."""
    return load().standin_calls(name.encode())


def pinned_live() -> int:
    return load().standin_pinned_live()


def device_live() -> int:
    """Blocks from cuMemAllocAsync not yet passed to cuMemFreeAsync."""
    return load().standin_device_live()


def sync_waits() -> int:
    return load().standin_sync_waits()


def blocked_streams() -> int:
    return load().standin_blocked_streams()


def reset_counters() -> None:
    load().standin_reset_counters()


class HostBackedArray:
    """A "device array" for the stand-in: ``__cuda_array_interface__`` (version 3) pointing at a
    C-contiguous numpy array's memory, which this object keeps alive. ``get()`` copies it out."""

    def __init__(self, array: np.ndarray):
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise ValueError("HostBackedArray needs a C-contiguous numpy array")
        self._array = array

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._array
        return {"version": 3, "shape": a.shape, "typestr": a.dtype.str,
                "data": (a.ctypes.data, not a.flags.writeable), "strides": None, "stream": None}

    @property
    def shape(self) -> tuple:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def ptr(self) -> int:
        return self._array.ctypes.data

    def get(self) -> np.ndarray:
        return self._array.copy()

    def __repr__(self) -> str:
        return f"HostBackedArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"


NcclLaunch = collections.namedtuple("NcclLaunch", (
    "coll", "count", "dtype", "op", "root", "peer", "min_ctas", "max_ctas", "nranks", "rank",
    "comm", "stream", "grouped", "group"))
NcclLaunch.__doc__ = """One NCCL launch the stand-in recorded (at the call): ``coll`` ("AllReduce",
"Broadcast", "Reduce", "AllGather", "ReduceScatter", "Send", "Recv"), ``count`` (elements),
``dtype`` (numpy name), ``op`` ("sum", ..., or None), ``root`` and ``peer`` (or None),
``min_ctas`` and ``max_ctas`` (the communicator's config; None: unset), ``nranks``, ``rank``,
``comm`` (an id unique in the process), ``stream`` (the handle), ``grouped`` (inside a group),
``group`` (the serial number, from 1, of the outermost ncclGroupStart/End it was issued in: one
per group in the process; 0 outside a group)."""


_NCCL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
                "float64", "bfloat16")
_NCCL_OPS = ("sum", "prod", "max", "min", "avg")
_UNSET = -(1 << 31)


def nccl_launches() -> list[NcclLaunch]:
    """Every NCCL launch recorded since load (or :func:`reset_nccl_launches`), in call order."""
    lib = load()
    out = []
    coll = ctypes.create_string_buffer(16)
    vals = (c_long * 13)()
    for i in range(lib.standin_nccl_launch_count()):
        if lib.standin_nccl_launch_get(i, coll, vals) != 0:
            break
        v = list(vals)
        out.append(NcclLaunch(*(
            coll.value.decode(), v[0], _NCCL_DTYPES[v[1]], _NCCL_OPS[v[2]] if v[2] >= 0 else None,
            v[3] if v[3] >= 0 else None, v[4] if v[4] >= 0 else None,
            None if v[5] == _UNSET else v[5], None if v[6] == _UNSET else v[6],
            v[7], v[8], v[9], v[10] & ((1 << 64) - 1), bool(v[11]), v[12])))
    return out


def reset_nccl_launches() -> None:
    load().standin_nccl_reset()


def nccl_stall(on: bool = True) -> None:
    """While on, nonblocking NCCL communicators that would settle stay ncclInProgress (a peer
    that never joins): creations, splits and operations."""
    load().standin_nccl_stall(1 if on else 0)


def driver_lock(on: bool = True) -> None:
    """Model CUDA's driver lock (also ``AL_STANDIN_DRIVER_LOCK=1``): a thread inside a
    synchronizing call (cuCtxSynchronize, pinned alloc/free, cuMemcpy) holds it while it waits
    for the device, and every call on streams, events or memory (NCCL launches too) waits for
    it. A call that waits for it while its thread holds the GIL is reported on stderr and
    counted (:func:`driver_lock_violations`): the rule every device call of aluminum_py follows
    is to release the GIL, since the device the other thread waits for may wait for a thread
    that needs the GIL."""
    load().standin_driver_lock(1 if on else 0)


def driver_lock_held() -> bool:
    """True while a synchronizing call holds the driver lock (lock mode on)."""
    return bool(load().standin_driver_lock_held())


def driver_lock_violations() -> tuple[int, str]:
    """(calls reported since load or :func:`reset_counters`, the first one's message)."""
    lib = load()
    buf = ctypes.create_string_buffer(320)
    lib.standin_driver_lock_report(buf, len(buf))
    return lib.standin_driver_lock_violations(), buf.value.decode()


@contextlib.contextmanager
def no_driver_lock_violations():
    """Raise AssertionError if a device call was reported by the driver lock (see
    :func:`driver_lock`) while the block ran: the check the stand-in test suites make around
    every test."""
    before = driver_lock_violations()[0]
    yield
    after, message = driver_lock_violations()
    if after != before:
        raise AssertionError(f"{after - before} device call(s) held the GIL while another "
                             f"thread waited in the driver; the first reported: {message}")


def driver_lock_waits() -> int:
    """The calls that found the driver lock held and waited for it (lock mode on), since load or
    :func:`reset_counters`."""
    return load().standin_driver_lock_waits()


def stream_hold(h: int, lock_waits: int, guard: float = 60.0) -> None:
    """Enqueue on stream `h` a command that keeps it busy (a long kernel) until
    :func:`driver_lock_waits` reaches `lock_waits`: a thread synchronizing on it holds the
    driver lock until the calls a test makes meanwhile have waited for that lock, whatever the
    machine's speed.  `guard` seconds end it all the same (a hang guard)."""
    _check(load().standin_stream_hold(h, lock_waits, guard), "standin_stream_hold")


def main() -> int:
    """Build the stand-in if needed and print its path (one line, nothing else)."""
    try:
        print(path())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
