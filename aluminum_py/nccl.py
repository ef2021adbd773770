"""NCCL for aluminum_py: finding and loading the library, and the Python layer over the thin
binding (`_nccl`): dtype and op names, one error check, communicators on raw device pointers and
stream handles. Where the library is looked for and how to use it: docs/gpu.md ("The low-level
aluminum_py.nccl module"). The GPU backend's NCCL rules are in :mod:`aluminum_py.backends.nccl_rules`.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading

from . import config
from .errors import NcclError, TimeoutError, UnavailableError

try:
    from . import _nccl
except ImportError:     # pragma: no cover - the extension is always built
    _nccl = None

# NCCL enums (nccl.h)
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
          "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
           3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
           6: "ncclRemoteError", 7: "ncclInProgress"}
SUCCESS, UNHANDLED_CUDA_ERROR, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS = 0, 1, 4, 5, 7

_state = {"path": None, "error": None, "tried": False}


def cuda_standin_nccl() -> str | None:
    """``AL_CUDA_LIBRARY`` when it names the CUDA stand-in (:mod:`aluminum_py.testing.cuda_standin`,
    recognised by its exports), which carries the NCCL stand-in too: a real NCCL cannot run on
    the stand-in's devices, so with ``AL_NCCL_LIBRARY`` unset this is NCCL's only candidate."""
    path = config.cuda_library()
    if not path or not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    return path if hasattr(lib, "standin_nccl_launch_count") else None


def _explicit() -> str | None:
    """The library asked for: ``AL_NCCL_LIBRARY``, else the NCCL stand-in of ``AL_CUDA_LIBRARY``."""
    return config.nccl_library() or cuda_standin_nccl()


def candidates() -> list[str]:
    """Where the library is looked for, in order: ``AL_NCCL_LIBRARY``; else, when
    ``AL_CUDA_LIBRARY`` is the CUDA stand-in, the NCCL stand-in in it and nothing else; the
    ``nvidia-nccl-cu12`` wheel's; ``libnccl.so.2`` on the loader's path."""
    paths = []
    env = config.nccl_library()
    if env:
        paths.append(env)
    else:
        standin = cuda_standin_nccl()
        if standin:
            return [standin]
    try:
        import nvidia.nccl
        for base in nvidia.nccl.__path__:
            paths.append(os.path.join(base, "lib", "libnccl.so.2"))
    except ImportError:
        pass
    paths.append("libnccl.so.2")
    return paths


def _check(code: int, comm: int, what: str) -> None:
    """Raise NcclError for a failed call (called by the binding)."""
    text = _nccl.error_string(code)
    last = _nccl.last_error(comm)
    name = RESULTS.get(code, f"ncclResult {code}")
    msg = f"{what} failed: {name}: {text}"
    if last:
        msg += f" ({last})"
    raise NcclError(msg, code)


def _load() -> None:
    if _state["tried"]:
        return
    _state["tried"] = True
    errors = []
    env = _explicit()
    for path in candidates():
        if path != "libnccl.so.2" and not os.path.exists(path):
            errors.append(f"{path}: not found")
            if path == env:
                break       # an explicit path that does not exist is an error, not a hint
            continue
        err = _nccl.load(path, _check)
        if err is None:
            _state["path"] = path
            return
        errors.append(f"{path}: {err}")
        if path == env:
            break
    _state["error"] = "; ".join(errors)


def available() -> bool:
    """True if libnccl.so.2 could be loaded (a GPU is not needed for this)."""
    _load()
    return _state["path"] is not None


def library_path() -> str | None:
    _load()
    return _state["path"]


def _need() -> None:
    if not available():
        raise UnavailableError(f"NCCL is not available: could not load libnccl.so.2 "
                               f"({_state['error']}); pip install nvidia-nccl-cu12 or set "
                               f"AL_NCCL_LIBRARY")


def _not_forked(what: str) -> None:
    """Raise aluminum_py.Error in a child process made by os.fork(): NCCL (and CUDA under it)
    cannot be used there, and the library refuses before any NCCL call, as it does for MPI."""
    from . import _core
    _core.check_not_forked(what)


def get_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded NCCL."""
    _need()
    code = _nccl.get_version()
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def get_unique_id() -> bytes:
    """A new 128-byte unique id (on one rank; broadcast it to the others)."""
    _need()
    return _nccl.get_unique_id()


def _dtype(dtype) -> int:
    import numpy as np
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise TypeError(f"dtype: {name} is not an NCCL datatype (NCCL has {', '.join(DTYPES)})")
    return DTYPES[name]


def _op(op) -> int:
    name = getattr(op, "name", op)
    key = str(name).lower()
    if key not in OPS:
        raise TypeError(f"op: {name} is not an NCCL reduction (NCCL has {', '.join(OPS)})")
    return OPS[key]


MAX_CHANNELS = 64      # NCCL's MAXCHANNELS: it caps minCTAs/maxCTAs there


def _config(min_ctas, max_ctas, cga_cluster_size, blocking) -> dict:
    """The communicator config, checked as NCCL 2.18+ checks ncclConfig_t. NCCL rejects a
    minCTAs above maxCTAs, and an unset maxCTAs counts as below any minCTAs: with only
    `min_ctas` given, `max_ctas` is set to max(min_ctas, MAX_CHANNELS) (NCCL's own cap)."""
    for name, v in (("min_ctas", min_ctas), ("max_ctas", max_ctas)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if min_ctas is not None and max_ctas is not None and min_ctas > max_ctas:
        raise ValueError(f"min_ctas ({min_ctas}) is larger than max_ctas ({max_ctas})")
    if min_ctas is not None and max_ctas is None:
        max_ctas = max(min_ctas, MAX_CHANNELS)
    if cga_cluster_size is not None and (isinstance(cga_cluster_size, bool)
                                         or not isinstance(cga_cluster_size, int)
                                         or cga_cluster_size < 0):
        raise ValueError(f"cga_cluster_size: expected an int >= 0, got {cga_cluster_size!r}")
    return {"min_ctas": min_ctas, "max_ctas": max_ctas, "cga_cluster_size": cga_cluster_size,
            "blocking": blocking}


_group = threading.local()      # per thread, as NCCL's groups: depth, nonblocking comms used


def settle(handle: int, what: str, timeout: float | None = None) -> None:
    """After `what` answered ncclInProgress on a nonblocking communicator: poll its state
    (ncclCommGetAsyncError, without the GIL) until it is no longer ncclInProgress, at most
    `timeout` seconds (default AL_HANG_TIMEOUT, 1800 s unless set; 0: no limit).

    Raises:
        TimeoutError: still in progress after `timeout` (the communicator is left as it is;
            abort it to give up).
        NcclError: the state became an error.
    """
    _need()
    if timeout is None:
        timeout = config.hang_timeout()
    state = _nccl.comm_wait(handle, -1.0 if timeout is None else float(timeout))
    if state == IN_PROGRESS:
        raise TimeoutError(f"{what}: the nonblocking NCCL communicator is still in progress "
                           f"after {timeout:g} s (AL_HANG_TIMEOUT; a peer that never joined?)")
    if state != SUCCESS:
        _check(state, handle, what)


class NcclComm:
    """An NCCL communicator (ncclCommInitRankConfig). Collective over the `nranks` processes.

    Args:
        nranks, unique_id, rank: as ncclCommInitRank (unique_id: 128 bytes from get_unique_id).
        min_ctas, max_ctas: ncclConfig_t.minCTAs / maxCTAs (NCCL >= 2.17): bounds on the
            thread blocks (CTAs) each collective uses; threads = CTAs * NCCL_NTHREADS.
        cga_cluster_size, blocking: ncclConfig_t.cgaClusterSize / blocking. With
            ``blocking=False`` NCCL may answer ncclInProgress; every call here then waits
            (without the GIL, at most AL_HANG_TIMEOUT) until the communicator's state is no
            longer ncclInProgress, as NCCL requires before the next call (see :func:`settle`).
    Raises:
        NcclError: NCCL failed (without a GPU: ncclUnhandledCudaError with NCCL's CUDA text).
        TimeoutError: a nonblocking communicator stayed in progress past AL_HANG_TIMEOUT.
    """

    def __init__(self, nranks: int, unique_id: bytes, rank: int, *, min_ctas=None, max_ctas=None,
                 cga_cluster_size=None, blocking=None):
        _not_forked("ncclCommInitRankConfig")
        _need()
        if not isinstance(unique_id, (bytes, bytearray)):
            raise TypeError(f"unique_id: expected 128 bytes, got {type(unique_id).__name__}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank: {rank} is out of range for {nranks} ranks")
        self.config = _config(min_ctas, max_ctas, cga_cluster_size, blocking)
        self.handle = 0
        handle, rc = _nccl.comm_init_rank(nranks, bytes(unique_id), rank, **_native(self.config))
        self.handle = _created(handle, rc, "ncclCommInitRankConfig")

    @classmethod
    def _from_handle(cls, handle: int, config: dict | None = None) -> "NcclComm":
        self = cls.__new__(cls)
        self.handle = handle
        self.config = config or _config(None, None, None, None)
        return self

    def __repr__(self) -> str:
        return f"<aluminum_py.nccl.NcclComm handle=0x{self.handle:x} config={self.config}>"

    def _h(self) -> int:
        _not_forked("NCCL communicator")
        if self.handle == 0 and not getattr(self, "_allow_null", False):
            raise NcclError("the NCCL communicator has been destroyed", INVALID_USAGE)
        return self.handle

    def split(self, color: int, key: int, *, min_ctas=None, max_ctas=None, cga_cluster_size=None,
              blocking=None) -> "NcclComm":
        """ncclCommSplit with its own config (e.g. another max_ctas). Collective.

        With a nonblocking parent, NCCL completes the split on its own thread and writes the
        new communicator only then; this waits for that (the parent's state leaves
        ncclInProgress, at most AL_HANG_TIMEOUT). ncclCommSplit answers ncclSuccess even then
        (NCCL 2.28 returns its own result, not the group's), so the parent's state is polled
        whatever the call returned."""
        cfg = _config(min_ctas, max_ctas, cga_cluster_size, blocking)
        slot, rc = _nccl.comm_split(self._h(), color, key, **_native(cfg))
        settle(self.handle, "ncclCommSplit")       # a timeout leaks the slot: NCCL may write it
        handle = _nccl.split_result(slot)
        if handle == 0:                            # the slot was left (not freed): see split_result
            raise NcclError("ncclCommSplit returned no communicator", INVALID_USAGE)
        state = _nccl.comm_async_error(handle)
        if state not in (SUCCESS, IN_PROGRESS):
            try:
                _check(state, handle, "ncclCommSplit")      # raises, with NCCL's last error
            finally:
                _nccl.comm_abort(handle)
        return NcclComm._from_handle(_created(handle, state, "ncclCommSplit"), cfg)

    def _done(self, rc: int, what: str) -> None:
        """After a call on this communicator: inside a group, NCCL reports the nonblocking
        state at ncclGroupEnd, so remember the communicator; else settle ncclInProgress."""
        if getattr(_group, "depth", 0) > 0:
            _group.comms.append(self.handle)
        elif rc == IN_PROGRESS:
            settle(self.handle, what)

    @property
    def count(self) -> int:
        return _nccl.comm_count(self._h())

    @property
    def user_rank(self) -> int:
        return _nccl.comm_user_rank(self._h())

    @property
    def device(self) -> int:
        return _nccl.comm_cu_device(self._h())

    def async_error(self) -> int:
        """ncclCommGetAsyncError: 0, ncclInProgress (7), or an error code."""
        return _nccl.comm_async_error(self._h())

    def check_async_error(self) -> None:
        code = self.async_error()
        if code not in (SUCCESS, IN_PROGRESS):
            _check(code, self.handle, "asynchronous NCCL operation")

    # collectives: device pointers and stream handles as ints; counts in elements
    def allreduce(self, send: int, recv: int, count: int, dtype, op, stream: int) -> None:
        self._done(_nccl.allreduce(send, recv, count, _dtype(dtype), _op(op), self._h(), stream), "ncclAllReduce")

    def broadcast(self, send: int, recv: int, count: int, dtype, root: int, stream: int) -> None:
        self._done(_nccl.broadcast(send, recv, count, _dtype(dtype), root, self._h(), stream), "ncclBroadcast")

    def reduce(self, send: int, recv: int, count: int, dtype, op, root: int, stream: int) -> None:
        self._done(_nccl.reduce(send, recv, count, _dtype(dtype), _op(op), root, self._h(), stream), "ncclReduce")

    def allgather(self, send: int, recv: int, sendcount: int, dtype, stream: int) -> None:
        self._done(_nccl.allgather(send, recv, sendcount, _dtype(dtype), self._h(), stream), "ncclAllGather")

    def reduce_scatter(self, send: int, recv: int, recvcount: int, dtype, op, stream: int) -> None:
        self._done(_nccl.reduce_scatter(send, recv, recvcount, _dtype(dtype), _op(op), self._h(), stream), "ncclReduceScatter")

    def send(self, buf: int, count: int, dtype, peer: int, stream: int) -> None:
        self._done(_nccl.send(buf, count, _dtype(dtype), peer, self._h(), stream), "ncclSend")

    def recv(self, buf: int, count: int, dtype, peer: int, stream: int) -> None:
        self._done(_nccl.recv(buf, count, _dtype(dtype), peer, self._h(), stream), "ncclRecv")

    def finalize(self) -> None:
        """ncclCommFinalize: flush the issued operations (a nonblocking communicator: waits
        for that, at most AL_HANG_TIMEOUT)."""
        self._done(_nccl.comm_finalize(self._h()), "ncclCommFinalize")

    def destroy(self) -> None:
        """ncclCommDestroy (after finalize, or to free an idle communicator). Idempotent."""
        if self.handle:
            h, self.handle = self.handle, 0
            _nccl.comm_destroy(h)

    def abort(self) -> None:
        """ncclCommAbort: stop outstanding operations and free the communicator. Idempotent."""
        if self.handle:
            h, self.handle = self.handle, 0
            _nccl.comm_abort(h)


def _native(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items()}


def _created(handle: int, rc: int, what: str) -> int:
    """A new communicator's handle once it is ready: ncclInProgress (nonblocking) is settled;
    if that fails the half-made communicator is aborted, as NCCL asks, and the error raised."""
    if rc == IN_PROGRESS:
        try:
            settle(handle, what)
        except BaseException:               # KeyboardInterrupt too: the creation is given up
            _nccl.comm_abort(handle)
            raise
    return handle


def group_start() -> None:
    _not_forked("ncclGroupStart")
    _need()
    _nccl.group_start()
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.comms = []


def group_end() -> None:
    """ncclGroupEnd; when it answers ncclInProgress (nonblocking communicators in the group),
    settle every communicator used in the outermost group."""
    _need()
    depth = getattr(_group, "depth", 0)
    _group.depth = max(0, depth - 1)
    rc = _nccl.group_end()
    if depth == 1:
        comms, _group.comms = _group.comms, []
        if rc == IN_PROGRESS:
            for h in dict.fromkeys(comms):
                settle(h, "ncclGroupEnd")


@contextlib.contextmanager
def group():
    """``with nccl.group(): ...`` fuses the NCCL calls inside (ncclGroupStart / ncclGroupEnd)."""
    group_start()
    try:
        yield
    finally:
        group_end()
