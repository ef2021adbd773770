# Python names of the C constants.

ERR_TIMEOUT = AL_ERR_TIMEOUT

KIND_NAMES = ("schedule", "allreduce", "reduce", "reduce_scatter", "allgather", "bcast",
              "alltoall", "gather", "scatter", "barrier", "send", "recv", "sendrecv",
              "host_transfer")
KINDS = {name: i for i, name in enumerate(KIND_NAMES)}
RECV_MODES = {"none": RECV_NONE, "into": RECV_INTO, "tmp_reduce": RECV_TMP_REDUCE,
              "into_reduce": RECV_INTO_REDUCE}
