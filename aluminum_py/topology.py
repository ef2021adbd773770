"""Where a communicator's ranks run: the node of every rank (``MPI_Comm_split_type(SHARED)``,
or ``AL_NODE_LAYOUT``) and how many ranks share this machine's cores.  Used by the host backend
(the hierarchical algorithm, the engine's yield policy), by the tuning table (entries are keyed
by topology) and by the crossover benchmark."""
from __future__ import annotations

from . import config, schedules


def node_layout(comm) -> tuple[int, ...]:
    """Per rank of `comm`, its node (``schedules.node_layout`` numbering), from
    ``MPI_Comm_split_type(SHARED)`` and one allgather (collective).  ``AL_NODE_LAYOUT`` (per
    rank a node label, comma-separated: ``0,0,1,1``) replaces it: a testing and emulation aid
    that makes the layout-aware algorithms treat one machine as several nodes."""
    labels = config.node_layout()
    if labels is not None:
        if len(labels) != comm.Get_size():
            raise ValueError(f"environment variable AL_NODE_LAYOUT={','.join(labels)!r}: "
                             f"expected one node label per rank ({comm.Get_size()} ranks), "
                             f"comma-separated")
        return schedules.node_layout(labels)
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = node.bcast(comm.Get_rank(), root=0)       # the node's lowest rank names it
    node.Free()
    return schedules.node_layout(comm.allgather(leader))


def machine_id() -> str:
    """This kernel's boot id (the hostname where it cannot be read): processes in separate
    network or UTS namespaces (``bench cluster``'s emulated nodes), or in containers, share it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


def machine_ranks(comm) -> int:
    """How many ranks of `comm` share this rank's kernel (and so its cores), whatever MPI calls
    a node (:func:`machine_id`; collective: one allgather)."""
    me = machine_id()
    return comm.allgather(me).count(me)
