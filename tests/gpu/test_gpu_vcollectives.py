"""The v-collectives on GPU buffers (issue 29): Allgatherv, Gatherv, Scatterv, Alltoallv as
grouped NCCL send/receive, Reduce_scatter with per-rank counts as grouped ncclReduce, against
numpy computed from every rank's host inputs (gathered with mpi4py), under mpiexec. Skips
without a GPU or CuPy (tests/gpu/conftest.py); runs on the CUDA, NCCL and CuPy stand-ins with
``-p aluminum_py.testing.pytest_standins`` (tests/test_mpi_suite.py::test_gpu_suite_on_standins).

The GPU backend's methods are called directly (``comm._gpu``): they take the raw buffers and the
user's counts and displacements, as the Communicator's methods pass them on.

Layouts: uneven counts, counts with zeros, one rank with everything, large blocks; packed
(displacements None) or in reverse rank order with gaps, whose elements must stay untouched,
as must a tail after every output. Blocks move as bytes, so dtypes NCCL lacks (int16,
complex128) move too. Every call runs blocking, then nonblocking (GpuRequest, waited on).
"""
import numpy as np
import pytest

from test_gpu import comm  # noqa: F401  (the fixture: a communicator bound to a CuPy stream)
from test_gpu import (assert_reduced, assert_same, cast, comparable, expected_reduction, fetch,
                      gather_inputs, np_dtype, payload, reduction_input, tail, to_gpu)

import aluminum_py as al

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

MOVE_DTYPES = ["float32", "int64", "uint8", "float16", "int16", "complex128"]
PATTERNS = ["uneven", "zeros", "one", "large"]
FORMS = ["packed", "gaps"]
FILL = 101          # initial value of outputs: no payload value equals it
RS_CASES = [("SUM", "float32"), ("SUM", "int64"), ("PROD", "int32"), ("MIN", "uint8"),
            ("MAX", "float16"), ("AVG", "float64"), ("SUM", "bfloat16")]


def counts_of(pattern: str, p: int, salt: int = 0) -> list:
    """Per-rank counts (the same on every rank for the same salt)."""
    if pattern == "uneven":
        return [(3 * j + salt) % 5 + 1 for j in range(p)]
    if pattern == "zeros":
        return [0 if (j + salt) % 2 == 0 else 3 for j in range(p)]
    if pattern == "one":
        return [7 if j == (p - 1 + salt) % p else 0 for j in range(p)]
    if pattern == "beyond":         # 8 MiB and more of float32 per block
        return [(2 << 20) + 1000 * j + salt for j in range(p)]
    return [(1 << 14) + 1000 * j + salt for j in range(p)]


def displs_of(counts: list, form: str):
    """(displs or None, extent): packed in rank order, or in reverse rank order from element 1
    with two elements between blocks."""
    if form == "packed":
        return None, sum(counts)
    d, at = [0] * len(counts), 1
    for j in reversed(range(len(counts))):
        d[j] = at
        at += counts[j] + 2
    return d, at + 1


def placed(dt, extent: int, blocks) -> np.ndarray:
    """FILL everywhere but `blocks` ((displ, values) pairs), then the tail."""
    out = cast(np.full(extent, FILL), dt)
    for at, values in blocks:
        out[at:at + values.size] = values
    return np.concatenate([out, tail(dt)])


def packed_displs(counts) -> list:
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def run(c, stream, blocking: bool, method: str, *args):
    """The backend's method, blocking (returns None) or nonblocking (a GpuRequest running
    NCCL, waited for), on the communicator's stream."""
    from aluminum_py.gpu import GpuRequest
    with stream:
        req = getattr(c._gpu, method)(*args, blocking)
        if blocking:
            assert req is None
        else:
            assert isinstance(req, GpuRequest) and req.algorithm == "nccl"
            req.Wait()


class Checks:
    """Comparisons collected on every rank and settled together (``settle``: every rank fails
    if any rank found a difference), so that a wrong result on one rank cannot leave the others
    waiting in the next test's collectives."""

    def __init__(self):
        self.problems = []

    def same(self, out, exp, what):
        try:
            assert_same(out, exp, what)
        except AssertionError as e:
            self.problems.append(str(e))

    def reduced(self, *args):
        try:
            assert_reduced(*args)
        except AssertionError as e:
            self.problems.append(str(e))

    def settle(self):
        from mpi4py import MPI
        everyone = MPI.COMM_WORLD.allgather(self.problems)
        bad = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
        assert not bad, "\n".join(bad)


def ragged(mine: np.ndarray) -> list:
    """Every rank's array (lengths may differ), in rank order (mpi4py, not the library)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.allgather(np.array(mine, copy=True))


# ----------------------------------------------------------------------------- data movement
def gathered(c, dtype: str, pattern: str, form: str, salt: int):
    """A gather-like call's layout: (dtype, counts, displs or None, extent, displs, this rank's
    block, the expected recvbuf with every rank's block placed)."""
    dt = np_dtype(dtype)
    counts = counts_of(pattern, c.size, salt)
    displs, extent = displs_of(counts, form)
    d = displs or packed_displs(counts)
    mine = payload(dtype, dt, c.rank, counts[c.rank])
    blocks = ragged(mine)
    return dt, counts, displs, extent, d, mine, placed(dt, extent, [(d[j], blocks[j])
                                                                    for j in range(c.size)])


def into_recvbuf(c, stream, ck, blocking, method, place, layout, what, *root):
    """`method` (allgatherv, gatherv at its root) into a fresh recvbuf, in place (sendbuf None,
    this rank's block already in recvbuf) or from sendbuf (which must not change), checked."""
    dt, counts, displs, extent, d, mine, exp = layout
    if place == "inplace":
        y = to_gpu(placed(dt, extent, [(d[c.rank], mine)]), stream)
        run(c, stream, blocking, method, None, y, counts, displs, *root)
        (out,) = fetch(stream, y)
    else:
        x, y = to_gpu(mine, stream), to_gpu(placed(dt, extent, []), stream)
        run(c, stream, blocking, method, x, y, counts, displs, *root)
        out, sent = fetch(stream, y, x)
        ck.same(sent, mine, what + ": sendbuf changed")
    ck.same(out, exp, what)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("place", ["inplace", "outofplace"])
def test_allgatherv(comm, place, dtype, pattern, form):
    """Every rank's block at displs[j] of every rank's recvbuf; in place (sendbuf None), this
    rank's block is already there."""
    c, stream = comm
    ck = Checks()
    layout = gathered(c, dtype, pattern, form, salt=0)
    for blocking in (True, False):
        into_recvbuf(c, stream, ck, blocking, "allgatherv", place, layout,
                     f"allgatherv {place} blocking={blocking} {dtype} {pattern} {form} "
                     f"rank {c.rank}")
    ck.settle()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", ["float64", "int8", "complex64"])
@pytest.mark.parametrize("place", ["inplace", "outofplace"])
def test_gatherv(comm, place, dtype, pattern, form):
    """Gatherv to the last rank (blocking) and to rank 0 (nonblocking); in place at the root
    (sendbuf None) its block is already in recvbuf; recvbuf matters at the root only."""
    c, stream = comm
    ck = Checks()
    layout = gathered(c, dtype, pattern, form, salt=1)
    mine = layout[5]
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"gatherv {place} root {root} blocking={blocking} {dtype} {pattern} {form} " \
               f"rank {c.rank}"
        if c.rank == root:
            into_recvbuf(c, stream, ck, blocking, "gatherv", place, layout, what, root)
            continue
        x = to_gpu(mine, stream)
        run(c, stream, blocking, "gatherv", x, None, None, None, root)
        (sent,) = fetch(stream, x)
        ck.same(sent, mine, what + ": sendbuf changed")
    ck.settle()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", ["float32", "uint64", "int16"])
@pytest.mark.parametrize("place", ["inplace", "outofplace"])
def test_scatterv(comm, place, dtype, pattern, form):
    """Scatterv from the last rank (blocking) and from rank 0 (nonblocking); in place at the
    root (recvbuf None) its block stays in sendbuf; sendbuf matters at the root only."""
    c, stream = comm
    ck = Checks()
    dt = np_dtype(dtype)
    counts = counts_of(pattern, c.size, salt=2)
    displs, extent = displs_of(counts, form)
    d = displs or packed_displs(counts)
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"scatterv {place} root {root} blocking={blocking} {dtype} {pattern} {form} " \
               f"rank {c.rank}"
        source = payload(dtype, dt, root, extent)          # the root's sendbuf, known to all
        exp = source[d[c.rank]:d[c.rank] + counts[c.rank]]
        if c.rank != root:
            full = to_gpu(placed(dt, counts[c.rank], []), stream)
            run(c, stream, blocking, "scatterv", None, full[:counts[c.rank]], None, None, root)
            (out,) = fetch(stream, full)
            ck.same(out, np.concatenate([exp, tail(dt)]), what)
            continue
        x = to_gpu(source, stream)
        if place == "inplace":
            run(c, stream, blocking, "scatterv", x, None, counts, displs, root)
            (sent,) = fetch(stream, x)
        else:
            full = to_gpu(placed(dt, counts[root], []), stream)
            y = full[:counts[root]]
            run(c, stream, blocking, "scatterv", x, y, counts, displs, root)
            out, sent = fetch(stream, full, x)
            ck.same(out, np.concatenate([exp, tail(dt)]), what)
        ck.same(sent, source, what + ": sendbuf changed")
    ck.settle()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_alltoallv(comm, dtype, pattern, form):
    """Rank i sends counts_of(pattern, p, salt=i)[j] elements to rank j (uneven in both
    directions), from sendbuf's layout into recvbuf's (both packed, or both with gaps)."""
    c, stream = comm
    ck = Checks()
    dt = np_dtype(dtype)
    p, me = c.size, c.rank
    matrix = [counts_of(pattern, p, salt=i) for i in range(p)]       # matrix[i][j]: i -> j
    scounts = matrix[me]
    rcounts = [matrix[i][me] for i in range(p)]
    sdispls, sext = displs_of(scounts, form)
    rdispls, rext = displs_of(rcounts, form)
    rd = rdispls or packed_displs(rcounts)
    mine = payload(dtype, dt, me, sext)
    sources = ragged(mine)
    sdisp_all = [displs_of(matrix[i], form)[0] or packed_displs(matrix[i]) for i in range(p)]
    exp = placed(dt, rext, [(rd[i], sources[i][sdisp_all[i][me]:sdisp_all[i][me] + rcounts[i]])
                            for i in range(p)])
    for blocking in (True, False):
        what = f"alltoallv blocking={blocking} {dtype} {pattern} {form} rank {me}"
        x, y = to_gpu(mine, stream), to_gpu(placed(dt, rext, []), stream)
        run(c, stream, blocking, "alltoallv", x, scounts, sdispls, y, rcounts, rdispls)
        out, sent = fetch(stream, y, x)
        ck.same(sent, mine, what + ": sendbuf changed")
        ck.same(out, exp, what)
    ck.settle()


@pytest.mark.parametrize("call", ["allgatherv", "alltoallv"])
def test_blocks_beyond_p2p_buffering(comm, call):
    """Blocks of 8 MiB and more per peer, beyond NCCL's point-to-point buffering (each send
    then waits for its receive, so a rank's grouped sends and receives must run together):
    Allgatherv out of place and Alltoallv, float32, with gaps, blocking and nonblocking."""
    if call == "allgatherv":
        test_allgatherv(comm, "outofplace", "float32", "beyond", "gaps")
    else:
        test_alltoallv(comm, "float32", "beyond", "gaps")


# ----------------------------------------------------------------------------- reduction
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("op,dtype", RS_CASES)
@pytest.mark.parametrize("place", ["inplace", "outofplace"])
def test_reduce_scatterv(comm, place, op, dtype, pattern):
    """Block i of sendbuf (recvcounts[i] elements, in rank order) reduced over the ranks into
    rank i; in place (recvbuf None) into the first recvcounts[rank] elements of sendbuf."""
    c, stream = comm
    ck = Checks()
    dt = np_dtype(dtype)
    counts = counts_of(pattern, c.size, salt=3)
    total, n = sum(counts), counts[c.rank]
    at = packed_displs(counts)[c.rank]
    mine = reduction_input(op, dtype, dt, c.rank, c.size, total)
    exp = expected_reduction(op, gather_inputs(mine))[at:at + n]
    for blocking in (True, False):
        what = f"reduce_scatterv {place} blocking={blocking} {op} {dtype} {pattern} rank {c.rank}"
        x = to_gpu(mine, stream)
        if place == "inplace":
            run(c, stream, blocking, "reduce_scatterv", x, None, counts, getattr(al, op))
            (out,) = fetch(stream, x)
            out = out[:n]
        else:
            y = to_gpu(np.concatenate([cast(np.full(n, FILL), dt), tail(dt)]), stream)
            run(c, stream, blocking, "reduce_scatterv", x, y, counts, getattr(al, op))
            full, sent = fetch(stream, y, x)
            ck.same(sent, mine, what + ": sendbuf changed")
            ck.same(full[n:], tail(dt), what + ": wrote past the end")
            out = full[:n]
        ck.reduced(out, exp, op, dtype, c.size, float(np.max(np.abs(comparable(mine)),
                                                                 initial=1.0)), what)
    ck.settle()


@pytest.mark.parametrize("scratch", ["device", "none"])
def test_reduce_scatterv_in_place_overlapping_move(comm, scratch, monkeypatch):
    """In place, rank r's result moves from its block down to the front of sendbuf; where the
    block is longer than the elements before it the two ranges overlap (here counts 1, 40, 3,
    ...: rank 1's block of 40 starts at element 1), and the move must still be exact: through
    stream-ordered scratch memory, or, where the device gives none ("none"), in copies that
    each read what no earlier one wrote."""
    if scratch == "none":
        from aluminum_py.backends.gpu_backend import GpuBackend
        monkeypatch.setattr(GpuBackend, "_scratch", lambda self, nbytes, stream: 0)
    c, stream = comm
    ck = Checks()
    counts = [1, 40, 3, 5][:c.size] + [2] * max(0, c.size - 4)
    total, n = sum(counts), counts[c.rank]
    at = packed_displs(counts)[c.rank]
    mine = (np.arange(total, dtype=np.int64) * 7 + c.rank) % 1000
    exp = gather_inputs(mine).sum(axis=0)[at:at + n]
    x = to_gpu(mine, stream)
    run(c, stream, True, "reduce_scatterv", x, None, counts, al.SUM)
    (out,) = fetch(stream, x)
    ck.same(out[:n], exp, f"in-place reduce_scatterv rank {c.rank}")
    ck.settle()


def test_in_place_reduce_scatterv_launches_one_copy_per_rank(comm):
    """On the CUDA stand-in, which counts driver calls: in place, a rank whose block is longer
    than the elements before it (counts 1, 4096, ...: rank 1's 4096 start at element 1) gets
    its result to the front of sendbuf in one device copy from stream-ordered scratch memory,
    not a copy per gap's length (4096 of 8 bytes), and the stream frees the scratch."""
    from aluminum_py import nccl
    from aluminum_py.testing import cuda_standin
    if nccl.library_path() != cuda_standin.path():
        pytest.skip("driver call counts are the CUDA stand-in's")
    c, stream = comm
    ck = Checks()
    counts = [1] + [4096] * (c.size - 1)
    total, n = sum(counts), counts[c.rank]
    at = packed_displs(counts)[c.rank]
    mine = (np.arange(total, dtype=np.int64) * 3 + c.rank) % 1000
    exp = gather_inputs(mine).sum(axis=0)[at:at + n]
    x = to_gpu(mine, stream)
    live, copies = cuda_standin.device_live(), cuda_standin.calls("cuMemcpyAsync")
    run(c, stream, True, "reduce_scatterv", x, None, counts, al.SUM)
    copies = cuda_standin.calls("cuMemcpyAsync") - copies
    (out,) = fetch(stream, x)
    ck.same(out[:n], exp, f"in-place reduce_scatterv rank {c.rank}")
    if copies != (1 if at else 0):
        ck.problems.append(f"{copies} device copies to move its result to the "
                           f"front, expected {1 if at else 0}")
    if cuda_standin.device_live() != live:
        ck.problems.append(f"{cuda_standin.device_live() - live} scratch blocks "
                           f"not freed")
    ck.settle()


def test_nonblocking_v_collectives_in_flight_together(comm):
    """Nonblocking Allgatherv, Alltoallv, Reduce_scatter with counts and Gatherv, all started
    before any is waited for (on the internal stream, in call order), then al.Waitall; the bound
    stream then sees every result."""
    c, stream = comm
    ck = Checks()
    p, me = c.size, c.rank
    counts = counts_of("uneven", p, salt=4)
    matrix = [counts_of("uneven", p, salt=i + 5) for i in range(p)]
    mine = payload("int32", np.dtype(np.int32), me, 64)
    everyone = ragged(mine)
    a_exp = np.concatenate([everyone[j][:counts[j]] for j in range(p)])
    sd, rd = packed_displs(matrix[me]), packed_displs([matrix[i][me] for i in range(p)])
    t_exp = np.concatenate([everyone[i][packed_displs(matrix[i])[me]:][:matrix[i][me]]
                            for i in range(p)])
    r_in = mine[:sum(counts)]
    at = packed_displs(counts)[me]
    r_exp = gather_inputs(r_in).sum(axis=0, dtype=np.int32)[at:at + counts[me]]
    with stream:
        a = to_gpu(np.zeros(sum(counts), np.int32), stream)
        t = to_gpu(np.zeros(sum(matrix[i][me] for i in range(p)), np.int32), stream)
        r = to_gpu(np.zeros(counts[me], np.int32), stream)
        g = to_gpu(np.zeros(sum(counts), np.int32), stream)
        x = to_gpu(mine, stream)
        gpu = c._gpu
        reqs = [gpu.allgatherv(x[:counts[me]], a, counts, None, False),
                gpu.alltoallv(x[:sum(matrix[me])], matrix[me], sd, t,
                              [matrix[i][me] for i in range(p)], rd, False),
                gpu.reduce_scatterv(x[:sum(counts)], r, counts, al.SUM, False),
                gpu.gatherv(x[:counts[me]], g if me == p - 1 else None, counts, None, p - 1,
                            False)]
        al.Waitall(reqs)
    outs = fetch(stream, a, t, r, g, x)
    ck.same(outs[0], a_exp, "Iallgatherv")
    ck.same(outs[1], t_exp, "Ialltoallv")
    ck.same(outs[2], r_exp, "Ireduce_scatter with counts")
    if me == p - 1:
        ck.same(outs[3], a_exp, "Igatherv")
    ck.same(outs[4], mine, "sendbuf changed")
    ck.settle()


def test_al_check_lets_matching_calls_run(comm, monkeypatch):
    """With AL_CHECK=1 the v-collectives first agree over the control communicator; calls
    whose ranks agree then run as without it."""
    c, stream = comm
    ck = Checks()
    monkeypatch.setattr(c._gpu, "_check", True)
    p, me = c.size, c.rank
    counts = counts_of("uneven", p)
    mine = payload("float32", np.dtype(np.float32), me, counts[me])
    exp = np.concatenate(ragged(mine))
    y = to_gpu(np.zeros(sum(counts), np.float32), stream)
    run(c, stream, True, "allgatherv", to_gpu(mine, stream), y, counts, None)
    ck.same(fetch(stream, y)[0], exp, "allgatherv under AL_CHECK")
    y = to_gpu(np.zeros(sum(counts), np.float32), stream)
    run(c, stream, False, "gatherv", to_gpu(mine, stream), y if me == 0 else None, counts, None, 0)
    if me == 0:
        ck.same(fetch(stream, y)[0], exp, "gatherv under AL_CHECK")
    total = np.arange(sum(counts), dtype=np.float32)
    x = to_gpu(total * (me + 1), stream)
    run(c, stream, True, "reduce_scatterv", x, None, counts, al.SUM)
    at = packed_displs(counts)[me]
    ck.same(fetch(stream, x)[0][:counts[me]], total[at:at + counts[me]] * (p * (p + 1) // 2),
            "reduce_scatterv under AL_CHECK")
    ck.settle()


# ----------------------------------------------------------------------------- what reaches NCCL
def test_launches_are_grouped_peer_blocks_and_rooted_reduces(comm):
    """On the NCCL stand-in, which records every launch: Alltoallv is one group of byte sends
    and receives, one per peer with a non-empty block (none to self: the own block is a device
    copy), and Reduce_scatter with counts one group of ncclReduce, rooted at each rank with a
    non-empty block, of that block's count."""
    from aluminum_py import nccl
    from aluminum_py.testing import cuda_standin, nccl_launches, reset_nccl_launches
    if nccl.library_path() != cuda_standin.path():
        pytest.skip("launch records are the NCCL stand-in's")
    c, stream = comm
    ck = Checks()
    p, me = c.size, c.rank
    matrix = [counts_of("zeros", p, salt=i) for i in range(p)]
    x = to_gpu(np.arange(sum(matrix[me]), dtype=np.float32), stream)
    y = to_gpu(np.zeros(sum(matrix[i][me] for i in range(p)), np.float32), stream)
    reset_nccl_launches()
    run(c, stream, True, "alltoallv", x, matrix[me], None, y, [matrix[i][me] for i in range(p)],
        None)
    sends = sorted((l.peer, l.count) for l in nccl_launches() if l.coll == "Send")
    recvs = sorted((l.peer, l.count) for l in nccl_launches() if l.coll == "Recv")
    if not all(l.grouped and l.dtype == "uint8" for l in nccl_launches()):
        ck.problems.append(f"alltoallv launches: {nccl_launches()}")
    ck.same(np.array(sends, dtype=np.int64).reshape(-1, 2), np.array(
        [(j, 4 * matrix[me][j]) for j in range(p) if j != me and matrix[me][j]],
        dtype=np.int64).reshape(-1, 2), "alltoallv sends (peer, bytes)")
    ck.same(np.array(recvs, dtype=np.int64).reshape(-1, 2), np.array(
        [(i, 4 * matrix[i][me]) for i in range(p) if i != me and matrix[i][me]],
        dtype=np.int64).reshape(-1, 2), "alltoallv receives (peer, bytes)")
    counts = counts_of("zeros", p)
    x = to_gpu(np.ones(sum(counts), np.float32), stream)
    y = to_gpu(np.zeros(counts[me], np.float32), stream)
    reset_nccl_launches()
    run(c, stream, True, "reduce_scatterv", x, y, counts, al.SUM)
    reduces = [(l.coll, l.root, l.count, l.op, l.grouped) for l in nccl_launches()]
    want = [("Reduce", j, counts[j], "sum", True) for j in range(p) if counts[j]]
    if reduces != want:
        ck.problems.append(f"reduce_scatterv launches {reduces}, expected {want}")
    (out,) = fetch(stream, y)
    ck.same(out, np.full(counts[me], p, np.float32), "reduce_scatterv result")
    ck.settle()
