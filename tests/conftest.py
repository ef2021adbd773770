"""Test layout (docs/testing.md has the whole of it).

* tests/test_*.py          single-process tests (no launcher): schedules, kernels, tables, parsing,
                           and the tests that launch programs or suites of their own.
* tests/mpi/test_*.py      multi-rank tests. The outer pytest run launches them itself under
                           ``mpiexec -n N`` for N in AL_TEST_RANKS (default 1, 2, 3, 4;
                           tests/test_mpi_suite.py); they are not collected by the outer run.
* tests/gpu/test_*.py      GPU suite: collected by the plain run (one rank) whenever a CUDA device
                           is present (it skips cleanly without one); at two ranks
                           ``mpiexec -n 2 python -m pytest --with-mpi tests/gpu``. Without a GPU
                           it runs on the CUDA/NCCL/CuPy stand-ins at 1, 2 and 4 ranks
                           (tests/test_mpi_suite.py::test_gpu_suite_on_standins).
* tests/standin/test_*.py  the CUDA code path against the CUDA driver stand-in
                           (aluminum_py.testing.cuda_standin), launched by
                           tests/test_mpi_suite.py::test_cuda_standin_suite at 1 and 2 ranks with
                           AL_CUDA_LIBRARY set; not collected by the outer run.

A multi-rank test marked ``local`` checks what a call does on its own rank before any
communication (bad arguments, names): its result does not depend on the rank count, so a suite
launched with AL_TEST_LOCAL_RANKS=N runs it only at N ranks (tests/test_mpi_suite.py sets it);
without the variable (a suite run by hand) it runs at every rank count.
"""
import os

import pytest

from aluminum_py.gpu import cuda_device_count

collect_ignore = (([] if cuda_device_count() > 0 else ["gpu"]) +
                  ([] if os.environ.get("AL_TEST_INNER") else ["mpi", "standin"]))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under mpiexec with AL_TEST_LOCAL_RANKS set to another rank count than this job's,
    deselect the tests marked ``local``."""
    want = os.environ.get("AL_TEST_LOCAL_RANKS")
    if not want:
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.size == int(want):
        return
    local = [item for item in items if item.get_closest_marker("local")]
    if local:
        config.hook.pytest_deselected(items=local)
        items[:] = [item for item in items if not item.get_closest_marker("local")]
