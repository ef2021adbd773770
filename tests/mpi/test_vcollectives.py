"""The v-collectives on host buffers (Allgatherv, Gatherv, Scatterv, Alltoallv, Reduce_scatter
with per-rank counts), against numpy built from every rank's inputs: each rank's input is a pure
function of (rank, length, dtype), so every rank rebuilds all of them.  Every call x dtype (a
1-byte one included) x counts (all zero, uneven with zeros, one rank with everything) x
displacements (packed, or reversed with gaps) x in place where MPI allows it x blocking and
nonblocking; Reduce_scatter with counts x every op; several I-calls in flight at once; mpi4py's
argument forms; AL_CHECK's cross-rank count check."""
import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from conftest import (WORLD, all_ranks_ok, differences, every_rank, make_input, ops_for,
                      reference)

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

DTYPES = ["int32", "float32", "float64", "complex128", "int8"]
PATTERNS = ["zeros", "uneven", "one"]
FILL = -1          # what the library must not write: gaps between blocks, untouched buffers


def inp(rank: int, n: int, dtype) -> np.ndarray:
    """Rank `rank`'s input of `n` elements (values 0..96: exact in every dtype, int8 included)."""
    v = (np.arange(n, dtype=np.int64) * 7 + rank * 31 + 3) % 97
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (v + 1j * ((v + rank) % 5)).astype(dt)
    return v.astype(dt)


def counts_of(pattern: str, p: int) -> np.ndarray:
    """Per-rank counts: all zero, uneven (zeros among them from 4 ranks), or the last rank with
    everything."""
    if pattern == "zeros":
        return np.zeros(p, dtype=int)
    if pattern == "uneven":
        return (np.arange(p) * 3 + 1) % 5
    c = np.zeros(p, dtype=int)
    c[-1] = 7
    return c


def pair_counts(pattern: str, p: int) -> np.ndarray:
    """Alltoallv: C[i, j] elements from rank i to rank j."""
    i, j = np.meshgrid(np.arange(p), np.arange(p), indexing="ij")
    if pattern == "zeros":
        return np.zeros((p, p), dtype=int)
    if pattern == "uneven":
        return (i * 2 + j * 3 + 1) % 4
    return np.where(j == p - 1, 5, 0)


def layout(counts, gapped: bool):
    """(displs or None, buffer length): packed in rank order, or in reverse rank order with a
    gap of one element before each block."""
    counts = [int(c) for c in counts]
    if not gapped:
        return None, sum(counts)
    displs, at = [0] * len(counts), 0
    for i in reversed(range(len(counts))):
        displs[i] = at + 1
        at += counts[i] + 1
    return displs, at


def packed(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) if len(counts) else []


def place(out, counts, displs, blocks):
    """`out` with block i at displs[i] (packed when None)."""
    displs = packed(counts) if displs is None else displs
    for i, b in enumerate(blocks):
        out[displs[i]:displs[i] + counts[i]] = b
    return out


def gathered(rc, displs, n, dtype):
    """Every rank's input of rc[i] elements at its block of a receive buffer of n elements."""
    return place(np.full(n, FILL, dtype), rc, displs, [inp(i, c, dtype) for i, c in enumerate(rc)])


def run(comm, blocking, name, *args, **kwargs):
    """comm.<name> blocking, or its I-form and Wait."""
    if blocking:
        assert getattr(comm, name)(*args, **kwargs) is None
    else:
        req = getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs)
        assert isinstance(req, al.Request)
        req.Wait(timeout=60)


MODES = [(b, g) for b in (True, False) for g in (False, True)]   # (blocking, gapped displs)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgatherv(comm, dtype, pattern):
    p, r = comm.size, comm.rank
    rc = counts_of(pattern, p)
    failures = []
    for blocking, gapped in MODES:
        displs, n = layout(rc, gapped)
        expected = gathered(rc, displs, n, dtype)
        for inplace in (False, True):
            out = np.full(n, FILL, dtype)
            send = inp(r, rc[r], dtype)
            if inplace:                       # this rank's block already in place
                d = packed(rc) if displs is None else displs
                out[d[r]:d[r] + rc[r]] = send
                run(comm, blocking, "Allgatherv", MPI.IN_PLACE if blocking else None,
                    [out, rc.tolist(), displs])
            else:
                run(comm, blocking, "Allgatherv", send, [out, rc, displs])
                failures += differences("sendbuf changed", send, inp(r, rc[r], dtype))
            failures += differences(f"blocking={blocking} gapped={gapped} inplace={inplace}",
                                    out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gatherv(comm, dtype, pattern):
    p, r = comm.size, comm.rank
    rc = counts_of(pattern, p)
    failures = []
    for k, (blocking, gapped) in enumerate(MODES):
        root = k % p
        displs, n = layout(rc, gapped)
        expected = gathered(rc, displs, n, dtype)
        for inplace in (False, True):
            send = inp(r, rc[r], dtype)
            out = np.full(n, FILL, dtype)
            if r != root:
                run(comm, blocking, "Gatherv", send, None, root)
                failures += differences("sendbuf changed", send, inp(r, rc[r], dtype))
                continue
            if inplace:
                place(out, rc, displs, [send if i == r else np.full(rc[i], FILL, dtype)
                                        for i in range(p)])
                run(comm, blocking, "Gatherv", MPI.IN_PLACE if blocking else None, out, root,
                    recvcounts=rc, displs=displs)
            else:
                run(comm, blocking, "Gatherv", send, [out, (rc, displs)] if gapped
                    else [out, rc], root)
            failures += differences(f"root {root} blocking={blocking} gapped={gapped} "
                                    f"inplace={inplace}", out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatterv(comm, dtype, pattern):
    p, r = comm.size, comm.rank
    sc = counts_of(pattern, p)
    failures = []
    for k, (blocking, gapped) in enumerate(MODES):
        root = (k + 1) % p
        displs, n = layout(sc, gapped)
        d = packed(sc) if displs is None else displs
        source = inp(root, n, dtype)
        for inplace in (False, True):
            if r != root:
                out = np.full(sc[r], FILL, dtype)
                run(comm, blocking, "Scatterv", None, out, root)
                failures += differences(f"root {root} blocking={blocking}", out,
                                        source[d[r]:d[r] + sc[r]])
                continue
            send = source.copy()
            if inplace:
                run(comm, blocking, "Scatterv", [send, sc, displs],
                    MPI.IN_PLACE if blocking else None, root)
            else:
                out = np.full(sc[r] + 2, FILL, dtype)       # longer: only sc[root] written
                run(comm, blocking, "Scatterv", send, out, root, sendcounts=sc, displs=displs)
                failures += differences("root's recvbuf", out,
                                        np.concatenate([source[d[r]:d[r] + sc[r]],
                                                        np.full(2, FILL, dtype)]))
            failures += differences("root's sendbuf changed", send, source)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoallv(comm, dtype, pattern):
    p, r = comm.size, comm.rank
    failures = []
    for blocking, gapped in MODES:
        for inplace in (False, True):
            C = pair_counts(pattern, p)
            if inplace:                       # in place: one layout for both sides
                C = C + C.T
            sc, rc = C[r], C[:, r]
            # every rank's send layout, to know what rank i sends to this rank
            sends = [layout(C[i], gapped) for i in range(p)]
            sdispls, slen = sends[r]
            rdispls, rlen = layout(rc, gapped)
            blocks = []
            for i in range(p):
                di = packed(C[i]) if sends[i][0] is None else sends[i][0]
                src = inp(i, sends[i][1], dtype)
                blocks.append(src[di[r]:di[r] + C[i, r]])
            expected = place(np.full(rlen, FILL, dtype), rc, rdispls, blocks)
            out = np.full(rlen, FILL, dtype)
            if inplace:
                # C is symmetric: this rank's data for rank j sits where rank j's block lands
                # (its send layout is its receive layout)
                place(out, rc, rdispls, [inp(r, slen, dtype)[(packed(sc) if sdispls is None
                                                              else sdispls)[j]:][:sc[j]]
                                         for j in range(p)])
                run(comm, blocking, "Alltoallv", MPI.IN_PLACE if blocking else None,
                    [out, rc, rdispls])
                failures += differences(f"inplace blocking={blocking} gapped={gapped}", out,
                                        expected)
                continue
            send = inp(r, slen, dtype)
            run(comm, blocking, "Alltoallv", [send, sc, sdispls], out, recvcounts=rc,
                rdispls=rdispls)
            failures += differences(f"blocking={blocking} gapped={gapped}", out, expected)
            failures += differences("sendbuf changed", send, inp(r, slen, dtype))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_alltoallv_every_argument_form(comm):
    """Alltoallv's argument forms give one result: mpi4py's usual ones on numpy arrays (split
    in C: [buf, counts, displs], [buf, (counts, displs)], tuples, keywords) and those the
    Python split takes (a list subclass, a memoryview buffer, counts in the list with displs
    as a keyword), blocking and not."""
    p, r = comm.size, comm.rank
    C = pair_counts("uneven", p)
    sc, rc = [int(v) for v in C[r]], [int(v) for v in C[:, r]]
    sd, rd = [int(v) for v in packed(sc)], [int(v) for v in packed(rc)]
    send = inp(r, sum(sc), "float64")
    blocks = [inp(i, int(C[i].sum()), "float64")[packed(C[i])[r]:][:C[i, r]] for i in range(p)]
    expected = place(np.full(sum(rc), FILL, "float64"), rc, rd, blocks)

    class Spec(list):
        pass

    forms = {
        "lists": lambda o: ([send, sc, sd], [o, rc, rd], {}),
        "pairs": lambda o: ([send, (sc, sd)], [o, (rc, rd)], {}),
        "tuples": lambda o: ((send, np.array(sc), np.array(sd)), (o, tuple(rc), tuple(rd)), {}),
        "keywords": lambda o: (send, o, dict(sendcounts=sc, sdispls=sd, recvcounts=rc,
                                               rdispls=rd)),
        "subclass": lambda o: (Spec([send, sc, sd]), Spec([o, rc, rd]), {}),
        "memoryview": lambda o: ([memoryview(send), sc, sd], [memoryview(o), rc, rd], {}),
        "mixed": lambda o: ([send, sc], [o, rc], dict(sdispls=sd, rdispls=rd)),
    }
    failures = []
    for name, form in forms.items():
        for blocking in (True, False):
            out = np.full(sum(rc), FILL, "float64")
            s, o, kw = form(out)
            run(comm, blocking, "Alltoallv", s, o, **kw)
            failures += differences(f"{name} blocking={blocking}", out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", ["int32", "float32", "float64", "complex64", "int8", "float16"])
def test_reduce_scatter_with_counts(comm, dtype, pattern):
    p, r = comm.size, comm.rank
    c = counts_of(pattern, p)
    total, d = int(c.sum()), packed(c)
    failures = []
    for k, op in enumerate(ops_for(dtype)):
        stack = np.stack([make_input(dtype, op, total, k, i) for i in range(p)])
        expected = reference(op, stack, p)[d[r]:d[r] + c[r]]
        mine = make_input(dtype, op, total, k, r)
        for form in range(4):
            blocking = (form + k) % 2 == 0
            what = f"{op.name} form {form} blocking={blocking}"
            if form == 0:                                   # out of place, recvcounts=
                out = np.full(c[r] + 1, FILL, dtype)
                send = mine.copy()
                run(comm, blocking, "Reduce_scatter", send, out, op, recvcounts=c)
                failures += differences(what, out[:c[r]], expected)
                failures += differences(what + " tail", out[c[r]:], np.full(1, FILL, dtype))
                failures += differences(what + " sendbuf", send, mine)
            elif form == 1:                                 # out of place, [buf, counts]
                out = np.full(c[r], FILL, dtype)
                run(comm, blocking, "Reduce_scatter", mine.copy(), [out, c.tolist()], op=op)
                failures += differences(what, out, expected)
            elif form == 2:                                 # in place: recvbuf None
                buf = mine.copy()
                run(comm, blocking, "Reduce_scatter", buf, None, op, recvcounts=c)
                failures += differences(what, buf[:c[r]], expected)
            else:                                           # mpi4py's: sendbuf MPI.IN_PLACE
                buf = mine.copy()
                run(comm, blocking, "Reduce_scatter", MPI.IN_PLACE, [buf, c], op)
                failures += differences(what, buf[:c[r]], expected)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_many_in_flight(comm):
    """Several nonblocking v-collectives in flight at once (and a block-form one among them),
    waited for in reverse order: each gets its own buffers and counts."""
    p, r = comm.size, comm.rank
    failures = []
    for rnd in range(3):
        c = (np.arange(p) + rnd) % 3 + 1
        C = pair_counts("uneven", p) + rnd
        reqs, checks = [], []
        ag = np.full(int(c.sum()), FILL, np.float64)
        reqs.append(comm.Iallgatherv(inp(r, c[r], "float64"), [ag, c]))
        checks.append(("allgatherv", ag,
                       np.concatenate([inp(i, c[i], "float64") for i in range(p)])))
        a2 = np.full(int(C[:, r].sum()), FILL, np.int32)
        reqs.append(comm.Ialltoallv([inp(r, int(C[r].sum()), "int32"), C[r]], [a2, C[:, r]]))
        checks.append(("alltoallv", a2, np.concatenate(
            [inp(i, int(C[i].sum()), "int32")[packed(C[i])[r]:][:C[i, r]] for i in range(p)])))
        rs = np.full(c[r], FILL, np.float32)
        reqs.append(comm.Ireduce_scatter(inp(r, int(c.sum()), "float32"), rs, recvcounts=c))
        checks.append(("reduce_scatterv", rs, np.add.reduce(
            np.stack([inp(i, int(c.sum()), "float32") for i in range(p)]))[packed(c)[r]:][:c[r]]))
        root = rnd % p
        gv = np.full(int(c.sum()), FILL, np.int8) if r == root else None
        reqs.append(comm.Igatherv(inp(r, c[r], "int8"), [gv, c], root=root))
        if r == root:
            checks.append(("gatherv", gv, np.concatenate([inp(i, c[i], "int8") for i in range(p)])))
        sv = np.full(c[r], FILL, np.complex128)
        reqs.append(comm.Iscatterv([inp(root, int(c.sum()), "complex128"), c]
                                   if r == root else None, sv, root=root))
        checks.append(("scatterv", sv, inp(root, int(c.sum()), "complex128")[packed(c)[r]:][:c[r]]))
        blk = np.full(2, FILL, np.float64)
        reqs.append(comm.Ireduce_scatter(np.arange(2.0 * p) + r, blk))
        checks.append(("reduce_scatter block", blk,
                       p * (np.arange(2.0 * p)[2 * r:2 * r + 2]) + p * (p - 1) / 2))
        for q in reversed(reqs):
            q.Wait(timeout=60)
        for name, got, want in checks:
            failures += differences(f"round {rnd} {name}", got, want)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_argument_forms(comm):
    """mpi4py's message forms and the keywords give the same result; buffer-protocol objects
    work as buffers."""
    p, r = comm.size, comm.rank
    c = (np.arange(p) % 2) + 1
    displs, n = layout(c, True)
    want = gathered(c, displs, n, "float64")
    forms = [lambda o: ((inp(r, c[r], "float64"), [o, c, displs]), {}),
             lambda o: ((inp(r, c[r], "float64"), [o, (c, displs)]), {}),
             lambda o: ((inp(r, c[r], "float64"), (o, list(c), tuple(displs))), {}),
             lambda o: ((inp(r, c[r], "float64"), o), {"recvcounts": c, "displs": displs}),
             lambda o: ((inp(r, c[r], "float64"), [o]), {"recvcounts": c, "displs": displs}),
             lambda o: ((inp(r, c[r], "float64"), [o, c]), {"displs": displs})]
    failures = []
    for k, form in enumerate(forms):
        out = np.full(n, FILL, np.float64)
        args, kwargs = form(out)
        comm.Allgatherv(*args, algorithm=("auto", "mpi")[k % 2], **kwargs)
        failures += differences(f"form {k}", out, want)
    # the request says what ran: "mpi" for "mpi"; "auto" may also choose "shm" (one node)
    for alg, ran in (("mpi", ("mpi",)), ("auto", ("mpi", "shm"))):
        req = comm.Iallgatherv(inp(r, c[r], "float64"), [np.empty(n), c, displs], algorithm=alg)
        req.Wait(timeout=60)
        if req.algorithm not in ran:
            failures.append(f"{alg}: Request.algorithm is {req.algorithm!r}")
    # a bytearray receive buffer (bytes, uint8) and a memoryview send buffer
    raw = bytearray(int(c.sum()))
    comm.Allgatherv(memoryview(inp(r, c[r], "int8").view(np.uint8)), [raw, c])
    failures += differences("bytearray", np.frombuffer(raw, np.int8),
                            np.concatenate([inp(i, c[i], "int8") for i in range(p)]))
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.skipif(WORLD.size < 2, reason="a count that differs across ranks needs two")
@pytest.mark.parametrize("call", ["allgatherv", "gatherv", "scatterv", "alltoallv",
                                  "reduce_scatterv"])
def test_al_check_names_the_counts_that_differ(monkeypatch, call):
    """AL_CHECK=1: counts that agree run as usual; rank 1 giving one element more or less
    than its peers expect raises al.Error on every rank, naming the rank and the argument,
    before any data moves (MPICH's nonblocking collectives do not report truncation at all).
    The MPI library's calls ("mpi"): "shm" checks the counts in its own rounds
    (test_shm_vcollectives.py)."""
    monkeypatch.setenv("AL_CHECK", "1")
    p, r = WORLD.size, WORLD.rank
    c = np.arange(p) + 1
    comm = al.Communicator()
    failures = []
    for bad in (0, 1, -1):
        mine = c.copy()
        if r == 1:
            mine[1] += bad
        out = np.full(int(c.sum()) + p * p + 1, FILL, np.float64)
        try:
            if call == "allgatherv":                  # rank 1's recvcounts[1] differs
                comm.Allgatherv(inp(r, mine[r], "float64"), [out, mine], algorithm="mpi")
                want = "rank 1's sendbuf has"
            elif call == "gatherv":
                comm.Gatherv(inp(r, mine[r], "float64"), [out, c], root=0)
                want = "rank 1's sendbuf has"
            elif call == "scatterv":
                comm.Scatterv([inp(0, int(c.sum()), "float64"), c], out[:mine[r]], root=0)
                want = "the root's (rank 0) sendcounts[1]"
            elif call == "alltoallv":
                sc, rc = c.copy(), np.full(p, c[r])     # rank 1 sends rank 0 a count off
                if r == 1:
                    sc[0] += bad
                comm.Alltoallv([inp(r, int(sc.sum()), "float64"), sc], [out, rc],
                               algorithm="mpi")
                want = "rank 1's sendcounts[0]"
            else:
                comm.Reduce_scatter(np.ones(int(mine.sum())), out[:mine[r]], recvcounts=mine)
                want = "recvcounts[1]"
            outcome = "ok"
        except al.Error as e:
            outcome = str(e)
        if bad == 0 and outcome != "ok":
            failures.append(f"matching counts raised: {outcome}")
        if bad != 0 and (want not in outcome or "AL_CHECK" not in outcome
                         or not np.all(out == FILL)):
            failures.append(f"counts off by {bad}: {outcome!r}, recvbuf {out}")
        if bad != 0:        # broken on every rank: a fresh communicator for the next case
            comm = al.Communicator()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_truncation_hint_names_the_arguments():
    """When MPI reports a truncation (Open MPI does; MPICH's nonblocking collectives do not),
    the MPIError of a v-collective says which arguments must agree."""
    from aluminum_py.request import _check

    class Op:
        name = "gatherv"
        error = (MPI.ERR_TRUNCATE, "MPI_Testall failed: Message truncated")
        status = None                   # no receive envelope: a collective

    with pytest.raises(al.MPIError, match=r"^gatherv: MPI_Testall failed: Message truncated "
                                          r"\(a rank sent more .* recvcounts\[i\].*AL_CHECK=1"):
        _check(Op())
    Op.name = "allreduce/mpi"
    with pytest.raises(al.MPIError, match=r"truncated$"):
        _check(Op())


@pytest.mark.skipif(WORLD.size < 2, reason="counts that differ between ranks need two")
@pytest.mark.parametrize("small", [True, False], ids=["16B", "8MiB"])
def test_auto_allgatherv_with_counts_that_differ_fails_on_every_rank(small):
    """"auto" never picks a transport from the counts: rank 1's recvcounts[1] off by one, at a
    small and a large size, raises al.Error on every rank (the segment's fingerprints carry the
    counts) instead of leaving ranks on different transports, waiting for each other."""
    comm = al.Communicator()
    if comm._host._no_shm is not None:      # the same on every rank
        pytest.skip(f"no shared-memory segment: {comm._host._no_shm}")
    p, r = WORLD.size, WORLD.rank
    n = 4 if small else (2 << 20)                  # float32 elements per rank
    c = [n] * p
    if r == 1:
        c[1] += 1
    out = np.zeros(sum(c) + 1, np.float32)
    try:
        comm.Allgatherv(np.ones(c[r], np.float32), [out, c])
        outcome = "returned"
    except al.Error as e:
        outcome = str(e)
    assert all_ranks_ok("differ" in outcome), every_rank([outcome])

