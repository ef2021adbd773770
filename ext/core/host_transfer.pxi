# The host-transfer state machine (paper Figs. 5-6): device copies around an inner host
# allreduce, enqueued by Launcher.host_transfer_allreduce and polled by the engine.

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



def ht_times(NativeOp o):
    """When the host-transfer phases ended: (copy-out seen, host algorithm done, flag written,
    copy-back seen), seconds on the monotonic clock."""
    return tuple(o.op.ht_times[i] for i in range(4))
