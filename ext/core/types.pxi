# The native types: op kinds, phases, schedule steps, communicator and op state.
# Constants shared with Python (KINDS and RECV_MODES in constants.pxi; schedules.py mirrors the modes)

# op kinds
cdef enum:
    K_SCHEDULE = 0
    K_ALLREDUCE = 1
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
    K_HOST_TRANSFER = 13
    K_NKINDS = 14

# phases
cdef enum:
    PH_NEW = 0
    PH_RUNNING = 1
    PH_DONE = 2

# schedule step receive modes and buffer selectors
cdef enum:
    RECV_NONE = 0
    RECV_INTO = 1          # receive into recvbuf[off]
    RECV_TMP_REDUCE = 2    # receive into scratch; recvbuf[off] = SRC[off] op scratch
    RECV_INTO_REDUCE = 3   # receive into recvbuf[off]; recvbuf[off] = sendbuf[off] op recvbuf[off]
    FROM_SEND = 0
    FROM_RECV = 1

# op.err of an op abandoned by the engine at its hang-timeout deadline (Python: TimeoutError)
DEF AL_ERR_TIMEOUT = -2

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

ctypedef struct al_op:
    int kind
    int phase
    int blocking         # MPI pass-through: use the blocking MPI call (see Launcher.launch)
    int counted          # counted in comm.pending
    al_comm* comm
    int tag
    char* sbuf           # NULL: in place (MPI_IN_PLACE)
    char* rbuf
    char* tmp
    size_t tmpbytes
    int64_t count        # elements (see the per-kind comment in op_start)
    int64_t count2
    int esize
    int dtype
    int rop
    MPI_Datatype mtype
    MPI_Op mop
    int root             # root, or peer for send/recv, or dest for sendrecv
    int peer2            # source for sendrecv
    al_step* steps
    int nsteps
    int cur
    int posted
    MPI_Request reqs[2]
    mpi.MPI_Status stats[2]
    int nreqs
    double avg_div       # > 0: divide avg_buf[:avg_cnt] by it at the end (AVG), or each
                         # owned block after its step when avg_in_steps
                         # avg_buf[:avg_cnt] is this rank's result region (reductions only)
    char* avg_buf
    int64_t avg_cnt
    int avg_in_steps     # the schedule divides its owned blocks (Step.owned), not op_finish
    int done             # atomic completion flag
    double t_start       # al_now() when the op started (engine or caller) and completed;
    double t_done        # written before `done` is released, read after it is acquired
    int err              # 0, an MPI error code, or -1 (library error)
    char errmsg[256]
    al_op* next
    # host transfer (K_HOST_TRANSFER): device copies around an inner host allreduce
    al_device* dev
    void* stream
    char* pinned         # host staging buffer (count * esize bytes) + three words, from the
                         # device's pinned pool (al_pinned_get/put):
    uint32_t* flag       # flag[0]: the stream waits until it is >= 1 before copying back;
                         # flag[1], flag[2]: the stream writes 1 once the copy to pinned memory
                         # (then the copy back) has completed. The engine polls them with plain
                         # loads: it makes no driver call, so a thread blocked in the driver
                         # (a pageable copy on the waiting stream) can never block it
    al_op* inner         # the host algorithm, in place on `pinned`
    int ht_phase         # 0 wait D2H, 1 host algorithm, 2 release stream, 3 wait H2D
    double ht_times[4]   # when each phase ended (al_now), for ordering checks
    double hang          # > 0: AL_HANG_TIMEOUT (s) for the host part, from the call
    double deadline      # when the host part is abandoned (hang > 0)
