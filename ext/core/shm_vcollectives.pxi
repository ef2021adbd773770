# Allgatherv, Alltoall and Alltoallv over the shared-memory segment (K_SHM_ALLGATHERV,
# K_SHM_ALLTOALL, K_SHM_ALLTOALLV): the entry points the Communicator's checked calls use, and
# the glue shm.pxi calls for these kinds (one rank, the counts a peer sends).  The protocol is
# in ext/al_shm.h ("allgatherv, alltoall, alltoallv").
#
# The entries take CHECKED arguments (the Communicator splits the message forms with
# buffers.vspec and checks them with buffers.vlayout / vno_overlap before it calls them):
#   * buffers: C-contiguous numpy arrays of one supported dtype, recvbuf writable;
#   * counts and displacements: C-contiguous int32 arrays of `size` entries (vlayout's result),
#     every block inside its buffer.
# What is cheap and would otherwise touch memory outside a buffer is checked again here, with
# the same messages (as_array, the dtype, the lengths, sendbuf overlapping recvbuf; counts that
# are not such arrays, or a block outside its buffer, go through buffers.vlayout, which raises
# or converts).  Not checked here (the caller's): overlapping receive blocks (vno_overlap),
# and for Allgatherv that sendbuf holds exactly counts[rank] elements.
# Each returns None (blocking) or a Request, as the other shm entries (Launcher.run_shm).

cdef tuple vchecked(object counts, object displs, int p, str name, Py_ssize_t elems):
    """(counts, displs): the given arrays when they are int32 arrays of `p` entries whose blocks
    lie inside a buffer of `elems` elements (the entries' precondition, checked in O(p)), else
    buffers.vlayout's result (which raises its message for anything wrong)."""
    cdef const int* c
    cdef const int* d
    cdef int i
    if vcounts_ok(counts, p) and vcounts_ok(displs, p):
        c = <const int*>cnp.PyArray_DATA(<cnp.ndarray>counts)
        d = <const int*>cnp.PyArray_DATA(<cnp.ndarray>displs)
        for i in range(p):
            if c[i] < 0 or d[i] < 0 or <int64_t>d[i] + c[i] > elems:
                break
        else:
            return counts, displs
    from aluminum_py.buffers import vlayout
    return vlayout(counts, displs, p, name, elems)

cdef inline int* vints_data(object a) noexcept:
    return <int*>cnp.PyArray_DATA(<cnp.ndarray>a)


def shm_allgatherv(Launcher L, s, r, counts, displs, bint blocking, double timeout):
    """Allgatherv over the segment: rank j's `counts[j]` elements land at `r[displs[j]:]` on
    every rank.

    `s`: this rank's block (at least counts[rank] elements of r's dtype, not overlapping r), or
    None: in place, the block already at r[displs[rank]:].  `counts`, `displs`: the same counts
    on every rank (a rank whose counts differ fails the op: the fingerprint holds their hash),
    displacements this rank's own; checked as the module comment says.  `timeout`: seconds
    (< 0: none), AL_HANG_TIMEOUT's."""
    cdef cnp.ndarray rb, sb = None
    cdef int p = L.state.c.size, me = L.state.c.rank, code
    cdef int esize
    cdef char* sp
    cdef NativeOp o
    L.shm_ready("allgatherv/shm")
    rb = as_array(r, "recvbuf", True)
    code = dtype_code_of(rb, "recvbuf")
    esize = <int>cnp.PyArray_ITEMSIZE(rb)
    counts, displs = vchecked(counts, displs, p, "recvbuf", cnp.PyArray_SIZE(rb))
    if s is None:
        sp = <char*>cnp.PyArray_DATA(rb) + <int64_t>vints_data(displs)[me] * esize
    else:
        sb = as_array(s, "sendbuf", False)
        same_dtype_of(sb, rb, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(sb) < vints_data(counts)[me]:
            _hooks.at_least(sb, vints_data(counts)[me], "sendbuf", "recvcounts[rank]")
        if overlap(sb, rb):
            _hooks.no_overlap(sb, rb, "sendbuf", "recvbuf")
        sp = <char*>cnp.PyArray_DATA(sb)
    o = L.shm_op(K_SHM_ALLGATHERV, "allgatherv/shm", sp, <char*>cnp.PyArray_DATA(rb),
                 vtotal_of(counts), code, esize, 0, 0)
    o.op.v.rcounts = vints_data(counts)
    o.op.v.rdispls = vints_data(displs)
    return L.run_shm(o, blocking, timeout, sb, (rb, counts, displs))


def shm_alltoall(Launcher L, s, r, Py_ssize_t n, bint blocking, double timeout):
    """Alltoall over the segment: block j (`n` elements at s[j * n:]) goes to rank j, block j of
    `r` comes from rank j.  `s` None: in place (r is both).  `n`: the same on every rank
    (fingerprinted); s and r hold at least size * n elements of one dtype and do not overlap."""
    cdef cnp.ndarray rb, sb = None
    cdef int p = L.state.c.size, code
    cdef char* rp
    cdef NativeOp o
    L.shm_ready("alltoall/shm")
    rb = as_array(r, "recvbuf", True)
    code = dtype_code_of(rb, "recvbuf")
    if n > 2147483647:
        _hooks.too_many(n, "count")
    if n < 0:
        raise ValueError(f"count: {n} is negative")        # (the callers pass len // size)
    if cnp.PyArray_SIZE(rb) < p * n:
        _hooks.at_least(rb, p * n, "recvbuf", "size * count")
    rp = <char*>cnp.PyArray_DATA(rb)
    if s is not None:
        sb = as_array(s, "sendbuf", False)
        same_dtype_of(sb, rb, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(sb) < p * n:
            _hooks.at_least(sb, p * n, "sendbuf", "size * count")
        if overlap(sb, rb):
            _hooks.no_overlap(sb, rb, "sendbuf", "recvbuf")
    o = L.shm_op(K_SHM_ALLTOALL, "alltoall/shm",
                 rp if sb is None else <char*>cnp.PyArray_DATA(sb), rp, n, code,
                 <int>cnp.PyArray_ITEMSIZE(rb), 0, 0)
    return L.run_shm(o, blocking, timeout, sb, rb)


def shm_alltoallv(Launcher L, s, scounts, sdispls, r, rcounts, rdispls, bint blocking,
                  double timeout):
    """Alltoallv over the segment: s[sdispls[j]:][:scounts[j]] goes to rank j, which receives
    it at r[rdispls[me]:][:rcounts[me]].

    `s` None: in place (MPI_IN_PLACE: r's layout, rcounts and rdispls, is used for both;
    scounts and sdispls are ignored).  What rank i sends rank j must be what rank j expects
    from rank i: a rank whose rcounts differ from its peer's scounts fails the op and the
    communicator (checked in round 0, al_shm.h); scounts[rank] must equal rcounts[rank]
    (buffers.vself_counts).  Otherwise checked as the module comment says."""
    cdef cnp.ndarray rb, sb = None
    cdef int p = L.state.c.size, me = L.state.c.rank, code
    cdef int esize
    cdef char* rp
    cdef NativeOp o
    L.shm_ready("alltoallv/shm")
    rb = as_array(r, "recvbuf", True)
    code = dtype_code_of(rb, "recvbuf")
    esize = <int>cnp.PyArray_ITEMSIZE(rb)
    rcounts, rdispls = vchecked(rcounts, rdispls, p, "recvbuf", cnp.PyArray_SIZE(rb))
    rp = <char*>cnp.PyArray_DATA(rb)
    if s is None:
        scounts, sdispls = rcounts, rdispls
    else:
        sb = as_array(s, "sendbuf", False)
        same_dtype_of(sb, rb, "sendbuf", "recvbuf")
        scounts, sdispls = vchecked(scounts, sdispls, p, "sendbuf", cnp.PyArray_SIZE(sb))
        if overlap(sb, rb):
            _hooks.no_overlap(sb, rb, "sendbuf", "recvbuf")
        if vints_data(scounts)[me] != vints_data(rcounts)[me]:
            from aluminum_py.buffers import vself_counts
            vself_counts(scounts, rcounts, me)                            # raises
    if p > 1 and al_shm_a2a_cap(L.state.c.shm, esize, 1) < 1:
        _hooks.fail(f"algorithm 'shm': Alltoallv of {esize}-byte elements on {p} ranks needs "
                    f"slots of at least {al_shm_vheader(p) + (p - 1) * esize} bytes, the segment's "
                    f"have {L.state.c.shm.slot} (AL_SHM_SLOT_BYTES); use algorithm='mpi'")
    o = L.shm_op(K_SHM_ALLTOALLV, "alltoallv/shm",
                 rp if sb is None else <char*>cnp.PyArray_DATA(sb), rp,
                 vtotal_of(rcounts), code, esize, 0, 0)
    o.op.v.scounts = vints_data(scounts)
    o.op.v.sdispls = vints_data(sdispls)
    o.op.v.rcounts = vints_data(rcounts)
    o.op.v.rdispls = vints_data(rdispls)
    return L.run_shm(o, blocking, timeout, (sb, scounts, sdispls), (rb, rcounts, rdispls))


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
