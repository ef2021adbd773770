"""Where a communicator's ranks run, computed once per Communicator (:func:`compute`): the node
of every rank (``MPI_Comm_split_type(SHARED)``, or ``AL_NODE_LAYOUT``), this rank's place in its
node, the machine (kernel) of every rank, and the node communicator.  Its users receive the
:class:`Topology` value and never exchange anything about topology themselves: the host backend
(the engine's yield policy, "shm" on one node, the per-node segments of "hierarchical"), the
tuning table (entries are keyed by :func:`ranks_per_node`) and the crossover benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import config, timeline
from .errors import Error


def canonical_layout(labels) -> tuple[int, ...]:
    """A layout in its one form: per rank, its node as a small int numbered by first appearance
    (``["b", "a", "b"]`` -> ``(0, 1, 0)``), so equal layouts compare equal."""
    seen: dict = {}
    return tuple(seen.setdefault(n, len(seen)) for n in labels)


def ranks_per_node(layout) -> tuple[int, ...]:
    """Ranks per node, in node order, of a canonical layout: ``(0, 0, 1, 1)`` -> ``(2, 2)``
    (the tuning table's key)."""
    counts = [0] * (max(layout) + 1 if len(layout) else 0)
    for node in layout:
        counts[node] += 1
    return tuple(counts)


def machine_id() -> str:
    """This kernel's boot id (the hostname where it cannot be read): processes in separate
    network or UTS namespaces (``bench cluster``'s emulated nodes), or in containers, share it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


@dataclass(eq=False)
class Topology:
    """Where the ranks of one communicator run (made by :func:`compute`).

    Attributes:
        rank, size: this rank and the communicator's size.
        layout: per rank its node (canonical: numbered by first appearance, rank 0's node 0),
            from ``MPI_Comm_split_type(SHARED)``, or ``AL_NODE_LAYOUT`` when set (then
            ``forced`` holds its labels): what the layout-aware algorithms and the tuning table
            see.
        local_rank, local_size: this rank's place in its MPI node (``Split_type(SHARED)``,
            whatever ``AL_NODE_LAYOUT`` says): ``Communicator.local_rank`` / ``local_size``.
        machines: per rank its machine (kernel boot id, :func:`machine_id`), canonical.
        node_comm: the ``Split_type(SHARED)`` communicator (ranks in the communicator's order);
            whoever takes it (:meth:`take_node_comm`) owns it and frees it.
    """

    rank: int
    size: int
    layout: tuple
    local_rank: int
    local_size: int
    machines: tuple
    node_comm: object = None
    forced: tuple | None = None

    @property
    def nodes(self) -> int:
        """How many nodes the layout has."""
        return max(self.layout) + 1 if self.layout else 0

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        return ranks_per_node(self.layout)

    @property
    def machine_ranks(self) -> int:
        """How many ranks share this rank's kernel (and so its cores), whatever MPI or
        ``AL_NODE_LAYOUT`` calls a node."""
        return self.machines.count(self.machines[self.rank])

    def node_members(self, node: int | None = None) -> tuple[int, ...]:
        """The ranks of `node` (default: this rank's) in rank order."""
        node = self.layout[self.rank] if node is None else node
        return tuple(r for r in range(self.size) if self.layout[r] == node)

    def take_node_comm(self):
        """The node communicator, handed over once: the caller owns it from now on."""
        comm, self.node_comm = self.node_comm, None
        return comm


def _forced_layout(size: int):
    """This rank's ``AL_NODE_LAYOUT``: (labels or None, None), or (None, its error text)."""
    try:
        labels = config.node_layout()
    except ValueError as e:
        return None, str(e)
    if labels is not None and len(labels) != size:
        return None, (f"environment variable AL_NODE_LAYOUT={','.join(labels)!r}: expected one "
                      f"node label per rank ({size} ranks), comma-separated")
    return labels, None


def compute(comm) -> Topology:
    """The topology of the mpi4py communicator `comm` (collective): two exchanges, the
    ``MPI_Comm_split_type(SHARED)`` and one allgather of (node leader, boot id, this rank's
    ``AL_NODE_LAYOUT``, its timeline state).  The node's leader (its lowest rank of `comm`,
    which names it) is found locally, by translating rank 0 of the node communicator (ordered
    by rank of `comm`) to `comm`'s group.  ``AL_NODE_LAYOUT`` (per rank a node label, comma-separated: ``0,0,1,1``)
    replaces the layout: a testing and emulation aid that makes the layout-aware algorithms treat
    one machine as several nodes.  A value bad on some rank, or not the same on every rank,
    raises ValueError on every rank (the ranks must agree on the layout).  The same allgather
    carries each rank's timeline state (:func:`timeline.agreement`): an ``AL_TIMELINE`` that
    could not be opened on some rank, or a timeline recording on some ranks only, raises
    aluminum_py.Error on every rank (each Communicator measures the clock offsets while
    recording, a collective)."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    node_group, group = node.Get_group(), comm.Get_group()
    try:
        leader = MPI.Group.Translate_ranks(node_group, [0], group)[0]
    finally:
        node_group.Free()
        group.Free()
    labels, error = _forced_layout(size)
    everyone = comm.allgather((leader, machine_id(), error or labels, timeline.agreement()))
    forced = [f for _, _, f, _ in everyone]
    error = config.first_error(forced)
    other = next((r for r, f in enumerate(forced) if f != forced[0]), None)
    if error is None and other is not None:
        error = (f"environment variable AL_NODE_LAYOUT: not the same on every rank (rank 0: "
                 f"{_shown(forced[0])}, rank {other}: {_shown(forced[other])}); set it the "
                 f"same on every rank")
    if error is not None:
        node.Free()
        raise ValueError(error)
    recording = timeline.disagreement([t for _, _, _, t in everyone])
    if recording is not None:
        node.Free()
        raise Error(recording)
    layout = canonical_layout(labels if labels is not None else [n for n, _, _, _ in everyone])
    return Topology(rank, size, layout, node.Get_rank(), node.Get_size(),
                    canonical_layout([m for _, m, _, _ in everyone]), node,
                    None if labels is None else tuple(labels))


def _shown(labels) -> str:
    return "unset" if labels is None else repr(",".join(labels))
