# The progress engine

cdef pthread_mutex_t g_lock
cdef pthread_cond_t g_submit_cond
cdef pthread_cond_t g_done_cond
pthread_mutex_init(&g_lock, NULL)
pthread_cond_init(&g_submit_cond, NULL)
pthread_cond_init(&g_done_cond, NULL)
cdef al_op* g_qhead = NULL
cdef al_op* g_qtail = NULL
cdef pthread_t g_thread
cdef int g_started = 0
cdef int g_stop = 0
cdef int g_waiters = 0
cdef double g_exit_grace = 2.0
cdef long g_loops = 0            # engine loop iterations (diagnostics)
cdef int g_yield_every = 0       # polls without progress between sched_yield calls (0: never)
cdef double g_wait_nap = 2.5e-4   # seconds an oversubscribed wait on shm flags polls before naps
cdef int64_t g_serial_bytes = 0   # see set_serial_bytes
cdef double g_idle_spin = 0.0    # seconds the idle engine polls for work before sleeping
cdef int g_nsubmitted = 0        # submissions so far (atomic; the idle poll watches it)
cdef double g_wait_spin = 5e-6   # seconds a wait spins before it yields (wait_poll; < 0: never)
# The engine's budget: not AL_WAIT_SPIN's microseconds.  A yield of the engine hands the core
# to this process's own Python thread as often as to anyone else, and the op then stalls
# behind a busy caller (measured with 5 us: 87 % of a 16 MiB shm op's time left to Wait after
# a busy caller, 0.0 % without; performance.md "Under load").  After milliseconds without
# progress the peer is descheduled, and yielding lets it have a core.
DEF ENGINE_WAIT_SPIN = 2e-3
DEF WAIT_NAP = 1e-5               # an oversubscribed wait's first sleep (80-140 us on the reference VM) ...
DEF WAIT_NAP_MAX = 1.6e-4         # ... doubling at each one without progress up to this

def set_idle_spin(double seconds):
    """How long the idle engine polls for new work before sleeping (AL_ENGINE_SPIN)."""
    global g_idle_spin
    g_idle_spin = seconds

def set_serial_bytes(int64_t nbytes):
    """All-reduces of at least `nbytes` bytes on one communicator run one at a time in the
    progress engine, in call order (0: all run together). See AL_ENGINE_SERIAL_BYTES."""
    global g_serial_bytes
    g_serial_bytes = nbytes

def set_poll_yield(int every):
    """While ops are active the engine polls continuously; every `every` polls without
    progress it calls sched_yield() (0: never). See AL_ENGINE_YIELD."""
    global g_yield_every
    g_yield_every = every

def poll_yield():
    """The polls between sched_yield calls now in force (set_poll_yield)."""
    return g_yield_every

def set_wait_nap(double seconds):
    """Where ranks outnumber cores: how long a wait for shm peers' flags polls (yielding)
    without progress before it sleeps between polls instead (AL_WAIT_NAP; 0: never)."""
    global g_wait_nap
    g_wait_nap = seconds

def set_wait_spin(double seconds):
    """How long a blocking call's wait polls without yielding where every rank has a core
    (AL_WAIT_SPIN; < 0: never yield).  The engine's loop uses ENGINE_WAIT_SPIN."""
    global g_wait_spin
    g_wait_spin = seconds

cdef inline void nap(double seconds) noexcept nogil:
    """Sleep `seconds` (below 1 s): at least the timer slack, 50 us by default."""
    cdef timespec ts
    ts.tv_sec = 0
    ts.tv_nsec = <long>(seconds * 1e9)
    nanosleep(&ts, NULL)

cdef inline void wait_poll(long polls, double* since, double spin, int on_flags) noexcept nogil:
    """The one policy of every polling wait: a blocking call's loop (run_inline) with
    spin = g_wait_spin, the engine's loop with ENGINE_WAIT_SPIN, and so an shm op's wait for its
    peers' flags (stepped by those two).  Called after
    each unsuccessful poll; `polls` counts them since the last progress (1 at the first),
    `since` is the caller's variable for this function, set at the first.
    Where ranks outnumber cores (g_yield_every > 0, AL_ENGINE_YIELD), it yields the core every
    g_yield_every polls: the peer waited for needs it.  If the wait is only for peers' flags
    (`on_flags`: shm ops, whose every publish is progress) and has lasted g_wait_nap seconds
    (AL_WAIT_NAP; the clock read every 16 polls), it sleeps at every poll from then on instead,
    WAIT_NAP at first and twice as long at each poll, up to WAIT_NAP_MAX (a sleep costs CPU too:
    a loop of 10 us sleeps used a third of a core on the reference VM, one of 200 us a
    seventh).  Yielding alone left 4 ranks on 2 cores in a state where shm allreduces took
    3-8x longer for seconds at a time (docs/performance.md, "Waits that sleep"), and a sleeping
    waiter always leaves its core to the peer.  Waits on MPI requests never sleep: MPICH moves
    a large message only while both sides poll.
    Otherwise it spins for `spin` seconds
    (g_wait_spin, AL_WAIT_SPIN; < 0: never yield; the clock read every 16 polls), then yields
    at every poll: a wait that long means the peer is not running (descheduled by other work
    on the machine) or is busy for a while, and spinning on would keep the core from it or
    from that work.  A wait on an idle machine (microseconds) seldom yields, and sched_yield
    returns at once when nothing else wants the core."""
    if g_yield_every > 0:
        if polls == 1:
            since[0] = al_now()
        if on_flags and g_wait_nap > 0 and (since[0] < 0 or (
                (polls & 15) == 0 and al_now() - since[0] >= g_wait_nap)):
            # past the budget: sleep at every poll from now on, since[0] = minus the next sleep
            since[0] = -WAIT_NAP if since[0] >= 0 else max(2 * since[0], -WAIT_NAP_MAX)
            nap(-since[0])
        elif polls % g_yield_every == 0:
            sched_yield()
    elif polls == 1:
        since[0] = al_now()
    elif spin < 0:
        return
    elif since[0] < 0:
        sched_yield()
    elif (polls & 15) == 0 and al_now() - since[0] >= spin:
        since[0] = -1.0               # past the budget: yield from now on
        sched_yield()

cdef inline void notify_done(al_op* op) noexcept nogil:
    op.t_done = al_now()
    if op.counted:
        al_fetch_add(&op.comm.pending, -1)
    al_store_seqcst(&op.done, 1)
    if al_load_seqcst(&g_waiters) > 0:
        pthread_mutex_lock(&g_lock)
        pthread_cond_broadcast(&g_done_cond)
        pthread_mutex_unlock(&g_lock)

cdef inline int starts_mpi_collective(al_op* op) noexcept nogil:
    """Ops whose start issues an MPI collective call on the collective communicator (a
    host-transfer op: when its inner host algorithm is one)."""
    if op.kind == K_HOST_TRANSFER:
        return op.ht.inner != NULL and kind_info(op.ht.inner.kind).mpi_collective
    return kind_info(op.kind).mpi_collective

cdef inline int ht_gate(al_op* active, al_comm* c) noexcept nogil:
    """An active host-transfer op on `c` still waiting to start its inner MPI collective."""
    cdef al_op* op = active
    while op != NULL:
        if (op.comm == c and op.kind == K_HOST_TRANSFER and op.ht.phase == HT_COPY_OUT
                and op.ht.inner != NULL and kind_info(op.ht.inner.kind).mpi_collective):
            return 1
        op = op.next
    return 0

cdef inline int64_t op_bytes(al_op* op) noexcept nogil:
    """The bytes an all-reduce moves per rank (0 for other kinds)."""
    if kind_info(op.kind).allreduce_bytes:
        return op.count * op.esize
    return 0

cdef inline int comm_blocked(al_comm** blocked, int n, al_comm* c) noexcept nogil:
    cdef int i
    if n > 64:
        return 1
    for i in range(n):
        if blocked[i] == c:
            return 1
    return 0

cdef inline int serial_gate(al_op* active, al_op* op, al_comm** blocked, int n) noexcept nogil:
    """`op` is a large all-reduce (at least g_serial_bytes) and a large one on its
    communicator is still running: it starts when that one completes.  Two large all-reduces
    progressed together share memory bandwidth and cache and each finishes later; one after
    the other, the first finishes early and the total is lower (AL_ENGINE_SERIAL_BYTES).
    It also waits while an earlier op on its communicator waits to start (`blocked`): else it
    could overtake a large MPI all-reduce held back on this rank only (ht_gate), then hold
    that one back, while the other ranks run the two in call order (a deadlock)."""
    cdef al_op* a = active
    if g_serial_bytes <= 0 or op_bytes(op) < g_serial_bytes:
        return 0
    if comm_blocked(blocked, n, op.comm):
        return 1
    while a != NULL:
        if a.comm == op.comm and op_bytes(a) >= g_serial_bytes:
            return 1
        a = a.next
    return 0

cdef inline void unlink(al_op** head, al_op** tail, al_op* prev, al_op* op) noexcept nogil:
    """Remove `op` (whose predecessor is `prev`, NULL at the head) from a tail-tracked list."""
    if prev == NULL:
        head[0] = op.next
    else:
        prev.next = op.next
    if tail[0] == op:
        tail[0] = prev
    op.next = NULL

cdef void* engine_main(void* arg) noexcept nogil:
    global g_qhead, g_qtail, g_loops
    cdef al_op* active = NULL
    cdef al_op* tail = NULL
    cdef al_op* take
    cdef al_op* op
    cdef al_op* prev
    cdef al_op* nxt
    cdef int stopping = 0, progress
    cdef long idle = 0
    cdef int on_flags = 0
    cdef int seen = 0
    cdef double spin_until, idle_since = 0.0
    cdef al_op* deferred = NULL       # submitted, not yet started (FIFO)
    cdef al_op* dtail = NULL
    cdef al_comm* blocked[64]
    cdef int nblocked = 0
    cdef double deadline = 0.0
    al_cuda_mark_engine_thread()      # CUDA contexts stay current on this thread (al_device.h)
    while True:
        if active == NULL and deferred == NULL and g_idle_spin > 0:
            # idle: poll for new work for a short while before sleeping, so that a burst of
            # submissions (one allreduce per layer) does not pay a thread wake-up each time
            spin_until = al_now() + g_idle_spin
            while al_load_acquire(&g_nsubmitted) == seen and al_now() < spin_until:
                sched_yield()
        pthread_mutex_lock(&g_lock)
        while g_qhead == NULL and active == NULL and deferred == NULL and not g_stop:
            pthread_cond_wait(&g_submit_cond, &g_lock)
        seen = al_load_acquire(&g_nsubmitted)
        take = g_qhead
        g_qhead = NULL
        g_qtail = NULL
        if g_stop and not stopping:
            stopping = 1
            deadline = al_now() + g_exit_grace
        pthread_mutex_unlock(&g_lock)
        g_loops += 1
        progress = 0
        # newly submitted ops join the start queue in submission order
        if take != NULL:
            progress = 1
            if dtail == NULL:
                deferred = take
            else:
                dtail.next = take
            while take.next != NULL:
                take = take.next
            dtail = take
        # start queued ops in order (per communicator: call order). An op that starts an MPI
        # collective waits while an earlier host-transfer op on its communicator has not yet
        # started its own MPI collective (that waits for a device copy), so MPI sees every
        # communicator's collectives in call order on every rank.  A large all-reduce waits
        # for the large one running on its communicator (serial_gate), an op over a shared-memory
        # segment for the one running over it (shm_gate); a waiting op also holds back the
        # later MPI collectives, large all-reduces and shm ops on its communicator.
        nblocked = 0
        prev = NULL
        op = deferred
        while op != NULL:
            nxt = op.next
            if op.phase == PH_NEW and ((starts_mpi_collective(op) and (
                    comm_blocked(blocked, nblocked, op.comm) or ht_gate(active, op.comm)))
                    or serial_gate(active, op, blocked, nblocked)
                    or shm_gate(active, op, blocked, nblocked)):
                if ht_expired(op):        # held back past its hang timeout: abandoned here
                    unlink(&deferred, &dtail, prev, op)
                    progress = 1
                    ht_abandon(op)
                    notify_done(op)
                    op = nxt
                    continue
                if not comm_blocked(blocked, nblocked, op.comm):   # each communicator once
                    if nblocked < 64:
                        blocked[nblocked] = op.comm
                    nblocked += 1
                prev = op
                op = nxt
                continue
            unlink(&deferred, &dtail, prev, op)
            progress = 1
            if op.phase == PH_NEW and op_start(op):
                notify_done(op)
            else:
                if tail == NULL:
                    active = op
                else:
                    tail.next = op
                tail = op
            op = nxt
        # step every active op
        prev = NULL
        op = active
        on_flags = 1                      # every op left waits on shm peers' flags alone
        while op != NULL:
            nxt = op.next
            if op_step(op):
                progress = 1
                unlink(&active, &tail, prev, op)
                notify_done(op)
            else:
                if shm_waits_anew(op):
                    progress = 1
                if not is_shm_kind(op.kind):
                    on_flags = 0
                prev = op
            op = nxt
        if stopping and ((active == NULL and deferred == NULL) or al_now() > deadline):
            break
        if progress:
            idle = 0
        else:
            idle += 1
            wait_poll(idle, &idle_since, ENGINE_WAIT_SPIN, on_flags)
    # shutdown: abandon what is left
    if dtail != NULL:                 # never-started ops are abandoned like the rest
        dtail.next = active
        active = deferred
    while active != NULL:
        op = active
        active = op.next
        op.next = NULL
        op_cancel(op, "cancelled: the progress engine stopped at interpreter exit before this op completed")
        notify_done(op)
    pthread_mutex_lock(&g_lock)
    take = g_qhead
    g_qhead = NULL
    g_qtail = NULL
    pthread_mutex_unlock(&g_lock)
    while take != NULL:
        op = take
        take = op.next
        op.next = NULL
        op_cancel(op, "cancelled: the progress engine stopped at interpreter exit before this op started")
        notify_done(op)
    return NULL

cdef int engine_submit(al_op* op) noexcept nogil:
    """Queue an op for the engine (starting the thread if needed). Returns 0 or an errno."""
    global g_qhead, g_qtail, g_started
    cdef int rc = 0
    op.counted = 1
    al_fetch_add(&op.comm.pending, 1)
    pthread_mutex_lock(&g_lock)
    if g_stop:
        pthread_mutex_unlock(&g_lock)
        al_fetch_add(&op.comm.pending, -1)
        op.counted = 0
        return -1
    if not g_started:
        rc = pthread_create(&g_thread, NULL, engine_main, NULL)
        if rc != 0:
            pthread_mutex_unlock(&g_lock)
            al_fetch_add(&op.comm.pending, -1)
            op.counted = 0
            return rc
        g_started = 1
    op.next = NULL
    if g_qtail == NULL:
        g_qhead = op
    else:
        g_qtail.next = op
    g_qtail = op
    al_fetch_add(&g_nsubmitted, 1)
    pthread_cond_signal(&g_submit_cond)
    pthread_mutex_unlock(&g_lock)
    return 0

# Every wait of a calling thread (blocking calls, Wait, Waitall, Free) returns to Python at
# least every WAKE seconds so that it can run the signal handlers (PyErr_CheckSignals): a
# Ctrl-C is raised within about WAKE, not when the peers arrive.  Only waits pay for it; a
# call that completes at once never reaches the check.
DEF WAKE = 0.05
DEF SLICE = 2                     # wait_done / run_inline: WAKE passed, the op is not done

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1

cdef inline double deadline_of(double timeout) noexcept nogil:
    """The monotonic deadline of a wait of `timeout` seconds (< 0: none)."""
    return al_now() + timeout if timeout >= 0 else 1e300

cdef int wait_done(al_op* op, double deadline, int spin) noexcept nogil:
    """Wait for op.done until `deadline` (al_now's clock) or for at most WAKE seconds, first
    polling a little if `spin` (the first slice of a wait: a short op is seen without a
    sleep; later slices skip it, as a loaded machine's sched_yield can take milliseconds).
    Returns 1 if done, 0 past the deadline, SLICE when WAKE passed first."""
    cdef int i
    cdef double now, until, wake
    cdef timespec ts
    for i in range(200 if spin else 1):
        if al_load_acquire(&op.done):
            return 1
        if i >= 50:
            sched_yield()
    wake = al_now() + WAKE
    pthread_mutex_lock(&g_lock)
    al_fetch_add(&g_waiters, 1)
    while not al_load_seqcst(&op.done):
        now = al_now()
        if now >= deadline or now >= wake:
            break
        until = (deadline if deadline < wake else wake) - now
        clock_gettime(CLOCK_REALTIME, &ts)
        ts.tv_nsec += <long>(until * 1e9)
        ts.tv_sec += ts.tv_nsec // 1000000000
        ts.tv_nsec = ts.tv_nsec % 1000000000
        pthread_cond_timedwait(&g_done_cond, &g_lock, &ts)
    al_fetch_add(&g_waiters, -1)
    pthread_mutex_unlock(&g_lock)
    if al_load_acquire(&op.done):
        return 1
    return 0 if al_now() >= deadline else SLICE

cdef int run_inline(al_op* op, double deadline) noexcept nogil:
    """Drive an op in the calling thread (starting it if new), polling: returns 1 once done,
    0 past `deadline`, SLICE after WAKE seconds (call again to go on).  Never a blocking MPI
    call, so the caller can check for signals and hand the op to the engine.  Waits through
    wait_poll with AL_WAIT_SPIN's budget (an shm op's publish starts a new wait): where ranks
    outnumber cores, a caller spinning on a peer's message would otherwise hold the core that
    peer needs for its whole time slice (milliseconds per step on the emulated cluster), and
    past the budget the peer is descheduled or busy."""
    cdef long n = 0, w = 0
    cdef double now, wake, since = 0.0
    if op.phase == PH_NEW:
        if op_start(op):
            op.t_done = al_now()
            al_store_release(&op.done, 1)
            return 1
    wake = al_now() + WAKE
    while not op_step(op):
        if shm_waits_anew(op):
            w = 0
        n += 1
        w += 1
        wait_poll(w, &since, g_wait_spin, is_shm_kind(op.kind))
        if (n & 15) == 0:
            now = al_now()
            if now > deadline:
                return 0
            if now > wake:
                return SLICE
    op.t_done = al_now()
    al_store_release(&op.done, 1)
    return 1

# os.fork(): the child has a copy of the engine's state but not its thread, and MPI cannot be
# used there; a lock the engine held at the fork stays held. The child marks itself (every
# entry point then raises, see fork_fail) and forgets the thread (interpreter exit must not
# join it).  A C handler (pthread_atfork), so that a fork made by C code is seen too.
cdef int g_forked = 0

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*)() noexcept nogil, void (*)() noexcept nogil,
                       void (*)() noexcept nogil)

cdef void after_fork_in_child() noexcept nogil:
    global g_forked, g_started, g_stop, g_waiters
    g_forked = 1
    g_started = 0
    g_stop = 1
    g_waiters = 0
    pthread_mutex_init(&g_lock, NULL)
    pthread_cond_init(&g_submit_cond, NULL)
    pthread_cond_init(&g_done_cond, NULL)

pthread_atfork(NULL, NULL, after_fork_in_child)

# MPI_Finalize in a forked child (mpi4py's at interpreter exit, or the program's own) would run
# on the parent's MPI state: the transport's shared-memory queues, which the child shares with
# the parent and its peers (it takes messages meant for the parent: wrong values, a peer that
# waits forever), and the parent's connection to the launcher (its barrier: a child that hangs
# at exit, a parent whose own finalize fails).  MPI deletes the attributes of MPI_COMM_SELF
# first thing in MPI_Finalize, before any of that; the delete function of ours fails it in a
# forked child, so MPI_Finalize returns an error there having touched nothing, and the child
# exits with its own status.  In the parent it lets MPI_Finalize go on.
cdef int g_finalize_guard = 0

cdef int finalize_guard(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    return mpi.MPI_ERR_OTHER if g_forked else mpi.MPI_SUCCESS

cdef void install_finalize_guard() noexcept nogil:
    """Set the attribute of MPI_COMM_SELF whose deletion fails MPI_Finalize in a forked child
    (once, when MPI is initialised: at import, else at the first Communicator)."""
    global g_finalize_guard
    cdef int keyval, up = 0, down = 1
    if g_finalize_guard or g_forked:
        return
    mpi.MPI_Initialized(&up)
    mpi.MPI_Finalized(&down)
    if not up or down:
        return
    if mpi.MPI_Comm_create_keyval(mpi.MPI_COMM_NULL_COPY_FN, finalize_guard, &keyval,
                                  NULL) != mpi.MPI_SUCCESS:
        return
    if mpi.MPI_Comm_set_attr(mpi.MPI_COMM_SELF, keyval, NULL) == mpi.MPI_SUCCESS:
        g_finalize_guard = 1

install_finalize_guard()

def forked():
    """True in a child process made by os.fork() after this module was imported."""
    return g_forked != 0

def shutdown_engine(double grace=2.0):
    """Stop the progress engine: finish what completes within `grace` seconds, cancel the rest."""
    global g_stop, g_exit_grace, g_started
    cdef int started
    with nogil:
        pthread_mutex_lock(&g_lock)
        g_exit_grace = grace
        g_stop = 1
        started = g_started
        pthread_cond_signal(&g_submit_cond)
        pthread_mutex_unlock(&g_lock)
        if started:
            pthread_join(g_thread, NULL)
            g_started = 0

def engine_running():
    return bool(g_started) and not g_stop

def engine_loops():
    """Number of progress-engine loop iterations so far (a diagnostic)."""
    return g_loops
