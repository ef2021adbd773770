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
        if o.kind == K_SHM_ALLREDUCE and o.phase == PH_RUNNING:
            return f"{self.name}: {shm_describe(o)}"
        if o.kind == K_SCHEDULE and o.phase == PH_RUNNING and o.sched.cur < o.sched.nsteps:
            st = &o.sched.steps[o.sched.cur]
            return (f"{self.name}: step {o.sched.cur + 1}/{o.sched.nsteps} waiting "
                    f"(recv from rank {st.recv_peer}, send to rank {st.send_peer}, tag {o.tag})")
        return f"{self.name}: {phase}"

    def submit(self, adopt=False):
        """Hand the op to the progress engine."""
        cdef int rc
        if g_forked:
            fork_fail(self.name)
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
        """Wait for completion (timeout < 0: forever). Returns True when done. Every WAKE
        seconds it runs the signal handlers: their exception (KeyboardInterrupt) propagates
        and the op goes on in the engine."""
        cdef int r, spin = 1
        cdef double deadline
        if al_load_acquire(&self.op.done):
            return True
        if g_forked:
            fork_fail(self.name)
        deadline = deadline_of(timeout)
        while True:
            with nogil:
                r = wait_done(self.op, deadline, spin)
            if r != SLICE:
                return r == 1
            spin = 0
            PyErr_CheckSignals()

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
    op.mpi.mop = mpi_op_for(dtype, rop)


def make_op(CommState cs, int kind, name, intptr_t sbuf, intptr_t rbuf, int64_t count,
            int dtype, int esize, int rop, int root=0, int64_t count2=0, int peer2=0,
            int tag=0, Schedule schedule=None, double avg_div=0.0, intptr_t avg_buf=0,
            int64_t avg_cnt=0, keep=None):
    """Build a NativeOp. Pointers are addresses (0 for in place / unused); counts are elements."""
    cdef NativeOp o = NativeOp.__new__(NativeOp)
    cdef al_op* op = o.op
    init_op(op, cs.c, kind, <char*>sbuf, <char*>rbuf, count, dtype, esize, rop)
    op.tag = tag
    op.mpi.count2 = count2
    op.mpi.root = root
    op.mpi.peer2 = peer2
    op.result.avg_div = avg_div
    op.result.buf = <char*>avg_buf
    op.result.count = avg_cnt
    if schedule is not None:
        op.sched.steps = schedule.steps
        op.sched.nsteps = schedule.nsteps
        op.sched.tmpbytes = <size_t>(schedule.tmp_elems * esize)
    o.keep = (cs, schedule, keep)
    o.name = name
    return o
