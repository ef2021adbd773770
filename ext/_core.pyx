# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Native core of aluminum_py: op state machines and the progress engine.

Everything below the Python-visible classes runs without the GIL:

* ``al_op`` is the state of one operation.  ``op_start`` and ``op_step`` are
  non-blocking; the same two functions drive an op to completion in the
  caller (blocking calls, GIL released) and in the progress engine thread
  (nonblocking calls).  One explicit ``phase`` field, no boolean soup.
* Our own allreduce algorithms run as a *schedule* (``al_step`` array built in
  Python by ``aluminum_py.schedules``): per step an optional local copy, an
  optional receive (plain, or followed by a reduction) and an optional send.
* MPI pass-through ops (the MPI library's own collectives and point-to-point)
  start with the ``MPI_I*`` call and are polled with ``MPI_Testall``.
* The engine thread is a pthread whose loop is pure ``nogil`` Cython calling
  the MPI C API through ``mpi4py.libmpi``.  Completion is an atomic flag
  (release store, acquire load); waiters sleep on a condition variable.
"""

from libc.stdlib cimport malloc, free, calloc, getenv
from libc.string cimport memcpy, memset, strncpy
from libc.stdint cimport int64_t, intptr_t, uint32_t, uintptr_t
from posix.time cimport timespec, clock_gettime, CLOCK_REALTIME
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS
cimport mpi4py.libmpi as mpi
cimport numpy as cnp
from mpi4py.libmpi cimport MPI_Comm, MPI_Request, MPI_Datatype, MPI_Op

cdef extern from "al_reduce.h" nogil:
    int al_reduce(int dtype, int op, void* out, const void* a, const void* b, size_t n)
    int al_scale_div(int dtype, void* buf, size_t n, double divisor)
    int al_reduce_div(int dtype, void* out, const void* a, const void* b, size_t n, double divisor)
    int al_load_acquire(const int* p)
    void al_store_release(int* p, int v)
    int al_fetch_add(int* p, int v)
    int al_load_seqcst(const int* p)
    void al_store_seqcst(int* p, int v)
    double al_now()
    int AL_FLOAT16, AL_BFLOAT16, AL_NDTYPES, AL_NOPS
    int AL_SUM, AL_PROD, AL_MIN, AL_MAX, AL_LAND, AL_LOR, AL_LXOR, AL_BAND, AL_BOR, AL_BXOR, AL_AVG

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t*, void*, void* (*)(void*) noexcept nogil, void*)
    int pthread_join(pthread_t, void**)
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_cond_init(pthread_cond_t*, void*)
    int pthread_cond_signal(pthread_cond_t*)
    int pthread_cond_broadcast(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const timespec*)

cdef extern from "al_device.h" nogil:
    ctypedef struct al_device:
        void* ctx
        int (*memcpy_async)(void*, void*, const void*, size_t, void*) noexcept nogil
        int (*event_create)(void*, void**) noexcept nogil
        int (*event_record)(void*, void*, void*) noexcept nogil
        int (*event_query)(void*, void*) noexcept nogil
        int (*event_destroy)(void*, void*) noexcept nogil
        int (*wait_value32)(void*, void*, uint32_t*, uint32_t) noexcept nogil
        int (*write_value32)(void*, void*, uint32_t*, uint32_t) noexcept nogil
        int (*host_alloc)(void*, size_t, void**) noexcept nogil
        int (*host_free)(void*, void*) noexcept nogil
        int (*synchronize)(void*) noexcept nogil
        int (*stream_create)(void*, void**) noexcept nogil
        int (*stream_destroy)(void*, void*) noexcept nogil
        int (*stream_wait_event)(void*, void*, void*) noexcept nogil
        void (*describe)(void*, int, char*, size_t) noexcept nogil
        size_t pool_cached
        long pool_allocs, pool_reuses, pool_out
    ctypedef struct al_cpu_trace:
        int kind
        double t
        const void* p
    ctypedef struct al_cpu_ctx:
        al_cpu_trace* trace
        long ntrace
        int strict, queues, nstreams
        long pinned_live, sync_waits
    ctypedef struct al_cpu_stream:
        long executed
    int al_pinned_get(al_device*, size_t, void**)
    void al_pinned_put(al_device*, void*)
    int al_pinned_release(al_device*)
    al_device* al_cpu_device_new_strict(int strict, int queues)
    al_device* al_cuda_device_new(int ordinal, char* err, size_t errlen)
    int al_cuda_current_device(int* ordinal, char* err, size_t errlen)
    int al_cuda_device_count(int* count, char* err, size_t errlen)
    void al_cuda_mark_engine_thread()
    int al_cpu_stream_sync(al_cpu_stream*, double)
    int al_cpu_memcpy_async(void*, void*, const void*, size_t, void*)
    int al_cpu_delay(void*, double)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<stdio.h>" nogil:
    int snprintf(char*, size_t, const char*, ...)

# ---------------------------------------------------------------------------
# Constants shared with Python (KINDS and RECV_MODES below; schedules.py mirrors the modes)

# op kinds
cdef enum:
    K_SCHEDULE = 0
    K_ALLREDUCE = 1
    K_REDUCE = 2
    K_REDUCE_SCATTER = 3
    K_ALLGATHER = 4
    K_BCAST = 5
    K_ALLTOALL = 6
    K_GATHER = 7
    K_SCATTER = 8
    K_BARRIER = 9
    K_SEND = 10
    K_RECV = 11
    K_SENDRECV = 12
    K_HOST_TRANSFER = 13
    K_NKINDS = 14

# phases
cdef enum:
    PH_NEW = 0
    PH_RUNNING = 1
    PH_DONE = 2

# schedule step receive modes and buffer selectors
cdef enum:
    RECV_NONE = 0
    RECV_INTO = 1          # receive into recvbuf[off]
    RECV_TMP_REDUCE = 2    # receive into scratch; recvbuf[off] = SRC[off] op scratch
    RECV_INTO_REDUCE = 3   # receive into recvbuf[off]; recvbuf[off] = sendbuf[off] op recvbuf[off]
    FROM_SEND = 0
    FROM_RECV = 1

# op.err of an op abandoned by the engine at its hang-timeout deadline (Python: TimeoutError)
DEF AL_ERR_TIMEOUT = -2
ERR_TIMEOUT = AL_ERR_TIMEOUT

KIND_NAMES = ("schedule", "allreduce", "reduce", "reduce_scatter", "allgather", "bcast",
              "alltoall", "gather", "scatter", "barrier", "send", "recv", "sendrecv",
              "host_transfer")
KINDS = {name: i for i, name in enumerate(KIND_NAMES)}
RECV_MODES = {"none": RECV_NONE, "into": RECV_INTO, "tmp_reduce": RECV_TMP_REDUCE,
              "into_reduce": RECV_INTO_REDUCE}

ctypedef struct al_step:
    int send_peer        # -1: no send
    int send_src         # FROM_SEND / FROM_RECV
    int64_t send_off     # elements
    int64_t send_cnt
    int recv_peer        # -1: no receive
    int recv_mode
    int reduce_src       # RECV_TMP_REDUCE: FROM_SEND / FROM_RECV
    int64_t recv_off
    int64_t recv_cnt
    int64_t copy_off     # local copy sendbuf -> recvbuf before communicating
    int64_t copy_cnt
    int owned            # 1: the received region is now this rank's final block (AVG divides it)

ctypedef struct al_comm:
    MPI_Comm coll        # internal traffic: collectives and our algorithms
    MPI_Comm p2p         # the user's Send/Recv
    int rank
    int size
    int pending          # ops handed to the engine and not yet complete (atomic)

ctypedef struct al_op:
    int kind
    int phase
    int blocking         # MPI pass-through: use the blocking MPI call (see Launcher.launch)
    int counted          # counted in comm.pending
    al_comm* comm
    int tag
    char* sbuf           # NULL: in place (MPI_IN_PLACE)
    char* rbuf
    char* tmp
    size_t tmpbytes
    int64_t count        # elements (see the per-kind comment in op_start)
    int64_t count2
    int esize
    int dtype
    int rop
    MPI_Datatype mtype
    MPI_Op mop
    int root             # root, or peer for send/recv, or dest for sendrecv
    int peer2            # source for sendrecv
    al_step* steps
    int nsteps
    int cur
    int posted
    MPI_Request reqs[2]
    mpi.MPI_Status stats[2]
    int nreqs
    double avg_div       # > 0: divide avg_buf[:avg_cnt] by it at the end (AVG), or each
                         # owned block after its step when avg_in_steps
                         # avg_buf[:avg_cnt] is this rank's result region (reductions only)
    char* avg_buf
    int64_t avg_cnt
    int avg_in_steps     # the schedule divides its owned blocks (Step.owned), not op_finish
    int done             # atomic completion flag
    double t_start       # al_now() when the op started (engine or caller) and completed;
    double t_done        # written before `done` is released, read after it is acquired
    int err              # 0, an MPI error code, or -1 (library error)
    char errmsg[256]
    al_op* next
    # host transfer (K_HOST_TRANSFER): device copies around an inner host allreduce
    al_device* dev
    void* stream
    char* pinned         # host staging buffer (count * esize bytes) + three words, from the
                         # device's pinned pool (al_pinned_get/put):
    uint32_t* flag       # flag[0]: the stream waits until it is >= 1 before copying back;
                         # flag[1], flag[2]: the stream writes 1 once the copy to pinned memory
                         # (then the copy back) has completed. The engine polls them with plain
                         # loads: it makes no driver call, so a thread blocked in the driver
                         # (a pageable copy on the waiting stream) can never block it
    al_op* inner         # the host algorithm, in place on `pinned`
    int ht_phase         # 0 wait D2H, 1 host algorithm, 2 release stream, 3 wait H2D
    double ht_times[4]   # when each phase ended (al_now), for ordering checks
    double hang          # > 0: AL_HANG_TIMEOUT (s) for the host part, from the call
    double deadline      # when the host part is abandoned (hang > 0)

# ---------------------------------------------------------------------------
# Scratch buffers: a cache of freed buffers per power-of-two size class, so that a steady
# stream of ops (dozens in flight at once, e.g. one allreduce per gradient) reuses memory
# instead of faulting in fresh pages for every op.  Freed buffers form an intrusive list per
# class (the link is stored in the buffer); up to g_scratch_cap bytes stay cached.

DEF SCRATCH_MIN_SHIFT = 12          # smallest class: 4 KiB
DEF SCRATCH_CLASSES = 52            # up to 2**63 bytes
cdef void* g_scratch_free[SCRATCH_CLASSES]
cdef size_t g_scratch_cached = 0    # bytes held in the lists
cdef size_t g_scratch_cap = 256 << 20
cdef long g_scratch_allocs = 0      # buffers obtained from malloc
cdef long g_scratch_reuses = 0      # buffers taken from the cache
cdef pthread_mutex_t g_pool_lock
pthread_mutex_init(&g_pool_lock, NULL)
memset(g_scratch_free, 0, sizeof(g_scratch_free))

cdef inline int scratch_class(size_t nbytes) noexcept nogil:
    cdef int c = 0
    cdef size_t cap = (<size_t>1) << SCRATCH_MIN_SHIFT
    while cap < nbytes and c < SCRATCH_CLASSES - 1:
        cap <<= 1
        c += 1
    return c

cdef char* scratch_get(size_t nbytes, size_t* got) noexcept nogil:
    """A buffer of at least `nbytes` (its class size goes to *got); NULL if out of memory."""
    global g_scratch_cached, g_scratch_allocs, g_scratch_reuses
    cdef int c = scratch_class(nbytes)
    cdef size_t size = (<size_t>1) << (c + SCRATCH_MIN_SHIFT)
    cdef void* p
    pthread_mutex_lock(&g_pool_lock)
    p = g_scratch_free[c]
    if p != NULL:
        g_scratch_free[c] = (<void**>p)[0]
        g_scratch_cached -= size
        g_scratch_reuses += 1
    else:
        g_scratch_allocs += 1
    pthread_mutex_unlock(&g_pool_lock)
    if p == NULL:
        p = malloc(size)
    got[0] = size
    return <char*>p

cdef void scratch_put(char* p, size_t nbytes) noexcept nogil:
    """Return a buffer from scratch_get (`nbytes` = its *got): cached, or freed over the cap."""
    global g_scratch_cached
    cdef int c = scratch_class(nbytes)
    if p == NULL:
        return
    pthread_mutex_lock(&g_pool_lock)
    if g_scratch_cached + nbytes <= g_scratch_cap:
        (<void**>p)[0] = g_scratch_free[c]
        g_scratch_free[c] = <void*>p
        g_scratch_cached += nbytes
        p = NULL
    pthread_mutex_unlock(&g_pool_lock)
    free(p)

def set_scratch_cache(size_t nbytes):
    """Bytes of freed scratch buffers kept for reuse (AL_SCRATCH_CACHE); what is cached above
    it now is freed."""
    global g_scratch_cap, g_scratch_cached
    cdef int c
    cdef void* p
    with nogil:
        pthread_mutex_lock(&g_pool_lock)
        g_scratch_cap = nbytes
        c = SCRATCH_CLASSES - 1
        while g_scratch_cached > g_scratch_cap and c >= 0:
            p = g_scratch_free[c]
            if p == NULL:
                c -= 1
                continue
            g_scratch_free[c] = (<void**>p)[0]
            g_scratch_cached -= (<size_t>1) << (c + SCRATCH_MIN_SHIFT)
            free(p)
        pthread_mutex_unlock(&g_pool_lock)

def _scratch_roundtrip(sizes):
    """Test hook: take a scratch buffer of each size (bytes) at once, then return them all."""
    cdef list held = []
    cdef size_t got
    cdef char* p
    for n in sizes:
        p = scratch_get(<size_t>n, &got)
        if p == NULL:
            raise MemoryError()
        held.append((<uintptr_t>p, got))
    for addr, got in held:
        scratch_put(<char*><uintptr_t>addr, got)

def scratch_stats():
    """{'allocs': buffers malloc'd, 'reuses': taken from the cache, 'cached': bytes held}."""
    return {"allocs": g_scratch_allocs, "reuses": g_scratch_reuses, "cached": g_scratch_cached}

# ---------------------------------------------------------------------------
# The op state machine

cdef inline int set_mpi_error(al_op* op, int rc, const char* where) noexcept nogil:
    cdef char msg[512]
    cdef int n = 0
    if mpi.MPI_Error_string(rc, msg, &n) != mpi.MPI_SUCCESS:
        n = 0
    msg[n if n < 511 else 511] = 0
    op.err = rc
    snprintf(op.errmsg, 256, "%s failed: %s", where, msg)
    return -1

cdef inline int status_error(al_op* op, int rc) noexcept nogil:
    """MPI_ERR_IN_STATUS: the real error is in one of the statuses."""
    cdef int i
    if rc == mpi.MPI_ERR_IN_STATUS:
        for i in range(op.nreqs):
            if op.stats[i].MPI_ERROR != mpi.MPI_SUCCESS and op.stats[i].MPI_ERROR != mpi.MPI_ERR_PENDING:
                return op.stats[i].MPI_ERROR
    return rc

cdef int op_finish(al_op* op) noexcept nogil:
    # post-processing of this rank's result region (avg_buf[:avg_cnt])
    if op.err == 0 and op.avg_cnt > 0:
        if op.avg_div > 0 and not op.avg_in_steps:
            al_scale_div(op.dtype, op.avg_buf, <size_t>op.avg_cnt, op.avg_div)
        if op.comm.size == 1 and (op.rop == AL_LAND or op.rop == AL_LOR or op.rop == AL_LXOR):
            # one rank: no reduction ran, but logical results are 0/1 as with more ranks
            al_reduce(op.dtype, AL_LAND, op.avg_buf, op.avg_buf, op.avg_buf, <size_t>op.avg_cnt)
    if op.tmp != NULL:
        scratch_put(op.tmp, op.tmpbytes)
        op.tmp = NULL
    op.phase = PH_DONE
    return 1

cdef int sched_advance(al_op* op, int block) noexcept nogil:
    """Run schedule steps until one would block (returns 0) or all are done (1)."""
    cdef al_step* st
    cdef char* dst
    cdef char* src
    cdef char* other
    cdef int rc, flag, es = op.esize
    cdef MPI_Comm comm = op.comm.coll
    while op.cur < op.nsteps:
        st = &op.steps[op.cur]
        if not op.posted:
            if st.copy_cnt > 0:
                memcpy(op.rbuf + st.copy_off * es, op.sbuf + st.copy_off * es, <size_t>(st.copy_cnt * es))
            op.nreqs = 0
            if st.recv_peer >= 0:
                dst = op.tmp if st.recv_mode == RECV_TMP_REDUCE else op.rbuf + st.recv_off * es
                rc = mpi.MPI_Irecv(dst, <int>st.recv_cnt, op.mtype, st.recv_peer, op.tag, comm, &op.reqs[0])
                if rc != mpi.MPI_SUCCESS:
                    set_mpi_error(op, rc, "MPI_Irecv")
                    return op_finish(op)
                op.nreqs = 1
            if st.send_peer >= 0:
                src = (op.sbuf if st.send_src == FROM_SEND else op.rbuf) + st.send_off * es
                rc = mpi.MPI_Isend(src, <int>st.send_cnt, op.mtype, st.send_peer, op.tag, comm, &op.reqs[op.nreqs])
                if rc != mpi.MPI_SUCCESS:
                    set_mpi_error(op, rc, "MPI_Isend")
                    return op_finish(op)
                op.nreqs += 1
            op.posted = 1
        if op.nreqs > 0:
            if block:
                rc = mpi.MPI_Waitall(op.nreqs, op.reqs, op.stats)
                flag = 1
            else:
                rc = mpi.MPI_Testall(op.nreqs, op.reqs, &flag, op.stats)
            if rc != mpi.MPI_SUCCESS:
                set_mpi_error(op, status_error(op, rc), "MPI_Waitall" if block else "MPI_Testall")
                return op_finish(op)
            if not flag:
                return 0
            op.nreqs = 0
        if st.recv_mode == RECV_TMP_REDUCE or st.recv_mode == RECV_INTO_REDUCE:
            dst = op.rbuf + st.recv_off * es
            if st.recv_mode == RECV_TMP_REDUCE:     # dst = SRC[off] op scratch
                src = (op.sbuf if st.reduce_src == FROM_SEND else op.rbuf) + st.recv_off * es
                other = op.tmp
            else:                                   # dst = sendbuf[off] op dst
                src = op.sbuf + st.recv_off * es
                other = dst
            # AVG: an owned block (always a reducing step) is divided in the same pass
            if st.owned and op.avg_in_steps and op.avg_div > 0:
                al_reduce_div(op.dtype, dst, src, other, <size_t>st.recv_cnt, op.avg_div)
            else:
                al_reduce(op.dtype, op.rop, dst, src, other, <size_t>st.recv_cnt)
        op.posted = 0
        op.cur += 1
    return op_finish(op)

cdef int mpi_start(al_op* op) noexcept nogil:
    """Start an MPI pass-through op: the blocking call when op.blocking, else MPI_I*."""
    cdef MPI_Comm comm = op.comm.coll
    cdef void* sb = <void*>op.sbuf if op.sbuf != NULL else mpi.MPI_IN_PLACE
    cdef void* rb = <void*>op.rbuf
    if rb == NULL and op.kind == K_SCATTER:      # root's block stays in place
        rb = mpi.MPI_IN_PLACE
    cdef int n = <int>op.count, b = op.blocking, rc = mpi.MPI_SUCCESS
    cdef MPI_Datatype t = op.mtype
    cdef MPI_Request* r = &op.reqs[0]
    op.nreqs = 0 if b else 1
    if op.kind == K_ALLREDUCE:
        rc = mpi.MPI_Allreduce(sb, rb, n, t, op.mop, comm) if b else mpi.MPI_Iallreduce(sb, rb, n, t, op.mop, comm, r)
    elif op.kind == K_REDUCE:
        rc = mpi.MPI_Reduce(sb, rb, n, t, op.mop, op.root, comm) if b else mpi.MPI_Ireduce(sb, rb, n, t, op.mop, op.root, comm, r)
    elif op.kind == K_REDUCE_SCATTER:
        rc = (mpi.MPI_Reduce_scatter_block(sb, rb, n, t, op.mop, comm) if b
              else mpi.MPI_Ireduce_scatter_block(sb, rb, n, t, op.mop, comm, r))
    elif op.kind == K_ALLGATHER:
        rc = (mpi.MPI_Allgather(sb, n, t, rb, n, t, comm) if b
              else mpi.MPI_Iallgather(sb, n, t, rb, n, t, comm, r))
    elif op.kind == K_BCAST:
        rc = mpi.MPI_Bcast(rb, n, t, op.root, comm) if b else mpi.MPI_Ibcast(rb, n, t, op.root, comm, r)
    elif op.kind == K_ALLTOALL:
        rc = (mpi.MPI_Alltoall(sb, n, t, rb, n, t, comm) if b
              else mpi.MPI_Ialltoall(sb, n, t, rb, n, t, comm, r))
    elif op.kind == K_GATHER:
        rc = (mpi.MPI_Gather(sb, n, t, rb, n, t, op.root, comm) if b
              else mpi.MPI_Igather(sb, n, t, rb, n, t, op.root, comm, r))
    elif op.kind == K_SCATTER:
        rc = (mpi.MPI_Scatter(sb, n, t, rb, n, t, op.root, comm) if b
              else mpi.MPI_Iscatter(sb, n, t, rb, n, t, op.root, comm, r))
    elif op.kind == K_BARRIER:
        rc = mpi.MPI_Barrier(comm) if b else mpi.MPI_Ibarrier(comm, r)
    elif op.kind == K_SEND:
        rc = (mpi.MPI_Send(sb, n, t, op.root, op.tag, op.comm.p2p) if b
              else mpi.MPI_Isend(sb, n, t, op.root, op.tag, op.comm.p2p, r))
    elif op.kind == K_RECV:
        rc = (mpi.MPI_Recv(rb, n, t, op.root, op.tag, op.comm.p2p, mpi.MPI_STATUS_IGNORE) if b
              else mpi.MPI_Irecv(rb, n, t, op.root, op.tag, op.comm.p2p, r))
    elif op.kind == K_SENDRECV:
        if b:
            rc = mpi.MPI_Sendrecv(sb, n, t, op.root, op.tag, rb, <int>op.count2, t, op.peer2, op.tag,
                                  op.comm.p2p, mpi.MPI_STATUS_IGNORE)
        else:
            rc = mpi.MPI_Irecv(rb, <int>op.count2, t, op.peer2, op.tag, op.comm.p2p, &op.reqs[0])
            if rc == mpi.MPI_SUCCESS:
                rc = mpi.MPI_Isend(sb, n, t, op.root, op.tag, op.comm.p2p, &op.reqs[1])
                op.nreqs = 2
    else:
        op.err = -1
        snprintf(op.errmsg, 256, "unknown op kind %d", op.kind)
        op.nreqs = 0
        return op_finish(op)
    if rc != mpi.MPI_SUCCESS:
        op.nreqs = 0
        set_mpi_error(op, rc, "MPI call")
        return op_finish(op)
    if op.nreqs == 0:
        return op_finish(op)
    return 0

cdef int ht_step(al_op* op) noexcept nogil:
    """Host-transfer state machine (paper Figs. 5-6), polled by the engine; never blocks and
    never calls the device driver (only loads and stores on the pinned words)."""
    if op.ht_phase <= 1 and op.hang > 0 and al_now() > op.deadline:
        return ht_abandon(op)
    if op.ht_phase == 0:                          # device -> pinned copy done?
        if not al_load_acquire(<int*>&op.flag[1]):
            return 0
        op.ht_times[0] = al_now()
        op.ht_phase = 1
        if op_start(op.inner, 0):
            op.ht_phase = 2
    if op.ht_phase == 1:                          # the host algorithm on the pinned buffer
        if not op_step(op.inner, 0):
            return 0
        op.ht_phase = 2
    if op.ht_phase == 2:                          # release the stream: it copies back next
        op.ht_times[1] = al_now()
        if op.inner.phase == PH_DONE and op.inner.err != 0 and op.err == 0:
            op.err = op.inner.err
            strncpy(op.errmsg, op.inner.errmsg, 255)
        al_store_release(<int*>op.flag, 1)
        op.ht_times[2] = al_now()
        op.ht_phase = 3
    if not al_load_acquire(<int*>&op.flag[2]):  # pinned -> device copy done?
        return 0
    op.ht_times[3] = al_now()
    al_pinned_put(op.dev, op.pinned)              # only after the last copy completed; never
    op.pinned = NULL                              # a (synchronizing) free on this thread
    return op_finish(op)

cdef int ht_abandon(al_op* op) noexcept nogil:
    """The host part missed its deadline (AL_HANG_TIMEOUT): fail the op and release the stream.

    The inner algorithm's point-to-point requests are cancelled; an MPI collective request is
    left to MPI (freeing or cancelling one is erroneous).  The pinned buffer and the inner
    op's scratch are leaked: the device or MPI may still write into them."""
    cdef al_op* inner = op.inner
    cdef int i
    cdef char where[160]
    if op.ht_phase == 0:
        snprintf(where, 160, "the stream had not reached it (device-to-pinned copy not complete)")
    elif inner.kind == K_SCHEDULE and inner.phase == PH_RUNNING and inner.cur < inner.nsteps:
        snprintf(where, 160, "host algorithm at step %d/%d (recv from rank %d, send to rank %d, tag %d)",
                 inner.cur + 1, inner.nsteps, inner.steps[inner.cur].recv_peer,
                 inner.steps[inner.cur].send_peer, inner.tag)
    else:
        snprintf(where, 160, "host algorithm (MPI call) not complete")
    if inner.phase == PH_RUNNING:
        if inner.kind == K_SCHEDULE:
            for i in range(inner.nreqs):
                mpi.MPI_Cancel(&inner.reqs[i])
                mpi.MPI_Request_free(&inner.reqs[i])
        inner.nreqs = 0
        inner.tmp = NULL
        inner.phase = PH_DONE
    op.err = AL_ERR_TIMEOUT
    snprintf(op.errmsg, 256, "host part not complete after %g s (AL_HANG_TIMEOUT): %s; the stream "
             "was released and the result is undefined", op.hang, where)
    al_store_release(<int*>op.flag, 1)
    op.pinned = NULL
    return op_finish(op)

cdef int op_start(al_op* op, int block) noexcept nogil:
    """Begin an op. Schedules wait for their first step only with `block`; MPI pass-through
    ops make the blocking MPI call when op.blocking. Returns 1 if already complete."""
    op.phase = PH_RUNNING
    op.t_start = al_now()
    if op.kind == K_HOST_TRANSFER:
        op.ht_phase = 0
        return ht_step(op)
    if op.kind == K_SCHEDULE:
        op.cur = 0
        op.posted = 0
        if op.tmpbytes > 0:
            op.tmp = scratch_get(op.tmpbytes, &op.tmpbytes)
            if op.tmp == NULL:
                op.err = -1
                snprintf(op.errmsg, 256, "out of memory allocating %zu bytes of scratch", op.tmpbytes)
                return op_finish(op)
        return sched_advance(op, block)
    return mpi_start(op)

cdef int op_step(al_op* op, int block) noexcept nogil:
    """Make progress; returns 1 when the op is complete. With block, waits for the current step."""
    cdef int rc, flag
    if op.phase == PH_DONE:
        return 1
    if op.kind == K_SCHEDULE:
        return sched_advance(op, block)
    if op.kind == K_HOST_TRANSFER:
        return ht_step(op)
    if op.nreqs > 0:
        if block:
            rc = mpi.MPI_Waitall(op.nreqs, op.reqs, op.stats)
            flag = 1
        else:
            rc = mpi.MPI_Testall(op.nreqs, op.reqs, &flag, op.stats)
        if rc != mpi.MPI_SUCCESS:
            set_mpi_error(op, status_error(op, rc), "MPI_Waitall" if block else "MPI_Testall")
            op.nreqs = 0
            return op_finish(op)
        if not flag:
            return 0
        op.nreqs = 0
    return op_finish(op)

cdef inline int req_is_recv(al_op* op, int i) noexcept nogil:
    """Whether op.reqs[i] is a receive (see sched_advance and mpi_start for the order)."""
    if op.kind == K_SCHEDULE:
        return i == 0 and op.cur < op.nsteps and op.steps[op.cur].recv_peer >= 0
    return (op.kind == K_RECV or op.kind == K_SENDRECV) and i == 0

cdef void op_cancel(al_op* op, const char* why) noexcept nogil:
    """Abandon an op (engine shutdown): cancel its outstanding receives and free every
    outstanding MPI request.  Sends and collectives are only freed: MPI-4 deprecates
    cancelling sends (MPICH over UCX crashed cancelling a large, unmatched one) and forbids
    cancelling collectives."""
    cdef int i
    if op.phase == PH_NEW:
        op.t_start = al_now()         # never started: Request.times reads (cancel, cancel)
    for i in range(op.nreqs):
        if req_is_recv(op, i):
            mpi.MPI_Cancel(&op.reqs[i])
        mpi.MPI_Request_free(&op.reqs[i])
    op.nreqs = 0
    if op.kind == K_HOST_TRANSFER and op.flag != NULL:
        if op.inner != NULL and op.inner.phase == PH_RUNNING:
            op_cancel(op.inner, why)
        al_store_release(<int*>op.flag, 1)        # never leave a device stream blocked
        # the pinned buffer is leaked: the device may still copy from it
    op.err = -1
    strncpy(op.errmsg, why, 255)
    op_finish(op)

# ---------------------------------------------------------------------------
# The progress engine

cdef pthread_mutex_t g_lock
cdef pthread_cond_t g_submit_cond
cdef pthread_cond_t g_done_cond
pthread_mutex_init(&g_lock, NULL)
pthread_cond_init(&g_submit_cond, NULL)
pthread_cond_init(&g_done_cond, NULL)
cdef al_op* g_qhead = NULL
cdef al_op* g_qtail = NULL
cdef pthread_t g_thread
cdef int g_started = 0
cdef int g_stop = 0
cdef int g_waiters = 0
cdef double g_exit_grace = 2.0
cdef long g_loops = 0            # engine loop iterations (diagnostics)
cdef int g_yield_every = 0       # polls without progress between sched_yield calls (0: never)
cdef int64_t g_serial_bytes = 0   # see set_serial_bytes
cdef double g_idle_spin = 0.0    # seconds the idle engine polls for work before sleeping
cdef int g_nsubmitted = 0        # submissions so far (atomic; the idle poll watches it)

def set_idle_spin(double seconds):
    """How long the idle engine polls for new work before sleeping (AL_ENGINE_SPIN)."""
    global g_idle_spin
    g_idle_spin = seconds

def set_serial_bytes(int64_t nbytes):
    """All-reduces of at least `nbytes` bytes on one communicator run one at a time in the
    progress engine, in call order (0: all run together). See AL_ENGINE_SERIAL_BYTES."""
    global g_serial_bytes
    g_serial_bytes = nbytes

def set_poll_yield(int every):
    """While ops are active the engine polls continuously; every `every` polls without
    progress it calls sched_yield() (0: never). See AL_ENGINE_YIELD."""
    global g_yield_every
    g_yield_every = every

cdef inline void notify_done(al_op* op) noexcept nogil:
    op.t_done = al_now()
    if op.counted:
        al_fetch_add(&op.comm.pending, -1)
    al_store_seqcst(&op.done, 1)
    if al_load_seqcst(&g_waiters) > 0:
        pthread_mutex_lock(&g_lock)
        pthread_cond_broadcast(&g_done_cond)
        pthread_mutex_unlock(&g_lock)

cdef inline int starts_mpi_collective(al_op* op) noexcept nogil:
    """Ops whose start issues an MPI collective call on the collective communicator."""
    if K_ALLREDUCE <= op.kind <= K_BARRIER:
        return 1
    return op.kind == K_HOST_TRANSFER and op.inner != NULL and op.inner.kind != K_SCHEDULE

cdef inline int ht_gate(al_op* active, al_comm* c) noexcept nogil:
    """An active host-transfer op on `c` still waiting to start its inner MPI collective."""
    cdef al_op* op = active
    while op != NULL:
        if (op.comm == c and op.kind == K_HOST_TRANSFER and op.ht_phase == 0
                and op.inner != NULL and op.inner.kind != K_SCHEDULE):
            return 1
        op = op.next
    return 0

cdef inline int64_t op_bytes(al_op* op) noexcept nogil:
    """The bytes an all-reduce moves per rank (0 for other kinds)."""
    if op.kind == K_SCHEDULE or op.kind == K_ALLREDUCE:
        return op.count * op.esize
    return 0

cdef inline int comm_blocked(al_comm** blocked, int n, al_comm* c) noexcept nogil:
    cdef int i
    if n > 64:
        return 1
    for i in range(n):
        if blocked[i] == c:
            return 1
    return 0

cdef inline int serial_gate(al_op* active, al_op* op, al_comm** blocked, int n) noexcept nogil:
    """`op` is a large all-reduce (at least g_serial_bytes) and a large one on its
    communicator is still running: it starts when that one completes.  Two large all-reduces
    progressed together share memory bandwidth and cache and each finishes later; one after
    the other, the first finishes early and the total is lower (AL_ENGINE_SERIAL_BYTES).
    It also waits while an earlier op on its communicator waits to start (`blocked`): else it
    could overtake a large MPI all-reduce held back on this rank only (ht_gate), then hold
    that one back, while the other ranks run the two in call order (a deadlock)."""
    cdef al_op* a = active
    if g_serial_bytes <= 0 or op_bytes(op) < g_serial_bytes:
        return 0
    if comm_blocked(blocked, n, op.comm):
        return 1
    while a != NULL:
        if a.comm == op.comm and op_bytes(a) >= g_serial_bytes:
            return 1
        a = a.next
    return 0

cdef inline void unlink(al_op** head, al_op** tail, al_op* prev, al_op* op) noexcept nogil:
    """Remove `op` (whose predecessor is `prev`, NULL at the head) from a tail-tracked list."""
    if prev == NULL:
        head[0] = op.next
    else:
        prev.next = op.next
    if tail[0] == op:
        tail[0] = prev
    op.next = NULL

cdef void* engine_main(void* arg) noexcept nogil:
    global g_qhead, g_qtail, g_loops
    cdef al_op* active = NULL
    cdef al_op* tail = NULL
    cdef al_op* take
    cdef al_op* op
    cdef al_op* prev
    cdef al_op* nxt
    cdef int stopping = 0, progress
    cdef long idle = 0
    cdef int seen = 0
    cdef double spin_until
    cdef al_op* deferred = NULL       # submitted, not yet started (FIFO)
    cdef al_op* dtail = NULL
    cdef al_comm* blocked[64]
    cdef int nblocked = 0
    cdef double deadline = 0.0
    al_cuda_mark_engine_thread()      # CUDA contexts stay current on this thread (al_device.h)
    while True:
        if active == NULL and deferred == NULL and g_idle_spin > 0:
            # idle: poll for new work for a short while before sleeping, so that a burst of
            # submissions (one allreduce per layer) does not pay a thread wake-up each time
            spin_until = al_now() + g_idle_spin
            while al_load_acquire(&g_nsubmitted) == seen and al_now() < spin_until:
                sched_yield()
        pthread_mutex_lock(&g_lock)
        while g_qhead == NULL and active == NULL and deferred == NULL and not g_stop:
            pthread_cond_wait(&g_submit_cond, &g_lock)
        seen = al_load_acquire(&g_nsubmitted)
        take = g_qhead
        g_qhead = NULL
        g_qtail = NULL
        if g_stop and not stopping:
            stopping = 1
            deadline = al_now() + g_exit_grace
        pthread_mutex_unlock(&g_lock)
        g_loops += 1
        progress = 0
        # newly submitted ops join the start queue in submission order
        if take != NULL:
            progress = 1
            if dtail == NULL:
                deferred = take
            else:
                dtail.next = take
            while take.next != NULL:
                take = take.next
            dtail = take
        # start queued ops in order (per communicator: call order). An op that starts an MPI
        # collective waits while an earlier host-transfer op on its communicator has not yet
        # started its own MPI collective (that waits for a device copy), so MPI sees every
        # communicator's collectives in call order on every rank.  A large all-reduce waits
        # for the large one running on its communicator (serial_gate); a waiting op also holds
        # back the later MPI collectives and large all-reduces on its communicator.
        nblocked = 0
        prev = NULL
        op = deferred
        while op != NULL:
            nxt = op.next
            if op.phase == PH_NEW and ((starts_mpi_collective(op) and (
                    comm_blocked(blocked, nblocked, op.comm) or ht_gate(active, op.comm)))
                    or serial_gate(active, op, blocked, nblocked)):
                if not comm_blocked(blocked, nblocked, op.comm):   # each communicator once
                    if nblocked < 64:
                        blocked[nblocked] = op.comm
                    nblocked += 1
                prev = op
                op = nxt
                continue
            unlink(&deferred, &dtail, prev, op)
            progress = 1
            if op.phase == PH_NEW and op_start(op, 0):
                notify_done(op)
            else:
                if tail == NULL:
                    active = op
                else:
                    tail.next = op
                tail = op
            op = nxt
        # step every active op
        prev = NULL
        op = active
        while op != NULL:
            nxt = op.next
            if op_step(op, 0):
                progress = 1
                unlink(&active, &tail, prev, op)
                notify_done(op)
            else:
                prev = op
            op = nxt
        if stopping and ((active == NULL and deferred == NULL) or al_now() > deadline):
            break
        if progress:
            idle = 0
        else:
            idle += 1
            if g_yield_every > 0 and idle % g_yield_every == 0:
                sched_yield()
    # shutdown: abandon what is left
    if dtail != NULL:                 # never-started ops are abandoned like the rest
        dtail.next = active
        active = deferred
    while active != NULL:
        op = active
        active = op.next
        op.next = NULL
        op_cancel(op, "cancelled: the progress engine stopped at interpreter exit before this op completed")
        notify_done(op)
    pthread_mutex_lock(&g_lock)
    take = g_qhead
    g_qhead = NULL
    g_qtail = NULL
    pthread_mutex_unlock(&g_lock)
    while take != NULL:
        op = take
        take = op.next
        op.next = NULL
        op_cancel(op, "cancelled: the progress engine stopped at interpreter exit before this op started")
        notify_done(op)
    return NULL

cdef int engine_submit(al_op* op) noexcept nogil:
    """Queue an op for the engine (starting the thread if needed). Returns 0 or an errno."""
    global g_qhead, g_qtail, g_started
    cdef int rc = 0
    op.counted = 1
    al_fetch_add(&op.comm.pending, 1)
    pthread_mutex_lock(&g_lock)
    if g_stop:
        pthread_mutex_unlock(&g_lock)
        al_fetch_add(&op.comm.pending, -1)
        op.counted = 0
        return -1
    if not g_started:
        rc = pthread_create(&g_thread, NULL, engine_main, NULL)
        if rc != 0:
            pthread_mutex_unlock(&g_lock)
            al_fetch_add(&op.comm.pending, -1)
            op.counted = 0
            return rc
        g_started = 1
    op.next = NULL
    if g_qtail == NULL:
        g_qhead = op
    else:
        g_qtail.next = op
    g_qtail = op
    al_fetch_add(&g_nsubmitted, 1)
    pthread_cond_signal(&g_submit_cond)
    pthread_mutex_unlock(&g_lock)
    return 0

cdef int wait_done(al_op* op, double timeout) noexcept nogil:
    """Wait for op.done; timeout < 0 waits forever. Returns 1 if done, 0 on timeout."""
    cdef int i
    cdef double deadline, now, until
    cdef timespec ts
    for i in range(200):
        if al_load_acquire(&op.done):
            return 1
        if i >= 50:
            sched_yield()
    deadline = al_now() + timeout if timeout >= 0 else 1e300
    pthread_mutex_lock(&g_lock)
    al_fetch_add(&g_waiters, 1)
    while not al_load_seqcst(&op.done):
        now = al_now()
        if now >= deadline:
            break
        until = deadline - now
        if until > 0.05:
            until = 0.05
        clock_gettime(CLOCK_REALTIME, &ts)
        ts.tv_nsec += <long>(until * 1e9)
        ts.tv_sec += ts.tv_nsec // 1000000000
        ts.tv_nsec = ts.tv_nsec % 1000000000
        pthread_cond_timedwait(&g_done_cond, &g_lock, &ts)
    al_fetch_add(&g_waiters, -1)
    pthread_mutex_unlock(&g_lock)
    return al_load_acquire(&op.done)

cdef int run_inline(al_op* op, double timeout) noexcept nogil:
    """Drive an op to completion in the calling thread. Returns 1 if done, 0 on timeout."""
    cdef double deadline
    cdef int n = 0
    if timeout < 0:
        if not op_start(op, 1):
            while not op_step(op, 1):
                pass
    else:
        deadline = al_now() + timeout
        if not op_start(op, 0):
            while not op_step(op, 0):
                n += 1
                if (n & 255) == 0 and al_now() > deadline:
                    return 0
    op.t_done = al_now()
    al_store_release(&op.done, 1)
    return 1

def shutdown_engine(double grace=2.0):
    """Stop the progress engine: finish what completes within `grace` seconds, cancel the rest."""
    global g_stop, g_exit_grace, g_started
    cdef int started
    with nogil:
        pthread_mutex_lock(&g_lock)
        g_exit_grace = grace
        g_stop = 1
        started = g_started
        pthread_cond_signal(&g_submit_cond)
        pthread_mutex_unlock(&g_lock)
        if started:
            pthread_join(g_thread, NULL)
            g_started = 0

def engine_running():
    return bool(g_started) and not g_stop

def engine_loops():
    """Number of progress-engine loop iterations so far (a diagnostic)."""
    return g_loops

# ---------------------------------------------------------------------------
# MPI datatypes and ops for our dtype codes

cdef MPI_Datatype g_types[16]
cdef MPI_Op g_mpi_ops[16]
cdef MPI_Op g_half_ops[2][4]      # user ops for float16 / bfloat16: SUM, PROD, MIN, MAX
cdef int g_mpi_ready = 0

cdef void uop_f16_sum(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_SUM, io, io, i, <size_t>n[0])
cdef void uop_f16_prod(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_PROD, io, io, i, <size_t>n[0])
cdef void uop_f16_min(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_MIN, io, io, i, <size_t>n[0])
cdef void uop_f16_max(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_FLOAT16, AL_MAX, io, io, i, <size_t>n[0])
cdef void uop_bf16_sum(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_SUM, io, io, i, <size_t>n[0])
cdef void uop_bf16_prod(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_PROD, io, io, i, <size_t>n[0])
cdef void uop_bf16_min(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_MIN, io, io, i, <size_t>n[0])
cdef void uop_bf16_max(void* i, void* io, int* n, MPI_Datatype* t) noexcept nogil:
    al_reduce(AL_BFLOAT16, AL_MAX, io, io, i, <size_t>n[0])

cdef int mpi_tables_init() except -1:
    global g_mpi_ready
    if g_mpi_ready:
        return 0
    g_types[0] = mpi.MPI_INT8_T
    g_types[1] = mpi.MPI_INT16_T
    g_types[2] = mpi.MPI_INT32_T
    g_types[3] = mpi.MPI_INT64_T
    g_types[4] = mpi.MPI_UINT8_T
    g_types[5] = mpi.MPI_UINT16_T
    g_types[6] = mpi.MPI_UINT32_T
    g_types[7] = mpi.MPI_UINT64_T
    g_types[8] = mpi.MPI_UINT16_T     # float16: moved as 16-bit words, reduced by our user ops
    g_types[9] = mpi.MPI_UINT16_T     # bfloat16: likewise
    g_types[10] = mpi.MPI_FLOAT
    g_types[11] = mpi.MPI_DOUBLE
    g_types[12] = mpi.MPI_C_FLOAT_COMPLEX
    g_types[13] = mpi.MPI_C_DOUBLE_COMPLEX
    g_mpi_ops[0] = mpi.MPI_SUM
    g_mpi_ops[1] = mpi.MPI_PROD
    g_mpi_ops[2] = mpi.MPI_MIN
    g_mpi_ops[3] = mpi.MPI_MAX
    g_mpi_ops[4] = mpi.MPI_LAND
    g_mpi_ops[5] = mpi.MPI_LOR
    g_mpi_ops[6] = mpi.MPI_LXOR
    g_mpi_ops[7] = mpi.MPI_BAND
    g_mpi_ops[8] = mpi.MPI_BOR
    g_mpi_ops[9] = mpi.MPI_BXOR
    g_mpi_ops[10] = mpi.MPI_SUM       # AVG: SUM, then divide
    mpi.MPI_Op_create(uop_f16_sum, 1, &g_half_ops[0][0])
    mpi.MPI_Op_create(uop_f16_prod, 1, &g_half_ops[0][1])
    mpi.MPI_Op_create(uop_f16_min, 1, &g_half_ops[0][2])
    mpi.MPI_Op_create(uop_f16_max, 1, &g_half_ops[0][3])
    mpi.MPI_Op_create(uop_bf16_sum, 1, &g_half_ops[1][0])
    mpi.MPI_Op_create(uop_bf16_prod, 1, &g_half_ops[1][1])
    mpi.MPI_Op_create(uop_bf16_min, 1, &g_half_ops[1][2])
    mpi.MPI_Op_create(uop_bf16_max, 1, &g_half_ops[1][3])
    g_mpi_ready = 1
    return 0

cdef MPI_Op mpi_op_for(int dtype, int rop) noexcept:
    cdef int r = AL_SUM if rop == AL_AVG else rop
    if dtype == AL_FLOAT16 or dtype == AL_BFLOAT16:
        return g_half_ops[dtype - AL_FLOAT16][r]
    return g_mpi_ops[r]

cnp.import_array()

def addr(cnp.ndarray a):
    """Address of an ndarray's data."""
    return <intptr_t>cnp.PyArray_DATA(a)

def thread_level():
    """The MPI thread support level as an int (mpi4py.MPI.THREAD_* values)."""
    cdef int provided = 0
    mpi.MPI_Query_thread(&provided)
    return provided

def thread_multiple():
    cdef int provided = 0
    mpi.MPI_Query_thread(&provided)
    return provided == mpi.MPI_THREAD_MULTIPLE

def reduce_into(int dtype, int rop, out, a, b):
    """out[:] = a OP b with the native kernel (numpy arrays of equal size; testing and benches)."""
    cdef Py_buffer bo, ba, bb
    cdef int rc
    PyObject_GetBuffer(out, &bo, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    PyObject_GetBuffer(a, &ba, PyBUF_C_CONTIGUOUS)
    PyObject_GetBuffer(b, &bb, PyBUF_C_CONTIGUOUS)
    try:
        if ba.len != bo.len or bb.len != bo.len or bo.itemsize != ba.itemsize:
            raise ValueError("reduce_into: buffers differ in size")
        with nogil:
            rc = al_reduce(dtype, rop, bo.buf, ba.buf, bb.buf, <size_t>(bo.len // bo.itemsize))
        if rc != 0:
            raise ValueError(f"reduce_into: op {rop} not defined for dtype {dtype}")
    finally:
        PyBuffer_Release(&bb)
        PyBuffer_Release(&ba)
        PyBuffer_Release(&bo)

# ---------------------------------------------------------------------------
# Python-visible handles

cdef class CommState:
    """Native state of one Communicator: two duplicated MPI communicators and a pending count."""
    cdef al_comm* c
    cdef readonly object coll_comm, p2p_comm
    cdef readonly unsigned int seq
    cdef public bint freed

    def __cinit__(self, coll_comm, p2p_comm):
        mpi_tables_init()
        self.c = <al_comm*>calloc(1, sizeof(al_comm))
        if self.c == NULL:
            raise MemoryError()
        self.coll_comm = coll_comm
        self.p2p_comm = p2p_comm
        self.c.coll = <MPI_Comm><size_t>coll_comm.handle
        self.c.p2p = <MPI_Comm><size_t>p2p_comm.handle
        mpi.MPI_Comm_set_errhandler(self.c.coll, mpi.MPI_ERRORS_RETURN)
        mpi.MPI_Comm_set_errhandler(self.c.p2p, mpi.MPI_ERRORS_RETURN)
        mpi.MPI_Comm_rank(self.c.coll, &self.c.rank)
        mpi.MPI_Comm_size(self.c.coll, &self.c.size)
        self.seq = 0

    def __dealloc__(self):
        # MPI communicators are freed by Communicator.Free(); the struct lives as long as any op
        # referencing it (ops keep a reference to this object).
        free(self.c)
        self.c = NULL

    @property
    def rank(self):
        return self.c.rank

    @property
    def size(self):
        return self.c.size

    @property
    def pending(self):
        """Ops handed to the progress engine on this communicator and not yet complete."""
        return al_load_acquire(&self.c.pending)

    def next_tag(self):
        """Tag for the next schedule op: identical on every rank because ops start in call order."""
        self.seq += 1
        return <int>(self.seq % 32000u) + 1


cdef class Schedule:
    """A native step array built from the pure-Python schedule (aluminum_py.schedules)."""
    cdef al_step* steps
    cdef readonly int nsteps
    cdef readonly int64_t tmp_elems
    cdef readonly bint owned         # some step marks this rank's owned block (see schedules)

    def __cinit__(self, steps, int64_t tmp_elems):
        cdef int i
        cdef al_step* s
        self.nsteps = len(steps)
        self.tmp_elems = tmp_elems
        self.owned = False
        self.steps = <al_step*>calloc(max(self.nsteps, 1), sizeof(al_step))
        if self.steps == NULL:
            raise MemoryError()
        for i, st in enumerate(steps):
            s = &self.steps[i]
            s.send_peer = st.send_peer
            s.send_src = st.send_src
            s.send_off = st.send_off
            s.send_cnt = st.send_cnt
            s.recv_peer = st.recv_peer
            s.recv_mode = st.recv_mode
            s.reduce_src = st.reduce_src
            s.recv_off = st.recv_off
            s.recv_cnt = st.recv_cnt
            s.copy_off = st.copy_off
            s.copy_cnt = st.copy_cnt
            s.owned = st.owned
            self.owned = self.owned or st.owned

    def __dealloc__(self):
        free(self.steps)


cdef class Device:
    """A device behind the al_device interface (ext/al_device.h): streams and events are
    handles (ints). Failures raise aluminum_py.Error naming the call and the device's error
    (CUDA: the CUresult's name, number and text)."""
    cdef al_device* dev
    cdef readonly str kind

    cdef int fail(self, str call, int code) except -1:
        cdef char buf[256]
        buf[0] = 0
        self.dev.describe(self.dev.ctx, code, buf, sizeof(buf))
        where = "" if self.kind == "cuda" else f" ({self.kind} device)"
        _hooks.fail(f"{call} failed{where}: {(<bytes>buf).decode('utf-8', 'replace')}")
        return -1

    def stream_create(self):
        """A new stream (CUDA: non-blocking) as a handle."""
        cdef void* st = NULL
        cdef int rc = self.dev.stream_create(self.dev.ctx, &st)
        if rc != 0:
            self.fail("cuStreamCreate", rc)
        return <uintptr_t>st

    def stream_destroy(self, uintptr_t stream):
        """Release `stream` once the work queued on it has run (CUDA: cuStreamDestroy returns
        at once; CPU: joins the worker thread). The handle is invalid afterwards."""
        cdef int rc
        with nogil:
            rc = self.dev.stream_destroy(self.dev.ctx, <void*>stream)
        if rc != 0:
            self.fail("cuStreamDestroy", rc)

    # Every device call releases the GIL: it may wait inside the driver (another thread in a
    # synchronizing call), and the thread that would unblock it may need the GIL.
    def event_create(self):
        cdef void* ev = NULL
        cdef int rc
        with nogil:
            rc = self.dev.event_create(self.dev.ctx, &ev)
        if rc != 0:
            self.fail("cuEventCreate", rc)
        return <uintptr_t>ev

    def event_record(self, uintptr_t ev, uintptr_t stream):
        cdef int rc
        with nogil:
            rc = self.dev.event_record(self.dev.ctx, <void*>ev, <void*>stream)
        if rc != 0:
            self.fail("cuEventRecord", rc)

    def event_query(self, uintptr_t ev):
        """True once the event's latest record has run."""
        cdef int q
        with nogil:
            q = self.dev.event_query(self.dev.ctx, <void*>ev)
        if q < 0:
            self.fail("cuEventQuery", -q)
        return q == 1

    def event_destroy(self, uintptr_t ev):
        with nogil:
            self.dev.event_destroy(self.dev.ctx, <void*>ev)

    def memcpy(self, uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
        """Enqueue a copy (device or pinned addresses) on `stream`."""
        cdef int rc
        with nogil:
            rc = self.dev.memcpy_async(self.dev.ctx, <void*>dst, <const void*>src, nbytes, <void*>stream)
        if rc != 0:
            self.fail("cuMemcpyAsync", rc)

    def stream_wait_event(self, uintptr_t stream, uintptr_t ev):
        """Work queued on `stream` later waits for the event's latest record so far."""
        cdef int rc
        with nogil:
            rc = self.dev.stream_wait_event(self.dev.ctx, <void*>stream, <void*>ev)
        if rc != 0:
            self.fail("cuStreamWaitEvent", rc)

    def synchronize(self):
        """Wait (without the GIL) until every stream of the device is idle (cuCtxSynchronize)."""
        cdef int rc
        with nogil:
            rc = self.dev.synchronize(self.dev.ctx)
        if rc != 0:
            self.fail("cuCtxSynchronize", rc)

    def pinned_stats(self):
        """The pinned staging-buffer pool of host-transfer ops: {"allocs": buffers obtained
        from the driver, "reuses": buffers taken from the pool, "taken": buffers in use by ops,
        "cached_bytes": bytes in the pool}."""
        return {"allocs": self.dev.pool_allocs, "reuses": self.dev.pool_reuses,
                "taken": self.dev.pool_out, "cached_bytes": self.dev.pool_cached}

    def release_pinned(self):
        """Synchronize the device, then free the pool's cached pinned buffers (buffers taken by
        ops in flight stay theirs). Called by Communicator.Free when no host-transfer op is in
        flight on the device, and at exit; never on the progress engine's thread."""
        cdef int rc
        with nogil:
            rc = al_pinned_release(self.dev)
        if rc != 0:
            self.fail("releasing pinned memory (cuMemFreeHost)", rc)

    cdef int take_pinned(self, size_t nbytes, char** out) except -1:
        """A pinned buffer of at least nbytes from the pool; a new one is allocated (an
        implicitly synchronizing call) without the GIL, on this (the caller's) thread."""
        cdef void* p = NULL
        cdef int rc
        with nogil:
            rc = al_pinned_get(self.dev, nbytes, &p)
        if rc != 0:
            self.fail(f"allocating {nbytes} bytes of pinned memory (cuMemHostAlloc)", rc)
        out[0] = <char*>p
        return 0


cdef class CpuDevice(Device):
    """The CPU implementation of the device interface: streams are worker threads that run
    queued copies, event records and value waits/writes in order; "device memory" is host
    memory. It lets the host-transfer state machine run under real MPI ranks without a GPU.
    A device lives until the process exits; a stream until it is destroyed.

    ``strict=True`` adds what CUDA does that a careless caller can deadlock on or be serialized
    by: allocating and freeing pinned memory, and ``synchronize``, wait until every stream of
    the device has run what was queued on it; freeing a pointer that was not allocated as
    pinned memory fails; ``queues=k`` (> 0) makes the streams share k hardware queues (stream i
    on queue i % k, as CUDA_DEVICE_MAX_CONNECTIONS): a stream blocked on a flag stalls every
    stream on its queue."""
    cdef readonly bint strict
    cdef readonly int queues

    def __cinit__(self, bint strict=False, int queues=0):
        if queues < 0 or queues > 64:
            raise ValueError(f"queues: expected 0..64, got {queues}")
        if queues and not strict:
            raise ValueError("queues: hardware queues are modelled by the strict device only "
                             "(CpuDevice(strict=True, queues=k))")
        self.dev = al_cpu_device_new_strict(1 if strict else 0, queues)
        if self.dev == NULL:
            raise MemoryError()
        self.kind = "cpu"
        self.strict = strict
        self.queues = queues

    def stream(self):
        """A new stream as a CpuStream object (its `handle` is what stream_create returns)."""
        cdef CpuStream st = CpuStream.__new__(CpuStream)
        st.s = <al_cpu_stream*><uintptr_t>self.stream_create()
        st.device = self
        return st

    def trace(self):
        """Executed commands in order: (kind, time, address). Kinds: 'copy', 'record', 'wait',
        'write', 'wait_event', 'delay', 'free' / 'alloc' (a pinned buffer released /
        allocated), 'sync' (an implicit or explicit device synchronization finished)."""
        cdef al_cpu_ctx* c = <al_cpu_ctx*>self.dev.ctx
        names = {1: "copy", 2: "record", 3: "wait", 4: "write", 5: "hostfn", 7: "wait_event",
                 8: "delay", 100: "free", 101: "alloc", 102: "sync"}
        return [(names.get(c.trace[i].kind, str(c.trace[i].kind)), c.trace[i].t,
                 <uintptr_t>c.trace[i].p) for i in range(c.ntrace)]

    def strict_stats(self):
        """Device counters: {"streams": streams created so far, "pinned_live" (strict): pinned
        buffers allocated and not freed, "sync_waits" (strict): synchronizations (implicit ones
        included) that found a stream busy}."""
        cdef al_cpu_ctx* c = <al_cpu_ctx*>self.dev.ctx
        return {"streams": c.nstreams, "pinned_live": c.pinned_live, "sync_waits": c.sync_waits}


cdef class CudaDevice(Device):
    """The CUDA implementation of the device interface (driver API via dlopen of
    libcuda.so.1, or AL_CUDA_LIBRARY), for device `ordinal`; it retains the device's primary
    context. Raises UnavailableError without a driver or device."""
    cdef readonly int ordinal

    def __cinit__(self, int ordinal=0):
        cdef char err[256]
        err[0] = 0
        self.dev = al_cuda_device_new(ordinal, err, sizeof(err))
        if self.dev == NULL:
            _hooks.unavailable((<bytes>err).decode("utf-8", "replace"))
        self.kind = "cuda"
        self.ordinal = ordinal


def cuda_device_count():
    """CUDA devices visible to this process: cuInit + cuDeviceGetCount only (no context is
    created or retained). 0 without a driver."""
    cdef char err[256]
    cdef int n = 0
    err[0] = 0
    if al_cuda_device_count(&n, err, sizeof(err)) != 0:
        return 0
    return n


def cuda_current_device():
    """The ordinal of the device of this thread's current CUDA context (cuCtxGetCurrent,
    cuCtxGetDevice), or None when no context is current. UnavailableError without a driver,
    aluminum_py.Error when a driver call fails."""
    cdef char err[256]
    cdef int ordinal = -1, rc
    err[0] = 0
    rc = al_cuda_current_device(&ordinal, err, sizeof(err))
    if rc < 0:
        msg = (<bytes>err).decode("utf-8", "replace")
        if msg.startswith("no CUDA driver"):
            _hooks.unavailable(msg)
        _hooks.fail(msg)
    return ordinal if rc == 1 else None


cdef class CpuStream:
    """A CPU device stream (see CpuDevice)."""
    cdef al_cpu_stream* s
    cdef readonly CpuDevice device

    cdef al_cpu_stream* live(self) except NULL:
        if self.s == NULL:
            raise ValueError("the CPU stream has been destroyed")
        return self.s

    @property
    def handle(self):
        return <uintptr_t>self.live()

    def memcpy(self, uintptr_t dst, uintptr_t src, size_t nbytes):
        """Enqueue a copy (addresses) after everything already queued."""
        cdef al_cpu_stream* s = self.live()
        cdef int rc
        with nogil:
            rc = al_cpu_memcpy_async(self.device.dev.ctx, <void*>dst, <const void*>src, nbytes, s)
        if rc != 0:
            raise MemoryError()

    def wait_value32(self, uintptr_t addr, uint32_t value):
        """Enqueue a wait: the stream stops until the uint32 at `addr` is >= `value`."""
        cdef al_cpu_stream* s = self.live()
        cdef int rc
        with nogil:
            rc = self.device.dev.wait_value32(self.device.dev.ctx, s, <uint32_t*>addr, value)
        if rc != 0:
            raise MemoryError()

    def delay(self, double seconds):
        """Enqueue a command that keeps the stream busy for `seconds` (a long kernel)."""
        if al_cpu_delay(self.live(), seconds) != 0:
            raise MemoryError()

    def synchronize(self, double timeout=-1.0):
        """Wait until everything queued has run. Returns False on timeout."""
        cdef int rc
        cdef al_cpu_stream* s = self.live()
        with nogil:
            rc = al_cpu_stream_sync(s, timeout)
        return rc == 0

    def destroy(self):
        """Run what is queued, stop and join the worker thread, free the stream (idempotent)."""
        if self.s != NULL:
            h, self.s = <uintptr_t>self.s, NULL
            self.device.stream_destroy(h)

    @property
    def executed(self):
        return self.live().executed


def ht_times(NativeOp o):
    """When the host-transfer phases ended: (copy-out seen, host algorithm done, flag written,
    copy-back seen), seconds on the monotonic clock."""
    return tuple(o.op.ht_times[i] for i in range(4))


_orphans = []   # (NativeOp) whose Request was dropped before completion


cdef class NativeOp:
    """One operation: the native state plus references to everything it reads or writes."""
    cdef al_op* op
    cdef readonly object keep        # buffers, schedule, comm state: alive until completion
    cdef readonly object name

    def __cinit__(self):
        self.op = <al_op*>calloc(1, sizeof(al_op))
        if self.op == NULL:
            raise MemoryError()

    def __dealloc__(self):
        # Last line of defence: an op the engine may still touch is leaked, never freed
        # (Request.__del__ and the launcher orphan such ops, so this should not happen).
        if self.op != NULL and (self.op.phase != PH_RUNNING or al_load_acquire(&self.op.done)):
            free(self.op)

    @property
    def done(self):
        return al_load_acquire(&self.op.done) != 0

    @property
    def error(self):
        """(code, message) or None. Only meaningful once done."""
        if self.op.err == 0:
            return None
        return (self.op.err, (<char*>self.op.errmsg).decode("utf-8", "replace"))

    @property
    def times(self):
        """(started, completed) on the monotonic clock (``time.monotonic``), or None before
        completion."""
        if not al_load_acquire(&self.op.done):
            return None
        return (self.op.t_start, self.op.t_done)

    def describe(self):
        """Where the op stands: its name, phase and, for schedules, the step and peers."""
        cdef al_op* o = self.op
        cdef al_step* st
        phase = ("new", "running", "done")[o.phase]
        if o.kind == K_SCHEDULE and o.phase == PH_RUNNING and o.cur < o.nsteps:
            st = &o.steps[o.cur]
            return (f"{self.name}: step {o.cur + 1}/{o.nsteps} waiting "
                    f"(recv from rank {st.recv_peer}, send to rank {st.send_peer}, tag {o.tag})")
        return f"{self.name}: {phase}"

    def submit(self, adopt=False):
        """Hand the op to the progress engine."""
        cdef int rc
        if _orphans:
            _sweep_orphans()
        if not thread_multiple():
            _hooks.fail("nonblocking operations need MPI_THREAD_MULTIPLE; "
                        "do not lower mpi4py.rc.thread_level")
        if not adopt:
            self.op.phase = PH_NEW
        with nogil:
            rc = engine_submit(self.op)
        if rc != 0:
            _hooks.fail("the progress engine is stopped (interpreter exit)" if rc < 0
                        else f"could not start the progress engine thread (errno {rc})")

    def wait(self, double timeout=-1.0):
        """Wait for completion (timeout < 0: forever). Returns True when done."""
        cdef int ok
        if al_load_acquire(&self.op.done):
            return True
        with nogil:
            ok = wait_done(self.op, timeout)
        return bool(ok)

    def test(self):
        return al_load_acquire(&self.op.done) != 0

    def orphan(self):
        """The Request was dropped before completion: keep buffers alive until done."""
        if not al_load_acquire(&self.op.done):
            _orphans.append(self)


def _sweep_orphans():
    _orphans[:] = [o for o in _orphans if not o.done]


cdef inline void init_op(al_op* op, al_comm* c, int kind, char* sbuf, char* rbuf, int64_t count,
                         int dtype, int esize, int rop) noexcept:
    """The fields every op sets; the rest stay zero (calloc)."""
    op.kind = kind
    op.phase = PH_NEW
    op.comm = c
    op.sbuf = sbuf
    op.rbuf = rbuf
    op.count = count
    op.dtype = dtype
    op.esize = esize
    op.rop = rop
    op.mtype = g_types[dtype]
    op.mop = mpi_op_for(dtype, rop)


def make_op(CommState cs, int kind, name, intptr_t sbuf, intptr_t rbuf, int64_t count,
            int dtype, int esize, int rop, int root=0, int64_t count2=0, int peer2=0,
            int tag=0, Schedule schedule=None, double avg_div=0.0, intptr_t avg_buf=0,
            int64_t avg_cnt=0, keep=None):
    """Build a NativeOp. Pointers are addresses (0 for in place / unused); counts are elements."""
    cdef NativeOp o = NativeOp.__new__(NativeOp)
    cdef al_op* op = o.op
    init_op(op, cs.c, kind, <char*>sbuf, <char*>rbuf, count, dtype, esize, rop)
    op.tag = tag
    op.count2 = count2
    op.root = root
    op.peer2 = peer2
    op.avg_div = avg_div
    op.avg_buf = <char*>avg_buf
    op.avg_cnt = avg_cnt
    if schedule is not None:
        op.steps = schedule.steps
        op.nsteps = schedule.nsteps
        op.tmpbytes = <size_t>(schedule.tmp_elems * esize)
    o.keep = (cs, schedule, keep)
    o.name = name
    return o


# ---------------------------------------------------------------------------
# The allreduce call path, in Cython because it is latency-critical: buffer checks, op/dtype
# check, algorithm choice (cached per communicator), schedule lookup (cached), op creation and
# launch.  Anything unusual (non-ndarray buffers, errors) defers to the Python helpers in
# `_hooks`, so each error message is written once, in Python.

cdef object _hooks = None           # aluminum_py.communicator._Hooks instance
cdef dict _dtype_codes = {}         # np.dtype -> dtype code
cdef int _valid[16][16]             # capability table: _valid[dtype][op]
cdef int _avg_code = 10
memset(_valid, 0, sizeof(_valid))

def configure(hooks, dtype_codes, valid_pairs):
    """Install the Python helpers and the capability table (called once at import)."""
    global _hooks, _dtype_codes
    _hooks = hooks
    _dtype_codes = dict(dtype_codes)
    memset(_valid, 0, sizeof(_valid))
    for d, o in valid_pairs:
        _valid[d][o] = 1

cdef inline cnp.ndarray as_array(obj, str name, bint writable):
    cdef cnp.ndarray a
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
        if cnp.PyArray_IS_C_CONTIGUOUS(a) and (not writable or cnp.PyArray_ISWRITEABLE(a)):
            return a
    return _hooks.as_array(obj, name, writable)

cdef inline int dtype_code_of(cnp.ndarray a) except -1:
    code = _dtype_codes.get(<object>cnp.PyArray_DESCR(a))
    if code is None:
        _hooks.as_array(a, "sendbuf", False)      # raises the unsupported-dtype error
        return -1
    return code

cdef inline void check_error(NativeOp o) except *:
    if o.op.err != 0:
        _hooks.raise_error(o)

cdef class Launcher:
    """Per-communicator call path: caches of auto's choice and of native schedules."""
    cdef readonly CommState state
    cdef dict auto_cache
    cdef dict sched_cache
    cdef object selector          # (nbytes, itemsize) -> algorithm name (Python, cached here)
    cdef object builder           # (alg, count, inplace) -> Schedule
    cdef frozenset host_algs

    def choose(self, Py_ssize_t nbytes, int itemsize):
        """auto's (cached) choice for a message of `nbytes` with elements of `itemsize` bytes."""
        return self.resolve("auto", nbytes, itemsize)

    def __cinit__(self, CommState state, selector, builder, host_algs):
        self.state = state
        self.auto_cache = {}
        self.sched_cache = {}
        self.selector = selector
        self.builder = builder
        self.host_algs = frozenset(host_algs)

    cpdef object launch(self, NativeOp o, bint blocking, double timeout, str algorithm):
        """Run `o` in the caller (blocking) or hand it to the engine (returns a Request)."""
        cdef int ok
        if self.state.freed:
            _hooks.fail(f"{o.name}: the communicator has been freed")
        # MPI matches blocking collectives only with blocking ones and nonblocking only with
        # nonblocking ones, so the variant must not depend on per-rank state (whether this
        # rank still has ops pending): blocking calls use the blocking MPI call, wherever they
        # run (here or, behind pending ops, in the engine), unless a hang timeout is set (the
        # same on every rank), which needs the pollable MPI_I* call.
        o.op.blocking = blocking and timeout < 0
        if not blocking:
            o.submit()
            return _hooks.request(o, algorithm)
        if al_load_acquire(&self.state.c.pending) == 0:
            with nogil:
                ok = run_inline(o.op, timeout)
            if not ok:
                # kept alive first: the engine finishes it, or (below MPI_THREAD_MULTIPLE,
                # where submit raises) it stays posted and MPI may still write its buffers
                o.orphan()
                o.submit(adopt=True)
                _hooks.raise_timeout(o, timeout)
            check_error(o)
            return None
        o.submit()                      # keep call order behind this communicator's pending ops
        if not o.wait(timeout):
            o.orphan()
            _hooks.raise_timeout(o, timeout)
        check_error(o)
        return None

    cdef str resolve(self, str algorithm, Py_ssize_t nbytes, int itemsize):
        cdef object alg
        cdef Py_ssize_t key
        if algorithm == "auto":
            key = (nbytes << 5) | itemsize
            alg = self.auto_cache.get(key)
            if alg is None:
                alg = self.selector(nbytes, itemsize)
                if len(self.auto_cache) > 4096:
                    self.auto_cache.clear()
                self.auto_cache[key] = alg
            return <str>alg
        if algorithm in self.host_algs:
            return algorithm
        return _hooks.bad_algorithm(algorithm)     # raises

    cdef Schedule schedule(self, str alg, Py_ssize_t count, bint inplace):
        key = (alg, count, inplace)
        sched = self.sched_cache.get(key)
        if sched is None:
            sched = self.builder(alg, count, inplace)
            if len(self.sched_cache) >= 256:
                self.sched_cache.clear()
            self.sched_cache[key] = sched
        return <Schedule>sched

    cdef NativeOp build_allreduce(self, intptr_t sp, intptr_t rp, Py_ssize_t count, int code,
                                  int esize, int opcode, str alg, bint inplace, keep):
        """One allreduce op on checked buffers (addresses; sp == rp in place)."""
        cdef NativeOp o = NativeOp.__new__(NativeOp)
        cdef Schedule sched
        init_op(o.op, self.state.c, K_SCHEDULE, <char*>sp, <char*>rp, count, code, esize, opcode)
        o.op.avg_buf = <char*>rp
        o.op.avg_cnt = count
        if opcode == _avg_code:
            o.op.avg_div = <double>self.state.c.size
        if alg == "mpi":
            o.op.kind = K_ALLREDUCE
            o.op.sbuf = NULL if inplace else <char*>sp
            o.name = "allreduce/mpi"
            o.keep = (self.state, None, keep)
        else:
            sched = self.schedule(alg, count, inplace)
            o.op.tag = self.state.next_tag()
            o.op.steps = sched.steps
            o.op.nsteps = sched.nsteps
            o.op.avg_in_steps = sched.owned
            o.op.tmpbytes = <size_t>(sched.tmp_elems * esize)
            o.name = "allreduce/" + alg
            o.keep = (self.state, sched, keep)
        return o

    def host_transfer_allreduce(self, Device dev, uintptr_t stream, uintptr_t dsend,
                                uintptr_t drecv, Py_ssize_t count, int code, int esize,
                                int opcode, str algorithm, keep, double timeout=-1.0):
        """Enqueue a host-transfer allreduce on `stream` and hand it to the engine.

        On the stream: copy dsend -> pinned, write 1 to a pinned word (cuStreamWriteValue32),
        wait until the host writes the flag, copy pinned -> drecv, write 1 to another word.  The
        engine polls the first word, runs the host algorithm (`algorithm`, in place on the
        pinned buffer), writes the flag, polls the second word, then returns the pinned buffer
        to the device's pool.  The engine makes no driver call for the op: a thread inside the
        driver waiting on this stream (a pageable cudaMemcpy, cuMemFreeHost, a synchronize)
        may hold locks an event query would need, and the engine must stay free to write the
        flag that stream waits for (the deadlock the first 2-rank GPU run hit).  The host
        never waits for the device.
        `timeout` > 0 (AL_HANG_TIMEOUT): the engine abandons the host part if it has not
        finished that many seconds after this call (ht_abandon).  Returns the NativeOp
        (submitted).
        """
        cdef size_t nbytes = <size_t>count * esize
        cdef al_device* d = dev.dev
        cdef NativeOp outer, inner
        cdef char* pinned
        cdef int rc
        if self.state.freed:
            _hooks.fail("host-transfer allreduce: the communicator has been freed")
        alg = self.resolve(algorithm, nbytes, esize)
        dev.take_pinned(nbytes + 64, &pinned)
        try:
            inner = self.build_allreduce(<intptr_t>pinned, <intptr_t>pinned, count, code, esize,
                                         opcode, alg, True, None)
        except BaseException:
            al_pinned_put(d, pinned)              # nothing was enqueued: the buffer is free
            raise
        outer = NativeOp.__new__(NativeOp)
        outer.op.kind = K_HOST_TRANSFER
        outer.op.phase = PH_NEW
        outer.op.comm = self.state.c
        outer.op.dev = d
        outer.op.stream = <void*>stream
        outer.op.pinned = pinned
        outer.op.flag = <uint32_t*>(pinned + ((nbytes + 7) & ~(<size_t>7)))
        outer.op.flag[0] = 0                      # release: written by the engine
        outer.op.flag[1] = 0                      # copy to pinned done: written by the stream
        outer.op.flag[2] = 0                      # copy back done: written by the stream
        outer.op.inner = inner.op
        if timeout > 0:
            outer.op.hang = timeout
            outer.op.deadline = al_now() + timeout
        outer.name = "allreduce/ht_" + alg
        outer.keep = (self.state, inner, (dev, keep))
        what = "cuMemcpyAsync (device to pinned)"
        rc = d.memcpy_async(d.ctx, pinned, <void*>dsend, nbytes, outer.op.stream)
        if rc == 0:
            what = "cuStreamWriteValue32"
            rc = d.write_value32(d.ctx, outer.op.stream, &outer.op.flag[1], 1)
        if rc == 0:
            what = "cuStreamWaitValue32"
            rc = d.wait_value32(d.ctx, outer.op.stream, outer.op.flag, 1)
        if rc == 0:
            what = "cuMemcpyAsync (pinned to device)"
            rc = d.memcpy_async(d.ctx, <void*>drecv, pinned, nbytes, outer.op.stream)
        if rc == 0:
            what = "cuStreamWriteValue32"
            rc = d.write_value32(d.ctx, outer.op.stream, &outer.op.flag[2], 1)
        if rc != 0:
            # part of the op may be queued: release the stream, leak the buffer (the stream
            # may still copy from it), never submit
            al_store_release(<int*>outer.op.flag, 1)
            outer.op.pinned = NULL
            outer.op.phase = PH_DONE
            dev.fail(f"host-transfer allreduce: enqueueing on the device stream: {what}", rc)
        outer.submit()
        return outer

    def allreduce(self, sendbuf, recvbuf, int opcode, str algorithm, bint blocking, double timeout):
        cdef cnp.ndarray s, r
        cdef bint inplace
        cdef Py_ssize_t count
        cdef intptr_t sp, rp
        cdef int code
        cdef char* slo
        cdef char* rlo
        cdef NativeOp o
        cdef str alg
        s = as_array(sendbuf, "sendbuf", recvbuf is None)
        code = dtype_code_of(s)
        count = cnp.PyArray_SIZE(s)
        if recvbuf is None:
            r = s
            inplace = True
        else:
            r = as_array(recvbuf, "recvbuf", True)
            if cnp.PyArray_DESCR(r) != cnp.PyArray_DESCR(s) and r.dtype != s.dtype:
                _hooks.same_dtype(s, r, "sendbuf", "recvbuf")
            if cnp.PyArray_SIZE(r) < count:
                _hooks.at_least(r, count, "recvbuf", "one element per sendbuf element")
            slo = <char*>cnp.PyArray_DATA(s)
            rlo = <char*>cnp.PyArray_DATA(r)
            if count == 0 or slo == rlo:
                inplace = count != 0
            elif slo < rlo + cnp.PyArray_NBYTES(r) and rlo < slo + cnp.PyArray_NBYTES(s):
                _hooks.no_partial_overlap(s, r, "sendbuf", "recvbuf")   # raises
                inplace = False
            else:
                inplace = False
        if opcode < 0 or opcode >= 16 or not _valid[code][opcode]:
            _hooks.check_op(opcode, code, s.dtype)                        # raises
        if count > 2147483647:
            _hooks.too_many(count, "sendbuf")
        alg = self.resolve(algorithm, cnp.PyArray_NBYTES(s), <int>cnp.PyArray_ITEMSIZE(s))
        rp = <intptr_t>cnp.PyArray_DATA(r)
        sp = rp if inplace else <intptr_t>cnp.PyArray_DATA(s)
        o = self.build_allreduce(sp, rp, count, code, <int>cnp.PyArray_ITEMSIZE(s), opcode, alg,
                                 inplace, (s, r))
        return self.launch(o, blocking, timeout, alg)
