cdef class CommState:
    """Native state of one Communicator: two duplicated MPI communicators and a pending count."""
    cdef al_comm* c
    cdef readonly object coll_comm, p2p_comm
    cdef readonly unsigned int seq
    cdef public bint freed

    def __cinit__(self, coll_comm, p2p_comm):
        mpi_tables_init()
        self.c = <al_comm*>calloc(1, sizeof(al_comm))
        if self.c == NULL:
            raise MemoryError()
        self.coll_comm = coll_comm
        self.p2p_comm = p2p_comm
        self.c.coll = <MPI_Comm><size_t>coll_comm.handle
        self.c.p2p = <MPI_Comm><size_t>p2p_comm.handle
        mpi.MPI_Comm_set_errhandler(self.c.coll, mpi.MPI_ERRORS_RETURN)
        mpi.MPI_Comm_set_errhandler(self.c.p2p, mpi.MPI_ERRORS_RETURN)
        mpi.MPI_Comm_rank(self.c.coll, &self.c.rank)
        mpi.MPI_Comm_size(self.c.coll, &self.c.size)
        self.seq = 0

    def __dealloc__(self):
        # MPI communicators are freed by Communicator.Free(); the struct lives as long as any op
        # referencing it (ops keep a reference to this object).
        free(self.c)
        self.c = NULL

    @property
    def rank(self):
        return self.c.rank

    @property
    def size(self):
        return self.c.size

    @property
    def pending(self):
        """Ops handed to the progress engine on this communicator and not yet complete."""
        return al_load_acquire(&self.c.pending)

    def next_tag(self):
        """Tag for the next schedule op: identical on every rank because ops start in call order."""
        self.seq += 1
        return <int>(self.seq % 32000u) + 1
