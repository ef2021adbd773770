cdef void fork_fail(name) except *:
    """Raise the error of any use of the library in a child process after os.fork()."""
    _hooks.fail(f"{name}: this process was made by os.fork() from a process that had imported "
                f"aluminum_py; communicators, requests and MPI cannot be used in it (the "
                f"progress engine thread and MPI's state do not survive fork). Communicate in "
                f"the parent, or start workers with multiprocessing's 'spawn' method.")

def check_not_forked(name):
    """Raise aluminum_py.Error naming fork in a child process after os.fork()."""
    if g_forked:
        fork_fail(name)

cdef class CommState:
    """Native state of one Communicator: two duplicated MPI communicators and a pending count."""
    cdef al_comm* c
    cdef readonly object coll_comm, p2p_comm
    cdef readonly unsigned int seq
    cdef public bint freed
    cdef public object interrupted   # NativeOp of a blocking call a signal interrupted, until done
    cdef public bint busy            # a thread is inside a blocking call on this communicator

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
        # referencing it (ops keep a reference to this object), and so does its segment.
        shm_release(self.c)
        free(self.c)
        self.c = NULL

    def check_usable(self, name):
        """Raise unless ops may start on this communicator: not in a child after os.fork(),
        not freed, no other thread inside a blocking call on it, and no blocking call interrupted by a signal still running (the ranks may be
        out of step: the interrupted call has not completed here, the program has gone on as if
        it had failed)."""
        if g_forked:
            fork_fail(name)
        if self.freed:
            _hooks.fail(f"{name}: the communicator has been freed")
        if self.busy:
            _hooks.fail(f"{name}: this communicator is in use by another thread (a blocking "
                        f"call has not returned); a communicator may be used by one thread at "
                        f"a time, because every rank must see its calls in the same order: "
                        f"give each thread its own Communicator")
        o = self.interrupted
        if o is not None:
            if o.done:
                self.interrupted = None
                return
            _hooks.fail(f"{name}: this communicator is unusable: an earlier blocking call, "
                        f"{o.describe()}, was interrupted by a signal (KeyboardInterrupt?) "
                        f"before it completed; it goes on in the background and the "
                        f"communicator works again once it completes (its peers joined). "
                        f"Otherwise use a new Communicator.")

    @property
    def rank(self):
        return self.c.rank

    @property
    def size(self):
        return self.c.size

    @property
    def abandoned(self):
        """An op on this communicator was abandoned at its hang timeout (a host-transfer op's
        host part): the peers' messages of that op may still be in flight."""
        return self.c.abandoned != 0

    @property
    def pending(self):
        """Ops handed to the progress engine on this communicator and not yet complete."""
        return al_load_acquire(&self.c.pending)

    def next_tag(self):
        """Tag for the next schedule op: identical on every rank because ops start in call order."""
        self.seq += 1
        return <int>(self.seq % 32000u) + 1
