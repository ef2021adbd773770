"""The topology of a communicator (aluminum_py/topology.py), computed once per Communicator with
two exchanges (the Split_type and one allgather), checked against what MPI says directly."""
import collections

import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import topology
from conftest import WORLD, all_ranks_ok
from test_hostile import within
from test_shm import with_env

pytestmark = pytest.mark.layout

COLLECTIVES = ["Dup", "Split", "Split_type", "Create_group", "allgather", "allreduce", "bcast",
               "gather", "scatter", "alltoall", "barrier", "Allgather", "Allreduce", "Bcast",
               "Barrier"]


def counting(comm, counts):
    """`comm` as an mpi4py communicator that counts its collective calls (by name) into
    `counts`, and those of the communicators made from it."""
    class Counting(MPI.Intracomm):
        pass

    def wrap(name):
        base = getattr(MPI.Intracomm, name)

        def call(self, *args, **kwargs):
            counts[name] += 1
            out = base(self, *args, **kwargs)
            return Counting(out) if isinstance(out, MPI.Intracomm) and out != MPI.COMM_NULL \
                else out
        return call
    for name in COLLECTIVES:
        setattr(Counting, name, wrap(name))
    return Counting(comm)


def test_two_exchanges_and_what_mpi_says():
    counts = collections.Counter()
    topo = topology.compute(counting(WORLD, counts))
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    leaders = WORLD.allgather(node.allreduce(WORLD.rank, op=MPI.MIN))
    expect = topology.canonical_layout(leaders)
    problems = []
    if dict(counts) != {"Split_type": 1, "allgather": 1}:
        problems.append(f"exchanges {dict(counts)}")
    if (topo.rank, topo.size) != (WORLD.rank, WORLD.size):
        problems.append(f"rank/size {topo.rank}/{topo.size}")
    if topo.layout != expect or topo.forced is not None:
        problems.append(f"layout {topo.layout} (forced {topo.forced}), MPI says {expect}")
    if (topo.local_rank, topo.local_size) != (node.Get_rank(), node.Get_size()):
        problems.append(f"local {topo.local_rank}/{topo.local_size}")
    if topo.ranks_per_node != tuple(expect.count(n) for n in range(max(expect) + 1)):
        problems.append(f"ranks_per_node {topo.ranks_per_node}")
    if topo.machine_ranks != WORLD.size:        # the suite runs on one machine
        problems.append(f"machine_ranks {topo.machine_ranks}")
    mine = tuple(r for r in range(WORLD.size) if expect[r] == expect[WORLD.rank])
    if topo.node_members() != mine:
        problems.append(f"node_members {topo.node_members()}")
    nc = topo.take_node_comm()
    if nc is None or topo.node_comm is not None or nc.Get_size() != node.Get_size():
        problems.append("take_node_comm")
    nc.Free()
    node.Free()
    assert all_ranks_ok(not problems), problems


def test_node_layout_variable_replaces_the_layout_not_local_rank():
    if WORLD.size < 2:
        pytest.skip("needs 2 ranks")
    labels = ["x" if r < WORLD.size // 2 else "y" for r in range(WORLD.size)]
    topo = with_env({"AL_NODE_LAYOUT": ",".join(labels)}, lambda: topology.compute(WORLD))
    node = topo.take_node_comm()
    ok = (topo.layout == topology.canonical_layout(labels) and topo.forced == tuple(labels)
          and topo.nodes == 2 and (topo.local_rank, topo.local_size) == (node.Get_rank(),
                                                                           node.Get_size()))
    node.Free()
    assert all_ranks_ok(ok), topo


def test_node_layout_of_another_length_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="AL_NODE_LAYOUT=.*expected one node label per rank"):
        with_env({"AL_NODE_LAYOUT": ",".join(["0"] * (WORLD.size + 1))},
                 lambda: topology.compute(WORLD))


def test_communicator_computes_it_once():
    """A Communicator's construction makes one Split_type (the topology's), and its backends
    use that value: no other exchange about where the ranks run."""
    counts = collections.Counter()
    comm = al.Communicator(counting(WORLD, counts))
    ok = (counts["Split_type"] == 1 and counts["Split"] == 0
          and (comm.local_rank, comm.local_size) == (comm._topology.local_rank,
                                                     comm._topology.local_size)
          and comm._host.layout == comm._topology.layout)
    comm.Free()
    assert all_ranks_ok(ok), dict(counts)


@pytest.mark.skipif(WORLD.size < 2, reason="needs a rank with another setting")
@pytest.mark.parametrize("value,says", [
    ("0,,1",
     "AL_NODE_LAYOUT='0,,1': expected one node label per rank, comma-separated (rank {last})"),
    ("{ones}", "AL_NODE_LAYOUT: not the same on every rank (rank 0: unset, rank {last}: '{ones}')"),
])
def test_node_layout_on_one_rank_only_fails_the_construction_on_every_rank(monkeypatch, value,
                                                                            says):
    """A bad AL_NODE_LAYOUT, or a good one set on the last rank only (the ranks would disagree
    on the layout, and so on every layout-aware schedule), fails Communicator() on every rank
    with the same error, never hangs it."""
    last = WORLD.size - 1
    ones = ",".join(["0"] * WORLD.size)
    if WORLD.rank == last:
        monkeypatch.setenv("AL_NODE_LAYOUT", value.format(ones=ones))
    how, what = within(60, al.Communicator)
    ok = (how == "raised" and isinstance(what, ValueError)
          and says.format(last=last, ones=ones) in str(what))
    assert all_ranks_ok(ok), (how, what)
