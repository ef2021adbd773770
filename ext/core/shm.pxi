# The shared-memory transport: the op glue of the "shm" collectives (K_SHM_ALLREDUCE ...
# K_SHM_BARRIER), their ordering rule in the engine (shm_gate), and the collective setup of a
# communicator's segment.
# The segment's layout and the protocol (with its memory-ordering argument) are in ext/al_shm.h.

cdef inline void shm_args(al_op* op, al_shm_args* a) noexcept nogil:
    a.dtype = op.dtype
    a.rop = op.rop
    a.esize = op.esize
    a.sbuf = op.sbuf
    a.rbuf = op.rbuf
    a.count = op.count
    a.avg_div = op.result.avg_div if op.result.avg_in_steps else 0.0
    a.coll = op.kind - K_SHM_ALLREDUCE     # 0: allreduce, else AL_SHM_ALLGATHER ... (al_shm.h)
    a.root = op.mpi.root
    if op.kind >= K_SHM_ALLGATHERV:        # the v-collectives (shm_vcollectives.pxi)
        a.coll = AL_SHM_ALLGATHERV + op.kind - K_SHM_ALLGATHERV
        a.scounts = op.v.scounts
        a.sdispls = op.v.sdispls
        a.rcounts = op.v.rcounts
        a.rdispls = op.v.rdispls

def set_shm_stream_bytes(nbytes, size_t cache_bytes=0):
    """"shm" allreduces of at least `nbytes` write recvbuf with streaming stores (al_shm.h;
    AL_SHM_STREAM_BYTES); None: those where the node's sendbufs and recvbufs (2 x ranks x
    bytes) fill the last-level cache, `cache_bytes` bytes (0: as it was, initially 32 MiB)."""
    global al_shm_stream_bytes, al_shm_cache_bytes
    al_shm_stream_bytes = AL_SHM_STREAM_BY_CACHE if nbytes is None else <size_t>nbytes
    if cache_bytes:
        al_shm_cache_bytes = cache_bytes

def set_shm_slot_stores(int mode):
    """How the "shm" collectives write the slots: 0 by size (streaming stores from
    AL_SHM_STREAM_SLOTS_FROM bytes written), 1 ordinary (cached) stores, 2 streaming stores
    (al_shm.h, "the slots' stores"; AL_SHM_SLOT_STORES)."""
    global al_shm_slot_stores
    al_shm_slot_stores = mode

cdef int shm_broken(al_op* op) noexcept nogil:
    """Fail `op` (1) if a rank broke the segment (al_shm_mark_broken_why: it gave up an op,
    refused a call, or found the calls differ; the rounds are out of step for good), else 0.
    The communicator is marked broken here too (every later call raises), except after an
    abandoned op: that leaves only the segment's rounds out of step, the MPI-based algorithms
    keep working."""
    cdef int who = al_shm_broken_by(op.comm.shm)
    if who < 0:
        return 0
    op.err = -1
    shm_broken_message(op.comm.shm, who, op.errmsg)
    if al_shm_broken_why(op.comm.shm) != AL_SHM_ABANDONED:   # else only the segment's rounds
        comm_mark(op.comm, op.errmsg)
    return 1

# names for the fingerprints' message (al_reduce.h's codes; al_shm.h's collective numbers)
cdef const char* g_dtype_names[16]
cdef const char* g_op_names[16]
cdef const char* g_coll_names[8]
for _i, _n in enumerate((b"int8", b"int16", b"int32", b"int64", b"uint8", b"uint16", b"uint32",
                         b"uint64", b"float16", b"bfloat16", b"float32", b"float64",
                         b"complex64", b"complex128", b"?", b"?")):
    g_dtype_names[_i] = _n
for _i, _n in enumerate((b"SUM", b"PROD", b"MIN", b"MAX", b"LAND", b"LOR", b"LXOR", b"BAND",
                         b"BOR", b"BXOR", b"AVG", b"?", b"?", b"?", b"?", b"?")):
    g_op_names[_i] = _n
_COLL_CALLS = (b"Allreduce", b"Allgather", b"Bcast", b"Reduce_scatter", b"Barrier", b"Allgatherv",
               b"Alltoall", b"Alltoallv")
for _i, _n in enumerate(_COLL_CALLS):
    g_coll_names[_i] = _n

cdef int fp_describe(uint64_t fp, char* out, size_t n) noexcept nogil:
    """The call a fingerprint (al_shm_fp) stands for, e.g. "Allreduce(count=1000, float32,
    SUM, call #17)"; returns snprintf's length."""
    cdef int coll, dtype, rop, root
    cdef int64_t count
    cdef long number
    al_shm_fp_unpack(fp, &coll, &dtype, &rop, &root, &count, &number)
    if coll == AL_SHM_ALLGATHERV:
        return snprintf(out, n, "%s(counts #%llx, %s, call #%ld)", g_coll_names[coll],
                        <long long>count, g_dtype_names[dtype], number)
    if coll == AL_SHM_ALLTOALLV:
        return snprintf(out, n, "%s(%s, call #%ld)", g_coll_names[coll], g_dtype_names[dtype],
                        number)
    if coll == 4:
        return snprintf(out, n, "%s(call #%ld)", g_coll_names[coll], number)
    if coll == 0 or coll == 3:
        return snprintf(out, n, "%s(count=%lld, %s, %s, call #%ld)", g_coll_names[coll],
                        <long long>count, g_dtype_names[dtype], g_op_names[rop], number)
    if coll == 2:
        return snprintf(out, n, "%s(count=%lld, %s, root=%d, call #%ld)", g_coll_names[coll],
                        <long long>count, g_dtype_names[dtype], root, number)
    return snprintf(out, n, "%s(count=%lld, %s, call #%ld)", g_coll_names[coll],
                    <long long>count, g_dtype_names[dtype], number)

cdef int shm_mismatch(al_op* op) noexcept nogil:
    """The fingerprint of peer op.shm.waiting differs from this op's (AL_SHM_MISMATCH): fail
    `op` naming both calls, and break the communicator on every rank (the health word)."""
    cdef char mine[96]
    cdef char theirs[96]
    cdef al_shm_seg* seg = op.comm.shm
    fp_describe(op.shm.fp, mine, 96)
    fp_describe(op.shm.theirs, theirs, 96)
    op.err = -1
    snprintf(op.errmsg, 256, "rank %d called %s, rank %d called %s: the ranks' calls differ "
             "(collective fingerprints); the communicator is now unusable on every rank",
             seg.rank, mine, op.shm.waiting, theirs)
    comm_break(op.comm, AL_SHM_MISMATCHED, op.errmsg)
    return op_finish(op)

cdef int shm_counts_disagree(al_op* op, int rc) noexcept nogil:
    """Alltoallv's round 0 found that peer op.shm.waiting expects op.shm.theirs elements from
    this rank, not the sendcounts this rank sends it (AL_SHM_COUNTS_EXPECTED), or that two other
    ranks disagree (AL_SHM_COUNTS_ELSEWHERE; ext/shm/vcollectives.h): fail `op` saying so, and
    break the communicator on every rank (the health word), as a fingerprint mismatch does."""
    cdef int peer = op.shm.waiting, me = op.comm.rank
    op.err = -1
    if rc == AL_SHM_COUNTS_EXPECTED:
        snprintf(op.errmsg, 256, "rank %d expects %lld elements from rank %d (its recvcounts[%d]), "
                 "rank %d sends %d (its sendcounts[%d]): the ranks' Alltoallv calls differ; the "
                 "communicator is now unusable on every rank", peer,
                 <long long><int64_t>op.shm.theirs, me, me, me, op.v.scounts[peer], peer)
    else:
        snprintf(op.errmsg, 256, "two other ranks' Alltoallv counts differ (what one sends the "
                 "other does not expect): the ranks' Alltoallv calls differ; the communicator is "
                 "now unusable on every rank")
    comm_break(op.comm, AL_SHM_MISMATCHED, op.errmsg)
    return op_finish(op)

cdef int shm_peer_died(al_op* op) noexcept nogil:
    """Fail `op` (1) if the peer it waits for has died (its process is gone: al_shm_dead_peer,
    ext/shm/segment.h, looked at every few dozen milliseconds of a wait), after storing that in
    the health word, so every rank waiting on the segment fails with it (shm_broken); else 0."""
    cdef int dead = al_shm_dead_peer(op.comm.shm, &op.shm)
    if dead < 0:
        return 0
    al_shm_mark_dead(op.comm.shm, dead)
    return shm_broken(op)

cdef int shm_step(al_op* op) noexcept nogil:
    """Advance the protocol until it would wait for a peer (0) or the op is complete (1).
    Never blocks and never yields: the loop that steps the op (run_inline, the engine) applies
    the wait policy (wait_poll), and counts a publish as progress (shm_waits_anew).  Every shm
    op (allreduce, allgather, bcast, reduce_scatter, barrier) waits here."""
    cdef al_shm_args a
    cdef int rc
    shm_args(op, &a)
    if a.coll == 0:
        rc = al_shm_allreduce_advance(op.comm.shm, &op.shm, &a)
    elif a.coll == AL_SHM_ALLGATHERV:
        rc = al_shm_allgatherv_advance(op.comm.shm, &op.shm, &a)
    elif a.coll >= AL_SHM_ALLTOALL:
        rc = al_shm_alltoall_advance(op.comm.shm, &op.shm, &a)
    else:
        rc = al_shm_coll_advance(op.comm.shm, &op.shm, &a)
    if rc == 0 and (shm_broken(op) or shm_peer_died(op)):
        return op_finish(op)
    if rc == 0:
        return 0
    if rc == AL_SHM_MISMATCH:
        return shm_mismatch(op)
    if rc == AL_SHM_COUNTS_DIFFER:
        return shm_counts_differ(op)           # shm_vcollectives.pxi
    if rc == AL_SHM_COUNTS_EXPECTED or rc == AL_SHM_COUNTS_ELSEWHERE:
        return shm_counts_disagree(op, rc)
    if rc < 0:
        op.err = -1
        snprintf(op.errmsg, 256, "shm %s: op %d is not defined for dtype %d",
                 kind_info(op.kind).name + 4, op.rop, op.dtype)
    return op_finish(op)

cdef inline int shm_waits_anew(al_op* op) noexcept nogil:
    """After an op_step that returned 0: `op`, or the op it runs inside (a host-transfer op's
    host algorithm, a K_HIER_SHM op's current phase), runs over a segment and began a new wait
    for its peers in that step (it published: al_shm_publish reset the count of unsuccessful
    polls, and the step ended after the first).  The stepping loops count that as progress.
    Only a running op counts: a finished inner op keeps its last poll count, and a host-transfer
    op waiting for its copy back (or out) must let the loop back off."""
    cdef int depth
    for depth in range(2):              # at most host transfer -> hierarchical -> shm
        if op.kind == K_HOST_TRANSFER and op.ht.inner != NULL:
            if op.ht.phase != HT_HOST_ALGORITHM:
                return 0
            op = op.ht.inner
        elif op.kind == K_HIER_SHM and op.hier.cur < op.hier.nphases:
            if op.hier.phases[op.hier.cur].op == NULL:
                return 0
            op = op.hier.phases[op.hier.cur].op
    return op.phase == PH_RUNNING and is_shm_kind(op.kind) and op.shm.polls == 1

def _waits_anew(NativeOp o, long inner_polls=-1):
    """Whether the progress engine would count a poll of `o` that made no progress as progress
    (shm_waits_anew): a diagnostic for tests of the engine's back-off.  `inner_polls` >= 0
    first sets the poll count of the shm op inside a host-transfer op `o` (as if its last wait
    had taken that many polls: 1 is a wait that began in its last step)."""
    cdef al_op* op = o.op
    if inner_polls >= 0 and op.kind == K_HOST_TRANSFER and op.ht.inner != NULL:
        op.ht.inner.shm.polls = inner_polls
    return bool(shm_waits_anew(op))

cdef int shm_alone(al_op* op) noexcept nogil:
    """One rank (no segment): the result is the input (op_finish normalises logical ops)."""
    cdef int64_t n = op.count
    if op.kind == K_SHM_BCAST or op.kind == K_SHM_BARRIER:
        n = 0
    if op.sbuf != op.rbuf and n > 0:
        memcpy(op.rbuf, op.sbuf, <size_t>(n * op.esize))
    return op_finish(op)

cdef int shm_start(al_op* op) noexcept nogil:
    cdef al_shm_args a
    if op.comm.size == 1 and op.kind >= K_SHM_ALLGATHERV:
        return shm_v_alone(op)            # shm_vcollectives.pxi
    if op.comm.size == 1:                 # nothing to exchange (and no segment)
        return shm_alone(op)
    if op.kind == K_SHM_REDUCE_SCATTER:
        op.result.avg_in_steps = 1        # AVG divided in the last reduction pass
    if shm_broken(op):
        return op_finish(op)
    shm_args(op, &a)
    if a.coll == 0:
        al_shm_allreduce_begin(op.comm.shm, &op.shm, &a)
    elif a.coll >= AL_SHM_ALLGATHERV:
        al_shm_v_begin(op.comm.shm, &op.shm, &a)
    else:
        al_shm_coll_begin(op.comm.shm, &op.shm, &a)
    return shm_step(op)

cdef inline int uses_shm(al_op* op) noexcept nogil:
    """The op (or a host-transfer op's inner host algorithm) runs over the segment (the
    communicator's, or for K_HIER_SHM its node's: used by no other kind of op)."""
    if op.kind == K_HOST_TRANSFER:
        return op.ht.inner != NULL and (op.ht.inner.kind == K_SHM_ALLREDUCE
                                        or op.ht.inner.kind == K_HIER_SHM)
    return is_shm_kind(op.kind) or op.kind == K_HIER_SHM    # the latter: the node's segment

cdef inline int shm_gate(al_op* active, al_op* op, al_comm** blocked, int n) noexcept nogil:
    """`op` runs over the segment and must not start yet: the segment's rounds are consumed in
    call order, one op at a time per communicator (al_shm.h), so it waits while an op over the
    segment of its communicator is active, or while an earlier op of its communicator waits to
    start (`blocked`; it would overtake it)."""
    cdef al_op* a = active
    if not uses_shm(op):
        return 0
    if comm_blocked(blocked, n, op.comm):
        return 1
    while a != NULL:
        if a.comm == op.comm and uses_shm(a):
            return 1
        a = a.next
    return 0

cdef str shm_describe(al_op* op):
    """Where a running shm op waits (NativeOp.describe, the timeout message)."""
    cdef al_shm_op* s = &op.shm
    # (read while the engine may be running it: a snapshot)
    what = ("copying in", "waiting for the peers' inputs",
            "waiting for the peers' reduced blocks", "done")[s.phase]
    who = (f" (rank {s.waiting} has not published {s.want} yet)"
           if s.phase in (1, 2) and s.waiting < op.comm.size else "")
    how = (f"{'split' if s.split else 'symmetric'} protocol, " if op.kind == K_SHM_ALLREDUCE
           else "")
    if op.kind >= K_SHM_ALLGATHERV:        # rounds over blocks of per-rank sizes
        upto = f"{s.end}" if s.end >= 0 else "(round 0 tells)"
        return f"elements {s.off}..{s.off + s.chunk} of each block, up to {upto}: {what}{who}"
    return f"{how}elements {s.off}..{s.off + s.chunk} of {op.count}: {what}{who}"


# ---- the segment of a communicator ----

cdef int g_shm_created = 0          # segments this process created (their names' suffix)
DEF SHM_MSG = 256                   # bytes per rank in the setup's exchange

def shm_bytes(int size, size_t slot):
    """The length of a segment for `size` ranks with slots of `slot` bytes (a multiple of 4096);
    0 when that makes no segment (al_shm_bytes: bad arguments, or the length overflows)."""
    return al_shm_bytes(size, slot)

def shm_header_check(const unsigned char[:] header, int size, size_t slot, uint64_t nonce):
    """None when `header` (a segment's first bytes, the whole mapping's length) is the header of
    the segment of `size` ranks, `slot` and `nonce`; else the message saying what differs
    (al_shm_header_check, which every rank runs on the segment it mapped)."""
    cdef char err[SHM_MSG]
    if al_shm_header_check(<const char*>&header[0], header.shape[0], size, slot, nonce,
                           "the segment", err, SHM_MSG) == 0:
        return None
    return (<bytes>err).decode()

def _shm_finish(req, deadline, double timeout, what):
    """Poll an MPI request of the setup until it completes or the deadline passes."""
    import time
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            _hooks.setup_timeout(f"shm: setting up the shared-memory segment ({what})", timeout)
        time.sleep(0)

DEF SHM_MEMFD = 1                   # the setup's modes (al_shm.h): an anonymous memory file,
DEF SHM_NAMED = 2                   # or the named fallback in /dev/shm

def _shm_test_die(int rank, faults):
    """TESTING AID ONLY (tests/test_shm_segment.py): faults[0] (AL_SHM_TEST_DIE_IN_SETUP, read
    by aluminum_py.config.shm_test_faults) == rank makes that rank os._exit in the middle of
    the setup: rank 0 right after it created the segment, any other rank after it received
    what to open and before opening it."""
    if faults[0] == rank:
        import os
        os._exit(9)

def _shm_test_nonce(int rank, nonce, faults):
    """TESTING AID ONLY (tests/mpi/test_hostile.py): faults[1] (AL_SHM_TEST_BAD_NONCE) == rank
    makes that rank expect another nonce than rank 0 sent, as if it had opened a file that is
    not rank 0's segment."""
    return nonce ^ 1 if faults[1] == rank else nonce

def shm_attach(CommState cs, node_comm, size_t slot, size_t small, double timeout,
               bint named=False, tuple faults=(-1, -1), size_t chunk=0):
    """Create and map the communicator's segment (at construction: collective over
    `node_comm`, an MPI communicator of the same ranks in the same order, all on one node; no
    other traffic uses it).  Rank 0 creates an anonymous memory file (memfd_create), every rank
    opens it through /proc/<rank 0's pid>/fd/<fd> and maps it, and rank 0 closes its fd as soon
    as every rank has reported: nothing is ever named in /dev/shm, and the memory goes away
    with the last process that maps it, however it ends.  Where that cannot work (no
    memfd_create on rank 0, or a rank may not open rank 0's fd), or with `named` (rank 0's
    AL_SHM_NAMED), the whole communicator uses a named POSIX object instead, unlinked by rank 0
    once every rank has reported (al_shm.h).  Rank 0's `slot` (bytes per rank per buffer, a
    multiple of 4096) and `small` (the symmetric protocol's limit) are used by all, and so is
    its `chunk`: the bytes of a split allreduce's round below the size from which recvbuf is
    streamed (al_shm_chunk; 0 or more than the slot: the slot), with that size.  Raises
    aluminum_py.Error naming every rank's failure, or TimeoutError after `timeout` seconds
    (< 0: none).  `faults`: testing aids (``aluminum_py.config.shm_test_faults``)."""
    cdef int size = cs.c.size, rank = cs.c.rank
    cdef int mode = SHM_NAMED if named else SHM_MEMFD
    if cs.c.shm != NULL:
        return
    if node_comm.Get_size() != size or node_comm.Get_rank() != rank:
        _hooks.fail("shm: the node communicator does not match the communicator")
    if size > AL_SHM_MAX_RANKS:
        _hooks.fail(f"algorithm 'shm': at most {AL_SHM_MAX_RANKS} ranks, the communicator has "
                    f"{size}")
    import time
    deadline = time.monotonic() + timeout if timeout >= 0 else None
    if _shm_try(cs, node_comm, slot, small, timeout, deadline, mode, faults, chunk) == SHM_NAMED:
        _shm_try(cs, node_comm, slot, small, timeout, deadline, SHM_NAMED, faults, chunk)

cdef int _shm_try(CommState cs, node_comm, size_t slot, size_t small, double timeout, deadline,
                  int mode, tuple faults, size_t chunk) except -1:
    """One attempt of shm_attach in `mode` (rank 0's: it may fall back to SHM_NAMED by itself
    when memfd_create is missing).  Returns 0 with the segment attached, or SHM_NAMED on every
    rank (they all see the same reports) when the memory file failed only where the named path
    may work; raises for any other failure."""
    global g_shm_created
    import os
    import numpy as np
    cdef int size = cs.c.size, rank = cs.c.rank
    cdef int fd = -1, unsupported = 0, named_instead = 0
    cdef long pid = 0
    cdef size_t length = 0
    cdef uint64_t nonce = 0, pidns = 0
    cdef char err[SHM_MSG]
    cdef char* base = NULL
    cdef al_shm_seg* seg
    cdef bytes bname = b""
    cdef const char* cname
    err[0] = 0

    # rank 0 creates; how to open it (or rank 0's error) and its parameters go to every rank
    # (its rounds too: al_shm_chunk, every rank must make the same rounds)
    params = np.zeros(9, dtype=np.uint64)    # slot, small, created, mode, pid, fd, nonce,
                                             # chunk, chunk_upto
    name = np.zeros(SHM_MSG, dtype=np.uint8)
    rounded = (<object>slot + 4095) // 4096 * 4096       # (a Python int: never wraps)
    if rank == 0 and slot == 0:
        snprintf(err, SHM_MSG, "disabled (AL_SHM_SLOT_BYTES=0)")
    elif rank == 0 and (rounded >= 2 ** 64 or al_shm_bytes(size, rounded) == 0):
        snprintf(err, SHM_MSG, "slots of %zu bytes for %d ranks make no segment (its length "
                 "overflows)", slot, size)
    elif rank == 0:
        slot = rounded
        small = min(small, slot)
        g_shm_created += 1
        nonce = int.from_bytes(os.urandom(8), "little")
        bname = f"al_shm_{os.getpid()}_{g_shm_created}".encode()
        length = al_shm_bytes(size, slot)
        cname = bname
        if mode == SHM_MEMFD:
            with nogil:
                base = al_shm_create_memfd(cname, length, size, slot, nonce, &fd, &unsupported,
                                           err, SHM_MSG)
            if unsupported:
                mode = SHM_NAMED                   # no memfd_create here: the named path
                err[0] = 0
        if mode == SHM_NAMED:
            # a name nobody can guess (and so pre-create: O_EXCL would then fail), as the
            # mkstemp names of MPICH's and NCCL's segments
            bname = b"/" + bname + b"_" + os.urandom(8).hex().encode()
            cname = bname
            with nogil:
                base = al_shm_create(cname, length, size, slot, nonce, err, SHM_MSG)
        params[:] = (slot, small, base != NULL, mode, os.getpid(), max(fd, 0), nonce,
                     chunk if 0 < chunk < slot else slot, al_shm_stream_from(size))
        name[:len(bname)] = np.frombuffer(bname, np.uint8)
        _shm_test_die(rank, faults)
    try:
        what = "receiving where the segment is"
        _shm_finish(node_comm.Ibcast(params, root=0), deadline, timeout, what)
        _shm_finish(node_comm.Ibcast(name, root=0), deadline, timeout, what)
        slot, small, mode = int(params[0]), int(params[1]), int(params[3])
        pid, fd = int(params[4]), int(params[5])
        nonce = _shm_test_nonce(rank, int(params[6]), faults)
        length = al_shm_bytes(size, slot)
        bname = name.tobytes().rstrip(b"\0")
        cname = bname
        if rank != 0:
            _shm_test_die(rank, faults)
        if rank != 0 and params[2] and (length == 0 or small > slot):
            snprintf(err, SHM_MSG, "rank 0's slots of %zu bytes (%zu symmetric) make no segment",
                     slot, small)
        elif rank != 0 and params[2] and mode == SHM_MEMFD:
            with nogil:
                base = al_shm_open_memfd(pid, fd, length, size, slot, nonce, &named_instead,
                                         err, SHM_MSG)
        elif rank != 0 and params[2]:
            with nogil:
                base = al_shm_open(cname, length, size, slot, nonce, err, SHM_MSG)
        elif rank != 0:
            snprintf(err, SHM_MSG, "rank 0 could not create the segment")
        if base != NULL:                   # who this rank is, for its peers' waits
            al_shm_ident_write(base, rank, &pidns)
        # a report: the error (empty: mapped), then in the last byte whether the named path
        # may work where the memory file did not
        mine = np.zeros(SHM_MSG, dtype=np.uint8)
        msg = (<bytes>err)[:SHM_MSG - 2]
        mine[:len(msg)] = np.frombuffer(msg, np.uint8)
        mine[SHM_MSG - 1] = named_instead
        every = np.zeros(SHM_MSG * size, dtype=np.uint8).reshape(size, SHM_MSG)
        _shm_finish(node_comm.Iallgather(mine, every), deadline, timeout,
                    "every rank reporting that it mapped the segment")
    finally:
        if rank == 0 and params[2] and mode == SHM_MEMFD:
            close(fd)                              # mapped everywhere, or failed: never leaked
        elif rank == 0 and params[2]:
            shm_unlink(bname)                      # (a rank killed before this leaves the name)
    failed = [r for r in range(size) if every[r, 0]]
    if failed and base != NULL:
        munmap(base, length)
    if failed and mode == SHM_MEMFD and all(every[r, SHM_MSG - 1] for r in failed):
        return SHM_NAMED
    if failed:
        _hooks.fail("algorithm 'shm': could not set up the shared-memory segment: "
                    + "; ".join(f"rank {r}: {every[r, :SHM_MSG - 1].tobytes().rstrip(b'\0').decode()}"
                                for r in failed))
    seg = <al_shm_seg*>calloc(1, sizeof(al_shm_seg))
    if seg == NULL:
        munmap(base, length)
        raise MemoryError()
    al_shm_init(seg, base, length, rank, size, slot, small)
    seg.chunk = <size_t>params[7]
    seg.chunk_upto = <size_t>params[8]
    seg.pidns = pidns
    cs.c.shm = seg
    return 0

cdef void shm_release(al_comm* c) noexcept nogil:
    """Unmap the segment (no op may use it any more)."""
    if c != NULL and c.shm != NULL:
        munmap(c.shm.base, c.shm.len)
        free(c.shm)
        c.shm = NULL

def shm_detach(CommState cs):
    """Unmap the communicator's segment, if it has one (Free; nothing may be pending)."""
    shm_release(cs.c)


def shm_info(CommState cs):
    """The segment as this rank sees it (None without one: one rank, or none could be made): its
    length, slot and symmetric-protocol limit in bytes, the rounds and flag value so far, the
    rank that made it unusable (None while it is usable: shm_broken), the least allreduce that
    streams recvbuf ("stream_from"), the least bytes written into the slots that stream them
    ("stream_slots_from", by AL_SHM_SLOT_STORES: 0 always, None never) and the split
    allreduce's rounds ("chunk" bytes below "chunk_upto", else a slot)."""
    cdef al_shm_seg* s = cs.c.shm
    if s == NULL:
        return None
    who = al_shm_broken_by(s)
    slots_from = (AL_SHM_STREAM_SLOTS_FROM, None, 0)[al_shm_slot_stores]
    return {"bytes": s.len, "slot": s.slot, "small": s.small, "rounds": s.round, "seq": s.seq,
            "broken_by": who if who >= 0 else None, "stream_from": al_shm_stream_from(s.size),
            "stream_slots_from": slots_from, "chunk": s.chunk, "chunk_upto": s.chunk_upto}
