# The schedule interpreter: runs the step array of one of our allreduce algorithms
# (built in Python by aluminum_py.schedules, copied by the Schedule class).

DEF NEAR_AHEAD = 64          # bytes: a copy whose destination starts 1-63 bytes after its source,
                             # modulo a page, runs at half speed (below)

cdef inline bint near_ahead(const char* dst, const char* src) noexcept nogil:
    """`dst` starts 1-63 bytes after `src` modulo a page.  MPICH moves a large message between
    the ranks of a node with one copy in the kernel (CMA: process_vm_readv; perf shows its
    _copy_to_iter), and that copy takes about twice its time there, most likely 4 KiB
    aliasing: its loads match the page offset of the stores just made.  Measured with ring at
    1 MiB, 2 ranks, sweeping the recvbuf offset: a recvbuf 4-28 bytes after the
    sendbuf's page offset 1.8-2.0x, 32-60 bytes after it, behind it or at it 0.98-1.05x; 64 is
    a margin.  MPICH's own allreduce (through its own buffers) is not affected."""
    return <size_t>((<uintptr_t>dst - <uintptr_t>src) & 4095) - 1 < NEAR_AHEAD - 1


cdef inline int recv_mode(al_op* op, al_step* st) noexcept nogil:
    """Where the receive of step `st` lands: its mode, except that a RECV_INTO_REDUCE step lands
    in the scratch when the op says so (sched_scratch): recvbuf[off] = sendbuf[off] op scratch,
    the same operands in the same order, so the same bits."""
    if st.recv_mode == RECV_INTO_REDUCE and op.sched.land_tmp:
        return RECV_TMP_REDUCE
    return st.recv_mode


cdef bint sched_scratch(al_op* op) noexcept nogil:
    """Take the scratch of a schedule op as it starts (0: out of memory), placed so that no
    message of the schedule is copied to a destination just ahead of its source (near_ahead).

    A peer sends from its sendbuf or its recvbuf; every rank is assumed to have its buffers at
    the same page offsets as this one (one program on every rank: numpy places them alike).  So
    * a message into this rank's recvbuf from a peer's sendbuf (RECV_INTO_REDUCE) is slow when
      recvbuf is just ahead of sendbuf: those steps then land in the scratch (land_tmp; the
      scratch grows to their largest block);
    * the scratch itself starts at sendbuf's page offset (recvbuf's in place, or where sendbuf
      is just ahead of recvbuf): a message from either is then at distance 0 or behind.
    Scratch under SCRATCH_SLACK_FROM bytes is not placed (CMA starts at larger messages); from
    there it starts up to a page into what scratch_get gave (its SCRATCH_SLACK)."""
    cdef size_t need = op.sched.tmpbytes, into = 0
    cdef int i
    cdef al_step* st
    cdef char* base
    cdef const char* like = op.rbuf
    cdef bint outplace = op.sbuf != NULL and op.sbuf != op.rbuf
    op.sched.land_tmp = 0
    op.sched.tmp = NULL
    op.sched.tmp_base = NULL
    if outplace and near_ahead(op.rbuf, op.sbuf):
        for i in range(op.sched.nsteps):
            st = &op.sched.steps[i]
            if st.recv_peer >= 0 and st.recv_mode == RECV_INTO_REDUCE:
                into = max(into, <size_t>(st.recv_cnt * op.esize))
        if into >= SCRATCH_SLACK_FROM:          # smaller messages go through MPICH's cells
            op.sched.land_tmp = 1
            need = max(need, into)
    if need == 0:
        return 1
    if outplace and not near_ahead(op.sbuf, op.rbuf):
        like = op.sbuf
    base = op_take_scratch(op, need)
    if base == NULL:
        return 0
    if op.sched.tmpbytes >= SCRATCH_SLACK_FROM:
        op.sched.tmp = base + ((<uintptr_t>like - <uintptr_t>base) & 4095)
    return 1


cdef int sched_advance(al_op* op) noexcept nogil:
    """Run schedule steps until one would block (returns 0) or all are done (1)."""
    cdef al_step* st
    cdef char* dst
    cdef char* src
    cdef char* other
    cdef int rc, flag, mode, es = op.esize
    cdef MPI_Comm comm = op.comm.coll
    while op.sched.cur < op.sched.nsteps:
        st = &op.sched.steps[op.sched.cur]
        if not op.sched.posted:
            if st.copy_cnt > 0:
                memcpy(op.rbuf + st.copy_off * es, op.sbuf + st.copy_off * es, <size_t>(st.copy_cnt * es))
            op.nreqs = 0
            if st.recv_peer >= 0:
                dst = op.sched.tmp if recv_mode(op, st) == RECV_TMP_REDUCE else op.rbuf + st.recv_off * es
                rc = mpi.MPI_Irecv(dst, <int>st.recv_cnt, op.mtype, st.recv_peer, op.tag, comm, &op.reqs[0])
                if rc != mpi.MPI_SUCCESS:
                    set_mpi_error(op, rc, "MPI_Irecv")
                    return op_finish(op)
                op.nreqs = 1
            if st.send_peer >= 0:
                src = (op.sbuf if st.send_src == FROM_SEND else op.rbuf) + st.send_off * es
                rc = mpi.MPI_Isend(src, <int>st.send_cnt, op.mtype, st.send_peer, op.tag, comm, &op.reqs[op.nreqs])
                if rc != mpi.MPI_SUCCESS:
                    set_mpi_error(op, rc, "MPI_Isend")
                    return op_finish(op)
                op.nreqs += 1
            op.sched.posted = 1
        if op.nreqs > 0:
            rc = mpi.MPI_Testall(op.nreqs, op.reqs, &flag, op.stats)
            if rc != mpi.MPI_SUCCESS:
                set_mpi_error(op, status_error(op, rc), "MPI_Testall")
                return op_finish(op)
            if not flag:
                return 0
            op.nreqs = 0
        mode = recv_mode(op, st)
        if mode == RECV_TMP_REDUCE or mode == RECV_INTO_REDUCE:
            dst = op.rbuf + st.recv_off * es
            if mode == RECV_TMP_REDUCE:             # dst = SRC[off] op scratch
                src = (op.sbuf if st.reduce_src == FROM_SEND or st.recv_mode == RECV_INTO_REDUCE
                       else op.rbuf) + st.recv_off * es
                other = op.sched.tmp
            else:                                   # dst = sendbuf[off] op dst
                src = op.sbuf + st.recv_off * es
                other = dst
            # AVG: an owned block (always a reducing step) is divided in the same pass
            if st.owned and op.result.avg_in_steps and op.result.avg_div > 0:
                al_reduce_div(op.dtype, dst, src, other, <size_t>st.recv_cnt, op.result.avg_div)
            else:
                al_reduce(op.dtype, op.rop, dst, src, other, <size_t>st.recv_cnt)
        op.sched.posted = 0
        op.sched.cur += 1
    return op_finish(op)


def _sched_scratch(Schedule sched, intptr_t sp, intptr_t rp, int esize):
    """Test hook: what sched_scratch decides for an op of `sched` (elements of `esize` bytes)
    on buffers at the addresses sp and rp (sp == rp: in place; never dereferenced):
    (RECV_INTO_REDUCE steps land in the scratch, the scratch's page offset or None for no
    scratch, its bytes)."""
    cdef al_op* op = <al_op*>calloc(1, sizeof(al_op))
    if op == NULL:
        raise MemoryError()
    op.sbuf = <char*>sp
    op.rbuf = <char*>rp
    op.esize = esize
    op.sched.steps = sched.steps
    op.sched.nsteps = sched.nsteps
    op.sched.tmpbytes = <size_t>(sched.tmp_elems * esize)
    try:
        if not sched_scratch(op):
            raise MemoryError()
        return (bool(op.sched.land_tmp),
                None if op.sched.tmp == NULL else <intptr_t>((<uintptr_t>op.sched.tmp) & 4095),
                op.sched.tmpbytes)
    finally:
        scratch_put(op.sched.tmp_base, op.sched.tmpbytes)
        free(op)
