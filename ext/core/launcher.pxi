# The latency-critical call paths, in Cython: the allreduce (buffer checks, op/dtype check,
# algorithm choice cached per communicator, schedule lookup cached, op creation and launch) and
# the "shm" collectives (allgather, bcast, reduce_scatter, barrier: the same checks as the
# host backend's Python path).  A blocking "shm" op runs at once in the caller on an op object
# reused from call to call (Launcher.run_shm).  Anything unusual (non-ndarray buffers, errors)
# defers to the Python helpers in `_hooks`, so each error message is written once, in Python.

cdef inline cnp.ndarray as_array(obj, str name, bint writable):
    cdef cnp.ndarray a
    if type(obj) is cnp.ndarray:
        a = <cnp.ndarray>obj
        if cnp.PyArray_IS_C_CONTIGUOUS(a) and (not writable or cnp.PyArray_ISWRITEABLE(a)):
            return a
    return _hooks.as_array(obj, name, writable)

cdef inline int dtype_code_of(cnp.ndarray a, str name) except -1:
    code = _dtype_codes.get(<object>cnp.PyArray_DESCR(a))
    if code is None:
        _hooks.as_array(a, name, False)           # raises the unsupported-dtype error
        return -1
    return code

cdef inline void same_dtype_of(cnp.ndarray s, cnp.ndarray r, str sname, str rname) except *:
    """Raise unless r has s's dtype (r's own unsupported dtype first, as buffers.as_array)."""
    if cnp.PyArray_DESCR(r) != cnp.PyArray_DESCR(s) and r.dtype != s.dtype:
        _hooks.as_array(r, rname, False)
        _hooks.same_dtype(s, r, sname, rname)

cdef inline bint overlap(cnp.ndarray s, cnp.ndarray r) noexcept:
    """s and r share memory (C-contiguous: their byte ranges intersect; np.may_share_memory)."""
    cdef char* slo = <char*>cnp.PyArray_DATA(s)
    cdef char* rlo = <char*>cnp.PyArray_DATA(r)
    return (cnp.PyArray_NBYTES(s) > 0 and cnp.PyArray_NBYTES(r) > 0
            and slo < rlo + cnp.PyArray_NBYTES(r) and rlo < slo + cnp.PyArray_NBYTES(s))

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
    cdef dict auto_cache
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
        cdef object alg
        cdef Py_ssize_t key
        if algorithm == "auto":
            key = (nbytes << 5) | itemsize
            alg = self.auto_cache.get(key)
            if alg is None:
                alg = self.chooser(nbytes, itemsize)
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
        """One allreduce op on checked buffers (addresses; sp == rp in place).  Its `keep` is
        set, except for "shm" (run_shm sets it when the op leaves the caller)."""
        cdef NativeOp o
        cdef Schedule sched
        if alg == "shm":
            self.shm_ready("allreduce/shm")
            o = self.shm_op(K_SHM_ALLREDUCE, "allreduce/shm", <char*>sp, <char*>rp, count, code,
                            esize, opcode, 0)
            o.op.result.buf = <char*>rp
            o.op.result.count = count
            if opcode == AL_AVG:
                o.op.result.avg_div = <double>self.state.c.size
            o.op.result.avg_in_steps = self.state.c.size > 1    # AVG fused in the last pass
            return o
        o = NativeOp.__new__(NativeOp)
        if unusual(self.state):                                 # before next_tag
            self.state.check_usable("allreduce/" + alg)
        init_op(o.op, self.state.c, K_SCHEDULE, <char*>sp, <char*>rp, count, code, esize, opcode)
        o.op.result.buf = <char*>rp
        o.op.result.count = count
        if opcode == AL_AVG:
            o.op.result.avg_div = <double>self.state.c.size
        if alg == "mpi":
            o.op.kind = K_ALLREDUCE
            o.op.sbuf = NULL if inplace else <char*>sp
            o.name = "allreduce/mpi"
            o.keep = (self.state, None, keep)
        elif alg == "hierarchical" and self.hierarchical is not None:
            return self.hierarchical(sp, rp, count, code, esize, opcode, inplace, keep)
        else:
            sched = self.schedule(alg, count, inplace)
            o.op.tag = self.state.next_tag()
            o.op.sched.steps = sched.steps
            o.op.sched.nsteps = sched.nsteps
            o.op.result.avg_in_steps = sched.owned
            o.op.sched.tmpbytes = <size_t>(sched.tmp_elems * esize)
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
        cdef int rc, failed = 0
        if unusual(self.state):
            self.state.check_usable("host-transfer allreduce")
        alg = self.choose_for(algorithm, nbytes, esize)
        dev.take_pinned(nbytes + 64, &pinned)
        try:
            inner = self.build_allreduce(<intptr_t>pinned, <intptr_t>pinned, count, code, esize,
                                         opcode, alg, True, None)
            if inner.keep is None:                # "shm": the outer op keeps the state
                inner.keep = (self.state, None, None)
        except BaseException:
            al_pinned_put(d, pinned)              # nothing was enqueued: the buffer is free
            raise
        outer = NativeOp.__new__(NativeOp)
        outer.op.kind = K_HOST_TRANSFER
        outer.op.phase = PH_NEW
        outer.op.comm = self.state.c
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
        outer.keep = (self.state, inner, (dev, keep))
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
        code = dtype_code_of(s, "sendbuf")
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
        alg = self.choose_for(algorithm, cnp.PyArray_NBYTES(s), <int>cnp.PyArray_ITEMSIZE(s))
        rp = <intptr_t>cnp.PyArray_DATA(r)
        sp = rp if inplace else <intptr_t>cnp.PyArray_DATA(s)
        if alg == "shm":
            o = self.build_allreduce(sp, rp, count, code, <int>cnp.PyArray_ITEMSIZE(s), opcode,
                                     alg, inplace, None)
            return self.run_shm(o, blocking, timeout, s, r)
        o = self.build_allreduce(sp, rp, count, code, <int>cnp.PyArray_ITEMSIZE(s), opcode, alg,
                                 inplace, (s, r))
        return self.launch(o, blocking, timeout, alg)

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

    cdef int rank_of(self, root) except -1:
        """`root` checked as a rank of this communicator (Communicator._rank_arg's errors)."""
        cdef Py_ssize_t v = -1
        if type(root) is int:
            try:
                v = root
            except OverflowError:
                v = -1
            if 0 <= v < self.state.c.size:
                return <int>v
        return _hooks.rank_arg(root, "root", self.state.c.size)

    def bcast_shm(self, buf, root, bint blocking, double timeout):
        """Bcast/Ibcast(algorithm="shm") of a numpy array: HostBackend.bcast's checks."""
        cdef cnp.ndarray b
        cdef int r = self.rank_of(root), code
        cdef Py_ssize_t n
        cdef NativeOp o
        self.shm_ready("bcast/shm")
        b = as_array(buf, "buf", self.state.c.rank != r)
        code = dtype_code_of(b, "buf")
        n = cnp.PyArray_SIZE(b)
        if n > 2147483647:
            _hooks.too_many(n, "count")
        o = self.shm_op(K_SHM_BCAST, "bcast/shm", <char*>cnp.PyArray_DATA(b),
                        <char*>cnp.PyArray_DATA(b), n, code, <int>cnp.PyArray_ITEMSIZE(b), 0, r)
        return self.run_shm(o, blocking, timeout, b, None)

    def allgather_shm(self, sendbuf, recvbuf, bint blocking, double timeout):
        """Allgather/Iallgather(algorithm="shm") of numpy arrays (recvbuf None: in place, the
        rank's block at its place in sendbuf): HostBackend.allgather's checks."""
        cdef cnp.ndarray s, r
        cdef int p = self.state.c.size, code
        cdef Py_ssize_t n
        cdef char* sp
        cdef NativeOp o
        self.shm_ready("allgather/shm")
        if recvbuf is None:
            r = as_array(sendbuf, "sendbuf", True)
            code = dtype_code_of(r, "sendbuf")
            n = cnp.PyArray_SIZE(r)
            if n % p:
                _hooks.divisible(r, "sendbuf", p)
            n //= p
            s = None
            sp = <char*>cnp.PyArray_DATA(r) + self.state.c.rank * n * cnp.PyArray_ITEMSIZE(r)
        else:
            s = as_array(sendbuf, "sendbuf", False)
            code = dtype_code_of(s, "sendbuf")
            r = as_array(recvbuf, "recvbuf", True)
            same_dtype_of(s, r, "sendbuf", "recvbuf")
            n = cnp.PyArray_SIZE(s)
            if cnp.PyArray_SIZE(r) < p * n:
                _hooks.at_least(r, p * n, "recvbuf", "size * len(sendbuf)")
            if overlap(s, r):
                _hooks.no_overlap(s, r, "sendbuf", "recvbuf")
            sp = <char*>cnp.PyArray_DATA(s)
        if n > 2147483647:
            _hooks.too_many(n, "count")
        o = self.shm_op(K_SHM_ALLGATHER, "allgather/shm", sp, <char*>cnp.PyArray_DATA(r), n, code,
                        <int>cnp.PyArray_ITEMSIZE(r), 0, 0)
        return self.run_shm(o, blocking, timeout, s, r)

    def reduce_scatter_shm(self, sendbuf, recvbuf, int opcode, bint blocking, double timeout):
        """Reduce_scatter/Ireduce_scatter(algorithm="shm") of numpy arrays with op code
        `opcode` (recvbuf None: in place, the result in sendbuf[:len // size]):
        HostBackend.reduce_scatter's checks."""
        cdef cnp.ndarray s, r
        cdef int p = self.state.c.size, code
        cdef Py_ssize_t n
        cdef char* sp
        cdef NativeOp o
        self.shm_ready("reduce_scatter/shm")
        s = as_array(sendbuf, "sendbuf", recvbuf is None)
        code = dtype_code_of(s, "sendbuf")
        n = cnp.PyArray_SIZE(s)
        if n % p:
            _hooks.divisible(s, "sendbuf", p)
        if opcode < 0 or opcode >= 16 or not _valid[code][opcode]:
            _hooks.check_op(opcode, code, s.dtype)                        # raises
        n //= p
        if n > 2147483647:
            _hooks.too_many(n, "recvbuf")
        sp = <char*>cnp.PyArray_DATA(s)
        if recvbuf is None:
            r = s
        else:
            r = as_array(recvbuf, "recvbuf", True)
            same_dtype_of(s, r, "sendbuf", "recvbuf")
            if cnp.PyArray_SIZE(r) < n:
                _hooks.at_least(r, n, "recvbuf", "len(sendbuf) // size")
            if (cnp.PyArray_DATA(r) != cnp.PyArray_DATA(s) or cnp.PyArray_SIZE(s) == 0
                    or cnp.PyArray_SIZE(r) == 0) and overlap(s, r):
                _hooks.no_partial_overlap(s, r, "sendbuf", "recvbuf")    # raises
        o = self.shm_op(K_SHM_REDUCE_SCATTER, "reduce_scatter/shm", sp,
                        <char*>cnp.PyArray_DATA(r), n, code, <int>cnp.PyArray_ITEMSIZE(s),
                        opcode, 0)
        o.op.result.buf = <char*>cnp.PyArray_DATA(r)
        o.op.result.count = n
        if opcode == AL_AVG:
            o.op.result.avg_div = <double>p
        return self.run_shm(o, blocking, timeout, s, r)

    def barrier_shm(self, bint blocking, double timeout):
        """Barrier/Ibarrier(algorithm="shm")."""
        self.shm_ready("barrier/shm")
        return self.run_shm(self.shm_op(K_SHM_BARRIER, "barrier/shm", NULL, NULL, 0, 0, 1, 0, 0),
                            blocking, timeout, None, None)

    cdef void shm_ready(self, str name) except *:
        """Raise unless an shm op may start here (checked before the buffers, as the host
        backend's collective_shm): the communicator usable, a segment (or one rank)."""
        if unusual(self.state):
            self.state.check_usable(name)
        if self.state.c.shm == NULL and self.state.c.size > 1:
            self.shm_unavailable()
