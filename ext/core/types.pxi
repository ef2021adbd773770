# The native types: op kinds and their property table, phases, schedule steps, communicator and
# op state.  Python sees the enum values through core/constants.pxi (never a copy).

# The enums are anonymous, their type named in a comment: Cython refuses a named enum's values
# as array indices (KIND_INFO[kind], ht.times[phase], ht.flag[word]).

# op kinds: what a NativeOp runs (communicator.py picks them by name from KINDS)
cdef enum:                  # al_kind
    K_SCHEDULE = 0          # one of our allreduce algorithms, run as a schedule (schedule.pxi)
    K_ALLREDUCE = 1         # up to K_SENDRECV: the MPI library's own call (passthrough.pxi)
    K_REDUCE = 2
    K_REDUCE_SCATTER = 3
    K_ALLGATHER = 4
    K_BCAST = 5
    K_ALLTOALL = 6
    K_GATHER = 7
    K_SCATTER = 8
    K_BARRIER = 9
    K_SEND = 10
    K_RECV = 11
    K_SENDRECV = 12
    K_HOST_TRANSFER = 13    # device copies around an inner host allreduce (ht_op.pxi)
    K_SHM_ALLREDUCE = 14    # allreduce over the communicator's shared-memory segment (shm.pxi)
    K_SHM_ALLGATHER = 15    # up to K_SHM_BARRIER: the other collectives over the segment
    K_SHM_BCAST = 16
    K_SHM_REDUCE_SCATTER = 17
    K_SHM_BARRIER = 18
    K_HIER_SHM = 19         # hierarchical over the node's segment: inner ops in turn (hier_shm.pxi)
    K_ALLGATHERV = 20       # up to K_EXSCAN: more of the MPI library's own calls (passthrough.pxi);
    K_GATHERV = 21          # the v-forms read their counts and displacements from al_op.v
    K_SCATTERV = 22
    K_ALLTOALLV = 23
    K_REDUCE_SCATTERV = 24  # MPI_Ireduce_scatter: per-rank receive counts (v.rcounts)
    K_SCAN = 25
    K_EXSCAN = 26
    K_SHM_ALLGATHERV = 27   # v-collectives over the shared-memory segment (shm.pxi)
    K_SHM_ALLTOALL = 28
    K_SHM_ALLTOALLV = 29
    K_NKINDS = 30

# What the engine needs to know about a kind, in one table (KIND_INFO, filled below) instead of
# tests on the enum's order.
ctypedef struct al_kind_info:
    const char* name        # KIND_NAMES / KINDS on the Python side
    int mpi_collective      # its start issues an MPI collective on the collective communicator:
                            # such ops start in call order on every rank (engine_main, ht_gate)
    int allreduce_bytes     # it moves count * esize bytes per rank as an all-reduce (serial_gate)
    int point_to_point      # traffic on the user's point-to-point communicator (tag and peers
                            # are the user's)
    int recv_first          # an MPI pass-through op whose reqs[0] is a receive (op_cancel)

cdef al_kind_info KIND_INFO[K_NKINDS + 1]    # row K_NKINDS: all zero, for an unknown kind
memset(KIND_INFO, 0, sizeof(KIND_INFO))

cdef inline const al_kind_info* kind_info(int kind) noexcept nogil:
    """The kind's row of KIND_INFO (the all-zero row for an unknown kind, which mpi_start fails)."""
    return &KIND_INFO[kind if 0 <= kind < K_NKINDS else K_NKINDS]

cdef inline int is_shm_kind(int kind) noexcept nogil:
    """The op runs over the communicator's shared-memory segment (shm.pxi)."""
    return K_SHM_ALLREDUCE <= kind <= K_SHM_BARRIER or K_SHM_ALLGATHERV <= kind <= K_SHM_ALLTOALLV

cdef void set_kind_info(int kind, const char* name, int mpi_collective, int allreduce_bytes,
                        int point_to_point, int recv_first) noexcept:
    KIND_INFO[kind].name = name
    KIND_INFO[kind].mpi_collective = mpi_collective
    KIND_INFO[kind].allreduce_bytes = allreduce_bytes
    KIND_INFO[kind].point_to_point = point_to_point
    KIND_INFO[kind].recv_first = recv_first

#             kind               name              coll  bytes  p2p  recv_first
set_kind_info(K_SCHEDULE,        "schedule",       0,    1,     0,   0)
set_kind_info(K_ALLREDUCE,       "allreduce",      1,    1,     0,   0)
set_kind_info(K_REDUCE,          "reduce",         1,    0,     0,   0)
set_kind_info(K_REDUCE_SCATTER,  "reduce_scatter", 1,    0,     0,   0)
set_kind_info(K_ALLGATHER,       "allgather",      1,    0,     0,   0)
set_kind_info(K_BCAST,           "bcast",          1,    0,     0,   0)
set_kind_info(K_ALLTOALL,        "alltoall",       1,    0,     0,   0)
set_kind_info(K_GATHER,          "gather",         1,    0,     0,   0)
set_kind_info(K_SCATTER,         "scatter",        1,    0,     0,   0)
set_kind_info(K_BARRIER,         "barrier",        1,    0,     0,   0)
set_kind_info(K_SEND,            "send",           0,    0,     1,   0)
set_kind_info(K_RECV,            "recv",           0,    0,     1,   1)
set_kind_info(K_SENDRECV,        "sendrecv",       0,    0,     1,   1)
# host transfer: its inner op is what issues MPI calls (starts_mpi_collective looks there)
set_kind_info(K_HOST_TRANSFER,   "host_transfer",  0,    0,     0,   0)
# no MPI call: its ordering is the segment's (shm_gate)
set_kind_info(K_SHM_ALLREDUCE,   "shm_allreduce",  0,    1,     0,   0)
set_kind_info(K_SHM_ALLGATHER,   "shm_allgather",  0,    0,     0,   0)
set_kind_info(K_SHM_BCAST,       "shm_bcast",      0,    0,     0,   0)
set_kind_info(K_SHM_REDUCE_SCATTER, "shm_reduce_scatter", 0, 0,  0,   0)
set_kind_info(K_SHM_BARRIER,     "shm_barrier",    0,    0,     0,   0)
# its inner ops: shm ops over the node's segment (ordered by shm_gate, like the others), and
# schedules between nodes (tagged point-to-point, no MPI collective)
set_kind_info(K_HIER_SHM,        "hier_shm",       0,    1,     0,   0)
set_kind_info(K_ALLGATHERV,      "allgatherv",     1,    0,     0,   0)
set_kind_info(K_GATHERV,         "gatherv",        1,    0,     0,   0)
set_kind_info(K_SCATTERV,        "scatterv",       1,    0,     0,   0)
set_kind_info(K_ALLTOALLV,       "alltoallv",      1,    0,     0,   0)
set_kind_info(K_REDUCE_SCATTERV, "reduce_scatterv", 1,   0,     0,   0)
set_kind_info(K_SCAN,            "scan",           1,    0,     0,   0)
set_kind_info(K_EXSCAN,          "exscan",         1,    0,     0,   0)
set_kind_info(K_SHM_ALLGATHERV,  "shm_allgatherv", 0,    0,     0,   0)
set_kind_info(K_SHM_ALLTOALL,    "shm_alltoall",   0,    0,     0,   0)
set_kind_info(K_SHM_ALLTOALLV,   "shm_alltoallv",  0,    0,     0,   0)

# op phases (al_op.phase)
cdef enum:                  # al_phase
    PH_NEW = 0
    PH_RUNNING = 1
    PH_DONE = 2

# host-transfer phases (al_op.ht.phase); al_op.ht.times[phase] is when each ended
cdef enum:                  # al_ht_phase
    HT_COPY_OUT = 0         # waiting for the stream's device -> pinned copy
    HT_HOST_ALGORITHM = 1   # the inner host algorithm runs on the pinned buffer
    HT_RELEASE = 2          # writing the flag the stream waits on before it copies back
    HT_COPY_BACK = 3        # waiting for the stream's pinned -> device copy
    HT_NPHASES = 4

# the words after a host-transfer op's pinned buffer (al_op.ht.flag[...])
cdef enum:                  # al_ht_flag
    FLAG_RELEASE = 0        # written by the engine: the stream waits until it is >= 1
    FLAG_COPIED_OUT = 1     # written (1) by the stream once the copy to pinned memory completed
    FLAG_COPIED_BACK = 2    # written (1) by the stream once the copy back completed

# schedule step receive modes and buffer selectors (schedules.py reads them from RECV_MODES and
# STEP_SOURCES)
cdef enum:                  # al_recv_mode
    RECV_NONE = 0
    RECV_INTO = 1          # receive into recvbuf[off]
    RECV_TMP_REDUCE = 2    # receive into scratch; recvbuf[off] = SRC[off] op scratch
    RECV_INTO_REDUCE = 3   # receive into recvbuf[off]; recvbuf[off] = sendbuf[off] op recvbuf[off]

cdef enum:                  # al_step_source
    FROM_SEND = 0
    FROM_RECV = 1

# op.err of an op abandoned by the engine at its hang-timeout deadline (Python: TimeoutError)
cdef enum:
    AL_ERR_TIMEOUT = -2

ctypedef struct al_step:
    int send_peer        # -1: no send
    int send_src         # FROM_SEND / FROM_RECV
    int64_t send_off     # elements
    int64_t send_cnt
    int recv_peer        # -1: no receive
    int recv_mode
    int reduce_src       # RECV_TMP_REDUCE: FROM_SEND / FROM_RECV
    int64_t recv_off
    int64_t recv_cnt
    int64_t copy_off     # local copy sendbuf -> recvbuf before communicating
    int64_t copy_cnt
    int owned            # 1: the received region is now this rank's final block (AVG divides it)

ctypedef struct al_comm:
    MPI_Comm coll        # internal traffic: collectives and our algorithms
    MPI_Comm p2p         # the user's Send/Recv
    int rank
    int size
    int pending          # ops handed to the engine and not yet complete (atomic)
    al_shm_seg* shm      # the shared-memory segment (shm.pxi), made with the communicator or NULL
    int abandoned        # an op on it was abandoned at its hang timeout (ht_abandon): its
                         # peers' messages may still arrive, so Free keeps its MPI communicators
    int broken           # 1 once the communicator is unusable for good (comm_mark; atomic)
    int claim            # the first comm_mark takes it (atomic), then writes `why`
    char why[256]        # why it is broken (read once `broken` is acquired)

cdef struct al_op

# ---- K_HIER_SHM (hier_shm.pxi): "hierarchical" over each node's shared-memory segment ----
# An op of this kind runs a list of phases in turn: inner ops (shm collectives over the node's
# segment, a schedule between nodes) and local actions between them (a copy out of the op's
# scratch, AVG's division).
DEF HIER_MAX_PHASES = 8

ctypedef struct al_hier_phase:
    al_op* op            # an inner op (owned by a NativeOp the outer one keeps), or NULL:
    char* dst            # a local action: copy cnt elements src -> dst, or (src NULL) divide
    char* src            #   dst[:cnt] by the op's result.avg_div (AVG)
    int64_t cnt
    int tmp              # 1: this phase's inner op writes (rbuf), or its copy reads (src), the
                         #   op's scratch (op.sched.tmp, taken when the op starts)

ctypedef struct al_hier_state:
    al_hier_phase phases[HIER_MAX_PHASES]
    int nphases
    int cur              # the phase in progress
    int started          # its inner op has been started
# ---- end of K_HIER_SHM ----

# The state of one op is the common part (al_op) plus one group per kind of machine: each group
# is read and written only by the code that serves it.

ctypedef struct al_sched_state:  # K_SCHEDULE: progress through the step array (schedule.pxi)
    al_step* steps       # owned by the Schedule object the op keeps alive
    int nsteps
    int cur              # the step in progress
    int posted           # its receive and send are posted
    char* tmp            # scratch for RECV_TMP_REDUCE, placed in tmp_base (sched_scratch)
    char* tmp_base       # what scratch_get gave (returned by op_finish)
    size_t tmpbytes
    int land_tmp         # 1: RECV_INTO_REDUCE steps land in tmp too (sched_scratch)

ctypedef struct al_mpi_args:     # MPI pass-through kinds: the call's arguments (passthrough.pxi)
    MPI_Op mop
    int root             # root, or peer for send/recv, or dest for sendrecv
    int peer2            # source for sendrecv
    int64_t count2       # elements sendrecv receives
    int tag2             # the tag sendrecv receives with (op.tag: the one it sends with)

ctypedef struct al_vargs:       # v-collectives (K_*V, K_SHM_ALLGATHERV/ALLTOALLV): per-rank
    int* scounts         # elements, as MPI takes them (int); arrays of `size` entries owned by
    int* sdispls         # the NativeOp's keep (int32 numpy arrays), NULL where the call has
    int* rcounts         # none (e.g. a non-root's receive side of Gatherv)
    int* rdispls

ctypedef struct al_result:       # reductions: this rank's result region (op_finish)
    double avg_div       # > 0: divide buf[:count] by it at the end (AVG), or each
                         # owned block after its step when avg_in_steps
    char* buf
    int64_t count
    int avg_in_steps     # the schedule divides its owned blocks (Step.owned), not op_finish
    int logical01        # make logical results 0/1 with peers too: a scan's first rank(s),
                         # where MPI copies the input and no reduction runs

ctypedef struct al_ht_state:     # K_HOST_TRANSFER (ht_op.pxi)
    al_device* dev
    void* stream
    char* pinned         # host staging buffer (count * esize bytes) + three words, from the
                         # device's pinned pool (al_pinned_get/put):
    uint32_t* flag       # the three words (al_ht_flag). The engine polls them with plain
                         # loads: it makes no driver call, so a thread blocked in the driver
                         # (a pageable copy on the waiting stream) can never block it
    al_op* inner         # the host algorithm, in place on `pinned`
    int phase            # al_ht_phase
    double times[HT_NPHASES]   # when each phase ended (al_now), for ordering checks
    double hang          # > 0: AL_HANG_TIMEOUT (s) for the host part, from the call
    double deadline      # when the host part is abandoned (hang > 0)

cdef struct al_op:
    int kind
    int phase
    int counted          # counted in comm.pending
    al_comm* comm
    int tag
    char* sbuf           # NULL: in place (MPI_IN_PLACE)
    char* rbuf
    int64_t count        # elements (see the per-kind comment in op_start)
    int esize
    int dtype
    int rop
    MPI_Datatype mtype
    MPI_Request reqs[2]
    mpi.MPI_Status stats[2]
    int nreqs
    int done             # atomic completion flag
    double t_start       # al_now() when the op started (engine or caller) and completed;
    double t_done        # written before `done` is released, read after it is acquired
    int err              # 0, an MPI error code, or -1 (library error)
    char errmsg[256]
    al_op* next
    al_sched_state sched
    al_mpi_args mpi
    al_vargs v           # K_*V: counts and displacements
    al_result result
    al_ht_state ht
    al_shm_op shm        # K_SHM_*: where the protocol stands (al_shm.h)
    al_hier_state hier   # K_HIER_SHM: its phases (hier_shm.pxi; its scratch is sched.tmp)
