"""Environment variables (all start with AL_).

Read once at import; call :func:`reload` after changing ``os.environ`` in a running program.
"""
from __future__ import annotations

import contextlib
import math
import os

# The accepted ranges (docs/environment.md lists each variable's).
MAX_SECONDS = 1e7               # a timeout of about 115 days: beyond it, say 0 (none)
MAX_BYTES = 2 ** 62             # every byte count fits an int64 with room to add to it
MAX_INT = 2 ** 31 - 1           # counts handed to C ints
MAX_SLOT_BYTES = 1 << 30        # AL_SHM_SLOT_BYTES: the segment holds 2 slots per rank
MAX_SPIN = 1.0                  # AL_ENGINE_SPIN: an idle engine polls at most this long
MAX_EXIT_GRACE = 3600.0


def _raw(name: str) -> str | None:
    """The variable's text; None when unset or empty (an empty value counts as unset)."""
    v = os.environ.get(name)
    return None if v is None or v.strip() == "" else v


def _number(name: str, default, lo: float, hi: float, expected: str, whole: bool = False):
    """The one parser of every numeric variable: a number (``float()`` syntax: ``1e6`` is
    accepted) in [lo, hi], a whole one if `whole`; NaN, infinities and anything out of range
    raise ValueError naming the variable and what it accepts."""
    v = _raw(name)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not lo <= x <= hi or (whole and x != int(x)):        # NaN fails the comparison
        return _reject(name, expected, default)
    return int(x) if whole else x


_deferred: list[str] = []       # errors of the variables read at import (construction_error)
_deferring = False


def _reject(name: str, expected: str, default=None):
    """The one error of a bad value: raised, or while reading at import (:func:`deferred`)
    remembered, and `default` used instead."""
    message = f"environment variable {name}={os.environ.get(name)!r}: expected {expected}"
    if not _deferring:
        raise ValueError(message)
    _deferred.append(message)
    return default


@contextlib.contextmanager
def deferred():
    """Read variables at import (or exit): a bad value is remembered and its default used, and
    :func:`construction_error` reports it, so ``Communicator()`` raises it on every rank at once.
    Raised at import it would end only the ranks that have it, and their peers would wait in
    their first collective for ever."""
    global _deferring
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


def _seconds(name: str, default, hi: float, lo: float = 0.0, note: str = ""):
    return _number(name, default, lo, hi, f"a number of seconds from {lo:g} to {hi:g}{note}")


def _bytes(name: str, default: int, lo: int = 0, hi: int = MAX_BYTES, note: str = "") -> int:
    return _number(name, default, lo, hi, f"a whole number of bytes from {lo} to {hi}{note}",
                   whole=True)


def _count(name: str, default, lo: int, hi: int, what: str, note: str = ""):
    return _number(name, default, lo, hi, f"a whole number of {what} from {lo} to {hi}{note}",
                   whole=True)


def _model(name: str, default: float) -> float:
    """A cost-model parameter: seconds per message or per byte, finite, 0 to 1."""
    return _number(name, default, 0.0, 1.0, "a cost-model parameter in seconds from 0 to 1")


# AL_HANG_TIMEOUT unset: torch.distributed's default.  A wait this long is a hang (a rank
# died where the launcher does not end the job, or the ranks' calls differ), and a job that
# raises ends where one that waits holds its allocation until the batch system kills it; a
# program that waits longer on purpose sets AL_HANG_TIMEOUT (0: no timeout).
DEFAULT_HANG_TIMEOUT = 1800.0
_hang_timeout: float | None = DEFAULT_HANG_TIMEOUT


def reload() -> None:
    """Re-read the environment variables that are cached (AL_HANG_TIMEOUT)."""
    global _hang_timeout
    t = _seconds("AL_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT, MAX_SECONDS,
                 note=" (0: no timeout)")
    _hang_timeout = t or None


def hang_timeout() -> float | None:
    """AL_HANG_TIMEOUT: seconds after which a blocking op, a Wait() without timeout or
    Communicator() raises (default 1800; None: no timeout, AL_HANG_TIMEOUT=0)."""
    return _hang_timeout


def hang_timeout_native() -> float:
    """AL_HANG_TIMEOUT for the native layer: -1.0 means wait forever."""
    return -1.0 if _hang_timeout is None else _hang_timeout


def exit_grace() -> float:
    """AL_EXIT_GRACE: seconds pending ops get to finish at interpreter exit (default 2)."""
    return _seconds("AL_EXIT_GRACE", 2.0, MAX_EXIT_GRACE)


def engine_yield() -> int | None:
    """AL_ENGINE_YIELD: polls without progress between sched_yield() calls of the progress
    engine while ops are active (0: never yield).  Unset: chosen per node, see
    :func:`default_engine_yield`."""
    return _count("AL_ENGINE_YIELD", None, 0, MAX_INT, "polls", " (0: never yield)")


def engine_spin() -> float:
    """AL_ENGINE_SPIN: seconds the idle progress engine keeps polling for new work before it
    sleeps (default 0.0002: a burst of per-layer allreduces then avoids a thread wake-up each)."""
    return _seconds("AL_ENGINE_SPIN", 200e-6, MAX_SPIN)


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
    return _count("AL_TIMELINE_BUFFER", 65536, 1, MAX_INT, "items")


def shm_slot_bytes() -> int:
    """AL_SHM_SLOT_BYTES: bytes of a rank's slot in a communicator's shared-memory segment, per
    buffer (default 1 MiB; rounded up to 4 KiB; 0: no segment, "shm" unavailable).  The segment
    holds two per rank, reserved when the communicator is made, and an "shm" allreduce larger
    than a slot runs in chunks of a slot.  Rank 0's value is used."""
    expected = f"0 (no segment) or a whole number of bytes from 4096 to {MAX_SLOT_BYTES}"
    n = _number("AL_SHM_SLOT_BYTES", 1 << 20, 0, MAX_SLOT_BYTES, expected, whole=True)
    if 0 < n < 4096:
        _reject("AL_SHM_SLOT_BYTES", expected)
    return n


def shm_small_bytes() -> int:
    """AL_SHM_SMALL_BYTES: "shm" allreduces of at most this many bytes use the symmetric
    protocol (one synchronisation, every rank reduces everything), larger ones reduce-scatter
    then allgather (default 64 KiB; at most the slot).  Rank 0's value is used."""
    return _bytes("AL_SHM_SMALL_BYTES", 64 << 10)


def shm_stream_bytes() -> int | None:
    """AL_SHM_STREAM_BYTES: "shm" allreduces (reduce-scatter then allgather) of at least this
    many bytes write recvbuf with streaming stores, which skip the read of every line before
    its write and leave the caches to the slots (a huge value: never).  Unset (None): those
    whose node's sendbufs and recvbufs, 2 x ranks x bytes, fill the last-level cache
    (:func:`last_level_cache_bytes`): 8 MiB at 2 ranks and 4 MiB at 4 on a 32 MiB L3.  Not
    needed to be the same on every rank."""
    return _bytes("AL_SHM_STREAM_BYTES", None)


def last_level_cache_bytes(cpu: int = 0) -> int:
    """The size of `cpu`'s largest data (or unified) cache from sysfs, 32 MiB where it cannot be
    read."""
    return cache_bytes(cpu) or 32 << 20


def cache_bytes(cpu: int = 0, level: int | None = None) -> int:
    """The size of `cpu`'s data (or unified) cache of `level` from sysfs (None: its largest);
    0 where it cannot be read."""
    best = 0
    base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(f"{base}/{entry}/type") as f:
                if f.read().strip() not in ("Data", "Unified"):
                    continue
            if level is not None:
                with open(f"{base}/{entry}/level") as f:
                    if f.read().strip() != str(level):
                        continue
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KkMmGg")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def shm_chunk_bytes(slot: int = 1 << 20, yielding: bool = False) -> int:
    """AL_SHM_CHUNK_BYTES: bytes of an "shm" allreduce's round (reduce-scatter then allgather)
    in allreduces under the size from which recvbuf is streamed (AL_SHM_STREAM_BYTES); the
    others, and every one where it is at least the slot, take a slot per round.  Unset: a
    quarter of the core's L2 cache (128 KiB of the reference VM's 512 KiB; 256 KiB where it
    cannot be read), so that a round's blocks stay in L2, where every rank has a core of its
    own (`yielding` False: 1.06-1.17x faster than 1 MiB rounds at 512 KiB-4 MiB, 2 ranks); the slot
    where ranks outnumber cores, where each round's two waits may each wait for a descheduled
    peer (1 MiB rounds 1.1-1.3x faster than 128-256 KiB ones at 1-2 MiB, 4 ranks on 2 cores).
    Rank 0's value is used (docs/performance.md, "Rounds that stay in L2"); rounded down to
    4 KiB, as rounds start on whole pages of the slot."""
    expected = f"a whole number of bytes from 4096 to {MAX_SLOT_BYTES}"
    n = _number("AL_SHM_CHUNK_BYTES", 0, 4096, MAX_SLOT_BYTES, expected, whole=True)
    if not n:
        n = slot if yielding else max((cache_bytes(0, 2) or 1 << 20) // 4, 64 << 10)
    return min(n - n % 4096, slot)


SHM_SLOT_STORES = ("auto", "cached", "streamed")


def shm_slot_stores() -> int:
    """AL_SHM_SLOT_STORES: how the "shm" collectives write the slots their peers read: ``auto``
    (default: streaming stores where an op writes 4 KiB or more into a rank's slots, ordinary
    ones below: al_shm.h, "the slots' stores"), ``cached`` (ordinary stores: peers read them
    from a cache they share) or ``streamed`` (streaming stores: peers read them from memory).
    An index into SHM_SLOT_STORES.  Need not be the same on every rank."""
    v = _raw("AL_SHM_SLOT_STORES")
    if v is None:
        return 0
    if v.strip().lower() not in SHM_SLOT_STORES:
        return _reject("AL_SHM_SLOT_STORES", "auto, cached or streamed", 0)
    return SHM_SLOT_STORES.index(v.strip().lower())


def wait_spin() -> float:
    """AL_WAIT_SPIN: seconds a blocking call's polling wait (an "shm" op's wait for its peers
    included) spins before it yields the core at every poll, where every rank has a core of
    its own (default 5e-06; negative: never yield; where ranks outnumber cores
    AL_ENGINE_YIELD's rule applies instead; the progress engine waits 2 ms)."""
    return _seconds("AL_WAIT_SPIN", 5e-6, MAX_SPIN, -MAX_SPIN, " (negative: never yield)")


def wait_nap() -> float:
    """AL_WAIT_NAP: where ranks outnumber cores, seconds an "shm" op's wait for its peers' flags
    polls (yielding, AL_ENGINE_YIELD) without progress before it sleeps between polls instead
    (default 0.00025; 0: never sleep).  Yielding alone let 4 ranks on 2 cores fall into a state
    where shm allreduces took 3-8x longer (docs/performance.md, "Waits that sleep")."""
    return _seconds("AL_WAIT_NAP", 2.5e-4, MAX_SPIN, note=" (0: never sleep)")


def shm_named() -> bool:
    """AL_SHM_NAMED: a debugging aid; 1 makes every communicator's shared-memory segment a named
    POSIX object in /dev/shm (unlinked once every rank has mapped it) instead of an anonymous
    memory file opened through /proc, the path taken anyway where that cannot work (default
    0).  Rank 0's value is used."""
    return _number("AL_SHM_NAMED", 0, 0, 1, "0 or 1", whole=True) == 1


def tuning_file() -> str | None:
    """AL_TUNING_FILE: the tuning table's path (None: the per-user cache file)."""
    return _raw("AL_TUNING_FILE")


def cuda_library() -> str | None:
    """AL_CUDA_LIBRARY: the CUDA driver library to dlopen (None: unset; :func:`cuda_driver` is
    what the native core is given), also the NCCL search's first candidate when it is the
    stand-in."""
    return _raw("AL_CUDA_LIBRARY")


def nccl_library() -> str | None:
    """AL_NCCL_LIBRARY: the NCCL library to dlopen first (None: search the usual places)."""
    return _raw("AL_NCCL_LIBRARY")


def node_layout() -> list[str] | None:
    """AL_NODE_LAYOUT: per rank a node label, comma-separated (``0,0,1,1``); None when unset.
    Whether there is one label per rank is checked where the communicator is known
    (topology.compute)."""
    v = _raw("AL_NODE_LAYOUT")
    if v is None:
        return None
    labels = [x.strip() for x in v.split(",")]
    if not all(labels):
        _reject("AL_NODE_LAYOUT", "one node label per rank, comma-separated")
    return labels


def nccl_ctas() -> tuple[int | None, int | None]:
    """(AL_NCCL_MIN_CTAS, AL_NCCL_MAX_CTAS): default thread-block limits of NCCL operations
    (None: NCCL's own); whole numbers from 1, the minimum at most the maximum."""
    lo = _count("AL_NCCL_MIN_CTAS", None, 1, MAX_INT, "thread blocks")
    hi = _count("AL_NCCL_MAX_CTAS", None, 1, MAX_INT, "thread blocks")
    if lo is not None and hi is not None and lo > hi:
        _reject("AL_NCCL_MIN_CTAS", f"at most AL_NCCL_MAX_CTAS={hi}")
    return lo, hi


def construction_error() -> str | None:
    """The error of the first bad variable among those a Communicator's construction reads
    (None: all good).  The host backend gathers every rank's answer first, so that a value bad
    on some ranks only fails the construction on every rank instead of leaving the others
    waiting for them.  A bad variable read at import comes first."""
    if _deferred:
        return _deferred[0]
    try:
        engine_yield()
        node_layout()
        shm_slot_bytes()
        shm_small_bytes()
        shm_chunk_bytes()
        shm_named()
        shm_test_faults()
        model_params()
        shm_model_params()
        check()
    except ValueError as e:
        return str(e)
    return None


def first_error(errors) -> str | None:
    """The one error of settings gathered from every rank (per rank an error text, or anything
    else for none): the first, naming its rank and how many more ranks have one; None when no
    rank has one.  Raised on every rank, so that a value bad on some ranks only fails the
    construction everywhere."""
    bad = [(r, e) for r, e in enumerate(errors) if isinstance(e, str)]
    if not bad:
        return None
    return (f"{bad[0][1]} (rank {bad[0][0]}"
            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})")


def check() -> bool:
    """AL_CHECK: a debugging aid; 1 makes every collective call of the point-to-point
    algorithms and "mpi" exchange its signature (kind, count, dtype, op, root, call number)
    with the peers first, so that ranks calling differently raise aluminum_py.Error naming both
    calls instead of failing in MPI, hanging or returning wrong values (default 0: only the
    shared-memory rounds carry fingerprints).  Set it the same on every rank: read at
    Communicator() (collective)."""
    return _number("AL_CHECK", 0, 0, 1, "0 or 1", whole=True) == 1


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

    Defaults: measured with bench/peers.py on the reference 2-core machine
    (MPICH 5, shared memory); see docs/algorithms.md.
    """
    return (_model("AL_ALPHA", 2.0e-6), _model("AL_BETA", 1.6e-10), _model("AL_GAMMA", 1.0e-10))


def shm_model_params() -> tuple[float, float]:
    """AL_SHM_SYNC (s per synchronisation of the "shm" allreduce: a publish and the wait for
    every peer's flag), AL_SHM_BYTE (s per byte of one rank's memory traffic): the "shm"
    formula of the cost model (aluminum_py.algorithms), on the scale of AL_ALPHA... (a per-call
    cost every algorithm pays is not in either).  Rank 0's values are used.

    Defaults, on the reference 2-core machine (docs/tuning.md, "The shm formula"): AL_SHM_BYTE
    fitted by least squares to a quiet 2-rank run, docs/data/shm_2ranks.json; AL_SHM_SYNC,
    which that fit puts at 0 (below what it resolves), the round trip of a cache line between
    two processes (a C ping-pong)."""
    return (_model("AL_SHM_SYNC", 2.0e-7), _model("AL_SHM_BYTE", 2.7e-11))


with deferred():
    reload()


# ---------------------------------------------------------------- values passed to the native
# core, and the environment of other libraries (every variable is read here; the C and
# Cython code is given the values, it never reads the environment)
CUDA_DRIVER = "libcuda.so.1"    # the driver's soname


def cuda_driver() -> str:
    """The CUDA driver library the native core opens (``_core.CudaDevice``,
    ``cuda_device_count``, ``cuda_current_device`` take it): AL_CUDA_LIBRARY, else
    libcuda.so.1."""
    return cuda_library() or CUDA_DRIVER


def shm_test_faults() -> tuple[int, int]:
    """TESTING AIDS ONLY, read at each shared-memory setup (``_core.shm_attach``'s `faults`):
    (AL_SHM_TEST_DIE_IN_SETUP, AL_SHM_TEST_BAD_NONCE), the rank that calls ``os._exit`` in the
    middle of the setup (tests/test_shm_segment.py) and the rank that expects another nonce
    than rank 0 sent, as if it had opened a file that is not rank 0's segment
    (tests/mpi/test_hostile.py); -1: none."""
    return (_count("AL_SHM_TEST_DIE_IN_SETUP", -1, 0, MAX_INT, "ranks"),
            _count("AL_SHM_TEST_BAD_NONCE", -1, 0, MAX_INT, "ranks"))


def cuda_standin_dir() -> str | None:
    """AL_CUDA_STANDIN_DIR: where aluminum_py.testing.cuda_standin builds its library (None:
    the per-user cache)."""
    return _raw("AL_CUDA_STANDIN_DIR")


def nccl_nthreads() -> int:
    """NCCL_NTHREADS, NCCL's own variable (threads per CTA, default 512), read here too: a
    thread budget becomes NCCL's maxCTAs with it (``gpu.threads_to_ctas``)."""
    return _count("NCCL_NTHREADS", 512, 1, MAX_INT, "threads")


def cache_home() -> str:
    """XDG_CACHE_HOME, else ~/.cache: where the per-user tuning table lives."""
    return _raw("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
