# Allgatherv, Alltoall and Alltoallv over the shared-memory segment (K_SHM_ALLGATHERV,
# K_SHM_ALLTOALL, K_SHM_ALLTOALLV): the ops of a parsed message (run_shm_allgatherv,
# run_shm_alltoallv: HostCollectives' "shm" forms), the module entries that parse and run them
# (shm_allgatherv, shm_alltoall, shm_alltoallv: the same parsers as the Communicator's calls,
# msgbuffer.pxi), and the glue shm.pxi calls for these kinds (one rank, the counts a peer
# sends).  The protocol is in ext/al_shm.h ("allgatherv, alltoall, alltoallv").
# Each returns None (blocking) or a Request, as the other shm entries (Launcher.run_shm).

cdef object run_shm_allgatherv(Launcher L, al_msg* m, rc, rd, bint blocking, double timeout):
    """Allgatherv of the message `m` (parse_vgather's) over the segment: rank j's rc[j]
    elements land at recvbuf[rd[j]:] on every rank.  The counts are the same on every rank (a
    rank whose counts differ fails the op: the fingerprint holds their hash)."""
    cdef int me = L.state.c.rank
    cdef char* sp = m.sp
    cdef NativeOp o
    if m.inplace:
        sp = m.rp + <int64_t>vints_data(rd)[me] * m.esize
    o = L.shm_op(K_SHM_ALLGATHERV, "allgatherv/shm", sp, m.rp, vtotal_of(rc), m.code, m.esize,
                 0, 0)
    o.op.v.rcounts = vints_data(rc)
    o.op.v.rdispls = vints_data(rd)
    return L.run_shm(o, blocking, timeout, msg_obj(m.s), (msg_obj(m.r), rc, rd))


def shm_allgatherv(Launcher L, s, r, counts, displs, bint blocking, double timeout):
    """Allgatherv over the segment: `s` (None: in place) to every rank's `r` at counts/displs,
    parsed as Communicator.Allgatherv's.  `timeout`: seconds (< 0: none)."""
    cdef al_msg m
    L.shm_ready("allgatherv/shm")
    rc, rd, hold = parse_vgather(&m, s, r, counts, displs, L.state.c.size, L.state.c.rank,
                                 "Allgatherv")
    return run_shm_allgatherv(L, &m, rc, rd, blocking, timeout)


def shm_alltoall(Launcher L, s, r, Py_ssize_t n, bint blocking, double timeout):
    """Alltoall over the segment: block j (`n` elements at s[j * n:]) goes to rank j, block j of
    `r` comes from rank j.  `s` None: in place (r is both).  `n`: the same on every rank
    (fingerprinted); s and r hold at least size * n elements of one dtype and do not overlap
    (a count of its own: the Communicator's Alltoall derives it from sendbuf, parse_blocks)."""
    cdef cnp.ndarray rb, sb = None
    cdef int p = L.state.c.size, code
    cdef al_msg m
    L.shm_ready("alltoall/shm")
    rb = as_array(r, "recvbuf", True)
    code = dtype_code_of(rb, "recvbuf")
    if n > 2147483647:
        _hooks.too_many(n, "count")
    if n < 0:
        raise ValueError(f"count: {n} is negative")        # (the callers pass len // size)
    if cnp.PyArray_SIZE(rb) < p * n:
        _hooks.at_least(rb, p * n, "recvbuf", "size * count")
    if s is not None:
        sb = as_array(s, "sendbuf", False)
        same_dtype_of(sb, rb, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(sb) < p * n:
            _hooks.at_least(sb, p * n, "sendbuf", "size * count")
        if overlap(sb, rb):
            _hooks.no_overlap(sb, rb, "sendbuf", "recvbuf")
    msg_set(&m, sb, rb, n, code)
    m.inplace = sb is None
    return run_shm_alltoall(L, &m, blocking, timeout)


cdef object run_shm_alltoall(Launcher L, al_msg* m, bint blocking, double timeout):
    """Alltoall of the message `m` (parse_blocks': `count` elements per block) over the
    segment."""
    cdef NativeOp o = L.shm_op(K_SHM_ALLTOALL, "alltoall/shm", m.rp if m.inplace else m.sp,
                               m.rp, m.count, m.code, m.esize, 0, 0)
    return L.run_shm(o, blocking, timeout, None if m.inplace else msg_obj(m.s), msg_obj(m.r))


cdef object run_shm_alltoallv(Launcher L, al_msg* m, sc, sd, rc, rd, bint blocking,
                              double timeout):
    """Alltoallv of the message `m` (parse_alltoallv's) over the segment: block j of the send
    layout goes to rank j, which receives it at its rd[me]; in place (sc None) the receive
    layout is both.  What rank i sends rank j must be what rank j expects from rank i: a rank
    whose rcounts differ from its peer's scounts fails the op and the communicator (checked in
    round 0, al_shm.h)."""
    cdef int p = L.state.c.size
    cdef NativeOp o
    if sc is None:
        sc, sd = rc, rd
    if p > 1 and al_shm_a2a_cap(L.state.c.shm, m.esize, 1) < 1:
        _hooks.fail(f"algorithm 'shm': Alltoallv of {m.esize}-byte elements on {p} ranks needs "
                    f"slots of at least {al_shm_vheader(p) + (p - 1) * m.esize} bytes, the "
                    f"segment's have {L.state.c.shm.slot} (AL_SHM_SLOT_BYTES); use "
                    f"algorithm='mpi'")
    o = L.shm_op(K_SHM_ALLTOALLV, "alltoallv/shm", m.rp if m.inplace else m.sp, m.rp,
                 vtotal_of(rc), m.code, m.esize, 0, 0)
    o.op.v.scounts = vints_data(sc)
    o.op.v.sdispls = vints_data(sd)
    o.op.v.rcounts = vints_data(rc)
    o.op.v.rdispls = vints_data(rd)
    return L.run_shm(o, blocking, timeout, (msg_obj(m.s), sc, sd), (msg_obj(m.r), rc, rd))


def shm_alltoallv(Launcher L, s, scounts, sdispls, r, rcounts, rdispls, bint blocking,
                  double timeout):
    """Alltoallv over the segment, parsed as Communicator.Alltoallv's (`s` None: in place,
    r's layout for both sides; scounts and sdispls are then not read)."""
    cdef al_msg m
    L.shm_ready("alltoallv/shm")
    if s is None:
        scounts = sdispls = None
    sc, sd, rc, rd, hold = parse_alltoallv(&m, s, scounts, sdispls, r, rcounts, rdispls,
                                           L.state.c.size, L.state.c.rank)
    return run_shm_alltoallv(L, &m, sc, sd, rc, rd, blocking, timeout)


# ---- the glue shm.pxi calls for these kinds ----

cdef int shm_v_alone(al_op* op) noexcept nogil:
    """One rank (no segment): this rank's block from sendbuf to its place in recvbuf (nothing in
    place)."""
    cdef int64_t es = op.esize, n
    cdef const char* src = op.sbuf
    cdef char* dst = op.rbuf
    if op.kind == K_SHM_ALLTOALL:
        n = op.count
    else:
        n = op.v.rcounts[0]
        dst += op.v.rdispls[0] * es
        if op.kind == K_SHM_ALLTOALLV:
            src += op.v.sdispls[0] * es
    if dst != src and n > 0:
        memcpy(dst, src, <size_t>(n * es))
    return op_finish(op)

cdef int shm_counts_differ(al_op* op) noexcept nogil:
    """Alltoallv's round 0 found that peer op.shm.waiting sends this rank op.shm.theirs
    elements, not the rcounts this rank expects (al_shm.h, AL_SHM_COUNTS_DIFFER): fail `op`
    naming both, and break the communicator on every rank (the health word), as a fingerprint
    mismatch does."""
    cdef int peer = op.shm.waiting
    op.err = -1
    snprintf(op.errmsg, 256, "rank %d expects %d elements from rank %d (its recvcounts[%d]), "
             "rank %d sends %lld (its sendcounts[%d]): the ranks' Alltoallv calls differ; the "
             "communicator is now unusable on every rank", op.comm.rank, op.v.rcounts[peer],
             peer, peer, peer, <long long><int64_t>op.shm.theirs, op.comm.rank)
    comm_break(op.comm, AL_SHM_MISMATCHED, op.errmsg)
    return op_finish(op)
