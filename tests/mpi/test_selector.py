"""auto's choice is identical on every rank, whatever each rank's own tuning file says."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import tuning
from conftest import WORLD, all_ranks_ok, gather_all

pytestmark = [pytest.mark.mpi, pytest.mark.layout]


def test_choice_follows_rank0_even_with_divergent_files(tmp_path_factory, monkeypatch):
    """Each rank points AL_TUNING_FILE at a file naming a different winner (three passes that
    agree, shm and the rest 9x slower); all ranks must choose rank 0's (a rank-divergent choice
    would deadlock)."""
    rank = WORLD.rank
    algs = ["ring", "rabenseifner", "recursive_doubling", "mpi"]
    mine = algs[rank % len(algs)]
    sizes = [4, 1024, 1 << 20]
    times = {a: [1e-6 if a == mine else 9e-6] * len(sizes) for a in algs + ["shm"]}
    entry = tuning.make_entry(WORLD.size, world_topology(), "host", 8, tuning.mpi_version(),
                              sizes, [times] * 3)
    path = tmp_path_factory.mktemp(f"rank{rank}") / "tuning.json"
    tuning.save(tuning.merge(tuning.empty_table(), entry), str(path))
    monkeypatch.setenv("AL_TUNING_FILE", str(path))
    comm = al.Communicator()
    choices = [al.explain(comm, n, "float64") for n in (8, 4096, 1 << 20, 1 << 28)]
    everyone = WORLD.allgather([c.algorithm for c in choices])
    assert all(e == everyone[0] for e in everyone)
    if comm.size == 1:                                 # one rank: nothing to choose
        assert {c.source for c in choices} == {"forced"}
        comm.Free()
        return
    assert everyone[0][:3] == ["ring"] * 3            # rank 0's file
    assert choices[0].source == "table" and choices[3].source == "model"
    x = np.full(1 << 17, 1.0)                          # 1 MiB float64: the table's choice runs
    req = comm.Iallreduce(x)
    req.Wait(timeout=60)
    assert req.algorithm == "ring" and np.all(x == comm.size)
    comm.Free()


def world_topology() -> tuple:
    """MPI.COMM_WORLD's ranks per node, as a Communicator over it sees them (collective)."""
    from aluminum_py import topology
    topo = topology.compute(WORLD)
    topo.take_node_comm().Free()
    return topo.ranks_per_node


def test_table_of_another_topology_is_not_used(tmp_path_factory, monkeypatch):
    """A table measured with every rank on its own node (a network) names ring everywhere; on
    this machine (the ranks share a node) auto falls back to the cost model and says why; with
    AL_NODE_LAYOUT making each rank its own node, the same table serves."""
    sizes = [8, 1024, 1 << 20]
    times = {a: [1e-6 if a == "ring" else 9e-6] * len(sizes)
             for a in ("ring", "rabenseifner", "recursive_doubling", "mpi")}
    net = (1,) * WORLD.size
    entry = tuning.make_entry(WORLD.size, net, "host", 8, tuning.mpi_version(), sizes,
                              [times] * 3)
    path = tmp_path_factory.mktemp(f"net{WORLD.rank}") / "tuning.json"
    tuning.save(tuning.merge(tuning.empty_table(), entry), str(path))
    monkeypatch.setenv("AL_TUNING_FILE", str(path))
    problems = []
    here = world_topology()
    if here != net:
        comm = al.Communicator()
        c = comm.explain(1024, "float64")
        if c.source != "model" or "measured on another topology" not in c.detail \
                or tuning.describe_topology(WORLD.size, net) not in c.detail:
            problems.append(f"on {here}: {c}")
        comm.Free()
    monkeypatch.setenv("AL_NODE_LAYOUT", ",".join(map(str, range(WORLD.size))))
    comm = al.Communicator()
    for n in sizes:
        c = comm.explain(n, "float64")
        # ring where the model chooses another algorithm (the table), or the model's ring
        if comm.size > 1 and (c.algorithm != "ring" or c.source not in ("table", "model")
                              or (n == 8 and c.source != "table")):
            problems.append(f"as {net} at {n} B: {c}")
    x = np.full(1 << 10, float(WORLD.rank))
    comm.Allreduce(x)
    if not np.all(x == sum(range(WORLD.size))):
        problems.append("the allreduce on the forced layout is wrong")
    comm.Free()
    assert all_ranks_ok(not problems), problems


def test_machine_ranks_counts_the_ranks_sharing_this_kernel():
    """The engine's yield policy counts the ranks on this machine: every rank of the suite
    runs here (whatever MPI calls a node; bench cluster's nodes are namespaces of one kernel)."""
    from aluminum_py import topology
    topo = topology.compute(WORLD)
    topo.take_node_comm().Free()
    assert topo.machine_ranks == WORLD.size


def test_auto_choices_agree_without_table(comm):
    sizes = [4, 100, 8192, 1 << 16, 1 << 20, 1 << 26]
    mine = [al.explain(comm, n).algorithm for n in sizes]
    assert all(m == mine for m in WORLD.allgather(mine))


def test_bad_model_parameter_raises_on_every_rank(monkeypatch):
    """An error while rank 0 reads the tuning data reaches every rank (no rank waits forever)."""
    monkeypatch.setenv("AL_ALPHA", "abc")
    with pytest.raises(ValueError, match="AL_ALPHA"):
        al.Communicator()


# -- auto runs what the table says, at every size class, blocking and nonblocking

# Exactly linear times (seconds = intercept + slope * bytes): the lower envelope is
# recursive doubling below ~1.4 KB, mpi to ~11 KB, Rabenseifner to ~200 KB, ring above; the
# model's choice (shm on one node, "ht_auto" for GPU buffers without NCCL) is slower than all.
LINES = {"recursive_doubling": (1e-6, 1e-9), "mpi": (2e-6, 3e-10),
         "rabenseifner": (4e-6, 1.2e-10), "ring": (8e-6, 1e-10)}
SLOW = (40e-6, 2e-9)
MEASURED = [8, 64, 512, 4096, 8192, 32768, 131072, 1 << 20, 2 << 20]     # bytes of float64
# (bytes, winner, source): every algorithm beats the model at every measured size, so each
# has a range over them all; where ranges overlap, the largest margin at the measured size at
# or below wins (the fastest there); beyond the largest size the model decides
CASES = [(8, "recursive_doubling", "table"), (300, "recursive_doubling", "table"),
         (512, "recursive_doubling", "table"), (3000, "recursive_doubling", "table"),
         (4096, "mpi", "table"),
         (6000, "mpi", "table"), (32768, "rabenseifner", "table"),
         (131072, "rabenseifner", "table"), (1 << 20, "ring", "table"),
         (2 << 20, "ring", "table"), (4 << 20, None, "model")]


def linear_table(tmp_path_factory, monkeypatch, buffer, prefix="", model=("shm",)):
    """Every rank writes the same table of three passes (for MPI.COMM_WORLD's topology) and
    points AL_TUNING_FILE at it."""
    lines = dict({prefix + a: v for a, v in LINES.items()}, **{m: SLOW for m in model})
    times = {a: [i + s * n for n in MEASURED] for a, (i, s) in lines.items()}
    entry = tuning.make_entry(WORLD.size, world_topology(), buffer, 8, tuning.mpi_version(),
                              MEASURED, [times] * 3)
    path = tmp_path_factory.mktemp(f"table{WORLD.rank}") / "tuning.json"
    tuning.save(tuning.merge(tuning.empty_table(), entry), str(path))
    monkeypatch.setenv("AL_TUNING_FILE", str(path))


def cases_input(nbytes: int) -> np.ndarray:
    """float64 values of mixed magnitudes: the algorithms add them in different orders, so
    at 3+ ranks their results differ in the last bits (which algorithm ran shows there)."""
    rng = np.random.default_rng([WORLD.rank, nbytes])
    return rng.standard_normal(nbytes // 8) * 10.0 ** rng.integers(-8, 8, nbytes // 8)


def results_by_algorithm(comm, x, also=None) -> dict:
    out = {}
    for alg in dict.fromkeys([*LINES, also or "ring"]):
        r = np.empty_like(x)
        comm.Allreduce(x, r, algorithm=alg)
        out[alg] = r.tobytes()
    return out


def test_auto_runs_the_table_winner_at_every_size_class(tmp_path_factory, monkeypatch):
    linear_table(tmp_path_factory, monkeypatch, "host")
    comm = al.Communicator()
    problems, told_apart = [], 0
    for nbytes, winner, how in CASES:
        choice = comm.explain(nbytes, "float64")
        if comm.size == 1:
            winner, how = choice.algorithm, "forced"         # one rank: nothing to choose
        elif winner is None:
            winner = choice.algorithm                        # the model's
        if choice.algorithm != winner or choice.source != how:
            problems.append(f"{nbytes} B: explain says {choice}, expected {winner} ({how})")
        x = cases_input(nbytes)
        exact = results_by_algorithm(comm, x, winner)
        others = [a for a in exact if exact[a] != exact[winner]]
        told_apart += len(others) == len(exact) - 1
        blocking = np.empty_like(x)
        comm.Allreduce(x, blocking)
        nonblocking = np.empty_like(x)
        req = comm.Iallreduce(x, nonblocking)
        req.Wait(timeout=60)
        if req.algorithm != winner:
            problems.append(f"{nbytes} B: Iallreduce ran {req.algorithm}, expected {winner}")
        for name, got in (("Allreduce", blocking), ("Iallreduce", nonblocking)):
            if got.tobytes() != exact[winner]:
                ran = [a for a in exact if exact[a] == got.tobytes()]
                problems.append(f"{nbytes} B: {name}'s result has the bits of {ran}, not of {winner}")
        stack = gather_all(x)
        if np.any(np.abs(blocking - stack.sum(axis=0)) > 1e-12 * np.abs(stack).sum(axis=0)):
            problems.append(f"{nbytes} B: Allreduce's result is not the sum")
    assert all_ranks_ok(not problems), problems
    if comm.size >= 4:
        # the bits identify Rabenseifner and ring (recursive doubling and MPICH's own agree)
        assert told_apart >= 4
    comm.Free()


def test_gpu_auto_runs_the_cuda_table_winner_at_every_size_class(tmp_path_factory, monkeypatch):
    """The same on the GPU backend (CPU device): auto for GPU buffers reads the "cuda"
    entries, whose host-transfer algorithms run the host algorithm of the same name."""
    from aluminum_py import host_transfer as ht
    from test_gpu_backend_cpu import DeviceArray
    comm = al.Communicator()
    linear_table(tmp_path_factory, monkeypatch, "cuda", prefix="ht_", model=("ht_auto", "nccl"))
    device = ht.CpuDevice()
    stream = device.stream()
    ht.bind(comm, device, stream)
    problems = []
    for nbytes, winner, _ in CASES:
        if winner is None:                  # the model's: ht_auto, the host rule inside
            continue
        x = cases_input(nbytes)
        exact = results_by_algorithm(comm, x)
        blocking, nonblocking = x.copy(), x.copy()
        comm.Allreduce(DeviceArray(blocking))
        req = comm.Iallreduce(DeviceArray(nonblocking))
        req.Wait(timeout=60)
        if not stream.synchronize(timeout=60):
            problems.append(f"{nbytes} B: the stream did not drain")
        if req.algorithm != "ht_" + winner:
            problems.append(f"{nbytes} B: Iallreduce ran {req.algorithm}, expected ht_{winner}")
        for name, got in (("Allreduce", blocking), ("Iallreduce", nonblocking)):
            if got.tobytes() != exact[winner]:
                ran = [a for a in exact if exact[a] == got.tobytes()]
                problems.append(f"{nbytes} B: GPU {name}'s result has the bits of {ran}, not of {winner}")
    assert all_ranks_ok(not problems), problems
    comm.Free()
    stream.destroy()
