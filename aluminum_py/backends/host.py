"""The host backend: collectives and point-to-point on host buffers, run by the native core
(``_core``). This module builds a communicator's native state (the launcher, auto's chooser,
the shared-memory segments) and says why something is unavailable; the calls themselves are
the native entries of ``_core.HostCollectives`` (ext/core/collectives.pxi: parse the buffers
into a message, pick the op kind from the algorithm, launch), bound as this backend's methods.
Every error message of that path is written here (:class:`_Hooks`) or in :mod:`..buffers`.
"""
from __future__ import annotations

import operator

from .. import _core, config, schedules, tuning
from ..algorithms import SHM_VCOLLECTIVES, shm_preferred
from ..algorithms import (COLLECTIVE_ALGORITHMS, GPU_ALLREDUCE, HOST_ALLREDUCE, HOST_CANDIDATES,
                          ONE_NODE, COLLECTIVE_NAMES)
from ..buffers import _IN_PLACE
from ..buffers import (as_array, at_least, check_count, no_overlap, no_partial_overlap,
                       same_dtype)
from ..buffers import (not_vlayout, vlayout, vno_overlap, vsame_count,  # v-collectives
                       vself_counts)
from ..errors import Error, MPIError, TimeoutError, UnavailableError
from ..gpu import cuda_device_count
from ..ops import DTYPE_CODES, OPS, VALID_PAIRS, Op, as_op, check_op
from ..request import Request, _check, _status_of
from ..status import ANY_SOURCE, ANY_TAG, Status
from .hier_shm import NodeSegments, attach_segment


def rank_arg(value, name: str, size: int) -> int:
    """`value` as a rank of a communicator of `size` ranks, else TypeError/ValueError naming
    `name`."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int rank, got {type(value).__name__}") from None
    if not 0 <= v < size:
        raise ValueError(f"{name}: rank {v} is out of range for a communicator of size {size}")
    return v


def divisible(arr, name: str, size: int) -> None:
    """Raise unless `arr` holds a whole number of blocks, one per rank of `size`."""
    if arr.size % size:
        raise ValueError(f"{name}: {arr.size} elements is not divisible by the communicator "
                         f"size {size}")


def tag_arg(tag, allow_any: bool, name: str = "tag") -> int:
    """`tag` as a point-to-point tag, 0..32767 (MPI.ANY_TAG too where `allow_any`: receives),
    else TypeError/ValueError naming it (`name`: tag, sendtag, recvtag)."""
    try:
        t = operator.index(tag)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(tag).__name__}") from None
    if allow_any and t == ANY_TAG:
        return t
    if not 0 <= t <= 32767:
        raise ValueError(f"{name}: {t} is out of range (0..32767"
                         f"{', or ANY_TAG' if allow_any else ''})")
    return t


def source_arg(value, size: int) -> int:
    """`value` as a receive's source: a rank of a communicator of `size` ranks or
    MPI.ANY_SOURCE, else TypeError/ValueError naming it."""
    from mpi4py import MPI
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"source: expected an int rank or MPI.ANY_SOURCE, got "
                        f"{type(value).__name__}") from None
    if v == MPI.ANY_SOURCE:
        return v
    return rank_arg(v, "source", size)


def collective_algorithm(what: str, algorithm, names=COLLECTIVE_ALGORITHMS) -> None:
    """Raise the error of `algorithm`, a name that `what` (a collective other than allreduce)
    does not run: it takes `names` ("mpi" and, for OTHER_COLLECTIVES, "shm")."""
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
    raise ValueError(f"algorithm: {what} takes {' or '.join(map(repr, names))}, got "
                     f"{algorithm!r}")


def _thread_name(ident: int) -> str:
    """A thread by name and ident, for the threading rule's messages."""
    import threading
    t = threading._active.get(ident)
    return f"{t.name!r} (ident {ident})" if t is not None else f"ident {ident} (ended)"


class _Hooks:
    """What the native call path calls back for: unusual buffers, and every error message."""

    as_array = staticmethod(as_array)
    same_dtype = staticmethod(same_dtype)
    at_least = staticmethod(at_least)
    no_partial_overlap = staticmethod(no_partial_overlap)
    no_overlap = staticmethod(no_overlap)
    rank_arg = staticmethod(rank_arg)
    divisible = staticmethod(divisible)
    not_vlayout = staticmethod(not_vlayout)         # the v-collectives (vcollectives.pxi)
    vlayout = staticmethod(vlayout)                 # the v-messages (msgbuffer.pxi)
    vno_overlap = staticmethod(vno_overlap)
    vsame_count = staticmethod(vsame_count)
    vself_counts = staticmethod(vself_counts)
    tag_arg = staticmethod(tag_arg)
    status_of = staticmethod(_status_of)    # a blocking receive's Status
    shm_preferred = staticmethod(shm_preferred)     # Alltoall's "auto"
    source_arg = staticmethod(source_arg)
    as_op = staticmethod(as_op)
    Op = Op                 # op_code: al.SUM ... take the one-test path
    IN_PLACE = _IN_PLACE    # msgbuffer.pxi's in-place forms
    config = config         # its _hang_timeout, read at every call

    @staticmethod
    def bad_collective_algorithm(what, algorithm):
        collective_algorithm(what, algorithm,
                             COLLECTIVE_NAMES[what][0] if what in COLLECTIVE_NAMES else ("mpi",))

    @staticmethod
    def in_place_layout():
        raise ValueError("sendbuf: in place (None or MPI.IN_PLACE) takes no send counts or "
                         "displacements: recvbuf's layout is used for both sides")

    @staticmethod
    def in_place_without_data():
        raise TypeError("sendbuf: None (in place) needs the data in recvbuf, which is None too")

    @staticmethod
    def required_off_root(name):
        raise TypeError(f"{name}: required on non-root ranks (in place is the root's form only)")

    @staticmethod
    def v_algorithm(what, algorithm):
        """The error of `algorithm`, a name the v-collective `what` does not run."""
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
        names = "'auto', 'mpi' or 'shm'" if what in SHM_VCOLLECTIVES else "'auto' or 'mpi'"
        raise ValueError(f"algorithm: {what} takes {names}, got {algorithm!r}")

    @staticmethod
    def no_ctas():
        raise ValueError("max_ctas/min_ctas: only for GPU buffers (NCCL thread-block limits)")

    @staticmethod
    def required(name, where):
        raise TypeError(f"{name}: required {where}")

    @staticmethod
    def fail(message):
        raise Error(message)

    @staticmethod
    def unavailable(message):
        raise UnavailableError(message)

    @staticmethod
    def request(op, algorithm):
        return Request(op, algorithm)

    @staticmethod
    def raise_error(op):
        _check(op)

    @staticmethod
    def raise_timeout(op, timeout):
        raise TimeoutError(f"{op.describe()}: not complete after {timeout:g} s "
                           f"(Communicator.timeout or AL_HANG_TIMEOUT; a peer that never "
                           f"joined?)")

    @staticmethod
    def setup_timeout(what, timeout):
        raise TimeoutError(f"{what}: not complete after {timeout:g} s (AL_HANG_TIMEOUT; a peer "
                           f"that never joined?)")

    @staticmethod
    def bad_algorithm(algorithm):
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
        if algorithm in GPU_ALLREDUCE and cuda_device_count() == 0:
            raise UnavailableError(f"algorithm: {algorithm!r} is for GPU buffers and no CUDA "
                                   f"device is available")
        if algorithm in GPU_ALLREDUCE:
            raise ValueError(f"algorithm: {algorithm!r} is for GPU buffers; host buffers take "
                             f"{', '.join(HOST_ALLREDUCE)}")
        raise ValueError(f"algorithm: unknown algorithm {algorithm!r}; choose from "
                         f"{', '.join(HOST_ALLREDUCE)}")

    @staticmethod
    def check_op(opcode, code, dtype):
        check_op(OPS[opcode], code, dtype)

    @staticmethod
    def too_many(n, name):
        check_count(n, name)

    @staticmethod
    def not_owner(name, owner, me):
        return (f"{name}: called from thread {_thread_name(me)}, but this communicator is "
                f"owned by thread {_thread_name(owner)}: a communicator is used by one thread "
                f"at a time, so that every rank sees its calls in the same order; hand it over "
                f"with comm.bind_thread() in the thread that uses it next, or give each thread "
                f"its own Communicator")

    @staticmethod
    def in_call(name, owner):
        return (f"{name}: thread {_thread_name(owner)} is inside a call on this communicator; "
                f"wait until it returns")

    # ---- scans, Probe ----
    @staticmethod
    def mpi_only(what, algorithm):
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
        raise ValueError(f"algorithm: {what} takes 'auto' or 'mpi' (the MPI library's own), "
                         f"got {algorithm!r}")

    @staticmethod
    def mpi_failed(where, code):
        from mpi4py import MPI
        raise MPIError(f"{where} failed: {MPI.Get_error_string(code)}", code)

    @staticmethod
    def probe_timeout(name, source, tag, timeout):
        src = "ANY_SOURCE" if source == ANY_SOURCE else f"rank {source}"
        tg = "ANY_TAG" if tag == ANY_TAG else f"tag {tag}"
        raise TimeoutError(f"{name}: no message from {src} with {tg} after {timeout:g} s "
                           f"(timeout=, Communicator.timeout or AL_HANG_TIMEOUT; a peer that never "
                           f"sent it?)")


_core.configure(_Hooks(), {dt: c for dt, (c, _) in DTYPE_CODES.items()}, VALID_PAIRS)


# The Backend methods that are HostCollectives' entries (HostBackend.__init__ binds them)
NATIVE_CALLS = ("allreduce", "reduce", "reduce_scatter", "allgather", "bcast", "alltoall", "gather",
                "scatter", "barrier", "send", "recv", "sendrecv", "allgatherv", "gatherv", "scatterv",
                "alltoallv", "reduce_scatterv", "scan", "exscan")

_largest_local_size = 0
_KEPT_AFTER_ABANDON: list = []   # MPI communicators never freed (HostBackend.close)


def set_engine_yield(local_size: int) -> None:
    """The engine's polling policy: AL_ENGINE_YIELD, else by whether ranks outnumber cores
    (judged from the largest communicator created so far on this node)."""
    global _largest_local_size
    _largest_local_size = max(_largest_local_size, local_size)
    every = config.engine_yield()
    _core.set_poll_yield(config.default_engine_yield(_largest_local_size) if every is None else every)


class HostBackend:
    """Host buffers of one Communicator.

    Args:
        state: the communicator's native state (``_core.CommState`` over its collective and
            point-to-point MPI communicators, which this backend frees at ``close``).
        tuning_comm: the MPI communicator whose rank 0 reads the tuning table for "auto"
            (collective: construction is).
        topo: where the ranks of `tuning_comm` run (``topology.compute``, made once by the
            Communicator): the ranks on this node and this machine (whether the engine and
            blocking calls yield the core, AL_ENGINE_YIELD), the node of every rank (the
            layout-aware schedules, ``hierarchical``; the tuning table's key), and the node
            communicator, which this backend takes: kept (freed at ``close``) when it holds
            every rank and the layout is one node (the "shm" algorithm sets up its segment over
            it), else freed here, and "shm" raises.
        any_source, any_tag: MPI.ANY_SOURCE and MPI.ANY_TAG.
    """

    def __init__(self, state, tuning_comm, topo, any_source: int, any_tag: int):
        self.state = state
        self.rank = state.rank
        self.size = state.size
        self._any_source = any_source
        self._any_tag = any_tag
        # every rank's verdict on its settings (an error text, else its AL_CHECK), gathered
        answers = tuning_comm.allgather(config.construction_error() or config.check())
        bad = config.first_error(answers)
        if bad:                     # on every rank, before anything else is set up
            raise ValueError(bad)
        if len(set(answers)) > 1:
            raise ValueError(f"environment variable AL_CHECK: 1 on ranks "
                             f"{[r for r, a in enumerate(answers) if a]} only; it must be the "
                             f"same on every rank (AL_CHECK=1 adds a collective per call)")
        self.check_calls: bool = answers[0]     # AL_CHECK, the same on every rank
        set_engine_yield(max(topo.local_size, topo.machine_ranks))
        self.topology = topo
        self.layout = topo.layout
        # several nodes: a segment per node, for "hierarchical" (None: its point-to-point form,
        # and why in _no_hier_shm)
        self._node_segments, self._no_hier_shm = NodeSegments.setup(state, tuning_comm, topo)
        self._node_comm = self._shm_comm(topo.take_node_comm())
        data = tuning.shared_data(tuning_comm, "host", self.layout)
        if self._node_comm is not None and self.size > 1:
            self._make_shm_segment()
        # what "auto" chooses from on this communicator (and the crossover benchmark times)
        self.candidates = tuple(a for a in HOST_CANDIDATES
                                if self._no_shm is None or a not in ONE_NODE)
        info = _core.shm_info(state) if self._no_shm is None else None
        limits = info and tuple(info[k] for k in ("small", "slot", "chunk", "chunk_upto"))
        self.chooser = tuning.Chooser.from_data(data, self.candidates, shm_limits=limits)
        self.launcher = _core.Launcher(state, self.chooser.choose,
                                       self._build_schedule, HOST_ALLREDUCE)
        self.launcher.shm_unavailable = self._shm_unavailable
        if self._node_segments is not None:
            self.launcher.hierarchical = self._node_segments.allreduce_op
        # The calls: the native entries (collectives.pxi), bound here so that a call from the
        # Communicator runs no Python (arguments as backends/base.py's Backend)
        self.calls = _core.HostCollectives(self.launcher)
        for name in NATIVE_CALLS:
            setattr(self, name, getattr(self.calls, name))
        # Alltoallv's arguments as the user gave them, split natively (the Communicator's
        # first try: a small call then costs what mpi4py's does)
        self.alltoallv_msg = self.calls.alltoallv_msg

    def close(self) -> None:
        _core.shm_detach(self.state)
        if self._node_segments is not None:
            self._node_segments.close()
        if self._node_comm is not None:
            self._node_comm.Free()
        if self.state.abandoned:
            # an op abandoned at its hang timeout may still have messages in flight to or from
            # its peers (sends are never cancelled): a communicator made after MPI_Comm_free
            # could get the same context id and receive them, so these are kept, never freed
            _KEPT_AFTER_ABANDON.append((self.state.coll_comm, self.state.p2p_comm))
            return
        self.state.coll_comm.Free()
        self.state.p2p_comm.Free()

    # ------------------------------------------------------------------ shared memory
    def _shm_comm(self, node_comm):
        """`node_comm` if the communicator is one node's (else it is freed): the "shm" setup's
        communicator.  Why not otherwise is kept for the error of "shm"."""
        nodes = self.topology.nodes
        forced = self.topology.forced
        self._no_shm = None
        if node_comm is not None and node_comm.Get_size() == self.size and nodes == 1:
            return node_comm
        if node_comm is not None:
            node_comm.Free()
        if nodes > 1:
            self._no_shm = (f"the communicator's {self.size} ranks are on {nodes} nodes"
                            + (f" (AL_NODE_LAYOUT={','.join(forced)})" if forced else ""))
        else:
            self._no_shm = "the communicator has no node communicator"
        return None

    def _make_shm_segment(self) -> None:
        """Map the communicator's shared-memory segment (collective, at construction: made by
        the first "shm" op instead, ops issued in different orders on different communicators
        would wait for each other's setup).  A failure (no room for the segment, ...) is the
        same on every rank: "shm" then raises it and "auto" leaves it out."""
        try:
            attach_segment(self.state, self._node_comm)
        except TimeoutError:
            raise
        except Error as e:
            self._no_shm = str(e)

    def _shm_unavailable(self) -> None:
        """The launcher found no segment for an "shm" op on more than one rank: say why (a
        freed communicator's segment is gone: that error, as for every other op)."""
        self.state.check_usable("allreduce/shm")
        if self._node_comm is None:
            raise UnavailableError(f"algorithm 'shm': {self._no_shm}; shm works among the ranks "
                                   f"of one node only (MPI_Comm_split_type(SHARED)); on "
                                   f"several nodes use 'hierarchical' or 'auto'")
        raise UnavailableError(f"algorithm 'shm': no shared-memory segment: {self._no_shm}")

    # ------------------------------------------------------------------ choosing
    def choose(self, algorithm: str, nbytes: int, itemsize: int) -> str:
        if algorithm == "auto":
            return self.launcher.choose(nbytes, itemsize)
        if isinstance(algorithm, str) and algorithm in HOST_ALLREDUCE:
            return algorithm
        return _Hooks.bad_algorithm(algorithm)

    def explain(self, nbytes: int, itemsize: int) -> "tuning.Choice":
        return self.chooser.explain(nbytes, itemsize)

    # ------------------------------------------------------------------ helpers
    def _build_schedule(self, alg: str, count: int, inplace: bool):
        steps, tmp = schedules.build(alg, self.size, self.rank, count, inplace,
                                     self.layout if alg in schedules.NEEDS_LAYOUT else None)
        return _core.Schedule(steps, tmp)

    def _tag_arg(self, tag, allow_any: bool, name: str = "tag") -> int:
        return tag_arg(tag, allow_any, name)

    # ------------------------------------------------------------------ probe
    def probe(self, source, tag, blocking, timeout, name):
        """MPI_Iprobe on the user's point-to-point communicator: the Status of the first
        matching message (count in bytes), or None (nonblocking: none there). Blocking: polls
        until one is there (aluminum_py.TimeoutError after `timeout` seconds, None: the
        communicator's timeout, else AL_HANG_TIMEOUT, 1800 s unless set; 0: no limit)."""
        tag = self._tag_arg(tag, True)
        limit = self.calls.wait_limit() if timeout is None else float(timeout)
        found = _core.probe(self.state, source, tag, blocking, limit, name)
        if found is None:
            if blocking:
                _Hooks.probe_timeout(name, source, tag, limit)
            return None
        return Status()._set(found[0], found[1], found[2], 1, 0)
