"""auto's rule and the tuning table: round trips, merging, bad files, where a table overrides
the cost model, the crossover's timing (single process)."""
import json
import os

import numpy as np
import pytest

from aluminum_py import tuning
from aluminum_py.algorithms import MODELLED, ShmCost, model_choice, model_time
from aluminum_py.bench.plots import crossover_map, format_map
from aluminum_py.bench.timing import parse_bytes, size_sweep
from aluminum_py.topology import ranks_per_node
from aluminum_py.tuning import Chooser, TuningWarning

from cost_reference import cheapest

MPI_NAME = "MPICH Version: 5.0.2"
USABLE = ("mpi",) + MODELLED
PARAMS = (2e-6, 1.6e-10, 1e-10)
SHM_LIMITS = (64 << 10, 1 << 20, 0, 0)
SHM_PARAMS = (2e-7, 2.7e-11)
SIZES = [4 << k for k in range(0, 25, 2)]


def synthetic_entry(p=2, local=2, dtype_size=4, sizes=None, params=(3e-6, 2e-10, 1e-10),
                    passes=3):
    """Times from the cost model (so the truth is known) plus an 'mpi' that is 10% slower
    than the best modelled algorithm, the same in each of `passes` passes; measured on
    p // local nodes of `local` ranks."""
    sizes = sizes or SIZES
    times = {a: [model_time(a, p, n, params) for n in sizes] for a in MODELLED}
    times["mpi"] = [1.1 * min(times[a][i] for a in MODELLED) for i in range(len(sizes))]
    return tuning.make_entry(p, [local] * (p // local), "host", dtype_size, MPI_NAME, sizes,
                             [times] * passes)


def chooser_for(entries=(), p=2, local=2, ranks_per_node=None, usable=USABLE, limits=None,
                shm_params=SHM_PARAMS):
    """The Chooser of a communicator of p ranks, p // local nodes of `local` ranks (or the
    given ranks_per_node), with a table of `entries` (`limits`: its segment's)."""
    table = tuning.empty_table()
    for e in entries:
        tuning.merge(table, e)
    rpn = tuple(ranks_per_node or [local] * (p // local))
    exact, others = tuning.find_data(table, rpn, "host", MPI_NAME)
    data = tuning.TuningData(exact, PARAMS, rpn, others, shm_params)
    return Chooser.from_data(data, usable, shm_limits=limits)


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
    assert loaded["entries"][key]["passes"] == e2["passes"] and len(e2["passes"]) == 3
    again = synthetic_entry(p=2, sizes=[4, 8])        # same configuration: replaced
    tuning.save(tuning.merge(loaded, again), path)
    final = tuning.load(path)
    assert len(final["entries"]) == 2 and final["entries"][key]["sizes"] == [4, 8]


def test_entry_times_are_the_median_over_passes():
    e = tuning.make_entry(2, [2], "host", 4, MPI_NAME, [4, 8],
                          [{"ring": [1.0, 5.0]}, {"ring": [3.0, 4.0]}, {"ring": [2.0, 9.0]}])
    assert e["times"] == {"ring": [2.0, 5.0]}
    one = tuning.make_entry(2, [2], "host", 4, MPI_NAME, [4, 8], {"ring": [1.0, 5.0]})
    assert "passes" not in one and tuning.validate_entry(one)["passes"] == [one["times"]]


def test_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("AL_TUNING_FILE", str(tmp_path / "x.json"))
    assert tuning.default_path() == str(tmp_path / "x.json")
    monkeypatch.delenv("AL_TUNING_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.default_path() == str(tmp_path / "aluminum_py" / "tuning.json")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": tuning.FORMAT, "version": 0, "entries": {}}),
                                     json.dumps({"format": tuning.FORMAT, "version": 1, "entries": {}}),
                                     json.dumps({"format": tuning.FORMAT, "version": 2}),
                                     json.dumps([1, 2, 3])])
def test_corrupt_or_old_files_warn_and_fall_back(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.warns(TuningWarning):
        table = tuning.load(str(path))
    assert table["entries"] == {}
    choice = chooser_for().explain(1024, 4)
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


@pytest.mark.parametrize("bad", [{"times": [1, 2]}, {"sizes": [0, 4]},
                                 {"times": {"ring": [0.0, 1e-6]}}, {"comm_size": 0},
                                 {"times": {"ring": [float("nan"), 1e-6]}},
                                 {"passes": {"ring": [1e-6, 1e-6]}}, {"passes": []},
                                 {"passes": [{"ring": [1e-6, 1e-6]}]},       # other algorithms
                                 {"ranks_per_node": [2, 1]}, {"ranks_per_node": [0, 2]},
                                 {"ranks_per_node": [1, 1], "local_size": 2}])
def test_malformed_entries_are_dropped_with_a_warning(tmp_path, bad):
    entry = dict(synthetic_entry(sizes=[4, 8]), **bad)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "version": 2, "entries": {"k": entry}}))
    with pytest.warns(TuningWarning):
        assert tuning.load(str(path))["entries"] == {}


def test_merge_into_file_locks_and_keeps_entries(tmp_path):
    path = str(tmp_path / "t.json")
    tuning.merge_into_file(synthetic_entry(p=2), path)
    tuning.merge_into_file(synthetic_entry(p=4, local=4), path)
    assert len(tuning.load(path)["entries"]) == 2
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.json.lock"]


def test_a_save_killed_before_the_rename_leaves_no_temporary_file(tmp_path, monkeypatch):
    """An error between the write and the rename removes the temporary file at once, and one
    that a killed writer left (no handler ran) is taken over by the next save: no temporary
    file survives either, and the table is the last complete one."""
    path = str(tmp_path / "t.json")
    tuning.merge_into_file(synthetic_entry(p=2), path)

    def killed(src, dst):
        raise KeyboardInterrupt                      # between the write and the rename
    monkeypatch.setattr(tuning.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        tuning.merge_into_file(synthetic_entry(p=4, local=4), path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.json.lock"]
    assert len(tuning.load(path)["entries"]) == 1
    # what a SIGKILL between the write and the rename leaves: the temporary file, written
    with open(path + ".tmp", "w") as f:
        f.write('{"half": ')
    tuning.merge_into_file(synthetic_entry(p=4, local=4), path)
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.json.lock"]
    assert len(tuning.load(path)["entries"]) == 2
    # a link planted at the temporary name is replaced, not followed
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, path + ".tmp")
    tuning.merge_into_file(synthetic_entry(p=2, sizes=[4, 8]), path)
    assert victim.read_text() == "keep" and not os.path.lexists(path + ".tmp")


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


def test_size_sweep_and_parse():
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("4") == 4 and parse_bytes("2k") == 2048
    assert size_sweep(4, 64, 4) == [4, 8, 16, 32, 64]
    assert size_sweep(4, 64, 4, odd=True) == [4, 8, 12, 16, 24, 32, 48, 64]
    assert size_sweep(1, 16, 8) == [8, 16]


# ---- the rule without a table: the cost model

def test_the_model_decides_without_a_table():
    """One node with a segment: the shm formula against the alpha-beta model (shm at every
    size with the default parameters); without a segment, or across nodes, the alpha-beta
    model; rank 0's AL_SHM_SYNC/AL_SHM_BYTE decide (a slow machine's shm loses)."""
    cost = ShmCost(*SHM_PARAMS, *SHM_LIMITS)
    for p in (2, 3, 4):
        one = chooser_for(p=p, local=p, usable=USABLE + ("shm",), limits=SHM_LIMITS)
        for n in SIZES:
            c = one.explain(n, 4)
            assert c.source == "model" and c.algorithm == model_choice(p, n, PARAMS, cost)
            assert c.detail.startswith("one node, cost model") and "shm formula" in c.detail
            assert f"no tuning entry for {p} ranks as 1 node x {p}" in c.detail
        assert {one.choose(n, 4) for n in SIZES} == {"shm"}
        for c in (chooser_for(p=p, local=p), chooser_for(p=p, local=1)):
            assert [c.choose(n, 4) for n in SIZES] == [cheapest(p, n, PARAMS) for n in SIZES]
    assert chooser_for(p=4, local=1).explain(64, 4).detail.startswith("4 nodes, cost model")
    slow = chooser_for(usable=USABLE + ("shm",), limits=SHM_LIMITS, shm_params=(1e-4, 1e-9))
    assert [slow.choose(n, 4) for n in SIZES] == [cheapest(2, n, PARAMS) for n in SIZES]


def test_one_rank_is_forced():
    c = chooser_for(p=1, local=1, usable=USABLE + ("shm",), limits=SHM_LIMITS).explain(64, 4)
    assert c.source == "forced" and "one rank" in c.detail


def test_same_inputs_give_the_same_choice():
    """No state: a Chooser answers the same, call after call, and a second one alike."""
    e = overriding_entry()
    a, b = chooser_for([e]), chooser_for([e])
    first = [str(a.explain(n, 4)) for n in SIZES]
    for _ in range(3):
        assert [str(a.explain(n, 4)) for n in SIZES] == first
    assert [str(b.explain(n, 4)) for n in SIZES] == first


# ---- where a table overrides the model

def model_times_for(p, sizes, params=PARAMS):
    return {a: [model_time(a, p, n, params) for n in sizes] for a in MODELLED}


def overriding_entry(p=2, sizes=SIZES, factor=0.5, at=range(6, 9), noise=(1.0, 1.02, 0.99),
                     alg="mpi"):
    """Passes whose modelled algorithms take the model's times (times `noise[k]` in pass k) and
    whose `alg` takes the model choice's time times `factor` at the sizes `at`, 3x elsewhere."""
    base = model_times_for(p, sizes)
    best = [min(base[a][i] for a in MODELLED) for i in range(len(sizes))]
    passes = []
    for k, f in enumerate(noise):
        t = {a: [x * f for x in ts] for a, ts in base.items()}
        t[alg] = [best[i] * f * (factor if i in at else 3.0) for i in range(len(sizes))]
        passes.append(t)
    return tuning.make_entry(p, [p], "host", 4, MPI_NAME, sizes, passes)


def test_a_margin_beyond_noise_over_neighbouring_sizes_overrides_the_model():
    e = overriding_entry()
    c = chooser_for([e])
    lo, hi = SIZES[6], SIZES[8]
    for i, n in enumerate(SIZES):
        got = c.explain(n, 4)
        if lo <= n <= hi:
            assert got.algorithm == "mpi" and got.source == "table", got
            assert f"overrides the model's {cheapest(2, lo, PARAMS)} from {lo} to {hi} B" in got.detail
            assert "in each of 3 passes" in got.detail and "spread between passes 3%" in got.detail
        else:
            assert got.algorithm == cheapest(2, n, PARAMS) and got.source == "model", got
            assert "no override at this size" in got.detail
    # between two measured sizes of the range too; past its ends the model
    assert c.choose(lo + 1, 4) == "mpi" and c.choose(hi + 1, 4) == cheapest(2, hi + 1, PARAMS)
    [o] = c.overrides[4]
    assert (o.algorithm, o.min_bytes, o.max_bytes) == ("mpi", lo, hi)
    assert o.margin == pytest.approx(2.0)
    assert o.spread == pytest.approx(1.02 / 0.99 - 1)


def test_a_single_size_is_an_island_not_an_override():
    c = chooser_for([overriding_entry(at=[6])])
    assert {c.explain(n, 4).source for n in SIZES} == {"model"}
    assert c.overrides[4] == []


def test_a_margin_within_the_spread_between_passes_keeps_the_model():
    """mpi 1.10x faster in the median, but a contender's times move 1.25x between passes."""
    c = chooser_for([overriding_entry(factor=1 / 1.10, noise=(1.0, 1.25, 1.1))])
    assert {c.explain(n, 4).source for n in SIZES} == {"model"}
    # the same lead with passes that agree overrides
    c = chooser_for([overriding_entry(factor=1 / 1.10, noise=(1.0, 1.01, 1.0))])
    assert c.choose(SIZES[7], 4) == "mpi"


def test_a_lead_in_some_passes_only_keeps_the_model():
    """mpi 2x faster in two passes, slower in the third: the margin is the worst pass's."""
    e = overriding_entry()
    e["passes"][1]["mpi"] = [t * 4 for t in e["passes"][1]["mpi"]]
    assert chooser_for([e]).overrides[4] == []


def test_fewer_than_three_passes_never_override():
    e = overriding_entry(noise=(1.0, 1.0))
    c = chooser_for([e]).explain(SIZES[7], 4)
    assert c.source == "model" and "2 passes, 3 needed to override" in c.detail
    one = chooser_for([overriding_entry(noise=(1.0,))]).explain(SIZES[7], 4)
    assert one.source == "model" and "1 pass, 3 needed" in one.detail


def test_an_override_of_an_algorithm_auto_may_not_use_is_ignored():
    e = overriding_entry(alg="hierarchical")
    assert chooser_for([e], usable=USABLE).overrides[4] == []
    assert chooser_for([e], usable=USABLE + ("hierarchical",)).choose(SIZES[7], 4) == "hierarchical"


def test_verdicts_and_overrides():
    sizes = [4, 8, 16, 32, 64]
    model = ["a"] * 5
    passes = [{"a": [1.0] * 5, "b": [2, 0.5, 0.5, 2, 0.5], "c": [2, 0.8, 0.6, 0.6, 2]}] * 3
    found = tuning.verdicts(sizes, passes, model, ("a", "b", "c"))
    assert [vs[0].algorithm for vs in found] == ["b", "b", "b", "c", "b"]
    assert found[0][0].margin == 0.5 and not found[0][0].beyond_noise
    # b beats the model at 8..16 (and 64: an island), c at 8..32: both ranges, which overlap
    assert tuning.overrides(sizes, found) == [
        tuning.Override("b", "a", 8, 16, 2.0, 0.0, (2.0, 2.0)),
        tuning.Override("c", "a", 8, 32, 1.25, 0.0, (1.25, 1 / 0.6, 1 / 0.6))]
    # where they overlap, the larger margin at the measured size at or below
    entry = tuning.make_entry(2, [2], "host", 4, MPI_NAME, sizes, passes)
    c = Chooser(lambda n, ds: tuning.Choice("a", "model", "m"), {4: entry}, ("a", "b", "c"))
    assert [c.choose(n, 4) for n in (4, 8, 12, 16, 24, 32, 48, 64)] == \
        ["a", "b", "b", "b", "c", "c", "a", "a"]
    # the model's choice not timed (GPU "ht_auto"): nothing compares
    assert tuning.verdicts(sizes, passes, ["x"] * 5, ("a", "b")) == [[]] * 5


def test_a_range_is_one_algorithms_even_where_another_wins_a_size_in_it():
    """mpi 2x faster than the model from 16 KiB to 1 MiB; hierarchical 2.5x at 256 KiB alone:
    the range is mpi's, whole (per-size winners would leave islands only)."""
    e = overriding_entry(at=range(6, 10))
    for p in e["passes"]:
        p["hierarchical"] = [t * 3 for t in p["mpi"]]
        p["hierarchical"][8] = p["mpi"][8] / 1.25
    [o] = chooser_for([e], usable=USABLE + ("hierarchical",)).overrides[4]
    assert (o.algorithm, o.min_bytes, o.max_bytes) == ("mpi", SIZES[6], SIZES[9])


def test_table_of_another_topology_never_serves():
    """Measured as 4 nodes x 1 (a network): a communicator of 4 ranks as 2 nodes x 2 or as one
    node x 4 gets the cost model, and explain says why; the one it was measured on gets the
    table."""
    net = overriding_entry(p=4)
    net.update(ranks_per_node=[1] * 4, local_size=1, nodes=4)
    assert chooser_for([net], p=4, local=1).explain(SIZES[7], 4).source == "table"
    for local in (2, 4):
        c = chooser_for([net], p=4, local=local).explain(SIZES[7], 4)
        assert c.source == "model" and c.algorithm == cheapest(4, SIZES[7], PARAMS)
        assert "4 ranks as 4 nodes x 1 are not used: measured on another topology" in c.detail


def test_other_dtype_size_and_mpi_are_separate():
    e = overriding_entry()
    e["dtype_size"] = 8
    c = chooser_for([e])
    assert c.explain(SIZES[7], 4).source == "model"
    assert c.explain(SIZES[7], 8).source == "table"
    table = tuning.merge(tuning.empty_table(), e)
    assert tuning.find_data(table, [2], "host", "Open MPI v5") == ({}, ())


def test_gpu_model_without_a_table():
    c = Chooser(tuning.gpu_model, {}, ("nccl", "ht_ring")).explain(1024, 4)
    assert c.source == "model" and c.algorithm in ("nccl", "ht_auto")


# ---- the crossover

class RecordingComm:
    """A communicator of one rank for crossover.sweep: records which recvbuf each algorithm's
    calls wrote (the allreduce of one rank is a copy)."""
    size, rank, stream = 1, 0, None

    class _topology:
        ranks_per_node = (1,)

    class _host:
        chooser = Chooser(tuning.Model(1, 1, ("ring",), PARAMS, None), {}, ("ring",))

    def __init__(self):
        self.recvbufs = {}

    def Allreduce(self, send, recv, algorithm):
        self.recvbufs.setdefault(algorithm, set()).add(recv.ctypes.data)
        recv[...] = send


@pytest.mark.parametrize("shared", [False, True])
def test_crossover_gives_each_algorithm_its_own_recvbuf(shared):
    """In a program, auto runs one algorithm per size on the caller's buffers, so the sweep
    times each algorithm on a recvbuf only it writes (2 ranks: shm right after ring on the same
    recvbuf took 2.9x its time at 1 MiB, 5.1-5.5x at 2 MiB).  shared_recv=True: one for all.
    Each pass's medians, the model's choice and the verdicts are recorded."""
    from mpi4py import MPI
    from aluminum_py.bench.crossover import sweep
    comm = RecordingComm()
    algorithms = ["ring", "shm", "rabenseifner"]
    run = sweep(comm, MPI.COMM_SELF, [1 << 16], algorithms, "float32", iters=3,
                shared_recv=shared, passes=1)
    assert run["sizes"] == [1 << 16] and run["fastest"][0] in algorithms
    assert all(len(bufs) == 1 for bufs in comm.recvbufs.values()), comm.recvbufs
    distinct = {next(iter(bufs)) for bufs in comm.recvbufs.values()}
    assert len(distinct) == (1 if shared else len(algorithms))
    run = sweep(RecordingComm(), MPI.COMM_SELF, [4, 8], algorithms, "float32", iters=3,
                passes=3)
    assert [len(p["ring"]) for p in run["passes"]] == [2, 2, 2]
    assert run["model"] == ["ring", "ring"] and len(run["verdicts"]) == 2


def test_crossover_describes_where_it_overrides_and_where_it_keeps_the_model():
    from aluminum_py.bench.crossover import describe_overrides
    e = overriding_entry(at=[2, 3, 9])
    model = [cheapest(2, n, PARAMS) for n in SIZES]
    found = tuning.verdicts(SIZES, e["passes"], model, USABLE)
    run = {"sizes": SIZES, "passes": e["passes"],
           "verdicts": [[list(v) for v in vs] for vs in found]}
    text = "\n".join(describe_overrides(run))
    assert f"overrides the model: mpi 64 B..256 B (the model's {model[2]}; at least 2.00x" in text
    assert f"keeps the model at {len(SIZES) - 2} of {len(SIZES)} sizes" in text
    assert "islands, not used): mpi at 1 MiB (2.00x)" in text
    short = dict(run, passes=e["passes"][:1])
    assert "1 passes: the table overrides the model only with 3" in describe_overrides(short)[0]


def test_crossover_map_merges_runs():
    r2 = {"ranks": 2, "sizes": [4, 8], "fastest": ["recursive_doubling", "ring"]}
    r4 = {"ranks": 4, "sizes": [4, 16], "fastest": ["mpi", "rabenseifner"]}
    ranks, sizes, cells = crossover_map([r2, r4])
    assert ranks == [2, 4] and sizes == [4, 8, 16]
    assert cells[(4, 16)] == "rabenseifner" and (2, 16) not in cells
    assert "ring" in format_map([r2, r4])


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


def test_iterations_are_not_cut_by_one_slow_first_call(monkeypatch):
    """One slow first call (a peer's warm-up) does not set the iteration count: where a round
    is short against the budget, three are timed and each contender counts its median; a
    round as long as a tenth of the budget is not repeated.  The contenders advance a fake
    clock, so the counts do not depend on how busy the machine is."""
    from mpi4py import MPI
    from aluminum_py.bench import timing
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    calls = []

    def slow_first():
        calls.append("a")
        now[0] += 0.05 if calls.count("a") == 1 else 0.001

    def steady():
        calls.append("b")
        now[0] += 0.001
    n = timing.iterations(MPI.COMM_SELF, {"a": slow_first, "b": steady}, budget=0.6)
    assert calls == ["a", "b"] * 3
    assert 299 <= n <= 300          # 0.6 s over the median round of 2 ms; one round alone: 11
    calls.clear()
    n = timing.iterations(MPI.COMM_SELF, {"a": slow_first, "b": steady}, budget=0.3, lo=3)
    assert calls == ["a", "b"] and n == 5     # 0.3 s over the one round of 51 ms


@pytest.mark.parametrize("nbytes", [(4 << 20) + 4, 8 << 20, 16 << 20])
def test_every_contenders_recvbuf_lies_on_huge_pages_alike(nbytes):
    """From 4 MiB (where numpy asks for transparent huge pages) each recvbuf starts at the
    sendbuf's offset into a 2 MiB page, in a mapping of its own, on huge pages only within the
    2 MiB pages wholly inside it: so every contender's recvbuf alike (fresh 4 MiB arrays lay
    half or wholly on them by the luck of their address, and MPICH's single copy into one wholly
    on them took 0.77-0.86x the time).  Below 4 MiB: the 4 KiB page offset only."""
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
