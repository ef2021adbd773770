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

cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil

# ---- a communicator's health: broken for good, on every rank ----
# A rank that refuses a call its peers may have accepted (another thread's: the threading
# rule), or that finds the ranks' calls differ (fingerprints), marks the communicator broken
# (comm_mark) and tells its peers (comm_break): on a communicator with a shared-memory segment
# through the segment's health word (al_shm.h), which every op over the segment checks while
# it waits; otherwise with a message of tag TAG_BROKEN on the collective communicator to every
# peer (our schedules' tags are 1..32000, MPI's collectives never match a message).  A peer
# finds either in the slow path of its waits (comm_poll_broken, every WAKE seconds of a wait:
# fast ops pay nothing) and fails instead of waiting for a rank that will never come.
DEF TAG_BROKEN = 32767
DEF WHY = 256

cdef int comm_mark(al_comm* c, const char* why) noexcept nogil:
    """Mark `c` broken with `why` (the first mark is kept); 1 if this call marked it."""
    if al_fetch_add(&c.claim, 1) != 0:
        return 0
    strncpy(c.why, why, WHY - 1)
    c.why[WHY - 1] = 0
    al_store_release(&c.broken, 1)
    return 1

cdef void comm_break(al_comm* c, int reason, const char* why) noexcept nogil:
    """comm_mark, and tell the peers: the segment's health word (`reason`: AL_SHM_REFUSED ...),
    or without a segment a message of `why` to every peer (sent without waiting; its buffer is
    never freed: a broken communicator is a program's error, once)."""
    cdef char* msg
    cdef MPI_Request req
    cdef int r
    if not comm_mark(c, why):
        return
    if c.shm != NULL:
        al_shm_mark_broken_why(c.shm, reason)
        return
    if c.size < 2:
        return
    msg = <char*>malloc(WHY)
    if msg == NULL:
        return
    strncpy(msg, why, WHY - 1)
    msg[WHY - 1] = 0
    for r in range(c.size):
        if r != c.rank and mpi.MPI_Isend(msg, WHY, mpi.MPI_CHAR, r, TAG_BROKEN, c.coll,
                                         &req) == mpi.MPI_SUCCESS:
            mpi.MPI_Request_free(&req)

cdef void shm_broken_message(al_shm_seg* seg, int who, char* out) noexcept nogil:
    """Why rank `who` broke the segment `seg` (its health word), for an error message."""
    cdef int why = al_shm_broken_why(seg)
    if why == AL_SHM_REFUSED:
        snprintf(out, WHY, "rank %d refused a call on this communicator from a thread that does "
                 "not own it (the threading rule: docs/semantics.md), so the ranks' calls are "
                 "out of step for good; use a new Communicator", who)
    elif why == AL_SHM_MISMATCHED:
        snprintf(out, WHY, "rank %d found that the ranks' calls on this communicator differ "
                 "(collective fingerprints: count, dtype, op, root or call order); use a new "
                 "Communicator", who)
    else:
        snprintf(out, WHY, "the communicator's shared-memory segment is unusable: rank %d "
                 "abandoned an op over it at its hang timeout (a host-transfer allreduce), which "
                 "left the ranks' rounds out of step; use a new Communicator", who)

cdef int comm_poll_broken(al_comm* c) noexcept nogil:
    """1 if `c` is broken: marked here, on its segment by a peer, or in a peer's message
    (received here).  The slow path of the waits; a probe of MPI when `c` has no segment."""
    cdef int flag = 0, who
    cdef mpi.MPI_Message m
    cdef mpi.MPI_Status st
    cdef char buf[WHY]
    cdef char why[WHY]
    if c == NULL:
        return 0
    if al_load_acquire(&c.broken):
        return 1
    if c.shm != NULL:
        who = al_shm_broken_by(c.shm)
        if who < 0 or al_shm_broken_why(c.shm) == AL_SHM_ABANDONED:   # the segment's alone
            return 0
        shm_broken_message(c.shm, who, why)
        comm_mark(c, why)
        return 1
    if c.size < 2 or mpi.MPI_Improbe(mpi.MPI_ANY_SOURCE, TAG_BROKEN, c.coll, &flag, &m,
                                     &st) != mpi.MPI_SUCCESS or not flag:
        return 0
    buf[0] = 0
    mpi.MPI_Mrecv(buf, WHY, mpi.MPI_CHAR, &m, &st)
    buf[WHY - 1] = 0
    snprintf(why, WHY, "rank %d: %s", st.MPI_SOURCE, buf)
    comm_mark(c, why)
    return 1

cdef inline bint unusual(CommState s) noexcept:
    """Anything that check_usable must look at (one test on the fast paths): forked, freed, a
    thread that does not own the communicator, broken, an interrupted call."""
    return (g_forked or s.freed or s.owner != PyThread_get_thread_ident() or s.c.broken
            or s.interrupted is not None)

cdef class CommState:
    """Native state of one Communicator: two duplicated MPI communicators and a pending count."""
    cdef al_comm* c
    cdef readonly object coll_comm, p2p_comm
    cdef readonly unsigned int seq
    cdef public bint freed
    cdef public object interrupted   # NativeOp of a blocking call a signal interrupted, until done
    cdef public bint busy            # the owner is inside a blocking call that released the GIL
    cdef readonly unsigned long owner   # the thread that may start calls (its ident)

    def __cinit__(self, coll_comm, p2p_comm):
        mpi_tables_init()
        install_finalize_guard()        # MPI was not initialised when the module was imported
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
        self.owner = PyThread_get_thread_ident()

    def __dealloc__(self):
        # MPI communicators are freed by Communicator.Free(); the struct lives as long as any op
        # referencing it (ops keep a reference to this object), and so does its segment.
        shm_release(self.c)
        free(self.c)
        self.c = NULL

    def check_usable(self, name):
        """Raise unless ops may start on this communicator: not in a child after os.fork(),
        not freed, called by the owner thread, not broken, and no blocking call interrupted by
        a signal still running (the ranks may be out of step: the interrupted call has not
        completed here, the program has gone on as if it had failed).  A call of another thread
        is refused and breaks the communicator on every rank (refuse)."""
        if g_forked:
            fork_fail(name)
        if self.freed:
            _hooks.fail(f"{name}: the communicator has been freed")
        if self.owner != PyThread_get_thread_ident():
            self.refuse(name)
        if self.c.broken:
            _hooks.fail(f"{name}: this communicator is unusable: "
                        f"{(<char*>self.c.why).decode('utf-8', 'replace')}")
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

    def refuse(self, name):
        """A thread other than the owner called `name`: mark the communicator broken, tell the
        peers (they may have accepted the same call, and would wait for this rank forever),
        raise."""
        msg = _hooks.not_owner(name, self.owner, PyThread_get_thread_ident())
        if not self.c.broken:
            comm_break(self.c, AL_SHM_REFUSED, msg.encode("utf-8", "replace")[:WHY - 1])
        _hooks.fail(f"{msg}; the communicator is now unusable on every rank")

    def bind_thread(self, name="bind_thread"):
        """Make the calling thread the owner (Communicator.bind_thread).  Raises while another
        thread is inside a blocking call on the communicator."""
        cdef unsigned long me = PyThread_get_thread_ident()
        if g_forked:
            fork_fail(name)
        if self.freed:
            _hooks.fail(f"{name}: the communicator has been freed")
        if self.busy and self.owner != me:
            _hooks.fail(_hooks.in_call(name, self.owner))
        self.owner = me

    def check_free(self, name="Free"):
        """Raise unless Free may go on: no call of this communicator in progress in another
        thread (its buffers and segment must stay), called by the owner (else refused as any
        call).  A broken communicator may be freed."""
        if g_forked:
            fork_fail(name)
        if self.busy:
            _hooks.fail(_hooks.in_call(name, self.owner))
        if self.owner != PyThread_get_thread_ident():
            self.refuse(name)

    @property
    def marked(self):
        """The communicator is known here to be broken (no polling: see `broken`)."""
        return self.c.broken != 0

    def mark_broken(self, why):
        """Mark the communicator broken with `why` on this rank only (AL_CHECK: every rank
        found the same mismatch); the first mark is kept."""
        comm_mark(self.c, why.encode("utf-8", "replace")[:WHY - 1])

    @property
    def broken(self):
        """Why the communicator is unusable for good (a str), or None; polls the peers' notices
        (comm_poll_broken)."""
        if not comm_poll_broken(self.c):
            return None
        return (<char*>self.c.why).decode("utf-8", "replace")

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
