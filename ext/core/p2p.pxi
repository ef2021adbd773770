# The user's point-to-point set beyond Send/Recv: Probe / Iprobe on the user's
# point-to-point communicator, and the wait of Waitany / Waitsome (wait_any) over several
# requests.  Both wait as every wait of a calling thread does (engine.pxi): never a blocking MPI
# call, the GIL released, back in Python every WAKE seconds for the signal handlers and a
# communicator a peer broke, and a deadline (AL_HANG_TIMEOUT or the caller's timeout).

DEF PROBE_SPIN = 2e-4       # seconds a blocking probe polls (wait_poll's policy) before sleeping
DEF PROBE_NAP_MAX = 1e-3    # the longest sleep between two polls after that (doubling from 20 us)

cdef int probe_slice(al_comm* c, int source, int tag, double deadline, mpi.MPI_Status* st,
                     int* rc) noexcept nogil:
    """Poll MPI_Iprobe(source, tag) on `c`'s point-to-point communicator until a message is
    there (1), `deadline` passed (0), WAKE seconds passed (SLICE) or MPI failed (-1, code in
    `rc`).  First it polls as a blocking call's wait does (a message on its way is seen without
    a sleep), then it sleeps between polls, up to PROBE_NAP_MAX: a probe may wait long for a
    message, and must not hold a core meanwhile."""
    cdef int flag = 0
    cdef long polls = 0
    cdef double now, start = al_now(), since = 0.0, naptime = 2e-5
    cdef double wake = start + WAKE
    while True:
        rc[0] = mpi.MPI_Iprobe(source, tag, c.p2p, &flag, st)
        if rc[0] != mpi.MPI_SUCCESS:
            return -1
        if flag:
            return 1
        polls += 1
        now = al_now()
        if now >= deadline:
            return 0
        if now >= wake:
            return SLICE
        if now - start < PROBE_SPIN:
            wait_poll(polls, &since, g_wait_spin, 0)
        else:
            nap(naptime)
            naptime = naptime * 2 if naptime * 2 < PROBE_NAP_MAX else PROBE_NAP_MAX

def probe(CommState cs, int source, int tag, bint blocking, double timeout, name):
    """MPI_Iprobe on `cs`'s point-to-point communicator: (source, tag, bytes) of the first
    message that matches `source` and `tag` (MPI's wildcards allowed), without receiving it.
    blocking: poll until one is there (probe_slice), at most `timeout` seconds (< 0: forever);
    otherwise one poll.  None: no message (nonblocking) or the timeout passed (blocking).
    `name` names the call in errors; the threading rule holds (check_usable)."""
    cdef mpi.MPI_Status st
    cdef int rc = 0, r, flag = 0, n = 0
    cdef double deadline
    if unusual(cs):
        cs.check_usable(name)
    if not blocking:
        with nogil:
            rc = mpi.MPI_Iprobe(source, tag, cs.c.p2p, &flag, &st)
        r = -1 if rc != mpi.MPI_SUCCESS else flag
    else:
        deadline = deadline_of(timeout)
        cs.busy = True          # bind_thread and Free refuse meanwhile, as in a blocking call
        try:
            while True:
                with nogil:
                    r = probe_slice(cs.c, source, tag, deadline, &st, &rc)
                if r != SLICE:
                    break
                PyErr_CheckSignals()
                if comm_poll_broken(cs.c):
                    _hooks.fail(f"{name}: this communicator is unusable: "
                                f"{(<char*>cs.c.why).decode('utf-8', 'replace')}")
        finally:
            cs.busy = False
    if r < 0:
        _hooks.mpi_failed(f"{name}: MPI_Iprobe", rc)
    if r == 0:
        return None
    mpi.MPI_Get_count(&st, mpi.MPI_BYTE, &n)
    return (st.MPI_SOURCE, st.MPI_TAG, n)


cdef int wait_any_done(al_op** ops, int n, double deadline, int spin) noexcept nogil:
    """wait_done (engine.pxi) for the first of `n` ops: the index of a done op, -1 past
    `deadline`, -SLICE when WAKE passed first.  It sleeps on the engine's condition variable,
    which every op completed by the engine signals (notify_done)."""
    cdef int i, j
    cdef double now, until, wake
    cdef timespec ts
    for i in range(200 if spin else 1):
        for j in range(n):
            if al_load_acquire(&ops[j].done):
                return j
        if i >= 50:
            sched_yield()
    wake = al_now() + WAKE
    pthread_mutex_lock(&g_lock)
    al_fetch_add(&g_waiters, 1)
    j = -1
    while True:
        for i in range(n):
            if al_load_seqcst(&ops[i].done):
                j = i
                break
        if j >= 0:
            break
        now = al_now()
        if now >= deadline or now >= wake:
            break
        until = (deadline if deadline < wake else wake) - now
        clock_gettime(CLOCK_REALTIME, &ts)
        ts.tv_nsec += <long>(until * 1e9)
        ts.tv_sec += ts.tv_nsec // 1000000000
        ts.tv_nsec = ts.tv_nsec % 1000000000
        pthread_cond_timedwait(&g_done_cond, &g_lock, &ts)
    al_fetch_add(&g_waiters, -1)
    pthread_mutex_unlock(&g_lock)
    if j >= 0:
        return j
    return -1 if al_now() >= deadline else -SLICE

def wait_any(ops, double timeout=-1.0):
    """Wait until one of the NativeOps `ops` (a sequence; none may be None) completes: its
    index, or -1 once `timeout` seconds passed (< 0: no limit).  Every WAKE seconds it runs the
    signal handlers and raises aluminum_py.Error if an op's communicator is broken (as
    NativeOp.wait does)."""
    cdef Py_ssize_t n = len(ops), i
    cdef al_op** arr
    cdef int r, spin = 1
    cdef double deadline = deadline_of(timeout)
    cdef NativeOp o
    if n == 0:
        return -1
    if g_forked:
        fork_fail("Waitany")
    arr = <al_op**>malloc(n * sizeof(al_op*))
    if arr == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            arr[i] = (<NativeOp?>ops[i]).op
        while True:
            with nogil:
                r = wait_any_done(arr, <int>n, deadline, spin)
            if r != -SLICE:
                return r
            spin = 0
            PyErr_CheckSignals()
            for i in range(n):
                o = <NativeOp>ops[i]
                if comm_poll_broken(o.op.comm):
                    _hooks.fail(f"{o.name}: this communicator is unusable: "
                                f"{(<char*>o.op.comm.why).decode('utf-8', 'replace')}")
    finally:
        free(arr)
