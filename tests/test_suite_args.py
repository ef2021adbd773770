"""AL_TEST_ARGS reaches every suite tests/test_mpi_suite.py launches: its -k/-m expression is
joined to the suite's own, and a suite it selects nothing in is skipped, not launched."""
import time

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


def test_a_selection_that_matches_nothing_skips_the_six_rank_suite(monkeypatch):
    """docs/gpu.md's AL_TEST_ARGS="-k host_transfer": the 6-rank allreduce matrix has no
    host_transfer test, so it is skipped within the collection's seconds, not run."""
    monkeypatch.setenv("AL_TEST_ARGS", "-k host_transfer")
    t0 = time.monotonic()
    with pytest.raises(pytest.skip.Exception, match="selects nothing in this suite"):
        suite.test_allreduce_at_six_ranks_oversubscribed()
    assert time.monotonic() - t0 < 120          # a launch of the matrix takes minutes


def test_a_selection_reaches_the_launched_suite(monkeypatch, capsys):
    """The control-traffic suite launched with AL_TEST_ARGS="-k control -rA": the merged
    selection runs its one test, and the summary lists it (the -rA arrived)."""
    monkeypatch.setenv("AL_TEST_ARGS", "-k control -rA")
    suite.test_gpu_control_traffic_order_with_nonblocking_mpich_bcast()
    out = capsys.readouterr().out
    assert "PASSED tests/mpi/test_gpu_backend_cpu.py::" in out, out[-3000:]
