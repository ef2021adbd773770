"""auto without a tuning table: on one node, the cost model's "shm" formula makes it run shm
(the segment's rounds advance by what the protocol says, the result is numpy's, every rank
chooses alike); across (emulated) nodes it never does."""
import math

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py.testing.internals import shm_info
from conftest import WORLD, all_ranks_ok, gather_all

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

SIZES = [4, 4096, 64 << 10, (64 << 10) + 64, 3 << 20]       # bytes of float32


def rounds(nbytes: int, info: dict) -> int:
    """Rounds of one shm allreduce (ext/al_shm.h): one up to `small`, else one per `chunk`
    bytes under `chunk_upto` bytes, one per slot from there."""
    if nbytes <= info["small"]:
        return 1
    return math.ceil(nbytes / (info["chunk"] if nbytes < info["chunk_upto"] else info["slot"]))


@pytest.fixture
def no_table(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("AL_TUNING_FILE", str(tmp_path_factory.mktemp("none") / "missing.json"))
    for name in ("AL_SHM_SYNC", "AL_SHM_BYTE", "AL_ALPHA", "AL_BETA", "AL_GAMMA"):
        monkeypatch.delenv(name, raising=False)


def run_auto(c, nbytes: int, problems: list) -> None:
    x = np.arange(nbytes // 4, dtype=np.float32) % 97 + c.rank
    y = np.empty_like(x)
    c.Allreduce(x, y)
    z = x.copy()
    req = c.Iallreduce(z)
    req.Wait(timeout=60)
    want = gather_all(x).sum(axis=0)
    if not (np.array_equal(y, want) and np.array_equal(z, want)):
        problems.append(f"{nbytes} B: wrong result")
    if req.algorithm != c.explain(nbytes).algorithm:
        problems.append(f"{nbytes} B: Iallreduce ran {req.algorithm}, explain says "
                        f"{c.explain(nbytes)}")


def test_auto_runs_shm_on_one_node_without_a_table(no_table):
    c = al.Communicator()
    choices = [c.explain(n) for n in SIZES]
    everyone = WORLD.allgather([(ch.algorithm, ch.source) for ch in choices])
    assert all(e == everyone[0] for e in everyone)
    problems = []
    info = shm_info(c._state)
    if c.size == 1:                           # no segment, nothing to exchange: the tie rule
        assert info is None and {ch.algorithm for ch in choices} == {"recursive_doubling"}
    else:
        for n, ch in zip(SIZES, choices):
            if ch.algorithm != "shm" or ch.source != "model" or "shm formula" not in ch.detail:
                problems.append(f"{n} B: {ch}")
    for n in SIZES:
        before = info and shm_info(c._state)["rounds"]
        run_auto(c, n, problems)
        if info is not None:
            got = shm_info(c._state)["rounds"] - before
            if got != 2 * rounds(n, info):                  # Allreduce, then Iallreduce
                problems.append(f"{n} B: the segment made {got} rounds, expected "
                                f"{2 * rounds(n, info)}")
    assert all_ranks_ok(not problems), problems
    c.Free()


def test_auto_never_runs_shm_across_nodes(no_table, monkeypatch):
    """AL_NODE_LAYOUT: every rank its own node; no segment, shm out of the model."""
    if WORLD.size < 2:
        pytest.skip("needs 2 nodes")
    monkeypatch.setenv("AL_NODE_LAYOUT", ",".join(map(str, range(WORLD.size))))
    c = al.Communicator()
    problems = []
    assert shm_info(c._state) is None
    for n in SIZES:
        ch = c.explain(n)
        if ch.algorithm == "shm" or "shm" in ch.detail:
            problems.append(f"{n} B: {ch}")
        run_auto(c, n, problems)
    assert all_ranks_ok(not problems), problems
    c.Free()
