# The host-transfer state machine (paper Figs. 5-6): device copies around an inner host
# allreduce, enqueued by host_transfer_allreduce (the end of this file) and polled by the engine.

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

cdef inline int ht_expired(al_op* op) noexcept nogil:
    """`op` is a host-transfer op with a hang timeout (AL_HANG_TIMEOUT) whose deadline has
    passed.  The engine asks it of an op it holds back in its start queue (behind an earlier op
    over the segment, or an earlier op waiting to start its MPI collective): the deadline
    counts from the call, wherever the op waits, and its stream must not wait on the flag past
    it (ht_abandon releases it)."""
    return op.kind == K_HOST_TRANSFER and op.ht.hang > 0 and al_now() > op.ht.deadline

cdef void abandon_running(al_op* op) noexcept nogil:
    """Give up the running inner op `op` of an abandoned host-transfer op for good.  As op_cancel
    does, its receives are cancelled and every point-to-point request freed, and sends are only
    freed, never cancelled (MPI-4 deprecates it; MPICH over UCX crashed cancelling a large,
    unmatched one); an MPI collective request is left to MPI (freeing or cancelling one is
    erroneous).  Unlike op_finish, its scratch is leaked, never returned to the pool: a receive
    that was already matched completes into it after the cancel.  A K_HIER_SHM op: its running
    phase likewise, and its own scratch is leaked too."""
    cdef al_hier_state* h
    cdef int i
    if op.phase != PH_RUNNING:
        return
    if op.kind == K_HIER_SHM:
        h = &op.hier
        if h.cur < h.nphases and h.started and h.phases[h.cur].op != NULL:
            abandon_running(h.phases[h.cur].op)
    elif not kind_info(op.kind).mpi_collective:
        for i in range(op.nreqs):
            if req_is_recv(op, i):
                mpi.MPI_Cancel(&op.reqs[i])
            mpi.MPI_Request_free(&op.reqs[i])
    op.nreqs = 0
    op.sched.tmp = NULL
    op.sched.tmp_base = NULL
    op.phase = PH_DONE

cdef int ht_abandon(al_op* op) noexcept nogil:
    """The host part missed its deadline (AL_HANG_TIMEOUT): fail the op and release the stream.

    Called by ht_step for a started op, and by the engine for one it still holds back in its
    start queue (ht_expired).  The inner algorithm is given up (abandon_running: receives
    cancelled, requests freed, scratch leaked).  The pinned buffer is leaked too: the device or
    MPI may still write into it.  An inner "shm" allreduce (started or not) leaves this rank's
    rounds of the segment out of step with its peers' for good (they may have published for it,
    or be waiting for it): the segment is marked unusable, so that every later op over it, here
    and on the peers (who see the mark while they wait), fails at once instead of waiting for,
    or reading, a round that will never match.  The same for an inner "hierarchical" over the
    nodes' segments (its node's segment)."""
    cdef al_op* inner = op.ht.inner
    cdef al_sched_state* s = &inner.sched
    cdef al_shm_seg* seg = NULL
    cdef char where[160]
    if op.phase == PH_NEW:
        op.t_start = al_now()
        snprintf(where, 160, "not started (queued behind an earlier op; device-to-pinned copy %s)",
                 "complete" if al_load_acquire(<int*>&op.ht.flag[FLAG_COPIED_OUT]) else "not complete")
    elif op.ht.phase == HT_COPY_OUT:
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
    if seg != NULL:
        al_shm_mark_broken(seg)
    abandon_running(inner)
    inner.phase = PH_DONE
    op.comm.abandoned = 1
    op.err = AL_ERR_TIMEOUT
    snprintf(op.errmsg, 256, "host part not complete after %g s (AL_HANG_TIMEOUT): %s; the stream "
             "was released and the result is undefined%s", op.ht.hang, where,
             "; the communicator's shared-memory segment is now unusable"
             if seg != NULL else "")
    al_store_release(<int*>&op.ht.flag[FLAG_RELEASE], 1)
    op.ht.pinned = NULL
    return op_finish(op)

# The device calls that enqueue a host-transfer op, in order (ht_enqueue; error messages).
HT_ENQUEUE_CALLS = ("cuMemcpyAsync (device to pinned)", "cuStreamWriteValue32",
                    "cuStreamWaitValue32", "cuMemcpyAsync (pinned to device)",
                    "cuStreamWriteValue32")

cdef int ht_enqueue(al_device* d, al_op* op, void* dsend, void* drecv, size_t nbytes,
                    int* failed) noexcept nogil:
    """Queue the device part of host-transfer op `op` on its stream (docs/gpu.md, step 4):
    copy out, write the copied-out word, wait for the flag, copy back, write the copied-back
    word.  Called without the GIL (the rule of every device call, device.pxi): a call may wait
    inside the driver for another thread's synchronizing call, whose stream may wait for a
    thread that needs the GIL.  Returns 0, or the failing call's code with its index in
    HT_ENQUEUE_CALLS in *failed."""
    cdef void* st = op.ht.stream
    cdef int rc
    failed[0] = 0
    rc = d.memcpy_async(d.ctx, op.ht.pinned, dsend, nbytes, st)
    if rc != 0:
        return rc
    failed[0] = 1
    rc = d.write_value32(d.ctx, st, &op.ht.flag[FLAG_COPIED_OUT], 1)
    if rc != 0:
        return rc
    failed[0] = 2
    rc = d.wait_value32(d.ctx, st, &op.ht.flag[FLAG_RELEASE], 1)
    if rc != 0:
        return rc
    failed[0] = 3
    rc = d.memcpy_async(d.ctx, drecv, op.ht.pinned, nbytes, st)
    if rc != 0:
        return rc
    failed[0] = 4
    return d.write_value32(d.ctx, st, &op.ht.flag[FLAG_COPIED_BACK], 1)


def ht_times(NativeOp o):
    """When the host-transfer phases ended: (copy-out seen, host algorithm done, flag written,
    copy-back seen), seconds on the monotonic clock."""
    return tuple(o.op.ht.times[i] for i in range(HT_NPHASES))


# The enqueue of one host-transfer allreduce: the op above, built beside its state machine
# (its inner op is the Launcher's allreduce on the pinned buffer).
def host_transfer_allreduce(Launcher L, Device dev, uintptr_t stream, uintptr_t dsend,
                            uintptr_t drecv, Py_ssize_t count, int code, int esize,
                            int opcode, str algorithm, keep, double timeout=-1.0):
    """Enqueue a host-transfer allreduce on `stream` and hand it to the engine; `L`: the
    Launcher of the communicator whose host algorithm runs it.

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
    cdef int rc, failed = 0
    if unusual(L.state):
        L.state.check_usable("host-transfer allreduce")
    alg = L.choose_for(algorithm, nbytes, esize)
    dev.take_pinned(nbytes + 64, &pinned)
    try:
        inner = build_allreduce(L, <intptr_t>pinned, <intptr_t>pinned, count, code, esize,
                                opcode, alg, True, None)
        if inner.keep is None:                # "shm": the outer op keeps the state
            inner.keep = (L.state, None, None)
    except BaseException:
        al_pinned_put(d, pinned)              # nothing was enqueued: the buffer is free
        raise
    outer = NativeOp.__new__(NativeOp)
    outer.op.kind = K_HOST_TRANSFER
    outer.op.phase = PH_NEW
    outer.op.comm = L.state.c
    outer.op.ht.dev = d
    outer.op.ht.stream = <void*>stream
    outer.op.ht.pinned = pinned
    outer.op.ht.flag = <uint32_t*>(pinned + ((nbytes + 7) & ~(<size_t>7)))
    outer.op.ht.flag[FLAG_RELEASE] = 0           # written by the engine
    outer.op.ht.flag[FLAG_COPIED_OUT] = 0        # written by the stream
    outer.op.ht.flag[FLAG_COPIED_BACK] = 0       # written by the stream
    outer.op.ht.inner = inner.op
    if timeout > 0:
        outer.op.ht.hang = timeout
        outer.op.ht.deadline = al_now() + timeout
    outer.name = "allreduce/ht_" + alg
    outer.keep = (L.state, inner, (dev, keep))
    with nogil:                                  # device calls never hold the GIL
        rc = ht_enqueue(d, outer.op, <void*>dsend, <void*>drecv, nbytes, &failed)
    if rc != 0:
        # part of the op may be queued: release the stream, leak the buffer (the stream
        # may still copy from it), never submit
        al_store_release(<int*>&outer.op.ht.flag[FLAG_RELEASE], 1)
        outer.op.ht.pinned = NULL
        outer.op.phase = PH_DONE
        dev.fail(f"host-transfer allreduce: enqueueing on the device stream: "
                 f"{HT_ENQUEUE_CALLS[failed]}", rc)
    if g_trace is not None:
        outer.t_call = al_now()
        trace_append(outer)
    outer.submit()
    return outer
