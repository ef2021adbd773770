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
        op.sched.tmp = scratch_get(op.sched.tmpbytes, &op.sched.tmpbytes)
        if op.sched.tmp == NULL:
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
                return op_finish(op)
        elif ph.src != NULL:
            memcpy(ph.dst, ph.src, <size_t>(ph.cnt * op.esize))
        elif ph.cnt > 0:
            al_scale_div(op.dtype, ph.dst, <size_t>ph.cnt, op.result.avg_div)
        h.cur += 1
        h.started = 0
    return op_finish(op)

cdef void hier_cancel(al_op* op, const char* why) noexcept nogil:
    """Engine shutdown: cancel the running inner op (its MPI requests, its scratch)."""
    cdef al_hier_state* h = &op.hier
    cdef al_op* inner
    if op.phase == PH_RUNNING and h.cur < h.nphases and h.started:
        inner = h.phases[h.cur].op
        if inner != NULL and inner.phase == PH_RUNNING:
            op_cancel(inner, why)

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


def make_hier_op(CommState cs, name, int64_t count, int dtype, int esize, int rop,
                 double avg_div, size_t tmpbytes, phases, members, keep=None):
    """The K_HIER_SHM op of one hierarchical allreduce (count elements; result in the buffers
    the phases name).  `phases`: per phase (label, NativeOp or None, dst, src, cnt, tmp): an inner
    op (made with make_op, not launched: this op starts and steps it), or a local action (copy
    cnt elements src -> dst; src 0: divide dst[:cnt] by avg_div); `tmp`: the inner op's rbuf
    (its result region too), or the copy's src, is this op's scratch of `tmpbytes` bytes, taken
    when it starts.  `members`: the ranks of this rank's node, by node rank (the timeout
    message)."""
    cdef NativeOp o = NativeOp.__new__(NativeOp)
    cdef NativeOp io
    cdef al_op* op = o.op
    cdef al_hier_phase* ph
    cdef int i
    if len(phases) > HIER_MAX_PHASES:
        _hooks.fail(f"{name}: {len(phases)} phases, at most {HIER_MAX_PHASES}")
    init_op(op, cs.c, K_HIER_SHM, NULL, NULL, count, dtype, esize, rop)
    op.result.avg_div = avg_div
    op.result.avg_in_steps = 1              # divided by a phase, never by op_finish
    op.sched.tmpbytes = tmpbytes
    inner = []
    for i, (label, phase_op, dst, src, cnt, tmp) in enumerate(phases):
        ph = &op.hier.phases[i]
        ph.dst = <char*><intptr_t>dst
        ph.src = <char*><intptr_t>src
        ph.cnt = cnt
        ph.tmp = tmp
        if phase_op is not None:
            io = <NativeOp?>phase_op
            ph.op = io.op
        inner.append(phase_op)
    op.hier.nphases = len(phases)
    o.keep = (cs, (tuple(inner), tuple(members), tuple(p[0] for p in phases)), keep)
    o.name = name
    return o
