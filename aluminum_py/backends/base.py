"""The protocol every backend implements: the collectives and point-to-point operations on
buffers of its kind, ``choose`` (what ``algorithm=`` runs) and ``close``.

A Communicator picks the backend from the buffer (:class:`~aluminum_py.backends.host.HostBackend`
for host buffers, :class:`~aluminum_py.backends.gpu_backend.GpuBackend` for GPU buffers) and calls it
with the user's arguments as given: the backend checks all of them (ranks, roots, tags, buffers,
the algorithm) before any communication. A backend gets everything it uses through its
constructor (MPI communicators, rank and size, the native launcher, the device and stream) and
never sees the Communicator. Every operation takes ``blocking``: True runs it to completion
(host buffers) or enqueues it on the bound stream (GPU buffers) and returns None; False returns
a request. Every collective takes ``algorithm`` last: a name the backend does not run for it
raises ValueError naming it (TypeError for a non-str; UnavailableError where it cannot run).
"""
from __future__ import annotations

from typing import Any, Protocol


class Backend(Protocol):
    """What a Communicator calls for the buffers of one kind."""

    def choose(self, algorithm: str, nbytes: int, itemsize: int) -> str:
        """The algorithm `algorithm` runs for a message of `nbytes` bytes of `itemsize`-byte
        elements: itself if this backend runs it, auto's choice for "auto"; raises ValueError
        (or UnavailableError) for a name this backend does not run."""

    def allreduce(self, sendbuf, recvbuf, op, algorithm: str, blocking: bool,
                  min_ctas: int | None = None, max_ctas: int | None = None) -> Any: ...

    # ---- prefix reductions: MPI_Scan / MPI_Exscan; recvbuf None: in place. A backend
    # that cannot run them (GPU buffers: NCCL has none) raises UnavailableError saying what to
    # do instead, on every rank, before anything runs.

    def scan(self, sendbuf, recvbuf, op, blocking: bool, algorithm: str = "auto") -> Any: ...

    def exscan(self, sendbuf, recvbuf, op, blocking: bool, algorithm: str = "auto") -> Any: ...

    def reduce(self, sendbuf, recvbuf, op, root: int, blocking: bool,
               algorithm: str = "mpi") -> Any: ...

    def reduce_scatter(self, sendbuf, recvbuf, op, blocking: bool,
                       algorithm: str = "mpi") -> Any: ...

    def allgather(self, sendbuf, recvbuf, blocking: bool, algorithm: str = "mpi") -> Any: ...

    def bcast(self, buf, root: int, blocking: bool, algorithm: str = "mpi") -> Any: ...

    def alltoall(self, sendbuf, recvbuf, blocking: bool, algorithm: str = "mpi") -> Any: ...

    def gather(self, sendbuf, recvbuf, root: int, blocking: bool,
               algorithm: str = "mpi") -> Any: ...

    def scatter(self, sendbuf, recvbuf, root: int, blocking: bool,
                algorithm: str = "mpi") -> Any: ...

    def barrier(self, blocking: bool, algorithm: str = "mpi") -> Any:
        """The Communicator's Barrier (it calls the host backend's: a barrier has no buffer)."""

    def send(self, buf, dest: int, tag: int, blocking: bool) -> Any: ...

    def recv(self, buf, source: int, tag: int, blocking: bool) -> Any: ...

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int,
                 blocking: bool) -> Any: ...

    # ---- v-collectives: buffers are the caller's objects (None: in place), counts
    # and displacements the user's values (elements; displs None: packed in rank order), which
    # the backend checks with buffers.vlayout against its buffers' lengths.  `algorithm`: "auto"
    # or a name the backend runs; ValueError (or UnavailableError) for any other.

    def allgatherv(self, sendbuf, recvbuf, counts, displs, blocking: bool,
                   algorithm: str = "auto") -> Any: ...

    def gatherv(self, sendbuf, recvbuf, counts, displs, root: int, blocking: bool,
                algorithm: str = "auto") -> Any: ...

    def scatterv(self, sendbuf, recvbuf, counts, displs, root: int, blocking: bool,
                 algorithm: str = "auto") -> Any: ...

    def alltoallv(self, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, blocking: bool,
                  algorithm: str = "auto") -> Any: ...

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, blocking: bool,
                        algorithm: str = "auto") -> Any: ...

    # ---- point to point: a blocking recv / sendrecv returns the receive's
    # aluminum_py.Status (GPU buffers: None), sendrecv takes recvtag= / sendtag=; the host
    # backend also has probe(source, tag, blocking, timeout, name)

    def close(self) -> BaseException | None:
        """At Communicator.Free, once no op is pending: release what the backend holds. Returns
        a failure to raise once everything is released (or None)."""
