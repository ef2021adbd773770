"""The allreduce algorithm registry, and the cost model that ``algorithm="auto"`` follows
(:mod:`aluminum_py.tuning`: the rule, and the tuning table that may override it).

:data:`REGISTRY` is the one list of algorithm names: for each, the devices whose buffers take it,
the backend that runs it, the host algorithm a host-transfer (``ht_*``) name runs, whether
``"auto"`` may choose it and whether the cost model has a formula for it. Every other list of
names (``al.algorithms()``, error messages, the backends, the crossover benchmark's defaults) is
derived from it.

Costs for p ranks and n bytes (paper section III-B, plus a reduction term gamma per byte
reduced; non-powers of two add the fold: one extra exchange of n bytes in and out):

* ring:               2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
* recursive doubling: log2(p') (a + n b + n g)                       (+ fold)
* rabenseifner:       2 log2(p') a + 2(p'-1)/p' n b + (p'-1)/p' n g  (+ fold)

with p' = 2^floor(log2 p).  The parameters come from AL_ALPHA / AL_BETA / AL_GAMMA.

"shm" (one node, over the communicator's segment: ext/al_shm.h) has its own formula, with a
synchronisation latency s (a publish and the wait for every peer's flag) and m, seconds per
byte of one rank's memory traffic (reads and writes), from AL_SHM_SYNC / AL_SHM_BYTE:

* symmetric (n <= small): s + (p + 3) n m          (copy in: n read + n written; reduce the
                                                     p slots into recvbuf: p n read + n written)
* split (n > small):      2 ceil(n / slot) s + (5 - 2/p) n m    (two synchronisations per round
                                                     of a slot; the traffic of al_shm.h's split)
"""
from __future__ import annotations

import math
from typing import NamedTuple

from . import config


class Algorithm(NamedTuple):
    """One allreduce algorithm name."""

    name: str
    devices: tuple[str, ...]    # buffers that take it: "host", "cuda"
    backend: str                # what runs it: "host", "nccl", "host_transfer" ("auto": chosen)
    host: str | None = None     # ht_*: the host algorithm it runs on the pinned buffer
    candidate: bool = False     # "auto" may choose it (the tuning table times it)
    modelled: bool = False      # the alpha-beta-gamma cost model has a formula for it
    listed: bool = True         # a name users pass; False: internal (what "auto" reports)
    one_node: bool = False      # only for communicators whose ranks all share a node


REGISTRY: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("auto", ("host", "cuda"), "auto"),
    Algorithm("mpi", ("host",), "host", candidate=True),
    Algorithm("recursive_doubling", ("host",), "host", candidate=True, modelled=True),
    Algorithm("rabenseifner", ("host",), "host", candidate=True, modelled=True),
    Algorithm("ring", ("host",), "host", candidate=True, modelled=True),
    # reduce inside each node, allreduce among node leaders, broadcast inside each node
    # (inside the nodes over each node's shared-memory segment where they can be made)
    Algorithm("hierarchical", ("host",), "host", candidate=True),
    # over a shared-memory segment of the node (docs/algorithms.md, "Shared memory")
    # (modelled by its own formula, shm_time: not one of MODELLED)
    Algorithm("shm", ("host",), "host", candidate=True, one_node=True),
    # "hierarchical" with point-to-point messages inside the nodes too (its form where the
    # nodes have no segments; a name to compare the two)
    Algorithm("hierarchical_p2p", ("host",), "host"),
    Algorithm("nccl", ("cuda",), "nccl", candidate=True),
    # host transfer with the host "auto" inside: what GPU "auto" falls back to without NCCL
    # (reported as a request's algorithm) and what aluminum_py.host_transfer.allreduce takes;
    # not a name the Communicator accepts, so not listed by al.algorithms()
    Algorithm("ht_auto", ("cuda",), "host_transfer", host="auto", listed=False),
    Algorithm("ht_mpi", ("cuda",), "host_transfer", host="mpi", candidate=True),
    Algorithm("ht_recursive_doubling", ("cuda",), "host_transfer", host="recursive_doubling",
              candidate=True),
    Algorithm("ht_rabenseifner", ("cuda",), "host_transfer", host="rabenseifner", candidate=True),
    Algorithm("ht_ring", ("cuda",), "host_transfer", host="ring", candidate=True),
)}


def _names(device: str, **want) -> tuple[str, ...]:
    return tuple(a.name for a in REGISTRY.values()
                 if device in a.devices and all(getattr(a, k) == v for k, v in want.items()))


HOST_ALLREDUCE = _names("host", listed=True)             # auto, mpi, recursive_doubling, ...
GPU_ALLREDUCE = _names("cuda", listed=True)              # auto, nccl, ht_mpi, ...
HOST_CANDIDATES = _names("host", candidate=True)         # what host "auto" chooses from
GPU_CANDIDATES = _names("cuda", candidate=True)          # what GPU "auto" chooses from
HOST_TRANSFER = _names("cuda", backend="host_transfer")  # ht_auto, ht_mpi, ..., ht_ring
MODELLED = _names("host", modelled=True)                 # recursive_doubling, rabenseifner, ring
ONE_NODE = _names("host", one_node=True)                 # shm

# The other collectives that take ``algorithm=`` (their blocking and nonblocking forms): the MPI
# library's own call (the default) or the shared-memory transport (host buffers of one node).
COLLECTIVE_ALGORITHMS = ("mpi", "shm")
OTHER_COLLECTIVES = ("allgather", "bcast", "reduce_scatter", "barrier", "alltoall")

# Every collective's ``algorithm=`` names, (host buffers, GPU buffers). "auto" of the collectives
# other than allreduce: "shm" where the communicator has a segment and shm_preferred says so,
# else "mpi" (host); NCCL (GPU). "mpi" and "nccl" on GPU buffers both run NCCL.
COLLECTIVE_NAMES = {
    **{op: (COLLECTIVE_ALGORITHMS, ("mpi",)) for op in ("allgather", "bcast", "reduce_scatter",
                                                         "barrier")},
    "alltoall": (("auto",) + COLLECTIVE_ALGORITHMS, ("auto", "mpi")),
    **{op: (("auto",) + COLLECTIVE_ALGORITHMS, ("auto", "nccl", "mpi"))
       for op in ("allgatherv", "alltoallv")},
    **{op: (("auto", "mpi"), ("auto", "nccl", "mpi"))
       for op in ("gatherv", "scatterv", "reduce_scatterv")},
    **{op: (("auto", "mpi"), ()) for op in ("scan", "exscan")},        # NCCL has no scan
}


def algorithms(op: str = "allreduce", device: str | None = None) -> tuple[str, ...]:
    """Names usable as ``algorithm=`` for `op` ("allreduce", or a key of COLLECTIVE_NAMES:
    "allgather", "alltoall", "allgatherv", "scan", ...; "reduce_scatterv" is Reduce_scatter
    with recvcounts): for host buffers, GPU buffers, or (None) both."""
    if device not in ("host", "cuda", "gpu", None):
        raise ValueError(f"device: expected 'host', 'cuda' or None, got {device!r}")
    if op in COLLECTIVE_NAMES:
        host, gpu = COLLECTIVE_NAMES[op]
    elif op == "allreduce":
        host, gpu = HOST_ALLREDUCE, GPU_ALLREDUCE
    else:
        raise ValueError(f"op: 'allreduce', {', '.join(map(repr, COLLECTIVE_NAMES))} take an "
                         f"algorithm argument, got {op!r}")
    if device == "host":
        return host
    if device in ("cuda", "gpu"):
        return gpu
    return host + tuple(a for a in gpu if a not in host)


def host_algorithm(algorithm: str) -> str:
    """The host algorithm a host-transfer name runs: 'ht_ring' -> 'ring' (and 'auto' -> 'auto',
    the host "auto" inside)."""
    if algorithm == "auto":
        return "auto"
    a = REGISTRY.get(algorithm)
    if a is None or a.backend != "host_transfer":
        raise ValueError(f"algorithm: {algorithm!r} is not a host-transfer algorithm; choose "
                         f"from {', '.join(HOST_TRANSFER)}")
    return a.host


def model_time(algorithm: str, p: int, nbytes: int, params=None) -> float:
    """Predicted seconds for one allreduce of `nbytes` on `p` ranks."""
    a, b, g = params or config.model_params()
    if p <= 1:
        return 0.0
    n = float(nbytes)
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    p2 = 1 << (p.bit_length() - 1)
    lg = math.log2(p2)
    fold = 0.0 if p2 == p else 2 * (a + n * b) + n * g
    if algorithm == "recursive_doubling":
        return lg * (a + n * b + n * g) + fold
    if algorithm == "rabenseifner":
        return 2 * lg * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + fold
    raise ValueError(f"algorithm: no cost model for {algorithm!r}")


class ShmCost(NamedTuple):
    """What the "shm" formula needs: the machine's synchronisation latency and per-byte memory
    time (AL_SHM_SYNC, AL_SHM_BYTE) and the segment's
    protocol limits (the communicator's, as rank 0's AL_SHM_SMALL_BYTES / AL_SHM_SLOT_BYTES
    made them)."""

    sync: float                 # s per synchronisation (publish, wait for every peer's flag)
    byte: float                 # s per byte of one rank's memory traffic
    small: int                  # symmetric protocol up to this many bytes
    slot: int                   # bytes per rank and round of the split protocol
    chunk: int = 0              # ... below chunk_upto bytes, bytes per round (0: the slot)
    chunk_upto: int = 0


def shm_terms(p: int, nbytes: int, small: int, slot: int, chunk: int = 0,
              chunk_upto: int = 0) -> tuple[float, float]:
    """(synchronisations, bytes of memory traffic per rank) of one "shm" allreduce of `nbytes`
    on `p` ranks of one node (ext/al_shm.h's protocols, al_shm_chunk's rounds: `chunk` bytes
    each under `chunk_upto` bytes, else a slot; 0 for p = 1 or nothing to reduce).  The
    traffic term does not see that rounds in L2 are cheaper (docs/performance.md)."""
    if p <= 1 or nbytes <= 0:
        return 0.0, 0.0
    n = float(nbytes)
    if nbytes <= small:
        return 1.0, (p + 3) * n
    per_round = chunk if 0 < chunk < slot and nbytes < chunk_upto else slot
    return 2.0 * math.ceil(nbytes / per_round), (5 - 2 / p) * n


def shm_time(p: int, nbytes: int, shm: ShmCost) -> float:
    """Predicted seconds of one "shm" allreduce (the formula in this module's docstring)."""
    syncs, traffic = shm_terms(p, nbytes, shm.small, shm.slot, shm.chunk, shm.chunk_upto)
    return syncs * shm.sync + traffic * shm.byte


def model_times(p: int, nbytes: int, params=None, shm: ShmCost | None = None) -> dict:
    """Every modelled algorithm's predicted seconds, in the tie order (MODELLED, then "shm"
    when `shm` is given: the communicator has a segment)."""
    times = {alg: model_time(alg, p, nbytes, params) for alg in MODELLED}
    if shm is not None:
        times["shm"] = shm_time(p, nbytes, shm)
    return times


def model_choice(p: int, nbytes: int, params=None, shm: ShmCost | None = None) -> str:
    """The modelled algorithm with the lowest predicted time (ties: the first in MODELLED;
    "shm" only with `shm`, and last)."""
    times = model_times(p, nbytes, params, shm)
    return min(times, key=times.get)


# ---- "auto" of Allgatherv, Alltoall and Alltoallv: the shared-memory transport where it measured
# faster than the MPI library's call (bench/vcollectives.py; docs/performance.md, "Allgatherv and
# Alltoallv over the segment").

SHM_VCOLLECTIVES = ("allgatherv", "alltoall", "alltoallv")
# bytes sent per rank up to which "auto" runs "shm" (Alltoall)
SHM_ALLTOALL_MAX_BYTES = 64 << 10


def shm_preferred(collective: str, nbytes_per_rank: int, size: int) -> bool:
    """Whether ``algorithm="auto"`` runs `collective` ("allgatherv", "alltoall" or "alltoallv")
    over the communicator's shared-memory segment rather than the MPI library's call (the caller
    asks only where the communicator has a segment, or one rank).

    Every rank must make the same choice (the two paths do not talk to each other), so the
    arguments must be the same on every rank: `size` the communicator's, `nbytes_per_rank` the
    bytes each rank sends: Alltoall ``size * count * itemsize`` (count per block). A choice that
    depends on a size lets an erroneous call (counts that differ between ranks) put ranks on
    different transports, where no fingerprint can catch it; so only Alltoall, whose one block
    count users rarely get wrong, uses the size. Allgatherv's and Alltoallv's counts are the
    error-prone part of a v-collective: their choice ignores `nbytes_per_rank`.

    The figures it rests on (bench/vcollectives.py, float32, MPICH, 2 and 4 ranks on 2 cores;
    the segment's protocols are bimodal on that machine: within minutes, the same sweep gave
    shm 0.5x of the MPI library's time in one run and 2-3x in the next):
      * Allgatherv: shm won at every size up to 1 MiB per rank in every run and at every size
        at 4 ranks; at 4 and 16 MiB on 2 ranks it lost 2.3-3.2x in 6 of 8 runs. "shm" always:
        with it, counts that differ between ranks are always caught (the counts are in the
        fingerprint of every round).
      * Alltoall: shm won up to 64 KiB in every run (0.3-0.5x); at 256 KiB it won (0.6x) in 4
        runs and lost 2.7x in 6: "shm" up to SHM_ALLTOALL_MAX_BYTES.
      * Alltoallv: shm won at 16 KiB and lost 2x at 256 KiB-16 MiB in 6 of 8 runs at 2 ranks,
        and at every size at 4 ranks: never "shm" (it stays available as algorithm="shm").
    One rank: "shm" (a local copy, no MPI call).
    """
    if collective not in SHM_VCOLLECTIVES:
        raise ValueError(f"collective: expected one of {', '.join(map(repr, SHM_VCOLLECTIVES))}, "
                         f"got {collective!r}")
    if size <= 1 or collective == "allgatherv":
        return True
    if collective == "alltoallv":
        return False
    return nbytes_per_rank <= SHM_ALLTOALL_MAX_BYTES
