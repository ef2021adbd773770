"""The tests of tests/mpi/test_torch_backend.py marked ``own_job``: each has crashed a process
(SIGSEGV) with the "aluminum" backend, which would end the multi-rank suite's whole session at
every rank count, so each runs here in a job of its own at 2 ranks (AL_TORCH_TEST_OWN_JOB=1),
where a crash fails one test."""
import os

import pytest

pytest.importorskip("torch")

from test_mpi_suite import run_suite  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# SIGSEGV in DDP's backward when a bucket all-reduce's Work fails: its Future gets
# set_exception() (the exception stored as the value), which DDP's reducer reads in C++ as
# the result
FAILED_WORK = pytest.mark.xfail(strict=True, reason="SIGSEGV: DDP's reducer reads a failed "
                                "Work's Future (set_exception) as its result")
OWN_JOB = {
    "test_timeout_reaches_backward_through_the_future": FAILED_WORK,
    "test_failed_call_reaches_backward": FAILED_WORK,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in OWN_JOB.items()])
def test_in_its_own_job(name):
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1", AL_TORCH_TEST_OWN_JOB="1")
    proc = run_suite(2, [os.path.join(HERE, "mpi", "test_torch_backend.py"), "--with-mpi", "-q",
                         "-p", "no:cacheprovider", "--timeout=120", "-k", name], env, 300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-6000:]
