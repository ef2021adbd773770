"""Bad arguments raise on the calling rank, before any communication, with the argument's name
at the start of the message: TypeError / ValueError, or aluminum_py.UnavailableError for GPU
buffers and streams.  Nothing the call was given is written.  Each case runs in the blocking and
the I-prefixed form; a second pass runs the cases on only some ranks (so a call that had started
communicating would break what follows); afterwards the communicator still computes correctly.

The bad calls go to their own Communicator, so a missing check cannot disturb other modules."""
import builtins
import os

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import config
from conftest import all_ranks_ok

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def hang_timeout():
    """If a check is missing, the rank that went on to communicate (its peers raised) gets an
    aluminum_py.TimeoutError instead of hanging the whole run."""
    old = os.environ.get("AL_HANG_TIMEOUT")
    os.environ["AL_HANG_TIMEOUT"] = "20"
    config.reload()
    yield
    if old is None:
        del os.environ["AL_HANG_TIMEOUT"]
    else:
        os.environ["AL_HANG_TIMEOUT"] = old
    config.reload()


@pytest.fixture(scope="module")
def bad():
    c = al.Communicator()
    yield c
    c.Free()


def f32(n):
    return np.arange(n, dtype=np.float32) + 1


def f64(n):
    return np.arange(n, dtype=np.float64) + 1


def i32(n):
    return np.arange(n, dtype=np.int32) + 1


def c64(n):
    return (np.arange(n) + 1j).astype(np.complex64)


def ro(a):
    a.flags.writeable = False
    return a


def strided(n, dtype=np.float32):
    return (np.arange(2 * n) + 1).astype(dtype)[::2]


class FakeGPUArray:
    """Looks like a CuPy array (no GPU backend in this build)."""
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


def named(arg):
    """Messages start with the argument's name ("recvbuf is too short", "root: ...")."""
    return rf"^{arg}\b"


OVERLAP = r"^sendbuf and recvbuf overlap"
# a negative dest/source that is none of MPI's special ranks (MPICH's PROC_NULL is -1)
BAD_RANK = next(v for v in (-1, -4, -7) if v not in (MPI.ANY_SOURCE, MPI.PROC_NULL, MPI.ROOT))

CASES = []


def case(name, exc, match, method, build, min_size=1):
    """build(p, r) -> (args, kwargs); min_size: communicator size the case needs (the check
    only exists there, e.g. a length not divisible by size)."""
    CASES.append(pytest.param(exc, match, method, build, min_size, id=name))


V, T, U = ValueError, TypeError, al.UnavailableError
nxt = lambda p, r: (r + 1) % p          # noqa: E731  a root that is not this rank (p > 1)

# --- output too short
case("allreduce-short-recvbuf", V, named("recvbuf"), "Allreduce", lambda p, r: ((f32(5), f32(4)), {}))
case("reduce-short-recvbuf", V, named("recvbuf"), "Reduce", lambda p, r: ((f32(5), f32(4)), {"root": r}))
case("reduce_scatter-short-recvbuf", V, named("recvbuf"), "Reduce_scatter",
     lambda p, r: ((f32(3 * p), f32(2)), {}))
case("allgather-short-recvbuf", V, named("recvbuf"), "Allgather", lambda p, r: ((f32(3), f32(3 * p - 1)), {}))
case("alltoall-short-recvbuf", V, named("recvbuf"), "Alltoall",
     lambda p, r: ((f32(3 * p), f32(3 * p - 1)), {}))
case("gather-short-recvbuf", V, named("recvbuf"), "Gather",
     lambda p, r: ((f32(3), f32(3 * p - 1)), {"root": r}))
case("scatter-short-recvbuf", V, named("recvbuf"), "Scatter",
     lambda p, r: ((f32(3 * p), f32(2)), {"root": r}))

# --- output of another dtype
case("allreduce-recvbuf-dtype", T, named("recvbuf"), "Allreduce", lambda p, r: ((f32(4), f64(4)), {}))
case("reduce-recvbuf-dtype", T, named("recvbuf"), "Reduce", lambda p, r: ((f32(4), i32(4)), {"root": r}))
case("reduce_scatter-recvbuf-dtype", T, named("recvbuf"), "Reduce_scatter",
     lambda p, r: ((f32(2 * p), f64(2)), {}))
case("allgather-recvbuf-dtype", T, named("recvbuf"), "Allgather", lambda p, r: ((f32(2), f64(2 * p)), {}))
case("alltoall-recvbuf-dtype", T, named("recvbuf"), "Alltoall", lambda p, r: ((f32(2 * p), i32(2 * p)), {}))
case("gather-recvbuf-dtype", T, named("recvbuf"), "Gather", lambda p, r: ((f32(2), f64(2 * p)), {"root": r}))
case("scatter-recvbuf-dtype", T, named("recvbuf"), "Scatter",
     lambda p, r: ((f32(2 * p), c64(2)), {"root": r}))
case("sendrecv-recvbuf-dtype", T, named("recvbuf"), "Sendrecv", lambda p, r: ((f32(2), r, f64(2), r), {}))

# --- read-only output (numpy flag, and bytes)
case("allreduce-ro-recvbuf", V, named("recvbuf"), "Allreduce", lambda p, r: ((f32(4), ro(f32(4))), {}))
case("allreduce-bytes-recvbuf", V, named("recvbuf"), "Allreduce",
     lambda p, r: ((np.zeros(4, np.uint8), bytes(4)), {}))
case("allreduce-inplace-ro", V, named("sendbuf"), "Allreduce", lambda p, r: ((ro(f32(4)),), {}))
case("allreduce-inplace-bytes", V, named("sendbuf"), "Allreduce", lambda p, r: ((bytes(4),), {}))
case("reduce-ro-recvbuf", V, named("recvbuf"), "Reduce", lambda p, r: ((f32(4), ro(f32(4))), {"root": r}))
case("reduce-bytes-recvbuf", V, named("recvbuf"), "Reduce",
     lambda p, r: ((np.zeros(4, np.uint8), bytes(4)), {"root": r}))
case("reduce-inplace-ro", V, named("sendbuf"), "Reduce", lambda p, r: ((ro(f32(4)), None), {"root": r}))
case("reduce_scatter-ro-recvbuf", V, named("recvbuf"), "Reduce_scatter",
     lambda p, r: ((f32(2 * p), ro(f32(2))), {}))
case("reduce_scatter-inplace-ro", V, named("sendbuf"), "Reduce_scatter", lambda p, r: ((ro(f32(2 * p)),), {}))
case("allgather-ro-recvbuf", V, named("recvbuf"), "Allgather", lambda p, r: ((f32(2), ro(f32(2 * p))), {}))
case("allgather-bytes-recvbuf", V, named("recvbuf"), "Allgather",
     lambda p, r: ((np.zeros(2, np.uint8), bytes(2 * p)), {}))
case("allgather-inplace-ro", V, named("sendbuf"), "Allgather", lambda p, r: ((ro(f32(2 * p)),), {}))
case("alltoall-ro-recvbuf", V, named("recvbuf"), "Alltoall", lambda p, r: ((f32(2 * p), ro(f32(2 * p))), {}))
case("alltoall-inplace-ro", V, named("sendbuf"), "Alltoall", lambda p, r: ((ro(f32(2 * p)),), {}))
case("gather-ro-recvbuf", V, named("recvbuf"), "Gather", lambda p, r: ((f32(2), ro(f32(2 * p))), {"root": r}))
case("gather-inplace-ro", V, named("sendbuf"), "Gather", lambda p, r: ((ro(f32(2 * p)), None), {"root": r}))
case("scatter-ro-recvbuf", V, named("recvbuf"), "Scatter",
     lambda p, r: ((f32(2 * p), ro(f32(2))), {"root": r}))
case("scatter-nonroot-bytes-recvbuf", V, named("recvbuf"), "Scatter",
     lambda p, r: ((None, bytes(2)), {"root": nxt(p, r)}), min_size=2)
case("bcast-nonroot-ro", V, named("buf"), "Bcast",
     lambda p, r: ((ro(f32(4)),), {"root": nxt(p, r)}), min_size=2)
case("recv-ro", V, named("buf"), "Recv", lambda p, r: ((ro(f32(4)), r), {}))
case("recv-bytes", V, named("buf"), "Recv", lambda p, r: ((bytes(4), r), {}))
case("sendrecv-ro-recvbuf", V, named("recvbuf"), "Sendrecv", lambda p, r: ((f32(2), r, ro(f32(2)), r), {}))

# --- non-contiguous input and output
case("allreduce-strided-sendbuf", V, named("sendbuf"), "Allreduce", lambda p, r: ((strided(4), f32(4)), {}))
case("allreduce-strided-recvbuf", V, named("recvbuf"), "Allreduce", lambda p, r: ((f32(4), strided(4)), {}))
case("allreduce-strided-inplace", V, named("sendbuf"), "Allreduce", lambda p, r: ((strided(4),), {}))
case("allreduce-strided-memoryview", V, named("sendbuf"), "Allreduce",
     lambda p, r: ((memoryview(f64(8))[::2], f64(4)), {}))
case("allreduce-fortran-order", V, named("sendbuf"), "Allreduce",
     lambda p, r: ((np.asfortranarray(f32(6).reshape(2, 3)), f32(6)), {}))
case("reduce-strided-sendbuf", V, named("sendbuf"), "Reduce",
     lambda p, r: ((strided(4), f32(4)), {"root": 0}))
case("reduce-strided-recvbuf", V, named("recvbuf"), "Reduce",
     lambda p, r: ((f32(4), strided(4)), {"root": r}))
case("reduce_scatter-strided-sendbuf", V, named("sendbuf"), "Reduce_scatter",
     lambda p, r: ((strided(2 * p), f32(2)), {}))
case("reduce_scatter-strided-recvbuf", V, named("recvbuf"), "Reduce_scatter",
     lambda p, r: ((f32(2 * p), strided(2)), {}))
case("allgather-strided-sendbuf", V, named("sendbuf"), "Allgather",
     lambda p, r: ((strided(2), f32(2 * p)), {}))
case("allgather-strided-recvbuf", V, named("recvbuf"), "Allgather",
     lambda p, r: ((f32(2), strided(2 * p)), {}))
case("bcast-strided", V, named("buf"), "Bcast", lambda p, r: ((strided(4),), {"root": 0}))
case("alltoall-strided-sendbuf", V, named("sendbuf"), "Alltoall",
     lambda p, r: ((strided(2 * p), f32(2 * p)), {}))
case("alltoall-strided-recvbuf", V, named("recvbuf"), "Alltoall",
     lambda p, r: ((f32(2 * p), strided(2 * p)), {}))
case("gather-strided-sendbuf", V, named("sendbuf"), "Gather",
     lambda p, r: ((strided(2), f32(2 * p)), {"root": 0}))
case("gather-strided-recvbuf", V, named("recvbuf"), "Gather",
     lambda p, r: ((f32(2), strided(2 * p)), {"root": r}))
case("scatter-strided-sendbuf", V, named("sendbuf"), "Scatter",
     lambda p, r: ((strided(2 * p), f32(2)), {"root": r}))
case("scatter-strided-recvbuf", V, named("recvbuf"), "Scatter",
     lambda p, r: ((f32(2 * p), strided(2)), {"root": 0}))
case("send-strided", V, named("buf"), "Send", lambda p, r: ((strided(4), r), {}))
case("recv-strided", V, named("buf"), "Recv", lambda p, r: ((strided(4), r), {}))
case("sendrecv-strided-sendbuf", V, named("sendbuf"), "Sendrecv",
     lambda p, r: ((strided(2), r, f32(2), r), {}))
case("sendrecv-strided-recvbuf", V, named("recvbuf"), "Sendrecv",
     lambda p, r: ((f32(2), r, strided(2), r), {}))

# --- op not defined for the dtype, or not an op
for _m in ("Allreduce", "Reduce", "Reduce_scatter"):
    _kw = {"root": 0} if _m == "Reduce" else {}
    for _op, _mk in ((al.BAND, f32), (al.AVG, i32), (al.MIN, c64), (al.LAND, f64), (al.BXOR, c64),
                     (al.LOR, c64), (al.MAX, c64)):
        case(f"{_m.lower()}-{_op.name}-{_mk.__name__}", T, named("op"), _m,
             lambda p, r, _op=_op, _mk=_mk, _kw=_kw: ((_mk(2 * p), _mk(2 * p)), dict(_kw, op=_op)))
    case(f"{_m.lower()}-op-str", T, named("op"), _m,
         lambda p, r, _kw=_kw: ((f32(2 * p), f32(2 * p)), dict(_kw, op="bogus")))
    case(f"{_m.lower()}-op-none", T, named("op"), _m,
         lambda p, r, _kw=_kw: ((f32(2 * p), f32(2 * p)), dict(_kw, op=None)))
    case(f"{_m.lower()}-op-mpi-replace", T, named("op"), _m,
         lambda p, r, _kw=_kw: ((f32(2 * p), f32(2 * p)), dict(_kw, op=MPI.REPLACE)))

# --- algorithm
case("allreduce-unknown-algorithm", V, named("algorithm"), "Allreduce",
     lambda p, r: ((f32(4),), {"algorithm": "bogus"}))
case("allreduce-algorithm-case", V, named("algorithm"), "Allreduce",
     lambda p, r: ((f32(4),), {"algorithm": "Ring"}))
case("allreduce-algorithm-none", T, named("algorithm"), "Allreduce",
     lambda p, r: ((f32(4),), {"algorithm": None}))
for _alg in ("nccl", "ht_ring", "ht_mpi"):
    case(f"allreduce-gpu-algorithm-{_alg}", U, r"^algorithm\b.*no CUDA device", "Allreduce",
         lambda p, r, _alg=_alg: ((f32(4), f32(4)), {"algorithm": _alg}))

# --- GPU buffers without a GPU backend
case("allreduce-gpu-sendbuf", U, named("sendbuf"), "Allreduce", lambda p, r: ((FakeGPUArray(),), {}))
case("allreduce-gpu-recvbuf", U, named("recvbuf"), "Allreduce", lambda p, r: ((f32(4), FakeGPUArray()), {}))
case("bcast-gpu-buf", U, named("buf"), "Bcast", lambda p, r: ((FakeGPUArray(),), {"root": 0}))
case("allgather-gpu-recvbuf", U, named("recvbuf"), "Allgather", lambda p, r: ((f32(1), FakeGPUArray()), {}))
case("send-gpu-buf", U, named("buf"), "Send", lambda p, r: ((FakeGPUArray(), r), {}))

# --- root / dest / source out of range or not an int
for _m, _build in (("Reduce", lambda p, r, x: ((f32(4), f32(4)), {"root": x})),
                   ("Bcast", lambda p, r, x: ((f32(4),), {"root": x})),
                   ("Gather", lambda p, r, x: ((f32(1), f32(p)), {"root": x})),
                   ("Scatter", lambda p, r, x: ((f32(p), f32(1)), {"root": x}))):
    case(f"{_m.lower()}-root-negative", V, named("root"), _m, lambda p, r, b=_build: b(p, r, -1))
    case(f"{_m.lower()}-root-size", V, named("root"), _m, lambda p, r, b=_build: b(p, r, p))
    case(f"{_m.lower()}-root-str", T, named("root"), _m, lambda p, r, b=_build: b(p, r, "0"))
    case(f"{_m.lower()}-root-float", T, named("root"), _m, lambda p, r, b=_build: b(p, r, 0.0))
case("send-dest-negative", V, named("dest"), "Send", lambda p, r: ((f32(4), BAD_RANK), {}))
case("send-dest-size", V, named("dest"), "Send", lambda p, r: ((f32(4), p), {}))
case("send-dest-any-source", V, named("dest"), "Send", lambda p, r: ((f32(4), MPI.ANY_SOURCE), {}))
case("send-dest-none", T, named("dest"), "Send", lambda p, r: ((f32(4), None), {}))
case("recv-source-negative", V, named("source"), "Recv", lambda p, r: ((f32(4), BAD_RANK), {}))
case("recv-source-size", V, named("source"), "Recv", lambda p, r: ((f32(4), p), {}))
case("recv-source-str", T, named("source"), "Recv", lambda p, r: ((f32(4), "0"), {}))
case("sendrecv-dest-size", V, named("dest"), "Sendrecv", lambda p, r: ((f32(2), p, f32(2), r), {}))
case("sendrecv-dest-negative", V, named("dest"), "Sendrecv", lambda p, r: ((f32(2), BAD_RANK, f32(2), r), {}))
case("sendrecv-source-size", V, named("source"), "Sendrecv", lambda p, r: ((f32(2), r, f32(2), p), {}))
case("sendrecv-source-negative", V, named("source"), "Sendrecv",
     lambda p, r: ((f32(2), r, f32(2), BAD_RANK), {}))
case("send-tag-negative", V, named("tag"), "Send", lambda p, r: ((f32(4), r), {"tag": -5}))
case("send-tag-any", V, named("tag"), "Send", lambda p, r: ((f32(4), r), {"tag": MPI.ANY_TAG}))
case("send-tag-too-big", V, named("tag"), "Send", lambda p, r: ((f32(4), r), {"tag": 1 << 20}))
case("recv-tag-str", T, named("tag"), "Recv", lambda p, r: ((f32(4), r), {"tag": "1"}))
case("sendrecv-tag-negative", V, named("tag"), "Sendrecv", lambda p, r: ((f32(2), r, f32(2), r), {"tag": -3}))

# --- not numeric buffers
for _what, _obj in (("list", lambda: [1.0, 2.0, 3.0]), ("str", lambda: "abc"), ("object", object),
                    ("int", lambda: 5), ("none", lambda: None),
                    ("char-buffer", lambda: memoryview(bytearray(b"abcd")).cast("c"))):
    case(f"allreduce-sendbuf-{_what}", T, named("sendbuf"), "Allreduce",
         lambda p, r, o=_obj: ((o(), f32(3)), {}))
    case(f"allreduce-inplace-{_what}", T, named("sendbuf"), "Allreduce", lambda p, r, o=_obj: ((o(),), {}))
    case(f"bcast-{_what}", T, named("buf"), "Bcast", lambda p, r, o=_obj: ((o(),), {"root": 0}))
    case(f"send-{_what}", T, named("buf"), "Send", lambda p, r, o=_obj: ((o(), r), {}))
    case(f"gather-sendbuf-{_what}", T, named("sendbuf"), "Gather",
         lambda p, r, o=_obj: ((o(), f32(3 * p)), {"root": 0}))
for _what, _obj in (("list", lambda n: [0.0] * n), ("str", lambda n: "x" * n), ("object", lambda n: object())):
    case(f"allreduce-recvbuf-{_what}", T, named("recvbuf"), "Allreduce",
         lambda p, r, o=_obj: ((f32(3), o(3)), {}))
    case(f"reduce-recvbuf-{_what}", T, named("recvbuf"), "Reduce",
         lambda p, r, o=_obj: ((f32(3), o(3)), {"root": r}))
    case(f"allgather-recvbuf-{_what}", T, named("recvbuf"), "Allgather",
         lambda p, r, o=_obj: ((f32(3), o(3 * p)), {}))
    case(f"recv-{_what}", T, named("buf"), "Recv", lambda p, r, o=_obj: ((o(3), r), {}))
case("scatter-nonroot-recvbuf-none", T, named("recvbuf"), "Scatter",
     lambda p, r: ((f32(2 * p), None), {"root": nxt(p, r)}), min_size=2)

# --- wrong lengths (sendbuf not divisible by size needs size > 1)
case("reduce_scatter-sendbuf-indivisible", V, named("sendbuf"), "Reduce_scatter",
     lambda p, r: ((f32(2 * p + 1), f32(3)), {}), min_size=2)
case("reduce_scatter-inplace-indivisible", V, named("sendbuf"), "Reduce_scatter",
     lambda p, r: ((f32(2 * p + 1),), {}), min_size=2)
case("allgather-inplace-indivisible", V, named("sendbuf"), "Allgather",
     lambda p, r: ((f32(2 * p + 1),), {}), min_size=2)
case("alltoall-sendbuf-indivisible", V, named("sendbuf"), "Alltoall",
     lambda p, r: ((f32(2 * p + 1), f32(3 * p)), {}), min_size=2)
case("alltoall-inplace-indivisible", V, named("sendbuf"), "Alltoall",
     lambda p, r: ((f32(2 * p + 1),), {}), min_size=2)
case("gather-inplace-indivisible", V, named("sendbuf"), "Gather",
     lambda p, r: ((f32(2 * p + 1), None), {"root": r}), min_size=2)
case("scatter-sendbuf-indivisible", V, named("sendbuf"), "Scatter",
     lambda p, r: ((f32(2 * p + 1), f32(3)), {"root": r}), min_size=2)
case("scatter-inplace-indivisible", V, named("sendbuf"), "Scatter",
     lambda p, r: ((f32(2 * p + 1), None), {"root": r}), min_size=2)


# --- sendbuf and recvbuf overlapping (partly, or gather-like ops given the same memory)
def _views(n_send, off, n_recv, dtype=np.float32):
    base = (np.arange(max(n_send, off + n_recv)) + 1).astype(dtype)
    return base[:n_send], base[off:off + n_recv]


case("allreduce-overlap", V, OVERLAP, "Allreduce", lambda p, r: (_views(4, 2, 4), {}))
case("reduce-overlap", V, OVERLAP, "Reduce", lambda p, r: (_views(4, 1, 4), {"root": r}))
case("reduce_scatter-overlap", V, OVERLAP, "Reduce_scatter", lambda p, r: (_views(2 * p, 1, 2), {}))
case("allgather-overlap", V, OVERLAP, "Allgather", lambda p, r: (_views(2, 1, 2 * p), {}))
case("alltoall-overlap", V, OVERLAP, "Alltoall", lambda p, r: (_views(2 * p, 1, 2 * p), {}))
case("gather-overlap", V, OVERLAP, "Gather", lambda p, r: (_views(2, 1, 2 * p), {"root": r}))
case("scatter-overlap", V, OVERLAP, "Scatter", lambda p, r: (_views(2 * p, 1, 2), {"root": r}))
case("sendrecv-overlap", V, OVERLAP, "Sendrecv",
     lambda p, r: ((lambda s, q: (s, r, q, r))(*_views(4, 2, 4)), {}))
case("allgather-same-start", V, OVERLAP, "Allgather", lambda p, r: (_views(2, 0, 2 * p), {}))
case("allgather-own-block", V, OVERLAP, "Allgather", lambda p, r: (_views(2 * p, 2 * r, 2)[::-1], {}))
case("gather-own-block", V, OVERLAP, "Gather", lambda p, r: (_views(2 * p, 2 * r, 2)[::-1], {"root": r}))
case("alltoall-same-array", V, OVERLAP, "Alltoall", lambda p, r: ((lambda a: (a, a))(f32(2 * p)), {}))
case("gather-same-start", V, OVERLAP, "Gather", lambda p, r: (_views(2, 0, 2 * p), {"root": r}))
case("scatter-same-start", V, OVERLAP, "Scatter", lambda p, r: (_views(2 * p, 0, 2), {"root": r}))
case("sendrecv-same-array", V, OVERLAP, "Sendrecv", lambda p, r: ((lambda a: (a, r, a, r))(f32(4)), {}))

# --- unsupported dtypes
_UNSUPPORTED = (("bool", lambda n: np.ones(n, bool)), ("object", lambda n: np.array([1.0] * n, dtype=object)),
                ("structured", lambda n: np.zeros(n, dtype=[("a", "i4"), ("b", "f4")])),
                ("big-endian", lambda n: np.arange(n, dtype=">i4")),
                ("unicode", lambda n: np.array(["ab"] * n)),
                ("datetime", lambda n: np.zeros(n, dtype="M8[s]")))
for _what, _mk in _UNSUPPORTED:
    case(f"allreduce-{_what}", T, named("sendbuf"), "Allreduce", lambda p, r, mk=_mk: ((mk(4), mk(4)), {}))
    case(f"allreduce-inplace-{_what}", T, named("sendbuf"), "Allreduce", lambda p, r, mk=_mk: ((mk(4),), {}))
    case(f"allreduce-recvbuf-{_what}", T, named("recvbuf"), "Allreduce",
         lambda p, r, mk=_mk: ((f32(4), mk(4)), {}))
    case(f"reduce-{_what}", T, named("sendbuf"), "Reduce", lambda p, r, mk=_mk: ((mk(4), mk(4)), {"root": 0}))
    case(f"reduce_scatter-{_what}", T, named("sendbuf"), "Reduce_scatter",
         lambda p, r, mk=_mk: ((mk(2 * p), mk(2)), {}))
    case(f"allgather-{_what}", T, named("sendbuf"), "Allgather",
         lambda p, r, mk=_mk: ((mk(2), mk(2 * p)), {}))
    case(f"bcast-{_what}", T, named("buf"), "Bcast", lambda p, r, mk=_mk: ((mk(4),), {"root": 0}))
    case(f"alltoall-{_what}", T, named("sendbuf"), "Alltoall",
         lambda p, r, mk=_mk: ((mk(2 * p), mk(2 * p)), {}))
    case(f"gather-{_what}", T, named("sendbuf"), "Gather",
         lambda p, r, mk=_mk: ((mk(2), mk(2 * p)), {"root": 0}))
    case(f"scatter-{_what}", T, named("recvbuf"), "Scatter",
         lambda p, r, mk=_mk: ((None, mk(2)), {"root": nxt(p, r)}), min_size=2)
    case(f"scatter-root-{_what}", T, named("sendbuf"), "Scatter",
         lambda p, r, mk=_mk: ((mk(2 * p), mk(2)), {"root": r}))
    case(f"send-{_what}", T, named("buf"), "Send", lambda p, r, mk=_mk: ((mk(4), r), {}))
    case(f"recv-{_what}", T, named("buf"), "Recv", lambda p, r, mk=_mk: ((mk(4), r), {}))
    case(f"sendrecv-{_what}", T, named("sendbuf"), "Sendrecv",
         lambda p, r, mk=_mk: ((mk(2), r, mk(2), r), {}))


# --- the v-collectives (issue 29): counts and displacements, in place, mixed buffers
def ones(p, n=1):
    return [n] * p


def _vcases():
    for m in ("Allgatherv", "Gatherv"):
        kw = (lambda p, r: {"root": r}) if m == "Gatherv" else (lambda p, r: {})
        low = m.lower()
        case(f"{low}-negative-count", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), [-1] + ones(p - 1)]), kw(p, r)))
        case(f"{low}-too-few-counts", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), ones(p - 1)]), kw(p, r)))
        case(f"{low}-count-float", T, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), [1.0] * p]), kw(p, r)))
        case(f"{low}-counts-str", T, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), f32(p)), dict(kw(p, r), recvcounts="1")))
        case(f"{low}-counts-past-buffer", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [f32(2 * p - 1), ones(p, 2)]), kw(p, r)))
        case(f"{low}-displs-past-buffer", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), ones(p), ones(p, p)]), kw(p, r)))
        case(f"{low}-displs-negative", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), ones(p), [-1] + list(range(1, p))]),
                                  kw(p, r)))
        case(f"{low}-blocks-overlap", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [f32(2 * p), ones(p, 2), [0] + list(range(1, p))]),
                                  kw(p, r)), min_size=2)
        case(f"{low}-sendbuf-not-its-count", V, named("sendbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [f32(3 * p), ones(p, 3)]), kw(p, r)))
        case(f"{low}-recvbuf-dtype", T, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [f64(2 * p), ones(p, 2)]), kw(p, r)))
        case(f"{low}-ro-recvbuf", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [ro(f32(2 * p)), ones(p, 2)]), kw(p, r)))
        case(f"{low}-strided-recvbuf", V, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(2), [strided(2 * p), ones(p, 2)]), kw(p, r)))
        case(f"{low}-overlap", V, OVERLAP, m,
             lambda p, r, kw=kw: ((lambda s, q: (s, [q, ones(p, 2)]))(*_views(2, 1, 2 * p)),
                                  kw(p, r)))
        case(f"{low}-counts-twice", T, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), ones(p)]), dict(kw(p, r), recvcounts=ones(p))))
        case(f"{low}-spec-four-items", T, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [f32(p), ones(p), None, 0]), kw(p, r)))
        case(f"{low}-gpu-recvbuf", U, named("recvbuf"), m,
             lambda p, r, kw=kw: ((f32(1), [FakeGPUArray(), ones(p)]), kw(p, r)))
        case(f"{low}-gpu-sendbuf", U, named("sendbuf"), m,
             lambda p, r, kw=kw: ((FakeGPUArray(), [f32(4 * p), ones(p, 4)]), kw(p, r)))
        case(f"{low}-unsupported-dtype", T, named("sendbuf"), m,
             lambda p, r, kw=kw: ((np.ones(1, bool), [np.ones(p, bool), ones(p)]), kw(p, r)))
    case("allgatherv-algorithm-ring", V, named("algorithm"), "Allgatherv",
         lambda p, r: ((f32(1), [f32(p), ones(p)]), {"algorithm": "ring"}))
    case("allgatherv-algorithm-none", T, named("algorithm"), "Allgatherv",
         lambda p, r: ((f32(1), [f32(p), ones(p)]), {"algorithm": None}))
    case("gatherv-nonroot-sendbuf-none", T, named("sendbuf"), "Gatherv",
         lambda p, r: ((None, None), {"root": nxt(p, r)}), min_size=2)
    case("gatherv-root-recvbuf-none", T, named("recvbuf"), "Gatherv",
         lambda p, r: ((f32(1), None), {"root": r, "recvcounts": ones(p)}))
    case("gatherv-root-out-of-range", V, named("root"), "Gatherv",
         lambda p, r: ((f32(1), [f32(p), ones(p)]), {"root": p}))
    case("gatherv-nonroot-strided-sendbuf", V, named("sendbuf"), "Gatherv",
         lambda p, r: ((strided(2), None), {"root": nxt(p, r)}), min_size=2)
    # Scatterv: the root's send layout, a non-root's recvbuf
    case("scatterv-negative-count", V, named("sendbuf"), "Scatterv",
         lambda p, r: (([f32(p), [-1] + ones(p - 1)], f32(1)), {"root": r}))
    case("scatterv-counts-past-buffer", V, named("sendbuf"), "Scatterv",
         lambda p, r: (([f32(2 * p - 1), ones(p, 2)], f32(2)), {"root": r}))
    case("scatterv-displs-past-buffer", V, named("sendbuf"), "Scatterv",
         lambda p, r: (([f32(p), ones(p), ones(p, p)], f32(1)), {"root": r}))
    case("scatterv-too-many-counts", V, named("sendbuf"), "Scatterv",
         lambda p, r: ((f32(p + 1), f32(1)), {"root": r, "sendcounts": ones(p + 1)}))
    case("scatterv-root-short-recvbuf", V, named("recvbuf"), "Scatterv",
         lambda p, r: (([f32(3 * p), ones(p, 3)], f32(2)), {"root": r}))
    case("scatterv-recvbuf-dtype", T, named("recvbuf"), "Scatterv",
         lambda p, r: (([f32(2 * p), ones(p, 2)], i32(2)), {"root": r}))
    case("scatterv-overlap", V, OVERLAP, "Scatterv",
         lambda p, r: ((lambda s, q: ([s, ones(p, 2)], q))(*_views(2 * p, 1, 2)), {"root": r}))
    case("scatterv-nonroot-recvbuf-none", T, named("recvbuf"), "Scatterv",
         lambda p, r: ((None, None), {"root": nxt(p, r)}), min_size=2)
    case("scatterv-nonroot-ro-recvbuf", V, named("recvbuf"), "Scatterv",
         lambda p, r: ((None, ro(f32(2))), {"root": nxt(p, r)}), min_size=2)
    case("scatterv-root-out-of-range", V, named("root"), "Scatterv",
         lambda p, r: ((None, f32(1)), {"root": -1}))
    # Alltoallv: both layouts, the rank's own block, in place
    case("alltoallv-send-block-past-buffer", V, named("sendbuf"), "Alltoallv",
         lambda p, r: (([f32(2 * p - 1), ones(p, 2)], [f32(2 * p), ones(p, 2)]), {}))
    case("alltoallv-recv-blocks-overlap", V, named("recvbuf"), "Alltoallv",
         lambda p, r: (([f32(2 * p), ones(p, 2)], [f32(2 * p), ones(p, 2),
                                                   [0] + list(range(1, p))]), {}), min_size=2)
    case("alltoallv-negative-recvcount", V, named("recvbuf"), "Alltoallv",
         lambda p, r: (([f32(p), ones(p)], f32(p)), {"recvcounts": [-1] + ones(p - 1)}))
    case("alltoallv-own-block-differs", V, named("sendbuf"), "Alltoallv",
         lambda p, r: (([f32(2 * p), ones(p, 2)], [f32(3 * p), ones(p, 3)]), {}))
    case("alltoallv-inplace-with-sendcounts", V, named("sendbuf"), "Alltoallv",
         lambda p, r: ((None, [f32(p), ones(p)]), {"sendcounts": ones(p)}))
    case("alltoallv-recvbuf-dtype", T, named("recvbuf"), "Alltoallv",
         lambda p, r: (([f32(p), ones(p)], [f64(p), ones(p)]), {}))
    case("alltoallv-same-array", V, OVERLAP, "Alltoallv",
         lambda p, r: ((lambda a: ([a, ones(p)], [a, ones(p)]))(f32(p)), {}))
    case("alltoallv-algorithm-unknown", V, named("algorithm"), "Alltoallv",
         lambda p, r: (([f32(p), ones(p)], [f32(p), ones(p)]), {"algorithm": "ring"}))
    case("alltoallv-inplace-ro", V, named("recvbuf"), "Alltoallv",
         lambda p, r: ((MPI.IN_PLACE, [ro(f32(p)), ones(p)]), {}))
    # Reduce_scatter with per-rank counts: sendbuf holds exactly sum(recvcounts)
    case("reduce_scatterv-sendbuf-short", V, named("sendbuf"), "Reduce_scatter",
         lambda p, r: ((f32(2 * p - 1), f32(2)), {"recvcounts": ones(p, 2)}))
    case("reduce_scatterv-sendbuf-long", V, named("sendbuf"), "Reduce_scatter",
         lambda p, r: ((f32(2 * p + 1), f32(2)), {"recvcounts": ones(p, 2)}))
    case("reduce_scatterv-inplace-recvbuf-long", V, named("recvbuf"), "Reduce_scatter",
         lambda p, r: ((MPI.IN_PLACE, [f32(2 * p + 1), ones(p, 2)]), {}))
    case("reduce_scatterv-negative-count", V, named("recvbuf"), "Reduce_scatter",
         lambda p, r: ((f32(p), f32(1)), {"recvcounts": [-1] + ones(p - 1)}))
    case("reduce_scatterv-short-recvbuf", V, named("recvbuf"), "Reduce_scatter",
         lambda p, r: ((f32(3 * p), [f32(2), ones(p, 3)]), {}))
    case("reduce_scatterv-displs", T, named("recvbuf"), "Reduce_scatter",
         lambda p, r: ((f32(p), [f32(1), ones(p), list(range(p))]), {}))
    case("reduce_scatterv-op-band-float", T, named("op"), "Reduce_scatter",
         lambda p, r: ((f32(p), f32(1)), {"recvcounts": ones(p), "op": al.BAND}))
    case("reduce_scatterv-avg-int", T, named("op"), "Reduce_scatter",
         lambda p, r: ((i32(p), i32(1)), {"recvcounts": ones(p), "op": al.AVG}))
    case("reduce_scatterv-algorithm-shm", V, named("algorithm"), "Reduce_scatter",
         lambda p, r: ((f32(p), f32(1)), {"recvcounts": ones(p), "algorithm": "shm"}))
    case("reduce_scatterv-inplace-ro", V, named("sendbuf"), "Reduce_scatter",
         lambda p, r: ((ro(f32(p)), None), {"recvcounts": ones(p)}))
    case("reduce_scatterv-both-in-place", T, named("sendbuf"), "Reduce_scatter",
         lambda p, r: ((MPI.IN_PLACE, None), {"recvcounts": ones(p)}))
    case("reduce_scatterv-recvbuf-dtype", T, named("recvbuf"), "Reduce_scatter",
         lambda p, r: ((f32(p), [f64(1), ones(p)]), {}))
    case("reduce_scatterv-overlap", V, OVERLAP, "Reduce_scatter",
         lambda p, r: ((lambda s, q: (s, [q, ones(p, 2)]))(*_views(2 * p, 1, 2)), {}))


_vcases()


# ---------------------------------------------------------------------------- running a case
def _owner(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def attempt(comm, exc, match, method, build, blocking):
    """Make the bad call; None if it raised `exc` matching `match` and wrote nothing, else why not.
    Never lets an exception out, so every rank reports the outcome together (all_ranks_ok)."""
    name = method if blocking else "I" + method[0].lower() + method[1:]
    try:
        args, kwargs = build(comm.size, comm.rank)
    except Exception as e:   # pragma: no cover - a broken case
        return f"{name}: building the case failed: {e!r}"
    flat = [b for a in list(args) + list(kwargs.values())       # [buf, counts] forms too
            for b in (a if isinstance(a, (list, tuple)) else [a])]
    arrays = [_owner(a) for a in flat if isinstance(a, np.ndarray)]
    before = [a.tobytes() for a in arrays]
    try:
        with pytest.raises(exc, match=match):
            getattr(comm, name)(*args, **kwargs)
    except (Exception, pytest.fail.Exception) as e:
        return f"{name}: {type(e).__name__}: {e}"
    changed = [i for i, (a, b) in enumerate(zip(arrays, before)) if a.tobytes() != b]
    if changed:
        return f"{name}: raised, but wrote into argument(s) {changed}"
    return None


@pytest.mark.local
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("exc,match,method,build,min_size", CASES)
def test_bad_argument(bad, exc, match, method, build, min_size, blocking):
    if bad.size < min_size:
        pytest.skip(f"needs {min_size} ranks")
    err = attempt(bad, exc, match, method, build, blocking)
    assert all_ranks_ok(err is None), err


def check_communicator_works(comm):
    """Allreduce with every host algorithm, and a Reduce and an Allgather, against numpy."""
    p, r = comm.size, comm.rank
    failures = []
    x = np.arange(1001, dtype=np.int64) * (r + 1)
    expected = np.arange(1001, dtype=np.int64) * (p * (p + 1) // 2)
    for alg in al.algorithms("allreduce", "host"):
        src, out = x.copy(), np.zeros_like(x)
        comm.Allreduce(src, out, algorithm=alg)
        if not np.array_equal(out, expected) or not np.array_equal(src, x):
            failures.append(f"allreduce {alg}")
        buf = x.copy()
        comm.Iallreduce(buf, algorithm=alg).Wait(timeout=60)
        if not np.array_equal(buf, expected):
            failures.append(f"iallreduce {alg}")
    out = np.zeros_like(x)
    comm.Reduce(x, out, op=al.MAX, root=p - 1)
    if r == p - 1 and not np.array_equal(out, x * p // (r + 1)):
        failures.append("reduce")
    out = np.zeros(3 * p, np.int32)
    comm.Allgather(np.full(3, r, np.int32), out)
    if not np.array_equal(out, np.repeat(np.arange(p, dtype=np.int32), 3)):
        failures.append("allgather")
    return failures


def test_errors_are_local(bad):
    """Each rank makes a different share of the bad calls (rank 0 at 1 rank: all of them) while
    the others make none: a call that had communicated before raising would leave a message or
    a half-started collective behind and break the correct collectives that follow."""
    p, r = bad.size, bad.rank
    errors = []
    for i, param in enumerate(CASES):
        exc, match, method, build, min_size = param.values
        if p >= min_size and i % p == r:
            err = attempt(bad, exc, match, method, build, blocking=(i // p) % 2 == 0)
            if err:
                errors.append(f"{param.id}: {err}")
    assert all_ranks_ok(not errors), errors[:10]
    failures = check_communicator_works(bad)
    assert all_ranks_ok(not failures), failures


def test_communicator_still_works(bad, comm):
    """After every bad call above, both the communicator that saw them and the session's one
    compute correctly."""
    failures = check_communicator_works(bad) + check_communicator_works(comm)
    assert all_ranks_ok(not failures), failures


# ---------------------------------------------------------------------------- constructor
@pytest.mark.local
def test_communicator_bad_arguments():
    errors = []
    for kwargs, exc, match in ((dict(comm="world"), TypeError, named("comm")),
                               (dict(comm=MPI.COMM_NULL), ValueError, named("comm")),
                               (dict(stream=object()), al.UnavailableError, r"^stream=")):
        comm = kwargs.pop("comm", None)
        try:
            with pytest.raises(exc, match=match):
                al.Communicator(comm, **kwargs)
        except (Exception, pytest.fail.Exception) as e:
            errors.append(f"{kwargs} {comm}: {type(e).__name__}: {e}")
    assert all_ranks_ok(not errors), errors


# ---------------------------------------------------------------------------- names and errors
@pytest.mark.local
def test_algorithm_names():
    host = ("auto", "mpi", "recursive_doubling", "rabenseifner", "ring", "hierarchical", "shm",
            "hierarchical_p2p")
    gpu = ("auto", "nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring")
    names = al.algorithms("allreduce")
    assert len(names) == len(set(names))
    assert set(names) == set(host) | set(gpu)
    assert set(al.algorithms("allreduce", "host")) == set(host)
    assert set(al.algorithms("allreduce", "cuda")) == set(gpu)
    with pytest.raises(ValueError, match=named("op")):
        al.algorithms("send")
    assert al.algorithms("alltoall", "host") == ("auto", "mpi", "shm")
    assert al.algorithms("scan", "cuda") == ()
    with pytest.raises(ValueError, match=named("device")):
        al.algorithms("allreduce", "tpu")
    with pytest.raises(ValueError, match=named("device")):
        al.algorithms("bcast", "tpu")


@pytest.mark.local
def test_error_hierarchy():
    for cls in (al.MPIError, al.TimeoutError, al.UnavailableError):
        assert issubclass(cls, al.Error), cls
        assert issubclass(cls, Exception)
    assert issubclass(al.TimeoutError, builtins.TimeoutError)
    assert al.TimeoutError is not builtins.TimeoutError
    assert not issubclass(al.Error, (ValueError, TypeError))
    with pytest.raises(builtins.TimeoutError):
        raise al.TimeoutError("x")
    e = al.MPIError("boom", 15)
    assert e.code == 15 and str(e) == "boom"
