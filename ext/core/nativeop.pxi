_orphans = []   # (NativeOp) whose Request was dropped before completion

# The timeline's buffer (aluminum_py.timeline). While it records, every launched op is recorded
# here and its writer thread takes them (trace_take); None while it does not record: the
# launcher's one test per op.  A completed op (a blocking call) is copied into a C array
# (trace_done: no Python object is allocated or kept, so a stream of small calls does not feed
# the garbage collector); an op still running (nonblocking, or a blocking call that timed out)
# is kept in the list until the writer finds it complete.  Both share one capacity: a full
# buffer drops the op and counts it.
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF

ctypedef struct trace_rec:       # one completed op (NativeOp.trace's fields)
    PyObject* name               # owned references
    PyObject* state
    double t_call
    double t_start
    double t_done
    int64_t count
    int esize
    int dtype
    int rop
    int kind
    int err
    int engine

cdef list g_trace = None
cdef trace_rec* g_recs = NULL
cdef Py_ssize_t g_nrecs = 0
cdef Py_ssize_t g_trace_cap = 0
cdef Py_ssize_t g_trace_dropped = 0

# Recording and taking run under the GIL.  trace_append and trace_done allocate nothing (no
# garbage collection, so no switch to another thread inside); they test g_trace again because
# another thread may have stopped the timeline while the op ran without the GIL.

cdef inline void trace_append(object item) noexcept:
    global g_trace_dropped
    if g_trace is None:
        return
    if len(g_trace) + g_nrecs < g_trace_cap:
        g_trace.append(item)
    else:
        g_trace_dropped += 1

cdef inline void trace_done(NativeOp o) noexcept:
    """Record the completed op `o` (the timeline records)."""
    global g_trace_dropped, g_nrecs
    cdef trace_rec* r
    if g_trace is None:
        return
    if len(g_trace) + g_nrecs >= g_trace_cap:
        g_trace_dropped += 1
        return
    r = &g_recs[g_nrecs]
    g_nrecs += 1
    r.name = <PyObject*>o.name
    r.state = <PyObject*>o.keep[0]
    Py_INCREF(o.name)
    Py_INCREF(o.keep[0])
    r.t_call = o.t_call
    r.t_start = o.op.t_start
    r.t_done = o.op.t_done
    r.count = o.op.count
    r.esize = o.op.esize
    r.dtype = o.op.dtype
    r.rop = o.op.rop
    r.kind = o.op.kind
    r.err = o.op.err
    r.engine = o.engine

def trace_start(Py_ssize_t capacity):
    """Record every launched op (and `trace_record`'s items) in a buffer of `capacity` items."""
    global g_trace, g_trace_cap, g_trace_dropped, g_recs, g_nrecs
    cdef trace_rec* recs = <trace_rec*>calloc(capacity, sizeof(trace_rec))
    if recs == NULL:
        raise MemoryError()
    if g_trace is not None:
        trace_stop()
    fresh = []
    g_recs, g_nrecs, g_trace_cap, g_trace_dropped, g_trace = recs, 0, capacity, 0, fresh

def trace_stop():
    """Stop recording; returns what `trace_take` would."""
    return trace_swap(False)

def trace_take():
    """(the items recorded since the last call: NativeOps and trace tuples, how many were
    dropped since then); empties the buffer. ([], 0) when not recording."""
    return trace_swap(True)

cdef object trace_swap(bint keep_recording):
    """Take the buffer, leaving an empty one (or none: recording stops).  The globals change
    together after every allocation, so a thread switch never sees them half changed."""
    global g_trace, g_trace_dropped, g_recs, g_nrecs
    cdef trace_rec* recs = NULL
    cdef trace_rec* r
    cdef Py_ssize_t i, n
    if g_trace is None:
        return [], 0
    fresh = [] if keep_recording else None
    if keep_recording:
        recs = <trace_rec*>calloc(g_trace_cap, sizeof(trace_rec))
        if recs == NULL:
            raise MemoryError()
    items, dropped, old, n = g_trace, g_trace_dropped, g_recs, g_nrecs
    g_trace, g_trace_dropped, g_recs, g_nrecs = fresh, 0, recs, 0
    for i in range(n):
        r = &old[i]
        items.append((<object>r.name, r.kind, r.t_call, r.t_start, r.t_done, r.count, r.esize,
                      r.dtype, r.rop, <object>r.state, bool(r.engine), r.err, 0, None))
        Py_DECREF(<object>r.name)
        Py_DECREF(<object>r.state)
    free(old)
    return items, dropped

def trace_record(item):
    """Append a Python item (a user region, a bucket) to the buffer; False when not recording."""
    if g_trace is None:
        return False
    trace_append(item)
    return True

def trace_recording():
    return g_trace is not None



cdef class NativeOp:
    """One operation: the native state plus references to everything it reads or writes."""
    cdef al_op* op
    cdef readonly object keep        # buffers, schedule, comm state: alive until completion
    cdef readonly object name
    cdef double t_call               # al_now() at the call, set while the timeline records
    cdef bint engine                 # handed to the progress engine (submit)

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

    @property
    def status(self):
        """(source, tag, bytes received, error code) of the op's receive (Recv, Sendrecv:
        reqs[0], whose MPI_Status MPI_Testall filled) once it is done; None for other ops and
        before completion."""
        cdef int n = 0
        cdef int64_t nbytes
        cdef mpi.MPI_Status* st = &self.op.stats[0]
        if not al_load_acquire(&self.op.done) or not kind_info(self.op.kind).recv_first:
            return None
        mpi.MPI_Get_count(st, mpi.MPI_BYTE, &n)
        nbytes = n
        if n == mpi.MPI_UNDEFINED:          # over 2**31 - 1 bytes: count whole elements
            mpi.MPI_Get_count(st, self.op.mtype, &n)
            nbytes = <int64_t>n * self.op.esize
        return (st.MPI_SOURCE, st.MPI_TAG, nbytes, self.op.err)

    @property
    def recv_count(self):
        """Elements the op's receive has room for (Recv: count; Sendrecv: count2)."""
        return self.op.mpi.count2 if self.op.kind == K_SENDRECV else self.op.count

    @property
    def esize(self):
        """Bytes per element of the op's buffers."""
        return self.op.esize

    def trace(self):
        """What the timeline writes (aluminum_py.timeline): (name, kind, called, started,
        completed, count, element size, dtype code, op code, comm state, ran in the engine,
        error code, stream or 0, host-transfer phase ends or None); None before completion."""
        cdef al_op* o = self.op
        cdef al_op* data = o          # the op with the message (host transfer: the inner one)
        if not al_load_acquire(&o.done):
            return None
        ht = None
        if o.kind == K_HOST_TRANSFER:
            ht = tuple(o.ht.times[i] for i in range(HT_NPHASES))
            if o.ht.inner != NULL:
                data = o.ht.inner
        return (self.name, o.kind, self.t_call, o.t_start, o.t_done, data.count, data.esize,
                data.dtype, data.rop, self.keep[0], self.engine, o.err, <uintptr_t>o.ht.stream,
                ht)

    def describe(self):
        """Where the op stands: its name, phase and, for schedules, the step and peers."""
        cdef al_op* o = self.op
        cdef al_step* st
        phase = ("new", "running", "done")[o.phase]
        if is_shm_kind(o.kind) and o.phase == PH_RUNNING:
            return f"{self.name}: {shm_describe(o)}"
        if o.kind == K_HIER_SHM and o.phase == PH_RUNNING:
            return hier_describe(self)
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
        self.engine = True
        with nogil:
            rc = engine_submit(self.op)
        if rc != 0:
            _hooks.fail("the progress engine is stopped (interpreter exit)" if rc < 0
                        else f"could not start the progress engine thread (errno {rc})")

    def wait(self, double timeout=-1.0):
        """Wait for completion (timeout < 0: forever). Returns True when done. Every WAKE
        seconds it runs the signal handlers: their exception (KeyboardInterrupt) propagates
        and the op goes on in the engine; and it raises aluminum_py.Error if the communicator
        is broken (comm_poll_broken: a peer refused a call or the calls differ)."""
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
            if comm_poll_broken(self.op.comm):      # a peer broke it: the op may never complete
                _hooks.fail(f"{self.name}: this communicator is unusable: "
                            f"{(<char*>self.op.comm.why).decode('utf-8', 'replace')}")

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
