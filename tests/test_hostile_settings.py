"""Hostile settings and files (issue 28): every AL_* variable refuses NaN, infinities,
negatives where they mean nothing and overflow with a ValueError naming it and what it accepts;
any tuning-file content or file type degrades to "no table" with one warning, never an
exception or a blocking open; the files the library writes never follow a planted symbolic
link and are created private.  (Multi-rank cases: tests/mpi/test_hostile.py.)"""
import json
import os
import stat
import threading
import warnings

import pytest

import aluminum_py as al
from aluminum_py import config, timeline, tuning
from aluminum_py.tuning import TuningWarning

# (variable, its reader in aluminum_py.config, values refused): every variable the library
# reads as a number
REFUSED = [
    ("AL_HANG_TIMEOUT", "reload", ["nan", "-1", "inf", "1e300", "soon"]),
    ("AL_EXIT_GRACE", "exit_grace", ["nan", "-1", "inf", "1e9"]),
    ("AL_ENGINE_SPIN", "engine_spin", ["1e300", "nan", "-1", "inf"]),
    ("AL_ENGINE_YIELD", "engine_yield", ["nan", "1e30", "-1", "1.5", "inf"]),
    ("AL_WAIT_SPIN", "wait_spin", ["nan", "inf", "-inf", "1e300"]),
    ("AL_ENGINE_SERIAL_BYTES", "engine_serial_bytes", ["-1", "1e300", "nan", "0.5"]),
    ("AL_SCRATCH_CACHE", "scratch_cache", ["-1", "inf", "nan"]),
    ("AL_SHM_SLOT_BYTES", "shm_slot_bytes", ["4611686018427387904", "100", "-4096",
                                          "nan", "1e30"]),
    ("AL_SHM_SMALL_BYTES", "shm_small_bytes", ["-1", "nan", "1e300"]),
    ("AL_SHM_CHUNK_BYTES", "shm_chunk_bytes", ["0", "100", "-4096", "nan", "1e30", "4096.5"]),
    ("AL_SHM_STREAM_BYTES", "shm_stream_bytes", ["-1", "nan", "inf"]),
    ("AL_SHM_SLOT_STORES", "shm_slot_stores", ["1", "nan", "yes"]),
    ("AL_SHM_NAMED", "shm_named", ["2", "-1", "nan", "yes"]),
    ("AL_TIMELINE_BUFFER", "timeline_buffer", ["0", "nan", "1e30"]),
    ("AL_ALPHA", "model_params", ["nan", "-1", "inf", "2"]),
    ("AL_BETA", "model_params", ["nan", "-1e-10"]),
    ("AL_GAMMA", "model_params", ["inf"]),
    ("AL_SHM_SYNC", "shm_model_params", ["nan", "-1"]),
    ("AL_SHM_BYTE", "shm_model_params", ["-inf"]),
    ("AL_NCCL_MIN_CTAS", "nccl_ctas", ["x", "0", "nan", "2.5", "1e30"]),
    ("AL_NCCL_MAX_CTAS", "nccl_ctas", ["-1", "inf"]),
]


@pytest.mark.parametrize("name,read,values", REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_settings_are_refused_naming_the_variable(monkeypatch, name, read, values):
    read = getattr(config, read)
    for v in values:
        monkeypatch.setenv(name, v)
        with pytest.raises(ValueError, match=rf"environment variable {name}='{v}': expected "):
            read()
    monkeypatch.delenv(name)
    read()                                  # unset: the default
    config.reload()


def test_documented_meanings_are_kept(monkeypatch):
    monkeypatch.setenv("AL_HANG_TIMEOUT", "0")              # 0: no timeout
    config.reload()
    assert config.hang_timeout() is None and config.hang_timeout_native() == -1.0
    monkeypatch.setenv("AL_HANG_TIMEOUT", "2.5")
    config.reload()
    assert config.hang_timeout() == 2.5
    monkeypatch.delenv("AL_HANG_TIMEOUT")
    config.reload()
    assert config.hang_timeout() == 1800.0 and config.hang_timeout_native() == 1800.0
    for name, value, read, expect in [("AL_WAIT_SPIN", "-1", config.wait_spin, -1.0),
                                      ("AL_ENGINE_YIELD", "0", config.engine_yield, 0),
                                      ("AL_ENGINE_YIELD", "1e3", config.engine_yield, 1000),
                                      ("AL_SHM_SLOT_BYTES", "0", config.shm_slot_bytes, 0),
                                      ("AL_SHM_SLOT_BYTES", "4e6", config.shm_slot_bytes, 4_000_000),
                                      ("AL_SHM_NAMED", "1", config.shm_named, True),
                                      ("AL_ENGINE_SPIN", "0", config.engine_spin, 0.0),
                                      ("AL_EXIT_GRACE", " ", config.exit_grace, 2.0)]:
        monkeypatch.setenv(name, value)
        assert read() == expect, (name, value)
        monkeypatch.delenv(name)


def test_cta_limits_in_order(monkeypatch):
    monkeypatch.setenv("AL_NCCL_MIN_CTAS", "8")
    monkeypatch.setenv("AL_NCCL_MAX_CTAS", "4")
    with pytest.raises(ValueError, match="AL_NCCL_MIN_CTAS='8': expected at most AL_NCCL_MAX_CTAS=4"):
        config.nccl_ctas()
    monkeypatch.setenv("AL_NCCL_MAX_CTAS", "16")
    assert config.nccl_ctas() == (8, 16)


def test_node_layout_labels(monkeypatch):
    monkeypatch.setenv("AL_NODE_LAYOUT", "0, 0,1")
    assert config.node_layout() == ["0", "0", "1"]
    monkeypatch.setenv("AL_NODE_LAYOUT", "0,,1")
    with pytest.raises(ValueError, match="AL_NODE_LAYOUT='0,,1': expected one node label"):
        config.node_layout()


# ---- the tuning file

def good_table() -> dict:
    sizes = [64, 1024]
    entry = tuning.make_entry(1, [1], "host", 4, "MPICH", sizes, {"ring": [1e-6, 2e-6]})
    return {"format": tuning.FORMAT, "version": 2, "entries": {"k": entry}}


def hostile_content():
    """(id, file content): each must give one warning and an empty table."""
    t = json.dumps(good_table())
    big = t.replace('"sizes": [64, 1024]', '"sizes": [64, 1' + "0" * 400 + "]")
    yield "401-digit size", big
    yield "comm_size Infinity", t.replace('"comm_size": 1', '"comm_size": Infinity')
    yield "time NaN", t.replace("1e-06", "NaN")
    yield "time 1e999", t.replace("1e-06", "1e999")
    yield "nested 100000 deep", ('{"format": "%s", "version": 2, "entries": {"k": ' % tuning.FORMAT
                                 + "[" * 100_000 + "]" * 100_000 + "}}")
    yield "size as string", t.replace('"sizes": [64, 1024]', '"sizes": ["64", "1024"]')
    yield "size as bool", t.replace('"sizes": [64, 1024]', '"sizes": [true, 1024]')
    yield "dtype_size huge", t.replace('"dtype_size": 4', '"dtype_size": 1' + "0" * 30)
    yield "ranks_per_node not a list", t.replace('"ranks_per_node": [1]', '"ranks_per_node": 1')
    yield "times a list", t.replace('"times": {"ring": [1e-06, 2e-06]}', '"times": [1, 2]')
    yield "buffer a number", t.replace('"buffer": "host"', '"buffer": 7')
    yield "entry a list", json.dumps({"format": tuning.FORMAT, "version": 2, "entries": {"k": []}})
    yield "not UTF-8", b"\xff\xfe{"


def load_warns_once(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = tuning.load(str(path))
    ours = [w for w in caught if issubclass(w.category, TuningWarning)]
    assert len(ours) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert table["entries"] == {}
    return str(ours[0].message)


@pytest.mark.parametrize("what,content", list(hostile_content()),
                         ids=[w for w, _ in hostile_content()])
def test_hostile_table_content_degrades_to_no_table(tmp_path, monkeypatch, what, content):
    path = tmp_path / "t.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    load_warns_once(path)
    # what the Communicator does with it (rank 0 reads, every rank gets the answer)
    from mpi4py import MPI
    monkeypatch.setenv("AL_TUNING_FILE", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningWarning)
        data = tuning.shared_data(MPI.COMM_SELF, "host", layout=(0,))
    assert data.exact == {}


def test_good_table_still_loads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good_table()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(tuning.load(str(path))["entries"]) == 1


def load_within(path, seconds=20):
    """tuning.load(path) in a thread: (True, message) if it warned once and returned an empty
    table in time, (False, None) if it blocked."""
    out = []
    t = threading.Thread(target=lambda: out.append(load_warns_once(path)), daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive() and bool(out)), (out[0] if out else None)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    done, message = load_within(fifo)
    if not done:                             # release the blocked open before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert done, "tuning.load blocked on a FIFO"
    assert "not a regular file" in message


@pytest.mark.parametrize("kind", ["/dev/zero", "directory", "huge", "dangling link"])
def test_other_file_kinds_degrade_to_no_table(tmp_path, kind):
    path = {"/dev/zero": "/dev/zero", "directory": str(tmp_path)}.get(kind, str(tmp_path / "t"))
    if kind == "huge":
        with open(path, "wb") as f:
            f.truncate(tuning.MAX_FILE_BYTES + 1)            # sparse: no disk used
    elif kind == "dangling link":
        os.symlink(tmp_path / "missing", path)
    done, message = load_within(path)
    assert done, kind
    assert path in message, message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_degrades_to_no_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good_table()))
    path.chmod(0)
    assert "Permission denied" in load_within(path)[1]


# ---- the files the library writes

def test_tuning_lock_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "t.json"
    os.symlink(victim, str(path) + ".lock")
    with pytest.raises(OSError, match="symbolic link"):
        tuning.merge_into_file(good_table()["entries"]["k"], str(path))
    assert victim.read_text() == "precious"
    os.unlink(str(path) + ".lock")
    tuning.merge_into_file(good_table()["entries"]["k"], str(path))
    assert stat.S_IMODE(os.stat(str(path) + ".lock").st_mode) == 0o600
    assert len(tuning.load(str(path))["entries"]) == 1


def test_timeline_file_never_follows_a_link_and_is_private(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = tmp_path / "tl.rank0.json"
    os.symlink(victim, planted)
    with pytest.raises(al.Error, match="timeline: cannot record to .*symbolic link"):
        timeline.start(str(tmp_path / "tl.json"))
    assert victim.read_text() == "precious" and not timeline.recording()
    os.unlink(planted)
    path = timeline.start(str(tmp_path / "tl.json"))
    timeline.stop()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(open(path).read())["otherData"]["rank"] == 0


@pytest.mark.parametrize("name,value", [("AL_HANG_TIMEOUT", "nan"), ("AL_ENGINE_SPIN", "1e300"),
                                        ("AL_EXIT_GRACE", "nan")])
def test_a_variable_read_at_import_bad_on_one_rank_fails_communicator_on_every_rank(name, value):
    """A variable read at import, bad on rank 1 only: the import takes the default, and
    Communicator() raises the variable's error on both ranks (raised at import, it ended rank 1
    alone and rank 0 waited in Communicator() for ever)."""
    import subprocess
    import sys
    from test_reliability_launch import mpiexec, run
    prog = ("import aluminum_py as al\n"
            "import sys\n"
            "try:\n    al.Communicator()\n    sys.stdout.write('MADE\\n')\n"
            "except ValueError as e:\n    sys.stdout.write(f'RAISED {e}\\n')\n")
    cmd = [mpiexec(), "-n", "1", sys.executable, "-c", prog, ":",
           "-n", "1", "-env", name, value, sys.executable, "-c", prog]
    try:
        proc, _ = run(cmd, 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}={value} on one rank: the job hung")
    raised = f"RAISED environment variable {name}={value!r}"
    assert proc.stdout.count(raised) == 2 and proc.stdout.count("(rank 1)") == 2, \
        proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:]
