# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin NCCL binding: raw device pointers (ints), stream handles (ints), status checks.

NCCL is loaded at run time with dlopen (see ``load``); nothing is linked.  Every call releases
the GIL and is followed by one status check that raises through the Python layer
(``aluminum_py.nccl``), which also owns library discovery, dtype/op mapping and errors.
ncclInProgress (a nonblocking communicator's answer) is not an error: the calls return it, and
the Python layer then polls the communicator with ``comm_wait``.
"""
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free

cdef extern from "al_nccl.h" nogil:
    ctypedef int ncclResult_t
    ctypedef int ncclDataType_t
    ctypedef int ncclRedOp_t
    ctypedef struct ncclComm:
        pass
    ctypedef ncclComm* ncclComm_t
    ctypedef void* cudaStream_t
    ctypedef struct ncclUniqueId:
        char internal[128]
    ctypedef struct ncclConfig_t:
        size_t size
        unsigned int magic
        unsigned int version
        int blocking
        int cgaClusterSize
        int minCTAs
        int maxCTAs
    ncclComm_t al_nccl_slot_load(ncclComm_t*)
    ctypedef struct al_nccl_api:
        void* handle
        ncclResult_t (*GetVersion)(int*) noexcept nogil
        ncclResult_t (*GetUniqueId)(ncclUniqueId*) noexcept nogil
        ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) noexcept nogil
        ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) noexcept nogil
        ncclResult_t (*CommFinalize)(ncclComm_t) noexcept nogil
        ncclResult_t (*CommDestroy)(ncclComm_t) noexcept nogil
        ncclResult_t (*CommAbort)(ncclComm_t) noexcept nogil
        ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) noexcept nogil
        ncclResult_t (*CommCount)(ncclComm_t, int*) noexcept nogil
        ncclResult_t (*CommUserRank)(ncclComm_t, int*) noexcept nogil
        ncclResult_t (*CommCuDevice)(ncclComm_t, int*) noexcept nogil
        const char* (*GetErrorString)(ncclResult_t) noexcept nogil
        const char* (*GetLastError)(ncclComm_t) noexcept nogil
        ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) noexcept nogil
        ncclResult_t (*GroupStart)() noexcept nogil
        ncclResult_t (*GroupEnd)() noexcept nogil
    ctypedef ncclResult_t (*al_nccl_get_t)(ncclComm_t, ncclResult_t*) noexcept nogil
    ncclResult_t al_nccl_poll(al_nccl_get_t get, ncclComm_t comm, double timeout,
                              ncclResult_t* state, long* polls)
    int al_nccl_load(const char* path, al_nccl_api* api, char* err, size_t errlen)
    ncclConfig_t al_nccl_config_init()
    int NCCL_CONFIG_UNDEF_INT
    int NCCL_VERSION_CODE

cdef al_nccl_api api
cdef bint loaded = False
cdef object _check = None       # aluminum_py.nccl._check(code, comm_handle, what) -> raises

HEADER_VERSION_CODE = NCCL_VERSION_CODE
UNDEF_INT = NCCL_CONFIG_UNDEF_INT


def load(str path, checker):
    """dlopen `path` and resolve the symbols. Returns None or an error message."""
    global loaded, _check
    cdef char err[512]
    cdef bytes p = path.encode()
    _check = checker
    if loaded:
        return None
    if al_nccl_load(p, &api, err, sizeof(err)) != 0:
        return (<bytes>err).decode("utf-8", "replace")
    loaded = True
    return None


def is_loaded():
    return loaded


DEF IN_PROGRESS = 7    # ncclInProgress

cdef inline int check(ncclResult_t rc, ncclComm_t comm, str what) except -1:
    """Raise for an error; return 0 (ncclSuccess) or IN_PROGRESS."""
    if rc != 0 and rc != IN_PROGRESS:
        _check(rc, <uintptr_t>comm, what)
        return -1
    return rc


cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1

# A wait returns to Python at least every WAKE seconds to run the signal handlers, as every
# wait of the library does (ext/core/engine.pxi): a Ctrl-C during a nonblocking communicator's
# creation, split or ncclGroupEnd is raised within about WAKE, not when the peers arrive.
DEF WAKE = 0.05

cdef ncclResult_t poll_interruptible(al_nccl_get_t get, ncclComm_t comm, double timeout,
                                     ncclResult_t* state, long* polls) except? -1:
    """al_nccl_poll in slices of at most WAKE seconds, without the GIL, checking for signals
    between them (a handler's exception, e.g. KeyboardInterrupt, propagates; the communicator
    is left as it is).  Same results as al_nccl_poll; *polls counts every query."""
    cdef double left = timeout, step
    cdef long n = 0
    cdef ncclResult_t rc
    polls[0] = 0
    while True:
        step = WAKE if timeout < 0 or left > WAKE else left
        with nogil:
            rc = al_nccl_poll(get, comm, step, state, &n)
        polls[0] += n
        if rc != 0 or state[0] != IN_PROGRESS:
            return rc
        if timeout >= 0:
            left -= step
            if left <= 0:
                return rc
        PyErr_CheckSignals()


def comm_wait(uintptr_t comm, double timeout):
    """Poll ncclCommGetAsyncError, without the GIL, until the state is no longer
    ncclInProgress or `timeout` seconds passed (< 0: no limit). Returns the last state.
    Signal handlers run every WAKE seconds meanwhile (KeyboardInterrupt gets through)."""
    cdef ncclResult_t state = 0, rc
    cdef long polls = 0
    if not loaded:
        raise RuntimeError("comm_wait: libnccl.so.2 is not loaded")
    rc = poll_interruptible(api.CommGetAsyncError, <ncclComm_t>comm, timeout, &state, &polls)
    check(rc, <ncclComm_t>comm, "ncclCommGetAsyncError")
    return state


# al_nccl_poll with a scripted stand-in for ncclCommGetAsyncError (tests of the loop)
cdef long _script_left = 0
cdef ncclResult_t _script_final = 0, _script_rc = 0

cdef ncclResult_t _scripted_get(ncclComm_t comm, ncclResult_t* state) noexcept nogil:
    global _script_left
    if _script_rc != 0:
        return _script_rc
    if _script_left > 0:
        _script_left -= 1
        state[0] = IN_PROGRESS
    else:
        state[0] = _script_final
    return 0


def poll_scripted(long in_progress, int final, double timeout, int query_error=0):
    """Run the poll loop of comm_wait against a stand-in that answers ncclInProgress
    `in_progress` times, then `final` (or fails with `query_error`). Returns
    (call result, last state, polls)."""
    global _script_left, _script_final, _script_rc
    cdef ncclResult_t state = 0, rc
    cdef long polls = 0
    _script_left, _script_final, _script_rc = in_progress, final, query_error
    rc = poll_interruptible(_scripted_get, NULL, timeout, &state, &polls)
    return rc, state, polls


def error_string(int code):
    cdef const char* s = api.GetErrorString(<ncclResult_t>code)
    return s.decode("utf-8", "replace") if s != NULL else f"NCCL error {code}"


def last_error(uintptr_t comm):
    cdef const char* s
    if api.GetLastError == NULL:
        return ""
    s = api.GetLastError(<ncclComm_t>comm)
    return s.decode("utf-8", "replace") if s != NULL else ""


def get_version():
    cdef int v = 0
    check(api.GetVersion(&v), NULL, "ncclGetVersion")
    return v


def get_unique_id():
    cdef ncclUniqueId uid
    with nogil:
        rc = api.GetUniqueId(&uid)
    check(rc, NULL, "ncclGetUniqueId")
    return (<char*>uid.internal)[:128]


cdef ncclConfig_t make_config(blocking, cga_cluster_size, min_ctas, max_ctas):
    cdef ncclConfig_t c = al_nccl_config_init()
    if blocking is not None:
        c.blocking = 1 if blocking else 0
    if cga_cluster_size is not None:
        c.cgaClusterSize = cga_cluster_size
    if min_ctas is not None:
        c.minCTAs = min_ctas
    if max_ctas is not None:
        c.maxCTAs = max_ctas
    return c


def config_fields(blocking=None, cga_cluster_size=None, min_ctas=None, max_ctas=None):
    """The ncclConfig_t that comm_init_rank / comm_split pass to NCCL for these arguments."""
    cdef ncclConfig_t c = make_config(blocking, cga_cluster_size, min_ctas, max_ctas)
    return {"size": c.size, "blocking": c.blocking, "cgaClusterSize": c.cgaClusterSize,
            "minCTAs": c.minCTAs, "maxCTAs": c.maxCTAs}


def comm_init_rank(int nranks, bytes unique_id, int rank, blocking=None, cga_cluster_size=None,
                   min_ctas=None, max_ctas=None):
    """ncclCommInitRankConfig; returns (communicator handle, 0 or ncclInProgress)."""
    cdef ncclUniqueId uid
    cdef ncclComm_t comm = NULL
    cdef ncclConfig_t cfg = make_config(blocking, cga_cluster_size, min_ctas, max_ctas)
    cdef ncclResult_t rc
    if len(unique_id) != 128:
        raise ValueError(f"unique_id: expected 128 bytes, got {len(unique_id)}")
    memcpy(uid.internal, <char*>unique_id, 128)
    with nogil:
        rc = api.CommInitRankConfig(&comm, nranks, uid, rank, &cfg)
    return <uintptr_t>comm, check(rc, comm, "ncclCommInitRankConfig")


def comm_split(uintptr_t comm, int color, int key, blocking=None, cga_cluster_size=None,
               min_ctas=None, max_ctas=None):
    """ncclCommSplit; returns (slot, 0 or ncclInProgress). NCCL writes the new communicator
    into *slot when the split is complete: at once for a blocking parent, later (from NCCL's
    own thread) for a nonblocking one, whose split is complete once the parent's state is no
    longer ncclInProgress. So the slot is heap memory that outlives this call: read it with
    split_result once the split is complete (a slot whose split never completed is leaked,
    never freed: NCCL may still write it)."""
    cdef ncclComm_t* slot = <ncclComm_t*>malloc(sizeof(ncclComm_t))
    cdef ncclConfig_t cfg = make_config(blocking, cga_cluster_size, min_ctas, max_ctas)
    cdef ncclResult_t rc
    if slot == NULL:
        raise MemoryError()
    slot[0] = NULL
    with nogil:
        rc = api.CommSplit(<ncclComm_t>comm, color, key, slot, &cfg)
    try:
        rc = check(rc, <ncclComm_t>comm, "ncclCommSplit")
    except BaseException:
        free(slot)
        raise
    return <uintptr_t>slot, rc


def split_result(uintptr_t slot):
    """The communicator a completed split wrote into `slot` (from comm_split); frees the slot.
    A slot still NULL is not freed (0 is returned): NCCL may still write it from its thread."""
    cdef ncclComm_t* p = <ncclComm_t*>slot
    cdef uintptr_t h = <uintptr_t>al_nccl_slot_load(p)
    if h != 0:
        free(p)
    return h


def comm_finalize(uintptr_t comm):
    cdef ncclResult_t rc
    with nogil:
        rc = api.CommFinalize(<ncclComm_t>comm)
    return check(rc, <ncclComm_t>comm, "ncclCommFinalize")


def comm_destroy(uintptr_t comm):
    cdef ncclResult_t rc
    with nogil:
        rc = api.CommDestroy(<ncclComm_t>comm)
    check(rc, NULL, "ncclCommDestroy")


def comm_abort(uintptr_t comm):
    cdef ncclResult_t rc
    with nogil:
        rc = api.CommAbort(<ncclComm_t>comm)
    check(rc, NULL, "ncclCommAbort")


def comm_async_error(uintptr_t comm):
    cdef ncclResult_t err = 0
    check(api.CommGetAsyncError(<ncclComm_t>comm, &err), <ncclComm_t>comm, "ncclCommGetAsyncError")
    return err


ctypedef ncclResult_t (*comm_int_query)(ncclComm_t, int*) noexcept nogil


cdef int comm_int(comm_int_query query, uintptr_t comm, str what) except? -1:
    """One of NCCL's integer queries of a communicator (count, rank, device)."""
    cdef int v = 0
    check(query(<ncclComm_t>comm, &v), <ncclComm_t>comm, what)
    return v


def comm_count(uintptr_t comm):
    return comm_int(api.CommCount, comm, "ncclCommCount")


def comm_user_rank(uintptr_t comm):
    return comm_int(api.CommUserRank, comm, "ncclCommUserRank")


def comm_cu_device(uintptr_t comm):
    return comm_int(api.CommCuDevice, comm, "ncclCommCuDevice")


def allreduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op, uintptr_t comm,
              uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.AllReduce(<const void*>send, <void*>recv, count, dtype, op, <ncclComm_t>comm,
                           <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclAllReduce")


def broadcast(uintptr_t send, uintptr_t recv, size_t count, int dtype, int root, uintptr_t comm,
              uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.Broadcast(<const void*>send, <void*>recv, count, dtype, root, <ncclComm_t>comm,
                           <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclBroadcast")


def reduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op, int root,
           uintptr_t comm, uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.Reduce(<const void*>send, <void*>recv, count, dtype, op, root, <ncclComm_t>comm,
                        <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclReduce")


def allgather(uintptr_t send, uintptr_t recv, size_t sendcount, int dtype, uintptr_t comm,
              uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.AllGather(<const void*>send, <void*>recv, sendcount, dtype, <ncclComm_t>comm,
                           <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclAllGather")


def reduce_scatter(uintptr_t send, uintptr_t recv, size_t recvcount, int dtype, int op,
                   uintptr_t comm, uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.ReduceScatter(<const void*>send, <void*>recv, recvcount, dtype, op,
                               <ncclComm_t>comm, <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclReduceScatter")


def send(uintptr_t buf, size_t count, int dtype, int peer, uintptr_t comm, uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.Send(<const void*>buf, count, dtype, peer, <ncclComm_t>comm, <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclSend")


def recv(uintptr_t buf, size_t count, int dtype, int peer, uintptr_t comm, uintptr_t stream):
    cdef ncclResult_t rc
    with nogil:
        rc = api.Recv(<void*>buf, count, dtype, peer, <ncclComm_t>comm, <cudaStream_t>stream)
    return check(rc, <ncclComm_t>comm, "ncclRecv")


def group_start():
    check(api.GroupStart(), NULL, "ncclGroupStart")


def group_end():
    cdef ncclResult_t rc
    with nogil:
        rc = api.GroupEnd()
    return check(rc, NULL, "ncclGroupEnd")
