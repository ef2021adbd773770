# The op state machine: op_start and op_step are non-blocking and return 1 once the op is
# complete; the caller (blocking calls) and the engine thread drive every kind with them.
# Each kind's machine lives in its own file (schedule.pxi, passthrough.pxi,
# ht_op.pxi); op_finish is where every op ends.

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

cdef char* op_take_scratch(al_op* op, size_t nbytes) noexcept nogil:
    """Give `op` scratch of at least `nbytes` (scratch_get): op.sched.tmp and tmp_base at its
    start, tmpbytes what it holds; op_finish returns it.  NULL (tmp and tmp_base too): out of
    memory.  The one place an op takes its scratch (the schedules, hierarchical over segments),
    so that what op_finish returns is always set."""
    cdef char* base = scratch_get(nbytes, &op.sched.tmpbytes)
    op.sched.tmp_base = base
    op.sched.tmp = base
    return base


cdef int op_finish(al_op* op) noexcept nogil:
    # post-processing of this rank's result region (result.buf[:result.count])
    if op.err == 0 and op.result.count > 0:
        if op.result.avg_div > 0 and not op.result.avg_in_steps:
            al_scale_div(op.dtype, op.result.buf, <size_t>op.result.count, op.result.avg_div)
        if ((op.comm.size == 1 or op.result.logical01)
                and (op.rop == AL_LAND or op.rop == AL_LOR or op.rop == AL_LXOR)):
            # one rank: no reduction ran, but logical results are 0/1 as with more ranks
            al_reduce(op.dtype, AL_LAND, op.result.buf, op.result.buf, op.result.buf,
                      <size_t>op.result.count)
    if op.sched.tmp_base != NULL:
        scratch_put(op.sched.tmp_base, op.sched.tmpbytes)
        op.sched.tmp_base = NULL
        op.sched.tmp = NULL
    op.phase = PH_DONE
    return 1


cdef int op_start(al_op* op) noexcept nogil:
    """Begin an op (never blocks). Returns 1 if already complete."""
    op.phase = PH_RUNNING
    op.t_start = al_now()
    if op.kind == K_HOST_TRANSFER:
        op.ht.phase = HT_COPY_OUT
        return ht_step(op)
    if op.kind == K_SCHEDULE:
        op.sched.cur = 0
        op.sched.posted = 0
        if not sched_scratch(op):
            op.err = -1
            snprintf(op.errmsg, 256, "out of memory allocating %zu bytes of scratch",
                     op.sched.tmpbytes)
            return op_finish(op)
        return sched_advance(op)
    if is_shm_kind(op.kind):
        return shm_start(op)
    if op.kind == K_HIER_SHM:
        return hier_start(op)
    return mpi_start(op)

cdef int op_step(al_op* op) noexcept nogil:
    """Make progress without blocking; returns 1 when the op is complete."""
    cdef int rc, flag
    if op.phase == PH_DONE:
        return 1
    if op.kind == K_SCHEDULE:
        return sched_advance(op)
    if op.kind == K_HOST_TRANSFER:
        return ht_step(op)
    if is_shm_kind(op.kind):
        return shm_step(op)
    if op.kind == K_HIER_SHM:
        return hier_step(op)
    if op.nreqs > 0:
        if op.err != 0:
            return op_drain(op)
        rc = mpi.MPI_Testall(op.nreqs, op.reqs, &flag, op.stats)
        if rc != mpi.MPI_SUCCESS:
            set_mpi_error(op, status_error(op, rc), "MPI_Testall")
            if rc == mpi.MPI_ERR_IN_STATUS and has_pending(op):
                return 0            # op_drain: the others still use their buffers
            op.nreqs = 0
            return op_finish(op)
        if not flag:
            return 0
        op.nreqs = 0
    return op_finish(op)

cdef inline int has_pending(al_op* op) noexcept nogil:
    """After MPI_ERR_IN_STATUS: whether a request neither failed nor completed (MPI_ERR_PENDING:
    still active, e.g. Sendrecv's send when its receive was truncated)."""
    cdef int i
    for i in range(op.nreqs):
        if op.stats[i].MPI_ERROR == mpi.MPI_ERR_PENDING:
            return 1
    return 0

cdef int op_drain(al_op* op) noexcept nogil:
    """A request of the op failed while others were pending (has_pending): the op completes,
    with its first error, only once those are done, so that its buffers are never released
    under MPI (a rendezvous send's peer reads the send buffer directly).  Only the pending
    ones are tested, each on its own (MPICH leaves a failed request allocated: MPI_Testall
    would report it again); op.stats keep the first envelope (a truncated receive's)."""
    cdef mpi.MPI_Status st
    cdef int i, rc, flag, pending = 0
    for i in range(op.nreqs):
        if op.stats[i].MPI_ERROR != mpi.MPI_ERR_PENDING or op.reqs[i] == mpi.MPI_REQUEST_NULL:
            continue
        flag = 0
        rc = mpi.MPI_Test(&op.reqs[i], &flag, &st)
        if rc != mpi.MPI_SUCCESS:
            op.stats[i].MPI_ERROR = rc              # failed too: complete, no longer pending
        elif flag:
            op.stats[i].MPI_ERROR = mpi.MPI_SUCCESS
        else:
            pending = 1
    if pending:
        return 0
    for i in range(op.nreqs):           # the failed ones, complete but still allocated
        if op.reqs[i] != mpi.MPI_REQUEST_NULL:
            mpi.MPI_Request_free(&op.reqs[i])
    op.nreqs = 0
    return op_finish(op)

cdef inline int req_is_recv(al_op* op, int i) noexcept nogil:
    """Whether op.reqs[i] is a receive (see sched_advance and mpi_start for the order)."""
    if op.kind == K_SCHEDULE:
        return (i == 0 and op.sched.cur < op.sched.nsteps
                and op.sched.steps[op.sched.cur].recv_peer >= 0)
    return i == 0 and kind_info(op.kind).recv_first

cdef void op_cancel(al_op* op, const char* why) noexcept nogil:
    """Abandon an op (engine shutdown): cancel its outstanding receives and free every
    outstanding MPI request.  Sends and collectives are only freed: MPI-4 deprecates
    cancelling sends (MPICH over UCX crashed cancelling a large, unmatched one) and forbids
    cancelling collectives."""
    cdef int i
    if op.phase == PH_NEW:
        op.t_start = al_now()         # never started: Request.times reads (cancel, cancel)
    for i in range(op.nreqs):
        if op.reqs[i] == mpi.MPI_REQUEST_NULL:     # completed or failed (op_drain)
            continue
        if req_is_recv(op, i):
            mpi.MPI_Cancel(&op.reqs[i])
        mpi.MPI_Request_free(&op.reqs[i])
    op.nreqs = 0
    if op.kind == K_HOST_TRANSFER and op.ht.flag != NULL:
        if op.ht.inner != NULL and op.ht.inner.phase == PH_RUNNING:
            op_cancel(op.ht.inner, why)
        al_store_release(<int*>&op.ht.flag[FLAG_RELEASE], 1)   # never leave a device stream blocked
        # the pinned buffer is leaked: the device may still copy from it
    if op.kind == K_HIER_SHM:
        hier_cancel(op, why)
    op.err = -1
    strncpy(op.errmsg, why, 255)
    op_finish(op)
