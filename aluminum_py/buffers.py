"""One buffer-normalisation path for every op.

A user's buffer argument becomes a C-contiguous numpy array view (no copy) plus its dtype code,
or a clear TypeError/ValueError naming the argument.  Accepted: numpy arrays and any
C-contiguous buffer-protocol object (bytearray, memoryview, array.array, ...).  GPU arrays
(``__cuda_array_interface__`` or a CUDA DLPack capsule) are recognised and rejected with
:class:`UnavailableError` until a GPU backend handles them.
"""
from __future__ import annotations

import numpy as np

from . import _core
from .errors import UnavailableError
from .ops import DTYPE_CODES

_ndarray = np.ndarray
CUDA_DLPACK_DEVICES = {2, 3, 13}   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def dlpack_device_type(obj) -> int | None:
    """The DLDeviceType of a DLPack producer (``__dlpack_device__()[0]``), else None."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or isinstance(obj, _ndarray):
        return None
    try:
        return int(dev()[0])
    except Exception:
        return None


def is_gpu_buffer(obj) -> bool:
    """An object with __cuda_array_interface__, or a DLPack producer on a CUDA device (DLPack
    producers on the CPU, such as PyTorch CPU tensors, are host buffers)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    return dlpack_device_type(obj) in CUDA_DLPACK_DEVICES


def as_array(obj, name: str, writable: bool = False) -> np.ndarray:
    """View `obj` as a C-contiguous numpy array; `name` is used in error messages."""
    if type(obj) is not _ndarray:
        if obj is None:
            raise TypeError(f"{name}: expected a numpy array or buffer, got None")
        if is_gpu_buffer(obj):
            from .gpu import cuda_device_count
            if cuda_device_count() == 0:
                raise UnavailableError(f"{name} is a GPU buffer: no CUDA device is available")
            raise TypeError(f"{name} is a GPU buffer but the other buffer is a host buffer; "
                            f"pass GPU buffers for both")
        if isinstance(obj, _ndarray):
            arr = obj
        else:
            try:
                mv = memoryview(obj)
            except TypeError:
                raise TypeError(f"{name}: expected a numpy array or a buffer-protocol object, got "
                                f"{type(obj).__name__}") from None
            if not mv.c_contiguous:
                raise ValueError(f"{name} is not C-contiguous")
            try:
                arr = np.asarray(mv)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{name}: buffer format {mv.format!r} is not numeric ({e})") from None
    else:
        arr = obj
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous (pass np.ascontiguousarray({name}))")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but is written by this operation")
    if arr.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: dtype {arr.dtype} is not supported (supported: "
                        f"{', '.join(str(d) for d in DTYPE_CODES)})")
    return arr


def dtype_code(arr: np.ndarray) -> int:
    return DTYPE_CODES[arr.dtype][0]


def addr(arr: np.ndarray) -> int:
    return _core.addr(arr)


def same_dtype(a: np.ndarray, b: np.ndarray, aname: str, bname: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{bname} has dtype {b.dtype} but {aname} has dtype {a.dtype}")


def at_least(arr: np.ndarray, n: int, name: str, what: str) -> None:
    if arr.size < n:
        raise ValueError(f"{name} is too short: {arr.size} elements, needs {n} ({what})")


def no_partial_overlap(a: np.ndarray, b: np.ndarray, aname: str, bname: str) -> bool:
    """True if a and b are the same memory (in place); raise if they overlap otherwise."""
    if a.size and b.size and _core.addr(a) == _core.addr(b):
        return True
    if np.may_share_memory(a, b):
        raise ValueError(f"{aname} and {bname} overlap; pass recvbuf=None for an in-place operation")
    return False


def no_overlap(a: np.ndarray, b: np.ndarray, aname: str, bname: str,
               hint: str = "pass recvbuf=None for an in-place operation") -> None:
    """Raise if a and b share any memory, the same start included: for ops (gather-like,
    Sendrecv) where MPI forbids aliased buffers and in place is only ever recvbuf=None."""
    if a.size and b.size and np.may_share_memory(a, b):
        raise ValueError(f"{aname} and {bname} overlap; {hint}")
