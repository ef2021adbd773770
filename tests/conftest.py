"""Test layout.

* tests/test_*.py          single-process tests (no launcher): schedules, kernels, tables, parsing.
* tests/gpu/test_*.py      GPU suite, run by hand on a GPU machine:
                           ``mpiexec -n 2 python -m pytest -m gpu --with-mpi tests/gpu``.
* tests/mpi/test_*.py      multi-rank tests. The outer pytest run launches them itself under
                           ``mpiexec -n N`` for N in 1, 2, 3, 4 (tests/test_mpi_suite.py); they are
                           not collected by the outer run.
* tests/standin/test_*.py  the CUDA code path against the CUDA driver stand-in
                           (aluminum_py.testing.cuda_standin), launched by
                           tests/test_mpi_suite.py::test_cuda_standin_suite at 1 and 2 ranks with
                           AL_CUDA_LIBRARY set; not collected by the outer run.
"""
import os

collect_ignore = ["gpu"] + ([] if os.environ.get("AL_TEST_INNER") else ["mpi", "standin"])
