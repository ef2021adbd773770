# Messages (mpi4py's msgbuffer.pxi): one parser per argument shape turns a call's buffers into
# an `al_msg` (data pointers, element count, dtype code, element size, in place or not) before
# any collective entry (collectives.pxi) runs, so the entries never look at a buffer.
#
#   parse_reduce   sendbuf / recvbuf / in place of a reduction (allreduce, reduce, and the
#                  block reduce_scatter: `blocks` = size)
#   parse_blocks   equal blocks, one per rank (allgather, alltoall; gather and scatter at root)
#   parse_one      one whole buffer (bcast, send, recv; gather's send side, scatter's receive
#                  side off root)
#   parse_pair     two separate buffers of one dtype (sendrecv)
#   parse_vgather  a v-message gathered into recvbuf's layout (allgatherv)
#   parse_alltoallv  two v-messages, each with its layout (alltoallv)
#   parse_vlayout  per-rank counts and displacements (the v-forms)
#   vsplit         mpi4py's usual v-message forms split into buffer, counts and displs
#
# mpi4py's in-place idiom is read here, once for every backend: MPI.IN_PLACE as sendbuf (as
# recvbuf for Scatter at the root) is the in-place form, the data in the other buffer
# (in_place_form); mpi4py's other buffer-protocol constants, and IN_PLACE anywhere else, reach
# _hooks.as_array, which refuses them by name: they are never read as (empty) data.
#
# Every check calls the Python helpers in `_hooks` (buffers.py, backends/host.py's _Hooks) for
# anything unusual, so each error message is written once, in Python.  A parser fills the
# message's `s` and `r` with borrowed references to the arrays and returns what keeps them
# alive: None when they are the call's own arguments (alive for the call), else the views it
# made (a buffer-protocol object seen as an ndarray); the caller holds that until its op is
# built (the op's `keep` then holds the arrays).

from cpython.ref cimport PyObject

DEF MAX_COUNT = 2147483647      # elements per operation: MPI's int count (buffers.MAX_COUNT)

ctypedef struct al_msg:
    char* sp            # send data; NULL: none, or MPI_IN_PLACE (inplace set)
    char* rp            # receive data; NULL: none
    int64_t count       # elements: of the whole buffer, or of one block (parse_blocks)
    int code            # dtype code
    int esize           # bytes per element
    bint inplace        # the result replaces the input in one buffer
    PyObject* s         # the send-side array (borrowed), or NULL
    PyObject* r         # the receive-side array (borrowed), or NULL

cdef inline object in_place_data(recvbuf):
    """sendbuf is MPI.IN_PLACE: the data and the result are in `recvbuf`, which must be given."""
    if recvbuf is None or recvbuf is _IN_PLACE:
        _hooks.required("recvbuf", "with sendbuf=MPI.IN_PLACE (the data and the result are in "
                        "recvbuf)")                                      # raises
    return recvbuf

def in_place_form(sendbuf, recvbuf):
    """mpi4py's in-place idiom in this library's form: (recvbuf, None) when sendbuf is
    MPI.IN_PLACE (the data in recvbuf; recvbuf None then raises, naming it), else the
    arguments as given.  The GPU backend's calls take it; the host entries read it in their
    parsers."""
    if sendbuf is _IN_PLACE:
        return in_place_data(recvbuf), None
    return sendbuf, recvbuf

cdef inline cnp.ndarray as_array(obj, str name, bint writable):
    cdef cnp.ndarray a
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
        if cnp.PyArray_IS_C_CONTIGUOUS(a) and (not writable or cnp.PyArray_ISWRITEABLE(a)):
            return a
    return _hooks.as_array(obj, name, writable)

cdef inline int dtype_code_of(cnp.ndarray a, str name) except -1:
    code = _dtype_codes.get(<object>cnp.PyArray_DESCR(a))
    if code is None:
        # raises the unsupported-dtype error, or adds a dtype numpy learnt after import
        _hooks.as_array(a, name, False)
        code = _dtype_codes[<object>cnp.PyArray_DESCR(a)]
    return code

cdef inline void same_dtype_of(cnp.ndarray s, cnp.ndarray r, str sname, str rname) except *:
    """Raise unless r has s's dtype (r's own unsupported dtype first, as buffers.as_array)."""
    if cnp.PyArray_DESCR(r) != cnp.PyArray_DESCR(s) and r.dtype != s.dtype:
        _hooks.as_array(r, rname, False)
        _hooks.same_dtype(s, r, sname, rname)

cdef inline bint overlap(cnp.ndarray s, cnp.ndarray r) noexcept:
    """s and r share memory (C-contiguous: their byte ranges intersect; np.may_share_memory)."""
    cdef char* slo = <char*>cnp.PyArray_DATA(s)
    cdef char* rlo = <char*>cnp.PyArray_DATA(r)
    return (cnp.PyArray_NBYTES(s) > 0 and cnp.PyArray_NBYTES(r) > 0
            and slo < rlo + cnp.PyArray_NBYTES(r) and rlo < slo + cnp.PyArray_NBYTES(s))

cdef inline int op_code(op) except -1:
    """The reduction op code of `op` (al.SUM ..., a name, an mpi4py op): the one place it is
    computed."""
    if type(op) is _Op:
        return op.code
    return _hooks.as_op(op).code

cdef inline void check_op_for(int opcode, int code, cnp.ndarray a) except *:
    """Raise unless the op `opcode` is defined for dtype `code` (the capability table)."""
    if opcode < 0 or opcode >= 16 or not _valid[code][opcode]:
        _hooks.check_op(opcode, code, a.dtype)                        # raises

cdef inline void check_count(int64_t n, str name) except *:
    if n > MAX_COUNT:
        _hooks.too_many(n, name)                                      # raises

cdef inline int check_blocks(cnp.ndarray a, str name, int p) except -1:
    """Raise unless `a` holds a whole number of blocks, one per rank of `p`."""
    if cnp.PyArray_SIZE(a) % p:
        _hooks.divisible(a, name, p)                                  # raises
    return 0

cdef inline object msg_obj(PyObject* p):
    return None if p == NULL else <object>p

cdef inline object msg_hold(al_msg* m, a, b):
    """What keeps the message's arrays alive: None when they are the arguments `a`, `b`."""
    if ((m.s == NULL or <object>m.s is a or <object>m.s is b)
            and (m.r == NULL or <object>m.r is a or <object>m.r is b)):
        return None
    return (msg_obj(m.s), msg_obj(m.r))

cdef inline void msg_set(al_msg* m, cnp.ndarray s, cnp.ndarray r, int64_t count, int code) noexcept:
    """The pointers and arrays of s and r (either None), `count` elements of dtype `code`."""
    cdef cnp.ndarray a = s if s is not None else r
    m.s = NULL if s is None else <PyObject*>s
    m.r = NULL if r is None else <PyObject*>r
    m.sp = NULL if s is None else <char*>cnp.PyArray_DATA(s)
    m.rp = NULL if r is None else <char*>cnp.PyArray_DATA(r)
    m.count = count
    m.code = code
    m.esize = <int>cnp.PyArray_ITEMSIZE(a)
    m.inplace = False

cdef object parse_reduce(al_msg* m, sendbuf, recvbuf, int opcode, int blocks, str what,
                         str count_name):
    """A reduction's message: sendbuf, and recvbuf (None: in place, the result in sendbuf).
    `blocks`: 1 (allreduce, reduce: recvbuf needs one element per sendbuf element) or the
    size (block reduce_scatter: sendbuf holds `blocks` blocks, recvbuf needs one; `count` is
    a block's).  recvbuf at sendbuf's own address is in place too; any other overlap is an
    error.  `count_name`: the argument named by the count limit's error."""
    cdef cnp.ndarray s, r
    cdef int code
    cdef Py_ssize_t n
    cdef str sname = "sendbuf"
    if sendbuf is _IN_PLACE:                    # mpi4py's in-place form: the data in recvbuf
        sendbuf, recvbuf, sname = in_place_data(recvbuf), None, "recvbuf"
    s = as_array(sendbuf, sname, recvbuf is None)
    code = dtype_code_of(s, sname)
    n = cnp.PyArray_SIZE(s)
    if blocks > 1:
        check_blocks(s, sname, blocks)
        check_op_for(opcode, code, s)
        n //= blocks
        check_count(n, count_name)
    if recvbuf is None:
        r = s
    else:
        r = as_array(recvbuf, "recvbuf", True)
        same_dtype_of(s, r, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(r) < n:
            _hooks.at_least(r, n, "recvbuf", what)
    msg_set(m, s, r, n, code)
    if recvbuf is None:
        m.inplace = True
    elif cnp.PyArray_SIZE(s) and cnp.PyArray_SIZE(r) and m.sp == m.rp:
        m.inplace = True
    elif overlap(s, r):
        _hooks.no_partial_overlap(s, r, "sendbuf", "recvbuf")        # raises
    if blocks == 1:
        check_op_for(opcode, code, s)
        check_count(n, count_name)
    return msg_hold(m, sendbuf, recvbuf)

cdef object parse_blocks(al_msg* m, sendbuf, recvbuf, int p, int blocks, str what):
    """Equal blocks, one per rank of `p`; `count` is a block's.  recvbuf None: in place,
    sendbuf holds the p blocks (m.s is None, m.r that buffer).  Else sendbuf and a separate
    recvbuf of `blocks` times sendbuf's length: `blocks` = p (allgather, gather: sendbuf is
    one block) or 1 (alltoall: sendbuf holds p blocks)."""
    cdef cnp.ndarray s, r
    cdef int code
    cdef Py_ssize_t n
    cdef str sname = "sendbuf"
    if sendbuf is _IN_PLACE:                    # mpi4py's in-place form: the data in recvbuf
        sendbuf, recvbuf, sname = in_place_data(recvbuf), None, "recvbuf"
    if recvbuf is None:
        r = as_array(sendbuf, sname, True)
        code = dtype_code_of(r, sname)
        check_blocks(r, sname, p)
        n = cnp.PyArray_SIZE(r) // p
        msg_set(m, None, r, n, code)
        m.inplace = True
    else:
        s = as_array(sendbuf, "sendbuf", False)
        code = dtype_code_of(s, "sendbuf")
        n = cnp.PyArray_SIZE(s)
        if blocks == 1:
            check_blocks(s, "sendbuf", p)
        r = as_array(recvbuf, "recvbuf", True)
        same_dtype_of(s, r, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(r) < blocks * n:
            _hooks.at_least(r, blocks * n, "recvbuf", what)
        if overlap(s, r):
            _hooks.no_overlap(s, r, "sendbuf", "recvbuf")            # raises
        msg_set(m, s, r, n if blocks > 1 else n // p, code)
    check_count(m.count, "count")
    return msg_hold(m, sendbuf, recvbuf)

cdef object parse_scatter(al_msg* m, sendbuf, recvbuf, int p):
    """Scatter at root: sendbuf holds p blocks (`count` is one), recvbuf one block, separate
    from it (None or MPI.IN_PLACE: in place, root's block stays in sendbuf; m.r is None)."""
    cdef cnp.ndarray s = as_array(sendbuf, "sendbuf", False), r = None
    if recvbuf is _IN_PLACE:
        recvbuf = None
    cdef int code = dtype_code_of(s, "sendbuf")
    cdef Py_ssize_t n
    check_blocks(s, "sendbuf", p)
    n = cnp.PyArray_SIZE(s) // p
    if recvbuf is not None:
        r = as_array(recvbuf, "recvbuf", True)
        same_dtype_of(s, r, "sendbuf", "recvbuf")
        if cnp.PyArray_SIZE(r) < n:
            _hooks.at_least(r, n, "recvbuf", "len(sendbuf) // size")
        if overlap(s, r):
            _hooks.no_overlap(s, r, "sendbuf", "recvbuf")            # raises
    msg_set(m, s, r, n, code)
    m.inplace = recvbuf is None
    check_count(n, "count")
    return msg_hold(m, sendbuf, recvbuf)

cdef int parse_rank(CommState cs, value, str name) except -1:
    """`value` as a rank of the communicator (else rank_arg's error naming `name`)."""
    cdef Py_ssize_t v = -1
    if type(value) is int:
        try:
            v = value
        except OverflowError:
            v = -1
        if 0 <= v < cs.c.size:
            return <int>v
    return _hooks.rank_arg(value, name, cs.c.size)

cdef int parse_tag(tag, bint allow_any, str name="tag") except? -2:
    """A point-to-point tag, 0..32767 (MPI.ANY_TAG where `allow_any`: receives); `name` is
    the argument's (tag, sendtag, recvtag)."""
    if type(tag) is int and 0 <= tag <= 32767:
        return <int>tag
    return _hooks.tag_arg(tag, allow_any, name)

cdef int parse_source(CommState cs, source) except? -2:
    """A receive's source: a rank, or MPI.ANY_SOURCE."""
    if type(source) is int and 0 <= source < cs.c.size:
        return <int>source
    return _hooks.source_arg(source, cs.c.size)

cdef object parse_one(al_msg* m, buf, str name, bint writable, bint receive, str count_name):
    """One whole buffer: sent from (receive False: m.s) or received into (m.r)."""
    cdef cnp.ndarray b = as_array(buf, name, writable)
    cdef int code = dtype_code_of(b, name)
    if receive:
        msg_set(m, None, b, cnp.PyArray_SIZE(b), code)
    else:
        msg_set(m, b, None, cnp.PyArray_SIZE(b), code)
    check_count(m.count, count_name)
    return msg_hold(m, buf, None)

cdef object parse_pair(al_msg* m, sendbuf, recvbuf, str hint):
    """Two separate buffers of one dtype, whole: `count` is sendbuf's (recvbuf's: its size)."""
    cdef cnp.ndarray s = as_array(sendbuf, "sendbuf", False)
    cdef int code = dtype_code_of(s, "sendbuf")
    cdef cnp.ndarray r = as_array(recvbuf, "recvbuf", True)
    same_dtype_of(s, r, "sendbuf", "recvbuf")
    if overlap(s, r):
        _hooks.no_overlap(s, r, "sendbuf", "recvbuf", hint)          # raises
    msg_set(m, s, r, cnp.PyArray_SIZE(s), code)
    check_count(m.count, "sendbuf")
    check_count(cnp.PyArray_SIZE(r), "recvbuf")
    return msg_hold(m, sendbuf, recvbuf)


# ---- v-messages: a buffer and its per-rank layout (counts and displacements in elements, as
# int32 arrays of `size` entries that the op's al_op.v points into)

cdef inline bint vcounts_ok(object c, int p) noexcept:
    """`c` is what a native v-op reads: a C-contiguous int32 ndarray of `p` entries (what
    buffers.vlayout returns)."""
    cdef cnp.ndarray a
    if type(c) is not cnp.ndarray:
        return False
    a = <cnp.ndarray>c
    return (cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_SIZE(a) == p)


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
    return vlayout_c(counts, displs, size, elems)

cdef object vlayout_c(counts, displs, int size, Py_ssize_t elems):
    """vlayout_common's work."""
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
    return blocks_in_order(counts, displs)

cdef bint blocks_in_order(cnp.ndarray counts, cnp.ndarray displs) noexcept:
    """vblocks_in_order's work."""
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


cdef inline int* vints_data(object a) noexcept:
    return <int*>cnp.PyArray_DATA(<cnp.ndarray>a)

cdef tuple parse_vlayout(counts, displs, int p, str name, Py_ssize_t elems, bint receive):
    """(counts, displs) as int32 arrays of `p` entries (displs None: packed in rank order), every
    block inside a buffer of `elems` elements; `receive`: no element written twice.  Lists of
    plain ints, and vlayout's own arrays, are checked here; anything else, and every error, in
    buffers.vlayout / vno_overlap (`name`: the buffer the layout is of)."""
    cdef const int* c
    cdef const int* d
    cdef int i
    cdef object lay = None
    if vcounts_ok(counts, p) and vcounts_ok(displs, p):
        c = <const int*>cnp.PyArray_DATA(<cnp.ndarray>counts)
        d = <const int*>cnp.PyArray_DATA(<cnp.ndarray>displs)
        for i in range(p):
            if c[i] < 0 or d[i] < 0 or <int64_t>d[i] + c[i] > elems:
                break
        else:
            lay = (counts, displs)
    if lay is None:
        lay = vlayout_c(counts, displs, p, elems)
    if lay is None:
        lay = _hooks.vlayout(counts, displs, p, name, elems)             # converts or raises
    if receive and not blocks_in_order(<cnp.ndarray>lay[0], <cnp.ndarray>lay[1]):
        _hooks.vno_overlap(lay[0], lay[1], name)                         # raises if they overlap
    return lay

cdef tuple parse_vgather(al_msg* m, sendbuf, recvbuf, counts, displs, int p, int me, str what):
    """A gather into a v-layout (Allgatherv): sendbuf holding exactly counts[me] elements (None:
    in place, this rank's block already at recvbuf[displs[me]:]), recvbuf and its receive
    layout, sharing no memory with sendbuf.  `count` is this rank's; returns (counts, displs,
    hold): `hold` (msg_hold's) keeps the message's arrays alive, so the caller keeps it until
    the message is used."""
    cdef cnp.ndarray s = None, r
    cdef int code
    cdef int64_t n
    if sendbuf is not None:
        s = as_array(sendbuf, "sendbuf", False)
        dtype_code_of(s, "sendbuf")
    r = as_array(recvbuf, "recvbuf", True)
    code = dtype_code_of(r, "recvbuf")
    if s is not None:
        same_dtype_of(s, r, "sendbuf", "recvbuf")
    rc, rd = parse_vlayout(counts, displs, p, "recvbuf", cnp.PyArray_SIZE(r), True)
    n = vints_data(rc)[me]
    if s is not None:
        if cnp.PyArray_SIZE(s) != n:
            _hooks.vsame_count(s, n, "sendbuf", f"recvcounts[{me}] (this rank's block)")
        if overlap(s, r):
            _hooks.no_overlap(s, r, "sendbuf", "recvbuf", f"pass sendbuf=None (or MPI.IN_PLACE) "
                              f"for an in-place {what}")                # raises
    msg_set(m, s, r, n, code)
    m.inplace = s is None
    return rc, rd, msg_hold(m, sendbuf, recvbuf)

cpdef tuple vsplit(spec, counts=None, displs=None):
    """(buf, counts, displs) of a v-message in one of mpi4py's usual forms: ``[buf, counts,
    displs]`` or ``[buf, (counts, displs)]`` with no keyword, or a buffer that is no list or
    tuple with the keywords `counts` and `displs` (either None where not given).  None for any
    other list or tuple (buffers.vspec splits it, and says what is wrong).  The buffer is not
    looked at."""
    cdef Py_ssize_t n
    if type(spec) is list or type(spec) is tuple:
        if counts is not None or displs is not None:
            return None
        n = len(<object>spec)
        if n == 3:
            return (spec[0], spec[1], spec[2])
        if n == 2:
            c = spec[1]
            if type(c) is tuple and len(<tuple>c) == 2 and (
                    type(c[0]) is list or type(c[0]) is tuple or type(c[0]) is cnp.ndarray):
                return (spec[0], c[0], c[1])
        return None
    if isinstance(spec, (list, tuple)):
        return None
    return (spec, counts, displs)

cdef tuple parse_alltoallv(al_msg* m, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls,
                           int p, int me):
    """Alltoallv's two v-messages: sendbuf with its layout (None: in place, recvbuf's layout
    for both sides, and no send layout may be given), recvbuf with its receive layout; the
    buffers apart; what this rank sends itself is what it receives from itself.  `count` is
    what this rank sends in all; returns (scounts, sdispls, rcounts, rdispls, hold), the send
    layout None in place, and `hold` as parse_vgather's."""
    cdef cnp.ndarray s = None, r
    cdef int code
    sc = sd = None
    if sendbuf is not None:
        s = as_array(sendbuf, "sendbuf", False)
        dtype_code_of(s, "sendbuf")
    r = as_array(recvbuf, "recvbuf", True)
    code = dtype_code_of(r, "recvbuf")
    if s is not None:
        same_dtype_of(s, r, "sendbuf", "recvbuf")
    elif scounts is not None or sdispls is not None:
        _hooks.in_place_layout()                                        # raises
    rc, rd = parse_vlayout(rcounts, rdispls, p, "recvbuf", cnp.PyArray_SIZE(r), True)
    if s is not None:
        sc, sd = parse_vlayout(scounts, sdispls, p, "sendbuf", cnp.PyArray_SIZE(s), False)
        if overlap(s, r):
            _hooks.no_overlap(s, r, "sendbuf", "recvbuf", "pass sendbuf=None (or MPI.IN_PLACE) "
                              "for an in-place Alltoallv")              # raises
        if vints_data(sc)[me] != vints_data(rc)[me]:
            _hooks.vself_counts(sc, rc, me)                             # raises
    msg_set(m, s, r, vtotal_of(rc if sc is None else sc), code)
    m.inplace = s is None
    return sc, sd, rc, rd, msg_hold(m, sendbuf, recvbuf)

cdef int64_t vtotal_of(object counts) except -1:
    """The sum of an int32 count array (vlayout's)."""
    cdef cnp.ndarray c = <cnp.ndarray?>counts
    cdef const int* p = <const int*>cnp.PyArray_DATA(c)
    cdef int64_t t = 0
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(c)):
        t += p[i]
    return t
