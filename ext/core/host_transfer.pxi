# The host-transfer state machine (paper Figs. 5-6): device copies around an inner host
# allreduce, enqueued by Launcher.host_transfer_allreduce and polled by the engine.

cdef int ht_step(al_op* op) noexcept nogil:
    """Host-transfer state machine (paper Figs. 5-6), polled by the engine; never blocks and
    never calls the device driver (only loads and stores on the pinned words)."""
    if op.ht.phase <= HT_HOST_ALGORITHM and op.ht.hang > 0 and al_now() > op.ht.deadline:
        return ht_abandon(op)
    if op.ht.phase == HT_COPY_OUT:                # device -> pinned copy done?
        if not al_load_acquire(<int*>&op.ht.flag[FLAG_COPIED_OUT]):
            return 0
        op.ht.times[HT_COPY_OUT] = al_now()
        op.ht.phase = HT_HOST_ALGORITHM
        if op_start(op.ht.inner):
            op.ht.phase = HT_RELEASE
    if op.ht.phase == HT_HOST_ALGORITHM:          # the host algorithm on the pinned buffer
        if not op_step(op.ht.inner):
            return 0
        op.ht.phase = HT_RELEASE
    if op.ht.phase == HT_RELEASE:                 # release the stream: it copies back next
        op.ht.times[HT_HOST_ALGORITHM] = al_now()
        if op.ht.inner.phase == PH_DONE and op.ht.inner.err != 0 and op.err == 0:
            op.err = op.ht.inner.err
            strncpy(op.errmsg, op.ht.inner.errmsg, 255)
        al_store_release(<int*>&op.ht.flag[FLAG_RELEASE], 1)
        op.ht.times[HT_RELEASE] = al_now()
        op.ht.phase = HT_COPY_BACK
    if not al_load_acquire(<int*>&op.ht.flag[FLAG_COPIED_BACK]):  # pinned -> device copy done?
        return 0
    op.ht.times[HT_COPY_BACK] = al_now()
    al_pinned_put(op.ht.dev, op.ht.pinned)        # only after the last copy completed; never
    op.ht.pinned = NULL                           # a (synchronizing) free on this thread
    return op_finish(op)

cdef int ht_abandon(al_op* op) noexcept nogil:
    """The host part missed its deadline (AL_HANG_TIMEOUT): fail the op and release the stream.

    The inner algorithm's point-to-point requests are cancelled; an MPI collective request is
    left to MPI (freeing or cancelling one is erroneous).  The pinned buffer and the inner
    op's scratch are leaked: the device or MPI may still write into them.  An inner "shm"
    allreduce (started or not) leaves this rank's rounds of the segment out of step with its
    peers' for good (they may have published for it, or be waiting for it): the segment is
    marked unusable, so that every later op over it, here and on the peers (who see the mark
    while they wait), fails at once instead of waiting for, or reading, a round that will
    never match.  The same for an inner "hierarchical" over the nodes' segments (its node's
    segment; its running phase is cancelled)."""
    cdef al_op* inner = op.ht.inner
    cdef al_sched_state* s = &inner.sched
    cdef al_shm_seg* seg = NULL
    cdef int i
    cdef char where[160]
    if op.ht.phase == HT_COPY_OUT:
        snprintf(where, 160, "the stream had not reached it (device-to-pinned copy not complete)")
    elif inner.kind == K_SCHEDULE and inner.phase == PH_RUNNING and s.cur < s.nsteps:
        snprintf(where, 160, "host algorithm at step %d/%d (recv from rank %d, send to rank %d, tag %d)",
                 s.cur + 1, s.nsteps, s.steps[s.cur].recv_peer, s.steps[s.cur].send_peer, inner.tag)
    elif inner.kind == K_SHM_ALLREDUCE and inner.phase == PH_RUNNING:
        snprintf(where, 160, "shm at elements %lld..%lld of %lld (rank %d has not published %llu)", <long long>inner.shm.off,
                 <long long>(inner.shm.off + inner.shm.chunk), <long long>inner.count,
                 inner.shm.waiting, <unsigned long long>inner.shm.want)
    elif inner.kind == K_HIER_SHM and inner.phase == PH_RUNNING:
        snprintf(where, 160, "hierarchical at phase %d/%d", inner.hier.cur + 1, inner.hier.nphases)
    else:
        snprintf(where, 160, "host algorithm (MPI call) not complete")
    if inner.kind == K_SHM_ALLREDUCE:
        seg = op.comm.shm
    elif inner.kind == K_HIER_SHM:
        seg = hier_segment(inner)
        hier_cancel(inner, "abandoned with its host-transfer op")
    if seg != NULL:
        al_shm_mark_broken(seg)
    if inner.phase == PH_RUNNING:
        if inner.kind == K_SCHEDULE:
            for i in range(inner.nreqs):
                mpi.MPI_Cancel(&inner.reqs[i])
                mpi.MPI_Request_free(&inner.reqs[i])
        inner.nreqs = 0
        inner.sched.tmp = NULL
        inner.phase = PH_DONE
    op.err = AL_ERR_TIMEOUT
    snprintf(op.errmsg, 256, "host part not complete after %g s (AL_HANG_TIMEOUT): %s; the stream "
             "was released and the result is undefined%s", op.ht.hang, where,
             "; the communicator's shared-memory segment is now unusable"
             if seg != NULL else "")
    al_store_release(<int*>&op.ht.flag[FLAG_RELEASE], 1)
    op.ht.pinned = NULL
    return op_finish(op)



def ht_times(NativeOp o):
    """When the host-transfer phases ended: (copy-out seen, host algorithm done, flag written,
    copy-back seen), seconds on the monotonic clock."""
    return tuple(o.op.ht.times[i] for i in range(HT_NPHASES))
