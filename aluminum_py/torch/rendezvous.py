"""The ``mpi://`` rendezvous of ``torch.distributed.init_process_group`` (docs/torch.md): the
ranks and the world size are MPI's (``MPI.COMM_WORLD``), and the store every process group needs
is a ``TCPStore`` that rank 0 opens on a port the operating system picks (port 0), whose address
rank 0 then broadcasts over MPI.  No ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` or ``WORLD_SIZE``,
and no race for a fixed port between jobs sharing a node.

    torch.distributed.init_process_group("aluminum", init_method="mpi://")

``mpi://`` takes no host or port; ``?timeout=`` is not read (torch passes its own timeout).
"""
import datetime
import os
import socket

import torch.distributed as dist

from ..errors import Error

SCHEME = "mpi"

HOW_TO_LAUNCH = ("start the job with an MPI launcher, one process per rank: "
                 "mpiexec -n N python prog.py (torchrun and python -m torch.distributed.run "
                 "start N separate MPI worlds of one process each)")


def mpi_world(what: str):
    """``MPI.COMM_WORLD`` after checking that this process is one rank of an MPI job: a
    launcher-less process (torchrun's workers, a plain ``python prog.py`` given a torchrun
    world size) gets an :class:`~aluminum_py.Error` saying how to launch."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    launched = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if world.size == 1 and launched > 1:
        raise Error(f"{what}: this process is an MPI world of 1 rank, but WORLD_SIZE={launched} "
                    f"(set by torchrun?): {HOW_TO_LAUNCH}")
    return world


def _host_for_peers(world) -> str:
    """The address the other ranks use to reach rank 0's store: the loopback address when
    every rank runs on rank 0's node, else rank 0's host name."""
    from mpi4py import MPI
    same_node = world.allreduce(MPI.Get_processor_name() == world.bcast(
        MPI.Get_processor_name(), root=0), op=MPI.LAND)
    return "127.0.0.1" if same_node else socket.gethostname()


def create_store(timeout: datetime.timedelta, world=None) -> "dist.TCPStore":
    """Collective over `world` (default ``MPI.COMM_WORLD``): a ``TCPStore`` served by rank 0 on
    a port the OS picks, rank 0's (host, port) broadcast over MPI, every other rank a client."""
    world = mpi_world("mpi:// rendezvous") if world is None else world
    host = _host_for_peers(world)
    store, failure = None, None
    if world.rank == 0:
        try:
            store = dist.TCPStore("0.0.0.0" if host != "127.0.0.1" else host, 0, world.size,
                                  is_master=True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        except Exception as e:      # noqa: BLE001  (every rank raises, below)
            failure, address = e, None
    else:
        address = None
    address = world.bcast(address if failure is None else ("", f"{type(failure).__name__}: "
                                                               f"{failure}"), root=0)
    if failure is not None:
        raise Error(f"mpi:// rendezvous: rank 0 could not open a TCPStore: {failure}") from failure
    if address[0] == "":
        raise Error(f"mpi:// rendezvous: rank 0 could not open a TCPStore: {address[1]}")
    if store is None:
        store = dist.TCPStore(address[0], address[1], world.size, is_master=False,
                              timeout=timeout)
    return store


def handler(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs):
    """The ``mpi://`` handler torch calls from ``init_process_group`` (a generator yielding
    ``(store, rank, world_size)`` once).  A `rank` or `world_size` given to
    ``init_process_group`` (torch passes them as the URL's query) must equal MPI's."""
    from urllib.parse import parse_qs, urlparse
    world = mpi_world("init_process_group(init_method='mpi://')")
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for name, mpi in (("rank", world.rank), ("world_size", world.size)):
        given = query.get(name, "-1")
        if given != "-1" and given != str(mpi):
            raise ValueError(f"init_process_group: {name}={given}, but MPI's is {mpi} "
                             f"(with init_method='mpi://' leave {name} out)")
    yield create_store(timeout, world), world.rank, world.size
    raise RuntimeError("mpi:// rendezvous: torch asked one rendezvous for a second store")


def register() -> None:
    """Register ``mpi://`` with torch.distributed (once)."""
    import importlib
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    if SCHEME not in rdzv._rendezvous_handlers:
        dist.register_rendezvous_handler(SCHEME, handler)
