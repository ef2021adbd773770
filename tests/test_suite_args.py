"""What tests/test_mpi_suite.py passes to the suites it launches: AL_TEST_ARGS (its -k/-m
expression joined to the suite's own; a suite it selects nothing in is skipped), and
AL_TEST_LOCAL_RANKS (the tests marked ``local`` run at that rank count only); and which
aluminum_py the tests import (the root conftest.py)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

import test_mpi_suite as suite


def test_merge_joins_selections_and_appends_the_rest():
    own = ["tests/mpi/test_allreduce.py", "-k", "matrix or nan", "-q"]
    assert suite.merge_args(own, ["-k", "host_transfer", "-v"]) == [
        "tests/mpi/test_allreduce.py", "-q", "-v", "-k", "(matrix or nan) and (host_transfer)"]
    assert suite.merge_args(["tests/mpi", "-q"], ["-kfoo", "-m=soak"]) == [
        "tests/mpi", "-q", "-k", "foo", "-m", "soak"]
    assert suite.merge_args(own, ["-x"]) == ["tests/mpi/test_allreduce.py", "-q", "-x", "-k",
                                             "matrix or nan"]
    with pytest.raises(ValueError, match="AL_TEST_ARGS: -k needs an expression"):
        suite.merge_args(own, ["-k"])


def test_a_selection_that_matches_nothing_skips_the_suite(monkeypatch):
    """A suite in which AL_TEST_ARGS selects no test (pytest's exit status 5 on every rank)
    is skipped, not failed."""
    monkeypatch.setenv("AL_TEST_ARGS", "-k no_test_has_this_name")
    with pytest.raises(pytest.skip.Exception, match="selects nothing in this suite"):
        suite.test_gpu_control_traffic_order_with_nonblocking_mpich_bcast()


def test_a_selection_reaches_the_launched_suite(monkeypatch, capsys):
    """The control-traffic suite launched with AL_TEST_ARGS="-k control -rA": the selection
    runs its one test, and the summary lists it (the -rA arrived)."""
    monkeypatch.setenv("AL_TEST_ARGS", "-k control -rA")
    suite.test_gpu_control_traffic_order_with_nonblocking_mpich_bcast()
    out = capsys.readouterr().out
    # (the summary's path is relative to the launched run's working directory)
    assert re.search(r"PASSED \S*tests/mpi/test_gpu_backend_cpu\.py::", out), out[-3000:]


LOCAL_FILE = '''
import os
import pytest
from mpi4py import MPI

def ran(what):
    """Leave a file saying that `what` ran on this rank (output of two ranks may interleave)."""
    world = MPI.COMM_WORLD
    open(os.path.join(os.environ["AL_RAN_DIR"], f"{what}-{world.size}-{world.rank}"), "w").close()

@pytest.mark.local
def test_local():
    ran("local")

def test_communicating():
    MPI.COMM_WORLD.Barrier()
    ran("communicating")
'''


@pytest.mark.parametrize("nranks,local_ranks", [(1, "2"), (2, "2")])
def test_local_tests_run_at_the_local_rank_count_only(tmp_path, nranks, local_ranks):
    """tests/conftest.py: under AL_TEST_LOCAL_RANKS=N a test marked ``local`` runs only in a job
    of N ranks (the others deselect it). The file sits in a copy of tests/ so that
    tests/conftest.py is its conftest."""
    tests, ran = tmp_path / "tests", tmp_path / "ran"
    tests.mkdir()
    ran.mkdir()
    (tests / "conftest.py").write_text(
        open(os.path.join(suite.HERE, "conftest.py")).read())
    (tests / "test_local_marker.py").write_text(textwrap.dedent(LOCAL_FILE))
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\nmarkers =\n    local: never communicates\n")
    env = dict(os.environ, AL_TEST_LOCAL_RANKS=local_ranks, AL_RAN_DIR=str(ran),
               PYTHONUNBUFFERED="1")
    proc = subprocess.run([*suite.launcher(), "-n", str(nranks), sys.executable, "-m", "pytest",
                           str(tests), "--with-mpi", "-q", "-p", "no:cacheprovider",
                           "--strict-markers"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    runs_local = local_ranks == str(nranks)
    expected = {f"communicating-{nranks}-{r}" for r in range(nranks)}
    expected |= {f"local-{nranks}-{r}" for r in range(nranks)} if runs_local else set()
    assert {p.name for p in ran.iterdir()} == expected, proc.stdout[-4000:]


WHICH = '''
import subprocess, sys
import aluminum_py

def test_which():
    child = subprocess.run([sys.executable, "-c", "import aluminum_py; print(aluminum_py.__file__)"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("IMPORTED", aluminum_py.__file__)
    print("CHILD", child.stdout.strip())
'''


def test_an_unbuilt_source_tree_tests_the_installed_package(tmp_path):
    """The root conftest.py in a source tree whose aluminum_py has no compiled core (a clone
    next to ``pip install .``): the tests, and the ``python -c`` they start, import the
    installed package (here the one this process imports, through PYTHONPATH), not the
    source tree's."""
    import aluminum_py
    installed = os.path.dirname(os.path.dirname(os.path.abspath(aluminum_py.__file__)))
    root = os.path.dirname(suite.HERE)
    (tmp_path / "conftest.py").write_text(open(os.path.join(root, "conftest.py")).read())
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\ntestpaths = tests\n")
    (tmp_path / "aluminum_py").mkdir()
    (tmp_path / "aluminum_py" / "__init__.py").write_text(
        'raise ImportError("the source tree\'s unbuilt package was imported")\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_which.py").write_text(WHICH)
    env = dict(os.environ, PYTHONPATH=installed, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-s", "-p",
                           "no:cacheprovider", "-o", "addopts="], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    expected = os.path.join(installed, "aluminum_py", "__init__.py")
    assert f"IMPORTED {expected}" in proc.stdout, proc.stdout[-4000:]
    assert f"CHILD {expected}" in proc.stdout, proc.stdout[-4000:]
