# The v-collectives on host buffers: Allgatherv, Gatherv, Scatterv, Alltoallv and
# Reduce_scatter with per-rank counts, as MPI pass-through ops (passthrough.pxi: MPI_I*v).
# Each entry has one shape: build one op from arguments the host backend has checked
# (aluminum_py/backends/host.py, "v-collectives": buffers.vlayout / vno_overlap give the counts
# and displacements as int32 arrays of `size` entries), then launch it.  The op's keep holds the
# buffers and the count arrays (op.v points into them) until it completes.

cdef inline bint vcounts_ok(object c, int p) noexcept:
    """`c` is what a native v-op reads: a C-contiguous int32 ndarray of `p` entries (what
    buffers.vlayout returns)."""
    cdef cnp.ndarray a
    if type(c) is not cnp.ndarray:
        return False
    a = <cnp.ndarray>c
    return (cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_SIZE(a) == p)

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

cdef int64_t vtotal_of(object counts) except -1:
    """The sum of an int32 count array (vlayout's)."""
    cdef cnp.ndarray c = <cnp.ndarray?>counts
    cdef const int* p = <const int*>cnp.PyArray_DATA(c)
    cdef int64_t t = 0
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(c)):
        t += p[i]
    return t

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

def allgatherv(Launcher L, s, r, counts, displs, bint blocking, double timeout):
    """Allgatherv of the checked arrays: s (None: in place, this rank's block already at
    displs[rank] of r) to every rank's r at counts/displs.  None (blocking) or a Request."""
    cdef int me = L.state.c.rank
    cdef int64_t n = cnp.PyArray_SIZE(<cnp.ndarray?>s) if s is not None else counts[me]
    o = vop(L, K_ALLGATHERV, "allgatherv", s, r, n, None, None, counts, displs, 0, 0)
    return L.launch(o, blocking, timeout, "mpi")

def gatherv(Launcher L, s, r, counts, displs, int root, bint blocking, double timeout):
    """Gatherv onto `root`: every rank's s (at root None: in place, root's block already at
    displs[root] of r) into root's r at counts/displs (r, counts, displs: None off the root)."""
    cdef int64_t n = cnp.PyArray_SIZE(<cnp.ndarray?>s) if s is not None else counts[root]
    o = vop(L, K_GATHERV, "gatherv", s, r, n, None, None, counts, displs, root, 0)
    return L.launch(o, blocking, timeout, "mpi")

def scatterv(Launcher L, s, r, counts, displs, int root, bint blocking, double timeout):
    """Scatterv from `root`: block i of root's s (counts/displs) into rank i's r (all of it off
    the root; at root its first counts[root] elements, or None: in place)."""
    cdef int64_t n = counts[root] if L.state.c.rank == root else cnp.PyArray_SIZE(<cnp.ndarray?>r)
    o = vop(L, K_SCATTERV, "scatterv", s, r, n, counts, displs, None, None, root, 0)
    return L.launch(o, blocking, timeout, "mpi")

def alltoallv(Launcher L, s, scounts, sdispls, r, rcounts, rdispls, bint blocking,
              double timeout):
    """Alltoallv: block j of s (scounts/sdispls) to rank j, block i of r (rcounts/rdispls) from
    rank i; s None: in place (r's layout for both, scounts/sdispls None)."""
    cdef int64_t n = vtotal_of(scounts if s is not None else rcounts)   # what this rank sends
    o = vop(L, K_ALLTOALLV, "alltoallv", s, r, n, scounts, sdispls, rcounts, rdispls, 0, 0)
    return L.launch(o, blocking, timeout, "mpi")

def reduce_scatterv(Launcher L, s, r, counts, int rop, bint blocking, double timeout):
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


# ---- the v-layout's common case in C (buffers.vlayout / vno_overlap call these first): counts
# and displacements given as lists or tuples of plain ints.  Anything else (numpy integers, a
# wrong length, a negative or too large value, a block past the buffer, blocks out of order)
# returns the "not here" answer and the Python check decides, raising its error: every message
# stays written once, in buffers.py.

cdef cnp.ndarray int32_array(Py_ssize_t n):
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    return cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)

cdef bint fill_ints(object seq, int* out, Py_ssize_t size):
    """Copy `seq`, a list or tuple of `size` plain ints each in 0..MAX_COUNT, into `out`."""
    cdef Py_ssize_t i
    cdef object v
    if (type(seq) is not list and type(seq) is not tuple) or len(seq) != size:
        return False
    for i in range(size):
        v = seq[i]
        if type(v) is not int or not 0 <= v <= MAX_COUNT:
            return False
        out[i] = <int>v
    return True

def vlayout_common(counts, displs, int size, Py_ssize_t elems):
    """(counts, displs) as int32 arrays of `size` entries when both are lists/tuples of plain
    ints in range (displs None: packed in rank order) and every block lies inside a buffer of
    `elems` elements; else None."""
    cdef cnp.ndarray c = int32_array(size), d = int32_array(size)
    cdef int* cp = <int*>cnp.PyArray_DATA(c)
    cdef int* dp = <int*>cnp.PyArray_DATA(d)
    cdef Py_ssize_t i
    cdef int64_t at = 0
    if not fill_ints(counts, cp, size):
        return None
    if displs is None:
        for i in range(size):
            dp[i] = <int>at
            at += cp[i]
            if at > MAX_COUNT:
                return None
        return (c, d) if at <= elems else None
    if not fill_ints(displs, dp, size):
        return None
    for i in range(size):
        if <int64_t>dp[i] + cp[i] > elems:
            return None
    return c, d

def vblocks_in_order(cnp.ndarray counts, cnp.ndarray displs):
    """True when the non-empty blocks of the int32 layout lie in rank order without overlapping
    (the common receive layout); False: buffers.vno_overlap sorts and decides."""
    cdef const int* c = <const int*>cnp.PyArray_DATA(counts)
    cdef const int* d = <const int*>cnp.PyArray_DATA(displs)
    cdef Py_ssize_t i
    cdef int64_t end = 0
    for i in range(cnp.PyArray_SIZE(counts)):
        if c[i] == 0:
            continue
        if d[i] < end:
            return False
        end = <int64_t>d[i] + c[i]
    return True
