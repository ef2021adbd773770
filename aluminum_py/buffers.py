"""Host buffer normalisation: a user's buffer argument (a numpy array or a C-contiguous
buffer-protocol object) as a C-contiguous numpy view, or a clear TypeError/ValueError naming the
argument; and the argument checks every host op shares (dtypes, lengths, overlap, counts).
A GPU buffer given where a host buffer is expected is refused here."""
from __future__ import annotations

import operator

import numpy as np

from . import _core
from .errors import UnavailableError
from .gpu import cuda_device_count, is_gpu_buffer
from .ops import DTYPE_CODES, known_dtype, supported_dtypes

_ndarray = np.ndarray


def as_array(obj, name: str, writable: bool = False) -> np.ndarray:
    """View `obj` as a C-contiguous numpy array; `name` is used in error messages."""
    if type(obj) is not _ndarray:
        if obj is None:
            raise TypeError(f"{name}: expected a numpy array or buffer, got None")
        if type(obj) in _MPI_CONSTANTS:
            not_data(obj, name)
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
    if not known_dtype(arr.dtype):
        raise TypeError(f"{name}: dtype {arr.dtype} is not supported (supported: "
                        f"{', '.join(supported_dtypes())})")
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


# ---- v-collectives (Allgatherv, Gatherv, Scatterv, Alltoallv, Reduce_scatter with counts):
# mpi4py's message forms, buf / [buf, counts] / [buf, counts, displs] / [buf, (counts, displs)],
# split here, and the per-rank counts and displacements checked once for every backend.

_LAYOUT_TYPES = (list, tuple, _ndarray)   # what counts and displs usually are


def vspec(spec, name: str, counts=None, displs=None):
    """Split a v-message argument into (buf, counts, displs), either None where not given.
    `counts` / `displs`: the call's keywords (recvcounts=, displs=, ...), which may not be given
    together with the same part inside the list form."""
    split = _core.vsplit(spec, counts, displs)      # the usual forms, natively
    if split is not None:
        return split
    if not 1 <= len(spec) <= 3:
        raise TypeError(f"{name}: expected buf, [buf, counts] or [buf, counts, displs], got "
                        f"a {type(spec).__name__} of {len(spec)} items")
    buf, c, d = (list(spec) + [None, None])[:3]
    if len(spec) == 2 and isinstance(c, tuple) and len(c) == 2 and (
            type(c[0]) in _LAYOUT_TYPES or not _is_int(c[0])):
        c, d = c                                    # [buf, (counts, displs)]
    if c is not None and counts is not None:
        raise TypeError(f"{name}: counts given twice (in the list and as a keyword)")
    if d is not None and displs is not None:
        raise TypeError(f"{name}: displacements given twice (in the list and as a keyword)")
    counts = c if c is not None else counts
    displs = d if d is not None else displs
    return buf, counts, displs


def _is_int(v) -> bool:
    try:
        operator.index(v)
        return True
    except TypeError:
        return False


def _int_list(values, name: str, size: int, what: str) -> list:
    """`values` as `size` Python ints of MPI's int range, else a clear error."""
    if type(values) is np.ndarray and values.ndim == 1:
        values = values.tolist()        # numpy ints as Python ints (a bool array stays bools)
    if (type(values) is list or type(values) is tuple) and len(values) == size:
        # the usual case, checked without a loop in Python: plain non-negative ints in range
        if all(type(v) is int for v in values) and (
                size == 0 or (min(values) >= 0 and max(values) <= MAX_COUNT)):
            return list(values)
    if isinstance(values, (str, bytes)) or values is None:
        raise TypeError(f"{name}: expected a sequence of {size} int {what}, got "
                        f"{type(values).__name__}")
    try:
        seq = list(values)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {size} int {what}, got "
                        f"{type(values).__name__}") from None
    if len(seq) != size:
        raise ValueError(f"{name}: {len(seq)} {what} given, one per rank needed ({size})")
    out = []
    for i, v in enumerate(seq):
        if isinstance(v, (bool, np.bool_)) or not _is_int(v):
            raise TypeError(f"{name}: {what} of rank {i} is {v!r}, not an int")
        v = operator.index(v)
        if v < 0:
            raise ValueError(f"{name}: {what} of rank {i} is negative ({v})")
        if v > MAX_COUNT:
            raise ValueError(f"{name}: {what} of rank {i} ({v}) exceeds 2**31-1")
        out.append(v)
    return out


def vlayout(counts, displs, size: int, name: str, elems: int):
    """Checked per-rank (counts, displs) of a v-message over a buffer of `elems` elements, as two
    int32 arrays of `size` entries. `displs` None: the blocks packed in rank order (the exclusive
    prefix sum of counts). Every block must lie inside the buffer; blocks may not overlap where
    they are written (`elems` is the buffer's length; use vno_overlap for a receive side).
    Lists of plain ints (the common case) are checked in C (_core.vlayout_common); anything else,
    and every error, here (Python lists, not numpy: for a few ranks numpy's per-call cost
    dominates)."""
    common = _core.vlayout_common(counts, displs, size, elems)
    if common is not None:
        return common
    c = _int_list(counts, f"{name} counts", size, "counts")
    if displs is None:
        d, at = [], 0
        for n in c:
            d.append(at)
            at += n
        if at > MAX_COUNT and size:
            raise ValueError(f"{name} counts: their sum ({at}) exceeds 2**31-1")
    else:
        d = _int_list(displs, f"{name} displs", size, "displacement")
    if size:
        ends = [x + n for x, n in zip(d, c)]
        end = max(ends)
        if end > elems:
            worst = ends.index(end)
            raise ValueError(f"{name}: the block of rank {worst} (displacement {d[worst]}, "
                             f"count {c[worst]}) ends at element {end}, past the buffer's "
                             f"{elems} elements")
    return np.array(c, dtype=np.int32), np.array(d, dtype=np.int32)


def vno_overlap(counts: np.ndarray, displs: np.ndarray, name: str) -> None:
    """Raise if two non-empty blocks of a receive layout overlap (each element is written once).
    `counts`, `displs`: vlayout's int32 arrays."""
    if _core.vblocks_in_order(counts, displs):
        return
    c, d = counts.tolist(), displs.tolist()
    end, prev = -1, -1
    for i in sorted(range(len(c)), key=d.__getitem__):      # stable: ties in rank order
        if c[i] == 0:
            continue
        if d[i] < end:
            raise ValueError(f"{name}: the blocks of ranks {prev} and {i} overlap (a "
                             f"receive layout writes each element once)")
        if d[i] + c[i] > end:
            end, prev = d[i] + c[i], i


def vself_counts(sendcounts, recvcounts, rank: int) -> None:
    """Raise unless this rank's block to itself has one size on both sides of an Alltoallv
    (sendcounts[rank] == recvcounts[rank]: MPI requires it; a mismatch would truncate)."""
    s, r = int(sendcounts[rank]), int(recvcounts[rank])
    if s != r:
        raise ValueError(f"sendbuf counts: sendcounts[{rank}] is {s} but recvcounts[{rank}] is "
                         f"{r}: what a rank sends itself must be what it receives from itself")


def not_data(constant, name: str) -> None:
    """Raise the TypeError of an mpi4py constant given as the buffer `name`: MPI.BOTTOM and
    MPI.BUFFER_AUTOMATIC expose an empty buffer, and MPI.IN_PLACE marks the in-place form only
    where the call has one (read by the parser, msgbuffer.pxi's in_place_form): none of them is
    ever read as data."""
    label = _MPI_CONSTANTS[type(constant)]
    if label == "IN_PLACE":
        raise TypeError(f"{name}: MPI.IN_PLACE marks an in-place form, which this call does not "
                        f"take here: it goes in sendbuf (Allreduce, Reduce and Gather at the "
                        f"root, Reduce_scatter, Allgather, Alltoall, Scan, Exscan and the "
                        f"v-forms) or in recvbuf (Scatter and Scatterv at the root)")
    raise TypeError(f"{name}: MPI.{label} is not a buffer (aluminum_py takes numpy arrays and "
                    f"buffer-protocol objects, not MPI addresses or datatypes)")


def unless_in_place(buf):
    """None for an in-place marker (None or MPI.IN_PLACE), else `buf`: how the Communicator's
    v-collectives pass "in place" on to a backend."""
    if buf is None or buf is _IN_PLACE:
        return None
    return buf


from mpi4py import MPI as _MPI  # noqa: E402  (mpi4py is loaded: _core needs it)

_IN_PLACE = _MPI.IN_PLACE
# mpi4py's constants that expose a (zero-length) buffer, by type: never data
_MPI_CONSTANTS = {type(getattr(_MPI, n)): n for n in ("IN_PLACE", "BOTTOM", "BUFFER_AUTOMATIC")
                  if hasattr(_MPI, n)}


def vsame_count(arr: np.ndarray, n: int, name: str, what: str) -> None:
    """Raise unless `arr` holds exactly `n` elements, the count `what` gives for it (a rank's
    own message must match its own block of the layout, as MPI requires)."""
    if arr.size != n:
        raise ValueError(f"{name}: {arr.size} elements, but {what} is {n}; they must be equal")


def not_vlayout(values, name: str, size: int) -> None:
    """The native v-collective entries take what vlayout returns; anything else is refused."""
    raise TypeError(f"{name}: expected an int32 array of {size} entries from buffers.vlayout, "
                    f"got {type(values).__name__}")
