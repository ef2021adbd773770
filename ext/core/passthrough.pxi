# MPI pass-through ops: the MPI library's own collectives and point-to-point calls,
# started with the MPI_I* call and polled with MPI_Testall in op_step (never a blocking MPI
# call: a blocking call could not be interrupted, engine.pxi).

cdef int mpi_start(al_op* op) noexcept nogil:
    """Start an MPI pass-through op with its MPI_I* call."""
    # the user's point-to-point calls go to their own communicator (their tags and peers)
    cdef MPI_Comm comm = op.comm.p2p if kind_info(op.kind).point_to_point else op.comm.coll
    cdef void* sb = <void*>op.sbuf if op.sbuf != NULL else mpi.MPI_IN_PLACE
    cdef void* rb = <void*>op.rbuf
    if rb == NULL and (op.kind == K_SCATTER or op.kind == K_SCATTERV):  # root's block stays
        rb = mpi.MPI_IN_PLACE
    cdef int n = <int>op.count, rc = mpi.MPI_SUCCESS
    cdef MPI_Datatype t = op.mtype
    cdef MPI_Request* r = &op.reqs[0]
    op.nreqs = 1
    if op.kind == K_ALLREDUCE:
        rc = mpi.MPI_Iallreduce(sb, rb, n, t, op.mpi.mop, comm, r)
    elif op.kind == K_REDUCE:
        rc = mpi.MPI_Ireduce(sb, rb, n, t, op.mpi.mop, op.mpi.root, comm, r)
    elif op.kind == K_REDUCE_SCATTER:
        rc = mpi.MPI_Ireduce_scatter_block(sb, rb, n, t, op.mpi.mop, comm, r)
    elif op.kind == K_ALLGATHER:
        rc = mpi.MPI_Iallgather(sb, n, t, rb, n, t, comm, r)
    elif op.kind == K_BCAST:
        rc = mpi.MPI_Ibcast(rb, n, t, op.mpi.root, comm, r)
    elif op.kind == K_ALLTOALL:
        rc = mpi.MPI_Ialltoall(sb, n, t, rb, n, t, comm, r)
    elif op.kind == K_GATHER:
        rc = mpi.MPI_Igather(sb, n, t, rb, n, t, op.mpi.root, comm, r)
    elif op.kind == K_SCATTER:
        rc = mpi.MPI_Iscatter(sb, n, t, rb, n, t, op.mpi.root, comm, r)
    elif op.kind == K_BARRIER:
        rc = mpi.MPI_Ibarrier(comm, r)
    elif op.kind == K_SEND:
        rc = mpi.MPI_Isend(sb, n, t, op.mpi.root, op.tag, comm, r)
    elif op.kind == K_RECV:
        rc = mpi.MPI_Irecv(rb, n, t, op.mpi.root, op.tag, comm, r)
    elif op.kind == K_SENDRECV:
        rc = mpi.MPI_Irecv(rb, <int>op.mpi.count2, t, op.mpi.peer2, op.mpi.tag2, comm,
                           &op.reqs[0])
        if rc == mpi.MPI_SUCCESS:
            rc = mpi.MPI_Isend(sb, n, t, op.mpi.root, op.tag, comm, &op.reqs[1])
            op.nreqs = 2
    # the v-collectives (vcollectives.pxi): per-rank counts and displacements from op.v, where
    # the call has them (NULL where MPI does not read them: a non-root's side of Gatherv)
    elif op.kind == K_ALLGATHERV:
        rc = mpi.MPI_Iallgatherv(sb, n, t, rb, op.v.rcounts, op.v.rdispls, t, comm, r)
    elif op.kind == K_GATHERV:
        rc = mpi.MPI_Igatherv(sb, n, t, rb, op.v.rcounts, op.v.rdispls, t, op.mpi.root, comm, r)
    elif op.kind == K_SCATTERV:
        rc = mpi.MPI_Iscatterv(<void*>op.sbuf, op.v.scounts, op.v.sdispls, t, rb, n, t,
                               op.mpi.root, comm, r)
    elif op.kind == K_ALLTOALLV:
        rc = mpi.MPI_Ialltoallv(sb, op.v.scounts, op.v.sdispls, t, rb, op.v.rcounts, op.v.rdispls,
                                t, comm, r)
    elif op.kind == K_REDUCE_SCATTERV:
        rc = mpi.MPI_Ireduce_scatter(sb, rb, op.v.rcounts, t, op.mpi.mop, comm, r)
    elif op.kind == K_SCAN:
        rc = mpi.MPI_Iscan(sb, rb, n, t, op.mpi.mop, comm, r)
    elif op.kind == K_EXSCAN:
        rc = mpi.MPI_Iexscan(sb, rb, n, t, op.mpi.mop, comm, r)
    else:
        op.err = -1
        snprintf(op.errmsg, 256, "unknown op kind %d", op.kind)
        op.nreqs = 0
        return op_finish(op)
    if rc != mpi.MPI_SUCCESS:
        op.nreqs = 0
        set_mpi_error(op, rc, "MPI call")
        return op_finish(op)
    return 0
