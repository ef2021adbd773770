"""Hostile inputs that need several ranks (issue 28): communicators the library cannot use are
refused on every rank before any communication, and a shared-memory segment whose size
overflows or whose header is not what rank 0 made is never used, by any rank.  The hostile
settings and files of a single process are in tests/test_config.py and tests/test_tuning.py."""
import threading

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.testing.internals import (CommState, shm_attach, shm_bytes, shm_detach,
                                           shm_header_check, shm_info)
from conftest import WORLD, all_ranks_ok, gather_all


def within(seconds, fn):
    """fn() in a thread, its exception or result; ('hung', None) if it has not returned after
    `seconds` (the thread is left behind: the test fails on every rank)."""
    out = {}

    def run():
        try:
            out["value"] = ("returned", fn())
        except BaseException as e:      # noqa: BLE001 (compared by the test)
            out["value"] = ("raised", e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return out.get("value", ("hung", None))


@pytest.mark.skipif(WORLD.size < 2, reason="an intercommunicator needs two groups")
def test_intercommunicator_refused_on_every_rank():
    color = WORLD.rank % 2
    local = WORLD.Split(color, key=WORLD.rank)
    inter = local.Create_intercomm(0, WORLD, 1 - color, tag=77)
    how, what = within(30, lambda: al.Communicator(inter))
    ok = how == "raised" and isinstance(what, TypeError) and "intercommunicator" in str(what)
    assert all_ranks_ok(ok), (how, what)
    inter.Free()
    local.Free()


def checked_allreduce(c, mpi_comm):
    x = np.arange(17, dtype=np.float64) * (mpi_comm.Get_rank() + 1)
    y = np.empty_like(x)
    c.Allreduce(x, y)
    return np.array_equal(y, np.stack(mpi_comm.allgather(x)).sum(axis=0))


def topologies():
    n, r = WORLD.size, WORLD.rank
    ring = [(i + 1) % n for i in range(n)]
    yield "cart", lambda: WORLD.Create_cart([n], periods=[True])
    yield "graph", lambda: WORLD.Create_graph(list(range(1, n + 1)), ring)
    yield "dist_graph", lambda: WORLD.Create_dist_graph_adjacent([(r - 1) % n], [(r + 1) % n])
    yield "split", lambda: WORLD.Split(0, key=n - r)          # ranks in reverse order


@pytest.mark.parametrize("kind", [k for k, _ in topologies()])
def test_intracommunicators_with_a_topology_work(kind):
    base = dict(topologies())[kind]()
    c = al.Communicator(base)
    assert (c.rank, c.size) == (base.Get_rank(), base.Get_size())
    assert all_ranks_ok(checked_allreduce(c, base))
    c.Free()
    base.Free()


def test_comm_self_null_and_communicators():
    c = al.Communicator(MPI.COMM_SELF)
    assert (c.rank, c.size) == (0, 1) and checked_allreduce(c, MPI.COMM_SELF)
    c.Free()
    with pytest.raises(ValueError, match="COMM_NULL"):
        al.Communicator(MPI.COMM_NULL)
    parent = al.Communicator()
    child = al.Communicator(parent)          # an al.Communicator: its ranks, a new one
    assert all_ranks_ok(checked_allreduce(child, WORLD))
    child.Free()
    parent.Free()
    with pytest.raises(ValueError, match="has been freed"):
        al.Communicator(parent)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        al.Communicator(42)


def node_state():
    """A CommState of WORLD's ranks on this node (the suite runs on one machine) and its
    communicator, for calling the segment's setup directly."""
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    if node.Get_size() != WORLD.size:
        node.Free()
        pytest.skip("the ranks are not on one node")
    return CommState(node, node), node


@pytest.mark.skipif(WORLD.size < 2, reason="a segment needs two ranks")
@pytest.mark.parametrize("slot", [2 ** 62, 2 ** 64 - 4096, 2 ** 64 - 1])
def test_segment_size_overflow_is_refused_on_every_rank(slot):
    # AL_SHM_SLOT_BYTES refuses such values (tests/test_config.py); the setup itself must too:
    # 2 * size * slot wrapped around to a small length, the header check passed, and the first
    # "shm" allreduce wrote far past the mapping (SIGSEGV on every rank)
    state, node = node_state()
    how, what = within(60, lambda: shm_attach(state, node, slot, 65536, 30.0))
    ok = how == "raised" and isinstance(what, al.Error) and "overflows" in str(what)
    shm_detach(state)
    node.Free()
    assert all_ranks_ok(ok), (how, what)
    assert shm_info(state) is None


def test_slot_that_overflows_the_segment_is_refused(monkeypatch):
    # issue 28's program: AL_SHM_SLOT_BYTES=2**62, then an "shm" allreduce segfaulted every rank
    monkeypatch.setenv("AL_SHM_SLOT_BYTES", "4611686018427387904")
    how, what = within(60, lambda: al.Communicator().Allreduce(np.ones(4), algorithm="shm"))
    ok = (how == "raised" and isinstance(what, ValueError)
          and "AL_SHM_SLOT_BYTES='4611686018427387904': expected " in str(what))
    assert all_ranks_ok(ok), (how, what)


@pytest.mark.skipif(WORLD.size < 2, reason="needs a rank with another setting")
@pytest.mark.parametrize("who,name,value,says,ends", [
    # a value bad on the last rank only: its error, naming that rank
    ("last", "AL_ENGINE_YIELD", "nan", "AL_ENGINE_YIELD='nan': expected a whole number",
     "(rank {last})"),
    # AL_CHECK=1 adds a collective per call (and a duplicated communicator at construction):
    # set on some ranks only, it must fail Communicator() on every rank, not hang it
    (0, "AL_CHECK", "1", "AL_CHECK: 1 on ranks [0] only", ""),
])
def test_setting_on_one_rank_only_fails_the_construction_on_every_rank(monkeypatch, who, name,
                                                                       value, says, ends):
    last = WORLD.size - 1
    if WORLD.rank == (last if who == "last" else who):
        monkeypatch.setenv(name, value)
    how, what = within(60, al.Communicator)
    ok = (how == "raised" and isinstance(what, ValueError) and says in str(what)
          and str(what).endswith(ends.format(last=last)))
    assert all_ranks_ok(ok), (how, what)


@pytest.mark.skipif(WORLD.size < 2, reason="a segment needs two ranks")
def test_bad_header_on_one_rank_disables_shm_on_every_rank(monkeypatch):
    # the last rank finds a header that is not rank 0's (AL_SHM_TEST_BAD_NONCE, a testing aid:
    # as if it had opened another file): no rank uses the segment, "shm" says why on every
    # rank, and "auto" gives the right values without it
    bad = WORLD.size - 1
    monkeypatch.setenv("AL_SHM_TEST_BAD_NONCE", str(bad))
    c = al.Communicator()
    monkeypatch.delenv("AL_SHM_TEST_BAD_NONCE")
    x = np.arange(100, dtype=np.float32) * (c.rank + 1)
    with pytest.raises(al.UnavailableError) as e:
        c.Allreduce(x.copy(), algorithm="shm")
    assert f"rank {bad}: " in str(e.value) and "nonce differs" in str(e.value), e.value
    assert all_ranks_ok(c._host.state is not None and shm_info(c._host.state) is None)
    assert WORLD.allgather(str(e.value)) == [str(e.value)] * WORLD.size
    y = np.empty_like(x)
    c.Allreduce(x, y)
    assert np.array_equal(y, gather_all(x).sum(axis=0))
    c.Free()


@pytest.mark.local
def test_header_check_names_what_differs():
    slot, nonce = 4096, 0x1234
    header = np.zeros(shm_bytes(2, slot), dtype=np.uint8)
    words = header[:40].view(np.uint64)
    words[:] = (0x6d68735f6c61, 2, slot, 0, nonce)          # AL_SHM_MAGIC, ranks, slot, health, nonce
    assert shm_header_check(header, 2, slot, nonce) is None
    for expect, args in (("nonce", (2, slot, nonce + 1)), ("slot bytes", (2, 2 * slot, nonce)),
                         ("ranks", (3, slot, nonce))):
        assert f"header: {expect} differs" in shm_header_check(header, *args)
    assert "length differs" in shm_header_check(header[:-4096], 2, slot, nonce)
    words[0] = 0
    assert "magic differs" in shm_header_check(header, 2, slot, nonce)
    assert shm_bytes(2, 2 ** 62) == 0 and shm_bytes(2, 4097) == 0
    assert shm_bytes(2, 4096) == 4096 + 4 * 4096
