# How an op runs and how its algorithm is chosen: the Launcher of one communicator launches an
# op (run in the caller with the GIL released, or handed to the progress engine), runs a "shm"
# op at once on an op object reused from call to call (run_shm), and caches auto's choice and
# the native schedules.  The calls themselves (argument parsing, one entry per collective) are
# in msgbuffer.pxi and collectives.pxi; the host-transfer enqueue in ht_op.pxi.

cdef inline void check_error(NativeOp o) except *:
    if o.op.err != 0:
        _hooks.raise_error(o)

DEF SHM_GIL_POLLS = 256     # polls of a blocking shm op before the caller releases the GIL

cdef int g_thread_multiple = -1     # MPI_THREAD_MULTIPLE provided (-1: not asked yet)

cdef inline bint mpi_thread_multiple() noexcept:
    """thread_multiple(), asked of MPI once (the level does not change after MPI_Init)."""
    global g_thread_multiple
    cdef int provided = 0
    if g_thread_multiple < 0:
        mpi.MPI_Query_thread(&provided)
        g_thread_multiple = provided == mpi.MPI_THREAD_MULTIPLE
    return g_thread_multiple

cdef inline int shm_poll(al_op* op, int polls) noexcept nogil:
    """Step the started shm op `op` at most `polls` times; 1 once it is complete."""
    cdef int i
    for i in range(polls):
        if shm_step(op):
            return 1
    return 0


cdef class Launcher:
    """Per-communicator call path: caches of auto's choice and of native schedules."""
    cdef readonly CommState state
    cdef dict auto_cache          # (nbytes, itemsize) key -> auto's choice
    cdef Py_ssize_t last_key      # the key of auto's last call (-1: none) ...
    cdef str last                 # ... and its choice: a loop of one size skips the dict
                                  # (set together under the GIL, which no step between drops)
    cdef dict sched_cache
    cdef object chooser           # (nbytes, itemsize) -> algorithm name (tuning.Chooser.choose; cached here)
    cdef object builder           # (alg, count, inplace) -> Schedule
    cdef frozenset host_algs
    cdef public object shm_unavailable   # () -> raises why an shm op finds no segment
    cdef public object hierarchical      # None, or (sp, rp, count, dtype, esize, op, inplace,
                                         # keep) -> the K_HIER_SHM op of "hierarchical" (hier_shm.pxi)
    cdef NativeOp spare           # a completed op of a blocking shm call, for the next one
    cdef public object checker    # None, or AL_CHECK's exchange: (name, kind, count, dtype,
                                  # rop, root) -> raises if the ranks' calls differ (check.py)

    def choose(self, Py_ssize_t nbytes, int itemsize):
        """auto's (cached) choice for a message of `nbytes` with elements of `itemsize` bytes."""
        return self.choose_for("auto", nbytes, itemsize)

    def __cinit__(self, CommState state, chooser, builder, host_algs):
        self.state = state
        self.auto_cache = {}
        self.last_key = -1
        self.sched_cache = {}
        self.chooser = chooser
        self.builder = builder
        self.host_algs = frozenset(host_algs)

    cpdef object launch(self, NativeOp o, bint blocking, double timeout, str algorithm):
        """Run `o` in the caller (blocking) or hand it to the engine (returns a Request)."""
        if g_trace is not None:          # the timeline records: the only test when it does not
            return self.launch_traced(o, blocking, timeout, algorithm)
        return self.launch_now(o, blocking, timeout, algorithm)

    cdef object launch_traced(self, NativeOp o, bint blocking, double timeout, str algorithm):
        """launch_now, recording `o` in the timeline's buffer (nativeop.pxi)."""
        o.t_call = al_now()
        if not blocking:
            request = self.launch_now(o, False, timeout, algorithm)
            trace_append(o)              # written once the writer finds it complete
            return request
        try:
            return self.launch_now(o, True, timeout, algorithm)
        finally:
            if al_load_acquire(&o.op.done):
                trace_done(o)
            elif o.op.phase != PH_NEW:   # timed out or interrupted: it goes on in the engine
                trace_append(o)

    cdef object launch_now(self, NativeOp o, bint blocking, double timeout, str algorithm):
        if unusual(self.state):
            self.state.check_usable(o.name)
        if self.checker is not None:
            self.check_call(o)
        # Blocking calls use the nonblocking MPI calls (MPI_I*) and poll them, in the caller
        # or, behind pending ops, in the engine, so that the caller can check for signals and
        # time out. MPI matches blocking collectives only with blocking ones, so the variant
        # must not depend on per-rank state: it is always MPI_I* (passthrough.pxi).
        if not blocking:
            o.submit()
            return _hooks.request(o, algorithm)
        # busy: the owner is inside the call (bind_thread and Free refuse meanwhile)
        self.state.busy = True
        try:
            return self.run_blocking(o, timeout)
        finally:
            self.state.busy = False

    cdef object run_blocking(self, NativeOp o, double timeout):
        """Run `o` to completion in the caller, or behind the pending ops in the engine."""
        cdef int ok
        if al_load_acquire(&self.state.c.pending) == 0:
            return self.run_here(o, deadline_of(timeout), timeout)
        o.submit()                      # keep call order behind this communicator's pending ops
        try:
            ok = o.wait(timeout)
        except BaseException:
            self.interrupted(o, False)
            raise
        if not ok:
            o.orphan()
            _hooks.raise_timeout(o, timeout)
        check_error(o)
        return None

    cdef object run_here(self, NativeOp o, double deadline, double timeout):
        """Run `o` (new, or started in this thread) to completion in the caller with the GIL
        released, checking for signals; hand it to the engine and raise at the deadline."""
        cdef int ok
        with nogil:
            ok = run_inline(o.op, deadline)
        while ok != 1:
            if ok == 0 or comm_poll_broken(o.op.comm):
                # kept alive first: the engine finishes it, or (below MPI_THREAD_MULTIPLE,
                # where submit raises) it stays posted and MPI may still write its buffers
                o.orphan()
                o.submit(adopt=True)
                if ok != 0:                 # a peer broke the communicator: it never comes
                    self.state.check_usable(o.name)
                _hooks.raise_timeout(o, timeout)
            try:
                PyErr_CheckSignals()
            except BaseException:
                self.interrupted(o, True)
                raise
            with nogil:
                ok = run_inline(o.op, deadline)
        check_error(o)
        return None

    cdef void interrupted(self, NativeOp o, bint inline) except *:
        """A signal handler raised during the blocking call of `o`: the engine keeps the op
        (running it to completion; its buffers stay alive) and the communicator is unusable
        until it completes (check_usable)."""
        if al_load_acquire(&o.op.done):
            return
        o.orphan()
        if inline:
            try:
                o.submit(adopt=True)
            except Exception:       # below MPI_THREAD_MULTIPLE: it stays posted, kept alive
                pass
        self.state.interrupted = o

    cdef void check_call(self, NativeOp o) except *:
        """AL_CHECK: the collective `o` is about to start: exchange its signature with the peers
        (the checker raises if the ranks' calls differ).  Shm ops carry their own fingerprints;
        point-to-point and GPU ops are not checked."""
        cdef al_op* op = o.op
        if is_shm_kind(op.kind) or not (op.kind == K_SCHEDULE or op.kind == K_HIER_SHM
                                         or kind_info(op.kind).mpi_collective):
            return
        self.checker(o.name, op.kind, op.count, op.dtype, op.rop, op.mpi.root)

    cdef str choose_for(self, str algorithm, Py_ssize_t nbytes, int itemsize):
        """The algorithm of a call: `algorithm` checked, or auto's choice: the chooser's answer
        (tuning.Chooser.choose), cached per (nbytes, itemsize)."""
        cdef Py_ssize_t key
        cdef str alg
        if algorithm == "auto":
            key = (nbytes << 5) | itemsize
            if key == self.last_key:
                return self.last
            alg = self.auto_cache.get(key)
            if alg is None:
                alg = self.chooser(nbytes, itemsize)
                if len(self.auto_cache) > 4096:
                    self.auto_cache.clear()
                self.auto_cache[key] = alg
            self.last_key, self.last = key, alg
            return alg
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

    # ---- "shm": the op of a call, its run, the collectives' entry points ----

    cdef NativeOp shm_op(self, int kind, str name, char* sp, char* rp, int64_t count, int code,
                         int esize, int rop, int root):
        """An op of `kind` (K_SHM_*) on checked buffers (after shm_ready): the spare op when
        there is one (cleared), else a new one; its `keep` is unset (run_shm)."""
        cdef NativeOp o = self.spare
        if o is None:
            o = NativeOp.__new__(NativeOp)
        else:
            self.spare = None
            memset(o.op, 0, sizeof(al_op))
        init_op(o.op, self.state.c, kind, sp, rp, count, code, esize, rop)
        o.op.mpi.root = root
        o.name = name
        return o

    cdef object run_shm(self, NativeOp o, bint blocking, double timeout, a, b):
        """Launch the shm op `o` (from shm_op) on the buffers a and b (None: none).
        With nothing pending on the communicator and the timeline off, the op starts here:
        * blocking: polled with the GIL held: among ranks that are all in the call a round
          takes a fraction of a microsecond, less than releasing the GIL and taking it back.
          After SHM_GIL_POLLS unsuccessful polls (microseconds: a peer is late), or from the
          first one where ranks outnumber cores (the yield rule), it goes on as any blocking
          op (run_here: GIL released, signals, the hang timeout counted from there).  An op
          that completed at once is kept for the next call (no allocation, no clock read);
        * nonblocking: started (op_start: what needs no peer is done, e.g. a bcast's root
          completes) and, unless complete, handed to the engine as it stands (a running op
          passes no gate: it is the communicator's only one), so that the engine's wake-up is
          paid only by an op that must wait.
        Otherwise it goes through launch (queued behind the pending ops, or traced).  An op
        that may leave the caller keeps its buffers and is never reused."""
        cdef al_op* op = o.op
        if g_trace is None and al_load_acquire(&self.state.c.pending) == 0:
            if not blocking and mpi_thread_multiple():
                o.keep = (self.state, None, (a, b))
                if op_start(op):
                    op.t_done = al_now()
                    al_store_release(&op.done, 1)
                else:
                    o.submit(adopt=True)
                return _hooks.request(o, "shm")
            if blocking:
                op.phase = PH_RUNNING              # op_start, without its clock read
                if shm_start(op) or (g_yield_every == 0 and shm_poll(op, SHM_GIL_POLLS)):
                    al_store_release(&op.done, 1)
                    check_error(o)
                    self.spare = o
                    return None
                o.keep = (self.state, None, (a, b))
                op.t_start = al_now()
                self.state.busy = True             # the GIL is released from here on
                try:
                    return self.run_here(o, deadline_of(timeout), timeout)
                finally:
                    self.state.busy = False
        o.keep = (self.state, None, (a, b))
        return self.launch(o, blocking, timeout, "shm")

    cdef void shm_ready(self, str name) except *:
        """Raise unless an shm op may start here (checked before the buffers, as the host
        backend's collective_shm): the communicator usable, a segment (or one rank)."""
        if unusual(self.state):
            self.state.check_usable(name)
        if self.state.c.shm == NULL and self.state.c.size > 1:
            self.shm_unavailable()
