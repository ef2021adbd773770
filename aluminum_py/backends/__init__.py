"""The backends a Communicator delegates to, one per kind of buffer and transport: the protocol
they implement (:mod:`.base`), the host path over MPI and the native engine (:mod:`.host`), the
GPU path (:mod:`.gpu`) with NCCL (:mod:`.nccl`) and the host-transfer allreduce
(:mod:`.host_transfer`)."""
