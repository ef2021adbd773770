"""The tuning table: round trips, merging, lookups, bad files (single process)."""
import json
import warnings

import numpy as np
import pytest

from aluminum_py import tuning
from aluminum_py.algorithms import MODELLED, model_time
from aluminum_py.bench.plots import crossover_map, format_map
from aluminum_py.bench.timing import parse_bytes, size_sweep
from aluminum_py.topology import ranks_per_node
from aluminum_py.tuning import Chooser, TuningWarning

from cost_reference import cheapest

MPI_NAME = "MPICH Version: 5.0.2"
USABLE = ("mpi",) + MODELLED
PARAMS = (2e-6, 1.6e-10, 1e-10)


def synthetic_entry(p=2, local=2, dtype_size=4, sizes=None, params=(3e-6, 2e-10, 1e-10)):
    """Times from the cost model (so the truth is known) plus an 'mpi' that is 10% slower
    than the best modelled algorithm; measured on p // local nodes of `local` ranks."""
    sizes = sizes or [4 << k for k in range(0, 25, 2)]
    times = {a: [model_time(a, p, n, params) for n in sizes] for a in MODELLED}
    times["mpi"] = [1.1 * min(times[a][i] for a in MODELLED) for i in range(len(sizes))]
    return tuning.make_entry(p, [local] * (p // local), "host", dtype_size, MPI_NAME, sizes, times)


def test_round_trip_and_merge(tmp_path):
    path = str(tmp_path / "t.json")
    table = tuning.load(path)                         # missing file: empty, no warning
    assert table["entries"] == {}
    e2, e4 = synthetic_entry(p=2), synthetic_entry(p=4, local=4)
    tuning.save(tuning.merge(table, e2), path)
    table = tuning.load(path)
    tuning.save(tuning.merge(table, e4), path)        # a second rank count: both kept
    loaded = tuning.load(path)
    assert len(loaded["entries"]) == 2
    assert loaded["version"] == tuning.VERSION
    key = tuning.make_key(2, [2], "host", 4, MPI_NAME)
    assert loaded["entries"][key]["times"] == e2["times"]
    again = synthetic_entry(p=2, sizes=[4, 8])        # same configuration: replaced
    tuning.save(tuning.merge(loaded, again), path)
    final = tuning.load(path)
    assert len(final["entries"]) == 2 and final["entries"][key]["sizes"] == [4, 8]


def test_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("AL_TUNING_FILE", str(tmp_path / "x.json"))
    assert tuning.default_path() == str(tmp_path / "x.json")
    monkeypatch.delenv("AL_TUNING_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.default_path() == str(tmp_path / "aluminum_py" / "tuning.json")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": tuning.FORMAT, "version": 0, "entries": {}}),
                                     json.dumps({"format": tuning.FORMAT, "version": 1}),
                                     json.dumps([1, 2, 3])])
def test_corrupt_or_old_files_warn_and_fall_back(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.warns(TuningWarning):
        table = tuning.load(str(path))
    assert table["entries"] == {}
    exact, fitted, others = tuning.find_data(table, [2], "host", MPI_NAME)
    choice = Chooser(2, exact, fitted, PARAMS, USABLE).explain(1024, 4)
    assert choice.source == "model" and choice.algorithm == cheapest(2, 1024, PARAMS)


def test_bad_entry_is_dropped_others_kept(tmp_path):
    good = synthetic_entry()
    table = {"format": tuning.FORMAT, "version": 2,
             "entries": {"good": good, "bad": {"sizes": [8, 4], "times": {"ring": [1, 2]}}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    with pytest.warns(TuningWarning, match="bad"):
        loaded = tuning.load(str(path))
    assert list(loaded["entries"]) == [tuning.entry_key(good)]


def chooser_for(entries, p=2, local=2, ranks_per_node=None):
    """The Chooser of a communicator of p ranks, p // local nodes of `local` ranks (or the
    given ranks_per_node), with a table of `entries`."""
    table = tuning.empty_table()
    for e in entries:
        tuning.merge(table, e)
    rpn = tuple(ranks_per_node or [local] * (p // local))
    exact, fitted, others = tuning.find_data(table, rpn, "host", MPI_NAME)
    return Chooser.from_data(tuning.TuningData(exact, fitted, PARAMS, rpn, others), USABLE)


def test_lookup_measured_sizes_pick_the_fastest():
    e = synthetic_entry()
    d = chooser_for([e])
    for i, n in enumerate(e["sizes"]):
        best = min(e["times"], key=lambda a: e["times"][a][i])
        c = d.explain(n, 4)
        assert c.algorithm == best and c.source == "table"


def test_lookup_interpolates_between_sizes():
    sizes = [1024, 4096]
    times = {"ring": [10e-6, 20e-6], "rabenseifner": [5e-6, 40e-6]}
    e = tuning.make_entry(2, [2], "host", 4, MPI_NAME, sizes, times)
    d = chooser_for([e])
    # log-linear: rabenseifner 5->40 us, ring 10->20 us; they cross at the geometric midpoint
    assert d.explain(1200, 4).algorithm == "rabenseifner"
    assert d.explain(3800, 4).algorithm == "ring"
    assert "interpolated" in d.explain(2000, 4).detail


def test_lookup_beyond_the_table():
    """Below the smallest size: the smallest size's winner. Above the largest: each
    algorithm's time at the largest size plus its fitted beta times the extra bytes, so a
    slower start with a smaller slope takes over past the crossing (here near 22 KB)."""
    sizes = [4, 64, 1024, 16384]
    # exactly linear times, so the fitted betas are the slopes written here
    steep = [1e-6 + 1e-10 * n for n in sizes]           # fastest at every measured size
    flat = [3e-6 + 1e-11 * n for n in sizes]
    e = tuning.make_entry(2, [2], "host", 4, MPI_NAME, sizes, {"ring": steep, "rabenseifner": flat})
    assert e["fit"]["ring"]["beta"] == pytest.approx(1e-10) and e["fit"]["rabenseifner"]["beta"] == pytest.approx(1e-11)
    d = chooser_for([e])
    assert d.explain(1, 4).algorithm == "ring" and d.explain(1, 4).source == "table"
    assert d.explain(16384, 4).algorithm == "ring"
    near = d.explain(20000, 4)                     # ring 3.0 us, rabenseifner 3.2 us
    assert (near.algorithm, near.source) == ("ring", "table-extrapolated")
    far = d.explain(1 << 20, 4)                    # ring 105.9 us, rabenseifner 13.5 us
    assert (far.algorithm, far.source) == ("rabenseifner", "table-extrapolated")
    crossing = 16384 + (flat[-1] - steep[-1]) / (1e-10 - 1e-11)
    assert d.explain(int(crossing * 0.99), 4).algorithm == "ring"
    assert d.explain(int(crossing * 1.01), 4).algorithm == "rabenseifner"


def test_unknown_rank_count_uses_fitted_model():
    truth = (3e-6, 2e-10, 1e-10)
    d = chooser_for([synthetic_entry(p=2, params=truth), synthetic_entry(p=8, local=8, params=truth)],
                    p=4, local=4)
    for n in [4, 1 << 12, 1 << 20, 1 << 26]:
        c = d.explain(n, 4)
        assert c.source == "model-fitted"
        assert c.algorithm == cheapest(4, n, truth)


def test_fit_machine_recovers_parameters():
    truth = (3e-6, 2e-10, 1e-10)
    a, b, g = tuning.fit_machine(synthetic_entry(p=4, local=4, params=truth))
    assert a == pytest.approx(truth[0], rel=1e-3)
    assert b == pytest.approx(truth[1], rel=1e-3)
    assert g == pytest.approx(truth[2], rel=1e-3)


def test_other_dtype_size_and_mpi_are_separate():
    d = chooser_for([synthetic_entry(dtype_size=8)])
    assert d.explain(1024, 4).source in ("model-fitted", "model")
    assert d.explain(1024, 8).source == "table"
    table = tuning.merge(tuning.empty_table(), synthetic_entry())
    exact, fitted, others = tuning.find_data(table, [2], "host", "Open MPI v5")
    assert not exact and not fitted and not others


def test_fit_alpha_beta_and_ranges():
    sizes = [4, 1024, 1 << 20]
    fit = tuning.fit_alpha_beta(sizes, [5e-6 + 1e-10 * n for n in sizes])
    assert fit["alpha"] == pytest.approx(5e-6, rel=1e-6)
    assert fit["beta"] == pytest.approx(1e-10, rel=1e-6)
    ranges = tuning.win_ranges([4, 8, 16, 32], {"a": [1, 1, 5, 5], "b": [2, 2, 1, 1]})
    assert ranges == [{"algorithm": "a", "min_bytes": 4, "max_bytes": 8},
                      {"algorithm": "b", "min_bytes": 16, "max_bytes": 32}]


def test_size_sweep_and_parse():
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("4") == 4 and parse_bytes("2k") == 2048
    assert size_sweep(4, 64, 4) == [4, 8, 16, 32, 64]
    assert size_sweep(4, 64, 4, odd=True) == [4, 8, 12, 16, 24, 32, 48, 64]
    assert size_sweep(1, 16, 8) == [8, 16]


class RecordingComm:
    """A communicator of one rank for crossover.sweep: records which recvbuf each algorithm's
    calls wrote (the allreduce of one rank is a copy)."""
    size, rank, stream = 1, 0, None

    class _topology:
        ranks_per_node = (1,)

    def __init__(self):
        self.recvbufs = {}

    def Allreduce(self, send, recv, algorithm):
        self.recvbufs.setdefault(algorithm, set()).add(recv.ctypes.data)
        recv[...] = send


@pytest.mark.parametrize("shared", [False, True])
def test_crossover_gives_each_algorithm_its_own_recvbuf(shared):
    """In a program, auto runs one algorithm per size on the caller's buffers, so the sweep
    times each algorithm on a recvbuf only it writes (2 ranks in the far placement: shm right
    after ring on the same recvbuf took 2.9x its time at 1 MiB and 5.1-5.5x at 2 MiB, and a
    shared recvbuf made the table choose ring, Rabenseifner or hierarchical there, issue 31).
    shared_recv=True: one for all."""
    from mpi4py import MPI
    from aluminum_py.bench.crossover import sweep
    comm = RecordingComm()
    algorithms = ["ring", "shm", "rabenseifner"]
    run = sweep(comm, MPI.COMM_SELF, [1 << 16], algorithms, "float32", iters=3,
                shared_recv=shared)
    assert run["sizes"] == [1 << 16] and run["fastest"][0] in algorithms
    assert all(len(bufs) == 1 for bufs in comm.recvbufs.values()), comm.recvbufs
    distinct = {next(iter(bufs)) for bufs in comm.recvbufs.values()}
    assert len(distinct) == (1 if shared else len(algorithms))


def test_crossover_map_merges_runs():
    r2 = {"ranks": 2, "sizes": [4, 8], "fastest": ["recursive_doubling", "ring"]}
    r4 = {"ranks": 4, "sizes": [4, 16], "fastest": ["mpi", "rabenseifner"]}
    ranks, sizes, cells = crossover_map([r2, r4])
    assert ranks == [2, 4] and sizes == [4, 8, 16]
    assert cells[(4, 16)] == "rabenseifner" and (2, 16) not in cells
    assert "ring" in format_map([r2, r4])


@pytest.mark.parametrize("bad", [{"times": [1, 2]}, {"fit": None, "sizes": [0, 4]},
                                 {"times": {"ring": [0.0, 1e-6]}}, {"comm_size": 0},
                                 {"times": {"ring": [float("nan"), 1e-6]}}])
def test_malformed_entries_are_dropped_with_a_warning(tmp_path, bad):
    entry = dict(synthetic_entry(sizes=[4, 8]), **bad)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "version": 2, "entries": {"k": entry}}))
    with pytest.warns(TuningWarning):
        assert tuning.load(str(path))["entries"] == {}


def test_stored_fit_is_recomputed_not_trusted(tmp_path):
    entry = dict(synthetic_entry(sizes=[4, 64, 1024]), fit={}, ranges="junk")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "version": 2, "entries": {"k": entry}}))
    loaded = tuning.load(str(path))["entries"][tuning.entry_key(entry)]
    assert set(loaded["fit"]) == set(loaded["times"]) and isinstance(loaded["ranges"], list)
    d = Chooser(2, {4: loaded}, {}, PARAMS, USABLE)
    assert d.explain(1 << 30, 4).source == "table-extrapolated"


def test_extrapolation_is_continuous_at_the_largest_size():
    e = synthetic_entry(sizes=[4, 1024, 1 << 20])
    d = chooser_for([e])
    assert d.explain(1 << 20, 4).algorithm == d.explain((1 << 20) + 4, 4).algorithm


def test_fit_for_another_element_size_is_used():
    d = chooser_for([synthetic_entry(p=4, local=4, dtype_size=4)], p=2, local=2)
    c = d.explain(1 << 20, 8)
    assert c.source == "model-fitted"


def test_merge_into_file_locks_and_keeps_entries(tmp_path):
    path = str(tmp_path / "t.json")
    tuning.merge_into_file(synthetic_entry(p=2), path)
    tuning.merge_into_file(synthetic_entry(p=4, local=4), path)
    import os
    assert len(tuning.load(path)["entries"]) == 2
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask     # not mkstemp's 0600


# ----------------------------------------------------------------- topology (issue 17)
def test_topology_of_a_layout_and_its_names():
    assert ranks_per_node((0, 0, 1, 1)) == (2, 2)
    assert ranks_per_node((0, 1, 0)) == (2, 1)
    assert ranks_per_node((0, 1, 2, 3)) == (1, 1, 1, 1)
    assert tuning.describe_topology(4, (2, 2)) == "4 ranks as 2 nodes x 2"
    assert tuning.describe_topology(4, (4,)) == "4 ranks as 1 node x 4"
    assert tuning.describe_topology(3, (2, 1)) == "3 ranks as 2 nodes (2+1)"
    keys = {tuning.make_key(4, rpn, "host", 4, MPI_NAME) for rpn in ([4], [2, 2], [1] * 4, [3, 1])}
    assert len(keys) == 4
    with pytest.raises(ValueError, match="topology of 4 ranks"):
        tuning.make_entry(4, [2, 1], "host", 4, MPI_NAME, [4], {"ring": [1e-6]})


def test_entry_records_its_topology_and_round_trips(tmp_path):
    path = str(tmp_path / "t.json")
    e = synthetic_entry(p=4, local=2)
    assert (e["nodes"], e["ranks_per_node"], e["local_size"]) == (2, [2, 2], 2)
    assert e["topology"] == "4 ranks as 2 nodes x 2"
    tuning.merge_into_file(e, path)
    tuning.merge_into_file(synthetic_entry(p=4, local=1), path)      # 4 nodes x 1: kept apart
    tuning.merge_into_file(synthetic_entry(p=4, local=4), path)      # 1 node x 4: kept apart
    raw = json.loads(open(path).read())
    assert raw["version"] == tuning.VERSION == 2 and len(raw["entries"]) == 3
    loaded = tuning.load(path)["entries"][tuning.entry_key(e)]
    assert loaded["ranks_per_node"] == [2, 2] and loaded["nodes"] == 2


def test_table_of_another_topology_never_serves():
    """Measured as 4 nodes x 1 (a network): a communicator of 4 ranks as 2 nodes x 2 or as one
    node x 4 gets the default cost model, and explain says why; the one it was measured on gets
    the table."""
    net = synthetic_entry(p=4, local=1)
    on_net = chooser_for([net], p=4, local=1)
    assert on_net.explain(1024, 4).source == "table"
    for local in (2, 4):
        c = chooser_for([net], p=4, local=local).explain(1024, 4)
        assert c.source == "model" and c.algorithm == cheapest(4, 1024, PARAMS)
        assert f"4 ranks as {4 // local} node" in c.detail
        assert "4 ranks as 4 nodes x 1 are not used: measured on another topology" in c.detail
    # uneven layouts are their own topology, in node order
    uneven = chooser_for([synthetic_entry(p=4, local=1)], p=3, ranks_per_node=[2, 1])
    assert uneven.explain(64, 4).source == "model"


def test_fitted_model_carries_over_only_within_a_shape():
    """Another rank count's entry may fit the cost model for the same shape (one node; or
    several nodes of the same ranks each), never across shapes."""
    truth = (3e-6, 2e-10, 1e-10)
    net8 = synthetic_entry(p=8, local=1, params=truth)
    c = chooser_for([net8], p=4, local=1).explain(1 << 20, 4)
    assert c.source == "model-fitted" and "8/8x1/host/4/" in c.detail
    for p, local in ((4, 4), (4, 2)):
        c = chooser_for([net8], p=p, local=local).explain(1 << 20, 4)
        assert c.source == "model" and "8 ranks as 8 nodes x 1" in c.detail
    two_by_two = synthetic_entry(p=4, local=2, params=truth)
    assert chooser_for([two_by_two], p=8, local=4).explain(64, 4).source == "model"


def test_version_1_tables_load(tmp_path):
    """A version 1 table (no topology recorded): an entry whose rank 0 node held every rank is
    one node's and serves that topology; any other is kept in the file but never used (its
    topology is unknown), explain names it, and a new measurement with the same rank count and
    rank 0 node size replaces it."""
    one_node = synthetic_entry(p=4, local=4)
    unknown = synthetic_entry(p=4, local=2)
    old = {}
    for e in (one_node, unknown):
        e = {k: v for k, v in e.items() if k not in ("nodes", "ranks_per_node", "topology")}
        old[f"{e['comm_size']}/{e['local_size']}/host/4/{MPI_NAME}"] = e
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "version": 1, "entries": old}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = tuning.load(str(path))
    entries = table["entries"]
    assert set(entries) == {tuning.make_key(4, [4], "host", 4, MPI_NAME),
                            tuning.make_key(4, None, "host", 4, MPI_NAME, local_size=2)}
    exact, fitted, others = tuning.find_data(table, (4,), "host", MPI_NAME)
    assert exact[4]["times"] == one_node["times"]
    exact, fitted, others = tuning.find_data(table, (2, 2), "host", MPI_NAME)
    assert not exact and not fitted
    assert "4 ranks, 2 on rank 0's node (topology not recorded)" in others
    tuning.merge(table, synthetic_entry(p=4, local=2))            # re-tuned: replaces it
    assert set(table["entries"]) == {tuning.make_key(4, [4], "host", 4, MPI_NAME),
                                     tuning.make_key(4, [2, 2], "host", 4, MPI_NAME)}
    tuning.save(table, str(path))
    assert json.loads(path.read_text())["version"] == 2


@pytest.mark.parametrize("bad", [{"ranks_per_node": [2, 1]}, {"ranks_per_node": [0, 2]},
                                 {"ranks_per_node": [1, 1], "local_size": 2}])
def test_bad_topology_drops_the_entry(tmp_path, bad):
    entry = dict(synthetic_entry(sizes=[4, 8]), **bad)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "version": 2, "entries": {"k": entry}}))
    with pytest.warns(TuningWarning):
        assert tuning.load(str(path))["entries"] == {}


# -- "shm" in the cost model: only with a segment, from AL_SHM_SYNC/AL_SHM_BYTE or fitted

SHM_LIMITS = (64 << 10, 1 << 20)
SHM_DEFAULT = (2e-7, 2.7e-11)


def shm_chooser(entries=(), p=2, local=2, usable=USABLE + ("shm",), limits=SHM_LIMITS,
                shm_params=SHM_DEFAULT):
    table = tuning.empty_table()
    for e in entries:
        tuning.merge(table, e)
    rpn = (local,) * (p // local)
    exact, fitted, others = tuning.find_data(table, rpn, "host", MPI_NAME)
    data = tuning.TuningData(exact, fitted, PARAMS, rpn, others, shm_params)
    return Chooser.from_data(data, usable, shm_limits=limits)


def test_model_chooses_shm_only_with_a_segment():
    from aluminum_py.algorithms import ShmCost, model_choice
    cost = ShmCost(*SHM_DEFAULT, *SHM_LIMITS)
    sizes = [4, 4096, 1 << 16, 1 << 20, 1 << 26]
    for p in (2, 3, 4):
        with_segment = shm_chooser(p=p, local=p)
        for n in sizes:
            c = with_segment.explain(n, 4)
            assert c.source == "model" and c.algorithm == model_choice(p, n, PARAMS, cost)
            assert "shm sync=2e-07 s, byte=2.7e-11 s/B" in c.detail
            assert f"{c.algorithm} " in c.detail.split(": ")[-1]       # its predicted time
        assert {with_segment.choose(n, 4) for n in sizes} == {"shm"}
        # no segment (several nodes, AL_SHM_SLOT_BYTES=0, a failed setup): shm not a candidate
        for chooser in (shm_chooser(p=p, local=p, usable=USABLE),
                        shm_chooser(p=p, local=p, limits=None)):
            for n in sizes:
                c = chooser.explain(n, 4)
                assert c.algorithm == cheapest(p, n, PARAMS) and "shm" not in c.detail
    # rank 0's AL_SHM_SYNC/AL_SHM_BYTE decide: a slow machine's shm loses to the others
    slow = shm_chooser(shm_params=(1e-4, 1e-9))
    assert [slow.choose(n, 4) for n in sizes] == [cheapest(2, n, PARAMS) for n in sizes]


def shm_entry(p, params=(3e-6, 2e-10, 1e-10), shm=(4e-7, 3e-11), call=2e-6):
    """A one-node entry whose times follow the cost model plus a per-call cost `call` that
    every algorithm pays, shm included."""
    from aluminum_py.algorithms import ShmCost, shm_time
    sizes = [4 << k for k in range(0, 25, 2)]
    times = {a: [call + model_time(a, p, n, params) for n in sizes] for a in MODELLED}
    times["shm"] = [call + shm_time(p, n, ShmCost(*shm, *SHM_LIMITS)) for n in sizes]
    return tuning.make_entry(p, [p], "host", 4, MPI_NAME, sizes, times)


def test_fit_recovers_the_shm_formula_and_the_call_cost():
    entry = shm_entry(4)
    abg, shm = tuning.fit_models(entry, SHM_LIMITS)
    assert abg == pytest.approx((3e-6, 2e-10, 1e-10), rel=1e-3)
    assert shm == pytest.approx((4e-7, 3e-11), rel=1e-3)
    assert tuning.fit_models(entry, None)[1] is None          # no segment: shm not fitted
    assert tuning.fit_machine(entry) == pytest.approx((3e-6, 2e-10, 1e-10), rel=1e-3)


def test_fitted_shm_decides_for_another_rank_count(monkeypatch):
    """A 2-rank entry with shm times serves 4 ranks on one node through the fitted formulas;
    one without shm times leaves shm out of the fitted model, and explain says so."""
    from aluminum_py.algorithms import ShmCost, model_choice
    monkeypatch.setenv("AL_SHM_SLOT_BYTES", str(SHM_LIMITS[1]))
    monkeypatch.setenv("AL_SHM_SMALL_BYTES", str(SHM_LIMITS[0]))
    slow_shm = (4e-7, 4e-10)             # wins small messages only
    d = shm_chooser([shm_entry(2, shm=slow_shm)], p=4, local=4)
    truth = ShmCost(*slow_shm, *SHM_LIMITS)
    picks = []
    for n in [4, 1024, 1 << 16, 1 << 20, 1 << 26]:
        c = d.explain(n, 4)
        assert c.source == "model-fitted" and "shm sync=" in c.detail
        assert c.algorithm == model_choice(4, n, (3e-6, 2e-10, 1e-10), truth)
        picks.append(c.algorithm)
    assert picks[0] == "shm" and picks[-1] != "shm"
    without = shm_chooser([synthetic_entry(p=2)], p=4, local=4)
    c = without.explain(4, 4)
    assert c.source == "model-fitted" and c.algorithm != "shm"
    assert "shm not modelled (the entry has no shm times" in c.detail


def test_table_with_shm_times_decides_by_measurement():
    e = shm_entry(2, shm=(4e-7, 4e-10))
    d = shm_chooser([e])
    for i, n in enumerate(e["sizes"]):
        best = min(e["times"], key=lambda a: e["times"][a][i])
        assert d.explain(n, 4).algorithm == best and d.explain(n, 4).source == "table"
    assert {d.choose(n, 4) for n in e["sizes"]} >= {"shm", "rabenseifner"}
    # the same table for a communicator without a segment: shm is never picked
    assert "shm" not in {shm_chooser([e], usable=USABLE).choose(n, 4) for n in e["sizes"]}


def test_table_without_shm_times_says_so():
    """A table tuned before shm existed still decides (measured), and explain says that shm
    can only be chosen after tuning again; without a segment nothing is said."""
    e = synthetic_entry()
    c = shm_chooser([e]).explain(1024, 4)
    assert c.source == "table" and c.algorithm != "shm"
    assert c.detail.endswith("(the entry has no shm times: tune again to let auto choose shm)")
    assert "shm" not in shm_chooser([e], limits=None).explain(1024, 4).detail


# ------------------------------------------------------------------ deciding within noise
def test_median_interval_covers_the_median_and_narrows_with_samples():
    from aluminum_py.bench.timing import median_interval
    rng = np.random.default_rng(3)
    few, many = rng.exponential(1.0, 25), rng.exponential(1.0, 2500)
    for s in (few, many):
        lo, hi = median_interval(s)
        assert lo <= np.median(s) <= hi
    assert np.subtract(*median_interval(many)[::-1]) < np.subtract(*median_interval(few)[::-1])
    assert median_interval([5.0]) == (5.0, 5.0)


def test_decide_clear_noisy_and_worst_case():
    from aluminum_py.bench.timing import decide
    rng = np.random.default_rng(4)
    fast, slow = 1.0 + 0.01 * rng.random(200), 2.0 + 0.01 * rng.random(200)
    d = decide({"a": slow, "b": fast})
    assert d["best"] == "b" and d["clear"] and d["decided"] == "median"
    assert d["margin"] == pytest.approx(np.median(slow) / np.median(fast))
    # the same typical time; "steady" is never slow, "bimodal" is 3x slower a third of the time
    # and its median is a hair lower: within noise, the better worst case wins
    steady = np.linspace(0.999, 1.005, 300)
    bimodal = np.concatenate([np.linspace(0.998, 1.0025, 200), np.full(100, 3.0)])
    d = decide({"steady": steady, "bimodal": bimodal})
    assert not d["clear"] and d["decided"] == "worst case" and d["best"] == "steady"
    assert d["runner_up"] == "bimodal" and d["margin"] < 1
    assert decide({"only": steady})["best"] == "only"


def test_table_choice_is_followed_and_explained():
    """An entry with the crossover's decisions: at a measured size "auto" takes the recorded
    choice even where another median is lower (within noise, the better worst case), and
    explain says so; an entry without them takes the lowest median, as before."""
    sizes = [1024, 4096]
    times = {"ring": [10e-6, 20e-6], "rabenseifner": [9.9e-6, 40e-6]}
    plain = tuning.make_entry(2, [2], "host", 4, MPI_NAME, sizes, times)
    assert chooser_for([plain]).explain(1024, 4).algorithm == "rabenseifner"
    e = tuning.make_entry(2, [2], "host", 4, MPI_NAME, sizes, times, choice=["ring", "ring"],
                          margin=[0.99, 2.0], decided=["worst case", "median"])
    e = tuning.validate_entry(json.loads(json.dumps(e)))
    c = chooser_for([e]).explain(1024, 4)
    assert c.algorithm == "ring" and "90th percentile" in c.detail
    assert "next rabenseifner" in c.detail
    assert chooser_for([e]).explain(4096, 4).algorithm == "ring"
    assert e["ranges"] == [{"algorithm": "ring", "min_bytes": 1024, "max_bytes": 4096}]


@pytest.mark.parametrize("field,value", [("choice", ["ring"]), ("choice", ["ring", "nope"]),
                                         ("margin", [1.0, -1.0]), ("margin", "1"),
                                         ("decided", ["median", "maybe"])])
def test_validate_entry_refuses_bad_decisions(field, value):
    e = tuning.make_entry(2, [2], "host", 4, MPI_NAME, [1024, 4096],
                          {"ring": [1e-5, 2e-5], "rabenseifner": [2e-5, 3e-5]})
    e[field] = value
    with pytest.raises(ValueError, match=field):
        tuning.validate_entry(json.loads(json.dumps(e)))


def test_time_interleaved_reports_every_call_to_after_call():
    """time_interleaved's after_call sees each contender once per iteration, in the order the
    calls ran (each iteration's own random order), and the samples keep their shape."""
    from mpi4py import MPI
    from aluminum_py.bench.timing import time_interleaved
    ran, seen = [], []
    calls = {name: (lambda name=name: ran.append(name)) for name in ("a", "b", "c")}
    samples = time_interleaved(MPI.COMM_SELF, calls, 5, salt=7,
                               after_call=lambda i, it: seen.append(("abc"[i], it)))
    assert [name for name, _ in seen] == ran
    assert sorted(seen) == [(n, it) for n in "abc" for it in range(5)]
    assert [it for _, it in seen] == sorted(it for _, it in seen)
    assert {k: v.shape for k, v in samples.items()} == {k: (5,) for k in "abc"}


def test_time_interleaved_draws_every_order_before_the_first_call(monkeypatch):
    """No generator is made between timed calls (at 4 ranks on 2 cores the Python that makes one
    made the last call of each iteration 2-3x slower), and the orders are the seeded ones: the
    same on every rank, each iteration a permutation of the contenders."""
    from mpi4py import MPI
    import aluminum_py.bench.timing as timing
    ran, made_at = [], []
    real = np.random.default_rng

    def counting_rng(*a, **kw):
        made_at.append(len(ran))
        return real(*a, **kw)
    monkeypatch.setattr(timing.np.random, "default_rng", counting_rng)
    calls = {name: (lambda name=name: ran.append(name)) for name in "abcd"}
    timing.time_interleaved(MPI.COMM_SELF, calls, 6, salt=11)
    assert made_at and set(made_at) == {0}
    orders = timing.interleaved_orders(4, 6, salt=11)
    assert ran == ["abcd"[i] for order in orders for i in order]
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    assert orders == [real([11, it]).permutation(4).tolist() for it in range(6)]


def test_time_interleaved_runs_of_calls_time_the_last():
    """With run=3 each contender's turn is three calls in a row, in the iteration's order, and
    only the third is timed: a contender whose first two calls of a turn are slow has the
    third call's time as its sample."""
    import time
    from mpi4py import MPI
    from aluminum_py.bench.timing import interleaved_orders, time_interleaved
    ran = []
    turn = {"a": 0, "b": 0}

    def call(name):
        def f():
            ran.append(name)
            turn[name] += 1
            if turn[name] % 3 != 0:          # the untimed calls of a turn: slow
                time.sleep(0.02)
        return f
    samples = time_interleaved(MPI.COMM_SELF, {"a": call("a"), "b": call("b")}, 4, salt=3,
                               run=3)
    orders = interleaved_orders(2, 4, salt=3)
    assert ran == ["ab"[i] for order in orders for i in order for _ in range(3)]
    assert all(v.shape == (4,) and v.max() < 0.015 for v in samples.values()), samples


def test_iterations_are_not_cut_by_one_slow_first_call():
    """One slow first call (a peer's warm-up) does not set the iteration count: where a round
    is short against the budget, three are timed and each contender counts its median; a
    round as long as a tenth of the budget is not repeated."""
    import time
    from mpi4py import MPI
    from aluminum_py.bench.timing import iterations
    calls = []

    def slow_first():
        calls.append("a")
        time.sleep(0.05 if calls.count("a") == 1 else 0.001)

    def steady():
        calls.append("b")
        time.sleep(0.001)
    n = iterations(MPI.COMM_SELF, {"a": slow_first, "b": steady}, budget=0.6)
    assert calls == ["a", "b"] * 3
    assert 150 <= n <= 300          # 0.6 s over 2 ms a round (sleeps run over); one round: 11
    calls.clear()
    n = iterations(MPI.COMM_SELF, {"a": slow_first, "b": steady}, budget=0.3, lo=3)
    assert calls == ["a", "b"] and n == 5     # 0.3 s over the one round of 52 ms


@pytest.mark.parametrize("nbytes", [(4 << 20) + 4, 8 << 20, 16 << 20])
def test_every_contenders_recvbuf_lies_on_huge_pages_alike(nbytes):
    """From 4 MiB (where numpy asks for transparent huge pages) each recvbuf starts at the
    sendbuf's offset into a 2 MiB page, in a mapping of its own, on huge pages only within the
    2 MiB pages wholly inside it: so every contender's recvbuf alike (fresh 4 MiB arrays lay
    half or wholly on them by the luck of their address, and MPICH's single copy into one wholly
    on them took 0.77-0.86x the time: issue 31).  Below 4 MiB: the 4 KiB page offset only."""
    import sys
    from aluminum_py.bench.timing import HUGE_PAGE, recvbuf_like
    from aluminum_py.testing import huge_share
    send = np.ones(nbytes // 4, np.float32)
    recvs = [recvbuf_like(send) for _ in range(3)]
    for r in recvs:
        assert r.shape == send.shape and r.dtype == send.dtype and not r.any()
        assert r.ctypes.data % HUGE_PAGE == send.ctypes.data % HUGE_PAGE
        r[:] = 2                                      # writable; touch every page
    little = np.ones(1000, np.float32)
    assert recvbuf_like(little).ctypes.data % 4096 == little.ctypes.data % 4096
    if not sys.platform.startswith("linux"):
        return
    shares = [huge_share(r) for r in recvs]
    if np.isnan(shares).any():
        pytest.skip("/proc/kpageflags is not readable (not root)")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" in thp:
        assert shares == [0.0] * 3
        return
    inside = ((send.ctypes.data + nbytes) // HUGE_PAGE * HUGE_PAGE
              - -(-send.ctypes.data // HUGE_PAGE) * HUGE_PAGE)
    pages = (recvs[0].ctypes.data + nbytes - 1) // 4096 - recvs[0].ctypes.data // 4096 + 1
    assert shares == [shares[0]] * 3 and shares[0] <= inside / 4096 / pages + 1e-9
