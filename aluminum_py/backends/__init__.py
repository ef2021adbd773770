"""The backends a Communicator delegates to, one per kind of buffer and transport: the protocol
they implement (:mod:`.base`), the host path over MPI and the native engine (:mod:`.host`, with
the per-node segments of "hierarchical" in :mod:`.hier_shm`), the GPU path
(:mod:`.gpu_backend`) with NCCL's rules (:mod:`.nccl_rules`) and the host-transfer allreduce's
enqueue (:mod:`.ht_enqueue`)."""
