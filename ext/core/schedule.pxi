# The schedule interpreter: runs the step array of one of our allreduce algorithms
# (built in Python by aluminum_py.schedules, copied by the Schedule class).

cdef int sched_advance(al_op* op) noexcept nogil:
    """Run schedule steps until one would block (returns 0) or all are done (1)."""
    cdef al_step* st
    cdef char* dst
    cdef char* src
    cdef char* other
    cdef int rc, flag, es = op.esize
    cdef MPI_Comm comm = op.comm.coll
    while op.sched.cur < op.sched.nsteps:
        st = &op.sched.steps[op.sched.cur]
        if not op.sched.posted:
            if st.copy_cnt > 0:
                memcpy(op.rbuf + st.copy_off * es, op.sbuf + st.copy_off * es, <size_t>(st.copy_cnt * es))
            op.nreqs = 0
            if st.recv_peer >= 0:
                dst = op.sched.tmp if st.recv_mode == RECV_TMP_REDUCE else op.rbuf + st.recv_off * es
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
        if st.recv_mode == RECV_TMP_REDUCE or st.recv_mode == RECV_INTO_REDUCE:
            dst = op.rbuf + st.recv_off * es
            if st.recv_mode == RECV_TMP_REDUCE:     # dst = SRC[off] op scratch
                src = (op.sbuf if st.reduce_src == FROM_SEND else op.rbuf) + st.recv_off * es
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
