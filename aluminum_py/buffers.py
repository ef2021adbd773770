"""Host buffer normalisation: a user's buffer argument (a numpy array or a C-contiguous
buffer-protocol object) as a C-contiguous numpy view, or a clear TypeError/ValueError naming the
argument; and the argument checks every host op shares (dtypes, lengths, overlap, counts).
A GPU buffer given where a host buffer is expected is refused here."""
from __future__ import annotations

import numpy as np

from . import _core
from .errors import UnavailableError
from .gpu import cuda_device_count, is_gpu_buffer
from .ops import DTYPE_CODES

_ndarray = np.ndarray


def as_array(obj, name: str, writable: bool = False) -> np.ndarray:
    """View `obj` as a C-contiguous numpy array; `name` is used in error messages."""
    if type(obj) is not _ndarray:
        if obj is None:
            raise TypeError(f"{name}: expected a numpy array or buffer, got None")
        if is_gpu_buffer(obj):
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


MAX_COUNT = 2**31 - 1        # elements per operation (MPI's int count)


def check_count(n: int, name: str) -> int:
    """`n` if it is at most MAX_COUNT elements, else ValueError naming `name`."""
    if n > MAX_COUNT:
        raise ValueError(f"{name}: {n} elements exceeds the limit of 2**31-1 per operation")
    return n


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
