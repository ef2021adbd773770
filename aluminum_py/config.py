"""Environment variables (all start with AL_).

Read once at import; call :func:`reload` after changing ``os.environ`` in a running program.
"""
from __future__ import annotations

import os


def _float(name: str, default):
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not a number") from None


def _bytes(name: str, default: int) -> int:
    """A byte count from the environment: a finite number >= 0 (``1e6`` is accepted)."""
    v = _float(name, float(default))
    if not (0 <= v < 2 ** 63):
        raise ValueError(f"environment variable {name}={os.environ.get(name)!r}: "
                         f"expected a number of bytes >= 0")
    return int(v)


_hang_timeout: float | None = None


def reload() -> None:
    """Re-read the environment variables that are cached (AL_HANG_TIMEOUT)."""
    global _hang_timeout
    t = _float("AL_HANG_TIMEOUT", None)
    _hang_timeout = None if t is None or t <= 0 else t


def hang_timeout() -> float | None:
    """AL_HANG_TIMEOUT: seconds after which a blocking op or a Wait() without timeout raises."""
    return _hang_timeout


def hang_timeout_native() -> float:
    """AL_HANG_TIMEOUT for the native layer: -1.0 means wait forever."""
    return -1.0 if _hang_timeout is None else _hang_timeout


def exit_grace() -> float:
    """AL_EXIT_GRACE: seconds pending ops get to finish at interpreter exit (default 2)."""
    return _float("AL_EXIT_GRACE", 2.0)


def engine_yield() -> int | None:
    """AL_ENGINE_YIELD: polls without progress between sched_yield() calls of the progress
    engine while ops are active (0: never yield).  Unset: chosen per node, see
    :func:`default_engine_yield`."""
    v = _float("AL_ENGINE_YIELD", None)
    return None if v is None else int(v)


def engine_spin() -> float:
    """AL_ENGINE_SPIN: seconds the idle progress engine keeps polling for new work before it
    sleeps (default 0.0002: a burst of per-layer allreduces then avoids a thread wake-up each)."""
    return _float("AL_ENGINE_SPIN", 200e-6)


def engine_serial_bytes() -> int:
    """AL_ENGINE_SERIAL_BYTES: all-reduces of at least this many bytes on one communicator
    run one at a time in the progress engine, in call order (default 1 MiB; 0: all run
    together).  Measured in docs/performance.md."""
    return _bytes("AL_ENGINE_SERIAL_BYTES", 1 << 20)


def scratch_cache() -> int:
    """AL_SCRATCH_CACHE: bytes of freed scratch buffers (the temporary space of in-place
    all-reduces) the library keeps for reuse (default 256 MiB; 0 frees each one at once)."""
    return _bytes("AL_SCRATCH_CACHE", 256 << 20)


def timeline() -> str | None:
    """AL_TIMELINE: record a timeline of every op from import on into this file name pattern
    (``{rank}`` is replaced by the rank, else ``.rank<N>.json`` is appended; docs/timeline.md)."""
    v = os.environ.get("AL_TIMELINE", "").strip()
    return v or None


def timeline_buffer() -> int:
    """AL_TIMELINE_BUFFER: items (ops, regions, buckets) the timeline buffers between two
    writer passes (default 65536); beyond it they are dropped and counted."""
    v = _float("AL_TIMELINE_BUFFER", 65536)
    if not (1 <= v < 2 ** 31):
        raise ValueError(f"environment variable AL_TIMELINE_BUFFER={os.environ.get('AL_TIMELINE_BUFFER')!r}: "
                         "expected a number of items >= 1")
    return int(v)


def shm_slot_bytes() -> int:
    """AL_SHM_SLOT_BYTES: bytes of a rank's slot in a communicator's shared-memory segment, per
    buffer (default 1 MiB; rounded up to 4 KiB; 0: no segment, "shm" unavailable).  The segment
    holds two per rank, reserved when the communicator is made, and an "shm" allreduce larger
    than a slot runs in chunks of a slot.  Rank 0's value is used."""
    n = _bytes("AL_SHM_SLOT_BYTES", 1 << 20)
    if 0 < n < 4096:
        raise ValueError(f"environment variable AL_SHM_SLOT_BYTES={n}: at least 4096 bytes")
    return n


def shm_small_bytes() -> int:
    """AL_SHM_SMALL_BYTES: "shm" allreduces of at most this many bytes use the symmetric
    protocol (one synchronisation, every rank reduces everything), larger ones reduce-scatter
    then allgather (default 64 KiB; at most the slot).  Rank 0's value is used."""
    return _bytes("AL_SHM_SMALL_BYTES", 64 << 10)


def shm_stream_bytes() -> int:
    """AL_SHM_STREAM_BYTES: "shm" allreduces (reduce-scatter then allgather) of at least this
    many bytes write recvbuf with streaming stores, which skip the read of every line before
    its write and leave the caches to the slots (default 8 MiB; a huge value: never).  Not
    needed to be the same on every rank."""
    return _bytes("AL_SHM_STREAM_BYTES", 8 << 20)


def wait_spin() -> float:
    """AL_WAIT_SPIN: seconds a blocking call's polling wait (an "shm" op's wait for its peers
    included) spins before it yields the core at every poll, where every rank has a core of
    its own (default 5e-06; negative: never yield; where ranks outnumber cores
    AL_ENGINE_YIELD's rule applies instead; the progress engine waits 2 ms)."""
    return _float("AL_WAIT_SPIN", 5e-6)


def shm_named() -> bool:
    """AL_SHM_NAMED: a debugging aid; 1 makes every communicator's shared-memory segment a named
    POSIX object in /dev/shm (unlinked once every rank has mapped it) instead of an anonymous
    memory file opened through /proc, the path taken anyway where that cannot work (default
    0).  Rank 0's value is used."""
    return _float("AL_SHM_NAMED", 0.0) != 0


def check() -> bool:
    """AL_CHECK: a debugging aid; 1 makes every collective call of the point-to-point
    algorithms and "mpi" exchange its signature (kind, count, dtype, op, root, call number)
    with the peers first, so that ranks calling differently raise aluminum_py.Error naming both
    calls instead of failing in MPI, hanging or returning wrong values (default 0: only the
    shared-memory rounds carry fingerprints).  Set it the same on every rank: read at
    Communicator() (collective)."""
    v = os.environ.get("AL_CHECK", "").strip()
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ValueError(f"environment variable AL_CHECK={v!r}: expected 0 or 1")


def default_engine_yield(local_size: int) -> int:
    """Never yield while every rank on the node has a core of its own (a GIL-holding caller
    would otherwise starve the engine); yield after every idle poll when ranks outnumber cores
    (a spinning engine would otherwise take the core from the peer it waits for).  Measured in
    docs/performance.md."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return 1 if local_size > cores else 0


def model_params() -> tuple[float, float, float]:
    """AL_ALPHA (s per message), AL_BETA (s per byte), AL_GAMMA (s per byte reduced).

    Defaults: measured with bench/allreduce_vs_mpi.py on the reference 2-core machine
    (MPICH 5, shared memory); see docs/algorithms.md.
    """
    return (_float("AL_ALPHA", 2.0e-6), _float("AL_BETA", 1.6e-10), _float("AL_GAMMA", 1.0e-10))


def shm_model_params() -> tuple[float, float]:
    """AL_SHM_SYNC (s per synchronisation of the "shm" allreduce: a publish and the wait for
    every peer's flag), AL_SHM_BYTE (s per byte of one rank's memory traffic): the "shm"
    formula of the cost model (aluminum_py.algorithms), on the scale of AL_ALPHA... (a per-call
    cost every algorithm pays is not in either).  Rank 0's values are used.

    Defaults, on the reference 2-core machine (docs/tuning.md, "The shm formula"): AL_SHM_BYTE
    fitted (tuning.fit_models) to the quiet 2-rank run bench/results/shm_2ranks.json;
    AL_SHM_SYNC, which that fit puts at 0 (below what it resolves), the round trip of a cache
    line between two processes (a C ping-pong, issue 18)."""
    return (_float("AL_SHM_SYNC", 2.0e-7), _float("AL_SHM_BYTE", 2.7e-11))


reload()
