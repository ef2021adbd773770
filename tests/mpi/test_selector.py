"""auto's choice is identical on every rank, whatever each rank's own tuning file says."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import tuning
from conftest import WORLD

pytestmark = pytest.mark.mpi


def test_choice_follows_rank0_even_with_divergent_files(tmp_path_factory, monkeypatch):
    """Each rank points AL_TUNING_FILE at a file naming a different winner; all ranks must
    choose rank 0's (a rank-divergent choice would deadlock)."""
    rank = WORLD.rank
    algs = ["ring", "rabenseifner", "recursive_doubling", "mpi"]
    mine = algs[rank % len(algs)]
    sizes = [4, 1024, 1 << 20]
    times = {a: [1e-6 if a == mine else 9e-6] * len(sizes) for a in algs}
    probe = al.Communicator()
    entry = tuning.make_entry(probe.size, WORLD.bcast(probe.local_size, root=0), "host", 8,
                              tuning.mpi_version(), sizes, times)
    probe.Free()
    path = tmp_path_factory.mktemp(f"rank{rank}") / "tuning.json"
    tuning.save(tuning.merge(tuning.empty_table(), entry), str(path))
    monkeypatch.setenv("AL_TUNING_FILE", str(path))
    comm = al.Communicator()
    choices = [al.explain(comm, n, "float64") for n in (8, 4096, 1 << 20, 1 << 28)]
    everyone = WORLD.allgather([c.algorithm for c in choices])
    assert all(e == everyone[0] for e in everyone)
    assert everyone[0][:3] == ["ring"] * 3            # rank 0's file
    assert choices[0].source == "table"
    x = np.full(1 << 17, 1.0)                          # 1 MiB float64: the table's choice runs
    req = comm.Iallreduce(x)
    req.Wait(timeout=60)
    assert req.algorithm == "ring" and np.all(x == comm.size)
    comm.Free()


def test_auto_choices_agree_without_table(comm):
    sizes = [4, 100, 8192, 1 << 16, 1 << 20, 1 << 26]
    mine = [al.explain(comm, n).algorithm for n in sizes]
    assert all(m == mine for m in WORLD.allgather(mine))


def test_bad_model_parameter_raises_on_every_rank(monkeypatch):
    """An error while rank 0 reads the tuning data reaches every rank (no rank waits forever)."""
    monkeypatch.setenv("AL_ALPHA", "abc")
    with pytest.raises(ValueError, match="AL_ALPHA"):
        al.Communicator()
