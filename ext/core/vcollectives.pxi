# The v-collectives on host buffers: Allgatherv, Gatherv, Scatterv, Alltoallv and
# Reduce_scatter with per-rank counts, as MPI pass-through ops (passthrough.pxi: MPI_I*v).
# Their entries (HostCollectives in collectives.pxi) build one op from checked arguments (counts
# and displacements as int32 arrays of `size` entries) and launch it.  The op's keep holds the
# buffers and the count arrays (op.v points into them) until it completes.

cdef int* vints(object a, int size, str name) except? NULL:
    """The data of `a`, an int32 array of `size` entries from buffers.vlayout; NULL for None."""
    if a is None:
        return NULL
    if vcounts_ok(a, size):
        return <int*>cnp.PyArray_DATA(<cnp.ndarray>a)
    _hooks.not_vlayout(a, name, size)          # raises
    return NULL

cdef inline char* vdata(object a) except? NULL:
    """The data address of the checked ndarray `a`; NULL for None (in place / not used)."""
    if a is None:
        return NULL
    return <char*>cnp.PyArray_DATA(<cnp.ndarray?>a)

cdef NativeOp vop(Launcher L, int kind, str name, s, r, int64_t count, sc, sd, rc, rd,
                  int root, int rop):
    """One op of `kind` on the checked arrays s (None: in place, MPI_IN_PLACE) and r (None: not
    used here), `count` elements of this rank's own message, per-rank counts and displacements
    (None where MPI does not read them)."""
    cdef cnp.ndarray a = <cnp.ndarray?>(s if s is not None else r)
    cdef int p = L.state.c.size
    cdef int code = dtype_code_of(a, "sendbuf" if s is not None else "recvbuf")
    cdef NativeOp o = NativeOp.__new__(NativeOp)
    init_op(o.op, L.state.c, kind, vdata(s), vdata(r), count, code, <int>cnp.PyArray_ITEMSIZE(a),
            rop)
    o.op.mpi.root = root
    o.op.v.scounts = vints(sc, p, "sendcounts")
    o.op.v.sdispls = vints(sd, p, "sdispls")
    o.op.v.rcounts = vints(rc, p, "recvcounts")
    o.op.v.rdispls = vints(rd, p, "rdispls")
    o.name = name
    o.keep = (L.state, None, (s, r, sc, sd, rc, rd))
    return o

cdef object vrow(int p, int at, int64_t n):
    """AL_CHECK's row of what a rank sends to or receives from each rank of `p`: -1 (nothing
    MPI reads) except `n` at rank `at` (a rooted v-collective)."""
    row = _np.full(p, -1, dtype=_np.int64)
    row[at] = n
    return row

cdef object launch_reduce_scatterv(Launcher L, s, r, counts, int rop, bint blocking,
                                   double timeout):
    """Reduce_scatter with per-rank counts (MPI_Ireduce_scatter): rank i gets counts[i]
    elements of the reduction of every rank's s (sum(counts) elements) in r; s None: in place,
    the data in r, the result in its first counts[rank] elements.  AVG divides the result."""
    cdef int me = L.state.c.rank
    cdef NativeOp o = vop(L, K_REDUCE_SCATTERV, "reduce_scatterv", s, r, counts[me], None, None,
                          counts, None, 0, rop)
    o.op.result.buf = o.op.rbuf
    o.op.result.count = o.op.count
    if rop == AL_AVG:
        o.op.result.avg_div = <double>L.state.c.size
    return L.launch(o, blocking, timeout, "mpi")
