# "hierarchical" over each node's shared-memory segment (K_HIER_SHM): one op whose state machine
# runs a list of phases in turn (al_hier_state, types.pxi), built per rank by
# aluminum_py.schedules.hierarchical_shm:
#   * inner shm ops (K_SHM_*) over the node's segment: the node's own al_comm (its CommState is
#     made by HostBackend over the node's sub-communicator), driven by shm_start/shm_step;
#   * an inner schedule (K_SCHEDULE) on the communicator: the allreduce between nodes, driven by
#     the schedule interpreter (sched_advance);
#   * local actions between them: a copy out of the op's scratch, AVG's division.
# No protocol is written twice: each phase is an op of an existing kind, started with op_start
# and stepped with op_step, by the caller (blocking) or the engine (nonblocking), like any op.
# The whole op counts as an op over the segment (uses_shm): shm_gate runs one at a time per
# communicator, in call order, so the node's ranks consume the segment's rounds in one order.

cdef int hier_start(al_op* op) noexcept nogil:
    """Begin: take the scratch (op.sched.tmpbytes, 0: none) and point the phases that use it at
    it, then run as far as possible."""
    cdef al_hier_state* h = &op.hier
    cdef al_hier_phase* ph
    cdef int i
    h.cur = 0
    h.started = 0
    if op.sched.tmpbytes > 0:
        if op_take_scratch(op, op.sched.tmpbytes) == NULL:
            op.err = -1
            snprintf(op.errmsg, 256, "out of memory allocating %zu bytes of scratch",
                     op.sched.tmpbytes)
            return op_finish(op)
        for i in range(h.nphases):
            ph = &h.phases[i]
            if ph.tmp and ph.op != NULL:
                ph.op.rbuf = op.sched.tmp
                ph.op.result.buf = op.sched.tmp
            elif ph.tmp:
                ph.src = op.sched.tmp
    return hier_step(op)

cdef int hier_step(al_op* op) noexcept nogil:
    """Advance the current phase; on to the next when it completes.  Returns 1 when the op is
    complete (or failed: the phase's error, named, becomes the op's)."""
    cdef al_hier_state* h = &op.hier
    cdef al_hier_phase* ph
    cdef int done
    while h.cur < h.nphases:
        ph = &h.phases[h.cur]
        if ph.op != NULL:
            done = op_step(ph.op) if h.started else op_start(ph.op)
            h.started = 1
            if not done:
                return 0
            if ph.op.err != 0:
                op.err = ph.op.err
                snprintf(op.errmsg, 256, "phase %d/%d: %s", h.cur + 1, h.nphases, ph.op.errmsg)
                if ph.op.comm != op.comm and al_load_acquire(&ph.op.comm.broken):
                    comm_break(op.comm, AL_SHM_MISMATCHED, ph.op.comm.why)   # every node
                return op_finish(op)
        elif ph.src != NULL:
            memcpy(ph.dst, ph.src, <size_t>(ph.cnt * op.esize))
        elif ph.cnt > 0:
            al_scale_div(op.dtype, ph.dst, <size_t>ph.cnt, op.result.avg_div)
        h.cur += 1
        h.started = 0
    return op_finish(op)

cdef void hier_cancel(al_op* op, const char* why) noexcept nogil:
    """Cancel the running inner op (its MPI requests, its scratch): engine shutdown.  (A
    host-transfer op abandoned at its hang timeout with this op inside leaks the scratch
    instead: abandon_running.)"""
    cdef al_hier_state* h = &op.hier
    cdef al_op* inner
    if op.phase == PH_RUNNING and h.cur < h.nphases and h.started:
        inner = h.phases[h.cur].op
        if inner != NULL and inner.phase == PH_RUNNING:
            op_cancel(inner, why)

cdef al_shm_seg* hier_segment(al_op* op) noexcept nogil:
    """The node's segment that the phases of `op` (K_HIER_SHM) use (NULL: none)."""
    cdef int i
    for i in range(op.hier.nphases):
        if op.hier.phases[i].op != NULL and is_shm_kind(op.hier.phases[i].op.kind):
            return op.hier.phases[i].op.comm.shm
    return NULL

cdef str hier_describe(NativeOp o):
    """Where a running K_HIER_SHM op waits (the timeout message): its phase and, inside it, the
    inner op's own description; a node rank an shm phase waits for is also named by its rank
    in the communicator."""
    cdef al_op* op = o.op
    cdef al_hier_state* h = &op.hier
    cdef al_op* inner
    cdef NativeOp io
    phases, members, labels = o.keep[1]
    if h.cur >= h.nphases:
        return f"{o.name}: finishing"
    where = f"{o.name}: phase {h.cur + 1}/{h.nphases} ({labels[h.cur]})"
    inner = h.phases[h.cur].op
    if inner == NULL or not h.started or inner.phase != PH_RUNNING:
        return where
    io = phases[h.cur]
    if is_shm_kind(inner.kind):
        w = inner.shm.waiting
        who = (f"; node rank {w} is rank {members[w]}"
               if inner.shm.phase in (1, 2) and w < len(members) else "")
        return f"{where}: {shm_describe(inner)}{who}"
    return f"{where}: {io.describe().partition(': ')[2]}"


DEF HIER_SEND = 0                  # HierPlan's buffers: sendbuf (recvbuf in place), recvbuf,
DEF HIER_RECV = 1                  # the op's scratch
DEF HIER_TMP = 2
DEF HIER_COPY_TMP = -1             # HierPlan's local actions (kind < 0)
DEF HIER_DIVIDE = -2

cdef class HierPlan:
    """One rank's phases of a hierarchical allreduce for one (count, in place), made once
    (aluminum_py.backends.hier_shm caches them) from schedules.hierarchical_shm: per phase
    (label, kind, src, src_off, dst, dst_off, count, root, Schedule or None), where kind is an
    op kind (K_SHM_*, K_SCHEDULE) or a local action (HIER_COPY_TMP: scratch -> recvbuf[dst_off:];
    HIER_DIVIDE: recvbuf[dst_off:dst_off + count] /= p, AVG only), src/dst name a buffer
    (0 sendbuf, 1 recvbuf, 2 scratch) and offsets are in elements.  `make` builds the op of
    one call."""
    cdef list phases
    cdef readonly int64_t tmp_elems
    cdef readonly tuple members

    def __cinit__(self, phases, int64_t tmp_elems, members):
        if len(phases) > HIER_MAX_PHASES:
            _hooks.fail(f"hierarchical: {len(phases)} phases, at most {HIER_MAX_PHASES}")
        self.phases = list(phases)
        self.tmp_elems = tmp_elems
        self.members = tuple(members)

    def make(self, CommState cs, CommState node, intptr_t sp, intptr_t rp, int64_t count,
             int dtype, int esize, int rop, int tag, keep=None):
        """The K_HIER_SHM op of one allreduce of `count` elements on checked buffers
        (addresses; sp == rp in place), not launched: its inner ops are made here (shm ops on
        the node's CommState `node`, the schedule on `cs` with `tag`), never launched
        themselves.  AVG (rop) divides by the communicator's size in the plan's HIER_DIVIDE
        phases; other ops skip them."""
        cdef NativeOp o = NativeOp.__new__(NativeOp)
        cdef NativeOp io
        cdef al_op* op = o.op
        cdef al_hier_phase* ph
        cdef int kind, src, dst, n = 0
        cdef int64_t src_off, dst_off, cnt
        cdef intptr_t base[3]
        cdef Schedule sched
        cdef bint avg = rop == AL_AVG
        base[HIER_SEND] = sp
        base[HIER_RECV] = rp
        base[HIER_TMP] = 0                  # set when the op starts (hier_start)
        init_op(op, cs.c, K_HIER_SHM, NULL, NULL, count, dtype, esize, rop)
        op.result.avg_div = <double>cs.c.size if avg else 0.0
        op.result.avg_in_steps = 1          # divided by a phase, never by op_finish
        op.sched.tmpbytes = <size_t>(self.tmp_elems * esize)
        inner = []
        labels = []
        for label, kind, src, src_off, dst, dst_off, cnt, root, sched_obj in self.phases:
            if kind == HIER_DIVIDE and not avg:
                continue
            ph = &op.hier.phases[n]
            n += 1
            labels.append(label)
            ph.tmp = dst == HIER_TMP if kind >= 0 else kind == HIER_COPY_TMP
            if kind < 0:                    # a local action on recvbuf
                ph.dst = <char*>(rp + dst_off * esize)
                ph.cnt = cnt
                inner.append(None)
                continue
            io = NativeOp.__new__(NativeOp)
            io.name = label
            if kind == K_SCHEDULE:
                sched = <Schedule>sched_obj
                init_op(io.op, cs.c, kind, <char*>rp, <char*>rp, count, dtype, esize, rop)
                io.op.tag = tag
                io.op.sched.steps = sched.steps
                io.op.sched.nsteps = sched.nsteps
                io.op.sched.tmpbytes = <size_t>(sched.tmp_elems * esize)
                io.keep = (cs, sched, None)
            else:
                init_op(io.op, node.c, kind, <char*>(base[src] + src_off * esize),
                        <char*>(base[dst] + dst_off * esize) if dst != HIER_TMP else NULL,
                        cnt, dtype, esize, rop)
                io.op.mpi.root = root
                io.keep = (node, None, None)
            ph.op = io.op
            inner.append(io)
        op.hier.nphases = n
        o.keep = (cs, (tuple(inner), self.members, tuple(labels)), keep)
        o.name = "allreduce/hierarchical"
        return o
